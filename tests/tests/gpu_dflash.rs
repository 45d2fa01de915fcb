//! The device check's DFlash and speed steps on the CPU, with stand-ins for both sides (the
//! steps themselves need a GPU and a Qwen3-8B shape): the runs they make, in order and with what
//! environment, what a failing side does, the check's time budget, and Ctrl-C.

use std::process::Command;

use crate::gpu::repo_root;

const OURS: &str = "bench-dflash-step ";
const TORCH: &str = "python3 scripts/py/dflash_step.py bench ";

/// The `dflash` step's calls at its defaults, as `(side, traced, env)`: round one's ours
/// (traced) and torch's, then ours with freed memory released and in parts of 2^28, then two
/// more rounds. `env` is what the call's environment added, the stand-in's last word.
const ROUNDS: [(&str, bool, &str); 8] = [
    (OURS, true, ""),
    (TORCH, false, ""),
    (OURS, false, "release"),
    (OURS, false, "parts=268435456"),
    (OURS, false, ""),
    (TORCH, false, ""),
    (OURS, false, ""),
    (TORCH, false, ""),
];

/// The stand-ins' `calls` are `want`, one line each: the side, the step's shape, traced or not,
/// and what the environment added.
fn check_calls(calls: &str, want: &[(&str, bool, &str)]) {
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(lines.len(), want.len(), "{calls}");
    for (i, (line, &(side, traced, env))) in lines.iter().zip(want).enumerate() {
        assert!(line.starts_with(side), "call {i}: {line}");
        assert!(
            line.contains("--device cuda --layers 5"),
            "call {i}: {line}"
        );
        assert_eq!(line.contains("--trace"), traced, "call {i}: {line}");
        assert_eq!(
            line.rsplit_once(' ').map(|(_, e)| e),
            Some(env),
            "call {i}: {line}"
        );
    }
}

