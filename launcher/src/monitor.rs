//! The live monitor: a progress bar on a terminal, plain periodic lines otherwise, and one JSON
//! line per tick in `metrics.jsonl`. `launcher.log` gets the plain lines either way.
//!
//! `metrics.jsonl` is what `launcher report` draws: each tick has the ring's occupancy, the
//! rate, every worker's shares by phase, and the events said since the previous tick (deaths,
//! restarts, stops), with the time they were said. A line is written with one `write`, and the
//! last tick when the run ends. A last line torn all the same (a kill in a write that crossed a
//! page, a cut after a full disk that failed, an older build) is ended before the next line
//! (`proto::jsonl`): it stays one unreadable line, which `launcher report` skips and counts.
//!
//! The same ticks go to TensorBoard's event files (`crate::tensorboard`), a view that may fail
//! without failing the run.
//!
//! Length: about 850 lines: the tick (every field of `metrics.jsonl`), what feeds it (the ring's
//! snapshots, the group's steps), the file, line and bar that record and print it (with the
//! bar's ETA) and their tests are one thing.
//!
//! The progress bar is never wider than the terminal: its layout is chosen for the terminal's
//! width at every tick (the bar shrinks, then goes), and the message is cut at its end.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use proto::plan::Epochs;
use proto::RunDir;
use ring_stat::analysis::{self, Interval, WorkerRates};
use serde::{Deserialize, Serialize};
use shm_ring::{Phase, Ring, Role, SlotCounts, Snapshot, WorkerState};

use crate::output::{Log, Tee};
use crate::summary::DrafterSummary;
use crate::tensorboard::Board;

/// One monitor tick, as written to metrics.jsonl. Fields added later default when read from an
/// older file.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Tick {
    pub t_s: f64,
    /// When the launcher that wrote the tick started (Unix time, ms): which launch of the run
    /// the tick is from (`t_s` starts again at each), for `launcher report`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch_unix_ms: Option<u64>,
    pub tokens_per_s: f64,
    /// Batches trained in the run so far: a resumed run's count starts at the batches its
    /// checkpoint holds. Those of `batches_lost` are not in it.
    pub batches_trained: u64,
    pub batches_total: u64,
    /// Batches the drafters took and trained in updates that were lost (every drafter died) or
    /// skipped (the group diverged), as `lost-steps.jsonl` says: untrained, and a resume trains
    /// them. Left out while 0.
    #[serde(skip_serializing_if = "is_zero")]
    pub batches_lost: u64,
    /// The epoch (1-based) of the first batch not yet trained, with several epochs planned:
    /// batches are trained in plan order, overlapping only by the batches in flight.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u32>,
    pub ring_ready: u32,
    pub ring_in_use: u32,
    pub ring_slots: u32,
    pub ready_per_bucket: Vec<u32>,
    pub targets_busy: f64,
    pub drafters_busy: f64,
    pub targets_waiting: f64,
    pub drafters_waiting: f64,
    pub restarts: u32,
    pub closed: bool,
    /// shm-ring-stat's verdict over the period.
    pub verdict: String,
    /// The verdict's class (`drafters`, `targets`, `balanced`, `draining`, `stalled`, ...), for
    /// a program reading the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bottleneck: Option<analysis::Bottleneck>,
    /// The worker the verdict holds responsible (`drafter-2`), if one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict_worker: Option<String>,
    /// Every worker over the period.
    pub workers: Vec<WorkerTick>,
    /// What the launcher said since the previous tick (a worker died, restarted, gave up; a
    /// stop began).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<EventTick>,
    /// The drafter group's training loss, once the drafters report it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafter_loss: Option<f64>,
    /// The drafter group's last applied step, once the drafters report it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_step: Option<u64>,
    /// The drafter's acceptance length (tau) over the interval's steps, once the drafters
    /// report it (a drafter that drafts blocks: DFlash).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acceptance_length: Option<f64>,
    /// The learning rate of the interval's last step (a drafter with a schedule).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// The leader's last speculative-decoding evaluation (mean tokens per target forward on
    /// held-out prompts; `dflash.eval_every`), once there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_acceptance_length: Option<f64>,
    /// Every group step applied in the interval: step, loss, tau, lr.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<proto::control::StepStats>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One worker in a tick: its shares of the period by phase (zero phases left out).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerTick {
    /// `target-0`, `drafter-2`: the names of the run directory's logs.
    pub name: String,
    pub gpu: Option<u32>,
    /// `alive`, `done`, `dead` (recovered, not running), `retired`, `vacant`.
    pub state: String,
    /// The record says alive and the process exists.
    pub alive: bool,
    pub restarts: u64,
    pub items: u64,
    pub tokens_per_s: f64,
    pub busy: f64,
    pub waiting: f64,
    /// By phase name (`wait_full`, ...).
    pub phases: BTreeMap<Phase, f64>,
    /// The longest stretch out of `compute` (its GPU idle) in the period, seconds (to the ms).
    pub largest_gap_s: f64,
}

