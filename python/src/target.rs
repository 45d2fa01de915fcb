//! The Python target: claims planned batches from the ring's work table (the same claim, gather,
//! reserve, write, mark-done and commit as `target-worker`), and lets Python write the hidden
//! states and greedy tokens straight into the slot.
//!
//! Ownership: a [`Claim`] holds its work item until it is reserved (then the [`Slot`] holds it)
//! or dropped (the item goes back to the table). A [`Slot`] holds its ring slot until
//! committed, aborted or dropped; one dropped while its views live is kept (`deferred`) until
//! they are let go, then given back with its item. Either dropped on another thread comes back
//! to this target's thread first (`local`), at its next call. `close()` finishes the producer
//! once nothing is held, so the ring's close broadcast counts this target.
//!
//! A slot dropped without `commit()` or `abort()`, or a claim without `reserve()` or `abort()`,
//! is a bug in the target's loop, not a way to give work back: its batch goes back to the work
//! table, the same target claims it again, and a loop that never commits spins for ever while
//! its heartbeats keep the launcher's hang check quiet. So each is said (a WARN naming the
//! batch) and the target's next `claim()` or `reserve()` raises, once, naming it: the process
//! ends with a clear exception and the launcher's restart limits apply. A target leaving
//! `with` on an exception, or already closed, lets go of what it holds without either: that is
//! how it ends, not a bug.
//!
//! Length: the target's core, the worker and its claims share that ownership (the claims, the
//! deferred slots, the forgotten ones) through private fields; one module keeps it in one place.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;
use std::sync::Arc;

use dataset::Dataset;
use proto::control::FinalReport;
use proto::plan::PlannedBatch;
use proto::{batch_len, BatchWriter};
use pyo3::prelude::*;
use shm_ring::{Producer, WorkClaim, WriteSlot};
use target_worker::Gathered;

use crate::common::{err, worker_methods, Core, InHand, Registered, Shared};
use crate::local::Local;
use crate::slot::Slot;
use crate::view::{self, Elem, Exports, View};

/// The sections of a slot, in `Exports`' order.
pub const SECTIONS: [&str; 4] = ["input_ids", "loss_mask", "target_tokens", "hidden_states"];

pub struct TargetCore {
    pub core: Core,
    producer: &'static Producer<'static>,
    data: Dataset,
    plan: Vec<PlannedBatch>,
    /// Items claimed and not yet committed or given back.
    claims: RefCell<BTreeSet<u64>>,
    /// Slots dropped while views of them lived: given back once they are let go.
    deferred: RefCell<Vec<(WriteSlot<'static>, u64, Arc<Exports>)>>,
    report: RefCell<FinalReport>,
    stopped: Cell<bool>,
    /// Left `with` on an exception: nothing is given back any more.
    dying: Cell<bool>,
    /// Slots and claims dropped without commit() or abort() since the last claim() or
    /// reserve(), which raises for them (see the module doc).
    forgotten: RefCell<Vec<(u64, Forgotten)>>,
    /// The item in hand: the one claimed (the user computes its forward) while no other is,
    /// until its batch is committed or aborted (a claim dropped, on an exception, leaves it).
    in_hand: InHand,
}

impl TargetCore {
    pub fn new(core: Core, producer: &'static Producer<'static>) -> Result<TargetCore, String> {
        let cfg = &core.setup.config;
        let data =
            target_worker::load_dataset(cfg).map_err(|e| format!("loading the dataset: {e}"))?;
        let plan = proto::plan::plan(data.lengths(), cfg);
        if core.ring.params().work_items != plan.len() as u64 {
            return Err(format!(
                "ring {} was made for {} batches but this dataset and config plan {}",
                core.ring.name(),
                core.ring.params().work_items,
                plan.len()
            ));
        }
        Ok(TargetCore {
            core,
            producer,
            data,
            plan,
            claims: RefCell::default(),
            deferred: RefCell::default(),
            report: RefCell::default(),
            stopped: Cell::new(false),
            dying: Cell::new(false),
            forgotten: RefCell::default(),
            in_hand: InHand::new(Registered::Producer(producer)),
        })
    }

    /// Gives back the deferred slots whose views are all gone, and first what other threads
    /// let go of (`local`).
    fn sweep(&self) {
        crate::local::bring_home();
        let mut deferred = self.deferred.borrow_mut();
        let mut i = 0;
        while i < deferred.len() {
            if deferred[i].2.try_close().is_ok() {
                let (slot, item, _) = deferred.swap_remove(i);
                drop(slot);
                self.give_back(item);
            } else {
                i += 1;
            }
        }
    }

