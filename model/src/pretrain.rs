//! `make-model --train`: the tiny Qwen3 trained on the built-in synthetic language (next-token
//! cross-entropy, AdamW), so it is a target worth drafting for: its greedy text follows the
//! language's chain instead of repeating the last token, as random small weights do.
//!
//! The forward here is a plain causal Qwen3 built from `train`'s differentiable ops over the
//! tensors `make` drew (their HF names); the model written afterwards is read back by the
//! inference [`Decoder`] for [`evaluate`], so the figures judge what a run loads.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dataset::language::{Language, SEED};

use crate::train::{self, linear, rms_norm, AdamW, AdamWConfig, Params};
use crate::{Decoder, ModelError, Need, Result};

/// How the target is trained.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainSpec {
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    pub seq_len: usize,
    pub lr: f64,
}

impl Default for TrainSpec {
    /// About a minute for a 2-layer tiny model on two cores (`make-model --train`'s defaults).
    fn default() -> Self {
        TrainSpec {
            steps: 1000,
            batch: 8,
            seq_len: 64,
            lr: 1e-2,
        }
    }
}

/// Sample ids of the target's training text: a stream of the language apart from a run's data
/// (which `data.seed` picks) and `launcher eval`'s held-out prompts.
const TRAIN_STREAM: u64 = 0x007a_26e7_0000_0000;
/// Sample ids of [`evaluate`]'s held-out text.
const EVAL_STREAM: u64 = 0x3e7a_1000_0000_0000;

/// The shape of the model being trained.
pub(crate) struct Shape {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub tied: bool,
    pub rope_theta: f64,
}

