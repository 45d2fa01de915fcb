//! Preparing an input once: its content key, the cache of prepared files, and the conversion
//! into a temporary file renamed into place.
//!
//! The key is an XXH3-128 hash of every byte of the input (for an HF directory, of its data
//! files' names and bytes, in order), of the format version and of `max_len` (which decides
//! what is refused), and with a tokenizer of everything that changes the ids and masks it
//! makes ([`crate::Chat::key`]: tokenizer, special tokens, template, options) and of what
//! becomes of too-long samples. Hashing reads the input once (about a second per GB from the page cache);
//! a key from the size and modification time, or from the head and tail, would be free but
//! would miss an edit inside the file that keeps its size, the kind re-tokenizing with a
//! similar tokenizer makes, and then train on stale data. So a re-run, a `--resume` and a
//! restarted target reuse the prepared file only when the input is byte for byte the same.
//!
//! Reading a 3 GB input again at every launch costs seconds, so once hashed, the key is
//! remembered in a *stamp* (`<cache>/stamps/`) with the input's device, inode, size,
//! modification and change times; a launch whose input shows the very same stamp takes the key
//! from it. Any write to a file moves its change time (ctime), which no user call can set back,
//! so an edited input never matches its old stamp, even with its size and mtime restored. As
//! git does, a stamp is only written for files whose times are over 2 s in the past when the
//! hash starts (a write in the same tick as the stamp could otherwise go unseen).
//!
//! Length: past 500 lines because the key, the stamp and the writing into place are one
//! protocol (what is reused when), kept in one file.

use std::fs::File;
use std::io::{BufWriter, Read};
use std::ops::ControlFlow;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use twox_hash::XxHash3_128;

use crate::convert::{self, Kind};
use crate::mapped::Mapped;
use crate::records::{ChatStats, Maker};
use crate::writer::Writer;
use crate::{DataError, Options, FORMAT_VERSION};

/// What a step of `prepare` is doing, for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Reading the input to compute its content key.
    Hashing,
    /// Converting it into the prepared file.
    Converting,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    Rows,
}

/// Progress of `prepare`: `done` of `total` (0: unknown) in `unit`.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub stage: Stage,
    pub done: u64,
    pub total: u64,
    pub unit: Unit,
}

/// Called with each [`Progress`] of `prepare`; returning `Break` stops the work, which then
/// fails with [`DataError::Cancelled`] (checked at least every MiB hashed and every chunk of
/// records converted).
pub type OnProgress<'a> = &'a mut dyn FnMut(Progress) -> ControlFlow<()>;

/// An [`OnProgress`] that shows nothing and never stops.
pub fn quiet(_: Progress) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

/// The outcome of `prepare`.
#[derive(Debug)]
pub struct Prepared {
    /// The prepared file every process maps.
    pub path: PathBuf,
    /// The input's content key (the file's name in the cache).
    pub key: String,
    /// True when an earlier preparation was reused (or the input was already prepared).
    pub reused: bool,
    /// True when the key came from the input's unchanged stamp, without reading it.
    pub key_from_stamp: bool,
    /// What the input was.
    pub kind: Kind,
    pub samples: u64,
    pub tokens: u64,
    /// What preparing conversations and texts counted (None: the input had none).
    pub chat: Option<ChatStats>,
    /// The `max_len` it was prepared under (None: a file that does not say).
    pub max_len: Option<u32>,
    /// What tokenized its conversations and texts: [`crate::Chat::tokenizer_key`] and
    /// [`crate::Chat::key`] (None: pre-tokenized data, or a file of a build that did not say).
    pub tokenizer: Option<String>,
    pub chat_key: Option<String>,
}

impl Prepared {
    /// The outcome of the file `m` maps.
    fn of(m: &Mapped, key: String, reused: bool, key_from_stamp: bool, kind: Kind) -> Prepared {
        let chat = ChatStats::from_meta(|k| m.meta(k).map(str::to_string));
        let (path, samples, tokens) = (m.path().to_path_buf(), m.len(), m.tokens());
        Prepared {
            path,
            key,
            reused,
            key_from_stamp,
            kind,
            samples,
            tokens,
            chat,
            max_len: m.meta("hspipe.max_len").and_then(|v| v.parse().ok()),
            tokenizer: m.meta("hspipe.chat.tokenizer").map(str::to_string),
            chat_key: m.meta("hspipe.chat.key").map(str::to_string),
        }
    }
}

/// What of `options` goes into the key beyond `max_len`: the tokenizer, template and chat
/// options, and what becomes of too-long samples (None without a tokenizer, so the keys of
/// pre-tokenized data stay what they were).
fn chat_part(options: &Options) -> Option<String> {
    options
        .chat
        .as_ref()
        .map(|c| format!("{} {:?}", c.key(), options.too_long))
}

