//! TensorBoard event files in `<run-dir>/tb/`, beside `metrics.jsonl`: the monitor's ticks as
//! scalars, for the dashboards users already read (`tensorboard --logdir <run-dir>/tb`).
//!
//! Each series is written at strictly increasing steps, because TensorBoard keeps a series'
//! points by step: a point at a step it has already seen drops every point from that step on
//! (its reservoir's preemption, meant for a job restarted from a checkpoint). So there are two
//! x-axes:
//! - `train/loss`, `train/tau` and `train/lr` are at the drafter group's step, and are written
//!   at the ticks whose interval applied a step (a tick that applied none, as in the drain at the
//!   end, would repeat the step). A resumed group restarts at its checkpoint's step, and
//!   TensorBoard rightly shows the resumed run's values from there on: those steps were trained
//!   again.
//! - The pipeline's series (`pipeline/tokens_per_s`, `targets/busy`, `drafters/waiting`,
//!   `drafters/phase/compute`, ...) are at the tick's time, in milliseconds since the run's first
//!   launch: the time in the name of the earliest event file in `tb/` (this launcher's own, for
//!   the first). A resume's ticks come after every earlier launch's, whatever was written of
//!   them; a tick's number in `metrics.jsonl` was not enough, since ticks lost to a full disk
//!   have no line there but do have their points here. A tick in the same millisecond as the
//!   one before goes one step on. Wall time, TensorBoard's other axis, lines both up.
//!
//! The pipeline's series are written at most every [`PIPELINE_EVERY_S`] (10 s) of run time,
//! not at every tick: at `--monitor 1` a point a tick made them nine tenths of `tb/`, about
//! 100 MB a day, and TensorBoard shows a week as 1,000 points a series anyway (its default
//! `--samples_per_plugin`). A point folds the ticks since the point before: each value is the
//! mean of theirs weighted by their intervals' length, which for a rate or a share of the
//! interval (every pipeline series is one) is the rate or share over the point's whole time,
//! so a stall of one second still moves its 10-s point. A point's step is its last tick's, so
//! the axis means what it did: the time, in ms since the run's first launch, at which the
//! point's interval ends. A launcher's first tick is a point at once (a new run or a resume
//! shows up straight away), and the ticks left at the run's end are written then
//! ([`Board::finish`]): the last value is always there. A killed launcher loses the ticks since
//! its last point (at most 10 s; `metrics.jsonl` has them). At `--monitor 10` or slower every
//! tick is a point, as before.
//!
//! Each launcher writes a new file, `events.out.tfevents.<seconds>.<host>.<pid>`, created only
//! if no such file exists: a resume adds a file beside the earlier ones, and TensorBoard reads
//! the folder as one run. TensorBoard is a view of the run, not its record: an error creating or
//! writing the file is said once, and the run goes on without it (`metrics.jsonl` has every
//! tick).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::Duration;

use proto::RunDir;
use ring_stat::analysis::Interval;
use shm_ring::{Phase, PhaseMap, Role};
use syntaxdot_summary::SummaryWriter;

use crate::monitor::{live, Tick};

/// The phases a role's workers spend time in: every phase but the other role's wait (a target
/// never waits for an item, a drafter never for a free slot).
fn role_phases(wait_of_the_other_role: Phase) -> impl Iterator<Item = Phase> {
    Phase::ALL
        .into_iter()
        .filter(move |&p| p != wait_of_the_other_role)
}

/// Mean shares by phase of the live workers of one role over an interval (zero without any).
fn phase_shares(iv: &Interval, role: Role) -> PhaseMap<f64> {
    let ws = live(iv, role);
    let mut mean = PhaseMap::default();
    for w in &ws {
        for (p, v) in &w.phases {
            mean[p] += v / ws.len() as f64;
        }
    }
    mean
}

/// Event files are named `events.out.tfevents.<seconds>.<host>.<pid>`.
const EVENTS_PREFIX: &str = proto::run_dir::TB_EVENTS_PREFIX;

