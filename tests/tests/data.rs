//! Training data end to end: the same samples through JSONL, Parquet and an HF `datasets`
//! directory plan and train the same; pyarrow reads the prepared file and we read pyarrow's;
//! bad rows in every format are named; the cache is reused by re-runs, a resume and a
//! restarted target, and refused when damaged; a resume of changed data trains the data it planned.
//!
//! Length: one test per format and per failure a user meets, each standing alone.
//!
//! Fixtures come from `tests/py/fixtures.py`, run with the Python that `scripts/test.sh`
//! provides (`.venv`, with pyarrow and datasets; `HSPIPE_PYTHON` names it). Without it these
//! tests fail, saying so: they never skip. Only the tests use Python: hspipe reads every
//! format, Parquet included, in Rust.

use rustix::process::Signal;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use proto::PipelineConfig;
use proto::{LedgerLine, RunDir};

use crate::launcher::{kill, no_segment_of};
use crate::support::{
    catches_sigterm, spawn, stale_segments_shared, workspace_bin, Proc, TestDir, WATCHDOG,
};

/// The environment variable naming the tests' Python (it makes fixtures and checks our files
/// with pyarrow; hspipe itself runs no Python, for any input format).
const PYTHON_ENV: &str = "HSPIPE_PYTHON";

/// The Python with pyarrow and datasets: `HSPIPE_PYTHON`, else the repository's `.venv`.
/// Panics, saying how to get one, when it is missing.
pub(crate) fn python() -> String {
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python");
    let py = std::env::var(PYTHON_ENV).unwrap_or_else(|_| venv.to_string());
    let out = Command::new(&py)
        .args(["-c", "import pyarrow, datasets"])
        .output();
    match out {
        Ok(o) if o.status.success() => py,
        Ok(o) => panic!(
            "the data tests need Python with pyarrow and datasets, and {py} has not them ({}): run scripts/test.sh, which installs them into .venv, or set {PYTHON_ENV} to a Python that has them",
            String::from_utf8_lossy(&o.stderr).trim(),
        ),
        Err(e) => panic!(
            "the data tests need Python with pyarrow and datasets, and {py} cannot run ({e}): run scripts/test.sh, which makes .venv with them, or set {PYTHON_ENV} to a Python that has them",
        ),
    }
}

