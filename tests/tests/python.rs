//! Python workers (the `hspipe` package, issue #28) end to end through the launcher: a numpy
//! target feeding our drafters, numpy drafters training as one group from our targets, a killed
//! Python worker restarted alone, the view-lifetime cases, and bad worker commands.
//!
//! The package is built and installed into the test venv by `scripts/test.sh`
//! (`scripts/py/build-wheel.sh`); the interpreter is `HSPIPE_PYTHON`, else the repository's
//! `.venv`.

use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::process::Signal;
use shm_ring::WorkerName;

use crate::launcher::{config_with, kill_one_of, no_segment_of, one_model, sample_counts, Run};

/// The Python with the built `hspipe` package and numpy.
fn python() -> String {
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python");
    let py = std::env::var("HSPIPE_PYTHON").unwrap_or_else(|_| venv.to_string());
    let out = Command::new(&py)
        .args(["-c", "import hspipe, numpy"])
        .output();
    match out {
        Ok(o) if o.status.success() => py,
        Ok(o) => panic!(
            "the Python worker tests need the hspipe package and numpy in {py} ({}): run scripts/test.sh, which builds and installs them",
            String::from_utf8_lossy(&o.stderr).trim(),
        ),
        Err(e) => panic!("the Python worker tests cannot run {py} ({e}): run scripts/test.sh"),
    }
}

/// A script of the package's (`python/examples/...`, `python/tests/...`).
fn script(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../python")
        .join(rel)
}

/// `[target]` and `[drafter]` commands as TOML, for `python` running `rel`.
fn command(rel: &str) -> String {
    format!(
        "command = [{:?}, {:?}]",
        python(),
        script(rel).display().to_string()
    )
}

/// The launcher tests' config (400 samples, ~35 batches of 2 layers x 16), with a Python
/// target and/or drafter command. `slow`: targets at 8,000 tokens/s, to act mid-run.
fn config(dir: &Path, slow: bool, target: Option<&str>, drafter: Option<&str>) -> PathBuf {
    let target = target.map(command).unwrap_or_default();
    let drafter = drafter.map(command).unwrap_or_default();
    config_with(dir, slow, &target, &format!("params = 64\n{drafter}"))
}

/// Every sample trained exactly once, by the ledgers and the summary.
fn every_sample_once(run: &Run) {
    let s = run.summary();
    assert_eq!(s["ok"], true, "{s}");
    let counts = sample_counts(&run.ledgers());
    assert_eq!(counts.len(), 400, "every sample trained");
    assert!(counts.values().all(|&c| c == 1), "a sample trained twice");
}

/// The mean of the leader's first and last three logged losses (`step N loss X` lines).
fn first_and_last_loss(log: &str) -> (f64, f64) {
    let losses: Vec<f64> = log
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split(" loss ")
                .nth(1)?
                .parse()
                .ok()
        })
        .collect();
    assert!(losses.len() >= 6, "too few steps logged: {log}");
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    (mean(&losses[..3]), mean(&losses[losses.len() - 3..]))
}

#[test]
fn a_numpy_target_feeds_our_drafters_which_verify_every_batch() {
    let run = Run::new("pyt");
    let cfg = config(&run.dir, false, Some("examples/numpy_target.py"), None);
    let launcher = run.launch(&cfg, &[]);
    let pid = launcher.child.id();
    let out = launcher.finish();
    assert!(out.contains("exit code 0"), "{out}");
    no_segment_of(pid);
    every_sample_once(&run);
    // Our mock drafters check every hidden state and greedy token against the mock target's
    // function: a wrong byte from Python would be a refused batch (and a degraded run).
    let s = run.summary();
    assert!(!s["notes"].to_string().contains("refused"), "{s}");
    // The Python targets' `with w.phase("compute")` reached the ring's telemetry: every
    // target that published spent time computing.
    for w in s["workers"].as_array().unwrap() {
        if w["role"] == "target" && w["items"].as_u64() > Some(0) {
            assert!(w["busy_frac"].as_f64().unwrap() > 0.0, "{w}");
        }
    }
    one_model(&run.ledgers());
}

