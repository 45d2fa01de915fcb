//! The Python drafter: takes batches from the ring (the same take, verify, ledger line and
//! release as `drafter-worker`), with read-only zero-copy views of every section.
//!
//! Ownership: a [`Batch`] holds its ring slot (READING) until `release()`, which writes the
//! batch's ledger line first, then frees the slot: a batch whose slot was freed has its line in
//! the ledger, as for our drafters. A batch dropped without `release()` (an exception, a
//! KeyboardInterrupt between `take()` and its caller) goes back to the ring untrained, READY for
//! redelivery as if this rank had died holding it (`ReadSlot::requeue`), once its views are let
//! go: never while one lives.
//!
//! The batch in hand (`Consumer::set_in_hand`, which the launcher holds a death against, to set
//! a batch that kills every drafter aside) is the last one taken, from `take()` until the rank
//! enters the `sync` phase (the group's reduction: `all_reduce` and `TorchGroup.all_reduce`
//! enter it) or releases it: Python's loop has no compute boundary the ring could see. A batch
//! dropped unreleased stays in hand until then: an exception raised on it that ends the
//! process is a death with it in hand.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use proto::control::{FinalReport, ToLauncher};
use proto::ledger::{Ledger, LedgerLine};
use proto::{BatchHeader, BatchView};
use pyo3::prelude::*;
use shm_ring::{Consumer, Phase, ReadSlot, Take};

use crate::common::{close_views, err, worker_methods, Core, InHand, Registered};
use crate::group::Group;
use crate::view::{Elem, Exports, Memory, View};

const SECTIONS: [&str; 4] = ["input_ids", "loss_mask", "target_tokens", "hidden_states"];

pub struct DrafterCore {
    pub core: Core,
    consumer: &'static Consumer<'static>,
    ledger: RefCell<Ledger>,
    deferred: RefCell<Vec<(ReadSlot<'static>, Arc<Exports>)>>,
    report: RefCell<FinalReport>,
    /// The ring's end was seen.
    ended: Cell<bool>,
    /// The step the next release records when no group step named one: releases so far.
    releases: Cell<u64>,
    /// The batch this rank said it has in hand (the last taken, until released).
    in_hand: InHand,
    pub group: Group,
}

impl DrafterCore {
    pub fn new(
        core: Core,
        consumer: &'static Consumer<'static>,
        group: Group,
    ) -> Result<DrafterCore, String> {
        let run_dir = &core.setup.run_dir;
        std::fs::create_dir_all(run_dir.ledger_dir())
            .map_err(|e| format!("creating {}: {e}", run_dir.ledger_dir().display()))?;
        let ledger = Ledger::open(&run_dir.ledger(core.setup.index)).map_err(|e| e.to_string())?;
        Ok(DrafterCore {
            core,
            consumer,
            ledger: RefCell::new(ledger),
            deferred: RefCell::default(),
            report: RefCell::default(),
            ended: Cell::new(false),
            releases: Cell::new(0),
            in_hand: InHand::new(Registered::Consumer(consumer)),
            group,
        })
    }

    /// Gives back the dropped batches whose views are all gone (READY again, for redelivery).
    fn sweep(&self) {
        let mut deferred = self.deferred.borrow_mut();
        let mut i = 0;
        while i < deferred.len() {
            if deferred[i].1.try_close().is_ok() {
                let (slot, _) = deferred.swap_remove(i);
                let batch = slot.meta().batch_id;
                tracing::warn!(
                    batch,
                    "a batch was dropped without release(): given back to the ring untrained, for redelivery"
                );
                if let Err(e) = slot.requeue() {
                    tracing::warn!(batch, error = %e, "giving a dropped batch back");
                }
            } else {
                i += 1;
            }
        }
    }
}

/// A drafter worker (what `hspipe.connect()` returns in a drafter process).
#[pyclass(unsendable, module = "hspipe")]
pub struct Drafter {
    pub(crate) d: Rc<DrafterCore>,
}

impl Drafter {
    fn core(&self) -> &Core {
        &self.d.core
    }

