//! Each worker's pace over its life, the stragglers it shows, and silent (hung) workers: the
//! per-worker evidence the verdict weighs.

use super::*;

/// Phases that are a worker's own work (not waiting on the ring or on other ranks).
pub(super) fn working(p: Phase) -> bool {
    !p.is_wait() && p != Phase::Sync
}

/// A worker's pace over its life: working nanoseconds per token, and the working phase it
/// spends most in with that phase's share of the working time. `None` before `MIN_ITEMS`.
pub(super) struct Pace {
    pub(super) ns_per_token: f64,
    pub(super) ns_per_item: f64,
    pub(super) phase: Phase,
    pub(super) share: f64,
}

pub(super) fn pace(w: &WorkerSnapshot) -> Option<Pace> {
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
pub(super) struct Slow {
    pub(super) role: Role,
    pub(super) index: u32,
    /// Its time per token over the peers' median.
    pub(super) ratio: f64,
    pub(super) phase: Phase,
    pub(super) share: f64,
}

impl Slow {
    pub(super) fn name(&self) -> WorkerName {
        WorkerName {
            role: self.role,
            index: self.index,
        }
    }
}

pub(super) fn slow_workers(b: &Snapshot) -> Vec<Slow> {
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
            let Some(m) = median(others) else {
                continue;
            };
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
pub(super) fn silent_worker(b: &Snapshot) -> Option<(&WorkerSnapshot, f64, Option<f64>)> {
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
pub(super) fn main_phase(w: &WorkerRates) -> Phase {
    w.phases
        .iter()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(Phase::Other, |(p, _)| p)
}
