//! Helpers the tests and benchmarks of several crates share (shm-ring's own tests, the
//! multi-process tests and `ring-peer`, the benchmarks), kept once here. Nothing in hspipe's
//! binaries uses it.

pub mod metrics;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A ring (or directory) name unique to this process and call. Rings are unlinked by their
/// creating handle's drop, so a failing test leaves nothing behind.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "hspipe-t-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Fills `buf` with bytes derived from `batch_id` alone, so a reader can check content, not
/// just a checksum.
pub fn fill(buf: &mut [u8], batch_id: u64) {
    for (chunk, x) in buf.chunks_mut(8).zip(words(batch_id)) {
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// The xorshift64 stream seeded by `batch_id`: `fill`'s bytes and `payload_len`'s length.
fn words(batch_id: u64) -> impl Iterator<Item = u64> {
    let mut x = batch_id ^ 0x9e37_79b9_7f4a_7c15;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
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
    let h = words(!batch_id).next().unwrap_or(0) as usize;
    1 + h % max_len
}

/// Runs `f` on a thread and fails the test, naming `what`, if it does not return within
/// `limit` (a spin or a hang): a hang caught without a timing assertion on the work itself.
pub fn watchdog<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not return in {limit:?}: it spins or hangs"))
}

/// CPU time this thread has used.
pub fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The error `read` gives for a FIFO named `name` in a fresh directory (`read` gets the
/// directory), which it must refuse without opening: an open with no writer waits for ever, so
/// a hang fails the test saying so (a writer then lets the open go). The directory is removed
/// after.
pub fn fifo_refusal(
    name: &str,
    read: impl FnOnce(&std::path::Path) -> Option<String> + Send + 'static,
) -> String {
    let dir = std::env::temp_dir().join(unique("fifo"));
    std::fs::create_dir(&dir).unwrap();
    let fifo = dir.join(name);
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || tx.send(read(&d)));
    let got = rx.recv_timeout(Duration::from_secs(30));
    if got.is_err() {
        // Let the blocked open go (a writer arrives).
        let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
    }
    let _ = std::fs::remove_dir_all(&dir);
    match got {
        Ok(Some(e)) => e,
        Ok(None) => panic!("{} was read as if it were a file", fifo.display()),
        Err(_) => panic!(
            "reading {} hung opening a FIFO with no writer",
            fifo.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_payload_verifies_and_a_changed_byte_does_not() {
        let mut b = vec![0u8; 1001];
        fill(&mut b, batch_id(3, 9));
        assert!(verify(&b, batch_id(3, 9)));
        assert!(!verify(&b, batch_id(3, 10)));
        b[500] ^= 1;
        assert!(!verify(&b, batch_id(3, 9)));
        assert_ne!(unique("a"), unique("a"));
    }
}
