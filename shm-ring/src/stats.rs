//! A consistent-enough, read-only picture of a ring for `shm-ring-stat`, the launcher's monitor
//! and tests. Taking a snapshot only loads atomics: it never writes the segment, never takes a
//! lock, and so never disturbs the run. Fields read at slightly different instants may disagree
//! by an operation in flight; rates over an interval are what matter. A worker's phase times
//! are the exception, read whole from its phase clock's seqlock (`phase_clock.rs`), since a
//! phase's total and the running phase read across a switch are off by a whole phase.

use serde::Serialize;

use crate::device::DeviceTimes;
use crate::layout::{
    peek, peek32, GapWord, Word, WorkWord, FREE, READING, READY, ROLE_PRODUCER, WRITING, W_ALIVE,
    W_DEAD, W_DONE, W_RETIRED, W_VACANT,
};
use crate::params::RingParams;
use crate::phase::{Phase, PhaseMap};
use crate::ring::Ring;
use crate::segment::{Creator, LAYOUT_VERSION, NO_GPU};
use crate::sync::Ordering;
use crate::sys;
use crate::worker::{Role, WorkerName};

/// Slots by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SlotCounts {
    pub free: u32,
    pub writing: u32,
    pub ready: u32,
    pub reading: u32,
}

/// Ring-wide counters since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RingCounters {
    /// Items committed.
    pub published: u64,
    /// Takes (a redelivered item is taken again and counts again).
    pub taken: u64,
    /// Items released by consumers.
    pub released: u64,
    /// Items returned to READY because the consumer holding them died.
    pub redelivered: u64,
    /// Slots given back unpublished (aborted writes, dead producers' writes).
    pub aborted: u64,
    /// Batches a supervisor set aside: never trained, never delivered again (published ones a
    /// consumer died on, and work items a producer died computing, never published).
    pub set_aside: u64,
    /// Items consumers freed unconsumed, refusing their content as corrupt: never trained,
    /// and not among `released`.
    pub refused: u64,
}

/// Work items by state (all zero when the ring has no work table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WorkCounts {
    pub total: u64,
    pub done: u64,
    pub claimed: u64,
    /// Set aside by a supervisor (they killed the producers that computed them): never published.
    pub set_aside: u64,
}

/// A worker record's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Never registered.
    Vacant,
    Alive,
    /// Finished or left cleanly.
    Done,
    /// Died and was recovered by the supervisor.
    Dead,
    /// A producer that died and will not come back, counted as finished.
    Retired,
}

/// One worker's registration and telemetry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerSnapshot {
    pub role: Role,
    pub index: u32,
    pub gpu: Option<u32>,
    pub state: WorkerState,
    pub pid: u32,
    /// True if the record says alive and the process exists.
    pub alive: bool,
    /// Registrations so far; `restarts` = epoch - 1.
    pub epoch: u64,
    pub restarts: u64,
    /// True once this producer finished or was retired.
    pub finished: bool,
    /// Nanoseconds since the last heartbeat (CLOCK_MONOTONIC), `None` if never registered.
    pub heartbeat_age_ns: Option<u64>,
    /// Nanoseconds since this epoch registered.
    pub registered_age_ns: Option<u64>,
    pub items: u64,
    pub tokens: u64,
    pub bytes: u64,
    /// Cumulative nanoseconds by phase (a map by phase name in JSON).
    pub phase_ns: PhaseMap<u64>,
    /// The idle gap in progress (out of `compute` since its last compute, while alive), in
    /// nanoseconds; null when computing or before the first compute.
    pub idle_now_ns: Option<u64>,
    /// The longest idle gap that ended in each of the last 32 seconds, as (CLOCK_MONOTONIC
    /// second, nanoseconds), oldest first; the analysis turns them into each interval's
    /// longest gap (not in JSON: `interval` has the figure).
    #[serde(skip)]
    pub idle_gaps: Vec<(u64, u64)>,
    /// What its device's own timeline says (CUDA events), for a worker that times its device;
    /// then `busy_ns` and the idle gaps are the device's. Null for a host-timed worker.
    pub device: Option<DeviceTimes>,
    /// The batch this worker said it is computing on ([`crate::Consumer::set_in_hand`],
    /// [`crate::Producer::set_in_hand`]: a producer's work item); for a dead one not yet
    /// recovered, the batch it died computing on.
    pub in_hand: Option<u64>,
}

impl WorkerSnapshot {
    pub fn name(&self) -> WorkerName {
        WorkerName {
            role: self.role,
            index: self.index,
        }
    }

    /// Nanoseconds busy: the device's compute stream running work, for a worker that times its
    /// device; else the host in `compute`.
    pub fn busy_ns(&self) -> u64 {
        match &self.device {
            Some(d) => d.busy_ns,
            None => self.phase_ns[Phase::Compute],
        }
    }
}

/// Everything a reader can know about a ring at one moment.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    pub name: String,
    pub layout_version: u32,
    pub params: RingParams,
    pub size_bytes: u64,
    pub creator: Creator,
    /// False only when the creator is known to be gone (see [`Creator::liveness`]).
    pub creator_alive: bool,
    pub closed: bool,
    pub producers_done: u32,
    pub producers_expected: u32,
    pub slots: SlotCounts,
    /// READY items per bucket.
    pub ready_per_bucket: Vec<u32>,
    pub counters: RingCounters,
    /// Every worker of the ring, in the ring's order: look one up with [`Snapshot::worker`],
    /// not by position.
    pub workers: Vec<WorkerSnapshot>,
    pub work: WorkCounts,
    /// CLOCK_MONOTONIC nanoseconds when the snapshot was taken, for rates between two snapshots.
    pub taken_at_ns: u64,
}

