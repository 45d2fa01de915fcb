//! The launcher: creates the ring, starts one worker process per GPU, restarts a crashed worker
//! alone while the others keep running, stops in order on SIGINT/SIGTERM/SIGHUP/SIGQUIT, shows a
//! live monitor (copied to `<run-dir>/launcher.log`) and writes the run directory's
//! `summary.json`. At start it reclaims the rings of dead launchers of the same user.
//!
//! `cli` is the command line; `run` settles everything that can be checked before the run
//! directory exists (`settle`), then hands over to the `supervisor`.

pub mod cli;
pub mod data;
pub mod eval;
pub mod model;
pub mod monitor;
mod output;
mod reclaim;
pub mod report;
mod resume;
mod signals;
mod spawn;
mod summary;
mod supervisor;
mod tensorboard;

use std::path::PathBuf;

use anyhow::{bail, Context};
use dataset::Dataset;
use gpu::BackendKind;
use proto::plan::{plan, Epochs};
use proto::{GpuLists, PipelineConfig, RunDir};

pub use crate::cli::{exit, Args, Backend, Cli, Command, UsageError};
pub use crate::spawn::name_process;

/// What this machine has for the cuda backend, in words ("NVIDIA driver for CUDA 13.0 with
/// 8 GPUs"), or why it has none. Loads the driver through the `cuda` crate (its presence
/// check comes before cudarc's first call, which would panic where no driver exists; the
/// launcher creates no context).
fn probe_driver() -> Result<(String, u32), String> {
    let d = cuda::Driver::load().map_err(|e| match e {
        // The reason names what the loader was asked for and where a driver is looked for.
        cuda::CudaError::NoDriver { why } => format!("no NVIDIA driver: {why}"),
        e => e.to_string(),
    })?;
    let (major, minor) = d.version();
    let n = d.device_count().map_err(|e| e.to_string())?;
    Ok((
        format!("NVIDIA driver for CUDA {major}.{minor} with {n} GPUs"),
        n,
    ))
}

/// A probe's finding, refused when the machine has fewer GPUs than the lists name (`need`: the
/// highest listed GPU + 1): workers on GPUs that do not exist would each fail.
fn enough_gpus(found: Result<(String, u32), String>, need: u32) -> Result<String, String> {
    let (words, n) = found?;
    if n < need {
        return Err(format!(
            "found an {words}, but the GPU lists name GPU {}",
            need - 1
        ));
    }
    Ok(words)
}

/// The backend the workers build, and why, for the run's first line. `need`: the highest GPU
/// the lists name, + 1.
fn choose_backend(b: Backend, model: bool, need: u32) -> anyhow::Result<(BackendKind, String)> {
    choose_backend_with(b, model, || enough_gpus(probe_driver(), need))
}

/// `probe` runs only for `auto` and `cuda`: with `--backend mock` the launcher never loads or
/// initialises a driver.
fn choose_backend_with(
    b: Backend,
    model: bool,
    probe: impl FnOnce() -> Result<String, String>,
) -> anyhow::Result<(BackendKind, String)> {
    choose_backend_in(b, model, probe, BackendKind::Cuda.maker().built())
}

