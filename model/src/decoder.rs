//! The dense decoder that `qwen3`, `qwen2` and `llama` all are, with the differences as flags of
//! [`ArchConfig`] (one file for the family, not one per model type: they share every line but
//! the flags).
//!
//! [`Decoder::forward`] runs a batch of concatenated sequences at once: the projections and MLPs
//! over all tokens together (big matrix products), attention within each sequence only, rope
//! positions restarting at 0 for each. It returns the outputs of the decoder layers asked for
//! (HF's `hidden_states[i + 1]` for layer `i`), and, when asked, the final normed state and the
//! greedy next token at every position, the LM head computed in chunks of positions so a real
//! vocabulary never needs a `positions x vocab` tensor. It stops after the last layer it needs.
//!
//! Inference only: candle's fused kernels used here (`rms_norm`, `rope_thd`,
//! `softmax_last_dim`) have no backward pass, so nothing trained may call this forward.
//!
//! Length: past 500 lines: the loading, the layer and the forward are one model, as in an HF
//! modeling file.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};

use crate::attention::{self, Plan};
use crate::config::ArchConfig;
use crate::fused::{GpuAttention, GpuAttentionUse, Launch};
use crate::rope::Rope;
use crate::weights::Weights;
use crate::{ModelError, Result};
use cuda::attention::Loads;

/// What a forward must produce.
#[derive(Clone, Debug, Default)]
pub struct Need<'a> {
    /// Decoder layers whose outputs to return, in this order.
    pub layers: &'a [usize],
    /// The state after the final norm (HF's last `hidden_states`).
    pub final_hidden: bool,
    /// The greedy next token at every position (argmax of the LM head).
    pub tokens: bool,
}

/// What a forward produced, for `tokens` positions.
pub struct Output {
    /// One `[tokens, hidden]` tensor per layer asked for, in order.
    pub layers: Vec<Tensor>,
    pub final_hidden: Option<Tensor>,
    /// u32 `[tokens]` on the model's device: left there, so a GPU's caller can copy it out
    /// asynchronously with the states ([`Output::token_ids`] copies it to the host now). Every
    /// one is [`NON_FINITE`] if a forward checked on the device computed NaN or infinities.
    pub tokens: Option<Tensor>,
}

/// The greedy token a forward checked on the device ([`Decoder::check_on_device`]) gives at
/// every position when it computed NaN or infinite values: no vocabulary reaches it, so whoever
/// reads the tokens, on the host, can tell ([`non_finite_marked`]).
pub const NON_FINITE: u32 = u32::MAX;

/// Whether greedy tokens read back from a forward (little-endian u32s) carry the
/// [`NON_FINITE`] mark.
pub fn non_finite_marked(tokens_le: &[u8]) -> bool {
    tokens_le
        .chunks_exact(4)
        .any(|t| u32::from_le_bytes(t.try_into().expect("4 bytes")) == NON_FINITE)
}

/// The error of a forward whose tokens carry the [`NON_FINITE`] mark.
pub fn non_finite_error() -> ModelError {
    non_finite("the decoder layers' outputs or the LM head's logits")
}

fn non_finite(what: &str) -> ModelError {
    ModelError::NonFinite(format!(
        "the forward computed NaN or infinite values in {what}: the weights or config.json are broken"
    ))
}

impl Output {
    /// The greedy tokens on the host (none if not asked for).
    /// An error if they carry the [`NON_FINITE`] mark.
    pub fn token_ids(&self) -> Result<Option<Vec<u32>>> {
        let Some(t) = &self.tokens else {
            return Ok(None);
        };
        let ids = t.to_vec1::<u32>()?;
        if ids.contains(&NON_FINITE) {
            return Err(non_finite_error());
        }
        Ok(Some(ids))
    }
}

/// How one forward attends: the blocked matrix products' plan, or the GPU kernel's launch.
enum Attend {
    Blocked(Plan),
    Fused(Launch),
}

