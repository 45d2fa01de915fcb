//! `config.json` as HF writes it, read into the one shape this crate runs: [`ArchConfig`].
//!
//! Both styles in use are read: most checkpoints on the Hub (transformers 4) write `rope_theta`,
//! `rope_scaling` and `torch_dtype` at the top level; transformers 5 writes `rope_parameters:
//! {rope_theta, rope_type, ...}` and `dtype`. Defaults are HF's own for each model type (Qwen3's
//! `head_dim` defaults to 128, not `hidden_size / num_attention_heads`). Anything else is refused
//! with the field and its value: another `model_type`, a mixture of experts, a rope type other
//! than `default` and `llama3`, an activation other than SiLU. A sliding window (Mistral's, and
//! Qwen's with `use_sliding_window`) is kept: it bounds the sequences run
//! ([`ArchConfig::positions`]), as no sequence at most as long as the window reaches past it,
//! and so it changes nothing.
//!
//! Length: past 500 lines with its tests, one per rule of HF's that this file follows.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::{ModelError, Result};

/// The model types this crate runs: one dense decoder, three sets of flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// q/k RMS norm per head, no biases, `head_dim` its own field.
    Qwen3,
    /// Biases on q, k and v (not o), no q/k norm.
    Qwen2,
    /// No q/k norm; `attention_bias` and `mlp_bias` as configured; llama3 rope scaling common.
    Llama,
    /// Llama's layers without biases, and a sliding window of attention (`sliding_window`).
    Mistral,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Qwen2 => "qwen2",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
        }
    }

    fn parse(s: &str) -> Option<Family> {
        Some(match s {
            "qwen3" => Family::Qwen3,
            "qwen2" => Family::Qwen2,
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            _ => return None,
        })
    }
}

/// Llama 3.1's frequency-dependent rope scaling (`rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// How rotary frequencies are scaled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Llama3(Llama3Scaling),
}

/// Everything the forward needs from `config.json`, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on the MLP's three projections.
    pub mlp_bias: bool,
    /// RMS norm of each head's q and k before rope (Qwen3).
    pub qk_norm: bool,
    /// The dtype the checkpoint says it stores (`torch_dtype` or `dtype`), if it says.
    pub stored_dtype: Option<String>,
    /// The longest context the model was made for (HF's default per type where absent); a
    /// drafter's export copies it.
    pub max_position_embeddings: usize,
    /// The sliding window (Mistral's; Qwen's with use_sliding_window): a token attends to the
    /// `sliding_window` tokens up to itself (HF's mask: key `j` for query `i` where `i - j <
    /// sliding_window`). `None`: all of them.
    pub sliding_window: Option<usize>,
}

/// The fields read, each `None` where absent or null; `rest` is the whole file, to look for
/// what must be refused.
struct Raw {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    rest: Map<String, Value>,
}

impl Raw {
    /// Reads each field on its own, so a value of the wrong type is an error naming the field
    /// and the value (serde's error for the whole struct names neither).
    fn read(rest: Map<String, Value>) -> std::result::Result<Raw, String> {
        fn field<T: DeserializeOwned>(
            m: &Map<String, Value>,
            name: &str,
        ) -> std::result::Result<Option<T>, String> {
            match m.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => T::deserialize(v)
                    .map(Some)
                    .map_err(|e| format!("{name} = {v}: {e}")),
            }
        }
        let m = &rest;
        Ok(Raw {
            model_type: field(m, "model_type")?,
            vocab_size: field(m, "vocab_size")?,
            hidden_size: field(m, "hidden_size")?,
            intermediate_size: field(m, "intermediate_size")?,
            num_hidden_layers: field(m, "num_hidden_layers")?,
            num_attention_heads: field(m, "num_attention_heads")?,
            num_key_value_heads: field(m, "num_key_value_heads")?,
            head_dim: field(m, "head_dim")?,
            rms_norm_eps: field(m, "rms_norm_eps")?,
            max_position_embeddings: field(m, "max_position_embeddings")?,
            rope_theta: field(m, "rope_theta")?,
            rope_scaling: field(m, "rope_scaling")?,
            rope_parameters: field(m, "rope_parameters")?,
            tie_word_embeddings: field(m, "tie_word_embeddings")?,
            attention_bias: field(m, "attention_bias")?,
            mlp_bias: field(m, "mlp_bias")?,
            hidden_act: field(m, "hidden_act")?,
            use_sliding_window: field(m, "use_sliding_window")?,
            sliding_window: field(m, "sliding_window")?,
            torch_dtype: field(m, "torch_dtype")?,
            dtype: field(m, "dtype")?,
            rest,
        })
    }
}

