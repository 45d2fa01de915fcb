//! TensorBoard's view of a run: the event files in `<run-dir>/tb/` read back as TensorBoard
//! reads them. A file is TFRecords (length u64, its masked CRC-32C, the data, its masked
//! CRC-32C), each an `Event` protobuf; the messages below keep the field numbers of
//! TensorBoard's `event.proto` and `summary.proto`, and prost decodes them.

use std::collections::BTreeMap;
use std::ops::{Range, RangeInclusive};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ::launcher::monitor::Tick;
use ::launcher::tensorboard::Board;
use proto::RunDir;
use ring_stat::analysis::{Interval, WorkerRates};
use shm_ring::{Phase, PhaseMap, Role, WorkerState};

use crate::launcher::{config, Run};
use crate::support::TestDir;

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

/// A mock run's event file has its ticks: the pipeline's series at the first tick with its
/// values, then a point at most every 10 s of run time, at its last tick's time since the
/// launch (ms) with the mean of its ticks (metrics.jsonl's), the last at the run's last tick;
/// the drafters' phase shares at the same steps; and the loss once per group step at that step
/// (no tau or lr: the mock reports none); summary.json has the group's last step and loss, and
/// no tau.
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
    let steps = pipeline_steps(tb.launch_ms(), &ticks);
    let points = tb.steps("pipeline/tokens_per_s");
    assert!(
        ticks.len() >= 2 && points.first() == steps.first() && points.last() == steps.last(),
        "{points:?} of the ticks at {steps:?}"
    );
    // The ticks of each point: those after the point before, up to its own.
    let mut folds = Vec::new();
    for p in &points {
        let from = folds.last().map_or(0, |f: &Range<usize>| f.end);
        let to = 1
            + (steps.iter())
                .position(|s| s == p)
                .unwrap_or_else(|| panic!("{p} is no tick's step: {steps:?}"));
        assert!(from < to, "{points:?}");
        folds.push(from..to);
    }
    for (tag, field) in [
        ("pipeline/tokens_per_s", "tokens_per_s"),
        ("targets/busy", "targets_busy"),
        ("targets/waiting", "targets_waiting"),
        ("drafters/busy", "drafters_busy"),
        ("drafters/waiting", "drafters_waiting"),
    ] {
        let series = &tb.series[tag];
        assert_eq!(tb.steps(tag), points, "{tag}");
        let value = |t: &serde_json::Value| t[field].as_f64().unwrap();
        assert_points(tag, &series[..1], &[(steps[0], value(&ticks[0]))]);
        // A mean of its ticks, weighted by their intervals (which metrics.jsonl lacks): between
        // the least and the greatest of them.
        for (&(step, v), fold) in series.iter().zip(&folds) {
            let folded = ticks[fold.clone()].iter().map(value);
            let least = folded.clone().fold(f64::INFINITY, f64::min);
            let greatest = folded.fold(f64::NEG_INFINITY, f64::max);
            let slack = 1e-6 * greatest.abs().max(1.0);
            assert!(
                (least - slack..=greatest + slack).contains(&f64::from(v)),
                "{tag} at {step}: {v} of ticks from {least} to {greatest}"
            );
        }
    }
    assert!(
        tb.series["pipeline/tokens_per_s"]
            .iter()
            .any(|&(_, v)| v > 0.0),
        "{:?}",
        tb.series["pipeline/tokens_per_s"]
    );
    // The drafters' phase shares: at the same steps, shares; the drafters computed.
    let phases: Vec<&String> = (tb.series.keys())
        .filter(|k| k.starts_with("drafters/phase/"))
        .collect();
    assert!(!phases.is_empty() && !tb.series.contains_key("drafters/phase/wait_full"));
    for p in &phases {
        assert_eq!(tb.steps(p), points, "{p}");
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

/// A tick of a board driven directly, `t_s` seconds into its launch at `launch_ms`, over an
/// interval of `seconds`, in which every pipeline value follows `x`: tokens/s `1000 x`, the
/// targets busy `x` and loading `x` of it, the drafters computing `x` of it; with group step
/// `2 t_s` and its loss, tau and lr.
fn board_tick(launch_ms: u64, t_s: f64, seconds: f64, x: f64) -> (Tick, Interval) {
    let worker = |role, index| {
        let mut phases = PhaseMap::default();
        match role {
            Role::Producer => (phases[Phase::Load], phases[Phase::WaitFull]) = (x, 1.0 - x),
            Role::Consumer => (phases[Phase::Compute], phases[Phase::Sync]) = (x, 1.0 - x),
        }
        WorkerRates {
            role,
            index,
            gpu: Some(index),
            pid: 100 + index,
            alive: true,
            state: WorkerState::Alive,
            restarts: 0,
            items: 1,
            items_per_s: 1.0,
            tokens_per_s: 1000.0 * x,
            busy: x,
            waiting: 1.0 - x,
            phases,
            device: None,
            largest_gap_s: 0.0,
        }
    };
    let iv = Interval {
        seconds,
        published_per_s: 1.0,
        released_per_s: 1.0,
        refused_per_s: 0.0,
        tokens_per_s: 1000.0 * x,
        full_frac: 0.0,
        empty_frac: 0.0,
        short_frac: 0.0,
        workers: (0..2)
            .map(|i| worker(Role::Producer, i))
            .chain((0..3).map(|i| worker(Role::Consumer, i)))
            .collect(),
    };
    let step = (2.0 * t_s).round() as u64;
    let tick = Tick {
        t_s,
        launch_unix_ms: Some(launch_ms),
        tokens_per_s: 1000.0 * x,
        targets_busy: x,
        targets_waiting: 1.0 - x,
        drafters_busy: x,
        drafters_waiting: 0.0,
        group_step: Some(step),
        drafter_loss: Some(3.0 / step as f64),
        acceptance_length: Some(1.0 + step as f64 / 100.0),
        lr: Some(1e-4 * step as f64),
        ..Tick::default()
    };
    (tick, iv)
}

/// Drives a board for ticks `monitor` apart, each `(t_s, interval seconds, x)`, then finishes
/// it; returns its event file and its launch (Unix time, ms) as the ticks have it.
fn drive_board(dir: &Path, monitor: Duration, ticks: &[(f64, f64, f64)]) -> (EventFile, u64) {
    let launch_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let (mut board, said) = Board::open(&RunDir::new(dir), monitor);
    assert_eq!(said, None);
    for &(t_s, seconds, x) in ticks {
        let (t, iv) = board_tick(launch_ms, t_s, seconds, x);
        assert_eq!(board.record(&t, &iv), None);
    }
    assert_eq!(board.finish(), None);
    drop(board);
    let mut files = read_run(dir);
    assert_eq!(files.len(), 1);
    (files.remove(0), launch_ms)
}

/// The pipeline's series of a week-long run at `--monitor 1` are a point every 10 s of run
/// time, not every tick: each point the mean of its ticks weighted by their intervals, at its
/// last tick's time since the launch (ms); the launcher's first tick is a point at once, and
/// the ticks left at the run's end are the last point, so the last value is there. The
/// training series keep a point at every group step. At `--monitor 10` every tick is a point,
/// as before. Before, every tick was a point: nine tenths of `tb/`, 90 MB a day.
#[test]
fn pipeline_series_are_a_mean_every_10_s_and_the_last_tick_the_training_series_every_step() {
    let dir = TestDir::new("tbfold");
    // 35 ticks a second apart (an interval 0.5 ms short of a second, as a snapshot taken a
    // little earlier after the monitor's clock makes it), the last at the run's end half a
    // second after the one before; the values go up and down.
    let ticks: Vec<(f64, f64, f64)> = (1..=35u32)
        .map(|i| match i {
            35 => (34.5, 0.5, 0.0),
            _ => (f64::from(i), 0.9995, f64::from(i % 7) / 10.0),
        })
        .collect();
    let (tb, launch_ms) = drive_board(&dir.path("run1"), Duration::from_secs(1), &ticks);
    let step = |t_s: f64| (launch_ms as i64 - tb.launch_ms()) + (t_s * 1000.0).round() as i64;
    // The first tick at once, then ten at a time, then the four left at the end.
    let points: [RangeInclusive<usize>; 5] = [0..=0, 1..=10, 11..=20, 21..=30, 31..=34];
    // A series' value at a tick, from the tick's `x` (or the group step's).
    type Of = fn(f64) -> f64;
    // A series' points, of its value by `f`.
    let want = |f: Of| -> Vec<(i64, f64)> {
        (points.iter().cloned())
            .map(|p| {
                let folded = &ticks[p];
                let seconds: f64 = folded.iter().map(|t| t.1).sum();
                let mean = folded.iter().map(|t| f(t.2) * t.1).sum::<f64>() / seconds;
                (step(folded.last().unwrap().0), mean)
            })
            .collect()
    };
    let (x, minus, zero): (Of, Of, Of) = (|x| x, |x| 1.0 - x, |_| 0.0);
    for (tag, f) in [
        ("pipeline/tokens_per_s", (|x| 1000.0 * x) as Of),
        ("targets/busy", x),
        ("targets/waiting", minus),
        ("drafters/busy", x),
        ("drafters/waiting", zero),
        ("targets/phase/load", x),
        ("targets/phase/wait_full", minus),
        ("targets/phase/compute", zero),
        ("drafters/phase/compute", x),
        ("drafters/phase/sync", minus),
        ("drafters/phase/checkpoint", zero),
    ] {
        assert_points(tag, &tb.series[tag], &want(f));
    }
    // The last point is the last four ticks' mean, the half-second one weighing half: not the
    // last tick's value (0), nor their plain mean (0.375).
    let last = tb.series["drafters/phase/compute"].last().unwrap().1;
    assert!(
        (f64::from(last) - 0.9995 * 1.5 / 3.4985).abs() < 1e-6,
        "{last}"
    );
    // Every series but the training ones at these points' steps.
    let at = tb.steps("pipeline/tokens_per_s");
    for (tag, series) in &tb.series {
        if !tag.starts_with("train/") {
            assert_eq!(tb.steps(tag), at, "{tag}");
        }
        assert!(!series.is_empty(), "{tag}");
    }
    // The training series: every group step, with its values.
    for (tag, f) in [
        ("train/loss", (|s| 3.0 / s) as Of),
        ("train/tau", |s| 1.0 + s / 100.0),
        ("train/lr", |s| 1e-4 * s),
    ] {
        let want: Vec<(i64, f64)> = (ticks.iter())
            .map(|t| (2.0 * t.0).round())
            .map(|s| (s as i64, f(s)))
            .collect();
        assert_points(tag, &tb.series[tag], &want);
    }
    // At `--monitor 10`, every tick is a point with its own values, also with an interval a
    // little short of 10 s.
    let ticks = [(10.0, 9.98, 0.1), (20.0, 10.0, 0.5), (30.0, 9.99, 0.2)];
    let (tb, launch_ms) = drive_board(&dir.path("run10"), Duration::from_secs(10), &ticks);
    let step = |t_s: f64| (launch_ms as i64 - tb.launch_ms()) + (t_s * 1000.0).round() as i64;
    let want: Vec<(i64, f64)> = ticks.iter().map(|t| (step(t.0), t.2)).collect();
    assert_points("drafters/busy", &tb.series["drafters/busy"], &want);
}
