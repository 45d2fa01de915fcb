//! Compute backends behind two traits, so the workers do not know whether a GPU is real.
//!
//! - [`mock`]: CPU only, deterministic, with simulated speed (time is spent sleeping, so eight
//!   mock GPUs run side by side on two cores) and fault injection. What `--backend auto`
//!   picks, driver or not, until the cuda backend is built; what every test runs on.
//! - [`candle`]: a real HF target (`model::Decoder`) on candle, on the CPU, writing the
//!   captured layers and greedy tokens; the drafter is DFlash ([`dflash`]).
//! - `cuda`: the same models on the worker's GPU (candle's CUDA device, the target in bf16),
//!   in the build with `--features cuda`; other builds name it and refuse it before any work.
//!
//! The seam: [`target`], [`drafter`] and [`drafter_sizes`] build a backend from the config and
//! the launcher's choice ([`BackendKind`], sent by name in the handshake). The workers hold
//! trait objects and never name a backend; the next one is a variant and a [`Maker`] in
//! `backend.rs`, the one place a backend is chosen.

use std::path::Path;
use std::sync::Arc;

use proto::BatchView;

pub mod backend;
pub mod candle;
pub mod candle_cuda;
mod copy_thread;
pub mod cuda_copy;
pub mod device_time;
pub mod dflash;
pub mod in_place;
pub mod mock;
mod pinned;
pub mod prefetch;
mod raw_out;
mod state;
pub mod step;
pub mod timeline;
pub mod writeback;

pub use backend::{BackendKind, Maker, Settling, UnknownBackend};
pub use cuda::nccl_group::OnDevice;
pub use device_time::DeviceClock;
pub use pinned::{pin_arena, PinnedArena};
pub use raw_out::RawOut;
pub use step::StepBuffer;

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
    #[error("batch {batch_id}: greedy token at position {token} is {got}, expected {want}")]
    GreedyToken {
        batch_id: u64,
        token: usize,
        got: u32,
        want: u32,
    },
    #[error("batch has dtype {0:?}; the mock backend produces bf16")]
    Dtype(proto::Dtype),
    #[error("checkpoint {path}: {why}")]
    Checkpoint { path: String, why: String },
    #[error("shape: {0}")]
    Shape(String),
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
}

impl GpuError {
    /// Whether the device failed (a CUDA or candle error, also from the model's code: out of
    /// memory, a lost context), not the input: a rank goes on after refusing a bad batch, not
    /// after this.
    pub fn is_device_failure(&self) -> bool {
        matches!(
            self,
            GpuError::Cuda(_) | GpuError::Candle(_) | GpuError::Model(model::ModelError::Candle(_))
        )
    }
}

/// Where a target writes a batch's results: two sections of its ring slot.
pub struct TargetOut<'a> {
    /// `tokens × layers × hidden` elements of the batch's dtype.
    pub hidden_states: &'a mut [u8],
    /// Little-endian u32 per token: the greedy next token after each position.
    pub target_tokens: &'a mut [u8],
}

impl TargetOut<'_> {
    /// Checks both sections' sizes for `tokens` tokens of `layers × hidden` elements of
    /// `elem` bytes.
    pub fn check(
        &self,
        tokens: usize,
        layers: usize,
        hidden: usize,
        elem: usize,
    ) -> Result<(), GpuError> {
        let want = tokens * layers * hidden * elem;
        if self.hidden_states.len() != want {
            return Err(GpuError::BufferSize {
                got: self.hidden_states.len(),
                want,
            });
        }
        if self.target_tokens.len() != tokens * 4 {
            return Err(GpuError::BufferSize {
                got: self.target_tokens.len(),
                want: tokens * 4,
            });
        }
        Ok(())
    }
}

/// A frozen target model: token ids in, hidden states of the captured layers and the greedy
/// next tokens out.
///
/// Two ways to run a batch: [`TargetBackend::forward`], which returns with the results written;
/// and [`TargetBackend::submit`] then [`TargetBackend::complete`], which lets a GPU's forward of
/// the next batch run while this one's results are still being copied into its ring slot (the
/// worker keeps up to [`TargetBackend::depth`] batches submitted). A backend that computes on the
/// host keeps the defaults: `submit` is `forward`, depth 1.
pub trait TargetBackend {
    /// Runs the forward pass over the concatenated sequences (no attention across them) and
    /// writes `tokens × layers × hidden` hidden states and one greedy token per position into
    /// `out`, in place.
    fn forward(
        &mut self,
        input_ids: &[u32],
        seq_lens: &[u32],
        out: TargetOut<'_>,
    ) -> Result<(), GpuError>;

    /// How many batches may be submitted and not yet completed (at least 1).
    fn depth(&self) -> usize {
        1
    }

    /// The most batches it can keep submitted when asked for more than [`TargetBackend::depth`]
    /// (`[target] depth`): by default its depth.
    fn max_depth(&self) -> usize {
        self.depth()
    }

