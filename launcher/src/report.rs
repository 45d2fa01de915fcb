//! `launcher report RUN_DIR`: one picture (SVG) of a whole run, from its run directory.
//!
//! It reads `metrics.jsonl` (one tick per monitor period, written by `monitor`), and, where they
//! exist, `summary.json` and the drafters' ledgers. It draws, over the run's time: the ring's
//! READY batches and slots in use against its capacity, tokens/s trained, one band per worker
//! with its time by phase (compute at the bottom: the band's green height is its busy share),
//! the drafter's loss and acceptance length once the metrics carry them, and the drafters'
//! longest idle gap per tick (a stretch out of compute: the GPU idle). Deaths, restarts,
//! hangs and stops are marked at the time the launcher reported them; a resumed run
//! (`--resume` appends to `metrics.jsonl`, its clock starting at 0 again) goes on where the
//! earlier session ended, the take-over marked.
//!
//! A run that did not finish (stopped, crashed, its launcher killed) is drawn as far as its
//! metrics go. A line of `metrics.jsonl` that is no tick (torn by a kill, cut short, edited) is
//! skipped and counted, the first one named: the report says so, and draws the rest. So is a
//! line that is no UTF-8 or longer than any tick (read through, never held whole), and a tick
//! with a number no monitor writes (see `parse_tick`: skipped rather than clamped). Input that
//! cannot be a run is refused with the file (and line) at fault: a missing directory or
//! `metrics.jsonl`, one that is no regular file (a FIFO would wait for ever), an empty one, or
//! one with no tick at all. `summary.json` and the ledgers, read whole, are left out with a
//! warning where they cannot be read, a summary also where it is not shaped as the launcher's
//! (`summary_shape`). The picture never replaces a file it is drawn from.
//!
//! A run of any length costs bounded memory: the ticks are folded into buckets as they are read
//! (`series`), and each column of the picture draws its buckets' mean over a light band from
//! their least to their greatest tick, so a spike of one tick in a week stays at its height.
//!
//! The report lives in the launcher because the launcher writes what it reads (`series::ReadTick`
//! reads the fields of the monitor's `Tick` that it draws, a test holding the two together);
//! `shm-ring-stat` views a live ring and knows nothing of run directories.
//!
//! Length: past 500 lines on purpose: reading the run and drawing its panels share the time
//! axis, the columns and the marks, and each panel is a few dozen lines of plotters calls.

use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use clap::Parser;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use proto::{ledger, RunDir};
use ring_stat::numbers::{median, pct};
use ring_stat::screen::human_rate;
use shm_ring::{Phase, Role, WorkerName};

use crate::monitor::EventTick;
use crate::UsageError;

mod series;

pub use series::{Agg, Bucket, ReadTick, Series, WorkerInfo, S};

/// Draw one picture of a run: ring occupancy against capacity, tokens/s, each worker's time
/// by phase, deaths and restarts. Works on finished, stopped and crashed runs.
///
/// Examples:
///   launcher report runs/1796046264-5282               writes runs/1796046264-5282/report.svg
///   launcher report runs/exp1 -o exp1.svg --width 1600
#[derive(Parser, Debug)]
#[command(name = "launcher report", version, verbatim_doc_comment)]
pub struct ReportArgs {
    /// The run directory (it holds metrics.jsonl).
    pub run_dir: PathBuf,
    /// Where to write the picture (SVG; its directory is made if missing) [default:
    /// <RUN_DIR>/report.svg].
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Width in pixels, 400 to 16384.
    #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u32).range(400..=MAX_SIDE as i64))]
    pub width: u32,
    /// Height in pixels, at most 16384 [default: 64 per worker plus about 500 for the rest, at
    /// most 16384: the workers past what fits have no band].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_SIDE as i64))]
    pub height: Option<u32>,
}

/// What a run directory says about its run.
pub struct RunData {
    pub dir: PathBuf,
    /// Every tick, folded into a bounded number of buckets.
    pub series: Series,
    /// The time of the last tick (seconds since the run started, resumes included).
    pub t_end: f64,
    /// What the launcher reported, in the order said.
    pub marks: Vec<Mark>,
    pub summary: Option<serde_json::Value>,
    /// Why summary.json, which exists, could not be read (cut short, not a file): `summary` is
    /// then None, and the run is drawn without it.
    pub summary_unreadable: Option<String>,
    /// Per drafter (in index order): batches trained, of them redelivered, last epoch.
    pub ledgers: Vec<LedgerStats>,
    /// The lines of metrics.jsonl that are no tick, skipped.
    pub skipped: Skipped,
    /// What could not be read and was left out, for the command to warn about.
    pub warnings: Vec<String>,
}

/// Lines of metrics.jsonl skipped: how many, and the first one's number and why.
#[derive(Debug, Default)]
pub struct Skipped {
    pub lines: u64,
    pub first: Option<(usize, String)>,
}

impl Skipped {
    /// `1 line of metrics.jsonl is no tick, skipped (line 7: ...)`; None when none was.
    fn said(&self) -> Option<String> {
        let (line, why) = self.first.as_ref()?;
        Some(match self.lines {
            1 => format!("1 line of metrics.jsonl is no tick, skipped (line {line}: {why})"),
            n => format!(
                "{n} lines of metrics.jsonl are no tick, skipped (the first, line {line}: {why})"
            ),
        })
    }
}

#[derive(Debug, Default)]
pub struct LedgerStats {
    pub drafter: u32,
    pub batches: u64,
    pub redelivered: u64,
    pub epochs: u64,
    /// Lines that did not parse (a drafter killed mid-write leaves none; an edited file may).
    pub unreadable: u64,
}

