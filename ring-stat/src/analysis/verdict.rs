//! The verdict's rules and its words: the bottleneck or state, the worker at fault, stragglers
//! and warnings.
//!
//! A verdict is made in three steps, each a list of small named functions over one [`Window`]
//! (the figures of the window, computed once):
//! 1. [`RULES`], in order: the first that holds names the state (finished, stalled, draining,
//!    starting, idle); when none does, [`sides`] says which side limits the pipeline. A new
//!    state is a new function in that list, at the place its precedence says (see the module
//!    doc of `analysis` for why the order is what it is).
//! 2. [`NOTES`], in order: what is added to any call (where the drafters' GPUs spend the time
//!    they do not compute when the drafters are the bottleneck, what a drafter group waits for
//!    in `sync`, the worker to blame when the rule named none).
//! 3. The stragglers and the warnings, listed whatever the call.
//!
//! Length: past 500 lines on purpose: every rule and note with its words is here, in the
//! order the verdict applies them, so one file reads as the whole verdict.

use super::pace::{main_phase, silent_worker, Slow};
use super::window::Window;
use super::*;

/// The verdict for the window `iv` that ends at snapshot `b`; `last` is the previous verdict's
/// class, for hysteresis; `fresh` says the window holds the first take.
pub(super) fn judge(
    b: &Snapshot,
    iv: &Interval,
    last: Option<Bottleneck>,
    fresh: bool,
    lost: u64,
) -> Verdict {
    let w = Window::new(b, iv, last, fresh, lost);
    let mut call = RULES
        .iter()
        .find_map(|rule| rule(&w))
        .unwrap_or_else(|| sides(&w));
    for note in NOTES {
        note(&w, &mut call);
    }
    Verdict {
        bottleneck: call.bottleneck,
        line: call.line,
        worker: call.worker,
        stragglers: stragglers(&w),
        warnings: warnings(b),
        trend: w.trend,
        window_s: iv.seconds,
    }
}

/// A rule's finding: the class, the line for people, and the worker it holds responsible.
struct Call {
    bottleneck: Bottleneck,
    line: String,
    worker: Option<WorkerName>,
}

impl Call {
    fn new(bottleneck: Bottleneck, line: String) -> Call {
        Call {
            bottleneck,
            line,
            worker: None,
        }
    }
}

/// A rule of the run's state: `Some` if it holds over the window.
type Rule = fn(&Window) -> Option<Call>;

/// The state rules, first match wins; [`sides`] decides when none holds.
const RULES: [Rule; 9] = [
    finished,
    stale,
    stalled,
    no_drafter,
    targets_done,
    plan_handed_out,
    first_take,
    not_started,
    nothing_moved,
];

/// What is added to a call, in order, whichever rule made it.
const NOTES: [fn(&Window, &mut Call); 3] = [drafters_idle, sync_wait, blame_slowest];

/// The ring is closed and empty: the run is over. "Every batch is trained" only when it is:
/// every planned batch published (the work table says so), none set aside, none refused as
/// corrupt by a drafter and none trained in an update that was lost or skipped. A ring closed
/// early (a stop, or every target given up) or with batches set aside, refused or in lost
/// updates ended short of its plan, and says by how much: the ring released the batches of lost
/// updates, so they were delivered, not trained (the summary's note says the same).
fn finished(w: &Window) -> Option<Call> {
    let b = w.b;
    if !b.closed || w.left > 0 {
        return None;
    }
    let (done, expected) = (b.producers_done, b.producers_expected);
    // Planned batches never published, those set aside apart (a target's set aside is never
    // published either, and is counted in both the work table and the ring's counter).
    let unpublished = (b.work.total).saturating_sub(b.work.done + b.work.set_aside);
    let aside = b.counters.set_aside.max(b.work.set_aside);
    let refused = b.counters.refused;
    // Released, so delivered, but not in the weights: what the rest is said to be.
    let rest = match w.lost {
        0 => "is trained".to_string(),
        n => format!(
            "was delivered, {n} of them in lost updates (lost-steps.jsonl; a resume trains them)"
        ),
    };
    let line = if unpublished == 0 && aside == 0 && refused == 0 && w.lost == 0 {
        format!("finished: every producer is done ({done}/{expected}) and every batch is trained")
    } else if unpublished == 0 && aside == 0 && refused == 0 {
        format!("ended: every producer is done ({done}/{expected}) and every batch {rest}")
    } else {
        let retired = (b.workers.iter())
            .filter(|w| w.state == WorkerState::Retired)
            .count();
        let retired = match retired {
            0 => String::new(),
            n => format!(", {n} retired"),
        };
        let planned = match b.work.total {
            0 => String::new(),
            total => format!("{unpublished} of {total} planned batch(es) not published, "),
        };
        // Published, taken and refused by the drafters: a target's states they cannot take.
        let refused = match refused {
            0 => String::new(),
            n => format!(", {n} refused as corrupt by the drafters (see their logs)"),
        };
        format!(
            "ended: the producers are done ({done}/{expected}{retired}) with {planned}{aside} set aside (never trained){refused}; every other batch {rest}"
        )
    };
    Some(Call::new(Bottleneck::Idle, line))
}