    /// Issues the forward of a batch whose results go into `out`, and their copy there; may
    /// return before they are written. They are once [`TargetBackend::complete`] has returned
    /// for this batch (batches complete in the order submitted). On an error nothing is in
    /// flight into `out`. (Whoever made `out` promised its memory stays valid and untouched
    /// until then: [`RawOut::new`].)
    fn submit(&mut self, input_ids: &[u32], seq_lens: &[u32], out: RawOut) -> Result<(), GpuError> {
        raw_out::forward_now(self, input_ids, seq_lens, out)
    }

    /// Waits until the oldest submitted batch's results are in its slot.
    fn complete(&mut self) -> Result<(), GpuError> {
        Ok(())
    }

    /// Waits for every copy in flight and forgets the batches submitted (their slots may be
    /// given back, unwritten or half written): before dropping them on an error or a stop.
    fn quiesce(&mut self) {}

    /// The device's own timeline of this backend's work (CUDA events), on a GPU: the worker
    /// moves its resolved spans into the ring as it goes. `None` (the default): the host's
    /// clock times the work (the ring's phases).
    fn device_clock(&self) -> Option<Arc<dyn DeviceClock>> {
        None
    }
}

/// Counters a drafter reports after a step (proto's: the leader sends them to the launcher).
pub use proto::control::StepStats;

/// A drafter being trained, one rank of a data-parallel group: it computes the gradient of
/// its loss on a batch, the group sums the gradients (the collective crate), and every rank
/// applies the same update, so the weights stay bitwise equal.
pub trait DrafterBackend {
    /// Length of the gradient (a [`StepBuffer`] for it is what the group sums each step).
    fn grad_len(&self) -> usize;
    /// Computes the gradient of the summed loss on `batch` into `out`'s gradient, and the loss
    /// sum and loss tokens into their parts (all overwritten), after verifying the batch's
    /// content. `out` is a buffer for `grad_len()` (for none, once the gradient stays on the
    /// device: [`DrafterBackend::gradient_on_device`]).
    fn gradient(&mut self, batch: &BatchView<'_>, out: &mut StepBuffer) -> Result<(), GpuError>;
    /// The part of a step's work on its batch that can run on another thread before the step:
    /// the copy of the batch to the drafter's device. The intake runs it on its copy thread,
    /// under the step before, and hands the result to [`DrafterBackend::gradient_staged`].
    /// `None` (the default): `gradient` does it all.
    fn stager(&self) -> Option<Stager> {
        None
    }
    /// [`DrafterBackend::gradient`] on a batch that [`DrafterBackend::stager`]'s function
    /// prepared as `staged`.
    fn gradient_staged(
        &mut self,
        batch: &BatchView<'_>,
        staged: Staged,
        out: &mut StepBuffer,
    ) -> Result<(), GpuError> {
        let _ = staged;
        self.gradient(batch, out)
    }
    /// From now on, keeps the gradient on the device for an exchange that reduces it there (the
    /// NCCL group): the step buffers' gradient words are then none (`StepBuffer::new(0)`), the
    /// step leaves the rank's gradient on the device, the exchange the group's sum, and `apply`
    /// takes that sum. Returns how the exchange reaches the gradient; `None` (the default):
    /// this backend's gradient stays in the step buffer, on the host.
    fn gradient_on_device(&mut self) -> Result<Option<Arc<dyn OnDevice>>, GpuError> {
        Ok(None)
    }
    /// Applies one optimizer update from the group's summed buffer (normalised here by the
    /// step's total loss tokens). Deterministic: the same input gives the same bits on every
    /// rank. Fails only with the device.
    fn apply(&mut self, summed: &StepBuffer) -> Result<StepStats, GpuError>;
    /// One step trained alone: `gradient`, then `apply` of this rank's own buffer (a backend
    /// whose gradient is on the host: after `gradient_on_device`, the sum is the exchange's).
    fn train_step(&mut self, batch: &BatchView<'_>) -> Result<StepStats, GpuError> {
        let mut b = StepBuffer::new(self.grad_len());
        self.gradient(batch, &mut b)?;
        self.apply(&b)
    }
    /// The group step of the last update applied (restored from a checkpoint, then counting
    /// on).
    fn step(&self) -> u64;
    /// Moves the step on to `step`, the group's, with no update: the group went on past updates
    /// that were lost (`proto::ledger::LostSteps`), and a step number is never used twice. The
    /// optimizer keeps its own count of the updates it made.
    fn skip_to(&mut self, step: u64);
    /// A digest of the weights: equal on every rank after every step.
    fn digest(&self) -> u64;
    /// Writes weights, optimizer state and step to `path` (the caller makes it atomic).
    fn save(&self, path: &Path) -> Result<(), GpuError>;
    /// Restores the state written by `save`.
    fn load(&mut self, path: &Path) -> Result<(), GpuError>;
    /// Length of `export_state`'s words.
    fn state_len(&self) -> usize;
    /// Weights, optimizer state and step as words, for a rank joining the group (copied from
    /// the device: fails only with it).
    fn export_state(&self) -> Result<Vec<u32>, GpuError>;
    /// Takes the state a live rank exported.
    fn import_state(&mut self, state: &[u32]) -> Result<(), GpuError>;
    /// Writes the drafter as an inference engine loads it into `dir` (the caller makes it
    /// atomic); nothing for a drafter no engine serves (the mock's).
    fn export(&self, _dir: &Path) -> Result<(), GpuError> {
        Ok(())
    }
    /// Whether [`DrafterBackend::export`] writes anything.
    fn exports(&self) -> bool {
        false
    }
    /// Whether the leader should evaluate after `step` (the config's `eval_every`).
    fn eval_due(&self, _step: u64) -> bool {
        false
    }
    /// Speculative decoding on held-out prompts: mean tokens per target forward; None for a
    /// drafter that drafts no blocks.
    fn evaluate(&mut self) -> Result<Option<f32>, GpuError> {
        Ok(None)
    }
    /// As [`TargetBackend::device_clock`].
    fn device_clock(&self) -> Option<Arc<dyn DeviceClock>> {
        None
    }
}

pub use proto::config::Faults;

/// What a drafter's [`Stager`] made of a batch, for its step (the DFlash drafter's: the
/// batch's context, on the drafter's device).
pub struct Staged(Box<dyn std::any::Any + Send>);

impl Staged {
    pub fn new<T: std::any::Any + Send>(value: T) -> Staged {
        Staged(Box::new(value))
    }

