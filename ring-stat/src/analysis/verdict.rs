//! The verdict's rules (see the module doc of `analysis` for their order) and its words: the
//! bottleneck or state, the worker at fault, stragglers and warnings.

use super::pace::{main_phase, pace, silent_worker, slow_workers, working, Slow};
use super::*;

/// The verdict for the window `iv` that ends at snapshot `b`; `last` is the previous verdict's
/// class, for hysteresis; `fresh` says the window holds the first take.
pub(super) fn judge(b: &Snapshot, iv: &Interval, last: Option<Bottleneck>, fresh: bool) -> Verdict {
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
        TakePolicy::Bucketed { min_ready, .. } => min_ready,
        TakePolicy::Fifo => 0,
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
        worker = Some(w.name());
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
            TakePolicy::Bucketed { min_ready, .. } if min_ready > 1 => format!(
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
        worker = slow_rank.or(slow.iter().find(blamed)).map(Slow::name);
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
            TakePolicy::Bucketed { min_ready, .. } if min_ready > 1 => format!(
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
