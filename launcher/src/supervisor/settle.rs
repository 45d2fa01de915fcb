//! How a dead worker's batches are settled instead of going back for another try: a drafter's
//! retired when the group applied its update before the death (its ledger line written for it),
//! and on either side a poison batch set aside.
//!
//! Retiring: the line is written (and synced) while the group removes the dead rank, before the
//! removal takes effect ([`collective::Collective::remove_settling`]): until then no round after
//! the dead rank's last can commit, so no checkpoint holds the batch's update. A launcher killed
//! at any point after leaves the line for `--resume`, which counts the batch trained once it is
//! in the checkpoint resumed from. The ring's settling that follows only frees the slot.
//!
//! Poison batches: a batch that kills whoever computes it would otherwise go back after every
//! death (a drafter's to the ring, a target's work item to the work table) and kill the next
//! worker to take it, until that side's workers are given up in a row and the run ends. Each
//! worker says which batch it is computing on (`set_in_hand`: a drafter around its gradient, a
//! target around its forward); the supervisor holds a death against that batch when the death
//! is the worker's own doing (an error exit; a signal it raised, such as SIGABRT or SIGSEGV) or
//! a hang it killed, never a signal from outside (SIGKILL from the OOM killer or a person, a stop
//! signal): those say nothing about the batch. At `--set-aside-after` deaths the batch is set
//! aside (a drafter's by `Ring::recover_settling`, a target's by
//! `Ring::recover_setting_aside_work`, so it is never published): written to `set-aside.jsonl`
//! with the deaths, its samples untrained (the run ends degraded; `--resume` tries them again).
//!
//! Two rules keep an innocent batch from being set aside:
//! - Only the batch in hand is struck, not every batch the worker held: a drafter holds two
//!   (this step's and the next one's, prefetched), a target up to four (one or two on the
//!   device, one gathered, one being gathered), and those beside a poison batch go back at each
//!   of its deaths too.
//! - The deaths must show that the batch, not the workers, is at fault: that side finished some
//!   other batch (trained one; published one) between the first death held against it and the
//!   last; or they are all one worker's, which had finished one since its start before the
//!   first (a lone drafter that trained, then dies on this batch at each restart); or two
//!   workers or more died on it having each finished one since its start (targets that meet a
//!   poison batch last, when nothing else is left to publish). Workers that cannot compute at
//!   all (a bad GPU, a bug on every batch) finish nothing between their deaths, and the batch
//!   one died on comes back to it (one drafter, or FIFO; a target claims returned items in
//!   table order once the fresh ones are out): that is one worker's `--max-restarts` crash
//!   loop, and sets nothing aside, even while other workers finish batches around it. A
//!   set-aside never ends a worker's restarts in a row either.
//!
//! What stays indistinguishable: one worker whose GPU breaks after it worked, taking the same
//! batch again at each restart, looks like that batch killing it (and so do two, if the second
//! breaks in the same way just as it takes the batch the first died on); the batch is set aside
//! and the workers given up at their next deaths, and `--resume` tries the batch again. So does
//! a batch passed between two workers that cannot compute at all while a third finishes
//! batches around them: from the deaths alone it is a poison batch killing fresh incarnations.
//!
//! Length: the policy, its strikes and the recovery that applies them stay together.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Instant;

use collective::Committed;
use proto::ledger::{LedgerError, SetAsideLine};
use proto::RunDir;
use shm_ring::{Recovered, Ring, Role, Settle, WorkerName};

use super::Supervisor;
use crate::monitor::Monitor;
use crate::signals::StopSignals;

/// A death held against the batch a worker had in hand.
pub(super) struct Struck {
    pub(super) batch: u64,
    /// The launcher's line for the death.
    pub(super) line: String,
    pub(super) worker: WorkerName,
    /// The dying incarnation had finished a batch: it can compute, so the batch is suspect.
    pub(super) after_work: bool,
    /// Batches its side had finished in the run at its death (the ring's count of publications
    /// for a target, of releases for a drafter).
    pub(super) finished: u64,
}

/// What the deaths held against a batch decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Fewer than the limit.
    Counting,
    /// Enough, and evidence against the batch: set it aside.
    SetAside,
    /// Enough, but nothing finished around it: the workers may be at fault.
    NoEvidence,
    /// Set aside already: a death that came before, recovered after.
    SetAsideAlready,
}

