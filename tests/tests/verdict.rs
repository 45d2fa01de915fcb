//! The verdict on every scenario a user meets (issue #14): the real launcher and workers on the
//! mock backend, one test per scenario. The test attaches to the run's ring read-only and judges
//! it every `PERIOD` with `ring_stat::analysis::Judge`, the code the launcher's monitor and
//! `shm-ring-stat` use, then asserts the verdict's class and the worker it names on every
//! interval of the scenario's regime, after a warm-up stated as a count of trained batches.
//!
//! Length: one test per scenario of the issue's table, each standing alone.
//!
//! Regimes are told apart by what the snapshot says (batches taken, the ring closed, the plan
//! handed out, a worker's heartbeat), never by the clock, and the sides' speeds differ by a
//! factor of 3 or more (the balanced run excepted, where they match), so the verdict does not
//! depend on the machine's speed. Once a scenario has been seen long enough, the run is stopped
//! hard (SIGINT, then SIGTERM: a second request, whoever sends it), which removes its ring like
//! any ending.

use rustix::process::Signal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ring_stat::analysis::{interval, Bottleneck, Judge, Verdict};
use shm_ring::{Phase, Role, Snapshot, WorkerName, WorkerState};

use crate::launcher::{attach, kill, Run};
use crate::support::{spawn, workspace_bin, Proc, WATCHDOG};

/// How often the test judges the ring: shorter than the target-bound run's batches, as the
/// monitor's period was when the verdict flipped to "idle".
const PERIOD: Duration = Duration::from_millis(250);

/// The mock pipeline of a scenario: 3 targets, 3 drafters (one synchronous group), batches of
/// up to 2048 tokens of sequences 16..=512 long.
struct Mock {
    slots: u32,
    /// `bucketed` (with `min_ready`) or `fifo`.
    policy: &'static str,
    min_ready: u32,
    samples: u64,
    /// Each worker's simulated speed.
    target_tps: f64,
    drafter_tps: f64,
    faults: &'static str,
}

/// Targets 3 x 30k tok/s against drafters 3 x 8k: the drafters are the bottleneck by 3.75x.
const DRAFTER_BOUND: Mock = Mock {
    slots: 24,
    policy: "bucketed",
    min_ready: 4,
    samples: 1000,
    target_tps: 30_000.0,
    drafter_tps: 8_000.0,
    faults: "",
};

/// Targets 3 x 2.5k tok/s (a batch takes about 0.7 s, longer than `PERIOD`) against drafters
/// 3 x 8k: the targets are the bottleneck by 3.2x.
const TARGET_BOUND: Mock = Mock {
    slots: 24,
    policy: "bucketed",
    min_ready: 3,
    samples: 500,
    target_tps: 2_500.0,
    drafter_tps: 8_000.0,
    faults: "",
};

impl Mock {
    fn toml(&self) -> String {
        format!(
            r#"
[ring]
slots = {}
policy = "{}"
min_ready = {}
[model]
layers = 2
hidden = 16
[data]
synthetic_samples = {}
min_len = 16
max_len = 512
[target]
token_budget = 2048
tokens_per_s = {:.1}
[drafter]
tokens_per_s = {:.1}
checkpoint_every = 1000
params = 4096
{}
"#,
            self.slots,
            self.policy,
            self.min_ready,
            self.samples,
            self.target_tps,
            self.drafter_tps,
            self.faults
        )
    }
}

/// One judged interval: the snapshot that ends it and the verdict over the window to it.
struct Obs {
    s: Snapshot,
    v: Verdict,
}

impl Obs {
    fn worker(&self, role: Role, index: u32) -> &shm_ring::WorkerSnapshot {
        self.s.worker(WorkerName { role, index }).unwrap()
    }
}

/// What a scenario's run gave: every interval judged, the launcher's exit code, its run dir.
struct Seen {
    obs: Vec<Obs>,
    code: Option<i32>,
    run: Run,
}