/// Runs `tests/py/fixtures.py` with `args`; returns its stdout.
fn fixtures(args: &[&str]) -> String {
    let py = python();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/py/fixtures.py");
    let out = Command::new(&py)
        .arg(script)
        .args(args)
        .env("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fixtures.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A test's directory; `s` gives a path in it as an argument.
type Dir = TestDir;

impl TestDir {
    fn s(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }
}

type Owned = (Vec<u32>, Option<Vec<u8>>);

/// `n` samples of 16..=512 tokens; every third without a mask.
fn samples(n: usize) -> Vec<Owned> {
    (0..n)
        .map(|i| {
            let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            let len = 16 + (h % 497) as usize;
            let ids = (0..len)
                .map(|j| ((h as usize + j * 7) % 150_000) as u32)
                .collect();
            let mask = (i % 3 != 0).then(|| (0..len).map(|j| u8::from(j >= len / 5)).collect());
            (ids, mask)
        })
        .collect()
}

fn jsonl_of(data: &[Owned]) -> String {
    data.iter()
        .map(|(ids, mask)| match mask {
            Some(m) => format!("{{\"input_ids\": {ids:?}, \"loss_mask\": {m:?}}}\n"),
            None => format!("{{\"input_ids\": {ids:?}}}\n"),
        })
        .collect()
}

fn samples_json(data: &[Owned]) -> String {
    let v: Vec<serde_json::Value> = data
        .iter()
        .map(|(ids, mask)| serde_json::json!({"input_ids": ids, "loss_mask": mask}))
        .collect();
    serde_json::to_string(&v).unwrap()
}

fn read_all(m: &dataset::Mapped) -> Vec<Owned> {
    (0..m.len())
        .map(|i| {
            let s = m.sample(i).unwrap();
            (s.input_ids.to_vec(), s.loss_mask.map(|m| m.into_owned()))
        })
        .collect()
}

fn prepare(
    input: &Path,
    max_len: u32,
    cache: &Path,
) -> Result<dataset::Prepared, dataset::DataError> {
    dataset::prepare(input, max_len, cache, None, &mut dataset::quiet)
}

/// A config for quick runs over 16..=512-token samples; `tokens_per_s` sets both sides' speed.
fn run_config(dir: &Dir, tokens_per_s: f64, extra: &str) -> PathBuf {
    let p = dir.path("run.toml");
    std::fs::write(
        &p,
        format!(
            "[ring]\nslots = 24\nmin_ready = 4\n[model]\nlayers = 2\nhidden = 16\n[data]\nmin_len = 16\nmax_len = 512\n[target]\ntoken_budget = 2048\ntokens_per_s = {tokens_per_s:.1}\n[drafter]\ntokens_per_s = {tokens_per_s:.1}\ncheckpoint_every = 3\n{extra}"
        ),
    )
    .unwrap();
    p
}

/// Starts `launcher` (5 targets, 3 drafters) with `config` (None: a resume) and `args`.
fn launch(config: Option<&Path>, args: &[&str]) -> Proc {
    let mut all = vec!["--targets", "0-4", "--drafters", "5-7", "--monitor", "0.5"];
    if let Some(c) = config {
        all.extend(["--config", c.to_str().unwrap()]);
    }
    all.extend_from_slice(args);
    spawn(&workspace_bin("launcher"), &all)
}

/// Every ledger line of a run, by batch: its sorted sample ids and tokens.
fn trained(run_dir: &Path) -> BTreeMap<u64, (Vec<u64>, u64)> {
    let mut out = BTreeMap::new();
    for d in 0..3 {
        let text = std::fs::read_to_string(RunDir::new(run_dir).ledger(d)).unwrap_or_default();
        for l in text.lines() {
            let l: LedgerLine = serde_json::from_str(l).unwrap();
            let mut ids = l.sample_ids.clone();
            ids.sort_unstable();
            out.insert(l.batch_id, (ids, l.tokens));
        }
    }
    out
}

#[test]
fn the_same_samples_as_jsonl_parquet_and_a_datasets_directory_plan_and_train_the_same() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dformats");
    let data = samples(300);
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&data)).unwrap();
    std::fs::write(dir.path("samples.json"), samples_json(&data)).unwrap();
    fixtures(&["formats", &dir.s("samples.json"), &dir.s("")]);
    let config = run_config(&dir, 2_000_000.0, "");
    let cfg = PipelineConfig::load(&config).unwrap();
    let inputs = ["train.jsonl", "train.parquet", "hf"];

    // The library: the same samples (a missing mask stays missing), so the same plan.
    let mut plans = Vec::new();
    for input in inputs {
        let p = prepare(&dir.path(input), 512, &dir.path("cache")).unwrap();
        let m = dataset::Mapped::open(&p.path).unwrap();
        assert_eq!(read_all(&m), data, "{input}");
        plans.push(proto::plan::plan(&m.lengths(), &cfg));
    }
    assert!(plans.len() == 3 && plans[0] == plans[1] && plans[0] == plans[2]);
    // Parquet compressed with ZSTD (pyarrow's default is Snappy, as above) reads the same.
    let z = prepare(&dir.path("train-zstd.parquet"), 512, &dir.path("cache")).unwrap();
    assert_eq!(read_all(&dataset::Mapped::open(&z.path).unwrap()), data);

    // End to end: each format trains the same batches with the same samples.
    let mut runs = Vec::new();
    for input in inputs {
        let run_dir = dir.path(&format!("run-{}", input.replace('.', "-")));
        let l = launch(
            Some(&config),
            &[
                "--data",
                &dir.s(input),
                "--run-dir",
                run_dir.to_str().unwrap(),
            ],
        );
        let out = l.finish();
        assert!(
            out.contains("exit code 0") && out.contains("prepared in"),
            "{input}: {out}"
        );
        runs.push(trained(&run_dir));
    }
    assert_eq!(runs[0].len(), plans[0].len(), "every planned batch trained");
    let samples: usize = runs[0].values().map(|(ids, _)| ids.len()).sum();
    assert_eq!(samples, 300);
    assert_eq!(runs[0], runs[1], "JSONL and Parquet");
    assert_eq!(runs[0], runs[2], "JSONL and the datasets directory");
}