/// Reads a run directory; refuses what cannot be a run, with the path (and line) at fault.
pub fn load(dir: &Path) -> anyhow::Result<RunData> {
    if !dir.exists() {
        bail!("run directory {} does not exist", dir.display());
    }
    if !dir.is_dir() {
        bail!(
            "{} is not a directory: name a launcher run directory",
            dir.display()
        );
    }
    let run = RunDir::new(dir);
    let path = run.metrics();
    if !path.exists() {
        bail!(
            "{} has no metrics.jsonl: not a launcher run directory, or its launcher stopped before it started the run",
            dir.display()
        );
    }
    // A FIFO would wait for a writer for ever, and a device such as /dev/zero never ends.
    let meta = std::fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?;
    if let Some(what) = atomic_file::not_regular(&meta) {
        bail!(
            "{} is {what}, not a regular file: a run's metrics.jsonl is a file the launcher writes",
            path.display()
        );
    }
    let file = std::fs::File::open(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let mut series = Series::default();
    let mut marks = Vec::new();
    let mut n = 0usize;
    let mut skipped = Skipped::default();
    let (mut last_raw, mut last_t, mut offset) = (0.0, 0.0, 0.0);
    let mut last_launch = None;
    // The spacing of the last ticks: a tick much shorter than their median (a launch's last)
    // has a noisy rate, left out.
    let mut spacings = std::collections::VecDeque::with_capacity(SPACINGS);
    let mut line = Vec::new();
    loop {
        let len = proto::jsonl::read_line_capped(&mut reader, &mut line, MAX_LINE)
            .with_context(|| format!("reading {}", path.display()))?;
        if len == 0 {
            break;
        }
        n += 1;
        let parsed = if len > line.len() as u64 {
            Err(format!(
                "not a monitor tick: a line of {len} bytes, longer than any tick ({} MiB at most)",
                MAX_LINE >> 20
            ))
        } else if line.trim_ascii().is_empty() {
            continue;
        } else {
            parse_tick(&line)
        };
        let (mut t, raw) = match parsed {
            Ok(t) => t,
            // Torn by a kill (the next launcher ended it), cut short, edited, or not text: the
            // rest of the run is still worth drawing.
            Err(why) => {
                skipped.lines += 1;
                skipped.first.get_or_insert((n, why));
                continue;
            }
        };
        // A resumed run appends ticks whose clock starts again at 0: they go on from where the
        // earlier session ended, and the restart is marked. Each tick names its launch (a
        // launch's clock never goes back; an older file's ticks name none).
        let other_launch = matches!(
            (last_launch, t.launch_unix_ms), (Some(was), Some(is)) if was != is
        );
        let resumed = other_launch || raw < last_raw;
        last_launch = t.launch_unix_ms;
        if resumed {
            offset = last_t;
            t.events.insert(
                0,
                EventTick {
                    t_s: 0.0,
                    text: RESUMED.to_string(),
                },
            );
        }
        last_raw = raw;
        let t_s = raw + offset;
        for e in &mut t.events {
            e.t_s += offset;
        }
        let short = series.ticks > 0
            && median(spacings.iter().copied()).is_some_and(|p| t_s - last_t < 0.5 * p);
        if series.ticks > 0 {
            if spacings.len() == SPACINGS {
                spacings.pop_front();
            }
            spacings.push_back(t_s - last_t);
        }
        last_t = t_s;
        marks.extend(marks_of(&t.events));
        series.push(&t, t_s, (!short).then_some(t.tokens_per_s));
    }
    if let (0, Some((line, why))) = (series.ticks, &skipped.first) {
        bail!(
            "{}:{line}: {why}; no line of the file is a tick, so there is nothing to draw",
            path.display()
        );
    }
    if series.ticks == 0 {
        bail!(
            "{} is empty: the run ended before its first monitor tick (the --monitor period), so there is nothing to draw",
            path.display()
        );
    }
    // A FIFO or a device in place of summary.json or a ledger is refused before it is read, a
    // summary larger than any summary is not read, and a ledger is read a line at a time (each
    // held to `ledger::MAX_LINE`): the report says what it could not read, and draws the rest.
    let mut warnings = Vec::new();
    let (summary, summary_unreadable) = match read_summary(&run.summary()) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, None),
        Err(e) => (None, Some(e.to_string())),
        Ok(text) => match serde_json::from_str(&text).map(|v| summary_shape(&v).map(|()| v)) {
            Ok(Ok(v)) => (Some(v), None),
            Ok(Err(why)) => (None, Some(format!("not a launcher's summary: {why}"))),
            Err(e) => (None, Some(format!("not JSON: {e}"))),
        },
    };
    if let Some(why) = &summary_unreadable {
        warnings.push(format!(
            "{} is unreadable ({why}): drawn without it",
            run.summary().display()
        ));
    }
    let mut ledgers = Vec::new();
    let indices = ledger::indices(&run).unwrap_or_else(|e| {
        warnings.push(format!("{e}: drawn without the ledgers"));
        Vec::new()
    });
    for d in indices {
        let mut st = LedgerStats {
            drafter: d,
            ..LedgerStats::default()
        };
        let found = ledger::scan(&run, d, |entry| match entry.line {
            Some(l) => {
                st.batches += 1;
                st.redelivered += u64::from(l.delivery > 0);
                st.epochs = st.epochs.max(l.epoch);
            }
            None => st.unreadable += 1,
        });
        match found {
            Ok(true) => ledgers.push(st),
            // Gone since the listing.
            Ok(false) => {}
            Err(e) => warnings.push(format!("{e}: drawn without it")),
        }
    }
    Ok(RunData {
        dir: dir.to_path_buf(),
        series,
        t_end: last_t,
        marks,
        summary,
        summary_unreadable,
        ledgers,
        skipped,
        warnings,
    })
}

/// The longest line of metrics.jsonl read as a tick: a tick of 8 workers is about 3.5 KB, so
/// this is thousands of workers. A longer line (a file ending in a crash's run of NUL bytes,
/// edited, not metrics at all) is skipped as no tick without being held whole.
const MAX_LINE: usize = 16 << 20;

/// The largest summary.json read: a summary is a few KB (thousands of workers make it some
/// hundreds); a larger file is no summary a launcher wrote, and is not read into memory.
const MAX_SUMMARY: u64 = 16 << 20;

/// A test of a JSON value's type (`Value::is_u64`).
type IsType = fn(&serde_json::Value) -> bool;

/// The fields of summary.json the report reads (`outcome`), with the JSON type the launcher
/// writes each as: a summary of another shape (edited, another program's) was drawn as
/// "exit code null: null/null samples trained", with no word of why.
const SUMMARY_FIELDS: [(&str, IsType, &str); 9] = [
    ("ok", serde_json::Value::is_boolean, "true or false"),
    ("exit_code", serde_json::Value::is_i64, "an integer"),
    ("samples_trained", serde_json::Value::is_u64, "a count"),
    ("samples_total", serde_json::Value::is_u64, "a count"),
    ("batches_trained", serde_json::Value::is_u64, "a count"),
    ("redelivered", serde_json::Value::is_u64, "a count"),
    ("wall_s", serde_json::Value::is_number, "a number"),
    ("tokens_per_s", serde_json::Value::is_number, "a number"),
    ("notes", serde_json::Value::is_array, "a list"),
];

/// Whether `v` is shaped as the summary the launcher writes, as far as the report reads it;
/// else what is wrong, naming the field.
fn summary_shape(v: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let kind = |v: &Value| match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    };
    let Some(fields) = v.as_object() else {
        return Err(format!("it is {}, not an object", kind(v)));
    };
    for (name, fits, want) in SUMMARY_FIELDS {
        match fields.get(name) {
            None => return Err(format!("it has no \"{name}\"")),
            Some(x) if !fits(x) => {
                return Err(format!("its \"{name}\" is {}, not {want}", kind(x)))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// summary.json's text, refused unless a regular file (as [`atomic_file::read_regular`]
/// refuses) of at most [`MAX_SUMMARY`] bytes.
fn read_summary(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    let too_big = |len: String| {
        Error::new(
            ErrorKind::InvalidData,
            format!(
                "it is {len} bytes, more than any summary ({} MiB at most)",
                MAX_SUMMARY >> 20
            ),
        )
    };
    let meta = std::fs::metadata(path)?;
    if let Some(what) = atomic_file::not_regular(&meta) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("it is {what}, not a regular file"),
        ));
    }
    if meta.len() > MAX_SUMMARY {
        return Err(too_big(meta.len().to_string()));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_SUMMARY + 1)
        .read_to_string(&mut text)?;
    // It grew since its size was read.
    if text.len() as u64 > MAX_SUMMARY {
        return Err(too_big(format!("over {MAX_SUMMARY}")));
    }
    Ok(text)
}

/// The latest time a tick may have, in seconds since its launch started (about 31 years).
const MAX_T_S: f64 = 1e9;

/// The largest value of a tick's drawn numbers (rates, shares, loss, seconds).
const MAX_VALUE: f64 = 1e12;

/// One line of metrics.jsonl as a tick, or why it is none.
///
/// What is drawn must be a number the monitor could have written, so a tick is refused (and
/// skipped, counted, like any other line that is no tick) rather than clamped where one is not:
/// its time `t_s` below 0 or past [`MAX_T_S`], or a rate, share, loss or gap below 0 or past
/// [`MAX_VALUE`] (JSON has no NaN or infinity, but `1e308` parses; plotters overflows turning
/// such a value into pixels, and a time axis to infinity is divided for ever). A clamped value
/// would draw a line the run never had; a skipped tick leaves a gap the warning accounts for.
/// Ticks whose clock goes back are kept: that marks a resume (see [`load`]).
fn parse_tick(line: &[u8]) -> Result<(ReadTick, f64), String> {
    // Every field of a tick has a default (for older files), so serde alone takes any object,
    // or an array, for one: a tick is an object with its time. Bytes that are no UTF-8 fail
    // to parse like any other edit.
    if let Err(e) = std::str::from_utf8(line) {
        return Err(format!(
            "not a monitor tick: not UTF-8 text (byte {} of the line)",
            e.valid_up_to() + 1
        ));
    }
    // An array would fill the fields in order: only an object is read.
    let object = line.trim_ascii_start().starts_with(b"{");
    let tick = match serde_json::from_slice::<ReadTick>(line) {
        Ok(t) if object && t.t_s.is_some() => Ok(t),
        Ok(_) => Err(serde::de::Error::custom(
            "an object with its time, t_s, is a tick",
        )),
        Err(e) => Err(e),
    };
    let tick = tick.map_err(|e| {
        if e.is_eof() && !line.ends_with(b"\n") {
            format!("cut short: {e}")
        } else {
            format!("not a monitor tick: {e}")
        }
    })?;
    let t_s = tick.t_s.unwrap_or_default();
    if !(0.0..=MAX_T_S).contains(&t_s) {
        return Err(format!(
            "not a monitor tick: t_s is {}, not a time from 0 to {MAX_T_S:e} s",
            number(t_s)
        ));
    }
    let mut numbers: Vec<(&str, f64)> = vec![
        ("tokens_per_s", tick.tokens_per_s),
        ("targets_busy", tick.targets_busy),
        ("drafters_busy", tick.drafters_busy),
    ];
    numbers.extend(tick.drafter_loss.map(|v| ("drafter_loss", v)));
    numbers.extend(tick.acceptance_length.map(|v| ("acceptance_length", v)));
    for w in &tick.workers {
        numbers.extend([
            ("a worker's busy", w.busy),
            ("a worker's largest_gap_s", w.largest_gap_s),
        ]);
        numbers.extend(w.phases.values().map(|&v| ("a worker's phase share", v)));
    }
    for e in &tick.events {
        if !(0.0..=MAX_T_S).contains(&e.t_s) {
            return Err(format!(
                "not a monitor tick: an event's t_s is {}, not a time from 0 to {MAX_T_S:e} s",
                number(e.t_s)
            ));
        }
    }
    if let Some((name, v)) = numbers
        .into_iter()
        .find(|(_, v)| !(0.0..=MAX_VALUE).contains(v))
    {
        return Err(format!(
            "not a monitor tick: {name} is {}, not a value from 0 to {MAX_VALUE:e}",
            number(v)
        ));
    }
    Ok((tick, t_s))
}

