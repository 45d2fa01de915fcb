//! Reading each input format row by row into the prepared file's [`Writer`], with the same
//! checks for every format. Memory stays bounded: one JSONL line, or one input record batch,
//! plus the writer's batch.
//!
//! Arrow IPC files and streams are read with arrow-ipc (`arrow_io`, which checks each record
//! batch against its body first), Parquet with the `parquet` crate's Arrow reader, a bounded
//! number of rows at a time: both give Arrow record batches, and one function checks and
//! converts their rows, whatever the writer (extra columns, `large_list`, any integer type).
//!
//! Length: past 500 lines because every input kind is here, so the one row check and the one
//! error per bad row (file and line or row) stay in one place for all of them.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::ops::{ControlFlow, Range};
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, RecordBatch};
use arrow_buffer::NullBuffer;
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;
use serde::Deserialize;

use crate::arrow_io::{self, is_chat, type_name, IpcError, IpcFile, IpcStream};
use crate::map::{buffer_of, map_read_only};
use crate::records::{record_of, ChatStats, Fields, Maker, Pipeline, Stop};
use crate::writer::Writer;
use crate::{check_sample, DataError};

/// Parquet rows per record batch: a bounded part of a row group in memory at a time.
const PARQUET_BATCH_ROWS: usize = 8192;

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
        cause: e,
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
    // Never opened: a FIFO's open waits for a writer, for ever if none comes; and the input
    // is read twice (hashed, then converted), which a pipe cannot give.
    if let Some(what) = atomic_file::not_regular(&meta) {
        return Err(format_err(
            path,
            format!("it is {what}, not a regular file: the data is read more than once, so write it to a file first"),
        ));
    }
    let mut head = [0u8; 8];
    let mut f = File::open(path).map_err(read_err(path))?;
    let n = read_up_to(&mut f, &mut head).map_err(read_err(path))?;
    let head = &head[..n];
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if head.starts_with(arrow_io::MAGIC) {
        let prepared = {
            let map = map_read_only(&f).map_err(read_err(path))?;
            IpcFile::open(&map)
                .map(|file| file.schema.metadata().contains_key("hspipe.dataset"))
                .unwrap_or(false)
        };
        return Ok(Kind::ArrowFile { prepared });
    }
    if head.starts_with(&arrow_io::CONTINUATION) {
        return Ok(Kind::ArrowStream);
    }
    if head.starts_with(b"PAR1") {
        return Ok(Kind::Parquet);
    }
    if let Some((name, how)) = COMPRESSED
        .iter()
        .find(|(magic, ..)| head.starts_with(magic))
        .map(|&(_, name, how)| (name, how))
    {
        return Err(format_err(
            path,
            format!(
                "it is {name}-compressed: decompress it first ({how} FILE) and give the result"
            ),
        ));
    }
    match ext {
        "parquet" | "arrow" | "feather" | "arrows" => {
            // The first byte past a byte order mark and white space: `{` or `[` is JSON.
            let text = head.strip_prefix("\u{feff}".as_bytes()).unwrap_or(head);
            let first = text.iter().find(|b| !b.is_ascii_whitespace());
            let json = match first {
                Some(b'{' | b'[') => {
                    ": it starts as JSON does (JSON Lines?): if it is JSONL, name it .jsonl"
                }
                _ => "",
            };
            Err(format_err(
                path,
                format!("named .{ext}, but it does not start like a {ext} file{json}"),
            ))
        }
        _ => Ok(Kind::Jsonl),
    }
}

/// The extensions of files meant as JSON Lines: their errors are about their lines alone.
const JSONL_EXTENSIONS: &[&str] = &["jsonl", "json", "ndjson", "jsonlines"];

/// What a JSONL error adds for a file whose extension is none of JSONL's (`data.csv`): it was
/// read as JSONL only because JSONL is what [`detect`] falls back to, so the user learns why
/// their CSV is said to hold no sample, and what hspipe reads instead.
fn read_as_jsonl(path: &Path) -> String {
    let Some(ext) = path.extension().map(|e| e.to_string_lossy()) else {
        return String::new();
    };
    if JSONL_EXTENSIONS.contains(&ext.to_ascii_lowercase().as_str()) {
        return String::new();
    }
    format!(
        " (read as JSONL, since .{ext} is not an extension hspipe knows; it reads JSONL (.jsonl), \
         Parquet, Arrow IPC files and streams, HF datasets directories and prepared files)"
    )
}

