//! Helpers shared by the multi-process tests and their `ring-peer` helper binary.

/// Fills `buf` with bytes derived from `batch_id` alone, so a reader can check content, not
/// just a checksum. Returns the checksum of the bytes.
pub fn fill(buf: &mut [u8], batch_id: u64) -> u64 {
    let mut x = batch_id ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    checksum(buf)
}

/// FNV-1a over the bytes.
pub fn checksum(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// True if `buf` is exactly what `fill` writes for `batch_id`.
pub fn verify(buf: &[u8], batch_id: u64) -> bool {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, batch_id);
    want == buf
}

/// The batch id of producer `p`'s item `seq`.
pub fn batch_id(p: u32, seq: u64) -> u64 {
    (u64::from(p) << 32) | seq
}

/// The payload length of a batch: varied, up to `max_len`.
pub fn payload_len(batch_id: u64, max_len: usize) -> usize {
    let h = checksum(&batch_id.to_le_bytes()) as usize;
    1 + h % max_len
}