#[test]
fn pyarrow_reads_what_we_write_and_we_map_what_pyarrow_writes() {
    let dir = Dir::new("dinterop");
    let data = samples(40);
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&data)).unwrap();
    let out = dir.path("train.arrow");
    let p = dataset::prepare(
        &dir.path("train.jsonl"),
        512,
        &dir.path("unused"),
        Some(&out),
        &mut dataset::quiet,
    )
    .unwrap();

    // pyarrow: a valid Arrow file (validated in full), our columns, types and metadata.
    let got: serde_json::Value =
        serde_json::from_str(&fixtures(&["read", &dir.s("train.arrow")])).unwrap();
    let ids: Vec<Vec<u32>> = serde_json::from_value(got["input_ids"].clone()).unwrap();
    let masks: Vec<Option<Vec<u8>>> = serde_json::from_value(got["loss_mask"].clone()).unwrap();
    let back: Vec<Owned> = ids.into_iter().zip(masks).collect();
    assert_eq!(back, data);
    assert_eq!(got["metadata"]["hspipe.key"], p.key.as_str());
    assert_eq!(got["metadata"]["hspipe.dataset"], dataset::FORMAT_VERSION);
    assert_eq!(got["types"][0], "list<item: uint32 not null>");
    assert_eq!(got["types"][1], "list<item: uint8 not null>");

    // What pyarrow writes (three record batches, other columns between ours) maps as it is.
    fixtures(&["arrow", &dir.s("")]);
    let m = dataset::Mapped::open(&dir.path("pyarrow.arrow")).unwrap();
    let mut want: Vec<Owned> = Vec::new();
    for k in 0..3u32 {
        for i in 0..5 + k {
            let ids = (0..=i).map(|j| k * 100 + i + j).collect();
            let mask = (i % 2 == 0).then(|| vec![1u8; i as usize + 1]);
            want.push((ids, mask));
        }
    }
    assert_eq!(read_all(&m), want);
    // And converts to the same samples; a large_list<int16> stream converts too.
    let c = prepare(&dir.path("pyarrow.arrow"), 512, &dir.path("cache")).unwrap();
    assert_eq!(c.kind, dataset::Kind::ArrowFile { prepared: false });
    assert_eq!(read_all(&dataset::Mapped::open(&c.path).unwrap()), want);
    let s = prepare(&dir.path("stream.arrows"), 512, &dir.path("cache")).unwrap();
    assert_eq!(s.kind, dataset::Kind::ArrowStream);
    assert_eq!(
        read_all(&dataset::Mapped::open(&s.path).unwrap()),
        vec![(vec![7, 8], None), (vec![9], None)]
    );
}

