//! The device check's non-GPU parts, as CI can run them: `scripts/gpu-check.sh` parses, and
//! `gpu-check` on a machine without a driver says so, exits 2 ("nothing checked", not a
//! failure of the data path) and leaves no ring behind. cudarc finds the driver by name, so
//! no path can be pointed nowhere; the tests reach exit 2 on any machine another way: a set
//! `HSPIPE_LIBCUDA` (retired) is refused before a driver is looked for, and a device ordinal
//! no machine has is refused after (here, with no driver, the presence check answers first).

use std::process::Command;

use crate::support::workspace_bin;

fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn gpu_check_script_parses() {
    let st = Command::new("bash")
        .arg("-n")
        .arg(repo_root().join("scripts/gpu-check.sh"))
        .status()
        .unwrap();
    assert!(st.success(), "bash -n scripts/gpu-check.sh: {st}");
}

/// The rings `gpu-check` names after its process, left in `/dev/shm`.
fn rings_left_behind() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("hspipe-gpucheck-"))
        .collect()
}

fn gpu_check(envs: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(repo_root().join("scripts/gpu-check.sh"));
    cmd.env("GPU_CHECK_BIN", workspace_bin("gpu-check"))
        .env_remove("HSPIPE_LIBCUDA")
        .env_remove("HSPIPE_LIBNCCL")
        .args(["--slot-mib", "1"])
        .args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn gpu_check_refuses_a_driver_path_it_can_no_longer_honour_with_exit_2() {
    let missing = "/nonexistent/hspipe-test/libcuda.so.1";
    let out = gpu_check(&[("HSPIPE_LIBCUDA", missing)], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("HSPIPE_LIBCUDA"), "stderr: {err}");
    assert!(err.contains(missing), "stderr: {err}");
    assert!(err.contains("LD_LIBRARY_PATH"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    let left = rings_left_behind();
    assert!(left.is_empty(), "rings left behind: {left:?}");
}

#[test]
fn gpu_check_without_a_driver_or_device_exits_2_naming_why_and_leaves_no_ring() {
    let ordinal = u32::MAX.to_string();
    let out = gpu_check(&[], &["--device", &ordinal]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    // Without a driver the presence check speaks (cudarc itself would panic); with one, the
    // driver counts its devices.
    let no_driver = err.contains("no CUDA driver") && err.contains("libcuda.so");
    let no_device = err.contains(&format!("no CUDA device {ordinal}"));
    assert!(no_driver || no_device, "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    let left = rings_left_behind();
    assert!(left.is_empty(), "rings left behind: {left:?}");
}

#[test]
fn gpu_check_help_says_how_the_libraries_are_found() {
    let out = Command::new(workspace_bin("gpu-check"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("LD_LIBRARY_PATH"), "{help}");
    assert!(help.contains("HSPIPE_LIBCUDA"), "{help}");
}

/// The device check's end-to-end step, run on the CPU as CI can (the candle backend; the GPU
/// machine runs it with `--backend cuda`): the tiny model is made, one target and one drafter
/// share one "GPU", and `e2e_check.py` finds every batch trained once and the loss falling. A
/// broken step (a flag the launcher no longer takes, a summary field renamed, a loss that
/// does not fall on the step's config) fails here before it wastes a GPU machine's minutes.
#[test]
fn gpu_check_e2e_step_trains_the_tiny_model_once_per_batch_and_the_loss_falls() {
    let _shared = crate::support::stale_segments_shared();
    let dir = crate::support::TestDir::new("gpu-check-e2e");
    let launcher = workspace_bin("launcher");
    let bins = std::path::Path::new(&launcher).parent().unwrap();
    let script = repo_root().join("scripts/gpu-check.sh");
    let out = crate::support::spawn(
        "/usr/bin/env",
        &[
            "GPU_CHECK_STEPS=e2e",
            "GPU_CHECK_BACKEND=candle",
            &format!("HSPIPE_BIN={}", bins.display()),
            &format!("GPU_CHECK_OUT={}", dir.path("out").display()),
            script.to_str().unwrap(),
        ],
    )
    .watchdog(std::time::Duration::from_secs(600))
    .finish();
    assert!(out.contains("e2e: ok"), "{out}");
    assert!(out.contains("gpu-check: every step passed (e2e)"), "{out}");
    let figures: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("out").join("e2e.json")).unwrap())
            .unwrap();
    assert_eq!(figures["ok"], true, "{figures}");
    assert!(
        figures["backend"].as_str().unwrap().starts_with("candle"),
        "{figures}"
    );
    assert_eq!(figures["batches_trained"], figures["batches_total"]);
    let (first, last) = (
        figures["loss_first_fifth"].as_f64().unwrap(),
        figures["loss_last_fifth"].as_f64().unwrap(),
    );
    assert!(last < first, "loss {first} -> {last}");
}

/// The CUDA build links the driver, so on a machine without one none of its binaries can
/// start: the script says so and exits 2 ("nothing checked") before it builds, unpacks or runs
/// anything, rather than failing the data step with the loader's exit 127.
#[test]
fn gpu_check_of_the_cuda_build_without_a_driver_exits_2_before_building_anything() {
    if cuda::Driver::load().is_ok() {
        // A machine with a driver goes on to the checks themselves; nothing to see here.
        return;
    }
    let dir = crate::support::TestDir::new("gpu-check-nodriver");
    let bins = dir.path("bin");
    let script = repo_root().join("scripts/gpu-check.sh");
    let out = Command::new(&script)
        .env_remove("GPU_CHECK_BIN")
        .env_remove("GPU_CHECK_BACKEND")
        .env("HSPIPE_BIN", &bins)
        .env("GPU_CHECK_OUT", dir.path("out"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(
        err.contains("no NVIDIA driver") && err.contains("libcuda.so.1"),
        "{err}"
    );
    assert!(err.contains("cuda-env: not found"), "{err}");
    assert!(!bins.exists(), "it unpacked or built binaries");
}

/// A round count that is not a positive number is a usage error before any step runs, not a
/// DFlash step that times nothing and passes.
#[test]
fn gpu_check_refuses_a_round_count_that_is_not_a_positive_number() {
    for bad in ["0", "x", "-1"] {
        let out = gpu_check(&[("GPU_CHECK_DFLASH_ROUNDS", bad)], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{bad}: stderr: {err}");
        assert!(err.contains("GPU_CHECK_DFLASH_ROUNDS"), "{bad}: {err}");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(!said.contains("=== "), "{bad}: a step ran: {said}");
    }
}

/// The DFlash step's plumbing, with stand-ins for both sides (the step itself needs a GPU and a
/// Qwen3-8B shape): each round runs ours then torch's with the step's flags, ours traces its
/// gradient and runs again with freed device memory released and in parts of 2^28 (whose
/// failure is logged, not the step's) in the first round only, every
/// line reaches `dflash-step.log`, and a side that fails fails the step with its exit status.
/// The `dflash-tf32` step runs each side once with TF32 asked for.
#[test]
fn gpu_check_dflash_step_traces_and_releases_in_the_first_round_and_fails_with_a_failing_side() {
    use std::os::unix::fs::PermissionsExt;
    let dir = crate::support::TestDir::new("gpu-check-dflash");
    let bins = dir.path("bin");
    std::fs::create_dir_all(&bins).unwrap();
    let calls = dir.path("calls");
    let stand_in = |name: &str, says: &str| {
        let path = bins.join(name);
        let body = format!(
            "#!/bin/sh\necho \"{name} $* ${{HSPIPE_CUDA_FREED_MEMORY:-}}${{HSPIPE_CUDA_TF32:+ tf32=$HSPIPE_CUDA_TF32}}${{HSPIPE_DFLASH_SCORES_PER_PART:+ parts=$HSPIPE_DFLASH_SCORES_PER_PART}}\" >> {}\n\
             echo progress >&2\n\
             [ -n \"${{FAIL_PARTS:-}}\" ] && [ -n \"${{HSPIPE_DFLASH_SCORES_PER_PART:-}}\" ] && exit 4\n\
             [ -n \"${{FAIL_SIDE:-}}\" ] && [ \"$FAIL_SIDE\" = {name} ] && exit 3\necho '{says}'\n",
            calls.display()
        );
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    stand_in("bench-dflash-step", r#"{"side":"ours"}"#);
    // torch's side is `python3 scripts/py/dflash_step.py bench ...`: python3 found on PATH.
    stand_in("python3", r#"{"side":"torch"}"#);
    let run_with = |steps: &str, fail: &str, fail_parts: &str| {
        let _ = std::fs::remove_file(&calls);
        let out_dir = dir.path(&format!("out-{steps}-{fail}-{fail_parts}"));
        let out = Command::new(repo_root().join("scripts/gpu-check.sh"))
            .env("GPU_CHECK_STEPS", steps)
            .env("GPU_CHECK_BACKEND", "candle")
            .env("GPU_CHECK_DFLASH_ROUNDS", "3")
            .env("HSPIPE_BIN", &bins)
            .env("GPU_CHECK_OUT", &out_dir)
            .env("FAIL_SIDE", fail)
            .env("FAIL_PARTS", fail_parts)
            // A caller's settings: the steps run ours at its defaults whatever they say.
            .env("HSPIPE_DFLASH_SCORES_PER_PART", "123")
            .env("HSPIPE_CUDA_TF32", "on")
            .env(
                "PATH",
                format!("{}:{}", bins.display(), std::env::var("PATH").unwrap()),
            )
            .output()
            .unwrap();
        let calls = std::fs::read_to_string(&calls).unwrap_or_default();
        (out, calls, out_dir)
    };
    let run_steps = |steps: &str, fail: &str| run_with(steps, fail, "");
    let run = |fail: &str| run_steps("dflash", fail);

    let (out, calls, out_dir) = run("");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    let lines: Vec<&str> = calls.lines().collect();
    // Round one: ours traced, ours with freed memory released, ours in parts of 2^28,
    // torch's; then ours and torch's.
    let (ours, torch) = (
        "bench-dflash-step ",
        "python3 scripts/py/dflash_step.py bench ",
    );
    // What a call's environment added, the stand-in's last word: freed memory released, the
    // part size, or nothing.
    let want = [
        (ours, true, ""),
        (ours, false, "release"),
        (ours, false, "parts=268435456"),
        (torch, false, ""),
        (ours, false, ""),
        (torch, false, ""),
        (ours, false, ""),
        (torch, false, ""),
    ];
    assert_eq!(lines.len(), want.len(), "{calls}");
    for (i, (line, (side, traced, env))) in lines.iter().zip(want).enumerate() {
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
    let ours_err = std::fs::read_to_string(out_dir.join("dflash-ours.log")).unwrap();
    assert_eq!(ours_err.matches("progress").count(), 5, "{ours_err}");

    // The run in parts of 2^28 out of memory: said in the log, and the step passes.
    let (out, calls, out_dir) = run_with("dflash", "", "yes");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    assert_eq!(calls.lines().count(), want.len(), "{calls}");
    let log = std::fs::read_to_string(out_dir.join("dflash-step.log")).unwrap();
    assert!(log.contains("ours-parts-2^28 failed (exit 4"), "{log}");
    assert_eq!(log.matches(r#"torch {"side":"torch"}"#).count(), 3, "{log}");

    for side in ["bench-dflash-step", "python3"] {
        let (out, calls, _) = run(side);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{side}: stderr: {err}");
        assert!(err.contains("dflash step (exit 3)"), "{side}: {err}");
        let want = if side == "python3" { 4 } else { 1 };
        assert_eq!(
            calls.lines().count(),
            want,
            "{side} failing stops the rounds: {calls}"
        );
    }

    // The TF32 step, named alone: each side once, ours with HSPIPE_CUDA_TF32=on, torch's with
    // --tf32, both lines in dflash-tf32.log; a failing side fails it.
    let (out, calls, out_dir) = run_steps("dflash-tf32", "");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
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
        let (out, _, _) = run_steps("dflash-tf32", side);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{side}: stderr: {err}");
        assert!(err.contains("dflash-tf32 step (exit 3)"), "{side}: {err}");
    }
}

/// `gpu_check_summary.py DIR` on a run's output.
fn summary(dir: &std::path::Path) -> (Option<i32>, serde_json::Value, String) {
    let out = Command::new("python3")
        .arg(repo_root().join("scripts/py/gpu_check_summary.py"))
        .arg(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code(), json, err)
}

/// The summary of a device check's figures: on the 2026-12-04 H200 run's log it gives the
/// 0.23x BENCHMARKS.md quotes; on three rounds with the first round's extra runs (one failed)
/// and the TF32 step, the medians, both kinds of ratio, each extra run against round one's, and
/// TF32 against each side's f32 median; a directory with nothing to read is exit 1.
#[test]
fn gpu_check_summary_takes_medians_and_side_by_side_ratios_of_a_runs_logs() {
    let dir = crate::support::TestDir::new("gpu-check-summary");
    let h200 = dir.path("h200");
    std::fs::create_dir_all(&h200).unwrap();
    std::fs::copy(
        repo_root().join("docs/gpu-check/2026-12-04/run4-dflash-step.log"),
        h200.join("dflash-step.log"),
    )
    .unwrap();
    let (code, s, err) = summary(&h200);
    assert_eq!(code, Some(0), "{err}");
    let speed = s["dflash"]["speed_ours_over_torch_of_medians"]
        .as_f64()
        .unwrap();
    assert!((speed - 0.2304).abs() < 1e-4, "{s}");
    assert_eq!(s["dflash"]["parts"], 17, "{s}");

    let run = dir.path("run");
    std::fs::create_dir_all(&run).unwrap();
    let ours = |step: f64, extra: &str| {
        format!(
            r#"{{"step_s":{step},"gradient_s":{},"update_s":0.1,"parts":10{extra}}}"#,
            step - 0.2
        )
    };
    let torch = |step: f64| format!(r#"{{"step_s":{step},"gradient_s":{step},"peak_gib":60}}"#);
    let log = [
        format!("ours {}", ours(4.0, r#","traced":{"forward_s":1.0}"#)),
        format!("ours-released {}", ours(5.0, "")),
        "ours-parts-2^28 failed (exit 1; not the step's failure): see dflash-ours.log".to_string(),
        format!("torch {}", torch(2.0)),
        format!("ours {}", ours(3.0, "")),
        format!("torch {}", torch(3.0)),
        format!("ours {}", ours(6.0, "")),
        format!("torch {}", torch(2.4)),
    ];
    std::fs::write(run.join("dflash-step.log"), log.join("\n") + "\n").unwrap();
    let tf32 = [
        format!("ours-tf32 {}", ours(2.0, "")),
        format!("torch-tf32 {}", torch(1.2)),
    ];
    std::fs::write(run.join("dflash-tf32.log"), tf32.join("\n") + "\n").unwrap();
    let (code, s, err) = summary(&run);
    assert_eq!(code, Some(0), "{err}");
    let d = &s["dflash"];
    let close = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-9;
    assert_eq!(d["rounds"], 3, "{s}");
    assert!(close(&d["ours_step_s_median"], 4.0), "{s}");
    assert!(close(&d["torch_step_s_median"], 2.4), "{s}");
    // Rounds' ratios 0.5, 1.0, 0.4: their median 0.5; the medians' ratio 2.4 / 4.0 = 0.6.
    assert!(
        close(&d["speed_ours_over_torch_median_of_rounds"], 0.5),
        "{s}"
    );
    assert!(close(&d["speed_ours_over_torch_of_medians"], 0.6), "{s}");
    assert!(close(&d["ours-released"]["over_ours_round_1"], 1.25), "{s}");
    assert!(
        d["ours-parts-2^28"]["failed"]
            .as_str()
            .unwrap()
            .contains("exit 1"),
        "{s}"
    );
    assert!(close(&d["traced"]["forward_s"], 1.0), "{s}");
    assert!(
        close(&s["dflash_tf32"]["ours-tf32"]["over_f32_median"], 0.5),
        "{s}"
    );
    assert!(
        close(&s["dflash_tf32"]["torch-tf32"]["over_f32_median"], 0.5),
        "{s}"
    );

    let (code, _, err) = summary(&dir.path("nothing-here"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("no dflash-step.log"), "{err}");
}