/// A line the launcher printed, and when (seconds since the run started).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EventTick {
    pub t_s: f64,
    pub text: String,
}

/// Shares rounded to 0.1%: finer is noise, and it keeps week-long metrics files small.
fn share(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl WorkerTick {
    fn new(w: &WorkerRates) -> WorkerTick {
        let state = match w.state {
            WorkerState::Vacant => "vacant",
            WorkerState::Alive => "alive",
            WorkerState::Done => "done",
            WorkerState::Dead => "dead",
            WorkerState::Retired => "retired",
        };
        WorkerTick {
            name: w.name().to_string(),
            gpu: w.gpu,
            state: state.to_string(),
            alive: w.alive,
            restarts: w.restarts,
            items: w.items,
            tokens_per_s: w.tokens_per_s.round(),
            busy: share(w.busy),
            waiting: share(w.waiting),
            phases: w
                .phases
                .iter()
                .filter(|(_, v)| share(**v) > 0.0)
                .map(|(k, v)| (k, share(*v)))
                .collect(),
            largest_gap_s: (w.largest_gap_s * 1000.0).round() / 1000.0,
        }
    }
}

/// The bar's template for a terminal `width` columns wide, with `len` batches planned: the
/// bar narrows, then goes, then the clock goes; the message fills the rest and is cut at its
/// end, so the line never wraps.
fn bar_template(width: u16, len: u64) -> String {
    let width = usize::from(width);
    let counts = 2 * len.to_string().len() + 2;
    let clock = "00:00:00 ".len();
    let bar = width.saturating_sub(clock + counts + 24) / 2;
    match bar.min(30) {
        b if b >= 6 => format!("{{elapsed_precise}} [{{bar:{b}}}] {{pos}}/{{len}} {{wide_msg}}"),
        _ if width >= clock + counts + 12 => "{elapsed_precise} {pos}/{len} {wide_msg}".into(),
        _ => "{pos}/{len} {wide_msg}".into(),
    }
}

/// How far back the ETA looks: the pace of the last few minutes, so that a week-long run's ETA
/// neither jumps with each step nor lags a change of pace (a drafter given up) by days.
const ETA_WINDOW_S: f64 = 300.0;

/// This launcher's progress at its ticks, `(t_s, batches trained)`, over the last
/// [`ETA_WINDOW_S`]: the bar's ETA. Not indicatif's estimator, which read a resume's
/// checkpointed batches as trained in its first moment (an ETA of seconds for a run of days),
/// decayed over the monitor period before each tick (at `--monitor 10`, an ETA 3 to 5 times
/// too long) and said `ETA 0s` before the first batch.
#[derive(Debug)]
struct Pace {
    points: VecDeque<(f64, u64)>,
}

impl Pace {
    /// A launcher that starts at `t_s` 0 with `done` batches trained by earlier launchers.
    fn new(done: u64) -> Pace {
        Pace {
            points: VecDeque::from([(0.0, done)]),
        }
    }

    fn push(&mut self, t_s: f64, trained: u64) {
        // No progress since the oldest point (the ring filling at the start, a stall longer
        // than the window): the pace is measured from the progress that follows.
        if self.points.front().is_some_and(|&(_, b)| b >= trained) {
            self.points.clear();
        }
        self.points.push_back((t_s, trained));
        // Keep one point at or before the window's start, so the pace spans the whole window.
        while self.points.len() >= 2 && self.points[1].0 <= t_s - ETA_WINDOW_S {
            self.points.pop_front();
        }
    }

    /// The time left for the `total` planned batches at the window's pace; `None` while the
    /// window holds no progress.
    fn eta(&self, total: u64) -> Option<Duration> {
        let (&(t0, b0), &(t1, b1)) = (self.points.front()?, self.points.back()?);
        if b1 >= total {
            return Some(Duration::ZERO);
        }
        if b1 <= b0 || t1 <= t0 {
            return None;
        }
        let left = (total - b1) as f64 * (t1 - t0) / (b1 - b0) as f64;
        Some(Duration::from_secs_f64(left))
    }

    /// `ETA 5m07s`, `ETA 31h04m`; `ETA ?` while there is no pace to go by.
    fn text(&self, total: u64) -> String {
        let Some(eta) = self.eta(total) else {
            return "ETA ?".into();
        };
        let eta = eta.as_secs();
        if eta >= 3600 {
            format!("ETA {}h{:02}m", eta / 3600, eta % 3600 / 60)
        } else if eta >= 60 {
            format!("ETA {}m{:02}s", eta / 60, eta % 60)
        } else {
            format!("ETA {eta}s")
        }
    }
}

/// The progress bar on a terminal.
struct Bar {
    bar: ProgressBar,
    term: console::Term,
    /// The template in use, so that it changes only with the width.
    template: String,
    /// The log, for what the bar shows (plain lines reach the log through stdout).
    log: Log,
    /// This launcher's pace, for the ETA.
    pace: Pace,
}

/// `metrics.jsonl`, open for appending.
struct Metrics {
    file: File,
    /// The file's length after its last whole line, where a failed write is cut back to; None
    /// until the first write and after a failed one, when the next write first reads it from
    /// the file and ends a torn last line (an older build's, a kill's, or a cut that failed).
    len: Option<u64>,
    /// Ticks not written since writing failed (None while it works).
    missed: Option<u64>,
}

impl Metrics {
    /// Opens (or creates) `path` for appending: a resumed run adds to what the run wrote before.
    fn open(path: &std::path::Path) -> anyhow::Result<Metrics> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Metrics {
            file,
            len: None,
            missed: None,
        })
    }

    /// Appends tick `t`; returns a line to say when writing starts or stops failing. A failed
    /// write (a full disk, some day of a week-long run) is cut back to the last whole line, and
    /// the tick's events go back to `events`, for the next tick: the file stays one `launcher
    /// report` reads, and the run goes on. It used to end the run there: the launcher exited
    /// with the error, its workers killed mid-step and no summary written.
    fn write(
        &mut self,
        t: &mut Tick,
        events: &mut Vec<EventTick>,
    ) -> anyhow::Result<Option<String>> {
        // One write per line: a launcher killed mid-run leaves whole lines only.
        let mut json = serde_json::to_string(&*t)?;
        json.push('\n');
        let path = "metrics.jsonl";
        let start = match self.len {
            Some(len) => Ok(len),
            None => proto::jsonl::end_torn_line(&mut self.file),
        };
        let written = start.and_then(|len| match self.file.write_all(json.as_bytes()) {
            Ok(()) => Ok(len + json.len() as u64),
            Err(e) => {
                // What part of the line went in comes out (appends go to the end whatever the
                // length); a truncation only frees space, so a full disk does not fail it.
                let _ = self.file.set_len(len);
                Err(e)
            }
        });
        match written {
            Ok(len) => {
                self.len = Some(len);
                Ok(self.missed.take().map(|n| {
                    format!("{path} is written again ({n} tick(s) missing before this one)")
                }))
            }
            Err(e) => {
                self.len = None;
                *events = std::mem::take(&mut t.events);
                let first = self.missed.is_none();
                *self.missed.get_or_insert(0) += 1;
                Ok(first.then(|| {
                    format!("warning: writing {path}: {e}: ticks are not recorded until it can be written again (the run goes on)")
                }))
            }
        }
    }
}