#[test]
fn bad_rows_in_every_format_are_named_by_file_and_row() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dbad");
    fixtures(&["bad", &dir.s("")]);
    let cases = [
        ("negative.parquet", "negative.parquet: row 2: input_ids[1] = -5 is out of range for a token id"),
        ("too_big.parquet", "too_big.parquet: row 2: input_ids[0] = 4294967296 is out of range"),
        ("empty.parquet", "empty.parquet: row 2: input_ids is empty"),
        ("null_row.parquet", "null_row.parquet: row 2: input_ids is null"),
        ("null_id.parquet", "null_id.parquet: row 2: input_ids[1] is null"),
        ("too_long.parquet", "too_long.parquet: row 2: 9 tokens, more than data.max_len 8"),
        ("mask_length.parquet", "mask_length.parquet: row 2: loss_mask has 1 entries, input_ids has 2"),
        ("mask_value.parquet", "mask_value.parquet: row 2: loss_mask entries must be 0 or 1"),
        ("float_ids.parquet", "column input_ids has type list<floating point>; it must be a list of integer token ids"),
        ("no_column.parquet", "no input_ids, messages, conversations or text column (columns: ids)"),
        ("not.parquet", "named .parquet, but it does not start like a parquet file: it starts as JSON does (JSON Lines?): if it is JSONL, name it .jsonl"),
        ("corrupt.parquet", "corrupt.parquet: not a readable Parquet file"),
        ("gzip.parquet", "gzip.parquet: it is compressed with GZIP, which hspipe does not read"),
        // Rows count across an HF directory's shards.
        ("hf_too_big", "hf_too_big/data-00001-of-00002.arrow: row 5: input_ids[0] = 4294967297 is out of range"),
        ("hf_mask_value", "hf_mask_value/data-00000-of-00001.arrow: row 2: loss_mask entries must be 0 or 1"),
        ("hf_empty", "hf_empty/data-00000-of-00001.arrow: row 1: input_ids is empty"),
        ("hf_dict", "a DatasetDict (splits: "),
    ];
    for (input, want) in cases {
        let err = prepare(&dir.path(input), 8, &dir.path("cache"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{input}: {err:?} should say {want:?}");
    }
    assert!(!dir.path("cache").exists(), "nothing left half-written");

    // Through the launcher: exit 1, the row named, no panic, nothing left in /dev/shm.
    let config = run_config(&dir, 2_000_000.0, "");
    let l = launch(
        Some(&config),
        &[
            "--data",
            &dir.s("negative.parquet"),
            "--run-dir",
            &dir.s("run"),
        ],
    );
    let pid = l.child.id();
    let (status, err) = l.wait_status_keep();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("error: preparing the dataset: ") && err.contains("row 2: input_ids[1] = -5"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    no_segment_of(pid);

    // No Python is needed to read Parquet: with none to be found, the launcher still reads the
    // file up to its bad row.
    let l = Command::new(workspace_bin("launcher"))
        .args([
            "prepare",
            &dir.s("negative.parquet"),
            "--data-cache",
            &dir.s("cache"),
        ])
        .env(PYTHON_ENV, "/nonexistent/python3")
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&l.stderr);
    assert_eq!(l.status.code(), Some(1), "{err}");
    assert!(
        err.contains("negative.parquet: row 2: input_ids[1] = -5") && !err.contains("ython"),
        "{err}"
    );
}

/// The prepared files in a cache (not its stamps).
fn cache_files(cache: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "arrow"))
        .collect();
    v.sort();
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Waits until some drafter has trained a batch of `run_dir`.
fn wait_trained(run_dir: &Path, what: &str) {
    let deadline = Instant::now() + WATCHDOG;
    while trained(run_dir).is_empty() {
        assert!(
            Instant::now() < deadline,
            "{what}: nothing trained in {WATCHDOG:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rerun_a_resume_and_a_restarted_target_reuse_the_prepared_data_and_a_resume_keeps_its_planned_data(
) {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dcache");
    let text = jsonl_of(&samples(400));
    std::fs::write(dir.path("train.jsonl"), &text).unwrap();
    let cache = dir.path("cache");
    // Target 1 crashes after every two batches (each incarnation counts anew) and is
    // restarted as often as that takes.
    let config = run_config(&dir, 2_000_000.0, "[faults.target-1]\ncrash_after = 2\n");
    let args = |run: &str| {
        vec![
            "--max-restarts".to_string(),
            "100".into(),
            "--data".into(),
            dir.s("train.jsonl"),
            "--data-cache".into(),
            cache.to_string_lossy().into_owned(),
            "--run-dir".into(),
            dir.s(run),
        ]
    };

    let out = launch(Some(&config), &strs(&args("run1"))).finish();
    assert!(
        out.contains("prepared in") && out.contains("exit code 0"),
        "{out}"
    );
    let files = cache_files(&cache);
    assert_eq!(files.len(), 1, "{files:?}");
    let made = std::fs::metadata(&files[0]).unwrap().modified().unwrap();
    // The restarted target mapped the prepared file again; no target converted anything.
    let log = std::fs::read_to_string(dir.path("run1/logs/target-1.log")).unwrap();
    let mapped = format!("{} (mapped, 400 samples)", files[0].display());
    assert!(
        log.matches(&mapped).count() >= 2,
        "two incarnations map it: {log}"
    );
    assert!(out.contains("target-1 restarted"), "{out}");

    // A re-run: found by content, not converted again.
    let out = launch(Some(&config), &strs(&args("run2"))).finish();
    assert!(
        out.contains("was prepared before") && !out.contains("prepared in"),
        "{out}"
    );
    assert_eq!(cache_files(&cache), files);
    assert_eq!(
        std::fs::metadata(&files[0]).unwrap().modified().unwrap(),
        made
    );

    // A run stopped early, then resumed with its data changed in between: the resume trains
    // the prepared file the run was planned from, and says so; without that file it is refused.
    let slow = run_config(&dir, 3000.0, "");
    let l = launch(Some(&slow), &strs(&args("run3")));
    wait_trained(&dir.path("run3"), "run3");
    kill(l.child.id(), Signal::INT);
    assert_eq!(l.wait_status().code(), Some(130));
    let changed = text.replacen("\"input_ids\": [", "\"input_ids\": [1", 1);
    std::fs::write(dir.path("train.jsonl"), &changed).unwrap();
    let resume = [
        "--resume",
        &dir.s("run3"),
        "--data-cache",
        cache.to_str().unwrap(),
    ];
    let planned = files[0].clone();
    let away = dir.path("planned.arrow");
    std::fs::rename(&planned, &away).unwrap();
    let l = launch(None, &resume);
    let (status, err) = l.wait_status_keep();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("the data changed since this run started") && err.contains("is gone"),
        "{err}"
    );
    std::fs::rename(&away, &planned).unwrap();
    let out = launch(None, &resume).finish();
    assert!(
        out.contains("the resume trains the prepared file the run was planned from")
            && out.contains("exit code 0"),
        "{out}"
    );
    assert_eq!(
        cache_files(&cache).len(),
        2,
        "the changed data was prepared (to compare), and not trained"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("run3/summary.json")).unwrap())
            .unwrap();
    assert_eq!(
        (s["ok"].clone(), s["samples_trained"].clone()),
        (true.into(), 400.into())
    );
}

