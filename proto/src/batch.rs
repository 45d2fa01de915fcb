//! The hidden-state batch as it lies in a ring slot, written in place by a target and read in
//! place by a drafter.
//!
//! ```text
//! 0      4        8            8+header_len   (each section 256-aligned)
//! | "HSB1" | hlen u32 | header (bincode) | pad | input_ids u32×T | loss_mask u8×T | target_tokens u32×T | hidden [T×L×H] dtype |
//! ```
//!
//! `target_tokens[t]` is the target's greedy next token after position `t` (the argmax of its
//! LM head), so a drafter can learn what the target would say. The header records every
//! section's offset and length and a CRC-32C over the four sections.
//! The header is written last, by [`BatchWriter::finish`], once the sections are filled, so a
//! target's backend writes hidden states straight into the slot: no intermediate copy.

use serde::{Deserialize, Serialize};

/// Layout version; a reader refuses any other. 2: the target's greedy tokens.
pub const BATCH_VERSION: u16 = 2;
/// Alignment of every section.
pub const ALIGN: usize = 256;
const MAGIC: [u8; 4] = *b"HSB1";
const PREFIX: usize = 8;

/// Element type of the hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    Bf16,
    F16,
    F32,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// A byte range inside the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Section {
    pub offset: u64,
    pub len: u64,
}

impl Section {
    fn range(&self) -> std::ops::Range<usize> {
        self.offset as usize..(self.offset + self.len) as usize
    }
}

/// What a target says about a batch before writing it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchSpec {
    pub batch_id: u64,
    pub producer: u32,
    pub sample_ids: Vec<u64>,
    /// Tokens of each sequence, in order; they are concatenated in the sections.
    pub seq_lens: Vec<u32>,
    pub dtype: Dtype,
    pub layers: u32,
    pub hidden: u32,
}

impl BatchSpec {
    pub fn tokens(&self) -> u64 {
        self.seq_lens.iter().map(|&l| u64::from(l)).sum()
    }
}

/// The header at the front of every batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchHeader {
    pub version: u16,
    pub spec: BatchSpec,
    pub input_ids: Section,
    pub loss_mask: Section,
    pub target_tokens: Section,
    pub hidden_states: Section,
    /// CRC-32C of input_ids, loss_mask, target_tokens and hidden_states, in that order.
    pub checksum: u32,
}

/// A batch's four sections, to fill in place (see [`BatchWriter::sections_mut`]).
pub struct SectionsMut<'a> {
    /// Little-endian u32 per token.
    pub input_ids: &'a mut [u8],
    /// One byte per token.
    pub loss_mask: &'a mut [u8],
    /// Little-endian u32 per token: the target's greedy next token.
    pub target_tokens: &'a mut [u8],
    /// `tokens × layers × hidden` elements of the batch's dtype.
    pub hidden_states: &'a mut [u8],
}

/// A batch that cannot be written or read, naming what is wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BatchError {
    #[error("batch of {needed} bytes does not fit a slot of {slot_size} bytes (lower the token budget or raise the slot size)")]
    TooLarge { needed: u64, slot_size: u64 },
    #[error("batch is truncated: {what}")]
    Truncated { what: String },
    #[error("batch is corrupt: {what}")]
    Corrupt { what: String },
    #[error("batch has layout version {found}, this program reads version {BATCH_VERSION}")]
    Version { found: u16 },
    #[error("batch {batch_id} failed its checksum: header says {expected:#010x}, sections hash to {found:#010x}")]
    Checksum {
        batch_id: u64,
        expected: u32,
        found: u32,
    },
}

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// The sections in the order they lie: input ids, loss mask, target tokens, hidden states.
fn sections(spec: &BatchSpec, header_len: u64) -> Option<[Section; 4]> {
    let t = spec.tokens();
    let ids = Section {
        offset: align(PREFIX as u64 + header_len),
        len: t.checked_mul(4)?,
    };
    let mask = Section {
        offset: align(ids.offset + ids.len),
        len: t,
    };
    let tokens = Section {
        offset: align(mask.offset + mask.len),
        len: t.checked_mul(4)?,
    };
    let hidden_len = t
        .checked_mul(u64::from(spec.layers))?
        .checked_mul(u64::from(spec.hidden))?
        .checked_mul(spec.dtype.size() as u64)?;
    let hidden = Section {
        offset: align(tokens.offset + tokens.len),
        len: hidden_len,
    };
    Some([ids, mask, tokens, hidden])
}

