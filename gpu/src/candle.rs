//! The candle backends: a real target (an HF model directory run by `model::Decoder`) and a
//! DFlash drafter, on the CPU (`candle`, f32) or on the worker's GPU through candle's CUDA device
//! (`cuda`, the target in bf16; the build with `--features cuda`). One code path: a
//! [`Placement`] says where and in what the models compute, and is all the two backends differ
//! by.
//!
//! Length: past 500 lines with its tests: the two backends' maker, the placement, the target
//! and the two layouts it writes, and the bf16-against-f32 check, which needs all of them.
//!
//! The target writes the captured layers `[tokens x layers x hidden]` in the slot's dtype and
//! the greedy next tokens into the slot. The drafter is a DFlash drafter (`dflash.rs`) trained
//! on them; the batches' checksums are what it verifies, the states being real.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use model::{ArchConfig, Decoder, GpuAttentionUse, Need};
use proto::{Dtype, PipelineConfig, WorkerName};

use crate::candle_cuda::CopyOut;
use crate::mock::{self, Sim};
use crate::{DrafterBackend, GpuError, Maker, RawOut, Settling, TargetBackend, TargetOut};

pub struct Candle {
    /// On the worker's GPU (the `cuda` backend, [`Placement::gpu`]), else on the CPU.
    gpu: bool,
}

impl Candle {
    /// The `candle` backend.
    pub const CPU: Candle = Candle { gpu: false };
    /// The `cuda` backend.
    pub const GPU: Candle = Candle { gpu: true };

    /// Where the models go, found in the worker that computes (never in the launcher).
    fn place(&self) -> Result<Placement, GpuError> {
        if self.gpu {
            Placement::gpu()
        } else {
            Ok(Placement::cpu())
        }
    }
}

/// Elements of one block of attention scores or LM-head logits on a GPU.
const GPU_BLOCK: usize = 1 << 28;

/// Where a backend's models compute, and the target's compute dtype. The drafter trains in f32
/// wherever it is (its masters and moments are f32; bf16 weights would be its own design).
#[derive(Clone, Debug)]
pub struct Placement {
    pub device: Device,
    pub target_dtype: DType,
}

impl Placement {
    /// The CPU in f32: the `candle` backend, and every test.
    pub fn cpu() -> Placement {
        Placement {
            device: Device::Cpu,
            target_dtype: DType::F32,
        }
    }

    /// The worker's GPU in bf16: device 0, the one GPU the launcher's `CUDA_VISIBLE_DEVICES`
    /// leaves a worker. A build without candle's CUDA device says so (candle's "not compiled
    /// with cuda support" would not say how to get one).
    pub fn gpu() -> Result<Placement, GpuError> {
        if !candle_core::utils::cuda_is_available() {
            return Err(GpuError::Config(
                "this build has no CUDA device: build with scripts/build-cuda.sh (the launcher's `cuda` feature), or use --backend candle".into(),
            ));
        }
        let freed = freed_memory(std::env::var(FREED_MEMORY_ENV).ok().as_deref())?;
        let tf32 = tf32(std::env::var(TF32_ENV).ok().as_deref())?;
        let device = Device::new_cuda(0)?;
        // Process-wide in candle (cuBLAS's compute type for every f32 product): the drafter's;
        // the target computes in bf16.
        candle_core::cuda::set_gemm_reduced_precision_f32(tf32);
        if tf32 {
            tracing::info!(
                "f32 matrix products on TF32 tensor cores ({TF32_ENV}=on): inputs rounded to 10 \
                 mantissa bits, sums in f32"
            );
        }
        let ctx = crate::candle_cuda::stream(&device)?.context().clone();
        match cuda::pool::set_freed_memory(&ctx, freed)? {
            true => tracing::info!(
                "device memory: freed memory {} ({FREED_MEMORY_ENV})",
                match freed {
                    cuda::pool::FreedMemory::Keep => "kept for reuse",
                    cuda::pool::FreedMemory::Release => "handed back at each synchronize",
                }
            ),
            false => tracing::info!(
                "device memory: this GPU has no memory pools; candle allocates and frees directly"
            ),
        }
        Ok(Placement {
            device,
            target_dtype: DType::BF16,
        })
    }

    /// On a GPU, blocks of attention scores and LM-head logits of 256M elements (1 GiB in f32)
    /// instead of the CPU's cache-sized ones: an 8B model's 1.2 GB head would otherwise be read
    /// again by each of ~75 chunks of a 8k-token batch, and attention be thousands of small
    /// kernels. And attention as one kernel per layer ([`gpu_attention`]).
    fn size_blocks(&self, decoder: &mut Decoder) -> Result<(), GpuError> {
        if !self.device.is_cpu() {
            decoder.set_score_block(GPU_BLOCK);
            decoder.set_logit_chunk(GPU_BLOCK);
            gpu_attention(decoder, std::env::var(ATTENTION_ENV).ok().as_deref())?;
        }
        Ok(())
    }

    /// Where `kind`'s models go: [`Placement::gpu`] for `cuda`, else the CPU.
    pub fn of(kind: crate::BackendKind) -> Result<Placement, GpuError> {
        match kind {
            crate::BackendKind::Cuda => Candle::GPU.place(),
            _ => Candle::CPU.place(),
        }
    }
}

