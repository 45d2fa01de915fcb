//! Helpers shared by the test modules.

use shm_ring::{RingParams, TakePolicy};

pub use testkit::unique;

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