/// The magic numbers of compressed files, their format's name and the command that
/// decompresses them: such a file is refused by name rather than read as JSON Lines.
const COMPRESSED: &[(&[u8], &str, &str)] = &[
    (&[0x1f, 0x8b], "gzip", "gunzip -k"),
    (&[0x28, 0xb5, 0x2f, 0xfd], "zstd", "zstd -d"),
    (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz", "unxz -k"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (b"PK\x03\x04", "zip", "unzip"),
];

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
    // Each shard as a single file is (see `detect`): a FIFO is never opened.
    for f in &files {
        if let Some(what) = std::fs::metadata(f)
            .ok()
            .as_ref()
            .and_then(atomic_file::not_regular)
        {
            return Err(format_err(
                f,
                format!("it is {what}, not a regular file: each shard is read more than once"),
            ));
        }
    }
    Ok(files)
}

/// Reports progress: units done (bytes or rows, as the caller set up). `Break` stops the
/// conversion with [`DataError::Cancelled`].
pub type Advance<'a> = &'a mut dyn FnMut(u64) -> ControlFlow<()>;

/// Goes on unless the caller's [`Advance`] said to stop.
fn go_on(path: &Path, c: ControlFlow<()>) -> Result<(), DataError> {
    match c {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(()) => Err(DataError::Cancelled {
            path: path.to_path_buf(),
        }),
    }
}

/// Converts `path` (of kind `kind`) into `w`, each record made into a sample by `maker`;
/// returns what conversations and texts counted.
pub fn convert<W: Write>(
    path: &Path,
    kind: &Kind,
    maker: &Maker,
    w: &mut Writer<W>,
    advance: Advance<'_>,
    total_rows: &mut dyn FnMut(u64),
) -> Result<ChatStats, DataError> {
    let mut p = Pipeline::new(maker, w);
    // Places are JSONL lines, or rows of a table.
    p.stats.rows = *kind != Kind::Jsonl;
    let mut err_path = path.to_path_buf();
    convert_into(path, kind, &mut p, advance, total_rows, &mut err_path)?;
    p.flush().map_err(|s| stopped(&err_path, kind, s))?;
    Ok(p.stats)
}

/// The error of a stopped pipeline: a JSONL line, or a row of an Arrow table.
fn stopped(path: &Path, kind: &Kind, s: Stop) -> DataError {
    match s {
        Stop::Write(e) => write_err(e),
        Stop::Record((place, why)) if *kind == Kind::Jsonl => DataError::Line {
            path: path.to_path_buf(),
            line: place,
            why: why + &read_as_jsonl(path),
        },
        Stop::Record((row, why)) => DataError::Row {
            path: path.to_path_buf(),
            row,
            why,
        },
    }
}

fn convert_into<W: Write>(
    path: &Path,
    kind: &Kind,
    w: &mut Pipeline<'_, W>,
    advance: Advance<'_>,
    total_rows: &mut dyn FnMut(u64),
    err_path: &mut PathBuf,
) -> Result<(), DataError> {
    match kind {
        Kind::Jsonl => jsonl(path, w, advance),
        Kind::ArrowStream => {
            let f = File::open(path).map_err(read_err(path))?;
            let mut rows = 0;
            stream(
                path,
                BufReader::with_capacity(1 << 20, f),
                w,
                &mut rows,
                &mut |read| advance(read),
            )
        }
        Kind::HfDir(files) => {
            let mut rows = 0;
            let mut before = 0;
            for file in files {
                // Rows still pending when a shard ends are named by its file.
                w.flush().map_err(|s| stopped(err_path, kind, s))?;
                *err_path = file.clone();
                let f = File::open(file).map_err(read_err(file))?;
                let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                stream(
                    file,
                    BufReader::with_capacity(1 << 20, f),
                    w,
                    &mut rows,
                    &mut |read| advance(before + read),
                )?;
                before += size;
            }
            Ok(())
        }
        Kind::ArrowFile { .. } => arrow_file(path, w, advance),
        Kind::Parquet => parquet(path, w, advance, total_rows),
    }
}