/// The run's first launch (Unix time, ms): the seconds in the name of the earliest event file in
/// `dir`, or `now_s` if there is none (or only one from a clock ahead of this one).
fn first_launch_ms(dir: &Path, now_s: u64) -> u64 {
    let earliest = (std::fs::read_dir(dir).into_iter().flatten().flatten())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix(EVENTS_PREFIX)?
                .split('.')
                .next()?
                .parse()
                .ok()
        })
        .min();
    earliest.unwrap_or(now_s).min(now_s).saturating_mul(1000)
}

/// The pipeline series' least spacing in run time, seconds: a point folds the ticks of at
/// least this long (ten at `--monitor 1`).
const PIPELINE_EVERY_S: f64 = 10.0;

/// How much short of [`PIPELINE_EVERY_S`] a fold is written all the same: ten 1-s ticks span
/// 10 s give or take the microseconds between the monitor's clock and the ring's snapshot
/// (which times an interval), and make one point, not one of eleven ticks.
const JITTER_S: f64 = 0.1;

/// The pipeline's scalars of one tick, by tag. Every one is a rate or a share of the tick's
/// interval, so a point of several ticks is their mean weighted by interval length (see
/// [`Fold`]): the rate or share over the point's time, as one tick that long would have
/// measured it. None is a last value (a counter, the ring's depth: a point would take its last
/// tick's) or a maximum (a worker's longest idle gap: a point would take the greatest); those
/// are in `metrics.jsonl`, and one added here needs that fold, not the mean.
fn pipeline_scalars(t: &Tick, iv: &Interval) -> Vec<(String, f64)> {
    // Tokens trained over the interval's seconds: the weighted mean is all the tokens over all
    // the seconds.
    let mut scalars = vec![("pipeline/tokens_per_s".to_string(), t.tokens_per_s)];
    // The live workers' mean shares of the interval busy and waiting.
    scalars.extend(
        [
            ("targets/busy", t.targets_busy),
            ("targets/waiting", t.targets_waiting),
            ("drafters/busy", t.drafters_busy),
            ("drafters/waiting", t.drafters_waiting),
        ]
        .map(|(tag, v)| (tag.to_string(), v)),
    );
    // The live workers' mean shares of the interval by phase.
    for (role, name, other_wait) in [
        (Role::Producer, "targets", Phase::WaitEmpty),
        (Role::Consumer, "drafters", Phase::WaitFull),
    ] {
        let shares = phase_shares(iv, role);
        for p in role_phases(other_wait) {
            scalars.push((format!("{name}/phase/{}", p.name()), shares[p]));
        }
    }
    scalars
}

/// The pipeline's scalars of the ticks since the last point, folded into the next one: the
/// mean of each over the ticks, weighted by their intervals' seconds.
#[derive(Debug, Default)]
struct Fold {
    /// The step of the last tick folded: the point's.
    tick: i64,
    /// The ticks' intervals, summed: the run time the point covers.
    seconds: f64,
    /// By tag, the ticks' values times their intervals' seconds, summed.
    sums: BTreeMap<String, f64>,
}

impl Fold {
    /// Folds in a tick at step `tick` with an interval of `seconds`.
    fn add(&mut self, tick: i64, seconds: f64, scalars: Vec<(String, f64)>) {
        // An interval of no length (the ring's are at least 1 ns) weighs a nanosecond: a fold
        // of such alone is their plain mean, not a division by zero.
        let w = seconds.max(1e-9);
        self.tick = tick;
        self.seconds += w;
        for (tag, v) in scalars {
            *self.sums.entry(tag).or_default() += v * w;
        }
    }

    /// The point, `(tag, step, mean)` by tag (none if no tick was folded); the fold is empty
    /// after.
    fn take(&mut self) -> Vec<(String, i64, f64)> {
        let Fold {
            tick,
            seconds,
            sums,
        } = std::mem::take(self);
        (sums.into_iter())
            .map(|(tag, sum)| (tag, tick, sum / seconds))
            .collect()
    }
}

