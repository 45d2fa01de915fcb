//! The device check's non-GPU parts, as CI can run them: `scripts/gpu-check.sh` parses, and
//! `gpu-check` on a machine without a driver says so, exits 2 ("nothing checked", not a
//! failure of the data path) and leaves no ring behind. cudarc finds the driver by name, so
//! no path can be pointed nowhere; the tests reach exit 2 on any machine another way: a set
//! `HSPIPE_LIBCUDA` (retired) is refused before a driver is looked for, and a device ordinal
//! no machine has is refused after (here, with no driver, the presence check answers first).

use std::process::Command;

use crate::support::workspace_bin;

/// The workspace's root, where `scripts/` is.
pub(crate) fn repo_root() -> std::path::PathBuf {
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
/// share one "GPU", and `e2e_check.py` finds every batch trained once and the loss falling;
/// the same run on a copy of the model computing infinities ends with its target refusing it. A
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
    // The model made to compute infinities is refused by its forward.
    assert!(
        out.contains("e2e: a target computing infinities is refused: NaN or infinite values in decoder layer 1's output"),
        "{out}"
    );
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

/// A round count or a time limit that is not a positive number, or a step it does not know, is a
/// usage error before any step runs, not a DFlash step that times nothing and passes, a check
/// with no time limit, or a step's time spent before the misspelling is found.
#[test]
fn gpu_check_refuses_a_round_count_or_time_limit_that_is_not_a_positive_number() {
    for var in [
        "GPU_CHECK_DFLASH_ROUNDS",
        "GPU_CHECK_BUDGET",
        "GPU_CHECK_E2E_TIMEOUT",
    ] {
        for bad in ["0", "x", "-1", "1.5"] {
            let out = gpu_check(&[(var, bad)], &[]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(64), "{var}={bad}: stderr: {err}");
            assert!(err.contains(var), "{var}={bad}: {err}");
            let said = String::from_utf8_lossy(&out.stdout);
            assert!(!said.contains("=== "), "{var}={bad}: a step ran: {said}");
        }
    }
    // A step misspelt after a good one: refused before the good one runs.
    let out = gpu_check(&[("GPU_CHECK_STEPS", "e2e dflsh")], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "stderr: {err}");
    assert!(err.contains("unknown step 'dflsh'"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("=== "));
}
