//! The DFlash drafter (block-diffusion drafting conditioned on the target's captured layers), as
//! SpecForge and the DFlash authors define it, trainable on candle.
//!
//! - Context: `ctx = hidden_norm(fc(concat of the k captured layers))`, one row per token.
//! - Blocks: each anchor `a` drafts `[token[a], MASK x (B-1)]`, embedded with the target's
//!   frozen `embed_tokens`, at RoPE positions `a .. a+B-1` (the context keeps its own).
//! - Layers: Qwen3 decoder layers (q/k norm, RoPE, SiLU MLP) whose keys and values are
//!   `[kv(ctx); kv(block)]`: a block's queries see context positions `j < a` and every position
//!   of their own block, never another block.
//! - Head: final norm, then the target's frozen `lm_head`; block position `k >= 1` predicts the
//!   token at `a + k`.
//!
//! The loss ([`Dflash::loss_and_grads`]) runs the head over the weighted positions in chunks, so
//! no `positions x vocab` tensor exists at a real vocabulary: each chunk's gradient at the
//! forward's last state is written by hand ([`train::head_loss`]), and the summed state gradient
//! then goes back through the layers once. The attention's core has its backward written by
//! hand too (`draft_attention`); with both, the gradient on the CPU took 0.69x the time of
//! candle's autograd over the same ops, in half the memory, at a shape whose scores dominate
//! (0.86x at one whose scores matter less; BENCHMARKS). A sequence's anchors are attended in
//! groups by position (each spanning fewer than 512 positions), each group reading the context
//! only up to its last anchor: scores masked to nothing are mostly not made (about half of
//! them, anchors spread over a long sequence). A batch too big for one backward graph
//! runs in parts ([`Dflash::loss_and_grads_parts`]); a sequence whose blocks span parts has its
//! context (fc, hidden norm, each layer's context keys and values) projected once and cut from
//! the graph: each part adds its gradient of the cut, and the sum goes back through the
//! projection after the sequence's last part.
//!
//! The trained parameters are named as the exported `model.safetensors` names them
//! (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...): [`export`](Dflash::export) writes
//! them as they are.
//!
//! Length: about 1350 lines: the config, its export and the checks of one read back, the
//! forward, the batch's anchors and labels, the chunked loss and the parts' shared context are
//! one model.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde_json::json;

use crate::config::ArchConfig;
use crate::draft_attention;
pub use crate::draft_attention::Backward as AttentionBackward;
use crate::rope::Rope;
use crate::train::{self, linear, rms_norm, Grads, Init, Params};
use crate::weights::Weights;
use crate::{ModelError, Result};

/// The largest block a drafter drafts (the run's `dflash.block_size` bound, `proto`'s
/// `MAX_BLOCK_SIZE`: this crate does not depend on `proto`).
pub const MAX_BLOCK_SIZE: usize = 1024;

/// The drafter's shape, and what its export's `config.json` says.
#[derive(Clone, Debug, PartialEq)]
pub struct DflashConfig {
    pub hidden: usize,
    /// Drafter decoder layers.
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub block_size: usize,
    /// The target's decoder layers the context is made of (DFlash's `target_layer_ids`).
    pub target_layer_ids: Vec<usize>,
    /// The target's decoder layers (`num_target_layers`).
    pub num_target_layers: usize,
    pub mask_token_id: u32,
}

/// Where a mask token id comes from when the config names none: the tokenizer's mask token,
/// else the last id of the vocabulary.
const MASK_TOKENS: &[&str] = &["<|mask|>", "<mask>", "[MASK]", "<|MASK|>"];

/// The mask token id for a drafter of the target in `dir`: `configured`, else the tokenizer's
/// mask token (`<|mask|>`, `<mask>`, `[MASK]` in `tokenizer.json`'s added tokens), else
/// `vocab - 1`, the documented fallback.
pub fn mask_token_id(dir: &Path, vocab: usize, configured: Option<u32>) -> Result<u32> {
    if let Some(id) = configured {
        if id as usize >= vocab {
            return Err(ModelError::Input(format!(
                "dflash.mask_token_id = {id} is outside the target's vocabulary of {vocab}: name a token the target has, or leave it out (the tokenizer's mask token, else the vocabulary's last id)"
            )));
        }
        return Ok(id);
    }
    let path = dir.join("tokenizer.json");
    // Not a FIFO's open, which would wait for a writer for ever: read_regular refuses it.
    if let Ok(text) = atomic_file::read_regular(&path) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
            let added = v["added_tokens"].as_array().cloned().unwrap_or_default();
            for t in added {
                let content = t["content"].as_str().unwrap_or("");
                if MASK_TOKENS.contains(&content) {
                    if let Some(id) = t["id"].as_u64().filter(|&id| (id as usize) < vocab) {
                        return Ok(id as u32);
                    }
                }
            }
        }
    }
    Ok(vocab as u32 - 1)
}

impl DflashConfig {
    /// A drafter for `target`, conditioned on `target_layer_ids`, of `layers` decoder layers
    /// (default: one per captured layer), otherwise shaped like the target.
    pub fn for_target(
        target: &ArchConfig,
        target_layer_ids: Vec<usize>,
        layers: Option<usize>,
        block_size: usize,
        mask_token_id: u32,
    ) -> DflashConfig {
        DflashConfig {
            hidden: target.hidden_size,
            layers: layers.unwrap_or(target_layer_ids.len()).max(1),
            heads: target.num_attention_heads,
            kv_heads: target.num_key_value_heads,
            head_dim: target.head_dim,
            intermediate: target.intermediate_size,
            vocab: target.vocab_size,
            rms_norm_eps: target.rms_norm_eps,
            rope_theta: target.rope_theta,
            max_position_embeddings: target.max_position_embeddings,
            block_size: block_size.max(2),
            num_target_layers: target.num_hidden_layers,
            target_layer_ids,
            mask_token_id,
        }
    }

    /// Every trained parameter: name (the export's), shape, initialisation, in order.
    pub fn param_specs(&self) -> Vec<(String, Vec<usize>, Init)> {
        let (h, d, i) = (self.hidden, self.head_dim, self.intermediate);
        let (q, kv) = (self.heads * d, self.kv_heads * d);
        let w = Init::Normal(0.02);
        let mut out = vec![
            (
                "fc.weight".to_string(),
                vec![h, self.target_layer_ids.len() * h],
                w,
            ),
            ("hidden_norm.weight".to_string(), vec![h], Init::Ones),
        ];
        for l in 0..self.layers {
            let p = |n: &str| format!("layers.{l}.{n}");
            out.extend([
                (p("input_layernorm.weight"), vec![h], Init::Ones),
                (p("self_attn.q_proj.weight"), vec![q, h], w),
                (p("self_attn.k_proj.weight"), vec![kv, h], w),
                (p("self_attn.v_proj.weight"), vec![kv, h], w),
                (p("self_attn.o_proj.weight"), vec![h, q], w),
                (p("self_attn.q_norm.weight"), vec![d], Init::Ones),
                (p("self_attn.k_norm.weight"), vec![d], Init::Ones),
                (p("post_attention_layernorm.weight"), vec![h], Init::Ones),
                (p("mlp.gate_proj.weight"), vec![i, h], w),
                (p("mlp.up_proj.weight"), vec![i, h], w),
                (p("mlp.down_proj.weight"), vec![h, i], w),
            ]);
        }
        out.push(("norm.weight".to_string(), vec![h], Init::Ones));
        out
    }

