//! Batches a Python drafter dropped without `release()` (an exception, a forgotten call), and
//! what becomes of each: it depends on whether the group applied its update.
//!
//! - Applied (a committed round named it): it was trained, on every member. It gets its ledger
//!   line at that round's step (no digest, as the launcher writes for a dead rank's applied
//!   batch) and is released: never delivered again, so no live rank trains it twice.
//! - Not applied: it goes back to the ring untrained, READY for redelivery, as if this rank had
//!   died holding it (`ReadSlot::requeue`).
//! - Undecided: its round was interrupted after this rank contributed it (a KeyboardInterrupt
//!   in `all_reduce`). The others may still commit it. It stays held until that is known: the
//!   round commits (applied), or the membership moves on first (not applied: the round is
//!   contributed again without it). A new `all_reduce` first waits for that, so it never
//!   replaces a contribution the others may be summing. A process that ends with it undecided
//!   leaves it held, for the launcher, which knows from the group whether it was applied.
//!
//! A batch is settled only once its views are gone (a slot is never reused while one lives),
//! at the drafter's next call. One let go of on another thread is first brought back to the
//! drafter's thread (`local`), at its next call too. When the drafter itself goes (the interpreter finishing, or the
//! worker and every batch of it let go) every batch it still keeps is settled then, views or
//! not: a view kept past its worker may see its slot reused, so keep the worker while you keep
//! views.

use std::sync::Arc;

use proto::BatchHeader;
use pyo3::prelude::*;
use shm_ring::{ReadSlot, RingError};

use crate::common::err;
use crate::drafter::DrafterCore;
use crate::view::Exports;

/// A batch dropped without `release()`, kept until it is settled.
pub struct Dropped {
    slot: ReadSlot<'static>,
    exports: Arc<Exports>,
    header: BatchHeader,
}

/// A round this rank contributed to and left undecided (interrupted).
#[derive(Clone, Debug, PartialEq)]
pub struct Pending {
    /// The batch it holds that the round trains, if it still held it.
    pub batch: Option<u64>,
    /// The batch id the contribution named.
    pub sent: Option<u64>,
    /// The step the round commits as, and the epoch of the contribution.
    pub step: u64,
    pub epoch: u16,
    /// The contribution: a call that finishes the round must make the same.
    pub data: Vec<f32>,
}

/// Whether the group applied a held or dropped batch's update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// In the update of this step.
    Applied(u64),
    NotApplied,
    /// Its round may still commit.
    Undecided,
}

impl DrafterCore {
    /// A batch dropped without `release()`: kept until its views are gone, then settled.
    pub(crate) fn dropped(
        &self,
        slot: ReadSlot<'static>,
        exports: Arc<Exports>,
        header: BatchHeader,
    ) {
        (self.deferred.borrow_mut()).push(Dropped {
            slot,
            exports,
            header,
        });
        self.sweep();
    }

    /// Settles the dropped batches whose views are all gone and whose fate is known, those
    /// other threads let go of first (`local`).
    pub(crate) fn sweep(&self) {
        crate::local::bring_home();
        let mut i = 0;
        loop {
            let mut deferred = self.deferred.borrow_mut();
            let Some(d) = deferred.get(i) else { break };
            let fate = self.fate(d.slot.meta().batch_id);
            if fate == Fate::Undecided || d.exports.try_close().is_err() {
                i += 1;
                continue;
            }
            let d = deferred.swap_remove(i);
            drop(deferred);
            self.settle(d, fate);
        }
    }

    /// Dropped batches kept only while views of them live (not those whose round is
    /// undecided: this rank cannot settle them).
    pub(crate) fn kept_for_views(&self) -> usize {
        let deferred = self.deferred.borrow();
        let undecided = |d: &&Dropped| self.fate(d.slot.meta().batch_id) == Fate::Undecided;
        deferred.len() - deferred.iter().filter(undecided).count()
    }

    /// `take()`'s error `e`, saying why when this rank holds as many batches as it may (one,
    /// for a Python rank): those taken and not released, by id, and those dropped without
    /// `release()` that are kept.
    pub(crate) fn refused_take(&self, e: RingError) -> PyErr {
        if !matches!(e, RingError::TooManyHeld { .. }) {
            return err(e);
        }
        let taken = self.taken.borrow();
        let kept = self.deferred.borrow().len();
        let mut why = Vec::new();
        match taken.as_slice() {
            [] => {}
            [b] => why.push(format!(
                "batch {b} was taken and not released: call its release() (after the update \
                 that used it) before the next take()"
            )),
            bs => why.push(format!(
                "batches {bs:?} were taken and not released: call their release() (after the \
                 update that used each) before the next take()"
            )),
        }
        if kept > 0 {
            why.push(format!(
                "{kept} batch(es) dropped without release() are still held until their views \
                 are gone (or, for one whose group round was interrupted, until that round is \
                 decided): let the views go (del the arrays or tensors), or release() a batch \
                 before letting it go"
            ));
        }
        if why.is_empty() {
            return err(e);
        }
        let most = self.core.ring.params().held_per_consumer;
        err(format!(
            "take(): a rank holds at most {most} batch(es) at a time; {}",
            why.join("; ")
        ))
    }

