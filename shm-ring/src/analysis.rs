//! What two snapshots of a ring say about the interval between them: rates, each worker's time
//! by phase, and a verdict that names the bottleneck and any straggler, with the figures that
//! show it. Pure functions of snapshots, so the same analysis serves `shm-ring-stat`, the
//! launcher and tests.
//!
//! Definitions (all fractions of the interval's wall time, per worker):
//! - *busy*: time in `compute` (the GPU doing model work);
//! - *waiting*: time blocked on the ring (`wait_full` for targets, `wait_empty` for drafters);
//! - everything else (`load`, `copy_in`, `sync`, `checkpoint`, `other`) is *overhead*.
//!
//! Verdict rules: a side that waits much while the other does not is fed by (or feeds) the
//! bottleneck. Targets waiting on a full ring mean the drafters are too slow; drafters waiting on
//! an empty ring (or one below `min_ready`) mean the targets are. A worker whose busy share is
//! far below its peers' is a straggler, and its largest non-compute phase says where its time
//! went.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::stats::{SlotCounts, Snapshot, WorkerSnapshot, WorkerState};
use crate::{Phase, Role};

/// A side counts as waiting when its mean waiting share is above this.
const WAITS: f64 = 0.20;
/// And as not waiting when below this.
const CALM: f64 = 0.10;
/// A straggler's busy share is below this fraction of its peers' median.
const STRAGGLER: f64 = 0.6;
/// A live worker silent this long is worth a warning (workers beat at every ring operation and
/// every 100 ms while blocked on the ring).
const SILENT_S: f64 = 60.0;

/// One worker over the interval.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WorkerRates {
    pub role: &'static str,
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
    pub phases: BTreeMap<&'static str, f64>,
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
    pub workers: Vec<WorkerRates>,
}

/// Share of the interval a drafter group's ranks spend in `sync` above which the verdict names
/// the rank the others wait for.
const SYNC_STALL: f64 = 0.10;

/// "drafters wait 37% in sync for drafter 2 (compute per token 3.0x the group median)" when
/// the ranks of a synchronous group spend a real share of their time waiting for each other.
/// The rank named is the slowest per token over its life (cumulative compute time over tokens
/// trained, from the snapshot), not the one with the longest batch of the moment: a batch's
/// length changes every step, a slow GPU does not, and one interval holds too few batches to
/// tell them apart. With no rank slow per token, the waits come from batches of unequal length.
fn group_stall(b: &Snapshot, drafters: Vec<&WorkerRates>) -> Option<String> {
    if drafters.len() < 2 {
        return None;
    }
    let phase = |w: &WorkerRates, p: &str| w.phases.get(p).copied().unwrap_or(0.0);
    let wait = mean(drafters.iter().map(|w| phase(w, "sync")))?;
    if wait < SYNC_STALL {
        return None;
    }
    // Compute nanoseconds per token trained, over each live rank's incarnation.
    let costs: Vec<(u32, f64)> = drafters
        .iter()
        .filter_map(|w| {
            let rec = b
                .workers
                .iter()
                .find(|r| r.role == Role::Consumer && r.index == w.index && r.alive)?;
            let ns = *rec.phase_ns.get("compute")?;
            (rec.tokens > 0).then(|| (w.index, ns as f64 / rec.tokens as f64))
        })
        .collect();
    let slowest = costs.iter().max_by(|a, b| a.1.total_cmp(&b.1));
    let m = (costs.len() >= 2).then(|| median(costs.iter().map(|c| c.1).collect()));
    match (slowest, m) {
        (Some(&(k, c)), Some(m)) if m > 0.0 && c >= SLOW_RANK * m => {
            let others = mean(
                drafters
                    .iter()
                    .filter(|w| w.index != k)
                    .map(|w| phase(w, "sync")),
            )
            .unwrap_or(wait);
            Some(format!(
                "drafters wait {} in sync for drafter {k} (compute per token {:.1}x the group median)",
                pct(others),
                c / m
            ))
        }
        _ => Some(format!(
            "drafters wait {} in sync: their batches take unequal time (no rank is slow per token)",
            pct(wait)
        )),
    }
}

/// How much slower per token than the group's median a rank must be to be named.
const SLOW_RANK: f64 = 1.5;

/// Which side limits the pipeline.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Bottleneck {
    Drafters,
    Targets,
    Balanced,
    /// Both sides wait: the time goes elsewhere (start-up, a stall).
    Neither,
    /// Nothing moved in the interval (finished, not started, or stale).
    Idle,
    /// Every producer is done; the consumers are training what is left.
    Draining,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Verdict {
    pub bottleneck: Bottleneck,
    /// One line for people, with the figures.
    pub line: String,
    pub stragglers: Vec<String>,
    /// Dead workers, a stale ring, and other things to look at.
    pub warnings: Vec<String>,
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Producer => "target",
        Role::Consumer => "drafter",
    }
}

