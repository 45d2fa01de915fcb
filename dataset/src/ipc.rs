//! Arrow IPC, the columnar format's own serialisation, as far as token datasets need it:
//! the schema and record-batch messages, the *file* format (what `prepare` writes and every
//! process maps) and the *stream* format (what HF `datasets` writes, and what the Parquet
//! helper pipes to us). Spec: <https://arrow.apache.org/docs/format/Columnar.html#serialization-and-interprocess-communication-ipc>.
//!
//! Length: about 900 lines, because reading and writing each table (message, schema, record
//! batch, footer) sit side by side, checked against one layout; apart, the two halves of a
//! table could drift.
//!
//! A message is `0xFFFFFFFF`, an `i32` metadata length, a FlatBuffer `Message` (padded to 8),
//! then the body: the record batch's buffers, each at an offset the metadata gives. A stream
//! is a schema message, record batches, and an end marker (`0xFFFFFFFF 0`). A file is
//! `ARROW1\0\0`, a stream, a FlatBuffer `Footer` (the schema and each record batch's
//! position), the footer's `i32` length and `ARROW1`.
//!
//! Reading walks any schema (columns of other types are skipped by counting their field nodes
//! and buffers, as the spec lays them out in pre-order), so files from other writers, with
//! extra columns, work. Compressed bodies and big-endian data are refused with a clear error.

use std::io::Read;

use crate::fb::{self, FbError, Tab, Table, Val};

/// The Arrow file magic.
pub const MAGIC: &[u8; 6] = b"ARROW1";
/// The continuation marker before each message's metadata length.
pub const CONTINUATION: u32 = 0xFFFF_FFFF;
/// `MetadataVersion::V5`.
const V5: i16 = 4;
/// Alignment of every buffer in a body we write (the spec recommends 64).
pub const BUFFER_ALIGN: usize = 64;

