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
//! against crashes, not against a hostile or buggy process of the same user. Consumers check a
//! checksum of each payload for that reason. Liveness is judged from `/proc`, so only processes
//! of the creator's pid namespace and boot may attach for writing.
//!
//! Under `cfg(loom)` only the state machine is compiled, on heap memory, for the loom models.

#![cfg_attr(loom, allow(dead_code, unused_imports))]

mod core;
mod layout;
mod params;
mod sync;

#[cfg(not(loom))]
pub mod analysis;
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

pub use crate::core::{CommitMeta, ItemMeta, Recovered};
pub use crate::layout::{MAX_WORKERS, PHASES};
pub use crate::params::{BucketPick, ConfigError, RingParams, TakePolicy, MAX_BUCKETS, MAX_SLOTS};

#[cfg(not(loom))]
pub use crate::ring::{Consumer, Producer, ReadSlot, Ring, Take, WriteSlot};
#[cfg(not(loom))]
pub use crate::segment::{list_segments, SegmentInfo, LAYOUT_VERSION, NAME_PREFIX};
#[cfg(not(loom))]
pub use crate::stats::{
    RingCounters, SlotCounts, Snapshot, WorkCounts, WorkerSnapshot, WorkerState,
};

use serde::{Deserialize, Serialize};

/// Where a worker's time goes. Waits are recorded by the ring itself; workers record the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(usize)]
pub enum Phase {
    /// A producer waiting for a free slot: the ring was full.
    WaitFull = 0,
    /// A consumer waiting for an item: the ring was empty or below `min_ready`.
    WaitEmpty = 1,
    /// Reading or preparing input (a target's dataset work).
    Load = 2,
    /// Moving data between host and device.
    CopyIn = 3,
    /// Model forward or train step.
    Compute = 4,
    /// Synchronisation with peers (e.g. gradient all-reduce).
    Sync = 5,
    /// Writing checkpoints and ledgers.
    Checkpoint = 6,
    /// Everything else the worker spends time on.
    Other = 7,
}

impl Phase {
    pub const ALL: [Phase; PHASES] = [
        Phase::WaitFull,
        Phase::WaitEmpty,
        Phase::Load,
        Phase::CopyIn,
        Phase::Compute,
        Phase::Sync,
        Phase::Checkpoint,
        Phase::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::WaitFull => "wait_full",
            Phase::WaitEmpty => "wait_empty",
            Phase::Load => "load",
            Phase::CopyIn => "copy_in",
            Phase::Compute => "compute",
            Phase::Sync => "sync",
            Phase::Checkpoint => "checkpoint",
            Phase::Other => "other",
        }
    }

    /// True for the phases in which the worker waits on the ring rather than working.
    pub fn is_wait(self) -> bool {
        matches!(self, Phase::WaitFull | Phase::WaitEmpty)
    }
}

/// Producer or consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Producer,
    Consumer,
}

/// A worker's place in the ring: producers are numbered `0..producers`, consumers
/// `0..consumers`. A restarted worker comes back under the same id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerId {
    pub role: Role,
    pub index: u32,
}

impl WorkerId {
    pub fn producer(index: u32) -> Self {
        WorkerId {
            role: Role::Producer,
            index,
        }
    }
    pub fn consumer(index: u32) -> Self {
        WorkerId {
            role: Role::Consumer,
            index,
        }
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let role = match self.role {
            Role::Producer => "producer",
            Role::Consumer => "consumer",
        };
        write!(f, "{role} {}", self.index)
    }
}

/// Everything the ring can refuse, naming what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("invalid ring name {name:?}: {why}")]
    InvalidName { name: String, why: &'static str },
    #[error("ring parameters: {0}")]
    Config(#[from] ConfigError),
    #[error("ring {name:?} already exists in /dev/shm (a live run, or a stale one: see `shm-ring-stat --list` and `--gc`)")]
    Exists { name: String },
    #[error("ring {name:?} not found in /dev/shm")]
    NotFound { name: String },
    #[error("permission denied opening ring {name:?}")]
    PermissionDenied { name: String },
    #[error("ring {name:?} belongs to uid {owner}, not to this user (uid {me})")]
    ForeignOwner { name: String, owner: u32, me: u32 },
    #[error("/dev/shm has {available} bytes free but ring {name:?} needs {needed}: enlarge /dev/shm (mount -o remount,size=...) or use fewer or smaller slots")]
    ShmTooSmall {
        name: String,
        needed: u64,
        available: u64,
    },
    #[error("{name:?} is not an hspipe ring (magic {found:#x})")]
    BadMagic { name: String, found: u64 },
    #[error("ring {name:?} has layout version {found}, this program reads version {expected}")]
    VersionMismatch {
        name: String,
        found: u32,
        expected: u32,
    },
    #[error("ring {name:?} is corrupt or truncated: {what}")]
    Corrupt { name: String, what: String },
    #[error("{op} ring {name:?}: {source}")]
    Io {
        op: &'static str,
        name: String,
        source: std::io::Error,
    },
    #[error("payload of {len} bytes does not fit a slot of {capacity} bytes")]
    PayloadTooLarge { len: u64, capacity: u64 },
    #[error("bucket {bucket} is out of range: the ring has {buckets} buckets")]
    BadBucket { bucket: u32, buckets: u32 },
    #[error("{id} does not exist: the ring has {producers} producers and {consumers} consumers")]
    NoSuchWorker {
        id: WorkerId,
        producers: u32,
        consumers: u32,
    },
    #[error("{id} is already registered by live process {pid}")]
    WorkerBusy { id: WorkerId, pid: u32 },
    #[error("cannot recover {id}: it is registered by process {pid}, which is still running (recover a worker only once its process has exited)")]
    WorkerAlive { id: WorkerId, pid: u32 },
    #[error("process id {pid} does not fit the ring's lease word (Linux pids are below 2^22)")]
    UnsupportedPid { pid: u32 },
    #[error("slot {slot} already carries work item {item}: one work item per slot")]
    SlotCarriesWork { slot: usize, item: u64 },
    #[error("ring {name:?} has mode {mode:03o}: group or other users may open it, so its contents cannot be trusted (hspipe rings are 0600)")]
    InsecureMode { name: String, mode: u32 },
    #[error("ring {name:?} was created in another {what}: its workers' liveness cannot be judged from here")]
    ForeignNamespace { name: String, what: &'static str },
    #[error(
        "this consumer already holds {held} item(s), the most the ring allows (held_per_consumer)"
    )]
    TooManyHeld { held: u32 },
    #[error("the ring is closed: every producer has finished")]
    Closed,
    #[error("this producer has already finished")]
    Finished,
    #[error("slot {slot} was reclaimed by recovery: this worker was declared dead")]
    Reclaimed { slot: usize },
    #[error("work item {item} does not exist: the ring has {items}")]
    NoSuchWorkItem { item: u64, items: u64 },
    #[error("work item {item} is not claimed by this producer")]
    NotClaimed { item: u64 },
    #[error("the ring was attached read-only")]
    ReadOnly,
}

#[cfg(not(loom))]
pub mod screen;
#[cfg(not(loom))]
pub mod stat_cli;
