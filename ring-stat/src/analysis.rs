//! What snapshots of a ring say: rates over an interval, each worker's time by phase, and a
//! verdict that names the bottleneck, the worker at fault if one is, and the figures that show
//! it. [`Judge`] gives the verdict over a sliding window of recent intervals with hysteresis;
//! the launcher's monitor, `shm-ring-stat` and the scenario tests (tests/tests/verdict.rs) all
//! use it, so they say the same thing.
//!
//! Definitions (all fractions of the interval's wall time, per worker):
//! - *busy*: time in `compute` (the GPU doing model work); for a worker that times its device
//!   (CUDA events), the time its device's compute stream ran work, and its idle gaps are the
//!   device's too (`WorkerRates::device`);
//! - *waiting*: time blocked on the ring (`wait_full` for targets, `wait_empty` for drafters);
//! - everything else (`load`, `copy_in`, `sync`, `checkpoint`, `other`) is *overhead*;
//! - *working*: every phase but the waits on the ring and `sync` (which waits for the other
//!   ranks): the time a worker's own step takes. A worker's *pace* is its working time per
//!   token over its life (all incarnations), from the cumulative counters of the last snapshot.
//!
//! The verdict, in order (the first that holds; 1-6 are the functions of `verdict::RULES`, 7 is
//! `verdict::sides`, and a new rule goes into that list at its place in this order):
//! 1. *finished*: the ring is closed and empty (*ended*, with what was not trained, when planned
//!    batches were never published, a stop or every target given up, or some were set aside);
//! 2. *stalled*: a live worker has sent no heartbeat for far longer than its steps take (10x its
//!    mean step, at least 5 s; 60 s before it has a history): hung, and named;
//! 3. *idle* when no drafter runs (after the first take: before it, drafters may still start);
//! 4. *draining*: every target is done (the ring closed), or every planned batch is handed out
//!    (published or claimed, by the work table); the drafters train what is left;
//! 5. *starting*: nothing was taken yet (the drafters wait for the ring to reach `min_ready`),
//!    or the window holds the first take;
//! 6. *idle*: nothing was published or trained and no worker did any work in the window;
//! 7. the sides: the ring *filling* (trained under 85% of published) means the drafters are the
//!    bottleneck whatever the waits (drafters that wait then wait for a bucket or `min_ready`,
//!    not for data), the ring *emptying* the targets; with the ring steady, targets waiting on a
//!    full ring while drafters do not mean the drafters are, drafters waiting on the ring while
//!    targets do not the targets; both calm is *balanced*; both waiting is *neither*.
//!
//! A phase in progress counts up to the snapshot, so a worker computing a batch longer than the
//! period is busy, not idle. The window holds at least [`WINDOW_EVENTS`] ring events (publishes
//! and releases; at most 60 s, never reaching back before the first take), so one long batch or
//! one group step of simultaneous releases does not flip the verdict; on top, a side stays the
//! bottleneck until its evidence falls below half the threshold that made it one (hysteresis).
//!
//! Drafters that spend time in `sync` form a synchronous group: a step lasts as long as its
//! slowest rank, so the group waits on the ring as long as its most waiting rank does, and a rank
//! slow per token (pace under 0.6x its peers' median) holds every other rank, which the verdict
//! says with the share they wait for it. Independent drafters (no `sync`) and targets (which
//! claim work as they go) lose only a slow worker's own share: the ring absorbs it.

use std::collections::VecDeque;

use serde::{Serialize, Serializer};
use shm_ring::{
    role_name, Phase, PhaseMap, Role, SlotCounts, Snapshot, TakePolicy, WorkerName, WorkerSnapshot,
    WorkerState,
};

mod pace;
mod verdict;
mod window;

use verdict::judge;

use crate::numbers::{median, pct};

