//! The safetensors file format (as Hugging Face defines it), for checkpoints and model weights.
//!
//! A file is: a little-endian `u64` N, then N bytes of JSON mapping each tensor name to
//! `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data that follows the
//! header) plus an optional `"__metadata__"` map of strings, then the data, tensors back to back.
//! This module writes and reads that format and checks every offset against the buffer: a file
//! we write opens in other tools, and a truncated or foreign file is a typed error, never a panic.
//!
//! Why not the `safetensors` crate: it is not packaged where this project's crates come from
//! (Debian), and the format is small.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A header larger than this is refused before it is parsed.
pub const MAX_HEADER: u64 = 100 << 20;

/// Element types, spelled as in the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StDtype {
    BOOL,
    U8,
    I8,
    U16,
    I16,
    F16,
    BF16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
}

impl StDtype {
    pub fn size(self) -> usize {
        use StDtype::*;
        match self {
            BOOL | U8 | I8 => 1,
            U16 | I16 | F16 | BF16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SafetensorsError {
    #[error("not a safetensors file: {0}")]
    Format(String),
    #[error("tensor {name:?}: {why}")]
    Tensor { name: String, why: String },
    #[error("no tensor named {0:?}")]
    Missing(String),
}

/// One tensor to write: its bytes are little-endian elements in row-major order.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: StDtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// One tensor of a parsed file, borrowing its bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorView<'a> {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

#[derive(Serialize, Deserialize)]
struct Entry {
    dtype: StDtype,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

fn elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Serialises `tensors` (names must be unique) with `metadata` into one buffer.
pub fn serialize(
    tensors: &[TensorRef<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, SafetensorsError> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for t in tensors {
        let bad = |why: String| SafetensorsError::Tensor {
            name: t.name.to_string(),
            why,
        };
        let want = elements(t.shape)
            .and_then(|n| n.checked_mul(t.dtype.size()))
            .ok_or_else(|| bad("shape overflows".into()))?;
        if want != t.data.len() {
            return Err(bad(format!(
                "shape {:?} of {:?} needs {want} bytes, got {}",
                t.shape,
                t.dtype,
                t.data.len()
            )));
        }
        if t.name == "__metadata__" || header.contains_key(t.name) {
            return Err(bad("duplicate or reserved name".into()));
        }
        let e = Entry {
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            data_offsets: [offset, offset + want],
        };
        header.insert(
            t.name.to_string(),
            serde_json::to_value(e).expect("plain data"),
        );
        offset += want;
    }
    let mut json = serde_json::to_vec(&header).expect("plain data");
    // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for t in tensors {
        out.extend_from_slice(t.data);
    }
    Ok(out)
}

/// A parsed file: the tensors' places, checked, and the bytes they borrow.
#[derive(Debug)]
pub struct SafeTensors<'a> {
    entries: BTreeMap<String, (StDtype, Vec<usize>, [usize; 2])>,
    metadata: BTreeMap<String, String>,
    data: &'a [u8],
}

impl<'a> SafeTensors<'a> {
    /// Parses and checks a whole file held (or mapped) in `bytes`.
    pub fn parse(bytes: &'a [u8]) -> Result<SafeTensors<'a>, SafetensorsError> {
        let fmt = |why: String| SafetensorsError::Format(why);
        let n = bytes
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .ok_or_else(|| {
                fmt(format!(
                    "{} bytes, shorter than the header size",
                    bytes.len()
                ))
            })?;
        if n > MAX_HEADER || n > (bytes.len() - 8) as u64 {
            return Err(fmt(format!(
                "header of {n} bytes in a file of {}",
                bytes.len()
            )));
        }
        let (head, data) = bytes[8..].split_at(n as usize);
        let raw: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(head).map_err(|e| fmt(format!("header: {e}")))?;
        let mut entries = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, v) in raw {
            if name == "__metadata__" {
                metadata = serde_json::from_value(v).map_err(|e| fmt(format!("metadata: {e}")))?;
                continue;
            }
            let bad = |why: String| SafetensorsError::Tensor {
                name: name.clone(),
                why,
            };
            let e: Entry = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
            let [b, end] = e.data_offsets;
            let want = elements(&e.shape)
                .and_then(|n| n.checked_mul(e.dtype.size()))
                .ok_or_else(|| bad("shape overflows".into()))?;
            if b > end || end > data.len() || end - b != want {
                return Err(bad(format!(
                    "offsets {b}..{end} for {want} bytes of {:?} {:?}, in {} data bytes",
                    e.dtype,
                    e.shape,
                    data.len()
                )));
            }
            entries.insert(name, (e.dtype, e.shape, e.data_offsets));
        }
        // The tensors must tile the data exactly: no gap, no overlap, nothing after.
        let mut spans: Vec<[usize; 2]> = entries.values().map(|e| e.2).collect();
        spans.sort_unstable();
        let mut at = 0;
        for [b, end] in spans {
            if b != at {
                return Err(fmt(format!("tensor data overlap or gap at byte {at}")));
            }
            at = end;
        }
        if at != data.len() {
            return Err(fmt(format!(
                "{} data bytes after the last tensor",
                data.len() - at
            )));
        }
        Ok(SafeTensors {
            entries,
            metadata,
            data,
        })
    }

    /// The named tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'a>, SafetensorsError> {
        let (dtype, shape, [b, e]) = self
            .entries
            .get(name)
            .ok_or_else(|| SafetensorsError::Missing(name.to_string()))?;
        Ok(TensorView {
            dtype: *dtype,
            shape: shape.clone(),
            data: &self.data[*b..*e],
        })
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let w: Vec<u8> = [1.0f32, -2.5, 3.25]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let s = 7u64.to_le_bytes();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        serialize(
            &[
                TensorRef {
                    name: "w",
                    dtype: StDtype::F32,
                    shape: &[3],
                    data: &w,
                },
                TensorRef {
                    name: "step",
                    dtype: StDtype::U64,
                    shape: &[1],
                    data: &s,
                },
            ],
            &meta,
        )
        .unwrap()
    }

    #[test]
    fn round_trip_keeps_names_shapes_bytes_and_metadata() {
        let buf = sample();
        assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()) % 8, 0);
        let st = SafeTensors::parse(&buf).unwrap();
        assert_eq!(st.names().collect::<Vec<_>>(), ["step", "w"]);
        let w = st.tensor("w").unwrap();
        assert_eq!((w.dtype, w.shape.as_slice()), (StDtype::F32, &[3][..]));
        assert_eq!(&w.data[4..8], &(-2.5f32).to_le_bytes());
        assert_eq!(st.tensor("step").unwrap().data, 7u64.to_le_bytes());
        assert_eq!(st.metadata()["format"], "pt");
        assert_eq!(
            st.tensor("nope").unwrap_err(),
            SafetensorsError::Missing("nope".into())
        );
    }

