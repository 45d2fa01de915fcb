//! `make-model`: a random-initialised dense decoder written in the HF layout, for the README, the
//! tests and benchmarks. What it writes is what a user's checkpoint is (`config.json`,
//! safetensors weights, `tokenizer.json`, `tokenizer_config.json`) and the same loader reads it:
//! there is no special path for models made here.
//!
//! [`MakeSpec`] covers every variant the loader takes (model type, head size apart from
//! `hidden / heads`, tied embeddings, bf16/f16/f32 storage, shards with an index, both config
//! styles, llama3 rope scaling), so each is a model the tests make and load. Weights are drawn
//! from a seeded normal distribution (HF's `initializer_range`, 0.02 by default); norm weights
//! are 1 plus a small seeded jitter, so a loader that ignored them would be caught.
//!
//! The tokenizer is a byte-level BPE (GPT-2 and Qwen style: any text encodes) trained with HF's
//! `tokenizers` on a seeded built-in English-like corpus, so its merges are real ones; its size
//! never exceeds the vocabulary (as HF allows, `vocab_size` may be larger than the tokenizer).
//!
//! The model is built in memory ([`build`]) and put in place as a whole directory in one rename
//! ([`Made::write`]): never through a link found there, never beside an earlier layout's files,
//! and only over a new directory, a link, or a directory of a model's files ([`check_dir`]).
//!
//! Length: about 1180 lines, four hundred of them the spec's and the directory's checks and
//! their tests: the config writer, every tensor of the three families, shards and the tokenizer
//! are one layout written in one place, which the loader's tests read back.

use std::collections::BTreeMap;
use std::path::Path;

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde_json::{json, Value};

use crate::config::{Family, Llama3Scaling};
use crate::{ModelError, Result};

/// How stored weights are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    F32,
    F16,
    Bf16,
}

impl Stored {
    fn hf_name(self) -> &'static str {
        match self {
            Stored::F32 => "float32",
            Stored::F16 => "float16",
            Stored::Bf16 => "bfloat16",
        }
    }
}

/// Which transformers wrote `config.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigStyle {
    /// transformers 4 (most checkpoints on the Hub): `rope_theta`, `rope_scaling`,
    /// `torch_dtype` at the top level.
    Legacy,
    /// transformers 5: `rope_parameters` and `dtype`.
    V5,
}

/// Everything `make-model` can vary.
#[derive(Clone, Debug)]
pub struct MakeSpec {
    pub family: Family,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Written as its own field; `None` writes none (HF then derives it: Qwen3 128, others
    /// `hidden / heads`).
    pub head_dim: Option<usize>,
    pub intermediate: usize,
    pub vocab: usize,
    pub seed: u64,
    pub init_std: f32,
    pub stored: Stored,
    pub tied: bool,
    /// Split the weights into shards of at most this many bytes, with an index.
    pub shard_bytes: Option<u64>,
    pub style: ConfigStyle,
    pub rope_theta: f64,
    pub llama3: Option<Llama3Scaling>,
    /// Bias on q, k and v for `llama` (`attention_bias`; qwen2 always has it).
    pub attention_bias: bool,
    /// Train the model on the built-in synthetic language before writing it (Qwen3 only).
    pub train: Option<crate::pretrain::TrainSpec>,
}

impl Default for MakeSpec {
    /// The tiny Qwen3 the README and the tests use.
    fn default() -> Self {
        MakeSpec {
            family: Family::Qwen3,
            layers: 8,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: Some(16),
            intermediate: 128,
            vocab: 1024,
            seed: 0,
            init_std: 0.02,
            stored: Stored::Bf16,
            tied: true,
            shard_bytes: None,
            style: ConfigStyle::Legacy,
            rope_theta: 1_000_000.0,
            llama3: None,
            attention_bias: false,
            train: None,
        }
    }
}

/// Tokens the tokenizer reserves, first (ids 0..): the end of text, ChatML's turn markers and
/// Qwen3's thinking markers.
pub const SPECIAL_TOKENS: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
];

/// The made model's chat template (ChatML with Qwen3's thinking blocks).
pub const CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

/// The `max_position_embeddings` (and tokenizer `model_max_length`) of a made model: HF's
/// Qwen3 and Qwen2 default. `--train-len` is held to it.
pub const MAX_POSITIONS: usize = 32768;

