//! target-worker and drafter-worker as real processes on a ring made by the test (the
//! launcher's part played by the test): exact coverage, restart from checkpoint, bad inputs.
//!
//! Length: one test per behaviour, each standing alone.

use rustix::process::Signal;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use collective::Collective;
use proto::plan::plan;
use proto::PipelineConfig;
use proto::{LedgerLine, RunDir};
use shm_ring::{Phase, Ring, Role, WorkerName};

use crate::support::{unique, Proc, TestDir};

const CONFIG: &str = r#"
[ring]
slots = 16
min_ready = 4
[model]
layers = 2
hidden = 16
[data]
synthetic_samples = 150
min_len = 16
max_len = 512
[target]
token_budget = 2048
tokens_per_s = 2000000.0
[drafter]
tokens_per_s = 2000000.0
checkpoint_every = 2
"#;

impl TestDir {
    fn config(&self, name: &str, extra: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, format!("{CONFIG}{extra}")).unwrap();
        p
    }
}

/// Creates the ring the launcher would, for `targets` × `drafters`; returns it and the number
/// of samples.
/// The ring and the drafter group, made as the launcher makes them.
fn make_ring(
    name: &str,
    config: &Path,
    targets: u32,
    drafters: u32,
) -> (Ring, Box<dyn Collective>, usize) {
    let cfg = PipelineConfig::load(config).unwrap();
    let data = target_worker::load_dataset(&cfg).unwrap();
    let batches = plan(data.lengths(), &cfg).len() as u64;
    let params = cfg.ring_params(targets, drafters, batches).unwrap();
    let ring = Ring::create(name, &params).unwrap();
    let group = collective::create(
        &proto::group_segment(name),
        &drafter_worker::group_params(gpu::BackendKind::Mock, &cfg, drafters, 0).unwrap(),
    )
    .unwrap();
    (ring, group, data.len())
}

/// A run directory with the standard config, and a ring for `targets` x `drafters` made as the
/// launcher would.
struct Setup {
    run: TestDir,
    config: PathBuf,
    name: String,
    ring: Ring,
    group: Box<dyn Collective>,
    samples: usize,
}

fn setup(tag: &str, targets: u32, drafters: u32) -> Setup {
    let run = TestDir::new(tag);
    let config = run.config("run.toml", "");
    let name = unique(tag);
    let (ring, group, samples) = make_ring(&name, &config, targets, drafters);
    Setup {
        run,
        config,
        name,
        ring,
        group,
        samples,
    }
}

fn worker(bin: &str, index: u32, ring: &str, run: &Path, config: &Path) -> Proc {
    crate::support::spawn(
        &crate::support::workspace_bin(bin),
        &[
            "--index",
            &index.to_string(),
            "--ring",
            ring,
            "--run-dir",
            run.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ],
    )
}

/// `n` workers of `bin`, indices 0..n.
fn workers(bin: &str, n: u32, ring: &str, run: &Path, config: &Path) -> Vec<Proc> {
    (0..n).map(|i| worker(bin, i, ring, run, config)).collect()
}

const TARGET: &str = "target-worker";
const DRAFTER: &str = "drafter-worker";

