//! The launcher: creates the ring, starts one worker process per GPU, restarts a crashed worker
//! alone while the others keep running, stops in order on SIGINT/SIGTERM/SIGHUP/SIGQUIT, shows a
//! live monitor (copied to `<run-dir>/launcher.log`) and writes the run directory's
//! `summary.json`. At start it reclaims the rings of dead launchers of the same user.

pub mod data;
pub mod gpus;
pub mod monitor;
mod output;
mod reclaim;
pub mod report;
mod resume;
mod signals;
mod spawn;
mod summary;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use collective::ShmGroup;
use proto::config::BackendKind;
use proto::control::{self, FinalReport, ToWorker, WorkerRole};
use proto::PipelineConfig;
use shm_ring::{Ring, WorkerId};
use target_worker::data::{plan, Dataset};

use crate::spawn::{Event, Key, Welcome, WorkerExe};

/// Exit codes (also in the README).
pub mod exit {
    /// Every sample was trained.
    pub const OK: i32 = 0;
    /// An error stopped the run (the message says which).
    pub const ERROR: i32 = 1;
    /// Bad command line.
    pub const USAGE: i32 = 2;
    /// The run ended but degraded: a worker gave up past its restart limit, samples were left
    /// untrained, or a batch was trained twice; `summary.json` says why.
    pub const DEGRADED: i32 = 3;
    /// Stopped by a stop signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) after draining cleanly.
    pub const INTERRUPTED: i32 = 130;
    /// Stopped by a second stop signal: workers were killed.
    pub const KILLED: i32 = 131;
}

/// Train speculative-decoding drafters from frozen target models, one process per GPU.
///
/// Targets turn training text into hidden states; drafters learn from them; batches move
/// through a shared-memory ring. A crashed worker is restarted alone; Ctrl-C (or SIGTERM, or
/// SIGHUP from a closed terminal, or SIGQUIT) stops targets, lets drafters drain and
/// checkpoint, then exits (a second signal kills at once). At start, rings left by dead
/// launchers of the same user are removed, with a line saying which run stopped.
///
/// Examples:
///   launcher --targets 0-4 --drafters 5-7                  mock GPUs, built-in synthetic data
///   launcher --targets 0,1 --drafters 2 --synthetic 500    a smaller run
///   launcher --targets 0-4 --drafters 5-7 --data train.jsonl --run-dir runs/exp1
///   launcher --targets 0 --drafters 0 --share-gpus         one GPU for both sides
///   launcher report runs/exp1                              a picture of a run (report --help)
///   launcher prepare train.parquet                         prepare data only (prepare --help)
///
/// --data is prepared once into a memory-mapped Arrow file in the cache (--data-cache,
/// default data-cache beside the run directory), which every worker maps; the same input is
/// found there by its content and never converted again.
///
/// The run directory gets logs/, ledger/, checkpoints/, config.toml, dataset.json,
/// launcher.log (all that is printed), metrics.jsonl and summary.json. Watch a run from another terminal with
/// `shm-ring-stat --list`.
#[derive(Parser, Debug)]
#[command(name = "launcher", version, verbatim_doc_comment)]
pub struct Args {
    /// GPUs for target workers: 0-4, 0,2,4 or 0-2,6.
    #[arg(long, value_parser = gpus::gpu_list_arg)]
    pub targets: gpus::GpuList,
    /// GPUs for drafter workers, same syntax.
    #[arg(long, value_parser = gpus::gpu_list_arg)]
    pub drafters: gpus::GpuList,
    /// Allow a GPU in both lists (for machines with a single GPU).
    #[arg(long)]
    pub share_gpus: bool,
    /// Compute backend. auto: mock (the cuda backend is not built yet; once it is, auto takes
    /// it where an NVIDIA driver is present).
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// Pipeline config (TOML); every field has a default.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the stopped or killed run in RUN_DIR from its group checkpoint, with its own
    /// config and data: batches whose update is in the checkpoint are not trained again.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["config", "data", "synthetic", "run_dir"])]
    pub resume: Option<PathBuf>,
    /// Training data: JSONL with input_ids (and optional loss_mask) per line, Parquet or Arrow
    /// with input_ids (and optional loss_mask) list columns, an HF datasets save_to_disk
    /// directory, or a file `launcher prepare` made.
    #[arg(long, conflicts_with = "synthetic")]
    pub data: Option<PathBuf>,
    /// Where prepared data is cached (default: data-cache beside the run directory).
    #[arg(long, value_name = "DIR")]
    pub data_cache: Option<PathBuf>,
    /// Use N samples of the built-in synthetic dataset (the default when --data is absent).
    #[arg(long)]
    pub synthetic: Option<u64>,
    /// Run directory (default: runs/<run id>). Must not hold an earlier run.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Restarts allowed per worker before it is given up.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// Seconds without a heartbeat after which a running worker counts as hung: it is killed
    /// and restarted like a crashed one. Workers beat at every ring operation and every 100 ms
    /// while blocked on the ring, so only a step or checkpoint longer than this trips it.
    #[arg(long, default_value_t = 600.0)]
    pub hang_timeout: f64,
    /// Seconds between monitor updates.
    #[arg(long, default_value_t = 1.0)]
    pub monitor: f64,
    /// Directory holding target-worker and drafter-worker (default: beside the launcher).
    #[arg(long)]
    pub worker_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Auto,
    Mock,
    Cuda,
}