/// Writes the model `spec` describes as the directory `dir`, replacing it whole (see
/// [`Made::write`]: refused where `dir` holds anything but a model's files).
pub fn make_model(dir: &Path, spec: &MakeSpec) -> Result<()> {
    make_model_reporting(dir, spec, &mut |_, _| {})
}

/// [`make_model`], calling `progress(step, loss)` after each training step. `dir` is checked
/// before the work of drawing and training, and again as it is replaced.
pub fn make_model_reporting(
    dir: &Path,
    spec: &MakeSpec,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<()> {
    check(spec)?;
    check_dir(dir)?;
    build(spec, progress)?.write(dir)
}

/// A made model, in memory: each file of its directory, by name. Nothing is on disk until
/// [`Made::write`], so a model stopped while it draws or trains leaves nothing behind.
pub struct Made {
    files: Vec<(String, Vec<u8>)>,
}

/// Draws (and with `spec.train`, trains) the model `spec` describes, and encodes its files.
pub fn build(spec: &MakeSpec, progress: &mut dyn FnMut(usize, f64)) -> Result<Made> {
    check(spec)?;
    let mut files = Vec::new();
    let mut tensors = tensors(spec);
    fits(&tensors, spec.stored)?;
    if let Some(ts) = &spec.train {
        train(spec, &mut tensors, ts, progress)?;
        fits(&tensors, spec.stored)?;
    }
    files.push((
        "config.json".into(),
        pretty(&config_json(spec)).into_bytes(),
    ));
    let shards = shard(&tensors, spec.shard_bytes);
    if shards.len() == 1 {
        files.push((
            "model.safetensors".into(),
            serialize(&tensors, spec.stored)?,
        ));
    } else {
        let n = shards.len();
        let mut map = BTreeMap::new();
        let mut total = 0u64;
        for (i, part) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let subset: Vec<Tensor> = part.iter().map(|&j| tensors[j].clone()).collect();
            for t in &subset {
                map.insert(t.name.clone(), Value::String(name.clone()));
                total += (t.data.len() * bytes_per(spec.stored)) as u64;
            }
            files.push((name, serialize(&subset, spec.stored)?));
        }
        let index = json!({"metadata": {"total_size": total}, "weight_map": map});
        files.push((
            "model.safetensors.index.json".into(),
            pretty(&index).into_bytes(),
        ));
    }
    let tok = tokenizer(spec.vocab, spec.seed)?;
    files.push(("tokenizer.json".into(), tok.into_bytes()));
    let tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": MAX_POSITIONS,
    });
    files.push(("tokenizer_config.json".into(), pretty(&tc).into_bytes()));
    // Where transformers 5 writes it; conversations are prepared through it.
    files.push((
        "chat_template.jinja".into(),
        CHAT_TEMPLATE.as_bytes().to_vec(),
    ));
    Ok(Made { files })
}

impl Made {
    /// Puts the model in place as the directory `dir`, whole: its files are written into a
    /// fresh directory beside `dir`, synced, and swapped in with one rename
    /// ([`atomic_file::replace_dir_with`]), so a crash or a failed write leaves the old `dir`
    /// (or none) and never a new config.json beside old or cut weights, and no file of an
    /// earlier layout (a single model.safetensors beside new shards, which the loader would
    /// prefer) survives. Nothing is written through a symbolic link: a link in `dir` (an HF
    /// snapshot's links into its blob store), or `dir` itself as a link, is replaced by a
    /// regular file or directory and what it points to is left alone. [`check_dir`] decides
    /// which `dir` may be replaced.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let io = |cause| ModelError::Io {
            path: dir.to_path_buf(),
            cause,
        };
        let is_link = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_symlink());
        // What a make-model killed mid-write left beside `dir` (its temporary directory, or
        // where a file system cannot exchange, the old directory moved aside: put back
        // first). Not beside a link's target: `leftovers` follows the link, and nothing is
        // written there.
        if !is_link {
            atomic_file::restore_dir(dir).map_err(io)?;
            for p in atomic_file::leftovers(dir).map_err(io)? {
                std::fs::remove_dir_all(&p).map_err(|cause| ModelError::Io { path: p, cause })?;
            }
        }
        check_dir(dir)?;
        atomic_file::replace_dir_with(dir, |tmp: &Path| -> std::io::Result<()> {
            for (name, bytes) in &self.files {
                let path = tmp.join(name);
                std::fs::write(&path, bytes).map_err(|e| {
                    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
                })?;
            }
            Ok(())
        })
        .map_err(io)
    }
}