/// A number as a message shows it: `-1e20`, not twenty-one digits.
fn number(v: f64) -> String {
    if v.abs() < 1e6 {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

/// The ticks whose spacing gives the period a tick is judged short against.
const SPACINGS: usize = 16;

/// The event that marks where a resumed run's launcher took over.
const RESUMED: &str = "resumed by launcher --resume";

/// A mark on the time axis: something the launcher reported.
#[derive(Clone, Debug, PartialEq)]
pub struct Mark {
    pub t: f64,
    /// The worker it is about (`drafter-1`), or none for the whole run (a stop).
    pub worker: Option<String>,
    pub kind: MarkKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkKind {
    Died,
    Restarted,
    GaveUp,
    Hung,
    /// A stop signal, or the run stopping for lack of drafters.
    Stop,
    /// A new launcher continued the run (`--resume`).
    Resumed,
}

impl MarkKind {
    fn word(self) -> &'static str {
        match self {
            MarkKind::Died => "died",
            MarkKind::Restarted => "restarted",
            MarkKind::GaveUp => "gave up",
            MarkKind::Hung => "hung",
            MarkKind::Stop => "stop",
            MarkKind::Resumed => "resumed",
        }
    }

    fn color(self) -> RGBColor {
        match self {
            MarkKind::Died | MarkKind::GaveUp => RGBColor(211, 47, 47),
            MarkKind::Hung => RGBColor(245, 124, 0),
            MarkKind::Restarted => RGBColor(46, 125, 50),
            MarkKind::Stop => RGBColor(97, 97, 97),
            MarkKind::Resumed => RGBColor(30, 136, 229),
        }
    }
}

/// The marks in the launcher's messages (see `lib.rs`: "drafter-1 (pid 7) died: ...",
/// "drafter-1 restarted (restart 4; 1 in a row of at most 3), pid 9", "drafter-1 gave up after ...",
/// "drafter-1 (pid 7) sent no heartbeat ...: killing it as hung", "stopping: SIGINT ...",
/// "no drafter left: stopping the targets").
pub fn marks_of<'e>(events: impl IntoIterator<Item = &'e EventTick>) -> Vec<Mark> {
    let mut out = Vec::new();
    for e in events {
        let first = e.text.split_whitespace().next().unwrap_or("");
        // A death's line may quote the worker (", saying ..."): only the launcher's words count.
        let text = e.text.split(", saying ").next().unwrap_or("");
        let worker = first
            .parse::<WorkerName>()
            .is_ok()
            .then(|| first.to_string());
        let kind = if worker.is_some() {
            if text.contains("killing it as hung") {
                MarkKind::Hung
            } else if text.contains(") died") {
                MarkKind::Died
            } else if text.starts_with(&format!("{first} restarted")) {
                MarkKind::Restarted
            } else if text.starts_with(&format!("{first} gave up")) {
                MarkKind::GaveUp
            } else {
                continue;
            }
        } else if e.text == RESUMED {
            MarkKind::Resumed
        } else if e.text.starts_with("stopping")
            || e.text.starts_with("second signal")
            || e.text.starts_with("no drafter left")
        {
            MarkKind::Stop
        } else {
            continue;
        };
        out.push(Mark {
            t: e.t_s,
            worker,
            kind,
        });
    }
    out
}

/// Phases in stacking order (compute at the bottom), with the colours of the legend.
const PHASES: [(Phase, &str, RGBColor); 8] = [
    (Phase::Compute, "compute", RGBColor(67, 160, 71)),
    (Phase::WaitFull, "wait: ring full", RGBColor(229, 57, 53)),
    (Phase::WaitEmpty, "wait: ring empty", RGBColor(255, 179, 0)),
    (Phase::Load, "load", RGBColor(30, 136, 229)),
    (Phase::CopyIn, "copy in", RGBColor(0, 172, 193)),
    (Phase::Sync, "sync", RGBColor(142, 36, 170)),
    (Phase::Checkpoint, "checkpoint", RGBColor(121, 134, 203)),
    (Phase::Other, "other", RGBColor(158, 158, 158)),
];

const FONT: &str = "sans-serif";
const TITLE_H: u32 = 64;
const LEGEND_H: u32 = 48;
const AXIS_H: u32 = 36;
const RING_H: u32 = 190;
const RATE_H: u32 = 150;
const WORKER_H: u32 = 64;
const EXTRA_H: u32 = 140;
/// Room for the y labels, so every panel's time axis lines up.
const Y_LABELS_W: u32 = 78;

/// Which panels the picture has, and their heights.
struct Plan {
    /// The workers with a band, by their place in `Series::workers`.
    workers: Vec<usize>,
    /// Workers left out: their bands would not fit in the tallest picture.
    hidden: usize,
    loss: bool,
    acceptance: bool,
    /// The drafters' longest idle gaps (metrics.jsonl has them from layout 5 on).
    gaps: bool,
    width: u32,
    height: u32,
    ring_h: u32,
    rate_h: u32,
    worker_h: u32,
    extra_h: u32,
}

/// The most pixels either side of the picture: the drawing walks its width (a bin per two
/// pixels, axis labels along it), so --width 4000000000 drew for ever.
const MAX_SIDE: u32 = 16384;

impl Plan {
    fn new(run: &RunData, width: u32, height: Option<u32>) -> anyhow::Result<Plan> {
        if width < 400 {
            return Err(UsageError(format!(
                "--width {width} is too narrow to draw a run: at least 400 pixels"
            ))
            .into());
        }
        if width > MAX_SIDE {
            return Err(UsageError(format!(
                "--width {width} is too wide: at most {MAX_SIDE} pixels"
            ))
            .into());
        }
        let series = &run.series;
        let mut workers: Vec<usize> = (0..series.workers.len()).collect();
        let loss = series.total(S::Loss).count() > 0;
        let acceptance = series.total(S::Tau).count() > 0;
        let gaps = series.total(S::Gap).max > 0.0;
        // Without per-worker records (an older metrics.jsonl) one band shows both sides' busy share.
        let extras = u32::from(loss) + u32::from(acceptance) + u32::from(gaps);
        let fixed = TITLE_H + LEGEND_H + AXIS_H;
        let natural = |bands: u32| RING_H + RATE_H + bands * WORKER_H + extras * EXTRA_H;
        let min = |bands: u32| fixed + 80 + 60 + bands * 24 + extras * 60;
        // At most as many bands as fit in the tallest picture at their smallest (hundreds):
        // the workers past them are left out, and the picture says so.
        let fit = ((MAX_SIDE - min(0)) / 24) as usize;
        let hidden = workers.len().saturating_sub(fit);
        workers.truncate(fit);
        let bands = workers.len().max(1) as u32;
        let natural = natural(bands);
        // The default is the natural height, as tall as can be drawn at most.
        let height = height.unwrap_or((fixed + natural).min(MAX_SIDE));
        let min = min(bands);
        if height > MAX_SIDE {
            return Err(UsageError(format!(
                "--height {height} is too tall: at most {MAX_SIDE} pixels"
            ))
            .into());
        }
        if height < min {
            return Err(UsageError(format!(
                "--height {height} is too short for this run's {} panels: at least {min} pixels",
                2 + bands + extras
            ))
            .into());
        }
        let scale = f64::from(height - fixed) / f64::from(natural);
        let px = |h: u32| (f64::from(h) * scale).floor() as u32;
        Ok(Plan {
            workers,
            hidden,
            loss,
            acceptance,
            gaps,
            width,
            height,
            ring_h: px(RING_H),
            rate_h: px(RATE_H),
            worker_h: px(WORKER_H),
            extra_h: px(EXTRA_H),
        })
    }
}

fn draw_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the picture: {e:?}")
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The first line under the title: how the run ended, from summary.json, else from what the
/// metrics and ledgers show.
fn outcome(run: &RunData) -> String {
    let said = match run.skipped.said() {
        Some(s) => format!("; {s}"),
        None => String::new(),
    };
    let end = run.t_end;
    match &run.summary {
        Some(s) => {
            let ok = s["ok"].as_bool().unwrap_or(false);
            // summary.json's time, rate and redeliveries are its last launch's; the batches
            // are the run's.
            let resumed = run.marks.iter().any(|m| m.kind == MarkKind::Resumed);
            format!(
                "{} (exit code {}): {}/{} samples trained, {} batches; {}{} redelivered, {:.1} s, {} tokens/s{}{said}",
                if ok { "finished" } else { "ended" },
                s["exit_code"],
                s["samples_trained"],
                s["samples_total"],
                s["batches_trained"],
                if resumed { "its last launch: " } else { "" },
                s["redelivered"],
                s["wall_s"].as_f64().unwrap_or(end),
                human_rate(s["tokens_per_s"].as_f64().unwrap_or(0.0)),
                match s["notes"].as_array().map(Vec::len).unwrap_or(0) {
                    0 => String::new(),
                    n => format!("; {n} note(s) in summary.json"),
                }
            )
        }
        None => {
            let batches: u64 = run.ledgers.iter().map(|l| l.batches).sum();
            let redelivered: u64 = run.ledgers.iter().map(|l| l.redelivered).sum();
            let why = match &run.summary_unreadable {
                Some(why) => format!("summary.json is unreadable ({why})"),
                None => "no summary.json: the launcher did not finish (still running, or killed)"
                    .to_string(),
            };
            format!(
                "{why}; drawn to {end:.1} s; the ledgers hold {batches} trained batches ({redelivered} redelivered){said}"
            )
        }
    }
}

/// A panel's y axis.
struct YAxis<'f> {
    desc: &'static str,
    labels: usize,
    /// Horizontal grid lines at the labels.
    grid: bool,
    format: &'f dyn Fn(&f64) -> String,
}