/// True if an NVIDIA driver library can be loaded. Never panics where none exists.
fn nvidia_driver_present() -> bool {
    // SAFETY: loading the driver library runs its initialisers, which NVIDIA's driver supports
    // in any process; nothing from it is called, and the handle is dropped (closed) at once.
    unsafe { libloading::Library::new("libcuda.so.1") }.is_ok()
}

/// The backend the workers build, and why, for the run's first line.
fn choose_backend(b: Backend) -> anyhow::Result<(BackendKind, String)> {
    let driver = nvidia_driver_present();
    let mock = |why: &str| Ok((BackendKind::Mock, format!("mock ({why})")));
    match b {
        Backend::Mock => mock("requested"),
        Backend::Auto if !driver => mock("no NVIDIA driver found"),
        Backend::Auto => mock("an NVIDIA driver is present, but the cuda backend is not built yet"),
        Backend::Cuda if !driver => {
            bail!("--backend cuda: no NVIDIA driver (libcuda.so.1) on this machine; use --backend mock")
        }
        Backend::Cuda => {
            bail!("--backend cuda: the cuda backend is not built yet; use --backend mock")
        }
    }
}

/// A usage error: printed like clap's, exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// Waiting out the backoff before a restart.
    Backoff(Instant),
    /// Exited 0: its part is complete.
    Done,
    /// Exited after a stop request.
    Stopped,
    /// Crashed past its restart limit.
    GaveUp,
}

struct Worker {
    role: WorkerRole,
    index: u32,
    gpu: u32,
    child: Option<Child>,
    pid: u32,
    spawns: u32,
    restarts: u32,
    phase: Phase,
    control: Option<control::Sender<ToWorker>>,
    report: Option<FinalReport>,
}

impl Worker {
    fn key(&self) -> Key {
        Key {
            role: self.role,
            index: self.index,
            spawn: self.spawns.saturating_sub(1),
        }
    }
    fn name(&self) -> String {
        match self.role {
            WorkerRole::Target => format!("target-{}", self.index),
            WorkerRole::Drafter => format!("drafter-{}", self.index),
        }
    }
    fn ring_id(&self) -> WorkerId {
        match self.role {
            WorkerRole::Target => WorkerId::producer(self.index),
            WorkerRole::Drafter => WorkerId::consumer(self.index),
        }
    }
    fn finished(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Stopped | Phase::GaveUp)
    }
}

fn backoff(restarts: u32) -> Duration {
    Duration::from_millis(200 * (1u64 << restarts.min(5))).min(Duration::from_secs(5))
}

/// Everything a finished run knows, for the summary.
pub struct Outcome {
    pub exit_code: i32,
    pub notes: Vec<String>,
}

/// What `run` settles before the run directory, and so its log, exists.
struct Prepared {
    cfg: PipelineConfig,
    /// The backend the workers build, and why (for the run's first line and the summary).
    backend: (BackendKind, String),
    exes: [WorkerExe; 2],
    data: Dataset,
    /// The line saying how the data was prepared.
    data_line: Option<String>,
    batches: u64,
    params: shm_ring::RingParams,
    run_id: String,
    run_dir: PathBuf,
    resume: Option<resume::Resume>,
}

/// Runs the launcher; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let prep = prepare(&args)?;
    // From here on everything printed is also in launcher.log, and a terminal that goes away
    // cannot make a write fail (see `output`).
    let tee = output::Tee::install(&prep.run_dir.join("launcher.log"))?;
    let result = supervise(&args, prep, &tee);
    if let Err(e) = &result {
        // main prints it to the terminal once the tee is gone; this is the log's copy.
        tee.log().line(&format!("error: {e:#}"));
    }
    result
}

