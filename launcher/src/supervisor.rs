//! The supervisor: owns the ring, the drafter group and one [`Worker`] record per worker
//! process, and runs the loop that keeps them going. Each pass of [`Supervisor::run`] does, in
//! order, every 20 ms:
//!
//! 1. [`signals`](Supervisor::signals): the first stop signal stops in order, the second kills.
//! 2. [`control_events`](Supervisor::control_events): what the handshake threads learned.
//! 3. [`hangs`](Supervisor::hangs): once a second, a worker silent past `--hang-timeout` is
//!    killed (its exit is then handled like any crash).
//! 4. [`exits`](Supervisor::exits): reap, recover the ring (and the group), decide restart or
//!    give up; with no drafter left, stop the targets.
//! 5. [`restarts`](Supervisor::restarts): start every worker whose backoff is over.
//! 6. [`monitor`](Supervisor::monitor): the progress bar or lines, and `metrics.jsonl`.
//! 7. [`place`](Supervisor::place): once a second, the run directory is still where it was
//!    (`place.rs`); deleted, moved or replaced, every worker is killed, exit code 1.
//! 8. [`logs`](Supervisor::logs): once a second, a worker's log past `--log-cap` is rotated.
//!
//! [`start`](Supervisor::start) (in `start.rs`) creates the ring and the group first. The loop
//! ends when every worker is finished (or killed by a second signal); then
//! [`finish`](Supervisor::finish) writes the summary and removes the ring.
//!
//! Length: past 500 lines: the loop's steps act on the same `Worker` records and are read
//! together; starting and settling are apart already (`start.rs`, `settle.rs`).

use std::collections::HashMap;
use std::process::{Child, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use collective::Collective;
use proto::control::{self, FinalReport, ToWorker};
use proto::plan::Epochs;
use proto::RunDir;
use shm_ring::{Ring, Role, Snapshot, WorkerName};

use crate::cli::{exit, Args};
use crate::monitor::Monitor;
use crate::signals::StopSignals;
use crate::spawn::{self, Event, Key, Welcome};
use crate::{log_cap, reclaim, summary};

mod diverged;
mod place;
mod quiet;
mod saves;
mod settle;
mod start;

/// Where a worker is in its life, as the supervisor sees it (not to be confused with
/// `shm_ring::Phase`, the time accounting of what a running worker does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    Running,
    /// Waiting out the backoff before a (re)start; the first start is due at once.
    Backoff(Instant),
    /// Exited 0: its part is complete.
    Done,
    /// Exited after a stop request.
    Stopped,
    /// Exited 0 without finishing its part (`unfinished_target`, `unfinished_drafter`): not
    /// restarted, and not counted as a drafter left to drain the ring.
    Unfinished,
    /// Crashed again with its restarts in a row at the limit.
    GaveUp,
}

/// One worker, across its incarnations.
struct Worker {
    name: WorkerName,
    gpu: u32,
    child: Option<Child>,
    pid: u32,
    spawns: u32,
    /// Restarts in all.
    restarts: u32,
    /// Restarts since it last finished an item (a batch published or trained): a crash loop
    /// counts up to `--max-restarts`, a crash after work starts again at 0.
    in_a_row: u32,
    /// Its items (the ring's count, over every incarnation) when this incarnation started.
    items_before: u64,
    /// This incarnation was killed for a hang (its death is its own, not a SIGKILL from outside).
    hung: bool,
    /// When this incarnation was started: until it registers in the ring it has no heartbeat,
    /// and its silence counts from here.
    spawned: Instant,
    life: Life,
    control: Option<control::Sender<ToWorker>>,
    report: Option<FinalReport>,
    /// Its log's last rotation failed, and that was said (once, until one succeeds).
    rotation_failed: bool,
    /// Its deaths said on the console this minute, and those held back (`quiet.rs`).
    death_lines: quiet::DeathLines,
    /// Its last death was held back from the console: so is its restart.
    restart_quietly: bool,
    /// The launcher's own descriptor of the log this incarnation writes: its log is rotated
    /// through it (`log_cap`), so a log deleted or moved while the worker writes it is still
    /// kept under `--log-cap`.
    log: Option<std::fs::File>,
    /// This incarnation's log was found gone from its path, and that was said.
    log_gone_said: bool,
}

