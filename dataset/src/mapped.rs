//! A prepared dataset, mapped read-only: every process of a run maps the same file, and the
//! kernel keeps one copy of its pages for all of them.
//!
//! Opening reads the footer and each record batch's metadata and list offsets (4 bytes a
//! sample, checked once: monotone, inside the values, masks as long as their ids), never the
//! token ids themselves; a sample is then a slice of the map.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::ipc::{self, Layout, ListColumn, Schema, Type};
use crate::map::{map_read_only, unmap_resident};
use crate::DataError;

/// One record batch: byte ranges in the map.
#[derive(Clone, Debug)]
struct Batch {
    /// `rows + 1` little-endian `i32` offsets of `input_ids`.
    ids_offsets: Range<usize>,
    /// The `u32` token ids (4-aligned in the map).
    ids: Range<usize>,
    mask: Option<Mask>,
}

#[derive(Clone, Debug)]
struct Mask {
    /// Empty when no row's mask is null.
    validity: Range<usize>,
    offsets: Range<usize>,
    values: Range<usize>,
}

/// A sample borrowed from the map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample<'a> {
    pub input_ids: &'a [u32],
    /// None: learn from every token.
    pub loss_mask: Option<&'a [u8]>,
}

/// A prepared dataset file, mapped.
pub struct Mapped {
    map: Mmap,
    path: PathBuf,
    schema: Schema,
    batches: Vec<Batch>,
    /// First sample of each batch, and the total at the end.
    starts: Vec<u64>,
    tokens: u64,
}

fn i32_at(map: &[u8], at: usize) -> i32 {
    map.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, i32::from_le_bytes)
}

