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