impl Worker {
    fn new(name: WorkerName, gpu: u32) -> Worker {
        Worker {
            name,
            gpu,
            child: None,
            pid: 0,
            spawns: 0,
            restarts: 0,
            in_a_row: 0,
            items_before: 0,
            hung: false,
            spawned: Instant::now(),
            life: Life::Backoff(Instant::now()),
            control: None,
            report: None,
            rotation_failed: false,
            death_lines: quiet::DeathLines::default(),
            restart_quietly: false,
            log: None,
            log_gone_said: false,
        }
    }
    /// The current incarnation (restarts get a new `spawn`).
    fn key(&self) -> Key {
        Key {
            name: self.name,
            spawn: self.spawns.saturating_sub(1),
        }
    }
    fn name(&self) -> WorkerName {
        self.name
    }
    fn finished(&self) -> bool {
        matches!(
            self.life,
            Life::Done | Life::Stopped | Life::Unfinished | Life::GaveUp
        )
    }
}

/// SIGKILLs worker `c` with every process of its own group (`spawn` starts each worker as the
/// leader of one): a command that runs the real worker as its child (`bash -c "... && python
/// w.py"`, `uv run w.py`) would otherwise leave it running, still in the ring, when the
/// command it ran under is killed.
fn kill_worker(c: &mut Child) {
    let _ = rustix::process::kill_process_group(
        rustix::process::Pid::from_child(c),
        rustix::process::Signal::KILL,
    );
    let _ = c.kill();
}

/// The wait before a worker's restart number `in_a_row + 1` in a row: 200 ms doubling, at most
/// 5 s.
fn backoff(in_a_row: u32) -> Duration {
    Duration::from_millis(200 * (1u64 << in_a_row.min(5))).min(Duration::from_secs(5))
}

pub(crate) struct Supervisor<'a> {
    args: &'a Args,
    // Dropped in this order: the ring and the group are removed before the launcher's record
    // of them (`reclaim`), so a launcher killed in between still leaves what reclaims them.
    ring: Ring,
    group: Box<dyn Collective>,
    _record: Option<reclaim::Registration>,
    /// The run directory's lock (`resume::hold`): no other launcher runs in it while this one
    /// does.
    _held: Option<std::fs::File>,
    ring_name: String,
    run_dir: RunDir,
    /// The backend's description, for the summary.
    backend: String,
    samples: u64,
    /// The plan's epochs: each ledger line's epoch, for the summary.
    epochs: Epochs,
    welcome: Welcome,
    workers: Vec<Worker>,
    signals: StopSignals,
    events: mpsc::Receiver<Event>,
    /// Given to each incarnation's handshake thread.
    events_tx: mpsc::Sender<Event>,
    mon: Monitor,
    /// Lines for the summary: why the run is degraded.
    notes: Vec<String>,
    /// Lines for the summary that do not degrade the run: what preparing the data left out
    /// of the plan (records dropped), said at the end as at the start.
    data_notes: Vec<String>,
    /// The deaths held against each batch a worker had in hand (`--set-aside-after`).
    strikes: settle::Strikes,
    /// The plan: the samples of a batch set aside before it was published.
    planned: Vec<proto::plan::PlannedBatch>,
    /// A stop was asked for (a signal, or no drafter left): targets stop, drafters drain.
    stopping: bool,
    /// The group's updates skipped in a row (`--stop-after-skipped`).
    skipped: diverged::Diverged,
    /// What the leader wrote at its checkpoints, and what it could not.
    saves: saves::Saves,
    /// A second signal killed every worker.
    killed: bool,
    /// The run directory as found at the start, and what became of it once it was found gone
    /// (`place.rs`): the run stops, exit code 1.
    place: place::Place,
    gone: Option<place::Gone>,
    last_hang_check: Instant,
    last_log_check: Instant,
    last_place_check: Instant,
    started: Instant,
}