fn percent(v: &f64) -> String {
    pct(*v)
}

/// The axis of the bands: shares of the time, 0 to 100%.
const SHARES: YAxis<'static> = YAxis {
    desc: "",
    labels: 2,
    grid: false,
    format: &percent,
};

/// A chart over the run's time on `area`, its axes drawn; the time axis only on the bottom panel.
fn panel<'a, 'b>(
    area: &'a Area<'b>,
    t_max: f64,
    y_max: f64,
    bottom: bool,
    y: &YAxis<'_>,
) -> anyhow::Result<Chart<'a, 'b>> {
    let mut c = ChartBuilder::on(area)
        .margin_right(24)
        .margin_top(6)
        .x_label_area_size(if bottom { AXIS_H } else { 0 })
        .y_label_area_size(Y_LABELS_W)
        .build_cartesian_2d(0f64..t_max, 0f64..y_max)
        .map_err(draw_err)?;
    let mut mesh = c.configure_mesh();
    mesh.max_light_lines(0)
        .label_style((FONT, 12))
        .y_desc(y.desc)
        .y_labels(y.labels)
        .y_label_formatter(y.format);
    if bottom {
        mesh.x_desc("seconds since the run started");
    }
    if y.grid {
        mesh.disable_x_mesh();
    } else {
        mesh.disable_mesh();
    }
    mesh.draw().map_err(draw_err)?;
    Ok(c)
}

/// A panel's name, top left inside its plot.
fn name_panel(c: &mut Chart<'_, '_>, text: &str, t_max: f64, y_max: f64) -> anyhow::Result<()> {
    let font = (FONT, 13).into_font().color(&BLACK);
    c.draw_series(std::iter::once(Text::new(
        text.to_string(),
        (t_max * 0.005, y_max * 0.97),
        font,
    )))
    .map_err(draw_err)?;
    Ok(())
}

/// Vertical lines at `marks`, labelled with the worker and what happened.
fn draw_marks(
    c: &mut Chart<'_, '_>,
    marks: &[&Mark],
    y_max: f64,
    labels: bool,
) -> anyhow::Result<()> {
    for (i, m) in marks.iter().enumerate() {
        let color = m.kind.color();
        c.draw_series(std::iter::once(PathElement::new(
            vec![(m.t, 0.0), (m.t, y_max)],
            color.stroke_width(2),
        )))
        .map_err(draw_err)?;
        if labels {
            let text = match &m.worker {
                Some(w) => format!("{w} {}", m.kind.word()),
                None => m.kind.word().to_string(),
            };
            // Staggered, so marks close in time keep readable labels.
            let y = y_max * (0.86 - 0.11 * (i % 4) as f64);
            c.draw_series(std::iter::once(Text::new(
                text,
                (m.t, y),
                (FONT, 11).into_font().color(&color),
            )))
            .map_err(draw_err)?;
        }
    }
    Ok(())
}

/// What every panel of one picture shares: the run, its time axis, its bins and its marks.
struct Canvas<'r> {
    run: &'r RunData,
    t_max: f64,
    /// The run's buckets merged into the picture's columns (one per two pixels).
    columns: Vec<Bucket>,
}

