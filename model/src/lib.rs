//! The real models, on candle: HF dense decoders (`qwen3`, `qwen2`, `llama`, `mistral`) loaded
//! from a model directory as HF writes it, and run forward with the decoder layers DFlash
//! conditions on captured, plus the target's greedy next token at every position.
//!
//! - [`config`]: `config.json` read into one [`ArchConfig`], whatever style wrote it
//!   (transformers 4's top-level `rope_theta`/`rope_scaling`/`torch_dtype` or 5's
//!   `rope_parameters`/`dtype`); anything this code does not run is an error naming the field.
//! - [`weights`]: the safetensors files (one, or shards under `model.safetensors.index.json`),
//!   memory-mapped; every tensor checked against the config's shape before it is used.
//! - [`decoder`]: the one dense decoder family; the four model types differ only in the
//!   flags of [`ArchConfig`] (q/k/v bias, q/k norm, head size, rope scaling).
//! - [`capture`]: which layers a drafter of `n` layers conditions on (SpecForge's rule).
//! - [`make`]: `make-model`, a random-initialised model in the HF layout with a `tokenizer.json`.
//! - [`train`]: differentiable ops, named f32 parameters, AdamW; [`dflash`]: the DFlash drafter
//!   trained on them; [`spec`]: greedy speculative decoding with it.
//!
//! Nothing here knows the ring or a batch: `gpu`'s candle backend turns [`decoder::Output`] into
//! a slot's bytes.

mod attention;
pub mod capture;
pub mod config;
pub mod decoder;
pub mod dflash;
mod draft_attention;
mod fused;
pub mod make;
pub mod pretrain;
mod rope;
pub mod spec;
pub mod train;
pub mod weights;

pub use config::{ArchConfig, Family, RopeScaling};
pub use decoder::{Decoder, Need, Output};
pub use fused::GpuAttentionUse;

use std::path::{Path, PathBuf};

/// What can go wrong loading or running a model, naming the file, field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: {why}")]
    Config { path: PathBuf, why: String },
    /// A directory named as a model or a drafter's export that is none: gone, a file, or
    /// without a `config.json` (a run directory given for its `drafter/`, say).
    #[error("{dir}: {why}")]
    NotADirectory { dir: PathBuf, why: String },
    #[error("{dir}: no weights file holds tensor {tensor}{hint}")]
    Missing {
        dir: PathBuf,
        tensor: String,
        hint: String,
    },
    #[error("{file}: tensor {tensor} has shape {got:?}, the config says {want:?}")]
    Shape {
        file: PathBuf,
        tensor: String,
        want: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{file}: {why}")]
    Weights { file: PathBuf, why: String },
    #[error("capture layer {layer} is out of range: the model has {layers} decoder layers (0..{layers})")]
    Layer { layer: usize, layers: usize },
    /// Captured layers that cannot be taken from the target (too many, or one twice).
    #[error("captured layers: {0}")]
    Capture(String),
    #[error("batch: {0}")]
    Input(String),
    /// A model or training spec that cannot be made (`make-model`'s flags).
    #[error("{0}")]
    Spec(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A DFlash drafter that cannot be made or run as asked (its shape, or its target's).
    #[error("DFlash drafter: {0}")]
    Drafter(String),
    /// A forward that computed NaN or infinite values (a broken checkpoint or config): its
    /// states and greedy tokens would be garbage that looks like data.
    #[error("{0}")]
    NonFinite(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// The error of a `config.json` at `path`, in `dir`, that could not be read. Where `dir`
/// itself is missing, a file, or holds no `config.json`, that is what is said, with `what` a
/// directory of the kind wanted holds: the OS's "No such file or directory" or "Not a
/// directory" on `dir/config.json`, a path the user never typed, leaves them guessing which
/// part is wrong. Any other failure is the file's own.
fn unreadable_config(dir: &Path, path: PathBuf, cause: std::io::Error, what: &str) -> ModelError {
    let why = match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!("no such directory ({what})"),
        Ok(m) if !m.is_dir() => format!("a file, not a directory ({what})"),
        Ok(_) if cause.kind() == std::io::ErrorKind::NotFound => {
            format!("holds no config.json ({what})")
        }
        _ => return ModelError::Io { path, cause },
    };
    ModelError::NotADirectory {
        dir: dir.to_path_buf(),
        why,
    }
}
