//! The target's attention on a GPU as one kernel per layer ([`cuda::attention`]): a custom op
//! over q, k and v queued on candle's stream, the batch's sequence starts put on the device once
//! per forward. The kernel keeps the scores on chip, where [`crate::attention::blocked`] writes
//! every block of them to memory, masks, softmaxes and reads them back, as transformers' eager
//! attention does: on an H200 the blocked target ran at 0.90x eager's speed and 0.62x sdpa's,
//! whose kernel is fused (BENCHMARKS.md; the gap was not profiled).
//!
//! candle's CUDA types exist only in the build with `--features cuda`, so `imp` holds this
//! crate's one `cfg`: without it, loading says the build has no CUDA device. The kernel's launch
//! and checks are the `cuda` crate's, compiled and linted in every build.

use std::sync::Arc;

use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use cuda::attention::{Causal, Heads, Loads};

use crate::config::ArchConfig;
use crate::{ModelError, Result};

/// What [`crate::decoder::Decoder::use_gpu_attention`] settled.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuAttentionUse {
    /// The kernel runs the attention: which form, its self-check's largest error against f64,
    /// and why the forms tried before it (the ldmatrix form, when the plain one runs) did not
    /// serve.
    Fused {
        loads: Loads,
        self_check_error: f64,
        passed_over: Option<String>,
    },
    /// The kernel cannot serve this decoder (the CPU, another dtype, heads it is not built for,
    /// a driver or GPU that cannot load it, a self-check that did not pass): why. The decoder
    /// keeps the blocked matrix products.
    Refused(String),
}

/// The kernel loaded on the decoder's device and checked there, for the decoder's heads.
// Read by `imp::forward`, which the build without CUDA does not have.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct GpuAttention {
    causal: Causal,
    heads: Heads,
    scale: f32,
}

impl GpuAttention {
    /// Which form of the kernel this is.
    pub(crate) fn loads(&self) -> Loads {
        self.causal.loads()
    }

    /// The kernel for a decoder of `cfg` computing in `dtype` on `device`, when it can serve
    /// one (a bf16 model on a CUDA device, heads it is built for, a module the driver loads, a
    /// self-check that passed), with what was settled
    /// ([`crate::decoder::Decoder::use_gpu_attention`]). An error is the driver's during the
    /// check: the device is then suspect (a fault ends a CUDA context), and the worker should
    /// stop rather than go on without the kernel.
    /// `forms`: the kernel's forms to try, in order of preference.
    pub(crate) fn settle(
        device: &Device,
        dtype: DType,
        cfg: &ArchConfig,
        forms: &[Loads],
    ) -> Result<(Option<GpuAttention>, GpuAttentionUse)> {
        let refused = |why: String| Ok((None, GpuAttentionUse::Refused(why)));
        if !device.is_cuda() || dtype != DType::BF16 {
            return refused(format!(
                "the fused attention kernel takes a bf16 model on a CUDA device, not {dtype:?} on {:?}",
                device.location()
            ));
        }
        let heads = Heads {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        if !heads.supported() {
            return refused(format!(
                "the fused attention kernel is built for head dims {:?} with query heads a \
                 positive multiple of the kv heads; this model has head dim {}, {} heads over {}",
                cuda::attention::HEAD_DIMS,
                heads.head_dim,
                heads.heads,
                heads.kv_heads
            ));
        }
        // The first form that loads and passes (the caller's order: ldmatrix first, then plain),
        // with why each one before it did not.
        let mut passed_over = Vec::new();
        for &loads in forms {
            let causal = match imp::load(device, loads) {
                Ok(c) => c,
                Err(why) => {
                    passed_over.push(format!("{loads:?}: {why}"));
                    continue;
                }
            };
            let check = imp::self_check(device, &causal, heads.head_dim)?;
            if !check.passed() {
                passed_over.push(format!("{loads:?}: {check}"));
                continue;
            }
            let gpu = GpuAttention {
                causal,
                heads,
                scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            };
            let used = GpuAttentionUse::Fused {
                loads,
                self_check_error: check.worst,
                passed_over: (!passed_over.is_empty()).then(|| passed_over.join("; ")),
            };
            return Ok((Some(gpu), used));
        }
        refused(format!(
            "no form of the fused attention kernel asked for ({forms:?}) serves: {}",
            passed_over.join("; ")
        ))
    }
}

/// One forward's launch: the sequences' starts on the device, their token count and the
/// longest's length.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Launch {
    gpu: Arc<GpuAttention>,
    starts: Tensor,
    tokens: usize,
    seqs: usize,
    longest: usize,
}

impl Launch {
    pub(crate) fn new(
        gpu: &Arc<GpuAttention>,
        seq_lens: &[u32],
        device: &Device,
    ) -> Result<Launch> {
        let mut starts = Vec::with_capacity(seq_lens.len() + 1);
        starts.push(0u32);
        for &l in seq_lens {
            starts.push(starts[starts.len() - 1] + l);
        }
        Ok(Launch {
            gpu: gpu.clone(),
            tokens: starts[seq_lens.len()] as usize,
            starts: Tensor::new(starts, device)?,
            seqs: seq_lens.len(),
            longest: seq_lens.iter().copied().max().unwrap_or(0) as usize,
        })
    }