/// A projection stored for the forward: the weight transposed to `[in, out]` and contiguous
/// (the matrix product reads it row by row), projections that read the same input fused into
/// one (q, k and v; gate and up), so each input is read once by one larger product.
struct Proj {
    wt: Tensor,
    bias: Option<Tensor>,
}

impl Proj {
    /// HF's `[out, in]` weights (and biases), concatenated along `out` in order.
    fn new(parts: Vec<(Tensor, Option<Tensor>)>) -> Result<Proj> {
        let ws: Vec<&Tensor> = parts.iter().map(|(w, _)| w).collect();
        let wt = Tensor::cat(&ws, 0)?.t()?.contiguous()?;
        let bias = if parts.iter().all(|(_, b)| b.is_some()) {
            let bs: Vec<&Tensor> = parts.iter().filter_map(|(_, b)| b.as_ref()).collect();
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        Ok(Proj { wt, bias })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.wt)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

struct Layer {
    ln1: Tensor,
    ln2: Tensor,
    /// q, k and v in one product: `[hidden, q_dim + 2 kv_dim]`.
    qkv: Proj,
    o: Proj,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// gate and up in one product: `[hidden, 2 intermediate]`.
    gate_up: Proj,
    down: Proj,
}

/// A linear layer's weight and bias (when the config has one), as `T`.
type Linear<T> = (T, Option<T>);

/// One decoder layer's tensors in the checkpoint, as `T`: loaded tensors for the forward, or
/// `()` when only the files' headers are checked ([`Decoder::check_weights`]). [`layer_parts`]
/// is the one list of their names and shapes that both read.
struct LayerParts<T> {
    ln1: T,
    ln2: T,
    q: Linear<T>,
    k: Linear<T>,
    v: Linear<T>,
    o: Linear<T>,
    q_norm: Option<T>,
    k_norm: Option<T>,
    gate: Linear<T>,
    up: Linear<T>,
    down: Linear<T>,
}

/// A getter of tensor `name` of shape `shape` ([`Weights::get`] or [`Weights::check`]).
type Get<'a, T> = &'a dyn Fn(&str, &[usize]) -> Result<T>;

/// Layer `l`'s tensors under `cfg`, each got by name and shape.
fn layer_parts<T>(cfg: &ArchConfig, l: usize, get: Get<'_, T>) -> Result<LayerParts<T>> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let p = format!("model.layers.{l}");
    let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear<T>> {
        let weight = get(&format!("{p}.{name}.weight"), &[out, inp])?;
        let bias = if bias {
            Some(get(&format!("{p}.{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok((weight, bias))
    };
    let norm = |n: &str, d: usize| get(&format!("{p}.{n}.weight"), &[d]);
    let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
    Ok(LayerParts {
        ln1: norm("input_layernorm", h)?,
        ln2: norm("post_attention_layernorm", h)?,
        q: linear("self_attn.q_proj", q_dim, h, cfg.qkv_bias)?,
        k: linear("self_attn.k_proj", kv_dim, h, cfg.qkv_bias)?,
        v: linear("self_attn.v_proj", kv_dim, h, cfg.qkv_bias)?,
        o: linear("self_attn.o_proj", h, q_dim, cfg.o_bias)?,
        q_norm: cfg
            .qk_norm
            .then(|| norm("self_attn.q_norm", cfg.head_dim))
            .transpose()?,
        k_norm: cfg
            .qk_norm
            .then(|| norm("self_attn.k_norm", cfg.head_dim))
            .transpose()?,
        gate: linear("mlp.gate_proj", i, h, cfg.mlp_bias)?,
        up: linear("mlp.up_proj", i, h, cfg.mlp_bias)?,
        down: linear("mlp.down_proj", h, i, cfg.mlp_bias)?,
    })
}

impl Layer {
    /// The layer's projections fused and laid out for the forward.
    fn new(t: LayerParts<Tensor>) -> Result<Layer> {
        Ok(Layer {
            ln1: t.ln1,
            ln2: t.ln2,
            qkv: Proj::new(vec![t.q, t.k, t.v])?,
            o: Proj::new(vec![t.o])?,
            q_norm: t.q_norm,
            k_norm: t.k_norm,
            gate_up: Proj::new(vec![t.gate, t.up])?,
            down: Proj::new(vec![t.down])?,
        })
    }
}

/// The final norm's weight, `[hidden]`.
fn final_norm<T>(cfg: &ArchConfig, get: Get<'_, T>) -> Result<T> {
    get("model.norm.weight", &[cfg.hidden_size])
}

/// The token embedding and the LM head, each `[vocab, hidden]` (the head is the embedding
/// itself when tied: the checkpoint then has no `lm_head.weight`). A drafter reads these two
/// alone from its target.
pub fn embed_and_head(cfg: &ArchConfig, w: &Weights) -> Result<(Tensor, Tensor)> {
    embed_and_head_with(cfg, &|name, shape| w.get(name, shape))
}

/// [`embed_and_head`] through any getter.
fn embed_and_head_with<T: Clone>(cfg: &ArchConfig, get: Get<'_, T>) -> Result<(T, T)> {
    let shape = [cfg.vocab_size, cfg.hidden_size];
    let embed = get("model.embed_tokens.weight", &shape)?;
    let lm_head = if cfg.tie_word_embeddings {
        embed.clone()
    } else {
        get("lm_head.weight", &shape).map_err(|e| match e {
            // A checkpoint saved tied whose config does not say so (HF's default is untied).
            ModelError::Missing { dir, tensor, .. } => ModelError::Missing {
                dir,
                tensor,
                hint: " (config.json: tie_word_embeddings is false, or absent, so the head is its own tensor)".into(),
            },
            e => e,
        })?
    };
    Ok((embed, lm_head))
}

/// A loaded dense decoder.
pub struct Decoder {
    cfg: ArchConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    rope: Rope,
    device: Device,
    dtype: DType,
    fused_attention: bool,
    /// The GPU's attention kernel, loaded and checked ([`Decoder::use_gpu_attention`]).
    gpu_attention: Option<Arc<GpuAttention>>,
    score_block: usize,
    logit_chunk: usize,
    /// Whether NaN and infinities are found on the device and the tokens marked, not read back
    /// at each layer ([`Decoder::check_on_device`]).
    check_on_device: bool,
    /// No NaN check at all: a benchmark's knob ([`Decoder::skip_checks_for_benchmark`]).
    skip_checks: bool,
}

/// Elements of one chunk of LM-head logits (positions x vocabulary): 16M f32 is 64 MiB.
const LOGIT_CHUNK: usize = 1 << 24;
/// Elements of one block of attention scores (heads x queries x keys): 8M f32 is 32 MiB.
const SCORE_BLOCK: usize = 1 << 23;

impl Decoder {
    /// Loads the model in `dir` (its `config.json` and safetensors weights) onto `device`,
    /// computing in `dtype`.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Decoder> {
        let cfg = ArchConfig::load(dir)?;
        let w = Weights::open(dir, device, dtype)?;
        Decoder::from_weights(cfg, &w)
    }

    /// Checks that the weights in `dir` are what `cfg` reads (every tensor there, of its
    /// shape, in a dtype that is read) from the files' headers alone: nothing is loaded, so a
    /// launcher finds a broken checkpoint before any worker starts, in moments at any size.
    pub fn check_weights(dir: &Path, cfg: &ArchConfig) -> Result<()> {
        let w = Weights::open(dir, &Device::Cpu, DType::F32)?;
        let get = |name: &str, shape: &[usize]| w.check(name, shape);
        embed_and_head_with(cfg, &get)?;
        for l in 0..cfg.num_hidden_layers {
            layer_parts(cfg, l, &get)?;
        }
        final_norm(cfg, &get)
    }

    /// Builds the decoder from `w`, every tensor checked against `cfg`'s shapes.
    pub fn from_weights(cfg: ArchConfig, w: &Weights) -> Result<Decoder> {
        let get = |name: &str, shape: &[usize]| w.get(name, shape);
        let (embed, lm_head) = embed_and_head_with(&cfg, &get)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Layer::new(layer_parts(&cfg, l, &get)?))
            .collect::<Result<Vec<_>>>()?;
        let norm = final_norm(&cfg, &get)?;
        Ok(Decoder {
            rope: Rope::new(&cfg),
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            device: w.device().clone(),
            dtype: w.dtype(),
            fused_attention: false,
            gpu_attention: None,
            score_block: SCORE_BLOCK,
            logit_chunk: LOGIT_CHUNK,
            check_on_device: !w.device().is_cpu(),
            skip_checks: false,
        })
    }

    pub fn config(&self) -> &ArchConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The token embedding, `[vocab, hidden]`.
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed
    }

    /// The LM head, `[vocab, hidden]` (the embedding itself when tied).
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Use candle's fused CPU flash attention instead of the blocked matrix products (the
    /// tests compare the two).
    pub fn set_fused_attention(&mut self, on: bool) {
        self.fused_attention = on;
    }

    /// Attention as one kernel per layer on the GPU (`cuda::attention`) instead of the blocked
    /// matrix products, for a bf16 model on a CUDA device: loads the kernel and runs its
    /// self-check there. [`GpuAttentionUse::Refused`] says why the kernel cannot serve (the CPU,
    /// another dtype, heads it is not built for, a GPU or driver that cannot load it, a check
    /// that did not pass); the decoder then keeps the matrix products. An error is the driver's
    /// during the check: the device is suspect.
    /// The kernel's ldmatrix form is tried first, then its plain one.
    pub fn use_gpu_attention(&mut self) -> Result<GpuAttentionUse> {
        self.use_gpu_attention_in(&Loads::PREFERENCE)
    }

    /// [`Decoder::use_gpu_attention`] with only `forms` of the kernel tried, in order (to
    /// compare them).
    pub fn use_gpu_attention_in(&mut self, forms: &[Loads]) -> Result<GpuAttentionUse> {
        let (gpu, used) = GpuAttention::settle(&self.device, self.dtype, &self.cfg, forms)?;
        self.gpu_attention = gpu.map(Arc::new);
        Ok(used)
    }

    /// Back to the blocked matrix products after [`Decoder::use_gpu_attention`].
    pub fn stop_gpu_attention(&mut self) {
        self.gpu_attention = None;
    }

    /// Whether attention runs as the GPU kernel ([`Decoder::use_gpu_attention`]).
    pub fn uses_gpu_attention(&self) -> bool {
        self.gpu_attention.is_some()
    }

    /// Which form of the GPU kernel runs the attention, if it does.
    pub fn gpu_attention_loads(&self) -> Option<Loads> {
        self.gpu_attention.as_ref().map(|g| g.loads())
    }

    /// Elements of one block of attention scores (default 8M); the tests make it small to
    /// check that blocking changes nothing.
    pub fn set_score_block(&mut self, elements: usize) {
        self.score_block = elements.max(1);
    }

    /// Elements of one chunk of LM-head logits (default 16M); the tests make it small to
    /// check that chunking changes nothing.
    pub fn set_logit_chunk(&mut self, elements: usize) {
        self.logit_chunk = elements.max(1);
    }

    /// How a forward finds NaN and infinities. On the CPU (the default there) the last layer's
    /// output, the final norm's and the logits are checked as they are made (a sum read back,
    /// confirmed element by element only when it is not finite), and the error names the first that
    /// is not finite. The last layer's output stands for every layer's (as below); when it is not
    /// finite the layers are run again, each checked, so the error names the first layer whose
    /// output is not. (`x - x` summed at every layer and on the logits cost 3-7% of a forward:
    /// BENCHMARKS.md, "The NaN checks' cost".) On a GPU (the default there) reading a verdict back
    /// would wait for the device, where the target worker overlaps one batch's forward with the
    /// last one's copy; so the verdict stays on the device: the last layer's output (a NaN or
    /// infinity in any layer's output stays in the residual stream to the last: each layer only
    /// adds to it) and the logits are summed as `x - x`, and every greedy token is set to
    /// [`NON_FINITE`] unless that is 0. The tokens are read anyway; [`Output::token_ids`] and the
    /// GPU target's write-back refuse marked ones. A forward that asks for no tokens is not checked
    /// this way. The tests turn it on for the CPU to run the GPU's check.
    pub fn check_on_device(&mut self, on: bool) {
        self.check_on_device = on;
    }

    /// A benchmark's knob, not a user's: forwards with no NaN check at all, host or device, so
    /// `bench-target --checks` can time what the checks cost. A forward run so can hand on
    /// garbage that looks like data.
    #[doc(hidden)]
    pub fn skip_checks_for_benchmark(&mut self, skip: bool) {
        self.skip_checks = skip;
    }

    /// Runs the concatenated sequences `ids` (lengths `seq_lens`) and returns what `need` asks.
    pub fn forward(&self, ids: &[u32], seq_lens: &[u32], need: &Need<'_>) -> Result<Output> {
        let total: u64 = seq_lens.iter().map(|&l| u64::from(l)).sum();
        if total != ids.len() as u64 {
            return Err(ModelError::Input(format!(
                "{} token ids but the sequence lengths sum to {total}",
                ids.len()
            )));
        }
        if let Some(pos) = seq_lens.iter().position(|&l| l == 0) {
            return Err(ModelError::Input(format!("sequence {pos} is empty")));
        }
        let vocab = self.cfg.vocab_size;
        if let Some((pos, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "token {id} at position {pos} is outside the model's vocabulary of {vocab}"
            )));
        }
        let n = self.layers.len();
        if let Some(&l) = need.layers.iter().find(|&&l| l >= n) {
            return Err(ModelError::Layer {
                layer: l,
                layers: n,
            });
        }
        let run = if need.final_hidden || need.tokens {
            n
        } else {
            need.layers.iter().map(|&l| l + 1).max().unwrap_or(0)
        };
        let t = ids.len();
        let mut positions = Vec::with_capacity(t);
        for &l in seq_lens {
            positions.extend(0..l);
        }
        let (cos, sin) = self.rope.tables(&positions, &self.device)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let lens = Tensor::new(seq_lens, &self.device)?;
        let attend = match &self.gpu_attention {
            Some(gpu) => Attend::Fused(Launch::new(gpu, seq_lens, &self.device)?),
            None => Attend::Blocked(Plan::new(
                seq_lens,
                self.cfg.num_attention_heads,
                self.score_block,
                &self.device,
                self.dtype,
            )?),
        };
        let ids = Tensor::new(ids, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let mut layers = vec![None; need.layers.len()];
        let check = !self.check_on_device && !self.skip_checks;
        for (li, layer) in self.layers.iter().enumerate().take(run) {
            x = self.layer(layer, &x, &cos, &sin, &lens, seq_lens, &attend)?;
            for (slot, _) in need.layers.iter().enumerate().filter(|(_, &l)| l == li) {
                layers[slot] = Some(x.clone());
            }
        }
        // The last layer's output checked for all of them: a NaN or an infinity in any layer's
        // output stays in the residual stream to the last (each layer only adds to it). Only
        // when it is found are the layers run again, each checked, to name the first.
        if check && run > 0 && !all_finite(&x)? {
            let mut y = self.embed.index_select(&ids, 0)?;
            for (li, layer) in self.layers.iter().enumerate().take(run) {
                y = self.layer(layer, &y, &cos, &sin, &lens, seq_lens, &attend)?;
                finite(&y, || format!("decoder layer {li}'s output"))?;
            }
            // A device that computed the layers differently the second time: the first run's
            // last layer is the one known to be bad.
            return Err(non_finite(&format!("decoder layer {}'s output", run - 1)));
        }
        let layers = layers.into_iter().flatten().collect();
        if !(need.final_hidden || need.tokens) {
            return Ok(Output {
                layers,
                final_hidden: None,
                tokens: None,
            });
        }
        let last = self.rms(&x, &self.norm)?;
        if check {
            finite(&last, || "the final norm's output".into())?;
        }
        let tokens = if need.tokens {
            let on_device = self.check_on_device && !self.skip_checks;
            let mut verdict = if on_device { Some(poison(&x)?) } else { None };
            let tokens = self.greedy(&last, check, verdict.as_mut())?;
            match verdict {
                Some(p) => Some(mark(&tokens, &p)?),
                None => Some(tokens),
            }
        } else {
            None
        };
        Ok(Output {
            layers,
            final_hidden: need.final_hidden.then_some(last),
            tokens,
        })
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            w,
            self.cfg.rms_norm_eps as f32,
        )?)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        lens: &Tensor,
        seq_lens: &[u32],
        attend: &Attend,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let t = x.dim(0)?;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let h = self.rms(x, &l.ln1)?;
        let qkv = l.qkv.forward(&h)?;
        let (qd, kvd) = (nh * hd, nkv * hd);
        let mut q = qkv.narrow(1, 0, qd)?.contiguous()?;
        let mut k = qkv.narrow(1, qd, kvd)?.contiguous()?;
        let v = qkv
            .narrow(1, qd + kvd, kvd)?
            .contiguous()?
            .reshape((t, nkv, hd))?;
        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
            q = self.rms(&q.reshape((t * nh, hd))?, qn)?;
            k = self.rms(&k.reshape((t * nkv, hd))?, kn)?;
        }
        let q =
            candle_nn::rotary_emb::rope_thd(&q.reshape((1, t, nh, hd))?.contiguous()?, cos, sin)?
                .reshape((t, nh, hd))?;
        let k =
            candle_nn::rotary_emb::rope_thd(&k.reshape((1, t, nkv, hd))?.contiguous()?, cos, sin)?
                .reshape((t, nkv, hd))?;
        let a = self.attend(&q, &k, &v, lens, seq_lens, attend)?;
        let x = (x + l.o.forward(&a.reshape((t, nh * hd))?)?)?;
        let h = self.rms(&x, &l.ln2)?;
        let gu = l.gate_up.forward(&h)?;
        let im = self.cfg.intermediate_size;
        let m = (candle_nn::ops::silu(&gu.narrow(1, 0, im)?)? * gu.narrow(1, im, im)?)?;
        Ok((x + l.down.forward(&m)?)?)
    }

    /// Causal attention within each sequence: `q` `[T, heads, d]`, `k`/`v` `[T, kv_heads, d]`:
    /// the GPU kernel when loaded ([`Decoder::use_gpu_attention`]), else the blocked matrix
    /// products of `attention.rs`, or candle's fused CPU flash kernel when asked for
    /// ([`Decoder::set_fused_attention`]).
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        lens: &Tensor,
        seq_lens: &[u32],
        attend: &Attend,
    ) -> Result<Tensor> {
        let plan = match attend {
            Attend::Fused(launch) => return launch.attend(q, k, v),
            Attend::Blocked(plan) => plan,
        };
        let scale = 1.0 / (self.cfg.head_dim as f64).sqrt();
        if self.fused_attention
            && self.device.is_cpu()
            && matches!(self.dtype, DType::F32 | DType::F16)
        {
            let max = seq_lens.iter().copied().max().unwrap_or(0) as usize;
            return Ok(candle_nn::attention::flash_attn_varlen_cpu(
                q,
                k,
                v,
                None,
                lens,
                lens,
                max,
                max,
                scale as f32,
                true,
                None,
                None,
            )?);
        }
        let c = &self.cfg;
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        attention::blocked(q, k, v, plan, nh, nkv, c.head_dim, scale)
    }

    /// Argmax of the LM head at every row of `last` (`[T, hidden]`), in chunks of rows: u32
    /// `[T]` on the device, nothing waited for. The logits are checked as they are made
    /// (`check`), or, with a `verdict` to add their [`poison`] to, on the device.
    fn greedy(
        &self,
        last: &Tensor,
        check: bool,
        mut verdict: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        let t = last.dim(0)?;
        let rows = (self.logit_chunk / self.cfg.vocab_size).max(1);
        let head = self.lm_head.t()?;
        let mut chunks = Vec::with_capacity(t.div_ceil(rows));
        let mut start = 0;
        while start < t {
            let n = rows.min(t - start);
            let logits = last.narrow(0, start, n)?.matmul(&head)?;
            match verdict.as_deref_mut() {
                Some(v) => *v = (&*v + poison(&logits)?)?,
                None if check => finite(&logits, || "the LM head's logits".into())?,
                None => {}
            }
            chunks.push(logits.argmax(D::Minus1)?);
            start += n;
        }
        if chunks.is_empty() {
            return Ok(Tensor::zeros(0, DType::U32, last.device())?);
        }
        Ok(Tensor::cat(&chunks, 0)?)
    }
}