/// `choose_backend_with` for a build with (`cuda_built`) or without candle's CUDA device.
fn choose_backend_in(
    b: Backend,
    model: bool,
    probe: impl FnOnce() -> Result<String, String>,
    cuda_built: bool,
) -> anyhow::Result<(BackendKind, String)> {
    let mock = |why: &str| Ok((BackendKind::Mock, format!("mock ({why})")));
    let candle = |why: &str| Ok((BackendKind::Candle, format!("candle on the CPU ({why})")));
    let unbuilt = "this launcher is built without CUDA (scripts/build-cuda.sh builds one)";
    match b {
        Backend::Kind(BackendKind::Mock) if model => bail!(
            "--backend mock makes up its hidden states and would ignore the model; use --backend candle (or auto) to run it"
        ),
        Backend::Kind(BackendKind::Mock) => mock("requested"),
        Backend::Kind(k @ (BackendKind::Candle | BackendKind::Cuda)) if !model => bail!(
            "--backend {k} runs a real model: name its HF directory with --model DIR (`launcher make-model DIR` makes a tiny one)"
        ),
        Backend::Kind(BackendKind::Candle) => candle("requested"),
        Backend::Auto => match (probe(), model) {
            (Ok(found), true) if cuda_built => Ok((
                BackendKind::Cuda,
                format!("cuda (a model is given; found an {found})"),
            )),
            (Ok(found), true) => candle(&format!("a model is given; found an {found}, but {unbuilt}")),
            (Ok(found), false) => mock(&format!(
                "found an {found}; no model is given (--model DIR runs one on the GPUs)"
            )),
            (Err(why), true) => candle(&format!("a model is given; {why}")),
            (Err(why), false) => mock(&why),
        },
        // The GPU backend: the driver must be there, and the build must have CUDA.
        Backend::Kind(k @ BackendKind::Cuda) => match probe() {
            Err(why) => bail!("--backend {k}: {why}; use --backend candle to run the model on the CPU"),
            Ok(found) if !cuda_built => bail!(
                "--backend {k}: found an {found}, but {unbuilt}; or use --backend candle"
            ),
            Ok(found) => Ok((k, format!("{k} ({found})"))),
        },
    }
}

/// What `run` settles before the run directory, and so its log, exists.
pub(crate) struct Settled {
    pub(crate) cfg: PipelineConfig,
    /// The backend the workers build, and why (for the run's first line and the summary).
    pub(crate) backend: (BackendKind, String),
    pub(crate) data: Dataset,
    /// The line saying how the data was prepared.
    pub(crate) data_line: Option<String>,
    pub(crate) batches: u64,
    /// Which epoch each planned batch is in.
    pub(crate) epochs: Epochs,
    pub(crate) params: shm_ring::RingParams,
    pub(crate) run_id: String,
    pub(crate) run_dir: RunDir,
    /// The GPUs the workers use: the command line's, or on a resume the run's own for a list
    /// not given.
    pub(crate) gpus: GpuLists,
    pub(crate) resume: Option<resume::Resume>,
}

/// Runs the launcher; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let settled = settle(&args)?;
    // From here on everything printed is also in launcher.log, and a terminal that goes away
    // cannot make a write fail (see `output`).
    let tee = output::Tee::install(&settled.run_dir.launcher_log())?;
    let result = supervisor::Supervisor::start(&args, settled, &tee).and_then(|s| s.run());
    if let Err(e) = &result {
        // main prints it to the terminal once the tee is gone; this is the log's copy.
        tee.log().line(&format!("error: {e:#}"));
    }
    result
}