/// Batches with deaths held against them that are remembered at most: past it, the batch first
/// struck longest ago is forgotten. A worker that dies after some work each time is never given
/// up (its restarts in a row start again), and each death is held against another batch: the
/// launcher grew by 0.8 KB a restart in such a loop (370 MB a week at one every 1.3 s), for
/// batches long trained.
/// A poison batch is delivered again within seconds of its death, so its strikes are recent.
pub(super) const REMEMBERED: usize = 4096;

/// The deaths held against each batch, and the count that sets one aside.
pub(super) struct Strikes {
    /// `--set-aside-after`: 0 never sets a batch aside.
    limit: u32,
    /// By the side that died on it (a target's work item and a drafter's batch of the same
    /// number are one planned batch at two stages) and batch: when it was first struck (a
    /// count of strikes) and its deaths.
    deaths: HashMap<(Role, u64), (u64, Vec<Struck>)>,
    /// Strikes so far.
    struck: u64,
    /// Set aside, by side: nothing more is held against them.
    set_aside: HashSet<(Role, u64)>,
}

impl Strikes {
    pub(super) fn new(limit: u32) -> Strikes {
        Strikes {
            limit,
            deaths: HashMap::new(),
            struck: 0,
            set_aside: HashSet::new(),
        }
    }

    /// Whether a worker's death is held against the batch it had in hand: it failed by itself
    /// (an error exit, a signal a process raises on itself) or hung (`hung`: the supervisor
    /// killed it for silence); not a signal from outside (SIGKILL, a stop signal, or the exit
    /// code a shell gives for one: 128 + SIGHUP, SIGINT, SIGQUIT, SIGKILL, SIGTERM).
    pub(super) fn counts(status: ExitStatus, hung: bool) -> bool {
        use rustix::process::Signal;
        if hung {
            return true;
        }
        if let Some(code) = status.code() {
            return !matches!(code, 0 | 129 | 130 | 131 | 137 | 143);
        }
        let own = [
            Signal::ABORT,
            Signal::SEGV,
            Signal::BUS,
            Signal::ILL,
            Signal::FPE,
            Signal::TRAP,
            Signal::SYS,
        ];
        (status.signal()).is_some_and(|sig| own.iter().any(|s| s.as_raw() == sig))
    }

    /// Holds a death against its batch. Returns the deaths held against it so far, and whether
    /// they set it aside: at least the limit, and evidence against the batch (the module's doc)
    /// (call [`Strikes::settled`] once it is set aside).
    pub(super) fn strike(&mut self, death: Struck) -> (usize, Verdict) {
        let key = (death.worker.role, death.batch);
        if self.set_aside.contains(&key) {
            return (0, Verdict::SetAsideAlready);
        }
        self.struck += 1;
        if !self.deaths.contains_key(&key) && self.deaths.len() >= REMEMBERED {
            let oldest = (self.deaths.iter()).min_by_key(|(_, (first, _))| *first);
            if let Some(&oldest) = oldest.map(|(k, _)| k) {
                self.deaths.remove(&oldest);
            }
        }
        let (_, deaths) = (self.deaths.entry(key)).or_insert_with(|| (self.struck, Vec::new()));
        deaths.push(death);
        let (first, last) = (&deaths[0], &deaths[deaths.len() - 1]);
        let around = last.finished > first.finished;
        let one_worker = deaths.iter().all(|d| d.worker == first.worker);
        // One worker that finishes nothing since its start, taking the same batch at each
        // restart, is a crash loop however much the others finish around it.
        let crash_loop = one_worker && !deaths.iter().any(|d| d.after_work);
        let lone = first.after_work && one_worker;
        let mut worked: Vec<WorkerName> = (deaths.iter())
            .filter_map(|d| d.after_work.then_some(d.worker))
            .collect();
        worked.sort();
        worked.dedup();
        let others_too = worked.len() >= 2;
        let verdict = if self.limit == 0 || deaths.len() < self.limit as usize {
            Verdict::Counting
        } else if !crash_loop && (around || lone || others_too) {
            Verdict::SetAside
        } else {
            Verdict::NoEvidence
        };
        (deaths.len(), verdict)
    }

    /// The lines of the deaths `role`'s workers died with `batch` in hand.
    pub(super) fn lines(&self, role: Role, batch: u64) -> Vec<String> {
        let deaths = (self.deaths.get(&(role, batch))).map_or(&[][..], |(_, d)| d.as_slice());
        deaths.iter().map(|d| d.line.clone()).collect()
    }

    /// Batches with deaths held against them now.
    #[cfg(test)]
    pub(super) fn remembered(&self) -> usize {
        self.deaths.len()
    }