/// The longest line of a JSON Lines file: a line is held whole while it is parsed, and a
/// 300 MB one (a whole export in one object) took twice that to be refused. A longer line stops
/// the preparation, whatever `data.too_long` says: it is a limit of reading JSONL, before the
/// record is parsed (it may not be JSON at all), so it is not dropped as too long. Parquet and
/// Arrow have no such limit (their cells are read a record batch at a time).
pub const MAX_JSONL_LINE: u64 = 64 << 20;

/// One JSON object per line: `{"input_ids": [...], "loss_mask": [...]}` (the mask is
/// optional: all ones), or a conversation or text (see `records`). Blank lines are skipped;
/// lines are parsed and made into samples a chunk at a time, in parallel. A UTF-8 byte order
/// mark before the first line is skipped, as Python's `datasets` and pandas skip it; a line
/// that is not UTF-8 is an error naming it, and a file that holds one JSON array, not lines.
fn jsonl<W: Write>(
    path: &Path,
    w: &mut Pipeline<'_, W>,
    advance: Advance<'_>,
) -> Result<(), DataError> {
    let f = File::open(path).map_err(read_err(path))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let (mut n, mut read, mut told) = (0u64, 0u64, 0u64);
    let mut first = true;
    let mut bytes = Vec::new();
    loop {
        bytes.clear();
        let got = (r.by_ref().take(MAX_JSONL_LINE + 1))
            .read_until(b'\n', &mut bytes)
            .map_err(read_err(path))?;
        if got == 0 {
            break;
        }
        n += 1;
        if got as u64 > MAX_JSONL_LINE {
            return Err(DataError::Line {
                path: path.to_path_buf(),
                line: n,
                why: format!(
                    "the line is longer than {} MiB, the most hspipe reads of one JSONL line (a line is parsed whole, before data.too_long could drop or cut its record): if the file is one JSON document, write it one record per line; a record this long (a text or conversation of hundreds of MB) can be given in Parquet or Arrow instead, where it is read as a cell and data.too_long drops or cuts it, or left out",
                    MAX_JSONL_LINE >> 20
                ),
            });
        }
        read += got as u64;
        // Every 4096 lines or MiB, whichever comes first: long conversations are slow to
        // tokenize, and a stop asked for is heard within a chunk or so.
        if n % 4096 == 0 || read - told >= 1 << 20 {
            told = read;
            go_on(path, advance(read))?;
        }
        let text = if n == 1 {
            bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&bytes)
        } else {
            &bytes[..]
        };
        let line = match std::str::from_utf8(text) {
            Ok(l) => l,
            Err(e) => {
                // Columns counted from 1, in bytes, as serde_json counts them in its errors.
                let at = e.valid_up_to();
                return Err(DataError::Line {
                    path: path.to_path_buf(),
                    line: n,
                    why: format!(
                        "not UTF-8 text: byte 0x{:02x} at column {}; JSON Lines must be UTF-8",
                        text[at],
                        at + 1
                    ),
                });
            }
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        // Said as what it is: serde_json would say "expected value at line 1 column 1".
        if line.starts_with('\u{feff}') {
            return Err(DataError::Line {
                path: path.to_path_buf(),
                line: n,
                why: "not a sample: the line starts with a UTF-8 byte order mark (U+FEFF), which only the file's first line may have (files joined with cat, each with its own?): remove them, e.g. sed -i 's/^\\xEF\\xBB\\xBF//' FILE".into(),
            });
        }
        if std::mem::take(&mut first) && line.starts_with('[') {
            return Err(format_err(
                path,
                "it holds a JSON array, not JSON Lines (one object per line): write one record \
                 per line, e.g. jq -c '.[]' FILE.json > FILE.jsonl",
            ));
        }
        w.push_line(n, line.to_string())
            .map_err(|s| stopped(path, &Kind::Jsonl, s))?;
    }
    go_on(path, advance(read))
}

fn write_err(e: std::io::Error) -> DataError {
    DataError::Write {
        path: PathBuf::from("(the prepared file)"),
        cause: e,
    }
}