    /// `close()`, or leaving `with` (`_failing`: on an exception; a rank has nothing to finish).
    fn close_inner(&self, py: Python<'_>, wait: Option<f64>, _failing: bool) -> PyResult<i32> {
        let d = &self.d;
        d.core.check_open()?;
        d.core.wait_deferred(py, wait, || {
            d.sweep();
            d.deferred.borrow().len()
        })?;
        d.ledger.borrow().sync().map_err(err)?;
        let mut report = d.report.borrow().clone();
        report.complete = d.ended.get();
        d.core.report(report);
        Ok(0)
    }
}

#[pymethods]
impl Drafter {
    /// Takes the next batch, verified (a corrupt one is refused and another taken), from bucket
    /// `prefer` when it has one READY. Blocks (the interpreter lock released) while the ring is
    /// open and empty. None once the ring is closed and nothing is READY: `ended` is then True
    /// if nothing is left anywhere, False while other ranks still hold batches (a group rank
    /// takes part in the step with nothing, and takes again). With `timeout`, raises
    /// TimeoutError after that many seconds without a batch.
    #[pyo3(signature = (prefer=None, timeout=None))]
    fn take(
        &self,
        py: Python<'_>,
        prefer: Option<u32>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Batch>> {
        let d = &self.d;
        d.core.check_open()?;
        d.sweep();
        let (consumer, ring) = (d.consumer, d.core.ring);
        loop {
            let got = d.core.wait(py, "take", timeout, false, |slice| {
                // Closed: nothing more will be published, so a short look is enough; the
                // batches other ranks hold are theirs (they are waiting for this rank's step).
                let closed = ring.is_closed();
                let slice = if closed {
                    std::time::Duration::from_millis(1)
                } else {
                    slice
                };
                Ok(
                    match consumer
                        .take_timeout_preferring(prefer, slice)
                        .map_err(err)?
                    {
                        Take::Item(slot) => Some(Some(slot)),
                        Take::End => {
                            d.ended.set(true);
                            Some(None)
                        }
                        Take::TimedOut if closed => Some(None),
                        Take::TimedOut => None,
                    },
                )
            })?;
            let Some(Some(slot)) = got else {
                return Ok(None);
            };
            consumer.enter(Phase::CopyIn);
            let header = BatchView::parse(slot.payload())
                .and_then(|v| v.verify().map(|()| v.header().clone()));
            consumer.enter(Phase::Other);
            match header {
                Ok(header) => {
                    d.in_hand.hold(slot.meta().batch_id);
                    let base = slot.payload().as_ptr() as usize;
                    return Ok(Some(Batch {
                        d: Rc::clone(d),
                        slot: Some(slot),
                        header,
                        base,
                        exports: Exports::new(&SECTIONS),
                    }));
                }
                Err(e) => {
                    tracing::error!(batch = slot.meta().batch_id, error = %e, "refusing a corrupt batch");
                    let mut r = d.report.borrow_mut();
                    r.refused += 1;
                    drop(r);
                    slot.release().map_err(err)?;
                }
            }
        }
    }

    /// True once the ring's stream ended: closed, and every batch taken and released.
    #[getter]
    fn ended(&self) -> bool {
        self.d.ended.get()
    }

    /// Batches dropped without release() while views of them lived: held (never reused) until the
    /// views are let go, then given back.
    #[getter]
    fn deferred(&self) -> usize {
        self.d.sweep();
        self.d.deferred.borrow().len()
    }

    /// Batches this drafter released after training them.
    #[getter]
    fn trained(&self) -> u64 {
        self.d.report.borrow().items
    }

    /// One group round: sums `data` (any float32 buffer: a numpy array, a CPU tensor's
    /// `.numpy()`) over the group's members, rank order, the same bits on every rank. `batch`
    /// is the batch this rank computed `data` from (None if it has none this step; the launcher
    /// then knows, should this rank die, whether that batch is in an applied update); `ended`
    /// that this rank saw the ring's end. Blocks with the interpreter lock released.
    ///
    /// With `epoch` (a membership epoch), the round commits only with that epoch's members: if
    /// the membership changes first it raises `hspipe.GroupChanged` and nothing is committed.
    /// `hspipe.dist.TorchGroup` commits this way after its torch.distributed exchange.
    #[pyo3(signature = (data, batch=None, ended=false, epoch=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        batch: Option<PyRef<'_, Batch>>,
        ended: bool,
        epoch: Option<u16>,
    ) -> PyResult<crate::group::Reduced> {
        self.d.core.check_open()?;
        let batch = batch.map(|b| b.batch_id());
        crate::group::all_reduce(&self.d.core, &self.d.group, py, data, batch, ended, epoch)
    }

