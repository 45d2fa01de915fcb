//! Writes the prepared format with arrow-ipc's `FileWriter`: an Arrow IPC file of record
//! batches, each holding up to `BATCH_TOKENS` tokens, so a conversion holds one batch in memory
//! whatever the input's size (arrow writes a batch's buffers as they are, without copying them
//! into one body first, and hands them back for the next batch).

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;

use arrow_array::{ArrayRef, ListArray, RecordBatch, UInt32Array, UInt8Array};
use arrow_buffer::{ArrowNativeType, Buffer, NullBufferBuilder, OffsetBuffer, ScalarBuffer};
use arrow_ipc::writer::FileWriter;
use arrow_schema::{ArrowError, DataType, Field, FieldRef, Schema};

/// Tokens per record batch: 16 MiB of ids and 4 MiB of mask in memory while converting.
pub const BATCH_TOKENS: usize = 1 << 22;
/// Rows per record batch at most.
pub const BATCH_ROWS: usize = 1 << 16;

/// Streams samples into an Arrow IPC file.
pub struct Writer<W: Write> {
    w: FileWriter<W>,
    schema: Arc<Schema>,
    ids_item: FieldRef,
    mask_item: FieldRef,
    ids: Vec<u32>,
    id_offsets: Vec<i32>,
    mask_valid: NullBufferBuilder,
    mask_offsets: Vec<i32>,
    mask: Vec<u8>,
    rows: usize,
    /// A batch holds at most this many tokens (or `BATCH_ROWS` rows), but for a single sample
    /// longer than that.
    batch_tokens: usize,
    /// Buffers that arrow did not hand back after a batch, so were allocated again (none, as
    /// long as `flush`'s reuse works; tested).
    fresh: u64,
    /// Samples and tokens written so far.
    pub samples: u64,
    pub tokens: u64,
}

/// The vector a buffer was made from, emptied, if nothing else holds the buffer (else a new
/// one, counted in `fresh`: the next batch then allocates its own).
fn reuse<T: ArrowNativeType>(b: Buffer, fresh: &mut u64) -> Vec<T> {
    let mut v = b.into_vec().unwrap_or_else(|_| {
        *fresh += 1;
        Vec::new()
    });
    v.clear();
    v
}

fn io_err(e: ArrowError) -> std::io::Error {
    match e {
        ArrowError::IoError(_, e) => e,
        e => std::io::Error::other(e.to_string()),
    }
}

impl<W: Write> Writer<W> {
    /// Starts a file whose schema carries `meta`: `input_ids: list<uint32>` (not null) and
    /// `loss_mask: list<uint8>` (a null mask means all ones).
    pub fn new(w: W, meta: Vec<(String, String)>) -> std::io::Result<Writer<W>> {
        let ids_item = Arc::new(Field::new("item", DataType::UInt32, false));
        let mask_item = Arc::new(Field::new("item", DataType::UInt8, false));
        let schema = Arc::new(
            Schema::new(vec![
                Field::new("input_ids", DataType::List(ids_item.clone()), false),
                Field::new("loss_mask", DataType::List(mask_item.clone()), true),
            ])
            .with_metadata(meta.into_iter().collect::<HashMap<_, _>>()),
        );
        let w = FileWriter::try_new(w, &schema).map_err(io_err)?;
        let mut me = Writer {
            w,
            schema,
            ids_item,
            mask_item,
            ids: Vec::new(),
            id_offsets: Vec::new(),
            mask_valid: NullBufferBuilder::new(0),
            mask_offsets: Vec::new(),
            mask: Vec::new(),
            rows: 0,
            batch_tokens: BATCH_TOKENS,
            fresh: 0,
            samples: 0,
            tokens: 0,
        };
        me.start_batch();
        Ok(me)
    }

    /// Buffers allocated again after a batch (see `fresh`).
    #[cfg(test)]
    pub(crate) fn fresh_buffers(&self) -> u64 {
        self.fresh
    }

    /// Smaller record batches, for tests of files with many.
    #[cfg(test)]
    pub(crate) fn batch_tokens(mut self, n: usize) -> Self {
        self.batch_tokens = n;
        self.start_batch();
        self
    }