/// The run's TensorBoard writer, or nothing once it failed.
pub struct Board {
    writer: Option<SummaryWriter<BufWriter<File>>>,
    /// The event file, for messages.
    path: PathBuf,
    /// The run's first launch (Unix time, ms): the pipeline series' step 0.
    first_launch_ms: u64,
    /// The step of this launcher's last tick.
    tick: Option<u64>,
    /// The group step the train series were last written at.
    step: Option<u64>,
    /// The seconds of run time a fold must span to be a point: 0 (every tick) at a monitor
    /// period of [`PIPELINE_EVERY_S`] or more.
    fold_s: f64,
    /// The ticks since the last pipeline point.
    fold: Fold,
    /// Whether this launcher wrote a pipeline point (its first tick is one at once).
    pointed: bool,
}

impl Board {
    /// A new event file in the run's `tb/`, for ticks `monitor` apart. On an error it returns
    /// the message to say, and a board that writes nothing.
    pub fn open(run_dir: &RunDir, monitor: Duration) -> (Board, Option<String>) {
        Board::open_at(run_dir, monitor, std::time::SystemTime::now())
    }

    /// [`Board::open`] at time `now`.
    fn open_at(
        run_dir: &RunDir,
        monitor: Duration,
        now: std::time::SystemTime,
    ) -> (Board, Option<String>) {
        let dir = run_dir.tensorboard_dir();
        let secs = now
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        // TensorFlow's own naming: TensorBoard finds files by `tfevents` in the name and reads
        // a folder's files in name order, so by time.
        let path = dir.join(format!(
            "{EVENTS_PREFIX}{secs:010}.{}.{}",
            hostname(),
            std::process::id()
        ));
        let mut board = Board {
            writer: None,
            path,
            first_launch_ms: first_launch_ms(&dir, secs),
            tick: None,
            step: None,
            // Ticks this far apart are points each, as they always were: folding them would
            // space the points further than the period, and their intervals are as long
            // already.
            fold_s: if monitor.as_secs_f64() >= PIPELINE_EVERY_S {
                0.0
            } else {
                PIPELINE_EVERY_S - JITTER_S
            },
            fold: Fold::default(),
            pointed: false,
        };
        let opened = std::fs::create_dir_all(&dir)
            .and_then(|()| {
                // Never truncates a file: an earlier launcher's events stay as they were.
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&board.path)
            })
            .and_then(|f| SummaryWriter::new(BufWriter::new(f)));
        match opened {
            Ok(w) => {
                board.writer = Some(w);
                (board, None)
            }
            Err(e) => {
                let msg = board.off("creating", &e);
                (board, Some(msg))
            }
        }
    }

    /// The message for an error, the board off from now on.
    fn off(&mut self, what: &str, e: &std::io::Error) -> String {
        self.writer = None;
        format!(
            "warning: TensorBoard events off: {what} {}: {e} (metrics.jsonl still has every tick)",
            self.path.display()
        )
    }

    /// Records tick `t` over interval `iv` (for the mean phase shares of the live targets and
    /// drafters): the train series at a new group step, and the pipeline's point once the ticks
    /// since the last one span [`PIPELINE_EVERY_S`]. Returns the message to say when writing
    /// failed (once: the board is off then).
    pub fn record(&mut self, t: &Tick, iv: &Interval) -> Option<String> {
        let next = self.tick.map_or(0, |last| last + 1);
        let at_ms =
            (t.launch_unix_ms).map(|launch| launch.saturating_add((t.t_s * 1000.0).round() as u64));
        let tick = at_ms.map_or(next, |ms| ms.saturating_sub(self.first_launch_ms).max(next));
        self.tick = Some(tick);
        self.fold
            .add(tick as i64, iv.seconds, pipeline_scalars(t, iv));
        let mut scalars = Vec::new();
        if !self.pointed || self.fold.seconds >= self.fold_s {
            self.pointed = true;
            scalars = self.fold.take();
        }
        if let Some(step) = t
            .group_step
            .filter(|&s| self.step.is_none_or(|last| s > last))
        {
            self.step = Some(step);
            let train = [
                ("train/loss", t.drafter_loss),
                ("train/tau", t.acceptance_length),
                ("train/lr", t.lr),
                ("eval/tau", t.eval_acceptance_length),
            ];
            for (tag, v) in train {
                if let Some(v) = v {
                    scalars.push((tag.to_string(), step as i64, v));
                }
            }
        }
        self.write(&scalars)
    }

    /// Writes the pipeline's point of the ticks since the last one, at the run's end: the last
    /// tick's value is always there. Returns the message to say when writing failed.
    pub fn finish(&mut self) -> Option<String> {
        let point = self.fold.take();
        self.write(&point)
    }

    /// Writes `(tag, step, value)`s; the message to say when that failed (once: the board is
    /// off then).
    fn write(&mut self, scalars: &[(String, i64, f64)]) -> Option<String> {
        let w = self.writer.as_mut()?;
        // TensorBoard's scalars are f32 (the `simple_value` of a summary).
        let written = (scalars.iter())
            .try_for_each(|(tag, step, v)| w.write_scalar(tag.as_str(), *step, *v as f32));
        written.err().map(|e| self.off("writing", &e))
    }
}

