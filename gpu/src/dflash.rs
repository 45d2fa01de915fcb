//! The candle backend's drafter: a DFlash drafter (`model::dflash`) trained as one rank of the
//! group. A batch's captured layers are its context, its greedy tokens (or data tokens) its
//! labels; the gradient of the batch's summed weighted loss, the weight sum and the blocks'
//! acceptance go into the step buffer; the update divides by the whole group's weight sum and
//! applies AdamW where the weights are (`model::train::DeviceAdamW`: on a GPU nothing the size
//! of the model is computed on the host), the same bits on every rank.
//!
//! Length: past 500 lines with its tests: the rank's step (context staged or made, shape checks,
//! the parts), its update, state and checkpoint, export and evaluation are one drafter.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Device, Tensor};
use model::dflash::{
    mask_token_id, AttentionBackward, Dflash, DflashConfig, DraftBatch, Frozen, Label, Pass,
    Sampling,
};
use model::train::{AdamWConfig, DeviceAdamW};
use model::ArchConfig;
use proto::config::DflashLabel;
use proto::{BatchView, Dtype, PipelineConfig, WorkerName};
use shm_ring::Phase;

use crate::candle::Placement;
use crate::candle_cuda::{CandleGradient, SharedGradient};
use crate::device_time::{self, CudaTimeline, StreamId, Timeline, Work};
use crate::mock::{self, Sim};
use crate::{state, DrafterBackend, GpuError, Staged, Stager, StepBuffer, StepStats};

/// Attention scores of one part of a batch's blocks (see `DraftBatch::split`) on the CPU: 16M
/// f32 elements, 64 MiB per layer and copy.
const SCORES_PER_PART_CPU: usize = 1 << 24;
/// On a GPU: 64M elements, 256 MiB per layer and copy. Measured on an H200 at the device check's
/// shape (a 5-layer Qwen3-8B-shaped drafter, 512 blocks of 16 in 4096 tokens: 17 parts), the
/// device's memory in use peaked at 34.7 GiB in a part's forward and fell back to 23-24.3 GiB
/// after each part's backward (`bench-dflash-step --trace-memory`, now `--trace`; the driver's count then, when freed
/// memory went back to it at each synchronize). Larger parts mean fewer
/// passes over the weights but have not been measured since a part's graph stopped outliving
/// its backward (`model::train::grad_of`): before that, 2^26, 2^27 and 2^28 all ran out of
/// memory. Since then the attention's backward is written by hand (`model::draft_attention`),
/// its graph holding the probabilities alone: on the CPU a part's peak fell by half; on a GPU,
/// not yet measured. And a part is now bounded by the context its blocks see (up to their last
/// anchor), so at that shape the batch is 10 parts, the first about 130 blocks where it was 31:
/// the attention's share of a part's memory is smaller, the rest (the layers' activations)
/// grows with its blocks. Also unmeasured on a GPU; the device check runs parts of 2^28 once.
const SCORES_PER_PART_GPU: usize = 1 << 26;

/// The attention scores a part of a batch may hold on `device` (see `DraftBatch::split`):
/// `HSPIPE_DFLASH_SCORES_PER_PART` when set (a positive count; a GPU with less memory, or a
/// measurement of the part size; read once per process, and for the CPU too), else the device
/// kind's default.
pub fn scores_per_part(device: &Device) -> usize {
    static SET: OnceLock<Option<usize>> = OnceLock::new();
    let set =
        SET.get_or_init(|| env_count(SCORES_PER_PART_ENV, std::env::var(SCORES_PER_PART_ENV).ok()));
    match (set, device.is_cpu()) {
        (Some(n), _) => *n,
        (None, true) => SCORES_PER_PART_CPU,
        (None, false) => SCORES_PER_PART_GPU,
    }
}

/// Sets [`scores_per_part`].
pub const SCORES_PER_PART_ENV: &str = "HSPIPE_DFLASH_SCORES_PER_PART";
/// Sets [`logits_per_chunk`].
pub const LOGITS_PER_CHUNK_ENV: &str = "HSPIPE_DFLASH_LOGITS_PER_CHUNK";

/// The LM-head logits the DFlash loss computes at once (`Dflash::set_logits_per_chunk`):
/// `HSPIPE_DFLASH_LOGITS_PER_CHUNK` when set (a positive count, read once per process; a GPU
/// with less memory: the loss's peak is a few times it in f32), else `None`, the model's
/// default for its device (2^27 on a GPU, 512 MiB).
pub fn logits_per_chunk() -> Option<usize> {
    static SET: OnceLock<Option<usize>> = OnceLock::new();
    *SET.get_or_init(|| {
        env_count(
            LOGITS_PER_CHUNK_ENV,
            std::env::var(LOGITS_PER_CHUNK_ENV).ok(),
        )
    })
}

/// Sets how the DFlash attention's core is differentiated ([`attention_backward`]).
pub const ATTENTION_BACKWARD_ENV: &str = "HSPIPE_DFLASH_ATTENTION";

/// [`ATTENTION_BACKWARD_ENV`]'s value read: unset or `by-hand` is the hand-written backward,
/// `autograd` candle's autograd of the same ops (to compare the two, or to step around the
/// hand-written one's custom op on a device where it fails); anything else is an error naming
/// it.
pub fn attention_backward(choice: Option<&str>) -> Result<AttentionBackward, GpuError> {
    match choice {
        None | Some("by-hand") => Ok(AttentionBackward::ByHand),
        Some("autograd") => Ok(AttentionBackward::Autograd),
        Some(other) => Err(GpuError::Config(format!(
            "{ATTENTION_BACKWARD_ENV} is {other:?}: it takes by-hand (the default) or autograd"
        ))),
    }
}

/// Gives `model` the settings the environment asks for: the LM head's chunk
/// ([`logits_per_chunk`]) and how its attention is differentiated ([`attention_backward`],
/// returned). A drafter worker and `bench-dflash-step` both start their drafters so.
pub fn settings_from_env(model: &mut Dflash) -> Result<AttentionBackward, GpuError> {
    if let Some(n) = logits_per_chunk() {
        model.set_logits_per_chunk(n);
    }
    let how = attention_backward(std::env::var(ATTENTION_BACKWARD_ENV).ok().as_deref())?;
    if how != AttentionBackward::ByHand {
        tracing::info!(
            "DFlash attention differentiated by candle's autograd ({ATTENTION_BACKWARD_ENV})"
        );
    }
    model.set_attention_backward(how);
    Ok(how)
}