/// The cache directory for runs whose directory is `run_dir`: `data-cache` beside it, so runs
/// under one parent (`runs/` by default) share it, and a resumed run finds it.
pub fn default_cache_dir(run_dir: &Path) -> PathBuf {
    let parent = run_dir.parent().filter(|p| !p.as_os_str().is_empty());
    parent.unwrap_or_else(|| Path::new(".")).join("data-cache")
}

/// The content key of `input` (of kind `kind`) under `options`.
pub fn content_key(
    input: &Path,
    kind: &Kind,
    options: &Options,
    progress: OnProgress<'_>,
) -> Result<String, DataError> {
    let max_len = options.max_len;
    let files = kind.files(input);
    let total: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let mut h = XxHash3_128::with_seed(0);
    h.write(b"hspipe dataset ");
    h.write(FORMAT_VERSION.as_bytes());
    h.write(&max_len.to_le_bytes());
    if let Some(c) = chat_part(options) {
        h.write(b"chat ");
        h.write(c.as_bytes());
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    for f in &files {
        if files.len() > 1 {
            let name = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            h.write(&(name.len() as u64).to_le_bytes());
            h.write(name.as_bytes());
        }
        let mut file = File::open(f).map_err(|e| DataError::Read {
            path: f.clone(),
            cause: e,
        })?;
        loop {
            let n = file.read(&mut buf).map_err(|e| DataError::Read {
                path: f.clone(),
                cause: e,
            })?;
            if n == 0 {
                break;
            }
            h.write(&buf[..n]);
            done += n as u64;
            let go = progress(Progress {
                stage: Stage::Hashing,
                done,
                total,
                unit: Unit::Bytes,
            });
            if go.is_break() {
                return Err(DataError::Cancelled {
                    path: input.to_path_buf(),
                });
            }
        }
    }
    Ok(format!("{:032x}", h.finish_128()))
}

/// Opens a prepared file and checks that it is the one for `key`.
fn open_cached(path: &Path, key: &str) -> Result<Mapped, DataError> {
    let hint = "it is truncated or not hspipe's; delete it and the data is prepared again";
    let m = Mapped::open(path).map_err(|e| DataError::Prepared {
        path: path.to_path_buf(),
        why: format!(
            "{}; {hint}",
            match e {
                DataError::Prepared { why, .. } => why,
                e => e.to_string(),
            }
        ),
    })?;
    match m.meta("hspipe.key") {
        Some(k) if k == key => Ok(m),
        other => Err(DataError::Prepared {
            path: path.to_path_buf(),
            why: format!(
                "it holds {}, not the data of key {key}; {hint}",
                other.map_or("no hspipe key".to_string(), |k| format!(
                    "the data of key {k}"
                ))
            ),
        }),
    }
}

/// [`prepare_with`] for pre-tokenized data (no tokenizer).
pub fn prepare(
    input: &Path,
    max_len: u32,
    cache_dir: &Path,
    out: Option<&Path>,
    progress: OnProgress<'_>,
) -> Result<Prepared, DataError> {
    prepare_with(input, &Options::new(max_len), cache_dir, out, progress)
}

/// Prepares `input` for runs: the prepared file in `cache_dir` named by the input's content
/// key, converted now if it is not there yet (or written to `out` instead, always converted).
/// An input that is itself a prepared file is used as it is.
pub fn prepare_with(
    input: &Path,
    options: &Options,
    cache_dir: &Path,
    out: Option<&Path>,
    progress: OnProgress<'_>,
) -> Result<Prepared, DataError> {
    let max_len = options.max_len;
    let kind = convert::detect(input)?;
    if kind == (Kind::ArrowFile { prepared: true }) && out.is_none() {
        let m = Mapped::open(input)?;
        if let Some((i, n)) = m.lengths().iter().enumerate().find(|(_, &n)| n > max_len) {
            return Err(DataError::Row {
                path: input.to_path_buf(),
                row: i as u64,
                why: format!("{n} tokens, more than data.max_len {max_len}"),
            });
        }
        if m.is_empty() {
            return Err(DataError::Empty {
                path: input.to_path_buf(),
            });
        }
        let key = m.meta("hspipe.key").unwrap_or("").to_string();
        return Ok(Prepared::of(&m, key, true, false, kind));
    }
    if let Some(out) = out {
        refuse_overwriting_input(input, &kind, out)?;
    }
    // Said as what it is, not as the error of a file made under it ("File exists").
    if cache_dir.exists() && !cache_dir.is_dir() {
        return Err(DataError::Write {
            path: cache_dir.to_path_buf(),
            cause: std::io::Error::other(
                "the data cache is a directory, and this is not one: name a directory",
            ),
        });
    }
    let chat = chat_part(options).unwrap_or_default();
    let stamp = Stamp::of(input, &kind, max_len, &chat);
    let stamp_path = stamp.as_ref().map(|s| s.path(cache_dir));
    let remembered = stamp_path.as_ref().and_then(|p| Stamp::read(p));
    // The stamp to remember once the data is prepared (never for input that fails).
    let mut to_stamp = None;
    let (key, key_from_stamp) = match (&stamp, remembered) {
        (Some(now), Some(was)) if was.same_input(now) => (was.key, true),
        _ => {
            let started = SystemTime::now();
            let key = content_key(input, &kind, options, progress)?;
            if let (Some(mut st), Some(p)) = (stamp, stamp_path) {
                if st.settled_before(started) {
                    st.key = key.clone();
                    to_stamp = Some((st, p));
                }
            }
            (key, false)
        }
    };
    let remember = |to_stamp: Option<(Stamp, PathBuf)>| {
        if let (Some((st, p)), None) = (to_stamp, out) {
            st.write(&p);
        }
    };
    let target = match out {
        Some(p) => p.to_path_buf(),
        None => cache_dir.join(format!("{key}.arrow")),
    };
    if out.is_none() && target.exists() {
        let m = open_cached(&target, &key)?;
        remember(to_stamp);
        return Ok(Prepared::of(&m, key, true, key_from_stamp, kind));
    }
    let dir = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let created_dir = !dir.exists();
    let write_err = |e: std::io::Error| DataError::Write {
        path: target.clone(),
        cause: e,
    };
    std::fs::create_dir_all(dir).map_err(write_err)?;
    // What an earlier preparation of this file left when it was killed (Ctrl-C before the
    // launcher handles signals): as big as the file, and nothing else removes it. A writer at
    // work, in another launcher, is not among them.
    for p in atomic_file::leftovers(&target).unwrap_or_default() {
        let _ = std::fs::remove_file(&p);
    }
    // Written whole or not at all (`atomic_file`: temporary file, sync, rename, sync
    // of the directory); a failure leaves no temporary file behind.
    let result = atomic_file::replace_with(&target, |tmp| {
        write_prepared(input, &kind, options, &key, tmp, progress).map_err(Failed::Data)
    });
    if let Err(e) = result {
        if created_dir {
            let _ = std::fs::remove_dir(dir);
        }
        return Err(match e {
            Failed::Data(e) => e,
            Failed::Io(e) => write_err(e),
        });
    }
    let m = open_cached(&target, &key)?;
    remember(to_stamp);
    Ok(Prepared::of(&m, key, false, key_from_stamp, kind))
}

/// Refuses an output file that is one of the input's files (by device and inode, so through
/// any path or link): the prepared file is renamed over `out` once written, and the data would
/// be gone, replaced by its conversion.
fn refuse_overwriting_input(input: &Path, kind: &Kind, out: &Path) -> Result<(), DataError> {
    let Ok(o) = std::fs::metadata(out) else {
        return Ok(());
    };
    let is_input = kind
        .files(input)
        .iter()
        .any(|f| std::fs::metadata(f).is_ok_and(|m| m.dev() == o.dev() && m.ino() == o.ino()));
    if is_input {
        return Err(DataError::Write {
            path: out.to_path_buf(),
            cause: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!(
                    "it is the input {}: the prepared file would replace the data; name another output file",
                    input.display()
                ),
            ),
        });
    }
    Ok(())
}

