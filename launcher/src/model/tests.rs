//! `launcher capture`'s config.

use clap::Parser;
use model::make::{make_model, MakeSpec};
use proto::config::MAX_PLANNED_SAMPLES;

use super::{capture_config, CaptureArgs};

/// A capture makes no plan, so it is not held to a run's plan bound (samples times epochs):
/// synthetic samples within their own bound are captured with a config of 1000 epochs, also
/// one whose own synthetic samples would plan too many. Before, both were refused ("1000
/// epochs of ... samples plan ... sample passes").
#[test]
fn a_capture_is_not_held_to_the_plan_bound_of_a_runs_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("tiny");
    make_model(&m, &MakeSpec::default()).unwrap();
    let samples = MAX_PLANNED_SAMPLES / 1000 + 1;
    let cfg = dir.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!("[data]\nsynthetic_samples = {samples}\nepochs = 1000\n"),
    )
    .unwrap();
    let synthetic = samples.to_string();
    let args = CaptureArgs::try_parse_from([
        "launcher capture",
        "--model",
        m.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
        "--synthetic",
        &synthetic,
        "-o",
        dir.path().join("caps").to_str().unwrap(),
    ])
    .unwrap();
    let c = capture_config(&args).unwrap();
    assert_eq!(c.data.synthetic_samples, samples);
    // A run of that config is refused: the bound is a run's.
    let err = proto::PipelineConfig::load(&cfg).unwrap_err().to_string();
    assert!(err.contains("sample passes"), "{err}");
}

/// `--threads` is bounded as the config's `[target] threads` is (1 to 1024) and `--shard-mib`
/// is at least 1, as make-model's is, each a usage error naming its flag: 100000 threads and a
/// shard of 0 MiB were accepted.
#[test]
fn capture_threads_and_shard_mib_are_bounded_by_their_flags() {
    for (flag, value) in [
        ("--threads", "100000"),
        ("--threads", "0"),
        ("--shard-mib", "0"),
    ] {
        let argv = ["launcher capture", "--model", "m", "-o", "o", flag, value];
        let e = CaptureArgs::try_parse_from(argv).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{flag} {value}: {e}");
        assert!(e.to_string().contains(flag), "{flag} {value}: {e}");
    }
    let argv = [
        "launcher capture",
        "--model",
        "m",
        "-o",
        "o",
        "--threads",
        "1024",
    ];
    assert_eq!(
        CaptureArgs::try_parse_from(argv).unwrap().threads,
        Some(1024)
    );
}