/// That every element of `x` is finite, else [`ModelError::NonFinite`] naming `what`.
pub(crate) fn finite(x: &Tensor, what: impl FnOnce() -> String) -> Result<()> {
    if all_finite(x)? {
        return Ok(());
    }
    Err(non_finite(&what()))
}

/// Whether every element of `x` is finite (in any float dtype, with no copy to the host but a
/// sum). A NaN or an infinity makes any sum of it NaN or infinite, so a finite sum of `x` clears
/// it in one read, with nothing written. Finite elements can overflow a sum too, so a sum that
/// is not finite is confirmed by `x - x`'s (0 at a finite element, NaN elsewhere): two passes
/// and a tensor as large as `x` (BENCHMARKS.md, "The NaN checks' cost").
fn all_finite(x: &Tensor) -> Result<bool> {
    let scalar = |t: Tensor| -> Result<f32> { Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()?) };
    if scalar(x.sum_all()?)?.is_finite() {
        return Ok(true);
    }
    #[allow(clippy::eq_op)] // x - x on purpose: NaN where x is not finite.
    let exact = scalar((x - x)?.sum_all()?)?;
    Ok(exact == 0.0)
}

/// `x - x` summed, as an f32 scalar left on the device: 0 exactly when every element of `x` is
/// finite (`x - x` is 0 at a finite element and NaN at a NaN or an infinity), NaN otherwise.
/// Summed by [`crate::train::sum_all`], spread over the GPU: candle's `sum_all` is one thread
/// block, one SM, for the whole tensor, and the logits a forward checks are gigabytes (an 8B
/// model's 151,936-wide head over 8k tokens: 2.5 GB in bf16).
fn poison(x: &Tensor) -> Result<Tensor> {
    #[allow(clippy::eq_op)] // x - x on purpose: NaN where x is not finite.
    let sum = crate::train::sum_all(&(x - x)?)?.to_dtype(DType::F32)?;
    Ok(sum)
}