/// Each round runs ours then torch's with the step's flags; in the first round only, ours
/// traces its gradient and, after torch's, runs again with freed device memory released and in
/// parts of 2^28 (whose failure is logged, not the step's); every line reaches
/// `dflash-step.log`. A caller's environment does not move ours off its defaults.
#[test]
fn gpu_check_dflash_step_traces_and_runs_its_extras_in_the_first_round() {
    let dir = crate::support::TestDir::new("gpu-check-dflash");
    let d = DflashStandIns::new(&dir);

    let (out, calls, out_dir) = d.run("dflash", &[]);
    exited(&out, 0);
    check_calls(&calls, &ROUNDS);
    let log = std::fs::read_to_string(out_dir.join("dflash-step.log")).unwrap();
    assert_eq!(log.matches(r#"ours {"side":"ours"}"#).count(), 3, "{log}");
    assert_eq!(
        log.matches(r#"ours-released {"side":"ours"}"#).count(),
        1,
        "{log}"
    );
    assert_eq!(log.matches(r#"torch {"side":"torch"}"#).count(), 3, "{log}");
    assert_eq!(
        log.matches(r#"ours-parts-2^28 {"side":"ours"}"#).count(),
        1,
        "{log}"
    );
    assert!(!log.contains("skipped"), "{log}");
    let ours_err = std::fs::read_to_string(out_dir.join("dflash-ours.log")).unwrap();
    assert_eq!(ours_err.matches("progress").count(), 5, "{ours_err}");
}

/// A side that fails fails the step with its exit status and stops the rounds; an extra run
/// that fails (parts of 2^28 out of memory) is logged and the step passes. Ours failing with
/// its hand-written attention backward fails the step but runs on with candle's autograd, so
/// the machine's time still brings figures back; so does ours failing only when it traces.
#[test]
fn gpu_check_dflash_step_fails_with_a_failing_side_and_falls_back_to_autograd() {
    let dir = crate::support::TestDir::new("gpu-check-dflash");
    let d = DflashStandIns::new(&dir);

    // The run in parts of 2^28 out of memory: said in the log, and the step passes.
    let (out, calls, out_dir) = d.run("dflash", &[("FAIL_PARTS", "yes")]);
    exited(&out, 0);
    assert_eq!(calls.lines().count(), ROUNDS.len(), "{calls}");
    let log = std::fs::read_to_string(out_dir.join("dflash-step.log")).unwrap();
    assert!(log.contains("ours-parts-2^28 failed (exit 4"), "{log}");
    assert_eq!(log.matches(r#"torch {"side":"torch"}"#).count(), 3, "{log}");

    // A side that fails stops the rounds; ours is tried again without the trace and with
    // autograd first.
    for (side, want_calls) in [("bench-dflash-step", 3), ("python3", 2)] {
        let (out, calls, _) = d.run("dflash", &[("FAIL_SIDE", side)]);
        let err = exited(&out, 1);
        assert!(err.contains("dflash step (exit 3)"), "{side}: {err}");
        assert_eq!(
            calls.lines().count(),
            want_calls,
            "{side} failing stops the rounds: {calls}"
        );
    }

    // The hand-written backward fails where candle's autograd does not: the step fails, naming
    // it, and every run of ours after it, the extras and a dflash-tf32 step's too, is autograd's.
    let (out, calls, out_dir) = d.run("dflash dflash-tf32", &[("FAIL_HAND", "yes")]);
    let err = exited(&out, 1);
    assert!(
        err.contains("hand-written backward (exit 5); its figures are autograd's"),
        "{err}"
    );
    assert!(!err.contains("dflash step (exit"), "{err}");
    let auto = "attention=autograd";
    check_calls(
        &calls,
        &[
            (OURS, true, ""),
            (OURS, false, ""),
            (OURS, false, auto),
            (TORCH, false, ""),
            (OURS, false, auto),
            (OURS, false, auto),
            (OURS, false, auto),
            (TORCH, false, ""),
            (OURS, false, auto),
            (TORCH, false, ""),
            (OURS, false, auto),
            (TORCH, false, ""),
        ],
    );
    assert!(
        calls
            .lines()
            .nth(10)
            .unwrap()
            .ends_with(" tf32=on attention=autograd"),
        "{calls}"
    );
    let log = std::fs::read_to_string(out_dir.join("dflash-step.log")).unwrap();
    assert_eq!(log.matches("ours failed (exit 5)").count(), 2, "{log}");
    assert_eq!(log.matches(r#"ours {"side":"ours"}"#).count(), 3, "{log}");

    // Autograd's fails too: the step fails with its status, claiming no figures of autograd's.
    let (out, calls, _) = d.run(
        "dflash",
        &[("FAIL_HAND", "yes"), ("FAIL_SIDE", "bench-dflash-step")],
    );
    let err = exited(&out, 1);
    assert!(err.contains("dflash step (exit 3)"), "{err}");
    assert!(!err.contains("autograd's"), "{err}");
    assert_eq!(calls.lines().count(), 3, "{calls}");

    // Only the trace fails: the step fails, naming it, and goes on untraced with the
    // hand-written backward.
    let (out, calls, _) = d.run("dflash", &[("FAIL_TRACE", "yes")]);
    let err = exited(&out, 1);
    assert!(
        err.contains("ours with --trace (exit 6); its figures are untraced"),
        "{err}"
    );
    assert!(!err.contains("autograd"), "{err}");
    let mut untraced = vec![(OURS, true, ""), (OURS, false, "")];
    untraced.extend_from_slice(&ROUNDS[1..]);
    check_calls(&calls, &untraced);
}

/// The check's time budget: the runs that only add figures are skipped when they would pass
/// it, said in the log, and the step passes on fewer; a run still going when it is spent is
/// stopped and the step fails, saying so.
#[test]
fn gpu_check_dflash_step_keeps_to_the_checks_time_budget() {
    let dir = crate::support::TestDir::new("gpu-check-dflash");
    let d = DflashStandIns::new(&dir);

    // Ours takes 8 s of a 15 s budget: the round's pair runs, the extras and the later rounds
    // (each about 8 s more) are skipped, said in the log, and the step passes on one round.
    let slow = [("SLEEP_OURS", "8"), ("GPU_CHECK_BUDGET", "15")];
    let (out, calls, out_dir) = d.run("dflash", &slow);
    exited(&out, 0);
    check_calls(&calls, &ROUNDS[..2]);
    let log = std::fs::read_to_string(out_dir.join("dflash-step.log")).unwrap();
    for what in ["ours-released", "ours-parts-2^28", "rounds 2-3"] {
        assert!(log.contains(&format!("skipped {what} (")), "{log}");
    }
    // With dflash-tf32 named after it, its time (a run of each side, about 5 s) is kept: ours
    // takes 5 s of 14, and the extras, which would leave the TF32 run too little, are skipped.
    let slow = [("SLEEP_OURS", "5"), ("GPU_CHECK_BUDGET", "14")];
    let (out, calls, out_dir) = d.run("dflash dflash-tf32", &slow);
    exited(&out, 0);
    let tf32 = [(OURS, false, "tf32=on"), (TORCH, false, "")];
    check_calls(&calls, &[ROUNDS[0], ROUNDS[1], tf32[0], tf32[1]]);
    let log = std::fs::read_to_string(out_dir.join("dflash-step.log")).unwrap();
    assert!(log.contains("skipped ours-released ("), "{log}");

    // A budget of 2 s: ours is stopped, not waited for, and the step fails saying why (no
    // second try with autograd: it was the time, not the backward).
    let (out, calls, _) = d.run("dflash", &[("SLEEP_OURS", "30"), ("GPU_CHECK_BUDGET", "2")]);
    let err = exited(&out, 1);
    assert!(
        err.contains("dflash step (out of time: the budget of 2 s)"),
        "{err}"
    );
    assert_eq!(calls.lines().count(), 1, "{calls}");
}

/// The `dflash-tf32` step, named alone: each side once, ours with HSPIPE_CUDA_TF32=on, torch's
/// with --tf32, both lines in dflash-tf32.log; a failing side fails it.
#[test]
fn gpu_check_dflash_tf32_step_runs_each_side_once_with_tf32() {
    let dir = crate::support::TestDir::new("gpu-check-dflash");
    let d = DflashStandIns::new(&dir);

    let (out, calls, out_dir) = d.run("dflash-tf32", &[]);
    exited(&out, 0);
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(lines.len(), 2, "{calls}");
    assert!(
        lines[0].starts_with("bench-dflash-step --shape") && lines[0].ends_with(" tf32=on"),
        "{calls}"
    );
    assert!(
        lines[1].starts_with("python3 scripts/py/dflash_step.py bench")
            && lines[1].contains(" --tf32")
            && !lines[1].contains("tf32=on"),
        "{calls}"
    );
    let log = std::fs::read_to_string(out_dir.join("dflash-tf32.log")).unwrap();
    assert!(log.contains(r#"ours-tf32 {"side":"ours"}"#), "{log}");
    assert!(log.contains(r#"torch-tf32 {"side":"torch"}"#), "{log}");
    for side in ["bench-dflash-step", "python3"] {
        let (out, _, _) = d.run("dflash-tf32", &[("FAIL_SIDE", side)]);
        let err = exited(&out, 1);
        assert!(err.contains("dflash-tf32 step (exit 3)"), "{side}: {err}");
    }
}

/// The speed step: the attention comparison (a check), then `bench_target.py`; after every
/// step, the comparison again with `--kernels` in a run of its own (a figure: its failure is
/// logged, the check passes, and every line reaches its log). The comparison failing fails the
/// step, and the other runs still run.
#[test]
fn gpu_check_speed_step_profiles_kernels_in_a_run_of_its_own() {
    let dir = crate::support::TestDir::new("gpu-check-speed");
    let d = DflashStandIns::new(&dir);

    let (out, calls, out_dir) = d.run("speed", &[("FAIL_KERNELS", "yes")]);
    exited(&out, 0);
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(lines.len(), 3, "{calls}");
    assert!(
        lines[0].contains("--compare-attention") && !lines[0].contains("--kernels"),
        "{calls}"
    );
    assert!(
        lines[1].starts_with("python3 scripts/py/bench_target.py"),
        "{calls}"
    );
    assert!(
        lines[2].contains("--compare-attention --kernels"),
        "{calls}"
    );
    let log = |name| std::fs::read_to_string(out_dir.join(name)).unwrap();
    assert!(log("attention.log").contains(r#"{"side":"target"}"#));
    let kernels = log("attention-kernels.log");
    assert!(
        kernels.contains("the kernel profile failed (exit 7; not the check's failure)"),
        "{kernels}"
    );
    assert!(log("speed.log").contains(r#"{"side":"torch"}"#));

    let (out, calls, _) = d.run("speed", &[("FAIL_SIDE", "bench-target")]);
    let err = exited(&out, 1);
    assert!(
        err.contains("fused attention against blocked (exit 3)"),
        "{err}"
    );
    assert_eq!(calls.lines().count(), 3, "{calls}");
}

/// Ctrl-C (SIGINT to the check's process group, as a terminal sends it) while a run is in
/// progress: the run, in the process group `timeout` gives it, is stopped too, and the check
/// exits 130 at once, not when the run would have ended.
#[test]
fn ctrl_c_stops_the_run_in_progress_and_the_check_exits_130() {
    use std::os::unix::process::CommandExt;
    use wait_timeout::ChildExt;
    let dir = crate::support::TestDir::new("gpu-check-ctrl-c");
    let d = DflashStandIns::new(&dir);
    let (mut cmd, _) = d.command("dflash", &[("SLEEP_OURS", "600")]);
    let err_path = dir.path("stderr");
    cmd.process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap());
    let mut check = cmd.spawn().unwrap();
    let watchdog = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let sleep = loop {
        let pids = std::fs::read_to_string(&d.sleeps).unwrap_or_default();
        if let Some(pid) = pids.lines().next() {
            break pid.trim().parse::<i32>().unwrap();
        }
        assert!(std::time::Instant::now() < watchdog, "ours never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let group = rustix::process::Pid::from_raw(check.id() as i32).unwrap();
    rustix::process::kill_process_group(group, rustix::process::Signal::INT).unwrap();
    let status = match check
        .wait_timeout(std::time::Duration::from_secs(120))
        .unwrap()
    {
        Some(status) => status,
        None => {
            // The check, and the run in the process group `timeout` gave it.
            let _ = check.kill();
            let sleep = rustix::process::Pid::from_raw(sleep).unwrap();
            let _ = rustix::process::kill_process(sleep, rustix::process::Signal::KILL);
            panic!("the check went on after Ctrl-C");
        }
    };
    let err = std::fs::read_to_string(&err_path).unwrap();
    assert_eq!(status.code(), Some(130), "stderr: {err}");
    assert!(
        err.contains("SIGINT: stopping the run in progress"),
        "{err}"
    );
    // The stand-in's sleep goes with the run (a zombie only until its new parent reaps it). Not
    // at once: `timeout` ends when its own child has, and the signal it sent the group may not
    // have ended a grandchild yet on a loaded machine (CI saw one still runnable, between its
    // fork and its exec of `sleep`): waited for, up to a watchdog.
    let watchdog = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{sleep}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").map(|(_, s)| &s[..1]);
        if matches!(state, None | Some("Z")) {
            break;
        }
        assert!(
            std::time::Instant::now() < watchdog,
            "sleep {sleep} still runs: {stat}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `out`'s stderr, once its exit status is `code` (else the failure shows the stderr).
fn exited(out: &std::process::Output, code: i32) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    err
}

/// Stand-ins for both sides of the DFlash and speed steps, `bench-dflash-step`,
/// `bench-target` and `python3`: each appends its arguments and what its environment set to
/// `calls`, says `progress` on stderr and its side as JSON on stdout. `FAIL_SIDE=NAME` makes
/// NAME exit 3, `FAIL_PARTS` ours exit 4 when given a part size, `FAIL_HAND` ours exit 5 unless
/// its attention is autograd's, `FAIL_TRACE` ours exit 6 when it traces, `FAIL_KERNELS`
/// bench-target exit 7 when it profiles, and `SLEEP_OURS=S` ours take S seconds (a `sleep`
/// whose pid goes to `sleeps`).
struct DflashStandIns {
    bins: std::path::PathBuf,
    calls: std::path::PathBuf,
    sleeps: std::path::PathBuf,
    root: std::path::PathBuf,
}

impl DflashStandIns {
    fn new(dir: &crate::support::TestDir) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let bins = dir.path("bin");
        std::fs::create_dir_all(&bins).unwrap();
        let calls = dir.path("calls");
        let sleeps = dir.path("sleeps");
        for (name, says) in [
            ("bench-dflash-step", r#"{"side":"ours"}"#),
            ("bench-target", r#"{"side":"target"}"#),
            // torch's side is `python3 scripts/py/dflash_step.py bench ...`: found on PATH.
            ("python3", r#"{"side":"torch"}"#),
        ] {
            let path = bins.join(name);
            let body = format!(
                "#!/bin/sh\necho \"{name} $* ${{HSPIPE_CUDA_FREED_MEMORY:-}}${{HSPIPE_CUDA_TF32:+ tf32=$HSPIPE_CUDA_TF32}}${{HSPIPE_DFLASH_SCORES_PER_PART:+ parts=$HSPIPE_DFLASH_SCORES_PER_PART}}${{HSPIPE_DFLASH_ATTENTION:+ attention=$HSPIPE_DFLASH_ATTENTION}}\" >> {}\n\
                 echo progress >&2\n\
                 [ -n \"${{FAIL_PARTS:-}}\" ] && [ -n \"${{HSPIPE_DFLASH_SCORES_PER_PART:-}}\" ] && exit 4\n\
                 [ {name} = bench-dflash-step ] && [ -n \"${{FAIL_HAND:-}}\" ] && [ -z \"${{HSPIPE_DFLASH_ATTENTION:-}}\" ] && exit 5\n\
                 [ {name} = bench-dflash-step ] && [ -n \"${{FAIL_TRACE:-}}\" ] && case \"$*\" in *--trace*) exit 6;; esac\n\
                 [ {name} = bench-target ] && [ -n \"${{FAIL_KERNELS:-}}\" ] && case \"$*\" in *--kernels*) exit 7;; esac\n\
                 [ {name} = bench-dflash-step ] && [ -n \"${{SLEEP_OURS:-}}\" ] && {{ sleep \"$SLEEP_OURS\" & echo $! >> {sleeps}; wait $!; }}\n\
                 [ -n \"${{FAIL_SIDE:-}}\" ] && [ \"$FAIL_SIDE\" = {name} ] && exit 3\necho '{says}'\n",
                calls.display(),
                sleeps = sleeps.display()
            );
            std::fs::write(&path, body).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        DflashStandIns {
            bins,
            calls,
            sleeps,
            root: dir.to_path_buf(),
        }
    }

    /// `gpu-check.sh` with `GPU_CHECK_STEPS=steps` and `envs`: its output, the stand-ins'
    /// calls, and its output directory.
    fn run(
        &self,
        steps: &str,
        envs: &[(&str, &str)],
    ) -> (std::process::Output, String, std::path::PathBuf) {
        let (mut cmd, out_dir) = self.command(steps, envs);
        let out = cmd.output().unwrap();
        let calls = std::fs::read_to_string(&self.calls).unwrap_or_default();
        (out, calls, out_dir)
    }

    /// The command `run` runs, and its output directory.
    fn command(&self, steps: &str, envs: &[(&str, &str)]) -> (Command, std::path::PathBuf) {
        let _ = std::fs::remove_file(&self.calls);
        let _ = std::fs::remove_file(&self.sleeps);
        let tag: String = (envs.iter())
            .map(|(k, v)| format!("-{k}={v}"))
            .collect::<String>()
            .replace(['/', ' '], "_");
        let out_dir = self.root.join(format!("out-{steps}{tag}"));
        let mut cmd = Command::new(repo_root().join("scripts/gpu-check.sh"));
        cmd.env("GPU_CHECK_STEPS", steps)
            .env("GPU_CHECK_BACKEND", "candle")
            .env("GPU_CHECK_DFLASH_ROUNDS", "3")
            .env("HSPIPE_BIN", &self.bins)
            .env("GPU_CHECK_OUT", &out_dir)
            // A caller's settings: the steps run ours at its defaults whatever they say.
            .env("HSPIPE_DFLASH_SCORES_PER_PART", "123")
            .env("HSPIPE_CUDA_TF32", "on")
            .env("HSPIPE_DFLASH_ATTENTION", "autograd")
            .env_remove("GPU_CHECK_BUDGET")
            .env(
                "PATH",
                format!("{}:{}", self.bins.display(), std::env::var("PATH").unwrap()),
            );
        for (k, v) in envs {
            cmd.env(k, v);
        }
        (cmd, out_dir)
    }
}