    /// Causal attention within each sequence: `q` `[T, heads, d]`, `k`/`v` `[T, kv_heads, d]`
    /// in bf16; returns `[T, heads, d]`.
    pub(crate) fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        // The kernel touches only rows below the last start, so the starts must end at the
        // token count (the launch's promise).
        if q.dim(0)? != self.tokens {
            return Err(ModelError::Input(format!(
                "fused attention: {} query rows for sequences of {} tokens in all",
                q.dim(0)?,
                self.tokens
            )));
        }
        // The kernel reads keys and values in 16-byte vectors from their buffers' starts: a
        // tensor contiguous from an aligned offset as it is, else a fresh copy (a view into
        // another's storage may start anywhere; `copy` would keep its layout).
        let own = |t: &Tensor| -> Result<Tensor> {
            let (_, l) = t.storage_and_layout();
            let aligned = l.is_contiguous() && l.start_offset() % 8 == 0;
            Ok(if aligned {
                t.clone()
            } else {
                t.force_contiguous()?
            })
        };
        Ok(own(q)?.apply_op3_no_bwd(&own(k)?, &own(v)?, self)?)
    }
}

impl CustomOp3 for Launch {
    fn name(&self) -> &'static str {
        "hspipe-causal-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "the fused attention kernel runs on CUDA only".into(),
        ))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        imp::forward(self, (q, ql), (k, kl), (v, vl))
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::{CudaStorage, Device, Layout, Shape, Storage};
    use cuda::attention::{Causal, Loads, SelfCheck};
    use cuda::cudarc::driver::CudaView;
    use half::bf16;

    use super::Launch;
    use crate::{ModelError, Result};

    /// The module loaded on `device`'s context, or why not (a driver or GPU that cannot take
    /// its PTX: nothing ran, so nothing is broken).
    pub(super) fn load(device: &Device, loads: Loads) -> std::result::Result<Causal, String> {
        let dev = device.as_cuda_device().map_err(|e| e.to_string())?;
        Causal::load(dev.cuda_stream().context(), loads).map_err(|e| e.to_string())
    }

    pub(super) fn self_check(
        device: &Device,
        causal: &Causal,
        head_dim: usize,
    ) -> Result<SelfCheck> {
        let stream = device.as_cuda_device()?.cuda_stream();
        causal
            .self_check(&stream, head_dim)
            .map_err(|e| ModelError::Input(format!("the fused attention kernel's self-check: {e}")))
    }

    fn view<'a>(
        (s, l): (&'a CudaStorage, &Layout),
        what: &str,
    ) -> candle_core::Result<CudaView<'a, bf16>> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("fused attention's {what} are not contiguous");
        };
        Ok(s.as_cuda_slice::<bf16>()?.slice(a..b))
    }

    pub(super) fn forward(
        l: &Launch,
        q: (&CudaStorage, &Layout),
        k: (&CudaStorage, &Layout),
        v: (&CudaStorage, &Layout),
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (starts, sl) = l.starts.storage_and_layout();
        let Storage::Cuda(starts) = &*starts else {
            candle_core::bail!("fused attention's sequence starts are not on the GPU");
        };
        let Some((a, b)) = sl.contiguous_offsets() else {
            candle_core::bail!("fused attention's sequence starts are not contiguous");
        };
        let starts = starts.as_cuda_slice::<u32>()?.slice(a..b);
        let dev = &q.0.device;
        let stream = dev.cuda_stream();
        let shape = q.1.shape().clone();
        // Zeroed, though the kernel writes every row: a memset of the output is a few
        // microseconds beside the attention, and no row can be left as garbage.
        let mut out = stream
            .alloc_zeros::<bf16>(shape.elem_count())
            .map_err(|e| candle_core::Error::Msg(format!("fused attention's output: {e}")))?;
        // SAFETY: the starts are the running sums of the sequence lengths from 0, and
        // `Launch::attend` checked that they end at the query rows' count; k and v start at an
        // offset that is a multiple of 8 elements (16 bytes) in a driver allocation (256-byte
        // aligned), as `attend` made sure.
        unsafe {
            l.gpu.causal.launch(
                &stream,
                l.gpu.heads,
                &view(q, "queries")?,
                &view(k, "keys")?,
                &view(v, "values")?,
                &starts,
                l.seqs,
                l.longest,
                l.gpu.scale,
                &mut out,
            )
        }
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape))
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use candle_core::{CudaStorage, Device, Layout, Shape};
    use cuda::attention::{Causal, Loads, SelfCheck};

    use super::Launch;
    use crate::{ModelError, Result};

    pub(super) fn load(_: &Device, _: Loads) -> std::result::Result<Causal, String> {
        Err("this build has no CUDA device (scripts/build-cuda.sh makes one)".into())
    }

    pub(super) fn self_check(_: &Device, _: &Causal, _: usize) -> Result<SelfCheck> {
        Err(ModelError::Input("this build has no CUDA device".into()))
    }

    pub(super) fn forward(
        _: &Launch,
        _: (&CudaStorage, &Layout),
        _: (&CudaStorage, &Layout),
        _: (&CudaStorage, &Layout),
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "this build has no CUDA device".into(),
        ))
    }
}