/// Runs `dir`'s train.jsonl with `config` and no restart allowed (a target's crash ends the
/// run), and checks that the run ends done with its `n` samples trained.
fn trains_every_sample_with_no_restart(dir: &Dir, config: &Path, n: u64) {
    let args = [
        "--data",
        &dir.s("train.jsonl"),
        "--run-dir",
        &dir.s("run"),
        "--max-restarts",
        "0",
    ];
    let out = launch(Some(config), &args).finish();
    assert!(out.contains("exit code 0"), "{out}");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("run/summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["samples_trained"], n, "{s}");
}

/// Samples shorter than `data.min_len` (a file's are not bound by it): the slots were sized
/// for a full token budget of min_len-token samples, and a batch of 2-token ones carried more
/// headers than a slot held, so every target crashed on it ("payload ... does not fit a slot").
#[test]
fn a_files_samples_shorter_than_min_len_fit_the_slots() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dshort");
    // Batches of a full token budget (2048) of 2- and 3-token samples: ~800 headers a batch.
    let short: Vec<Owned> = (0..3000u32)
        .map(|i| ((0..2 + i % 2).map(|j| i * 7 + j).collect(), None))
        .collect();
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&short)).unwrap();
    let config = run_config(&dir, 2_000_000.0, "");
    trains_every_sample_with_no_restart(&dir, &config, 3000);
}

/// A file whose shortest sample (below `data.min_len`) does not divide the token budget: the
/// slots were sized for `budget / shortest` samples of the shortest length, fewer tokens than a
/// full budget of longer ones (here 136 x 15 = 2040 against 4 x 512 = 2048; with a hidden of
/// 256, 8 tokens outweigh 132 headers), so every target crashed on the first full batch
/// ("payload ... does not fit a slot"), and a resume sized the ring the same.
#[test]
fn a_full_token_budget_fits_the_slots_whatever_the_shortest_sample() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dbudget");
    let mut data: Vec<Owned> = vec![((0..15).collect(), None)];
    data.extend((0..200u32).map(|i| ((0..512).map(|j| (i * 13 + j) % 150_000).collect(), None)));
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&data)).unwrap();
    let config = dir.path("run.toml");
    std::fs::write(
        &config,
        "[ring]\nslots = 16\nmin_ready = 2\n[model]\nlayers = 2\nhidden = 256\n[data]\nmin_len = 16\nmax_len = 512\n[target]\ntoken_budget = 2048\ntokens_per_s = 2000000.0\n[drafter]\ntokens_per_s = 2000000.0\n",
    )
    .unwrap();
    trains_every_sample_with_no_restart(&dir, &config, 201);
}