/// A column of lists of integers, whatever its offsets' width and its integer type.
struct Lists<'a> {
    name: &'static str,
    nulls: Option<&'a NullBuffer>,
    offsets: Offsets<'a>,
    values: &'a dyn Array,
}

enum Offsets<'a> {
    Small(&'a [i32]),
    Large(&'a [i64]),
}

impl<'a> Lists<'a> {
    /// `col`, which `check_list` accepted the type of.
    fn of(col: &'a ArrayRef, name: &'static str) -> Result<Lists<'a>, String> {
        let (offsets, values) = if let Some(l) = col.as_list_opt::<i32>() {
            (Offsets::Small(l.value_offsets()), l.values())
        } else if let Some(l) = col.as_list_opt::<i64>() {
            (Offsets::Large(l.value_offsets()), l.values())
        } else {
            return Err(format!("column {name} is not a list"));
        };
        Ok(Lists {
            name,
            nulls: col.nulls().filter(|n| n.null_count() > 0),
            offsets,
            values: values.as_ref(),
        })
    }

    fn is_null(&self, row: usize) -> bool {
        self.nulls.is_some_and(|n| n.is_null(row))
    }

    /// The value range of `row` (arrow checked the offsets when it decoded the batch).
    fn range(&self, row: usize) -> Range<usize> {
        match self.offsets {
            Offsets::Small(o) => o[row] as usize..o[row + 1] as usize,
            Offsets::Large(o) => o[row] as usize..o[row + 1] as usize,
        }
    }

    /// Appends the values of `row` to `out`, each as `conv` turns it; `Err` says which entry
    /// is refused, and why.
    fn push<U>(
        &self,
        row: usize,
        out: &mut Vec<U>,
        conv: impl Fn(i128) -> Result<U, String>,
    ) -> Result<(), String> {
        let r = self.range(row);
        let v = self.values;
        match v.data_type() {
            DataType::Int8 => ints::<Int8Type, U>(v, r, out, conv),
            DataType::Int16 => ints::<Int16Type, U>(v, r, out, conv),
            DataType::Int32 => ints::<Int32Type, U>(v, r, out, conv),
            DataType::Int64 => ints::<Int64Type, U>(v, r, out, conv),
            DataType::UInt8 => ints::<UInt8Type, U>(v, r, out, conv),
            DataType::UInt16 => ints::<UInt16Type, U>(v, r, out, conv),
            DataType::UInt32 => ints::<UInt32Type, U>(v, r, out, conv),
            DataType::UInt64 => ints::<UInt64Type, U>(v, r, out, conv),
            t => Err((0, format!(" holds {}, not integers", type_name(t)))),
        }
        .map_err(|(j, why)| format!("{}[{j}]{why}", self.name))
    }
}

/// Appends `values[range]` (integers of type `T`) to `out` through `conv`; `Err` gives the
/// refused entry, counted from the range's start, and what is wrong with it.
fn ints<T: ArrowPrimitiveType, U>(
    values: &dyn Array,
    range: Range<usize>,
    out: &mut Vec<U>,
    conv: impl Fn(i128) -> Result<U, String>,
) -> Result<(), (usize, String)>
where
    i128: From<T::Native>,
{
    let Some(a) = values.as_primitive_opt::<T>() else {
        return Err((0, " holds other values than its schema says".into()));
    };
    let nulls = a.nulls().filter(|n| n.null_count() > 0);
    for (j, i) in range.enumerate() {
        if nulls.is_some_and(|n| n.is_null(i)) {
            return Err((j, " is null".into()));
        }
        out.push(conv(i128::from(a.values()[i])).map_err(|why| (j, why))?);
    }
    Ok(())
}

/// Checks that `f` is a list (or large list) of integers; `what` describes them for messages.
fn check_list(f: &Field, what: &str) -> Result<(), String> {
    match f.data_type() {
        DataType::List(c) | DataType::LargeList(c) if c.data_type().is_integer() => Ok(()),
        t => Err(format!(
            "column {} has type {}; it must be a list of integer {what}",
            f.name(),
            type_name(t)
        )),
    }
}