/// Whether `name` is a file of an HF model directory (config, weights, tokenizer, chat
/// template): what `make-model` may replace.
pub fn is_model_file(name: &str) -> bool {
    const NAMES: &[&str] = &[
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    ];
    NAMES.contains(&name) || (name.starts_with("model") && name.ends_with(".safetensors"))
}

/// Whether the model may be written as `dir`, which [`Made::write`] replaces whole: `dir` is
/// new, a symbolic link (replaced; what it names is left alone), or a directory holding only a
/// model's files ([`is_model_file`], as regular files or links). A directory holding anything
/// else (a README, notes, a subdirectory, an HF snapshot's `.cache`) is refused naming it, as is
/// a `dir` that is a file: replacing it would delete what is not a model's. A `dir` with no
/// name of its own (`.`, `..`, `/`) is refused: it cannot be renamed.
pub fn check_dir(dir: &Path) -> Result<()> {
    let bad = |why: String| Err(ModelError::Spec(format!("{}: {why}", dir.display())));
    if !matches!(
        dir.components().next_back(),
        Some(std::path::Component::Normal(_))
    ) {
        return bad("name the model's directory by its own name (not ., .. or /)".into());
    }
    let meta = match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        r => r.map_err(|cause| ModelError::Io {
            path: dir.to_path_buf(),
            cause,
        })?,
    };
    if meta.is_symlink() {
        return Ok(());
    }
    if !meta.is_dir() {
        let kind = atomic_file::not_regular(&meta).unwrap_or("a file");
        return bad(format!("it is {kind}, not a directory"));
    }
    let io = |cause| ModelError::Io {
        path: dir.to_path_buf(),
        cause,
    };
    let mut foreign = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let t = entry.file_type().map_err(io)?;
        if !(is_model_file(&name) && (t.is_file() || t.is_symlink())) {
            foreign.push(name);
        }
    }
    if foreign.is_empty() {
        return Ok(());
    }
    foreign.sort();
    let n = foreign.len();
    let mut list = foreign.into_iter().take(5).collect::<Vec<_>>().join(", ");
    if n > 5 {
        list.push_str(&format!(" and {} more", n - 5));
    }
    bad(format!(
        "it holds {list}, which are not a model's files; the model replaces the directory whole, so it is made only as a new directory or over one holding only a model's files (config.json, model*.safetensors, model.safetensors.index.json, tokenizer files, chat template): move those or name another directory"
    ))
}

/// Every weight fits `stored`: a value past its range would be written as an infinity (f16's
/// largest is 65504; `--init-std 1e6` made 62139 of 65536 embedding entries inf), a model
/// no one computes with.
fn fits(tensors: &[Tensor], stored: Stored) -> Result<()> {
    let fit = |x: f32| match stored {
        Stored::F32 => x.is_finite(),
        Stored::F16 => half::f16::from_f32(x).is_finite(),
        Stored::Bf16 => half::bf16::from_f32(x).is_finite(),
    };
    for t in tensors {
        if let Some(x) = t.data.iter().find(|&&x| !fit(x)) {
            let largest = match stored {
                Stored::F32 => f64::from(f32::MAX),
                Stored::F16 => f64::from(half::f16::MAX),
                Stored::Bf16 => f64::from(half::bf16::MAX),
            };
            return Err(ModelError::Spec(format!(
                "tensor {} holds {x:e}, which {} does not hold (its largest is {largest:e}): lower --init-std{}",
                t.name,
                stored.hf_name(),
                if stored == Stored::F16 { " or store bf16 or f32" } else { "" }
            )));
        }
    }
    Ok(())
}

/// Trains `tensors` in place (see [`crate::pretrain`]).
fn train(
    s: &MakeSpec,
    tensors: &mut [Tensor],
    ts: &crate::pretrain::TrainSpec,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let values = tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), t.data.clone()))
        .collect();
    let mut params = crate::train::Params::from_values(values, &dev)?;
    let shape = crate::pretrain::Shape {
        layers: s.layers,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: head_dim(s),
        vocab: s.vocab,
        tied: s.tied,
        rope_theta: s.rope_theta,
    };
    crate::pretrain::train(&mut params, &shape, ts, progress)?;
    let flat = params.flat()?;
    let mut at = 0;
    for t in tensors {
        let n = t.data.len();
        t.data.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
    Ok(())
}