    /// The batch is set aside by `role`'s side: nothing more is held against it there.
    pub(super) fn settled(&mut self, role: Role, batch: u64) {
        self.deaths.remove(&(role, batch));
        self.set_aside.insert((role, batch));
    }
}

/// What a recovery settled, for the death's line: the batch in hand and its deaths so far (to
/// append to the line), and the lines that say how batches were settled (said after it).
#[derive(Default)]
pub(super) struct Settled {
    pub(super) in_hand: Option<String>,
    pub(super) lines: Vec<String>,
}

impl Supervisor<'_> {
    /// Restores the ring's invariants after worker `i` died. A drafter leaves the group first:
    /// survivors blocked in the reduction go on without it, and we learn whether its last
    /// batch is in an applied update: if it still holds that batch, its ledger line is written
    /// before the survivors go on, and it is retired, not redelivered. The death (`struck`: the
    /// batch it had in hand, unless that is the applied one) is held against that batch, which
    /// is set aside once enough deaths are (see the module's doc). Returns what was recovered,
    /// and what to say of the settled batches.
    pub(super) fn recover(
        &mut self,
        i: usize,
        struck: Option<Struck>,
    ) -> anyhow::Result<(Recovered, Settled)> {
        let w = &self.workers[i];
        let (name, index) = (w.name(), w.name.index);
        if w.name.role == Role::Producer {
            return self.recover_target(name, struck);
        }
        // Its lines made durable first: once it is removed the group goes on, and the next
        // checkpoint may hold their updates.
        if let Err(e) = proto::ledger::sync_dead(&self.run_dir, index) {
            self.mon.say(&format!("warning: {name}'s ledger: {e}"));
        }
        // The batch of an applied update gets its line while the dead rank is still a member:
        // until the removal, no round after its last can commit, so no checkpoint holds that
        // update. Written after, a launcher killed in between left the batch with no line in a
        // checkpoint that holds it, and `--resume` trained it a second time.
        let (ring, run_dir) = (&self.ring, &self.run_dir);
        let mut space = SpaceWait::new(&mut self.mon, &self.signals, written_for(name));
        let mut recorded: Option<anyhow::Result<bool>> = None;
        let gone = (self.group).remove_settling(index, &mut |c| {
            if !matches!(recorded, Some(Ok(_))) {
                recorded = Some(record_applied(ring, run_dir, name, index, c, &mut space));
            }
        })?;
        drop(space);
        let committed = gone.committed.map(|c| (c.batch, c.step));
        pause_after_removal(committed);
        let mut settle = Vec::new();
        if let Some((batch, _)) = committed {
            settle.push((batch, Settle::Retire));
        }
        let mut out = Settled::default();
        // The batch in hand, unless it is the applied one (a Python rank holds it until its
        // release, after the update).
        let struck = struck.filter(|s| committed.is_none_or(|(b, _)| b != s.batch));
        let mut setting_aside = None;
        if let Some(s) = struck {
            (out.in_hand, setting_aside) = self.judge(s);
        }
        if let Some((batch, _)) = setting_aside {
            settle.push((batch, Settle::SetAside));
        }
        if settle.is_empty() {
            return Ok((self.ring.recover(name)?, out));
        }
        let (run_dir, strikes) = (&self.run_dir, &self.strikes);
        let mut space = SpaceWait::new(&mut self.mon, &self.signals, written_for(name));
        let (mut retired, mut set_aside) = (None, None);
        let r = (self.ring).recover_settling(name, &settle, |how, meta, payload| match how {
            // Written before the removal (`record_applied`); tried again here if it was not (a
            // line already there is not written twice).
            Settle::Retire => {
                let step = committed.map_or(0, |(_, step)| u64::from(step));
                retired = Some(match &recorded {
                    Some(Ok(true)) => Ok(true),
                    _ => {
                        let waiting = &mut |e: &LedgerError| space.waiting(e);
                        proto::ledger::record_retired(run_dir, index, meta, payload, step, waiting)
                            .map_err(anyhow::Error::from)
                    }
                });
            }
            Settle::SetAside => {
                let deaths = strikes.lines(Role::Consumer, meta.batch_id);
                set_aside = Some(SetAsideLine::of_slot(meta, payload, &deaths));
            }
        })?;
        drop(space);
        if let (Some(wrote), Some((batch, step))) = (retired, committed) {
            let how = match wrote {
                Ok(true) => "its ledger line written for it".to_string(),
                Ok(false) => "its ledger line was already written".into(),
                Err(e) => format!("its ledger line could not be written: {e:#}"),
            };
            out.lines.push(format!(
                "{name} died holding batch {batch}, whose update the group applied at step {step}: retired, not redelivered ({how})"
            ));
        }
        if let Some((batch, n)) = setting_aside {
            match set_aside {
                Some(line) => {
                    let note = self.set_aside(Role::Consumer, batch, n, line.map_err(Into::into));
                    out.lines.push(note);
                }
                // Given back and taken by a live drafter before this recovery: that one's now.
                None => out.in_hand = Some(not_set_aside(batch, n, "another drafter has it now")),
            }
        }
        Ok((r, out))
    }

    /// Drafter `i` exited cleanly (`status`): it leaves the group, and batches it still held (a
    /// Python rank's batch whose group round it left undecided) are recovered as a dead
    /// drafter's are: retired if the group applied their update, else delivered again.
    pub(super) fn left_behind(&mut self, i: usize, status: ExitStatus) -> anyhow::Result<()> {
        let name = self.workers[i].name();
        if self.ring.held_by(name)? == 0 {
            self.group.remove(name.index)?;
            return Ok(());
        }
        let (r, settled) = self.recover(i, None)?;
        self.mon
            .say(&format!("{name} exited ({status}) holding batches; {r}"));
        for line in settled.lines {
            self.mon.say(&line);
        }
        Ok(())
    }

    /// [`Supervisor::recover`] for a target: the work item it had in hand is set aside once
    /// enough deaths are held against it (never claimed again, so never published); the rest
    /// of what it held goes back to the work table.
    fn recover_target(
        &mut self,
        name: WorkerName,
        struck: Option<Struck>,
    ) -> anyhow::Result<(Recovered, Settled)> {
        let mut out = Settled::default();
        let Some(s) = struck else {
            return Ok((self.ring.recover(name)?, out));
        };
        let (in_hand, judged) = self.judge(s);
        out.in_hand = in_hand;
        let Some((batch, n)) = judged else {
            return Ok((self.ring.recover(name)?, out));
        };
        let r = self.ring.recover_setting_aside_work(name, &[batch])?;
        if r.work_set_aside == 0 {
            let why = "it no longer held it: given back, another target's, or published";
            out.in_hand = Some(not_set_aside(batch, n, why));
            return Ok((r, out));
        }
        let deaths = self.strikes.lines(Role::Producer, batch);
        let line = (self.planned.get(batch as usize))
            .map(|p| SetAsideLine::of_plan(batch, p, &deaths))
            .ok_or_else(|| anyhow::anyhow!("batch {batch} is not in the run's plan"));
        out.lines
            .push(self.set_aside(Role::Producer, batch, n, line));
        Ok((r, out))
    }

    /// Holds death `s` against the batch in hand: what to say of it on the death's line, and
    /// the batch and its count of deaths if they now set it aside (see the module's doc).
    fn judge(&mut self, s: Struck) -> (Option<String>, Option<(u64, usize)>) {
        let (batch, role) = (s.batch, s.worker.role);
        let (n, verdict) = self.strikes.strike(s);
        let limit = self.args.set_aside_after;
        let (finished, side) = match role {
            Role::Producer => ("published", "targets"),
            Role::Consumer => ("trained", "drafters"),
        };
        match verdict {
            _ if limit == 0 => (None, None),
            Verdict::Counting => (
                Some(format!(
                    "batch {batch} in hand (death {n} held against it; {limit} set it aside)"
                )),
                None,
            ),
            Verdict::NoEvidence => (
                Some(format!(
                    "batch {batch} in hand (death {n} held against it, but no other batch was {finished} since the first: the {side} may be at fault, not set aside)"
                )),
                None,
            ),
            Verdict::SetAside => (
                Some(format!("batch {batch} in hand (death {n} held against it)")),
                Some((batch, n)),
            ),
            Verdict::SetAsideAlready => (Some(format!("batch {batch} in hand (set aside already)")), None),
        }
    }

    /// `role`'s side set `batch` aside at its `n`-th death: its record (`line`) is appended to
    /// `set-aside.jsonl` and nothing more is held against it. Returns the note that says so,
    /// also kept for the summary.
    fn set_aside(
        &mut self,
        role: Role,
        batch: u64,
        n: usize,
        line: anyhow::Result<SetAsideLine>,
    ) -> String {
        self.strikes.settled(role, batch);
        let what = format!("batch {batch}'s line in set-aside.jsonl");
        let mut space = SpaceWait::new(&mut self.mon, &self.signals, what);
        let wrote = line.and_then(|l| {
            let waiting = &mut |e: &LedgerError| space.waiting(e);
            proto::ledger::record_set_aside(&self.run_dir, &l, waiting)?;
            Ok(l)
        });
        drop(space);
        let what = match wrote {
            Ok(line) => format!(
                "its {} sample(s) left untrained, listed in {}",
                line.sample_ids.len(),
                self.run_dir.set_aside().display()
            ),
            Err(e) => format!("its record could not be written: {e:#}"),
        };
        let note = format!(
            "batch {batch} set aside: in hand at {n} {} death(s) (--set-aside-after); {what}",
            role.name()
        );
        self.notes.push(note.clone());
        note
    }
}