/// What a GPU's memory pool, where candle's tensors live, does with memory freed into it
/// (`cuda::pool`): `keep` (the default: kept for the next allocation, as PyTorch's caching
/// allocator does) or `release` (the driver's default: handed back at each synchronize, which a
/// DFlash step does about thirty-five times; for a GPU shared with other programs, and to compare the two).
pub const FREED_MEMORY_ENV: &str = "HSPIPE_CUDA_FREED_MEMORY";

/// [`FREED_MEMORY_ENV`]'s value read: unset is `keep`; a value neither `keep` nor `release` is
/// an error naming it.
pub fn freed_memory(choice: Option<&str>) -> Result<cuda::pool::FreedMemory, GpuError> {
    match choice {
        None | Some("keep") => Ok(cuda::pool::FreedMemory::Keep),
        Some("release") => Ok(cuda::pool::FreedMemory::Release),
        Some(other) => Err(GpuError::Config(format!(
            "{FREED_MEMORY_ENV} is {other:?}: it takes keep (the default) or release"
        ))),
    }
}

/// Whether a GPU's f32 matrix products may run on its TF32 tensor cores (cuBLAS's
/// `CUBLAS_COMPUTE_32F_FAST_TF32`, set through candle): `off` (the default, as PyTorch's
/// `allow_tf32`: f32 products in f32) or `on` (each product's inputs rounded to TF32's 10-bit
/// mantissa, the sums kept in f32; several times the speed of an H200's f32 units for the
/// drafter's products, at the rounding of a half-precision input). A training setting, not a
/// default: it changes the drafter's numerics.
pub const TF32_ENV: &str = "HSPIPE_CUDA_TF32";

/// [`TF32_ENV`]'s value read: unset or `off` is false, `on` true; anything else is an error
/// naming it.
pub fn tf32(choice: Option<&str>) -> Result<bool, GpuError> {
    match choice {
        None | Some("off") => Ok(false),
        Some("on") => Ok(true),
        Some(other) => Err(GpuError::Config(format!(
            "{TF32_ENV} is {other:?}: it takes off (the default) or on"
        ))),
    }
}

/// How a target on a GPU attends: `fused` (the default: one kernel per layer, the scores kept on
/// chip, `cuda::attention`, its ldmatrix form or else its plain one), `plain` (the kernel's plain
/// form only) or `blocked` (candle's matrix products over blocks of scores, the CPU's way); the
/// last two for comparing.
pub const ATTENTION_ENV: &str = "HSPIPE_TARGET_ATTENTION";

/// Sets `decoder`'s attention on a GPU from `choice` ([`ATTENTION_ENV`]'s value): the fused
/// kernel unless `blocked` is asked for. A kernel that cannot serve there (heads it is not
/// built for, a GPU or driver that cannot load it, a self-check that did not pass) leaves the
/// matrix products, with a warning that says why; any other value is an error, and so is a
/// driver failure during the kernel's self-check (the device is then suspect).
pub fn gpu_attention(decoder: &mut Decoder, choice: Option<&str>) -> Result<(), GpuError> {
    use cuda::attention::Loads;
    let forms: &[Loads] = match choice {
        None | Some("fused") => &Loads::PREFERENCE,
        Some("plain") => &[Loads::Plain],
        Some("blocked") => {
            tracing::info!("attention: candle's matrix products over blocks of scores ({ATTENTION_ENV}=blocked)");
            return Ok(());
        }
        Some(other) => {
            return Err(GpuError::Config(format!(
                "{ATTENTION_ENV} is {other:?}: it takes fused (the default), plain or blocked"
            )))
        }
    };
    match decoder.use_gpu_attention_in(forms)? {
        GpuAttentionUse::Fused {
            loads,
            self_check_error,
            passed_over,
        } => {
            tracing::info!(
                "attention: one fused kernel per layer, {loads:?} loads (its self-check is within {self_check_error:.4} of f64)"
            );
            if let Some(why) = passed_over {
                tracing::warn!("attention: a preferred form of the kernel was passed over: {why}");
            }
        }
        GpuAttentionUse::Refused(why) => tracing::warn!(
            "attention: candle's matrix products over blocks of scores, since the fused kernel cannot serve: {why}"
        ),
    }
    Ok(())
}

/// The model directory the config names, or the error that says how to name one.
pub(crate) fn model_dir(cfg: &PipelineConfig) -> Result<&Path, GpuError> {
    cfg.model.path.as_deref().ok_or_else(|| {
        GpuError::Config(
            "the candle backend runs a real model: name its HF directory with --model DIR (or [model] path); `launcher make-model DIR` makes a tiny one".into(),
        )
    })
}