    /// Elements of all trained parameters (the gradient the group sums).
    pub fn param_len(&self) -> usize {
        (self.param_specs().iter())
            .map(|(_, s, _)| s.iter().product::<usize>())
            .sum()
    }

    /// The export's `config.json`: what SGLang's and vLLM's DFlash loaders read.
    pub fn to_json(&self, dtype: &str) -> serde_json::Value {
        json!({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "tie_word_embeddings": false,
            "torch_dtype": dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": vec!["full_attention"; self.layers],
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        })
    }

    /// The `config.json` of the export in `dir` (see [`DflashConfig::from_json`]).
    pub fn load(dir: &Path) -> Result<DflashConfig> {
        let path = dir.join("config.json");
        let text = atomic_file::read_regular(&path).map_err(|cause| {
            crate::unreadable_config(
                dir,
                path.clone(),
                cause,
                "a DFlash drafter's export holds config.json and model.safetensors: a run's <run-dir>/drafter",
            )
        })?;
        DflashConfig::from_json(&text, &path)
    }

    /// Reads an export's `config.json` back: every field the drafter computes with present
    /// and of its type, the shape one a drafter can have ([`DflashConfig::check`]), and nothing
    /// set that the drafter would not compute (`layer_types` other than full attention, an
    /// activation other than SiLU, attention biases, rope scaling).
    pub fn from_json(text: &str, path: &Path) -> Result<DflashConfig> {
        let bad = |why: String| ModelError::Config {
            path: path.to_path_buf(),
            why,
        };
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not a config: {e}")))?;
        // A field missing and a field of another type are told apart: "no block_size field"
        // for `"block_size": -3` sent the reader looking for a field that is there.
        fn get<T: serde::de::DeserializeOwned>(
            v: &serde_json::Value,
            name: &str,
            what: &str,
        ) -> std::result::Result<T, String> {
            let mut at = v;
            for key in name.split('.') {
                at = &at[key];
            }
            if at.is_null() {
                return Err(format!("no {name} field"));
            }
            T::deserialize(at).map_err(|_| format!("{name} = {at} is not {what}"))
        }
        let n = |k: &str| get::<usize>(&v, k, "a whole number").map_err(bad);
        let f = |k: &str| get::<f64>(&v, k, "a number").map_err(bad);
        let (layers, ids, mask) = (
            n("num_hidden_layers")?,
            get::<Vec<usize>>(
                &v,
                "dflash_config.target_layer_ids",
                "a list of layer numbers",
            )
            .map_err(bad)?,
            get::<u32>(&v, "dflash_config.mask_token_id", "a token id").map_err(bad)?,
        );
        let unlike = |k: &str, want: serde_json::Value| {
            let got = &v[k];
            (!got.is_null() && *got != want).then(|| {
                bad(format!(
                    "{k} = {got}: this drafter computes only {want} (a drafter of another kind?)"
                ))
            })
        };
        // Before anything is sized by it (the layer types here; `check` holds it too).
        if layers > crate::make::MAX_LAYERS {
            return Err(bad(format!(
                "num_hidden_layers = {layers}: at most {} (a drafter is a few layers)",
                crate::make::MAX_LAYERS
            )));
        }
        let full = json!(vec!["full_attention"; layers]);
        for (k, want) in [
            ("layer_types", full),
            ("hidden_act", json!("silu")),
            ("attention_bias", json!(false)),
            ("rope_scaling", serde_json::Value::Null),
        ] {
            if let Some(e) = unlike(k, want) {
                return Err(e);
            }
        }
        let cfg = DflashConfig {
            hidden: n("hidden_size")?,
            layers,
            heads: n("num_attention_heads")?,
            kv_heads: n("num_key_value_heads")?,
            head_dim: n("head_dim")?,
            intermediate: n("intermediate_size")?,
            vocab: n("vocab_size")?,
            rms_norm_eps: f("rms_norm_eps")?,
            rope_theta: f("rope_theta")?,
            max_position_embeddings: n("max_position_embeddings")?,
            block_size: n("block_size")?,
            num_target_layers: n("num_target_layers")?,
            target_layer_ids: ids,
            mask_token_id: mask,
        };
        cfg.check().map_err(bad)?;
        Ok(cfg)
    }

    /// Why no drafter can have this shape, if none can: a block drafts at least one token
    /// (`block_size` 2 or more), every size is at least 1, the heads share their key-value
    /// heads evenly, a head's size is even (RoPE rotates pairs), the norms' epsilon and the
    /// rope base are positive numbers, the mask token is in the vocabulary, and the captured
    /// layers are the target's.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (name, n) in [
            ("hidden_size", self.hidden),
            ("num_hidden_layers", self.layers),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab),
            ("num_target_layers", self.num_target_layers),
        ] {
            if n == 0 {
                return Err(format!("{name} = 0: it must be at least 1"));
            }
        }
        if self.block_size < 2 {
            return Err(format!(
                "block_size = {}: a block is its anchor's token and at least one drafted token, so at least 2",
                self.block_size
            ));
        }
        // As the run's `[dflash] block_size`: a block's attention scores grow with its square
        // (an export's 30000 aborted `launcher eval` allocating 14 GB).
        if self.block_size > MAX_BLOCK_SIZE {
            return Err(format!(
                "block_size = {}: at most {MAX_BLOCK_SIZE} (a drafted block's attention is computed whole)",
                self.block_size
            ));
        }
        // Before anything is sized by it (`param_specs` lists every layer's tensors).
        if self.layers > crate::make::MAX_LAYERS {
            return Err(format!(
                "num_hidden_layers = {}: at most {} (a drafter is a few layers)",
                self.layers,
                crate::make::MAX_LAYERS
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "num_attention_heads = {} is not a multiple of num_key_value_heads = {}",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim = {}: RoPE rotates pairs of channels, so it must be even",
                self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!(
                "rms_norm_eps = {}: it must be a positive number",
                self.rms_norm_eps
            ));
        }
        // As the target's loader asks (`config.rs`).
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(format!(
                "rope_theta = {}: it must be a number above 1",
                self.rope_theta
            ));
        }
        if self.mask_token_id as usize >= self.vocab {
            return Err(format!(
                "dflash_config.mask_token_id = {} is outside the vocabulary of {} (vocab_size)",
                self.mask_token_id, self.vocab
            ));
        }
        if self.target_layer_ids.is_empty() {
            return Err("dflash_config.target_layer_ids is empty: the drafter conditions on no target layer".into());
        }
        if let Some(&l) = (self.target_layer_ids.iter()).find(|&&l| l >= self.num_target_layers) {
            return Err(format!(
                "dflash_config.target_layer_ids holds layer {l}, past the target's {} layers (num_target_layers)",
                self.num_target_layers
            ));
        }
        Ok(())
    }

    /// Where `other`'s weights would be laid out or read otherwise than this drafter's: the
    /// fields that set their shapes and the captured layers the context projection reads, each
    /// as `field theirs (this one's: mine)`. The block size, the mask token, the norm's eps,
    /// the rope base and the positions change no weight's meaning, so they may differ.
    pub fn layout_differences(&self, other: &DflashConfig) -> Vec<String> {
        let sizes = [
            ("hidden_size", self.hidden, other.hidden),
            ("num_hidden_layers", self.layers, other.layers),
            ("num_attention_heads", self.heads, other.heads),
            ("num_key_value_heads", self.kv_heads, other.kv_heads),
            ("head_dim", self.head_dim, other.head_dim),
            ("intermediate_size", self.intermediate, other.intermediate),
            ("vocab_size", self.vocab, other.vocab),
            (
                "num_target_layers",
                self.num_target_layers,
                other.num_target_layers,
            ),
        ];
        let mut out: Vec<String> = (sizes.iter())
            .filter(|(_, mine, theirs)| mine != theirs)
            .map(|(k, mine, theirs)| format!("{k} {theirs} (this one's: {mine})"))
            .collect();
        if self.target_layer_ids != other.target_layer_ids {
            out.push(format!(
                "target_layer_ids {:?} (this one's: {:?})",
                other.target_layer_ids, self.target_layer_ids
            ));
        }
        out
    }

    /// Why this drafter cannot draft for `target`, if it cannot: it was made for a target of
    /// another hidden size, vocabulary or number of layers (a drafter of another model).
    pub fn check_target(&self, target: &ArchConfig) -> std::result::Result<(), String> {
        let mut differ = Vec::new();
        for (what, mine, theirs) in [
            ("hidden size", self.hidden, target.hidden_size),
            ("vocabulary", self.vocab, target.vocab_size),
            (
                "decoder layers",
                self.num_target_layers,
                target.num_hidden_layers,
            ),
        ] {
            if mine != theirs {
                differ.push(format!("{what} {mine} (the target's: {theirs})"));
            }
        }
        if differ.is_empty() {
            return Ok(());
        }
        Err(format!(
            "the drafter was made for a target of {}: a drafter of another model",
            differ.join(", ")
        ))
    }
}