/// Fields whose presence (with a non-zero value) means a mixture of experts.
const MOE_FIELDS: &[&str] = &[
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
];

impl ArchConfig {
    /// Reads `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<ArchConfig> {
        let path = dir.join("config.json");
        let text = atomic_file::read_regular(&path).map_err(|cause| {
            crate::unreadable_config(
                dir,
                path.clone(),
                cause,
                "an HF model directory holds config.json, safetensors weights and tokenizer.json; `launcher make-model DIR` makes a tiny one",
            )
        })?;
        ArchConfig::parse(&text, &path)
    }

    /// Parses a `config.json`'s text (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<ArchConfig> {
        let bad = |why: String| ModelError::Config {
            path: path.to_path_buf(),
            why,
        };
        let map: Map<String, Value> =
            serde_json::from_str(text).map_err(|e| bad(format!("not a config: {e}")))?;
        let raw = Raw::read(map).map_err(bad)?;
        let model_type = raw
            .model_type
            .as_deref()
            .ok_or_else(|| bad("no model_type field".into()))?;
        let family = Family::parse(model_type).ok_or_else(|| {
            bad(format!(
                "model_type = {model_type:?} is not supported: expected \"qwen3\", \"qwen2\", \"llama\" or \"mistral\" (dense decoders)"
            ))
        })?;
        for f in MOE_FIELDS {
            if let Some(v) = raw.rest.get(*f) {
                if !(v.is_null() || v.as_u64() == Some(0)) {
                    return Err(bad(format!(
                        "{f} = {v}: mixture-of-experts models are not supported (dense decoders only)"
                    )));
                }
            }
        }
        if let Some(q) = raw.rest.get("quantization_config").filter(|q| !q.is_null()) {
            return Err(bad(format!(
                "quantization_config = {q}: quantized checkpoints are not supported (f32, f16 or bf16 weights only)"
            )));
        }
        let need = |v: Option<usize>, name: &str| -> Result<usize> {
            match v {
                Some(0) => Err(bad(format!("{name} = 0: must be at least 1"))),
                Some(v) => Ok(v),
                None => Err(bad(format!("no {name} field"))),
            }
        };
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        // HF's defaults: null is num_attention_heads; absent is Qwen2Config's and Qwen3Config's
        // 32, MistralConfig's 8, LlamaConfig's num_attention_heads.
        let kv_absent = !raw.rest.contains_key("num_key_value_heads");
        let num_key_value_heads = match (raw.num_key_value_heads, family) {
            (Some(n), _) => n,
            (None, Family::Qwen3 | Family::Qwen2) if kv_absent => 32,
            (None, Family::Mistral) if kv_absent => 8,
            (None, _) => num_attention_heads,
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            let which = if raw.num_key_value_heads.is_none() && kv_absent {
                format!(
                    "no num_key_value_heads field: HF's default for {} is {num_key_value_heads}, which",
                    family.name()
                )
            } else {
                format!("num_key_value_heads = {num_key_value_heads}")
            };
            return Err(bad(format!(
                "{which} must divide num_attention_heads = {num_attention_heads}"
            )));
        }
        let head_dim = match (raw.head_dim, family) {
            (Some(d), _) => d,
            // HF's Qwen3Config defaults head_dim to 128 whatever the hidden size.
            (None, Family::Qwen3) => 128,
            (None, _) => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(bad(format!(
                        "no head_dim field, and hidden_size = {hidden_size} is not a multiple of num_attention_heads = {num_attention_heads}"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!(
                "head_dim = {head_dim}: rotary embeddings need an even head size"
            )));
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(bad(format!(
                    "hidden_act = {act:?} is not supported: expected \"silu\""
                )));
            }
        }
        let qwen = matches!(family, Family::Qwen3 | Family::Qwen2);
        if raw.use_sliding_window == Some(true) && !qwen {
            return Err(bad(format!(
                "use_sliding_window = true is not a {} field (full attention only)",
                family.name()
            )));
        }
        // HF's defaults: Qwen3Config 32768, Qwen2Config 32768, LlamaConfig 2048,
        // MistralConfig 4096 * 32.
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(match family {
            Family::Qwen3 | Family::Qwen2 => 32768,
            Family::Llama => 2048,
            Family::Mistral => 4096 * 32,
        });
        // MistralConfig's default is 4096 (Mistral 7B v0.1's); null is no window (v0.3's).
        // Qwen's configs write a window they use only with use_sliding_window (and then in the
        // layers from max_window_layers on: bounding every sequence by it covers those too);
        // their default is 4096 as well. Llama has none.
        let window = || match raw.rest.contains_key("sliding_window") {
            false => Some(4096),
            true => raw.sliding_window,
        };
        let sliding_window = match family {
            Family::Mistral => window(),
            Family::Qwen3 | Family::Qwen2 if raw.use_sliding_window == Some(true) => window(),
            _ => None,
        };
        if sliding_window == Some(0) {
            return Err(bad(
                "sliding_window = 0: a token must attend to itself at least".into(),
            ));
        }
        let (rope_theta, rope_scaling) =
            rope(&raw, family, max_position_embeddings).map_err(bad)?;
        // A zero or negative epsilon turns RMSNorm's square root into NaN (or a division by
        // zero) for every token: the forward would compute NaN states and argmax 0 tokens.
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(bad(format!(
                "rms_norm_eps = {rms_norm_eps}: must be a positive number"
            )));
        }
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let cfg = ArchConfig {
            family,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            // Mistral's layers have no biases (MistralConfig reads no attention_bias).
            qkv_bias: match family {
                Family::Qwen2 => true,
                Family::Qwen3 | Family::Llama => attention_bias,
                Family::Mistral => false,
            },
            o_bias: match family {
                Family::Qwen2 | Family::Mistral => false,
                Family::Qwen3 | Family::Llama => attention_bias,
            },
            mlp_bias: match family {
                Family::Llama => raw.mlp_bias.unwrap_or(false),
                Family::Qwen3 | Family::Qwen2 | Family::Mistral => false,
            },
            qk_norm: family == Family::Qwen3,
            stored_dtype: raw.dtype.or(raw.torch_dtype),
            max_position_embeddings,
            sliding_window,
        };
        Ok(cfg)
    }

    /// The longest sequence this crate runs as HF does: the model's positions, and no more
    /// than its sliding window, where our attention (which sees every earlier token) would
    /// differ from the window's.
    pub fn positions(&self) -> usize {
        (self.sliding_window).map_or(self.max_position_embeddings, |w| {
            w.min(self.max_position_embeddings)
        })
    }

    /// What bounds [`positions`](Self::positions), for errors: `max_position_embeddings = N`
    /// or `sliding_window = N`.
    pub fn positions_bound(&self) -> String {
        match self.sliding_window {
            Some(w) if w < self.max_position_embeddings => format!(
                "sliding_window = {w} (a longer sequence's attention would see past the window)"
            ),
            _ => format!("max_position_embeddings = {}", self.max_position_embeddings),
        }
    }

    /// Features a q or k projection produces: heads x head size.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}