#[test]
fn numpy_drafters_learn_from_our_targets_as_one_group() {
    let run = Run::new("pyd");
    let cfg = config(&run.dir, false, None, Some("examples/numpy_drafter.py"));
    let out = run.launch(&cfg, &[]).finish();
    assert!(out.contains("exit code 0"), "{out}");
    every_sample_once(&run);
    let lines = run.ledgers();
    let steps = one_model(&lines);
    assert!(
        steps < lines.len(),
        "ranks shared steps: {steps} steps, {} batches",
        lines.len()
    );
    // The leader (drafter-0) logs the group's loss: it falls.
    let log = std::fs::read_to_string(run.run_dir().join("logs/drafter-0.log")).unwrap();
    let (first, last) = first_and_last_loss(&log);
    assert!(last < first * 0.8, "loss {first} -> {last}");
    // The leader's progress reached the launcher: the summary has the group's last loss.
    let s = run.summary();
    let summary_loss = s["drafter"]["loss"].as_f64().unwrap_or(f64::NAN);
    assert!(summary_loss.is_finite() && summary_loss < first, "{s}");
}

/// Sends `sig` to `victim` of a run of `cfg` once 3 batches are published (the targets are
/// slow: the run cannot be over): only it is restarted, every sample is trained once, the
/// drafters kept one model (the launcher tests' checks). Returns the victim's log.
fn kill_python_worker_mid_run(tag: &str, victim: WorkerName, cfg: &Path, sig: Signal) -> String {
    let run = Run::new(tag);
    let cfg = std::fs::read_to_string(cfg).unwrap();
    std::fs::write(run.dir.join("test.toml"), cfg).unwrap();
    let launcher = run.launch(&run.dir.join("test.toml"), &[]);
    kill_one_of(&run, launcher, victim, sig)
}

/// Our slow targets four times slower still: a restarted Python rank (interpreter and numpy
/// start-up, on a loaded machine) must come back while there are batches left to train.
fn slower_targets(cfg: PathBuf) -> PathBuf {
    let slower: String = (0..5)
        .map(|i| format!("[faults.target-{i}]\nslow = 4.0\n"))
        .collect();
    let text = std::fs::read_to_string(&cfg).unwrap() + &slower;
    std::fs::write(&cfg, text).unwrap();
    cfg
}

#[test]
fn a_sigkilled_python_drafter_is_restarted_alone_and_rejoins_the_group() {
    let dir = crate::support::TestDir::new("pykd-cfg");
    let cfg = slower_targets(config(&dir, true, None, Some("examples/numpy_drafter.py")));
    kill_python_worker_mid_run("pykd", WorkerName::consumer(1), &cfg, Signal::KILL);
}

/// Ctrl-C reaches a Python drafter blocked in the ring or the group (the interpreter lock is
/// released in slices of 100 ms): KeyboardInterrupt ends it, and it is restarted like a crash.
#[test]
fn ctrl_c_gets_through_a_python_drafters_blocking_calls() {
    let dir = crate::support::TestDir::new("pyint-cfg");
    let cfg = slower_targets(config(&dir, true, None, Some("examples/numpy_drafter.py")));
    let log = kill_python_worker_mid_run("pyint", WorkerName::consumer(2), &cfg, Signal::INT);
    assert!(log.contains("KeyboardInterrupt"), "{log}");
}

#[test]
fn a_sigkilled_python_target_is_restarted_alone_and_its_batches_redone() {
    let dir = crate::support::TestDir::new("pykt-cfg");
    let cfg = config(&dir, true, Some("tests/slow_target.py"), None);
    kill_python_worker_mid_run("pykt", WorkerName::producer(2), &cfg, Signal::KILL);
}

