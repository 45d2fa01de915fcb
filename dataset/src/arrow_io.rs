//! Arrow IPC files and streams read through arrow-rs (`arrow-ipc`), with the one thing of our
//! own that arrow-rs leaves to its caller: checking a record batch's field nodes and buffers
//! against its body before decoding it. arrow-ipc 60 asserts (panics) on three things a
//! truncated or damaged file holds: a buffer that reaches past the body
//! (`Buffer::slice_with_length`), an offsets buffer (of a list, a string or a binary, at any
//! depth of a decoded column: a `messages` struct's strings too) whose length is not a whole
//! number of offsets, and, when told not to copy, a misaligned buffer (both in
//! `Buffer::typed_data`). A damaged cache file or input must be an error naming the file,
//! never a panic.
//!
//! Only our columns are decoded (arrow's projection): `input_ids` and `loss_mask`, or the
//! conversation's or text's column, `loss_mask` and `tools`; the other columns of other writers' files
//! (scores, their dictionaries) are skipped unread. A dictionary of one of our columns (a
//! pandas categorical `role` or `text`) is checked as a record batch of its values, then read.
//!
//! A file is read over a [`Buffer`] of the whole file (a memory map: the record batches'
//! arrays are slices of it, nothing is copied); a stream, message by message from a reader
//! (HF `datasets` shards), one record batch in memory at a time.
//!
//! Length: past 500 lines because the layout of every Arrow type (which buffers a column
//! takes, which of them arrow reads as typed values) must be known to check a batch before
//! arrow reads it, and it is kept in one place with the file and stream readers that use it.

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;

use arrow_array::ArrayRef;
use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::reader::{read_dictionary, read_record_batch, FileDecoder};
use arrow_ipc::{Block, Endianness, MessageHeader, MetadataVersion};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};

/// The Arrow file magic.
pub const MAGIC: &[u8; 6] = b"ARROW1";
/// The continuation marker before each message's metadata length.
pub const CONTINUATION: [u8; 4] = [0xff; 4];

/// No array of a record batch is longer than this (2^40 rows or values); a larger length is
/// damage. Bounding it keeps arrow's size arithmetic (length times width) from overflowing.
const MAX_LENGTH: i64 = 1 << 40;