    /// A slot dropped uncommitted: kept until its views are gone, then given back.
    pub(crate) fn dropped(&self, slot: WriteSlot<'static>, item: u64, exports: Arc<Exports>) {
        self.deferred.borrow_mut().push((slot, item, exports));
        self.sweep();
    }

    /// `what` of batch `item` was dropped unfinished: said now, raised at the next claim() or
    /// reserve() (`check_forgotten`). Not while the target dies or once it closed: letting go
    /// of what it holds is then how it ends.
    pub(crate) fn forgot(&self, item: u64, what: Forgotten) {
        if self.dying.get() || self.core.closed.get() {
            return;
        }
        tracing::warn!(batch = item, "{}", what.said(item));
        // The mistake is the loop's, not the batch's: a death it causes is not held against
        // the batch (three would set it aside as a poison batch).
        self.in_hand.let_go(item);
        self.forgotten.borrow_mut().push((item, what));
    }

    /// Raises, once, for the slots and claims dropped unfinished since the last claim() or
    /// reserve().
    fn check_forgotten(&self) -> PyResult<()> {
        let forgotten = std::mem::take(&mut *self.forgotten.borrow_mut());
        let Some(&(item, what)) = forgotten.first() else {
            return Ok(());
        };
        let mut said = what.said(item);
        if forgotten.len() > 1 {
            let rest: Vec<u64> = forgotten[1..].iter().map(|&(i, _)| i).collect();
            said.push_str(&format!(" (batches {rest:?} too)"));
        }
        Err(err(said))
    }

    /// Batch `item` of `tokens` tokens was committed.
    pub(crate) fn committed(&self, item: u64, tokens: u64) {
        self.claims.borrow_mut().remove(&item);
        self.in_hand.let_go(item);
        let mut r = self.report.borrow_mut();
        r.items += 1;
        r.tokens += tokens;
    }

    /// Batch `item`'s slot was aborted: the item goes back to the work table.
    pub(crate) fn aborted(&self, item: u64) {
        self.give_back(item);
        self.in_hand.let_go(item);
    }

    /// Returns a claimed item to the work table, for any target to claim again (not once the
    /// target is dying: see `close_inner`).
    fn give_back(&self, item: u64) {
        if !self.dying.get() && self.claims.borrow_mut().remove(&item) {
            if let Err(e) = self.producer.unclaim_work(item) {
                tracing::warn!(item, error = %e, "giving back a claimed batch");
            }
        }
    }
}

/// What of a batch a target let go of unfinished (see the module doc).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Forgotten {
    Slot,
    Claim,
}

impl Forgotten {
    fn said(self, item: u64) -> String {
        let (what, fix) = match self {
            Forgotten::Slot => (
                "slot",
                "commit() or abort(): commit() a slot once it is written, or abort() it to give \
                 its batch back",
            ),
            Forgotten::Claim => (
                "claim",
                "reserve() or abort(): reserve() a claim's slot and commit it, or abort() the \
                 claim to give its batch back",
            ),
        };
        format!(
            "the {what} of batch {item} was dropped without {fix}. The batch went back to the \
             work table; a target that drops them claims the same batches for ever"
        )
    }
}

/// A target worker (what `hspipe.connect()` returns in a target process). Iterate it for
/// claims; `close()` (or leaving `with`) finishes. Its attributes (`name`, `config`, ...) and
/// `heartbeat()` answer on any thread; the rest on the thread that connected it.
#[pyclass(module = "hspipe")]
pub struct Target {
    shared: Shared,
    t: Local<Rc<TargetCore>>,
}

impl Target {
    pub fn new(t: TargetCore) -> Target {
        Target {
            shared: Shared::of(&t.core),
            t: Local::new("hspipe.Target", Rc::new(t)),
        }
    }

    fn core(&self) -> PyResult<&Core> {
        Ok(&self.t.get()?.core)
    }

    /// `close()`, or leaving `with` (`failing`: on an exception, the process about to die: not
    /// finished, so its restart claims work again; the supervisor retires it if it gives up).
    fn close_inner(&self, py: Python<'_>, wait: Option<f64>, failing: bool) -> PyResult<i32> {
        let t = self.t.get()?;
        t.core.check_open()?;
        // Dying: what it holds stays claimed until the launcher recovers it, so a batch that
        // killed it is still its own then (to be set aside), not already another's. Marked
        // first: waiting for views of dropped slots could fail, and claims dropped after would
        // be given back.
        if failing {
            t.dying.set(true);
            // What other threads let go of: kept, as what it holds (the claims stay claimed).
            crate::local::bring_home();
        } else {
            t.core.wait_deferred(py, wait, || {
                t.sweep();
                t.deferred.borrow().len()
            })?;
        }
        let held: Vec<u64> = t.claims.borrow().iter().copied().collect();
        for item in held {
            t.give_back(item);
            t.stopped.set(true);
        }
        t.stopped
            .set(t.stopped.get() || t.core.setup.stop.stopping() || failing);
        if !failing {
            t.producer.finish_shared();
        }
        let mut report = t.report.borrow().clone();
        report.complete = !t.stopped.get();
        t.core.report(report);
        Ok(if t.stopped.get() {
            proto::stop::EXIT_STOPPED
        } else {
            0
        })
    }
}