/// The header for `spec` with a placeholder checksum (bincode encodes a u32 in fixed 4 bytes,
/// so the length does not change when the real checksum is filled in).
fn header_for(spec: &BatchSpec) -> Result<(BatchHeader, u64), BatchError> {
    let overflow = || BatchError::TooLarge {
        needed: u64::MAX,
        slot_size: 0,
    };
    let mut h = BatchHeader {
        version: BATCH_VERSION,
        spec: spec.clone(),
        input_ids: Section::default(),
        loss_mask: Section::default(),
        target_tokens: Section::default(),
        hidden_states: Section::default(),
        checksum: 0,
    };
    // The header's own length does not depend on the section values (fixed-width integers).
    let hlen = bincode::serialized_size(&h).map_err(|_| overflow())?;
    [h.input_ids, h.loss_mask, h.target_tokens, h.hidden_states] =
        sections(spec, hlen).ok_or_else(overflow)?;
    Ok((h, hlen))
}

/// Bytes a batch of this shape occupies.
pub fn batch_len(spec: &BatchSpec) -> Result<u64, BatchError> {
    let (h, _) = header_for(spec)?;
    Ok(h.hidden_states.offset + h.hidden_states.len)
}

/// Writes one batch in place into a slot's payload.
pub struct BatchWriter<'a> {
    buf: &'a mut [u8],
    header: BatchHeader,
}

impl<'a> BatchWriter<'a> {
    /// Lays the batch out in `buf` (a slot's payload). Fails if it does not fit.
    pub fn new(buf: &'a mut [u8], spec: &BatchSpec) -> Result<Self, BatchError> {
        let (header, _) = header_for(spec)?;
        let needed = header.hidden_states.offset + header.hidden_states.len;
        if needed > buf.len() as u64 {
            return Err(BatchError::TooLarge {
                needed,
                slot_size: buf.len() as u64,
            });
        }
        Ok(BatchWriter { buf, header })
    }

    /// Total bytes of this batch (what to reserve in the ring).
    pub fn len(&self) -> usize {
        (self.header.hidden_states.offset + self.header.hidden_states.len) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The header as it will be written (section offsets and lengths; checksum not yet).
    pub fn header(&self) -> &BatchHeader {
        &self.header
    }

    /// The four sections, to fill in place.
    pub fn sections_mut(&mut self) -> SectionsMut<'_> {
        let h = &self.header;
        let ranges =
            [h.input_ids, h.loss_mask, h.target_tokens, h.hidden_states].map(|s| s.range());
        // The sections lie in this order without overlapping: split the buffer at each start.
        let (_, rest) = self.buf.split_at_mut(ranges[0].start);
        let (ids, rest) = rest.split_at_mut(ranges[1].start - ranges[0].start);
        let (mask, rest) = rest.split_at_mut(ranges[2].start - ranges[1].start);
        let (tokens, rest) = rest.split_at_mut(ranges[3].start - ranges[2].start);
        SectionsMut {
            input_ids: &mut ids[..ranges[0].len()],
            loss_mask: &mut mask[..ranges[1].len()],
            target_tokens: &mut tokens[..ranges[2].len()],
            hidden_states: &mut rest[..ranges[3].len()],
        }
    }

