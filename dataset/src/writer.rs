//! Writes the prepared format with arrow-ipc's `FileWriter`: an Arrow IPC file of record
//! batches, each holding up to `BATCH_TOKENS` tokens, so a conversion holds one batch in memory
//! whatever the input's size (arrow writes a batch's buffers as they are, without copying them
//! into one body first).

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;

use arrow_array::{ArrayRef, ListArray, RecordBatch, UInt32Array, UInt8Array};
use arrow_buffer::{NullBufferBuilder, OffsetBuffer, ScalarBuffer};
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
    /// Samples and tokens written so far.
    pub samples: u64,
    pub tokens: u64,
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
            samples: 0,
            tokens: 0,
        };
        me.start_batch();
        Ok(me)
    }

    /// Smaller record batches, for tests of files with many.
    #[cfg(test)]
    pub(crate) fn batch_tokens(mut self, n: usize) -> Self {
        self.batch_tokens = n;
        self.start_batch();
        self
    }

    /// Empty buffers for the next batch, sized for a full one: the arrays of the last batch
    /// were handed to arrow and freed once written.
    fn start_batch(&mut self) {
        let (tokens, rows) = (self.batch_tokens.min(BATCH_TOKENS), BATCH_ROWS);
        self.ids = Vec::with_capacity(tokens);
        self.mask = Vec::with_capacity(tokens);
        self.id_offsets = Vec::with_capacity(rows + 1);
        self.mask_offsets = Vec::with_capacity(rows + 1);
        self.id_offsets.push(0);
        self.mask_offsets.push(0);
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
        // The offsets are monotone by construction (each is the previous plus a length).
        let ids = ListArray::try_new(
            self.ids_item.clone(),
            OffsetBuffer::new(ScalarBuffer::from(std::mem::take(&mut self.id_offsets))),
            Arc::new(UInt32Array::from(std::mem::take(&mut self.ids))),
            None,
        )
        .map_err(io_err)?;
        let mask = ListArray::try_new(
            self.mask_item.clone(),
            OffsetBuffer::new(ScalarBuffer::from(std::mem::take(&mut self.mask_offsets))),
            Arc::new(UInt8Array::from(std::mem::take(&mut self.mask))),
            self.mask_valid.finish(),
        )
        .map_err(io_err)?;
        let batch = RecordBatch::try_new(
            self.schema.clone(),
            vec![Arc::new(ids) as ArrayRef, Arc::new(mask)],
        )
        .map_err(io_err)?;
        self.w.write(&batch).map_err(io_err)?;
        drop(batch);
        self.start_batch();
        Ok(())
    }

    /// Writes the last batch, the end-of-stream marker and the footer; returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.flush()?;
        self.w.finish().map_err(io_err)?;
        self.w.into_inner().map_err(io_err)
    }
}