pub struct Monitor {
    metrics: Metrics,
    /// `launcher.log`, for what is not shown on the console.
    log: Log,
    /// The run directory, for its lost updates.
    run_dir: RunDir,
    lost: Lost,
    /// The TensorBoard event file.
    board: Board,
    total: u64,
    /// Batches trained before this launcher started (a resume's checkpointed batches, marked
    /// done in the ring): the ring's counters count only this launcher's.
    done_before: u64,
    /// The plan's epochs, for the line's `epoch e/E`.
    epochs: Epochs,
    every: Duration,
    last: Option<(Instant, Snapshot)>,
    /// Slot counts sampled since the last tick, for the ring-full/empty shares.
    occupancy: Vec<SlotCounts>,
    bar: Option<Bar>,
    /// When the monitor started, for the time of events.
    started: Instant,
    /// When this launcher started (Unix time, ms): every tick's `launch_unix_ms`.
    launch_unix_ms: u64,
    /// Events said since the last tick.
    events: Vec<EventTick>,
    /// The restarts of the last tick, for the final one.
    restarts: u32,
    /// The drafter group's progress since the last tick: loss x tokens, tokens.
    loss_sum: f64,
    loss_tokens: u64,
    /// The group's last step, with its last loss, tau and lr (for the ticks and the summary).
    group: Option<DrafterSummary>,
    /// The last interval's loss, kept while an interval brings no step.
    loss: Option<f64>,
    /// Tau x steps and steps since the last tick; the last interval's tau.
    tau_sum: f64,
    tau_steps: u64,
    tau: Option<f64>,
    /// The last evaluation's acceptance length.
    eval_tau: Option<f64>,
    /// The steps since the last tick, for its `steps`.
    steps: Vec<proto::control::StepStats>,
    /// The verdict over recent ticks (a window, with hysteresis).
    judge: analysis::Judge,
    /// The count of batches refused as corrupt at which they are said next (1, 10, 100, ...).
    refused_next: u64,
}