    /// Computes the checksum and writes the header. Returns (length, checksum).
    pub fn finish(mut self) -> (usize, u32) {
        let crc = checksum_sections(self.buf, &self.header);
        self.header.checksum = crc;
        let bytes = bincode::serialize(&self.header).expect("header serialises");
        self.buf[..4].copy_from_slice(&MAGIC);
        self.buf[4..8].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
        self.buf[PREFIX..PREFIX + bytes.len()].copy_from_slice(&bytes);
        (self.len(), crc)
    }
}

fn checksum_sections(buf: &[u8], h: &BatchHeader) -> u32 {
    let crc = crc32c::crc32c(&buf[h.input_ids.range()]);
    let crc = crc32c::crc32c_append(crc, &buf[h.loss_mask.range()]);
    let crc = crc32c::crc32c_append(crc, &buf[h.target_tokens.range()]);
    crc32c::crc32c_append(crc, &buf[h.hidden_states.range()])
}

/// A batch read in place from a slot's payload.
pub struct BatchView<'a> {
    buf: &'a [u8],
    header: BatchHeader,
}

impl<'a> BatchView<'a> {
    /// Parses and checks the layout (not the checksum: see [`BatchView::verify`]).
    pub fn parse(buf: &'a [u8]) -> Result<Self, BatchError> {
        let truncated = |what: String| BatchError::Truncated { what };
        let corrupt = |what: String| BatchError::Corrupt { what };
        if buf.len() < PREFIX {
            return Err(truncated(format!(
                "{} bytes, less than the 8-byte prefix",
                buf.len()
            )));
        }
        if buf[..4] != MAGIC {
            return Err(corrupt(format!("bad magic {:02x?}", &buf[..4])));
        }
        let hlen = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes")) as usize;
        if PREFIX + hlen > buf.len() {
            return Err(truncated(format!(
                "header of {hlen} bytes runs past the end ({} bytes)",
                buf.len()
            )));
        }
        // Peek the version first so another version gets its own error, not a decode error.
        let version = u16::from_le_bytes(
            buf.get(PREFIX..PREFIX + 2)
                .ok_or_else(|| truncated("no version".into()))?
                .try_into()
                .expect("2 bytes"),
        );
        if version != BATCH_VERSION {
            return Err(BatchError::Version { found: version });
        }
        let header: BatchHeader = bincode::deserialize(&buf[PREFIX..PREFIX + hlen])
            .map_err(|e| corrupt(format!("header does not decode: {e}")))?;
        let (want, _) = header_for(&header.spec).map_err(|_| corrupt("impossible shape".into()))?;
        let sections =
            |h: &BatchHeader| [h.input_ids, h.loss_mask, h.target_tokens, h.hidden_states];
        if sections(&want) != sections(&header) {
            return Err(corrupt(
                "section offsets disagree with the batch shape".into(),
            ));
        }
        let end = header.hidden_states.offset + header.hidden_states.len;
        if end > buf.len() as u64 {
            return Err(truncated(format!(
                "sections end at byte {end}, the payload has {}",
                buf.len()
            )));
        }
        Ok(BatchView { buf, header })
    }

    /// Checks the CRC-32C of the sections against the header.
    pub fn verify(&self) -> Result<(), BatchError> {
        let found = checksum_sections(self.buf, &self.header);
        if found != self.header.checksum {
            return Err(BatchError::Checksum {
                batch_id: self.header.spec.batch_id,
                expected: self.header.checksum,
                found,
            });
        }
        Ok(())
    }

    pub fn header(&self) -> &BatchHeader {
        &self.header
    }

