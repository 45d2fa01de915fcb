//! The launcher: creates the ring, starts one worker process per GPU, restarts a crashed worker
//! alone while the others keep running, stops in order on SIGINT/SIGTERM/SIGHUP/SIGQUIT, shows a
//! live monitor (copied to `<run-dir>/launcher.log`) and writes the run directory's
//! `summary.json`. At start it reclaims the rings of dead launchers of the same user.
//!
//! `cli` is the command line; `run` settles everything that can be checked before the run
//! directory exists (`settle`), then hands over to the `supervisor`.
//!
//! Length: about 540 lines: `settle` orders every check a run or a resume makes before its run
//! directory is touched (config, model, data, plan, ring, GPU lists), and its order is the point.

mod choose;
pub mod cli;
pub mod data;
mod digests;
pub mod eval;
mod log_cap;
pub mod model;
mod model_record;
pub mod monitor;
mod output;
mod reclaim;
pub mod report;
mod resume;
mod schedule;
mod signals;
mod spawn;
mod summary;
mod supervisor;
pub mod tensorboard;

use std::path::PathBuf;

use anyhow::{bail, Context};
use choose::{choose_backend, choose_collective, probe_nccl};
use dataset::Dataset;
use gpu::BackendKind;
use proto::plan::{plan, plan_fields, Epochs, PlanDigest};
use proto::{GpuLists, PipelineConfig, RunDir};

pub use crate::cli::{exit, Args, Backend, Cli, Command, Interrupted, UsageError};
pub use crate::spawn::name_process;

/// `n` with its noun, singular for one: "1 drafter", "3 drafters", "1 batch". The lines a user
/// reads first said "1 drafters" for a run of one.
pub(crate) fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

/// What `run` settles before the run directory, and so its log, exists.
pub(crate) struct Settled {
    pub(crate) cfg: PipelineConfig,
    /// The backend the workers build, and why (for the run's first line and the summary).
    pub(crate) backend: (BackendKind, String),
    pub(crate) data: Dataset,
    /// The line saying how the data was prepared.
    pub(crate) data_line: Option<String>,
    /// What preparing it left out of the plan, for the end's notes ([`data::dropped_notes`]).
    pub(crate) data_notes: Vec<String>,
    pub(crate) batches: u64,
    /// The plan: batch `i`'s samples (the line of a batch set aside before it was published).
    pub(crate) planned: Vec<proto::plan::PlannedBatch>,
    /// Which epoch each planned batch is in.
    pub(crate) epochs: Epochs,
    pub(crate) params: shm_ring::RingParams,
    pub(crate) run_id: String,
    pub(crate) run_dir: RunDir,
    /// The GPUs the workers use: the command line's, or on a resume the run's own for a list
    /// not given.
    pub(crate) gpus: GpuLists,
    pub(crate) resume: Option<resume::Resume>,
    /// The run directory, held for the launcher's life ([`resume::hold`]).
    pub(crate) held: Option<std::fs::File>,
    /// Lines for the run's start, said once its log exists (what an earlier launch left and
    /// this one removed; a resumed run's choice this build would refuse a new run).
    pub(crate) said: Vec<String>,
}

/// Runs the launcher; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    // First of all: a stop signal while the data is prepared (minutes, for a large set) stops
    // the preparation, which leaves nothing partial, instead of killing the launcher. Counted
    // from here, never fatal, so the ring made later is always removed.
    let signals = signals::StopSignals::install().context("installing signal handlers")?;
    let settled = match settle(&args, &signals) {
        Ok(s) => s,
        Err(e) => {
            // A refused resume (a damaged checkpoint, a model that moved) still frees what dead
            // launchers hold: the killed launch it was to continue left its ring, up to tens of
            // GB of /dev/shm, which only a launch that starts would otherwise reclaim.
            if let Some(dir) = &args.resume {
                let this = reclaim::This {
                    run_dir: dir,
                    resuming: true,
                    refused: true,
                };
                for line in reclaim::reclaim(&this) {
                    println!("{line}");
                }
            }
            return Err(e);
        }
    };
    // From here on everything printed is also in launcher.log, and a terminal that goes away
    // cannot make a write fail (see `output`).
    let tee = output::Tee::install(&settled.run_dir.launcher_log())?;
    for line in &settled.said {
        println!("{line}");
    }
    if signals.received() > 0 {
        // Asked while the run was settled (its model checked, its directory laid out). A
        // resume's earlier launches trained what they trained; this one trained nothing more.
        let (trained, verb) = match settled.resume {
            None => ("nothing was trained", "starts"),
            Some(_) => ("nothing more was trained", "resumes"),
        };
        println!(
            "stopped by {} before the workers started: {trained}; `{}` {verb} the run",
            signals.last_name(),
            resume::command(settled.run_dir.path())
        );
        return Ok(exit::INTERRUPTED);
    }
    let result = supervisor::Supervisor::start(&args, settled, &tee, signals).and_then(|s| s.run());
    if let Err(e) = &result {
        // main prints it to the terminal once the tee is gone; this is the log's copy.
        tee.log().line(&format!("error: {e:#}"));
    }
    result
}