/// Draws the run as an SVG document of `plan`'s size: the title, then the panels top to bottom
/// (the ring, tokens/s, one band per worker, loss and acceptance), then the legend.
fn draw(run: &RunData, plan: &Plan) -> anyhow::Result<String> {
    let t_max = run.t_end.max(1e-3) * 1.01;
    let canvas = Canvas {
        run,
        t_max,
        columns: run.series.columns((plan.width / 2) as usize, t_max),
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (plan.width, plan.height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (title, rest) = root.split_vertically(TITLE_H);
        draw_title(&title, run, plan)?;
        let (areas, legend) = split_panels(rest, plan);
        let last = areas.len() - 1;
        let mut areas = areas.iter().enumerate().map(|(i, a)| (a, i == last));
        let (area, bottom) = areas.next().expect("the ring panel");
        canvas.ring_panel(area, bottom)?;
        let (area, bottom) = areas.next().expect("the rate panel");
        canvas.rate_panel(area, bottom)?;
        if plan.workers.is_empty() {
            let (area, bottom) = areas.next().expect("the busy panel");
            canvas.busy_panel(area, bottom)?;
        }
        for &w in &plan.workers {
            let (area, bottom) = areas.next().expect("a worker band");
            canvas.worker_band(area, bottom, w)?;
        }
        // The drafter's loss and acceptance length, once the metrics carry them, and the
        // drafters' longest idle gaps.
        for (on, what, s) in [
            (plan.loss, "drafter loss", S::Loss),
            (plan.acceptance, "acceptance length (tau)", S::Tau),
            (
                plan.gaps,
                "longest idle gap of the drafters, seconds (out of compute: the GPU idle)",
                S::Gap,
            ),
        ] {
            if on {
                let (area, bottom) = areas.next().expect("an extra panel");
                canvas.extra_panel(area, bottom, what, s)?;
            }
        }
        draw_legend(&legend, plan.width)?;
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// The workers whose bands are left out, in words; None when every one is drawn.
fn left_out(plan: &Plan) -> Option<String> {
    (plan.hidden > 0).then(|| {
        format!(
            "the last {} of its {} workers have no band: no more fit in {MAX_SIDE} pixels",
            plan.hidden,
            plan.hidden + plan.workers.len()
        )
    })
}

/// The run's name and how it ended.
fn draw_title(title: &Area<'_>, run: &RunData, plan: &Plan) -> anyhow::Result<()> {
    let name = run
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run.dir.display().to_string());
    let left_out = match left_out(plan) {
        Some(said) => format!(" ({said})"),
        None => String::new(),
    };
    title
        .draw_text(
            &format!("hspipe run {name}{left_out}"),
            &(FONT, 20).into_font().style(FontStyle::Bold).color(&BLACK),
            (12, 8),
        )
        .map_err(draw_err)?;
    title
        .draw_text(
            &outcome(run),
            &(FONT, 13).into_font().color(&BLACK),
            (12, 36),
        )
        .map_err(draw_err)?;
    Ok(())
}

/// The panels' areas, top to bottom (the last one taller by the time axis it carries), and
/// what is left below them for the legend.
fn split_panels<'b>(rest: Area<'b>, plan: &Plan) -> (Vec<Area<'b>>, Area<'b>) {
    let mut panels: Vec<u32> = vec![plan.ring_h, plan.rate_h];
    let bands = plan.workers.len().max(1);
    panels.extend(std::iter::repeat_n(plan.worker_h, bands));
    panels.extend(std::iter::repeat_n(
        plan.extra_h,
        usize::from(plan.loss) + usize::from(plan.acceptance) + usize::from(plan.gaps),
    ));
    let last = panels.len() - 1;
    let mut areas = Vec::new();
    let mut rest = rest;
    for (i, h) in panels.iter().enumerate() {
        let h = if i == last { h + AXIS_H } else { *h };
        let (a, r) = rest.split_vertically(h);
        areas.push(a);
        rest = r;
    }
    (areas, rest)
}

impl Canvas<'_> {
    fn all_marks(&self) -> Vec<&Mark> {
        self.run.marks.iter().collect()
    }

    /// Series `s` by column: (time, mean, min, max), columns without a value left out.
    fn points(&self, s: S) -> Vec<(f64, f64, f64, f64)> {
        (self.columns.iter())
            .filter_map(|c| {
                let a = c.get(s);
                Some((c.t, a.mean()?, a.min, a.max))
            })
            .collect()
    }

    /// Draws series `s` as its mean, a line, over the band from its least to its greatest
    /// value in each column (a spike lasting one tick stays as tall as it was), light. Returns
    /// the chart's top for the points, which the caller's chart must have: see `y_max`.
    fn draw_spread(
        c: &mut Chart<'_, '_>,
        points: &[(f64, f64, f64, f64)],
        color: RGBColor,
    ) -> anyhow::Result<()> {
        // Only where a column holds ticks that differ: a short run draws its ticks as they are.
        if points.iter().any(|p| p.3 > p.2) {
            let band: Vec<(f64, f64)> = (points.iter().map(|p| (p.0, p.3)))
                .chain(points.iter().rev().map(|p| (p.0, p.2)))
                .collect();
            c.draw_series(std::iter::once(Polygon::new(
                band,
                color.mix(0.25).filled(),
            )))
            .map_err(draw_err)?;
        }
        c.draw_series(LineSeries::new(
            points.iter().map(|p| (p.0, p.1)),
            color.stroke_width(2),
        ))
        .map_err(draw_err)?;
        Ok(())
    }

    /// The ring: READY and in use, against the capacity.
    fn ring_panel(&self, area: &Area<'_>, bottom: bool) -> anyhow::Result<()> {
        let t_max = self.t_max;
        let slots = self.run.series.slots.max(1);
        let y_max = f64::from(slots) * 1.25;
        let mut c = panel(
            area,
            t_max,
            y_max,
            bottom,
            &YAxis {
                desc: "batches",
                labels: 5,
                grid: true,
                format: &|v| format!("{v:.0}"),
            },
        )?;
        let mean = |s| self.points(s).into_iter().map(|p| (p.0, p.1));
        let green = RGBColor(67, 160, 71);
        c.draw_series(AreaSeries::new(mean(S::Ready), 0.0, green.mix(0.35)).border_style(green))
            .map_err(draw_err)?;
        c.draw_series(LineSeries::new(
            mean(S::InUse),
            RGBColor(30, 136, 229).stroke_width(2),
        ))
        .map_err(draw_err)?;
        c.draw_series(DashedLineSeries::new(
            [(0.0, f64::from(slots)), (t_max, f64::from(slots))],
            8,
            6,
            RGBColor(211, 47, 47).stroke_width(2),
        ))
        .map_err(draw_err)?;
        draw_marks(&mut c, &self.all_marks(), y_max, true)?;
        name_panel(
            &mut c,
            &format!("ring: READY batches (green area) and slots in use (blue), capacity {slots} (red dashes)"),
            t_max,
            y_max,
        )
    }

    /// Tokens/s trained, a tick's rate left out where the tick is much shorter than the period
    /// (its rate is noise).
    fn rate_panel(&self, area: &Area<'_>, bottom: bool) -> anyhow::Result<()> {
        let t_max = self.t_max;
        let rate = self.points(S::Rate);
        let r_max = rate.iter().map(|p| p.3).fold(0.0, f64::max).max(1.0) * 1.2;
        let mut c = panel(
            area,
            t_max,
            r_max,
            bottom,
            &YAxis {
                desc: "tokens/s",
                labels: 4,
                grid: true,
                format: &|v| human_rate(*v),
            },
        )?;
        let mean = self.run.series.total(S::Rate).mean().unwrap_or(0.0);
        let teal = RGBColor(0, 131, 143);
        Self::draw_spread(&mut c, &rate, teal)?;
        c.draw_series(DashedLineSeries::new(
            [(0.0, mean), (t_max, mean)],
            6,
            6,
            teal.mix(0.6).stroke_width(1),
        ))
        .map_err(draw_err)?;
        draw_marks(&mut c, &self.all_marks(), r_max, false)?;
        name_panel(
            &mut c,
            &format!(
                "tokens/s trained (mean {}, dashed{}{})",
                human_rate(mean),
                if self.spread_said().is_empty() {
                    ""
                } else {
                    "; "
                },
                self.spread_said()
            ),
            t_max,
            r_max,
        )
    }

    /// What a panel's name says of its light band, where a column holds several ticks.
    fn spread_said(&self) -> &'static str {
        if self.columns.iter().any(|c| c.ticks > 1) {
            "light: least to greatest tick of each column"
        } else {
            ""
        }
    }

    /// Without per-worker records (an older metrics.jsonl): one band with both sides' busy share.
    fn busy_panel(&self, area: &Area<'_>, bottom: bool) -> anyhow::Result<()> {
        let mut c = panel(area, self.t_max, 1.25, bottom, &SHARES)?;
        for (s, color) in [
            (S::TargetsBusy, RGBColor(30, 136, 229)),
            (S::DraftersBusy, RGBColor(67, 160, 71)),
        ] {
            c.draw_series(LineSeries::new(
                self.points(s).into_iter().map(|p| (p.0, p.1)),
                color.stroke_width(2),
            ))
            .map_err(draw_err)?;
        }
        name_panel(&mut c, "busy share: targets (blue), drafters (green); this metrics.jsonl has no per-worker records", self.t_max, 1.25)
    }

    /// Worker `w`'s band (by its place in `Series::workers`): its time by phase, stacked, its
    /// marks, and its label.
    fn worker_band(&self, area: &Area<'_>, bottom: bool, w: usize) -> anyhow::Result<()> {
        let info = &self.run.series.workers[w];
        let name = info.name.as_str();
        let mut c = panel(area, self.t_max, 1.3, bottom, &SHARES)?;
        // Cumulative shares, drawn from the top band down so each covers the one below.
        for k in (0..PHASES.len()).rev() {
            let series =
                (self.columns.iter()).filter_map(|col| Some((col.t, col.worker(w).stacked(k)?)));
            let color = PHASES[k].2;
            c.draw_series(AreaSeries::new(series, 0.0, color.filled()))
                .map_err(draw_err)?;
        }
        let mine: Vec<&Mark> = (self.run.marks)
            .iter()
            .filter(|m| m.worker.as_deref() == Some(name) || m.worker.is_none())
            .collect();
        draw_marks(&mut c, &mine, 1.3, false)?;
        let label = self.worker_label(info, &mine);
        name_panel(&mut c, &label, self.t_max, 1.3)
    }

    /// A worker band's label: its GPU, busy share, deaths and restarts, and a drafter's ledger.
    fn worker_label(&self, info: &WorkerInfo, mine: &[&Mark]) -> String {
        let name = info.name.as_str();
        let deaths = mine.iter().filter(|m| m.kind == MarkKind::Died).count();
        let mut label = format!(
            "{name}{}: busy {:.0}% of the run",
            info.gpu.map(|g| format!(" (GPU {g})")).unwrap_or_default(),
            info.busy.mean().unwrap_or(0.0) * 100.0
        );
        if deaths > 0 || info.restarts > 0 {
            label.push_str(&format!(
                ", {deaths} death(s), {} restart(s)",
                info.restarts
            ));
        }
        if let Some(l) = name
            .parse::<WorkerName>()
            .ok()
            .filter(|n| n.role == Role::Consumer)
            .and_then(|n| self.run.ledgers.iter().find(|l| l.drafter == n.index))
        {
            label.push_str(&format!(
                "; ledger: {} batches, {} redelivered",
                l.batches, l.redelivered
            ));
        }
        label
    }

    /// A line over the run (the drafter's loss, the acceptance length, the idle gaps), named
    /// `what`, over the spread of its ticks.
    fn extra_panel(&self, area: &Area<'_>, bottom: bool, what: &str, s: S) -> anyhow::Result<()> {
        let points = self.points(s);
        let y_max = points.iter().map(|p| p.3).fold(0.0, f64::max).max(1e-6) * 1.2;
        let mut c = panel(
            area,
            self.t_max,
            y_max,
            bottom,
            &YAxis {
                desc: "",
                labels: 4,
                grid: true,
                format: &|v| format!("{v:.2}"),
            },
        )?;
        Self::draw_spread(&mut c, &points, RGBColor(142, 36, 170))?;
        draw_marks(&mut c, &self.all_marks(), y_max, false)?;
        // The greatest value, said: a spike of one tick in a week is a sliver of a column.
        let name = match self.spread_said() {
            "" => what.to_string(),
            said => format!(
                "{what}: greatest {:.2} ({said})",
                self.run.series.total(s).max
            ),
        };
        name_panel(&mut c, &name, self.t_max, y_max)
    }
}