/// The target's two frozen tensors a drafter uses, `[vocab, hidden]` each, f32.
pub struct Frozen {
    pub embed: Tensor,
    pub lm_head: Tensor,
}

impl Frozen {
    /// `embed_tokens` and `lm_head` (those two tensors only) from the target in `dir`.
    pub fn load(dir: &Path, device: &Device) -> Result<Frozen> {
        let arch = ArchConfig::load(dir)?;
        let w = Weights::open(dir, device, DType::F32)?;
        let (embed, lm_head) = crate::decoder::embed_and_head(&arch, &w)?;
        Ok(Frozen { embed, lm_head })
    }
}

/// One sequence's share of a forward: its context rows in the batch and its anchors.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqBlocks {
    /// The sequence's first row in the context (rows of all sequences concatenated).
    pub ctx_start: usize,
    pub ctx_len: usize,
    /// Anchor positions within the sequence, one block each, in the blocks' order.
    pub anchors: Vec<u32>,
}

impl SeqBlocks {
    /// The context rows its blocks read: those before its last anchor (a block at `a` sees
    /// rows `0..a`), one at least, so that no product is empty (a block at 0 sees that one
    /// masked). Attention past them would be scores masked to nothing: a part of anchors early
    /// in a sequence computes only what they see.
    pub fn visible(&self) -> usize {
        rows_seen(
            self.anchors.iter().max().copied().unwrap_or(0),
            self.ctx_len,
        )
    }

    /// The attention scores its blocks make together, per layer: `heads x B` query rows a
    /// block, each over the rows seen and the block.
    pub fn scores(&self, cfg: &DflashConfig) -> usize {
        scores_of(cfg, self.anchors.len(), self.visible())
    }
}

/// The context rows a block at anchor `a` reads, of a sequence of `ctx_len` (see
/// [`SeqBlocks::visible`]).
fn rows_seen(a: u32, ctx_len: usize) -> usize {
    (a as usize).max(1).min(ctx_len)
}

/// [`SeqBlocks::scores`] of `blocks` blocks that see `visible` rows.
fn scores_of(cfg: &DflashConfig, blocks: usize, visible: usize) -> usize {
    let b = cfg.block_size;
    blocks * cfg.heads * b * (visible + b)
}

/// A batch made ready for the drafter: blocks, labels and weights per block position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftBatch {
    pub seqs: Vec<SeqBlocks>,
    /// `blocks x block_size` token ids: `[token[a], MASK, ...]` per block.
    pub block_ids: Vec<u32>,
    /// The label of each block position (0 where the weight is 0).
    pub labels: Vec<u32>,
    /// `loss_mask[a+k] * exp(-(k-1)/gamma)` for `k >= 1`; 0 at `k = 0` and past a sequence.
    pub weights: Vec<f32>,
}

/// What a block position learns to predict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Label {
    /// The target's greedy token at `a+k` (the drafter learns what the target would say).
    Target,
    /// The data's token at `a+k`.
    Data,
}

/// How a batch's anchors and labels are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub num_anchors: usize,
    pub gamma: f64,
    pub label: Label,
    /// Anchors of a batch are drawn from `seed` and the batch's id, so a redelivered batch
    /// trains the same blocks.
    pub seed: u64,
}