/// The batches of this launch whose updates were lost or skipped: the ledger lines in the steps
/// `lost-steps.jsonl` names. Lines of steps lost in earlier launches are not among them: a
/// resume drops those lines and the file before this launcher's monitor starts.
#[derive(Debug, Default)]
struct Lost {
    /// The file's length when it was last read: it only grows during a run (a drafter, or the
    /// launcher at the end, appends a range), so a tick costs one `stat`, and the ledgers are
    /// read only when a range was added (every drafter died, or the group diverged).
    len: u64,
    batches: u64,
}

impl Lost {
    fn batches(&mut self, run_dir: &RunDir) -> u64 {
        let len = std::fs::metadata(run_dir.lost_steps()).map_or(0, |m| m.len());
        if len != self.len {
            // Read again at the next tick if this read fails: the summary reads the same
            // files at the end and says what fails there.
            if let Ok(l) = proto::ledger::read_all(run_dir) {
                (self.len, self.batches) = (len, l.lost.len() as u64);
            }
        }
        self.batches
    }
}

/// The live workers of one role over an interval.
pub(crate) fn live(iv: &Interval, role: Role) -> Vec<&WorkerRates> {
    (iv.workers.iter())
        .filter(|w| w.role == role && w.alive)
        .collect()
}

/// Mean (busy, waiting) shares of the live workers of one role over an interval.
fn shares(iv: &Interval, role: Role) -> (f64, f64) {
    let ws = live(iv, role);
    if ws.is_empty() {
        return (0.0, 0.0);
    }
    let n = ws.len() as f64;
    (
        ws.iter().map(|w| w.busy).sum::<f64>() / n,
        ws.iter().map(|w| w.waiting).sum::<f64>() / n,
    )
}

