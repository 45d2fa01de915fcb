//! A prepared dataset, mapped read-only: every process of a run maps the same file, and the
//! kernel keeps one copy of its pages for all of them.
//!
//! Opening reads the footer and each record batch's metadata and list offsets (4 bytes a
//! sample, checked once by arrow and by us: monotone, inside the values, masks as long as their
//! ids), never the token ids themselves: arrow's `FileDecoder` decodes over a buffer that owns
//! the map, so the arrays are slices of it (alignment required, so nothing is copied); a
//! sample is then a slice of the map.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt8Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field};
use memmap2::Mmap;

use crate::arrow_io::{type_name, IpcFile};
use crate::map::{buffer_of, map_read_only, unmap_resident};
use crate::{DataError, FORMAT_VERSION};

/// A `list<uint*>` column of one record batch: slices of the map.
#[derive(Clone, Debug)]
struct List<T: arrow_buffer::ArrowNativeType> {
    /// Present only when some row is null.
    nulls: Option<NullBuffer>,
    offsets: OffsetBuffer<i32>,
    values: ScalarBuffer<T>,
}

impl<T: arrow_buffer::ArrowNativeType> List<T> {
    fn range(&self, row: usize) -> std::ops::Range<usize> {
        self.offsets[row] as usize..self.offsets[row + 1] as usize
    }

    fn len_of(&self, row: usize) -> usize {
        (self.offsets[row + 1] - self.offsets[row]) as usize
    }

    fn is_null(&self, row: usize) -> bool {
        self.nulls.as_ref().is_some_and(|n| n.is_null(row))
    }
}

/// One record batch.
#[derive(Clone, Debug)]
struct Batch {
    ids: List<u32>,
    mask: Option<List<u8>>,
}

/// A sample: borrowed from the map, or made on request (the synthetic dataset's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample<'a> {
    pub input_ids: Cow<'a, [u32]>,
    /// None: learn from every token.
    pub loss_mask: Option<Cow<'a, [u8]>>,
}

/// A prepared dataset file, mapped.
pub struct Mapped {
    map: Arc<Mmap>,
    path: PathBuf,
    meta: HashMap<String, String>,
    batches: Vec<Batch>,
    /// First sample of each batch, and the total at the end.
    starts: Vec<u64>,
    tokens: u64,
}

/// True when `f` is `list<uint{bits}>` (32-bit offsets, the values not dictionary-encoded).
fn is_list_of(f: &Field, item: &DataType) -> bool {
    matches!(f.data_type(), DataType::List(c) if c.data_type() == item)
}