/// A resume whose input file is gone trains the prepared file the run was planned from: it was
/// refused ("reading dataset ...: No such file or directory") while that file was in the cache,
/// and nothing said the way on.
#[test]
fn a_resume_whose_input_is_gone_trains_the_prepared_file() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dgone");
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&samples(400))).unwrap();
    let cache = dir.path("cache");
    let slow = run_config(&dir, 3000.0, "");
    let args = [
        "--data",
        &dir.s("train.jsonl"),
        "--data-cache",
        cache.to_str().unwrap(),
        "--run-dir",
        &dir.s("run"),
    ];
    let l = launch(Some(&slow), &args);
    wait_trained(&dir.path("run"), "run");
    kill(l.child.id(), Signal::INT);
    assert_eq!(l.wait_status().code(), Some(130));
    std::fs::remove_file(dir.path("train.jsonl")).unwrap();
    let resume = [
        "--resume",
        &dir.s("run"),
        "--data-cache",
        cache.to_str().unwrap(),
    ];
    // With the prepared file gone too: both are named, not a bare "No such file".
    let planned = cache_files(&cache).remove(0);
    let away = dir.path("planned.arrow");
    std::fs::rename(&planned, &away).unwrap();
    let (status, err) = launch(None, &resume).wait_status_keep();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("train.jsonl is gone, and so is the prepared file the run was planned from"),
        "{err}"
    );
    std::fs::rename(&away, &planned).unwrap();
    let out = launch(None, &resume).finish();
    assert!(
        out.contains(
            "train.jsonl is gone: the resume trains the prepared file the run was planned from"
        ) && out.contains("exit code 0"),
        "{out}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("run/summary.json")).unwrap())
            .unwrap();
    assert_eq!(
        (s["ok"].clone(), s["samples_trained"].clone()),
        (true.into(), 400.into())
    );
}

