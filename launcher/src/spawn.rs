//! Starting one worker process: the launcher's own binary through a hidden subcommand, its GPU,
//! its log, a parent-death signal, and the control-channel handshake (in a thread, so a worker
//! that dies before connecting cannot block the supervisor).
//!
//! Length: about 650 lines: starting a worker, its handshake and the reason read from its log
//! are one incarnation's life, and their tests need a real process and log beside them.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;

use anyhow::Context;
use proto::control::{self, ControlError, FinalReport, ToLauncher, ToWorker, PROTOCOL_VERSION};
use shm_ring::{Role, WorkerName};

/// Which worker, and which incarnation of it (restarts get a new `spawn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    pub name: WorkerName,
    pub spawn: u32,
}

impl Key {
    pub fn name(&self) -> WorkerName {
        self.name
    }
}

/// What handshake threads tell the supervisor.
pub enum Event {
    Connected(Key, control::Sender<ToWorker>),
    Report(Key, FinalReport),
    /// The group leader's step, loss and tau (see [`ToLauncher::Progress`]).
    Progress(control::StepStats),
    /// What the group leader wrote at a checkpoint step (see [`ToLauncher::Saved`]).
    Saved(control::SaveReport),
    HandshakeFailed(Key, String),
}

/// What the launcher runs as a worker: itself. `/proc/self/exe` is the launcher's own binary
/// (the file it was started from, even if that path has been replaced since, say by a rebuild),
/// so a worker is always the launcher's own code: no worker binary to deploy beside it, and no
/// stale one to pick up by mistake.
const SELF_EXE: &str = "/proc/self/exe";

/// The hidden subcommand that makes the launcher's binary a worker of `role` (`cli::Command`).
fn subcommand(role: Role) -> &'static str {
    match role {
        Role::Producer => "target-worker",
        Role::Consumer => "drafter-worker",
    }
}

/// Names this process after the worker subcommand it runs (`/proc/self/comm`: what `ps -C`,
/// `top` and `pgrep` show), which exec'ing `/proc/self/exe` left as `exe`. Only cosmetic, so a
/// failure is ignored.
pub fn name_process(role: Role) {
    if let Ok(name) = std::ffi::CString::new(subcommand(role)) {
        let _ = rustix::thread::set_name(&name);
    }
}

/// What the supervisor passes to every worker in its Welcome.
#[derive(Clone)]
pub struct Welcome {
    pub ring: String,
    pub run_dir: PathBuf,
    pub config_toml: String,
    pub backend: gpu::BackendKind,
    /// CPU threads each worker's model computes with (`RAYON_NUM_THREADS`, which candle's
    /// kernels and matrix products read when they first run).
    pub threads: usize,
    /// The programs run as targets and drafters instead of the launcher's own workers
    /// (`[target] command`, `[drafter] command`: Python workers).
    pub target_command: Option<Vec<String>>,
    pub drafter_command: Option<Vec<String>>,
    /// The directories they run in (`command_dir`).
    pub target_command_dir: Option<PathBuf>,
    pub drafter_command_dir: Option<PathBuf>,
    /// The step of the checkpoint this launch resumed the run from (`ToWorker::Welcome`'s).
    pub resume_step: Option<u64>,
}

impl Welcome {
    fn command(&self, role: Role) -> Option<&[String]> {
        match role {
            Role::Producer => self.target_command.as_deref(),
            Role::Consumer => self.drafter_command.as_deref(),
        }
    }

    fn command_dir(&self, role: Role) -> Option<&Path> {
        match role {
            Role::Producer => self.target_command_dir.as_deref(),
            Role::Consumer => self.drafter_command_dir.as_deref(),
        }
    }
}

/// Each worker command's directory ([`proto::config::TargetConfig::command_dir`]): the config's,
/// made absolute, else the one the launcher runs in. A resume keeps the run's own, so a command
/// whose paths are relative runs as it did when the run started, wherever it is resumed from.
pub fn settle_command_dirs(cfg: &mut proto::PipelineConfig) -> anyhow::Result<()> {
    for (command, dir) in [
        (&cfg.target.command, &mut cfg.target.command_dir),
        (&cfg.drafter.command, &mut cfg.drafter.command_dir),
    ] {
        if command.is_some() {
            *dir = Some(match dir.take() {
                Some(d) => std::path::absolute(&d).with_context(|| {
                    format!("resolving the command's directory {}", d.display())
                })?,
                None => std::env::current_dir().context("reading the current directory")?,
            });
        }
    }
    Ok(())
}

