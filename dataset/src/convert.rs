//! Reading each input format row by row into the prepared file's [`Writer`], with the same
//! checks for every format. Memory stays bounded: one JSONL line, or one input record batch,
//! plus the writer's batch.
//!
//! Parquet is read through pyarrow, in a small Python helper (`parquet_to_arrow.py`, bundled
//! in the binary) that streams the file's row groups to us as an Arrow IPC stream. No Rust
//! Parquet reader is packaged by Debian (crates.io is not reachable here), and a reader of our
//! own would need Thrift metadata, the Snappy/ZSTD/GZIP codecs, dictionary pages, and
//! repetition/definition levels for list columns: weeks of format work, against a
//! dependency that every Parquet user already has. The helper needs Python 3 with pyarrow
//! (`HSPIPE_PYTHON` names the interpreter, default `python3`); the error says so when it is
//! missing.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;

use crate::ipc::{self, Columns, IpcError, Layout, ListColumn, StreamReader};
use crate::map::map_read_only;
use crate::writer::Writer;
use crate::{check_sample, DataError};

/// The environment variable naming the Python interpreter for Parquet (default `python3`).
pub const PYTHON_ENV: &str = "HSPIPE_PYTHON";

const PARQUET_HELPER: &str = include_str!("parquet_to_arrow.py");

/// What an input is, found from its content (and for a directory, its files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Jsonl,
    /// An Arrow IPC file (`ARROW1`); `prepared` when hspipe wrote it (used as it is).
    ArrowFile {
        prepared: bool,
    },
    ArrowStream,
    Parquet,
    /// An HF `datasets` `save_to_disk` directory: its Arrow stream files, in order.
    HfDir(Vec<PathBuf>),
}

impl Kind {
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Jsonl => "JSONL",
            Kind::ArrowFile { prepared: true } => "prepared Arrow file",
            Kind::ArrowFile { prepared: false } => "Arrow IPC file",
            Kind::ArrowStream => "Arrow IPC stream",
            Kind::Parquet => "Parquet",
            Kind::HfDir(_) => "HF datasets directory",
        }
    }

    /// The files whose bytes make the input, in order.
    pub fn files(&self, path: &Path) -> Vec<PathBuf> {
        match self {
            Kind::HfDir(files) => files.clone(),
            _ => vec![path.to_path_buf()],
        }
    }
}

fn read_err(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |e| DataError::Read {
        path: path.to_path_buf(),
        source: e,
    }
}