    /// Buffers for the next batch: the last batch's, handed back by arrow once written (see
    /// `flush`), else new ones sized for a full batch.
    fn start_batch(&mut self) {
        let (tokens, rows) = (self.batch_tokens.min(BATCH_TOKENS), BATCH_ROWS);
        self.ids.clear();
        self.ids.reserve(tokens);
        self.mask.clear();
        self.mask.reserve(tokens);
        for v in [&mut self.id_offsets, &mut self.mask_offsets] {
            v.clear();
            v.reserve(rows + 1);
            v.push(0);
        }
        self.mask_valid = NullBufferBuilder::new(rows);
        self.rows = 0;
    }

    /// Appends one sample; `mask` None means every token is learned from.
    pub fn push(&mut self, ids: &[u32], mask: Option<&[u8]>) -> std::io::Result<()> {
        // Offsets are 32-bit (`list`, not `large_list`); a batch is flushed long before.
        if ids.len() > (i32::MAX as usize) - self.batch_tokens {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a sample of {} tokens is too long for one record batch",
                    ids.len()
                ),
            ));
        }
        // The batch is written before it would pass its size, so its buffers never grow.
        if self.rows > 0 && self.ids.len() + ids.len() > self.batch_tokens {
            self.flush()?;
        }
        self.ids.extend_from_slice(ids);
        self.id_offsets.push(self.ids.len() as i32);
        match mask {
            Some(m) => {
                self.mask.extend_from_slice(m);
                self.mask_valid.append_non_null();
            }
            None => self.mask_valid.append_null(),
        }
        self.mask_offsets.push(self.mask.len() as i32);
        self.rows += 1;
        self.samples += 1;
        self.tokens += ids.len() as u64;
        if self.ids.len() >= self.batch_tokens || self.rows >= BATCH_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        // Arrow takes the vectors as they are (no copy); once the batch is written and dropped
        // these handles are the last, and give the vectors back with their capacity. A new
        // 16 MiB vector per batch would cost more than the page faults: glibc raises its mmap
        // threshold after the first is freed, serves the next ones from the heap, and the
        // process's peak grew by 4 MiB at 600 MB of input.
        let ids = Buffer::from_vec(std::mem::take(&mut self.ids));
        let id_offsets = Buffer::from_vec(std::mem::take(&mut self.id_offsets));
        let mask = Buffer::from_vec(std::mem::take(&mut self.mask));
        let mask_offsets = Buffer::from_vec(std::mem::take(&mut self.mask_offsets));
        let written = self.write_batch(&ids, &id_offsets, &mask, &mask_offsets);
        self.ids = reuse(ids, &mut self.fresh);
        self.id_offsets = reuse(id_offsets, &mut self.fresh);
        self.mask = reuse(mask, &mut self.fresh);
        self.mask_offsets = reuse(mask_offsets, &mut self.fresh);
        written?;
        self.start_batch();
        Ok(())
    }

    /// Writes one record batch of these buffers (`rows` rows).
    fn write_batch(
        &mut self,
        ids: &Buffer,
        id_offsets: &Buffer,
        mask: &Buffer,
        mask_offsets: &Buffer,
    ) -> std::io::Result<()> {
        let list = |item: &FieldRef, offsets: &Buffer, values: ArrayRef, nulls| {
            let offsets = ScalarBuffer::<i32>::new(offsets.clone(), 0, self.rows + 1);
            // The offsets are monotone by construction (each is the previous plus a length).
            ListArray::try_new(item.clone(), OffsetBuffer::new(offsets), values, nulls)
                .map_err(io_err)
        };
        let ids = list(
            &self.ids_item,
            id_offsets,
            Arc::new(UInt32Array::new(
                ScalarBuffer::new(ids.clone(), 0, ids.len() / 4),
                None,
            )),
            None,
        )?;
        let mask = list(
            &self.mask_item,
            mask_offsets,
            Arc::new(UInt8Array::new(
                ScalarBuffer::new(mask.clone(), 0, mask.len()),
                None,
            )),
            self.mask_valid.finish(),
        )?;
        let batch = RecordBatch::try_new(
            self.schema.clone(),
            vec![Arc::new(ids) as ArrayRef, Arc::new(mask)],
        )
        .map_err(io_err)?;
        self.w.write(&batch).map_err(io_err)
    }

    /// Writes the last batch, the end-of-stream marker and the footer (with `footer_meta` as
    /// its custom metadata: what is only known at the end); returns the writer.
    pub fn finish(mut self, footer_meta: Vec<(String, String)>) -> std::io::Result<W> {
        self.flush()?;
        for (k, v) in footer_meta {
            self.w.write_metadata(k, v);
        }
        self.w.finish().map_err(io_err)?;
        self.w.into_inner().map_err(io_err)
    }
}