/// Environment variable `name`'s `value` as a positive count, logged when used; anything else
/// is ignored with a warning on stderr and in the log.
fn env_count(name: &str, value: Option<String>) -> Option<usize> {
    let v = value?;
    match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => {
            tracing::info!(count = n, "DFlash setting from {name}");
            Some(n)
        }
        _ => {
            let why = format!("{name} is not a positive count; ignored");
            tracing::warn!(value = %v, "{why}");
            eprintln!("warning: {why} ({v:?})");
            None
        }
    }
}

/// Steps assumed for the schedule when the launcher set none (a drafter built outside a run).
const DEFAULT_TOTAL_STEPS: u64 = 1000;

/// Tokens of each held-out prompt the leader's evaluation decodes from.
const EVAL_PROMPT_LEN: usize = 32;

/// Every how many steps the leader evaluates; 0: never. File data skips it: the built-in
/// language's prompts would say nothing about it.
pub(crate) fn eval_every(cfg: &PipelineConfig) -> u64 {
    if cfg.data.synthetic_language == Some(true) && cfg.data.path.is_none() {
        cfg.dflash.eval_every
    } else {
        0
    }
}

/// That the leader's evaluation stays within the target's positions (the rule `launcher eval`
/// holds to): else it would decode past them, wrong without a word.
pub(crate) fn check_eval_reach(
    cfg: &PipelineConfig,
    target: &model::ArchConfig,
) -> Result<(), GpuError> {
    if eval_every(cfg) == 0 {
        return Ok(());
    }
    let f = &cfg.dflash;
    model::spec::check_reach(
        EVAL_PROMPT_LEN,
        f.eval_new_tokens as usize,
        f.block_size as usize,
        target,
    )
    .map_err(|why| {
        GpuError::Config(format!(
            "dflash.eval_new_tokens = {} (evaluated every {} steps): {why}",
            f.eval_new_tokens, f.eval_every
        ))
    })
}

/// The drafter's shape for the run `cfg` describes (its target's config, captured layers and
/// the `[dflash]` section).
pub fn drafter_config(cfg: &PipelineConfig) -> Result<DflashConfig, GpuError> {
    let dir = crate::candle::model_dir(cfg)?;
    let arch = ArchConfig::load(dir)?;
    let ids = crate::candle::layer_ids(cfg, &arch)?;
    let f = &cfg.dflash;
    let mask = mask_token_id(dir, arch.vocab_size, f.mask_token_id)?;
    Ok(DflashConfig::for_target(
        &arch,
        ids,
        f.layers.map(|l| l as usize),
        f.block_size as usize,
        mask,
    ))
}

/// How the parts of a batch (see [`scores_per_part`]) share their sequences' context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// The worker's: the parts run together, each sequence's context projected once
    /// (`Dflash::loss_and_grads_parts`).
    Together,
    /// Each part run alone, projecting the context of its own sequences again: the step
    /// benchmark's comparison (`--per-part`).
    Alone,
}

/// The loss sums of `batch` with its gradient added into `grad`, the blocks in parts (see
/// [`scores_per_part`]), so a batch of long sequences and many anchors never holds more than
/// one part's attention graph at once: the worker's gradient (`Schedule::Together`), and the
/// step benchmark's. The parts' gradients are summed on the device and copied to the host once.
pub fn loss_and_grads_in_parts(
    model: &Dflash,
    ctx: &Tensor,
    batch: &DraftBatch,
    grad: &mut [f32],
    schedule: Schedule,
) -> Result<model::dflash::LossSums, GpuError> {
    let (sums, acc) = parts_timed(model, ctx, batch, None, schedule)?;
    acc.add_to(&model.params, grad)?;
    Ok(sums)
}

/// [`loss_and_grads_in_parts`] with the gradient left on the model's device as one flat f32
/// tensor (`Grads::flat`): what a GPU rank on NCCL computes (the exchange reduces it there).
pub fn loss_and_flat_grads_in_parts(
    model: &Dflash,
    ctx: &Tensor,
    batch: &DraftBatch,
    schedule: Schedule,
) -> Result<(model::dflash::LossSums, Tensor), GpuError> {
    let (sums, acc) = parts_timed(model, ctx, batch, None, schedule)?;
    Ok((sums, acc.flat(&model.params)?))
}

/// A GPU drafter's digest of its weights (the ledger's, once a step): XXH3-64 of their row sums
/// in f64, made on the device (`Params::row_sums`), so about 8 bytes a row come to the host
/// instead of 4 a weight (1.6 MB for 4.19 GB on a 5-layer Qwen3-8B-shaped drafter). Ranks of
/// one group run the same kernels on the same bits (candle's CUDA `sum` is a block reduction
/// per row in a fixed order, `fast_sum`, no atomics), so equal weights give equal digests; a
/// rank whose weights drifted by one ulp almost anywhere gives another.
pub fn row_digest(params: &model::train::Params) -> Result<u64, GpuError> {
    let sums = params.row_sums()?;
    Ok(twox_hash::XxHash3_64::oneshot(
        zerocopy::IntoBytes::as_bytes(sums.as_slice()),
    ))
}

/// `f`, which queues `work` on candle's stream, timed there on a GPU.
fn on_compute<T>(
    gpu: Option<&OnGpu>,
    work: Work,
    f: impl FnOnce() -> Result<T, GpuError>,
) -> Result<T, GpuError> {
    match gpu {
        Some(g) => g.timed(COMPUTE, work, f),
        None => f(),
    }
}

/// The loss sums of `batch` and its gradient summed on the device over the parts (see
/// [`loss_and_grads_in_parts`]), on a GPU each part's forward and its loss and backward timed
/// on candle's stream.
fn parts_timed(
    model: &Dflash,
    ctx: &Tensor,
    batch: &DraftBatch,
    gpu: Option<&OnGpu>,
    schedule: Schedule,
) -> Result<(model::dflash::LossSums, model::train::Grads), GpuError> {
    let mut acc = model.params.grads();
    let parts = batch.split(&model.cfg, scores_per_part(model.device()));
    let mut run = |parts: &[DraftBatch]| {
        model.loss_and_grads_parts(ctx, parts, &mut acc, |pass, f| {
            let work = match pass {
                Pass::Forward => device_time::FORWARD,
                Pass::Loss => LOSS,
                Pass::Backward => device_time::BACKWARD,
            };
            on_compute(gpu, work, || Ok(f()?))
        })
    };
    let sums = match schedule {
        Schedule::Together => run(&parts)?,
        Schedule::Alone => {
            let mut sums = model::dflash::LossSums::default();
            for p in &parts {
                sums += run(std::slice::from_ref(p))?;
            }
            sums
        }
    };
    Ok((sums, acc))
}

