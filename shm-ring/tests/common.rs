//! Helpers shared by the test modules.

use std::sync::atomic::{AtomicU32, Ordering};

use shm_ring::{RingParams, TakePolicy};

/// A ring name unique to this test process and call; rings are unlinked by their creating
/// handle's drop, so a failing test leaves nothing behind.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "hspipe-t-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A FIFO ring of `slots` 4 KiB slots and 4 buckets.
pub fn fifo(producers: u32, consumers: u32, slots: u32) -> RingParams {
    RingParams {
        slots,
        slot_size: 4096,
        buckets: 4,
        producers,
        consumers,
        held_per_consumer: 1,
        policy: TakePolicy::Fifo,
        seed: 1,
        work_items: 0,
    }
}
