//! The little of FlatBuffers that Arrow's IPC metadata needs, written by hand (no flatbuffers
//! crate is packaged by Debian): a builder for a tree of tables, and a bounds-checked reader.
//!
//! Wire format, as the FlatBuffers spec defines it: a buffer starts with a `u32` offset to the
//! root table. A table starts with an `i32` *soffset*: its vtable is at `table - soffset`. A
//! vtable is `u16`s: its own size, the table's inline size, then one offset per field id from
//! the table's start (0: absent, the default applies). Offset fields (tables, strings,
//! vectors) hold a `u32` *uoffset* from the field's own position, always forward. A vector is a
//! `u32` count followed by its elements; a string is a vector of bytes plus a NUL.
//!
//! The builder writes front to back: a vtable, its table (fields sorted by size, each aligned
//! to its size, absolutely, which Arrow's C++ verifier checks), then the table's children,
//! patching each parent's uoffset once the child's position is known. So every uoffset points
//! forward, as the spec requires.
//!
//! The reader never panics: every position is checked against the buffer, and a malformed
//! buffer is an `FbError` naming what was out of bounds.

/// A malformed FlatBuffer: what the reader was looking for when it went wrong.
#[derive(Debug, thiserror::Error)]
#[error("malformed metadata: {0}")]
pub struct FbError(pub String);

type Result<T> = std::result::Result<T, FbError>;

/// A field value of a table under construction.
pub enum Val {
    U8(u8),
    Bool(bool),
    I16(i16),
    I32(i32),
    I64(i64),
    Table(Table),
    Str(String),
    Tables(Vec<Table>),
    /// A vector of structs: raw little-endian bytes, `count` elements, aligned to `align`.
    Structs {
        align: usize,
        count: usize,
        bytes: Vec<u8>,
    },
}

impl Val {
    /// Inline size of the field in its table (offset fields are 4 bytes).
    fn size(&self) -> usize {
        match self {
            Val::U8(_) | Val::Bool(_) => 1,
            Val::I16(_) => 2,
            Val::I64(_) => 8,
            _ => 4,
        }
    }
}

/// A table under construction: field id and value.
#[derive(Default)]
pub struct Table(Vec<(u16, Val)>);

impl Table {
    pub fn new() -> Table {
        Table(Vec::new())
    }
    pub fn with(mut self, id: u16, v: Val) -> Table {
        self.0.push((id, v));
        self
    }
}

fn pad_to(b: &mut Vec<u8>, align: usize) {
    while !b.len().is_multiple_of(align) {
        b.push(0);
    }
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Serialises `root` into a FlatBuffer whose length is a multiple of 8.
pub fn finish(root: &Table) -> Vec<u8> {
    let mut b = vec![0u8; 4];
    let t = write_table(&mut b, root);
    put_u32(&mut b, 0, t as u32);
    pad_to(&mut b, 8);
    b
}

fn write_table(b: &mut Vec<u8>, t: &Table) -> usize {
    let slots =
        t.0.iter()
            .map(|(id, _)| usize::from(*id) + 1)
            .max()
            .unwrap_or(0);
    pad_to(b, 2);
    let vt = b.len();
    b.resize(vt + 4 + 2 * slots, 0);
    // The table starts 8-aligned, so its fields align absolutely when aligned relatively.
    pad_to(b, 8);
    let tpos = b.len();
    b.extend_from_slice(&((tpos - vt) as i32).to_le_bytes());
    let mut order: Vec<&(u16, Val)> = t.0.iter().collect();
    order.sort_by_key(|(_, v)| std::cmp::Reverse(v.size()));
    let mut children = Vec::new();
    for (id, v) in order {
        pad_to(b, v.size());
        let pos = b.len();
        match v {
            Val::U8(x) => b.push(*x),
            Val::Bool(x) => b.push(u8::from(*x)),
            Val::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Val::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Val::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
            _ => {
                b.extend_from_slice(&[0; 4]);
                children.push((pos, v));
            }
        }
        put_u16(b, vt + 4 + 2 * usize::from(*id), (pos - tpos) as u16);
    }
    let size = b.len() - tpos;
    put_u16(b, vt, (4 + 2 * slots) as u16);
    put_u16(b, vt + 2, size as u16);
    for (field, v) in children {
        let child = write_child(b, v);
        put_u32(b, field, (child - field) as u32);
    }
    tpos
}

fn write_child(b: &mut Vec<u8>, v: &Val) -> usize {
    match v {
        Val::Table(t) => write_table(b, t),
        Val::Str(s) => {
            pad_to(b, 4);
            let pos = b.len();
            b.extend_from_slice(&(s.len() as u32).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
            b.push(0);
            pos
        }
        Val::Tables(ts) => {
            pad_to(b, 4);
            let pos = b.len();
            b.extend_from_slice(&(ts.len() as u32).to_le_bytes());
            b.resize(pos + 4 + 4 * ts.len(), 0);
            for (k, t) in ts.iter().enumerate() {
                let elem = pos + 4 + 4 * k;
                let child = write_table(b, t);
                put_u32(b, elem, (child - elem) as u32);
            }
            pos
        }
        Val::Structs {
            align,
            count,
            bytes,
        } => {
            // The elements (after the 4-byte count) must be aligned to `align`.
            while !(b.len() + 4).is_multiple_of((*align).max(4)) {
                b.push(0);
            }
            let pos = b.len();
            b.extend_from_slice(&(*count as u32).to_le_bytes());
            b.extend_from_slice(bytes);
            pos
        }
        Val::U8(_) | Val::Bool(_) | Val::I16(_) | Val::I32(_) | Val::I64(_) => {
            unreachable!("scalars are written inline")
        }
    }
}

fn bytes_at<'a>(buf: &'a [u8], pos: usize, n: usize, what: &str) -> Result<&'a [u8]> {
    pos.checked_add(n)
        .and_then(|end| buf.get(pos..end))
        .ok_or_else(|| {
            FbError(format!(
                "{what} at {pos}+{n} is past the end of the {}-byte buffer",
                buf.len()
            ))
        })
}