impl Drop for Board {
    /// A launcher that ends on an error, without [`Board::finish`], still writes its last ticks
    /// (nothing to say by then: `metrics.jsonl` is the record).
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// The machine's name, as TensorFlow puts it in an event file's name.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use super::*;

    /// A resume's pipeline points come after every earlier launch's, also when the earlier
    /// launch lost ticks to a full disk (points here, no line in metrics.jsonl): a point's step
    /// is its tick's time since the run's first launch. Before, it was the tick's line in
    /// metrics.jsonl, so the resume's first points fell on the earlier launch's last steps, and
    /// TensorBoard dropped them.
    #[test]
    fn a_resumes_ticks_come_after_every_earlier_tick_also_those_lost_to_a_full_disk() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let iv = Interval {
            seconds: 1.0,
            published_per_s: 0.0,
            released_per_s: 0.0,
            refused_per_s: 0.0,
            tokens_per_s: 0.0,
            full_frac: 0.0,
            empty_frac: 0.0,
            short_frac: 0.0,
            workers: Vec::new(),
        };
        let at = |s: u64| -> SystemTime { UNIX_EPOCH + Duration::from_secs(s) };
        let tick = |launch_s: u64, t_s: f64| Tick {
            t_s,
            launch_unix_ms: Some(launch_s * 1000),
            ..Tick::default()
        };
        let mut steps = Vec::new();
        // The first launch ticks five times; metrics.jsonl keeps two (then the disk filled).
        let (mut first, said) = Board::open_at(&run, Duration::from_secs(1), at(1_000_000));
        assert_eq!(said, None);
        for t_s in [1.0, 2.0, 3.0, 4.0, 5.0] {
            assert_eq!(first.record(&tick(1_000_000, t_s), &iv), None);
            steps.push(first.tick.unwrap());
        }
        drop(first);
        let kept = [tick(1_000_000, 1.0), tick(1_000_000, 2.0)]
            .map(|t| serde_json::to_string(&t).unwrap() + "\n");
        std::fs::write(run.metrics(), kept.concat()).unwrap();
        // The resume, a minute later; two ticks, the second in the same millisecond.
        let (mut resumed, said) = Board::open_at(&run, Duration::from_secs(1), at(1_000_070));
        assert_eq!(said, None);
        for t_s in [1.0, 1.0001] {
            assert_eq!(resumed.record(&tick(1_000_070, t_s), &iv), None);
            steps.push(resumed.tick.unwrap());
        }
        assert_eq!(
            steps,
            [1000, 2000, 3000, 4000, 5000, 71_000, 71_001],
            "strictly increasing"
        );
    }
}
