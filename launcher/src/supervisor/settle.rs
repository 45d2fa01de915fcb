//! How a dead drafter's batches are settled instead of being delivered again: retired when the
//! group applied its update before the death (its ledger line written for it), or set aside as
//! a poison batch.
//!
//! Poison batches: a batch that kills whoever trains it would otherwise be redelivered after
//! every death until the drafters are given up in a row, ending the run. Each drafter says which
//! batch it is computing on (`Consumer::set_in_hand`); the supervisor holds a death against that
//! batch when the death is the drafter's own doing (an error exit; a signal it raised, such as
//! SIGABRT or SIGSEGV) or a hang it killed, never a signal from outside (SIGKILL from the OOM
//! killer or a person, a stop signal): those say nothing about the batch. At `--set-aside-after`
//! deaths the batch is set aside (`Ring::recover_settling`): written to `set-aside.jsonl` with
//! the deaths, never delivered again, its samples untrained (the run ends degraded; `--resume`
//! tries them again).
//!
//! Two rules keep an innocent batch from being set aside:
//! - Only the batch in hand is struck, not the ring's delivery count: a drafter holds two
//!   batches (this step's and the next one's, prefetched), and one waiting beside a poison
//!   batch is delivered again at each of its deaths too.
//! - The deaths must show that the batch, not the drafters, is at fault: some other batch was
//!   trained between the first death held against it and the last (training goes on around
//!   it), or they are all one drafter's and it had trained before the first (a lone drafter
//!   that dies on this batch and worked before). Drafters that cannot train at all (a bad GPU,
//!   a bug on every batch) train nothing between their deaths, and with one drafter, or FIFO,
//!   the batch they died on comes back to them: that is `--max-restarts`'s crash loop, and sets
//!   nothing aside. A set-aside never ends a worker's restarts in a row either.
//!
//! What stays indistinguishable: one drafter whose GPU breaks after it trained, taking the same
//! batch again at each restart (FIFO), looks like that batch killing it; the batch is set aside
//! and the drafter given up at its next death, and `--resume` tries the batch again.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use shm_ring::{Recovered, Role, Settle};

use super::Supervisor;

/// A death held against the batch a drafter had in hand.
pub(super) struct Struck {
    pub(super) batch: u64,
    /// The launcher's line for the death.
    pub(super) line: String,
    pub(super) drafter: u32,
    /// The dying incarnation had trained a batch: it can train, so the batch is suspect.
    pub(super) after_work: bool,
    /// Batches trained in the run at its death (the ring's count of releases).
    pub(super) trained: u64,
}

/// What the deaths held against a batch decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Fewer than the limit.
    Counting,
    /// Enough, and evidence against the batch: set it aside.
    SetAside,
    /// Enough, but nothing trained around it: the drafters may be at fault.
    NoEvidence,
}

/// The deaths held against each batch, and the count that sets one aside.
pub(super) struct Strikes {
    /// `--set-aside-after`: 0 never sets a batch aside.
    limit: u32,
    deaths: HashMap<u64, Vec<Struck>>,
}