impl DraftBatch {
    /// Anchors, blocks, labels and weights for the concatenated sequences `seq_lens` of
    /// `ids`, `loss_mask` (one byte per token) and `greedy` (the target's next token after each
    /// position).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &DflashConfig,
        s: &Sampling,
        batch_id: u64,
        ids: &[u32],
        loss_mask: &[u8],
        greedy: &[u32],
        seq_lens: &[u32],
    ) -> DraftBatch {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(
            s.seed ^ batch_id.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        let b = cfg.block_size;
        let mut out = DraftBatch::default();
        let mut start = 0usize;
        for &len in seq_lens {
            let len = len as usize;
            let m = |p: usize| loss_mask.get(start + p).is_some_and(|&x| x != 0);
            let mut valid: Vec<u32> = (0..len.saturating_sub(1))
                .filter(|&a| m(a) && m(a + 1))
                .map(|a| a as u32)
                .collect();
            // A partial Fisher-Yates shuffle: the first `n` are a draw without replacement.
            let n = valid.len().min(s.num_anchors);
            for i in 0..n {
                let j = rng.random_range(i..valid.len());
                valid.swap(i, j);
            }
            let mut anchors = valid[..n].to_vec();
            anchors.sort_unstable();
            for &a in &anchors {
                let a = a as usize;
                out.block_ids.push(ids[start + a]);
                out.labels.push(0);
                out.weights.push(0.0);
                for k in 1..b {
                    out.block_ids.push(cfg.mask_token_id);
                    let p = a + k;
                    if p < len && m(p) {
                        out.labels.push(match s.label {
                            Label::Target => greedy[start + p - 1],
                            Label::Data => ids[start + p],
                        });
                        out.weights.push((-((k - 1) as f64) / s.gamma).exp() as f32);
                    } else {
                        out.labels.push(0);
                        out.weights.push(0.0);
                    }
                }
            }
            if !anchors.is_empty() {
                out.seqs.push(SeqBlocks {
                    ctx_start: start,
                    ctx_len: len,
                    anchors,
                });
            }
            start += len;
        }
        out
    }

    pub fn blocks(&self) -> usize {
        self.seqs.iter().map(|s| s.anchors.len()).sum()
    }

    /// The batch cut into parts whose attention scores stay under `max_scores` elements a
    /// layer each (one block at least), in block order: their gradients summed are the batch's,
    /// and a part's graph is all a backward pass holds. A part's scores are bounded as if each
    /// of its sequences were one group ([`SeqBlocks::scores`]; the drafter's groups by position
    /// make at most that): the context up to its last anchor there, so parts early in a sequence hold
    /// more blocks than late ones.
    pub fn split(&self, cfg: &DflashConfig, max_scores: usize) -> Vec<DraftBatch> {
        let b = cfg.block_size;
        let per = |blocks, visible| scores_of(cfg, blocks, visible);
        let mut parts: Vec<DraftBatch> = Vec::new();
        let mut cur = DraftBatch::default();
        // The current part's scores of its sequences before the last, and of the last: its
        // blocks there and the rows they see.
        let mut before = 0usize;
        let mut blk = 0usize;
        for s in &self.seqs {
            let (mut n, mut visible) = (0usize, 0usize);
            for &a in &s.anchors {
                let sees = rows_seen(a, s.ctx_len);
                let wider = visible.max(sees);
                if before + n > 0 && before + per(n + 1, wider) > max_scores {
                    parts.push(std::mem::take(&mut cur));
                    (before, n, visible) = (0, 0, sees);
                } else {
                    visible = wider;
                }
                match cur.seqs.last_mut() {
                    Some(last) if last.ctx_start == s.ctx_start => last.anchors.push(a),
                    _ => cur.seqs.push(SeqBlocks {
                        ctx_start: s.ctx_start,
                        ctx_len: s.ctx_len,
                        anchors: vec![a],
                    }),
                }
                let r = blk * b..(blk + 1) * b;
                cur.block_ids.extend_from_slice(&self.block_ids[r.clone()]);
                cur.labels.extend_from_slice(&self.labels[r.clone()]);
                cur.weights.extend_from_slice(&self.weights[r]);
                n += 1;
                blk += 1;
            }
            before += per(n, visible);
        }
        if !cur.seqs.is_empty() {
            parts.push(cur);
        }
        parts
    }
}

/// What a batch's loss was, summed (the group normalises by the whole step's weight sum).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossSums {
    /// Sum over weighted positions of `weight * cross-entropy`.
    pub loss: f64,
    pub weight: f64,
    /// Leading block positions whose greedy prediction equals the label, summed over blocks.
    pub accepted: u64,
    pub blocks: u64,
}

impl std::ops::AddAssign for LossSums {
    fn add_assign(&mut self, o: LossSums) {
        self.loss += o.loss;
        self.weight += o.weight;
        self.accepted += o.accepted;
        self.blocks += o.blocks;
    }
}

/// A pass of one part of a batch, as [`Dflash::loss_and_grads_parts`] hands it to its caller's
/// clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The part's forward (the context of its sequences not projected yet projected first).
    Forward,
    /// Its loss: the frozen LM head over its last states, the weighted cross-entropy, the
    /// acceptance, and the loss's gradient at the last states.
    Loss,
    /// Its backward from there, then the backward through the context of the sequences whose
    /// last part it is.
    Backward,
}

/// The context keys and values of one or more sequences for every layer, made by
/// [`Dflash::projected`].
struct Projected {
    /// `(ctx_start, first row here)` of each of its sequences.
    starts: Vec<(usize, usize)>,
    /// Layer `l`'s keys at `2l` and values at `2l + 1`, `[kv heads, rows, head_dim]`, as the
    /// layers read them: the projection itself, or (cut) variables holding its values.
    kv: Vec<Tensor>,
    /// Cut: the projection, in the graph to the parameters; empty when not cut.
    graph: Vec<Tensor>,
    /// Cut: the parts' gradients of `kv`, summed so far.
    grad: Vec<Option<Tensor>>,
}

impl Projected {
    fn holds(&self, ctx_start: usize) -> bool {
        self.starts.iter().any(|&(s, _)| s == ctx_start)
    }
}

/// The projected context of a batch's sequences while its parts run (see
/// [`Dflash::loss_and_grads_parts`]).
struct Context<'a> {
    /// The batch's context features, `[tokens, layers * hidden]`.
    input: &'a Tensor,
    /// How many parts not yet finished hold blocks of each sequence (by `ctx_start`).
    left: HashMap<usize, usize>,
    /// The projections parts still read.
    live: Vec<Projected>,
}