/// `tokens` as they are where `poison` is 0, every one [`NON_FINITE`] otherwise: all made on
/// the device (the 0 and the mark too: a scalar from the host would be a copy, which waits for
/// the device's queue).
fn mark(tokens: &Tensor, poison: &Tensor) -> Result<Tensor> {
    let fine = poison.eq(&poison.zeros_like()?)?;
    let fine = fine.broadcast_as(tokens.shape())?;
    let marked = Tensor::full(NON_FINITE, tokens.shape(), tokens.device())?;
    Ok(fine.where_cond(tokens, &marked)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finite values whose sum overflows are finite all the same (the sum's verdict is
    /// confirmed element by element); one NaN or infinity anywhere is not, whatever the others.
    #[test]
    fn all_finite_is_exact_where_a_sum_overflows() {
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        let big = f32::MAX / 2.0;
        assert!(all_finite(&t(&[big, big, big, 1.0])).unwrap());
        assert!(all_finite(&t(&[-big, -big, -big])).unwrap());
        assert!(all_finite(&t(&[0.0; 5])).unwrap());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(!all_finite(&t(&[1.0, bad, 2.0])).unwrap(), "{bad}");
            assert!(!all_finite(&t(&[big, big, bad])).unwrap(), "{bad}");
        }
        assert!(!all_finite(&t(&[f32::INFINITY, f32::NEG_INFINITY])).unwrap());
    }
}