/// The ring's launcher is gone, and its workers with it (they die with it): nothing will move
/// again, whatever the figures were. Before, a killed launcher's ring read "starting" or
/// "stalled" as if the run went on.
fn stale(w: &Window) -> Option<Call> {
    let b = w.b;
    if b.creator_alive {
        return None;
    }
    Some(Call::new(
        Bottleneck::Idle,
        format!(
            "stale: the launcher (pid {}) is gone and its workers with it; nothing will move: `shm-ring-stat --gc` removes this ring, `launcher --resume RUN_DIR` goes on with the run",
            b.creator.pid
        ),
    ))
}

/// A live worker is silent far past its usual step: hung, and named, whatever else holds.
fn stalled(w: &Window) -> Option<Call> {
    let (s, age, step) = w.silent?;
    let role = s.role;
    let now =
        w.iv.workers
            .iter()
            .find(|r| r.name() == s.name())
            .map_or(Phase::Other, main_phase)
            .name();
    let usual = step.map_or(String::new(), |s| format!(", its steps take {s:.1}s"));
    let peers = (w.b.workers.iter())
        .filter(|x| x.role == role && x.index != s.index && x.alive)
        .count();
    let held = if peers == 0 {
        // "The other drafters go on without it" of a run with one drafter was false.
        let side = match role {
            Role::Producer => "no batch is made",
            Role::Consumer => "no batch is trained",
        };
        format!("; it is the only live {role}: {side} while it is silent")
    } else if s.role == Role::Consumer && w.group {
        let others = w.others_sync(s.index).unwrap_or(0.0);
        format!("; the other drafters wait {} in sync for it", pct(others))
    } else {
        format!("; the other {role}s go on without it")
    };
    Some(Call {
        bottleneck: Bottleneck::Stalled,
        line: format!(
            "stalled: {role} {} (pid {}) has sent no heartbeat for {age:.0}s, in {now}{usual}: hung, or a step far longer than usual{held}",
            s.index, s.pid
        ),
        worker: Some(s.name()),
    })
}

/// No drafter runs after the first take, or once one has died (before either, drafters may
/// still be starting): a drafter given up at its start leaves nobody to train what is left.
fn no_drafter(w: &Window) -> Option<Call> {
    let started = w.b.counters.taken > 0 || w.drafters_down > 0;
    (w.drafters_live == 0 && started).then(|| {
        Call::new(
            Bottleneck::Idle,
            format!(
                "idle: no drafter is running; {} batch(es) wait in the ring",
                w.b.slots.ready
            ),
        )
    })
}

/// Every target is done (the ring closed): the drafters train what is left.
fn targets_done(w: &Window) -> Option<Call> {
    let b = w.b;
    (b.closed && w.left > 0).then(|| {
        Call::new(
            Bottleneck::Draining,
            format!(
                "draining: the targets are done ({}/{}); the drafters are training the last {} batch(es) ({} ready, {} held by drafters)",
                b.producers_done, b.producers_expected, w.left, b.slots.ready, b.slots.reading
            ),
        )
    })
}

/// The end of the plan: every planned batch is published or being computed (the work table
/// says so), so a target with none in hand has nothing left to claim. Targets finish only once
/// every batch is settled, when the ring closes, so their being done cannot tell this earlier.
fn plan_handed_out(w: &Window) -> Option<Call> {
    let b = w.b;
    let handed_out = b.work.total > 0
        && b.work.done + b.work.claimed + b.work.set_aside >= b.work.total
        && b.counters.taken > 0;
    handed_out.then(|| {
        Call::new(
            Bottleneck::Draining,
            format!(
                "draining: every planned batch is handed out ({} of {} published, {} being computed by the targets); the drafters train what the ring holds ({} ready, {} held by drafters)",
                b.work.done, b.work.total, b.work.claimed, b.slots.ready, b.slots.reading
            ),
        )
    })
}

/// The window holds the first take: it is mostly start-up.
fn first_take(w: &Window) -> Option<Call> {
    let b = w.b;
    (w.fresh && b.counters.taken > 0 && !b.closed).then(|| {
        Call::new(
            Bottleneck::Starting,
            format!(
                "starting: the drafters took their first {} batch(es) in the last {:.1}s, after waiting for the ring to fill",
                b.counters.taken, w.iv.seconds
            ),
        )
    })
}