/// The config's worker commands name programs that exist (a path, or a name found on `PATH`),
/// checked before the run starts: a typo is an error at once, not a crash loop.
pub fn check_commands(cfg: &proto::PipelineConfig) -> anyhow::Result<()> {
    for (section, command, dir) in [
        ("target", &cfg.target.command, &cfg.target.command_dir),
        ("drafter", &cfg.drafter.command, &cfg.drafter.command_dir),
    ] {
        let Some(program) = command.as_ref().and_then(|c| c.first()) else {
            continue;
        };
        // A resume from a directory since removed (a scratch checkout), a config from another
        // machine: every start would fail, reading as if the program were missing.
        if let Some(d) = dir.as_deref().filter(|d| !d.is_dir()) {
            anyhow::bail!(
                "[{section}] command_dir {}: not a directory (the command runs there; the run records where it started): restore it, or set command_dir in the run's config.toml",
                d.display()
            );
        }
        let executable = |p: &Path| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        };
        let found = if program.contains('/') {
            // Relative to the directory the command runs in.
            let path = dir.as_deref().unwrap_or(Path::new(".")).join(program);
            let found = path.is_file();
            // A script without its execute bit: every start fails with EACCES (a crash loop
            // whose logs say nothing), where the user forgot a chmod or the interpreter.
            if found && !executable(&path) {
                anyhow::bail!(
                    "[{section}] command: {program:?} is not executable: `chmod +x {}` (a script needs its #! line too), or run it through its interpreter: command = [\"python3\", {program:?}, ...]",
                    path.display()
                );
            }
            found
        } else {
            // As the shell looks: the first executable of that name on PATH.
            std::env::var_os("PATH").is_some_and(|path| {
                std::env::split_paths(&path).any(|dir| executable(&dir.join(program)))
            })
        };
        if !found {
            anyhow::bail!(
                "[{section}] command: no program {program:?}{}",
                match dir {
                    _ if !program.contains('/') => " on PATH".to_string(),
                    Some(d) => format!(" in {}", d.display()),
                    None => String::new(),
                }
            );
        }
    }
    Ok(())
}

/// Threads per worker: `[target] threads`, or the machine's cores shared out among `workers`
/// (at least one each), so eight processes on two cores do not each start two threads per
/// core.
pub fn threads_per_worker(configured: u32, workers: usize) -> usize {
    if configured > 0 {
        return configured as usize;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / workers.max(1)).max(1)
}

/// The line a worker's log starts each incarnation with (then its number and GPU).
const STARTING: &str = "--- launcher: starting";

/// How far from the end of a dead worker's log its reason is looked for, in lines: a crash's
/// message ends the log (a panic's note, or a Python traceback's exception, after it; a panic's
/// backtrace may follow too, and is passed over).
const LAST_LINES: usize = 8;