/// Checks the command line and config, loads the data and lays out the run directory.
fn settle(args: &Args) -> anyhow::Result<Settled> {
    args.check()?;
    let mut cfg = match (&args.resume, &args.config) {
        (Some(dir), _) => {
            let p = RunDir::new(dir).config();
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
    spawn::check_commands(&cfg)?;
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
    let need = gpus
        .targets
        .iter()
        .chain(&gpus.drafters)
        .max()
        .map_or(0, |g| g + 1);
    let backend = choose_backend(args.backend, cfg.model.path.is_some(), need)?;
    // The model fixes the hidden size and captured layers the ring is sized for.
    gpu::settle(backend.0, &mut cfg).context("loading the model's config")?;
    cfg.validate().context("checking the config")?;

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

    // The data, prepared once (or found prepared) and mapped: only the lengths are read here.
    let mut prepared = None;
    let mut data_line = None;
    if let Some(input) = cfg.data.path.clone() {
        let cache = args
            .data_cache
            .clone()
            .unwrap_or_else(|| dataset::default_cache_dir(run_dir.path()));
        let options = data::options(&cfg, cfg.data.max_len)?;
        let (p, line) = data::prepare_dataset(&input, &options, &cache, None)?;
        if args.resume.is_some() {
            data::check_same(&run_dir, &p)
                .with_context(|| format!("resuming {}", run_dir.path().display()))?;
        }
        cfg.data.prepared = Some(p.path.clone());
        data_line = Some(line);
        prepared = Some((input, p));
    }
    let data = target_worker::load_dataset(&cfg).context("loading the dataset")?;
    if let (Some(m), Some((input, _))) = (&cfg.model.path, &prepared) {
        model::check_ids_fit(&data, m, input)?;
    }
    let planned = plan(data.lengths(), &cfg);
    let (batches, epochs) = (planned.len() as u64, Epochs::of(&planned));
    let (nt, nd) = (gpus.targets.len() as u32, gpus.drafters.len() as u32);
    // The drafter's learning-rate schedule spans the run: one group step per batch per rank.
    cfg.drafter
        .total_steps
        .get_or_insert(batches.div_ceil(u64::from(nd.max(1))));
    let params = cfg
        .ring_params(nt, nd, batches)
        .context("sizing the ring")?;

    let resume = match &args.resume {
        Some(dir) => {
            run_dir
                .check_plan_version()
                .with_context(|| format!("resuming {}", dir.display()))?;
            Some(
                resume::check(&run_dir, &cfg, backend.0, nd, batches)
                    .with_context(|| format!("resuming {}", dir.display()))?,
            )
        }
        None => {
            run_dir.lay_out()?;
            run_dir.write_plan_version()?;
            let p = run_dir.config();
            std::fs::write(&p, cfg.to_toml())
                .with_context(|| format!("writing {}", p.display()))?;
            None
        }
    };
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
        batches,
        epochs,
        params,
        run_id,
        run_dir,
        gpus,
        resume,
    })
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
            };
            (lists, false)
        }
        // clap requires both lists without --resume; this is for a caller that built `Args`.
        (None, _, _) => {
            let why = "--targets and --drafters are required (unless --resume RUN_DIR)";
            return Err(UsageError(why.into()).into());
        }
    };
    // The run's own lists were accepted when it started, --share-gpus and all.
    if !recorded {
        cli::check_gpus(&lists.targets, &lists.drafters, args.share_gpus)?;
    }
    Ok(lists)
}

#[cfg(test)]
mod backend_tests {
    use super::*;

