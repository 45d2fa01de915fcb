//! The choices made before a run from what this machine has: the backend (mock, candle on the
//! CPU, cuda) from the command line, the model and the driver; the drafter group's collective
//! (shm or NCCL) from the config, the backend and NCCL. Each says why, for the run's first lines.

use anyhow::bail;
use gpu::BackendKind;
use proto::config::CollectiveKind;

use crate::cli::{Backend, UsageError};

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
    Ok((driver_said((major, minor), n), n))
}

/// The driver found, in words: its CUDA version and its GPUs, one said in the singular (a
/// one-GPU machine read "with 1 GPUs" on the run's first line).
fn driver_said((major, minor): (u32, u32), n: u32) -> String {
    let gpus = crate::count(n, "GPU", "GPUs");
    format!("NVIDIA driver for CUDA {major}.{minor} with {gpus}")
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

/// What `[drafter] collective` is for this run: `auto` settled (NCCL for two or more of our
/// drafters on the cuda backend, when `nccl` finds the library), an explicit `nccl` checked.
/// `nccl` is the probe, run only when NCCL could be chosen.
pub(crate) fn choose_collective(
    asked: CollectiveKind,
    backend: BackendKind,
    drafters: u32,
    own_drafters: bool,
    nccl: impl FnOnce() -> Result<String, String>,
) -> anyhow::Result<CollectiveKind> {
    let on_gpus = backend == BackendKind::Cuda && own_drafters;
    Ok(match asked {
        CollectiveKind::Shm => CollectiveKind::Shm,
        CollectiveKind::Auto if !on_gpus || drafters < 2 => CollectiveKind::Shm,
        CollectiveKind::Auto => match nccl() {
            Ok(_) => CollectiveKind::Nccl,
            Err(why) => {
                println!("drafter group: summing on the host (shm): {why}");
                CollectiveKind::Shm
            }
        },
        CollectiveKind::Nccl if backend != BackendKind::Cuda => bail!(
            "[drafter] collective = \"nccl\" sums the gradients between GPUs: it needs --backend cuda (this run's is {backend}); use \"shm\" or \"auto\""
        ),
        CollectiveKind::Nccl if !own_drafters => bail!(
            "[drafter] collective = \"nccl\" is for hspipe's drafter workers; a [drafter] command exchanges its gradients itself (hspipe.dist)"
        ),
        CollectiveKind::Nccl => match nccl() {
            Ok(_) => CollectiveKind::Nccl,
            Err(why) => bail!("[drafter] collective = \"nccl\": {why}"),
        },
    })
}

/// Whether NCCL loads here (what `choose_collective` asks).
pub(crate) fn probe_nccl() -> Result<String, String> {
    match cuda::nccl::Nccl::load() {
        Ok(n) => Ok(format!("NCCL {:?}", n.version())),
        Err(e) => Err(format!("no NCCL ({e})")),
    }
}

/// The backend the workers build, and why, for the run's first line. `need`: the highest GPU
/// the lists name, + 1.
pub(crate) fn choose_backend(
    b: Backend,
    model: bool,
    need: u32,
) -> anyhow::Result<(BackendKind, String)> {
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
        // Flags that contradict each other: usage errors (exit 2).
        Backend::Kind(BackendKind::Mock) if model => Err(UsageError(
            "--backend mock makes up its hidden states and would ignore the model; use --backend candle (or auto) to run it".into(),
        )
        .into()),
        Backend::Kind(BackendKind::Mock) => mock("requested"),
        Backend::Kind(k @ (BackendKind::Candle | BackendKind::Cuda)) if !model => Err(UsageError(format!(
            "--backend {k} runs a real model: name its HF directory with --model DIR (`launcher make-model DIR` makes a tiny one)"
        ))
        .into()),
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
            // Without a model the driver changes nothing: the loader's details (every README
            // run's first line) only matter to a user who expected a GPU, who gives a model.
            (Err(why), false) => mock(&format!(
                "no model is given; {}",
                why.split(':').next().unwrap_or(&why)
            )),
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

#[cfg(test)]
mod backend_tests {
    use super::*;

    #[test]
    fn the_driver_is_said_with_its_gpus_counted() {
        assert_eq!(
            driver_said((13, 0), 1),
            "NVIDIA driver for CUDA 13.0 with 1 GPU"
        );
        assert_eq!(
            driver_said((12, 4), 8),
            "NVIDIA driver for CUDA 12.4 with 8 GPUs"
        );
    }

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
            assert_eq!(why, "mock (no model is given; no CUDA driver)");
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
        // Flags that contradict each other: usage errors (exit 2), as clap's are.
        for (k, model, says) in [
            (BackendKind::Candle, false, "make-model"),
            (BackendKind::Cuda, false, "make-model"),
            (BackendKind::Mock, true, "would ignore the model"),
        ] {
            let e = choose_backend_with(Backend::Kind(k), model, none).unwrap_err();
            assert!(e.is::<UsageError>(), "{k}: {e}");
            assert!(e.to_string().contains(says), "{e}");
        }
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
    /// `auto` takes NCCL only for two or more of our drafters on the cuda backend, and only if
    /// NCCL loads (saying why not, then shm); an explicit `nccl` elsewhere is a clear error; the
    /// probe is not run where NCCL cannot be chosen.
    #[test]
    fn the_group_is_on_nccl_only_for_cuda_drafters_with_nccl() {
        use BackendKind::{Candle, Cuda, Mock};
        use CollectiveKind::{Auto, Nccl, Shm};
        let found = || Ok("NCCL (2, 27, 3)".to_string());
        let none = || Err("no NCCL (libnccl.so.2 not found)".to_string());
        let unasked =
            || -> Result<String, String> { panic!("probed NCCL where it cannot be chosen") };
        let pick = |asked, backend, drafters, own, probe: &dyn Fn() -> Result<String, String>| {
            choose_collective(asked, backend, drafters, own, probe)
        };
        assert_eq!(pick(Auto, Cuda, 2, true, &found).unwrap(), Nccl);
        assert_eq!(pick(Auto, Cuda, 2, true, &none).unwrap(), Shm);
        for (backend, drafters, own) in [
            (Cuda, 1, true),
            (Candle, 3, true),
            (Mock, 3, true),
            (Cuda, 3, false),
        ] {
            assert_eq!(pick(Auto, backend, drafters, own, &unasked).unwrap(), Shm);
            assert_eq!(pick(Shm, backend, drafters, own, &unasked).unwrap(), Shm);
        }
        // Asked for: one cuda drafter may use it (the device check does).
        assert_eq!(pick(Nccl, Cuda, 1, true, &found).unwrap(), Nccl);
        let e = pick(Nccl, Cuda, 2, true, &none).unwrap_err().to_string();
        assert!(e.contains("libnccl.so.2"), "{e}");
        let e = pick(Nccl, Candle, 2, true, &unasked)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--backend cuda") && e.contains("candle"), "{e}");
        let e = pick(Nccl, Cuda, 2, false, &unasked)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hspipe.dist"), "{e}");
    }
}
