//! The device check's non-GPU parts, as CI can run them: `scripts/gpu-check.sh` parses, and
//! `gpu-check` on a machine without a driver says so, exits 2 ("nothing checked", not a
//! failure of the data path) and leaves no ring behind. The driver is pointed at a path that
//! cannot exist, so this holds on a GPU machine too.

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

#[test]
fn gpu_check_without_a_driver_exits_2_naming_it_and_leaves_no_ring() {
    let missing = "/nonexistent/hspipe-test/libcuda.so.1";
    let out = Command::new(repo_root().join("scripts/gpu-check.sh"))
        .env("GPU_CHECK_BIN", workspace_bin("gpu-check"))
        .env("HSPIPE_LIBCUDA", missing)
        .args(["--slot-mib", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("no CUDA driver"), "stderr: {err}");
    assert!(err.contains(missing), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("hspipe-gpucheck-"))
        .collect();
    assert!(left.is_empty(), "rings left behind: {left:?}");
}