/// What went wrong reading Arrow data; the caller adds the file.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error(transparent)]
    Fb(#[from] FbError),
    #[error("{0}")]
    Bad(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

type Result<T> = std::result::Result<T, IpcError>;

fn bad<T>(why: impl Into<String>) -> Result<T> {
    Err(IpcError::Bad(why.into()))
}

// `Type` union codes (Schema.fbs).
const T_NULL: u8 = 1;
const T_INT: u8 = 2;
const T_FLOAT: u8 = 3;
const T_BINARY: u8 = 4;
const T_UTF8: u8 = 5;
const T_BOOL: u8 = 6;
const T_LIST: u8 = 12;
const T_STRUCT: u8 = 13;
const T_UNION: u8 = 14;
const T_FIXED_SIZE_LIST: u8 = 16;
const T_MAP: u8 = 17;
const T_LARGE_BINARY: u8 = 19;
const T_LARGE_UTF8: u8 = 20;
const T_LARGE_LIST: u8 = 21;
const T_RUN_END: u8 = 22;
const T_BINARY_VIEW: u8 = 23;
const T_UTF8_VIEW: u8 = 24;
const T_LIST_VIEW: u8 = 25;
const T_LARGE_LIST_VIEW: u8 = 26;

// `MessageHeader` union codes (Message.fbs).
const H_SCHEMA: u8 = 1;
const H_DICTIONARY: u8 = 2;
const H_RECORD_BATCH: u8 = 3;

/// A column's type, as much of it as we use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Type {
    Int {
        bits: u8,
        signed: bool,
    },
    /// `List` (32-bit offsets) or `LargeList` (64-bit).
    List {
        large: bool,
    },
    /// Anything else: its `Type` union code, and for unions whether they are dense.
    Other {
        code: u8,
        dense_union: bool,
    },
}

/// A field of a schema, with its children.
#[derive(Clone, Debug)]
pub struct Field {
    pub name: String,
    pub nullable: bool,
    pub ty: Type,
    pub children: Vec<Field>,
    /// Dictionary-encoded: the record batch holds indices only.
    pub dictionary: bool,
}

impl Field {
    /// The type for messages: `list<uint32>`, `int64`, `type 5`.
    pub fn type_name(&self) -> String {
        let base = match &self.ty {
            Type::Int { bits, signed } => format!("{}int{bits}", if *signed { "" } else { "u" }),
            Type::List { large } => {
                let child = self
                    .children
                    .first()
                    .map_or_else(|| "?".to_string(), Field::type_name);
                format!("{}list<{child}>", if *large { "large_" } else { "" })
            }
            Type::Other { code, .. } => match *code {
                T_FLOAT => "floating point".into(),
                T_UTF8 | T_LARGE_UTF8 | T_UTF8_VIEW => "string".into(),
                T_BINARY | T_LARGE_BINARY | T_BINARY_VIEW => "binary".into(),
                T_BOOL => "bool".into(),
                T_STRUCT => "struct".into(),
                T_FIXED_SIZE_LIST => "fixed_size_list".into(),
                c => format!("Arrow type {c}"),
            },
        };
        if self.dictionary {
            format!("dictionary<{base}>")
        } else {
            base
        }
    }
}

/// A schema: its fields and its key/value metadata.
#[derive(Clone, Debug, Default)]
pub struct Schema {
    pub fields: Vec<Field>,
    pub metadata: Vec<(String, String)>,
}

impl Schema {
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn parse_field(t: Tab<'_>, depth: usize) -> Result<Field> {
    if depth > 64 {
        return bad("a schema nested more than 64 levels deep");
    }
    let name = t.str(0)?.unwrap_or("").to_string();
    let nullable = t.bool(1)?;
    let code = t.u8(2, 0)?;
    let ty = match code {
        T_INT => {
            let it = t
                .table(3)?
                .ok_or_else(|| IpcError::Bad(format!("field {name}: int without its width")))?;
            let bits = it.i32(0, 0)?;
            if ![8, 16, 32, 64].contains(&bits) {
                return bad(format!("field {name}: int of {bits} bits"));
            }
            Type::Int {
                bits: bits as u8,
                signed: it.bool(1)?,
            }
        }
        T_LIST => Type::List { large: false },
        T_LARGE_LIST => Type::List { large: true },
        0 => return bad(format!("field {name} has no type")),
        _ => {
            let dense_union =
                code == T_UNION && t.table(3)?.map(|u| u.i16(0, 0)).transpose()? == Some(1);
            Type::Other { code, dense_union }
        }
    };
    let dictionary = t.table(4)?.is_some();
    let children = t
        .tables(5)?
        .into_iter()
        .map(|c| parse_field(c, depth + 1))
        .collect::<Result<Vec<_>>>()?;
    Ok(Field {
        name,
        nullable,
        ty,
        children,
        dictionary,
    })
}

fn parse_kv(t: &Tab<'_>, id: u16) -> Result<Vec<(String, String)>> {
    t.tables(id)?
        .into_iter()
        .map(|kv| {
            Ok((
                kv.str(0)?.unwrap_or("").to_string(),
                kv.str(1)?.unwrap_or("").to_string(),
            ))
        })
        .collect()
}

/// Reads a `Schema` table.
pub fn parse_schema(t: Tab<'_>) -> Result<Schema> {
    if t.i16(0, 0)? != 0 {
        return bad("the data is big-endian; only little-endian Arrow data is read");
    }
    let fields = t
        .tables(1)?
        .into_iter()
        .map(|f| parse_field(f, 0))
        .collect::<Result<Vec<_>>>()?;
    Ok(Schema {
        fields,
        metadata: parse_kv(&t, 2)?,
    })
}

/// A message's header.
pub enum Header<'a> {
    Schema(Schema),
    RecordBatch(Tab<'a>),
    Dictionary,
}

/// Parses a message's FlatBuffer metadata; returns the header and the body length.
pub fn parse_message(meta: &[u8]) -> Result<(Header<'_>, u64)> {
    let m = Tab::root(meta)?;
    let body = m.i64(3, 0)?;
    if body < 0 {
        return bad(format!("a message with a body of {body} bytes"));
    }
    let header = match m.u8(1, 0)? {
        H_SCHEMA => {
            Header::Schema(parse_schema(m.table(2)?.ok_or_else(|| {
                IpcError::Bad("a schema message without its schema".into())
            })?)?)
        }
        H_RECORD_BATCH => Header::RecordBatch(
            m.table(2)?
                .ok_or_else(|| IpcError::Bad("a record batch message without its header".into()))?,
        ),
        H_DICTIONARY => Header::Dictionary,
        h => {
            return bad(format!(
                "a message of type {h}, neither a schema nor a record batch"
            ))
        }
    };
    Ok((header, body as u64))
}

/// A column of `List<Int>` in one record batch, borrowed from its body.
#[derive(Clone, Copy, Debug)]
pub struct ListColumn<'a> {
    pub rows: usize,
    /// The list's validity bitmap; empty when nothing is null.
    pub validity: &'a [u8],
    pub null_count: u64,
    /// `rows + 1` offsets, 4 or 8 bytes each.
    pub offsets: &'a [u8],
    pub large: bool,
    pub values: &'a [u8],
    pub values_len: usize,
    pub values_validity: &'a [u8],
    pub values_null_count: u64,
    pub bits: u8,
    pub signed: bool,
}

fn bit(bitmap: &[u8], i: usize) -> bool {
    bitmap.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
}

impl<'a> ListColumn<'a> {
    pub fn is_null(&self, row: usize) -> bool {
        self.null_count > 0 && !bit(self.validity, row)
    }

    fn offset(&self, i: usize) -> i64 {
        if self.large {
            let b = &self.offsets[8 * i..8 * i + 8];
            i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))
        } else {
            let b = &self.offsets[4 * i..4 * i + 4];
            i64::from(i32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
        }
    }

    /// The value range of `row`; checked against the values when the column was made.
    pub fn range(&self, row: usize) -> std::ops::Range<usize> {
        self.offset(row) as usize..self.offset(row + 1) as usize
    }

    /// Value `i` of the child, widened, or None if it is null.
    pub fn value(&self, i: usize) -> Option<i128> {
        if self.values_null_count > 0 && !bit(self.values_validity, i) {
            return None;
        }
        let w = usize::from(self.bits / 8);
        let b = &self.values[w * i..w * i + w];
        let mut a = [0u8; 8];
        a[..w].copy_from_slice(b);
        let u = u64::from_le_bytes(a);
        Some(if self.signed {
            let shift = 64 - u32::from(self.bits);
            i128::from(((u << shift) as i64) >> shift)
        } else {
            i128::from(u)
        })
    }

    /// Checks offsets and sizes once, so `range` and `value` stay in bounds.
    fn check(&self, name: &str) -> Result<()> {
        let w = if self.large { 8 } else { 4 };
        let need = self.rows.checked_add(1).and_then(|n| n.checked_mul(w));
        if need.is_none_or(|n| self.offsets.len() < n) {
            return bad(format!(
                "column {name}: {} bytes of offsets for {} rows",
                self.offsets.len(),
                self.rows
            ));
        }
        if self.null_count > 0 && (self.validity.len() as u64) * 8 < self.rows as u64 {
            return bad(format!("column {name}: validity bitmap too short"));
        }
        if self.values_null_count > 0
            && (self.values_validity.len() as u64) * 8 < self.values_len as u64
        {
            return bad(format!("column {name}: value validity bitmap too short"));
        }
        let need = self.values_len.checked_mul(usize::from(self.bits / 8));
        if need.is_none_or(|n| self.values.len() < n) {
            return bad(format!(
                "column {name}: {} bytes of values for {} values",
                self.values.len(),
                self.values_len
            ));
        }
        let mut prev = self.offset(0);
        if prev < 0 {
            return bad(format!("column {name}: negative offset"));
        }
        for i in 1..=self.rows {
            let o = self.offset(i);
            if o < prev || o as u64 > self.values_len as u64 {
                return bad(format!(
                    "column {name}: row {}: offsets {prev}..{o} outside its {} values",
                    i - 1,
                    self.values_len
                ));
            }
            prev = o;
        }
        Ok(())
    }
}