fn rates(a: &WorkerSnapshot, b: &WorkerSnapshot, dt_ns: f64) -> WorkerRates {
    let frac = |name: &str| {
        let d = b.phase_ns[name].saturating_sub(a.phase_ns[name]) as f64;
        (d / dt_ns).clamp(0.0, 1.0)
    };
    let phases: BTreeMap<&'static str, f64> = Phase::ALL
        .iter()
        .map(|p| (p.name(), frac(p.name())))
        .collect();
    let waiting = match b.role {
        Role::Producer => phases["wait_full"],
        Role::Consumer => phases["wait_empty"],
    };
    let secs = dt_ns / 1e9;
    WorkerRates {
        role: role_name(b.role),
        index: b.index,
        gpu: b.gpu,
        pid: b.pid,
        alive: b.alive,
        state: b.state,
        restarts: b.restarts,
        items: b.items,
        items_per_s: b.items.saturating_sub(a.items) as f64 / secs,
        tokens_per_s: b.tokens.saturating_sub(a.tokens) as f64 / secs,
        busy: phases["compute"],
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
        workers: a
            .workers
            .iter()
            .zip(&b.workers)
            .map(|(x, y)| rates(x, y, dt_ns))
            .collect(),
    }
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

/// The verdict for an interval of ring `b` (its end snapshot).
pub fn verdict(b: &Snapshot, iv: &Interval) -> Verdict {
    let mut warnings = Vec::new();
    if !b.creator_alive {
        warnings.push(format!(
            "stale: creator pid {} is gone; `shm-ring-stat --gc` removes this ring",
            b.creator.pid
        ));
    }
    for w in &iv.workers {
        match w.state {
            WorkerState::Dead => warnings.push(format!(
                "{} {} died (pid {}) and was recovered; not running now",
                w.role, w.index, w.pid
            )),
            WorkerState::Alive if !w.alive => warnings.push(format!(
                "{} {} (pid {}) is registered but its process is gone: not recovered yet",
                w.role, w.index, w.pid
            )),
            WorkerState::Retired => warnings.push(format!(
                "{} {} was retired after crashing past its restart limit",
                w.role, w.index
            )),
            _ => {}
        }
    }
    for w in b.workers.iter().filter(|w| w.alive) {
        let age = w.heartbeat_age_ns.unwrap_or(0) as f64 / 1e9;
        if age > SILENT_S {
            warnings.push(format!(
                "{} {} (pid {}) has sent no heartbeat for {age:.0}s: hung, or in a very long step",
                role_name(w.role),
                w.index,
                w.pid
            ));
        }
    }
    let live = |role: &'static str| iv.workers.iter().filter(move |w| w.role == role && w.alive);
    let tw = mean(live("target").map(|w| w.waiting));
    let dw = mean(live("drafter").map(|w| w.waiting));
    let moved = iv.published_per_s > 0.0 || iv.released_per_s > 0.0;
    let left = b.slots.ready + b.slots.reading;
    let (bottleneck, mut line) = match (tw, dw) {
        _ if b.closed && left > 0 => (
            Bottleneck::Draining,
            format!(
                "draining: the targets are done ({}/{}); the drafters are training the last {left} batch(es) ({} ready, {} in training)",
                b.producers_done, b.producers_expected, b.slots.ready, b.slots.reading
            ),
        ),
        _ if !moved && b.closed => (
            Bottleneck::Idle,
            format!("finished: every producer is done ({}/{}) and nothing moved", b.producers_done, b.producers_expected),
        ),
        _ if !moved => (
            Bottleneck::Idle,
            "idle: nothing was published or trained in the interval".to_string(),
        ),
        (Some(t), Some(d)) if t > WAITS && d < CALM => (
            Bottleneck::Drafters,
            format!(
                "drafters are the bottleneck: ring full {} of the time, targets waited {} (drafters waited {})",
                pct(iv.full_frac), pct(t), pct(d)
            ),
        ),
        (Some(t), Some(d)) if d > WAITS && t < CALM => (
            Bottleneck::Targets,
            format!(
                "targets are the bottleneck: ring empty {} of the time, drafters waited {} (targets waited {})",
                pct(iv.empty_frac), pct(d), pct(t)
            ),
        ),
        (Some(t), Some(d)) if t < WAITS && d < WAITS => (
            Bottleneck::Balanced,
            format!("balanced: targets waited {}, drafters waited {}", pct(t), pct(d)),
        ),
        (t, d) => (
            Bottleneck::Neither,
            format!(
                "both sides wait (targets {}, drafters {}): the time goes elsewhere; see each worker's phases",
                pct(t.unwrap_or(0.0)), pct(d.unwrap_or(0.0))
            ),
        ),
    };
    // A synchronous drafter group waits for its slowest rank at every step: name it.
    let group = group_stall(b, live("drafter").collect());
    if let Some(g) = &group {
        line.push_str("; ");
        line.push_str(g);
    }
    let mut stragglers = Vec::new();
    if moved {
        for role in ["target", "drafter"] {
            if role == "drafter" && group.is_some() {
                // In a group the fast ranks wait in sync (low busy); the straggler is named above.
                continue;
            }
            let peers: Vec<&WorkerRates> = live(role).collect();
            if peers.len() < 2 {
                continue;
            }
            for w in &peers {
                let others: Vec<f64> = peers
                    .iter()
                    .filter(|p| p.index != w.index)
                    .map(|p| p.busy)
                    .collect();
                let m = median(others);
                if m > 0.2 && w.busy < STRAGGLER * m {
                    let (phase, share) = w
                        .phases
                        .iter()
                        .filter(|(name, _)| **name != "compute")
                        .max_by(|a, b| a.1.total_cmp(b.1))
                        .map(|(n, s)| (*n, *s))
                        .unwrap_or(("other", 0.0));
                    stragglers.push(format!(
                        "{role} {} busy {} vs peers {}: {} in {phase}",
                        w.index,
                        pct(w.busy),
                        pct(m),
                        pct(share)
                    ));
                }
            }
        }
    }
    Verdict {
        bottleneck,
        line,
        stragglers,
        warnings,
    }
}