    /// A restarted rank joins the group: waits to be admitted by the leader and returns
    /// `(step, state)`, the leader's live state (uint32 words, as the leader passed them to
    /// `admit`); None for a rank that is a member already (a first incarnation) or if the group
    /// was empty.
    fn join(&self, py: Python<'_>) -> PyResult<Option<(u64, View)>> {
        crate::group::join(&self.d.core, &self.d.group, py)
    }

    /// The leader, between steps: admits ranks waiting to join, handing them `state` (any
    /// buffer). Returns how many joined (0 when none waits, or this rank is not the leader).
    fn admit(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<u32> {
        crate::group::admit(&self.d.group, py, state)
    }

    /// The leader tells the launcher a step's loss (and loss tokens, acceptance length,
    /// learning rate): the monitor's line, `metrics.jsonl`, TensorBoard and the summary show
    /// it as they do our drafters'. Other ranks need not call it.
    #[pyo3(signature = (step, loss, tokens=0, tau=None, lr=None))]
    fn progress(&self, step: u64, loss: f32, tokens: u64, tau: Option<f32>, lr: Option<f32>) {
        if let Some(tx) = &self.d.core.setup.to_launcher {
            // Telemetry: a launcher that is going away is not an error here.
            let _ = tx.send(ToLauncher::Progress(proto::control::StepStats {
                step,
                tokens,
                loss,
                tau,
                lr,
                eval_tau: None,
            }));
        }
    }

    /// The group now: (epoch, last committed step, member ranks).
    #[getter]
    fn membership(&self) -> (u16, u64, Vec<u32>) {
        crate::group::membership(&self.d.group)
    }

    /// Finishes: syncs the ledger and sends the launcher this drafter's report. Returns the
    /// exit code for the process (`sys.exit(w.close())`).
    #[pyo3(signature = (wait=None))]
    fn close(&self, py: Python<'_>, wait: Option<f64>) -> PyResult<i32> {
        self.close_inner(py, wait, false)
    }
}

worker_methods!(Drafter);

/// A batch taken from the ring: read-only views of its sections, then `release()` after the
/// update that used it.
#[pyclass(unsendable, module = "hspipe")]
pub struct Batch {
    d: Rc<DrafterCore>,
    slot: Option<ReadSlot<'static>>,
    header: BatchHeader,
    base: usize,
    exports: Arc<Exports>,
}

impl Batch {
    fn view(&self, section: usize, elem: Elem, shape: Vec<usize>) -> PyResult<View> {
        if self.slot.is_none() || self.exports.is_closed() {
            return Err(err(format!(
                "batch {}: it was released",
                self.header.spec.batch_id
            )));
        }
        let h = &self.header;
        let s = [h.input_ids, h.loss_mask, h.target_tokens, h.hidden_states][section];
        let (addr, len) = (self.base + s.offset as usize, s.len as usize);
        crate::view::check_shape(SECTIONS[section], elem, &shape, len)?;
        Ok(View::new(
            Memory::Slot {
                exports: Arc::clone(&self.exports),
                section,
                addr,
                len,
            },
            SECTIONS[section],
            elem,
            shape,
            false,
        ))
    }

    fn n_tokens(&self) -> usize {
        self.header.spec.tokens() as usize
    }