impl Mapped {
    /// Maps `path` and checks its structure (not its token ids).
    pub fn open(path: &Path) -> Result<Mapped, DataError> {
        let bad = |why: String| DataError::Prepared {
            path: path.to_path_buf(),
            why,
        };
        let file = File::open(path).map_err(|e| DataError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        let map = map_read_only(&file).map_err(|e| DataError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        let (schema, blocks) =
            ipc::parse_footer(&map).map_err(|e| bad(format!("not an Arrow IPC file: {e}")))?;
        let layout = Layout::new(&schema).map_err(|e| bad(e.to_string()))?;
        let want = |name: &str, bits: u8| -> Result<(), DataError> {
            let Some(f) = schema.fields.iter().find(|f| f.name == name) else {
                return Ok(());
            };
            let ok = f.ty == Type::List { large: false }
                && f.children[0].ty
                    == Type::Int {
                        bits,
                        signed: false,
                    };
            if ok {
                Ok(())
            } else {
                Err(bad(format!(
                    "column {name} is {}, not list<uint{bits}>: give this file to `launcher prepare` as input to convert it",
                    f.type_name()
                )))
            }
        };
        want("input_ids", 32)?;
        want("loss_mask", 8)?;
        let base = map.as_ptr() as usize;
        let range = |s: &[u8]| {
            let a = s.as_ptr() as usize - base;
            a..a + s.len()
        };
        let mut batches = Vec::with_capacity(blocks.len());
        let mut starts = vec![0u64];
        let mut tokens = 0u64;
        for (k, b) in blocks.iter().enumerate() {
            let (rb, body) =
                ipc::block_parts(&map, b).map_err(|e| bad(format!("record batch {k}: {e}")))?;
            let cols = layout
                .columns(rb, body)
                .map_err(|e| bad(format!("record batch {k}: {e}")))?;
            let first = *starts.last().unwrap_or(&0);
            let ids: &ListColumn<'_> = &cols.input_ids;
            if ids.null_count > 0 || ids.values_null_count > 0 {
                return Err(bad(format!("record batch {k}: input_ids has nulls")));
            }
            if !(ids.values.as_ptr() as usize).is_multiple_of(4) {
                return Err(bad(format!(
                    "record batch {k}: input_ids is not 4-byte aligned"
                )));
            }
            for row in 0..cols.rows {
                if ids.range(row).is_empty() {
                    return Err(bad(format!(
                        "sample {}: input_ids is empty",
                        first + row as u64
                    )));
                }
            }
            let mask = match &cols.loss_mask {
                None => None,
                Some(m) => {
                    if m.values_null_count > 0 {
                        return Err(bad(format!("record batch {k}: loss_mask has null entries")));
                    }
                    for row in 0..cols.rows {
                        if !m.is_null(row) && m.range(row).len() != ids.range(row).len() {
                            return Err(bad(format!(
                                "sample {}: loss_mask has {} entries, input_ids has {}",
                                first + row as u64,
                                m.range(row).len(),
                                ids.range(row).len()
                            )));
                        }
                    }
                    Some(Mask {
                        validity: if m.null_count > 0 {
                            range(m.validity)
                        } else {
                            0..0
                        },
                        offsets: range(&m.offsets[..4 * (cols.rows + 1)]),
                        values: range(&m.values[..m.values_len]),
                    })
                }
            };
            if cols.rows > 0 {
                tokens += (ids.range(cols.rows - 1).end - ids.range(0).start) as u64;
            }
            batches.push(Batch {
                ids_offsets: range(&ids.offsets[..4 * (cols.rows + 1)]),
                ids: range(&ids.values[..4 * ids.values_len]),
                mask,
            });
            starts.push(first + cols.rows as u64);
        }
        // Checked (the offsets were read in order, with the kernel's readahead); from here
        // samples are read scattered, a few KB here and there: no readahead around them. Only
        // a hint: ignored where unsupported.
        let _ = map.advise(memmap2::Advice::Random);
        Ok(Mapped {
            map,
            path: path.to_path_buf(),
            schema,
            batches,
            starts,
            tokens,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Samples in the file.
    pub fn len(&self) -> u64 {
        *self.starts.last().unwrap_or(&0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens in the file.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// A value of the schema's metadata (`hspipe.key`, `hspipe.source`, ...).
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.schema.meta(key)
    }

    /// Every sample's length, in order, from the offsets alone.
    pub fn lengths(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len() as usize);
        for (k, b) in self.batches.iter().enumerate() {
            let rows = (self.starts[k + 1] - self.starts[k]) as usize;
            let mut prev = i32_at(&self.map, b.ids_offsets.start);
            for r in 1..=rows {
                let o = i32_at(&self.map, b.ids_offsets.start + 4 * r);
                out.push((o - prev) as u32);
                prev = o;
            }
        }
        out
    }

    /// Lets go of the pages read so far: a page fault maps a whole large folio (megabytes on
    /// Linux 6.x) around the few KB of a sample, so a process that read many scattered samples
    /// shows most of the file as resident. The pages stay in the page cache, shared; calling
    /// this after copying out a batch keeps the process's resident size to that batch.
    pub fn unmap_resident(&self) {
        unmap_resident(&self.map);
    }

    /// Sample `i` (dataset order); None past the end.
    pub fn sample(&self, i: u64) -> Option<Sample<'_>> {
        if i >= self.len() {
            return None;
        }
        let k = self.starts.partition_point(|&s| s <= i) - 1;
        let b = &self.batches[k];
        let row = (i - self.starts[k]) as usize;
        let (a, e) = (
            i32_at(&self.map, b.ids_offsets.start + 4 * row) as usize,
            i32_at(&self.map, b.ids_offsets.start + 4 * row + 4) as usize,
        );
        // Aligned and in bounds: `open` checked both.
        let input_ids: &[u32] =
            bytemuck::cast_slice(&self.map[b.ids.start + 4 * a..b.ids.start + 4 * e]);
        let loss_mask = b.mask.as_ref().and_then(|m| {
            let valid = m.validity.is_empty()
                || self.map[m.validity.start + row / 8] & (1 << (row % 8)) != 0;
            valid.then(|| {
                let a = i32_at(&self.map, m.offsets.start + 4 * row) as usize;
                let e = i32_at(&self.map, m.offsets.start + 4 * row + 4) as usize;
                &self.map[m.values.start + a..m.values.start + e]
            })
        });
        Some(Sample {
            input_ids,
            loss_mask,
        })
    }
}