/// A side counts as waiting when its waiting share is above this (to become the bottleneck's
/// evidence) ...
const WAITS: f64 = 0.20;
/// ... and as not waiting when below this.
const CALM: f64 = 0.10;
/// A straggler's speed per token is below this fraction of its peers' median.
const STRAGGLER: f64 = 0.6;
/// Items a worker must have finished before its pace is judged (the first few are noisy).
const MIN_ITEMS: u64 = 5;
/// A live worker silent this long is hung whatever its history.
const SILENT_S: f64 = 60.0;
/// A live worker silent for this many of its mean steps, and at least `SILENT_MIN_S`, is hung.
const SILENT_STEPS: f64 = 10.0;
const SILENT_MIN_S: f64 = 5.0;
/// Share of the window a drafter group's ranks spend in `sync` above which the verdict says
/// what they wait for.
const SYNC_STALL: f64 = 0.10;
/// Share of the window the drafters (the bottleneck) are not computing above which the verdict
/// says where their GPUs' time goes instead.
const IDLE_NOTE: f64 = 0.10;
/// Ring events (publishes + releases) a window holds at least, unless history is shorter.
pub const WINDOW_EVENTS: u64 = 48;
/// A window never reaches further back than this.
const WINDOW_MAX_S: f64 = 60.0;
/// The ring fills (or empties) when its net change over the window is at least this many
/// batches, twice what the drafters can hold at once (a group step takes a batch per rank at
/// once) and `min_ready` (the gate makes the ring swing by as much), and this share of what was
/// published (trained): a window of 48 events holds about 24 publishes, so smaller imbalances
/// are noise. Half the share keeps a side the bottleneck (hysteresis).
const TREND_MIN: f64 = 4.0;
const TREND_SHARE: f64 = 0.15;

/// One worker over the interval.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WorkerRates {
    /// `"target"` or `"drafter"` in JSON.
    #[serde(with = "role_name")]
    pub role: Role,
    pub index: u32,
    pub gpu: Option<u32>,
    pub pid: u32,
    pub alive: bool,
    pub state: WorkerState,
    pub restarts: u64,
    pub items: u64,
    pub items_per_s: f64,
    pub tokens_per_s: f64,
    pub busy: f64,
    pub waiting: f64,
    /// Share of the interval in each phase (the host's clock).
    pub phases: PhaseMap<f64>,
    /// For a worker that times its device (a GPU's events), what the device did; then `busy`
    /// and `largest_gap_s` are the device's. Null for a host-timed worker.
    pub device: Option<DeviceRates>,
    /// The longest stretch out of `compute` (its GPU idle) that ended in the interval, or is
    /// still going on at its end, in seconds; 0 if none. Gaps are kept per second, so one that
    /// ended in the second the interval starts in counts too.
    pub largest_gap_s: f64,
}

impl WorkerRates {
    pub fn name(&self) -> WorkerName {
        WorkerName {
            role: self.role,
            index: self.index,
        }
    }
}

/// A device-timed worker's device over the interval, as shares of its wall time.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DeviceRates {
    /// Its compute stream running work (kernel time over wall time).
    pub busy: f64,
    /// Device time by phase (copies overlap compute, so these may sum past 1).
    pub phases: PhaseMap<f64>,
    /// Its compute stream idle between two computations, by what the worker's host thread was
    /// doing meanwhile: `sync` is waiting for the group's all-reduce, `copy_in` for a copy,
    /// `wait_empty` for data.
    pub idle: PhaseMap<f64>,
}

/// The ring over the interval.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Interval {
    pub seconds: f64,
    pub published_per_s: f64,
    pub released_per_s: f64,
    /// Batches per second drafters freed unconsumed, refusing them as corrupt: out of the
    /// ring as the released ones are (its flow), not trained.
    pub refused_per_s: f64,
    /// Tokens per second trained (released by drafters).
    pub tokens_per_s: f64,
    /// Share of occupancy samples with no FREE slot (ring full).
    pub full_frac: f64,
    /// Share of occupancy samples with no READY item.
    pub empty_frac: f64,
    /// Share of occupancy samples with fewer READY items than the take policy serves from
    /// (`min_ready`; 1 for FIFO), the ring open: drafters could take nothing.
    pub short_frac: f64,
    pub workers: Vec<WorkerRates>,
}

/// Which side limits the pipeline, or what state the run is in.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Bottleneck {
    Drafters,
    Targets,
    Balanced,
    /// Both sides wait: the time goes elsewhere.
    Neither,
    /// Nothing moved and nobody worked in the window (finished, not started, or stale).
    Idle,
    /// The targets are done (or have every planned batch in hand); the drafters are training
    /// what is left.
    Draining,
    /// Nothing was taken yet: the targets fill the ring up to `min_ready`.
    Starting,
    /// A live worker is silent far past its usual step: hung, and named.
    Stalled,
}

/// Where the ring's occupancy went over the window.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Trend {
    /// Published well above trained: the drafters cannot keep up.
    Filling,
    /// Trained well above published: the targets cannot keep up.
    Emptying,
    Steady,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Verdict {
    pub bottleneck: Bottleneck,
    /// One line for people, with the figures.
    pub line: String,
    /// The worker the verdict holds responsible, named as in the run directory's logs
    /// (`drafter-2`): a silent worker, the rank a drafter group waits for, or else the slowest
    /// straggler (of the bottleneck's side when one side is). `None` when no one worker is at
    /// fault. Written by name in JSON (`"drafter-2"`), as the logs name it.
    #[serde(serialize_with = "name_text")]
    pub worker: Option<WorkerName>,
    /// Workers far slower per token than their peers, with their figures and what they cost.
    pub stragglers: Vec<String>,
    /// Dead workers, a stale ring, and other things to look at.
    pub warnings: Vec<String>,
    pub trend: Trend,
    /// Seconds of history the verdict is judged over.
    pub window_s: f64,
}