/// Writes the ledger line of batch `c.batch`, whose update the group applied at `c.step`, for
/// dead drafter `name` (ledger `index`) if it still holds the batch, from the batch in its slot;
/// one it released has its own line (a rank releases a batch only after writing it). Returns
/// whether a line was added. The slot stays held for the settling that retires it.
fn record_applied(
    ring: &Ring,
    run_dir: &RunDir,
    name: WorkerName,
    index: u32,
    c: Committed,
    space: &mut SpaceWait<'_>,
) -> anyhow::Result<bool> {
    let mut wrote = Ok(false);
    ring.read_held(name, c.batch, |meta, payload| {
        let step = u64::from(c.step);
        let waiting = &mut |e: &LedgerError| space.waiting(e);
        wrote = proto::ledger::record_retired(run_dir, index, meta, payload, step, waiting);
    })?;
    Ok(wrote?)
}

/// The launcher's wait for space to write a line on a full disk (a dead drafter's ledger line,
/// `proto::ledger::record_retired`; a batch set aside; the lost steps of a group that
/// diverged), as a drafter waits for its own: said once, with the file, and once more when the
/// wait ends. The launcher waits in place (for a dead drafter's line, the group waits for the
/// removal meanwhile, its ranks beating): until space comes back, or a second stop signal,
/// which kills the run (the first stops it in order, and the ordered stop needs the line).
pub(super) struct SpaceWait<'s> {
    mon: &'s mut Monitor,
    signals: &'s StopSignals,
    /// The line waited for, said: `drafter-1's ledger line, written for it`.
    what: String,
    since: Option<Instant>,
}