fn u16_at(buf: &[u8], pos: usize, what: &str) -> Result<u16> {
    let b = bytes_at(buf, pos, 2, what)?;
    Ok(u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(buf: &[u8], pos: usize, what: &str) -> Result<u32> {
    let b = bytes_at(buf, pos, 4, what)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A table in a FlatBuffer being read.
#[derive(Clone, Copy, Debug)]
pub struct Tab<'a> {
    buf: &'a [u8],
    pos: usize,
    vt: usize,
    vt_size: usize,
}

impl<'a> Tab<'a> {
    /// The root table of `buf`.
    pub fn root(buf: &'a [u8]) -> Result<Tab<'a>> {
        let off = u32_at(buf, 0, "root offset")? as usize;
        Tab::at(buf, off)
    }

    fn at(buf: &'a [u8], pos: usize) -> Result<Tab<'a>> {
        let so = u32_at(buf, pos, "table")? as i32;
        let vt = pos as i64 - i64::from(so);
        if vt < 0 {
            return Err(FbError(format!(
                "vtable of the table at {pos} is before the buffer"
            )));
        }
        let vt = vt as usize;
        let vt_size = usize::from(u16_at(buf, vt, "vtable")?);
        bytes_at(buf, vt, vt_size, "vtable")?;
        Ok(Tab {
            buf,
            pos,
            vt,
            vt_size,
        })
    }

    /// The position of field `id`, or None if it is absent.
    fn field(&self, id: u16) -> Result<Option<usize>> {
        let slot = 4 + 2 * usize::from(id);
        if slot + 2 > self.vt_size {
            return Ok(None);
        }
        let off = u16_at(self.buf, self.vt + slot, "vtable entry")?;
        Ok((off != 0).then_some(self.pos + usize::from(off)))
    }

    fn scalar<const N: usize>(&self, id: u16) -> Result<Option<[u8; N]>> {
        match self.field(id)? {
            None => Ok(None),
            Some(p) => {
                let b = bytes_at(self.buf, p, N, "field")?;
                let mut a = [0u8; N];
                a.copy_from_slice(b);
                Ok(Some(a))
            }
        }
    }

    pub fn u8(&self, id: u16, default: u8) -> Result<u8> {
        Ok(self.scalar::<1>(id)?.map_or(default, |a| a[0]))
    }
    pub fn bool(&self, id: u16) -> Result<bool> {
        Ok(self.u8(id, 0)? != 0)
    }
    pub fn i16(&self, id: u16, default: i16) -> Result<i16> {
        Ok(self.scalar::<2>(id)?.map_or(default, i16::from_le_bytes))
    }
    pub fn i32(&self, id: u16, default: i32) -> Result<i32> {
        Ok(self.scalar::<4>(id)?.map_or(default, i32::from_le_bytes))
    }
    pub fn i64(&self, id: u16, default: i64) -> Result<i64> {
        Ok(self.scalar::<8>(id)?.map_or(default, i64::from_le_bytes))
    }

    /// Follows the uoffset of field `id`.
    fn target(&self, id: u16) -> Result<Option<usize>> {
        match self.field(id)? {
            None => Ok(None),
            Some(p) => {
                let off = u32_at(self.buf, p, "offset field")? as usize;
                Ok(Some(p + off))
            }
        }
    }

    pub fn table(&self, id: u16) -> Result<Option<Tab<'a>>> {
        self.target(id)?.map(|p| Tab::at(self.buf, p)).transpose()
    }

    pub fn str(&self, id: u16) -> Result<Option<&'a str>> {
        let Some(p) = self.target(id)? else {
            return Ok(None);
        };
        let n = u32_at(self.buf, p, "string length")? as usize;
        let b = bytes_at(self.buf, p + 4, n, "string")?;
        std::str::from_utf8(b)
            .map(Some)
            .map_err(|_| FbError(format!("string at {p} is not UTF-8")))
    }

    /// A vector of tables (empty when absent).
    pub fn tables(&self, id: u16) -> Result<Vec<Tab<'a>>> {
        let Some(p) = self.target(id)? else {
            return Ok(Vec::new());
        };
        let n = u32_at(self.buf, p, "vector length")? as usize;
        bytes_at(self.buf, p + 4, n.saturating_mul(4), "vector")?;
        (0..n)
            .map(|k| {
                let elem = p + 4 + 4 * k;
                let off = u32_at(self.buf, elem, "vector element")? as usize;
                Tab::at(self.buf, elem + off)
            })
            .collect()
    }

    /// A vector of `size`-byte structs, as raw bytes (empty when absent).
    pub fn structs(&self, id: u16, size: usize) -> Result<&'a [u8]> {
        let Some(p) = self.target(id)? else {
            return Ok(&[]);
        };
        let n = u32_at(self.buf, p, "vector length")? as usize;
        bytes_at(self.buf, p + 4, n.saturating_mul(size), "struct vector")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_tree_reads_back_and_offsets_point_forward() {
        let t = Table::new()
            .with(0, Val::I16(4))
            .with(1, Val::U8(3))
            .with(
                2,
                Val::Table(Table::new().with(0, Val::I64(-7)).with(1, Val::Bool(true))),
            )
            .with(3, Val::I64(1 << 40))
            .with(
                5,
                Val::Tables(vec![
                    Table::new().with(0, Val::Str("input_ids".into())),
                    Table::new().with(0, Val::Str("loss_mask".into())),
                ]),
            )
            .with(
                6,
                Val::Structs {
                    align: 8,
                    count: 2,
                    bytes: (0..32u8).collect(),
                },
            );
        let b = finish(&t);
        assert_eq!(b.len() % 8, 0);
        let r = Tab::root(&b).unwrap();
        assert_eq!(r.i16(0, 0).unwrap(), 4);
        assert_eq!(r.u8(1, 0).unwrap(), 3);
        assert_eq!(r.i64(3, 0).unwrap(), 1 << 40);
        assert_eq!(r.i32(4, 9).unwrap(), 9, "absent: the default");
        let c = r.table(2).unwrap().unwrap();
        assert_eq!(c.i64(0, 0).unwrap(), -7);
        assert!(c.bool(1).unwrap());
        let names: Vec<_> = r
            .tables(5)
            .unwrap()
            .iter()
            .map(|t| t.str(0).unwrap().unwrap())
            .collect();
        assert_eq!(names, ["input_ids", "loss_mask"]);
        let s = r.structs(6, 16).unwrap();
        assert_eq!(s, (0..32u8).collect::<Vec<_>>().as_slice());
        assert_eq!((s.as_ptr() as usize - b.as_ptr() as usize) % 8, 0);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for b in [
            vec![],
            vec![0xff; 3],
            vec![0xff; 64],
            vec![8, 0, 0, 0, 0, 0, 0, 0],
            vec![4, 0, 0, 0, 0x10, 0, 0, 0, 4, 0],
        ] {
            if let Ok(t) = Tab::root(&b) {
                let _ = t.table(0);
                let _ = t.tables(1);
                let _ = t.str(2);
                let _ = t.structs(3, 16);
                let _ = t.i64(4, 0);
            }
        }
    }
}
