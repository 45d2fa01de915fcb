//! `shm-ring`: a crash-safe, zero-copy, lock-free multi-producer multi-consumer ring in POSIX
//! shared memory, built to hand hidden-state batches from target-model processes to drafter
//! processes on one machine.
//!
//! - **Zero-copy**: a producer [`Producer::reserve`]s a slot, writes its payload in place and
//!   [`WriteSlot::commit`]s it; a consumer [`Consumer::take`]s a slot, reads in place and
//!   [`ReadSlot::release`]s it. The ring never copies a payload byte.
//! - **Lock-free**: every slot state change is one CAS on a word holding state, owner and
//!   generation (see `core.rs`); no mutex anywhere.
//! - **Blocking without spinning**: waiters sleep on shared futex words, at most 100 ms at a time.
//! - **Exact end of stream**: the last of the expected producers to [`Producer::finish`] closes
//!   the ring and wakes every consumer; consumers drain what is left, then see the end.
//! - **Crash recovery**: [`Ring::recover`] returns a dead worker's slots (a dead consumer's item is
//!   delivered again); [`Ring::retire`] counts a producer that will not return as finished.
//! - **Telemetry in the segment**: per-worker time by [`Phase`] and ring counters, read with
//!   [`Ring::snapshot`] without disturbing the run.
//! - **Take policies**: FIFO serves the oldest publish ticket among the READY items one scan
//!   sees (approximate across producers: a commit landing during the scan can be passed), or
//!   bucketed by length class.
//!
//! # Trust
//!
//! A ring is created 0600 and attach refuses a segment that group or other users may open. But
//! every process of the same uid can map it and write anything into it, payloads and state words
//! alike, and so break the protocol (lose, duplicate or corrupt batches): the ring protects
//! against crashes, not against a hostile or buggy process of the same user. Consumers check what
//! each payload carries for that reason (hspipe's batches carry their own checksum). Liveness is judged from `/proc`, so only processes
//! of the creator's pid namespace and boot may attach for writing.
//!
//! Under `cfg(loom)` only the state machine is compiled, on heap memory, for the loom models.

#![cfg_attr(loom, allow(dead_code, unused_imports))]

mod core;
mod device;
mod error;
mod layout;
mod params;
mod phase;
mod phase_clock;
mod sync;
mod worker;

#[cfg(not(loom))]
mod ring;
#[cfg(not(loom))]
mod segment;
#[cfg(not(loom))]
mod stats;
#[cfg(not(loom))]
mod sys;

#[cfg(any(test, loom))]
mod model;

#[cfg(all(test, not(loom)))]
mod crash_tests;

#[cfg(all(test, not(loom)))]
mod crash_search;

pub use crate::core::{CommitMeta, ItemMeta, Recovered, Settle, WorkClaim};
pub use crate::device::{DeviceSpan, DeviceTimes};
pub use crate::error::RingError;
pub use crate::layout::PHASES;
pub use crate::params::{
    BucketPick, ConfigError, RingParams, TakePolicy, MAX_BUCKETS, MAX_SLOTS, MAX_WORKERS,
    MAX_WORK_ITEMS,
};
/// The ring's clock (CLOCK_MONOTONIC, ns): heartbeats, phases, gaps and [`DeviceSpan`]s.
pub use shmem::monotonic_ns;

pub use crate::phase::{Phase, PhaseMap};
#[cfg(not(loom))]
pub use crate::ring::{Beat, Consumer, Producer, ReadSlot, Ring, Take, WriteSlot};
#[cfg(not(loom))]
pub use crate::segment::{judge_orphan, list_segments, SegmentInfo, LAYOUT_VERSION, NAME_PREFIX};
#[cfg(not(loom))]
pub use crate::stats::{
    RingCounters, SlotCounts, Snapshot, WorkCounts, WorkerSnapshot, WorkerState,
};
pub use crate::worker::{role_name, BadWorkerName, Role, WorkerName};