/// The checkpoint's metadata key holding the drafter's `config.json` (as exported, f32).
const SHAPE_KEY: &str = "dflash_config";

/// How the drafter whose `config.json` is `saved` (a checkpoint's at `path`) differs from
/// `cfg` in what its weights mean ([`DflashConfig::layout_differences`]), if it does.
fn other_shape(cfg: &DflashConfig, saved: &str, path: &Path) -> Option<String> {
    match DflashConfig::from_json(saved, path) {
        Err(e) => Some(format!("its recorded shape does not read: {e}")),
        Ok(theirs) => {
            let differ = cfg.layout_differences(&theirs);
            (!differ.is_empty()).then(|| differ.join(", "))
        }
    }
}

/// `(grad_len, state_len)` of [`DflashDrafter`] for `cfg`.
pub fn sizes(cfg: &PipelineConfig) -> Result<(usize, usize), GpuError> {
    let n = drafter_config(cfg)?.param_len();
    Ok((n, 3 * n + 4))
}

/// A DFlash drafter rank.
pub struct DflashDrafter {
    /// The weights are the model's own f32 parameters, on its device.
    model: Dflash,
    opt: DeviceAdamW,
    /// The weights' digest, made after each change of them (the ledger line of every batch
    /// carries it).
    digest: u64,
    sampling: Sampling,
    /// Group steps applied (a step whose group had no weighted position moves no weight).
    step: u64,
    /// Updates left out since this rank started: the group's gradient was NaN or infinite.
    skipped: u64,
    /// The faults injected into this worker (crash or hang after N batches); no simulated time.
    sim: Sim,
    /// What the leader's evaluations need: the target (loaded at the first), the prompts.
    eval: Evaluation,
    /// On a GPU: the stager's copy stream, and the device's timeline.
    gpu: Option<OnGpu>,
    /// Where the gradient waits between the step and the update when it stays on the device
    /// (see [`DrafterBackend::gradient_on_device`]); None: in the step buffer.
    on_device: Option<SharedGradient>,
    /// A staged context that candle's stream may still read (see `gradient_with`), dropped
    /// once the update's digest has waited for that stream.
    in_use: Option<Tensor>,
}

/// A GPU drafter's streams (candle's, and the copy stream the stager's copies run on beside
/// it) and the device's timeline of its work on both: each step's forward and backward, each
/// update, the weights' copy out for their digest, each batch's copy in.
#[derive(Clone)]
struct OnGpu {
    streams: [Arc<cuda::CudaStream>; 2],
    timeline: CudaTimeline,
    on: [StreamId; 2],
}

const COMPUTE: usize = 0;
const COPY: usize = 1;

impl OnGpu {
    fn new(device: &Device) -> Result<OnGpu, GpuError> {
        let streams = [
            crate::candle_cuda::stream(device)?,
            crate::candle_cuda::copy_stream(device)?,
        ];
        let mut t = Timeline::new();
        let on = [t.add_cuda(&streams[COMPUTE])?, t.add_cuda(&streams[COPY])?];
        Ok(OnGpu {
            streams,
            timeline: Arc::new(Mutex::new(t)),
            on,
        })
    }

    /// Re-measures candle's stream's clock if due (every 30 s): call it where the host has just
    /// waited for that stream, so the wait is free. Telemetry: an error is logged.
    fn reanchor_compute(&self) {
        let (on, stream) = (self.on[COMPUTE], &self.streams[COMPUTE]);
        if let Err(e) = device_time::reanchor_due(&self.timeline, on, stream) {
            tracing::warn!(error = %e, "re-anchoring the device's timeline");
        }
    }

    /// `f`, which queues `work` on stream `s` (COMPUTE or COPY), timed there.
    fn timed<T>(
        &self,
        s: usize,
        work: Work,
        f: impl FnOnce() -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        device_time::timed(&self.timeline, self.on[s], &self.streams[s], work, f)
    }
}

/// A part's loss: the frozen LM head over its weighted positions, in chunks, and the loss's
/// gradient at the last states (the backward through the drafter is `BACKWARD`).
const LOSS: Work = Work {
    name: "loss",
    phase: Phase::Compute,
    busy: true,
};
/// The step's gradient copied to the host for the group's reduction, on candle's stream.
const GRADIENT_OUT: Work = Work {
    name: "gradient device-to-host",
    phase: Phase::CopyIn,
    busy: false,
};
/// The step's gradient gathered into one flat buffer on the device for the group's exchange
/// there, on candle's stream.
const GRADIENT_FLAT: Work = Work {
    name: "gradient gathered on the device",
    phase: Phase::Compute,
    busy: true,
};
/// An update: the summed gradient uploaded (unless the exchange left it on the device), then
/// AdamW, on candle's stream.
const OPTIMIZER: Work = Work {
    name: "optimizer",
    phase: Phase::Compute,
    busy: true,
};
/// The leader's speculative decoding of held-out prompts (target and drafter), on candle's
/// stream; one span, so the host's waits between its decoding steps count as busy.
const EVALUATION: Work = Work {
    name: "evaluation",
    phase: Phase::Compute,
    busy: true,
};
/// The weights' digest: their row sums made on candle's stream and copied to the host.
const DIGEST: Work = Work {
    name: "weights' digest (row sums)",
    phase: Phase::Compute,
    busy: true,
};

/// The leader's periodic speculative decoding on held-out prompts.
struct Evaluation {
    every: u64,
    model: std::path::PathBuf,
    /// Where the drafter is, and the target's dtype there (a GPU's target runs in bf16).
    place: Placement,
    target: Option<model::Decoder>,
    prompts: Vec<Vec<u32>>,
    new_tokens: usize,
}