/// The decoder layers to capture: the config's (each one the model has: what a forward
/// needs; a layer named twice is refused to a new run by [`Maker::settle`], not here, where
/// the workers of a resumed run take their run's layers as its first launch chose them), or
/// SpecForge's rule for `model.layers`.
pub fn layer_ids(cfg: &PipelineConfig, arch: &ArchConfig) -> Result<Vec<usize>, GpuError> {
    let n = arch.num_hidden_layers;
    let ids = match &cfg.model.target_layer_ids {
        Some(ids) => {
            let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
            model::capture::check_layer_ids(&ids, n)
                .map_err(|e| GpuError::Config(format!("model.target_layer_ids: {e}")))?;
            ids
        }
        None => model::capture::default_layer_ids(n, cfg.model.layers as usize)
            .map_err(|e| GpuError::Config(format!("model.layers = {}: {e}", cfg.model.layers)))?,
    };
    Ok(ids)
}

impl Maker for Candle {
    /// The CPU always; the GPU when this build has candle's CUDA device (`--features cuda`).
    fn built(&self) -> bool {
        !self.gpu || candle_core::utils::cuda_is_available()
    }

    fn settle(&self, cfg: &mut PipelineConfig, settling: Settling) -> Result<(), GpuError> {
        let dir = model_dir(cfg)?;
        let arch = ArchConfig::load(dir)?;
        // Rope runs at any position, as HF's does, but the states past the model's length are
        // not what it was trained for: a drafter would learn from them silently. (A drafted
        // block reaches up to block_size - 1 positions past a sequence, but only with masks
        // past its end, which carry no loss (the block's other masks attend to them, as they
        // do at inference): data as long as the model's positions stays allowed.)
        // So are states past a sliding window, which our attention does not have.
        let most = arch.positions();
        if cfg.data.max_len as usize > most {
            return Err(GpuError::Config(format!(
                "data.max_len = {} is more than the model's {} ({}): set data.max_len to {most} at most",
                cfg.data.max_len,
                arch.positions_bound(),
                dir.join("config.json").display()
            )));
        }
        // A drafter deeper than its target drafts slower than the target decodes; and its
        // weights (times four, with the optimizer's) would be sized by a typo.
        if let Some(l) = cfg
            .dflash
            .layers
            .filter(|&l| l as usize > arch.num_hidden_layers)
        {
            return Err(GpuError::Config(format!(
                "dflash.layers = {l} is more than the target's {} layers ({}): a drafter deeper than its target drafts slower than the target decodes (DFlash's drafters have 1 to 8)",
                arch.num_hidden_layers,
                dir.join("config.json").display()
            )));
        }
        let ids = layer_ids(cfg, &arch)?;
        // A new run's layers are each captured once: a layer twice is the same states twice
        // and less of the target. A resumed run's are the ones its checkpoint was trained on,
        // which an earlier build's rule may have taken twice (SpecForge's, 6 of 8 layers):
        // other layers would be another run, and a checkpoint of them is refused on load.
        if settling != Settling::Resume && cfg.model.target_layer_ids.is_some() {
            model::capture::check_distinct(&ids)
                .map_err(|e| GpuError::Config(format!("model.target_layer_ids: {e}")))?;
        }
        // A tensor missing, of another shape or quantized is found here from the files'
        // headers, not by each target worker as it loads (restarted to its limit, the run lost).
        // A shape has no weights files: its weights are made on the device.
        if settling != Settling::Shape {
            Decoder::check_weights(dir, &arch)?;
        }
        cfg.model.hidden = arch.hidden_size as u32;
        cfg.model.layers = ids.len() as u32;
        cfg.model.target_layer_ids = Some(ids.iter().map(|&i| i as u32).collect());
        let vocab = arch.vocab_size as u32;
        match cfg.data.synthetic_vocab {
            Some(v) if v > vocab => {
                return Err(GpuError::Config(format!(
                    "data.synthetic_vocab = {v} is more than the model's vocabulary of {vocab}"
                )))
            }
            Some(_) => {}
            None => cfg.data.synthetic_vocab = Some(vocab),
        }
        // A real model's synthetic data is text it can be trained on: the built-in language.
        cfg.data.synthetic_language.get_or_insert(true);
        crate::dflash::check_eval_reach(cfg, &arch)?;
        Ok(())
    }

    fn target(
        &self,
        cfg: &PipelineConfig,
        name: WorkerName,
    ) -> Result<Box<dyn TargetBackend + Send>, GpuError> {
        Ok(Box::new(CandleTarget::new(cfg, name, &self.place()?)?))
    }

    fn drafter(
        &self,
        cfg: &PipelineConfig,
        name: Option<WorkerName>,
    ) -> Result<Box<dyn DrafterBackend + Send>, GpuError> {
        // A drafter made outside a worker (the launcher reading a checkpoint) stays on the CPU:
        // the launcher holds no GPU.
        let place = match name {
            Some(_) => self.place()?,
            None => Placement::cpu(),
        };
        Ok(Box::new(crate::dflash::DflashDrafter::new(
            cfg, name, &place,
        )?))
    }

    fn drafter_sizes(&self, cfg: &PipelineConfig) -> Result<(usize, usize), GpuError> {
        crate::dflash::sizes(cfg)
    }

    fn drafter_exports(&self) -> bool {
        true
    }
}