    pub fn batch_id(&self) -> u64 {
        self.header.spec.batch_id
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            (self.d.deferred.borrow_mut()).push((slot, Arc::clone(&self.exports)));
            self.d.sweep();
        }
    }
}

#[pymethods]
impl Batch {
    #[getter(batch_id)]
    fn py_batch_id(&self) -> u64 {
        self.batch_id()
    }
    #[getter]
    fn sample_ids(&self) -> Vec<u64> {
        self.header.spec.sample_ids.clone()
    }
    #[getter]
    fn seq_lens(&self) -> Vec<u32> {
        self.header.spec.seq_lens.clone()
    }
    #[getter]
    fn tokens(&self) -> u64 {
        self.header.spec.tokens()
    }
    /// The length bucket the target published it in.
    #[getter]
    fn bucket(&self) -> PyResult<u32> {
        Ok(self.meta()?.bucket)
    }
    /// Earlier deliveries of this batch to drafters that died holding it (0 the first time).
    #[getter]
    fn delivery(&self) -> PyResult<u32> {
        Ok(self.meta()?.delivery)
    }
    /// The hidden states' element type (`bfloat16`, `float16`, `float32`).
    #[getter]
    fn dtype(&self) -> &'static str {
        Elem::of(self.header.spec.dtype).name()
    }
    /// uint32 [T], read-only.
    #[getter]
    fn input_ids(&self) -> PyResult<View> {
        self.view(0, Elem::U32, vec![self.n_tokens()])
    }
    /// uint8 [T], read-only.
    #[getter]
    fn loss_mask(&self) -> PyResult<View> {
        self.view(1, Elem::U8, vec![self.n_tokens()])
    }
    /// The target's greedy next token after each position, uint32 [T], read-only.
    #[getter]
    fn target_tokens(&self) -> PyResult<View> {
        self.view(2, Elem::U32, vec![self.n_tokens()])
    }
    /// [T, L, H] in the batch's dtype, read-only.
    #[getter]
    fn hidden_states(&self) -> PyResult<View> {
        let s = &self.header.spec;
        let shape = vec![self.n_tokens(), s.layers as usize, s.hidden as usize];
        self.view(3, Elem::of(s.dtype), shape)
    }

    /// After the update that used the batch: writes its ledger line (the step of that update,
    /// by default the last group step or this drafter's count of releases, and the weights'
    /// digest after it), then frees its slot. Raises, naming them, while views of it are alive
    /// (or waits up to `wait` seconds for them to go).
    #[pyo3(signature = (step=None, digest=None, wait=None))]
    fn release(
        &mut self,
        py: Python<'_>,
        step: Option<u64>,
        digest: Option<String>,
        wait: Option<f64>,
    ) -> PyResult<()> {
        let what = format!("release batch {}", self.batch_id());
        let d = Rc::clone(&self.d);
        let Some(slot) = &self.slot else {
            return Err(err(format!("{what}: already released")));
        };
        let meta = *slot.meta();
        close_views(&d.core, py, &self.exports, &what, wait)?;
        d.consumer.enter(Phase::Checkpoint);
        let releases = d.releases.get() + 1;
        let line = LedgerLine {
            batch_id: meta.batch_id,
            sample_ids: self.header.spec.sample_ids.clone(),
            tokens: self.header.spec.tokens(),
            delivery: meta.delivery,
            ticket: meta.ticket,
            step: step.or(d.group.last_step()).unwrap_or(releases),
            digest: digest.or_else(|| d.group.last_digest()).unwrap_or_default(),
            epoch: d.consumer.epoch(),
        };
        let wrote = d.ledger.borrow_mut().append(&line);
        d.consumer.enter(Phase::Other);
        wrote.map_err(err)?;
        self.slot
            .take()
            .expect("checked above")
            .release()
            .map_err(err)?;
        d.releases.set(releases);
        d.in_hand.let_go(meta.batch_id);
        let mut r = d.report.borrow_mut();
        r.items += 1;
        r.tokens += line.tokens;
        drop(r);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "<hspipe.Batch {} of {} tokens{}>",
            self.batch_id(),
            self.n_tokens(),
            if self.slot.is_some() {
                ""
            } else {
                ", released"
            }
        )
    }
}

impl Batch {
    fn meta(&self) -> PyResult<&shm_ring::ItemMeta> {
        match &self.slot {
            Some(s) => Ok(s.meta()),
            None => Err(err(format!("batch {}: it was released", self.batch_id()))),
        }
    }
}