/// Checks that `schema` has our columns, of usable types.
fn check_schema(path: &Path, schema: &Schema) -> Result<(), DataError> {
    let mask = schema.index_of("loss_mask").ok();
    if !is_chat(schema) {
        let (ids, _) = arrow_io::our_columns(schema).map_err(|e| format_err(path, e))?;
        check_list(schema.field(ids), "token ids").map_err(|e| format_err(path, e))?;
    }
    if let Some(m) = mask {
        check_list(schema.field(m), "0/1 flags").map_err(|e| format_err(path, e))?;
    }
    Ok(())
}

/// The rows of a batch of conversations or texts, into the pipeline.
fn chat_rows<W: Write>(
    path: &Path,
    batch: &RecordBatch,
    first: u64,
    p: &mut Pipeline<'_, W>,
) -> Result<(), DataError> {
    let col = |name| batch.column_by_name(name);
    let (m, c, t) = (col("messages"), col("conversations"), col("text"));
    let tl = col(arrow_io::TOOLS_COLUMN);
    let lm = col("loss_mask")
        .map(|c| Lists::of(c, "loss_mask"))
        .transpose()
        .map_err(|e| format_err(path, e))?;
    for row in 0..batch.num_rows() {
        let cell = |a: Option<&ArrayRef>, name: &str| {
            a.map(|a| crate::cells::json_of(a.as_ref(), row).map_err(|e| format!("{name} {e}")))
                .transpose()
        };
        let r = (|| {
            let mask = match &lm {
                Some(l) if !l.is_null(row) => {
                    let mut v = Vec::new();
                    l.push(row, &mut v, |x| Ok(u8::try_from(x).unwrap_or(u8::MAX)))?;
                    Some(v)
                }
                _ => None,
            };
            let fields = Fields {
                messages: cell(m, "messages")?,
                conversations: cell(c, "conversations")?,
                text: cell(t, "text")?,
                tools: cell(tl, "tools")?,
            };
            record_of(fields, mask)
        })();
        let bytes = r.as_ref().map_or(0, crate::records::Record::text_bytes);
        p.push(first + row as u64, r, bytes)
            .map_err(|s| stopped(path, &Kind::Parquet, s))?;
    }
    Ok(())
}

fn token_id(v: i128) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!(" = {v} is out of range for a token id (0..=4294967295)"))
}