/// Why writing the prepared file failed: converting the input, or the file system.
enum Failed {
    Data(DataError),
    Io(std::io::Error),
}

impl From<std::io::Error> for Failed {
    fn from(e: std::io::Error) -> Failed {
        Failed::Io(e)
    }
}

fn write_prepared(
    input: &Path,
    kind: &Kind,
    options: &Options,
    key: &str,
    tmp: &Path,
    progress: OnProgress<'_>,
) -> Result<(), DataError> {
    let werr = |e: std::io::Error| DataError::Write {
        path: tmp.to_path_buf(),
        cause: e,
    };
    let meta = vec![
        ("hspipe.dataset".to_string(), FORMAT_VERSION.to_string()),
        ("hspipe.key".to_string(), key.to_string()),
        ("hspipe.source".to_string(), input.display().to_string()),
        ("hspipe.max_len".to_string(), options.max_len.to_string()),
    ];
    let maker = Maker {
        max_len: options.max_len,
        too_long: options.too_long,
        chat: options.chat.clone(),
        no_tokenizer_in: options.no_tokenizer_in.clone(),
    };
    let f = File::create(tmp).map_err(werr)?;
    let mut w = Writer::new(BufWriter::with_capacity(1 << 20, f), meta).map_err(werr)?;
    let (unit, mut total) = match kind {
        Kind::Parquet => (Unit::Rows, 0),
        k => (
            Unit::Bytes,
            k.files(input)
                .iter()
                .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
                .sum(),
        ),
    };
    let total_cell = std::cell::Cell::new(0u64);
    let stats = convert::convert(
        input,
        kind,
        &maker,
        &mut w,
        &mut |done: u64| {
            if total_cell.get() != 0 {
                total = total_cell.get();
            }
            progress(Progress {
                stage: Stage::Converting,
                done,
                total,
                unit,
            })
        },
        &mut |n| total_cell.set(n),
    )
    .map_err(|e| match e {
        DataError::Write { cause: source, .. } => werr(source),
        e => e,
    })?;
    if w.samples == 0 && stats.conversations + stats.texts > 0 {
        let why = stats.nothing_left(options.max_len);
        return Err(DataError::Format {
            path: input.to_path_buf(),
            why,
        });
    }
    if w.samples == 0 {
        return Err(DataError::Empty {
            path: input.to_path_buf(),
        });
    }
    // What tokenized the conversations and texts, to tell a run of another tokenizer (or
    // template, or options) that maps this file as it is. Pre-tokenized data has none.
    let footer = match &options.chat {
        Some(c) if stats.conversations + stats.texts > 0 => {
            let mut f = stats.to_meta();
            f.push(("hspipe.chat.tokenizer".into(), c.tokenizer_key().into()));
            f.push(("hspipe.chat.key".into(), c.key().into()));
            f
        }
        _ => Vec::new(),
    };
    let buf = w.finish(footer).map_err(werr)?;
    // Flushed here; the caller syncs and renames it.
    buf.into_inner().map_err(|e| werr(e.into_error()))?;
    Ok(())
}