fn check(s: &MakeSpec) -> Result<()> {
    let bad = |why: String| Err(ModelError::Spec(why));
    if s.train.is_some() && (s.family != Family::Qwen3 || s.llama3.is_some()) {
        return bad("--train trains a qwen3 model only".into());
    }
    if s.layers == 0 || s.hidden == 0 || s.heads == 0 || s.kv_heads == 0 || s.intermediate == 0 {
        return bad(
            "layers, hidden, heads, kv heads and intermediate size must be at least 1".into(),
        );
    }
    if !s.heads.is_multiple_of(s.kv_heads) {
        return bad(format!(
            "{} kv heads do not divide {} heads",
            s.kv_heads, s.heads
        ));
    }
    let hd = head_dim(s);
    if hd == 0 || !hd.is_multiple_of(2) {
        return bad(format!("head size {hd} must be even and at least 2"));
    }
    if s.head_dim.is_none() && s.family != Family::Qwen3 && !s.hidden.is_multiple_of(s.heads) {
        return bad(format!(
            "hidden {} is not a multiple of {} heads: give a head size",
            s.hidden, s.heads
        ));
    }
    if s.layers > MAX_LAYERS {
        return bad(format!(
            "{} layers: at most {MAX_LAYERS} (a test model; the largest HF models have under 200)",
            s.layers
        ));
    }
    let n = parameters(s);
    if n > MAX_PARAMETERS {
        return bad(format!(
            "{n} parameters (vocabulary {}, hidden {}, {} layers, {} heads of {hd}, intermediate {}): at most {MAX_PARAMETERS}, 4 GiB of f32, which the maker holds at once",
            s.vocab, s.hidden, s.layers, s.heads, s.intermediate
        ));
    }
    let least = SPECIAL_TOKENS.len() + 256;
    if s.vocab < least {
        return bad(format!(
            "vocabulary {} is too small for a byte-level tokenizer: at least {least}",
            s.vocab
        ));
    }
    // NaN or negative: weights no model computes with, written without a word.
    if !(s.init_std.is_finite() && s.init_std > 0.0) {
        return bad(format!("init std {} must be a positive number", s.init_std));
    }
    // As the loader asks (`config.rs`): a base of 1 or less makes no rotation frequencies.
    if !(s.rope_theta.is_finite() && s.rope_theta > 1.0) {
        return bad(format!(
            "rope theta {} must be a number above 1",
            s.rope_theta
        ));
    }
    if s.shard_bytes == Some(0) {
        return bad("shard size 0: must be at least 1 MiB".into());
    }
    if let Some(t) = &s.train {
        crate::pretrain::check(t)?;
        // A sequence past the positions the config declares; and before that bound, attention
        // scores past memory (batch x heads x len^2 per layer, with their gradients): both
        // aborted on an allocation after seconds, leaving an empty directory.
        if t.seq_len > MAX_POSITIONS {
            return bad(format!(
                "--train-len {} is past the model's max_position_embeddings, {MAX_POSITIONS}",
                t.seq_len
            ));
        }
        let scores = (s.layers as u128)
            .saturating_mul(t.batch as u128)
            .saturating_mul(s.heads as u128)
            .saturating_mul((t.seq_len as u128).saturating_pow(2));
        if scores > MAX_PARAMETERS {
            return bad(format!(
                "--train-len {} with --train-batch {}, {} heads and {} layers trains on {scores} attention scores at once: at most {MAX_PARAMETERS}, 4 GiB of f32; shorten --train-len or --train-batch",
                t.seq_len, t.batch, s.heads, s.layers
            ));
        }
    }
    Ok(())
}

/// The most decoder layers a made model has.
pub const MAX_LAYERS: usize = 1024;

/// The most parameters a made model has (2^30, 4 GiB of f32): every weight is drawn in f32 and
/// held at once, so past it a typo aborts on the allocation or draws for minutes.
pub const MAX_PARAMETERS: u128 = 1 << 30;

/// The parameters [`tensors`] draws for `s` (biases and norms of any family counted, so an
/// upper bound), without overflow.
fn parameters(s: &MakeSpec) -> u128 {
    let n = |x: usize| x as u128;
    let (h, i, v, hd) = (n(s.hidden), n(s.intermediate), n(s.vocab), n(head_dim(s)));
    let (q, kv) = (
        n(s.heads).saturating_mul(hd),
        n(s.kv_heads).saturating_mul(hd),
    );
    let attention = h.saturating_mul(q.saturating_mul(2).saturating_add(kv.saturating_mul(2)));
    let mlp = h.saturating_mul(i).saturating_mul(3);
    let small = (h.saturating_mul(3))
        .saturating_add(q)
        .saturating_add(kv.saturating_mul(2))
        .saturating_add(hd.saturating_mul(2));
    let layer = attention.saturating_add(mlp).saturating_add(small);
    let embeddings = v
        .saturating_mul(h)
        .saturating_mul(if s.tied { 1 } else { 2 });
    n(s.layers)
        .saturating_mul(layer)
        .saturating_add(embeddings)
        .saturating_add(h)
}

