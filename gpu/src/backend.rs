//! The one place a compute backend is chosen. [`BackendKind`] names every backend: its spelling
//! (on the command line, in messages and in the launcher's Welcome) is derived from the variant,
//! and [`BackendKind::maker`] is the one match that maps it to what builds it. Adding a backend is
//! one variant and one arm here, plus its [`Maker`].

use crate::{candle, mock, DrafterBackend, GpuError, TargetBackend};
use proto::{PipelineConfig, WorkerName};

/// The compute backend a run uses, chosen by the launcher and sent to every worker by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// CPU only: simulated speed and content, a real learner.
    Mock,
    /// A real target (an HF model directory, --model) on candle, on the CPU, and a DFlash
    /// drafter trained on its states.
    Candle,
    /// The candle backend's models on the worker's GPU (candle's CUDA device; the target in
    /// bf16): the build with `--features cuda` (scripts/build-cuda.sh).
    Cuda,
}

/// Whose config [`Maker::settle`] settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settling {
    /// A new run's: what it chooses is held to every check of this build.
    New,
    /// A resumed run's own `config.toml`: what the launch that started the run chose there (by
    /// an earlier build, maybe, with fewer checks) is what its checkpoint was trained on, so it
    /// is kept where this build can still run it. Checks of a choice's worth (a captured layer
    /// named twice) are a new run's; what running it needs (each layer in the model) is
    /// checked all the same.
    Resume,
    /// A model's shape alone, its `config.json` without weights, which are made on the device
    /// instead (the benchmarks' `--random` on `scripts/shapes/`): there are no files to check
    /// the weights in; the rest is checked as for [`Settling::New`].
    Shape,
}

/// What builds one backend's models.
pub trait Maker {
    /// False for a backend this build lacks (`cuda` without `--features cuda`): asking for it
    /// is an error before a worker takes any work.
    fn built(&self) -> bool;
    /// Completes `cfg` with what the backend's model fixes (a real model's hidden size and
    /// captured layers), before the ring is sized, and checks it (as `settling` asks). The
    /// launcher calls it once; workers get the result in their config.
    fn settle(&self, _cfg: &mut PipelineConfig, _settling: Settling) -> Result<(), GpuError> {
        Ok(())
    }
    /// A frozen target for worker `name` (its faults, for the mock) under `cfg`.
    fn target(
        &self,
        cfg: &PipelineConfig,
        name: WorkerName,
    ) -> Result<Box<dyn TargetBackend + Send>, GpuError>;
    /// A drafter rank for worker `name` under `cfg` (see [`crate::drafter`]).
    fn drafter(
        &self,
        cfg: &PipelineConfig,
        name: Option<WorkerName>,
    ) -> Result<Box<dyn DrafterBackend + Send>, GpuError>;
    /// `(grad_len, state_len)` of the drafter [`Maker::drafter`] builds, without building one.
    fn drafter_sizes(&self, cfg: &PipelineConfig) -> Result<(usize, usize), GpuError>;
    /// Whether the drafter [`Maker::drafter`] builds writes an export
    /// ([`DrafterBackend::exports`]), without building one: the launcher refuses
    /// `[drafter] keep_export_every` to a run that would keep nothing.
    fn drafter_exports(&self) -> bool {
        false
    }
}

impl BackendKind {
    /// Every backend.
    pub fn all() -> &'static [BackendKind] {
        <BackendKind as clap::ValueEnum>::value_variants()
    }

    /// What builds this backend's models.
    pub fn maker(self) -> Box<dyn Maker> {
        match self {
            BackendKind::Mock => Box::new(mock::Mock),
            BackendKind::Candle => Box::new(candle::Candle::CPU),
            BackendKind::Cuda => Box::new(candle::Candle::GPU),
        }
    }
}

/// The backend's name (`mock`), as the command line and the Welcome spell it: clap's derived
/// name, so there is no second spelling to keep in step.
impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use clap::ValueEnum;
        match self.to_possible_value() {
            Some(v) => f.write_str(v.get_name()),
            // The derive gives every variant a name (none is skipped).
            None => write!(f, "{self:?}"),
        }
    }
}

/// A name that is no backend's, naming what was asked for and what exists.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown backend {name:?}: expected one of {known:?}")]
pub struct UnknownBackend {
    pub name: String,
    pub known: Vec<String>,
}

impl std::str::FromStr for BackendKind {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        <BackendKind as clap::ValueEnum>::from_str(s, false).map_err(|_| UnknownBackend {
            name: s.to_string(),
            known: BackendKind::all().iter().map(|k| k.to_string()).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_reads_back_from_its_name_and_an_unknown_one_is_named() {
        for &k in BackendKind::all() {
            assert_eq!(k.to_string().parse::<BackendKind>(), Ok(k));
        }
        assert_eq!(BackendKind::Mock.to_string(), "mock");
        let e = "rocm".parse::<BackendKind>().unwrap_err().to_string();
        assert!(e.contains("\"rocm\"") && e.contains("cuda"), "{e}");
        assert!(BackendKind::Mock.maker().built() && BackendKind::Candle.maker().built());
        // The cuda backend is built exactly in the build with candle's CUDA device.
        assert_eq!(BackendKind::Cuda.maker().built(), cfg!(feature = "cuda"));
    }
}