impl Seen {
    /// The trace, for a failure message.
    fn trace(&self) -> String {
        self.obs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                format!(
                    "{i:3} released {:4} ready {:2} closed {:5} {:?} {:?} | {} {:?} {:?}\n",
                    o.s.counters.released,
                    o.s.slots.ready,
                    o.s.closed,
                    o.v.bottleneck,
                    o.v.worker,
                    o.v.line,
                    o.v.stragglers,
                    o.v.warnings
                )
            })
            .collect()
    }

    /// Asserts `want` and `worker` on every interval `regime` selects, and that it selects at
    /// least `min`.
    fn expect(
        &self,
        what: &str,
        regime: impl Fn(&Obs) -> bool,
        want: Bottleneck,
        worker: Option<&str>,
        min: usize,
    ) -> Vec<&Obs> {
        let sel: Vec<&Obs> = self.obs.iter().filter(|o| regime(o)).collect();
        assert!(
            sel.len() >= min,
            "{what}: only {} intervals in the regime, want {min}\n{}",
            sel.len(),
            self.trace()
        );
        for o in &sel {
            assert!(
                o.v.bottleneck == want && o.v.worker.map(|w| w.to_string()).as_deref() == worker,
                "{what}: want {want:?} naming {worker:?}, got {:?} naming {:?}: {}\n{}",
                o.v.bottleneck,
                o.v.worker,
                o.v.line,
                self.trace()
            );
        }
        sel
    }

    /// Asserts that every line of `sel` passes `ok`.
    fn every_line(&self, sel: &[&Obs], ok: impl Fn(&str) -> bool) {
        if let Some(o) = sel.iter().find(|o| !ok(&o.v.line)) {
            panic!("unexpected: {}\n{}", o.v.line, self.trace());
        }
    }

    /// Asserts that on every interval that ends with the worker down (dead, retired, or its
    /// process gone and not yet recovered) a warning starting with `who` says so.
    fn warned_while_down(&self, role: Role, index: u32, who: &str) {
        for o in &self.obs {
            let w = o.worker(role, index);
            let down = matches!(w.state, WorkerState::Dead | WorkerState::Retired)
                || (w.state == WorkerState::Alive && !w.alive);
            assert!(
                !down || o.v.warnings.iter().any(|l| l.starts_with(who)),
                "no warning about {who}\n{}",
                self.trace()
            );
        }
    }

    /// The launcher's monitor lines, from `metrics.jsonl`.
    fn monitor_verdicts(&self) -> Vec<String> {
        std::fs::read_to_string(self.run.run_dir().join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|t| t["verdict"].as_str().map(String::from))
            .collect()
    }
}

/// Runs the launcher on `mock` and judges its ring every `PERIOD` until the launcher exits or
/// `enough` says the scenario has been seen, then stops the run hard. Intervals that end after
/// the launcher exited (its workers gone, its ring torn down) are not kept.
fn scenario(tag: &str, mock: &Mock, extra: &[&str], enough: impl Fn(&[Obs]) -> bool) -> Seen {
    let run = Run::new(tag);
    let cfg: PathBuf = run.dir.join("scenario.toml");
    std::fs::write(&cfg, mock.toml()).unwrap();
    let run_dir = run.run_dir();
    let mut args = vec![
        "--targets",
        "0-2",
        "--drafters",
        "3-5",
        "--config",
        cfg.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--monitor",
        "0.5",
    ];
    args.extend_from_slice(extra);
    let mut launcher = spawn(&workspace_bin("launcher"), &args);
    let ring = attach(&mut launcher);
    let mut judge = Judge::new();
    let mut a = ring.snapshot();
    let mut obs = Vec::new();
    let deadline = Instant::now() + WATCHDOG;
    loop {
        let start = Instant::now();
        let mut occupancy = Vec::new();
        while start.elapsed() < PERIOD {
            occupancy.push(ring.slot_counts());
            std::thread::sleep(Duration::from_millis(10));
        }
        let b = ring.snapshot();
        if launcher.child.try_wait().unwrap().is_some() {
            break;
        }
        let v = judge.verdict(&a, &b, &occupancy);
        obs.push(Obs { s: b.clone(), v });
        a = b;
        if enough(&obs) {
            // A second signal stops hard: the workers are killed, the ring removed. What the
            // ring shows from here on is the stop, not the scenario.
            kill(launcher.child.id(), Signal::INT);
            std::thread::sleep(Duration::from_millis(300));
            // Another signal: the same one again from this process within a second would be
            // the same request (as `timeout`'s copy is), not the kill.
            kill(launcher.child.id(), Signal::TERM);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{tag}: the run went on for {WATCHDOG:?}"
        );
    }
    let code = wait(launcher);
    let seen = Seen { obs, code, run };
    // Shown with a failing test's output (and with --nocapture).
    println!("{tag}: exit {code:?}\n{}", seen.trace());
    seen
}

fn wait(launcher: Proc) -> Option<i32> {
    launcher.wait_status().code()
}

/// Data flows and the targets still have planned batches to hand out.
fn flowing(o: &Obs) -> bool {
    let s = &o.s;
    s.counters.taken > 0 && !s.closed && s.work.done + s.work.claimed < s.work.total
}

fn trained(o: &Obs) -> u64 {
    o.s.counters.released
}