    pub fn input_ids(&self) -> impl Iterator<Item = u32> + 'a {
        self.buf[self.header.input_ids.range()]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
    }

    pub fn loss_mask(&self) -> &'a [u8] {
        &self.buf[self.header.loss_mask.range()]
    }

    /// The target's greedy next token after each position.
    pub fn target_tokens(&self) -> impl Iterator<Item = u32> + 'a {
        self.buf[self.header.target_tokens.range()]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
    }

    /// Raw hidden states, `tokens × layers × hidden` elements of the header's dtype.
    pub fn hidden_states(&self) -> &'a [u8] {
        &self.buf[self.header.hidden_states.range()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BatchSpec {
        BatchSpec {
            batch_id: 77,
            producer: 2,
            sample_ids: vec![10, 11, 12],
            seq_lens: vec![5, 3, 9],
            dtype: Dtype::Bf16,
            layers: 3,
            hidden: 16,
        }
    }

    fn write(buf: &mut [u8]) -> (usize, u32) {
        let mut w = BatchWriter::new(buf, &spec()).unwrap();
        let s = w.sections_mut();
        for (i, c) in s.input_ids.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&(i as u32 * 3).to_le_bytes());
        }
        s.loss_mask.fill(1);
        for (i, c) in s.target_tokens.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&(i as u32 + 100).to_le_bytes());
        }
        for (i, b) in s.hidden_states.iter_mut().enumerate() {
            *b = i as u8;
        }
        w.finish()
    }

    #[test]
    fn written_in_place_and_read_back() {
        let mut buf = vec![0u8; 8192];
        let (len, _) = write(&mut buf);
        assert_eq!(len as u64, batch_len(&spec()).unwrap());
        let v = BatchView::parse(&buf[..len]).unwrap();
        v.verify().unwrap();
        let h = v.header();
        assert_eq!(h.spec, spec());
        for s in [h.input_ids, h.loss_mask, h.target_tokens, h.hidden_states] {
            assert_eq!(s.offset % ALIGN as u64, 0, "sections are 256-byte aligned");
        }
        assert_eq!(
            v.input_ids().collect::<Vec<_>>(),
            (0..17).map(|i| i * 3).collect::<Vec<_>>()
        );
        assert_eq!(v.loss_mask(), &[1u8; 17][..]);
        assert_eq!(
            v.target_tokens().collect::<Vec<_>>(),
            (100..117).collect::<Vec<_>>()
        );
        assert_eq!(v.hidden_states().len(), 17 * 3 * 16 * 2);
        assert_eq!(v.hidden_states()[5], 5);
    }

    #[test]
    fn too_small_a_slot_is_refused() {
        let mut buf = vec![0u8; 512];
        let err = BatchWriter::new(&mut buf, &spec()).err().unwrap();
        assert!(
            matches!(err, BatchError::TooLarge { slot_size: 512, .. }),
            "{err}"
        );
    }

    #[test]
    fn truncated_corrupt_and_other_version_batches_are_refused() {
        let mut buf = vec![0u8; 8192];
        let (len, _) = write(&mut buf);

        let err = BatchView::parse(&buf[..len - 1]).err().unwrap();
        assert!(matches!(err, BatchError::Truncated { .. }), "{err}");
        let err = BatchView::parse(&buf[..4]).err().unwrap();
        assert!(matches!(err, BatchError::Truncated { .. }), "{err}");

        let mut flipped = buf.clone();
        flipped[len - 3] ^= 0x40;
        let err = BatchView::parse(&flipped[..len])
            .unwrap()
            .verify()
            .unwrap_err();
        assert!(
            matches!(err, BatchError::Checksum { batch_id: 77, .. }),
            "{err}"
        );

        // A flipped greedy token is caught too: the checksum covers all four sections.
        let mut flipped = buf.clone();
        let at = BatchView::parse(&buf[..len])
            .unwrap()
            .header()
            .target_tokens
            .offset as usize;
        flipped[at + 5] ^= 0x01;
        let err = BatchView::parse(&flipped[..len]).unwrap().verify();
        assert!(matches!(err, Err(BatchError::Checksum { .. })), "{err:?}");

        let mut other = buf.clone();
        other[8..10].copy_from_slice(&9u16.to_le_bytes());
        let err = BatchView::parse(&other[..len]).err().unwrap();
        assert_eq!(err, BatchError::Version { found: 9 });

        let mut junk = buf.clone();
        junk[0] = b'X';
        assert!(matches!(
            BatchView::parse(&junk[..len]),
            Err(BatchError::Corrupt { .. })
        ));
    }
}