/// The columns we read from one record batch.
pub struct Columns<'a> {
    pub rows: usize,
    pub input_ids: ListColumn<'a>,
    pub loss_mask: Option<ListColumn<'a>>,
}

/// Where `input_ids` and `loss_mask` are in a schema, checked once per schema.
#[derive(Clone, Debug)]
pub struct Layout {
    ids: Col,
    mask: Option<Col>,
    /// Buffers taken by the fields before each view-typed field need the batch's variadic
    /// counts; only then is the layout worked out per batch.
    views: bool,
    schema: Schema,
}

/// A column's field index and its first field node and buffer in a record batch.
#[derive(Clone, Copy, Debug)]
struct Col {
    field: usize,
    node: usize,
    buf: usize,
}

/// Counts the field nodes and buffers a field takes in a record batch. `variadic` supplies the
/// buffer counts of view types, in order.
fn walk(
    f: &Field,
    nodes: &mut usize,
    bufs: &mut usize,
    variadic: &mut dyn FnMut() -> Result<usize>,
) -> Result<()> {
    *nodes += 1;
    if f.dictionary {
        *bufs += 2;
        return Ok(());
    }
    let (own, children) = match &f.ty {
        Type::Int { .. } => (2, false),
        Type::List { .. } => (2, true),
        Type::Other { code, dense_union } => match *code {
            T_NULL => (0, false),
            T_BINARY | T_UTF8 | T_LARGE_BINARY | T_LARGE_UTF8 => (3, false),
            T_STRUCT | T_FIXED_SIZE_LIST => (1, true),
            T_MAP => (2, true),
            T_UNION => (if *dense_union { 2 } else { 1 }, true),
            T_RUN_END => (0, true),
            T_LIST_VIEW | T_LARGE_LIST_VIEW => (3, true),
            T_BINARY_VIEW | T_UTF8_VIEW => (2 + variadic()?, false),
            _ => (2, false),
        },
    };
    *bufs += own;
    if children {
        for c in &f.children {
            walk(c, nodes, bufs, variadic)?;
        }
    }
    Ok(())
}