impl DflashDrafter {
    /// Worker `name`'s drafter under `cfg` (no faults for `None`), at step 0.
    pub fn new(
        cfg: &PipelineConfig,
        name: Option<WorkerName>,
        place: &Placement,
    ) -> Result<DflashDrafter, GpuError> {
        let faults = name.map(|n| cfg.faults_for(n)).unwrap_or_default();
        mock::start(&faults);
        let dc = drafter_config(cfg)?;
        let frozen = Frozen::load(crate::candle::model_dir(cfg)?, &place.device)?;
        let f = &cfg.dflash;
        let mut model = Dflash::new(dc, frozen, f.seed)?;
        settings_from_env(&mut model)?;
        let gpu = match &place.device {
            Device::Cpu => None,
            d => Some(OnGpu::new(d)?),
        };
        let total = cfg
            .drafter
            .total_steps
            .unwrap_or(DEFAULT_TOTAL_STEPS)
            .max(1);
        let opt = DeviceAdamW::new(
            AdamWConfig {
                lr: f.lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: f.weight_decay,
                warmup_steps: (f.warmup_ratio * total as f64).ceil() as u64,
                total_steps: total,
                min_lr_ratio: 0.1,
                clip: f.clip,
            },
            &model.params,
        )?;
        let mut d = DflashDrafter {
            model,
            opt,
            digest: 0,
            sampling: Sampling {
                num_anchors: f.num_anchors as usize,
                gamma: f.gamma,
                label: match f.label {
                    DflashLabel::Target => Label::Target,
                    DflashLabel::Data => Label::Data,
                },
                seed: f.seed,
            },
            step: 0,
            skipped: 0,
            sim: Sim::new(f64::INFINITY, faults),
            eval: Evaluation {
                // File data: the built-in language's prompts would say nothing about it.
                every: eval_every(cfg),
                model: crate::candle::model_dir(cfg)?.to_path_buf(),
                place: place.clone(),
                target: None,
                prompts: dataset::language::held_out(
                    cfg.data.synthetic_vocab.unwrap_or(0).max(6),
                    f.eval_prompts as usize,
                    EVAL_PROMPT_LEN as u32,
                ),
                new_tokens: f.eval_new_tokens as usize,
            },
            gpu,
            on_device: None,
            in_use: None,
        };
        d.digest = d.weights_digest()?;
        Ok(d)
    }

    /// From now on the gradient stays on the drafter's device between the step and the update
    /// (on the CPU, host tensors: how a test plays the exchange); returns where it waits.
    pub(crate) fn keep_gradient_on_device(&mut self) -> SharedGradient {
        self.on_device.get_or_insert_with(Default::default).clone()
    }

    /// The words of a step buffer's gradient: none when it stays on the device.
    fn host_grad_len(&self) -> usize {
        match self.on_device {
            Some(_) => 0,
            None => self.grad_len(),
        }
    }

    pub fn model(&self) -> &Dflash {
        &self.model
    }

    /// Takes weights, moments and counters read from a checkpoint or a live rank.
    fn set_state(&mut self, tables: Vec<Vec<f32>>, counters: &[u64]) -> Result<(), GpuError> {
        let [w, m, v]: [Vec<f32>; 3] = tables.try_into().expect("three tables");
        self.model.params.set_flat(&w)?;
        self.opt.set_moments(&self.model.params, &m, &v)?;
        (self.step, self.opt.step) = (counters[0], counters[1]);
        self.digest = self.weights_digest()?;
        Ok(())
    }

    /// The digest of the weights as they are now: on the CPU of their bytes, on a GPU of their
    /// row sums made there ([`row_digest`]).
    fn weights_digest(&self) -> Result<u64, GpuError> {
        let params = &self.model.params;
        match &self.gpu {
            Some(g) => g.timed(COMPUTE, DIGEST, || row_digest(params)),
            None => Ok(mock::digest(&params.flat()?)),
        }
    }

    /// Weights, moments, then the counters (step, optimizer step): the state a checkpoint and a
    /// joining rank take (on a GPU, copied to the host).
    fn state(&self) -> Result<([Vec<f32>; 3], [u64; 2]), GpuError> {
        let (m, v) = self.opt.moments()?;
        Ok((
            [self.model.params.flat()?, m, v],
            [self.step, self.opt.step],
        ))
    }
}