impl Monitor {
    /// A monitor of a plan of `total` batches, `done` of them trained by earlier launchers (a
    /// resume's).
    pub fn new(
        run_dir: &RunDir,
        (total, done): (u64, u64),
        epochs: &Epochs,
        every: Duration,
        tee: &Tee,
    ) -> anyhow::Result<Monitor> {
        let path = run_dir.metrics();
        let (board, board_error) = Board::open(run_dir, every);
        let metrics = Metrics::open(&path)?;
        let bar = tee.terminal().map(|term| Bar {
            bar: ProgressBar::with_draw_target(
                Some(total),
                ProgressDrawTarget::term(term.clone(), 20),
            )
            .with_position(done),
            term,
            template: String::new(),
            log: tee.log(),
            // From what earlier launchers trained: the ETA is this launcher's pace.
            pace: Pace::new(done),
        });
        let mut mon = Monitor {
            metrics,
            log: tee.log(),
            run_dir: run_dir.clone(),
            lost: Lost::default(),
            board,
            total,
            done_before: done,
            epochs: epochs.clone(),
            every,
            last: None,
            occupancy: Vec::new(),
            bar,
            started: Instant::now(),
            launch_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            events: Vec::new(),
            restarts: 0,
            loss_sum: 0.0,
            loss_tokens: 0,
            group: None,
            loss: None,
            tau_sum: 0.0,
            tau_steps: 0,
            tau: None,
            eval_tau: None,
            steps: Vec::new(),
            judge: analysis::Judge::new(),
            refused_next: 1,
        };
        if let Some(msg) = board_error {
            mon.say(&msg);
        }
        Ok(mon)
    }

    /// The group leader applied a step: its mean loss per loss token, its tau and lr.
    pub fn progress(&mut self, s: &proto::control::StepStats) {
        let weight = s.loss_weight();
        if weight > 0 {
            self.loss_sum += f64::from(s.loss) * weight as f64;
            self.loss_tokens += weight;
        }
        if let Some(tau) = s
            .tau
            .filter(|t| t.is_finite() && (s.tokens > 0 || s.tokens_unknown))
        {
            self.tau_sum += f64::from(tau);
            self.tau_steps += 1;
        }
        if let Some(e) = s.eval_tau {
            self.eval_tau = Some(f64::from(e));
        }
        DrafterSummary::update(&mut self.group, s);
        self.steps.push(*s);
    }

    /// The group's last step, loss, tau and lr, for the summary; `None` before any step.
    pub fn group(&self) -> Option<DrafterSummary> {
        self.group
    }

    /// The mean tau of the steps since the last tick (or the last one known).
    fn interval_tau(&mut self) -> Option<f64> {
        if self.tau_steps > 0 {
            self.tau = Some(self.tau_sum / self.tau_steps as f64);
            (self.tau_sum, self.tau_steps) = (0.0, 0);
        }
        self.tau
    }

    /// The token-weighted mean loss of the steps since the last tick (or the last one known).
    fn interval_loss(&mut self) -> Option<f64> {
        if self.loss_tokens > 0 {
            self.loss = Some(self.loss_sum / self.loss_tokens as f64);
            (self.loss_sum, self.loss_tokens) = (0.0, 0);
        }
        self.loss
    }

    /// Says batches refused as corrupt as they come, when the count passes 1, 10, 100, ...
    /// (once per tick at most, with the count then): a drafter that refuses every batch (a
    /// target of one's own computing what the mock drafter does not expect, a broken device)
    /// trains nothing, and a week is not the time to learn it from the end's note.
    fn say_refused(&mut self, refused: u64) {
        if refused < self.refused_next {
            return;
        }
        while self.refused_next <= refused {
            self.refused_next = self.refused_next.saturating_mul(10);
        }
        self.say(&format!(
            "the drafters refused {refused} batch(es) so far as corrupt (its checksum, shape or content): not trained; see the drafters' logs for why"
        ));
    }