/// What went wrong reading Arrow data; the caller adds the file.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error("{0}")]
    Bad(String),
    #[error("{0}")]
    Arrow(#[from] ArrowError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

type Result<T> = std::result::Result<T, IpcError>;

fn bad<T>(why: impl Into<String>) -> Result<T> {
    Err(IpcError::Bad(why.into()))
}

/// A column's type for messages, in the words the earlier reader used: `list<uint32>`,
/// `large_list<int16>`, `list<floating point>`, `string`.
pub fn type_name(t: &DataType) -> String {
    match t {
        DataType::Int8 => "int8".into(),
        DataType::Int16 => "int16".into(),
        DataType::Int32 => "int32".into(),
        DataType::Int64 => "int64".into(),
        DataType::UInt8 => "uint8".into(),
        DataType::UInt16 => "uint16".into(),
        DataType::UInt32 => "uint32".into(),
        DataType::UInt64 => "uint64".into(),
        DataType::List(f) => format!("list<{}>", type_name(f.data_type())),
        DataType::LargeList(f) => format!("large_list<{}>", type_name(f.data_type())),
        DataType::Float16 | DataType::Float32 | DataType::Float64 => "floating point".into(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => "binary".into(),
        DataType::Boolean => "bool".into(),
        DataType::Struct(_) => "struct".into(),
        DataType::FixedSizeList(..) => "fixed_size_list".into(),
        DataType::Dictionary(_, v) => format!("dictionary<{}>", type_name(v)),
        t => t.to_string(),
    }
}

/// The indices of `input_ids` (required) and `loss_mask` (if there is one) in `schema`.
pub fn our_columns(schema: &Schema) -> Result<(usize, Option<usize>)> {
    let Ok(ids) = schema.index_of("input_ids") else {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        return bad(format!(
            "no input_ids, messages, conversations or text column (columns: {}): a sample is token ids (input_ids, with loss_mask), a conversation (messages or conversations) or a text (text); rename the column that holds them",
            if names.is_empty() {
                "none".into()
            } else {
                names.join(", ")
            }
        ));
    };
    Ok((ids, schema.index_of("loss_mask").ok()))
}

/// The columns a conversation or text is read from, when there is no `input_ids`.
pub const CHAT_COLUMNS: [&str; 3] = ["messages", "conversations", "text"];

/// Read with a conversation's column: its function definitions (`tools`), a list of structs
/// or a string of JSON. It makes no row a conversation by itself.
pub const TOOLS_COLUMN: &str = "tools";

/// True when `schema` holds conversations or texts rather than token ids.
pub fn is_chat(schema: &Schema) -> bool {
    schema.index_of("input_ids").is_err() && CHAT_COLUMNS.iter().any(|c| schema.index_of(c).is_ok())
}

/// The projection that decodes only our columns: `input_ids` first, then `loss_mask`; for
/// conversations and texts, theirs, `loss_mask` and `tools`, in the schema's order.
pub fn projection(schema: &Schema) -> Result<Vec<usize>> {
    if is_chat(schema) {
        let mut v: Vec<usize> = CHAT_COLUMNS
            .iter()
            .chain(&["loss_mask", TOOLS_COLUMN])
            .filter_map(|n| schema.index_of(n).ok())
            .collect();
        v.sort_unstable();
        return Ok(v);
    }
    let (ids, mask) = our_columns(schema)?;
    Ok(std::iter::once(ids).chain(mask).collect())
}

fn check_schema_fb(s: arrow_ipc::Schema<'_>) -> Result<Schema> {
    if s.endianness() != Endianness::Little {
        return bad("the data is big-endian; only little-endian Arrow data is read");
    }
    Ok(arrow_ipc::convert::try_fb_to_schema(s)?)
}

/// A buffer that arrow reads as a slice of fixed-width values (`Buffer::typed_data`, which
/// asserts that its length is a whole number of them): its index among the record batch's
/// buffers, the values' width in bytes, and what they are, for the error.
struct Typed {
    buffer: usize,
    width: usize,
    what: &'static str,
}

/// The buffers of a `t` node, after its first, that arrow reads through `typed_data` when it
/// validates the array: offsets (strings, binaries, lists, maps, dense unions), list views'
/// sizes, string views, dictionary keys. `first` is the node's first buffer; `v5` as in
/// [`walk`].
fn typed_buffers(t: &DataType, first: usize, v5: bool, out: &mut Vec<Typed>) {
    let mut push = |k: usize, width: usize, what: &'static str| {
        out.push(Typed {
            buffer: first + k,
            width,
            what,
        })
    };
    match t {
        DataType::Utf8 | DataType::Binary => push(1, 4, "string offsets"),
        DataType::LargeUtf8 | DataType::LargeBinary => push(1, 8, "string offsets"),
        DataType::List(_) | DataType::Map(..) => push(1, 4, "list offsets"),
        DataType::LargeList(_) => push(1, 8, "list offsets"),
        DataType::ListView(_) => {
            push(1, 4, "list view offsets");
            push(2, 4, "list view sizes");
        }
        DataType::LargeListView(_) => {
            push(1, 8, "list view offsets");
            push(2, 8, "list view sizes");
        }
        DataType::Utf8View | DataType::BinaryView => push(1, 16, "string views"),
        DataType::Union(_, arrow_schema::UnionMode::Dense) => {
            push(usize::from(!v5) + 1, 4, "union offsets")
        }
        DataType::Dictionary(k, _) => {
            if let Some(w) = k.primitive_width() {
                push(1, w, "dictionary keys")
            }
        }
        _ => {}
    }
}

/// Counts the field nodes and buffers a column of type `t` takes in a record batch, as the
/// format lays them out (depth first) and arrow-ipc reads them; `variadic` gives the buffer
/// counts of view types, in order. With `typed`, the column is decoded, and the buffers of it
/// and its children that arrow reads as typed values are added there.
fn walk(
    t: &DataType,
    v5: bool,
    (nodes, bufs): (&mut usize, &mut usize),
    variadic: &mut dyn Iterator<Item = i64>,
    mut typed: Option<&mut Vec<Typed>>,
) -> Result<()> {
    *nodes += 1;
    let (own, kids): (usize, Vec<&DataType>) = match t {
        DataType::Null => (0, vec![]),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary => {
            (3, vec![])
        }
        DataType::Utf8View | DataType::BinaryView => {
            let n = variadic.next().and_then(|n| usize::try_from(n).ok());
            let n = n.ok_or_else(|| IpcError::Bad("a bad variadic buffer count".into()))?;
            (n.saturating_add(2), vec![])
        }
        DataType::List(c) | DataType::LargeList(c) | DataType::Map(c, _) => {
            (2, vec![c.data_type()])
        }
        DataType::ListView(c) | DataType::LargeListView(c) => (3, vec![c.data_type()]),
        DataType::FixedSizeList(c, _) => (1, vec![c.data_type()]),
        DataType::Struct(fs) => (1, fs.iter().map(|f| f.data_type()).collect()),
        DataType::RunEndEncoded(a, b) => (0, vec![a.data_type(), b.data_type()]),
        DataType::Union(fs, mode) => (
            usize::from(!v5) + 1 + usize::from(*mode == arrow_schema::UnionMode::Dense),
            fs.iter().map(|(_, f)| f.data_type()).collect(),
        ),
        // Dictionary indices, and every fixed-width type: validity and values.
        _ => (2, vec![]),
    };
    if let Some(typed) = typed.as_deref_mut() {
        typed_buffers(t, *bufs, v5, typed);
    }
    *bufs = bufs.saturating_add(own);
    for c in kids {
        walk(
            c,
            v5,
            (&mut *nodes, &mut *bufs),
            variadic,
            typed.as_deref_mut(),
        )?;
    }
    Ok(())
}

/// The buffers of our columns (`ours`, at any depth) that arrow reads as typed values.
fn our_typed_buffers(
    schema: &Schema,
    ours: &[usize],
    rb: &arrow_ipc::RecordBatch<'_>,
    v5: bool,
) -> Result<Vec<Typed>> {
    let mut variadic = rb.variadicBufferCounts().into_iter().flatten();
    let (mut nodes, mut bufs) = (0, 0);
    let mut out = Vec::new();
    for (i, f) in schema.fields().iter().enumerate() {
        let typed = ours.contains(&i).then_some(&mut out);
        walk(
            f.data_type(),
            v5,
            (&mut nodes, &mut bufs),
            &mut variadic,
            typed,
        )?;
    }
    Ok(out)
}

/// Checks a record batch's field nodes and buffers against its body of `body_len` bytes, so
/// that decoding it cannot index past the body, and the offsets (and other typed) buffers of
/// our columns (`ours`, of `schema`, at any depth: a `messages` struct's strings too) hold
/// whole values. With `aligned` (the body starts 8-aligned in
/// memory), every buffer must be 8-aligned too, as the format asks.
fn check_body(
    rb: &arrow_ipc::RecordBatch<'_>,
    body_len: usize,
    aligned: bool,
    (schema, ours, version): (&Schema, &[usize], MetadataVersion),
) -> Result<()> {
    if rb.compression().is_some() {
        return bad("the record batches are compressed (LZ4 or ZSTD); write the file uncompressed");
    }
    if !(0..=MAX_LENGTH).contains(&rb.length()) {
        return bad(format!("a record batch of {} rows", rb.length()));
    }
    for n in rb.nodes().into_iter().flatten() {
        if !(0..=MAX_LENGTH).contains(&n.length()) || !(0..=n.length()).contains(&n.null_count()) {
            return bad(format!(
                "a field node of {} values with {} nulls",
                n.length(),
                n.null_count()
            ));
        }
    }
    for (i, b) in rb.buffers().into_iter().flatten().enumerate() {
        let (off, len) = (b.offset(), b.length());
        let fits = off >= 0
            && len >= 0
            && off
                .checked_add(len)
                .is_some_and(|end| end as u64 <= body_len as u64);
        if !fits {
            return bad(format!(
                "buffer {i} at {off}+{len} is past the end of its {body_len}-byte body (truncated?)"
            ));
        }
        if aligned && len > 0 && off % 8 != 0 {
            return bad(format!("buffer {i} at {off} is not 8-byte aligned"));
        }
    }
    let bufs = rb.buffers();
    for t in our_typed_buffers(schema, ours, rb, version >= MetadataVersion::V5)? {
        let (i, width, what) = (t.buffer, t.width, t.what);
        let len = bufs.and_then(|b| b.iter().nth(i)).map_or(0, |b| b.length());
        if len % width as i64 != 0 {
            return bad(format!(
                "buffer {i} holds {len} bytes, not a whole number of {width}-byte {what}"
            ));
        }
    }
    Ok(())
}

/// Checks a dictionary batch against its body of `body_len` bytes, as `check_body` checks a
/// record batch of its values. False when the dictionary is of none of our columns (`ours`, of
/// `schema`): it is skipped unread, as their columns are.
fn check_dictionary(
    db: &arrow_ipc::DictionaryBatch<'_>,
    body_len: usize,
    aligned: bool,
    (schema, ours, version): (&Schema, &[usize], MetadataVersion),
) -> Result<bool> {
    let ours = schema.project(ours)?;
    // arrow-ipc 60's own reader finds a dictionary's field by this id, the same way.
    #[expect(
        deprecated,
        reason = "arrow-ipc 60 still keys dictionaries by the schema's ids"
    )]
    let fields = ours.fields_with_dict_id(db.id());
    let Some(DataType::Dictionary(_, values)) = fields.first().map(|f| f.data_type()) else {
        return Ok(false);
    };
    let Some(data) = db.data() else {
        return bad(format!("dictionary {} has no data", db.id()));
    };
    let values = Schema::new(vec![Field::new("values", (**values).clone(), true)]);
    check_body(&data, body_len, aligned, (&values, &[0], version))?;
    Ok(true)
}

