//! The device check's Python on the CPU: `gpu_check_summary.py` on a run's logs, and the speed
//! step's `bench_target.py` with its torch side stubbed out and one side of ours failing.

use std::process::Command;

use crate::gpu::repo_root;

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
/// 0.23x BENCHMARKS.md quotes; on three rounds with the first round's extra runs (one failed),
/// a round the budget skipped, and the TF32 step, the medians, both kinds of ratio, each extra
/// run against the untraced rounds, round one (traced) against them, what was skipped, and
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
        format!(
            "ours {}",
            ours(
                4.0,
                &format!(
                    r#","traced":{{"forward_s":1.0,"kernels":{{"backward":{{"device_s":2.5,"launches":40,"kernels":12,"longest":[{}]}}}}}}"#,
                    (0..10)
                        .map(|i| format!(r#"{{"name":"k{i}","launches":4,"s":0.{}}}"#, 9 - i))
                        .collect::<Vec<_>>()
                        .join(",")
                )
            )
        ),
        format!("torch {}", torch(2.0)),
        format!("ours-released {}", ours(5.0, "")),
        "ours-parts-2^28 failed (exit 1; not the step's failure): see dflash-ours.log".to_string(),
        format!("ours {}", ours(3.0, "")),
        format!("torch {}", torch(3.0)),
        format!("ours {}", ours(6.0, "")),
        format!("torch {}", torch(2.4)),
        "skipped rounds 4-4 (a round takes about 9 s; 446 of the budget's 450 s spent)".to_string(),
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
    // Against the untraced rounds' median (4.5), not round one's traced process; round one
    // against them.
    assert!(close(&d["ours-released"]["over_ours"], 5.0 / 4.5), "{s}");
    assert_eq!(d["ours-released"]["ours"], "untraced rounds' median", "{s}");
    assert!(close(&d["ours_traced_over_untraced"], 4.0 / 4.5), "{s}");
    assert!(
        d["ours-parts-2^28"]["failed"]
            .as_str()
            .unwrap()
            .contains("exit 1"),
        "{s}"
    );
    assert!(close(&d["traced"]["forward_s"], 1.0), "{s}");
    // The trace's kernels: each pass's totals, and its eight longest of the ten listed.
    let back = &d["kernels"]["backward"];
    assert!(close(&back["device_s"], 2.5), "{s}");
    assert_eq!(back["launches"], 40, "{s}");
    assert_eq!(back["longest"].as_array().map(Vec::len), Some(8), "{s}");
    assert_eq!(back["longest"][0]["name"], "k0", "{s}");
    assert_eq!(d["skipped"].as_array().map(Vec::len), Some(1), "{s}");
    assert!(
        d["skipped"][0].as_str().unwrap().starts_with("rounds 4-4"),
        "{s}"
    );
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

/// The speed step's `bench_target.py`, its torch side stubbed out (no torch in CI: every
/// transformers rate is 1000 tokens/s) and `bench-target` a stand-in (900 tokens/s fused, 850
/// plain, 800 blocked). With every side running: the ratios side by side and exit 0. With the
/// fused kernel failing (as a fault on a GPU would): it is dropped after its first failure,
/// named in `failed` with its last stderr line, the other sides still measured against both of
/// transformers' attentions, and exit 1.
#[test]
fn bench_target_keeps_the_other_sides_figures_when_one_side_of_ours_fails() {
    use std::os::unix::fs::PermissionsExt;
    let dir = crate::support::TestDir::new("bench-target-py");
    let stubs = dir.path("stubs");
    std::fs::create_dir_all(stubs.join("torch")).unwrap();
    std::fs::create_dir_all(stubs.join("transformers")).unwrap();
    std::fs::write(
        stubs.join("torch/__init__.py"),
        "class T:\n    def mul(self, *a):\n        return self\n    remainder = reshape = to = mul\n\
         def arange(*a):\n    return T()\n\
         def set_num_threads(n):\n    pass\n",
    )
    .unwrap();
    std::fs::write(
        stubs.join("transformers/__init__.py"),
        "AutoConfig = AutoModelForCausalLM = None\n",
    )
    .unwrap();
    let calls = dir.path("calls");
    // The fused side fails while this file exists (bench_target.py passes bench-target only
    // the variables it names, so the stand-in cannot be told by its environment).
    let fail = dir.path("fail-fused");
    let bin = dir.path("bench-target");
    std::fs::write(
        &bin,
        format!(
            "#!/bin/sh\necho \"${{HSPIPE_TARGET_ATTENTION:-fused}}\" >> {calls}\n\
             case \"${{HSPIPE_TARGET_ATTENTION:-}}\" in\n\
             blocked) echo '{{\"tokens_per_s\": 800}}' ;;\n\
             plain) echo '{{\"tokens_per_s\": 850, \"attention\": \"fused-plain\"}}' ;;\n\
             *) [ -e {fail} ] && {{ echo 'warming up' >&2; echo 'error: CUDA_ERROR_ILLEGAL_ADDRESS' >&2; exit 101; }}\n\
                echo '{{\"tokens_per_s\": 900, \"attention\": \"fused-ldmatrix\"}}' ;;\n\
             esac\n",
            calls = calls.display(),
            fail = fail.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = |fails: bool| {
        let _ = std::fs::remove_file(&calls);
        match fails {
            true => std::fs::write(&fail, "").unwrap(),
            false => drop(std::fs::remove_file(&fail)),
        }
        let harness = format!(
            "import sys\nsys.path[:0] = [{stubs:?}, {py:?}]\nimport bench_target as b\n\
             b.load = lambda a, impl: type('M', (), {{'config': type('C', (), {{'num_hidden_layers': 8, 'vocab_size': 100}})}})\n\
             b.torch_rate = lambda *a: 1000.0\n\
             sys.argv = ['bench_target.py', '--model', 'x', '--bin', {bin:?}, '--shapes', '16x2', '--rounds', '3', '--blocked-too', '--plain-too']\n\
             b.main()\n",
            stubs = stubs.display().to_string(),
            py = repo_root().join("scripts/py").display().to_string(),
            bin = bin.display().to_string(),
        );
        let out = Command::new("python3")
            .args(["-c", &harness])
            // The import must not leave a compiled file in the repository's scripts/py.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let json: serde_json::Value = (stdout.lines())
            .find(|l| l.starts_with('{'))
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or(serde_json::Value::Null);
        let calls = std::fs::read_to_string(&calls).unwrap_or_default();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), json, calls, err)
    };

    let (code, j, calls, err) = run(false);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(calls.lines().count(), 9, "{calls}");
    assert_eq!(j["hspipe_over_sdpa"], 0.9, "{j}");
    assert_eq!(j["hspipe_over_blocked"], 1.125, "{j}");
    assert_eq!(j["over_sdpa"]["hspipe-plain"], 0.85, "{j}");
    assert!(j.get("failed").is_none(), "{j}");

    let (code, j, calls, err) = run(true);
    assert_eq!(code, Some(1), "{err}");
    // The fused side ran once, the other two every round.
    assert_eq!(
        calls.lines().filter(|l| *l == "fused").count(),
        1,
        "{calls}"
    );
    assert_eq!(calls.lines().count(), 7, "{calls}");
    assert_eq!(
        j["failed"]["hspipe"], "exit 101: error: CUDA_ERROR_ILLEGAL_ADDRESS",
        "{j}"
    );
    assert_eq!(j["over_sdpa"]["hspipe-blocked"], 0.8, "{j}");
    assert_eq!(j["over_eager"]["hspipe-plain"], 0.85, "{j}");
    assert!(j.get("hspipe_over_sdpa").is_none(), "{j}");
    assert!(
        err.contains("hspipe failed, the other sides go on"),
        "{err}"
    );
}