    /// Records an event line in `launcher.log` and the next tick, not on the console (what
    /// would flood it: a crash loop's deaths past the first of each minute).
    pub fn log_only(&mut self, msg: &str) {
        self.events.push(EventTick {
            t_s: share(self.started.elapsed().as_secs_f64()),
            text: msg.to_string(),
        });
        self.log.line(msg);
    }

    /// Prints an event line without breaking the progress bar; the next tick records it.
    pub fn say(&mut self, msg: &str) {
        self.events.push(EventTick {
            t_s: share(self.started.elapsed().as_secs_f64()),
            text: msg.to_string(),
        });
        match &self.bar {
            Some(b) => {
                b.bar.println(msg);
                b.log.line(msg);
            }
            None => println!("{msg}"),
        }
    }

    pub fn tick(&mut self, ring: &Ring, restarts: u32, started: Instant) -> anyhow::Result<()> {
        let now = Instant::now();
        self.restarts = restarts;
        let Some((at, _)) = &self.last else {
            self.last = Some((now, ring.snapshot()));
            return Ok(());
        };
        self.occupancy.push(ring.slot_counts());
        if now.duration_since(*at) < self.every {
            return Ok(());
        }
        self.record(ring, restarts, started, now)
    }

    /// Writes a tick for the period since the last one, and shows it.
    fn record(
        &mut self,
        ring: &Ring,
        restarts: u32,
        started: Instant,
        now: Instant,
    ) -> anyhow::Result<()> {
        if self.last.is_none() {
            return Ok(());
        }
        let snap = ring.snapshot();
        self.say_refused(snap.counters.refused);
        let Some((_, prev)) = &self.last else {
            return Ok(());
        };
        let iv = analysis::interval(prev, &snap, &self.occupancy);
        let lost = self.lost.batches(&self.run_dir);
        self.judge.set_lost(lost);
        let verdict = self.judge.verdict(prev, &snap, &self.occupancy);
        self.occupancy.clear();
        let (tb, tw) = shares(&iv, Role::Producer);
        let (db, dw) = shares(&iv, Role::Consumer);
        // The run's, not this launcher's: a resume goes on from the batches it marked done.
        // The ring released the batches of lost updates too: they are not trained.
        let trained = (self.done_before + snap.counters.released).saturating_sub(lost);
        let mut t = Tick {
            t_s: started.elapsed().as_secs_f64(),
            launch_unix_ms: Some(self.launch_unix_ms),
            tokens_per_s: iv.tokens_per_s,
            batches_trained: trained,
            batches_total: self.total,
            batches_lost: lost,
            epoch: (self.epochs.count() > 1).then(|| self.epochs.of_batch(trained) + 1),
            ring_ready: snap.slots.ready,
            ring_in_use: snap.slots.ready + snap.slots.writing + snap.slots.reading,
            ring_slots: snap.params.slots,
            ready_per_bucket: snap.ready_per_bucket.clone(),
            targets_busy: tb,
            drafters_busy: db,
            targets_waiting: tw,
            drafters_waiting: dw,
            restarts,
            closed: snap.closed,
            verdict: verdict.line,
            bottleneck: Some(verdict.bottleneck),
            verdict_worker: verdict.worker.map(|w| w.to_string()),
            workers: iv.workers.iter().map(WorkerTick::new).collect(),
            events: std::mem::take(&mut self.events),
            drafter_loss: self.interval_loss(),
            group_step: self.group.map(|g| g.step),
            acceptance_length: self.interval_tau(),
            lr: self.group.and_then(|g| g.lr),
            eval_acceptance_length: self.eval_tau,
            steps: std::mem::take(&mut self.steps),
        };
        if let Some(msg) = self.metrics.write(&mut t, &mut self.events)? {
            self.say(&msg);
        }
        if let Some(msg) = self.board.record(&t, &iv) {
            self.say(&msg);
        }
        let rate = if t.tokens_per_s >= 1000.0 {
            format!("{:.1}k tok/s", t.tokens_per_s / 1000.0)
        } else {
            format!("{:.0} tok/s", t.tokens_per_s)
        };
        // The one model the drafter group trains: its step and loss.
        let mut group = match (t.group_step, t.drafter_loss) {
            (Some(step), Some(loss)) => format!("  step {step} loss {loss:.4}"),
            (Some(step), None) => format!("  step {step}"),
            _ => String::new(),
        };
        if let Some(tau) = t.acceptance_length {
            group.push_str(&format!(" tau {tau:.2}"));
        }
        if let Some(e) = t.eval_acceptance_length {
            group.push_str(&format!(" (eval {e:.2})"));
        }
        if let Some(n) = self.group.map(|g| g.updates_skipped).filter(|&n| n > 0) {
            group.push_str(&format!(" skipped {n} (gradient NaN)"));
        }
        let epoch = match t.epoch {
            Some(e) => format!(" (epoch {e}/{})", self.epochs.count()),
            None => String::new(),
        };
        let lost = match t.batches_lost {
            0 => String::new(),
            n => format!(" ({n} in lost updates)"),
        };
        let line = format!(
            "[{:6.1}s] {rate:>12}  trained {}/{}{lost}{epoch}{group}  ring {}/{} ready {:?}  busy: targets {:.0}% drafters {:.0}%  restarts {restarts}  | {}",
            t.t_s,
            t.batches_trained,
            t.batches_total,
            t.ring_ready,
            t.ring_slots,
            t.ready_per_bucket,
            tb * 100.0,
            db * 100.0,
            t.verdict
        );
        match &mut self.bar {
            Some(b) => {
                let (_, width) = b.term.size();
                let template = bar_template(width, self.total);
                if template != b.template {
                    b.bar.set_style(
                        ProgressStyle::with_template(&template)
                            .expect("valid template")
                            .progress_chars("=> "),
                    );
                    b.template = template;
                }
                // Most important first: the end is what a narrow terminal cuts.
                b.pace.push(t.t_s, t.batches_trained);
                let eta = b.pace.text(self.total);
                b.bar.set_position(t.batches_trained);
                b.bar.set_message(format!(
                    "{rate}{group}  ring {}/{}  {eta}  busy T {:.0}% D {:.0}%  restarts {restarts}  | {}",
                    t.ring_ready,
                    t.ring_slots,
                    tb * 100.0,
                    db * 100.0,
                    t.verdict
                ));
                b.log.line(&line);
            }
            None => println!("{line}"),
        }
        self.last = Some((now, snap));
        Ok(())
    }