/// The footer of an Arrow IPC file: its schema and where its record batches are.
pub struct IpcFile {
    pub schema: SchemaRef,
    /// The footer's custom metadata.
    pub footer_meta: Vec<(String, String)>,
    version: MetadataVersion,
    blocks: Vec<Block>,
    dictionaries: Vec<Block>,
}

impl IpcFile {
    /// Reads the footer of `file` (the whole file's bytes); nothing else is read.
    pub fn open(file: &[u8]) -> Result<IpcFile> {
        let n = file.len();
        if n < 8 + 10 || &file[..6] != MAGIC {
            return bad("it does not start with the Arrow file magic ARROW1");
        }
        if &file[n - 6..] != MAGIC {
            return bad("it does not end with the Arrow file magic ARROW1 (truncated?)");
        }
        let flen = i32::from_le_bytes([file[n - 10], file[n - 9], file[n - 8], file[n - 7]]);
        let start = usize::try_from(flen)
            .ok()
            .and_then(|l| (n - 10).checked_sub(l))
            .filter(|&s| flen > 0 && s >= 8);
        let Some(start) = start else {
            return bad(format!("its footer length {flen} does not fit the file"));
        };
        let footer = arrow_ipc::root_as_footer(&file[start..n - 10])
            .map_err(|e| IpcError::Bad(format!("its footer is damaged: {e}")))?;
        let schema = check_schema_fb(
            footer
                .schema()
                .ok_or_else(|| IpcError::Bad("the footer has no schema".into()))?,
        )?;
        let footer_meta = footer
            .custom_metadata()
            .map(|kv| {
                kv.iter()
                    .filter_map(|e| Some((e.key()?.to_string(), e.value()?.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        Ok(IpcFile {
            schema: Arc::new(schema),
            footer_meta,
            version: footer.version(),
            blocks: footer
                .recordBatches()
                .map(|v| v.iter().copied().collect())
                .unwrap_or_default(),
            dictionaries: footer
                .dictionaries()
                .map(|v| v.iter().copied().collect())
                .unwrap_or_default(),
        })
    }

    /// Record batches in the file.
    pub fn batches(&self) -> usize {
        self.blocks.len()
    }

    /// Where record batch `k` ends in the file (for progress).
    pub fn batch_end(&self, k: usize) -> u64 {
        self.blocks.get(k).map_or(0, |b| {
            (b.offset() as u64)
                .saturating_add(b.metaDataLength() as u64)
                .saturating_add(b.bodyLength() as u64)
        })
    }

    /// A decoder of our columns, with the dictionaries of `file` (the buffer `open` read the
    /// footer of) that they use. With `require_alignment`, a buffer that is not 8-aligned is an
    /// error; without it arrow copies a buffer not aligned for its type to an aligned one.
    pub fn decoder(&self, file: &Buffer, require_alignment: bool) -> Result<Decoder> {
        let ours = projection(&self.schema)?;
        let mut d = FileDecoder::new(self.schema.clone(), self.version)
            .with_projection(ours.clone())
            .with_require_alignment(require_alignment);
        for (k, b) in self.dictionaries.iter().enumerate() {
            let m = self.message_at(file, b, require_alignment, "dictionary")?;
            let Some(db) = m.msg.header_as_dictionary_batch() else {
                return bad(format!("the block at {} is not a dictionary", b.offset()));
            };
            let checked = (&*self.schema, &ours[..], m.msg.version());
            if check_dictionary(&db, m.body_len, require_alignment, checked)
                .map_err(|e| IpcError::Bad(format!("dictionary {k}: {e}")))?
            {
                d.read_dictionary(b, &m.block)?;
            }
        }
        Ok(Decoder {
            d,
            aligned: require_alignment,
            ours,
        })
    }

    /// The message of block `b` of `file`, its bounds checked: `what` names the block's kind
    /// for errors.
    fn message_at<'f>(
        &self,
        file: &'f Buffer,
        b: &Block,
        aligned: bool,
        what: &str,
    ) -> Result<BlockMessage<'f>> {
        let (off, meta, body) = (b.offset(), i64::from(b.metaDataLength()), b.bodyLength());
        let end = off
            .checked_add(meta)
            .and_then(|m| m.checked_add(body))
            .filter(|&e| off >= 0 && meta >= 8 && body >= 0 && e as u64 <= file.len() as u64);
        let Some(end) = end else {
            return bad(format!(
                "a {what} at {off}+{} is past the end of the {}-byte file (truncated?)",
                meta.saturating_add(body),
                file.len()
            ));
        };
        let (off, meta, end) = (off as usize, meta as usize, end as usize);
        let m = &file.as_slice()[off..off + meta];
        // `0xFFFFFFFF len` then the FlatBuffer (or, before Arrow 0.15, just `len`).
        let fb = if m[..4] == CONTINUATION {
            &m[8..]
        } else {
            &m[4..]
        };
        let msg = arrow_ipc::root_as_message(fb)
            .map_err(|e| IpcError::Bad(format!("the {what} at {off}: damaged metadata: {e}")))?;
        if msg.bodyLength() != body {
            return bad(format!(
                "the block at {off} disagrees with its message on the body length"
            ));
        }
        if aligned && !(file.as_ptr() as usize + off + meta).is_multiple_of(8) {
            return bad(format!("the {what} at {off} is not 8-byte aligned"));
        }
        Ok(BlockMessage {
            msg,
            body_len: end - off - meta,
            block: file.slice_with_length(off, end - off),
        })
    }

    /// Record batch `k` of `file` (the buffer `open` read the footer of), its arrays slices of
    /// `file`: columns `input_ids` and, if the file has it, `loss_mask`.
    pub fn batch(&self, d: &Decoder, file: &Buffer, k: usize) -> Result<RecordBatch> {
        let Some(b) = self.blocks.get(k) else {
            return bad(format!("no record batch {k}"));
        };
        let m = self
            .message_at(file, b, d.aligned, "record batch")
            .map_err(|e| IpcError::Bad(format!("record batch {k}: {e}")))?;
        let off = b.offset();
        let Some(rb) = m.msg.header_as_record_batch() else {
            return bad(format!("the block at {off} is not a record batch"));
        };
        check_body(
            &rb,
            m.body_len,
            d.aligned,
            (&self.schema, &d.ours, m.msg.version()),
        )?;
        d.d.read_record_batch(b, &m.block)?
            .ok_or_else(|| IpcError::Bad(format!("the block at {off} is not a record batch")))
    }
}

/// A block of a file: its message (metadata), its body's length and the whole block.
struct BlockMessage<'f> {
    msg: arrow_ipc::Message<'f>,
    body_len: usize,
    block: Buffer,
}

/// Arrow's decoder of a file's record batches, and whether it requires aligned buffers.
pub struct Decoder {
    d: FileDecoder,
    aligned: bool,
    /// The projection: our columns' indices in the schema.
    ours: Vec<usize>,
}

/// Reads an Arrow IPC stream message by message, one record batch in memory at a time.
pub struct IpcStream<R> {
    r: R,
    meta: Vec<u8>,
    /// The full schema and the projection of our columns, once the schema message came.
    schema: Option<(SchemaRef, Vec<usize>)>,
    /// The dictionaries of our columns read so far, by id.
    dictionaries: HashMap<i64, ArrayRef>,
    /// Bytes consumed so far, for progress.
    pub read: u64,
}

impl<R: Read> IpcStream<R> {
    pub fn new(r: R) -> IpcStream<R> {
        IpcStream {
            r,
            meta: Vec::new(),
            schema: None,
            dictionaries: HashMap::new(),
            read: 0,
        }
    }

    /// Reads up to `n` bytes into `buf` (cleared first); fewer only at the end of the stream.
    /// The buffer grows as data arrives, so a garbage length cannot allocate gigabytes up
    /// front.
    fn fill(r: &mut R, read: &mut u64, n: u64, buf: &mut Vec<u8>) -> Result<u64> {
        buf.clear();
        let got = r.take(n).read_to_end(buf)? as u64;
        *read += got;
        Ok(got)
    }

    /// The next record batch (our columns only), or None at the end of the stream.
    pub fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        let truncated = |what: &str| bad(format!("the stream ends inside {what} (truncated?)"));
        loop {
            let got = Self::fill(&mut self.r, &mut self.read, 4, &mut self.meta)?;
            if got == 0 {
                return Ok(None);
            }
            if got < 4 {
                return truncated("a message header");
            }
            if self.meta[..4] == CONTINUATION
                && Self::fill(&mut self.r, &mut self.read, 4, &mut self.meta)? < 4
            {
                return truncated("a message header");
            }
            let len = i32::from_le_bytes([self.meta[0], self.meta[1], self.meta[2], self.meta[3]]);
            if len == 0 {
                return Ok(None);
            }
            if !(0..=1 << 30).contains(&len) {
                return bad(format!("a message with {len} bytes of metadata"));
            }
            if Self::fill(&mut self.r, &mut self.read, len as u64, &mut self.meta)? < len as u64 {
                return truncated("a message's metadata");
            }
            let msg = arrow_ipc::root_as_message(&self.meta)
                .map_err(|e| IpcError::Bad(format!("a damaged message: {e}")))?;
            let Ok(body_len) = u64::try_from(msg.bodyLength()) else {
                return bad(format!(
                    "a message with a body of {} bytes",
                    msg.bodyLength()
                ));
            };
            let mut body = Vec::new();
            if Self::fill(&mut self.r, &mut self.read, body_len, &mut body)? < body_len {
                return truncated("a record batch");
            }
            match msg.header_type() {
                MessageHeader::Schema => {
                    let s = msg.header_as_schema().ok_or_else(|| {
                        IpcError::Bad("a schema message without its schema".into())
                    })?;
                    let s = check_schema_fb(s)?;
                    let p = projection(&s)?;
                    self.schema = Some((Arc::new(s), p));
                }
                MessageHeader::DictionaryBatch => {
                    let Some((schema, p)) = &self.schema else {
                        return bad("a dictionary before the schema");
                    };
                    let db = msg.header_as_dictionary_batch().ok_or_else(|| {
                        IpcError::Bad("a dictionary message without its header".into())
                    })?;
                    if check_dictionary(&db, body.len(), false, (schema, p, msg.version()))? {
                        read_dictionary(
                            &Buffer::from_vec(body),
                            db,
                            schema,
                            &mut self.dictionaries,
                            &msg.version(),
                        )?;
                    }
                }
                MessageHeader::RecordBatch => {
                    let Some((schema, p)) = &self.schema else {
                        return bad("a record batch before the schema");
                    };
                    let rb = msg.header_as_record_batch().ok_or_else(|| {
                        IpcError::Bad("a record batch message without its header".into())
                    })?;
                    // Arrow copies a misaligned buffer of a stream (read into memory anyway).
                    check_body(&rb, body.len(), false, (schema, p, msg.version()))?;
                    let batch = read_record_batch(
                        &Buffer::from_vec(body),
                        rb,
                        schema.clone(),
                        &self.dictionaries,
                        Some(p),
                        &msg.version(),
                    )?;
                    return Ok(Some(batch));
                }
                h => {
                    return bad(format!(
                        "a message of type {h:?}, neither a schema nor a record batch"
                    ))
                }
            }
        }
    }
}
