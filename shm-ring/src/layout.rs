//! The shared-memory types: the slot state word, the control block, slot and worker records.
//!
//! Everything here is `#[repr(C)]`, made only of atomics, and valid when all-zero, so that a
//! freshly `ftruncate`d segment is a valid (empty) ring before the creator fills in the
//! parameters; the creator publishes the magic number last. No type holds a pointer: processes
//! map the segment at different addresses, so positions are offsets computed from the header.
//! Atomics that different processes write often sit on their own 128-byte lines.

use crate::params::{MAX_SLOTS, MAX_WORKERS};
use crate::phase_clock::PhaseClock;
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

// Zeroed records on the heap (`Default`, below) are for the loom models and unit tests; a
// segment is zeroed by the kernel instead.

/// An atomic alone on a 128-byte line (two lines, for the adjacent-line prefetcher).
#[cfg_attr(any(test, loom), derive(Default))]
#[repr(C, align(128))]
pub(crate) struct Padded<T>(pub T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Ring-wide counters and futex words, written by every worker.
#[cfg_attr(any(test, loom), derive(Default))]
#[repr(C)]
pub(crate) struct Control {
    /// Publish tickets, drawn just before each commit: FIFO serves the lowest it sees READY.
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
    /// Futex word producers sleep on while work items are held by others; bumped when an item
    /// goes back FREE, when a batch that completes an item is committed, and at the close.
    pub work_seq: Padded<AtomicU32>,
    /// Producers about to sleep or asleep on `work_seq`.
    pub work_waiters: Padded<AtomicU32>,
    /// Items a supervisor set aside: freed unconsumed, neither released nor delivered again
    /// (see `Settling`).
    pub set_aside: Padded<AtomicU64>,
    /// Items consumers freed without consuming them, their content refused as corrupt (a
    /// checksum, a shape, a token out of range): never trained, never delivered again, and not
    /// in `released`.
    pub refused: Padded<AtomicU64>,
}

/// One slot's state word and the metadata of the item it holds. The metadata is written by the
/// owner while the slot is WRITING and published by the Release CAS to READY.
#[cfg_attr(any(test, loom), derive(Default))]
#[repr(C, align(128))]
pub(crate) struct SlotRecord {
    pub state: AtomicU64,
    pub ticket: AtomicU64,
    pub len: AtomicU64,
    pub batch_id: AtomicU64,
    pub tokens: AtomicU64,
    pub bucket: AtomicU32,
    /// How many times this item has been handed to a consumer before (0 on first delivery).
    pub delivery: AtomicU32,
    pub producer: AtomicU32,
    /// Work item (+1) this slot's batch completes, 0 if none; see `core.rs`, "Work items".
    /// Set only by the slot's writer while WRITING, cleared before every CAS to FREE, so a FREE
    /// slot never carries an item.
    pub work_item: AtomicU64,
}

/// Number of named phases a worker's time is split into.
pub const PHASES: usize = 8;

/// One worker's registration and telemetry. Written by that worker (and by the supervisor when
/// it recovers it); read by anyone.
#[cfg_attr(any(test, loom), derive(Default))]
#[repr(C, align(128))]
pub(crate) struct WorkerRecord {
    /// Who holds this worker id now: a [`Lease`] word, taken and given back by one CAS each.
    /// The authority on registration; `state`, `pid` and `pid_start` below are telemetry.
    pub lease: AtomicU64,
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
    /// Time by phase, and the phase the worker is in now and since when, so a reader can count
    /// a long phase that has not ended yet (a seqlock: `phase_clock.rs`).
    pub clock: PhaseClock,
    /// When the worker last left `compute` (CLOCK_MONOTONIC ns); 0 while it computes, before
    /// its first compute, and once it left or was recovered (each incarnation starts at 0). From then until it computes again its GPU has nothing to do: an idle
    /// gap.
    pub gap_since: AtomicU64,
    /// The longest idle gap that ended in each of the last [`GAP_SECONDS`] seconds, one
    /// [`GapWord`] per second in slot `second % GAP_SECONDS`. Written by the worker alone.
    pub gaps: [AtomicU64; GAP_SECONDS],
    /// 1 once the worker times its device itself (`device.rs`): its gaps are then the device's.
    /// Cleared at registration (a restart may run another backend) and when a worker's timeline
    /// fails.
    pub device_timed: AtomicU32,
    /// Device time by phase, busy time, and idle time by the host's phase (`DeviceTimes`).
    pub device_ns: [AtomicU64; PHASES],
    pub device_busy_ns: AtomicU64,
    pub device_idle_ns: [AtomicU64; PHASES],
    /// Where the device's last busy span ended (CLOCK_MONOTONIC ns); 0 before this incarnation's
    /// first, so the time before it is no gap.
    pub device_busy_until: AtomicU64,
    /// The worker's last [`PHASE_LOG`] phase switches, `time << 4 | (phase + 1)` (0 for a stopped
    /// clock) in slot `n % PHASE_LOG` for the `n`-th, `phase_log_next` being the next `n`; what a
    /// device gap is attributed by. Written by the worker alone.
    pub phase_log: PhaseLog,
    pub phase_log_next: AtomicU64,
    /// The batch (id + 1; 0: none) this worker is computing on (a producer's: its work item), said
    /// by the worker itself (`set_in_hand`). Read by its supervisor once the process is dead, to hold the
    /// death against that batch; cleared at registration and by recovery.
    pub in_hand: AtomicU64,
}

/// Phase switches a worker's log keeps: a step makes about eight, and a device's spans are
/// resolved within a step or two of their end; but a drafter waiting for batches switches about
/// ten times a second (each timed-out take: `wait_empty` and back), and a long wait's gap is the
/// one the verdict must attribute: 256 cover about 25 s of it (2 KiB a worker).
pub const PHASE_LOG: usize = 256;

/// A worker's phase log (see [`WorkerRecord::phase_log`]): the array alone, in a type of its
/// own for the tests' `Default` (std derives it for arrays of at most 32).
#[repr(transparent)]
pub(crate) struct PhaseLog(pub [AtomicU64; PHASE_LOG]);

#[cfg(any(test, loom))]
impl Default for PhaseLog {
    fn default() -> PhaseLog {
        PhaseLog(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// Seconds of idle-gap history a worker keeps (the verdict's window is usually a few seconds
/// and at most 60: a longer one sees the gaps of its last 32 seconds and the gap in progress).
pub const GAP_SECONDS: usize = 32;

/// One second's longest idle gap: `second << 32 | microseconds` (a gap over 71 minutes is
/// clamped; the hang check has spoken long before). The second is CLOCK_MONOTONIC's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct GapWord(pub u64);

impl GapWord {
    pub(crate) fn new(second: u64, gap_ns: u64) -> GapWord {
        let us = (gap_ns / 1000).min(u64::from(u32::MAX));
        GapWord((second & 0xFFFF_FFFF) << 32 | us)
    }
    pub(crate) fn second(self) -> u64 {
        self.0 >> 32
    }
    pub(crate) fn gap_ns(self) -> u64 {
        (self.0 & 0xFFFF_FFFF) * 1000
    }
}

/// Worker states, as stored in `WorkerRecord::state`.
pub(crate) const W_VACANT: u32 = 0;
pub(crate) const W_ALIVE: u32 = 1;
pub(crate) const W_DONE: u32 = 2;
pub(crate) const W_DEAD: u32 = 3;
pub(crate) const W_RETIRED: u32 = 4;

/// A work-table word: `kind | a << 2 | b << 12`.
///
/// - FREE (0): nobody holds the item. RETURNED (FREE with `a` = 1): nobody holds it, and the
///   last holder died with it (a recovery returned it): whoever claims it next runs it alone,
///   so that an error it causes, even one a device reports late, is known to be its own.
/// - CLAIMED: `a` = the producer's worker id, `b` = the registration epoch that claimed it, so a
///   stale incarnation of the same id can never complete or give back a claim it lost.
/// - DONE: `a` = the slot that carries the item's batch, `b` = that slot's generation while it
///   was WRITING. Recovery undoes a DONE only when it names exactly the WRITING slot it is
///   freeing, so an old or stale `work_item` can never bring a published batch back.
/// - SET_ASIDE (3, no fields): a supervisor set the item aside (it killed the producers that
///   computed it): settled for good, never claimed, published or undone.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct WorkWord(pub u64);

pub(crate) const WORK_FREE: u64 = 0;
pub(crate) const WORK_RETURNED: u64 = WORK_FREE | 1 << WORK_A_SHIFT;
const WORK_CLAIMED: u64 = 1;
const WORK_DONE: u64 = 2;
pub(crate) const WORK_SET_ASIDE: u64 = 3;
const WORK_KIND_MASK: u64 = 0b11;
const WORK_A_SHIFT: u32 = 2;
const WORK_B_SHIFT: u32 = 12;
const WORK_A_MASK: u64 = (1 << (WORK_B_SHIFT - WORK_A_SHIFT)) - 1;
const WORK_B_MASK: u64 = (1 << (64 - WORK_B_SHIFT)) - 1;
// Worker ids and slot indices must fit the 10-bit `a` field.
const _: () = assert!(MAX_WORKERS as u64 - 1 <= WORK_A_MASK);
const _: () = assert!(MAX_SLOTS as u64 - 1 <= WORK_A_MASK);
// And a worker id must fit the slot state word's owner field.
const _: () = assert!(MAX_WORKERS as u64 - 1 < 1 << OWNER_BITS);

impl WorkWord {
    pub(crate) fn claimed(owner: u32, epoch: u64) -> Self {
        WorkWord(
            WORK_CLAIMED
                | (u64::from(owner) & WORK_A_MASK) << WORK_A_SHIFT
                | (epoch & WORK_B_MASK) << WORK_B_SHIFT,
        )
    }
    /// DONE by the batch in slot `idx` while its state word had generation `generation`.
    pub(crate) fn done(idx: usize, generation: u64) -> Self {
        WorkWord(
            WORK_DONE
                | (idx as u64 & WORK_A_MASK) << WORK_A_SHIFT
                | (generation & WORK_B_MASK) << WORK_B_SHIFT,
        )
    }
    /// DONE before the run started (a resumed run's item whose training is in its checkpoint).
    /// No WRITING period can match it, so no recovery undoes it: its generation is the field's
    /// largest value, which a slot's state word (40-bit generations) never reaches.
    pub(crate) fn done_before() -> Self {
        Self::done(0, WORK_B_MASK)
    }
    /// FREE, fresh or RETURNED: claimable.
    pub(crate) fn is_free(self) -> bool {
        self.0 == WORK_FREE || self.0 == WORK_RETURNED
    }
    pub(crate) fn is_done(self) -> bool {
        self.0 & WORK_KIND_MASK == WORK_DONE
    }
    pub(crate) fn is_set_aside(self) -> bool {
        self.0 == WORK_SET_ASIDE
    }
    /// The slot named by a DONE word (for `done_before`, slot 0 with a generation no WRITING
    /// period has).
    pub(crate) fn done_slot(self) -> Option<usize> {
        self.is_done()
            .then_some(((self.0 >> WORK_A_SHIFT) & WORK_A_MASK) as usize)
    }
    /// The slot generation a DONE word names (meaningless for other kinds).
    pub(crate) fn done_generation(self) -> u64 {
        (self.0 >> WORK_B_SHIFT) & WORK_B_MASK
    }
    /// The claiming worker's id, if the item is CLAIMED.
    pub(crate) fn claimer(self) -> Option<u32> {
        (self.0 & WORK_KIND_MASK == WORK_CLAIMED)
            .then_some(((self.0 >> WORK_A_SHIFT) & WORK_A_MASK) as u32)
    }
}

/// A worker record's lease word: 0 when nobody holds the id, else
/// `HELD | pid << 41 | start_ticks`, the pid and start time (clock ticks since boot, 41 bits:
/// centuries) of the holding process. One word, so a registrant's CAS names the process
/// completely: no reader can see a new pid paired with an old start time.
///
/// Staleness rule: a holder is gone when `/proc/<pid>` does not exist, is a zombie, or started at
/// another time (the pid was recycled); see `sys::holder_alive`. Only processes of the creator's
/// pid namespace and boot may attach for writing, so every judge sees every holder's pid.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Lease(pub u64);

const LEASE_HELD: u64 = 1 << 63;
const LEASE_PID_SHIFT: u32 = 41;
/// Linux pids are below 2^22 (`PID_MAX_LIMIT`).
pub(crate) const LEASE_PID_LIMIT: u32 = 1 << 22;
pub(crate) const LEASE_START_MASK: u64 = (1 << LEASE_PID_SHIFT) - 1;

impl Lease {
    pub(crate) const FREE: Lease = Lease(0);

    /// The lease of process `pid` started at `start_ticks` (0: unknown); None if `pid` does not
    /// fit the word.
    pub(crate) fn of(pid: u32, start_ticks: u64) -> Option<Lease> {
        (pid < LEASE_PID_LIMIT).then_some(Lease(
            LEASE_HELD | u64::from(pid) << LEASE_PID_SHIFT | (start_ticks & LEASE_START_MASK),
        ))
    }
    pub(crate) fn is_held(self) -> bool {
        self.0 & LEASE_HELD != 0
    }
    pub(crate) fn pid(self) -> u32 {
        ((self.0 & !LEASE_HELD) >> LEASE_PID_SHIFT) as u32
    }
    /// The holder's start time in clock ticks, truncated to 41 bits; 0 if unknown.
    pub(crate) fn start_ticks(self) -> u64 {
        self.0 & LEASE_START_MASK
    }
}

pub(crate) const ROLE_PRODUCER: u32 = 1;
pub(crate) const ROLE_CONSUMER: u32 = 2;

/// Reads a word for display; telemetry needs no ordering.
pub(crate) fn peek(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

pub(crate) fn peek32(a: &AtomicU32) -> u32 {
    a.load(Ordering::Relaxed)
}