/// One input file's identity and change times.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileStamp {
    name: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

/// What an input looked like when its content key was computed.
#[derive(Debug, Serialize, Deserialize)]
struct Stamp {
    format: String,
    max_len: u32,
    /// The tokenizer, template and options' part of the key (empty without a tokenizer).
    #[serde(default)]
    chat: String,
    files: Vec<FileStamp>,
    key: String,
}

impl Stamp {
    /// The input's stamp now (None if a file cannot be looked at: then it is hashed).
    fn of(input: &Path, kind: &Kind, max_len: u32, chat: &str) -> Option<Stamp> {
        let files = kind
            .files(input)
            .into_iter()
            .map(|f| {
                let f = std::fs::canonicalize(&f).ok()?;
                let m = std::fs::metadata(&f).ok()?;
                Some(FileStamp {
                    dev: m.dev(),
                    ino: m.ino(),
                    size: m.size(),
                    mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
                    ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
                    name: f,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Stamp {
            format: FORMAT_VERSION.to_string(),
            max_len,
            chat: chat.to_string(),
            files,
            key: String::new(),
        })
    }

    /// Where the stamp of this input lives: named by a hash of its files' paths and max_len.
    fn path(&self, cache_dir: &Path) -> PathBuf {
        let mut h = XxHash3_128::with_seed(1);
        for f in &self.files {
            h.write(f.name.as_os_str().as_encoded_bytes());
            h.write(&[0]);
        }
        h.write(&self.max_len.to_le_bytes());
        h.write(self.chat.as_bytes());
        cache_dir
            .join("stamps")
            .join(format!("{:032x}.json", h.finish_128()))
    }

    fn read(path: &Path) -> Option<Stamp> {
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
    }

    fn same_input(&self, now: &Stamp) -> bool {
        self.format == now.format
            && self.max_len == now.max_len
            && self.chat == now.chat
            && self.files == now.files
            && self.key.len() == 32
    }

    /// True when every file's times are over 2 s before `t` (see the module doc).
    fn settled_before(&self, t: SystemTime) -> bool {
        let Ok(t) = t.duration_since(UNIX_EPOCH) else {
            return false;
        };
        let limit = (t.saturating_sub(Duration::from_secs(2))).as_nanos() as i128;
        self.files
            .iter()
            .all(|f| f.mtime_ns < limit && f.ctime_ns < limit)
    }

    /// Best effort: without a stamp the next launch hashes the input again.
    fn write(&self, path: &Path) {
        let Some(dir) = path.parent() else { return };
        if std::fs::create_dir_all(dir).is_err() {
            return;
        }
        let Ok(text) = serde_json::to_string(self) else {
            return;
        };
        let _ = atomic_file::replace(path, text.as_bytes());
    }
}