/// A frozen HF model computing a batch's captured layers and greedy tokens.
pub struct CandleTarget {
    decoder: Decoder,
    layers: Vec<usize>,
    dtype: Dtype,
    /// The faults injected into this worker (crash or hang after N batches); no simulated time.
    sim: Sim,
    /// On a GPU: the copy-out beside candle's stream, and the batches submitted and not yet
    /// completed. Dropping the target waits for the copies.
    gpu: Option<CopyOut>,
    /// The sequence lengths of the batches submitted and not yet completed (on a GPU).
    submitted: std::collections::VecDeque<Vec<u32>>,
}

impl CandleTarget {
    /// Worker `name`'s target under `cfg`, loaded once from the model directory.
    pub fn new(
        cfg: &PipelineConfig,
        name: WorkerName,
        place: &Placement,
    ) -> Result<CandleTarget, GpuError> {
        let faults = cfg.faults_for(name);
        mock::start(&faults);
        let dir = model_dir(cfg)?;
        let mut t = CandleTarget::load_at(dir, cfg, place)?;
        t.sim = Sim::new(f64::INFINITY, faults);
        if !place.device.is_cpu() {
            t.gpu = Some(CopyOut::new(&place.device)?);
        }
        Ok(t)
    }

    /// Loads the model in `dir` for the layers and dtype `cfg` names (the launcher's `capture`
    /// uses this without a worker), checking that its states fit the ring's slots.
    pub fn load(dir: &Path, cfg: &PipelineConfig) -> Result<CandleTarget, GpuError> {
        CandleTarget::load_at(dir, cfg, &Placement::cpu())
    }

    /// [`CandleTarget::load`] at `place`.
    pub fn load_at(
        dir: &Path,
        cfg: &PipelineConfig,
        place: &Placement,
    ) -> Result<CandleTarget, GpuError> {
        let decoder = Decoder::load(dir, &place.device, place.target_dtype)?;
        CandleTarget::with_decoder(dir, decoder, cfg, place)
    }

    /// A target of `dir`'s shape (its `config.json` alone) with weights made up at `place`
    /// (`model::Weights::random`): for measuring speed at sizes no test downloads.
    pub fn random(
        dir: &Path,
        cfg: &PipelineConfig,
        place: &Placement,
    ) -> Result<CandleTarget, GpuError> {
        let w = model::weights::Weights::random(&place.device, place.target_dtype);
        let decoder = Decoder::from_weights(ArchConfig::load(dir)?, &w)?;
        CandleTarget::with_decoder(dir, decoder, cfg, place)
    }

    /// The target around `decoder` (of the model in `dir`), its blocks sized for `place`,
    /// checked against the ring's slots.
    fn with_decoder(
        dir: &Path,
        mut decoder: Decoder,
        cfg: &PipelineConfig,
        place: &Placement,
    ) -> Result<CandleTarget, GpuError> {
        place.size_blocks(&mut decoder)?;
        let arch = decoder.config();
        let layers = layer_ids(cfg, arch)?;
        if arch.hidden_size != cfg.model.hidden as usize
            || layers.len() != cfg.model.layers as usize
        {
            return Err(GpuError::Config(format!(
                "{}: hidden size {} x {} captured layers does not fit the ring's slots, sized for hidden {} x {} layers (the launcher sets model.hidden and model.layers from the model)",
                dir.display(),
                arch.hidden_size,
                layers.len(),
                cfg.model.hidden,
                cfg.model.layers
            )));
        }
        Ok(CandleTarget {
            decoder,
            layers,
            dtype: cfg.model.dtype,
            sim: Sim::new(f64::INFINITY, Default::default()),
            gpu: None,
            submitted: Default::default(),
        })
    }

    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// The decoder, to change how it computes (bench-target compares its two attentions).
    pub fn decoder_mut(&mut self) -> &mut Decoder {
        &mut self.decoder
    }

    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// The forward of a batch up to what a slot holds: the captured layers, and the greedy
    /// tokens if `tokens` (else it stops after the last captured layer).
    fn captured(
        &self,
        input_ids: &[u32],
        seq_lens: &[u32],
        tokens: bool,
    ) -> Result<model::Output, GpuError> {
        let need = Need {
            layers: &self.layers,
            final_hidden: false,
            tokens,
        };
        Ok(self.decoder.forward(input_ids, seq_lens, &need)?)
    }

    /// The captured layers and greedy tokens of one batch, as the slot's bytes: `hidden`
    /// `[tokens x layers x hidden]` in the slot's dtype, `tokens` little-endian u32s.
    /// `tokens: false` stops the forward after the last captured layer and leaves them zero.
    pub fn run(
        &self,
        input_ids: &[u32],
        seq_lens: &[u32],
        out: TargetOut<'_>,
        tokens: bool,
    ) -> Result<(), GpuError> {
        let h = self.decoder.config().hidden_size;
        out.check(input_ids.len(), self.layers.len(), h, self.dtype.size())?;
        let got = self.captured(input_ids, seq_lens, tokens)?;
        let l = self.layers.len();
        if self.decoder.device().is_cpu() {
            for (li, x) in got.layers.iter().enumerate() {
                write_layer(x, self.dtype, li, l, h, out.hidden_states)?;
            }
        } else {
            write_stacked(&got.layers, self.dtype, out.hidden_states)?;
        }
        match got.token_ids()? {
            Some(tk) => {
                for (dst, id) in out.target_tokens.chunks_exact_mut(4).zip(tk) {
                    dst.copy_from_slice(&id.to_le_bytes());
                }
            }
            None => out.target_tokens.fill(0),
        }
        Ok(())
    }
}

