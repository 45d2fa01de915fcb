//! What snapshots of a ring say: rates over an interval, each worker's time by phase, and a
//! verdict that names the bottleneck, the worker at fault if one is, and the figures that show
//! it. [`Judge`] gives the verdict over a sliding window of recent intervals with hysteresis;
//! the launcher's monitor, `shm-ring-stat` and the scenario tests (tests/tests/verdict.rs) all
//! use it, so they say the same thing.
//!
//! Definitions (all fractions of the interval's wall time, per worker):
//! - *busy*: time in `compute` (the GPU doing model work);
//! - *waiting*: time blocked on the ring (`wait_full` for targets, `wait_empty` for drafters);
//! - everything else (`load`, `copy_in`, `sync`, `checkpoint`, `other`) is *overhead*;
//! - *working*: every phase but the waits on the ring and `sync` (which waits for the other
//!   ranks): the time a worker's own step takes. A worker's *pace* is its working time per
//!   token over its life (all incarnations), from the cumulative counters of the last snapshot.
//!
//! The verdict, in order (the first that holds):
//! 1. *finished*: the ring is closed and empty;
//! 2. *stalled*: a live worker has sent no heartbeat for far longer than its steps take (10x its
//!    mean step, at least 5 s; 60 s before it has a history): hung, and named;
//! 3. *idle* when no drafter runs (after the first take: before it, drafters may still start);
//! 4. *draining*: every target is done (the ring closed), or every planned batch is handed out
//!    and a target is already out of work; the drafters train what is left;
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

use serde::Serialize;

use crate::phase::{Phase, PhaseMap};
use crate::stats::{SlotCounts, Snapshot, WorkerSnapshot, WorkerState};
use crate::worker::{role_name, Role, WorkerName};

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
    /// Share of the interval in each phase.
    pub phases: PhaseMap<f64>,
}

impl WorkerRates {
    pub fn name(&self) -> WorkerName {
        WorkerName {
            role: self.role,
            index: self.index,
        }
    }
}

/// The ring over the interval.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Interval {
    pub seconds: f64,
    pub published_per_s: f64,
    pub released_per_s: f64,
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
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
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
    /// fault.
    pub worker: Option<String>,
    /// Workers far slower per token than their peers, with their figures and what they cost.
    pub stragglers: Vec<String>,
    /// Dead workers, a stale ring, and other things to look at.
    pub warnings: Vec<String>,
    pub trend: Trend,
    /// Seconds of history the verdict is judged over.
    pub window_s: f64,
}

fn rates(a: &WorkerSnapshot, b: &WorkerSnapshot, dt_ns: f64) -> WorkerRates {
    let phases = PhaseMap::from_fn(|p: Phase| {
        let d = b.phase_ns[p].saturating_sub(a.phase_ns[p]) as f64;
        (d / dt_ns).clamp(0.0, 1.0)
    });
    let waiting = match b.role {
        Role::Producer => phases[Phase::WaitFull],
        Role::Consumer => phases[Phase::WaitEmpty],
    };
    let secs = dt_ns / 1e9;
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
        busy: phases[Phase::Compute],
        waiting,
        phases,
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
        crate::params::TakePolicy::Bucketed { min_ready, .. } if !b.closed => min_ready.max(1),
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
        tokens_per_s: tokens as f64 / secs,
        full_frac: samples.iter().filter(|s| s.free == 0).count() as f64 / n,
        empty_frac: samples.iter().filter(|s| s.ready == 0).count() as f64 / n,
        short_frac: samples.iter().filter(|s| s.ready < serves_from).count() as f64 / n,
        workers: a
            .workers
            .iter()
            .zip(&b.workers)
            .map(|(x, y)| rates(x, y, dt_ns))
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
}