/// Checks the command line and config, loads the data and lays out the run directory.
fn settle(args: &Args, signals: &signals::StopSignals) -> anyhow::Result<Settled> {
    args.check()?;
    // On a resume every error says which run it stopped, and one of this build's checks of the
    // config alone says that it refused the run's own config.toml, with the ways on
    // (`resume::config_refused`): a build newer than the run's may check more.
    let resuming = |e: anyhow::Error| match &args.resume {
        Some(dir) => e.context(format!("resuming {}", dir.display())),
        None => e,
    };
    let refused = |e: anyhow::Error| match &args.resume {
        Some(dir) => resume::config_refused(dir, &e),
        None => e,
    };
    let mut said = Vec::new();
    let mut cfg = match (&args.resume, &args.config) {
        (Some(dir), _) => {
            let p = RunDir::new(dir).config();
            // `try_exists`: a directory that cannot be looked at (no permission) is not said to
            // be missing.
            match dir.try_exists() {
                Ok(true) => {}
                Ok(false) => bail!(
                    "{} does not exist: --resume takes the run directory a launch wrote (its --run-dir)",
                    dir.display()
                ),
                Err(e) => bail!("{}: {e}", dir.display()),
            }
            if !dir.is_dir() {
                bail!(
                    "{} is a file, not a run directory: --resume takes the directory a launch wrote (its --run-dir)",
                    dir.display()
                );
            }
            if !p.is_file() {
                bail!(
                    "{} is not a run directory: it has no config.toml",
                    dir.display()
                );
            }
            // Loaded, an empty file is the default config: another run than this one.
            if std::fs::read_to_string(&p).is_ok_and(|t| t.trim().is_empty()) {
                bail!(
                    "{} is empty (cut short by a crash as it was written?): the run cannot be resumed without its config",
                    p.display()
                );
            }
            PipelineConfig::load(&p).map_err(|e| match e {
                proto::config::ConfigError::Read { .. } => resuming(e.into()),
                // The launcher writes it whole (atomically): text that is not TOML was
                // changed since, which no build's check explains. README tells users to edit
                // it (a learning rate, kept exports), so an edit is as likely as damage.
                proto::config::ConfigError::Syntax { .. } => resuming(anyhow::anyhow!(
                    "{e}: the launch that started the run wrote its config.toml whole, so it was edited or damaged since; repair it by hand (its fields: README, \"Running it\"; a resume refuses a config whose model, layers or data do not match the run's plan and checkpoint)"
                )),
                proto::config::ConfigError::Parse { .. } => {
                    resume::config_unknown(dir, &e.into())
                }
                e => refused(e.into()),
            })?
        }
        (None, Some(p)) => PipelineConfig::load(p)?,
        (None, None) => PipelineConfig::default(),
    };
    // Before anything else is checked or written: a run whose launcher still runs is not
    // resumed under it.
    let mut held = match &args.resume {
        Some(dir) => resume::hold(&RunDir::new(dir))
            .with_context(|| format!("resuming {}", dir.display()))?,
        None => None,
    };
    spawn::settle_command_dirs(&mut cfg).map_err(resuming)?;
    spawn::check_commands(&cfg).map_err(resuming)?;
    // After the config: a directory that is no run at all is told so, not that it lacks
    // a record of its GPUs.
    let gpus = gpu_lists(args)?;
    if let Some(p) = &args.data {
        cfg.data.path = Some(p.clone());
    }
    if let Some(n) = args.synthetic {
        cfg.data.path = None;
        cfg.data.synthetic_samples = n;
    }
    if let Some(m) = &args.model {
        cfg.model.path = Some(m.clone());
    }
    // The paths go into the run's config.toml, which `--resume` reads from wherever it is run
    // (the reclaim line prints the run's absolute path to copy): relative to this directory,
    // they would find nothing there, or another model or tokenizer of the same name.
    for p in [
        &mut cfg.model.path,
        &mut cfg.data.path,
        &mut cfg.data.tokenizer,
    ]
    .into_iter()
    .flatten()
    {
        *p = std::path::absolute(&p).with_context(|| format!("resolving {}", p.display()))?;
    }
    let need = gpus
        .targets
        .iter()
        .chain(&gpus.drafters)
        .max()
        .map_or(0, |g| g + 1);
    let backend = choose_backend(args.backend, cfg.model.path.is_some(), need).map_err(|e| {
        // A resume takes no --model: the run's own decides, so say what the run is.
        match (&args.resume, &cfg.model.path) {
            (Some(dir), None) => e.context(format!(
                "{} ran without a model (the mock backend), and a resume runs what the run ran: leave --backend out, or give --backend mock",
                dir.display()
            )),
            _ => e,
        }
    })?;
    if let (Some(dir), Some(m)) = (&args.resume, &cfg.model.path) {
        // Before the model is settled: another model at the path is the thing to say, not a
        // check it fails.
        model_record::check_same(&RunDir::new(dir), m).map_err(resuming)?;
    }
    // The model fixes the hidden size and captured layers the ring is sized for.
    let settled = match &args.resume {
        None => gpu::settle(backend.0, &mut cfg),
        Some(_) => gpu::settle_resumed(backend.0, &mut cfg),
    };
    settled
        .context("checking the model (its config.json and weights)")
        .map_err(refused)?;
    if let (Some(dir), Some(_), Some(ids)) =
        (&args.resume, &cfg.model.path, &cfg.model.target_layer_ids)
    {
        let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        if let Err(e) = ::model::capture::check_distinct(&ids) {
            said.push(format!(
                "note: resuming {} with its captured layers {ids:?} ({e}): this build refuses that to a new run, and keeps it for this one, whose checkpoint was trained on these layers",
                dir.display()
            ));
        }
    }
    cfg.drafter.collective = choose_collective(
        cfg.drafter.collective,
        backend.0,
        gpus.drafters.len() as u32,
        cfg.drafter.command.is_none(),
        probe_nccl,
    )
    .map_err(resuming)?;
    cfg.validate()
        .context("checking the config")
        .map_err(refused)?;
    // Our DFlash worker exports; the mock's drafter and a `[drafter] command` write none.
    let exports = gpu::drafter_exports(backend.0) && cfg.drafter.command.is_none();
    cfg.check_kept_exports(exports)
        .context("checking the config")
        .map_err(refused)?;
    let mock = backend.0 == BackendKind::Mock;
    (cfg.check_mock_dtype(
        mock && cfg.target.command.is_none(),
        mock && cfg.drafter.command.is_none(),
    ))
    .context("checking the config")
    .map_err(refused)?;
    // A target of one's own beside the mock drafter, which checks every byte against the mock
    // target's states: fine for numpy_target.py (which computes them), every batch refused for
    // a real model's. Said at the start, not found in the end's note.
    if backend.0 == BackendKind::Mock
        && cfg.target.command.is_some()
        && cfg.drafter.command.is_none()
    {
        said.push(
            "note: [target] command runs beside the mock drafter (no model is given), which refuses any batch whose hidden states are not the mock target's (python/examples/numpy_target.py computes them); a target of your own model needs a drafter that takes its states: [drafter] command, or --model DIR for ours".to_string(),
        );
    }
    // A new run only: a resume runs what its run ran, a mock one with its [dflash] too. A
    // `[drafter] command` is the user's own drafter, which may read the section.
    if args.resume.is_none() {
        let dflash = gpu::drafter_exports(backend.0) || cfg.drafter.command.is_some();
        cfg.check_dflash_used(dflash)
            .context("checking the config")?;
    }
    // The GPU lists count here too, and a resume may change them: not the config's fault alone.
    cfg.check_faults(gpus.targets.len() as u32, gpus.drafters.len() as u32)
        .context("checking the config")
        .map_err(resuming)?;

    let run_id = format!(
        "{}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        std::process::id()
    );
    let run_dir = RunDir::new(match (&args.resume, &args.run_dir) {
        (Some(dir), _) | (None, Some(dir)) => dir.clone(),
        (None, None) => PathBuf::from("runs").join(&run_id),
    });
    // Before the data is prepared (minutes, for a large set): a directory a new run may not
    // use is refused now, and again where it is laid out.
    if args.resume.is_none() {
        run_dir.check_new(args.data_cache.as_deref())?;
    }

    // The data, prepared once (or found prepared) and mapped: only the lengths are read here.
    // A config's own `data.prepared` is not this run's: the effective config of an earlier run
    // (`<run-dir>/config.toml`, also what a resume loads) names that run's prepared file, which
    // a run on `--synthetic` or a resume would otherwise map in place of its data.
    cfg.data.prepared = None;
    cfg.data.prepared_key = None;
    let mut prepared = None;
    let mut data_line = None;
    let mut data_notes = Vec::new();
    if let Some(input) = cfg.data.path.clone() {
        let cache = args
            .data_cache
            .clone()
            .unwrap_or_else(|| dataset::default_cache_dir(run_dir.path()));
        let options = data::options(&cfg, cfg.data.max_len)?;
        let (p, line) = match &args.resume {
            None => data::prepare_dataset(&input, &options, &cache, None, Some(signals))?,
            Some(_) => {
                data::resume_data(&run_dir, &input, &options, &cache, signals).map_err(resuming)?
            }
        };
        // With its key: a worker (re)started later refuses a file replaced at that path.
        cfg.data.prepared = Some(p.path.clone());
        cfg.data.prepared_key = Some(p.key.clone());
        data_line = Some(line);
        data_notes = data::dropped_notes(&input, &p, cfg.data.max_len);
        prepared = Some((input, p));
    }
    let data =
        (target_worker::load_dataset(&cfg).context("loading the dataset")).map_err(resuming)?;
    // A file's samples are not bound by data.min_len (the synthetic data's shortest), but the
    // ring's slots hold a full token budget of min_len-token samples: batches of shorter ones
    // carried more headers than a slot holds, and every target crashed on them. Sized for
    // the file's shortest instead (min_len plans nothing for file data).
    if let (Some(_), Some(&shortest)) = (&cfg.data.path, data.lengths().iter().min()) {
        if shortest < cfg.data.min_len {
            cfg.data.min_len = shortest.max(1);
            cfg.validate()
                .context("checking the config for the data's shortest sample")
                .map_err(refused)?;
        }
    }
    (cfg.check_plan_size(data.len() as u64))
        .context("checking the config")
        .map_err(refused)?;
    if let (Some(m), Some((input, _))) = (&cfg.model.path, &prepared) {
        model::check_ids_fit(&data, m, input).map_err(resuming)?;
    }
    let planned = plan(data.lengths(), &cfg);
    let (batches, epochs) = (planned.len() as u64, Epochs::of(&planned));
    let (nt, nd) = (gpus.targets.len() as u32, gpus.drafters.len() as u32);
    // Not `refused`: the ring is sized by the GPU lists too, which a resume may change.
    let params = (cfg.ring_params(nt, nd, batches))
        .context("sizing the ring")
        .map_err(|e| match &args.resume {
            // A resume's [ring] is the run's own config.toml, which the user did not give.
            Some(dir) => e.context(format!(
                "resuming {}: the ring for --targets/--drafters as given does not fit the run's [ring] settings: change them in {}, or resume with fewer workers",
                dir.display(),
                RunDir::new(dir).config().display()
            )),
            None => e,
        })?;

    let resume = match &args.resume {
        Some(dir) => {
            run_dir
                .check_plan_version(&PlanDigest::of(&planned), &plan_fields(&cfg))
                .with_context(|| format!("resuming {}", dir.display()))?;
            Some(
                resume::check(&run_dir, &cfg, backend.0, nd, batches)
                    .with_context(|| format!("resuming {}", dir.display()))?,
            )
        }
        None => {
            // Read before the directory is laid out: a model that cannot be read leaves none.
            let model = (cfg.model.path.as_deref())
                .map(model_record::ModelRecord::of)
                .transpose()?;
            // A `--data-cache` inside it was made by the preparation above.
            run_dir.lay_out_with(args.data_cache.as_deref())?;
            held = resume::hold(&run_dir)?;
            // Held, so no launcher runs here: what an earlier launch that trained nothing left
            // goes, and this run starts clean (`RunDir::clear_earlier_launch` says why).
            let cleared = run_dir.clear_earlier_launch()?;
            if !cleared.is_empty() {
                said.push(cleared_line(&run_dir, &cleared));
            }
            if let Some(m) = &model {
                model_record::write(&run_dir, m)?;
            }
            run_dir.write_plan_version(&PlanDigest::of(&planned), &plan_fields(&cfg))?;
            // Before the schedule is settled below: a total_steps in it is the user's.
            let p = run_dir.config();
            atomic_file::replace(&p, cfg.to_toml().as_bytes())
                .with_context(|| format!("writing {}", p.display()))?;
            None
        }
    };
    // After config.toml is written (`schedule` says why); said only for a drafter with a
    // learning-rate schedule: ours on a model, or the user's own.
    let resumed = resume.as_ref().map(|r| schedule::Resumed {
        step: u64::from(r.step),
        done: r.done.len() as u64,
        drafters_before: (run_dir.read_gpus().ok().flatten()).map(|g| g.drafters.len() as u32),
    });
    let line = schedule::settle(&mut cfg, &run_dir, resumed, batches, nd)?;
    said.extend(line.filter(|_| gpu::drafter_exports(backend.0) || cfg.drafter.command.is_some()));
    if let Some((input, p)) = &prepared {
        data::write_record(&run_dir, input, p)?;
    }
    // Rewritten by a resume too (after its checks): the next `--resume` alone runs on the GPUs
    // this one ran on, which fit the run's ledgers.
    run_dir.write_gpus(&gpus)?;
    Ok(Settled {
        cfg,
        backend,
        data,
        data_line,
        data_notes,
        batches,
        planned,
        epochs,
        params,
        run_id,
        run_dir,
        gpus,
        resume,
        held,
        said,
    })
}

