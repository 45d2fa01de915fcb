//! Tokenized training data, prepared once into one memory-mapped Arrow IPC file that every
//! process maps read-only.
//!
//! - [`prepare`] turns an input (JSONL, Parquet, an HF `datasets` `save_to_disk` directory, or
//!   an Arrow IPC file or stream) into the prepared file, streaming with bounded memory, and
//!   caches it by the input's content (an XXH3-128 hash of its bytes): the same input is never
//!   converted twice, a changed one always is.
//! - [`Mapped`] maps a prepared file: opening it reads the footer and the list offsets only
//!   (4 bytes a sample); a sample's ids are a slice of the map, so a process touches only the
//!   pages of the samples it uses.
//! - [`Dataset`] is what a run reads: a mapped prepared file, or the built-in synthetic samples.
//!
//! The prepared file is an Arrow IPC *file* (`ARROW1`) with two columns, `input_ids:
//! list<uint32>` and `loss_mask: list<uint8>` (a null mask means all ones), and schema metadata
//! `hspipe.dataset` (format version), `hspipe.key` (the input's content key) and
//! `hspipe.source`. pyarrow, arrow-rs and DuckDB read it as they read any Arrow file.
//!
//! Records may also hold conversations or text ([`chat`]): the target's tokenizer and chat
//! template make them into ids and a mask of the assistant's tokens, in parallel.
//!
//! Every row of every format is checked as the JSONL loader always did (empty, longer than
//! `max_len`, a mask of another length or with entries other than 0/1, ids that are not
//! integers or out of range for `u32`), naming the file and line (JSONL) or row (Arrow,
//! Parquet, counted from 0).

mod arrow_io;
mod cache;
mod cells;
pub mod chat;
mod convert;
pub mod language;
mod map;
mod mapped;
mod records;
mod samples;
mod writer;

use std::path::PathBuf;

pub use cache::{
    content_key, default_cache_dir, prepare, prepare_with, quiet, OnProgress, Prepared, Progress,
    Stage, Unit,
};
pub use chat::{Chat, ChatError, ChatOptions};
pub use convert::{detect, Kind};
pub use language::Language;
pub use mapped::{Mapped, Sample};
pub use records::ChatStats;
pub use samples::{mix, Dataset, Synthetic, SYNTHETIC_VOCAB};
pub use writer::Writer;

#[cfg(target_endian = "big")]
compile_error!(
    "Arrow data is little-endian and hspipe maps it in place: a little-endian machine is needed"
);

/// The prepared format's version, in its metadata and in every content key.
pub const FORMAT_VERSION: &str = "1";

/// A dataset that cannot be used, naming the file and the line or row at fault.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("reading dataset {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("dataset {path} has no samples")]
    Empty { path: PathBuf },
    /// A JSONL line (counted from 1).
    #[error("{path}:{line}: {why}")]
    Line {
        path: PathBuf,
        line: u64,
        why: String,
    },
    /// A row of an Arrow or Parquet table (counted from 0, over the whole dataset).
    #[error("{path}: row {row}: {why}")]
    Row {
        path: PathBuf,
        row: u64,
        why: String,
    },
    /// A file that is not what its kind promises (malformed Arrow, missing columns).
    #[error("dataset {path}: {why}")]
    Format { path: PathBuf, why: String },
    /// A Parquet file that the `parquet` crate cannot read (damaged, or compressed with a
    /// codec this build leaves out).
    #[error("reading Parquet file {path}: {why}")]
    Parquet { path: PathBuf, why: String },
    /// A prepared (cached) file that cannot be used.
    #[error("prepared data {path} is not usable: {why}")]
    Prepared { path: PathBuf, why: String },
    #[error("writing prepared data {path}: {cause}")]
    Write {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// The caller's progress callback asked to stop (e.g. on Ctrl-C). Nothing partial is left:
    /// the temporary file is removed, as on any error.
    #[error("preparing {path} was stopped before it was done")]
    Cancelled { path: PathBuf },
}

/// What becomes of a sample hspipe tokenized (a conversation or a text) that is longer than
/// `data.max_len`: dropped (the default) or cut to it; both are counted. Pre-tokenized samples
/// longer than that stay an error: whoever tokenized them chose their length for this run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TooLong {
    #[default]
    Drop,
    Truncate,
}

/// How [`prepare_with`] makes samples.
#[derive(Clone, Default)]
pub struct Options {
    pub max_len: u32,
    pub too_long: TooLong,
    /// The target's tokenizer and template, for conversations and texts.
    pub chat: Option<std::sync::Arc<Chat>>,
    /// Without `chat`: the model directory the tokenizer was looked for in, which has no
    /// `tokenizer.json` (the first conversation or text says so, and what to do).
    pub no_tokenizer_in: Option<std::path::PathBuf>,
}

impl Options {
    pub fn new(max_len: u32) -> Options {
        Options {
            max_len,
            ..Options::default()
        }
    }
}

/// Checks one sample as the JSONL loader always did; `Err` says why it is refused.
pub(crate) fn check_sample(
    ids_len: usize,
    mask: Option<&[u8]>,
    max_len: u32,
) -> Result<(), String> {
    if ids_len == 0 {
        return Err("input_ids is empty".into());
    }
    if ids_len > max_len as usize {
        return Err(format!(
            "{ids_len} tokens, more than data.max_len {max_len}"
        ));
    }
    if let Some(m) = mask {
        if m.len() != ids_len {
            return Err(format!(
                "loss_mask has {} entries, input_ids has {ids_len}",
                m.len()
            ));
        }
        if m.iter().any(|&b| b > 1) {
            return Err("loss_mask entries must be 0 or 1".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