/// Nothing was taken yet: the drafters wait for the ring to reach `min_ready`, or the targets
/// compute the first batches.
fn not_started(w: &Window) -> Option<Call> {
    let b = w.b;
    if b.counters.taken > 0 || b.closed {
        return None;
    }
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
    Some(Call::new(Bottleneck::Starting, format!("starting: {gate}")))
}

/// Nothing was published or trained and no worker did any work in the window.
fn nothing_moved(w: &Window) -> Option<Call> {
    (!w.moved && !w.worked).then(|| {
        Call::new(
            Bottleneck::Idle,
            format!(
                "idle: nothing was published or trained, and no worker worked, in the last {:.1}s",
                w.iv.seconds
            ),
        )
    })
}

/// Which side limits the pipeline, from the waits and the ring's trend over the window: what
/// the verdict says when no state rule holds.
fn sides(w: &Window) -> Call {
    let (b, iv, last) = (w.b, w.iv, w.last);
    let (t, d) = (w.t_wait.unwrap_or(0.0), w.d_wait.unwrap_or(0.0));
    // Hysteresis: a side that was the bottleneck stays it until its evidence halves.
    let hi = |c| if last == Some(c) { CALM } else { WAITS };
    let lo = |c| if last == Some(c) { WAITS } else { CALM };
    let by_waits_d = t > hi(Bottleneck::Drafters) && d < lo(Bottleneck::Drafters);
    let by_waits_t = d > hi(Bottleneck::Targets) && t < lo(Bottleneck::Targets);
    // The trend wins over the waits: drafters that wait while the ring fills wait for a bucket
    // or for `min_ready` (the policy), not for data; targets never wait on an emptying ring.
    let drafters = match w.trend {
        Trend::Filling => true,
        Trend::Emptying => false,
        Trend::Steady => by_waits_d,
    };
    let targets = !drafters && (w.trend == Trend::Emptying || by_waits_t);
    let ring = format!("{}/{}", b.slots.ready, b.params.slots);
    let (secs, net) = (iv.seconds, w.published - w.freed);
    let (bottleneck, line) = if drafters && by_waits_d {
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
                w.released / secs, w.published / secs, pct(t), pct(d)
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
                w.published / secs, w.released / secs, pct(d), pct(t)
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
    };
    Call::new(bottleneck, line)
}

/// The drafters are the bottleneck, yet their GPUs do not compute all the time: say where the
/// rest goes (the live drafters' mean share of each other phase, largest first, those of 1% or
/// more, at most three; `sync` left to [`sync_wait`] when it speaks), and the longest stretch
/// any of them was out of compute: "drafter GPUs idle 31% (longest gap 420ms): 24% in the
/// all-reduce (sync), 7% copying batches in". For drafters timed with CUDA events the idle share
/// is their devices' and the parts are the device's idle time by what the host did meanwhile.
/// The time
/// a GPU could compute but does not is what more GPUs cannot buy back; one long gap and many
/// short ones call for different fixes.
fn drafters_idle(w: &Window, call: &mut Call) {
    if call.bottleneck != Bottleneck::Drafters {
        return;
    }
    let Some(compute) = mean(w.live(Role::Consumer).map(|r| r.busy)) else {
        return;
    };
    let idle = 1.0 - compute.min(1.0);
    if idle < IDLE_NOTE {
        return;
    }
    // Where the idle time goes: a device-timed drafter's device idle time by what its host was
    // doing meanwhile (its host in `compute` too: launching work, or the host's part of the
    // step), else the host's own phases out of `compute`.
    let share = |r: &WorkerRates, p: Phase| match &r.device {
        Some(d) => d.idle[p],
        None if p == Phase::Compute => 0.0,
        None => r.phases[p],
    };
    let mut parts: Vec<(f64, Phase)> = Phase::ALL
        .iter()
        // The group's wait in sync gets its own clause, with the figure of the ranks that
        // wait (not this mean over every rank, the slow one included).
        .filter(|&&p| p != Phase::Sync || !sync_said(w, call))
        .filter_map(|&p| Some((mean(w.live(Role::Consumer).map(|r| share(r, p)))?, p)))
        .filter(|&(share, _)| share >= 0.01)
        .collect();
    parts.sort_by(|a, b| b.0.total_cmp(&a.0));
    let words: Vec<String> = parts
        .iter()
        .take(3)
        .map(|&(share, p)| format!("{} {}", pct(share), idle_words(p)))
        .collect();
    call.line
        .push_str(&format!("; drafter GPUs idle {}", pct(idle)));
    let gap = (w.live(Role::Consumer).map(|r| r.largest_gap_s)).fold(0.0, f64::max);
    if gap > 0.0 {
        call.line
            .push_str(&format!(" (longest gap {})", duration(gap)));
    }
    if !words.is_empty() {
        call.line.push_str(&format!(": {}", words.join(", ")));
    }
}

