//! Starting one worker process: its binary, its GPU, its log, a parent-death signal, and the
//! control-channel handshake (in a thread, so a worker that dies before connecting cannot block
//! the supervisor).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;

use anyhow::{bail, Context};
use proto::control::{self, FinalReport, ToLauncher, ToWorker, PROTOCOL_VERSION};
use shm_ring::{Role, WorkerName};

/// Which worker, and which incarnation of it (restarts get a new `spawn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    pub role: Role,
    pub index: u32,
    pub spawn: u32,
}

impl Key {
    pub fn name(&self) -> WorkerName {
        WorkerName {
            role: self.role,
            index: self.index,
        }
    }
}

/// What handshake threads tell the supervisor.
pub enum Event {
    Connected(Key, control::Sender<ToWorker>),
    Report(Key, FinalReport),
    /// The group leader's step and loss (see [`ToLauncher::Progress`]).
    Progress {
        step: u64,
        loss: f32,
        tokens: u64,
    },
    HandshakeFailed(Key, String),
}

/// How to run a worker: a separate binary, or the launcher itself in worker mode.
#[derive(Clone, Debug)]
pub enum WorkerExe {
    Binary(PathBuf),
    SelfAs(&'static str),
}

impl WorkerExe {
    /// The worker binaries beside the launcher (or in `dir`); without `dir`, falls back to the
    /// launcher's own worker mode when they are not there (e.g. after `cargo run -p launcher`).
    pub fn find(role: Role, dir: Option<&Path>) -> anyhow::Result<WorkerExe> {
        let (name, mode) = match role {
            Role::Producer => ("target-worker", "worker-target"),
            Role::Consumer => ("drafter-worker", "worker-drafter"),
        };
        match dir {
            Some(d) => {
                let p = d.join(name);
                if !p.is_file() {
                    bail!(
                        "worker binary not found: {} (check --worker-dir)",
                        p.display()
                    );
                }
                Ok(WorkerExe::Binary(p))
            }
            None => {
                let me = std::env::current_exe().context("finding the launcher's own path")?;
                let beside = me.with_file_name(name);
                Ok(if beside.is_file() {
                    WorkerExe::Binary(beside)
                } else {
                    WorkerExe::SelfAs(mode)
                })
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            WorkerExe::Binary(p) => p.display().to_string(),
            WorkerExe::SelfAs(mode) => format!("launcher {mode}"),
        }
    }
}

/// What the supervisor passes to every worker in its Welcome.
#[derive(Clone)]
pub struct Welcome {
    pub ring: String,
    pub run_dir: PathBuf,
    pub config_toml: String,
    pub backend: proto::config::BackendKind,
}

/// Starts worker `key` on `gpu`, logging to `log`, and a thread that handshakes with it and
/// forwards its messages as `Event`s.
pub fn spawn(
    exe: &WorkerExe,
    key: Key,
    gpu: u32,
    log: &Path,
    welcome: &Welcome,
    events: Sender<Event>,
) -> anyhow::Result<Child> {
    let server = control::Server::new().context("opening a control channel")?;
    let server_name = server.name().to_string();
    let mut logf = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening log {}", log.display()))?;
    writeln!(
        logf,
        "--- launcher: starting (incarnation {}) on GPU {gpu}",
        key.spawn + 1
    )?;
    let mut cmd = match exe {
        WorkerExe::Binary(p) => Command::new(p),
        WorkerExe::SelfAs(mode) => {
            let mut c = Command::new(std::env::current_exe()?);
            c.arg(mode);
            c
        }
    };
    cmd.args(["--index", &key.index.to_string(), "--control", &server_name])
        .env("CUDA_VISIBLE_DEVICES", gpu.to_string())
        .stdin(Stdio::null())
        .stdout(logf.try_clone()?)
        .stderr(logf);
    // Own process group: a terminal's Ctrl-C or hang-up reaches the launcher only, which then
    // stops the workers in order.
    cmd.process_group(0);
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs in the child between fork and exec and only makes
    // async-signal-safe system calls (prctl, getppid); its errors are errno values, which do
    // not allocate.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the launcher, even if it is SIGKILLed.
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::Kill))?;
            // The launcher may have died before that took effect: then do not start at all.
            if rustix::process::getppid() != Some(parent) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", exe.describe()))?;
    let welcome = welcome.clone();
    std::thread::spawn(move || handshake(server, key, gpu, welcome, events));
    Ok(child)
}

fn handshake(server: control::Server, key: Key, gpu: u32, welcome: Welcome, events: Sender<Event>) {
    let failed = |why: String| {
        let _ = events.send(Event::HandshakeFailed(key, why));
    };
    // Blocks until the worker connects; a worker that dies first leaves this thread waiting,
    // which costs nothing (bounded by the restart limit).
    let (reply, rx) = match server.accept() {
        Ok(x) => x,
        Err(e) => return failed(format!("accept: {e}")),
    };
    let hello = match rx.recv() {
        Ok(m) => m,
        Err(e) => return failed(format!("no Hello: {e}")),
    };
    let ToLauncher::Hello {
        version,
        role,
        index,
        ..
    } = hello
    else {
        return failed("the first message was not Hello".into());
    };
    if version != PROTOCOL_VERSION || role != key.role || index != key.index {
        let why = format!(
            "expected {} speaking protocol {PROTOCOL_VERSION}, got {} speaking {version}",
            key.name(),
            WorkerName { role, index }
        );
        let _ = reply.send(ToWorker::Refused { why: why.clone() });
        return failed(why);
    }
    let sent = reply.send(ToWorker::Welcome {
        version: PROTOCOL_VERSION,
        ring: welcome.ring,
        run_dir: welcome.run_dir,
        gpu: Some(gpu),
        config_toml: welcome.config_toml,
        backend: welcome.backend,
    });
    if sent.is_err() {
        return failed("the worker went away during the handshake".into());
    }
    if events.send(Event::Connected(key, reply)).is_err() {
        return;
    }
    while let Ok(msg) = rx.recv() {
        let ev = match msg {
            ToLauncher::Report(r) => Event::Report(key, r),
            ToLauncher::Progress { step, loss, tokens } => Event::Progress { step, loss, tokens },
            ToLauncher::Hello { .. } => continue,
        };
        if events.send(ev).is_err() {
            return;
        }
    }
}
