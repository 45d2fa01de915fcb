//! TensorBoard's view of a run: the event files in `<run-dir>/tb/` read back as TensorBoard
//! reads them. A file is TFRecords (length u64, its masked CRC-32C, the data, its masked
//! CRC-32C), each an `Event` protobuf; the messages below keep the field numbers of
//! TensorBoard's `event.proto` and `summary.proto`, and prost decodes them.

use std::collections::BTreeMap;
use std::path::Path;

use proto::RunDir;

use crate::launcher::{config, Run};

/// `tensorboard.Event`: its `oneof what` as the two members we write.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `Summary.Value`, a scalar (`simple_value`).
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// One event file: its name and its scalars by tag, as (step, value) in file order.
pub(crate) struct EventFile {
    pub(crate) name: String,
    pub(crate) series: BTreeMap<String, Vec<(i64, f32)>>,
    /// The file ends inside a record (its writer was killed mid-write): TensorBoard reads the
    /// records before it.
    pub(crate) truncated: bool,
}

impl EventFile {
    /// When its launcher started (Unix time, ms, to the second): the seconds in its name,
    /// `events.out.tfevents.<seconds>.<host>.<pid>`.
    pub(crate) fn launch_ms(&self) -> i64 {
        let secs = self.name.strip_prefix("events.out.tfevents.").unwrap();
        1000 * secs.split('.').next().unwrap().parse::<i64>().unwrap()
    }

    /// The steps of a series (none for a series the file lacks).
    pub(crate) fn steps(&self, tag: &str) -> Vec<i64> {
        self.series
            .get(tag)
            .map_or(Vec::new(), |p| p.iter().map(|&(s, _)| s).collect())
    }
}

/// TFRecord's checksum: CRC-32C, rotated and offset.
fn masked_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// Reads an event file whole, checking every record's framing and that it starts with the
/// file version TensorBoard expects.
fn read_file(path: &Path) -> EventFile {
    let bytes = std::fs::read(path).unwrap();
    let mut rest = &bytes[..];
    let mut events = Vec::new();
    let mut truncated = false;
    while !rest.is_empty() {
        if rest.len() < 12 {
            truncated = true;
            break;
        }
        let (len, tail) = rest.split_at(8);
        let crc = u32::from_le_bytes(tail[..4].try_into().unwrap());
        assert_eq!(crc, masked_crc(len), "{}: length checksum", path.display());
        let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
        if tail.len() < 4 + n + 4 {
            truncated = true;
            break;
        }
        let (data, tail) = tail[4..].split_at(n);
        let crc = u32::from_le_bytes(tail[..4].try_into().unwrap());
        assert_eq!(crc, masked_crc(data), "{}: data checksum", path.display());
        events.push(<Event as prost::Message>::decode(data).unwrap());
        rest = &tail[4..];
    }
    assert_eq!(
        events.first().and_then(|e| e.file_version.as_deref()),
        Some("brain.Event:2"),
        "{}",
        path.display()
    );
    let mut series: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    for e in &events[1..] {
        assert!(e.wall_time > 1e9, "a wall time in seconds: {e:?}");
        for v in &e.summary.as_ref().expect("a summary").value {
            let x = v.simple_value.expect("a scalar");
            series.entry(v.tag.clone()).or_default().push((e.step, x));
        }
    }
    EventFile {
        name: path.file_name().unwrap().to_string_lossy().into_owned(),
        series,
        truncated,
    }
}

/// The same points, steps exactly and values to f32's precision (metrics.jsonl's values went
/// through JSON text).
fn assert_points(tag: &str, got: &[(i64, f32)], want: &[(i64, f64)]) {
    let close = |a: f32, b: f64| (f64::from(a) - b).abs() <= 1e-6 * b.abs().max(1.0);
    assert!(
        got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| g.0 == w.0 && close(g.1, w.1)),
        "{tag}: {got:?}, want {want:?}"
    );
}