/// One causal forward of `ids` (`batch` sequences of `t` tokens): logits `[batch * t, vocab]`.
fn forward(p: &Params, s: &Shape, ids: &Tensor, batch: usize, t: usize) -> Result<Tensor> {
    let dev = ids.device();
    let eps = 1e-6;
    let embed = p.get("model.embed_tokens.weight");
    let mut x = embed.index_select(ids, 0)?;
    let (nh, nkv, d) = (s.heads, s.kv_heads, s.head_dim);
    let g = nh / nkv;
    let positions: Vec<u32> = (0..t as u32).collect();
    let (cos, sin) = crate::rope::Rope::plain(d, s.rope_theta).tables(&positions, dev)?;
    // Causal, tiled for the g query heads that share a kv head: [g * t, t].
    let mask: Vec<f32> = (0..g * t)
        .flat_map(|r| (0..t).map(move |j| if j <= r % t { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (g * t, t), dev)?;
    let scale = 1.0 / (d as f64).sqrt();
    for l in 0..s.layers {
        let w = |n: &str| p.get(&format!("model.layers.{l}.{n}"));
        let hn = rms_norm(&x, w("input_layernorm.weight"), eps)?;
        let qk = |n: &str| {
            Some(train::QkNorm {
                weight: w(n),
                eps,
                cos: &cos,
                sin: &sin,
            })
        };
        let proj = |n: &str| linear(&hn, w(&format!("self_attn.{n}_proj.weight")));
        let lead = [batch, t];
        let q = train::heads(&proj("q")?, &lead, nh, d, qk("self_attn.q_norm.weight"))?;
        let k = train::heads(&proj("k")?, &lead, nkv, d, qk("self_attn.k_norm.weight"))?;
        let v = train::heads(&proj("v")?, &lead, nkv, d, None)?;
        // Heads h = kv * g + i read kv head `kv`: [batch, kv, g * t, d].
        let q = q.reshape((batch, nkv, g * t, d))?;
        let scores = (q.matmul(&k.transpose(2, 3)?)? * scale)?.broadcast_add(&mask)?;
        let o = train::softmax(&scores)?
            .matmul(&v)?
            .reshape((batch, nh, t, d))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((batch * t, nh * d))?;
        x = (x + linear(&o, w("self_attn.o_proj.weight"))?)?;
        let hn = rms_norm(&x, w("post_attention_layernorm.weight"), eps)?;
        let gate = linear(&hn, w("mlp.gate_proj.weight"))?.silu()?;
        let up = linear(&hn, w("mlp.up_proj.weight"))?;
        x = (x + linear(&(gate * up)?, w("mlp.down_proj.weight"))?)?;
    }
    let x = rms_norm(&x, p.get("model.norm.weight"), eps)?;
    let head = if s.tied {
        embed
    } else {
        p.get("lm_head.weight")
    };
    linear(&x, head)
}

/// Mean next-token cross-entropy of `batch` sequences of `t` tokens.
fn loss(p: &Params, s: &Shape, seqs: &[Vec<u32>], dev: &Device) -> Result<Tensor> {
    let (b, t) = (seqs.len(), seqs[0].len());
    let flat: Vec<u32> = seqs.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(flat, b * t, dev)?;
    let logits = forward(p, s, &ids, b, t)?.reshape((b, t, s.vocab))?;
    let pred = logits
        .narrow(1, 0, t - 1)?
        .reshape((b * (t - 1), s.vocab))?;
    let next: Vec<u32> = seqs.iter().flat_map(|q| q[1..].iter().copied()).collect();
    let next = Tensor::from_vec(next, (b * (t - 1), 1), dev)?;
    let nll = (train::log_sum_exp(&pred)? - pred.gather(&next, 1)?)?;
    Ok(nll.mean_all()?)
}

/// Refuses a spec that trains nothing, or on NaN (`make-model` checks it before it writes).
pub(crate) fn check(ts: &TrainSpec) -> Result<()> {
    if ts.steps == 0 || ts.batch == 0 || ts.seq_len < 2 {
        return Err(ModelError::Spec(
            "training needs at least one step, one sequence and sequences of 2 tokens".into(),
        ));
    }
    if !(ts.lr.is_finite() && ts.lr > 0.0) {
        return Err(ModelError::Spec(format!(
            "learning rate {} must be a positive number",
            ts.lr
        )));
    }
    Ok(())
}

/// Trains `params` (the model's tensors by HF name) on the language over `vocab` ids; calls
/// `progress(step, loss)` after each step. Returns the first and last steps' losses.
pub(crate) fn train(
    params: &mut Params,
    s: &Shape,
    ts: &TrainSpec,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<(f64, f64)> {
    check(ts)?;
    let dev = Device::Cpu;
    let lang = Language::new(0, s.vocab as u32, SEED);
    let mut opt = AdamW::new(
        AdamWConfig {
            lr: ts.lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_steps: (ts.steps / 20).max(1) as u64,
            total_steps: ts.steps as u64,
            min_lr_ratio: 0.1,
            clip: 1.0,
        },
        params.len(),
    );
    let mut w = params.flat()?;
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..ts.steps {
        let seqs: Vec<Vec<u32>> = (0..ts.batch)
            .map(|j| {
                lang.sample(
                    TRAIN_STREAM ^ (step * ts.batch + j) as u64,
                    ts.seq_len as u32,
                )
            })
            .collect();
        let l = loss(params, s, &seqs, &dev)?;
        let grads = l.backward()?;
        let mut g = vec![0f32; w.len()];
        params.add_grads(&grads, &mut g)?;
        opt.update(&mut w, &g, 1.0);
        params.set_flat(&w)?;
        last = f64::from(l.to_scalar::<f32>()?);
        if step == 0 {
            first = last;
        }
        progress(step + 1, last);
    }
    Ok((first, last))
}

/// How well a target predicts the built-in language, on held-out text.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LanguageFit {
    /// Share of positions (past the first two) whose greedy next token is the text's next one.
    pub accuracy: f64,
    /// What always guessing one id would score: 1 / the language's ids.
    pub chance: f64,
    /// Share of positions whose greedy next token is the language's likeliest successor.
    pub follows_chain: f64,
    /// Share of greedy decoding steps that repeat the last token.
    pub greedy_repeats: f64,
}

/// Measures the target in `dir` on `samples` held-out samples of the language (the inference
/// decoder, as a run loads it).
pub fn evaluate(dir: &Path, samples: usize) -> Result<LanguageFit> {
    let d = Decoder::load(dir, &Device::Cpu, DType::F32)?;
    let vocab = d.config().vocab_size as u32;
    let lang = Language::new(0, vocab, SEED);
    let none = Need {
        layers: &[],
        final_hidden: false,
        tokens: true,
    };
    let (mut hit, mut chain, mut n) = (0usize, 0usize, 0usize);
    let (mut repeats, mut steps) = (0usize, 0usize);
    for i in 0..samples as u64 {
        let text = lang.sample(EVAL_STREAM ^ i, 64);
        let out = d.forward(&text, &[text.len() as u32], &none)?;
        let greedy = out.token_ids()?.unwrap_or_default();
        for p in 2..text.len() - 1 {
            hit += usize::from(greedy[p] == text[p + 1]);
            chain += usize::from(greedy[p] == lang.likeliest(text[p - 1], text[p]));
            n += 1;
        }
        // Greedy decoding from the first 16 tokens.
        let mut ids = text[..16].to_vec();
        for _ in 0..32 {
            let out = d.forward(&ids, &[ids.len() as u32], &none)?;
            let next = *out.token_ids()?.unwrap_or_default().last().unwrap_or(&0);
            repeats += usize::from(Some(&next) == ids.last());
            steps += 1;
            ids.push(next);
        }
    }
    Ok(LanguageFit {
        accuracy: hit as f64 / n.max(1) as f64,
        chance: 1.0 / f64::from(vocab.min(dataset::language::ACTIVE)),
        follows_chain: chain as f64 / n.max(1) as f64,
        greedy_repeats: repeats as f64 / steps.max(1) as f64,
    })
}