/// `launcher prepare good.jsonl -o /dev/null`, as root, replaced the device with the prepared
/// file (the rename of the atomic write puts a file in place of whatever is there): now a
/// target that is not a regular file is refused, naming `-o`, and left as it is.
#[test]
fn prepare_refuses_an_output_that_is_not_a_regular_file_and_leaves_it() {
    use std::os::unix::fs::FileTypeExt;
    let dir = Dir::new("dfifo");
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&samples(20))).unwrap();
    let fifo = dir.path("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let out = Command::new(workspace_bin("launcher"))
        .args(["prepare", &dir.s("train.jsonl"), "-o", &dir.s("fifo")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("error: -o {}", fifo.display()))
            && err.contains("is a FIFO (a named pipe, or a shell's <(...)), not a regular file"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let t = std::fs::symlink_metadata(&fifo).unwrap().file_type();
    assert!(t.is_fifo(), "still a FIFO, not {t:?}");
}

/// A stop signal while the data is prepared (minutes, for a large set) stops the preparation:
/// exit 130 and a line saying what was stopped, nothing partial in the data cache, no run laid
/// out, no segment. Before, the launcher had no handler yet and died of the signal, leaving
/// its temporary file (as big as the prepared file) in the cache. Both the run and `launcher
/// prepare`. The signal is sent once the handler is installed (the launcher's first act); if
/// the preparation was done by the time it was heard, the run stops before its workers start,
/// which exits 130 too.
#[test]
fn a_stop_signal_while_the_data_is_prepared_exits_130_leaving_nothing_partial() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dstop");
    std::fs::write(dir.path("big.jsonl"), jsonl_of(&samples(12_000))).unwrap();
    let config = run_config(&dir, 2_000_000.0, "");
    let config = config.to_str().unwrap();
    let cache = dir.path("cache");
    std::fs::write(dir.path("out.arrow"), "old").unwrap();
    let runs: [Vec<String>; 3] = [
        strings(&[
            "--targets",
            "0",
            "--drafters",
            "1",
            "--config",
            config,
            "--data",
            &dir.s("big.jsonl"),
            "--data-cache",
            &dir.s("cache"),
            "--run-dir",
            &dir.s("run"),
        ]),
        strings(&[
            "prepare",
            &dir.s("big.jsonl"),
            "--config",
            config,
            "--data-cache",
            &dir.s("cache"),
        ]),
        strings(&[
            "prepare",
            &dir.s("big.jsonl"),
            "--config",
            config,
            "-o",
            &dir.s("out.arrow"),
        ]),
    ];
    for args in runs {
        let p = spawn(&workspace_bin("launcher"), &strs(&args));
        let pid = p.child.id();
        let t0 = Instant::now();
        while !catches_sigterm(pid) {
            assert!(
                t0.elapsed() < WATCHDOG,
                "launcher {args:?} never caught SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        kill(pid, Signal::TERM);
        let (status, out, p) = p.finish_status();
        std::thread::sleep(Duration::from_millis(100));
        let err = p.stderr();
        let said = format!("{out}{err}");
        let to_file = args.iter().any(|a| a == "-o");
        // `launcher prepare` done before the stop was heard: a whole file, and exit 0.
        if status.code() == Some(0) && args[0] == "prepare" {
            eprintln!("{args:?}: done before the stop");
            continue;
        }
        assert_eq!(status.code(), Some(130), "{args:?}: {status}\n{said}");
        let left = match to_file {
            true => format!("big.jsonl: {} is left as it was", dir.s("out.arrow")),
            false => "big.jsonl: nothing of it is left in the data cache".into(),
        };
        let in_preparation =
            said.contains("stopped by SIGTERM while preparing") && said.contains(&left);
        let before_workers = said.contains("stopped by SIGTERM before the workers started");
        assert!(in_preparation || before_workers, "{args:?}: {said}");
        if to_file {
            assert_eq!(std::fs::read(dir.path("out.arrow")).unwrap(), b"old");
            let beside: Vec<_> = (std::fs::read_dir(dir.path("")).unwrap())
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".tmp"))
                .collect();
            assert!(beside.is_empty(), "left beside out.arrow: {beside:?}");
        }
        assert!(
            !said.contains("error:") && !said.contains("panicked"),
            "{said}"
        );
        eprintln!(
            "{}: stopped {}",
            args[0],
            if in_preparation {
                "in the preparation"
            } else {
                "after it"
            }
        );
        let partial: Vec<_> = std::fs::read_dir(&cache)
            .into_iter()
            .flatten()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(partial.is_empty(), "left in the cache: {partial:?}");
        if in_preparation {
            assert!(!dir.path("run/config.toml").exists(), "no run was laid out");
        }
        no_segment_of(pid);
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `launcher prepare ARGS`, which must succeed; returns its stdout.
fn launcher_prepare(args: &[&str]) -> String {
    let out = Command::new(workspace_bin("launcher"))
        .arg("prepare")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_truncated_or_foreign_cache_file_stops_the_launcher_with_a_clear_error() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dtrunc");
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&samples(60))).unwrap();
    let config = run_config(&dir, 2_000_000.0, "");
    let stdout = launcher_prepare(&[
        &dir.s("train.jsonl"),
        "--config",
        config.to_str().unwrap(),
        "--data-cache",
        &dir.s("cache"),
    ]);
    let cached = PathBuf::from(stdout.lines().last().unwrap());
    assert!(cached.starts_with(dir.path("cache")), "{stdout}");
    let good = std::fs::read(&cached).unwrap();
    let run = |n: &str| {
        [
            "--data",
            &dir.s("train.jsonl"),
            "--data-cache",
            &dir.s("cache"),
            "--run-dir",
            &dir.s(n),
        ]
        .map(String::from)
    };

    for (n, bytes) in [
        ("cut", good[..good.len() - 100].to_vec()),
        ("foreign", b"{\"input_ids\": [1, 2]}\n".to_vec()),
    ] {
        std::fs::write(&cached, &bytes).unwrap();
        let args = run(n);
        let l = launch(
            Some(&config),
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let pid = l.child.id();
        let (status, err) = l.wait_status_keep();
        assert_eq!(status.code(), Some(1), "{n}: {err}");
        assert!(
            err.contains(&format!("prepared data {} is not usable", cached.display()))
                && err.contains("truncated or not hspipe's; delete it"),
            "{n}: {err}"
        );
        no_segment_of(pid);
    }
    // Deleted, as the message says: prepared again.
    std::fs::remove_file(&cached).unwrap();
    let args = run("again");
    let out = launch(
        Some(&config),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .finish();
    assert!(
        out.contains("prepared in") && out.contains("exit code 0"),
        "{out}"
    );
}

#[test]
fn a_file_launcher_prepare_wrote_is_used_as_it_is() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dout");
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&samples(60))).unwrap();
    let config = run_config(&dir, 2_000_000.0, "");
    launcher_prepare(&[&dir.s("train.jsonl"), "-o", &dir.s("train.arrow")]);
    // Moved to "another machine": the input is gone, the prepared file is all a run needs.
    std::fs::remove_file(dir.path("train.jsonl")).unwrap();
    let out = launch(
        Some(&config),
        &["--data", &dir.s("train.arrow"), "--run-dir", &dir.s("run")],
    )
    .finish();
    assert!(
        out.contains("is prepared; mapped as it is") && out.contains("exit code 0"),
        "{out}"
    );
    assert!(!dir.path("data-cache").exists(), "nothing converted");
}