impl TargetBackend for CandleTarget {
    fn forward(
        &mut self,
        input_ids: &[u32],
        seq_lens: &[u32],
        out: TargetOut<'_>,
    ) -> Result<(), GpuError> {
        self.run(input_ids, seq_lens, out, true)?;
        self.sim.finish_item(seq_lens, std::time::Instant::now());
        Ok(())
    }

    /// Two on a GPU: the forward of a batch runs while the last one's results are copied out.
    fn depth(&self) -> usize {
        if self.gpu.is_some() {
            2
        } else {
            1
        }
    }

    fn submit(&mut self, input_ids: &[u32], seq_lens: &[u32], out: RawOut) -> Result<(), GpuError> {
        if self.gpu.is_none() {
            return crate::raw_out::forward_now(self, input_ids, seq_lens, out);
        }
        let h = self.decoder.config().hidden_size;
        let (l, t) = (self.layers.len(), input_ids.len());
        let want = (t * l * h * self.dtype.size(), t * 4);
        let got = (out.hidden_states().1, out.target_tokens().1);
        if got != want {
            return Err(GpuError::Shape(format!(
                "a slot's sections of {got:?} bytes for a batch of {want:?} (hidden states, tokens)"
            )));
        }
        let began = (self.gpu.as_ref().expect("checked above")).begin()?;
        let got = self.captured(input_ids, seq_lens, true)?;
        let states = stacked(&got.layers, self.dtype)?;
        let tokens = got
            .tokens
            .ok_or_else(|| GpuError::Shape("the forward gave no greedy tokens".into()))?;
        let gpu = self.gpu.as_mut().expect("checked above");
        gpu.start(began, states, tokens, out)?;
        self.submitted.push_back(seq_lens.to_vec());
        Ok(())
    }

    fn complete(&mut self) -> Result<(), GpuError> {
        if let Some(g) = &mut self.gpu {
            g.complete()?;
        }
        // Counted done (the faults' count) once its results are in its slot, as on the host.
        if let Some(lens) = self.submitted.pop_front() {
            self.sim.finish_item(&lens, std::time::Instant::now());
        }
        Ok(())
    }

    fn quiesce(&mut self) {
        if let Some(g) = &mut self.gpu {
            g.quiesce();
        }
        self.submitted.clear();
    }

    /// On a GPU: each batch's forward on candle's stream and its copy into the slot.
    fn device_clock(&self) -> Option<std::sync::Arc<dyn crate::DeviceClock>> {
        let t = self.gpu.as_ref()?.timeline();
        Some(t)
    }
}

/// The captured layers (each `[tokens, hidden]`) as one contiguous `[tokens x layers x
/// hidden]` tensor of `dtype`, laid out and converted where they are.
fn stacked(layers: &[Tensor], dtype: Dtype) -> Result<Tensor, GpuError> {
    Ok(Tensor::stack(layers, 1)?
        .flatten_all()?
        .to_dtype(candle_dtype(dtype))?
        .contiguous()?)
}

/// candle's name for a slot's element type.
pub(crate) fn candle_dtype(dtype: Dtype) -> DType {
    match dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
    }
}

/// Writes the captured layers (each `[tokens, hidden]`) into `out` as `[tokens x layers x
/// hidden]` elements of `dtype`, laid out and converted on the layers' device, then copied to
/// the host once (on a GPU, one device-to-host copy instead of one per layer and a scatter on
/// the CPU).
fn write_stacked(layers: &[Tensor], dtype: Dtype, out: &mut [u8]) -> Result<(), GpuError> {
    // The slot's elements are little-endian, as this machine's are (x86-64, aarch64): one
    // memcpy of the host copy's bytes, not a loop over hundreds of millions of elements.
    const _: () = assert!(cfg!(target_endian = "little"));
    use zerocopy::IntoBytes;
    let flat = stacked(layers, dtype)?;
    let want = flat.elem_count() * dtype.size();
    if out.len() != want {
        return Err(GpuError::BufferSize {
            got: out.len(),
            want,
        });
    }
    match dtype {
        Dtype::F32 => out.copy_from_slice(flat.to_vec1::<f32>()?.as_bytes()),
        Dtype::Bf16 => out.copy_from_slice(flat.to_vec1::<half::bf16>()?.as_bytes()),
        Dtype::F16 => out.copy_from_slice(flat.to_vec1::<half::f16>()?.as_bytes()),
    }
    Ok(())
}