impl<'a> Supervisor<'a> {
    /// Runs the workers to the end; returns the process exit code once the summary is written.
    pub(crate) fn run(mut self) -> anyhow::Result<i32> {
        loop {
            if self.signals() {
                break;
            }
            self.control_events();
            self.hangs();
            self.exits()?;
            self.restarts()?;
            self.monitor()?;
            self.place();
            self.logs();
            if self.workers.iter().all(Worker::finished) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.finish()
    }

    /// Step 1: the first stop signal stops in order, the second kills every worker. True when
    /// the loop must end (killed).
    fn signals(&mut self) -> bool {
        let received = self.signals.received();
        if received >= 1 && !self.stopping {
            self.stopping = true;
            self.mon.say(&format!(
                "stopping: {}: targets stop claiming, drafters drain and checkpoint (a second signal kills every worker)",
                self.signals.last_name()
            ));
            self.send_stop();
            self.stop_unstarted();
        }
        if received < 2 {
            return false;
        }
        self.mon.say(&format!(
            "second signal ({}): killing every worker",
            self.signals.last_name()
        ));
        for w in &mut self.workers {
            if let Some(mut c) = w.child.take() {
                kill_worker(&mut c);
                let _ = c.wait();
            }
            if !w.finished() {
                w.life = Life::Stopped;
            }
        }
        self.killed = true;
        true
    }

    /// Step 2: what the handshake threads report (a connected worker, its final report, the
    /// group's progress, a failed handshake).
    fn control_events(&mut self) {
        while let Ok(ev) = self.events.try_recv() {
            self.control_event(ev);
        }
    }

    /// One of [`control_events`](Self::control_events).
    fn control_event(&mut self, ev: Event) {
        match ev {
            Event::Connected(key, sender) => {
                if let Some(w) = self.workers.iter_mut().find(|w| w.key() == key) {
                    if self.stopping {
                        let _ = sender.send(ToWorker::Stop);
                    }
                    w.control = Some(sender);
                }
            }
            Event::Report(key, r) => {
                if let Some(w) = self.workers.iter_mut().find(|w| w.key() == key) {
                    w.report = Some(r);
                }
            }
            Event::Progress(s) => {
                self.mon.progress(&s);
                self.diverged(&s);
            }
            Event::Saved(r) => {
                let lines = self.saves.saved(&r);
                // With the run directory gone, every save fails, as `place` said.
                if self.gone.is_none() {
                    for line in lines {
                        self.mon.say(&line);
                    }
                }
            }
            Event::HandshakeFailed(key, why) => {
                self.mon
                    .say(&format!("{}: handshake failed: {why}", key.name()));
            }
        }
    }

    /// A group that skips every update (its gradient NaN or infinite) has diverged
    /// ([`diverged`]): at `--stop-after-skipped` in a row the run stops in order, degraded.
    fn diverged(&mut self, s: &proto::control::StepStats) {
        let Some(note) = self.skipped.step(s, self.args.stop_after_skipped) else {
            return;
        };
        self.mon.say(&note);
        self.notes.push(note);
        if !self.stopping {
            self.stopping = true;
            self.send_stop();
            self.stop_unstarted();
        }
    }

    /// True if this incarnation of `w` registered in the ring: by its pid, or since it started
    /// (a command that runs the worker as its child registers another pid).
    fn registered(w: &Worker, snap: &Snapshot) -> bool {
        let since_start = w.spawned.elapsed().as_nanos() as u64;
        snap.worker(w.name()).is_some_and(|rec| {
            rec.pid == w.pid || rec.registered_age_ns.is_some_and(|age| age < since_start)
        })
    }

    /// Step 3, once a second: a running worker silent for too long is killed; its exit is
    /// handled by [`exits`](Self::exits) like any crash. Silent: no heartbeat for
    /// `--hang-timeout` since it registered in the ring, or not registered `--start-timeout`
    /// after its start (a model load or a GPU's initialisation that never returns, a Python
    /// worker stuck before `hspipe` attaches): such a worker was never killed, and a stop
    /// signal, which it never hears, did not end the run either.
    fn hangs(&mut self) {
        if self.last_hang_check.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_hang_check = Instant::now();
        let snap = self.ring.snapshot();
        let hang_ns = (self.args.hang_timeout * 1e9) as u64;
        let start_ns = (self.args.start_timeout * 1e9) as u64;
        for w in &mut self.workers {
            if w.child.is_none() {
                continue;
            }
            let since_start = w.spawned.elapsed().as_nanos() as u64;
            let this = (snap.worker(w.name())).filter(|_| Self::registered(w, &snap));
            // A worker loads its model before it registers: say how to allow a longer load.
            let (silent, limit, what, hint) = match this {
                Some(rec) => (
                    rec.heartbeat_age_ns.unwrap_or(0),
                    hang_ns,
                    "sent no heartbeat",
                    "",
                ),
                None => (
                    since_start,
                    start_ns,
                    "has not registered in the ring",
                    " (a model load or GPU start-up this long? raise --start-timeout)",
                ),
            };
            if silent > limit {
                self.mon.say(&format!(
                    "{} (pid {}) {what} for {:.0}s: killing it as hung{hint}",
                    w.name(),
                    w.pid,
                    silent as f64 / 1e9
                ));
                if let Some(c) = &mut w.child {
                    w.hung = true;
                    kill_worker(c);
                }
            }
        }
    }

    /// Step 4: reaps exited workers and decides what each exit means; with every drafter
    /// gone, stops the targets (nothing could drain the ring).
    fn exits(&mut self) -> anyhow::Result<()> {
        // Counted before this pass's exits: a drafter given up now is seen at the next pass.
        let drafters_left = (self.workers.iter())
            .filter(|w| w.name.role == Role::Consumer)
            .filter(|w| !matches!(w.life, Life::GaveUp | Life::Unfinished))
            .count();
        for i in 0..self.workers.len() {
            let run_stopping = self.stopping || self.signals.received() > 0;
            let w = &mut self.workers[i];
            let Some(child) = &mut w.child else {
                continue;
            };
            let Some(status) = child.try_wait().context("waiting for a worker")? else {
                continue;
            };
            w.child = None;
            w.control = None;
            // Its log's space is freed with the worker's descriptors if the log was deleted,
            // once its last words are read (through this descriptor: its path may name another
            // file, or none).
            let log = w.log.take();
            // Stopped while the launcher did not stop the run: a stop signal from outside (ours
            // say so: `proto::stop::OUTSIDE_SIGNAL`), which such a worker takes only after it
            // waited for the launcher's Stop in vain (`worker_runtime::LAUNCHERS_STOP_GRACE`):
            // not a stop of the run, a death, and restarted as one. A signal the launcher got
            // too (but has not acted on yet) makes it part of the run's stop, as before.
            let outside = status.code() == Some(proto::stop::EXIT_STOPPED) && !run_stopping;
            match status.code() {
                _ if outside => self.crashed(i, status, true, log.as_ref())?,
                Some(c @ (0 | proto::stop::EXIT_STOPPED)) => {
                    w.life = if c == 0 { Life::Done } else { Life::Stopped };
                    // A drafter that finished has left the group: a rank restarted late must
                    // not wait for it to admit it (it admits itself into an empty group, sees
                    // the ring's end and finishes too).
                    if w.name.role == Role::Consumer {
                        self.left_behind(i, status)?;
                        self.unfinished_drafter(i, status);
                    }
                }
                _ => self.crashed(i, status, false, log.as_ref())?,
            }
            if self.workers[i].finished() && self.workers[i].name.role == Role::Producer {
                self.unfinished_target(i, status)?;
            }
        }
        if drafters_left == 0 && !self.stopping {
            self.stopping = true;
            let note = "no drafter left: stopping the targets".to_string();
            self.mon.say(&note);
            self.notes.push(note);
            self.send_stop();
            self.stop_unstarted();
        }
        Ok(())
    }

    /// Worker `i` died: recover what it held, then schedule its restart or give it up. Only
    /// restarts in a row count against `--max-restarts`: an incarnation that finished an item
    /// (the ring's count of them grew) ends the row, so a run of a week keeps a GPU through a
    /// few crashes far apart, and a crash loop still ends at the limit. The price: a fault that
    /// recurs after some work (a device that fails now and then) is restarted for as long as
    /// the run goes on, as supervisord and Kubernetes do once a process has run; the death's
    /// line says why each time ([`spawn::last_error`]). A full disk is no such fault: the
    /// ledgers, checkpoints and metrics wait it out or try again, and no worker dies of it
    /// (`proto::ledger::Ledger::append_waiting`, `saves.rs`). A death with a batch in hand is held against
    /// that batch, which is set aside at `--set-aside-after` deaths (`settle.rs`). `outside`:
    /// it stopped on a stop signal that the launcher did not send ([`exits`](Self::exits)),
    /// which is said as such and is not held against its batch. `log`: the launcher's
    /// descriptor of the log the worker wrote, read for its last words.
    fn crashed(
        &mut self,
        i: usize,
        status: ExitStatus,
        outside: bool,
        log: Option<&std::fs::File>,
    ) -> anyhow::Result<()> {
        let snap = self.ring.snapshot();
        let rec = snap.worker(self.workers[i].name()).cloned();
        let items = rec.as_ref().map_or(0, |rec| rec.items);
        // SIGKILL (the OOM killer, ours for a hang, a person's) leaves no last word: what the
        // log ends with was said before, about something else.
        let killed = std::os::unix::process::ExitStatusExt::signal(&status)
            == Some(rustix::process::Signal::KILL.as_raw());
        let last = (!killed)
            .then(|| spawn::last_error(&self.run_dir.log(self.workers[i].name()), log))
            .flatten();
        let w = &mut self.workers[i];
        let death = match (outside, last) {
            (true, last) => {
                let signal = last
                    .as_deref()
                    .and_then(|l| l.strip_prefix(proto::stop::OUTSIDE_SIGNAL));
                format!(
                    "{} (pid {}) stopped on a signal from outside the launcher ({}): not a stop of the run, so handled as a crash",
                    w.name(),
                    w.pid,
                    signal.unwrap_or("it did not say which")
                )
            }
            (false, Some(e)) => {
                format!("{} (pid {}) died: {status}, saying {e:?}", w.name(), w.pid)
            }
            (false, None) => format!("{} (pid {}) died: {status}", w.name(), w.pid),
        };
        // The batch it was computing on, if its death is held against that batch.
        let finished = match w.name.role {
            Role::Producer => snap.counters.published,
            Role::Consumer => snap.counters.released,
        };
        let struck = (rec.and_then(|r| r.in_hand))
            .filter(|_| !outside && settle::Strikes::counts(status, w.hung))
            .map(|batch| settle::Struck {
                batch,
                line: death.clone(),
                worker: w.name,
                after_work: items > w.items_before,
                finished,
            });
        w.hung = false;
        self.down(i, death, struck, items)
    }

    /// Worker `i` is down (it died, or could not be started): recover what it held, then
    /// schedule its restart or give it up. `items`: the ring's count of items it finished.
    fn down(
        &mut self,
        i: usize,
        death: String,
        struck: Option<settle::Struck>,
        items: u64,
    ) -> anyhow::Result<()> {
        let registered = Self::registered(&self.workers[i], &self.ring.snapshot());
        let (r, settled) = self.recover(i, struck)?;
        let w = &mut self.workers[i];
        // A batch published or trained, or one whose update the group applied before it died.
        let worked = items > w.items_before || r.retired > 0;
        if worked {
            w.in_a_row = 0;
        }
        w.items_before = items;
        let in_hand = settled.in_hand.map_or(String::new(), |h| format!("; {h}"));
        let line = format!("{death}{in_hand}; {r}");
        // Deaths after work are never given up: past five a minute they are counted on the
        // console, not said one by one (`quiet.rs`). A crash loop in a row ends at the limit.
        let (held, say) = if worked {
            w.death_lines.death(&w.name().to_string(), Instant::now())
        } else {
            (None, true)
        };
        w.restart_quietly = !say;
        if let Some(held) = held {
            self.mon.say(&held);
        }
        if say {
            self.mon.say(&line);
        } else {
            self.mon.log_only(&line);
        }
        for line in settled.lines {
            self.mon.say(&line);
        }
        let w = &mut self.workers[i];
        // While stopping, targets are not restarted, nor a worker that went down before it
        // registered (killed by the stop, or stuck starting): only a drafter that was draining.
        // With the run directory gone (`place`), none: nothing it does can be saved there.
        let stopped = self.stopping && (w.name.role == Role::Producer || !registered);
        let gone = self.gone.is_some();
        if w.in_a_row < self.args.max_restarts && !stopped && !gone {
            w.life = Life::Backoff(Instant::now() + backoff(w.in_a_row));
            w.in_a_row += 1;
            w.restarts += 1;
            return Ok(());
        }
        if gone {
            w.life = Life::Stopped;
        } else if stopped {
            w.life = Life::Stopped;
            if w.name.role == Role::Consumer {
                let note = format!(
                    "{} went down before it registered while the run stops: not restarted; what the ring still holds is trained by the other drafters, or by `launcher --resume`",
                    w.name()
                );
                self.mon.say(&note);
                self.notes.push(note);
            }
        } else {
            w.life = Life::GaveUp;
            let note = format!(
                "{} gave up after {} restart(s) in a row ({} in all); log: {}",
                w.name(),
                w.in_a_row,
                w.restarts,
                self.run_dir.log(w.name()).display()
            );
            self.mon.say(&note);
            self.notes.push(note);
        }
        if w.name.role == Role::Producer {
            // Count it as finished so the ring still closes.
            self.ring.retire(w.name.index)?;
        }
        Ok(())
    }

    /// A target that exited cleanly (0, or stopped) without counting itself finished in the
    /// ring (a Python target that never called `close()`) would keep the ring open for ever:
    /// what it held goes back to the others and it is retired, so the ring still closes.
    fn unfinished_target(&mut self, i: usize, status: ExitStatus) -> anyhow::Result<()> {
        let name = self.workers[i].name();
        if (self.ring.snapshot().worker(name)).is_none_or(|r| r.finished) {
            return Ok(());
        }
        let (r, _) = (self.ring.recover(name)?, self.ring.retire(name.index)?);
        self.workers[i].life = Life::Unfinished;
        let note = format!("{name} exited ({status}) without finishing (a Python target that never called close()?): its {} work item(s) went back to the other targets, and it is not restarted", r.work_returned);
        self.mon.say(&note);
        self.notes.push(note);
        Ok(())
    }

    /// A drafter that exited 0 without finishing its part, which ends only with the ring (closed,
    /// and drained by the group): one that never registered in the ring (a command that is not a
    /// drafter, or exits before `hspipe.connect()`), or that left while the targets were still
    /// publishing and no stop was asked for (a loop that ends early). Such an exit used to count
    /// as done: the batches it left were silently untrained, and with no drafter running the
    /// targets were not stopped. Like an unfinished target it is not restarted (it would do the
    /// same again); what it held is back in the ring already (`left_behind`), for the others.
    fn unfinished_drafter(&mut self, i: usize, status: ExitStatus) {
        let snap = self.ring.snapshot();
        let w = &self.workers[i];
        let why = if !Self::registered(w, &snap) {
            "without registering in the ring (a command that is not an hspipe drafter, or one that exits before hspipe.connect()?)"
        } else if !self.stopping && !snap.closed {
            "while the targets were still publishing (a drafter loop that ends before take() returns None with w.ended?)"
        } else {
            return;
        };
        let note = format!(
            "{} exited ({status}) {why}: it is not restarted, and what it did not train is left to the other drafters; see its log {}",
            w.name(),
            self.run_dir.log(w.name()).display()
        );
        self.workers[i].life = Life::Unfinished;
        self.mon.say(&note);
        self.notes.push(note);
    }

    /// Step 5: starts every worker whose backoff is over (the first start is due at once).
    fn restarts(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        for i in 0..self.workers.len() {
            let w = &self.workers[i];
            let Life::Backoff(at) = w.life else {
                continue;
            };
            if now < at {
                continue;
            }
            // A target waiting for its restart when a stop came is not restarted: targets stop
            // (`down`). It counts as finished, so the ring still closes.
            if self.stopping && w.name.role == Role::Producer {
                let index = w.name.index;
                self.workers[i].life = Life::Stopped;
                self.ring.retire(index)?;
                continue;
            }
            let key = Key {
                name: w.name,
                spawn: w.spawns,
            };
            let started = spawn::spawn(
                key,
                w.gpu,
                &self.run_dir.log(w.name()),
                &self.welcome,
                self.events_tx.clone(),
            );
            let (child, log) = match started {
                Ok(started) => started,
                // A start that fails (its log unwritable on a full disk, its program gone) is
                // a death at start: restarted to the limit, then given up. It used to end the
                // run, every other worker killed mid-step and no summary written.
                Err(e) => {
                    let death = format!("{} could not be started: {e:#}", w.name());
                    let items = w.items_before;
                    self.down(i, death, None, items)?;
                    continue;
                }
            };
            let w = &mut self.workers[i];
            if w.spawns > 0 {
                let line = format!(
                    "{} restarted (restart {}; {} in a row of at most {}), pid {}",
                    w.name(),
                    w.restarts,
                    w.in_a_row,
                    self.args.max_restarts,
                    child.id()
                );
                if w.restart_quietly {
                    self.mon.log_only(&line);
                } else {
                    self.mon.say(&line);
                }
            }
            w.pid = child.id();
            w.spawned = Instant::now();
            w.spawns += 1;
            w.child = Some(child);
            w.log = Some(log);
            w.log_gone_said = false;
            w.life = Life::Running;
        }
        Ok(())
    }

    /// Step 6: the progress bar or lines, and a line of `metrics.jsonl` when one is due.
    fn monitor(&mut self) -> anyhow::Result<()> {
        self.held_deaths(false);
        let restarts: u32 = self.workers.iter().map(|w| w.restarts).sum();
        self.mon.tick(&self.ring, restarts, self.started)
    }

    /// Step 7, once a second: the run directory is still where the run started it
    /// (`place.rs`). Deleted, moved or replaced, nothing more can be saved there, so every
    /// worker is killed at once and the run ends with exit code 1: training on to the end
    /// trained for nothing (see `place.rs`), and a drain would write its checkpoint, export and
    /// ledger lines by path, into whatever is there now (a new run's directory, made since),
    /// or make the path again (a kept export's directory).
    fn place(&mut self) {
        if self.gone.is_some() || self.last_place_check.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_place_check = Instant::now();
        let Some(gone) = self.place.gone() else {
            return;
        };
        self.gone = Some(gone);
        let note = format!(
            "the run directory {} {}: nothing more can be saved there (checkpoints, ledgers, logs, summary.json), so every worker is killed and the run ends",
            self.run_dir.path().display(),
            gone.said()
        );
        self.mon.say(&format!("error: {note}"));
        self.notes.push(note);
        self.stopping = true;
        for w in &mut self.workers {
            if let Some(mut c) = w.child.take() {
                kill_worker(&mut c);
                let _ = c.wait();
            }
            w.life = Life::Stopped;
        }
    }

    /// Step 8, once a second: each worker's log past `--log-cap` is rotated (`log_cap`), after
    /// this pass's deaths have been read from their logs. A rotation that fails (a full disk)
    /// leaves the log as it is, said once per worker until one succeeds. A log deleted or moved
    /// while its worker writes it is rotated all the same, through the launcher's descriptor
    /// of it (it grew without limit, out of `du`'s sight), and that is said once; a `logs/`
    /// deleted with it is made again (`log_cap::make_dir_again`).
    fn logs(&mut self) {
        if self.args.log_cap == 0
            || self.gone.is_some()
            || self.last_log_check.elapsed() < Duration::from_secs(1)
        {
            return;
        }
        self.last_log_check = Instant::now();
        for w in &mut self.workers {
            let Some(live) = &w.log else {
                continue;
            };
            let log = self.run_dir.log(w.name());
            if !w.log_gone_said && log_cap::gone(&log, live) {
                if self.place.gone().is_some() {
                    // The whole directory is: `place` says that at the next pass.
                    self.last_place_check = (Instant::now().checked_sub(Duration::from_secs(1)))
                        .unwrap_or(self.last_place_check);
                    return;
                }
                w.log_gone_said = true;
                // `rm -rf logs/`: made again at once, so that the rotation below and a restart
                // have it (a failure is the rotation's to say).
                let made = match log_cap::make_dir_again(&log) {
                    Ok(true) => "; its directory was gone too, and is made again",
                    _ => "",
                };
                self.mon.say(&format!(
                    "warning: {} was deleted or moved while {} writes it: the worker writes on to the file it opened (out of du's sight if deleted), still kept under --log-cap, its earlier part going to {} at each rotation; its next start makes a new log{made}",
                    log.display(),
                    w.name(),
                    proto::run_dir::rotated(&log).display()
                ));
            }
            match log_cap::rotate_past_cap(&log, live, self.args.log_cap) {
                Ok(_) => w.rotation_failed = false,
                Err(e) if !w.rotation_failed => {
                    w.rotation_failed = true;
                    self.mon.say(&format!(
                        "warning: {} is past --log-cap and could not be rotated: {e}; it grows on",
                        log.display()
                    ));
                }
                Err(_) => {}
            }
        }
    }

    /// At a stop, a worker that has not registered in the ring yet (loading its model, or
    /// stuck before it: a Python worker importing, a GPU that never answers) is killed at once.
    /// It holds no batch and no part of the group, and the stop need not wait for it: before,
    /// such a worker was waited for up to `--start-timeout` and then restarted, the stop taking
    /// up to (`--max-restarts` + 1) x 600 s. It is not restarted (see [`down`](Self::down)).
    fn stop_unstarted(&mut self) {
        let snap = self.ring.snapshot();
        for w in &mut self.workers {
            if w.child.is_none() || Self::registered(w, &snap) {
                continue;
            }
            self.mon.say(&format!(
                "{} (pid {}) has not started (not registered in the ring): stopping it at once",
                w.name(),
                w.pid
            ));
            if let Some(c) = &mut w.child {
                kill_worker(c);
            }
        }
    }

    /// Asks every connected worker to stop in order.
    fn send_stop(&self) {
        for w in &self.workers {
            if let Some(c) = &w.control {
                let _ = c.send(ToWorker::Stop);
            }
        }
    }

    /// The last tick, the exit code, `summary.json`; then the ring and the group go.
    /// Says how many deaths of each worker were held back from the console in a minute now
    /// over (`end`: at the run's end, every one still held).
    fn held_deaths(&mut self, end: bool) {
        let now = Instant::now();
        for w in &mut self.workers {
            if let Some(line) = w.death_lines.held_back(&w.name().to_string(), now, end) {
                self.mon.say(&line);
            }
        }
    }

    fn finish(mut self) -> anyhow::Result<i32> {
        self.held_deaths(true);
        // The leader's last steps and its last checkpoint's report, sent as it drained, may
        // still be on their way: each handshake thread ends once its worker's connection closes,
        // at the worker's exit, so with this end's sender gone the channel closes once every
        // thread has passed on what it read. Bounded: a worker's child may hold its connection.
        self.events_tx = mpsc::channel().0;
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            self.control_events();
            let left = deadline.saturating_duration_since(Instant::now());
            match self
                .events
                .recv_timeout(left.min(Duration::from_millis(20)))
            {
                Ok(ev) => self.control_event(ev),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
        // A row of skipped updates that stopped the run (or that the data ended in) is lost:
        // recorded before the last tick and the summary read it, so its batches count
        // untrained in both. Nothing is written in a run directory gone (`place`): what is at its
        // path now, if anything, is not this run's.
        let lost = self.skipped.lost(self.args.stop_after_skipped);
        if let Some(lost) = lost.filter(|_| self.gone.is_none()) {
            let what = format!("the record of lost steps {}..={}", lost.first, lost.last);
            let mut space = settle::SpaceWait::new(&mut self.mon, &self.signals, what);
            let waiting = &mut |e: &proto::ledger::LedgerError| space.waiting(e);
            let recorded = proto::ledger::record_lost(&self.run_dir, &lost, waiting);
            drop(space);
            if let Err(e) = recorded {
                self.notes.push(format!(
                    "recording {lost} in {} failed ({e}): those batches count as trained",
                    self.run_dir.lost_steps().display()
                ));
            }
        }
        self.mon.finish(&self.ring)?;
        let wall = self.started.elapsed();
        let mut exit_code = exit::OK;
        if self.killed {
            exit_code = exit::KILLED;
        } else if self.gone.is_some() {
            exit_code = exit::ERROR;
        } else if self.stopping && self.signals.received() > 0 {
            exit_code = exit::INTERRUPTED;
        }
        let restarts: HashMap<WorkerName, u32> = (self.workers.iter())
            .map(|w| (w.name(), w.restarts))
            .collect();
        let summary = summary::build(&summary::Facts {
            run_dir: &self.run_dir,
            ring: &self.ring_name,
            backend: &self.backend,
            snap: &self.ring.snapshot(),
            samples_total: self.samples,
            epochs: &self.epochs,
            wall,
            restarts: &restarts,
            drafter: self.mon.group(),
        })?;
        let mut notes = std::mem::take(&mut self.notes);
        notes.extend(self.skipped.at_the_end(self.args.stop_after_skipped));
        // A run that ends without its checkpoint (or export) degrades: see `saves.rs` for why.
        // With its directory gone, they failed for that, said already, and no resume follows.
        if self.gone.is_none() {
            notes.extend((self.saves).at_the_end(&crate::resume::command(self.run_dir.path())));
            // Ranks whose weights drifted apart did not train one model: degraded
            // (`digests.rs`).
            let drift = crate::digests::first_drift(&self.run_dir)
                .context("comparing the ranks' weights digests in the ledgers")?;
            notes.extend(drift.map(|d| d.note()));
        } else {
            notes.push(
                "the counts above are read from the run directory's ledgers, gone with it".into(),
            );
        }
        if exit_code == exit::INTERRUPTED && notes.is_empty() && summary.exactly_once() {
            // The stop came as the data ended, and the drain trained the rest: the run is done
            // (a resume would find nothing to do), not stopped short.
            println!(
                "the stop ({}) came as the data ended: the drain trained every sample, so the run is done",
                self.signals.last_name()
            );
            exit_code = exit::OK;
        }
        // Judged from the ledgers only (summary.rs): what was trained, and what twice.
        // Every sample once in every epoch, or the run is degraded.
        if exit_code == exit::OK && (!notes.is_empty() || !summary.exactly_once()) {
            exit_code = exit::DEGRADED;
            notes.extend(summary.untrained());
        }
        let refused: u64 = (self.workers.iter())
            .filter_map(|w| w.report.as_ref())
            .map(|r| r.refused)
            .sum();
        if refused > 0 {
            notes.push(format!(
                "drafters refused {refused} corrupt batch(es); see their logs"
            ));
        }
        notes.extend(self.saves.not_kept());
        notes.extend(std::mem::take(&mut self.data_notes));
        let summary = summary::finalise(summary, exit_code, notes);
        // The end is printed before summary.json is written: a write that failed (a full or
        // read-only disk) took the end with it, its table, notes and exit code (3, 130) lost
        // behind `error: writing summary.json`, exit code 1. Its last line, the exit code,
        // comes after the write, which may change it: a full run's end said `exit code 0` and
        // the launcher exited 1.
        summary::print(&summary, &self.run_dir, self.gone.is_none());
        let exit_code = match self.gone {
            Some(gone) => {
                println!(
                    "summary.json is not written: the run directory {} {}",
                    self.run_dir.path().display(),
                    gone.said()
                );
                exit_code
            }
            None => {
                crate::resume::sweep_leftovers(&self.run_dir);
                match summary::write(&self.run_dir, &summary) {
                    Ok(()) => exit_code,
                    Err(e) => self.unwritten(&e, exit_code),
                }
            }
        };
        summary::print_exit_code(exit_code);
        Ok(exit_code)
    }

    /// Says that summary.json could not be written (`e`) at the end of a run whose exit code
    /// was `exit_code`; the exit code then: the run's own where it is not 0 (3, 130 and 131 keep
    /// their meaning), and 1 for a run that trained every sample, whose record is incomplete.
    fn unwritten(&self, e: &anyhow::Error, exit_code: i32) -> i32 {
        let dir = self.run_dir.path();
        let end = "the end above is the run's (in launcher.log too, if that can still be written)";
        if exit_code != exit::OK {
            println!(
                "error: {e:#}: summary.json is not written; {end}, and `launcher --resume` needs no summary.json; exit code {exit_code}"
            );
            return exit_code;
        }
        println!(
            "error: {e:#}: summary.json is not written, so the run's record is incomplete: exit code {}, not 0; every sample was trained, as {end}; once {} can be written, `{}` finds every batch trained and writes it",
            exit::ERROR,
            dir.display(),
            crate::resume::command(dir)
        );
        exit::ERROR
    }
}