fn is_view(f: &Field) -> bool {
    matches!(
        f.ty,
        Type::Other {
            code: T_BINARY_VIEW | T_UTF8_VIEW,
            ..
        }
    ) || f.children.iter().any(is_view)
}

/// Checks that `f` is a list of integers; `what` describes the values for messages.
fn check_list(f: &Field, what: &str) -> Result<()> {
    let ok = !f.dictionary
        && matches!(f.ty, Type::List { .. })
        && f.children.len() == 1
        && matches!(f.children[0].ty, Type::Int { .. })
        && !f.children[0].dictionary;
    if ok {
        Ok(())
    } else {
        bad(format!(
            "column {} has type {}; it must be a list of integer {what}",
            f.name,
            f.type_name()
        ))
    }
}

impl Layout {
    /// Finds `input_ids` (required) and `loss_mask` (optional) in `schema`.
    pub fn new(schema: &Schema) -> Result<Layout> {
        let find = |name: &str| schema.fields.iter().position(|f| f.name == name);
        let Some(ids) = find("input_ids") else {
            let names: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
            return bad(format!(
                "no input_ids column (columns: {})",
                if names.is_empty() {
                    "none".into()
                } else {
                    names.join(", ")
                }
            ));
        };
        check_list(&schema.fields[ids], "token ids")?;
        let mask = find("loss_mask");
        if let Some(m) = mask {
            check_list(&schema.fields[m], "0/1 flags")?;
        }
        let views = schema.fields.iter().any(is_view);
        let col = |field| Col {
            field,
            node: 0,
            buf: 0,
        };
        let mut l = Layout {
            ids: col(ids),
            mask: mask.map(col),
            views,
            schema: schema.clone(),
        };
        if !views {
            l.place(&mut || Ok(0))?;
        }
        Ok(l)
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Works out the first node and buffer of our columns.
    fn place(&mut self, variadic: &mut dyn FnMut() -> Result<usize>) -> Result<()> {
        let (mut nodes, mut bufs) = (0, 0);
        let mut at = Vec::with_capacity(self.schema.fields.len());
        for f in &self.schema.fields {
            at.push((nodes, bufs));
            walk(f, &mut nodes, &mut bufs, variadic)?;
        }
        for c in std::iter::once(&mut self.ids).chain(self.mask.as_mut()) {
            (c.node, c.buf) = at[c.field];
        }
        Ok(())
    }

    /// The columns of a record batch whose metadata is `rb` and body `body`.
    pub fn columns<'a>(&self, rb: Tab<'_>, body: &'a [u8]) -> Result<Columns<'a>> {
        if rb.table(3)?.is_some() {
            return bad(
                "the record batches are compressed (LZ4 or ZSTD); write the file uncompressed",
            );
        }
        let rows = rb.i64(0, 0)?;
        let nodes = rb.structs(1, 16)?;
        let bufs = rb.structs(2, 16)?;
        let mut layout = self.clone();
        if self.views {
            let counts = rb.structs(4, 8)?;
            let mut k = 0;
            layout.place(&mut || {
                let c = counts
                    .get(8 * k..8 * k + 8)
                    .ok_or_else(|| IpcError::Bad("missing variadic buffer counts".into()))?;
                k += 1;
                let c = i64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
                usize::try_from(c)
                    .map_err(|_| IpcError::Bad("negative variadic buffer count".into()))
            })?;
        }
        let rows =
            usize::try_from(rows).map_err(|_| IpcError::Bad(format!("a batch of {rows} rows")))?;
        let node = |i: usize| -> Result<(u64, u64)> {
            let b = nodes
                .get(16 * i..16 * i + 16)
                .ok_or_else(|| IpcError::Bad(format!("record batch has no field node {i}")))?;
            let len = i64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]));
            let nulls = i64::from_le_bytes(b[8..].try_into().unwrap_or([0; 8]));
            if len < 0 || nulls < 0 {
                return bad("a negative length in a field node");
            }
            Ok((len as u64, nulls as u64))
        };
        let buffer = |i: usize| -> Result<&'a [u8]> {
            let b = bufs
                .get(16 * i..16 * i + 16)
                .ok_or_else(|| IpcError::Bad(format!("record batch has no buffer {i}")))?;
            let off = i64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]));
            let len = i64::from_le_bytes(b[8..].try_into().unwrap_or([0; 8]));
            if off < 0 || len < 0 {
                return bad("a negative buffer offset or length");
            }
            let (off, len) = (off as u64, len as u64);
            off.checked_add(len)
                .filter(|&end| end <= body.len() as u64)
                .map(|end| &body[off as usize..end as usize])
                .ok_or_else(|| {
                    IpcError::Bad(format!(
                        "buffer {i} at {off}+{len} is past the end of its {}-byte body (truncated?)",
                        body.len()
                    ))
                })
        };
        let list = |c: Col| -> Result<ListColumn<'a>> {
            let (n, b) = (c.node, c.buf);
            let f = &layout.schema.fields[c.field];
            let (len, nulls) = node(n)?;
            let (vlen, vnulls) = node(n + 1)?;
            if len != rows as u64 {
                return bad(format!(
                    "column {}: {len} rows in a batch of {rows}",
                    f.name
                ));
            }
            let Type::List { large } = f.ty else {
                return bad("not a list");
            };
            let Type::Int { bits, signed } = f.children[0].ty else {
                return bad("not a list of integers");
            };
            let c = ListColumn {
                rows,
                validity: buffer(b)?,
                null_count: nulls,
                offsets: buffer(b + 1)?,
                large,
                values_validity: buffer(b + 2)?,
                values_null_count: vnulls,
                values: buffer(b + 3)?,
                values_len: usize::try_from(vlen)
                    .map_err(|_| IpcError::Bad("too many values".into()))?,
                bits,
                signed,
            };
            c.check(&f.name)?;
            Ok(c)
        };
        Ok(Columns {
            rows,
            input_ids: list(layout.ids)?,
            loss_mask: layout.mask.map(list).transpose()?,
        })
    }
}