/// Checks the command line and config, loads the data and lays out the run directory.
fn prepare(args: &Args) -> anyhow::Result<Prepared> {
    let (targets, drafters) = (&args.targets.0, &args.drafters.0);
    let shared = gpus::overlap(targets, drafters);
    if !shared.is_empty() && !args.share_gpus {
        return Err(UsageError(format!(
            "GPU(s) {shared:?} are in both --targets and --drafters; pass --share-gpus to allow that on a machine with few GPUs"
        ))
        .into());
    }
    if !(args.hang_timeout.is_finite() && args.hang_timeout > 0.0) {
        return Err(UsageError(format!(
            "--hang-timeout must be a positive number of seconds, got {}",
            args.hang_timeout
        ))
        .into());
    }
    if !(args.monitor.is_finite() && args.monitor > 0.0) {
        return Err(UsageError(format!(
            "--monitor must be a positive number of seconds, got {}",
            args.monitor
        ))
        .into());
    }
    let mut cfg = match (&args.resume, &args.config) {
        (Some(dir), _) => {
            let p = dir.join("config.toml");
            if !p.is_file() {
                bail!(
                    "{} is not a run directory: it has no config.toml",
                    dir.display()
                );
            }
            PipelineConfig::load(&p).context("loading the run's config")?
        }
        (None, Some(p)) => PipelineConfig::load(p)?,
        (None, None) => PipelineConfig::default(),
    };
    if let Some(p) = &args.data {
        cfg.data.path = Some(p.clone());
    }
    if let Some(n) = args.synthetic {
        cfg.data.path = None;
        cfg.data.synthetic_samples = n;
    }
    cfg.validate().context("checking the config")?;
    let backend = choose_backend(args.backend)?;
    let exes = [
        WorkerExe::find(WorkerRole::Target, args.worker_dir.as_deref())?,
        WorkerExe::find(WorkerRole::Drafter, args.worker_dir.as_deref())?,
    ];

    let run_id = format!(
        "{}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        std::process::id()
    );
    let run_dir = match (&args.resume, &args.run_dir) {
        (Some(dir), _) | (None, Some(dir)) => dir.clone(),
        (None, None) => PathBuf::from("runs").join(&run_id),
    };

    // The data, prepared once (or found prepared) and mapped: only the lengths are read here.
    let mut prepared = None;
    let mut data_line = None;
    if let Some(input) = cfg.data.path.clone() {
        let cache = args
            .data_cache
            .clone()
            .unwrap_or_else(|| dataset::default_cache_dir(&run_dir));
        let (p, line) = data::prepare(&input, cfg.data.max_len, &cache, None)?;
        if args.resume.is_some() {
            data::check_same(&run_dir, &p)
                .with_context(|| format!("resuming {}", run_dir.display()))?;
        }
        cfg.data.prepared = Some(p.path.clone());
        data_line = Some(line);
        prepared = Some((input, p));
    }
    let data = Dataset::load(&cfg).context("loading the dataset")?;
    let batches = plan(&data, &cfg).len() as u64;
    let (nt, nd) = (targets.len() as u32, drafters.len() as u32);
    let params = cfg
        .ring_params(nt, nd, batches)
        .context("sizing the ring")?;

    let resume = match &args.resume {
        Some(dir) => Some(
            resume::check(dir, &cfg, backend.0, nd, batches)
                .with_context(|| format!("resuming {}", dir.display()))?,
        ),
        None => {
            prepare_run_dir(&run_dir)?;
            std::fs::write(run_dir.join("config.toml"), cfg.to_toml())
                .with_context(|| format!("writing {}", run_dir.join("config.toml").display()))?;
            None
        }
    };
    if let Some((input, p)) = &prepared {
        data::write_record(&run_dir, input, p)?;
    }
    Ok(Prepared {
        cfg,
        backend,
        exes,
        data,
        data_line,
        batches,
        params,
        run_id,
        run_dir,
        resume,
    })
}