/// A run's `config.toml`, reused with `--synthetic N`, trains N synthetic samples. It names
/// the file the run's data was prepared into (`data.prepared`), and before, that file was
/// what the workers mapped: the new run trained the old run's data instead.
#[test]
fn a_runs_config_reused_with_synthetic_trains_the_synthetic_samples() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dsynth");
    std::fs::write(dir.path("train.jsonl"), jsonl_of(&samples(60))).unwrap();
    let config = run_config(&dir, 2_000_000.0, "");
    let first = [
        "--data",
        &dir.s("train.jsonl"),
        "--data-cache",
        &dir.s("cache"),
        "--run-dir",
        &dir.s("run1"),
    ];
    assert!(launch(Some(&config), &first)
        .finish()
        .contains("exit code 0"));
    let reused = dir.path("run1/config.toml");
    let text = std::fs::read_to_string(&reused).unwrap();
    assert!(text.contains("prepared = "), "{text}");

    let out = launch(
        Some(&reused),
        &["--synthetic", "7", "--run-dir", &dir.s("run2")],
    )
    .finish();
    assert!(out.contains("data: synthetic (7 samples"), "{out}");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("run2/summary.json")).unwrap())
            .unwrap();
    assert_eq!(
        (s["ok"].clone(), s["samples_total"].clone()),
        (true.into(), 7.into()),
        "{s}"
    );
}

/// Waits until every target's log of `run_dir` says it attached (mapped the data and joined).
fn wait_attached(run_dir: &Path, targets: u32) {
    let deadline = Instant::now() + WATCHDOG;
    let attached = |i: u32| {
        let log = run_dir.join(format!("logs/target-{i}.log"));
        std::fs::read_to_string(log).is_ok_and(|l| l.contains("attached"))
    };
    while !(0..targets).all(attached) {
        assert!(
            Instant::now() < deadline,
            "not every target attached in {WATCHDOG:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A prepared file replaced at its path while the run trains it (`launcher prepare -o` again):
/// the running workers keep the file they mapped, and a target restarted after a crash refuses
/// the new one, naming both keys, instead of training other samples under the run's sample ids
/// (same lengths, so the same plan: the old build trained the mix and said `ok`). It is given up
/// like any crash loop; the other targets train the run's own data, every sample once.
#[test]
fn a_prepared_file_replaced_during_the_run_is_refused_by_a_restarted_target() {
    let _shared = stale_segments_shared();
    let dir = Dir::new("dswap");
    let text = jsonl_of(&samples(400));
    std::fs::write(dir.path("train.jsonl"), &text).unwrap();
    // The same lengths, other ids: the same plan, other data.
    let other = text.replacen("\"input_ids\": [", "\"input_ids\": [1", 1);
    std::fs::write(dir.path("other.jsonl"), &other).unwrap();
    launcher_prepare(&[&dir.s("train.jsonl"), "-o", &dir.s("train.arrow")]);
    let key_of = |p: &Path| {
        (dataset::Mapped::open(p).unwrap().meta("hspipe.key"))
            .unwrap()
            .to_string()
    };
    let run_key = key_of(&dir.path("train.arrow"));
    let config = run_config(&dir, 3000.0, "[faults.target-1]\ncrash_after = 2\n");
    let l = launch(
        Some(&config),
        &[
            "--max-restarts",
            "2",
            "--data",
            &dir.s("train.arrow"),
            "--run-dir",
            &dir.s("run"),
        ],
    );
    wait_attached(&dir.path("run"), 5);
    launcher_prepare(&[&dir.s("other.jsonl"), "-o", &dir.s("train.arrow")]);
    let new_key = key_of(&dir.path("train.arrow"));
    assert_ne!(run_key, new_key);
    let (status, out, _) = l.finish_status();
    assert_eq!(status.code(), Some(3), "{out}");
    let log = std::fs::read_to_string(dir.path("run/logs/target-1.log")).unwrap();
    let refusal = format!("it holds the data of key {new_key}, not the run's key {run_key}");
    assert!(log.contains(&refusal), "{log}");
    assert!(
        out.contains(&refusal) && out.contains("target-1 gave up"),
        "{out}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path("run/summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["samples_trained"], 400, "{s}");
    assert_eq!(s["duplicated"], 0, "{s}");
}