impl<'a> Context<'a> {
    fn new(input: &'a Tensor, parts: &[DraftBatch]) -> Context<'a> {
        let mut left = HashMap::new();
        for s in parts.iter().flat_map(|p| &p.seqs) {
            *left.entry(s.ctx_start).or_insert(0) += 1;
        }
        Context {
            input,
            left,
            live: Vec::new(),
        }
    }

    /// Whether the sequence at `ctx_start` has blocks in more than one part not yet finished.
    fn spans(&self, ctx_start: usize) -> bool {
        self.left.get(&ctx_start).is_some_and(|&n| n > 1)
    }

    /// The projection holding sequence `s`, and its first row there.
    fn rows_of(&self, s: &SeqBlocks) -> Result<(&Projected, usize)> {
        (self.live.iter())
            .find_map(|p| {
                (p.starts.iter())
                    .find(|&&(start, _)| start == s.ctx_start)
                    .map(|&(_, at)| (p, at))
            })
            .ok_or_else(|| {
                ModelError::Input(format!(
                    "the context of the sequence at row {} was not projected",
                    s.ctx_start
                ))
            })
    }

    /// Adds to each cut projection the gradient of its values in `grads` (one part's backward).
    fn gather(&mut self, grads: &GradStore) -> Result<()> {
        for p in &mut self.live {
            for (t, sum) in p.kv.iter().zip(&mut p.grad) {
                if let Some(g) = train::grad_of(grads, t) {
                    train::add_into(sum, g)?;
                }
            }
        }
        Ok(())
    }
}

/// LM-head logits computed at once (`rows x vocab` f32) on `dev`: 16 MiB on the CPU, cache-sized;
/// 512 MiB on a GPU, so a part's rows (about 450 of the Qwen3-8B shape's 151,936-wide head) are
/// one matrix product. A GPU at the CPU's size ran 27 rows at a time there: each chunk read the
/// whole 2.5 GB head for a skinny product, and waited on the host three times, some 290 chunks
/// a step. The peak is a few times the chunk (the logits, their exponentials, their shift). A
/// drafter takes another size by [`Dflash::set_logits_per_chunk`].
fn logit_elements(dev: &Device) -> usize {
    match dev.is_cpu() {
        true => 1 << 22,
        false => 1 << 27,
    }
}

/// The most context positions a group of one sequence's anchors spans (first anchor to last),
/// by default. A group's attention reads the context up to its last anchor, masked beyond each
/// of its other anchors, so an anchor's wasted scores are fewer than the span, where one group
/// for a whole sequence wastes about half of them. Cut by span rather than by count, a new group
/// (one more set of kernels on a GPU) starts only at an anchor 512 or more positions past the
/// group's first: a sequence shorter than the span stays one group (a batch of short
/// conversations is not cut into hundreds of tiny products), and so does a part of a long
/// sequence that spans less (`DraftBatch::split` cuts the batch by position already).
const CONTEXT_PER_GROUP: usize = 512;

/// `seqs` with each sequence's anchors cut, in their order, into groups each spanning fewer
/// than `span` positions from its first anchor to its last, one entry a group: the blocks'
/// order is kept, and each group's attention reads the context only up to its own last anchor
/// ([`SeqBlocks::visible`]). `DraftBatch::new` sorts a sequence's anchors, so a group is a
/// range of positions; unsorted ones would train the same, saving less.
fn by_position(seqs: &[SeqBlocks], span: usize) -> Vec<SeqBlocks> {
    let mut out = Vec::with_capacity(seqs.len());
    for s in seqs {
        let mut first = 0;
        for i in 1..=s.anchors.len() {
            let cut =
                (s.anchors.get(i)).is_none_or(|&a| a.abs_diff(s.anchors[first]) as usize >= span);
            if cut {
                out.push(SeqBlocks {
                    anchors: s.anchors[first..i].to_vec(),
                    ..*s
                });
                first = i;
            }
        }
    }
    out
}

/// The drafter: its config, trained parameters, the target's frozen tensors, its rope.
pub struct Dflash {
    pub cfg: DflashConfig,
    pub params: Params,
    pub frozen: Frozen,
    rope: Rope,
    /// Context rows projected since the drafter was made (see [`Dflash::context_rows_projected`]).
    projected_rows: AtomicU64,
    /// Attention scores made since the drafter was made (see [`Dflash::scores_made`]).
    scores: AtomicU64,
    /// See [`Dflash::set_context_per_group`].
    context_per_group: usize,
    /// LM-head logits computed at once (`rows x vocab`), at least one row's.
    logits_per_chunk: usize,
    /// How the attention's core is differentiated.
    attention: AttentionBackward,
}

impl Dflash {
    /// A fresh drafter: parameters drawn from `seed` (the same on every rank). Its shape must
    /// be one a drafter can have ([`DflashConfig::check`]), and `frozen` the target's
    /// `[vocab, hidden]` tensors of that shape.
    pub fn new(cfg: DflashConfig, frozen: Frozen, seed: u64) -> Result<Dflash> {
        cfg.check().map_err(ModelError::Drafter)?;
        let want = [cfg.vocab, cfg.hidden];
        for (name, t) in [
            ("embed_tokens", &frozen.embed),
            ("lm_head", &frozen.lm_head),
        ] {
            if t.dims() != want {
                return Err(ModelError::Drafter(format!(
                    "the target's {name} is {:?}, the drafter's vocabulary x hidden size is {want:?}",
                    t.dims()
                )));
            }
        }
        let dev = frozen.embed.device().clone();
        let params = Params::new(&cfg.param_specs(), seed, &dev)?;
        let rope = Rope::plain(cfg.head_dim, cfg.rope_theta);
        Ok(Dflash {
            logits_per_chunk: logit_elements(&dev),
            attention: AttentionBackward::default(),
            cfg,
            params,
            frozen,
            rope,
            projected_rows: AtomicU64::new(0),
            scores: AtomicU64::new(0),
            context_per_group: CONTEXT_PER_GROUP,
        })
    }

    /// Compute at most `n` LM-head logits at once (whole rows of the vocabulary, one row at
    /// least) in the loss and in [`Dflash::predict`]: the loss's peak memory is a few times
    /// `n` f32 values. The default is the device kind's (2^22 on the CPU, 2^27 on a GPU).
    pub fn set_logits_per_chunk(&mut self, n: usize) {
        self.logits_per_chunk = n;
    }

    /// Attend a sequence's anchors in groups by position, each spanning fewer than `n` positions
    /// from its first anchor to its last (one at least: each anchor alone; 512 by default) and
    /// reading the context up to its last anchor: fewer masked scores for more, smaller
    /// products. The result changes by rounding only.
    pub fn set_context_per_group(&mut self, n: usize) {
        self.context_per_group = n.max(1);
    }

    /// See [`Dflash::set_context_per_group`].
    pub fn context_per_group(&self) -> usize {
        self.context_per_group
    }

    /// Differentiate the attention's core by hand (the default) or by candle's autograd of
    /// the same ops (to compare them, or to step around the hand-written one's custom op).
    pub fn set_attention_backward(&mut self, how: AttentionBackward) {
        self.attention = how;
    }

    /// Rows of the head computed at once.
    fn head_rows(&self) -> usize {
        (self.logits_per_chunk / self.cfg.vocab).max(1)
    }

    /// The rows of context (one a token of a sequence) whose projection (fc, hidden norm, each
    /// layer's context keys and values) the drafter has made since it was made: a batch run in
    /// parts by [`Dflash::loss_and_grads_parts`] adds its context's rows once, however many parts
    /// hold each sequence's blocks.
    pub fn context_rows_projected(&self) -> u64 {
        self.projected_rows.load(Ordering::Relaxed)
    }

    /// Attention scores made by the forwards since the drafter was made, a layer's count
    /// ([`SeqBlocks::scores`] of each group of anchors attended together).
    pub fn scores_made(&self) -> u64 {
        self.scores.load(Ordering::Relaxed)
    }

    /// The device the drafter computes on (its frozen embedding's).
    pub fn device(&self) -> &Device {
        self.frozen.embed.device()
    }

    /// The last state (after the final norm) of every block position, `[blocks * B, hidden]`,
    /// for context features `ctx_in` (`[tokens, layers * hidden]`, the captured layers side by
    /// side) and the blocks of `seqs` with token ids `block_ids`.
    pub fn forward(
        &self,
        ctx_in: &Tensor,
        block_ids: &[u32],
        seqs: &[SeqBlocks],
    ) -> Result<Tensor> {
        self.forward_in(&mut Context::new(ctx_in, &[]), block_ids, seqs)
    }

