//! What both workers do the same way: their command line, the handshake or standalone setup,
//! logging, and learning that they should stop (a signal, or `Stop` from the launcher).
//!
//! Worker runtime, not protocol: what the launcher and a worker agree on (the control messages,
//! the stop signals and exit codes) is in `proto`; how a worker process sets itself up is here,
//! shared by `target-worker` and `drafter-worker` (their standalone binaries and the launcher's
//! hidden subcommands alike).

pub mod malloc;
pub mod space;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::process::ExitCode;

use gpu::{BackendKind, UnknownBackend};
use proto::control::{self, ControlError, ToLauncher, ToWorker};
use proto::stop::{EXIT_SECOND_SIGNAL, STOP_SIGNALS};
use proto::{ConfigError, PipelineConfig, Role, RunDir, WorkerName};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;

/// The command line both workers share.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// This worker's index among its kind (target i is ring producer i, drafter i consumer i).
    #[arg(long)]
    pub index: u32,
    /// The launcher's control server; with it, everything below comes from the launcher.
    #[arg(long)]
    pub control: Option<String>,
    /// Ring to attach to (standalone).
    #[arg(long, required_unless_present = "control")]
    pub ring: Option<String>,
    /// Run directory for ledgers and checkpoints (standalone).
    #[arg(long, required_unless_present = "control")]
    pub run_dir: Option<PathBuf>,
    /// Pipeline config in TOML (standalone; defaults apply without it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// GPU this worker drives, for telemetry (standalone).
    #[arg(long)]
    pub gpu: Option<u32>,
    /// Compute backend (standalone; the launcher chooses it otherwise).
    #[arg(long, value_enum, default_value_t = BackendKind::Mock)]
    pub backend: BackendKind,
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("signal handler: {0}")]
    Signal(std::io::Error),
    #[error("the launcher's backend: {0}")]
    Backend(#[from] UnknownBackend),
}

/// Everything a worker needs to start.
pub struct Setup {
    pub index: u32,
    pub name: WorkerName,
    pub ring: String,
    pub run_dir: RunDir,
    pub gpu: Option<u32>,
    pub config: PipelineConfig,
    /// The compute backend to build (the launcher's choice, or `--backend` standalone).
    pub backend: BackendKind,
    pub stop: StopFlags,
    /// Present when the launcher started us.
    pub to_launcher: Option<control::Sender<ToLauncher>>,
    /// The step of the checkpoint the launcher resumed the run from (Welcome's), for a drafter
    /// of the user's own to load; None for a new run, a resume from the start, or standalone.
    pub resume_step: Option<u64>,
}

/// Set by a stop signal or by the launcher.
#[derive(Clone, Default)]
pub struct StopFlags {
    /// Finish gracefully (the launcher's Stop).
    pub stop: Arc<AtomicBool>,
    /// A stop signal arrived (kept apart from `stop`: only a second *signal* exits at once).
    pub signalled: Arc<AtomicBool>,
    /// The first stop signal: which, from whom, and when (recorded by a thread, just after the
    /// handler set `signalled`).
    origin: Arc<Mutex<Option<(String, Instant)>>>,
}

/// How long a worker the launcher started waits, after a stop signal, for the launcher's Stop
/// before it takes the signal for one from outside the launcher. A stop of the whole run may
/// reach every process at once (systemd's stop signals the whole cgroup, a user may
/// `pkill -f hspipe`): the launcher, signalled too, sends Stop within one pass of its loop
/// (20 ms), so the worker stops as part of the run's ordered stop and is not restarted.
pub const LAUNCHERS_STOP_GRACE: Duration = Duration::from_secs(1);