/// The rope base and scaling, from `rope_parameters` (transformers 5) or the top-level
/// `rope_theta` and `rope_scaling` (older), never both disagreeing (transformers 5 would take
/// `rope_scaling`). `max_position_embeddings` is the model's, with HF's default applied.
fn rope(
    raw: &Raw,
    family: Family,
    max_position_embeddings: usize,
) -> std::result::Result<(f64, RopeScaling), String> {
    let read = |params, where_| rope_from(raw, family, max_position_embeddings, params, where_);
    // An empty object is no parameters, as transformers takes it (falsy in Python).
    let given = |v: &Option<Value>| -> Option<Value> {
        v.clone()
            .filter(|v| v.as_object().is_none_or(|o| !o.is_empty()))
    };
    match (&given(&raw.rope_parameters), &given(&raw.rope_scaling)) {
        (Some(p), Some(s)) => {
            let (a, b) = (
                read(Some(p), "rope_parameters")?,
                read(Some(s), "rope_scaling")?,
            );
            if a != b {
                return Err(format!(
                    "rope_parameters = {p} and rope_scaling = {s} disagree: keep one of them"
                ));
            }
            Ok(a)
        }
        (Some(p), None) => read(Some(p), "rope_parameters"),
        (None, Some(s)) => read(Some(s), "rope_scaling"),
        (None, None) => read(None, ""),
    }
}