    /// The value, if it is a `T`.
    pub fn into_inner<T: std::any::Any>(self) -> Option<T> {
        self.0.downcast().ok().map(|b| *b)
    }
}

/// A drafter's preparation of a batch before its step ([`DrafterBackend::stager`]): called on
/// the intake's copy thread while the drafter steps on another batch, so it touches nothing the
/// step uses but its device.
pub type Stager = std::sync::Arc<dyn Fn(&BatchView<'_>) -> Result<Staged, GpuError> + Send + Sync>;

/// Buffers on the device for the double-buffered copies (`prefetch`'s copy-in, `writeback`'s
/// copy-out): one computing, one being copied. Here, beside the modules, so the CPU copy thread
/// and the engines all take it from one place without importing each other.
pub const BUFFERS: usize = 2;

/// A frozen target for worker `name` (its faults, for the mock) under `cfg`.
pub fn target(
    kind: BackendKind,
    cfg: &proto::PipelineConfig,
    name: proto::WorkerName,
) -> Result<Box<dyn TargetBackend + Send>, GpuError> {
    kind.maker().target(cfg, name)
}

/// A drafter rank for worker `name` under `cfg`, at step 0 (load a checkpoint or join the
/// group to go on); `None` for a drafter that is no worker and takes no worker's faults (the
/// launcher reading a checkpoint).
pub fn drafter(
    kind: BackendKind,
    cfg: &proto::PipelineConfig,
    name: Option<proto::WorkerName>,
) -> Result<Box<dyn DrafterBackend + Send>, GpuError> {
    kind.maker().drafter(cfg, name)
}

/// Completes a new run's `cfg` with what backend `kind`'s model fixes (see [`Maker::settle`]).
pub fn settle(kind: BackendKind, cfg: &mut proto::PipelineConfig) -> Result<(), GpuError> {
    kind.maker().settle(cfg, Settling::New)
}

/// [`settle`] for a resumed run's own config ([`Settling::Resume`]).
pub fn settle_resumed(kind: BackendKind, cfg: &mut proto::PipelineConfig) -> Result<(), GpuError> {
    kind.maker().settle(cfg, Settling::Resume)
}

/// [`settle`] for a model's shape alone, whose weights are made on the device
/// ([`Settling::Shape`]: a benchmark's `--random`).
pub fn settle_shape(kind: BackendKind, cfg: &mut proto::PipelineConfig) -> Result<(), GpuError> {
    kind.maker().settle(cfg, Settling::Shape)
}

/// `(grad_len, state_len)` of the drafter [`drafter`] builds, without building one (the
/// launcher sizes the group segment with it).
pub fn drafter_sizes(
    kind: BackendKind,
    cfg: &proto::PipelineConfig,
) -> Result<(usize, usize), GpuError> {
    kind.maker().drafter_sizes(cfg)
}

/// Whether the drafter of backend `kind` writes an export (see [`Maker::drafter_exports`]).
pub fn drafter_exports(kind: BackendKind) -> bool {
    kind.maker().drafter_exports()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device's failure ends a drafter rank (its batches go back to the ring); a bad batch's
    /// is refused and the rank goes on: the intake tells them apart by this.
    #[test]
    fn device_failures_are_told_from_bad_input() {
        let oom = candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY".into());
        assert!(GpuError::Candle(oom).is_device_failure());
        let in_model = candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY".into());
        assert!(GpuError::Model(model::ModelError::Candle(in_model)).is_device_failure());
        assert!(!GpuError::Shape("3 layers, want 2".into()).is_device_failure());
        assert!(!GpuError::BufferSize { got: 1, want: 2 }.is_device_failure());
    }
}