impl StopFlags {
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.signalled.load(Ordering::Relaxed)
    }

    /// Whether a stop signal came and the launcher's Stop did not (yet), for a worker the
    /// launcher started (`launched`).
    fn signalled_alone(&self, launched: bool) -> bool {
        launched && !self.stop.load(Ordering::Relaxed) && self.signalled.load(Ordering::Relaxed)
    }

    /// The stop signal that came from outside the launcher, in words (`SIGTERM from pid 4242
    /// (bash)`), once [`LAUNCHERS_STOP_GRACE`] passed after it without the launcher's Stop;
    /// None before, without a signal, with the launcher's Stop, or for a worker the launcher did
    /// not start (`launched` false: standalone, a signal is how it is stopped). Such a worker
    /// does not take part in a stop of the run: it leaves the run as a crash would, and the
    /// launcher restarts it. A person's `kill` of one worker used to stop it for good, unsaid,
    /// and the run went on without its GPU.
    pub fn outside_signal(&self, launched: bool) -> Option<String> {
        if !self.signalled_alone(launched) {
            return None;
        }
        let origin = self.origin.lock().unwrap_or_else(|p| p.into_inner());
        match &*origin {
            Some((what, at)) if at.elapsed() >= LAUNCHERS_STOP_GRACE => Some(what.clone()),
            _ => None,
        }
    }

    /// Whether a wait that the run's ordered stop needs to end gives up (a ledger line waiting
    /// for space on a full disk): on a stop signal from outside the launcher
    /// ([`outside_signal`](Self::outside_signal): the worker leaves the run as a crash would),
    /// or, standalone (`launched` false), on any stop signal. The launcher's Stop does not end
    /// it: its ordered stop needs what the wait is for. A second stop signal ends the process
    /// at once, as anywhere.
    pub fn ends_wait(&self, launched: bool) -> bool {
        match launched {
            true => self.outside_signal(true).is_some(),
            false => self.signalled.load(Ordering::Relaxed),
        }
    }

    /// [`outside_signal`](Self::outside_signal), waiting out the grace: for a worker that
    /// stopped already and must say whether it leaves the run or takes part in its stop.
    pub fn wait_outside_signal(&self, launched: bool) -> Option<String> {
        // The origin thread records the signal within microseconds; should it never (it could
        // not be started), the signal is still taken for one from outside, later.
        let deadline = Instant::now() + 2 * LAUNCHERS_STOP_GRACE;
        while self.signalled_alone(launched) {
            if let Some(what) = self.outside_signal(launched) {
                return Some(what);
            }
            if Instant::now() > deadline {
                return Some("a stop signal".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

/// A stop signal and its sender in words: `SIGTERM from pid 4242 (bash)`; one the kernel sent
/// (a terminal's Ctrl-C) has no sender.
fn signal_said(signal: i32, sender: Option<i32>) -> String {
    let name = signal_hook::low_level::signal_name(signal).unwrap_or("a stop signal");
    match sender {
        Some(pid) => {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok();
            let comm = comm.map_or(String::new(), |c| format!(" ({})", c.trim_end()));
            format!("{name} from pid {pid}{comm}")
        }
        None => format!("{name} from the kernel (a terminal's key?)"),
    }
}

/// Any stop signal: the first sets `flags.signalled` (a graceful stop), the second exits at once
/// with `EXIT_SECOND_SIGNAL` (signal-hook's second-signal idiom). A thread records the first
/// one's origin, for [`StopFlags::outside_signal`].
fn install_signal_handlers(flags: &StopFlags) -> std::io::Result<()> {
    for sig in STOP_SIGNALS {
        // Registered first, so it runs first: it exits only if the flag was already set, by an
        // earlier signal. The order of the two registrations is what makes it the *second*.
        signal_hook::flag::register_conditional_shutdown(
            sig,
            EXIT_SECOND_SIGNAL,
            Arc::clone(&flags.signalled),
        )?;
        signal_hook::flag::register(sig, Arc::clone(&flags.signalled))?;
    }
    let mut signals = SignalsInfo::<WithOrigin>::new(STOP_SIGNALS)?;
    let origin = Arc::clone(&flags.origin);
    std::thread::Builder::new()
        .name("stop-origin".into())
        .spawn(move || {
            for o in signals.forever() {
                let mut first = origin.lock().unwrap_or_else(|p| p.into_inner());
                if first.is_none() {
                    let said = signal_said(o.signal, o.process.map(|p| p.pid));
                    *first = Some((said, Instant::now()));
                }
            }
        })?;
    Ok(())
}

/// Logs to stderr (the launcher sends it to the worker's log file), with `RUST_LOG` honoured.
pub fn init_logging(name: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
    tracing::info!(worker = name, pid = std::process::id(), "starting");
}

/// After the worker's model is loaded: gives what the load freed back to the kernel (see
/// [`malloc::give_back_freed`]), and logs how much.
pub fn model_loaded() {
    let Some(g) = malloc::give_back_freed() else {
        return;
    };
    let (freed, resident) = (g.bytes() >> 20, g.resident_after >> 20);
    if freed > 0 {
        tracing::info!(
            "model loaded; {freed} MiB freed while loading given back, {resident} MiB resident"
        );
    } else {
        tracing::debug!("model loaded; {resident} MiB resident");
    }
}

/// Handshakes with the launcher (if `--control`) or reads the standalone flags, loads and
/// validates the config, and installs the stop handlers.
pub fn setup(args: &WorkerArgs, role: Role) -> Result<Setup, SetupError> {
    let name = WorkerName {
        role,
        index: args.index,
    };
    init_logging(&name.to_string());
    match malloc::keep_freed_memory() {
        malloc::Malloc::Kept => tracing::debug!("glibc's malloc keeps freed memory for reuse"),
        malloc::Malloc::UserSet(k) => {
            tracing::info!("malloc left as {k} in the environment sets it")
        }
        malloc::Malloc::Refused(setting) => {
            tracing::warn!("glibc's malloc refused {setting}: freed memory may not be kept")
        }
        malloc::Malloc::NotGlibc => tracing::debug!("malloc unchanged (not glibc)"),
    }
    let stop = StopFlags::default();
    install_signal_handlers(&stop).map_err(SetupError::Signal)?;
    let setup = connect_or_read(args, role, name, stop)?;
    Ok(setup)
}

/// Handshakes with the launcher's control server `server` as worker `index` of `role`: the
/// launcher's Welcome (ring, run directory, GPU, config, backend) becomes the [`Setup`], and a
/// thread turns its Stop message into `stop`'s flag, and its going away into
/// this process's end ([`launcher_gone`]). For any process the launcher started as a worker:
/// ours (`--control`) and a Python worker's (`hspipe.connect()`, which installs no signal
/// handlers: Python keeps its own).
pub fn connect(server: &str, role: Role, index: u32, stop: StopFlags) -> Result<Setup, SetupError> {
    let link = control::connect(server, role, index, Duration::from_secs(30))?;
    let config = PipelineConfig::from_toml(&link.config_toml, std::path::Path::new("<launcher>"))?;
    let flags = stop.clone();
    let rx = link.from_launcher;
    std::thread::spawn(move || loop {
        match rx.recv() {
            Ok(ToWorker::Stop) => flags.stop.store(true, Ordering::Relaxed),
            Ok(_) => {}
            Err(_) => launcher_gone(),
        }
    });
    Ok(Setup {
        index,
        name: WorkerName { role, index },
        ring: link.ring,
        run_dir: RunDir::new(link.run_dir),
        gpu: link.gpu,
        config,
        backend: link.backend.parse()?,
        stop,
        to_launcher: Some(link.to_launcher),
        resume_step: link.resume_step,
    })
}

/// The launcher's end of the control channel closed: the launcher died (its handshake thread
/// holds that end until this worker's end closes, so only the launcher's exit closes it). A
/// channel that fails otherwise (a frame that cannot be read) ends the worker the same way:
/// nothing more can be heard from the launcher. Nothing supervises this process any more: no one recovers a dead peer or
/// closes the ring for a dead target, so a drain would wait forever. It dies as the launcher's
/// own children do when it dies (their parent-death signal, SIGKILL), which reaches only the
/// launcher's direct children, not a process a command started (`sh -c "...; :"`, `uv run`).
/// Its batch in hand stays in the ring, which the next launcher reclaims; `--resume` goes on
/// from the last checkpoint.
fn launcher_gone() -> ! {
    // Not tracing: a Python worker has no subscriber. Not eprintln!: it panics if stderr is gone.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        b"error: the launcher is gone (its control channel closed): this worker ends at once, as \
          the workers it started itself do; `launcher --resume RUN_DIR` continues the run\n",
    );
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    // SIGKILL to itself does not return; should it fail, end without unwinding.
    std::process::abort()
}

fn connect_or_read(
    args: &WorkerArgs,
    role: Role,
    name: WorkerName,
    stop: StopFlags,
) -> Result<Setup, SetupError> {
    match &args.control {
        Some(server) => connect(server, role, args.index, stop),
        None => {
            let config = match &args.config {
                Some(p) => PipelineConfig::load(p)?,
                None => PipelineConfig::default(),
            };
            Ok(Setup {
                index: args.index,
                name,
                ring: args.ring.clone().expect("clap requires --ring"),
                run_dir: RunDir::new(args.run_dir.clone().expect("clap requires --run-dir")),
                gpu: args.gpu,
                config,
                backend: args.backend,
                stop,
                to_launcher: None,
                resume_step: None,
            })
        }
    }
}

/// A worker's exit code from what its `run` returned: its own code, or 1 with the error chain
/// on stderr (its log). For the workers' `main`s, standalone or as the launcher's subcommands.
pub fn exit_code(result: anyhow::Result<i32>) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            // Not eprintln!: it panics if stderr is gone.
            let _ =
                std::io::Write::write_fmt(&mut std::io::stderr(), format_args!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}