impl Strikes {
    pub(super) fn new(limit: u32) -> Strikes {
        Strikes {
            limit,
            deaths: HashMap::new(),
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
        let deaths = self.deaths.entry(death.batch).or_default();
        deaths.push(death);
        let (first, last) = (&deaths[0], &deaths[deaths.len() - 1]);
        let around = last.trained > first.trained;
        let lone = first.after_work && deaths.iter().all(|d| d.drafter == first.drafter);
        let verdict = if self.limit == 0 || deaths.len() < self.limit as usize {
            Verdict::Counting
        } else if around || lone {
            Verdict::SetAside
        } else {
            Verdict::NoEvidence
        };
        (deaths.len(), verdict)
    }

    /// The lines of the deaths held against `batch`.
    pub(super) fn lines(&self, batch: u64) -> Vec<String> {
        let deaths = self.deaths.get(&batch).map_or(&[][..], Vec::as_slice);
        deaths.iter().map(|d| d.line.clone()).collect()
    }

    /// The batch is set aside: nothing more is held against it.
    pub(super) fn settled(&mut self, batch: u64) {
        self.deaths.remove(&batch);
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
    /// batch is in an applied update: if it still holds that batch, it is retired, not
    /// redelivered. The death (`struck`: the batch it had in hand, unless that is the applied
    /// one) is held against that batch, which is set aside once enough deaths are (see the
    /// module's doc). Returns what was recovered, and what to say of the settled batches.
    pub(super) fn recover(
        &mut self,
        i: usize,
        struck: Option<Struck>,
    ) -> anyhow::Result<(Recovered, Settled)> {
        let w = &self.workers[i];
        let (name, index) = (w.name(), w.name.index);
        let committed = if w.name.role == Role::Consumer {
            let gone = self.group.remove(index)?;
            gone.committed_batch.map(|b| (b, gone.membership.step))
        } else {
            None
        };
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
            let batch = s.batch;
            let (n, verdict) = self.strikes.strike(s);
            let limit = self.args.set_aside_after;
            out.in_hand = match verdict {
                _ if limit == 0 => None,
                Verdict::Counting => Some(format!(
                    "batch {batch} in hand (death {n} held against it; {limit} set it aside)"
                )),
                Verdict::NoEvidence => Some(format!(
                    "batch {batch} in hand (death {n} held against it, but no other batch was trained since the first: the drafters may be at fault, not set aside)"
                )),
                Verdict::SetAside => {
                    settle.push((batch, Settle::SetAside));
                    setting_aside = Some((batch, n));
                    None
                }
            };
        }
        if settle.is_empty() {
            return Ok((self.ring.recover(name)?, out));
        }
        let (run_dir, strikes) = (&self.run_dir, &self.strikes);
        let (mut retired, mut set_aside) = (None, None);
        let r = (self.ring).recover_settling(name, &settle, |how, meta, payload| match how {
            Settle::Retire => {
                let step = committed.map_or(0, |(_, step)| u64::from(step));
                retired = Some(proto::ledger::record_retired(
                    run_dir, index, meta, payload, step,
                ));
            }
            Settle::SetAside => {
                let deaths = strikes.lines(meta.batch_id);
                set_aside = Some((
                    meta.batch_id,
                    deaths.len(),
                    proto::ledger::record_set_aside(run_dir, meta, payload, &deaths),
                ));
            }
        })?;
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
        if let (Some((batch, n)), None) = (setting_aside, &set_aside) {
            // Given back and taken by a live drafter before this recovery: that drafter's now.
            out.in_hand = Some(format!(
                "batch {batch} in hand (death {n} held against it; not set aside: another drafter has it now)"
            ));
        }
        if let Some((batch, n, wrote)) = set_aside {
            self.strikes.settled(batch);
            let what = match wrote {
                Ok(line) => format!(
                    "its {} sample(s) left untrained, listed in {}",
                    line.sample_ids.len(),
                    self.run_dir.set_aside().display()
                ),
                Err(e) => format!("its record could not be written: {e:#}"),
            };
            let note = format!(
                "batch {batch} set aside: in hand at {n} drafter death(s) (--set-aside-after); {what}"
            );
            self.notes.push(note.clone());
            out.lines.push(note);
        }
        Ok((r, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signalled(sig: rustix::process::Signal) -> ExitStatus {
        ExitStatus::from_raw(sig.as_raw())
    }

    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    #[test]
    fn a_workers_own_failure_or_hang_counts_a_signal_from_outside_does_not() {
        use rustix::process::Signal;
        assert!(Strikes::counts(exited(1), false), "an error");
        assert!(
            Strikes::counts(exited(134), false),
            "an abort, through a shell"
        );
        assert!(
            Strikes::counts(signalled(Signal::ABORT), false),
            "a panic's abort"
        );
        assert!(Strikes::counts(signalled(Signal::SEGV), false));
        assert!(
            !Strikes::counts(signalled(Signal::KILL), false),
            "the OOM killer, a person"
        );
        assert!(
            !Strikes::counts(exited(137), false),
            "the same, through a shell"
        );
        assert!(
            Strikes::counts(signalled(Signal::KILL), true),
            "ours, for a hang"
        );
        assert!(
            !Strikes::counts(signalled(Signal::INT), false),
            "Ctrl-C in Python"
        );
        assert!(!Strikes::counts(signalled(Signal::TERM), false));
        assert!(
            !Strikes::counts(exited(130), false),
            "a shell's code for SIGINT"
        );
    }

    /// A death against batch `batch` by `drafter`, after it trained or not, with `trained`
    /// batches trained in the run.
    fn death(batch: u64, drafter: u32, after_work: bool, trained: u64) -> Struck {
        Struck {
            batch,
            line: format!("drafter-{drafter} died"),
            drafter,
            after_work,
            trained,
        }
    }

    #[test]
    fn a_batch_is_set_aside_at_the_limit_while_others_train_and_never_at_0() {
        use Verdict::*;
        let mut s = Strikes::new(3);
        assert_eq!(s.strike(death(7, 0, false, 10)), (1, Counting));
        assert_eq!(
            s.strike(death(8, 1, false, 10)),
            (1, Counting),
            "another batch apart"
        );
        assert_eq!(s.strike(death(7, 1, false, 12)), (2, Counting));
        assert_eq!(
            s.strike(death(7, 2, false, 14)),
            (3, SetAside),
            "others trained around it"
        );
        assert_eq!(s.lines(7).len(), 3);
        s.settled(7);
        assert_eq!(
            s.strike(death(7, 0, false, 20)),
            (1, Counting),
            "settled: counted afresh"
        );
        let mut never = Strikes::new(0);
        assert!((0..10).all(|i| never.strike(death(1, i % 3, true, i.into())).1 == Counting));
    }

    #[test]
    fn drafters_that_train_nothing_set_nothing_aside_a_lone_drafter_that_trained_does() {
        use Verdict::*;
        // One drafter dying at its first batch, the same batch each time (FIFO).
        let mut s = Strikes::new(3);
        assert_eq!(s.strike(death(7, 0, false, 0)), (1, Counting));
        assert_eq!(s.strike(death(7, 0, false, 0)), (2, Counting));
        assert_eq!(s.strike(death(7, 0, false, 0)), (3, NoEvidence));
        // Three drafters all failing on every batch: nothing trained between their deaths.
        let mut s = Strikes::new(3);
        for (n, d) in [(1, Counting), (2, Counting), (3, NoEvidence)]
            .into_iter()
            .zip(0..)
        {
            assert_eq!(s.strike(death(7, d, d == 0, 5)), n, "drafter {d}");
        }
        // A lone drafter that trained, then dies on it at each restart.
        let mut s = Strikes::new(3);
        assert_eq!(s.strike(death(7, 0, true, 13)), (1, Counting));
        assert_eq!(s.strike(death(7, 0, false, 13)), (2, Counting));
        assert_eq!(s.strike(death(7, 0, false, 13)), (3, SetAside));
    }
}