/// A worker's name as its text (`"drafter-2"`), or null.
fn name_text<S: Serializer>(w: &Option<WorkerName>, s: S) -> Result<S::Ok, S::Error> {
    match w {
        Some(w) => s.collect_str(w),
        None => s.serialize_none(),
    }
}

/// The longest idle gap of `b` that ended between the seconds of `from_ns` and `to_ns`, or the
/// one in progress, in seconds.
fn largest_gap(b: &WorkerSnapshot, from_ns: u64, to_ns: u64) -> f64 {
    let (first, last) = (from_ns / 1_000_000_000, to_ns / 1_000_000_000);
    let ended = (b.idle_gaps.iter())
        .filter(|(second, _)| (first..=last).contains(second))
        .map(|&(_, ns)| ns);
    ended.chain(b.idle_now_ns).max().unwrap_or(0) as f64 / 1e9
}

fn rates(a: &WorkerSnapshot, b: &WorkerSnapshot, span: (u64, u64)) -> WorkerRates {
    let dt_ns = (span.1.saturating_sub(span.0)).max(1) as f64;
    let phases = PhaseMap::from_fn(|p: Phase| {
        let d = b.phase_ns[p].saturating_sub(a.phase_ns[p]) as f64;
        (d / dt_ns).clamp(0.0, 1.0)
    });
    let waiting = match b.role {
        Role::Producer => phases[Phase::WaitFull],
        Role::Consumer => phases[Phase::WaitEmpty],
    };
    let secs = dt_ns / 1e9;
    let share = |a: u64, b: u64| (b.saturating_sub(a) as f64 / dt_ns).clamp(0.0, 1.0);
    // Both ends must have the device's figures: a worker that began timing its device within
    // the interval has counters that started mid-interval.
    let device = a
        .device
        .as_ref()
        .zip(b.device.as_ref())
        .map(|(x, y)| DeviceRates {
            busy: share(x.busy_ns, y.busy_ns),
            phases: PhaseMap::from_fn(|p: Phase| share(x.phase_ns[p], y.phase_ns[p])),
            idle: PhaseMap::from_fn(|p: Phase| share(x.idle_ns[p], y.idle_ns[p])),
        });
    WorkerRates {
        role: b.role,
        index: b.index,
        gpu: b.gpu,
        pid: b.pid,
        alive: b.alive,
        state: b.state,
        restarts: b.restarts,
        items: b.items,
        items_per_s: b.items.saturating_sub(a.items) as f64 / secs,
        tokens_per_s: b.tokens.saturating_sub(a.tokens) as f64 / secs,
        busy: device.as_ref().map_or(phases[Phase::Compute], |d| d.busy),
        waiting,
        phases,
        device,
        largest_gap_s: largest_gap(b, span.0, span.1),
    }
}

/// Rates between two snapshots of one ring; `occupancy` is slot counts sampled during the
/// interval (may be empty: then the end snapshot's counts stand in).
pub fn interval(a: &Snapshot, b: &Snapshot, occupancy: &[SlotCounts]) -> Interval {
    let dt_ns = (b.taken_at_ns.saturating_sub(a.taken_at_ns)).max(1) as f64;
    let secs = dt_ns / 1e9;
    let samples: Vec<SlotCounts> = if occupancy.is_empty() {
        vec![b.slots]
    } else {
        occupancy.to_vec()
    };
    let n = samples.len() as f64;
    let serves_from = match b.params.policy {
        TakePolicy::Bucketed { min_ready, .. } if !b.closed => min_ready.max(1),
        _ => 1,
    };
    let tokens: u64 = b
        .workers
        .iter()
        .zip(&a.workers)
        .filter(|(w, _)| w.role == Role::Consumer)
        .map(|(w, v)| w.tokens.saturating_sub(v.tokens))
        .sum();
    Interval {
        seconds: secs,
        published_per_s: b.counters.published.saturating_sub(a.counters.published) as f64 / secs,
        released_per_s: b.counters.released.saturating_sub(a.counters.released) as f64 / secs,
        refused_per_s: b.counters.refused.saturating_sub(a.counters.refused) as f64 / secs,
        tokens_per_s: tokens as f64 / secs,
        full_frac: samples.iter().filter(|s| s.free == 0).count() as f64 / n,
        empty_frac: samples.iter().filter(|s| s.ready == 0).count() as f64 / n,
        short_frac: samples.iter().filter(|s| s.ready < serves_from).count() as f64 / n,
        workers: a
            .workers
            .iter()
            .zip(&b.workers)
            .map(|(x, y)| rates(x, y, (a.taken_at_ns, b.taken_at_ns)))
            .collect(),
    }
}