/// The run's event files in name order, the order TensorBoard reads them in.
pub(crate) fn read_run(run_dir: &Path) -> Vec<EventFile> {
    let mut paths: Vec<_> = std::fs::read_dir(RunDir::new(run_dir).tensorboard_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths.iter().map(|p| read_file(p)).collect()
}

/// The monitor's ticks, as metrics.jsonl has them (a line torn by a kill skipped).
pub(crate) fn ticks(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(RunDir::new(run_dir).metrics())
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The pipeline series' steps of `ticks`, in a run first launched at `first_launch_ms`: each
/// tick's time since then in ms, one on from the tick before where that is not more.
pub(crate) fn pipeline_steps(first_launch_ms: i64, ticks: &[serde_json::Value]) -> Vec<i64> {
    let mut last = None;
    (ticks.iter())
        .map(|t| {
            let at = t["launch_unix_ms"].as_i64().unwrap()
                + (t["t_s"].as_f64().unwrap() * 1000.0).round() as i64;
            let step = (at - first_launch_ms).max(last.map_or(0, |l| l + 1));
            last = Some(step);
            step
        })
        .collect()
}

/// A mock run's event file has every tick: the pipeline's series once per tick at the tick's
/// time since the launch (ms) with metrics.jsonl's values, the drafters' phase shares, and the
/// loss once per group step at that step (no tau or lr: the mock reports none); summary.json
/// has the group's last step and loss, and no tau.
#[test]
fn a_run_writes_its_ticks_to_tensorboard_and_its_last_step_to_the_summary() {
    let run = Run::new("ltb");
    let cfg = config(&run.dir, false, "");
    let out = run.launch(&cfg, &["--monitor", "0.1"]).finish();
    assert!(out.contains("exit code 0"), "{out}");
    let ticks = ticks(&run.run_dir());
    let files = read_run(&run.run_dir());
    assert_eq!(files.len(), 1, "one file per launcher");
    let tb = &files[0];
    assert!(tb.name.starts_with("events.out.tfevents."), "{}", tb.name);
    assert!(!tb.truncated, "{}", tb.name);
    let n = ticks.len() as i64;
    for (tag, field) in [
        ("pipeline/tokens_per_s", "tokens_per_s"),
        ("targets/busy", "targets_busy"),
        ("targets/waiting", "targets_waiting"),
        ("drafters/busy", "drafters_busy"),
        ("drafters/waiting", "drafters_waiting"),
    ] {
        // One point per tick, at its time.
        let want: Vec<(i64, f64)> = pipeline_steps(tb.launch_ms(), &ticks)
            .into_iter()
            .zip(&ticks)
            .map(|(i, t)| (i, t[field].as_f64().unwrap()))
            .collect();
        assert_points(tag, &tb.series[tag], &want);
    }
    assert!(
        tb.series["pipeline/tokens_per_s"]
            .iter()
            .any(|&(_, v)| v > 0.0),
        "{:?}",
        tb.series["pipeline/tokens_per_s"]
    );
    // The drafters' phase shares: every tick, shares of the tick; the drafters computed.
    let phases: Vec<&String> = (tb.series.keys())
        .filter(|k| k.starts_with("drafters/phase/"))
        .collect();
    assert!(!phases.is_empty() && !tb.series.contains_key("drafters/phase/wait_full"));
    for p in &phases {
        assert_eq!(tb.series[*p].len() as i64, n, "{p}");
        assert!(
            tb.series[*p].iter().all(|&(_, v)| (0.0..=1.0).contains(&v)),
            "{p}"
        );
    }
    let compute = &tb.series["drafters/phase/compute"];
    assert!(compute.iter().any(|&(_, v)| v > 0.0), "{compute:?}");
    assert!(tb.series.contains_key("targets/phase/load"));
    // The loss: once per tick that brought a new group step, at that step, the tick's value.
    let mut want = Vec::new();
    let mut last = None;
    for t in &ticks {
        if let Some(step) = t["group_step"].as_i64().filter(|&s| last < Some(s)) {
            last = Some(step);
            want.push((step, t["drafter_loss"].as_f64().unwrap()));
        }
    }
    let loss = &tb.series["train/loss"];
    assert!(!want.is_empty());
    assert_points("train/loss", loss, &want);
    assert!(
        loss.iter().all(|&(_, v)| v.is_finite() && v > 0.0),
        "{loss:?}"
    );
    assert!(!tb.series.contains_key("train/tau") && !tb.series.contains_key("train/lr"));
    // summary.json: the group where it ended.
    let s = run.summary();
    let last_trained = run.ledgers().iter().map(|l| l.step).max().unwrap();
    let d = &s["drafter"];
    assert!(d["step"].as_u64() >= Some(last_trained), "{s}");
    assert_eq!(d["step"].as_i64(), last, "{s}");
    assert!(d["loss"].as_f64().is_some_and(|l| l > 0.0), "{s}");
    assert!(d["tau"].is_null(), "{s}");
}

/// A run whose event file cannot be made (`tb` is a file) says so once and runs to the end
/// as any other; metrics.jsonl has every tick.
#[test]
fn a_run_that_cannot_write_tensorboard_says_so_once_and_finishes() {
    let run = Run::new("ltboff");
    // In a run directory laid out (by a launcher that ended before training), as a new run may
    // use.
    RunDir::new(run.run_dir()).lay_out().unwrap();
    std::fs::write(
        RunDir::new(run.run_dir()).tensorboard_dir(),
        b"not a folder",
    )
    .unwrap();
    let cfg = config(&run.dir, false, "");
    let out = run.launch(&cfg, &["--monitor", "0.1"]).finish();
    assert!(out.contains("exit code 0"), "{out}");
    assert_eq!(out.matches("TensorBoard events off").count(), 1, "{out}");
    assert_eq!(run.summary()["ok"], true);
    assert!(ticks(&run.run_dir()).len() > 1);
}
