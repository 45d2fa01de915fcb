//! A drafter's state in the two forms the group moves it in, shared by the backends' drafters:
//! a checkpoint (safetensors: f32 tables and a `step` tensor of u64 counters) and the words a
//! joining rank receives (the tables' bits, then each counter as two words).
//!
//! A checkpoint carries the CRC-32C of its tensors' bytes in its metadata ([`CRC_KEY`]), checked
//! when it is read back: a byte flipped on disk inside the weights or the optimizer's moments
//! leaves a file that still parses, and a resume would go on from weights no step made. A
//! checkpoint written before the key existed has none and loads unchecked.

use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use crate::GpuError;

/// What a drafter's state is made of: named f32 tables and u64 counters (steps), and words
/// about it in the file's metadata (what shape the tables are of, where their total size
/// alone does not say).
pub struct State<'a> {
    pub tables: Vec<(&'a str, Vec<usize>, &'a [f32])>,
    pub counters: Vec<u64>,
    pub metadata: Vec<(&'a str, String)>,
}

fn err(path: &Path, why: String) -> GpuError {
    GpuError::Checkpoint {
        path: path.display().to_string(),
        why,
    }
}

/// The metadata key of the CRC-32C of a checkpoint's tensors: each table's bytes in the
/// order the drafter names them, then the `step` tensor's (hex, 8 digits).
pub const CRC_KEY: &str = "hspipe.crc32c";

/// The CRC-32C of `parts`, one after another, as [`CRC_KEY`] records it.
fn crc_of<'b>(parts: impl IntoIterator<Item = &'b [u8]>) -> String {
    let crc = parts.into_iter().fold(0, crc32c::crc32c_append);
    format!("{crc:08x}")
}

/// Writes `s` to `path` (the caller makes it atomic).
pub fn save(path: &Path, s: &State<'_>) -> Result<(), GpuError> {
    let bytes = |xs: &[f32]| -> Vec<u8> { xs.iter().flat_map(|f| f.to_le_bytes()).collect() };
    let data: Vec<Vec<u8>> = s.tables.iter().map(|(_, _, xs)| bytes(xs)).collect();
    let counters: Vec<u8> = s.counters.iter().flat_map(|c| c.to_le_bytes()).collect();
    let crc = crc_of(data.iter().map(Vec::as_slice).chain([counters.as_slice()]));
    let mut tensors = Vec::new();
    for ((name, shape, _), d) in s.tables.iter().zip(&data) {
        let v = TensorView::new(StDtype::F32, shape.clone(), d)
            .map_err(|e| err(path, e.to_string()))?;
        tensors.push((*name, v));
    }
    let v = TensorView::new(StDtype::U64, vec![s.counters.len()], &counters)
        .map_err(|e| err(path, e.to_string()))?;
    tensors.push(("step", v));
    let meta = (s.metadata.iter())
        .map(|(k, v)| (k.to_string(), v.clone()))
        .chain([(CRC_KEY.to_string(), crc)])
        .collect();
    let meta = Some(meta);
    let out = safetensors::serialize(tensors, meta).map_err(|e| err(path, e.to_string()))?;
    std::fs::write(path, out).map_err(|e| err(path, e.to_string()))
}

/// Reads the tables `names` (each of `shape`) and `counters` counters from the checkpoint at
/// `path`; `hint` says what a shape mismatch may mean.
pub fn load(
    path: &Path,
    names: &[&str],
    shape: &[usize],
    counters: usize,
    hint: &str,
) -> Result<(Vec<Vec<f32>>, Vec<u64>), GpuError> {
    let (t, c, _) = load_with_metadata(path, names, shape, counters, hint)?;
    Ok((t, c))
}

/// A checkpoint read back: its tables, its counters, and its metadata (empty when it has
/// none).
pub type Loaded = (
    Vec<Vec<f32>>,
    Vec<u64>,
    std::collections::HashMap<String, String>,
);

/// [`load`], with the file's metadata.
pub fn load_with_metadata(
    path: &Path,
    names: &[&str],
    shape: &[usize],
    counters: usize,
    hint: &str,
) -> Result<Loaded, GpuError> {
    let bytes = std::fs::read(path).map_err(|e| err(path, e.to_string()))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| err(path, format!("not a safetensors file: {e}")))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(path, format!("not a safetensors file: {e}")))?;
    let tensor = |name: &str| {
        st.tensor(name)
            .map_err(|e| err(path, format!("{name}: {e}")))
    };
    let mut tables = Vec::new();
    let mut parts = Vec::new();
    for name in names {
        let t = tensor(name)?;
        if t.dtype() != StDtype::F32 || t.shape() != shape {
            return Err(err(
                path,
                format!(
                    "{name} is {:?} {:?}, this drafter needs F32 {shape:?} ({hint})",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        parts.push(t.data());
        tables.push(
            t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
    }
    let s = tensor("step")?;
    if s.dtype() != StDtype::U64 || s.shape() != [counters] {
        return Err(err(path, format!("step must be U64[{counters}]")));
    }
    if let Some(want) = metadata.get(CRC_KEY) {
        let got = crc_of(parts.into_iter().chain([s.data()]));
        if &got != want {
            return Err(err(
                path,
                format!(
                    "damaged: its tensors' CRC-32C is {got}, and it was written with {want} (a byte changed on disk since it was written); the run cannot go on from it"
                ),
            ));
        }
    }
    let counters = s
        .data()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    Ok((tables, counters, metadata))
}

/// Words of `tables` (each `n` f32s) and `counters`, for a joining rank.
pub fn words(tables: &[&[f32]], counters: &[u64]) -> Vec<u32> {
    let mut out: Vec<u32> = tables
        .iter()
        .flat_map(|t| t.iter().map(|x| x.to_bits()))
        .collect();
    out.extend(counters.iter().flat_map(|&c| [c as u32, (c >> 32) as u32]));
    out
}

/// Words made by [`words`] for `tables` tables of `n` f32s and `counters` counters, read back.
pub fn from_words(
    w: &[u32],
    n: usize,
    tables: usize,
    counters: usize,
) -> Result<(Vec<Vec<f32>>, Vec<u64>), GpuError> {
    let want = tables * n + 2 * counters;
    if w.len() != want {
        return Err(GpuError::BufferSize {
            got: w.len() * 4,
            want: want * 4,
        });
    }
    let t = (0..tables)
        .map(|k| {
            w[k * n..(k + 1) * n]
                .iter()
                .map(|&b| f32::from_bits(b))
                .collect()
        })
        .collect();
    let c = (0..counters)
        .map(|i| u64::from(w[tables * n + 2 * i]) | (u64::from(w[tables * n + 2 * i + 1]) << 32))
        .collect();
    Ok((t, c))
}
