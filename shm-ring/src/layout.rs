//! The shared-memory types: the slot state word, the control block, slot and worker records.
//!
//! Everything here is `#[repr(C)]`, made only of atomics, and valid when all-zero, so that a
//! freshly `ftruncate`d segment is a valid (empty) ring before the creator fills in the
//! parameters; the creator publishes the magic number last. No type holds a pointer: processes
//! map the segment at different addresses, so positions are offsets computed from the header.
//! Atomics that different processes write often sit on their own 128-byte lines.

use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Slot states. See the state machine in `core.rs`.
pub(crate) const FREE: u64 = 0;
pub(crate) const WRITING: u64 = 1;
pub(crate) const READY: u64 = 2;
pub(crate) const READING: u64 = 3;

const STATE_BITS: u32 = 8;
const OWNER_BITS: u32 = 16;
const OWNER_SHIFT: u32 = STATE_BITS;
const GEN_SHIFT: u32 = STATE_BITS + OWNER_BITS;

/// The most workers one ring can have: an owner id must fit the state word.
pub const MAX_WORKERS: u32 = 1 << 10;

/// A decoded slot state word: `state | owner << 8 | generation << 24`.
///
/// The generation grows by one on every transition, so a CAS that expects a word seen earlier
/// fails if the slot moved in between, even if it came back to the same state and owner (ABA).
/// 40 bits of generation last 34 years at a thousand transitions per second per slot.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Word(pub u64);

impl Word {
    pub(crate) fn new(state: u64, owner: u32, generation: u64) -> Self {
        Word(state | (u64::from(owner) << OWNER_SHIFT) | (generation << GEN_SHIFT))
    }
    pub(crate) fn state(self) -> u64 {
        self.0 & ((1 << STATE_BITS) - 1)
    }
    pub(crate) fn owner(self) -> u32 {
        ((self.0 >> OWNER_SHIFT) & ((1 << OWNER_BITS) - 1)) as u32
    }
    pub(crate) fn generation(self) -> u64 {
        self.0 >> GEN_SHIFT
    }
    /// The word for the next state of this slot, owned by `owner`.
    pub(crate) fn next(self, state: u64, owner: u32) -> Self {
        Word::new(
            state,
            owner,
            self.generation().wrapping_add(1) & ((1 << 40) - 1),
        )
    }
}