/// Seconds for people: `250ms` under a second, `1.5s` from there.
fn duration(secs: f64) -> String {
    if secs < 1.0 {
        format!("{:.0}ms", secs * 1e3)
    } else {
        format!("{secs:.1}s")
    }
}

/// What a drafter does in a phase that is not computing, for the idle note.
fn idle_words(p: Phase) -> &'static str {
    match p {
        Phase::Sync => "in the all-reduce (sync)",
        Phase::CopyIn => "copying batches in (copy_in)",
        Phase::WaitEmpty => "waiting for batches (wait_empty)",
        Phase::Checkpoint => "checkpointing (checkpoint)",
        Phase::Load => "loading (load)",
        Phase::WaitFull => "waiting for a free slot (wait_full)",
        Phase::Compute => "with the host launching work (compute)",
        Phase::Other => "elsewhere (other)",
    }
}

/// Whether [`sync_wait`] adds its clause to `call`.
fn sync_said(w: &Window, call: &Call) -> bool {
    w.group
        && w.sync >= SYNC_STALL
        && !matches!(
            call.bottleneck,
            Bottleneck::Targets | Bottleneck::Starting | Bottleneck::Stalled
        )
}

/// A synchronous group waits for its slowest rank at every step: say for whom, unless the ranks
/// wait for one that waits for data (the targets' fault, said by the call itself), the run is
/// starting, or a rank is hung (the stall says it).
fn sync_wait(w: &Window, call: &mut Call) {
    if !sync_said(w, call) {
        return;
    }
    let note = match w.slow_rank() {
        Some(s) => format!(
            "; drafters wait {} in sync for drafter {} ({} per token {:.1}x the group median)",
            pct(w.others_sync(s.index).unwrap_or(w.sync)),
            s.index,
            s.phase.name(),
            s.ratio
        ),
        // A rank down, and every live rank waited (a lone one too): the group waited for a
        // rank outside the live ones, the one down (a dead rank until its removal, or one
        // restarting to rejoin). Unequal batches leave the slowest live rank waiting little.
        None if w.drafters_down_lately > 0 && w.least_sync >= SYNC_STALL => format!(
            "; drafters wait {} in sync for a dead or restarting rank",
            pct(w.sync)
        ),
        // Two live ranks or more, every one's pace known and none slow: the batches differ.
        None if w.drafters_live >= 2 && w.live_paces == w.drafters_live => format!(
            "; drafters wait {} in sync: their batches take unequal time (no rank is slow per token)",
            pct(w.sync)
        ),
        None => format!("; drafters wait {} in sync", pct(w.sync)),
    };
    call.line.push_str(&note);
}

/// When the rule named no worker: the rank a group waits for, or else the slowest straggler.
/// A slow worker on the side that is not the bottleneck holds nothing up: it is listed as a
/// straggler, not blamed.
fn blame_slowest(w: &Window, call: &mut Call) {
    if call.worker.is_some() {
        return;
    }
    let blamed = |s: &&Slow| match call.bottleneck {
        Bottleneck::Drafters => s.role == Role::Consumer,
        Bottleneck::Targets => s.role == Role::Producer,
        _ => true,
    };
    call.worker = w.slow_rank().or(w.slow.iter().find(blamed)).map(Slow::name);
}

/// Each slow worker with its figures and what it costs the run.
fn stragglers(w: &Window) -> Vec<String> {
    w.slow
        .iter()
        .map(|s| {
            let role = s.role;
            let me = w.iv.workers.iter().find(|r| r.name() == s.name());
            let peers: Vec<f64> = w
                .live(role)
                .filter(|r| r.index != s.index)
                .map(|r| r.items_per_s)
                .collect();
            let items = match (me, median(peers)) {
                (Some(me), Some(peers)) => {
                    format!(", {:.1} items/s vs peers {:.1}", me.items_per_s, peers)
                }
                _ => String::new(),
            };
            let cost = match s.role {
                Role::Producer => {
                    "targets claim work as they go, so the others take more: it costs only its own share".to_string()
                }
                Role::Consumer if w.group => format!(
                    "the group waits for it at every step: the other ranks wait {} in sync",
                    pct(w.others_sync(s.index).unwrap_or(0.0))
                ),
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
        .collect()
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