#[test]
fn python_views_are_zero_copy_and_never_outlive_their_slot() {
    let run = Run::new("pyviews");
    let views = "tests/view_lifetimes.py";
    let cfg = config(&run.dir, false, Some(views), Some(views));
    let args = ["--targets", "0", "--drafters", "1", "--max-restarts", "0"];
    let launcher = crate::support::spawn(
        &crate::support::workspace_bin("launcher"),
        &[
            &["--config", cfg.to_str().unwrap()][..],
            &["--run-dir", run.run_dir().to_str().unwrap()],
            &args,
        ]
        .concat(),
    );
    let out = launcher.finish();
    assert!(out.contains("exit code 0"), "{out}");
    let cases = std::fs::read_to_string(run.run_dir().join("view-cases.txt")).unwrap();
    for case in [
        "bf16 via dlpack",
        "commit with live views names them",
        "read-only sections",
        "commit waits for views to go",
        "no view after commit",
        "a dropped slot is kept while viewed",
        "and given back after",
        "drafter views are read-only",
        "release with live views names them",
        "no view after release",
    ] {
        assert!(
            cases.lines().any(|l| l == case),
            "case {case:?} did not hold: {cases}"
        );
    }
    let s = run.summary();
    assert_eq!(s["ok"], true, "{s}");
}

/// A drafter command that fails (`what`) is restarted up to the limit, then given up; the run
/// goes on degraded with our other drafters, and nothing is left behind.
fn bad_drafter_command(tag: &str, argv: &[&str], log_says: &str) {
    let run = Run::new(tag);
    let cfg = config(&run.dir, false, None, None);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let argv: Vec<String> = argv.iter().map(|a| format!("{a:?}")).collect();
    let text = text.replace(
        "params = 64\n",
        &format!("params = 64\ncommand = [{}]\n", argv.join(", ")),
    );
    std::fs::write(&cfg, text).unwrap();
    let launcher = run.launch(&cfg, &["--max-restarts", "1"]);
    let pid = launcher.child.id();
    let (status, out) = launcher.wait_status_keep();
    no_segment_of(pid);
    // Every drafter runs the bad command: all give up, the targets are stopped.
    assert_eq!(status.code(), Some(3), "degraded: {out}");
    let s = run.summary();
    assert_eq!(s["ok"], false);
    let notes = s["notes"].to_string();
    assert!(
        notes.contains("drafter-1 gave up after 1 restart(s)"),
        "{notes}"
    );
    let log = std::fs::read_to_string(run.run_dir().join("logs/drafter-1.log")).unwrap();
    assert!(log.contains(log_says), "{log}");
    assert_eq!(log.matches("--- launcher: starting").count(), 2, "{log}");
}

#[test]
fn a_missing_worker_script_is_restarted_to_the_limit_then_given_up() {
    let py = python();
    bad_drafter_command(
        "pymissing",
        &[&py, "/nonexistent/worker.py"],
        "No such file",
    );
}

#[test]
fn a_worker_that_exits_at_once_is_restarted_to_the_limit_then_given_up() {
    let py = python();
    bad_drafter_command(
        "pyexit",
        &[&py, "-c", "import sys; sys.exit(5)"],
        "starting",
    );
}

#[test]
fn a_worker_that_claims_another_name_is_refused_in_the_handshake() {
    let py = python();
    let lie = "import os, hspipe; os.environ['HSPIPE_WORKER'] = 'target-7'; hspipe.connect()";
    bad_drafter_command(
        "pylie",
        &[&py, "-c", lie],
        "expected drafter-1 speaking protocol",
    );
}

#[test]
fn a_worker_program_that_does_not_exist_is_an_error_before_the_run() {
    let run = Run::new("pynoprog");
    let cfg = config(&run.dir, false, None, None);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text.replace(
        "params = 64\n",
        "params = 64\ncommand = [\"no-such-program-hspipe\"]\n",
    );
    std::fs::write(&cfg, text).unwrap();
    let launcher = run.launch(&cfg, &[]);
    let pid = launcher.child.id();
    let (status, err) = launcher.wait_status_keep();
    no_segment_of(pid);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("[drafter] command: no program \"no-such-program-hspipe\" on PATH"),
        "{err}"
    );
}