/// Creates the ring, runs the workers to the end and writes the summary.
fn supervise(args: &Args, prep: Prepared, tee: &output::Tee) -> anyhow::Result<i32> {
    let Prepared {
        cfg,
        backend,
        exes,
        data,
        data_line,
        batches,
        params,
        run_id,
        run_dir,
        resume,
    } = prep;
    let (targets, drafters) = (&args.targets.0, &args.drafters.0);
    let (nt, nd) = (targets.len() as u32, drafters.len() as u32);
    // Before the ring exists: from here a stop signal is counted, never fatal, so the ring is
    // always removed.
    let signals = signals::StopSignals::install().context("installing signal handlers")?;
    // Frees what dead launchers hold before this ring takes its share of /dev/shm.
    for line in reclaim::reclaim() {
        println!("{line}");
    }
    let ring_name = format!("{}{run_id}", shm_ring::NAME_PREFIX);
    // Declared before the ring, so dropped after it: while the ring exists, so does the record.
    let group_name = proto::group_segment(&ring_name);
    let _record = reclaim::register(&ring_name, std::slice::from_ref(&group_name), &run_dir)
        .map_err(|e| println!("warning: this run is not recorded for reclaiming: {e:#}"))
        .ok();
    let ring = Ring::create(&ring_name, &params).context("creating the ring")?;
    // A resumed run: the ledgers keep what the checkpoint holds, and those batches are done.
    let start_step = match &resume {
        Some(r) => {
            r.apply()?;
            let n = ring
                .mark_work_done(r.done.iter().copied())
                .context("marking the checkpointed batches done")?;
            println!(
                "resuming {} from its checkpoint at step {}: {n} batch(es) already trained, {} ledger line(s) after the checkpoint dropped (their batches are trained again)",
                run_dir.display(),
                r.step,
                r.dropped
            );
            r.step
        }
        None => 0,
    };
    // The drafter group: one model trained by every drafter (see the collective crate).
    let group = ShmGroup::create(
        &group_name,
        &drafter_worker::group_params(backend.0, &cfg, nd, start_step)?,
    )
    .context("creating the drafter group")?;
    // For `shm-ring-stat --run-dir`.
    std::fs::write(run_dir.join("ring"), format!("{ring_name}\n"))
        .with_context(|| format!("writing {}", run_dir.join("ring").display()))?;

    println!(
        "hspipe: {} targets (GPUs {:?}), {} drafters (GPUs {:?}); backend {}",
        nt, targets, nd, drafters, backend.1
    );
    if let Some(line) = &data_line {
        println!("{line}");
    }
    println!(
        "data: {}, {} batches; ring {ring_name} ({} slots x {} KiB); run dir {}",
        data.source,
        batches,
        params.slots,
        params.slot_size / 1024,
        run_dir.display()
    );

    let welcome = Welcome {
        ring: ring_name.clone(),
        run_dir: run_dir.clone(),
        config_toml: cfg.to_toml(),
        backend: backend.0,
    };
    let mut workers: Vec<Worker> = targets
        .iter()
        .enumerate()
        .map(|(i, &gpu)| (WorkerRole::Target, i as u32, gpu))
        .chain(
            drafters
                .iter()
                .enumerate()
                .map(|(i, &gpu)| (WorkerRole::Drafter, i as u32, gpu)),
        )
        .map(|(role, index, gpu)| Worker {
            role,
            index,
            gpu,
            child: None,
            pid: 0,
            spawns: 0,
            restarts: 0,
            phase: Phase::Backoff(Instant::now()),
            control: None,
            report: None,
        })
        .collect();

    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<Event>();
    let mut mon = monitor::Monitor::new(
        &run_dir,
        batches,
        Duration::from_secs_f64(args.monitor),
        tee,
    )?;
    let mut notes: Vec<String> = Vec::new();
    let mut stopping = false;
    let mut killed = false;
    let mut last_hang_check = Instant::now();

    loop {
        // 1. Signals: the first stops in order, the second kills.
        let received = signals.received();
        if received >= 1 && !stopping {
            stopping = true;
            mon.say(&format!(
                "stopping: {}: targets stop claiming, drafters drain and checkpoint (a second signal kills every worker)",
                signals.last_name()
            ));
            send_stop(&workers);
        }
        if received >= 2 {
            mon.say(&format!(
                "second signal ({}): killing every worker",
                signals.last_name()
            ));
            for w in &mut workers {
                if let Some(mut c) = w.child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                if !w.finished() {
                    w.phase = Phase::Stopped;
                }
            }
            killed = true;
            break;
        }

        // 2. Messages from handshake threads.
        while let Ok(ev) = rx.try_recv() {
            match ev {
                Event::Connected(key, sender) => {
                    if let Some(w) = workers.iter_mut().find(|w| w.key() == key) {
                        if stopping {
                            let _ = sender.send(ToWorker::Stop);
                        }
                        w.control = Some(sender);
                    }
                }
                Event::Report(key, r) => {
                    if let Some(w) = workers.iter_mut().find(|w| w.key() == key) {
                        w.report = Some(r);
                    }
                }
                Event::Progress { step, loss, tokens } => mon.progress(step, loss, tokens),
                Event::HandshakeFailed(key, why) => {
                    mon.say(&format!(
                        "{:?} {}: handshake failed: {why}",
                        key.role, key.index
                    ));
                }
            }
        }

        // 3. Hangs, checked once a second: a running worker silent for too long is killed; its
        // exit is handled below like any crash.
        if last_hang_check.elapsed() >= Duration::from_secs(1) {
            last_hang_check = Instant::now();
            let snap = ring.snapshot();
            let hang_ns = (args.hang_timeout * 1e9) as u64;
            for w in &mut workers {
                let rec = &snap.workers[match w.role {
                    WorkerRole::Target => w.index as usize,
                    WorkerRole::Drafter => (nt + w.index) as usize,
                }];
                // Only a worker that has registered this incarnation can be late.
                let silent = rec.heartbeat_age_ns.unwrap_or(0);
                if w.child.is_some() && rec.pid == w.pid && silent > hang_ns {
                    mon.say(&format!(
                        "{} (pid {}) sent no heartbeat for {:.0}s: killing it as hung",
                        w.name(),
                        w.pid,
                        silent as f64 / 1e9
                    ));
                    if let Some(c) = &mut w.child {
                        let _ = c.kill();
                    }
                }
            }
        }

        // 4. Exits, recoveries, restarts.
        let drafters_left = workers
            .iter()
            .filter(|w| w.role == WorkerRole::Drafter && !matches!(w.phase, Phase::GaveUp))
            .count();
        for w in &mut workers {
            if let Some(child) = &mut w.child {
                let Some(status) = child.try_wait().context("waiting for a worker")? else {
                    continue;
                };
                w.child = None;
                w.control = None;
                match status.code() {
                    Some(0) => {
                        w.phase = Phase::Done;
                        // A drafter that finished has left the group: a rank restarted late
                        // must not wait for it to admit it (it admits itself into an empty
                        // group, sees the ring's end and finishes too).
                        if w.role == WorkerRole::Drafter {
                            group.remove(w.index)?;
                        }
                    }
                    Some(c) if c == proto::stop::EXIT_STOPPED => w.phase = Phase::Stopped,
                    _ => {
                        // A drafter leaves the group first: survivors blocked in the reduction
                        // go on without it, and we learn whether its batch is in an applied
                        // update. If it still holds that batch, it is retired, not redelivered.
                        let committed = if w.role == WorkerRole::Drafter {
                            let gone = group.remove(w.index)?;
                            gone.committed_batch.map(|b| (b, gone.membership.step))
                        } else {
                            None
                        };
                        let r = match committed {
                            Some((batch, step)) => {
                                let mut wrote = Ok(false);
                                let r =
                                    ring.recover_retiring(w.ring_id(), batch, |meta, payload| {
                                        wrote = drafter_worker::record_retired(
                                            &run_dir,
                                            w.index,
                                            meta,
                                            payload,
                                            u64::from(step),
                                        );
                                    })?;
                                if r.retired > 0 {
                                    let how = match wrote {
                                        Ok(true) => "its ledger line written for it".to_string(),
                                        Ok(false) => "its ledger line was already written".into(),
                                        Err(e) => {
                                            format!("its ledger line could not be written: {e:#}")
                                        }
                                    };
                                    mon.say(&format!(
                                        "{} died holding batch {batch}, whose update the group applied at step {step}: retired, not redelivered ({how})",
                                        w.name()
                                    ));
                                }
                                r
                            }
                            None => ring.recover(w.ring_id())?,
                        };
                        let what = format!(
                            "{} (pid {}) died: {status}; recovered {} held batch(es), {} slot(s), {} work item(s)",
                            w.name(),
                            w.pid,
                            r.requeued,
                            r.freed,
                            r.work_returned
                        );
                        mon.say(&what);
                        let stop_target = stopping && w.role == WorkerRole::Target;
                        if w.restarts < args.max_restarts && !stop_target {
                            w.phase = Phase::Backoff(Instant::now() + backoff(w.restarts));
                            w.restarts += 1;
                        } else {
                            w.phase = if stop_target {
                                Phase::Stopped
                            } else {
                                Phase::GaveUp
                            };
                            if !stop_target {
                                let note = format!(
                                    "{} gave up after {} restart(s); log: {}",
                                    w.name(),
                                    w.restarts,
                                    log_path(&run_dir, w).display()
                                );
                                mon.say(&note);
                                notes.push(note);
                            }
                            if w.role == WorkerRole::Target {
                                // Count it as finished so the ring still closes.
                                ring.retire(w.index)?;
                            }
                        }
                    }
                }
            }
        }
        // With every drafter gone nothing can drain the ring: stop the targets.
        if drafters_left == 0 && !stopping {
            stopping = true;
            let note = "no drafter left: stopping the targets".to_string();
            mon.say(&note);
            notes.push(note);
            send_stop(&workers);
        }
        let now = Instant::now();
        for w in &mut workers {
            if let Phase::Backoff(at) = w.phase {
                if now >= at {
                    let exe = &exes[usize::from(w.role == WorkerRole::Drafter)];
                    let key = Key {
                        role: w.role,
                        index: w.index,
                        spawn: w.spawns,
                    };
                    let child = spawn::spawn(
                        exe,
                        key,
                        w.gpu,
                        &log_path(&run_dir, w),
                        &welcome,
                        tx.clone(),
                    )
                    .with_context(|| format!("starting {}", w.name()))?;
                    if w.spawns > 0 {
                        mon.say(&format!(
                            "{} restarted (restart {} of at most {}), pid {}",
                            w.name(),
                            w.restarts,
                            args.max_restarts,
                            child.id()
                        ));
                    }
                    w.pid = child.id();
                    w.spawns += 1;
                    w.child = Some(child);
                    w.phase = Phase::Running;
                }
            }
        }

        // 5. Monitor.
        let restarts: u32 = workers.iter().map(|w| w.restarts).sum();
        mon.tick(&ring, restarts, started)?;

        if workers.iter().all(Worker::finished) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    mon.finish(&ring)?;

    let wall = started.elapsed();
    let snap = ring.snapshot();
    let mut exit_code = exit::OK;
    if killed {
        exit_code = exit::KILLED;
    } else if stopping && signals.received() > 0 {
        exit_code = exit::INTERRUPTED;
    }
    let restarts: HashMap<String, u32> = workers.iter().map(|w| (w.name(), w.restarts)).collect();
    let summary = summary::build(
        &run_dir,
        &ring_name,
        &backend.1,
        &snap,
        data.len() as u64,
        nd,
        wall,
        &restarts,
    )?;
    // Judged from the ledgers only (summary.rs): what was trained, and what twice.
    if exit_code == exit::OK
        && (!notes.is_empty()
            || summary.samples_trained < summary.samples_total
            || summary.duplicated > 0)
    {
        exit_code = exit::DEGRADED;
        if summary.samples_trained < summary.samples_total {
            notes.push(format!(
                "{} of {} samples were not trained",
                summary.samples_total - summary.samples_trained,
                summary.samples_total
            ));
        }
    }
    let refused: u64 = workers
        .iter()
        .filter_map(|w| w.report.as_ref())
        .map(|r| r.refused)
        .sum();
    if refused > 0 {
        notes.push(format!(
            "drafters refused {refused} corrupt batch(es); see their logs"
        ));
    }
    let summary = summary::finalise(summary, exit_code, notes);
    summary::write(&run_dir, &summary)?;
    summary::print(&summary);
    drop(ring);
    Ok(exit_code)
}

/// Asks every connected worker to stop in order.
fn send_stop(workers: &[Worker]) {
    for w in workers {
        if let Some(c) = &w.control {
            let _ = c.send(ToWorker::Stop);
        }
    }
}

fn log_path(run_dir: &Path, w: &Worker) -> PathBuf {
    run_dir.join("logs").join(format!("{}.log", w.name()))
}

/// Creates the run directory's layout; refuses one that already holds a run.
fn prepare_run_dir(dir: &Path) -> anyhow::Result<()> {
    for sub in ["ledger", "checkpoints"] {
        let p = dir.join(sub);
        if p.read_dir()
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
        {
            bail!(
                "run directory {} already holds a run ({} is not empty): pick another --run-dir",
                dir.display(),
                p.display()
            );
        }
    }
    for sub in ["logs", "ledger", "checkpoints"] {
        std::fs::create_dir_all(dir.join(sub))
            .with_context(|| format!("creating {}", dir.join(sub).display()))?;
    }
    Ok(())
}