/// Reads messages from a stream, one record batch in memory at a time.
pub struct StreamReader<R> {
    r: R,
    meta: Vec<u8>,
    body: Vec<u8>,
    layout: Option<Layout>,
    /// Bytes consumed so far, for progress.
    pub read: u64,
    /// Rows of the record batches returned so far.
    pub rows: u64,
}

impl<R: Read> StreamReader<R> {
    pub fn new(r: R) -> StreamReader<R> {
        StreamReader {
            r,
            meta: Vec::new(),
            body: Vec::new(),
            layout: None,
            read: 0,
            rows: 0,
        }
    }

    /// The row count a writer announced in the schema (`hspipe.rows`; our Parquet helper).
    pub fn rows_total(&self) -> Option<u64> {
        self.layout
            .as_ref()
            .and_then(|l| l.schema().meta("hspipe.rows"))
            .and_then(|n| n.parse().ok())
    }

    /// Reads exactly `n` bytes into `buf`, or fewer at the end of the stream.
    fn fill(&mut self, n: usize, into_body: bool) -> Result<usize> {
        let buf = if into_body {
            &mut self.body
        } else {
            &mut self.meta
        };
        buf.clear();
        // Grown as data arrives, so a garbage length cannot allocate gigabytes up front.
        let got = (&mut self.r).take(n as u64).read_to_end(buf)?;
        self.read += got as u64;
        Ok(got)
    }

