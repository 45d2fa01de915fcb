//! What can be checked without a GPU: a missing or foreign driver library is an error that
//! names it, never a panic; the probe's PTX is well formed.

use super::*;

/// No libcuda here (CI, laptops): loading gives NoDriver naming the library, and does not panic.
#[test]
fn a_missing_driver_is_an_error_naming_the_library() {
    let e = Driver::load_from("/nonexistent/libcuda.so.1")
        .err()
        .expect("no driver at that path");
    assert!(matches!(e, CudaError::NoDriver { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/libcuda.so.1"), "{e}");
}

/// A library that loads but is not a driver (libc here) is refused by the first entry point it
/// lacks, before anything is called through the table.
#[test]
fn a_library_without_the_driver_api_is_refused_by_name() {
    let e = Driver::load_from("libc.so.6")
        .err()
        .expect("libc is not a CUDA driver");
    match e {
        CudaError::Symbol { name, .. } => assert_eq!(name, "cuInit"),
        other => panic!("expected a missing symbol, got {other}"),
    }
}

/// The shipped PTX declares both kernels the probe looks up (a rename in probe.cu without
/// regenerating probe.ptx fails here, not on the first GPU machine).
#[test]
fn the_probe_ptx_declares_its_kernels() {
    let ptx = include_str!("probe.ptx");
    for k in ["spin", "byte_sum"] {
        assert!(
            ptx.contains(&format!(".visible .entry {k}(")),
            "probe.ptx lacks kernel {k}"
        );
    }
}

/// NCCL is optional until a group spans GPUs: a missing library is an error naming it.
#[test]
fn a_missing_nccl_is_an_error_naming_the_library() {
    let e = nccl::Nccl::load_from("/nonexistent/libnccl.so.2")
        .err()
        .expect("no NCCL at that path");
    assert!(matches!(e, CudaError::NoNccl { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/libnccl.so.2"), "{e}");
    let e = nccl::Nccl::load_from("libc.so.6")
        .err()
        .expect("libc is not NCCL");
    assert!(e.to_string().contains("ncclGetVersion"), "{e}");
}
