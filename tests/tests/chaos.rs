//! Chaos: launcher runs on the mock backend while the test SIGKILLs targets and drafters at
//! random, many times over. Every sample must still be trained exactly once by the ledgers.
//! When the kills take every drafter down at once, the updates since the group's checkpoint are
//! lost with them: the run says so (`lost-steps.jsonl`, exit 3), and `launcher --resume` must
//! then train exactly those batches, so that every sample is in exactly one applied update.
//!
//! The choices (the pause before each kill, the victim) come from one seed, printed at the start:
//! `HSPIPE_CHAOS_SEED=<seed> cargo test -p tests --test tests chaos` replays the same sequence of
//! choices. Where each kill lands in a worker's code still depends on scheduling, which is the
//! point: over many kills they land everywhere, between and inside ring operations.

use rustix::process::Signal;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use proto::{LedgerLine, RunDir};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::launcher::{attach, config, kill, no_segment_of, pid_alive, Run};
use crate::support::{spawn, workspace_bin};

/// The seed of the choices, from `HSPIPE_CHAOS_SEED` or a fixed default.
fn seed() -> u64 {
    std::env::var("HSPIPE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x05ee_d0f0_c4a0_5000)
}

/// The seeded choices of victims and pauses.
struct Choices(Xoshiro256PlusPlus);

impl Choices {
    fn new(seed: u64) -> Choices {
        Choices(Xoshiro256PlusPlus::seed_from_u64(seed))
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n)
    }
}

/// Kills wanted across runs, and at most per run (so the kills spread over several runs and
/// each run still finishes).
const KILLS: u32 = 32;
const KILLS_PER_RUN: u32 = 16;
/// A bound on runs, so a run that ends too fast to be killed often cannot loop for ever.
const MAX_RUNS: u32 = 8;

/// Samples whose training the ledgers record other than exactly once: for each sample, the
/// publications (batch id, ticket) of the lines naming it must be one, and that publication's
/// deliveries distinct (an earlier delivery's line is a drafter that died holding the batch).
fn not_trained_once(lines: &[LedgerLine], samples: u64) -> Vec<u64> {
    let mut seen: HashMap<u64, Vec<(u64, u64, u32)>> = HashMap::new();
    for l in lines {
        for &s in &l.sample_ids {
            seen.entry(s)
                .or_default()
                .push((l.batch_id, l.ticket, l.delivery));
        }
    }
    (0..samples)
        .filter(|s| {
            let Some(v) = seen.get(s) else { return true };
            let pubs: BTreeSet<(u64, u64)> = v.iter().map(|&(b, t, _)| (b, t)).collect();
            let deliveries: BTreeSet<u32> = v.iter().map(|&(_, _, d)| d).collect();
            pubs.len() != 1 || deliveries.len() != v.len()
        })
        .collect()
}

/// One launcher run (5 targets, 3 drafters) SIGKILLed up to `cap` times. Returns the kills.
fn one_run(run_no: u32, choices: &mut Choices, cap: u32) -> u32 {
    let run = Run::new(&format!("chaos{run_no}"));
    let cfg = config(&run.dir, true, "");
    // Slower than the other launcher tests, so a run lasts long enough to be killed often.
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("tokens_per_s = 8000.0", "tokens_per_s = 3000.0");
    std::fs::write(&cfg, text).unwrap();
    let mut launcher = run.launch(
        &cfg,
        &[
            // Few monitor lines: nobody reads the launcher's output until it ends.
            "--monitor",
            "5",
            "--max-restarts",
            "1000",
            // Workers beat at least every 100 ms while blocked and every step is under a
            // second: one silent this long is spinning or hung, which the test forbids.
            "--hang-timeout",
            "30",
        ],
    );
    let pid = launcher.child.id();
    let ring = attach(&mut launcher);
    let mut kills = 0;
    let mut victims = Vec::new();
    while kills < cap && launcher.child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(100 + choices.below(300)));
        let victim = choices.below(8) as usize;
        let w = &ring.snapshot().workers[victim];
        if w.alive {
            kill(w.pid, Signal::KILL);
            kills += 1;
            victims.push(victim);
        }
    }
    eprintln!("chaos run {run_no}: {kills} SIGKILLs of workers {victims:?}");
    let (status, mut out, _) = launcher.finish_status();
    let lost = RunDir::new(run.run_dir()).lost_steps();
    if status.code() == Some(3) && lost.exists() {
        // Every drafter was down at once: said, and nothing else degraded the run; the resume
        // trains what was lost.
        let notes = run.summary()["notes"].clone();
        let said = |n: &serde_json::Value| {
            let n = n.as_str().unwrap_or("");
            n.contains("whose updates were lost") || n.contains("samples were not trained")
        };
        assert!(
            notes.as_array().unwrap().iter().all(said),
            "run {run_no}: {notes}\n{out}"
        );
        eprintln!(
            "chaos run {run_no}: updates lost ({}), resumed",
            std::fs::read_to_string(&lost).unwrap().trim()
        );
        let dir = run.run_dir();
        let args = ["--resume", dir.to_str().unwrap(), "--monitor", "5"];
        let resumed = spawn(&workspace_bin("launcher"), &args).finish();
        out = format!("{out}\n{resumed}");
    }
    assert!(out.contains("exit code 0"), "run {run_no}:\n{out}");
    assert!(!out.contains("hung"), "a worker went silent:\n{out}");
    assert!(!out.contains("gave up"), "a worker was given up:\n{out}");
    no_segment_of(pid);
    for w in &ring.snapshot().workers {
        assert!(
            !pid_alive(w.pid) || !w.alive,
            "worker {} outlived the run",
            w.pid
        );
    }
    let s = run.summary();
    assert_eq!(s["ok"], true, "{s}");
    assert_eq!(s["duplicated"], 0, "{s}");
    assert_eq!(s["samples_trained"], s["samples_total"], "{s}");
    let samples = s["samples_total"].as_u64().unwrap();
    let bad = not_trained_once(&run.ledgers(), samples);
    assert!(bad.is_empty(), "samples not trained exactly once: {bad:?}");
    kills
}

/// Seeded random SIGKILLs of targets and drafters over several runs (at least `KILLS` in all):
/// each run ends with every sample trained exactly once by the ledgers, `duplicated` 0, its
/// ring gone from /dev/shm, and no worker given up or killed as hung. Watchdogs guard against a
/// hang; nothing is timed.
#[test]
fn random_sigkills_of_targets_and_drafters_lose_and_repeat_nothing() {
    let seed = seed();
    eprintln!("chaos seed {seed} (replay with HSPIPE_CHAOS_SEED={seed})");
    let mut choices = Choices::new(seed);
    let (mut kills, mut runs) = (0, 0);
    while kills < KILLS {
        assert!(
            runs < MAX_RUNS,
            "{runs} runs ended after only {kills} kills: make the runs longer"
        );
        kills += one_run(runs, &mut choices, KILLS_PER_RUN.min(KILLS - kills));
        runs += 1;
    }
    eprintln!("chaos: {kills} SIGKILLs over {runs} runs, seed {seed}");
}