    #[test]
    fn the_header_is_what_other_tools_read() {
        let buf = sample();
        let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
        let v: serde_json::Value = serde_json::from_slice(&buf[8..8 + n]).unwrap();
        assert_eq!(
            v["w"],
            serde_json::json!({"dtype": "F32", "shape": [3], "data_offsets": [0, 12]})
        );
        assert_eq!(v["step"]["data_offsets"], serde_json::json!([12, 20]));
    }

    #[test]
    fn truncated_foreign_and_lying_files_are_typed_errors() {
        let buf = sample();
        for cut in [0, 5, 8, 20, buf.len() - 1] {
            assert!(SafeTensors::parse(&buf[..cut]).is_err(), "cut at {cut}");
        }
        assert!(matches!(
            SafeTensors::parse(b"not a checkpoint at all"),
            Err(SafetensorsError::Format(_))
        ));
        let mut extra = buf.clone();
        extra.push(0);
        assert!(SafeTensors::parse(&extra).is_err(), "trailing bytes");
        let wrong = TensorRef {
            name: "x",
            dtype: StDtype::F32,
            shape: &[2],
            data: &[0; 4],
        };
        assert!(matches!(
            serialize(&[wrong], &BTreeMap::new()),
            Err(SafetensorsError::Tensor { .. })
        ));
    }
}