/// What a worker's last incarnation said as it died, from the end of its log: its last error
/// line among its last [`LAST_LINES`] (anyhow's `error: ...`, a tracing `ERROR` line, a Rust
/// panic with its message, a Python exception's last line), cut to 300 characters. None if it
/// said nothing of the kind there (an error it logged long before is not the reason) or the log
/// cannot be read. The caller does not ask for a worker killed by SIGKILL, which had no chance
/// to say anything. A log rotated since the incarnation started (`--log-cap`) is read on from
/// the end of its rotated part: the rotation may have moved the last words there. `live`: the
/// launcher's descriptor of the file the worker wrote, read instead of the path, which may name
/// no file by now (the log deleted, or `logs/` with it) or another one; its rotated part is
/// read at the path still.
pub fn last_error(log: &Path, live: Option<&std::fs::File>) -> Option<String> {
    let mut text = tail(&live.map_or_else(|| log.to_path_buf(), crate::log_cap::reopened))?;
    if let Some(after) = text.strip_prefix(crate::log_cap::ROTATED) {
        if !after.contains(STARTING) {
            let after = after.split_once('\n').map_or("", |(_, after)| after);
            if let Some(before) = tail(&proto::run_dir::rotated(log)) {
                text = before + after;
            }
        }
    }
    let this = text.rsplit(STARTING).next()?;
    let lines: Vec<&str> = this.lines().filter(|l| !l.trim().is_empty()).collect();
    let last = lines.len().saturating_sub(LAST_LINES);
    // A panic's backtrace (RUST_BACKTRACE) and its note may follow it to the end of the log.
    let trace = |l: &str| {
        let t = l.trim_start();
        l.starts_with("stack backtrace:")
            || l.starts_with("note: ")
            || t.starts_with("at ")
            || t.split_once(':')
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut said = None;
    for (i, l) in lines.iter().enumerate() {
        let next = || lines.get(i + 1).map_or("", |n| n.trim());
        let panic = l.starts_with("thread '") && l.contains(" panicked at ");
        let after = (i + 2).min(lines.len());
        if panic && (i >= last || lines[after..].iter().all(|l| trace(l))) {
            said = Some(format!("{} {}", l.trim(), next()));
        } else if l.starts_with("Traceback (most recent call last)") {
            // The exception is the first line after the frames, which are indented.
            let e = (i + 1..lines.len()).find(|&j| !lines[j].starts_with(' '));
            if let Some(j) = e.filter(|&j| j >= last) {
                said = Some(lines[j].trim_end().to_string());
            }
        } else if i < last {
            continue;
        } else if l.starts_with("error:") || python_said(l) {
            said = Some(l.trim().to_string());
        } else if let Some(at) = l.find(" ERROR ").filter(|&at| !l[..at].contains(' ')) {
            // A tracing line: its timestamp, then the level.
            said = Some(l[at + " ERROR ".len()..].trim().to_string());
        }
    }
    said.map(|s| match s.char_indices().nth(300) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s,
    })
}

/// The last 64 KiB of the log at `log`, as text; None if it cannot be read.
fn tail(log: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 64 << 10;
    let mut f = std::fs::File::open(log).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL))).ok()?;
    let mut bytes = Vec::new();
    // At most the tail: a process the worker left behind may still append to its log.
    f.take(TAIL).read_to_end(&mut bytes).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// A line Python ends a failed start with where it prints no traceback: a `SyntaxError` or
/// `IndentationError` (the file and a caret above it, no `Traceback` header), or the interpreter
/// given a script that is not there (`python3: can't open file '...': [Errno 2] ...`). An
/// exception's line: its class name (module-qualified: `hspipe.HspipeError`), ending in `Error`
/// or `Exception`, then a colon.
fn python_said(l: &str) -> bool {
    let exception = l.split_once(": ").is_some_and(|(name, _)| {
        (name.ends_with("Error") || name.ends_with("Exception"))
            && (name.rsplit('.').next())
                .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_uppercase()))
            && (name.chars()).all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
    });
    exception || l.contains(": can't open file '")
}

/// Starts worker `key` on `gpu`, logging to `log`, and a thread that handshakes with it and
/// forwards its messages as `Event`s. Returns the worker and the launcher's own descriptor of
/// the log it writes (for `log_cap`, which rotates the log through it).
pub fn spawn(
    key: Key,
    gpu: u32,
    log: &Path,
    welcome: &Welcome,
    events: Sender<Event>,
) -> anyhow::Result<(Child, std::fs::File)> {
    let server = control::Server::new().context("opening a control channel")?;
    let server_name = server.name().to_string();
    // A `logs/` deleted while the run goes on is made again (the rotation does too).
    crate::log_cap::make_dir_again(log)
        .with_context(|| format!("making the directory of {} again", log.display()))?;
    let mut logf = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening log {}", log.display()))?;
    writeln!(
        logf,
        "{STARTING} (incarnation {}) on GPU {gpu}",
        key.spawn + 1
    )?;
    let sub = subcommand(key.name.role);
    let mut cmd = match welcome.command(key.name.role) {
        // A user's program (a Python worker): its arguments are its own; the control server
        // and the worker's name come in the environment.
        Some([program, args @ ..]) => {
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env(control::ENV_CONTROL, &server_name)
                .env(control::ENV_WORKER, key.name.to_string())
                // Python's prints reach the log as they happen.
                .env("PYTHONUNBUFFERED", "1");
            if let Some(dir) = welcome.command_dir(key.name.role) {
                cmd.current_dir(dir);
            }
            cmd
        }
        _ => {
            let mut cmd = Command::new(SELF_EXE);
            // argv[0]: `ps` shows `target-worker 3 ...`, not `launcher`.
            cmd.arg0(format!("{sub} {}", key.name.index))
                .arg(sub)
                .args([
                    "--index",
                    &key.name.index.to_string(),
                    "--control",
                    &server_name,
                ]);
            cmd
        }
    };
    // NCCL connects a communicator's peers inside init, not in its first collective, so a
    // drafter can give up on a dead peer while waiting (cuda/src/nccl_group.rs); a user's own
    // setting wins.
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        cmd.env("NCCL_RUNTIME_CONNECT", "0");
    }
    cmd.env("CUDA_VISIBLE_DEVICES", gpu.to_string())
        .env("RAYON_NUM_THREADS", welcome.threads.to_string())
        .stdin(Stdio::null())
        .stdout(logf.try_clone()?)
        .stderr(logf.try_clone()?);
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
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            // The launcher may have died before that took effect: then do not start at all.
            if rustix::process::getppid() != Some(parent) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| match welcome.command(key.name.role) {
            Some(argv) => format!("starting {argv:?} (the config's command for {})", key.name),
            None => format!("starting {SELF_EXE} {sub}"),
        })?;
    let welcome = welcome.clone();
    // Opened before anyone can reap the child, so it is this child's. A kernel without pidfds
    // (before 5.3), or a sandbox that forbids them, gets the plain wait, said once.
    let exited = rustix::process::pidfd_open(
        rustix::process::Pid::from_child(&child),
        rustix::process::PidfdFlags::empty(),
    )
    .map_err(|e| {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            println!(
                "warning: pidfd_open: {e}: a worker that dies before it connects keeps a thread and a socket of the launcher until the launcher exits"
            )
        })
    })
    .ok();
    std::thread::spawn(move || handshake(server, exited, key, gpu, welcome, events));
    Ok((child, logf))
}