#[pymethods]
impl Target {
    /// Claims the next planned batch: its sample ids and token ids, to compute. Blocks (the
    /// interpreter lock released) while every batch left is held by other targets, which give
    /// theirs back if they die. None when every batch is published, or a stop was asked for.
    #[pyo3(signature = (timeout=None))]
    fn claim(&self, py: Python<'_>, timeout: Option<Bound<'_, PyAny>>) -> PyResult<Option<Claim>> {
        let t = self.t.get()?;
        let timeout = crate::args::seconds("claim()", "timeout", timeout.as_ref())?;
        t.core.check_open()?;
        t.sweep();
        t.check_forgotten()?;
        let producer = t.producer;
        let got = t.core.wait(py, "claim", timeout, true, |slice| {
            Ok(match producer.claim_work_timeout(slice) {
                WorkClaim::Item(item) => Some(Some((item, false))),
                WorkClaim::Returned(item) => Some(Some((item, true))),
                WorkClaim::Settled => Some(None),
                WorkClaim::Pending => None,
            })
        });
        let (item, alone) = match got {
            Ok(Some(Some(got))) => got,
            Ok(Some(None)) => return Ok(None),
            Ok(None) => {
                t.stopped.set(true);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        t.claims.borrow_mut().insert(item);
        // In hand only while it is the only claim: with two at once, whose an error is is unknown.
        match t.claims.borrow().len() {
            1 => t.in_hand.hold(item),
            _ => t.in_hand.clear(),
        }
        let cfg = &t.core.setup.config;
        let g = target_worker::gather(
            item,
            &t.plan[item as usize],
            &t.data,
            cfg,
            t.core.setup.index,
        );
        Ok(Some(Claim::new(Rc::clone(t), Gathered { alone, ..g })))
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Claim>> {
        self.claim(py, None)
    }

    /// Finishes: gives back what is claimed and not committed, counts this target toward the
    /// ring's close and sends the launcher its report. Returns the exit code the process should
    /// exit with (0 when its part is done, 3 when stopped first): `sys.exit(w.close())`.
    #[pyo3(signature = (wait=None))]
    fn close(&self, py: Python<'_>, wait: Option<Bound<'_, PyAny>>) -> PyResult<i32> {
        let wait = crate::args::seconds("close()", "wait", wait.as_ref())?;
        self.close_inner(py, wait, false)
    }

    /// Batches dropped without commit() while views of them lived: held (never reused) until the
    /// views are let go, then given back.
    #[getter]
    fn deferred(&self) -> PyResult<usize> {
        let t = self.t.get()?;
        t.sweep();
        Ok(t.deferred.borrow().len())
    }

    /// Batches this target committed.
    #[getter]
    fn committed(&self) -> PyResult<u64> {
        Ok(self.t.get()?.report.borrow().items)
    }
}

worker_methods!(Target);

/// A planned batch this target claimed: what to compute (readable from any thread).
/// `reserve()`, on the target's thread, gets its slot.
#[pyclass(module = "hspipe")]
pub struct Claim {
    item: u64,
    g: Gathered,
    held: Local<ClaimHeld>,
}

/// What of a claim only its target's thread touches.
struct ClaimHeld {
    t: Rc<TargetCore>,
    item: u64,
    /// A slot was reserved for it (the slot holds the work item now), or it was given back.
    settled: bool,
    /// A slot was reserved for it.
    reserved: bool,
}

impl Drop for ClaimHeld {
    fn drop(&mut self) {
        if !self.settled {
            self.t.forgot(self.item, Forgotten::Claim);
            self.t.give_back(self.item);
        }
    }
}

impl Claim {
    fn new(t: Rc<TargetCore>, g: Gathered) -> Claim {
        let held = ClaimHeld {
            t,
            item: g.item,
            settled: false,
            reserved: false,
        };
        Claim {
            item: g.item,
            g,
            held: Local::new("hspipe.Claim", held),
        }
    }

    fn gathered(&self) -> PyResult<&Gathered> {
        Ok(&self.g)
    }
}

#[pymethods]
impl Claim {
    /// The planned batch's id (its index in the plan).
    #[getter]
    fn batch_id(&self) -> u64 {
        self.item
    }
    /// A target died with this batch: compute it alone (commit what you hold first, and
    /// synchronize the device before the next), so a fault it causes is known to be its own.
    #[getter]
    fn returned(&self) -> bool {
        self.g.alone
    }
    /// The ids of the samples in it (their rows in the dataset), one per sequence.
    #[getter]
    fn sample_ids(&self) -> PyResult<Vec<u64>> {
        Ok(self.gathered()?.spec.sample_ids.clone())
    }
    /// Tokens of each sequence; the sections hold them one after another.
    #[getter]
    fn seq_lens(&self) -> PyResult<Vec<u32>> {
        Ok(self.gathered()?.spec.seq_lens.clone())
    }
    /// Tokens in all (T: the sum of `seq_lens`).
    #[getter]
    fn tokens(&self) -> PyResult<u64> {
        Ok(self.gathered()?.spec.tokens())
    }
    #[getter]
    fn bucket(&self) -> PyResult<u32> {
        Ok(self.gathered()?.bucket)
    }
    /// The batch's token ids, uint32 [T], read-only.
    #[getter]
    fn input_ids(&self) -> PyResult<View> {
        let g = self.gathered()?;
        let bytes: Vec<u8> = g.input_ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        Ok(view::owned(
            "input_ids",
            Elem::U32,
            vec![g.input_ids.len()],
            &bytes,
        ))
    }
    /// Which tokens are trained on, uint8 [T] (0 or 1), read-only.
    #[getter]
    fn loss_mask(&self) -> PyResult<View> {
        let g = self.gathered()?;
        Ok(view::owned(
            "loss_mask",
            Elem::U8,
            vec![g.loss_mask.len()],
            &g.loss_mask,
        ))
    }

    /// Reserves a ring slot for the batch and writes its ids and mask into it; blocks (the
    /// interpreter lock released) while the ring is full. None if a stop was asked for while
    /// waiting (the batch goes back to the work table).
    #[pyo3(signature = (timeout=None))]
    fn reserve(
        &mut self,
        py: Python<'_>,
        timeout: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Option<Slot>> {
        let timeout = crate::args::seconds("reserve()", "timeout", timeout.as_ref())?;
        let held = self.held.get_mut()?;
        let t = Rc::clone(&held.t);
        t.core.check_open()?;
        if held.settled {
            return Err(err(format!(
                "batch {} was reserved already, or given back",
                self.item
            )));
        }
        t.sweep();
        t.check_forgotten()?;
        let len = batch_len(&self.g.spec).map_err(err)? as usize;
        let producer = t.producer;
        let got = t.core.wait(py, "reserve", timeout, true, |slice| {
            producer.reserve_timeout(len, slice).map_err(err)
        });
        let got = got.inspect_err(|_| t.in_hand.let_go(self.item))?; // a full ring: not its doing
        let Some(mut slot) = got else {
            t.stopped.set(true);
            held.settled = true;
            t.give_back(self.item);
            t.in_hand.let_go(self.item);
            return Ok(None);
        };
        held.settled = true;
        held.reserved = true;
        let g = &self.g;
        let base = slot.payload_mut().as_mut_ptr() as usize;
        let mut w = BatchWriter::new(slot.payload_mut(), &g.spec).map_err(err)?;
        let h = w.header().clone();
        let sections = w.sections_mut();
        for (dst, id) in sections.input_ids.chunks_exact_mut(4).zip(&g.input_ids) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        sections.loss_mask.copy_from_slice(&g.loss_mask);
        let at = [h.input_ids, h.loss_mask, h.target_tokens, h.hidden_states]
            .map(|s| (base + s.offset as usize, s.len as usize));
        Ok(Some(Slot::new(
            t,
            slot,
            g.item,
            g.spec.clone(),
            g.bucket,
            at,
        )))
    }

    /// Gives the batch back to the work table unreserved, for a target to claim again (this
    /// one's next claim may be it). A claim is reserved or aborted: one dropped with neither
    /// makes the next claim() or reserve() raise.
    fn abort(&mut self) -> PyResult<()> {
        let held = self.held.get_mut()?;
        if held.reserved {
            return Err(err(format!(
                "batch {} was reserved: abort() its slot instead",
                self.item
            )));
        }
        if !held.settled {
            held.settled = true;
            held.t.give_back(self.item);
            held.t.in_hand.let_go(self.item);
        }
        Ok(())
    }
}