/// The head size the config implies (HF's defaults when none is written).
fn head_dim(s: &MakeSpec) -> usize {
    match (s.head_dim, s.family) {
        (Some(d), _) => d,
        (None, Family::Qwen3) => 128,
        (None, _) => s.hidden / s.heads,
    }
}

fn config_json(s: &MakeSpec) -> Value {
    let arch = match s.family {
        Family::Qwen3 => "Qwen3ForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
        Family::Llama => "LlamaForCausalLM",
        Family::Mistral => "MistralForCausalLM",
    };
    let mut c = json!({
        "architectures": [arch],
        "model_type": s.family.name(),
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": s.tied,
        "initializer_range": s.init_std,
        "bos_token_id": null,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_cache": true,
    });
    let o = c.as_object_mut().expect("an object");
    if let Some(d) = s.head_dim {
        o.insert("head_dim".into(), json!(d));
    }
    match s.family {
        Family::Qwen3 | Family::Qwen2 => {
            o.insert("use_sliding_window".into(), json!(false));
            // Qwen3 checkpoints write null; Qwen2's write a size (unused without the flag).
            let window = match s.family {
                Family::Qwen2 => json!(32768),
                _ => Value::Null,
            };
            o.insert("sliding_window".into(), window);
            o.insert("max_window_layers".into(), json!(s.layers));
            o.insert("attention_bias".into(), json!(s.family == Family::Qwen2));
        }
        Family::Llama => {
            o.insert("attention_bias".into(), json!(s.attention_bias));
            o.insert("mlp_bias".into(), json!(false));
        }
        // As Mistral 7B v0.3 writes it: no window (v0.1 wrote 4096).
        Family::Mistral => {
            o.insert("sliding_window".into(), Value::Null);
        }
    }
    let scaling = s.llama3.map(|l| {
        json!({
            "rope_type": "llama3",
            "factor": l.factor,
            "low_freq_factor": l.low_freq_factor,
            "high_freq_factor": l.high_freq_factor,
            // An integer, as HF writes it.
            "original_max_position_embeddings": l.original_max_position_embeddings.round() as u64,
        })
    });
    match s.style {
        ConfigStyle::Legacy => {
            o.insert("rope_theta".into(), json!(s.rope_theta));
            o.insert("rope_scaling".into(), scaling.unwrap_or(Value::Null));
            o.insert("torch_dtype".into(), json!(s.stored.hf_name()));
            o.insert("transformers_version".into(), json!("4.51.0"));
        }
        ConfigStyle::V5 => {
            let mut p = scaling.unwrap_or_else(|| json!({"rope_type": "default"}));
            p.as_object_mut()
                .expect("an object")
                .insert("rope_theta".into(), json!(s.rope_theta));
            o.insert("rope_parameters".into(), p);
            o.insert("dtype".into(), json!(s.stored.hf_name()));
            o.insert("transformers_version".into(), json!("5.0.0"));
        }
    }
    c
}

fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("JSON values serialise");
    s.push('\n');
    s
}