    /// Records the last period and the events since the last tick, and clears the bar.
    pub fn finish(&mut self, ring: &Ring) -> anyhow::Result<()> {
        if let Some(b) = &self.bar {
            b.bar.finish_and_clear();
        }
        // The bar is gone: the last line goes to the terminal as a plain line.
        self.bar = None;
        self.record(ring, self.restarts, self.started, Instant::now())?;
        // TensorBoard's pipeline series get the ticks since their last point, so the last
        // tick's value is there.
        if let Some(msg) = self.board.finish() {
            self.say(&msg);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bar's ETA goes by this launcher's pace: `?` before its first batch (not `0s`), a
    /// resume's checkpointed batches not counted as trained at once, and the pace over a long
    /// monitor period as it was, the pace of the last five minutes.
    #[test]
    fn the_eta_is_the_pace_of_this_launchers_batches() {
        // A resume with 100 of 200 batches checkpointed: nothing trained while the ring fills.
        let mut pace = Pace::new(100);
        for t in [10.0, 20.0, 30.0] {
            pace.push(t, 100);
            assert_eq!(pace.text(200), "ETA ?", "at {t} s");
        }
        // 10 batches a tick of 10 s, from 30 s on.
        pace.push(40.0, 110);
        assert_eq!(pace.text(200), "ETA 1m30s");
        pace.push(50.0, 120);
        assert_eq!(pace.text(200), "ETA 1m20s", "{pace:?}");
        // A week-long run at --monitor 60: 2 batches a minute, 10,000 left.
        let mut pace = Pace::new(0);
        for i in 1..=20 {
            pace.push(60.0 * f64::from(i), 2 * i as u64);
        }
        assert_eq!(pace.eta(10_040), Some(Duration::from_secs(300_000)));
        assert_eq!(pace.text(10_040), "ETA 83h20m");
        // The pace of the last five minutes: the run slowed to one batch a minute.
        for i in 21..=26 {
            pace.push(60.0 * f64::from(i), 40 + (i - 20) as u64);
        }
        assert_eq!(pace.text(1046), "ETA 16h40m");
        assert_eq!(pace.text(46), "ETA 0s", "every batch trained");
    }

    /// The batches of lost updates are the ledger lines in the steps `lost-steps.jsonl` names,
    /// counted again when a range is added: none without the file.
    #[test]
    fn the_batches_in_lost_updates_are_counted_from_the_ledgers() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        run.lay_out().unwrap();
        let lines: String = (1..=6)
            .map(|step| {
                let l = proto::ledger::LedgerLine {
                    batch_id: step,
                    sample_ids: vec![step],
                    tokens: 8,
                    delivery: 0,
                    ticket: step,
                    step,
                    digest: String::new(),
                    epoch: 1,
                };
                serde_json::to_string(&l).unwrap() + "\n"
            })
            .collect();
        std::fs::write(run.ledger(0), lines).unwrap();
        let mut lost = Lost::default();
        assert_eq!(lost.batches(&run), 0);
        let range = proto::ledger::LostSteps::between(0, 2, 4).unwrap();
        proto::ledger::record_lost(&run, &range, &mut |_| false).unwrap();
        assert_eq!(lost.batches(&run), 2, "steps 3 and 4");
        let skipped = proto::ledger::LostSteps {
            first: 6,
            last: 6,
            rank: None,
            skipped: true,
        };
        proto::ledger::record_lost(&run, &skipped, &mut |_| false).unwrap();
        assert_eq!(lost.batches(&run), 3, "and step 6");
    }

    /// metrics.jsonl names phases as it always did (`"wait_full"`, ...), and reads them back.
    #[test]
    fn a_worker_tick_keeps_its_json_names() {
        let mut t = WorkerTick {
            name: shm_ring::WorkerName::consumer(2).to_string(),
            ..WorkerTick::default()
        };
        t.phases.insert(Phase::WaitFull, 0.25);
        t.phases.insert(Phase::Compute, 0.5);
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["name"], "drafter-2");
        assert_eq!(
            json["phases"],
            serde_json::json!({"wait_full": 0.25, "compute": 0.5})
        );
        let back: WorkerTick = serde_json::from_value(json).unwrap();
        assert_eq!(back.phases, t.phases);
        let old = r#"{"name": "target-0", "phases": {"copy_in": 0.1, "sync": 0.2}}"#;
        let old: WorkerTick = serde_json::from_str(old).unwrap();
        assert_eq!(old.phases[&Phase::CopyIn], 0.1);
        assert_eq!(old.phases[&Phase::Sync], 0.2);
    }

    /// A metrics.jsonl whose last line a kill (or an older build) tore is appended to after a
    /// newline: the torn line stays one unreadable line, and the next tick's line reads back.
    /// Before, the next tick was glued to the torn line, and both were lost.
    #[test]
    fn a_tick_after_a_torn_line_is_a_line_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = RunDir::new(dir.path()).metrics();
        let tick = |t_s: f64| Tick {
            t_s,
            ..Tick::default()
        };
        let whole = serde_json::to_string(&tick(1.0)).unwrap();
        std::fs::write(&path, format!("{whole}\n{}", &whole[..10])).unwrap();
        let mut metrics = Metrics::open(&path).unwrap();
        let mut events = Vec::new();
        for t_s in [2.0, 3.0] {
            let said = metrics.write(&mut tick(t_s), &mut events).unwrap();
            assert_eq!(said, None);
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let read: Vec<Option<f64>> = (text.lines())
            .map(|l| serde_json::from_str::<Tick>(l).ok().map(|t| t.t_s))
            .collect();
        assert_eq!(read, [Some(1.0), None, Some(2.0), Some(3.0)], "{text}");
        assert!(text.ends_with('\n'));
    }
}