/// The legend: the phases' colours, and the marks; a second row when the first is full.
fn draw_legend(legend: &Area<'_>, width: u32) -> anyhow::Result<()> {
    let font = (FONT, 12).into_font().color(&BLACK);
    let left = i32::try_from(Y_LABELS_W).unwrap_or(0);
    let right = i32::try_from(width).unwrap_or(i32::MAX) - 10;
    let (mut x, mut y) = (left, 4);
    let mut room = |w: i32| -> (i32, i32) {
        if x + w > right && x > left {
            (x, y) = (left, y + 20);
        }
        let at = (x, y);
        x += w;
        at
    };
    let (lx, ly) = room(100);
    legend
        .draw_text("time by phase:", &font, (lx, ly))
        .map_err(draw_err)?;
    for (_, label, color) in PHASES {
        let (lx, ly) = room(24 + 7 * label.len() as i32);
        legend
            .draw(&Rectangle::new(
                [(lx, ly), (lx + 12, ly + 12)],
                color.filled(),
            ))
            .map_err(draw_err)?;
        legend
            .draw_text(label, &font, (lx + 16, ly))
            .map_err(draw_err)?;
    }
    let (lx, ly) = room(56);
    legend
        .draw_text("marks:", &font, (lx + 10, ly))
        .map_err(draw_err)?;
    for kind in [
        MarkKind::Died,
        MarkKind::Restarted,
        MarkKind::Hung,
        MarkKind::Stop,
        MarkKind::Resumed,
    ] {
        let color = kind.color();
        let (lx, ly) = room(26 + 7 * kind.word().len() as i32);
        legend
            .draw(&PathElement::new(
                vec![(lx + 6, ly - 2), (lx + 6, ly + 14)],
                color.stroke_width(2),
            ))
            .map_err(draw_err)?;
        legend
            .draw_text(kind.word(), &font, (lx + 12, ly))
            .map_err(draw_err)?;
    }
    Ok(())
}

/// Draws `run` and writes the picture to `out` (via a temporary file, so a reader never sees
/// half of one). Returns its size in pixels, and what it left out (workers without a band).
pub fn write(
    run: &RunData,
    out: &Path,
    width: u32,
    height: Option<u32>,
) -> anyhow::Result<(u32, u32, Option<String>)> {
    let plan = Plan::new(run, width, height)?;
    let svg = draw(run, &plan)?;
    // `-o` may name a directory not made yet, as `eval --json` and `prepare -o` may: made only
    // now that the picture is drawn, so a refused one leaves no empty directory behind. Where a
    // link leads is where the file goes, so its directory is the one made.
    let dest = atomic_file::target(out).with_context(|| format!("-o {}", out.display()))?;
    if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("making the directory {} for the picture", dir.display()))?;
    }
    atomic_file::replace(out, svg.as_bytes())
        .with_context(|| format!("writing the picture {}", out.display()))?;
    Ok((plan.width, plan.height, left_out(&plan)))
}

/// Refuses to write the picture over a file it is drawn from (`-o` naming metrics.jsonl, a
/// link to it or a hard link): compared by device and inode, as `launcher prepare` refuses an
/// output that is its input, since the replace follows links.
fn refuse_overwriting_input(run_dir: &Path, out: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(o) = std::fs::metadata(out) else {
        return Ok(());
    };
    let run = RunDir::new(run_dir);
    let indices = run.ledger_indices().unwrap_or_default();
    let ledgers = indices.into_iter().map(|d| run.ledger(d));
    for input in [run.metrics(), run.summary()].into_iter().chain(ledgers) {
        if std::fs::metadata(&input).is_ok_and(|m| m.dev() == o.dev() && m.ino() == o.ino()) {
            bail!(
                "-o {}: it is {}, which the report is drawn from; the picture would replace it: name another file",
                out.display(),
                input.display()
            );
        }
    }
    Ok(())
}

