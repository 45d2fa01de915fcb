//! Writes the prepared format: an Arrow IPC file of record batches, each holding up to
//! `BATCH_TOKENS` tokens, so a conversion holds one batch in memory whatever the input's size.

use std::io::Write;

use crate::ipc::{self, Block, BUFFER_ALIGN, CONTINUATION, MAGIC};

/// Tokens per record batch: 16 MiB of ids and 4 MiB of mask in memory while converting.
pub const BATCH_TOKENS: usize = 1 << 22;
/// Rows per record batch at most.
pub const BATCH_ROWS: usize = 1 << 16;

/// Streams samples into an Arrow IPC file.
pub struct Writer<W: Write> {
    w: W,
    pos: u64,
    meta: Vec<(String, String)>,
    blocks: Vec<Block>,
    ids: Vec<u32>,
    id_offsets: Vec<i32>,
    mask_valid: Vec<u8>,
    mask_nulls: u64,
    mask_offsets: Vec<i32>,
    mask: Vec<u8>,
    rows: usize,
    /// A batch is written once it holds this many tokens (or `BATCH_ROWS` rows).
    batch_tokens: usize,
    /// Samples and tokens written so far.
    pub samples: u64,
    pub tokens: u64,
}

fn le_bytes(v: &[i32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl<W: Write> Writer<W> {
    /// Starts a file whose schema carries `meta`.
    pub fn new(mut w: W, meta: Vec<(String, String)>) -> std::io::Result<Writer<W>> {
        let mut head = Vec::with_capacity(256);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&[0, 0]);
        head.extend_from_slice(&ipc::schema_message(&meta));
        w.write_all(&head)?;
        Ok(Writer {
            w,
            pos: head.len() as u64,
            meta,
            blocks: Vec::new(),
            ids: Vec::new(),
            id_offsets: Vec::new(),
            mask_valid: Vec::new(),
            mask_nulls: 0,
            mask_offsets: Vec::new(),
            mask: Vec::new(),
            rows: 0,
            batch_tokens: BATCH_TOKENS,
            samples: 0,
            tokens: 0,
        })
    }

    /// Smaller record batches, for tests of files with many.
    #[cfg(test)]
    pub(crate) fn batch_tokens(mut self, n: usize) -> Self {
        self.batch_tokens = n;
        self
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
        if self.rows == 0 {
            self.id_offsets.push(0);
            self.mask_offsets.push(0);
        }
        self.ids.extend_from_slice(ids);
        self.id_offsets.push(self.ids.len() as i32);
        if self.rows.is_multiple_of(8) {
            self.mask_valid.push(0);
        }
        match mask {
            Some(m) => {
                self.mask.extend_from_slice(m);
                if let Some(last) = self.mask_valid.last_mut() {
                    *last |= 1 << (self.rows % 8);
                }
            }
            None => self.mask_nulls += 1,
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
        let validity: &[u8] = if self.mask_nulls > 0 {
            &self.mask_valid
        } else {
            &[]
        };
        let buffers: [&[u8]; 8] = [
            &[],
            le_bytes(&self.id_offsets),
            &[],
            bytemuck::cast_slice(&self.ids),
            validity,
            le_bytes(&self.mask_offsets),
            &[],
            &self.mask,
        ];
        let mut layout = Vec::with_capacity(buffers.len());
        let mut body_len = 0u64;
        for b in buffers {
            layout.push((body_len, b.len() as u64));
            body_len += (b.len() as u64).next_multiple_of(BUFFER_ALIGN as u64);
        }
        let rows = self.rows as u64;
        let nodes = [
            (rows, 0),
            (self.ids.len() as u64, 0),
            (rows, self.mask_nulls),
            (self.mask.len() as u64, 0),
        ];
        let msg = ipc::batch_message(rows, &nodes, &layout, body_len);
        self.w.write_all(&msg)?;
        let pad = [0u8; BUFFER_ALIGN];
        for b in buffers {
            self.w.write_all(b)?;
            let rest = b.len().next_multiple_of(BUFFER_ALIGN) - b.len();
            self.w.write_all(&pad[..rest])?;
        }
        self.blocks.push(Block {
            offset: self.pos,
            meta_len: msg.len() as u32,
            body_len,
        });
        self.pos += msg.len() as u64 + body_len;
        self.ids.clear();
        self.id_offsets.clear();
        self.mask_valid.clear();
        self.mask_nulls = 0;
        self.mask_offsets.clear();
        self.mask.clear();
        self.rows = 0;
        Ok(())
    }

    /// Writes the last batch, the end-of-stream marker and the footer; returns the writer.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.flush()?;
        let footer = ipc::footer(&self.meta, &self.blocks);
        let mut tail = Vec::with_capacity(footer.len() + 20);
        tail.extend_from_slice(&CONTINUATION.to_le_bytes());
        tail.extend_from_slice(&0u32.to_le_bytes());
        tail.extend_from_slice(&footer);
        tail.extend_from_slice(&(footer.len() as i32).to_le_bytes());
        tail.extend_from_slice(MAGIC);
        self.w.write_all(&tail)?;
        self.w.flush()?;
        Ok(self.w)
    }
}
