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
//! Each launcher writes a new file, `events.out.tfevents.<seconds>.<host>.<pid>`, created only
//! if no such file exists: a resume adds a file beside the earlier ones, and TensorBoard reads
//! the folder as one run. TensorBoard is a view of the run, not its record: an error creating or
//! writing the file is said once, and the run goes on without it (`metrics.jsonl` has every
//! tick).

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

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
}

impl Board {
    /// A new event file in the run's `tb/`. On an error it returns the message to say, and a
    /// board that writes nothing.
    pub fn open(run_dir: &RunDir) -> (Board, Option<String>) {
        Board::open_at(run_dir, std::time::SystemTime::now())
    }

    /// [`Board::open`] at time `now`.
    fn open_at(run_dir: &RunDir, now: std::time::SystemTime) -> (Board, Option<String>) {
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

    /// Writes the scalars of tick `t` over interval `iv` (for the mean phase shares of the live
    /// targets and drafters). Returns the message to say when writing failed (once: the board
    /// is off then).
    pub fn record(&mut self, t: &Tick, iv: &Interval) -> Option<String> {
        let next = self.tick.map_or(0, |last| last + 1);
        let at_ms =
            (t.launch_unix_ms).map(|launch| launch.saturating_add((t.t_s * 1000.0).round() as u64));
        let tick = at_ms.map_or(next, |ms| ms.saturating_sub(self.first_launch_ms).max(next));
        self.tick = Some(tick);
        let tick = tick as i64;
        let mut scalars: Vec<(String, i64, f64)> = Vec::new();
        let pipeline = [
            ("pipeline/tokens_per_s", t.tokens_per_s),
            ("targets/busy", t.targets_busy),
            ("targets/waiting", t.targets_waiting),
            ("drafters/busy", t.drafters_busy),
            ("drafters/waiting", t.drafters_waiting),
        ];
        scalars.extend(pipeline.map(|(tag, v)| (tag.to_string(), tick, v)));
        for (role, name, other_wait) in [
            (Role::Producer, "targets", Phase::WaitEmpty),
            (Role::Consumer, "drafters", Phase::WaitFull),
        ] {
            let shares = phase_shares(iv, role);
            for p in role_phases(other_wait) {
                scalars.push((format!("{name}/phase/{}", p.name()), tick, shares[p]));
            }
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
        let w = self.writer.as_mut()?;
        // TensorBoard's scalars are f32 (the `simple_value` of a summary).
        let written = (scalars.iter())
            .try_for_each(|(tag, step, v)| w.write_scalar(tag.as_str(), *step, *v as f32));
        written.err().map(|e| self.off("writing", &e))
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
        let (mut first, said) = Board::open_at(&run, at(1_000_000));
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
        let (mut resumed, said) = Board::open_at(&run, at(1_000_070));
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