fn ledger(run: &Path, index: u32) -> Vec<LedgerLine> {
    std::fs::read_to_string(RunDir::new(run).ledger(index))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Samples trained, counted across all drafters' ledgers.
fn trained(run: &Path, drafters: u32) -> HashMap<u64, u32> {
    let mut n = HashMap::new();
    for d in 0..drafters {
        for line in ledger(run, d) {
            for id in line.sample_ids {
                *n.entry(id).or_default() += 1;
            }
        }
    }
    n
}

#[test]
fn two_targets_two_drafters_train_every_sample_exactly_once() {
    let Setup {
        run,
        config,
        name,
        ring,
        samples,
        group: _group,
    } = setup("w2x2", 2, 2);
    let (drafters, targets) = (
        workers(DRAFTER, 2, &name, &run.0, &config),
        workers(TARGET, 2, &name, &run.0, &config),
    );
    for p in targets.into_iter().chain(drafters) {
        p.finish();
    }
    let n = trained(&run.0, 2);
    assert_eq!(n.len(), samples, "every sample trained");
    assert!(n.values().all(|&c| c == 1), "none twice without a crash");
    let s = ring.snapshot();
    assert_eq!((s.work.done, s.work.total), (s.work.total, s.work.total));
    assert!(s.closed);
    // Each worker's time is broken down by phase in its record.
    for w in s.workers.iter().filter(|w| w.items > 0) {
        assert!(w.phase_ns[Phase::Compute] > 0, "compute time of {w:?}");
    }
    for w in s.workers_of(Role::Consumer).filter(|w| w.items > 0) {
        assert!(w.phase_ns[Phase::CopyIn] > 0, "drafter copy-in time");
    }
    for w in s.workers_of(Role::Consumer) {
        assert!(w.phase_ns[Phase::Checkpoint] > 0, "drafter checkpoint time");
    }
    for d in 0..2 {
        assert!(
            RunDir::new(&run.0).checkpoint().exists(),
            "final checkpoint of drafter {d}"
        );
    }
}

/// Drafter 1 dies after the group applied step 10 (a checkpoint step), before its ledger line;
/// the launcher, played by the test, has not removed it yet. The leader's checkpoint of step 10
/// must not exist then: a resume from it would find no line for drafter 1's batch, though its
/// update is in the checkpoint, and train it a second time. Before, the leader wrote it right
/// after its own step-10 line, before contributing to step 11. Once drafter 1 is removed, step
/// 11 commits and the checkpoint is written.
#[test]
fn the_checkpoint_of_a_step_waits_for_every_members_ledger_line_of_it() {
    let run = TestDir::new("wckptorder");
    let text = CONFIG
        .replace("synthetic_samples = 150", "synthetic_samples = 600")
        .replace("checkpoint_every = 2", "checkpoint_every = 10");
    let config = run.path("run.toml");
    std::fs::write(
        &config,
        format!("{text}[faults.drafter-1]\ncrash_after_commit_at = 10\n"),
    )
    .unwrap();
    let name = unique("wckptorder");
    let (ring, group, _) = make_ring(&name, &config, 2, 2);
    let (drafters, targets) = (
        workers(DRAFTER, 2, &name, &run.0, &config),
        workers(TARGET, 2, &name, &run.0, &config),
    );
    let mut drafters = drafters.into_iter();
    let (leader, victim) = (drafters.next().unwrap(), drafters.next().unwrap());
    assert!(
        !victim.wait_status().success(),
        "the injected crash kills drafter 1"
    );
    assert!(
        ledger(&run.0, 1).iter().all(|l| l.step < 10),
        "drafter 1 died before its line"
    );
    // Drafter 0 arrives in step 11's round only after its step-10 line and, before, after the
    // checkpoint it wrote right after that line.
    let rank0 = collective::attach(&proto::group_segment(&name), 0).unwrap();
    let deadline = std::time::Instant::now() + crate::support::WATCHDOG;
    while rank0.arrival().is_none_or(|(_, step)| step < 11) {
        assert!(
            std::time::Instant::now() < deadline,
            "drafter 0 never reached step 11"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let ckpt = RunDir::new(&run.0).checkpoint();
    assert!(
        !ckpt.exists(),
        "checkpoint 10 written before drafter 1's line of step 10"
    );
    group.remove(1).unwrap();
    ring.recover(WorkerName::consumer(1)).unwrap();
    for p in targets.into_iter().chain([leader]) {
        p.finish();
    }
    assert!(ckpt.exists(), "the checkpoint once step 11 committed");
}

#[test]
fn a_crashed_drafter_restarts_from_its_checkpoint_and_nothing_is_lost() {
    // One drafter, so it surely reaches its fifth batch and, restarted, trains the rest.
    let Setup {
        run,
        config,
        name,
        ring,
        samples,
        group,
    } = setup("wcrash", 2, 1);
    let crashing = run.config("crash.toml", "[faults.drafter-0]\ncrash_after = 5\n");
    let victim = worker(DRAFTER, 0, &name, &run.0, &crashing);
    let targets: Vec<Proc> = (0..2)
        .map(|i| worker(TARGET, i, &name, &run.0, &config))
        .collect();

    let status = victim.wait_status();
    assert!(!status.success(), "the injected crash kills drafter 0");
    // The supervisor's part: remove it from the group, recover the ring, restart it alone.
    let gone = group.remove(0).unwrap();
    assert!(gone.was_member);
    let r = ring.recover(WorkerName::consumer(0)).unwrap();
    // The batch it trained goes back, and the next one's if it had prefetched it.
    assert!((1..=2).contains(&r.requeued), "{r:?}");
    let before = ledger(&run.0, 0);
    let last_ckpt_step = before.last().unwrap().step / 2 * 2;
    let restarted = worker(DRAFTER, 0, &name, &run.0, &config);
    for p in targets.into_iter().chain([restarted]) {
        p.finish();
    }
    let after: Vec<LedgerLine> = ledger(&run.0, 0)
        .into_iter()
        .filter(|l| l.epoch == 2)
        .collect();
    assert!(!after.is_empty(), "the restarted drafter trained");
    assert_eq!(
        after[0].step,
        last_ckpt_step + 1,
        "its state carries on from the checkpoint"
    );
    let n = trained(&run.0, 1);
    assert_eq!(
        n.len(),
        samples,
        "every sample trained, including the one held at the crash"
    );
    let redelivered: Vec<u64> = (0..1)
        .flat_map(|d| ledger(&run.0, d))
        .filter(|l| l.delivery > 0)
        .map(|l| l.batch_id)
        .collect();
    assert_eq!(
        redelivered.len(),
        r.requeued as usize,
        "each trained once more"
    );
}

fn run_bin(bin: &str, args: &[&str]) -> Output {
    Command::new(crate::support::workspace_bin(bin))
        .args(args)
        .output()
        .unwrap()
}

fn assert_error(out: &Output, want: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(
        err.contains("error:") && err.contains(want),
        "{err:?} should say {want:?}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_inputs_give_clear_errors() {
    let Setup {
        run,
        config,
        name,
        ring: _ring,
        samples: _,
        group: _group,
    } = setup("wbad", 1, 1);
    let dir = run.0.to_str().unwrap();
    // A standalone worker on `ring` with `config`.
    let standalone = |bin: &str, index: &str, ring: &str, config: &Path| {
        run_bin(
            bin,
            &[
                "--index",
                index,
                "--ring",
                ring,
                "--run-dir",
                dir,
                "--config",
                config.to_str().unwrap(),
            ],
        )
    };
    let with_config = |file: &str, text: String| {
        let p = run.0.join(file);
        std::fs::write(&p, text).unwrap();
        p
    };

    // A ring that does not exist.
    assert_error(
        &standalone(TARGET, "0", "hspipe-nope", &config),
        "hspipe-nope",
    );

    // A backend this build lacks (the default build has no CUDA device): a clear error from
    // either worker before it takes work, saying how to get it.
    for bin in [TARGET, DRAFTER] {
        let out = run_bin(
            bin,
            &[
                "--index",
                "0",
                "--ring",
                &name,
                "--run-dir",
                dir,
                "--backend",
                "cuda",
            ],
        );
        assert_error(&out, "scripts/build-cuda.sh");
    }

    // A config field that does not exist.
    let bad = run.config("bad.toml", "[drafter]\nspeed = 3\n");
    assert_error(&standalone(DRAFTER, "0", &name, &bad), "bad.toml");

    // A dataset file that is missing, and one with a malformed line.
    let missing = with_config(
        "missing.toml",
        CONFIG.replace("[data]", "[data]\npath = \"/nonexistent/data.jsonl\""),
    );
    assert_error(
        &standalone(TARGET, "0", &name, &missing),
        "/nonexistent/data.jsonl",
    );
    let data = run.0.join("data.jsonl");
    std::fs::write(&data, "{\"input_ids\": [1, 2]}\n{\"input_ids\": oops}\n").unwrap();
    let malformed = with_config(
        "malformed.toml",
        CONFIG.replace(
            "[data]",
            &format!("[data]\npath = {:?}", data.to_str().unwrap()),
        ),
    );
    assert_error(&standalone(TARGET, "0", &name, &malformed), "data.jsonl:2");

    // A worker index the ring does not have.
    assert_error(&standalone(TARGET, "7", &name, &config), "producer 7");

    // A config that plans a different number of batches than the ring was made for.
    let other = with_config(
        "other.toml",
        CONFIG.replace("synthetic_samples = 150", "synthetic_samples = 40"),
    );
    assert_error(&standalone(TARGET, "0", &name, &other), "disagree");

    // A checkpoint that does not load.
    std::fs::create_dir_all(run.0.join("checkpoints")).unwrap();
    std::fs::write(RunDir::new(&run.0).checkpoint(), b"garbage").unwrap();
    assert_error(
        &standalone(DRAFTER, "0", &name, &config),
        "drafter.safetensors",
    );

    // Missing flags are usage errors.
    let out = run_bin(TARGET, &["--index", "0"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_crashed_target_is_redone_by_its_restart_and_every_sample_is_trained_once() {
    let Setup {
        run,
        config,
        name,
        ring,
        samples,
        group: _group,
    } = setup("tcrash", 2, 2);
    let crashing = run.config("crash.toml", "[faults.target-0]\ncrash_after = 3\n");
    let drafters: Vec<Proc> = (0..2)
        .map(|i| worker(DRAFTER, i, &name, &run.0, &config))
        .collect();
    // The victim runs alone until it crashes, so it surely reaches its third batch.
    let victim = worker(TARGET, 0, &name, &run.0, &crashing);
    assert!(
        !victim.wait_status().success(),
        "the injected crash kills target 0"
    );
    let other = worker(TARGET, 1, &name, &run.0, &config);
    let r = ring.recover(WorkerName::producer(0)).unwrap();
    assert_eq!(r.freed, 1, "it died writing its third batch");
    assert!(r.work_returned >= 1, "its unpublished claims go back");
    let restarted = worker(TARGET, 0, &name, &run.0, &config);
    for p in [other, restarted].into_iter().chain(drafters) {
        p.finish();
    }
    let n = trained(&run.0, 2);
    assert_eq!(n.len(), samples, "every sample trained");
    assert!(
        n.values().all(|&c| c == 1),
        "exactly once: no batch published twice"
    );
    assert_eq!(
        ring.snapshot()
            .worker(WorkerName::producer(0))
            .unwrap()
            .epoch,
        2
    );
}

#[test]
fn a_stop_signal_stops_targets_claiming_and_drafters_drain_and_checkpoint() {
    let run = TestDir::new("wint");
    // Slow targets and more data, so the run is still going when the signal comes.
    let config = run.0.join("slow.toml");
    std::fs::write(
        &config,
        CONFIG
            .replace("synthetic_samples = 150", "synthetic_samples = 600")
            .replacen("tokens_per_s = 2000000.0", "tokens_per_s = 20000.0", 1),
    )
    .unwrap();
    let name = unique("wint");
    let (ring, _group, samples) = make_ring(&name, &config, 2, 2);
    let (drafters, targets) = (
        workers(DRAFTER, 2, &name, &run.0, &config),
        workers(TARGET, 2, &name, &run.0, &config),
    );
    let deadline = std::time::Instant::now() + crate::support::WATCHDOG;
    while ring.snapshot().counters.published < 2 {
        assert!(std::time::Instant::now() < deadline, "nothing published");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Any stop signal: SIGINT, SIGTERM, and here SIGHUP (a closed terminal) and SIGQUIT.
    for (t, sig) in targets.iter().zip([Signal::HUP, Signal::QUIT]) {
        crate::launcher::kill(t.child.id(), sig);
    }
    for t in targets {
        assert_eq!(t.wait_status().code(), Some(3), "a stopped target exits 3");
    }
    for d in drafters {
        d.finish();
    }
    let s = ring.snapshot();
    assert!(s.closed, "stopped targets still finish, so the ring closes");
    assert!(s.work.done < s.work.total, "targets stopped claiming");
    assert_eq!(s.work.claimed, 0, "prefetched claims were given back");
    assert_eq!(
        s.counters.released, s.counters.published,
        "drafters drained the ring"
    );
    let n = trained(&run.0, 2);
    assert!(n.len() < samples && n.values().all(|&c| c == 1));
    assert!(
        RunDir::new(&run.0).checkpoint().exists(),
        "the group checkpointed"
    );
}

#[test]
fn a_target_started_by_a_launcher_handshakes_and_reports() {
    use proto::control::{Server, ToLauncher, ToWorker, PROTOCOL_VERSION};

    let Setup {
        run,
        config,
        name,
        ring,
        samples: _,
        group: _group,
    } = setup("whello", 1, 1);
    let batches = ring.params().work_items;
    let server = Server::new().unwrap();
    let server_name = server.name().to_string();
    let target = crate::support::spawn(
        &crate::support::workspace_bin(TARGET),
        &["--index", "0", "--control", &server_name],
    );
    let drafter = worker(DRAFTER, 0, &name, &run.0, &config);
    let (reply, rx) = server.accept().unwrap();
    let ToLauncher::Hello { version, index, .. } = rx.recv().unwrap() else {
        panic!("first message must be Hello");
    };
    assert_eq!((version, index), (PROTOCOL_VERSION, 0));
    reply
        .send(ToWorker::Welcome {
            version: PROTOCOL_VERSION,
            ring: name.clone(),
            run_dir: run.0.clone(),
            gpu: Some(4),
            config_toml: std::fs::read_to_string(&config).unwrap(),
            backend: "mock".into(),
            resume_step: None,
        })
        .unwrap();
    let report = match rx.recv_timeout(crate::support::WATCHDOG).unwrap() {
        ToLauncher::Report(r) => r,
        other => panic!("expected a report, got {other:?}"),
    };
    assert!(report.complete);
    assert_eq!(report.items, batches);
    target.finish();
    drafter.finish();
    assert_eq!(
        ring.snapshot().worker(WorkerName::producer(0)).unwrap().gpu,
        Some(4)
    );
}

#[test]
fn a_drafter_refuses_corrupt_batches_loudly_and_trains_nothing_from_them() {
    let Setup {
        run,
        config,
        name,
        ring,
        samples: _,
        group: _group,
    } = setup("wcorrupt", 1, 1);
    let drafter = worker(DRAFTER, 0, &name, &run.0, &config);
    // ring-peer publishes payloads that are not batches.
    crate::support::ring_peer(&["produce", &name, "0", "3", "4096"]).finish();
    let err = {
        let status = drafter.wait_status_keep();
        assert!(status.0.success(), "a refused batch is not a crash");
        status.1
    };
    assert_eq!(err.matches("refusing a corrupt batch").count(), 3, "{err}");
    assert!(ledger(&run.0, 0).is_empty());
    // Counted refused, not released: the monitor's "trained" and the end's verdict read the
    // released ones as trained.
    let c = ring.snapshot().counters;
    assert_eq!((c.refused, c.released), (3, 0));
}

/// Prefetch: while a step trains, the drafter already holds the next step's batch (taken and
/// being verified), so a slow drafter is seen holding two slots; and exactly-once still holds.
/// Without prefetch it never holds more than one, and the watchdog (60 s) fails the test.
#[test]
fn a_drafter_holds_the_next_batch_while_it_trains_one() {
    let run = TestDir::new("wprefetch");
    let config = run.config("run.toml", "[faults.drafter-0]\nslow = 50.0\n");
    let name = unique("wprefetch");
    let (ring, _group, samples) = make_ring(&name, &config, 1, 1);
    assert_eq!(
        ring.params().held_per_consumer,
        2,
        "prefetch is the default"
    );
    let drafter = worker(DRAFTER, 0, &name, &run.0, &config);
    let target = worker(TARGET, 0, &name, &run.0, &config);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut most = 0;
    while most < 2 && std::time::Instant::now() < deadline {
        most = most.max(ring.snapshot().slots.reading);
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    target.finish();
    drafter.finish();
    assert_eq!(
        most, 2,
        "the drafter held the next batch while training one"
    );
    let n = trained(&run.0, 1);
    assert_eq!(n.len(), samples, "every sample trained");
    assert!(n.values().all(|&c| c == 1), "none twice");
    assert_eq!(ring.snapshot().slots.reading, 0, "nothing left held");
}

/// A drafter that fails with an error in the middle of a step (here: removed from the group
/// while alive, standing in for any error between its take and its ledger line; its next
/// reduction is refused)
/// exits non-zero without releasing the batch it was training: the recovery redelivers it
/// (the group never applied it) and the prefetched one went back already, so a restarted
/// drafter trains every sample exactly once. Released on the error path, that batch would be
/// lost (no ledger line, nothing READING to recover).
#[test]
fn a_drafter_failing_with_an_error_leaves_its_batch_to_the_recovery() {
    let run = TestDir::new("wfail");
    let slow = run.config("slow.toml", "[faults.drafter-0]\nslow = 20.0\n");
    let config = run.config("run.toml", "");
    let name = unique("wfail");
    let (ring, group, samples) = make_ring(&name, &slow, 1, 1);
    let drafter = worker(DRAFTER, 0, &name, &run.0, &slow);
    let target = worker(TARGET, 0, &name, &run.0, &config);
    // Wait (at most 60 s) until it has trained two batches and holds one in training.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while (ledger(&run.0, 0).len() < 2 || ring.snapshot().slots.reading == 0)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(ledger(&run.0, 0).len() >= 2, "the drafter trained");
    group.remove(0).unwrap();
    let (status, err) = drafter.wait_status_keep();
    assert!(!status.success(), "removed, it fails: {err}");
    assert!(err.contains("not a member"), "{err}");
    let r = ring.recover(WorkerName::consumer(0)).unwrap();
    assert!(
        r.requeued >= 1,
        "the batch in training was left for the recovery: {r:?}"
    );
    let restarted = worker(DRAFTER, 0, &name, &run.0, &config);
    target.finish();
    restarted.finish();
    let n = trained(&run.0, 1);
    assert_eq!(
        n.len(),
        samples,
        "every sample trained, the one in training included"
    );
    assert!(n.values().all(|&c| c == 1), "none twice");
}