/// [`rope`] from one object of rope parameters (`where_` names it), or none.
fn rope_from(
    raw: &Raw,
    family: Family,
    max_position_embeddings: usize,
    params: Option<&Value>,
    where_: &str,
) -> std::result::Result<(f64, RopeScaling), String> {
    // HF's defaults: Qwen2 and Qwen3 configs default rope_theta to 10000.0 as Llama's does.
    let default_theta = match family {
        Family::Qwen3 | Family::Qwen2 | Family::Llama | Family::Mistral => 10000.0,
    };
    let obj = match params {
        None => None,
        Some(Value::Object(o)) => Some(o),
        Some(v) => return Err(format!("{where_} = {v}: expected an object")),
    };
    let num = |o: &Map<String, Value>, k: &str| -> std::result::Result<Option<f64>, String> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("{where_}.{k} = {v}: expected a number")),
        }
    };
    let theta = match obj {
        Some(o) => num(o, "rope_theta")?,
        None => None,
    }
    .or(raw.rope_theta)
    .unwrap_or(default_theta);
    if !(theta.is_finite() && theta > 1.0) {
        return Err(format!("rope_theta = {theta}: must be a number above 1"));
    }
    let Some(o) = obj else {
        return Ok((theta, RopeScaling::None));
    };
    // transformers 4 wrote "type" before "rope_type".
    let ty = o.get("rope_type").or_else(|| o.get("type"));
    let ty = match ty {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(format!("{where_}.rope_type = {v}: expected a string")),
    };
    match ty {
        "default" => Ok((theta, RopeScaling::None)),
        "llama3" => {
            let get = |k: &str| -> std::result::Result<f64, String> {
                num(o, k)?.ok_or_else(|| format!("{where_} has rope_type \"llama3\" but no {k}"))
            };
            // transformers' `standardize_rope_params`: the scaling's own, else the model's
            // length. A top-level original_max_position_embeddings is not read for these
            // models (only config classes that declare it, such as Phi3's, take it).
            let original = num(o, "original_max_position_embeddings")?
                .unwrap_or(max_position_embeddings as f64);
            let s = Llama3Scaling {
                factor: get("factor")?,
                low_freq_factor: get("low_freq_factor")?,
                high_freq_factor: get("high_freq_factor")?,
                original_max_position_embeddings: original,
            };
            let finite = [
                s.factor,
                s.low_freq_factor,
                s.high_freq_factor,
                s.original_max_position_embeddings,
            ]
            .iter()
            .all(|v| v.is_finite());
            if !(finite
                && s.factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.low_freq_factor > 0.0
                && s.original_max_position_embeddings > 0.0)
            {
                return Err(format!(
                    "{where_}: llama3 scaling needs finite numbers, factor > 0, original_max_position_embeddings > 0 and high_freq_factor > low_freq_factor > 0, got {s:?}"
                ));
            }
            Ok((theta, RopeScaling::Llama3(s)))
        }
        other => Err(format!(
            "{where_}.rope_type = {other:?} is not supported: expected \"default\" or \"llama3\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ArchConfig> {
        ArchConfig::parse(s, Path::new("m/config.json"))
    }

    /// A model directory whose config.json is a FIFO is refused by what it is, naming it,
    /// before it is opened (the open waited for a writer for ever).
    #[test]
    fn a_config_json_that_is_a_fifo_is_refused_without_opening_it() {
        let e = testkit::fifo_refusal("config.json", |d| {
            ArchConfig::load(d).err().map(|e| e.to_string())
        });
        assert!(
            e.contains("config.json") && e.contains("FIFO") && e.contains("not a regular file"),
            "{e}"
        );
    }

    /// A model path that is not a model directory (a typo, the weights file itself, a
    /// directory without config.json) says which of them it is, naming the path given, not
    /// the OS's "No such file or directory" or "Not a directory" on `DIR/config.json`.
    #[test]
    fn a_path_that_is_no_model_directory_says_what_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, "").unwrap();
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        for (d, said) in [
            (dir.path().join("typo"), "no such directory"),
            (file, "a file, not a directory"),
            (empty, "holds no config.json"),
        ] {
            let e = ArchConfig::load(&d).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{}: {said}", d.display()))
                    && e.contains("an HF model directory holds config.json"),
                "{e}"
            );
        }
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300"#;

    #[test]
    fn both_config_styles_give_the_same_rope() {
        let old = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
            "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        let new = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "dtype": "bfloat16",
            "rope_parameters": {{"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(old, new);
        assert_eq!(old.rope_theta, 500000.0);
        assert!(matches!(old.rope_scaling, RopeScaling::Llama3(s) if s.factor == 8.0));
        assert_eq!(old.stored_dtype.as_deref(), Some("bfloat16"));
        assert_eq!(old.head_dim, 16);
    }

    #[test]
    fn each_family_takes_its_own_flags_and_defaults() {
        let q3 = parse(&format!(r#"{{"model_type": "qwen3", {BASE}}}"#)).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias);
        assert_eq!(
            q3.head_dim, 128,
            "Qwen3's head_dim defaults to 128, as HF's"
        );
        let q2 = parse(&format!(r#"{{"model_type": "qwen2", {BASE}}}"#)).unwrap();
        assert!(q2.qkv_bias && !q2.o_bias && !q2.qk_norm);
        let l = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "attention_bias": true, "mlp_bias": true, "tie_word_embeddings": true}}"#
        ))
        .unwrap();
        assert!(l.qkv_bias && l.o_bias && l.mlp_bias && l.tie_word_embeddings);
    }

    /// Mistral takes MistralConfig's defaults (8 kv heads, a window of 4096 where the field is
    /// absent, none where it is null), no biases whatever attention_bias says (MistralConfig
    /// reads none), and its window bounds the positions run. Before, `mistral` was refused.
    #[test]
    fn mistral_takes_its_defaults_and_its_window_bounds_the_positions() {
        let base = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 16, "vocab_size": 300"#;
        let v01 = parse(&format!(
            r#"{{"model_type": "mistral", {base}, "attention_bias": true}}"#
        ))
        .unwrap();
        assert_eq!(v01.family, Family::Mistral);
        assert_eq!((v01.num_key_value_heads, v01.head_dim), (8, 4));
        assert!(!v01.qkv_bias && !v01.o_bias && !v01.mlp_bias && !v01.qk_norm);
        assert_eq!(v01.max_position_embeddings, 131072);
        assert_eq!((v01.sliding_window, v01.positions()), (Some(4096), 4096));
        assert!(v01.positions_bound().starts_with("sliding_window = 4096"));
        let v03 = parse(&format!(
            r#"{{"model_type": "mistral", {base}, "sliding_window": null, "max_position_embeddings": 32768}}"#
        ))
        .unwrap();
        assert_eq!((v03.sliding_window, v03.positions()), (None, 32768));
        assert_eq!(v03.positions_bound(), "max_position_embeddings = 32768");
        let wide = parse(&format!(
            r#"{{"model_type": "mistral", {base}, "sliding_window": 65536, "max_position_embeddings": 32768}}"#
        ))
        .unwrap();
        assert_eq!(wide.positions(), 32768, "a window wider than the model");
        // Qwen2 writes a window it does not use: its positions stay its own.
        let q2 = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "sliding_window": 4096, "use_sliding_window": false}}"#
        ))
        .unwrap();
        assert_eq!((q2.sliding_window, q2.positions()), (None, 32768));
        // With use_sliding_window, its window bounds the sequences as Mistral's does (it was
        // refused).
        let q2 = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "sliding_window": 2048, "use_sliding_window": true}}"#
        ))
        .unwrap();
        assert_eq!((q2.sliding_window, q2.positions()), (Some(2048), 2048));
        let e = parse(&format!(
            r#"{{"model_type": "mistral", {base}, "sliding_window": 0}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("sliding_window = 0"), "{e}");
    }

    #[test]
    fn what_is_not_run_is_refused_by_field_and_value() {
        let cases = [
            (r#""model_type": "mixtral""#, "model_type = \"mixtral\""),
            (
                r#""model_type": "qwen3", "num_experts": 8"#,
                "num_experts = 8",
            ),
            (
                r#""model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#,
                "rope_scaling.rope_type = \"yarn\"",
            ),
            (
                r#""model_type": "llama", "rope_parameters": {"rope_type": "dynamic"}"#,
                "rope_parameters.rope_type = \"dynamic\"",
            ),
            (
                r#""model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#,
                "no low_freq_factor",
            ),
            (
                r#""model_type": "llama", "hidden_act": "gelu""#,
                "hidden_act = \"gelu\"",
            ),
            (
                r#""model_type": "llama", "use_sliding_window": true"#,
                "use_sliding_window = true is not a llama field",
            ),
            // RMSNorm's epsilon: a negative one made every state NaN and every greedy token 0,
            // which capture wrote and eval scored as perfect.
            (
                r#""model_type": "qwen3", "rms_norm_eps": -1"#,
                "rms_norm_eps = -1: must be a positive number",
            ),
            (
                r#""model_type": "llama", "rms_norm_eps": 0"#,
                "rms_norm_eps = 0: must be a positive number",
            ),
            (
                r#""model_type": "llama", "rope_theta": 0.5"#,
                "rope_theta = 0.5",
            ),
        ];
        for (fields, want) in cases {
            let e = parse(&format!("{{{fields}, {BASE}}}"))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("m/config.json: ") && e.contains(want), "{e}");
        }
        let e = parse(r#"{"model_type": "qwen3", "hidden_size": 64}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no num_attention_heads field"), "{e}");
        let e = parse(
            r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
            "vocab_size": 300}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("num_key_value_heads = 3 must divide"), "{e}");
        let e = parse("[1, 2]").unwrap_err().to_string();
        assert!(e.contains("not a config"), "{e}");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named_with_its_value() {
        for (field, value) in [
            ("head_dim", r#""128""#),
            ("rms_norm_eps", r#""1e-6""#),
            ("tie_word_embeddings", r#""yes""#),
            ("max_position_embeddings", "-1"),
            ("hidden_act", "1"),
        ] {
            let e = parse(&format!(
                r#"{{"model_type": "qwen3", {BASE}, "{field}": {value}}}"#
            ))
            .unwrap_err()
            .to_string();
            assert!(
                e.starts_with("m/config.json: ") && e.contains(&format!("{field} = {value}")),
                "{field}: {e}"
            );
        }
    }

    const LLAMA3: &str = r#""rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192"#;

    #[test]
    fn rope_parameters_and_rope_scaling_must_agree() {
        // transformers 5 takes rope_scaling over rope_parameters; reading one of two that
        // disagree would run another rope than HF's.
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{{LLAMA3}}},
            "rope_parameters": {{"rope_type": "default", "rope_theta": 10000.0}}}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rope_parameters") && e.contains("rope_scaling") && e.contains("disagree"),
            "{e}"
        );
        let both = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 500000.0, "rope_scaling": {{{LLAMA3}}},
            "rope_parameters": {{{LLAMA3}, "rope_theta": 500000.0}}}}"#
        ))
        .unwrap();
        assert!(matches!(both.rope_scaling, RopeScaling::Llama3(s) if s.factor == 8.0));
        // An empty rope_scaling is none, as transformers takes it: rope_parameters holds.
        let empty = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{}},
            "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#
        ))
        .unwrap();
        assert_eq!(empty.rope_theta, 500000.0);
    }

    #[test]
    fn llama3_scaling_without_its_original_length_takes_max_position_embeddings() {
        // As transformers' `standardize_rope_params`: the model's own length where the
        // scaling names none.
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "max_position_embeddings": 4096,
            "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}}}}"#
        ))
        .unwrap();
        assert!(matches!(c.rope_scaling,
            RopeScaling::Llama3(s) if s.original_max_position_embeddings == 4096.0));
        // A top-level original_max_position_embeddings is ignored, as transformers ignores it
        // for llama, qwen2 and qwen3 (checked with LlamaConfig.from_dict, transformers 5.23).
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "original_max_position_embeddings": 2048,
            "rope_scaling": {{{LLAMA3}}}}}"#
        ))
        .unwrap();
        assert!(matches!(c.rope_scaling,
            RopeScaling::Llama3(s) if s.original_max_position_embeddings == 8192.0));
    }

    #[test]
    fn num_key_value_heads_absent_takes_each_types_default() {
        // HF's Qwen2Config and Qwen3Config default it to 32 where the field is absent (to
        // num_attention_heads only where it is null); LlamaConfig to num_attention_heads.
        let heads = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 64, "head_dim": 16, "vocab_size": 300"#;
        for (ty, kv) in [("qwen3", 32), ("qwen2", 32), ("llama", 64)] {
            let c = parse(&format!(r#"{{"model_type": "{ty}", {heads}}}"#)).unwrap();
            assert_eq!(c.num_key_value_heads, kv, "{ty}");
            let c = parse(&format!(
                r#"{{"model_type": "{ty}", {heads}, "num_key_value_heads": null}}"#
            ))
            .unwrap();
            assert_eq!(c.num_key_value_heads, 64, "{ty}");
        }
        let e = parse(
            r#"{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("no num_key_value_heads field") && e.contains("32"),
            "{e}"
        );
    }

    #[test]
    fn a_quantized_checkpoint_is_refused_by_its_config() {
        let e = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "quantization_config": {{"quant_method": "awq", "bits": 4}}}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("quantization_config") && e.contains("awq"),
            "{e}"
        );
    }
}
