//! `model.json`: which target model a run trains its drafter for, so `--resume` refuses another
//! model at the same path (made again, fine-tuned, swapped) instead of training on against it
//! silently: a drafter learns one target's states, and a checkpoint of it is worth nothing for
//! another.
//!
//! The fingerprint costs the same at any size: the CRC-32C of `config.json`, and of each weights
//! file its size, the CRC-32C of its safetensors header (every tensor's name, dtype, shape and
//! place) and that of [`BLOCKS`] blocks of [`BLOCK`] bytes spread evenly over it, about 1 MiB
//! read a file. Weights of the same shapes made again or trained further differ in every block
//! (each value changes), so the sampled blocks find them; a change to a few values only would
//! pass, which no edit of a model a user makes is.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use proto::RunDir;
use serde::{Deserialize, Serialize};

/// Blocks read from each weights file, and their size.
const BLOCKS: u64 = 16;
const BLOCK: u64 = 64 << 10;

/// A model directory's fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ModelRecord {
    /// The directory, as the run's config names it.
    pub(crate) path: PathBuf,
    pub(crate) config_crc32c: u32,
    pub(crate) files: Vec<FileRecord>,
}

/// One weights file's fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileRecord {
    /// Its name in the model directory.
    pub(crate) name: String,
    pub(crate) bytes: u64,
    /// The safetensors header: names, dtypes, shapes, offsets.
    pub(crate) header_crc32c: u32,
    /// [`BLOCKS`] blocks spread over the file.
    pub(crate) sampled_crc32c: u32,
}

impl ModelRecord {
    /// The fingerprint of the model in `dir`: its `config.json` and the weights files the
    /// model crate reads (one `model.safetensors`, or an index's shards).
    pub(crate) fn of(dir: &Path) -> anyhow::Result<ModelRecord> {
        let config = dir.join("config.json");
        let text =
            std::fs::read(&config).with_context(|| format!("reading {}", config.display()))?;
        let weights =
            model::weights::Weights::open(dir, &candle_core::Device::Cpu, candle_core::DType::F32)
                .with_context(|| format!("reading {}", dir.display()))?;
        let files = weights
            .files()
            .map(file_record)
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(ModelRecord {
            path: dir.to_path_buf(),
            config_crc32c: crc32c::crc32c(&text),
            files,
        })
    }

    /// How `now` differs from this record, in words (None: the same model).
    fn differences(&self, now: &ModelRecord) -> Option<String> {
        let mut said = Vec::new();
        if self.config_crc32c != now.config_crc32c {
            said.push("config.json changed".to_string());
        }
        let names = |r: &ModelRecord| r.files.iter().map(|f| f.name.clone()).collect::<Vec<_>>();
        if names(self) != names(now) {
            said.push(format!(
                "its weights files were {:?} and are {:?}",
                names(self),
                names(now)
            ));
        } else {
            for (was, is) in self.files.iter().zip(&now.files) {
                if was.header_crc32c != is.header_crc32c || was.bytes != is.bytes {
                    said.push(format!(
                        "{}: its tensors' names, shapes or dtypes changed",
                        is.name
                    ));
                } else if was.sampled_crc32c != is.sampled_crc32c {
                    said.push(format!("{}: its weights' values changed", is.name));
                }
            }
        }
        (!said.is_empty()).then(|| said.join("; "))
    }
}

/// The fingerprint of weights file `path`.
fn file_record(path: &Path) -> anyhow::Result<FileRecord> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let bytes = f.metadata()?.len();
    let read = |at: u64, len: u64| -> anyhow::Result<Vec<u8>> {
        let mut buf = vec![0u8; len as usize];
        f.read_exact_at(&mut buf, at)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(buf)
    };
    // safetensors: an 8-byte little-endian header length, then the JSON header (Weights::open
    // checked both against the file's size).
    let n = u64::from_le_bytes(read(0, 8)?.try_into().expect("8 bytes"));
    let header_crc32c = crc32c::crc32c(&read(8, n)?);
    let mut sampled_crc32c = 0;
    let span = bytes.saturating_sub(BLOCK);
    for i in 0..BLOCKS {
        let at = span * i / (BLOCKS - 1);
        sampled_crc32c = crc32c::crc32c_append(sampled_crc32c, &read(at, BLOCK.min(bytes))?);
    }
    Ok(FileRecord {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        bytes,
        header_crc32c,
        sampled_crc32c,
    })
}

/// Records the model of a new run in its directory.
pub(crate) fn write(run_dir: &RunDir, r: &ModelRecord) -> anyhow::Result<()> {
    let path = run_dir.model_record();
    atomic_file::replace(&path, (serde_json::to_string_pretty(r)? + "\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Refuses to resume `run_dir` with a model other than the one it started with. A run of a
/// build that kept no record (or of no model) is not checked.
pub(crate) fn check_same(run_dir: &RunDir, dir: &Path) -> anyhow::Result<()> {
    let path = run_dir.model_record();
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let was: ModelRecord =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    let now = ModelRecord::of(dir)?;
    if let Some(what) = was.differences(&now) {
        bail!(
            "the target model changed since this run started ({}: {what}); its drafter was trained against the model as it was ({}), so resuming would go on against another. Restore the model, or start a new run",
            dir.display(),
            path.display()
        );
    }
    Ok(())
}