/// Writes layer `li` of `l` (`x`, `[tokens, hidden]`) into `out`, `[tokens x l x hidden]`
/// little-endian elements of `dtype`: each value converted once, straight into its place.
fn write_layer(
    x: &Tensor,
    dtype: Dtype,
    li: usize,
    l: usize,
    h: usize,
    out: &mut [u8],
) -> Result<(), GpuError> {
    fn scatter<const N: usize>(
        vals: impl Iterator<Item = [u8; N]>,
        li: usize,
        l: usize,
        h: usize,
        out: &mut [u8],
    ) {
        for (i, v) in vals.enumerate() {
            let (t, c) = (i / h, i % h);
            let at = ((t * l + li) * h + c) * N;
            out[at..at + N].copy_from_slice(&v);
        }
    }
    let flat = x.flatten_all()?;
    match dtype {
        Dtype::F32 => scatter(
            flat.to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .into_iter()
                .map(f32::to_le_bytes),
            li,
            l,
            h,
            out,
        ),
        Dtype::Bf16 => scatter(
            flat.to_dtype(DType::BF16)?
                .to_vec1::<half::bf16>()?
                .into_iter()
                .map(half::bf16::to_le_bytes),
            li,
            l,
            h,
            out,
        ),
        Dtype::F16 => scatter(
            flat.to_dtype(DType::F16)?
                .to_vec1::<half::f16>()?
                .into_iter()
                .map(half::f16::to_le_bytes),
            li,
            l,
            h,
            out,
        ),
    }
    Ok(())
}

/// A tiny target for the tests (4 layers, vocabulary 300, 2 captured) and a config settled
/// for it.
#[cfg(test)]
pub(crate) fn tiny_target(dir: &Path) -> (std::path::PathBuf, PipelineConfig) {
    tiny_target_of(dir, model::Family::Qwen3)
}