/// The verdict over a sliding window of recent intervals, with hysteresis. Feed it every
/// interval in order: the monitor per tick, `shm-ring-stat --watch` per refresh, a test per
/// observation.
#[derive(Default)]
pub struct Judge {
    /// Snapshots ending the recent intervals, oldest first, each with the occupancy samples of
    /// the interval it ends (the first has none: it only starts the history).
    history: VecDeque<(Snapshot, Vec<SlotCounts>)>,
    /// The last verdict's class, for hysteresis.
    last: Option<Bottleneck>,
    /// Batches whose updates were lost or skipped ([`Judge::set_lost`]).
    lost: u64,
}

impl Judge {
    pub fn new() -> Judge {
        Judge::default()
    }

    /// Tells the verdicts from now on that `batches` of the batches the ring released were
    /// trained in updates that were lost or skipped (the run directory's `lost-steps.jsonl`:
    /// every drafter died, or the group diverged). The ring cannot know it: it counts them
    /// released, and the end would say them trained.
    pub fn set_lost(&mut self, batches: u64) {
        self.lost = batches;
    }

    /// The verdict at `b`, the end of the interval from `a` (with the occupancy samples taken
    /// during it), judged over the window of recent intervals that ends at `b`. Intervals are
    /// expected in order, each starting where the previous ended; one that does not starts a
    /// new history.
    pub fn verdict(&mut self, a: &Snapshot, b: &Snapshot, occupancy: &[SlotCounts]) -> Verdict {
        let continues = self.history.back().is_some_and(|(s, _)| {
            s.taken_at_ns == a.taken_at_ns && s.name == a.name && s.workers.len() == b.workers.len()
        });
        if !continues {
            self.history.clear();
            self.history.push_back((a.clone(), Vec::new()));
        }
        self.history.push_back((b.clone(), occupancy.to_vec()));
        // Forget what no window can reach (keeping the two newest entries at least).
        while self.history.len() > 2
            && (b.taken_at_ns.saturating_sub(self.history[1].0.taken_at_ns) as f64 / 1e9)
                > WINDOW_MAX_S
        {
            self.history.pop_front();
        }
        let start = self.window_start();
        let samples: Vec<SlotCounts> = self
            .history
            .iter()
            .skip(start + 1)
            .flat_map(|(_, occ)| occ.iter().copied())
            .collect();
        let first = &self.history[start].0;
        let iv = interval(first, b, &samples);
        // The window holds the first take: it is mostly start-up.
        let fresh = first.counters.taken == 0;
        let v = judge(b, &iv, self.last, fresh, self.lost);
        self.last = Some(v.bottleneck);
        v
    }

    /// Index in `history` of the window's first snapshot: the newest that leaves at least
    /// `WINDOW_EVENTS` ring events in the window, or the oldest within `WINDOW_MAX_S`; never one
    /// before the first take (start-up waits say nothing about the run), unless the window
    /// would be empty.
    fn window_start(&self) -> usize {
        let n = self.history.len();
        let b = &self.history[n - 1].0;
        let events = |s: &Snapshot| {
            b.counters.published.saturating_sub(s.counters.published)
                + b.counters.released.saturating_sub(s.counters.released)
                + b.counters.refused.saturating_sub(s.counters.refused)
        };
        let mut k = n - 2;
        while k > 0 {
            let s = &self.history[k].0;
            let older = &self.history[k - 1].0;
            if events(s) >= WINDOW_EVENTS
                || (b.taken_at_ns.saturating_sub(older.taken_at_ns) as f64 / 1e9) > WINDOW_MAX_S
                || (older.counters.taken == 0 && b.counters.taken > 0)
            {
                break;
            }
            k -= 1;
        }
        k
    }
}

/// The verdict for one interval of ring `b` (its end snapshot), without a window or history:
/// what [`Judge`] says for a single interval.
pub fn verdict(b: &Snapshot, iv: &Interval) -> Verdict {
    judge(b, iv, None, false, 0)
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = v.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}