/// The line saying what an earlier launch that trained nothing left in `run_dir` and this one
/// removed: each file by name, a folder's by their number.
fn cleared_line(run_dir: &RunDir, cleared: &[PathBuf]) -> String {
    let mut names: Vec<(String, usize)> = Vec::new();
    for p in cleared {
        let mut parts = p.components();
        let first = parts.next().map(|c| c.as_os_str().to_string_lossy());
        let name = match (first, parts.next()) {
            (Some(dir), Some(_)) => format!("{dir}/"),
            (Some(file), None) => file.into_owned(),
            (None, _) => continue,
        };
        match names.iter_mut().find(|(n, _)| *n == name) {
            Some((_, k)) => *k += 1,
            None => names.push((name, 1)),
        }
    }
    let list: Vec<String> = (names.into_iter())
        .map(|(n, k)| match n.ends_with('/') {
            true => format!("{n} ({k} file{})", if k == 1 { "" } else { "s" }),
            false => n,
        })
        .collect();
    format!(
        "run dir {}: an earlier launch laid it out and trained nothing; removed what it left, so this run starts clean: {}",
        run_dir.path().display(),
        list.join(", ")
    )
}

/// The GPU lists of the run, checked: those given, and on a resume the run's own for a list
/// not given.
fn gpu_lists(args: &Args) -> anyhow::Result<GpuLists> {
    let (lists, recorded) = match (&args.resume, &args.targets, &args.drafters) {
        (Some(dir), t, d) => resume::gpu_lists(&RunDir::new(dir), t.as_ref(), d.as_ref())?,
        (None, Some(t), Some(d)) => {
            let lists = GpuLists {
                targets: t.0.clone(),
                drafters: d.0.clone(),
                share_gpus: None,
            };
            (lists, false)
        }
        // clap requires both lists without --resume; this is for a caller that built `Args`.
        (None, _, _) => {
            let why = "--targets and --drafters are required (unless --resume RUN_DIR)";
            return Err(UsageError(why.into()).into());
        }
    };
    // The run's own lists, resumed as they are, were accepted with --share-gpus if their record
    // says so, or says nothing (an earlier build's, which checked them when the run started);
    // they are checked all the same, since the record can be edited by hand.
    let share_gpus = args.share_gpus || (recorded && lists.share_gpus != Some(false));
    cli::check_gpus(&lists.targets, &lists.drafters, share_gpus).map_err(|e| {
        let Some(dir) = &args.resume else {
            return e;
        };
        let gpus = RunDir::new(dir).gpus();
        let shared = !cli::overlap(&lists.targets, &lists.drafters).is_empty();
        // A resume takes a list not given from the run's record: an overlap with GPUs the user
        // never typed is said to come from there (and only an overlap: the other list is no way
        // out of too many workers).
        let (flag, list) = match (&args.targets, &args.drafters) {
            (Some(_), None) if shared => ("--drafters", &lists.drafters),
            (None, Some(_)) if shared => ("--targets", &lists.targets),
            (None, None) => {
                return cli::UsageError(format!(
                    "{}, the GPU lists the run last ran on (--targets {} --drafters {}; edited since?): {}",
                    gpus.display(),
                    cli::format_gpu_list(&lists.targets),
                    cli::format_gpu_list(&lists.drafters),
                    e.0
                ))
            }
            _ => return e,
        };
        cli::UsageError(format!(
            "{}; {flag} was not given, so it is the run's own, {} (from {}): give {flag} too",
            e.0,
            cli::format_gpu_list(list),
            gpus.display()
        ))
    })?;
    Ok(GpuLists {
        share_gpus: Some(share_gpus),
        ..lists
    })
}