    /// The next record batch, or None at the end of the stream. The schema must come first.
    pub fn next_batch(&mut self) -> Result<Option<Columns<'_>>> {
        loop {
            let got = self.fill(4, false)?;
            if got == 0 {
                return Ok(None);
            }
            if got < 4 {
                return bad("the stream ends inside a message header (truncated?)");
            }
            let mut len = u32::from_le_bytes(self.meta[..4].try_into().unwrap_or([0; 4]));
            if len == CONTINUATION {
                if self.fill(4, false)? < 4 {
                    return bad("the stream ends inside a message header (truncated?)");
                }
                len = u32::from_le_bytes(self.meta[..4].try_into().unwrap_or([0; 4]));
            }
            if len == 0 {
                return Ok(None);
            }
            let len = len as usize;
            if len > 1 << 30 || self.fill(len, false)? < len {
                return bad("the stream ends inside a message's metadata (truncated?)");
            }
            let (is_batch, body_len) = {
                let (h, body_len) = parse_message(&self.meta)?;
                match h {
                    Header::Schema(s) => {
                        self.layout = Some(Layout::new(&s)?);
                        (false, body_len)
                    }
                    Header::RecordBatch(_) => (true, body_len),
                    Header::Dictionary => (false, body_len),
                }
            };
            let body_len =
                usize::try_from(body_len).map_err(|_| IpcError::Bad("huge body".into()))?;
            if self.fill(body_len, true)? < body_len {
                return bad("the stream ends inside a record batch (truncated?)");
            }
            if !is_batch {
                continue;
            }
            let Some(layout) = &self.layout else {
                return bad("a record batch before the schema");
            };
            let (Header::RecordBatch(rb), _) = parse_message(&self.meta)? else {
                return bad("not a record batch");
            };
            let cols = layout.columns(rb, &self.body)?;
            self.rows += cols.rows as u64;
            return Ok(Some(cols));
        }
    }
}