impl<'s> SpaceWait<'s> {
    pub(super) fn new(mon: &'s mut Monitor, signals: &'s StopSignals, what: String) -> Self {
        SpaceWait {
            mon,
            signals,
            what,
            since: None,
        }
    }

    /// After a try that failed for a full disk (`e`): whether to go on waiting.
    pub(super) fn waiting(&mut self, e: &LedgerError) -> bool {
        if self.since.is_none() {
            self.since = Some(Instant::now());
            self.mon.say(&format!(
                "{}: {e}; waiting for space (a second stop signal ends the wait)",
                self.what
            ));
        }
        self.signals.received() < 2
    }
}

impl Drop for SpaceWait<'_> {
    /// Says the end of a wait.
    fn drop(&mut self) {
        if let Some(since) = self.since {
            let waited = since.elapsed().as_secs_f64();
            self.mon.say(&format!(
                "{}: the wait for space ended after {waited:.1}s",
                self.what
            ));
        }
    }
}

/// What a [`SpaceWait`] for dead drafter `name`'s ledger line waits for, said.
fn written_for(name: WorkerName) -> String {
    format!("{name}'s ledger line, written for it")
}

/// The tests' pause point between a dead drafter's removal from the group and the settling of
/// its batches in the ring: with `HSPIPE_TEST_PAUSE_AFTER_REMOVAL=FILE` in its environment
/// (never set in a real run), the launcher writes FILE (`<batch> <step>`: the dead rank's batch
/// the removal said is in an applied update, or `-` for none) and waits while FILE exists, so
/// a test can kill it there. The group goes on meanwhile, and its checkpoints may hold that
/// update: nothing a resume needs may be left to the settling after this point.
fn pause_after_removal(committed: Option<(u64, u32)>) {
    let Some(file) = std::env::var_os("HSPIPE_TEST_PAUSE_AFTER_REMOVAL") else {
        return;
    };
    let said = committed.map_or_else(|| "-".to_string(), |(b, s)| format!("{b} {s}"));
    if std::fs::write(&file, format!("{said}\n")).is_err() {
        return;
    }
    while std::path::Path::new(&file).exists() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The death line's words for a batch the deaths set aside but the recovery could not (`why`).
fn not_set_aside(batch: u64, n: usize, why: &str) -> String {
    format!("batch {batch} in hand (death {n} held against it; not set aside: {why})")
}

#[cfg(test)]
mod tests;