/// [`tiny_target`] of `family` (HF's head size for it).
#[cfg(test)]
pub(crate) fn tiny_target_of(
    dir: &Path,
    family: model::Family,
) -> (std::path::PathBuf, PipelineConfig) {
    let m = dir.join("tiny");
    let spec = model::make::MakeSpec {
        family,
        layers: 4,
        vocab: 300,
        head_dim: (family == model::Family::Qwen3).then_some(16),
        ..Default::default()
    };
    model::make::make_model(&m, &spec).unwrap();
    let mut cfg = PipelineConfig::default();
    cfg.model.path = Some(m.clone());
    // Named: SpecForge's rule takes layer 1 twice of 4 layers.
    cfg.model.target_layer_ids = Some(vec![1, 2]);
    cfg.model.layers = 2;
    (m, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replaces `from` (which must be there) by `to` in the model `m`'s config.json.
    fn edit_config(m: &Path, from: &str, to: &str) {
        let p = m.join("config.json");
        let c = std::fs::read_to_string(&p).unwrap();
        assert!(c.contains(from), "{c}");
        std::fs::write(&p, c.replace(from, to)).unwrap();
    }

    /// A model's states past its max_position_embeddings are not what it was trained for: data
    /// that long is refused before any worker starts, naming both numbers.
    #[test]
    fn data_longer_than_the_models_positions_is_refused_at_settle() {
        let dir = tempfile::tempdir().unwrap();
        let (m, mut cfg) = tiny_target(dir.path());
        edit_config(
            &m,
            "\"max_position_embeddings\": 32768",
            "\"max_position_embeddings\": 64",
        );
        cfg.data.max_len = 65;
        let e = Candle::CPU
            .settle(&mut cfg.clone(), Settling::New)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("data.max_len = 65") && e.contains("max_position_embeddings = 64"),
            "{e}"
        );
        cfg.data.max_len = 64;
        // No evaluation: its prompts and new tokens would reach past 64 positions.
        cfg.dflash.eval_every = 0;
        Candle::CPU.settle(&mut cfg, Settling::New).unwrap();
    }

    /// Mistral's sliding window bounds the data as the model's positions do: within it the
    /// window masks nothing and our full attention is HF's; past it, HF's attention would not
    /// see the first tokens and ours would. So data longer is refused, naming the window, and
    /// so is an evaluation that would decode past it.
    #[test]
    fn data_longer_than_a_mistral_window_is_refused_at_settle() {
        let dir = tempfile::tempdir().unwrap();
        let (m, mut cfg) = tiny_target_of(dir.path(), model::Family::Mistral);
        edit_config(&m, "\"sliding_window\": null", "\"sliding_window\": 96");
        cfg.data.max_len = 97;
        cfg.dflash.eval_every = 0;
        let e = (Candle::CPU.settle(&mut cfg.clone(), Settling::New))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("data.max_len = 97") && e.contains("sliding_window = 96"),
            "{e}"
        );
        cfg.data.max_len = 96;
        Candle::CPU.settle(&mut cfg.clone(), Settling::New).unwrap();
        cfg.dflash.eval_every = 10;
        cfg.dflash.eval_new_tokens = 100;
        let e = (Candle::CPU.settle(&mut cfg, Settling::New))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dflash.eval_new_tokens = 100") && e.contains("sliding_window = 96"),
            "{e}"
        );
    }

    /// A model's shape alone (its config.json, no weights files: the benchmarks' `--random`,
    /// whose weights are made on the device) settles as a shape and fills in the model's sizes;
    /// a run's settle still refuses a directory without weights.
    #[test]
    fn a_shape_without_weights_settles_as_a_shape_only() {
        let dir = tempfile::tempdir().unwrap();
        let (m, mut cfg) = tiny_target(dir.path());
        let shape = dir.path().join("shape");
        std::fs::create_dir(&shape).unwrap();
        std::fs::copy(m.join("config.json"), shape.join("config.json")).unwrap();
        cfg.model.path = Some(shape);
        let e = (Candle::CPU.settle(&mut cfg.clone(), Settling::New))
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.safetensors"), "{e}");
        cfg.model.hidden = 0;
        Candle::CPU.settle(&mut cfg, Settling::Shape).unwrap();
        let arch = ArchConfig::load(&m).unwrap();
        assert_eq!(cfg.model.hidden as usize, arch.hidden_size);
    }

    /// A drafter deeper than its target: refused at settle naming both (a typo of 100000
    /// sized a group segment of 74 GB, or drafters that died allocating their weights).
    #[test]
    fn a_drafter_deeper_than_its_target_is_refused_at_settle() {
        let dir = tempfile::tempdir().unwrap();
        let (m, mut cfg) = tiny_target(dir.path());
        let layers = ArchConfig::load(&m).unwrap().num_hidden_layers as u32;
        cfg.dflash.layers = Some(layers + 1);
        let e = (Candle::CPU
            .settle(&mut cfg.clone(), Settling::New)
            .unwrap_err())
        .to_string();
        assert!(
            e.contains(&format!("dflash.layers = {}", layers + 1))
                && e.contains(&format!("the target's {layers} layers")),
            "{e}"
        );
        cfg.dflash.layers = Some(layers);
        Candle::CPU.settle(&mut cfg, Settling::New).unwrap();
    }

    /// The leader's evaluation decodes past the model's positions: refused at settle, as
    /// `launcher eval` refuses it (the drafter went silent and was killed as stalled).
    #[test]
    fn an_evaluation_past_the_models_positions_is_refused_at_settle() {
        let dir = tempfile::tempdir().unwrap();
        let (_, mut cfg) = tiny_target(dir.path());
        cfg.dflash.eval_new_tokens = 100_000;
        let e = Candle::CPU
            .settle(&mut cfg.clone(), Settling::New)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dflash.eval_new_tokens = 100000")
                && e.contains("max_position_embeddings = 32768"),
            "{e}"
        );
        cfg.dflash.eval_every = 0;
        Candle::CPU.settle(&mut cfg, Settling::New).unwrap();
    }

    /// Captured layers the model does not have, or one twice, are refused naming the field and
    /// what the model has. A resumed run's own layers with one twice (an earlier build's rule
    /// chose them, and its checkpoint was trained on them) are kept, as its workers take them;
    /// one the model lacks is refused all the same.
    #[test]
    fn more_captured_layers_than_the_model_has_or_one_twice_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (m, mut cfg) = tiny_target(dir.path());
        cfg.model.target_layer_ids = None;
        cfg.model.layers = 100;
        let e = Candle::CPU
            .settle(&mut cfg.clone(), Settling::New)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.layers = 100") && e.contains("the model has 4 decoder layers"),
            "{e}"
        );
        cfg.model.layers = 2;
        cfg.model.target_layer_ids = Some(vec![2, 2]);
        let e = Candle::CPU
            .settle(&mut cfg.clone(), Settling::New)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.target_layer_ids") && e.contains("layer 2 twice"),
            "{e}"
        );
        let mut resumed = cfg.clone();
        Candle::CPU.settle(&mut resumed, Settling::Resume).unwrap();
        assert_eq!(resumed.model.target_layer_ids, Some(vec![2, 2]));
        assert_eq!(
            layer_ids(&resumed, &ArchConfig::load(&m).unwrap()).unwrap(),
            [2, 2]
        );
        cfg.model.target_layer_ids = Some(vec![2, 4]);
        let e = Candle::CPU
            .settle(&mut cfg.clone(), Settling::Resume)
            .unwrap_err()
            .to_string();
        assert!(e.contains("capture layer 4 is out of range"), "{e}");
        cfg.model.target_layer_ids = Some(vec![2, 1]);
        Candle::CPU.settle(&mut cfg, Settling::New).unwrap();
    }

    /// HSPIPE_TARGET_ATTENTION takes fused, plain or blocked, and anything else is an error naming it;
    /// a decoder the kernel cannot serve (here, one on the CPU) keeps the matrix products
    /// rather than failing the worker.
    #[test]
    fn the_attention_choice_is_fused_plain_or_blocked_and_falls_back_when_it_cannot_serve() {
        let dir = tempfile::tempdir().unwrap();
        let (m, _) = tiny_target(dir.path());
        let mut d = Decoder::load(&m, &Device::Cpu, DType::F32).unwrap();
        let e = gpu_attention(&mut d, Some("flash")).expect_err("an unknown choice");
        let msg = e.to_string();
        assert!(
            msg.contains(ATTENTION_ENV) && msg.contains("\"flash\""),
            "{msg}"
        );
        for choice in [None, Some("fused"), Some("plain"), Some("blocked")] {
            gpu_attention(&mut d, choice).unwrap();
            assert!(!d.uses_gpu_attention(), "{choice:?}");
        }
        let GpuAttentionUse::Refused(why) = d.use_gpu_attention().unwrap() else {
            panic!("the kernel served a decoder on the CPU");
        };
        assert!(why.contains("CUDA device") && why.contains("F32"), "{why}");
    }

    /// HSPIPE_CUDA_FREED_MEMORY: unset is keep, keep and release are themselves, anything else
    /// is an error naming the variable and the value.
    #[test]
    fn the_freed_memory_choice_is_keep_or_release() {
        use cuda::pool::FreedMemory::{Keep, Release};
        for (choice, want) in [
            (None, Keep),
            (Some("keep"), Keep),
            (Some("release"), Release),
        ] {
            assert_eq!(freed_memory(choice).unwrap(), want, "{choice:?}");
        }
        let msg = freed_memory(Some("Keep")).unwrap_err().to_string();
        assert!(
            msg.contains(FREED_MEMORY_ENV) && msg.contains("\"Keep\""),
            "{msg}"
        );
    }

    /// HSPIPE_CUDA_TF32: unset is off, off and on are themselves, anything else (a `1`, a
    /// capital) is an error naming the variable and the value.
    #[test]
    fn the_tf32_choice_is_off_or_on() {
        for (choice, want) in [(None, false), (Some("off"), false), (Some("on"), true)] {
            assert_eq!(tf32(choice).unwrap(), want, "{choice:?}");
        }
        for bad in ["1", "On", ""] {
            let msg = tf32(Some(bad)).unwrap_err().to_string();
            assert!(
                msg.contains(TF32_ENV) && msg.contains(&format!("{bad:?}")),
                "{msg}"
            );
        }
    }

    /// The GPU's layout (`write_stacked`: stacked and converted on the device, copied once)
    /// writes the same bytes as the CPU's per-layer scatter, in every dtype.
    #[test]
    fn the_stacked_write_lays_out_the_layers_as_the_scatter_does() {
        let (t, h) = (5, 3);
        let layers: Vec<Tensor> = (0..3)
            .map(|li| {
                let v: Vec<f32> = (0..t * h).map(|i| (li * 100 + i) as f32 * 0.37).collect();
                Tensor::from_vec(v, (t, h), &Device::Cpu).unwrap()
            })
            .collect();
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let n = t * layers.len() * h * dtype.size();
            let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
            for (li, x) in layers.iter().enumerate() {
                write_layer(x, dtype, li, layers.len(), h, &mut want).unwrap();
            }
            write_stacked(&layers, dtype, &mut got).unwrap();
            assert_eq!(got, want, "{dtype:?}");
            assert!(write_stacked(&layers, dtype, &mut got[1..]).is_err());
        }
    }

    /// The GPU's target computes in bf16; the same code runs in bf16 on the CPU, so its numbers
    /// are checked here against the f32 forward (the oracle-checked one) on the same weights.
    /// Tolerance: every captured state within 5% of its layer's largest magnitude (bf16 keeps 8
    /// bits of mantissa, 0.4% per rounding, over four layers of sums), and the greedy tokens the
    /// same at 90% of positions at least (a near tie in a random model may flip).
    #[test]
    fn the_bf16_target_writes_the_f32_targets_states_within_bf16_tolerance() {
        let dir = tempfile::tempdir().unwrap();
        let (m, mut cfg) = tiny_target(dir.path());
        cfg.model.dtype = Dtype::F32;
        Candle::CPU.settle(&mut cfg, Settling::New).unwrap();
        let seq_lens = [12u32, 9];
        let ids: Vec<u32> = (0..21).map(|i| (i * 31 + 7) % 290 + 5).collect();
        let run = |dtype: DType| {
            let place = Placement {
                device: Device::Cpu,
                target_dtype: dtype,
            };
            let t = CandleTarget::load_at(&m, &cfg, &place).unwrap();
            let h = t.decoder().config().hidden_size;
            let mut states = vec![0u8; ids.len() * 2 * h * 4];
            let mut tokens = vec![0u8; ids.len() * 4];
            let out = TargetOut {
                hidden_states: &mut states,
                target_tokens: &mut tokens,
            };
            t.run(&ids, &seq_lens, out, true).unwrap();
            let f = |b: &[u8]| -> Vec<f32> {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            };
            let u = |b: &[u8]| -> Vec<u32> {
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            };
            (f(&states), u(&tokens), h)
        };
        let (want, want_tokens, h) = run(DType::F32);
        let (got, got_tokens, _) = run(DType::BF16);
        assert_eq!(got.len(), want.len());
        assert_ne!(got, want, "the bf16 forward computed in f32");
        for layer in 0..2 {
            let of = |v: &[f32]| -> Vec<f32> {
                v.chunks_exact(h)
                    .skip(layer)
                    .step_by(2)
                    .flatten()
                    .copied()
                    .collect()
            };
            let (w, g) = (of(&want), of(&got));
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = w
                .iter()
                .zip(&g)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                scale > 0.0 && worst <= 0.05 * scale,
                "layer {layer}: off by {worst} at scale {scale}"
            );
        }
        let same = want_tokens
            .iter()
            .zip(&got_tokens)
            .filter(|(a, b)| a == b)
            .count();
        assert!(
            same * 10 >= want_tokens.len() * 9,
            "{same} of {} greedy tokens agree",
            want_tokens.len()
        );
    }
}
