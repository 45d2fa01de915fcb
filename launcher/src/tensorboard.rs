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
//!   `drafters/phase/compute`, ...) are at the tick's number, its line in `metrics.jsonl` (1 for
//!   the first line): a resume appends to `metrics.jsonl`, so it continues the count. Wall time,
//!   TensorBoard's other axis, lines both up.
//!
//! Each launcher writes a new file, `events.out.tfevents.<seconds>.<host>.<pid>`, created only
//! if no such file exists: a resume adds a file beside the earlier ones, and TensorBoard reads
//! the folder as one run. TensorBoard is a view of the run, not its record: an error creating or
//! writing the file is said once, and the run goes on without it (`metrics.jsonl` has every
//! tick).

use std::fs::File;
use std::io::{BufRead, BufWriter};
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

/// The lines a metrics file already holds (a resume appends to it), 0 for none.
fn lines_in(path: &Path) -> u64 {
    let Ok(f) = File::open(path) else { return 0 };
    let mut r = std::io::BufReader::with_capacity(1 << 16, f);
    let mut n = 0;
    while let Ok(buf) = r.fill_buf() {
        if buf.is_empty() {
            break;
        }
        n += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        let len = buf.len();
        r.consume(len);
    }
    n
}

/// The run's TensorBoard writer, or nothing once it failed.
pub struct Board {
    writer: Option<SummaryWriter<BufWriter<File>>>,
    /// The event file, for messages.
    path: PathBuf,
    /// The tick number of the last tick written (the number of ticks before this launcher's
    /// first, for a resume).
    tick: u64,
    /// The group step the train series were last written at.
    step: Option<u64>,
}

impl Board {
    /// A new event file in the run's `tb/`, its ticks numbered after those `metrics.jsonl`
    /// already holds (call it before the monitor appends). On an error it returns the message
    /// to say, and a board that writes nothing.
    pub fn open(run_dir: &RunDir) -> (Board, Option<String>) {
        let dir = run_dir.tensorboard_dir();
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        // TensorFlow's own naming: TensorBoard finds files by `tfevents` in the name and reads
        // a folder's files in name order, so by time.
        let path = dir.join(format!(
            "events.out.tfevents.{secs:010}.{}.{}",
            hostname(),
            std::process::id()
        ));
        let mut board = Board {
            writer: None,
            path,
            tick: lines_in(&run_dir.metrics()),
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
        self.tick += 1;
        let mut scalars: Vec<(String, i64, f64)> = Vec::new();
        let tick = self.tick as i64;
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
