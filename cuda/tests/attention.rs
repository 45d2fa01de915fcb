//! The target's fused attention kernel without a GPU: its source run on the CPU (every block's
//! threads as fibers, the tensor-core product from the PTX ISA's fragment layout; see
//! `attention_host.cpp`) against attention in f64 and for exact causality, and the shipped PTX
//! made from this very source.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sha2::{Digest, Sha256};

const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// The kernel computes causal attention per sequence and head: within 0.02 of f64 on bf16
/// inputs (sequences of 1 to 150 tokens, head dims 16 to 128, grouped-query heads), every output
/// written, and a token's keys and values reach no row before it nor any other sequence; its
/// ldmatrix form gives the plain form's bits.
#[test]
fn the_attention_kernel_computes_causal_attention_when_run_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("attention_host");
    let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/attention_host.cpp");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            "-fno-strict-aliasing",
            "-w",
            "-I",
            SRC,
            "-o",
        ])
        .arg(&exe)
        .arg(&harness)
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler {cxx:?}: {e}"));
    assert!(
        built.status.success(),
        "compiling {}:\n{}",
        harness.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    let out = testkit::watchdog(
        "the attention kernel on the CPU",
        Duration::from_secs(300),
        {
            let exe = exe.clone();
            move || Command::new(exe).output().expect("running the harness")
        },
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.ends_with("ok\n"),
        "the kernel failed on the CPU:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // All four head dims were checked, both kernels of each, every way.
    for d in cuda::attention::HEAD_DIMS {
        for kind in ["plain", "ldsm"] {
            for line in ["largest error", "token 5 of sequence 1"] {
                let want = format!("d={d} {kind}: {line}");
                assert!(stdout.contains(&want), "no {want:?} in {stdout}");
            }
        }
        let same = format!("d={d} ldsm: 0 outputs differ from plain's");
        assert!(stdout.contains(&same), "no {same:?} in {stdout}");
    }
}

/// attention.ptx was made from attention.cu as it is (the digest nvcc's recipe puts on its first
/// line), and declares every kernel the loader asks for.
#[test]
fn the_shipped_ptx_is_made_from_the_kernel_source() {
    let src = std::fs::read(Path::new(SRC).join("attention.cu")).unwrap();
    let digest: String = Sha256::digest(&src)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let first = cuda::attention::PTX.lines().next().unwrap_or("");
    assert_eq!(
        first,
        format!("// source sha256 {digest}"),
        "attention.ptx is stale: regenerate it as attention.cu's header says"
    );
    for d in cuda::attention::HEAD_DIMS {
        for kind in ["", "ldsm_"] {
            let entry = format!(".visible .entry causal_bf16_{kind}d{d}(");
            assert!(cuda::attention::PTX.contains(&entry), "no {entry}");
        }
    }
}
