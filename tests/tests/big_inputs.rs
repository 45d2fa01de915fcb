//! Inputs far larger than what is kept of them cost a bounded amount of memory: a text record
//! of tens of MB through `capture --data` (the tokenizer), a summary.json and a ledger of GBs
//! through `launcher report`. Each runs the launcher under a data-size limit (`prlimit
//! --data`) that the old whole reads passed, and died of (`memory allocation failed`, SIGABRT).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use model::make::{make_model, MakeSpec};

use crate::support::{spawn, workspace_bin, TestDir};

/// The launcher's data limit: far above what it needs, far below what a whole read needs.
const DATA_LIMIT: &str = "--data=536870912";

/// `launcher ARGS` under [`DATA_LIMIT`]: its exit status and what it printed.
fn launcher_limited(args: &[&str]) -> (std::process::ExitStatus, String) {
    let launcher = workspace_bin("launcher");
    let mut all = vec![DATA_LIMIT, "--", &launcher];
    all.extend(args);
    let (status, out, p) = spawn("prlimit", &all).finish_status();
    std::thread::sleep(std::time::Duration::from_millis(100));
    (status, format!("{out}{}", p.stderr()))
}

/// A 40 MB text (one JSONL line) beside a short one is dropped as longer than data.max_len, or
/// cut to it, at the cost of its first tokens: the tokenizer was handed it whole, some 20 bytes
/// of bookkeeping per byte, and the capture aborted.
#[test]
fn a_huge_text_record_is_dropped_or_cut_without_tokenizing_it_whole() {
    let dir = TestDir::new("bigtext");
    let m = dir.path("m");
    make_model(&m, &MakeSpec::default()).unwrap();
    let data = dir.path("big.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&data).unwrap());
    f.write_all(b"{\"text\": \"").unwrap();
    for _ in 0..(40 << 20) / 32 {
        f.write_all(b"the quick brown fox jumps over ").unwrap();
        f.write_all(b"\\n").unwrap();
    }
    f.write_all(b"\"}\n{\"text\": \"a short one\"}\n").unwrap();
    f.into_inner().unwrap().sync_all().unwrap();
    let cache = dir.path("cache");
    let truncate = dir.path("truncate.toml");
    std::fs::write(&truncate, "[data]\nmax_len = 64\ntoo_long = \"truncate\"\n").unwrap();
    for (config, want) in [
        (None, "1 dropped: longer than data.max_len 4096"),
        (Some(&truncate), "1 truncated to data.max_len 64"),
    ] {
        let out = dir.path(if config.is_some() { "cut" } else { "dropped" });
        let mut args = vec![
            "capture",
            "--model",
            m.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--data-cache",
            cache.to_str().unwrap(),
            "--layers",
            "0,1",
            "--threads",
            "1",
            "-o",
            out.to_str().unwrap(),
        ];
        if let Some(c) = config {
            args.extend(["--config", c.to_str().unwrap()]);
        }
        let (status, said) = launcher_limited(&args);
        assert!(status.success(), "{status}: {said}");
        assert!(said.contains(want), "{said}");
        let samples = if config.is_some() { 2 } else { 1 };
        assert!(
            said.contains(&format!("capture: {samples} samples, ")),
            "{said}"
        );
    }
}

/// `launcher report` of a run whose summary.json is 2 GiB and whose ledger holds a line of
/// 1 GiB between two batches (sparse files, NUL bytes: a crash's leftovers, or a file that is
/// no run's) draws the run: the summary said to be too large, the long line an unreadable one,
/// the two batches counted. Before, both files were read whole.
#[test]
fn report_reads_a_huge_summary_and_ledger_within_bounds() {
    let dir = TestDir::new("bigreport");
    let run = dir.path("run");
    std::fs::create_dir_all(run.join("ledger")).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"t_s\":1}\n{\"t_s\":2}\n").unwrap();
    let sparse = |path: &Path, before: &str, len: u64, after: &str| {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(before.as_bytes()).unwrap();
        f.set_len(len).unwrap();
        f.seek(SeekFrom::End(0)).unwrap();
        f.write_all(after.as_bytes()).unwrap();
    };
    sparse(&run.join("summary.json"), "{", 2 << 30, "}");
    let line = |batch: u64| {
        format!(
            "{{\"batch_id\":{batch},\"sample_ids\":[{batch}],\"tokens\":10,\"delivery\":0,\"step\":{batch},\"epoch\":1}}\n"
        )
    };
    sparse(
        &run.join("ledger").join("drafter-0.jsonl"),
        &line(0),
        1 << 30,
        &format!("\n{}", line(1)),
    );
    let svg = dir.path("report.svg");
    let (status, said) =
        launcher_limited(&["report", run.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(status.success(), "{status}: {said}");
    assert!(
        said.contains("summary.json is unreadable (it is 2147483649 bytes, more than any summary"),
        "{said}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.contains("the ledgers hold 2 trained batches"),
        "{said}"
    );
}

/// `launcher report` of a long run (40,000 ticks a second apart, stopped and resumed, a death,
/// a one-tick stall with a 600 s idle gap) draws every series downsampled to the picture's
/// columns, at most two points a column, keeps the stall's gap at its height, and marks the
/// resume and the death; under the data limit, and the watchdog's eye for a hang.
#[test]
fn report_draws_a_long_run_downsampled_with_its_spike_and_resume() {
    let dir = TestDir::new("longreport");
    let run = dir.path("run");
    std::fs::create_dir_all(&run).unwrap();
    let spec = testkit::metrics::Run {
        targets: 1,
        drafters: 1,
        launches: vec![24_000, 16_000],
        period_s: 1.0,
        steps_per_tick: 1,
        spike_at: Some(31_000),
        death_at: Some(5_000),
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(run.join("metrics.jsonl")).unwrap());
    assert_eq!(spec.write(&mut f).unwrap(), 40_000);
    f.flush().unwrap();
    let svg = dir.path("report.svg");
    let (status, said) =
        launcher_limited(&["report", run.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(status.success(), "{status}: {said}");
    assert!(
        said.contains("40000 ticks over 40000.0 s, 1 deaths, 1 restarts"),
        "{said}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    // 1200 pixels wide: 600 columns; a band from the least to the greatest of each column is
    // two points a column, an area one, plus its two corners on the axis.
    let mut series = 0;
    for element in ["<polyline", "<polygon", "<path"] {
        for at in picture.match_indices(element).map(|(i, _)| i) {
            let rest = &picture[at..];
            let tag = &rest[..rest.find('>').unwrap()];
            let Some(points) = tag.split(" points=\"").nth(1) else {
                continue;
            };
            let n = points.split('"').next().unwrap().split_whitespace().count();
            assert!(n <= 2 * 600 + 2, "{element} of {n} points: {}", &tag[..200]);
            series += usize::from(n > 100);
        }
    }
    // The ring (2), tokens/s (band and line), 8 phases of 2 workers, loss, tau and the gaps
    // (band and line each).
    assert!(series >= 2 + 2 + 16 + 6, "{series} series drawn");
    for want in [
        "the GPU idle): greatest 600.00",
        "drafter-0 died",
        "drafter-0 restarted",
        "light: least to greatest tick of each column",
    ] {
        assert!(picture.contains(want), "the picture lacks {want:?}");
    }
    assert_eq!(
        picture.matches("\nresumed\n").count(),
        2,
        "the resume is not marked"
    );
}