#[derive(Clone)]
struct Tensor {
    name: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// Every tensor of the model, in HF's order, drawn from one seeded stream.
fn tensors(s: &MakeSpec) -> Vec<Tensor> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(s.seed);
    let mut normal = move |n: usize, mean: f32, std: f32| -> Vec<f32> {
        (0..n)
            .map(|_| mean + std * crate::train::normal(&mut rng))
            .collect()
    };
    let (h, i, v, std) = (s.hidden, s.intermediate, s.vocab, s.init_std);
    let hd = head_dim(s);
    let (q, kv) = (s.heads * hd, s.kv_heads * hd);
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, data: Vec<f32>| {
        out.push(Tensor { name, shape, data });
    };
    push(
        "model.embed_tokens.weight".into(),
        vec![v, h],
        normal(v * h, 0.0, std),
    );
    let qkv_bias = match s.family {
        Family::Qwen2 => true,
        Family::Llama => s.attention_bias,
        Family::Qwen3 | Family::Mistral => false,
    };
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        push(
            format!("{p}.input_layernorm.weight"),
            vec![h],
            normal(h, 1.0, 0.1),
        );
        for (n, out_dim) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            push(
                format!("{p}.self_attn.{n}.weight"),
                vec![out_dim, h],
                normal(out_dim * h, 0.0, std),
            );
            if qkv_bias {
                push(
                    format!("{p}.self_attn.{n}.bias"),
                    vec![out_dim],
                    normal(out_dim, 0.0, std),
                );
            }
        }
        push(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, q],
            normal(h * q, 0.0, std),
        );
        if s.family == Family::Llama && s.attention_bias {
            push(
                format!("{p}.self_attn.o_proj.bias"),
                vec![h],
                normal(h, 0.0, std),
            );
        }
        if s.family == Family::Qwen3 {
            push(
                format!("{p}.self_attn.q_norm.weight"),
                vec![hd],
                normal(hd, 1.0, 0.1),
            );
            push(
                format!("{p}.self_attn.k_norm.weight"),
                vec![hd],
                normal(hd, 1.0, 0.1),
            );
        }
        push(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            normal(h, 1.0, 0.1),
        );
        push(
            format!("{p}.mlp.gate_proj.weight"),
            vec![i, h],
            normal(i * h, 0.0, std),
        );
        push(
            format!("{p}.mlp.up_proj.weight"),
            vec![i, h],
            normal(i * h, 0.0, std),
        );
        push(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            normal(h * i, 0.0, std),
        );
    }
    push("model.norm.weight".into(), vec![h], normal(h, 1.0, 0.1));
    if !s.tied {
        push("lm_head.weight".into(), vec![v, h], normal(v * h, 0.0, std));
    }
    out
}

fn bytes_per(s: Stored) -> usize {
    match s {
        Stored::F32 => 4,
        Stored::F16 | Stored::Bf16 => 2,
    }
}

/// Groups tensor indices into shards of at most `max` bytes (one tensor per shard at least).
fn shard(tensors: &[Tensor], max: Option<u64>) -> Vec<Vec<usize>> {
    let Some(max) = max else {
        return vec![(0..tensors.len()).collect()];
    };
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let b = (t.data.len() * 4) as u64;
        let last = shards.last_mut().expect("one shard");
        if !last.is_empty() && size + b > max {
            shards.push(vec![i]);
            size = b;
        } else {
            last.push(i);
            size += b;
        }
    }
    shards
}

fn serialize(tensors: &[Tensor], stored: Stored) -> Result<Vec<u8>> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let bytes: Vec<u8> = match stored {
                Stored::F32 => t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Stored::F16 => t
                    .data
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect(),
                Stored::Bf16 => t
                    .data
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect(),
            };
            (t.name.clone(), t.shape.clone(), bytes)
        })
        .collect();
    let dtype = match stored {
        Stored::F32 => safetensors::Dtype::F32,
        Stored::F16 => safetensors::Dtype::F16,
        Stored::Bf16 => safetensors::Dtype::BF16,
    };
    let mut views = Vec::with_capacity(encoded.len());
    for (name, shape, bytes) in &encoded {
        let view = safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes)
            .map_err(|e| ModelError::Input(format!("tensor {name}: {e}")))?;
        views.push((name.as_str(), view));
    }
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::serialize(views, Some(meta))
        .map_err(|e| ModelError::Input(format!("serialising the weights: {e}")))
}

/// Words of the built-in corpus the tokenizer's merges are learnt from.
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "token",
    "layer",
    "train",
    "data",
    "speculative",
    "decoding",
    "draft",
    "target",
    "hidden",
    "state",
    "sequence",
    "batch",
    "memory",
    "process",
    "question",
    "answer",
    "please",
    "explain",
    "why",
    "how",
    "what",
    "think",
    "step",
    "first",
    "then",
    "finally",
    "number",
    "value",
    "function",
    "return",
    "print",
    "list",
    "time",
    "people",
    "world",
    "water",
    "light",
    "system",
    "work",
    "example",
    "because",
    "about",
    "between",
    "through",
    "after",
    "before",
    "under",
    "over",
    "small",
    "large",
    "good",
    "new",
    "old",
    "long",
    "right",
    "left",
    "city",
    "river",
    "house",
];