/// Waits for worker `key` to connect and handshakes with it. `exited`, a pidfd of the worker:
/// a worker that dies before it connects ends the wait, and this thread; the supervisor says
/// the death from its exit status. Waiting for ever cost a thread and a socket per such death,
/// and a restart limit bounds only deaths in a row.
fn handshake(
    server: control::Server,
    exited: Option<std::os::fd::OwnedFd>,
    key: Key,
    gpu: u32,
    welcome: Welcome,
    events: Sender<Event>,
) {
    let failed = |why: String| {
        let _ = events.send(Event::HandshakeFailed(key, why));
    };
    let accepted = match &exited {
        Some(fd) => server.accept_unless_exited(std::os::fd::AsFd::as_fd(fd)),
        None => server.accept().map(Some),
    };
    drop(exited);
    let (reply, rx) = match accepted {
        Ok(Some(x)) => x,
        Ok(None) => return,
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
    if version != PROTOCOL_VERSION || role != key.name.role || index != key.name.index {
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
        backend: welcome.backend.to_string(),
        resume_step: welcome.resume_step,
    });
    if sent.is_err() {
        return failed("the worker went away during the handshake".into());
    }
    if events.send(Event::Connected(key, reply)).is_err() {
        return;
    }
    let mut said_undecodable = false;
    loop {
        let msg = match rx.recv() {
            Ok(msg) => msg,
            // Both ends are built together, so this is a bug; the frame was read whole, and the
            // next one reads on. A reader that stopped here left the worker blocked in its next
            // send once the socket's buffer filled: a drafter's leader hung after ~280 steps.
            Err(ControlError::Undecodable(why)) => {
                if !std::mem::replace(&mut said_undecodable, true) {
                    println!(
                        "warning: {}: a message on its control channel could not be read ({why}): its progress or report is lost (a bug: please report it)",
                        key.name()
                    );
                }
                continue;
            }
            Err(_) => {
                // Gone, or the stream out of step: the worker's sends fail from now on, none
                // blocks.
                rx.stop_reading();
                return;
            }
        };
        let ev = match msg {
            ToLauncher::Report(r) => Event::Report(key, r),
            ToLauncher::Progress(s) => Event::Progress(s),
            ToLauncher::Saved(r) => Event::Saved(r),
            ToLauncher::Hello { .. } => continue,
        };
        if events.send(ev).is_err() {
            rx.stop_reading();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{last_error, STARTING};
    use std::io::Write;

    /// `log` written to a file, and what [`last_error`] finds in it.
    fn said(log: &str) -> Option<String> {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), log).unwrap();
        last_error(f.path(), None)
    }

    #[test]
    fn a_dead_workers_reason_is_its_last_incarnations_last_error() {
        let anyhow = format!(
            "{STARTING} (incarnation 1) on GPU 2\n2026-12-06T00:35:54Z  INFO attached\n\
             error: writing the checkpoint c.safetensors: No space left on device (os error 28)\n"
        );
        assert_eq!(
            said(&anyhow).as_deref(),
            Some("error: writing the checkpoint c.safetensors: No space left on device (os error 28)")
        );
        // The next incarnation said nothing yet (killed by a signal): not the earlier's reason.
        let again = format!("{anyhow}{STARTING} (incarnation 2) on GPU 2\nINFO attached\n");
        assert_eq!(said(&again), None);
        let traced =
            format!("{STARTING} (incarnation 1) on GPU 0\n2026Z ERROR injected crash at start\n");
        assert_eq!(said(&traced).as_deref(), Some("injected crash at start"));
        let panic = format!(
            "{STARTING} (incarnation 1) on GPU 0\nthread 'main' (4242) panicked at src/lib.rs:3:5:\n\
             index out of bounds\nnote: run with `RUST_BACKTRACE=1`\n"
        );
        assert_eq!(
            said(&panic).as_deref(),
            Some("thread 'main' (4242) panicked at src/lib.rs:3:5: index out of bounds")
        );
        // With RUST_BACKTRACE set, the frames after it are passed over.
        let frames =
            "   0: __rustc::rust_begin_unwind\n             at /rustc/x/panicking.rs:689:5\n"
                .repeat(10);
        let traced_panic = format!(
            "{STARTING} (incarnation 1) on GPU 0\nthread 'main' (7) panicked at src/a.rs:1:2:\n\
             bad shape\nstack backtrace:\n{frames}note: Some details are omitted\n"
        );
        assert_eq!(
            said(&traced_panic).as_deref(),
            Some("thread 'main' (7) panicked at src/a.rs:1:2: bad shape")
        );
        // " ERROR " inside an INFO line's message is not a tracing ERROR.
        let info = format!("{STARTING} (incarnation 1) on GPU 0\nZ  INFO saw \"x ERROR y\" here\n");
        assert_eq!(said(&info), None);
        let python = format!(
            "{STARTING} (incarnation 1) on GPU 0\nTraceback (most recent call last):\n  \
             File \"w.py\", line 3, in <module>\n    step()\nRuntimeError: CUDA out of memory\n"
        );
        assert_eq!(
            said(&python).as_deref(),
            Some("RuntimeError: CUDA out of memory")
        );
        // Python's failures without a traceback: a script that does not parse, and one that is
        // not there.
        let syntax = format!(
            "{STARTING} (incarnation 1) on GPU 0\n  File \"/w/t.py\", line 3\n    def (\n        \
             ^\nSyntaxError: invalid syntax\n"
        );
        assert_eq!(
            said(&syntax).as_deref(),
            Some("SyntaxError: invalid syntax")
        );
        let missing = format!(
            "{STARTING} (incarnation 1) on GPU 0\npython3: can't open file '/w/nope.py': [Errno 2] No such file or directory\n"
        );
        assert_eq!(
            said(&missing).as_deref(),
            Some("python3: can't open file '/w/nope.py': [Errno 2] No such file or directory")
        );
        let qualified = format!("{STARTING} (incarnation 1) on GPU 0\nhspipe.HspipeError: bad\n");
        assert_eq!(said(&qualified).as_deref(), Some("hspipe.HspipeError: bad"));
        // A log line that merely mentions an error class is not one.
        let info =
            format!("{STARTING} (incarnation 1) on GPU 0\nZ  INFO retrying after KeyError: 3\n");
        assert_eq!(said(&info), None);
        // An error logged long before a death by a signal is not its reason.
        let stale = format!(
            "{STARTING} (incarnation 1) on GPU 0\nZ ERROR a batch was refused\n{}",
            "Z  INFO step\n".repeat(8)
        );
        assert_eq!(said(&stale), None);
        let long = format!(
            "{STARTING} (incarnation 1) on GPU 0\nerror: {}\n",
            "é".repeat(400)
        );
        let cut = said(&long).unwrap();
        assert_eq!(cut.chars().count(), 303, "cut to 300 characters and ...");
        assert!(cut.ends_with("é..."), "{cut}");
    }

    /// A worker that died just after its log was rotated (`--log-cap`) left its last words in
    /// the rotated part: its reason is still found. Before, the rotated log's note was all
    /// there was to read.
    #[test]
    fn a_dead_workers_reason_is_found_across_its_logs_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("drafter-0.log");
        let said = "error: writing the checkpoint: No space left on device (os error 28)";
        let before = format!(
            "{STARTING} (incarnation 1) on GPU 0\n{}{said}\n",
            "Z  INFO step\n".repeat(8000)
        );
        std::fs::write(&log, before).unwrap();
        let live = std::fs::File::open(&log).unwrap();
        crate::log_cap::rotate_past_cap(&log, &live, 64 << 10)
            .unwrap()
            .unwrap();
        assert_eq!(last_error(&log, None).as_deref(), Some(said));
        // Its restart said nothing yet: not the earlier incarnation's reason.
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        writeln!(f, "{STARTING} (incarnation 2) on GPU 0\nZ  INFO attached").unwrap();
        assert_eq!(last_error(&log, None), None);
    }

    /// A worker whose log was deleted while it wrote it (`rm -rf logs/`) said its last words to
    /// the deleted file: they are read through the launcher's descriptor of it, not from the
    /// path, which names no file (or another one).
    #[test]
    fn a_dead_workers_reason_is_read_from_its_log_deleted_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("target-0.log");
        let said = "error: the device is gone";
        std::fs::write(
            &log,
            format!("{STARTING} (incarnation 1) on GPU 0\n{said}\n"),
        )
        .unwrap();
        let live = std::fs::File::open(&log).unwrap();
        std::fs::remove_file(&log).unwrap();
        assert_eq!(last_error(&log, None), None);
        assert_eq!(last_error(&log, Some(&live)).as_deref(), Some(said));
        std::fs::write(&log, format!("{STARTING} (incarnation 2) on GPU 0\n")).unwrap();
        assert_eq!(last_error(&log, Some(&live)).as_deref(), Some(said));
    }

    /// A command naming a script without its execute bit is refused before the run, saying
    /// how to fix it: every start failed with EACCES, a crash loop whose logs said nothing.
    /// With the bit set it passes.
    #[test]
    fn a_command_that_is_not_executable_is_refused_before_the_run() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("noexec.py");
        std::fs::write(&script, "#!/usr/bin/env python3\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut cfg = proto::PipelineConfig::default();
        cfg.target.command = Some(vec!["./noexec.py".into()]);
        cfg.target.command_dir = Some(dir.path().to_path_buf());
        let err = super::check_commands(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("[target] command: \"./noexec.py\" is not executable")
                && err.contains("chmod +x")
                && err.contains("python3"),
            "{err}"
        );
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        super::check_commands(&cfg).unwrap();
    }

    /// A worker that dies before it connects (here a program that exits at once) ends its
    /// handshake thread: the thread drops its sender of events, saying nothing. It used to wait
    /// in `accept` for the launcher's whole life, a thread and a socket per such death.
    #[test]
    fn a_worker_dead_before_it_connects_ends_its_handshake_thread() {
        use std::sync::mpsc::{channel, RecvTimeoutError};
        let dir = tempfile::tempdir().unwrap();
        let welcome = super::Welcome {
            ring: "hspipe-test-none".into(),
            run_dir: dir.path().to_path_buf(),
            config_toml: String::new(),
            backend: gpu::BackendKind::Mock,
            threads: 1,
            target_command: Some(vec!["/bin/false".into()]),
            drafter_command: None,
            target_command_dir: None,
            drafter_command_dir: None,
            resume_step: None,
        };
        let key = super::Key {
            name: shm_ring::WorkerName::producer(0),
            spawn: 0,
        };
        let (tx, rx) = channel();
        let log = dir.path().join("target-0.log");
        let (mut child, _log) = super::spawn(key, 0, &log, &welcome, tx).unwrap();
        assert!(!child.wait().unwrap().success());
        // A watchdog, not a timing: the thread ends as soon as the worker has exited.
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Err(RecvTimeoutError::Disconnected) => {}
            Err(RecvTimeoutError::Timeout) => {
                panic!("the handshake thread still waits for a worker that has exited")
            }
            Ok(_) => panic!("an event for a worker that never connected"),
        }
    }

    #[test]
    fn threads_are_the_configured_number_or_the_cores_shared_out() {
        assert_eq!(super::threads_per_worker(3, 8), 3);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(super::threads_per_worker(0, 1), cores);
        assert_eq!(
            super::threads_per_worker(0, cores * 4),
            1,
            "at least one each"
        );
    }
}