/// An atomic alone on a 128-byte line (two lines, for the adjacent-line prefetcher).
#[repr(C, align(128))]
pub(crate) struct Padded<T>(pub T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Ring-wide counters and futex words, written by every worker.
#[repr(C)]
pub(crate) struct Control {
    /// Publish tickets: FIFO order is ascending ticket.
    pub next_ticket: Padded<AtomicU64>,
    /// Futex word consumers sleep on; bumped when an item becomes READY or the ring closes.
    pub ready_seq: Padded<AtomicU32>,
    /// Futex word producers sleep on; bumped when a slot becomes FREE.
    pub free_seq: Padded<AtomicU32>,
    /// Consumers about to sleep or asleep on `ready_seq`; a waker skips the wake system call
    /// when there are none (see `RingRef::bump`).
    pub ready_waiters: Padded<AtomicU32>,
    /// Producers about to sleep or asleep on `free_seq`.
    pub free_waiters: Padded<AtomicU32>,
    /// Producers that called `finish()` or were retired.
    pub producers_done: Padded<AtomicU32>,
    /// 1 once the last expected producer finished: no item will be published any more.
    pub closed: Padded<AtomicU32>,
    /// Where the next producer starts looking for a FREE slot, to spread writers over slots.
    pub reserve_hint: Padded<AtomicU32>,
    pub published: Padded<AtomicU64>,
    pub taken: Padded<AtomicU64>,
    pub released: Padded<AtomicU64>,
    pub redelivered: Padded<AtomicU64>,
    pub aborted: Padded<AtomicU64>,
    /// Next never-claimed work item (a hint: the work table's CAS decides).
    pub work_cursor: Padded<AtomicU64>,
    /// Work items returned by recovery, not yet claimed again.
    pub work_redo: Padded<AtomicU64>,
}

/// One slot's state word and the metadata of the item it holds. The metadata is written by the
/// owner while the slot is WRITING and published by the Release CAS to READY.
#[repr(C, align(128))]
pub(crate) struct SlotRecord {
    pub state: AtomicU64,
    pub ticket: AtomicU64,
    pub len: AtomicU64,
    pub batch_id: AtomicU64,
    pub checksum: AtomicU64,
    pub tokens: AtomicU64,
    pub bucket: AtomicU32,
    /// How many times this item has been handed to a consumer before (0 on first delivery).
    pub delivery: AtomicU32,
    pub producer: AtomicU32,
    /// Work item (+1) this slot's batch completes, 0 if none; see `core.rs`, "Work items".
    pub work_item: AtomicU64,
}

/// Number of named phases a worker's time is split into.
pub const PHASES: usize = 8;

/// One worker's registration and telemetry. Written by that worker (and by the supervisor when
/// it recovers it); read by anyone.
#[repr(C, align(128))]
pub(crate) struct WorkerRecord {
    pub role: AtomicU32,
    pub index: AtomicU32,
    pub gpu: AtomicU32,
    pub state: AtomicU32,
    pub pid: AtomicU32,
    /// 1 once this producer finished or was retired; never reset, so a producer counts once.
    pub finished: AtomicU32,
    pub epoch: AtomicU64,
    pub pid_start: AtomicU64,
    pub registered_ns: AtomicU64,
    pub heartbeat_ns: AtomicU64,
    pub items: AtomicU64,
    pub tokens: AtomicU64,
    pub bytes: AtomicU64,
    pub phase_ns: [AtomicU64; PHASES],
    /// The phase the worker is in now (+1; 0: none) and since when (CLOCK_MONOTONIC ns), so a
    /// reader can count a long phase that has not ended yet.
    pub phase_cur: AtomicU32,
    pub phase_since: AtomicU64,
}

/// Worker states, as stored in `WorkerRecord::state`.
pub(crate) const W_VACANT: u32 = 0;
pub(crate) const W_ALIVE: u32 = 1;
pub(crate) const W_DONE: u32 = 2;
pub(crate) const W_DEAD: u32 = 3;
pub(crate) const W_RETIRED: u32 = 4;

/// Work item states, as stored in the work table: unclaimed, done, or claimed by worker `id`
/// (`WORK_CLAIMED + id`).
pub(crate) const WORK_FREE: u64 = 0;
pub(crate) const WORK_DONE: u64 = 1;
pub(crate) const WORK_CLAIMED: u64 = 2;

pub(crate) const ROLE_PRODUCER: u32 = 1;
pub(crate) const ROLE_CONSUMER: u32 = 2;

/// Builds zeroed shared types on the heap, for loom models and unit tests of the state machine
/// without a segment.
#[cfg(any(test, loom))]
pub(crate) mod heap {
    use super::*;

    fn u64s() -> AtomicU64 {
        AtomicU64::new(0)
    }
    fn u32s() -> AtomicU32 {
        AtomicU32::new(0)
    }

    pub(crate) fn control() -> Control {
        Control {
            next_ticket: Padded(u64s()),
            ready_seq: Padded(u32s()),
            free_seq: Padded(u32s()),
            ready_waiters: Padded(u32s()),
            free_waiters: Padded(u32s()),
            producers_done: Padded(u32s()),
            closed: Padded(u32s()),
            reserve_hint: Padded(u32s()),
            published: Padded(u64s()),
            taken: Padded(u64s()),
            released: Padded(u64s()),
            redelivered: Padded(u64s()),
            aborted: Padded(u64s()),
            work_cursor: Padded(u64s()),
            work_redo: Padded(u64s()),
        }
    }

    pub(crate) fn slot() -> SlotRecord {
        SlotRecord {
            state: u64s(),
            ticket: u64s(),
            len: u64s(),
            batch_id: u64s(),
            checksum: u64s(),
            tokens: u64s(),
            bucket: u32s(),
            delivery: u32s(),
            producer: u32s(),
            work_item: u64s(),
        }
    }

    pub(crate) fn worker() -> WorkerRecord {
        WorkerRecord {
            role: u32s(),
            index: u32s(),
            gpu: u32s(),
            state: u32s(),
            pid: u32s(),
            finished: u32s(),
            epoch: u64s(),
            pid_start: u64s(),
            registered_ns: u64s(),
            heartbeat_ns: u64s(),
            items: u64s(),
            tokens: u64s(),
            bytes: u64s(),
            phase_ns: std::array::from_fn(|_| u64s()),
            phase_cur: u32s(),
            phase_since: u64s(),
        }
    }
}

/// Reads a word for display; telemetry needs no ordering.
pub(crate) fn peek(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

pub(crate) fn peek32(a: &AtomicU32) -> u32 {
    a.load(Ordering::Relaxed)
}