    /// Batch `batch` was named in a committed round of step `step` (the last one, if named in
    /// two).
    pub(crate) fn record_applied(&self, batch: u64, step: u64) {
        let mut applied = self.applied.borrow_mut();
        applied.retain(|&(b, _)| b != batch);
        applied.push((batch, step));
    }

    /// Before this rank contributes to a round (naming batch `sent`): a round it left is taken
    /// out of `pending`. Still undecided, it is returned: this call finishes it, with the same
    /// contribution. Committed, its batch is recorded applied, but this rank never got its sum:
    /// its weights are behind the group's, which is an error. Given up by the group (the
    /// membership moved on first), it is forgotten.
    pub(crate) fn before_round(&self, sent: Option<u64>) -> PyResult<Option<Pending>> {
        let Some(p) = self.pending.borrow_mut().take() else {
            return Ok(None);
        };
        match self.decided(&p) {
            None if sent.is_none() || sent == p.sent => Ok(Some(p)),
            None => {
                let (was, step) = (p.sent, p.step);
                *self.pending.borrow_mut() = Some(p);
                Err(err(format!(
                    "all_reduce: this rank left the round of step {step} (interrupted) with \
                     batch {was:?}, and it is still open: finish it with that batch and the same \
                     data, not batch {sent:?}"
                )))
            }
            Some(true) => {
                if let Some(b) = p.batch {
                    self.record_applied(b, p.step);
                }
                Err(err(format!(
                    "all_reduce: the round of step {} that this rank left (interrupted) was \
                     committed by the group, and this rank never got its sum: its weights are \
                     behind the group's. End this process: its restart rejoins with the \
                     leader's state",
                    p.step
                )))
            }
            Some(false) => Ok(None),
        }
    }

    /// Whether the round `p` was left in is applied: `Some(true)` once the step reached it
    /// (it cannot without this rank's contribution), `Some(false)` once the epoch moved on
    /// first (the round is then contributed again, without it), `None` while undecided.
    fn decided(&self, p: &Pending) -> Option<bool> {
        let (epoch, step) = self.group.now();
        if step >= p.step {
            Some(true)
        } else if epoch != p.epoch {
            Some(false)
        } else {
            None
        }
    }

    pub(crate) fn fate(&self, batch: u64) -> Fate {
        let applied = self.applied.borrow();
        if let Some(&(_, step)) = applied.iter().find(|&&(b, _)| b == batch) {
            return Fate::Applied(step);
        }
        let pending = self.pending.borrow();
        match pending.as_ref().filter(|p| p.batch == Some(batch)) {
            None => Fate::NotApplied,
            Some(p) => match self.decided(p) {
                Some(true) => Fate::Applied(p.step),
                Some(false) => Fate::NotApplied,
                None => Fate::Undecided,
            },
        }
    }

    fn settle(&self, d: Dropped, fate: Fate) {
        let batch = d.slot.meta().batch_id;
        match fate {
            Fate::Applied(step) => {
                tracing::warn!(
                    batch,
                    step,
                    "a batch was dropped without release() after the group applied it (step \
                     {step}): released as trained"
                );
                let mut slot = Some(d.slot);
                // A full disk is waited out, with no end: no Python code runs here to be
                // interrupted, and the launcher's kill still ends it.
                let settled =
                    self.settle_trained(&mut slot, &d.header, step, String::new(), &mut || false);
                if let Err(e) = settled {
                    // Dropping the slot frees it: trained, never redelivered; a missing line
                    // only means a resume trains it again.
                    tracing::error!(batch, error = %e, "no ledger line for a dropped batch");
                }
            }
            Fate::NotApplied => {
                tracing::warn!(
                    batch,
                    "a batch was dropped without release(): given back to the ring untrained, \
                     for redelivery"
                );
                if let Err(e) = d.slot.requeue() {
                    tracing::warn!(batch, error = %e, "giving a dropped batch back");
                }
            }
            Fate::Undecided => {
                tracing::warn!(
                    batch,
                    "a batch dropped during an interrupted group round is left held: the \
                     launcher settles it when this process ends"
                );
                // Held (READING) until the launcher recovers this worker: not freed here.
                std::mem::forget(d.slot);
            }
        }
    }
}

impl Drop for DrafterCore {
    /// The drafter goes (the interpreter is finishing): every batch it still keeps is settled
    /// now. Left to the fields' drops, a kept slot would be freed as if released: neither
    /// trained nor given back, its samples lost.
    fn drop(&mut self) {
        let kept = std::mem::take(&mut *self.deferred.borrow_mut());
        for d in kept {
            let fate = self.fate(d.slot.meta().batch_id);
            self.settle(d, fate);
        }
    }
}