impl Snapshot {
    /// The worker of that name; `None` if the ring has no such worker.
    pub fn worker(&self, name: WorkerName) -> Option<&WorkerSnapshot> {
        self.workers.iter().find(|w| w.name() == name)
    }

    /// The workers of one role, in index order.
    pub fn workers_of(&self, role: Role) -> impl Iterator<Item = &WorkerSnapshot> {
        self.workers.iter().filter(move |w| w.role == role)
    }
}

impl Ring {
    /// Slots by state now: a cheap scan, for sampling occupancy often.
    pub fn slot_counts(&self) -> SlotCounts {
        let mut c = SlotCounts::default();
        for s in self.segment().slots() {
            match Word(s.state.load(Ordering::Relaxed)).state() {
                FREE => c.free += 1,
                WRITING => c.writing += 1,
                READY => c.ready += 1,
                READING => c.reading += 1,
                _ => {}
            }
        }
        c
    }

    /// Reads the ring's state and telemetry without writing anything.
    pub fn snapshot(&self) -> Snapshot {
        let seg = self.segment();
        let p = *self.params();
        let ctl = seg.control();
        let now = sys::monotonic_ns();
        let mut slots = SlotCounts::default();
        let mut ready_per_bucket = vec![0u32; p.buckets as usize];
        for s in seg.slots() {
            match Word(s.state.load(Ordering::Acquire)).state() {
                FREE => slots.free += 1,
                WRITING => slots.writing += 1,
                READY => {
                    slots.ready += 1;
                    let b = (peek32(&s.bucket) as usize).min(ready_per_bucket.len() - 1);
                    ready_per_bucket[b] += 1;
                }
                READING => slots.reading += 1,
                _ => {}
            }
        }
        let workers = seg
            .workers()
            .iter()
            .map(|w| {
                let state = match peek32(&w.state) {
                    W_ALIVE => WorkerState::Alive,
                    W_DONE => WorkerState::Done,
                    W_DEAD => WorkerState::Dead,
                    W_RETIRED => WorkerState::Retired,
                    W_VACANT => WorkerState::Vacant,
                    _ => WorkerState::Vacant,
                };
                let pid = peek32(&w.pid);
                let epoch = peek(&w.epoch);
                let since = |t: u64| (epoch > 0).then(|| now.saturating_sub(t));
                let gpu = peek32(&w.gpu);
                let alive =
                    state == WorkerState::Alive && sys::process_alive(pid, peek(&w.pid_start));
                // The phase in progress counts up to now, if the worker still runs.
                let clock = w.clock.read(now, alive);
                WorkerSnapshot {
                    role: if peek32(&w.role) == ROLE_PRODUCER {
                        Role::Producer
                    } else {
                        Role::Consumer
                    },
                    index: peek32(&w.index),
                    gpu: (gpu != NO_GPU).then_some(gpu),
                    state,
                    pid,
                    alive,
                    epoch,
                    restarts: epoch.saturating_sub(1),
                    finished: peek32(&w.finished) != 0,
                    heartbeat_age_ns: since(peek(&w.heartbeat_ns)),
                    registered_age_ns: since(peek(&w.registered_ns)),
                    items: peek(&w.items),
                    tokens: peek(&w.tokens),
                    bytes: peek(&w.bytes),
                    phase_ns: clock.ns,
                    idle_now_ns: {
                        // A device-timed worker's gap in progress is its device's since its
                        // last busy span, counted only while the host is out of compute (in
                        // compute, work may be queued whose spans are not resolved yet).
                        let start = if peek32(&w.device_timed) != 0 {
                            peek(&w.device_busy_until)
                        } else {
                            peek(&w.gap_since)
                        };
                        let computing = clock.cur == Some(Phase::Compute);
                        (alive && !computing && start != 0).then(|| now.saturating_sub(start))
                    },
                    idle_gaps: {
                        let mut g: Vec<(u64, u64)> = (w.gaps.iter())
                            .map(|g| GapWord(peek(g)))
                            .filter(|g| g.0 != 0)
                            .map(|g| (g.second(), g.gap_ns()))
                            .collect();
                        g.sort_unstable();
                        g
                    },
                    device: crate::device::times(w),
                    in_hand: peek(&w.in_hand).checked_sub(1),
                }
            })
            .collect();
        let creator = seg.creator();
        let mut work = WorkCounts {
            total: p.work_items,
            ..WorkCounts::default()
        };
        for w in seg.work() {
            let w = WorkWord(peek(w));
            if w.is_done() {
                work.done += 1;
            } else if w.is_set_aside() {
                work.set_aside += 1;
            } else if !w.is_free() {
                work.claimed += 1;
            }
        }
        Snapshot {
            name: self.name().to_string(),
            layout_version: LAYOUT_VERSION,
            params: p,
            size_bytes: self.size_bytes(),
            creator,
            creator_alive: creator.alive(),
            closed: self.is_closed(),
            producers_done: peek32(&ctl.producers_done),
            producers_expected: p.producers,
            slots,
            ready_per_bucket,
            counters: RingCounters {
                published: peek(&ctl.published),
                taken: peek(&ctl.taken),
                released: peek(&ctl.released),
                redelivered: peek(&ctl.redelivered),
                aborted: peek(&ctl.aborted),
                set_aside: peek(&ctl.set_aside),
                refused: peek(&ctl.refused),
            },
            workers,
            work,
            taken_at_ns: now,
        }
    }
}