/// Converts the rows of one record batch; `first` is the dataset row of its first row.
fn rows<W: Write>(
    path: &Path,
    batch: &RecordBatch,
    first: u64,
    p: &mut Pipeline<'_, W>,
    ids: &mut Vec<u32>,
    mask: &mut Vec<u8>,
) -> Result<(), DataError> {
    check_schema(path, &batch.schema())?;
    if is_chat(&batch.schema()) {
        return chat_rows(path, batch, first, p);
    }
    let max_len = p.maker().max_len;
    let w = p.writer().map_err(|s| stopped(path, &Kind::Parquet, s))?;
    let col = |name| batch.column_by_name(name);
    let Some(ic) = col("input_ids") else {
        return Err(format_err(path, "no input_ids column"));
    };
    let ic = Lists::of(ic, "input_ids").map_err(|e| format_err(path, e))?;
    let mc = col("loss_mask")
        .map(|c| Lists::of(c, "loss_mask"))
        .transpose()
        .map_err(|e| format_err(path, e))?;
    // The common case, `list<uint32>` without nulls, is copied straight from the values.
    let direct = ic
        .values
        .as_primitive_opt::<UInt32Type>()
        .filter(|v| v.null_count() == 0);
    for row in 0..batch.num_rows() {
        let bad = |why: String| DataError::Row {
            path: path.to_path_buf(),
            row: first + row as u64,
            why,
        };
        if ic.is_null(row) {
            return Err(bad("input_ids is null".into()));
        }
        ids.clear();
        match direct {
            Some(v) => ids.extend_from_slice(&v.values()[ic.range(row)]),
            None => ic.push(row, ids, token_id).map_err(bad)?,
        }
        let m = match &mc {
            Some(mc) if !mc.is_null(row) => {
                mask.clear();
                // Anything but 0 and 1 is refused by `check_sample`.
                mc.push(row, mask, |v| Ok(u8::try_from(v).unwrap_or(u8::MAX)))
                    .map_err(bad)?;
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
            cause: e,
        },
        e => format_err(path, e),
    }
}

/// Converts an Arrow IPC stream; `row` counts dataset rows across calls (HF shards).
fn stream<R: Read, W: Write>(
    path: &Path,
    r: R,
    w: &mut Pipeline<'_, W>,
    row: &mut u64,
    advance: Advance<'_>,
) -> Result<(), DataError> {
    let mut s = IpcStream::new(r);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    while let Some(batch) = s.next_batch().map_err(ipc_err(path))? {
        rows(path, &batch, *row, w, &mut ids, &mut mask)?;
        *row += batch.num_rows() as u64;
        go_on(path, advance(s.read))?;
    }
    Ok(())
}

/// Converts an Arrow IPC file (not one hspipe prepared: that one is used as it is). It is
/// mapped, and read through the same checked decoder as a prepared file.
fn arrow_file<W: Write>(
    path: &Path,
    w: &mut Pipeline<'_, W>,
    advance: Advance<'_>,
) -> Result<(), DataError> {
    let f = File::open(path).map_err(read_err(path))?;
    let map = std::sync::Arc::new(map_read_only(&f).map_err(read_err(path))?);
    let file = IpcFile::open(&map).map_err(ipc_err(path))?;
    check_schema(path, &file.schema)?;
    // Other writers' buffers may be unaligned: arrow copies those (converting copies anyway).
    let buffer = buffer_of(&map);
    let decoder = file.decoder(&buffer, false).map_err(ipc_err(path))?;
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    let mut row = 0u64;
    for k in 0..file.batches() {
        let batch = file.batch(&decoder, &buffer, k).map_err(ipc_err(path))?;
        rows(path, &batch, row, w, &mut ids, &mut mask)?;
        row += batch.num_rows() as u64;
        go_on(path, advance(file.batch_end(k)))?;
    }
    Ok(())
}

/// What a Parquet error means for the user: the codecs this build leaves out are named.
fn parquet_why(e: impl std::fmt::Display) -> String {
    let e = e.to_string();
    const OFF: &str = "Disabled feature at compile time: ";
    match e.find(OFF).map(|i| e[i + OFF.len()..].trim()) {
        Some(codec) => {
            let codec = match codec {
                "flate2" => "GZIP".to_string(),
                c => c.to_uppercase(),
            };
            format!(
                "it is compressed with {codec}, which hspipe does not read (it reads uncompressed, Snappy and ZSTD Parquet): write it again with one of those (pyarrow: `pq.write_table(t, path, compression=\"zstd\")`)"
            )
        }
        None => format!("not a readable Parquet file: {e}"),
    }
}

/// Converts a Parquet file, `PARQUET_BATCH_ROWS` rows at a time (of our columns only).
fn parquet<W: Write>(
    path: &Path,
    w: &mut Pipeline<'_, W>,
    advance: Advance<'_>,
    total_rows: &mut dyn FnMut(u64),
) -> Result<(), DataError> {
    let err = |e: String| DataError::Parquet {
        path: path.to_path_buf(),
        why: e,
    };
    let f = File::open(path).map_err(read_err(path))?;
    let b = ParquetRecordBatchReaderBuilder::try_new(f).map_err(|e| err(parquet_why(e)))?;
    let schema = b.schema().clone();
    check_schema(path, &schema)?;
    total_rows(u64::try_from(b.metadata().file_metadata().num_rows()).unwrap_or(0));
    let wanted = arrow_io::projection(&schema).map_err(|e| format_err(path, e))?;
    let only_ours = ProjectionMask::roots(b.parquet_schema(), wanted);
    let reader = b
        .with_projection(only_ours)
        .with_batch_size(PARQUET_BATCH_ROWS)
        .build()
        .map_err(|e| err(parquet_why(e)))?;
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    let mut row = 0u64;
    for batch in reader {
        let batch = batch.map_err(|e| err(parquet_why(e)))?;
        rows(path, &batch, row, w, &mut ids, &mut mask)?;
        row += batch.num_rows() as u64;
        go_on(path, advance(row))?;
    }
    Ok(())
}