    /// [`Dflash::forward`] with the context of `seqs` taken from `ctx`, the sequences it has not
    /// projected yet projected into it first.
    fn forward_in(
        &self,
        ctx: &mut Context<'_>,
        block_ids: &[u32],
        seqs: &[SeqBlocks],
    ) -> Result<Tensor> {
        self.project(ctx, seqs)?;
        let seqs = &by_position(seqs, self.context_per_group);
        let made: usize = seqs.iter().map(|s| s.scores(&self.cfg)).sum();
        // Relaxed: a count for tests and benchmarks, as `projected_rows`.
        self.scores.fetch_add(made as u64, Ordering::Relaxed);
        let c = &self.cfg;
        let dev = self.device();
        let b = c.block_size;
        let ids = Tensor::from_slice(block_ids, block_ids.len(), dev)?;
        let mut x = self.frozen.embed.index_select(&ids, 0)?;
        let mut bpos = Vec::with_capacity(block_ids.len());
        let mut masks = Vec::with_capacity(seqs.len());
        let mut kv = Vec::with_capacity(seqs.len());
        for s in seqs {
            let len = s.visible();
            let mut mask = Vec::with_capacity(s.anchors.len() * len);
            for &a in &s.anchors {
                bpos.extend(a..a + b as u32);
                mask.extend((0..len).map(|j| {
                    if j < a as usize {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                }));
            }
            masks.push(Tensor::from_vec(mask, (s.anchors.len(), 1, len), dev)?);
            kv.push(ctx.rows_of(s)?);
        }
        let (bcos, bsin) = self.rope.tables(&bpos, dev)?;
        for l in 0..c.layers {
            x = self.layer(l, &x, (&bcos, &bsin), seqs, &kv, &masks)?;
        }
        rms_norm(&x, self.params.get("norm.weight"), c.rms_norm_eps)
    }

    /// Projects into `ctx` the context of the sequences of `seqs` it does not hold: those whose
    /// blocks are all in this part together, in the graph to the parameters (as one batch's
    /// context), and each one with blocks in later parts too alone, cut from the graph.
    fn project(&self, ctx: &mut Context<'_>, seqs: &[SeqBlocks]) -> Result<()> {
        let new: Vec<&SeqBlocks> = (seqs.iter())
            .filter(|s| !ctx.live.iter().any(|p| p.holds(s.ctx_start)))
            .collect();
        let (cut, whole): (Vec<&SeqBlocks>, Vec<&SeqBlocks>) =
            new.into_iter().partition(|s| ctx.spans(s.ctx_start));
        if !whole.is_empty() {
            let p = self.projected(ctx.input, &whole, false)?;
            ctx.live.push(p);
        }
        for s in cut {
            let p = self.projected(ctx.input, &[s], true)?;
            ctx.live.push(p);
        }
        Ok(())
    }

    /// The context keys and values of `seqs` (their rows of `ctx_in` side by side): `fc`, the
    /// hidden norm and each layer's k and v projections, k normed and rotated at the context's
    /// positions.
    fn projected(&self, ctx_in: &Tensor, seqs: &[&SeqBlocks], cut: bool) -> Result<Projected> {
        let c = &self.cfg;
        let p = &self.params;
        let dev = self.device();
        let (nkv, d, eps) = (c.kv_heads, c.head_dim, c.rms_norm_eps);
        // Sequences next to each other in the batch are one view of its rows, not a copy.
        let next_to = (seqs.windows(2)).all(|w| w[0].ctx_start + w[0].ctx_len == w[1].ctx_start);
        let rows = match seqs {
            [first, ..] if next_to => {
                let total = seqs.iter().map(|s| s.ctx_len).sum();
                ctx_in.narrow(0, first.ctx_start, total)?
            }
            _ => {
                let rows: Vec<Tensor> = (seqs.iter())
                    .map(|s| ctx_in.narrow(0, s.ctx_start, s.ctx_len))
                    .collect::<candle_core::Result<_>>()?;
                Tensor::cat(&rows, 0)?
            }
        };
        // Relaxed: a count for tests and benchmarks; no other memory is published with it.
        (self.projected_rows).fetch_add(rows.dim(0)? as u64, Ordering::Relaxed);
        let ctx = rms_norm(
            &linear(&rows, p.get("fc.weight"))?,
            p.get("hidden_norm.weight"),
            eps,
        )?;
        let mut at = 0;
        let mut starts = Vec::with_capacity(seqs.len());
        let mut pos = Vec::with_capacity(ctx.dim(0)?);
        for s in seqs {
            starts.push((s.ctx_start, at));
            pos.extend(0..s.ctx_len as u32);
            at += s.ctx_len;
        }
        let (cos, sin) = self.rope.tables(&pos, dev)?;
        let mut graph = Vec::with_capacity(2 * c.layers);
        for l in 0..c.layers {
            let w = |n: &str| p.get(&format!("layers.{l}.self_attn.{n}.weight"));
            let qk = train::QkNorm {
                weight: w("k_norm"),
                eps,
                cos: &cos,
                sin: &sin,
            };
            graph.push(train::heads(
                &linear(&ctx, w("k_proj"))?,
                &[at],
                nkv,
                d,
                Some(qk),
            )?);
            graph.push(train::heads(
                &linear(&ctx, w("v_proj"))?,
                &[at],
                nkv,
                d,
                None,
            )?);
        }
        if !cut {
            return Ok(Projected {
                starts,
                kv: graph,
                graph: Vec::new(),
                grad: Vec::new(),
            });
        }
        let kv = (graph.iter())
            .map(|t| Ok(Var::from_tensor(&t.detach())?.as_tensor().clone()))
            .collect::<Result<Vec<Tensor>>>()?;
        Ok(Projected {
            starts,
            grad: vec![None; kv.len()],
            kv,
            graph,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: usize,
        x: &Tensor,
        (bcos, bsin): (&Tensor, &Tensor),
        seqs: &[SeqBlocks],
        kv: &[(&Projected, usize)],
        masks: &[Tensor],
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let w = |n: &str| self.params.get(&format!("layers.{l}.{n}"));
        let (nh, nkv, d, b) = (c.heads, c.kv_heads, c.head_dim, c.block_size);
        let g = nh / nkv;
        let eps = c.rms_norm_eps;
        let hn = rms_norm(x, w("input_layernorm.weight"), eps)?;
        // [rows, heads * d] -> [heads, rows, d]; q and k normed per head and rotated at the
        // blocks' positions.
        let qk = |weight| {
            Some(train::QkNorm {
                weight,
                eps,
                cos: bcos,
                sin: bsin,
            })
        };
        let (qn, kn) = (w("self_attn.q_norm.weight"), w("self_attn.k_norm.weight"));
        let proj = |x: &Tensor, n: &str| linear(x, w(&format!("self_attn.{n}_proj.weight")));
        let rb = x.dim(0)?;
        let q = train::heads(&proj(&hn, "q")?, &[rb], nh, d, qk(qn))?;
        let kb = train::heads(&proj(&hn, "k")?, &[rb], nkv, d, qk(kn))?;
        let vb = train::heads(&proj(&hn, "v")?, &[rb], nkv, d, None)?;
        let scale = 1.0 / (d as f64).sqrt();
        let mut outs = Vec::with_capacity(seqs.len());
        let mut b0 = 0;
        for ((s, mask), &(p, at)) in seqs.iter().zip(masks).zip(kv) {
            // Only the rows its blocks see (`SeqBlocks::visible`), as its mask was made.
            let (n, len) = (s.anchors.len(), s.visible());
            let m = n * b;
            // Queries grouped by the kv head they read: [kv, n, g * B, d].
            let qs = q
                .narrow(1, b0, m)?
                .reshape((nkv, g, n, b, d))?
                .permute((0, 2, 1, 3, 4))?
                .contiguous()?
                .reshape((nkv, n, g * b, d))?;
            let kcs = p.kv[2 * l].narrow(1, at, len)?;
            let vcs = p.kv[2 * l + 1].narrow(1, at, len)?;
            let kbs = kb.narrow(1, b0, m)?.reshape((nkv, n, b, d))?;
            let vbs = vb.narrow(1, b0, m)?.reshape((nkv, n, b, d))?;
            // The scale goes on the queries (len / d times fewer values than the scores); the
            // core's backward is written by hand (`draft_attention`).
            let attend = match self.attention {
                AttentionBackward::ByHand => draft_attention::attend,
                AttentionBackward::Autograd => draft_attention::attend_autograd,
            };
            let o = attend(&(qs * scale)?, (&kcs, &vcs), mask, (&kbs, &vbs))?;
            let o = o
                .reshape((nkv, n, g, b, d))?
                .permute((1, 3, 0, 2, 4))?
                .contiguous()?
                .reshape((m, nh * d))?;
            outs.push(o);
            b0 += m;
        }
        let attn = linear(&Tensor::cat(&outs, 0)?, w("self_attn.o_proj.weight"))?;
        let x = (x + attn)?;
        let hn = rms_norm(&x, w("post_attention_layernorm.weight"), eps)?;
        let gate = linear(&hn, w("mlp.gate_proj.weight"))?.silu()?;
        let up = linear(&hn, w("mlp.up_proj.weight"))?;
        let mlp = linear(&(gate * up)?, w("mlp.down_proj.weight"))?;
        Ok((x + mlp)?)
    }

    /// The greedy prediction at every block position (`[blocks * B]`).
    pub fn predict(
        &self,
        ctx_in: &Tensor,
        block_ids: &[u32],
        seqs: &[SeqBlocks],
    ) -> Result<Vec<u32>> {
        let h = self.forward(ctx_in, block_ids, seqs)?;
        // Refused as the target's forward is: NaN or infinite states (weights broken by a
        // diverged training or a damaged export) argmax to token 0 everywhere, and such a
        // drafter was scored as one that never guesses right.
        crate::decoder::finite(&h, || "the drafter's output".into())?;
        let rows = self.head_rows();
        let mut out = Vec::with_capacity(block_ids.len());
        for start in (0..h.dim(0)?).step_by(rows) {
            let n = rows.min(h.dim(0)? - start);
            let logits = h.narrow(0, start, n)?.matmul(&self.frozen.lm_head.t()?)?;
            out.extend(logits.argmax(D::Minus1)?.to_vec1::<u32>()?);
        }
        Ok(out)
    }

    /// The weighted cross-entropy of `batch` summed, with the gradient of that sum added into
    /// `grad` (the layout of [`Params::flat`]), and the blocks' acceptance.
    pub fn loss_and_grads(
        &self,
        ctx_in: &Tensor,
        batch: &DraftBatch,
        grad: &mut [f32],
    ) -> Result<LossSums> {
        let mut acc = self.params.grads();
        let parts = std::slice::from_ref(batch);
        let sums = self.loss_and_grads_parts(ctx_in, parts, &mut acc, |_, pass| pass())?;
        acc.add_to(&self.params, grad)?;
        Ok(sums)
    }

    /// The loss sums of one batch cut into `parts` (by [`DraftBatch::split`], in any order)
    /// with the gradient summed into `acc` on the device: one part's attention graph held at a
    /// time, and each sequence's context projected once however many parts hold its blocks (a
    /// sequence in several parts has its projection cut from the graph; each part's backward
    /// adds its gradient of the cut, and the sum goes back through the projection once, after
    /// the sequence's last part). `timed` runs each pass of each part (a caller's clock around
    /// it: the worker times them on the GPU's stream).
    pub fn loss_and_grads_parts<E: From<ModelError>>(
        &self,
        ctx_in: &Tensor,
        parts: &[DraftBatch],
        acc: &mut Grads,
        mut timed: impl FnMut(Pass, &mut dyn FnMut() -> Result<()>) -> std::result::Result<(), E>,
    ) -> std::result::Result<LossSums, E> {
        let mut ctx = Context::new(ctx_in, parts);
        let mut sums = LossSums::default();
        for part in parts {
            sums.blocks += part.blocks() as u64;
            if part.seqs.is_empty() {
                continue;
            }
            let mut h = None;
            timed(Pass::Forward, &mut || {
                h = Some(self.forward_in(&mut ctx, &part.block_ids, &part.seqs)?);
                Ok(())
            })?;
            let mut at_h = None;
            timed(Pass::Loss, &mut || {
                let h = h.take().ok_or_else(|| {
                    ModelError::Input("a part's loss was timed before its forward".into())
                })?;
                let (s, grad_h) = self.loss(&h, part)?;
                sums += s;
                at_h = Some((h, grad_h));
                Ok(())
            })?;
            let mut done = false;
            timed(Pass::Backward, &mut || {
                let (h, grad_h) = at_h.take().ok_or_else(|| {
                    ModelError::Input("a part's backward was timed before its loss".into())
                })?;
                self.backward(&h, &grad_h, acc, &mut ctx)?;
                self.context_backward(&mut ctx, part, acc)?;
                done = true;
                Ok(())
            })?;
            // A clock that skipped a pass (or all three) would lose the part's loss or gradient
            // without a word. The backward finishes only after the loss, the loss only after
            // the forward.
            if !done {
                let why = "a part was left without its loss or its backward: `timed` did not run \
                           every pass it was handed";
                return Err(ModelError::Input(why.into()).into());
            }
        }
        // Every part ran its backward, so every sequence's projection went back too; one left
        // here would be a context gradient lost.
        if !ctx.live.is_empty() {
            let n = ctx.live.len();
            let why = format!("{n} context projections were left without their backward");
            return Err(ModelError::Input(why).into());
        }
        Ok(sums)
    }

    /// The weighted cross-entropy of `batch` summed from its last states `h` (made by
    /// [`Dflash::forward_in`]), the blocks' acceptance (`blocks` left 0), and the loss's
    /// gradient at `h` (what [`Dflash::backward`] takes).
    fn loss(&self, h: &Tensor, batch: &DraftBatch) -> Result<(LossSums, Tensor)> {
        let mut sums = LossSums::default();
        let dev = self.device();
        // The head and loss run one chunk of rows at a time, their gradient at `h` by hand.
        let rows: Vec<u32> = (0..batch.weights.len() as u32)
            .filter(|&i| batch.weights[i as usize] > 0.0)
            .collect();
        let mut predicted = vec![u32::MAX; batch.weights.len()];
        let mut grad_h = Tensor::zeros(h.shape(), DType::F32, dev)?;
        let per = self.head_rows();
        for chunk in rows.chunks(per) {
            let idx = Tensor::from_slice(chunk, chunk.len(), dev)?;
            let labels: Vec<u32> = chunk.iter().map(|&i| batch.labels[i as usize]).collect();
            let wts: Vec<f32> = chunk.iter().map(|&i| batch.weights[i as usize]).collect();
            let lab = Tensor::from_vec(labels, chunk.len(), dev)?;
            // The weights are the host's: summed here, without a wait on the device.
            sums.weight += wts.iter().map(|&w| f64::from(w)).sum::<f64>();
            let wt = Tensor::from_vec(wts, chunk.len(), dev)?;
            let hc = h.detach().index_select(&idx, 0)?;
            let out = train::head_loss(&hc, &self.frozen.lm_head, &lab, &wt)?;
            sums.loss += f64::from(out.loss.to_scalar::<f32>()?);
            grad_h = grad_h.index_add(&idx, &out.grad, 0)?;
            let am = out.argmax.to_vec1::<u32>()?;
            for (&i, p) in chunk.iter().zip(am) {
                predicted[i as usize] = p;
            }
        }
        let b = self.cfg.block_size;
        for blk in 0..batch.blocks() {
            let accepted = (1..b)
                .take_while(|&k| {
                    let i = blk * b + k;
                    batch.weights[i] > 0.0 && predicted[i] == batch.labels[i]
                })
                .count();
            sums.accepted += accepted as u64;
        }
        Ok((sums, grad_h))
    }

    /// The backward of a part from `grad_h`, its loss's gradient at its last states `h`: the
    /// parameters' gradient added into `acc` on the device, and the cut projections' into
    /// `ctx`.
    fn backward(
        &self,
        h: &Tensor,
        grad_h: &Tensor,
        acc: &mut Grads,
        ctx: &mut Context<'_>,
    ) -> Result<()> {
        let surrogate = train::sum_all(&(h * grad_h.detach())?)?;
        let grads = surrogate.backward()?;
        self.params.accumulate(&grads, acc)?;
        ctx.gather(&grads)
    }

    /// After `part`'s backward: the summed gradient of each cut projection whose sequences have
    /// no blocks in a later part goes back through the projection (adding into `acc`), and
    /// the projections of those sequences are dropped.
    fn context_backward(
        &self,
        ctx: &mut Context<'_>,
        part: &DraftBatch,
        acc: &mut Grads,
    ) -> Result<()> {
        for s in &part.seqs {
            if let Some(n) = ctx.left.get_mut(&s.ctx_start) {
                *n = n.saturating_sub(1);
            }
        }
        let (done, live): (Vec<Projected>, Vec<Projected>) =
            std::mem::take(&mut ctx.live).into_iter().partition(|p| {
                p.starts
                    .iter()
                    .all(|(s, _)| ctx.left.get(s).is_none_or(|&n| n == 0))
            });
        ctx.live = live;
        let mut surrogate: Option<Tensor> = None;
        for p in done {
            for (t, g) in p.graph.iter().zip(&p.grad) {
                if let Some(g) = g {
                    // `g` is detached (gathered through `train::grad_of`): a constant here.
                    train::add_into(&mut surrogate, train::sum_all(&(t * g)?)?)?;
                }
            }
        }
        if let Some(s) = surrogate {
            self.params.accumulate(&s.backward()?, acc)?;
        }
        Ok(())
    }

    /// Writes the drafter as an inference engine loads it: `config.json` and `model.safetensors`
    /// (the trained parameters only, in bf16), into `dir` (created; files replaced).
    pub fn export(&self, dir: &Path) -> Result<()> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelError::Io {
                path,
                cause: source,
            }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut named = Vec::new();
        for (name, t) in self.params.tensors() {
            named.push((name.to_string(), t.to_dtype(DType::BF16)?));
        }
        let st = dir.join("model.safetensors");
        // `format: pt` as torch's `save_file` and `save_pretrained` write it: transformers
        // refuses a safetensors file whose metadata names no framework it knows, and some of its
        // versions one with no metadata at all.
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(named.iter().map(|(n, t)| (n.as_str(), t)), Some(meta), &st)
            .map_err(|e| ModelError::Weights {
                file: st.clone(),
                why: format!("writing the export: {e}"),
            })?;
        let cfg = serde_json::to_string_pretty(&self.cfg.to_json("bfloat16")).expect("json");
        let path = dir.join("config.json");
        std::fs::write(&path, cfg + "\n").map_err(io(&path))?;
        // safetensors writes through a temporary file of mode 0600, so a server running as
        // another user (a container, a teammate's SGLang) could read the config and not the
        // weights: they get the mode the config got (0666 less the umask).
        let mode = std::fs::metadata(&path).map_err(io(&path))?.permissions();
        std::fs::set_permissions(&st, mode).map_err(io(&st))
    }

    /// A drafter read back from its export in `dir`, with the target's frozen tensors: its
    /// `model.safetensors` must hold exactly the tensors its `config.json` describes.
    pub fn load_export(dir: &Path, frozen: Frozen) -> Result<Dflash> {
        let path = dir.join("config.json");
        let cfg = DflashConfig::load(dir)?;
        let st = dir.join("model.safetensors");
        // candle's own errors name no file ("header too small", or a bare "No such file").
        let w = candle_core::safetensors::load(&st, frozen.embed.device()).map_err(|e| {
            ModelError::Weights {
                file: st.clone(),
                why: format!("not a readable safetensors file: {e}"),
            }
        })?;
        // The weights are checked against the config's tensors before the drafter is made: a
        // config's sizes (`num_hidden_layers` 100000) would otherwise size an allocation that
        // aborts the process, where the file holds what it holds.
        let specs = cfg.param_specs();
        // A tensor the config has no place for is a config that does not describe these
        // weights (`num_hidden_layers` lowered by hand dropped the last layers without a word).
        // The target's embeddings and LM head, which an export of another trainer may carry, are
        // not the drafter's: the target's own are used, as ours exports none.
        let target_own = |k: &str| k.ends_with("embed_tokens.weight") || k == "lm_head.weight";
        let names: std::collections::HashSet<&str> =
            specs.iter().map(|(n, ..)| n.as_str()).collect();
        let mut extra: Vec<&String> = (w.keys())
            .filter(|k| !names.contains(k.as_str()) && !target_own(k))
            .collect();
        if !extra.is_empty() {
            extra.sort();
            return Err(ModelError::Weights {
                file: st.clone(),
                why: format!(
                    "holds {} tensor(s) a drafter of {} has no place for ({}), so that config does not describe these weights",
                    extra.len(),
                    path.display(),
                    (extra.iter().take(3)).map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                ),
            });
        }
        for (name, shape, _) in &specs {
            let t = w.get(name).ok_or_else(|| ModelError::Missing {
                dir: dir.to_path_buf(),
                tensor: name.clone(),
                hint: String::new(),
            })?;
            if !t.dtype().is_float() {
                return Err(ModelError::Weights {
                    file: st.clone(),
                    why: format!("tensor {name} is {:?}, not floating point", t.dtype()),
                });
            }
            if t.dims() != shape.as_slice() {
                return Err(ModelError::Shape {
                    file: st.clone(),
                    tensor: name.clone(),
                    want: shape.clone(),
                    got: t.dims().to_vec(),
                });
            }
        }
        let mut d = Dflash::new(cfg, frozen, 0)?;
        let mut flat = Vec::with_capacity(d.params.len());
        for name in d.params.names() {
            let t = &w[name];
            flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        d.params.set_flat(&flat)?;
        Ok(d)
    }
}