    /// `auto` says what it found; with a model it takes the GPU exactly when there is a driver
    /// and the build has CUDA, else candle on the CPU, saying why; `cuda` is a clear error
    /// without either; the words name the library that was missing.
    #[test]
    fn auto_says_what_it_found_and_cuda_is_a_clear_error() {
        let none = || Err("no CUDA driver: cannot load /x/libcuda.so.1 (not found)".to_string());
        let gpu = || Ok("NVIDIA driver for CUDA 13.0 with 8 GPUs".to_string());
        for built in [false, true] {
            let (k, why) = choose_backend_in(Backend::Auto, false, none, built).unwrap();
            assert_eq!(k, BackendKind::Mock);
            assert!(why.contains("/x/libcuda.so.1"), "{why}");
            let (k, why) = choose_backend_in(Backend::Auto, false, gpu, built).unwrap();
            assert_eq!(k, BackendKind::Mock);
            assert!(
                why.contains("CUDA 13.0 with 8 GPUs") && why.contains("--model"),
                "{why}"
            );
            let (k, why) = choose_backend_in(Backend::Auto, true, none, built).unwrap();
            assert_eq!(k, BackendKind::Candle);
            assert!(why.contains("/x/libcuda.so.1"), "{why}");
            let e = choose_backend_in(Backend::Kind(BackendKind::Cuda), true, none, built)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("/x/libcuda.so.1") && e.contains("--backend candle"),
                "{e}"
            );
            let e = choose_backend_in(Backend::Kind(BackendKind::Cuda), false, gpu, built)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--model DIR"), "{e}");
        }
        let (k, why) = choose_backend_in(Backend::Auto, true, gpu, false).unwrap();
        assert_eq!(k, BackendKind::Candle);
        assert!(
            why.contains("8 GPUs") && why.contains("build-cuda.sh"),
            "{why}"
        );
        let (k, why) = choose_backend_in(Backend::Auto, true, gpu, true).unwrap();
        assert_eq!(
            (k, why.contains("8 GPUs")),
            (BackendKind::Cuda, true),
            "{why}"
        );
        let e = choose_backend_in(Backend::Kind(BackendKind::Cuda), true, gpu, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("built without CUDA") && e.contains("build-cuda.sh"),
            "{e}"
        );
        let (k, _) = choose_backend_in(Backend::Kind(BackendKind::Cuda), true, gpu, true).unwrap();
        assert_eq!(k, BackendKind::Cuda);
        assert_eq!(
            choose_backend_with(Backend::Kind(BackendKind::Mock), false, gpu)
                .unwrap()
                .1,
            "mock (requested)"
        );
    }

    /// A machine with fewer GPUs than the lists name is no machine for the cuda backend: auto
    /// keeps to the CPU saying why, and `--backend cuda` refuses (the probe's words either way).
    #[test]
    fn too_few_gpus_for_the_lists_is_said_and_auto_stays_on_the_cpu() {
        let two = || Ok(("NVIDIA driver for CUDA 13.0 with 2 GPUs".to_string(), 2));
        assert_eq!(enough_gpus(two(), 2).unwrap(), two().unwrap().0);
        let e = enough_gpus(two(), 6).unwrap_err();
        assert!(e.contains("with 2 GPUs") && e.contains("name GPU 5"), "{e}");
        let short = || enough_gpus(two(), 6);
        let (k, why) = choose_backend_in(Backend::Auto, true, short, true).unwrap();
        assert_eq!(k, BackendKind::Candle);
        assert!(why.contains("name GPU 5"), "{why}");
        let e = choose_backend_in(Backend::Kind(BackendKind::Cuda), true, short, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("name GPU 5"), "{e}");
    }

    /// A model makes auto take candle; candle without a model, or the mock with one, is a
    /// clear error before anything starts.
    #[test]
    fn a_model_chooses_candle_and_a_mismatch_is_a_clear_error() {
        let none = || Err("no NVIDIA driver: cannot load libcuda.so.1".to_string());
        let (k, why) = choose_backend_with(Backend::Auto, true, none).unwrap();
        assert_eq!(k, BackendKind::Candle);
        assert!(
            why.contains("a model is given") && why.contains("libcuda"),
            "{why}"
        );
        let (k, _) = choose_backend_with(Backend::Kind(BackendKind::Candle), true, none).unwrap();
        assert_eq!(k, BackendKind::Candle);
        let e = choose_backend_with(Backend::Kind(BackendKind::Candle), false, none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--model DIR") && e.contains("make-model"), "{e}");
        let e = choose_backend_with(Backend::Kind(BackendKind::Mock), true, none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("would ignore the model"), "{e}");
    }

    /// On this machine (or any): probing never panics, and its words say what it found, checked
    /// against the `cuda` crate's own load: without a driver, the library the loader could not
    /// find and where it looks; with one, the driver's CUDA version and its GPU count.
    #[test]
    fn probing_the_driver_names_the_missing_library_or_the_drivers_version() {
        match (probe_driver(), cuda::Driver::load()) {
            (Ok((found, n)), Ok(d)) => {
                let (major, minor) = d.version();
                let want = format!("NVIDIA driver for CUDA {major}.{minor} with {n} GPUs");
                assert_eq!(found, want);
            }
            (Err(why), Err(cuda::CudaError::NoDriver { .. })) => assert!(
                why.starts_with("no NVIDIA driver: ")
                    && why.contains("libcuda")
                    && why.contains("LD_LIBRARY_PATH"),
                "{why}"
            ),
            // A driver that is there but refused (too old, not a driver): the refusal's words.
            (Err(why), Err(e)) => assert_eq!(why, e.to_string()),
            (Ok((found, _)), Err(e)) => {
                panic!("the probe found {found:?} where no driver loads: {e}")
            }
            // The driver loads but cannot count its devices: the error says which call failed.
            (Err(why), Ok(_)) => assert!(why.contains("cuDeviceGetCount"), "{why}"),
        }
    }
}