/// The list column `col` of a batch, as `list<T>`; `open` checked the schema's types.
fn list<T: arrow_array::ArrowPrimitiveType>(
    col: &ArrayRef,
    name: &str,
) -> Result<List<T::Native>, String> {
    let l = col
        .as_list_opt::<i32>()
        .ok_or_else(|| format!("column {name} is not a list"))?;
    let values = l
        .values()
        .as_primitive_opt::<T>()
        .ok_or_else(|| format!("column {name} holds other values than its schema says"))?;
    if values.null_count() > 0 {
        return Err(format!("{name} has null entries"));
    }
    Ok(List {
        nulls: l.nulls().filter(|n| n.null_count() > 0).cloned(),
        offsets: l.offsets().clone(),
        values: values.values().clone(),
    })
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
            cause: e,
        })?;
        let map = Arc::new(map_read_only(&file).map_err(|e| DataError::Read {
            path: path.to_path_buf(),
            cause: e,
        })?);
        let ipc = IpcFile::open(&map).map_err(|e| bad(format!("not an Arrow IPC file: {e}")))?;
        let schema = ipc.schema.clone();
        let footer_meta = ipc.footer_meta.clone();
        let want = |name: &str, item: DataType| -> Result<(), DataError> {
            let Ok(f) = schema.field_with_name(name) else {
                return Ok(());
            };
            if is_list_of(f, &item) {
                Ok(())
            } else {
                Err(bad(format!(
                    "column {name} is {}, not list<{}>: give this file to `launcher prepare` as input to convert it",
                    type_name(f.data_type()),
                    type_name(&item)
                )))
            }
        };
        // A format this build does not know was mapped as if it were its own.
        if let Some(v) = (schema.metadata().get("hspipe.dataset")).filter(|v| *v != FORMAT_VERSION)
        {
            return Err(bad(format!(
                "it is hspipe's prepared data of format version {v:?}, and this build reads version {FORMAT_VERSION:?}: prepare the data again with this build (a file in the data cache: delete it and the data is prepared again)"
            )));
        }
        want("input_ids", DataType::UInt32)?;
        want("loss_mask", DataType::UInt8)?;
        // Aligned buffers are required: a misaligned one would be copied, and the point of the
        // map is that nothing is.
        let buffer = buffer_of(&map);
        let decoder = ipc.decoder(&buffer, true).map_err(|e| bad(e.to_string()))?;
        let mut batches = Vec::with_capacity(ipc.batches());
        let mut starts = vec![0u64];
        let mut tokens = 0u64;
        for k in 0..ipc.batches() {
            let in_batch = |e: String| bad(format!("record batch {k}: {e}"));
            let rb: RecordBatch = ipc
                .batch(&decoder, &buffer, k)
                .map_err(|e| in_batch(e.to_string()))?;
            let first = *starts.last().unwrap_or(&0);
            let rows = rb.num_rows();
            let cols = rb.columns();
            if cols[0].null_count() > 0 {
                return Err(in_batch("input_ids has nulls".into()));
            }
            let ids = list::<UInt32Type>(&cols[0], "input_ids").map_err(in_batch)?;
            for row in 0..rows {
                if ids.len_of(row) == 0 {
                    return Err(bad(format!(
                        "sample {}: input_ids is empty",
                        first + row as u64
                    )));
                }
            }
            let mask = match cols.get(1) {
                None => None,
                Some(c) => {
                    let m = list::<UInt8Type>(c, "loss_mask").map_err(in_batch)?;
                    for row in 0..rows {
                        if !m.is_null(row) && m.len_of(row) != ids.len_of(row) {
                            return Err(bad(format!(
                                "sample {}: loss_mask has {} entries, input_ids has {}",
                                first + row as u64,
                                m.len_of(row),
                                ids.len_of(row)
                            )));
                        }
                    }
                    Some(m)
                }
            };
            if rows > 0 {
                tokens += (ids.offsets[rows] - ids.offsets[0]) as u64;
            }
            batches.push(Batch { ids, mask });
            starts.push(first + rows as u64);
        }
        // Checked (the offsets were read in order, with the kernel's readahead); from here
        // samples are read scattered, a few KB here and there: no readahead around them. Only
        // a hint: ignored where unsupported.
        let _ = map.advise(memmap2::Advice::Random);
        Ok(Mapped {
            map,
            path: path.to_path_buf(),
            // The schema's metadata, then the footer's (what is known only at the end).
            meta: schema
                .metadata()
                .clone()
                .into_iter()
                .chain(footer_meta)
                .collect(),
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

    /// A value of the schema's or the footer's metadata (`hspipe.key`, `hspipe.source`,
    /// `hspipe.chat.*`).
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.meta.get(key).map(String::as_str)
    }

    /// Every sample's length, in order, from the offsets alone.
    pub fn lengths(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len() as usize);
        for b in &self.batches {
            out.extend(b.ids.offsets.windows(2).map(|w| (w[1] - w[0]) as u32));
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
        // In bounds: arrow checked every offset against the values when it decoded the batch.
        let input_ids = &b.ids.values[b.ids.range(row)];
        let loss_mask = b
            .mask
            .as_ref()
            .filter(|m| !m.is_null(row))
            .map(|m| &m.values[m.range(row)]);
        Some(Sample {
            input_ids: Cow::Borrowed(input_ids),
            loss_mask: loss_mask.map(Cow::Borrowed),
        })
    }
}

#[cfg(test)]
impl Mapped {
    /// The addresses of the map, for tests that samples are slices of it.
    pub(crate) fn map_range(&self) -> std::ops::Range<usize> {
        let r = self.map.as_ptr_range();
        r.start as usize..r.end as usize
    }

    /// Record batches in the file.
    pub(crate) fn record_batches(&self) -> usize {
        self.batches.len()
    }
}