impl Judge {
    pub fn new() -> Judge {
        Judge::default()
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
        let v = judge(b, &iv, self.last, fresh);
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
    judge(b, iv, None, false)
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = v.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

/// Phases that are a worker's own work (not waiting on the ring or on other ranks).
fn working(p: Phase) -> bool {
    !p.is_wait() && p != Phase::Sync
}

/// A worker's pace over its life: working nanoseconds per token, and the working phase it
/// spends most in with that phase's share of the working time. `None` before `MIN_ITEMS`.
struct Pace {
    ns_per_token: f64,
    ns_per_item: f64,
    phase: Phase,
    share: f64,
}

fn pace(w: &WorkerSnapshot) -> Option<Pace> {
    let work: Vec<(Phase, u64)> = Phase::ALL
        .iter()
        .filter(|p| working(**p))
        .map(|&p| (p, w.phase_ns[p]))
        .collect();
    let total: u64 = work.iter().map(|(_, ns)| ns).sum();
    if w.items < MIN_ITEMS || w.tokens == 0 || total == 0 {
        return None;
    }
    let (phase, ns) = work
        .iter()
        .copied()
        .max_by_key(|(_, ns)| *ns)
        .unwrap_or((Phase::Compute, 0));
    Some(Pace {
        ns_per_token: total as f64 / w.tokens as f64,
        ns_per_item: total as f64 / w.items as f64,
        phase,
        share: ns as f64 / total as f64,
    })
}

/// A worker far slower per token than the median of its live peers of the same role.
struct Slow {
    role: Role,
    index: u32,
    /// Its time per token over the peers' median.
    ratio: f64,
    phase: Phase,
    share: f64,
}

impl Slow {
    fn name(&self) -> WorkerName {
        WorkerName {
            role: self.role,
            index: self.index,
        }
    }
}

fn slow_workers(b: &Snapshot) -> Vec<Slow> {
    let mut out = Vec::new();
    for role in [Role::Producer, Role::Consumer] {
        let paces: Vec<(&WorkerSnapshot, Pace)> = b
            .workers
            .iter()
            .filter(|w| w.role == role && w.alive)
            .filter_map(|w| Some((w, pace(w)?)))
            .collect();
        for (w, p) in &paces {
            let others: Vec<f64> = paces
                .iter()
                .filter(|(o, _)| o.index != w.index)
                .map(|(_, q)| q.ns_per_token)
                .collect();
            if others.is_empty() {
                continue;
            }
            let m = median(others);
            if m > 0.0 && p.ns_per_token * STRAGGLER > m {
                out.push(Slow {
                    role,
                    index: w.index,
                    ratio: p.ns_per_token / m,
                    phase: p.phase,
                    share: p.share,
                });
            }
        }
    }
    out.sort_by(|a, b| b.ratio.total_cmp(&a.ratio));
    out
}

/// The live worker silent longest past what its steps explain, with its silence in seconds.
fn silent_worker(b: &Snapshot) -> Option<(&WorkerSnapshot, f64, Option<f64>)> {
    b.workers
        .iter()
        .filter(|w| w.alive)
        .filter_map(|w| {
            let age_ns = w.heartbeat_age_ns?;
            let age = age_ns as f64 / 1e9;
            // Its usual step, from the work done up to its last heartbeat: the silence itself
            // (a phase in progress, counted up to the snapshot) must not stretch it.
            let step = pace(w).map(|p| {
                let done = (p.ns_per_item * w.items as f64 - age_ns as f64).max(0.0);
                done / w.items as f64 / 1e9
            });
            let limit = step.map_or(SILENT_S, |s| {
                (SILENT_STEPS * s).clamp(SILENT_MIN_S, SILENT_S)
            });
            (age > limit).then_some((w, age, step))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// The phase a worker spent most of the window in: for a silent worker, the one it is stuck
/// in (a phase in progress counts up to the snapshot).
fn main_phase(w: &WorkerRates) -> Phase {
    w.phases
        .iter()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(Phase::Other, |(p, _)| p)
}

/// The verdict for the window `iv` that ends at snapshot `b`; `last` is the previous verdict's
/// class, for hysteresis; `fresh` says the window holds the first take.
fn judge(b: &Snapshot, iv: &Interval, last: Option<Bottleneck>, fresh: bool) -> Verdict {
    let warnings = warnings(b);
    let live = |role: Role| iv.workers.iter().filter(move |w| w.role == role && w.alive);
    let phase = |w: &WorkerRates, p: Phase| w.phases[p];
    // Drafters that ever waited in `sync` are one synchronous group.
    let drafters = || b.workers.iter().filter(|w| w.role == Role::Consumer);
    let group = drafters().count() >= 2 && drafters().any(|w| w.phase_ns[Phase::Sync] > 0);
    let tw = mean(live(Role::Producer).map(|w| w.waiting));
    // A group steps at its slowest rank's pace: it waits for data while any rank does.
    let dw = if group {
        live(Role::Consumer).map(|w| w.waiting).reduce(f64::max)
    } else {
        mean(live(Role::Consumer).map(|w| w.waiting))
    };
    let published = (iv.published_per_s * iv.seconds).round();
    let released = (iv.released_per_s * iv.seconds).round();
    let net = published - released;
    let share = |c| {
        if last == Some(c) {
            TREND_SHARE / 2.0
        } else {
            TREND_SHARE
        }
    };
    let gate = match b.params.policy {
        crate::params::TakePolicy::Bucketed { min_ready, .. } => min_ready,
        crate::params::TakePolicy::Fifo => 0,
    };
    let swing = (2 * b.params.consumers * b.params.held_per_consumer.max(1)).max(gate);
    let least = TREND_MIN.max(f64::from(swing));
    let trend = if net >= least && net >= share(Bottleneck::Drafters) * published {
        Trend::Filling
    } else if -net >= least && -net >= share(Bottleneck::Targets) * released {
        Trend::Emptying
    } else {
        Trend::Steady
    };
    let moved = published > 0.0 || released > 0.0;
    let worked = iv.workers.iter().filter(|w| w.alive).any(|w| {
        Phase::ALL
            .iter()
            .any(|p| working(*p) && phase(w, *p) > 0.01)
    });
    let slow = slow_workers(b);
    let slow_rank = slow.iter().find(|s| s.role == Role::Consumer && group);
    let sync = mean(live(Role::Consumer).map(|w| phase(w, Phase::Sync))).unwrap_or(0.0);
    let drafters_live = drafters().filter(|w| w.alive).count();
    let live_paces = drafters().filter(|w| w.alive && pace(w).is_some()).count();
    let left = b.slots.ready + b.slots.reading;
    // The end of the plan: every batch claimed and a target already out of work.
    let work_handed_out = b.work.total > 0
        && b.work.done + b.work.claimed >= b.work.total
        && b.producers_done > 0
        && b.counters.taken > 0;
    let mut worker = None;

    let silent = silent_worker(b);
    let (bottleneck, mut line) = if b.closed && left == 0 {
        (
            Bottleneck::Idle,
            format!(
                "finished: every producer is done ({}/{}) and every batch is trained",
                b.producers_done, b.producers_expected
            ),
        )
    } else if let Some((w, age, step)) = silent {
        let role = w.role;
        worker = Some(w.name().to_string());
        let now = iv
            .workers
            .iter()
            .find(|r| r.name() == w.name())
            .map_or(Phase::Other, main_phase)
            .name();
        let usual = step.map_or(String::new(), |s| format!(", its steps take {s:.1}s"));
        let held = if w.role == Role::Consumer && group {
            let others = mean(
                live(Role::Consumer)
                    .filter(|r| r.index != w.index)
                    .map(|r| phase(r, Phase::Sync)),
            )
            .unwrap_or(0.0);
            format!("; the other drafters wait {} in sync for it", pct(others))
        } else {
            format!("; the other {role}s go on without it")
        };
        (
            Bottleneck::Stalled,
            format!(
                "stalled: {role} {} (pid {}) has sent no heartbeat for {age:.0}s, in {now}{usual}: hung, or a step far longer than usual{held}",
                w.index, w.pid
            ),
        )
    } else if drafters_live == 0 && b.counters.taken > 0 {
        (
            Bottleneck::Idle,
            format!(
                "idle: no drafter is running; {} batch(es) wait in the ring",
                b.slots.ready
            ),
        )
    } else if b.closed && left > 0 {
        (
            Bottleneck::Draining,
            format!(
                "draining: the targets are done ({}/{}); the drafters are training the last {left} batch(es) ({} ready, {} in training)",
                b.producers_done, b.producers_expected, b.slots.ready, b.slots.reading
            ),
        )
    } else if work_handed_out {
        (
            Bottleneck::Draining,
            format!(
                "draining: every planned batch is handed out ({} of {} published, {} claimed; targets done {}/{}); the drafters are training the last {left} batch(es) ({} ready, {} in training)",
                b.work.done, b.work.total, b.work.claimed, b.producers_done, b.producers_expected, b.slots.ready, b.slots.reading
            ),
        )
    } else if fresh && b.counters.taken > 0 && !b.closed {
        (
            Bottleneck::Starting,
            format!(
                "starting: the drafters took their first {} batch(es) in the last {:.1}s, after waiting for the ring to fill",
                b.counters.taken, iv.seconds
            ),
        )
    } else if b.counters.taken == 0 && !b.closed {
        let gate = match b.params.policy {
            crate::params::TakePolicy::Bucketed { min_ready, .. } if min_ready > 1 => format!(
                "the drafters wait until {min_ready} batches are READY ({} now, {} being written)",
                b.slots.ready, b.slots.writing
            ),
            _ => format!(
                "the targets compute the first batches ({} being written)",
                b.slots.writing
            ),
        };
        (Bottleneck::Starting, format!("starting: {gate}"))
    } else if !moved && !worked {
        (
            Bottleneck::Idle,
            format!(
                "idle: nothing was published or trained, and no worker worked, in the last {:.1}s",
                iv.seconds
            ),
        )
    } else {
        let e = Evidence {
            t: tw,
            d: dw,
            trend,
            published,
            released,
        };
        sides(b, iv, last, &e)
    };

    // A synchronous group waits for its slowest rank at every step: say for whom, unless the
    // ranks wait for one that waits for data (the targets' fault, said above).
    if group
        && sync >= SYNC_STALL
        && !matches!(
            bottleneck,
            Bottleneck::Targets | Bottleneck::Starting | Bottleneck::Stalled
        )
    {
        match slow_rank {
            Some(s) => {
                let others = mean(
                    live(Role::Consumer)
                        .filter(|w| w.index != s.index)
                        .map(|w| phase(w, Phase::Sync)),
                )
                .unwrap_or(sync);
                line.push_str(&format!(
                    "; drafters wait {} in sync for drafter {} ({} per token {:.1}x the group median)",
                    pct(others),
                    s.index,
                    s.phase.name(),
                    s.ratio
                ));
            }
            // Every rank's pace is known and none is slow: the batches differ.
            None if live_paces == drafters_live => line.push_str(&format!(
                "; drafters wait {} in sync: their batches take unequal time (no rank is slow per token)",
                pct(sync)
            )),
            None => line.push_str(&format!("; drafters wait {} in sync", pct(sync))),
        }
    }

    let stragglers: Vec<String> = slow
        .iter()
        .map(|s| {
            let role = s.role;
            let ips = |w: &WorkerRates| w.items_per_s;
            let me = iv.workers.iter().find(|w| w.name() == s.name());
            let peers: Vec<f64> = live(role).filter(|w| w.index != s.index).map(ips).collect();
            let items = match (me, peers.is_empty()) {
                (Some(me), false) => {
                    format!(", {:.1} items/s vs peers {:.1}", me.items_per_s, median(peers))
                }
                _ => String::new(),
            };
            let cost = match s.role {
                Role::Producer => {
                    "targets claim work as they go, so the others take more: it costs only its own share".to_string()
                }
                Role::Consumer if group => {
                    let others = mean(
                        live(Role::Consumer)
                            .filter(|w| w.index != s.index)
                            .map(|w| phase(w, Phase::Sync)),
                    )
                    .unwrap_or(0.0);
                    format!(
                        "the group waits for it at every step: the other ranks wait {} in sync",
                        pct(others)
                    )
                }
                Role::Consumer => {
                    "the ring absorbs it: the other drafters take more batches, so it costs only its own share".to_string()
                }
            };
            format!(
                "{role} {} is slow: {:.1}x its peers' time per token ({} in {}{items}); {cost}",
                s.index,
                s.ratio,
                pct(s.share),
                s.phase.name()
            )
        })
        .collect();
    if worker.is_none() {
        // A slow worker on the side that is not the bottleneck holds nothing up: listed as a
        // straggler, not blamed.
        let blamed = |s: &&Slow| match bottleneck {
            Bottleneck::Drafters => s.role == Role::Consumer,
            Bottleneck::Targets => s.role == Role::Producer,
            _ => true,
        };
        worker = slow_rank
            .or(slow.iter().find(blamed))
            .map(|s| s.name().to_string());
    }
    Verdict {
        bottleneck,
        line,
        worker,
        stragglers,
        warnings,
        trend,
        window_s: iv.seconds,
    }
}

/// What the sides did over the window.
struct Evidence {
    /// Targets' mean waiting share, drafters' (a group's: its most waiting rank's).
    t: Option<f64>,
    d: Option<f64>,
    trend: Trend,
    /// Batches published and trained in the window.
    published: f64,
    released: f64,
}

/// Which side limits the pipeline, from the waits and the ring's trend over the window.
fn sides(
    b: &Snapshot,
    iv: &Interval,
    last: Option<Bottleneck>,
    e: &Evidence,
) -> (Bottleneck, String) {
    let (t, d) = (e.t.unwrap_or(0.0), e.d.unwrap_or(0.0));
    // Hysteresis: a side that was the bottleneck stays it until its evidence halves.
    let hi = |c| if last == Some(c) { CALM } else { WAITS };
    let lo = |c| if last == Some(c) { WAITS } else { CALM };
    let by_waits_d = t > hi(Bottleneck::Drafters) && d < lo(Bottleneck::Drafters);
    let by_waits_t = d > hi(Bottleneck::Targets) && t < lo(Bottleneck::Targets);
    // The trend wins over the waits: drafters that wait while the ring fills wait for a bucket
    // or for `min_ready` (the policy), not for data; targets never wait on an emptying ring.
    let drafters = match e.trend {
        Trend::Filling => true,
        Trend::Emptying => false,
        Trend::Steady => by_waits_d,
    };
    let targets = !drafters && (e.trend == Trend::Emptying || by_waits_t);
    let ring = format!("{}/{}", b.slots.ready, b.params.slots);
    let (secs, net) = (iv.seconds, e.published - e.released);
    if drafters && by_waits_d {
        (
            Bottleneck::Drafters,
            format!(
                "drafters are the bottleneck: ring full {} of the time, targets waited {} (drafters waited {})",
                pct(iv.full_frac), pct(t), pct(d)
            ),
        )
    } else if drafters {
        (
            Bottleneck::Drafters,
            format!(
                "drafters are the bottleneck: the ring fills (+{net:.0} batches in {secs:.1}s, now {ring} ready): they train {:.1}/s of the {:.1}/s published (targets waited {}, drafters {})",
                e.released / secs, e.published / secs, pct(t), pct(d)
            ),
        )
    } else if targets && by_waits_t {
        let short = match b.params.policy {
            crate::params::TakePolicy::Bucketed { min_ready, .. } if min_ready > 1 => format!(
                "ring below min_ready ({min_ready}) {} of the time",
                pct(iv.short_frac)
            ),
            _ => format!("ring empty {} of the time", pct(iv.empty_frac)),
        };
        (
            Bottleneck::Targets,
            format!(
                "targets are the bottleneck: {short}, drafters waited {} (targets waited {})",
                pct(d),
                pct(t)
            ),
        )
    } else if targets {
        (
            Bottleneck::Targets,
            format!(
                "targets are the bottleneck: the ring empties ({net:.0} batches in {secs:.1}s, now {ring} ready): they publish {:.1}/s of the {:.1}/s trained (drafters waited {}, targets {})",
                e.published / secs, e.released / secs, pct(d), pct(t)
            ),
        )
    } else if t < WAITS && d < WAITS {
        (
            Bottleneck::Balanced,
            format!(
                "balanced: targets waited {}, drafters waited {}; the ring holds steady ({ring} ready)",
                pct(t),
                pct(d)
            ),
        )
    } else {
        (
            Bottleneck::Neither,
            format!(
                "both sides wait (targets {}, drafters {}): the time goes elsewhere; see each worker's phases",
                pct(t),
                pct(d)
            ),
        )
    }
}

/// Dead, unrecovered, retired and silent workers, and a stale ring.
fn warnings(b: &Snapshot) -> Vec<String> {
    let mut warnings = Vec::new();
    if !b.creator_alive {
        warnings.push(format!(
            "stale: creator pid {} is gone; `shm-ring-stat --gc` removes this ring",
            b.creator.pid
        ));
    }
    for w in &b.workers {
        let role = w.role;
        match w.state {
            WorkerState::Dead => warnings.push(format!(
                "{role} {} died (pid {}) and was recovered; not running now",
                w.index, w.pid
            )),
            WorkerState::Alive if !w.alive => warnings.push(format!(
                "{role} {} (pid {}) is registered but its process is gone: not recovered yet",
                w.index, w.pid
            )),
            WorkerState::Retired => warnings.push(format!(
                "{role} {} was retired after crashing past its restart limit",
                w.index
            )),
            _ => {}
        }
    }
    if let Some((w, age, _)) = silent_worker(b) {
        warnings.push(format!(
            "{} {} (pid {}) has sent no heartbeat for {age:.0}s: hung, or in a very long step",
            w.role, w.index, w.pid
        ));
    }
    warnings
}