/// A byte-level BPE `tokenizer.json` of at most `vocab` tokens.
fn tokenizer(vocab: usize, seed: u64) -> Result<String> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, Tokenizer};

    let err = |e: tokenizers::Error| ModelError::Tokenizer(e.to_string());
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x70c);
    let mut lines = Vec::with_capacity(4000);
    for _ in 0..4000 {
        let n = rng.random_range(4..16usize);
        let mut line = String::new();
        for k in 0..n {
            let w = WORDS[rng.random_range(0..WORDS.len())];
            if k == 0 {
                let mut c = w.chars();
                if let Some(f) = c.next() {
                    line.extend(f.to_uppercase());
                    line.push_str(c.as_str());
                }
            } else {
                line.push(' ');
                line.push_str(w);
            }
        }
        line.push_str(if rng.random_bool(0.2) { "?\n" } else { ".\n" });
        if rng.random_bool(0.1) {
            line.push_str(&format!(
                "{} {}\n",
                rng.random_range(0..1000u32),
                rng.random_range(0..100u32)
            ));
        }
        lines.push(line);
    }
    let specials = SPECIAL_TOKENS
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    tok.train(&mut trainer, lines.iter()).map_err(err)?;
    tok.to_string(true).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec no model can be made from is refused before anything is written, saying which
    /// value is wrong (not as a "batch" of a run); NaN weights are never written.
    #[test]
    fn a_bad_spec_is_refused_before_the_directory_is_made() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("m");
        let train = |f: fn(&mut crate::pretrain::TrainSpec)| {
            let mut ts = crate::pretrain::TrainSpec::default();
            f(&mut ts);
            MakeSpec {
                train: Some(ts),
                ..MakeSpec::default()
            }
        };
        let cases = [
            (
                MakeSpec {
                    heads: 0,
                    ..MakeSpec::default()
                },
                "at least 1",
            ),
            (
                MakeSpec {
                    init_std: f32::NAN,
                    ..MakeSpec::default()
                },
                "init std NaN",
            ),
            (
                MakeSpec {
                    init_std: -1.0,
                    ..MakeSpec::default()
                },
                "init std -1",
            ),
            (
                MakeSpec {
                    rope_theta: 0.0,
                    ..MakeSpec::default()
                },
                "rope theta 0",
            ),
            // Positive, but no base the loader takes: the model would not load.
            (
                MakeSpec {
                    rope_theta: 0.5,
                    ..MakeSpec::default()
                },
                "rope theta 0.5 must be a number above 1",
            ),
            (
                MakeSpec {
                    shard_bytes: Some(0),
                    ..MakeSpec::default()
                },
                "shard size",
            ),
            // Sizes that aborted on the allocation or drew for minutes.
            (
                MakeSpec {
                    vocab: u32::MAX as usize,
                    ..MakeSpec::default()
                },
                "at most 1073741824",
            ),
            (
                MakeSpec {
                    hidden: 1_000_000,
                    ..MakeSpec::default()
                },
                "at most 1073741824",
            ),
            (
                MakeSpec {
                    layers: u32::MAX as usize,
                    ..MakeSpec::default()
                },
                "4294967295 layers: at most 1024",
            ),
            (
                MakeSpec {
                    heads: usize::MAX,
                    kv_heads: 1,
                    ..MakeSpec::default()
                },
                "at most 1073741824",
            ),
            (train(|t| t.steps = 0), "at least one step"),
            (train(|t| t.lr = f64::NAN), "learning rate NaN"),
            // Aborted on an allocation after 14 s, leaving an empty directory.
            (
                train(|t| t.seq_len = 40_000),
                "--train-len 40000 is past the model's max_position_embeddings, 32768",
            ),
            (
                train(|t| t.seq_len = 4096),
                "--train-len 4096 with --train-batch 8, 4 heads and 8 layers",
            ),
            // Written as infinities before.
            (
                MakeSpec {
                    stored: Stored::F16,
                    init_std: 1e6,
                    ..MakeSpec::default()
                },
                "which float16 does not hold (its largest is 6.5504e4): lower --init-std",
            ),
            (
                MakeSpec {
                    stored: Stored::F32,
                    init_std: 1e38,
                    ..MakeSpec::default()
                },
                "which float32 does not hold",
            ),
        ];
        for (spec, want) in cases {
            let e = make_model_reporting(&dir, &spec, &mut |_, _| {})
                .unwrap_err()
                .to_string();
            assert!(e.contains(want) && !e.starts_with("batch"), "{want}: {e}");
            assert!(!dir.exists(), "{want}: {} was made", dir.display());
        }
    }

    /// A small model: a 2-layer tiny Qwen3 in about 0.3 MB of f32, so shards of 64 KiB split it.
    fn small() -> MakeSpec {
        MakeSpec {
            layers: 2,
            ..MakeSpec::default()
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Links found where the model goes are replaced, never written through: an HF snapshot's
    /// files are links into its blob store. Before, the file a link named got the weights and a
    /// dangling link's target was created. Every link here points into the test's own dir.
    #[test]
    fn a_model_is_never_written_through_a_link() {
        let t = tempfile::tempdir().unwrap();
        let p = |n: &str| t.path().join(n);
        std::fs::write(p("precious"), "precious").unwrap();
        std::fs::create_dir(p("snapshot")).unwrap();
        std::os::unix::fs::symlink(p("precious"), p("snapshot/model.safetensors")).unwrap();
        std::os::unix::fs::symlink(p("nowhere"), p("snapshot/config.json")).unwrap();
        make_model(&p("snapshot"), &small()).unwrap();
        assert_eq!(std::fs::read_to_string(p("precious")).unwrap(), "precious");
        assert!(!p("nowhere").exists(), "a dangling link's target was made");
        for f in ["model.safetensors", "config.json"] {
            let m = std::fs::symlink_metadata(p("snapshot").join(f)).unwrap();
            assert!(m.is_file(), "{f} is a regular file now");
        }
        // The directory itself as a link (to a directory, or dangling): the link is replaced
        // by the model's directory; what it named is left as it was.
        std::fs::create_dir(p("real")).unwrap();
        std::fs::write(p("real/notes.txt"), "mine").unwrap();
        std::os::unix::fs::symlink(p("real"), p("linked")).unwrap();
        std::os::unix::fs::symlink(p("missing"), p("dangling")).unwrap();
        for d in ["linked", "dangling"] {
            make_model(&p(d), &small()).unwrap();
            assert!(std::fs::symlink_metadata(p(d)).unwrap().is_dir(), "{d}");
            assert!(p(d).join("config.json").is_file(), "{d}");
        }
        assert_eq!(names(&p("real")), ["notes.txt"]);
        assert!(!p("missing").exists());
        let left: Vec<String> = names(t.path())
            .into_iter()
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "temporaries left: {left:?}");
    }

    /// A model made again replaces the earlier one whole: a single file left beside new shards
    /// (or shards and an index beside a new single file) would be loaded instead of, or with,
    /// the new weights. Before, the earlier layout's files stayed.
    #[test]
    fn a_model_made_again_leaves_nothing_of_the_earlier_layout() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("m");
        let one = [
            "chat_template.jinja",
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ];
        make_model(&d, &small()).unwrap();
        assert_eq!(names(&d), one);
        let sharded = MakeSpec {
            shard_bytes: Some(64 << 10),
            seed: 5,
            ..small()
        };
        make_model(&d, &sharded).unwrap();
        let got = names(&d);
        assert!(!got.contains(&"model.safetensors".to_string()), "{got:?}");
        assert!(
            got.contains(&"model.safetensors.index.json".to_string()),
            "{got:?}"
        );
        assert!(
            got.iter().any(|n| n.starts_with("model-00001-of-")),
            "{got:?}"
        );
        make_model(&d, &small()).unwrap();
        assert_eq!(names(&d), one);
    }

    /// The model replaces its directory whole, so a directory holding anything but a model's
    /// files is refused, naming them, and left as it was (before, they were kept beside the
    /// model; now they would be deleted). So is a file, and a directory with no name.
    #[test]
    fn a_directory_holding_other_files_is_refused_and_left_alone() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("m");
        make_model(&d, &small()).unwrap();
        std::fs::write(d.join("notes.txt"), "mine").unwrap();
        std::fs::create_dir(d.join(".cache")).unwrap();
        let before = names(&d);
        let e = make_model(&d, &small()).unwrap_err().to_string();
        assert!(
            e.contains("it holds .cache, notes.txt, which are not a model's files"),
            "{e}"
        );
        assert_eq!(names(&d), before);
        let f = t.path().join("file");
        std::fs::write(&f, "x").unwrap();
        let e = make_model(&f, &small()).unwrap_err().to_string();
        assert!(e.contains("it is a file, not a directory"), "{e}");
        let e = make_model(&d.join(".."), &small()).unwrap_err().to_string();
        assert!(e.contains("by its own name"), "{e}");
    }
}