/// Little-endian `dtype` elements (a batch's hidden states) as f32.
pub fn values_f32(dtype: Dtype, b: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

/// A batch's `[tokens x layers x hidden]` states as f32 `[tokens, layers * hidden]` on the CPU.
fn context(batch: &BatchView<'_>) -> Result<Tensor, GpuError> {
    let vals = values_f32(batch.header().spec.dtype, batch.hidden_states());
    Ok(Tensor::from_vec(vals, context_shape(batch), &Device::Cpu)?)
}

/// `[tokens, layers * hidden]`: the shape of a batch's context.
fn context_shape(batch: &BatchView<'_>) -> (usize, usize) {
    let spec = &batch.header().spec;
    let t = spec.tokens() as usize;
    (t, spec.layers as usize * spec.hidden as usize)
}

/// A batch's context on `device`: made f32 on the CPU, or on a GPU copied as it is (the slot's
/// dtype) on the copy stream, converted to f32 by the step on candle's stream. The stager's
/// work.
fn stage(batch: &BatchView<'_>, device: &Device, gpu: Option<&OnGpu>) -> Result<Tensor, GpuError> {
    match (device, gpu) {
        (Device::Cpu, _) | (_, None) => Ok(context(batch)?.to_device(device)?),
        (d, Some(g)) => {
            let dtype = crate::candle::candle_dtype(batch.header().spec.dtype);
            let shape = context_shape(batch).into();
            g.timed(COPY, device_time::HOST_TO_DEVICE, || {
                crate::candle_cuda::upload(&g.streams[COPY], batch.hidden_states(), dtype, shape, d)
            })
        }
    }
}

impl DflashDrafter {
    /// The step on `batch` with its context `ctx` (any float dtype, `[tokens, layers *
    /// hidden]`, on the drafter's device).
    fn gradient_with(
        &mut self,
        batch: &BatchView<'_>,
        ctx: Option<Tensor>,
        out: &mut StepBuffer,
    ) -> Result<(), GpuError> {
        let started = std::time::Instant::now();
        let spec = &batch.header().spec;
        let c = &self.model.cfg;
        if spec.hidden as usize != c.hidden || spec.layers as usize != c.target_layer_ids.len() {
            return Err(GpuError::Shape(format!(
                "batch has {} layers x hidden {}, this drafter conditions on {} layers x hidden {}",
                spec.layers,
                spec.hidden,
                c.target_layer_ids.len(),
                c.hidden
            )));
        }
        if out.gradient().len() != self.host_grad_len() {
            return Err(GpuError::BufferSize {
                got: out.gradient().len(),
                want: self.host_grad_len(),
            });
        }
        let ids: Vec<u32> = batch.input_ids().collect();
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= c.vocab) {
            return Err(GpuError::Shape(format!(
                "batch {}: token id {bad} is outside the target's vocabulary of {}",
                spec.batch_id, c.vocab
            )));
        }
        let greedy: Vec<u32> = batch.target_tokens().collect();
        // The greedy tokens are the labels: one outside the vocabulary would fail the loss's
        // lookup as a candle error, which reads as the device failing (the rank would die for
        // the batch's content).
        if let Some(&bad) = greedy.iter().find(|&&i| i as usize >= c.vocab) {
            return Err(GpuError::Shape(format!(
                "batch {}: greedy token {bad} is outside the target's vocabulary of {}",
                spec.batch_id, c.vocab
            )));
        }
        let db = DraftBatch::new(
            c,
            &self.sampling,
            spec.batch_id,
            &ids,
            batch.loss_mask(),
            &greedy,
            &spec.seq_lens,
        );
        // The context as it came (staged: on the copy stream's memory, in the slot's dtype) is
        // kept until candle's stream has passed the cast that reads it (the gradient on the
        // host below, or the update's digest): the cast does not record that use, and dropped
        // earlier it would be freed on the copy stream, which is not ordered with candle's,
        // while the cast may still be queued.
        let raw = match ctx {
            Some(ctx) => {
                if ctx.dims() != [context_shape(batch).0, context_shape(batch).1] {
                    return Err(GpuError::Shape(format!(
                        "batch {}: a staged context of shape {:?}, the batch's is {:?}",
                        spec.batch_id,
                        ctx.dims(),
                        context_shape(batch)
                    )));
                }
                ctx
            }
            None => stage(batch, self.model.device(), self.gpu.as_ref())?,
        };
        out.gradient_mut().fill(0.0);
        let cast = || Ok(raw.to_dtype(DType::F32)?);
        let ctx = match &self.gpu {
            Some(g) => g.timed(COMPUTE, device_time::FORWARD, cast)?,
            None => cast()?,
        };
        let (sums, acc) = parts_timed(
            &self.model,
            &ctx,
            &db,
            self.gpu.as_ref(),
            Schedule::Together,
        )?;
        let (params, gpu) = (&self.model.params, self.gpu.as_ref());
        match &self.on_device {
            None => on_compute(gpu, GRADIENT_OUT, || {
                Ok(acc.add_to(params, out.gradient_mut())?)
            })?,
            Some(shared) => {
                let flat = on_compute(gpu, GRADIENT_FLAT, || Ok(acc.flat(params)?))?;
                let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                (g.mine, g.sum) = (Some(flat), None);
            }
        }
        if let (Some(g), None) = (&self.gpu, &self.on_device) {
            // The gradient's copy to the host waited for candle's stream: its clock is
            // re-measured here for free (every 30 s).
            g.reanchor_compute();
        }
        out.set_loss(sums.loss as f32);
        out.set_loss_tokens(sums.weight as f32);
        out.set_blocks(sums.accepted as f32, sums.blocks as f32);
        match self.on_device {
            // The gradient is on the host: candle's stream has passed every use of `raw`.
            None => drop(raw),
            Some(_) => self.in_use = Some(raw),
        }
        self.sim.finish_item(&spec.seq_lens, started);
        Ok(())
    }
}

impl DrafterBackend for DflashDrafter {
    fn grad_len(&self) -> usize {
        self.model.params.len()
    }

    fn gradient(&mut self, batch: &BatchView<'_>, out: &mut StepBuffer) -> Result<(), GpuError> {
        self.gradient_with(batch, None, out)
    }

