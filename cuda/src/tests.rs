//! What can be checked without a GPU: a machine without a driver or NCCL gets an error that says
//! so, never a panic (cudarc's own load would panic); a set retired variable is refused by name;
//! a driver older than the bindings is refused; the probe's PTX is well formed.

use super::*;

/// No libcuda here (CI, laptops): `Driver::load` gives NoDriver, where cudarc itself would
/// panic at its first call. On a machine with a driver the same test expects a loaded driver;
/// what decides is cudarc's own presence check, so the two never disagree.
#[test]
fn loading_the_driver_never_panics_and_says_why_there_is_none() {
    let present = present::cudarc_finds(present::Lib::Driver);
    match Driver::load_with(None) {
        Ok(d) => {
            assert!(present, "a driver loaded where cudarc finds none");
            assert!(d.version() >= BUILT_FOR, "{:?}", d.version());
        }
        Err(e @ CudaError::NoDriver { .. }) => {
            assert!(!present, "cudarc finds a driver, yet: {e}");
            let msg = e.to_string();
            assert!(msg.contains("no CUDA driver"), "{msg}");
            assert!(msg.contains("libcuda.so"), "{msg}");
            assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
        }
        // A driver that is there but too old or not a driver is an error too, not a panic.
        Err(e) => assert!(present, "{e}"),
    }
}

/// The same for NCCL, which a group needs only once it spans GPUs.
#[test]
fn loading_nccl_never_panics_and_says_why_there_is_none() {
    let present = present::cudarc_finds(present::Lib::Nccl);
    match nccl::Nccl::load_with(None) {
        Ok(n) => assert!(
            present,
            "NCCL loaded where cudarc finds none ({:?})",
            n.version()
        ),
        Err(e @ CudaError::NoNccl { .. }) => {
            assert!(!present, "cudarc finds NCCL, yet: {e}");
            let msg = e.to_string();
            assert!(msg.contains("no NCCL"), "{msg}");
            assert!(msg.contains("libnccl.so"), "{msg}");
        }
        Err(e) => assert!(present, "{e}"),
    }
}

/// cudarc cannot be told a library path, so a path set in the old variables is refused, naming
/// the variable and the path, before any library is looked for (so on a GPU machine too).
#[test]
fn a_retired_library_variable_is_refused_by_name() {
    let e = Driver::load_with(Some("/nonexistent/libcuda.so.1".into()))
        .expect_err("a set HSPIPE_LIBCUDA is refused");
    let msg = e.to_string();
    assert!(matches!(e, CudaError::Retired { .. }), "{msg}");
    assert!(msg.contains("HSPIPE_LIBCUDA"), "{msg}");
    assert!(msg.contains("/nonexistent/libcuda.so.1"), "{msg}");
    assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");

    let e = nccl::Nccl::load_with(Some("/nonexistent/libnccl.so.2".into()))
        .expect_err("a set HSPIPE_LIBNCCL is refused");
    assert!(matches!(e, CudaError::Retired { .. }), "{e}");
    assert!(e.to_string().contains("HSPIPE_LIBNCCL"), "{e}");
}

/// The bindings are CUDA 13.0's: a driver for 12.x lacks entry points they call, so it is
/// refused up front instead of panicking at the first missing one.
#[test]
fn a_driver_older_than_the_bindings_is_refused() {
    match check_version(12080) {
        Err(CudaError::DriverTooOld { have, need }) => {
            assert_eq!(have, (12, 8));
            assert_eq!(need, BUILT_FOR);
        }
        other => panic!("expected DriverTooOld, got {other:?}"),
    }
    assert_eq!(check_version(13000).unwrap(), (13, 0));
    assert_eq!(check_version(13020).unwrap(), (13, 2));
    assert_eq!(check_version(14000).unwrap(), (14, 0));
}

/// A copy past a buffer's end is an error naming the sizes (cudarc's copies would assert).
#[test]
fn bounds_name_the_overrun() {
    assert!(bounds("copy", 8, 0, 8).is_ok());
    let e = bounds("copy", 8, 4, 8).expect_err("4 + 8 > 8");
    assert_eq!(
        e.to_string(),
        "copy: 8 bytes at offset 4 overrun a buffer of 8 bytes"
    );
    assert!(bounds("copy", 8, usize::MAX, 1).is_err());
}

/// The shipped PTX declares the kernels the probe looks up (a rename in probe.cu without
/// regenerating probe.ptx fails here, not on the first GPU machine).
#[test]
fn the_probe_ptx_declares_its_kernels() {
    let ptx = include_str!("probe.ptx");
    for k in ["spin", "byte_sum", "stamp"] {
        assert!(
            ptx.contains(&format!(".visible .entry {k}(")),
            "probe.ptx lacks kernel {k}"
        );
    }
}

/// The PTX is JIT-compiled by the driver, which refuses an ISA newer than it knows: nvcc 13
/// writes 9.0 (CUDA 13 drivers only); the file is kept at 7.0 (CUDA 11.0 drivers on).
#[test]
fn the_probe_ptx_is_read_by_drivers_from_cuda_11() {
    let ptx = include_str!("probe.ptx");
    let v = ptx
        .lines()
        .find_map(|l| l.strip_prefix(".version "))
        .expect("probe.ptx has a .version line");
    assert_eq!(v.trim(), "7.0", "regenerate probe.ptx as probe.cu says");
}