/// `launcher report`: returns the exit code.
pub fn run(args: ReportArgs) -> anyhow::Result<i32> {
    let data = load(&args.run_dir)?;
    if let Some(said) = data.skipped.said() {
        eprintln!("warning: {}: {said}", args.run_dir.display());
    }
    for w in &data.warnings {
        eprintln!("warning: {w}");
    }
    let out = args
        .output
        .clone()
        .unwrap_or_else(|| RunDir::new(&args.run_dir).report_svg());
    if out.extension().and_then(|e| e.to_str()) != Some("svg") {
        bail!(
            "{}: the report is an SVG picture; name a .svg file (a browser shows it, and `rsvg-convert` turns it into PNG)",
            out.display()
        );
    }
    if args.output.is_some() {
        atomic_file::target(&out).with_context(|| format!("-o {}", out.display()))?;
    }
    refuse_overwriting_input(&args.run_dir, &out)?;
    let (w, h, left_out) = write(&data, &out, args.width, args.height)?;
    if let Some(said) = left_out {
        eprintln!("warning: {}: {said}", args.run_dir.display());
    }
    let m = &data.marks;
    let count = |k: MarkKind| m.iter().filter(|x| x.kind == k).count();
    println!(
        "wrote {} ({w}x{h} px): {} ticks over {:.1} s, {} deaths, {} restarts{}",
        out.display(),
        data.series.ticks,
        data.t_end,
        count(MarkKind::Died),
        count(MarkKind::Restarted),
        match (&data.summary, &data.summary_unreadable) {
            (Some(_), _) => "",
            (None, Some(_)) => "; summary.json is unreadable (warned above)",
            (None, None) => "; no summary.json (the run did not finish)",
        }
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::{load, marks_of, outcome, MarkKind, Plan, RunData, Skipped};
    use crate::monitor::{EventTick, Tick};

    /// The times of the buckets `run` keeps: of each tick, while the run is short.
    fn times(run: &RunData) -> Vec<f64> {
        run.series.buckets.iter().map(|b| b.t).collect()
    }

    /// A side past what can be drawn is refused naming the flag, not drawn for ever.
    #[test]
    fn a_picture_too_large_to_draw_is_refused() {
        let mut series = super::Series::default();
        series.push(&super::ReadTick::default(), 0.0, None);
        let run = RunData {
            dir: "runs/1".into(),
            series,
            t_end: 0.0,
            marks: Vec::new(),
            summary: None,
            summary_unreadable: None,
            ledgers: Vec::new(),
            skipped: Skipped::default(),
            warnings: Vec::new(),
        };
        for (w, h, flag) in [
            (4_000_000_000, None, "--width"),
            (1200, Some(u32::MAX), "--height"),
        ] {
            let e = Plan::new(&run, w, h).err().expect("refused");
            assert!(e.is::<crate::UsageError>(), "exit 2: {e}");
            let e = e.to_string();
            assert!(e.contains(flag) && e.contains("at most 16384"), "{e}");
        }
        assert!(Plan::new(&run, 16384, Some(16384)).is_ok());
    }

    /// A resume is found by the launch each tick names, also when its clock does not go back
    /// (the earlier launch stopped after a tick, or the resume ticks less often): its ticks go
    /// on from the earlier launch's end, marked resumed. An older file, without the field, by
    /// its clock going back.
    #[test]
    fn a_resume_is_marked_where_its_launch_begins() {
        let dir = tempfile::tempdir().unwrap();
        let tick = |launch: Option<u64>, t_s: f64| {
            let t = Tick {
                t_s,
                launch_unix_ms: launch,
                ..Tick::default()
            };
            serde_json::to_string(&t).unwrap() + "\n"
        };
        let resumed_at = |lines: &[String]| -> Vec<f64> {
            std::fs::write(dir.path().join("metrics.jsonl"), lines.concat()).unwrap();
            let run = load(dir.path()).unwrap();
            (run.marks.iter())
                .filter(|m| m.kind == MarkKind::Resumed)
                .map(|m| m.t)
                .collect()
        };
        // Stopped at 1 s; resumed with --monitor 5: its first tick at 5 s, drawn at 6 s. The mark
        // is where the earlier launch ended.
        let new = [tick(Some(7), 1.0), tick(Some(9), 5.0), tick(Some(9), 10.0)];
        assert_eq!(resumed_at(&new), [1.0]);
        let old = [tick(None, 1.0), tick(None, 2.0), tick(None, 0.5)];
        assert_eq!(resumed_at(&old), [2.0]);
        std::fs::write(dir.path().join("metrics.jsonl"), new.concat()).unwrap();
        assert_eq!(times(&load(dir.path()).unwrap()), [1.0, 6.0, 11.0]);
        std::fs::write(dir.path().join("metrics.jsonl"), old.concat()).unwrap();
        // The outcome says whose time and rate summary.json's are: the last launch's.
        let mut run = load(dir.path()).unwrap();
        run.summary = Some(serde_json::json!({
            "ok": true, "exit_code": 0, "samples_trained": 10, "samples_total": 10,
            "batches_trained": 4, "redelivered": 1, "wall_s": 12.0, "tokens_per_s": 50.0,
        }));
        let said = outcome(&run);
        assert!(
            said.contains("4 batches; its last launch: 1 redelivered, 12.0 s"),
            "{said}"
        );
    }

    /// A line of metrics.jsonl: an empty tick at `t_s` of one launch.
    fn tick(t_s: f64) -> String {
        let t = Tick {
            t_s,
            launch_unix_ms: Some(7),
            ..Tick::default()
        };
        serde_json::to_string(&t).unwrap() + "\n"
    }

    /// A line a kill tore (and the next launcher ended), and a last line cut short, are
    /// skipped and counted, the first one named; the ticks around them are drawn. Before, the
    /// report refused the whole run at such a line. A file with no tick at all is refused.
    #[test]
    fn lines_that_are_no_tick_are_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let torn = &tick(2.0)[..12];
        // JSON, but no tick: every field of one has a default, so serde alone took these.
        let text = [
            &tick(1.0),
            torn,
            "\n{\"a\":1}\n[1,2]\n",
            &tick(3.0),
            &tick(4.0)[..20],
        ]
        .concat();
        std::fs::write(dir.path().join("metrics.jsonl"), text).unwrap();
        let run = load(dir.path()).unwrap();
        assert_eq!(times(&run), [1.0, 3.0]);
        assert_eq!(run.skipped.lines, 4);
        let said = run.skipped.said().unwrap();
        assert!(
            said.starts_with("4 lines of metrics.jsonl are no tick, skipped (the first, line 2: "),
            "{said}"
        );
        assert!(outcome(&run).ends_with(&format!("; {said}")));
        std::fs::write(dir.path().join("metrics.jsonl"), format!("{torn}\n")).unwrap();
        let err = load(dir.path()).err().expect("refused").to_string();
        assert!(err.contains("metrics.jsonl:1: not a monitor tick"), "{err}");
    }

    #[test]
    fn a_death_is_marked_by_the_launchers_words_not_by_what_it_quotes() {
        let said = |text: &str| Tick {
            events: vec![EventTick {
                t_s: 1.0,
                text: text.into(),
            }],
            ..Tick::default()
        };
        let ticks = [
            said(
                r#"drafter-1 (pid 7) died: exit status: 1, saying "error: killing it as hung, then restarted""#,
            ),
            said("drafter-1 (pid 8) sent no heartbeat for 601s: killing it as hung"),
        ];
        let kinds: Vec<MarkKind> = (marks_of(ticks.iter().flat_map(|t| &t.events)).iter())
            .map(|m| m.kind)
            .collect();
        assert_eq!(kinds, [MarkKind::Died, MarkKind::Hung]);
    }

    /// Runs `f` on a thread and returns what it returns; fails the test saying that `what`
    /// hung when that takes more than a minute (a FIFO waits for a writer for ever).
    fn watched<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        use std::sync::mpsc::RecvTimeoutError;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(v) => v,
            Err(RecvTimeoutError::Timeout) => panic!("{what} hung"),
            Err(RecvTimeoutError::Disconnected) => panic!("{what} panicked (above)"),
        }
    }

    /// Loads `metrics` as a run's metrics.jsonl and draws it at the default size (watched):
    /// the run, and the picture.
    fn load_and_draw(dir: &std::path::Path, metrics: &[u8]) -> (RunData, String) {
        std::fs::write(dir.join("metrics.jsonl"), metrics).unwrap();
        let dir = dir.to_path_buf();
        watched("drawing the report", move || {
            let run = load(&dir).unwrap();
            let svg = super::draw(&run, &Plan::new(&run, 1200, None).unwrap()).unwrap();
            (run, svg)
        })
    }

    /// The times of the ticks `run` kept, how many lines it skipped, and what it says of them.
    fn kept(run: &RunData) -> (Vec<f64>, u64, String) {
        (
            times(run),
            run.skipped.lines,
            run.skipped.said().unwrap_or_default(),
        )
    }

    /// A number no monitor writes (a negative rate, a value past what can be drawn) made
    /// plotters overflow turning it into pixels (a panic; garbage in a release build), and a
    /// time of 1e308 drew for ever: such a tick is skipped and counted like any line that is
    /// no tick, and the rest is drawn.
    #[test]
    fn ticks_with_absurd_numbers_are_skipped_not_drawn() {
        let dir = tempfile::tempdir().unwrap();
        for field in [
            "\"tokens_per_s\":-1e20",
            "\"drafter_loss\":-1e20",
            "\"acceptance_length\":-1e20",
            "\"targets_busy\":-1e20",
            "\"tokens_per_s\":1e308",
            "\"workers\":[{\"name\":\"drafter-0\",\"busy\":-1e20}]",
            "\"events\":[{\"t_s\":1e300,\"text\":\"stopping: SIGINT\"}]",
        ] {
            let text = format!("{{\"t_s\":1,{field}}}\n{{\"t_s\":2}}\n");
            let (run, _) = load_and_draw(dir.path(), text.as_bytes());
            let (t_s, lines, said) = kept(&run);
            assert_eq!((t_s, lines), (vec![2.0], 1), "{field}");
            assert!(said.contains("line 1: not a monitor tick: "), "{said}");
        }
        // A time past any run's, or before its start: its resumes summed to infinity.
        let (run, _) = load_and_draw(
            dir.path(),
            b"{\"t_s\":0}\n{\"t_s\":1e308}\n{\"t_s\":0}\n{\"t_s\":1e308}\n{\"t_s\":-5}\n{\"t_s\":3}\n",
        );
        let (t_s, lines, said) = kept(&run);
        assert_eq!((t_s, lines), (vec![0.0, 0.0, 3.0], 3));
        assert!(
            said.contains("line 2: not a monitor tick: t_s is 1e308"),
            "{said}"
        );
    }

    /// One byte that is no UTF-8 failed the whole report ("stream did not contain valid
    /// UTF-8", no line): its line is skipped and counted like any other that is no tick.
    #[test]
    fn a_line_that_is_no_utf8_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (run, _) = load_and_draw(
            dir.path(),
            b"{\"t_s\":1}\n{\"t_s\":2,\"verdict\":\"\xff\"}\n\xfe\xff\n{\"t_s\":3}\n",
        );
        let (t_s, lines, said) = kept(&run);
        assert_eq!((t_s, lines), (vec![1.0, 3.0], 2));
        assert!(
            said.contains("line 2: not a monitor tick: not UTF-8"),
            "{said}"
        );
    }

    /// A line is kept to `max` bytes however long it is (a file ending in a crash's run of NUL
    /// bytes, or /dev/zero, grew one without bound), and its whole length is told.
    #[test]
    fn a_line_is_read_to_its_end_but_held_to_its_bound() {
        let text = [&[0u8; 100_000][..], b"\n{\"t_s\":1}\n", &[0u8; 5000][..]].concat();
        let mut r = std::io::BufReader::with_capacity(64, &text[..]);
        let mut line = Vec::new();
        let mut lens = Vec::new();
        loop {
            let len = proto::jsonl::read_line_capped(&mut r, &mut line, 1000).unwrap();
            if len == 0 {
                break;
            }
            assert!(line.len() <= 1000);
            lens.push((len, line.len()));
        }
        assert_eq!(lens, [(100_001, 1000), (10, 10), (5000, 1000)]);
        // A long line of metrics.jsonl is skipped, named by its length.
        let dir = tempfile::tempdir().unwrap();
        let long = [
            b"{\"t_s\":1}\n",
            &vec![0u8; 17 << 20][..],
            b"\n{\"t_s\":2}\n",
        ]
        .concat();
        let (run, _) = load_and_draw(dir.path(), &long);
        assert_eq!(run.series.ticks, 2);
        let said = run.skipped.said().unwrap();
        assert!(
            said.contains("line 2: not a monitor tick: a line of 17825793 bytes"),
            "{said}"
        );
    }

    /// A FIFO in place of metrics.jsonl, summary.json or a ledger made the report wait for a
    /// writer for ever, and /dev/zero read without end: metrics.jsonl that is not a file is
    /// refused, and summary.json or a ledger that is not is left out with a warning.
    #[test]
    fn run_files_that_are_not_files_are_refused_not_waited_on() {
        let mkfifo = |p: &std::path::Path| {
            rustix::fs::mkfifoat(rustix::fs::CWD, p, rustix::fs::Mode::from_raw_mode(0o600))
                .unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        mkfifo(&metrics);
        let d = dir.path().to_path_buf();
        let e = watched("a FIFO metrics.jsonl", move || {
            load(&d).err().expect("refused")
        });
        assert!(e.to_string().contains("is a FIFO"), "{e}");
        std::fs::remove_file(&metrics).unwrap();
        std::fs::write(&metrics, "{\"t_s\":1}\n").unwrap();
        mkfifo(&dir.path().join("summary.json"));
        std::fs::create_dir(dir.path().join("ledger")).unwrap();
        mkfifo(&dir.path().join("ledger/drafter-0.jsonl"));
        let d = dir.path().to_path_buf();
        let run = watched("a FIFO summary.json and ledger", move || load(&d).unwrap());
        assert!(run.summary.is_none() && run.ledgers.is_empty());
        let said = outcome(&run);
        assert!(
            said.starts_with("summary.json is unreadable (it is a FIFO"),
            "{said}"
        );
    }

    /// metrics.jsonl naming a device that never ends is refused before it is read.
    #[test]
    fn metrics_that_are_a_device_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("metrics.jsonl")).unwrap();
        let d = dir.path().to_path_buf();
        let e = watched("metrics.jsonl -> /dev/zero", move || {
            load(&d).err().expect("refused")
        });
        assert!(
            e.to_string().contains("is a device, not a regular file"),
            "{e}"
        );
    }

    /// A summary.json cut short said "no summary.json (the run did not finish)": it says it is
    /// unreadable, and the run is drawn without it.
    #[test]
    fn a_summary_cut_short_is_said_unreadable() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("summary.json"), "{\"ok\": tr").unwrap();
        let (run, _) = load_and_draw(dir.path(), b"{\"t_s\":1}\n");
        let said = outcome(&run);
        assert!(
            said.starts_with("summary.json is unreadable (not JSON: EOF while parsing"),
            "{said}"
        );
    }

    /// A summary.json of another shape than the launcher writes (edited) is left out with a
    /// warning naming the file and the field, as one that is not JSON is. Before, it was read
    /// silently and the picture said "exit code null: null/null samples trained".
    #[test]
    fn a_summary_of_another_shape_is_left_out_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let summary = dir.path().join("summary.json");
        for (text, why) in [
            ("[]", "it is a list, not an object"),
            (
                "{\"ok\": \"yes\"}",
                "its \"ok\" is a string, not true or false",
            ),
            ("{\"ok\": true}", "it has no \"exit_code\""),
        ] {
            std::fs::write(&summary, text).unwrap();
            let (run, _) = load_and_draw(dir.path(), b"{\"t_s\":1}\n");
            assert!(run.summary.is_none(), "{text}");
            let want = format!(
                "{} is unreadable (not a launcher's summary: {why}): drawn without it",
                summary.display()
            );
            assert_eq!(run.warnings, [want], "{text}");
            assert!(
                outcome(&run).starts_with("summary.json is unreadable"),
                "{text}"
            );
        }
    }

    /// 2000 workers asked, with no --height, for "--height 128628 is too tall": the default
    /// height fits, the bands that fit are drawn, and the picture says which are left out.
    #[test]
    fn the_default_height_fits_however_many_workers() {
        let dir = tempfile::tempdir().unwrap();
        let workers: Vec<_> = (0..2000)
            .map(|i| serde_json::json!({"name": format!("target-{i}"), "busy": 0.5}))
            .collect();
        let tick = serde_json::json!({"t_s": 1, "workers": workers}).to_string() + "\n";
        let (run, svg) = load_and_draw(dir.path(), tick.as_bytes());
        let plan = Plan::new(&run, 1200, None).unwrap();
        assert_eq!(plan.height, super::MAX_SIDE);
        assert!(plan.workers.len() > 500 && plan.workers.len() < 2000);
        let left = 2000 - plan.workers.len();
        assert!(
            svg.contains(&format!("the last {left} of its 2000 workers have no band")),
            "{}",
            &svg[..1000]
        );
        // A --height given that is too short is still refused, naming the flag.
        let e = Plan::new(&run, 1200, Some(1000)).err().expect("refused");
        assert!(
            e.to_string().starts_with("--height 1000 is too short"),
            "{e}"
        );
    }

    /// `-o` into a directory that does not exist yet makes it, as `eval --json` and `prepare -o`
    /// do (the temporary file beside the picture failed with "No such file or directory").
    #[test]
    fn the_picture_goes_into_a_directory_made_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        std::fs::create_dir_all(&run_dir).unwrap();
        std::fs::write(run_dir.join("metrics.jsonl"), tick(1.0) + &tick(2.0)).unwrap();
        let out = dir.path().join("out/pictures/x.svg");
        let args = super::ReportArgs {
            run_dir,
            output: Some(out.clone()),
            width: 1200,
            height: None,
        };
        assert_eq!(super::run(args).unwrap(), 0);
        assert!(std::fs::read_to_string(&out).unwrap().starts_with("<svg"));
    }

    /// `-o` naming one of the run's own files (through a link, or a hard link) replaced it with
    /// the picture: refused, the file left as it was.
    #[test]
    fn the_picture_is_not_written_over_the_runs_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        std::fs::create_dir_all(run_dir.join("ledger")).unwrap();
        let metrics = "{\"t_s\":1}\n";
        std::fs::write(run_dir.join("metrics.jsonl"), metrics).unwrap();
        std::fs::write(run_dir.join("summary.json"), "{\"ok\": true}").unwrap();
        std::fs::write(run_dir.join("ledger/drafter-0.jsonl"), "").unwrap();
        let link = dir.path().join("m.svg");
        std::os::unix::fs::symlink(run_dir.join("metrics.jsonl"), &link).unwrap();
        let hard = dir.path().join("s.svg");
        std::fs::hard_link(run_dir.join("summary.json"), &hard).unwrap();
        let ledger = dir.path().join("l.svg");
        std::os::unix::fs::symlink(run_dir.join("ledger/drafter-0.jsonl"), &ledger).unwrap();
        for out in [link, hard, ledger] {
            let args = super::ReportArgs {
                run_dir: run_dir.clone(),
                output: Some(out.clone()),
                width: 1200,
                height: None,
            };
            let e = super::run(args).expect_err("refused");
            assert!(
                e.to_string().contains("which the report is drawn from"),
                "{e}"
            );
        }
        let read = |p: &str| std::fs::read_to_string(run_dir.join(p)).unwrap();
        assert_eq!(read("metrics.jsonl"), metrics);
        assert_eq!(read("summary.json"), "{\"ok\": true}");
        assert_eq!(read("ledger/drafter-0.jsonl"), "");
    }
}