    /// The batch's context made on the copy thread: on a GPU copied there on the drafter's copy
    /// stream, on the CPU converted to f32 there, under the step before.
    fn stager(&self) -> Option<Stager> {
        let (device, gpu) = (self.model.device().clone(), self.gpu.clone());
        Some(Arc::new(move |batch: &BatchView<'_>| {
            Ok(Staged::new(stage(batch, &device, gpu.as_ref())?))
        }))
    }

    /// On a GPU: each step's forward and backward and the weights' upload on candle's stream,
    /// each batch's copy in on the copy stream.
    fn device_clock(&self) -> Option<Arc<dyn crate::DeviceClock>> {
        let t = self.gpu.as_ref()?.timeline.clone();
        Some(t)
    }

    fn gradient_staged(
        &mut self,
        batch: &BatchView<'_>,
        staged: Staged,
        out: &mut StepBuffer,
    ) -> Result<(), GpuError> {
        let ctx = staged
            .into_inner::<Tensor>()
            .ok_or_else(|| GpuError::Shape("the staged batch is not a context tensor".into()))?;
        self.gradient_with(batch, Some(ctx), out)
    }

    /// The gradient stays on the GPU for the NCCL exchange; on the CPU there is no NCCL.
    fn gradient_on_device(&mut self) -> Result<Option<Arc<dyn crate::OnDevice>>, GpuError> {
        if self.gpu.is_none() {
            return Ok(None);
        }
        let shared = self.keep_gradient_on_device();
        let len = self.grad_len();
        let bridge = CandleGradient::new(shared, self.model.device(), len)?;
        Ok(Some(Arc::new(bridge)))
    }

    fn apply(&mut self, summed: &StepBuffer) -> Result<StepStats, GpuError> {
        self.step += 1;
        let weight = summed.loss_tokens();
        // On the device: the exchange's sum, and the rank's own gradient spent (a step without
        // a batch contributes zeros).
        let on_device = match &self.on_device {
            Some(shared) => {
                let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                g.mine = None;
                Some(g.sum.take())
            }
            None => None,
        };
        let (mut lr, mut skipped) = (None, false);
        if weight > 0.0 {
            let params = &self.model.params;
            let opt = &mut self.opt;
            let scale = 1.0 / weight;
            let mut update = || match &on_device {
                None => Ok(opt.update(params, summed.gradient(), scale)?),
                Some(Some(sum)) => Ok(opt.update_flat(params, sum, scale)?),
                Some(None) => Err(GpuError::Shape(
                    "the group's exchange left no sum of the gradient on the device".into(),
                )),
            };
            let u = on_compute(self.gpu.as_ref(), OPTIMIZER, &mut update)?;
            lr = Some(u.lr as f32);
            skipped = u.skipped;
            if u.skipped {
                self.skipped += 1;
                // Said at the first and every 100th: a drafter that diverged skips every step.
                if self.skipped == 1 || self.skipped.is_multiple_of(100) {
                    tracing::warn!(
                        step = self.step,
                        grad_norm = u.grad_norm,
                        skipped = self.skipped,
                        "the group's gradient is NaN or infinite: the update is skipped, the weights left as they were (if every step is, the drafter diverged: lower dflash.lr)"
                    );
                }
            }
            self.digest = self.weights_digest()?;
        }
        // The digest (or the exchange's completion, with no update) has waited for candle's
        // stream: its clock is re-measured here for free (every 30 s) when the gradient stays on
        // the device (else at the gradient's copy to the host).
        self.in_use = None;
        if let (Some(g), Some(_)) = (&self.gpu, &self.on_device) {
            g.reanchor_compute();
        }
        let blocks = summed.blocks();
        Ok(StepStats {
            step: self.step,
            tokens: blocks as u64,
            loss: if weight > 0.0 {
                summed.loss() / weight
            } else {
                0.0
            },
            tau: (blocks > 0.0).then(|| 1.0 + summed.accepted() / blocks),
            lr,
            eval_tau: None,
            skipped,
            tokens_unknown: false,
        })
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn skip_to(&mut self, step: u64) {
        self.step = self.step.max(step);
    }

    fn digest(&self) -> u64 {
        self.digest
    }

    fn save(&self, path: &Path) -> Result<(), GpuError> {
        let ([w, m, v], counters) = self.state()?;
        let n = vec![w.len()];
        state::save(
            path,
            &state::State {
                tables: vec![
                    ("weights", n.clone(), &w),
                    ("adam.m", n.clone(), &m),
                    ("adam.v", n, &v),
                ],
                counters: counters.to_vec(),
                metadata: vec![(SHAPE_KEY, self.model.cfg.to_json("float32").to_string())],
            },
        )
    }

    fn load(&mut self, path: &Path) -> Result<(), GpuError> {
        let (t, c, meta) = state::load_with_metadata(
            path,
            &["weights", "adam.m", "adam.v"],
            &[self.grad_len()],
            2,
            "another DFlash shape, or another backend's checkpoint?",
        )?;
        // Drafters of one size may differ in shape (other captured layers, another target of
        // the same width): the total alone let such a checkpoint load, its weights read in
        // another arrangement without a word. A checkpoint from before the shape was recorded
        // is taken on its size.
        if let Some(saved) = meta.get(SHAPE_KEY) {
            if let Some(why) = other_shape(&self.model.cfg, saved, path) {
                return Err(GpuError::Checkpoint {
                    path: path.display().to_string(),
                    why: format!("it holds another drafter: {why}"),
                });
            }
        }
        self.set_state(t, &c)
    }

    fn state_len(&self) -> usize {
        3 * self.grad_len() + 4
    }

    fn export_state(&self) -> Result<Vec<u32>, GpuError> {
        let ([w, m, v], counters) = self.state()?;
        Ok(state::words(&[&w, &m, &v], &counters))
    }

    fn import_state(&mut self, words: &[u32]) -> Result<(), GpuError> {
        let (t, c) = state::from_words(words, self.grad_len(), 3, 2)?;
        self.set_state(t, &c)
    }

    fn export(&self, dir: &Path) -> Result<(), GpuError> {
        Ok(self.model.export(dir)?)
    }

    fn exports(&self) -> bool {
        true
    }

    fn eval_due(&self, step: u64) -> bool {
        self.eval.every > 0 && step.is_multiple_of(self.eval.every)
    }

    fn evaluate(&mut self) -> Result<Option<f32>, GpuError> {
        let e = &mut self.eval;
        if e.every == 0 || e.prompts.is_empty() {
            return Ok(None);
        }
        if e.target.is_none() {
            e.target = Some(model::Decoder::load(
                &e.model,
                &e.place.device,
                e.place.target_dtype,
            )?);
        }
        let target = e.target.as_ref().expect("loaded above");
        let decode = || {
            let (mut tokens, mut forwards) = (0usize, 0usize);
            for p in &e.prompts {
                let g = model::spec::speculative(target, &self.model, p, e.new_tokens)?;
                tokens += g.accept_lengths.iter().sum::<usize>();
                forwards += g.accept_lengths.len();
            }
            Ok(tokens as f32 / forwards.max(1) as f32)
        };
        // Timed as one span of compute: left out, the leader's device would look idle for the
        // whole evaluation, and the verdict would blame the host's phase meanwhile.
        let tau = match &self.gpu {
            Some(g) => g.timed(COMPUTE, EVALUATION, decode)?,
            None => decode()?,
        };
        Ok(Some(tau))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candle::CandleTarget;
    use crate::TargetOut;
    use proto::{BatchSpec, BatchWriter};

    /// A run's block and an export's are held to one bound: a block the run may train, an
    /// export of it loads (the two crates each name it; neither depends on the other).
    #[test]
    fn the_runs_and_the_exports_block_bound_are_one() {
        assert_eq!(
            proto::config::MAX_BLOCK_SIZE as usize,
            model::dflash::MAX_BLOCK_SIZE
        );
    }

    /// The DFlash size settings take a positive count, spaces around it allowed; zero, a
    /// negative or a word is ignored (the default stays), as is an unset variable.
    #[test]
    fn a_size_setting_is_a_positive_count_or_ignored() {
        let count = |v: Option<&str>| env_count(LOGITS_PER_CHUNK_ENV, v.map(String::from));
        assert_eq!(count(Some("4096")), Some(4096));
        assert_eq!(count(Some(" 12\n")), Some(12));
        for bad in ["0", "-3", "1e6", "lots", ""] {
            assert_eq!(count(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(count(None), None);
    }

    /// The attention's backward is by hand unless `autograd` is asked for; any other value is
    /// an error naming it and the two it takes.
    #[test]
    fn the_attention_backward_is_by_hand_or_candles_autograd() {
        assert_eq!(attention_backward(None).unwrap(), AttentionBackward::ByHand);
        assert_eq!(
            attention_backward(Some("by-hand")).unwrap(),
            AttentionBackward::ByHand
        );
        assert_eq!(
            attention_backward(Some("autograd")).unwrap(),
            AttentionBackward::Autograd
        );
        let e = attention_backward(Some("Autograd"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"Autograd\"") && e.contains("by-hand") && e.contains("autograd"),
            "{e}"
        );
    }

    /// A tiny target, a config for it, and one batch of its real states.
    fn setup(dir: &Path) -> (PipelineConfig, Vec<u8>) {
        setup_edited(dir, |_| {})
    }

    /// [`setup`], with the batch's greedy tokens (little-endian u32s) edited by `edit` after the
    /// target wrote them.
    fn setup_edited(dir: &Path, edit: impl FnOnce(&mut [u8])) -> (PipelineConfig, Vec<u8>) {
        let (m, mut cfg) = crate::candle::tiny_target(dir);
        cfg.dflash.block_size = 4;
        cfg.dflash.num_anchors = 4;
        cfg.dflash.layers = Some(1);
        crate::candle::Candle::CPU
            .settle(&mut cfg, crate::Settling::New)
            .unwrap();
        let target = CandleTarget::load(&m, &cfg).unwrap();
        let seq_lens = vec![12, 9];
        let ids: Vec<u32> = (0..21).map(|i| (i * 31 + 7) % 290 + 5).collect();
        let spec = BatchSpec {
            batch_id: 5,
            producer: 0,
            sample_ids: vec![0, 1],
            seq_lens: seq_lens.clone(),
            dtype: Dtype::Bf16,
            layers: 2,
            hidden: 64,
        };
        let mut buf = vec![0u8; proto::batch::batch_len(&spec).unwrap() as usize];
        let mut w = BatchWriter::new(&mut buf, &spec).unwrap();
        let s = w.sections_mut();
        for (c, id) in s.input_ids.chunks_exact_mut(4).zip(&ids) {
            c.copy_from_slice(&id.to_le_bytes());
        }
        s.loss_mask.fill(1);
        let out = TargetOut {
            hidden_states: s.hidden_states,
            target_tokens: s.target_tokens,
        };
        target.run(&ids, &seq_lens, out, true).unwrap();
        edit(w.sections_mut().target_tokens);
        let len = w.finish().0;
        buf.truncate(len);
        (cfg, buf)
    }

    use crate::Maker;

    /// A greedy token outside the vocabulary (a foreign or buggy producer's) is the batch's
    /// fault: refused by name as bad content, not a candle error that reads as the device
    /// failing (which would kill the rank and count against the batch).
    #[test]
    fn a_greedy_token_outside_the_vocabulary_is_bad_content_not_a_device_failure() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, buf) = setup_edited(dir.path(), |t| {
            t[4..8].copy_from_slice(&1_000_000u32.to_le_bytes())
        });
        let view = BatchView::parse(&buf).unwrap();
        let mut d = DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        let e = (d.gradient(&view, &mut StepBuffer::new(d.grad_len()))).unwrap_err();
        assert!(!e.is_device_failure(), "{e}");
        assert!(e.to_string().contains("greedy token 1000000"), "{e}");
    }

    /// A group gradient with a NaN in it (one rank's overflow, summed into every rank's) is
    /// not applied: the weights and their digest stay as they were, the step counts and says
    /// it was skipped; the next finite gradient is applied.
    #[test]
    fn a_gradient_that_is_not_finite_is_skipped_and_the_weights_stay() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, buf) = setup(dir.path());
        let view = BatchView::parse(&buf).unwrap();
        let mut d = DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        let mut sum = StepBuffer::new(d.grad_len());
        d.gradient(&view, &mut sum).unwrap();
        let finite = sum.gradient().to_vec();
        assert!(sum.loss_tokens() > 0.0);
        let before = d.digest();
        sum.gradient_mut()[3] = f32::NAN;
        let s = d.apply(&sum).unwrap();
        assert!(s.skipped && s.step == 1, "{s:?}");
        assert_eq!(d.digest(), before, "the weights changed");
        sum.gradient_mut().copy_from_slice(&finite);
        let s = d.apply(&sum).unwrap();
        assert!(!s.skipped && s.step == 2, "{s:?}");
        assert_ne!(d.digest(), before, "a finite gradient is applied");
    }

    /// The leader's evaluation runs its target where the drafter is, in the target's dtype
    /// there (bf16 on a GPU); the states it gives the drafter are f32 whatever the target
    /// computes in (a bf16 target's states into the drafter's f32 weights was a dtype error,
    /// logged and so never reported on a GPU).
    #[test]
    fn the_evaluation_decodes_with_a_bf16_target() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cfg, _) = setup(dir.path());
        cfg.dflash.eval_every = 1;
        cfg.dflash.eval_prompts = 2;
        cfg.dflash.eval_new_tokens = 6;
        let place = Placement {
            device: Device::Cpu,
            target_dtype: candle_core::DType::BF16,
        };
        let mut d = DflashDrafter::new(&cfg, None, &place).unwrap();
        let tau = d.evaluate().unwrap().expect("an evaluation");
        assert!((1.0..=cfg.dflash.block_size as f32).contains(&tau), "{tau}");
    }

    /// A batch staged on another thread (the intake's copy thread, here a scoped one) gives
    /// the step the same gradient, bit for bit, as the step making its context itself; a staged
    /// context of another batch's shape is refused by name, not trained on.
    #[test]
    fn a_staged_batch_trains_as_the_batch_itself() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, buf) = setup(dir.path());
        let view = BatchView::parse(&buf).unwrap();
        let mut d = DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        let stager = d.stager().expect("the DFlash drafter stages its batches");
        let staged = std::thread::scope(|s| s.spawn(|| stager(&view)).join().unwrap()).unwrap();
        let n = d.grad_len();
        let (mut plain, mut from_staged) = (StepBuffer::new(n), StepBuffer::new(n));
        d.gradient(&view, &mut plain).unwrap();
        d.gradient_staged(&view, staged, &mut from_staged).unwrap();
        assert!(plain.loss_tokens() > 0.0);
        assert_eq!(plain.words(), from_staged.words());
        let wrong = Staged::new(Tensor::zeros((3, 128), DType::F32, &Device::Cpu).unwrap());
        let e = d
            .gradient_staged(&view, wrong, &mut from_staged)
            .unwrap_err();
        assert!(
            e.to_string().contains("staged context of shape [3, 128]"),
            "{e}"
        );
    }

    /// A gradient kept on the device (what the NCCL exchange reduces there, played here by the
    /// test on CPU tensors) trains as the host's: the rank's gradient is the host copy's
    /// values, and ranks updated from the device sum have the weights, bit for bit, of ranks
    /// updated from the host sum, also in a step where one rank had no batch (its gradient spent
    /// by the update before, so it adds nothing). A host-sized buffer, or an update with no sum
    /// left by the exchange, is an error naming it.
    #[test]
    fn a_gradient_kept_on_the_device_trains_as_the_hosts_does() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, buf) = setup(dir.path());
        let view = BatchView::parse(&buf).unwrap();
        let rank = || DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        let (mut a, mut b, mut c, mut d) = (rank(), rank(), rank(), rank());
        let (gc, gd) = (c.keep_gradient_on_device(), d.keep_gradient_on_device());
        let n = a.grad_len();
        let e = c.gradient(&view, &mut StepBuffer::new(n)).unwrap_err();
        assert!(matches!(e, GpuError::BufferSize { want: 0, .. }), "{e}");
        let mine = |g: &SharedGradient| g.lock().unwrap().mine.clone();
        for step in 0..3 {
            // In step 1 the second rank of each pair has no batch.
            let second = step != 1;
            let (mut ga, mut gb) = (StepBuffer::new(n), StepBuffer::new(n));
            let (mut tc, mut td) = (StepBuffer::new(0), StepBuffer::new(0));
            a.gradient(&view, &mut ga).unwrap();
            c.gradient(&view, &mut tc).unwrap();
            if second {
                b.gradient(&view, &mut gb).unwrap();
                d.gradient(&view, &mut td).unwrap();
            } else {
                assert!(mine(&gd).is_none(), "the last update spent the gradient");
            }
            let flat = mine(&gc).expect("the step left its gradient");
            assert_eq!(flat.to_vec1::<f32>().unwrap(), ga.gradient());
            assert_eq!(
                tc.words(),
                &ga.words()[n..],
                "the words besides the gradient"
            );
            let mut host = StepBuffer::new(n);
            for (s, (x, y)) in (host.words_mut().iter_mut()).zip(ga.words().iter().zip(gb.words()))
            {
                *s = x + y;
            }
            let zeros = || flat.zeros_like().unwrap();
            let sum = (&flat + mine(&gd).unwrap_or_else(zeros)).unwrap();
            let mut tail = StepBuffer::new(0);
            for (s, (x, y)) in (tail.words_mut().iter_mut()).zip(tc.words().iter().zip(td.words()))
            {
                *s = x + y;
            }
            for (r, g) in [(&mut c, &gc), (&mut d, &gd)] {
                g.lock().unwrap().sum = Some(sum.clone());
                r.apply(&tail).unwrap();
            }
            a.apply(&host).unwrap();
            b.apply(&host).unwrap();
            assert_eq!(a.digest(), b.digest());
            assert_eq!(
                (c.digest(), d.digest()),
                (a.digest(), a.digest()),
                "step {step}"
            );
        }
        // A sum left from before the step is not the step's: the step clears it.
        gc.lock().unwrap().sum = Some(Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap());
        c.gradient(&view, &mut StepBuffer::new(0)).unwrap();
        let mut tail = StepBuffer::new(0);
        tail.set_loss_tokens(1.0);
        let e = c.apply(&tail).unwrap_err();
        assert!(e.to_string().contains("left no sum"), "{e}");
    }

    /// Two ranks applying one summed buffer stay bitwise equal; the state hand-over and the
    /// checkpoint reproduce a rank exactly; another shape's checkpoint is refused by name.
    #[test]
    fn ranks_agree_and_the_state_and_checkpoint_reproduce_a_rank() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, buf) = setup(dir.path());
        let view = BatchView::parse(&buf).unwrap();
        let (mut a, mut b) = (
            DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap(),
            DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap(),
        );
        assert_eq!(a.digest(), b.digest(), "one seed, one start");
        let n = a.grad_len();
        assert_eq!(sizes(&cfg).unwrap(), (n, a.state_len()));
        for _ in 0..3 {
            let (mut ga, mut gb) = (StepBuffer::new(n), StepBuffer::new(n));
            a.gradient(&view, &mut ga).unwrap();
            b.gradient(&view, &mut gb).unwrap();
            assert!(ga.blocks() == 8.0 && ga.loss_tokens() > 0.0);
            let mut sum = StepBuffer::new(n);
            for (s, (x, y)) in (sum.words_mut().iter_mut()).zip(ga.words().iter().zip(gb.words())) {
                *s = x + y;
            }
            let st = a.apply(&sum).unwrap();
            b.apply(&sum).unwrap();
            assert_eq!(a.digest(), b.digest());
            assert!(st.tau.is_some_and(|t| t >= 1.0) && st.lr.is_some() && st.loss > 0.0);
        }
        let mut c = DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        c.import_state(&a.export_state().unwrap()).unwrap();
        assert_eq!((c.digest(), c.step(), c.opt.step), (a.digest(), 3, 3));
        let path = dir.path().join("ckpt.safetensors");
        a.save(&path).unwrap();
        let mut d = DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        d.load(&path).unwrap();
        assert_eq!(d.export_state().unwrap(), a.export_state().unwrap());
        // The next step is the same on the restored ranks as on the original.
        let mut g = StepBuffer::new(n);
        a.gradient(&view, &mut g).unwrap();
        let mut h = StepBuffer::new(n);
        d.gradient(&view, &mut h).unwrap();
        assert_eq!(g, h);
        let mut other = cfg.clone();
        other.dflash.layers = Some(2);
        let err = DflashDrafter::new(&other, None, &Placement::cpu())
            .unwrap()
            .load(&path)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("weights") && err.contains("ckpt.safetensors"),
            "{err}"
        );
    }

    /// A checkpoint of a drafter of the same size but another shape (its captured layers
    /// in another order here: the same weights' count, another meaning) is refused naming the
    /// field; it used to load, the context's projection applied to the wrong layers. The
    /// block size, which the weights do not depend on, may change.
    #[test]
    fn a_checkpoint_of_another_shape_of_the_same_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cfg, _) = setup(dir.path());
        cfg.model.target_layer_ids = Some(vec![1, 2]);
        let path = dir.path().join("ckpt.safetensors");
        let a = DflashDrafter::new(&cfg, None, &Placement::cpu()).unwrap();
        a.save(&path).unwrap();
        let mut swapped = cfg.clone();
        swapped.model.target_layer_ids = Some(vec![2, 1]);
        let mut d = DflashDrafter::new(&swapped, None, &Placement::cpu()).unwrap();
        assert_eq!(d.grad_len(), a.grad_len());
        let err = d.load(&path).unwrap_err().to_string();
        assert!(
            err.contains("ckpt.safetensors") && err.contains("target_layer_ids"),
            "{err}"
        );
        let mut longer = cfg.clone();
        longer.dflash.block_size = 8;
        let mut e = DflashDrafter::new(&longer, None, &Placement::cpu()).unwrap();
        e.load(&path).unwrap();
        assert_eq!(e.export_state().unwrap(), a.export_state().unwrap());
    }
}
