//! The candle backend: a real target (an HF model directory run by `model::Decoder`) on the CPU;
//! the same code takes a GPU once candle's CUDA device is built in (the CUDA issue).
//!
//! The target writes the captured layers `[tokens x layers x hidden]` in the slot's dtype and
//! the greedy next tokens into the slot. The drafter is a DFlash drafter (`dflash.rs`) trained
//! on them; the batches' checksums are what it verifies, the states being real.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use model::{ArchConfig, Decoder, Need};
use proto::{Dtype, PipelineConfig, WorkerName};

use crate::mock::{self, Sim};
use crate::{DrafterBackend, GpuError, Maker, TargetBackend, TargetOut};

pub struct Candle;

/// The model directory the config names, or the error that says how to name one.
pub(crate) fn model_dir(cfg: &PipelineConfig) -> Result<&Path, GpuError> {
    cfg.model.path.as_deref().ok_or_else(|| {
        GpuError::Config(
            "the candle backend runs a real model: name its HF directory with --model DIR (or [model] path); `launcher make-model DIR` makes a tiny one".into(),
        )
    })
}

/// The decoder layers to capture: the config's, or SpecForge's rule for `model.layers`.
pub fn layer_ids(cfg: &PipelineConfig, arch: &ArchConfig) -> Result<Vec<usize>, GpuError> {
    let n = arch.num_hidden_layers;
    let ids = match &cfg.model.target_layer_ids {
        Some(ids) => {
            let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
            model::capture::check_layer_ids(&ids, n)?;
            ids
        }
        None => model::capture::default_layer_ids(n, cfg.model.layers as usize)?,
    };
    Ok(ids)
}

impl Maker for Candle {
    fn built(&self) -> bool {
        true
    }

    fn settle(&self, cfg: &mut PipelineConfig) -> Result<(), GpuError> {
        let dir = model_dir(cfg)?;
        let arch = ArchConfig::load(dir)?;
        let ids = layer_ids(cfg, &arch)?;
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
        Ok(())
    }

    fn target(
        &self,
        cfg: &PipelineConfig,
        name: WorkerName,
    ) -> Result<Box<dyn TargetBackend + Send>, GpuError> {
        Ok(Box::new(CandleTarget::new(cfg, name)?))
    }

    fn drafter(
        &self,
        cfg: &PipelineConfig,
        name: Option<WorkerName>,
    ) -> Result<Box<dyn DrafterBackend + Send>, GpuError> {
        Ok(Box::new(crate::dflash::DflashDrafter::new(cfg, name)?))
    }

    fn drafter_sizes(&self, cfg: &PipelineConfig) -> Result<(usize, usize), GpuError> {
        crate::dflash::sizes(cfg)
    }
}

/// A frozen HF model computing a batch's captured layers and greedy tokens.
pub struct CandleTarget {
    decoder: Decoder,
    layers: Vec<usize>,
    dtype: Dtype,
    /// The faults injected into this worker (crash or hang after N batches); no simulated time.
    sim: Sim,
}

impl CandleTarget {
    /// Worker `name`'s target under `cfg`, loaded once from the model directory.
    pub fn new(cfg: &PipelineConfig, name: WorkerName) -> Result<CandleTarget, GpuError> {
        let faults = cfg.faults_for(name);
        mock::start(&faults);
        let dir = model_dir(cfg)?;
        let t = CandleTarget::load(dir, cfg)?;
        Ok(CandleTarget {
            sim: Sim::new(f64::INFINITY, faults),
            ..t
        })
    }

    /// Loads the model in `dir` for the layers and dtype `cfg` names (the launcher's `capture`
    /// uses this without a worker), checking that its states fit the ring's slots.
    pub fn load(dir: &Path, cfg: &PipelineConfig) -> Result<CandleTarget, GpuError> {
        let decoder = Decoder::load(dir, &Device::Cpu, DType::F32)?;
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
        })
    }

    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    pub fn layers(&self) -> &[usize] {
        &self.layers
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
        let got = self.decoder.forward(
            input_ids,
            seq_lens,
            &Need {
                layers: &self.layers,
                final_hidden: false,
                tokens,
            },
        )?;
        let l = self.layers.len();
        for (li, x) in got.layers.iter().enumerate() {
            write_layer(x, self.dtype, li, l, h, out.hidden_states)?;
        }
        match got.tokens {
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
