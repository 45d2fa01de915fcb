//! Compute backends behind two traits, so the workers do not know whether a GPU is real.
//!
//! - [`mock`]: CPU only, deterministic, with simulated speed (time is spent sleeping, so eight
//!   mock GPUs run side by side on two cores) and fault injection. The default where no GPU
//!   driver is present, and what every test runs on.
//! - `cuda` (later): cudarc, loaded dynamically; never panics where no driver exists.

use std::path::Path;

use proto::BatchView;
use serde::{Deserialize, Serialize};

pub mod mock;

/// What can go wrong in a backend, naming the file or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("hidden-state buffer holds {got} bytes, the batch needs {want}")]
    BufferSize { got: usize, want: usize },
    #[error("batch {batch_id}: hidden state at token {token}, layer {layer}, channel {channel} is {got:#06x}, expected {want:#06x}")]
    Content {
        batch_id: u64,
        token: usize,
        layer: u32,
        channel: u32,
        got: u16,
        want: u16,
    },
    #[error("batch has dtype {0:?}; the mock backend produces bf16")]
    Dtype(proto::Dtype),
    #[error("checkpoint {path}: {why}")]
    Checkpoint { path: String, why: String },
}

/// A frozen target model: token ids in, hidden states of the captured layers out.
pub trait TargetBackend {
    /// Runs the forward pass over the concatenated sequences and writes
    /// `tokens × layers × hidden` hidden states into `out`, in place.
    fn forward(
        &mut self,
        input_ids: &[u32],
        seq_lens: &[u32],
        out: &mut [u8],
    ) -> Result<(), GpuError>;
}

/// Counters a drafter reports after a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    pub step: u64,
    pub tokens: u64,
    /// A number that moves with training, for logs.
    pub loss: f32,
}

/// A drafter being trained: batches in, state that checkpoints and restores.
pub trait DrafterBackend {
    /// One training step on a batch read in place from the ring.
    fn train_step(&mut self, batch: &BatchView<'_>) -> Result<StepStats, GpuError>;
    /// Steps taken so far (restored from a checkpoint, then counting on).
    fn step(&self) -> u64;
    /// Writes the state to `path` (the caller makes it atomic: temp file, then rename).
    fn save(&self, path: &Path) -> Result<(), GpuError>;
    /// Restores the state written by `save`.
    fn load(&mut self, path: &Path) -> Result<(), GpuError>;
}

pub use proto::config::Faults;