/// Targets far faster than the drafters: the ring fills, then stays full with the targets
/// waiting. Every interval after the first 12 batches until the plan is handed out says the
/// drafters are the bottleneck and blames no worker (a target that gets fewer free slots, or
/// less of a busy machine's CPU, holds nothing up).
#[test]
fn drafter_bound_names_the_drafters() {
    let seen = scenario("vdrafters", &DRAFTER_BOUND, &[], |obs| {
        obs.iter()
            .filter(|o| flowing(o) && trained(o) >= 12)
            .count()
            >= 10
    });
    seen.expect(
        "drafter-bound",
        |o| flowing(o) && trained(o) >= 12,
        Bottleneck::Drafters,
        None,
        6,
    );
}

/// The end of any run: the targets are done, the drafters train what the ring holds. Every
/// interval from the plan all handed out (every planned batch published or claimed: a target
/// with none is out of work, though no target is done before the ring closes) to the last batch
/// trained says draining, with what is left, never "both sides wait"; then "finished".
#[test]
fn the_end_of_a_run_is_draining() {
    let mock = Mock {
        samples: 300,
        ..DRAFTER_BOUND
    };
    let seen = scenario("vdrain", &mock, &[], |_| false);
    assert_eq!(seen.code, Some(0), "{}", seen.trace());
    let sel = seen.expect(
        "end of the run",
        |o| {
            let s = &o.s;
            s.work.total > 0
                && s.work.done + s.work.claimed >= s.work.total
                && s.counters.taken > 0
                && !(s.closed && s.slots.ready + s.slots.reading == 0)
        },
        Bottleneck::Draining,
        None,
        3,
    );
    seen.expect(
        "the last batch trained",
        |o| o.s.closed && o.s.slots.ready + o.s.slots.reading == 0,
        Bottleneck::Idle,
        None,
        0,
    );
    assert!(
        sel.iter()
            .any(|o| o.v.line.starts_with("draining: the targets are done (3/3)")),
        "{}",
        seen.trace()
    );
}

/// Issue #14's third row: target-bound with batches longer than the period. Every interval
/// after warm-up says the targets are the bottleneck, never "idle" while they compute. The
/// drafters of the group wait in sync for the rank that waits for data: that is the targets'
/// doing, so no rank is named, and neither does the monitor ever say "idle".
#[test]
fn target_bound_with_long_batches_names_the_targets_never_idle() {
    let seen = scenario("vtargets", &TARGET_BOUND, &[], |obs| {
        obs.iter().filter(|o| flowing(o) && trained(o) >= 6).count() >= 16
    });
    let sel = seen.expect(
        "target-bound",
        |o| flowing(o) && trained(o) >= 6,
        Bottleneck::Targets,
        None,
        12,
    );
    seen.every_line(&sel, |l| !l.contains("in sync"));
    // Nor did the launcher's monitor, judging its own ticks, ever call the run idle while the
    // targets computed (its last tick, after the hard stop killed every worker, may say that no
    // drafter runs, which is true).
    let monitor = seen.monitor_verdicts();
    let idle: Vec<&String> = monitor
        .iter()
        .filter(|v| v.starts_with("idle") && !v.starts_with("idle: no drafter is running"))
        .collect();
    assert!(idle.is_empty(), "the monitor said {idle:?}");
}

/// Matched sides (3 x 8k tok/s each; the group's own overhead leaves the targets a little
/// ahead, so the large ring fills slowly and never fills up in the run): nobody waits, the
/// ring holds. Balanced on every interval after warm-up: 36 batches trained, by when the
/// window no longer holds the start, when the drafters (each holding two: one training, one
/// prefetched) waited for the ring to reach min_ready.
#[test]
fn matched_sides_are_balanced() {
    let mock = Mock {
        slots: 60,
        policy: "bucketed",
        min_ready: 4,
        samples: 1400,
        target_tps: 8_000.0,
        drafter_tps: 8_000.0,
        faults: "",
    };
    let seen = scenario("vbalanced", &mock, &[], |obs| {
        obs.iter()
            .filter(|o| flowing(o) && trained(o) >= 36)
            .count()
            >= 16
    });
    seen.expect(
        "balanced",
        |o| flowing(o) && trained(o) >= 36,
        Bottleneck::Balanced,
        None,
        16,
    );
}