/// One record batch's place in a file (the footer's `Block`).
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub offset: u64,
    pub meta_len: u32,
    pub body_len: u64,
}

/// A file's footer: the schema and the blocks of its record batches.
pub fn parse_footer(file: &[u8]) -> Result<(Schema, Vec<Block>)> {
    let n = file.len();
    if n < 8 + 10 || &file[..6] != MAGIC {
        return bad("it does not start with the Arrow file magic ARROW1");
    }
    if &file[n - 6..] != MAGIC {
        return bad("it does not end with the Arrow file magic ARROW1 (truncated?)");
    }
    let flen = i32::from_le_bytes(file[n - 10..n - 6].try_into().unwrap_or([0; 4]));
    let start = (n - 10).checked_sub(flen.max(0) as usize);
    let Some(start) = start.filter(|&s| flen > 0 && s >= 8) else {
        return bad(format!("its footer length {flen} does not fit the file"));
    };
    let f = Tab::root(&file[start..n - 10])?;
    let schema = parse_schema(
        f.table(1)?
            .ok_or_else(|| IpcError::Bad("the footer has no schema".into()))?,
    )?;
    let blocks = f
        .structs(3, 24)?
        .chunks_exact(24)
        .map(|b| {
            let offset = i64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]));
            let meta_len = i32::from_le_bytes(b[8..12].try_into().unwrap_or([0; 4]));
            let body_len = i64::from_le_bytes(b[16..].try_into().unwrap_or([0; 8]));
            if offset < 0 || meta_len < 8 || body_len < 0 {
                return bad("a record batch block with a negative position or size");
            }
            Ok(Block {
                offset: offset as u64,
                meta_len: meta_len as u32,
                body_len: body_len as u64,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((schema, blocks))
}

/// The metadata and body of the record batch at `b` in `file`, bounds-checked.
pub fn block_parts<'a>(file: &'a [u8], b: &Block) -> Result<(Tab<'a>, &'a [u8])> {
    let end = b
        .offset
        .checked_add(u64::from(b.meta_len))
        .and_then(|m| m.checked_add(b.body_len).map(|e| (m, e)))
        .filter(|&(_, e)| e <= file.len() as u64);
    let Some((meta_end, end)) = end else {
        return bad(format!(
            "a record batch at {}+{} is past the end of the {}-byte file (truncated?)",
            b.offset,
            u64::from(b.meta_len) + b.body_len,
            file.len()
        ));
    };
    let m = &file[b.offset as usize..meta_end as usize];
    // `0xFFFFFFFF len` then the FlatBuffer (or, before Arrow 0.15, just `len`).
    let fb = if m.len() >= 8 && m[..4] == CONTINUATION.to_le_bytes() {
        &m[8..]
    } else {
        &m[4.min(m.len())..]
    };
    let (Header::RecordBatch(rb), body_len) = parse_message(fb)? else {
        return bad(format!("the block at {} is not a record batch", b.offset));
    };
    if body_len != b.body_len {
        return bad(format!(
            "the block at {} disagrees with its message on the body length",
            b.offset
        ));
    }
    Ok((rb, &file[meta_end as usize..end as usize]))
}

// ---- writing ----

fn kv_vec(meta: &[(String, String)]) -> Val {
    Val::Tables(
        meta.iter()
            .map(|(k, v)| {
                Table::new()
                    .with(0, Val::Str(k.clone()))
                    .with(1, Val::Str(v.clone()))
            })
            .collect(),
    )
}