fn format_err(path: &Path, why: impl std::fmt::Display) -> DataError {
    DataError::Format {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

#[derive(Deserialize)]
struct HfState {
    #[serde(rename = "_data_files")]
    data_files: Vec<HfFile>,
}

#[derive(Deserialize)]
struct HfFile {
    filename: String,
}

/// What `path` holds: a directory is an HF `datasets` directory; a file is told by its first
/// bytes (Arrow file or stream, Parquet), else JSONL.
pub fn detect(path: &Path) -> Result<Kind, DataError> {
    let meta = std::fs::metadata(path).map_err(read_err(path))?;
    if meta.is_dir() {
        return hf_files(path).map(Kind::HfDir);
    }
    let mut head = [0u8; 8];
    let mut f = File::open(path).map_err(read_err(path))?;
    let n = read_up_to(&mut f, &mut head).map_err(read_err(path))?;
    let head = &head[..n];
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if head.starts_with(ipc::MAGIC) {
        let prepared = {
            let map = map_read_only(&f).map_err(read_err(path))?;
            ipc::parse_footer(&map)
                .map(|(s, _)| s.meta("hspipe.dataset").is_some())
                .unwrap_or(false)
        };
        return Ok(Kind::ArrowFile { prepared });
    }
    if head.starts_with(&ipc::CONTINUATION.to_le_bytes()) {
        return Ok(Kind::ArrowStream);
    }
    if head.starts_with(b"PAR1") {
        return Ok(Kind::Parquet);
    }
    match ext {
        "parquet" | "arrow" | "feather" | "arrows" => Err(format_err(
            path,
            format!("named .{ext}, but it does not start like a {ext} file"),
        )),
        _ => Ok(Kind::Jsonl),
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// An HF `save_to_disk` directory's data files, in the order `state.json` lists them (else
/// `data-*.arrow` sorted by name).
fn hf_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    if dir.join("dataset_dict.json").is_file() {
        let splits: Vec<String> = std::fs::read_dir(dir)
            .map_err(read_err(dir))?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        return Err(format_err(
            dir,
            format!(
                "a DatasetDict (splits: {}): give one split's directory, e.g. {}",
                splits.join(", "),
                dir.join(splits.first().map_or("train", String::as_str))
                    .display()
            ),
        ));
    }
    let state = dir.join("state.json");
    let files = if state.is_file() {
        let text = std::fs::read_to_string(&state).map_err(read_err(&state))?;
        let s: HfState = serde_json::from_str(&text)
            .map_err(|e| format_err(&state, format!("not an HF datasets state.json: {e}")))?;
        s.data_files
            .into_iter()
            .map(|f| dir.join(f.filename))
            .collect::<Vec<_>>()
    } else {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(read_err(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("data-") && n.ends_with(".arrow"))
            })
            .collect();
        v.sort();
        v
    };
    if files.is_empty() {
        return Err(format_err(
            dir,
            "a directory without data-*.arrow files: not an HF datasets save_to_disk directory",
        ));
    }
    Ok(files)
}

/// Reports progress: units done (bytes or rows, as the caller set up).
pub type Tick<'a> = &'a mut dyn FnMut(u64);

/// Converts `path` (of kind `kind`) into `w`, checking every row against `max_len`.
pub fn convert<W: Write>(
    path: &Path,
    kind: &Kind,
    max_len: u32,
    w: &mut Writer<W>,
    tick: Tick<'_>,
    total_rows: &mut dyn FnMut(u64),
) -> Result<(), DataError> {
    match kind {
        Kind::Jsonl => jsonl(path, max_len, w, tick),
        Kind::ArrowStream => {
            let f = File::open(path).map_err(read_err(path))?;
            let mut rows = 0;
            stream(
                path,
                BufReader::with_capacity(1 << 20, f),
                max_len,
                w,
                &mut rows,
                &mut |r| tick(r.read),
            )
        }
        Kind::HfDir(files) => {
            let mut rows = 0;
            let mut before = 0;
            for file in files {
                let f = File::open(file).map_err(read_err(file))?;
                let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                stream(
                    file,
                    BufReader::with_capacity(1 << 20, f),
                    max_len,
                    w,
                    &mut rows,
                    &mut |r| tick(before + r.read),
                )?;
                before += size;
            }
            Ok(())
        }
        Kind::ArrowFile { .. } => arrow_file(path, max_len, w, tick),
        Kind::Parquet => parquet(path, max_len, w, tick, total_rows),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSample {
    input_ids: Vec<u32>,
    #[serde(default)]
    loss_mask: Option<Vec<u8>>,
}

/// One JSON object per line: `{"input_ids": [...], "loss_mask": [...]}` (the mask is
/// optional: all ones). Blank lines are skipped.
fn jsonl<W: Write>(
    path: &Path,
    max_len: u32,
    w: &mut Writer<W>,
    tick: Tick<'_>,
) -> Result<(), DataError> {
    let f = File::open(path).map_err(read_err(path))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut line = String::new();
    let (mut n, mut read) = (0u64, 0u64);
    loop {
        line.clear();
        let got = r.read_line(&mut line).map_err(read_err(path))?;
        if got == 0 {
            break;
        }
        n += 1;
        read += got as u64;
        if n % 4096 == 0 {
            tick(read);
        }
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| DataError::Line {
            path: path.to_path_buf(),
            line: n,
            why,
        };
        let s: JsonSample =
            serde_json::from_str(&line).map_err(|e| bad(format!("not a sample: {e}")))?;
        check_sample(s.input_ids.len(), s.loss_mask.as_deref(), max_len).map_err(bad)?;
        w.push(&s.input_ids, s.loss_mask.as_deref())
            .map_err(write_err)?;
    }
    tick(read);
    Ok(())
}

fn write_err(e: std::io::Error) -> DataError {
    DataError::Write {
        path: PathBuf::from("(the prepared file)"),
        source: e,
    }
}

/// Converts the rows of one record batch; `first` is the dataset row of its first row.
fn rows<W: Write>(
    path: &Path,
    cols: &Columns<'_>,
    first: u64,
    max_len: u32,
    w: &mut Writer<W>,
    ids: &mut Vec<u32>,
    mask: &mut Vec<u8>,
) -> Result<(), DataError> {
    let ic: &ListColumn<'_> = &cols.input_ids;
    // The common case, `list<uint32>` without nulls, is copied straight from the body.
    let direct = ic.bits == 32 && !ic.signed && ic.values_null_count == 0;
    for row in 0..cols.rows {
        let bad = |why: String| DataError::Row {
            path: path.to_path_buf(),
            row: first + row as u64,
            why,
        };
        if ic.is_null(row) {
            return Err(bad("input_ids is null".into()));
        }
        ids.clear();
        let range = ic.range(row);
        if direct {
            let b = &ic.values[4 * range.start..4 * range.end];
            ids.extend(
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        } else {
            for (j, i) in range.enumerate() {
                match ic.value(i) {
                    None => return Err(bad(format!("input_ids[{j}] is null"))),
                    Some(v) => match u32::try_from(v) {
                        Ok(v) => ids.push(v),
                        Err(_) => {
                            return Err(bad(format!(
                            "input_ids[{j}] = {v} is out of range for a token id (0..=4294967295)"
                        )))
                        }
                    },
                }
            }
        }
        let m = match &cols.loss_mask {
            Some(mc) if !mc.is_null(row) => {
                mask.clear();
                for (j, i) in mc.range(row).enumerate() {
                    match mc.value(i) {
                        None => return Err(bad(format!("loss_mask[{j}] is null"))),
                        // Anything but 0 and 1 is refused by `check_sample`.
                        Some(v) => mask.push(u8::try_from(v).unwrap_or(u8::MAX)),
                    }
                }
                Some(mask.as_slice())
            }
            _ => None,
        };
        check_sample(ids.len(), m, max_len).map_err(bad)?;
        w.push(ids, m).map_err(write_err)?;
    }
    Ok(())
}

fn ipc_err(path: &Path) -> impl Fn(IpcError) -> DataError + '_ {
    move |e| match e {
        IpcError::Io(e) => DataError::Read {
            path: path.to_path_buf(),
            source: e,
        },
        e => format_err(path, e),
    }
}

/// Converts an Arrow IPC stream; `rows` counts dataset rows across calls (HF shards).
fn stream<R: Read, W: Write>(
    path: &Path,
    r: R,
    max_len: u32,
    w: &mut Writer<W>,
    row: &mut u64,
    tick: &mut dyn FnMut(&StreamReader<R>),
) -> Result<(), DataError> {
    let mut s = StreamReader::new(r);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    while let Some(cols) = s.next_batch().map_err(ipc_err(path))? {
        let n = cols.rows as u64;
        rows(path, &cols, *row, max_len, w, &mut ids, &mut mask)?;
        *row += n;
        tick(&s);
    }
    Ok(())
}

/// Converts an Arrow IPC file (not one hspipe prepared: that one is used as it is).
fn arrow_file<W: Write>(
    path: &Path,
    max_len: u32,
    w: &mut Writer<W>,
    tick: Tick<'_>,
) -> Result<(), DataError> {
    let f = File::open(path).map_err(read_err(path))?;
    let map = map_read_only(&f).map_err(read_err(path))?;
    let (schema, blocks) = ipc::parse_footer(&map).map_err(ipc_err(path))?;
    let layout = Layout::new(&schema).map_err(ipc_err(path))?;
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    let mut row = 0u64;
    for b in &blocks {
        let (rb, body) = ipc::block_parts(&map, b).map_err(ipc_err(path))?;
        let cols = layout.columns(rb, body).map_err(ipc_err(path))?;
        rows(path, &cols, row, max_len, w, &mut ids, &mut mask)?;
        row += cols.rows as u64;
        tick(b.offset + u64::from(b.meta_len) + b.body_len);
    }
    Ok(())
}

/// The Python interpreter for the Parquet helper.
pub fn python() -> String {
    std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".into())
}

fn parquet<W: Write>(
    path: &Path,
    max_len: u32,
    w: &mut Writer<W>,
    tick: Tick<'_>,
    total_rows: &mut dyn FnMut(u64),
) -> Result<(), DataError> {
    let py = python();
    let err = |why: String| DataError::Parquet {
        path: path.to_path_buf(),
        why,
    };
    let how = format!(
        "hspipe reads Parquet through pyarrow: install it (`{py} -m pip install pyarrow`), or set {PYTHON_ENV} to a Python that has it (scripts/test.sh makes .venv/bin/python with it)"
    );
    let mut child = Command::new(&py)
        .arg("-c")
        .arg(PARQUET_HELPER)
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(format!("could not start {py}: {e}; {how}")))?;
    let stderr = child.stderr.take();
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut e) = stderr {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let out = child.stdout.take();
    let result = match out {
        None => Err(err("no output from the helper".into())),
        Some(out) => {
            let mut told = false;
            let mut row = 0;
            stream(path, BufReader::new(out), max_len, w, &mut row, &mut |r| {
                if !told {
                    told = true;
                    if let Some(n) = r.rows_total() {
                        total_rows(n);
                    }
                }
                tick(row_of(r));
            })
        }
    };
    // On a bad row we stop reading: the helper must not be left blocked on a full pipe.
    if result.is_err() {
        let _ = child.kill();
    }
    let status = child
        .wait()
        .map_err(|e| err(format!("waiting for {py}: {e}")))?;
    let stderr = errs.join().unwrap_or_default();
    // Python's last line says what went wrong (a traceback's exception, or our helper's line).
    let tail = stderr
        .trim()
        .lines()
        .last()
        .unwrap_or("")
        .trim()
        .to_string();
    match status.code() {
        _ if result.is_err() => result,
        Some(0) => result,
        Some(3) => Err(err(format!("{py} has no pyarrow ({tail}); {how}"))),
        Some(4) => Err(format_err(path, tail)),
        _ => Err(err(format!("pyarrow could not read it: {tail}"))),
    }
}

fn row_of<R>(r: &StreamReader<R>) -> u64 {
    r.rows
}