/// Issue #14's second row: one drafter three times slower holds the group, so the ring fills
/// while nobody waits yet; then it is full and the targets wait. The drafters are the
/// bottleneck from warm-up on, and the verdict names drafter 1 all along, with the share the
/// others wait for it in sync; the filling was judged from the ring's trend. The launcher's
/// monitor, judging its own ticks, says the same.
#[test]
fn a_slow_drafter_fills_the_ring_and_is_named() {
    let mock = Mock {
        slots: 60,
        policy: "bucketed",
        min_ready: 4,
        samples: 1500,
        target_tps: 8_000.0,
        drafter_tps: 8_000.0,
        faults: "[faults.drafter-1]\nslow = 3.0\n",
    };
    let seen = scenario("vslowfill", &mock, &[], |obs| {
        obs.iter().filter(|o| o.s.slots.free == 0).count() >= 3
            && obs
                .iter()
                .filter(|o| flowing(o) && trained(o) >= 18)
                .count()
                >= 10
    });
    let sel = seen.expect(
        "slow drafter",
        |o| flowing(o) && trained(o) >= 18,
        Bottleneck::Drafters,
        Some("drafter-1"),
        8,
    );
    let filling = sel
        .iter()
        .filter(|o| o.v.line.contains("the ring fills"))
        .count();
    assert!(
        filling >= 3,
        "filling seen {filling} times\n{}",
        seen.trace()
    );
    // The launcher's monitor, judging its own ticks, said so too.
    let monitor = seen.monitor_verdicts();
    assert!(
        monitor.iter().any(|v| v.contains("the ring fills"))
            && monitor.iter().any(|v| v.contains("in sync for drafter 1")),
        "{monitor:#?}"
    );
    seen.every_line(&sel, |l| {
        l.contains("in sync for drafter 1 (compute per token")
    });
}

/// The group with one slow rank (drafter 2, 3x) and a full ring: drafters are the bottleneck,
/// their GPUs idle while the fast ranks wait (the idle note),
/// the line says the other ranks wait in sync for drafter 2 with its pace against the group's,
/// the straggler line says what it costs, and the ranks that wait are never named.
#[test]
fn the_group_names_its_slow_rank_not_the_ranks_that_wait_for_it() {
    let mock = Mock {
        faults: "[faults.drafter-2]\nslow = 3.0\n",
        ..DRAFTER_BOUND
    };
    let seen = scenario("vslowrank", &mock, &[], |obs| {
        obs.iter()
            .filter(|o| flowing(o) && trained(o) >= 18)
            .count()
            >= 10
    });
    let sel = seen.expect(
        "slow rank",
        |o| flowing(o) && trained(o) >= 18,
        Bottleneck::Drafters,
        Some("drafter-2"),
        8,
    );
    for o in &sel {
        let ratio: f64 =
            o.v.line
                .split("compute per token ")
                .nth(1)
                .and_then(|r| r.split('x').next())
                .and_then(|r| r.parse().ok())
                .unwrap_or_else(|| panic!("no pace in {}", o.v.line));
        assert!(
            (2.0..=4.5).contains(&ratio),
            "{}\n{}",
            o.v.line,
            seen.trace()
        );
        // The fast ranks idle while they wait for it: the idle note says so, and leaves the
        // wait in sync to the clause that names whom they wait for.
        assert!(
            o.v.line.contains("; drafter GPUs idle ")
                && !o.v.line.contains("in the all-reduce (sync)"),
            "{}\n{}",
            o.v.line,
            seen.trace()
        );
        assert!(
            o.v.stragglers.len() == 1
                && o.v.stragglers[0].starts_with("drafter 2 is slow")
                && o.v.stragglers[0].contains("the group waits for it"),
            "{}",
            seen.trace()
        );
    }
}

/// The group with a rank waiting in sync: under FIFO, each rank takes whatever is READY, so in
/// a target-bound run the ranks that got a batch wait in sync for the one still waiting on the
/// empty ring. The ranks wait in sync a real share of the time, yet the verdict says the
/// targets are the bottleneck and blames no rank: they wait for data, not for a slow rank.
#[test]
fn ranks_waiting_in_sync_for_a_rank_without_data_blame_the_targets() {
    let mock = Mock {
        policy: "fifo",
        ..TARGET_BOUND
    };
    let regime = |o: &Obs| flowing(o) && trained(o) >= 6;
    let seen = scenario("vsyncdata", &mock, &[], |obs| {
        obs.iter().filter(|o| regime(o)).count() >= 16
    });
    let sel = seen.expect(
        "ranks waiting in sync",
        regime,
        Bottleneck::Targets,
        None,
        12,
    );
    seen.every_line(&sel, |l| {
        l.starts_with("targets are the bottleneck: ring empty") && !l.contains("in sync")
    });
    let (first, last) = (&sel[0].s, &sel[sel.len() - 1].s);
    let iv = interval(first, last, &[]);
    let drafters: Vec<_> = iv
        .workers
        .iter()
        .filter(|w| w.role == Role::Consumer)
        .collect();
    let sync = drafters.iter().map(|w| w.phases[Phase::Sync]).sum::<f64>() / drafters.len() as f64;
    assert!(
        sync >= 0.10,
        "the ranks waited only {sync:.2} in sync\n{}",
        seen.trace()
    );
}