fn int_field(name: &str, bits: i32, nullable: bool) -> Table {
    Table::new()
        .with(0, Val::Str(name.into()))
        .with(1, Val::Bool(nullable))
        .with(2, Val::U8(T_INT))
        .with(
            3,
            Val::Table(
                Table::new()
                    .with(0, Val::I32(bits))
                    .with(1, Val::Bool(false)),
            ),
        )
        .with(5, Val::Tables(Vec::new()))
}

fn list_field(name: &str, nullable: bool, child: Table) -> Table {
    Table::new()
        .with(0, Val::Str(name.into()))
        .with(1, Val::Bool(nullable))
        .with(2, Val::U8(T_LIST))
        .with(3, Val::Table(Table::new()))
        .with(5, Val::Tables(vec![child]))
}

/// Our schema: `input_ids: list<uint32>` (not null), `loss_mask: list<uint8>` (null: all
/// ones), with `meta` as its key/value metadata.
pub fn our_schema(meta: &[(String, String)]) -> Table {
    Table::new()
        .with(0, Val::I16(0))
        .with(
            1,
            Val::Tables(vec![
                list_field("input_ids", false, int_field("item", 32, false)),
                list_field("loss_mask", true, int_field("item", 8, false)),
            ]),
        )
        .with(2, kv_vec(meta))
}

/// A message's FlatBuffer wrapped as the format wants: marker, length, metadata padded so the
/// body starts 8-aligned.
pub fn frame(header_type: u8, header: Table, body_len: u64) -> Vec<u8> {
    let m = fb::finish(
        &Table::new()
            .with(0, Val::I16(V5))
            .with(1, Val::U8(header_type))
            .with(2, Val::Table(header))
            .with(3, Val::I64(body_len as i64)),
    );
    let mut out = Vec::with_capacity(8 + m.len());
    out.extend_from_slice(&CONTINUATION.to_le_bytes());
    out.extend_from_slice(&(m.len() as u32).to_le_bytes());
    out.extend_from_slice(&m);
    out
}

pub fn schema_message(meta: &[(String, String)]) -> Vec<u8> {
    frame(H_SCHEMA, our_schema(meta), 0)
}

/// A record batch's metadata for `rows` rows, with these field nodes `(length, nulls)` and
/// buffers `(offset, length)` in the body.
pub fn batch_message(
    rows: u64,
    nodes: &[(u64, u64)],
    buffers: &[(u64, u64)],
    body_len: u64,
) -> Vec<u8> {
    let structs = |v: &[(u64, u64)]| Val::Structs {
        align: 8,
        count: v.len(),
        bytes: v
            .iter()
            .flat_map(|&(a, b)| {
                (a as i64)
                    .to_le_bytes()
                    .into_iter()
                    .chain((b as i64).to_le_bytes())
            })
            .collect(),
    };
    frame(
        H_RECORD_BATCH,
        Table::new()
            .with(0, Val::I64(rows as i64))
            .with(1, structs(nodes))
            .with(2, structs(buffers)),
        body_len,
    )
}

/// A file's footer FlatBuffer.
pub fn footer(meta: &[(String, String)], blocks: &[Block]) -> Vec<u8> {
    fb::finish(
        &Table::new()
            .with(0, Val::I16(V5))
            .with(1, Val::Table(our_schema(meta)))
            .with(
                3,
                Val::Structs {
                    align: 8,
                    count: blocks.len(),
                    bytes: blocks
                        .iter()
                        .flat_map(|b| {
                            let mut e = [0u8; 24];
                            e[..8].copy_from_slice(&(b.offset as i64).to_le_bytes());
                            e[8..12].copy_from_slice(&(b.meta_len as i32).to_le_bytes());
                            e[16..].copy_from_slice(&(b.body_len as i64).to_le_bytes());
                            e
                        })
                        .collect(),
                },
            ),
    )
}