/// Start-up under min_ready: the drafters wait for 8 READY batches from slow targets. Every
/// interval before the first take says "starting", not "targets are the bottleneck".
#[test]
fn start_up_under_min_ready_is_starting() {
    let mock = Mock {
        min_ready: 8,
        ..TARGET_BOUND
    };
    let seen = scenario("vstart", &mock, &[], |obs| {
        obs.iter().filter(|o| o.s.counters.taken > 0).count() >= 2
    });
    let sel = seen.expect(
        "start-up",
        |o| o.s.counters.taken == 0 && !o.s.closed,
        Bottleneck::Starting,
        None,
        4,
    );
    seen.every_line(&sel, |l| l.contains("wait until 8 batches are READY"));
}

/// A drafter that crashes in every 6th batch and is restarted each time (each incarnation
/// trained batches, so no restart is in a row): the drafters stay the bottleneck on every
/// interval, no worker is blamed for the restart, and while drafter 1 is down a warning says so.
#[test]
fn a_crashed_drafter_restarting_keeps_the_verdict() {
    let mock = Mock {
        faults: "[faults.drafter-1]\ncrash_after = 6\n",
        ..DRAFTER_BOUND
    };
    let seen = scenario("vdcrash", &mock, &["--max-restarts", "2"], |_| false);
    let restarts = seen
        .obs
        .last()
        .map_or(0, |o| o.worker(Role::Consumer, 1).restarts);
    assert!(restarts >= 1, "drafter 1 never restarted\n{}", seen.trace());
    seen.expect(
        "drafter crash",
        |o| flowing(o) && trained(o) >= 12,
        Bottleneck::Drafters,
        None,
        6,
    );
    seen.warned_while_down(Role::Consumer, 1, "drafter 1 ");
}

/// A target that crashes in every 5th batch in a target-bound run (restarted each time: each
/// incarnation published batches): the targets stay the bottleneck, the crashing one is not
/// called slow, and while it is down a warning names it.
#[test]
fn a_crashed_target_keeps_the_verdict() {
    let mock = Mock {
        faults: "[faults.target-1]\ncrash_after = 5\n",
        ..TARGET_BOUND
    };
    let seen = scenario("vtcrash", &mock, &["--max-restarts", "2"], |obs| {
        obs.last()
            .is_some_and(|o| o.worker(Role::Producer, 1).restarts >= 1 && trained(o) >= 30)
    });
    seen.expect(
        "target crash",
        |o| flowing(o) && trained(o) >= 6,
        Bottleneck::Targets,
        None,
        10,
    );
    seen.warned_while_down(Role::Producer, 1, "target 1 ");
}

/// A drafter that hangs in its step after 7 batches: the group waits for it in sync and the
/// ring fills. Once it has been silent for more than 10 of its steps (at least 5 s), every
/// interval says the run is stalled and names drafter 1 (and so does the launcher's monitor);
/// before it hung, the drafters were the bottleneck and nobody was named.
#[test]
fn a_hung_drafter_stalls_the_group_and_is_named() {
    let mock = Mock {
        faults: "[faults.drafter-1]\nhang_after = 7\n",
        ..DRAFTER_BOUND
    };
    let silent = |o: &Obs| {
        o.worker(Role::Consumer, 1)
            .heartbeat_age_ns
            .is_some_and(|ns| ns > 5_500_000_000)
    };
    let seen = scenario("vhang", &mock, &[], |obs| {
        obs.iter().filter(|o| silent(o)).count() >= 4
    });
    seen.expect(
        "hung drafter",
        |o| silent(o),
        Bottleneck::Stalled,
        Some("drafter-1"),
        4,
    );
    let monitor = seen.monitor_verdicts();
    assert!(
        monitor.iter().any(|v| v.starts_with("stalled: drafter 1 ")),
        "{monitor:#?}"
    );
    // Before the hang: drafter 1 beats at every ring operation and group wait.
    seen.expect(
        "before the hang",
        |o| {
            flowing(o)
                && trained(o) >= 9
                && o.worker(Role::Consumer, 1)
                    .heartbeat_age_ns
                    .is_some_and(|ns| ns < 1_000_000_000)
                && o.worker(Role::Consumer, 1).items < 6
        },
        Bottleneck::Drafters,
        None,
        0,
    );
}
