//! The Python drafter: takes batches from the ring (the same take, verify, ledger line and
//! release as `drafter-worker`), with read-only zero-copy views of every section.
//!
//! Ownership: a [`Batch`] holds its ring slot (READING) until `release()`, which writes the
//! batch's ledger line first, then frees the slot: a batch whose slot was freed has its line in
//! the ledger, as for our drafters. A batch dropped without `release()` (an exception, a
//! KeyboardInterrupt between `take()` and its caller) goes back to the ring untrained, READY for
//! redelivery as if this rank had died holding it (`ReadSlot::requeue`), once its views are let
//! go: never while one lives; one dropped on another thread comes back to this drafter's thread
//! first (`local`), at its next call. A batch dropped after a committed group round named it was trained
//! (every member applied the update): it gets its ledger line (that round's step, no digest, as
//! the launcher writes for a dead rank's applied batch) and is released, never redelivered, so
//! no live rank trains it twice.
//!
//! The batch in hand (`Consumer::set_in_hand`, which the launcher holds a death against, to set
//! a batch that kills every drafter aside) is the last one taken, from `take()` until the rank
//! enters the `sync` phase (the group's reduction: `all_reduce` and `TorchGroup.all_reduce`
//! enter it) or releases it: Python's loop has no compute boundary the ring could see. A batch
//! dropped unreleased stays in hand until then: an exception raised on it that ends the
//! process is a death with it in hand.
//!
//! Length: past 500 lines: what a round, a release and a take may do hinges on one state (the
//! batches held, which committed round named each, the round left undecided), so the checks
//! that refuse a round without its batch or a release at another step live beside it.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use proto::control::{FinalReport, ToLauncher};
use proto::ledger::{Ledger, LedgerLine};
use proto::{BatchHeader, BatchView};
use pyo3::prelude::*;
use shm_ring::{Consumer, Phase, ReadSlot, Take};

use crate::args;
use crate::batch::Batch;
use crate::common::{err, worker_methods, Core, InHand, Registered, Shared};
use crate::dropped::{Dropped, Fate, Pending};
use crate::group::{Group, Round};
use crate::local::Local;
use crate::view::View;

pub struct DrafterCore {
    pub core: Core,
    consumer: &'static Consumer<'static>,
    ledger: RefCell<Ledger>,
    /// Batches taken and still held by Python (neither released nor dropped), in take order:
    /// what a refused take() names.
    pub(crate) taken: RefCell<Vec<u64>>,
    /// Batches dropped unreleased, with their views and headers, until settled (`dropped.rs`).
    pub(crate) deferred: RefCell<Vec<Dropped>>,
    /// Batches named in a committed group round and not yet released: (batch, the round's step).
    pub(crate) applied: RefCell<Vec<(u64, u64)>>,
    /// The batch of a round interrupted after this rank contributed it (a KeyboardInterrupt in
    /// `all_reduce`), and the step that round commits as, if it ever does: undecided until then.
    pub(crate) pending: RefCell<Option<Pending>>,
    report: RefCell<FinalReport>,
    /// The ring's end was seen.
    ended: Cell<bool>,
    /// The step the next release records when no group step named one: releases so far.
    pub(crate) releases: Cell<u64>,
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
            taken: RefCell::default(),
            deferred: RefCell::default(),
            applied: RefCell::default(),
            pending: RefCell::new(None),
            report: RefCell::default(),
            ended: Cell::new(false),
            releases: Cell::new(0),
            in_hand: InHand::new(Registered::Consumer(consumer)),
            group,
        })
    }

    /// A round about to be contributed with no batch named (`batch=None`): refused while this
    /// rank holds a batch that no committed round has named yet. The launcher learns which
    /// batch a rank's update used only from the rounds that name it: a rank that dies after a
    /// round that should have named its batch, before `release()`, has that batch redelivered
    /// and trained again by another rank, silently (every count still agrees). The held batch
    /// is not named for the caller, though a rank holds only one: a round without it may come
    /// before its update (a count the update needs), and naming the batch there would count it
    /// trained should the rank die before the update's round, its samples never trained, as
    /// silently. A round after the one that named it (a loss reduced for the log) is fine.
    fn no_batch_named(&self) -> PyResult<()> {
        let applied = self.applied.borrow();
        let taken = self.taken.borrow();
        let unnamed: Vec<u64> = (taken.iter().copied())
            .filter(|b| !applied.iter().any(|&(a, _)| a == *b))
            .collect();
        let Some(&b) = unnamed.first() else {
            return Ok(());
        };
        Err(err(format!(
            "all_reduce: this rank holds batch {b} (taken, not released) and no committed round \
             has named it: pass batch= in the round whose update uses it (w.all_reduce(data, \
             batch=b, ...)), so that, should this rank die after that round, the batch counts \
             trained and is not trained again by another rank; a number the update needs (a \
             token count) goes into that same round's data, and a round after it (a loss for \
             the log) needs no batch"
        )))
    }

    /// The step `release()` records for batch `batch`: `asked`, or by default the step of the
    /// committed round that named it, else this rank's last round's (or, for a rank that never
    /// took part in one, its count of releases). A resume keeps or trains again a ledger line by
    /// its step, so a step the group did not commit with the batch is refused: for a batch a
    /// committed round named, any step but that round's (the step the launcher would record had
    /// the rank died); for another, a step past the group's last (a count of releases past it,
    /// for a rank that never took part in a round); for one whose round is undecided (left by a
    /// KeyboardInterrupt), any step until that round is finished.
    pub(crate) fn release_step(&self, batch: u64, asked: Option<u64>) -> Result<u64, String> {
        match self.fate(batch) {
            Fate::Applied(step) => match asked {
                Some(s) if s != step => Err(format!(
                    "step={s}, but the group applied this batch in the round of step {step} (the \
                     round that named it with batch=): its ledger line records that step, by \
                     which a resume keeps it or trains it again; pass step={step} (that round's \
                     r.step), or leave step out"
                )),
                _ => Ok(step),
            },
            Fate::Undecided => Err(format!(
                "the group round of step {} that named it was interrupted and is not decided: \
                 call all_reduce again with the same data (which finishes it), then release",
                self.pending.borrow().as_ref().map_or(0, |p| p.step)
            )),
            Fate::NotApplied => {
                let last = self.group.last_step();
                let committed = last.unwrap_or(0).max(self.group.now().1);
                let (default, most) = match last {
                    Some(l) => (l, committed),
                    // A rank that never took part in a round numbers its own steps.
                    None => {
                        let own = self.releases.get() + 1;
                        (own, own.max(committed))
                    }
                };
                match asked {
                    Some(s) if s > most => Err(format!(
                        "step={s}, but no round named this batch and the group's last committed \
                         step is {committed}{}: a ledger line records the step whose update used \
                         its batch, by which a resume keeps it or trains it again; pass the step \
                         of that update (r.step), or name the batch in its round \
                         (all_reduce(..., batch=b))",
                        if last.is_none() {
                            format!(" (this rank's releases so far: {})", self.releases.get())
                        } else {
                            String::new()
                        }
                    )),
                    Some(s) => Ok(s),
                    None => Ok(default),
                }
            }
        }
    }

    /// A trained batch: writes its ledger line, then frees its slot and counts it (a freed
    /// slot's line is in the ledger). If the line cannot be written the slot stays in `slot`,
    /// held, and the error is returned. On a full disk it waits for space as our drafter does
    /// (said once in the log, and once more when the line is written; beating meanwhile),
    /// until `interrupted` says to stop waiting (a KeyboardInterrupt).
    pub(crate) fn settle_trained(
        &self,
        slot: &mut Option<ReadSlot<'static>>,
        header: &BatchHeader,
        step: u64,
        digest: String,
        interrupted: &mut dyn FnMut() -> bool,
    ) -> Result<(), String> {
        let meta = *slot.as_ref().ok_or("already released")?.meta();
        self.consumer.enter(Phase::Checkpoint);
        let line = LedgerLine {
            batch_id: meta.batch_id,
            sample_ids: header.spec.sample_ids.clone(),
            tokens: header.spec.tokens(),
            delivery: meta.delivery,
            ticket: meta.ticket,
            step,
            digest,
            epoch: self.consumer.epoch(),
        };
        let mut ledger = self.ledger.borrow_mut();
        let what = format!("the ledger line of batch {}", meta.batch_id);
        let mut beat = || {
            self.consumer.heartbeat();
            !interrupted()
        };
        let wrote = worker_runtime::space::wait_for_space(
            &what,
            "release() returns once it is written",
            &mut beat,
            |waiting| ledger.append_waiting(&line, waiting),
        );
        drop(ledger);
        self.consumer.enter(Phase::Other);
        wrote.map_err(|e| e.to_string())?;
        let slot = slot.take().expect("checked above");
        slot.release().map_err(|e| e.to_string())?;
        self.releases.set(self.releases.get() + 1);
        self.applied
            .borrow_mut()
            .retain(|&(b, _)| b != meta.batch_id);
        // Settled: a round left with it undecided no longer decides its fate.
        if let Some(p) = self.pending.borrow_mut().as_mut() {
            p.batch = p.batch.filter(|&b| b != meta.batch_id);
        }
        self.in_hand.let_go(meta.batch_id);
        self.taken.borrow_mut().retain(|&b| b != meta.batch_id);
        let mut r = self.report.borrow_mut();
        r.items += 1;
        r.tokens += line.tokens;
        Ok(())
    }
}

/// A drafter worker (what `hspipe.connect()` returns in a drafter process). Its attributes
/// (`name`, `config`, ...) and `heartbeat()` answer on any thread; the rest on the thread that
/// connected it.
#[pyclass(module = "hspipe")]
pub struct Drafter {
    shared: Shared,
    d: Local<Rc<DrafterCore>>,
}

impl Drafter {
    pub fn new(d: DrafterCore) -> Drafter {
        Drafter {
            shared: Shared::of(&d.core),
            d: Local::new("hspipe.Drafter", Rc::new(d)),
        }
    }

    fn core(&self) -> PyResult<&Core> {
        Ok(&self.d.get()?.core)
    }

    /// `close()`, or leaving `with` (`failing`: on an exception; a rank has nothing to finish,
    /// and what it keeps is settled when the process goes).
    fn close_inner(&self, py: Python<'_>, wait: Option<f64>, failing: bool) -> PyResult<i32> {
        let d = self.d.get()?;
        d.core.check_open()?;
        // Batches let go of on other threads come back now (kept, they are settled when the
        // process goes).
        crate::local::bring_home();
        // Leaving on an exception, the process dies: what it keeps is settled when it goes.
        if !failing {
            d.core.wait_deferred(py, wait, || {
                d.sweep();
                d.kept_for_views()
            })?;
        }
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
        prefer: Option<Bound<'_, PyAny>>,
        timeout: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Option<Batch>> {
        let d = self.d.get()?;
        let buckets = d.core.ring.params().buckets;
        let prefer = args::maybe_unsigned(
            "take()",
            "prefer",
            "a length bucket of the ring",
            u64::from(buckets.saturating_sub(1)),
            prefer.as_ref(),
        )?
        .map(|b| b as u32);
        let timeout = args::seconds("take()", "timeout", timeout.as_ref())?;
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
                        .map_err(|e| d.refused_take(e))?
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
                    d.taken.borrow_mut().push(slot.meta().batch_id);
                    return Ok(Some(Batch::new(Rc::clone(d), slot, header)));
                }
                Err(e) => {
                    tracing::error!(batch = slot.meta().batch_id, error = %e, "refusing a corrupt batch");
                    let mut r = d.report.borrow_mut();
                    r.refused += 1;
                    drop(r);
                    slot.refuse().map_err(err)?;
                }
            }
        }
    }

    /// True once the ring's stream ended: closed, and every batch taken and released.
    #[getter]
    fn ended(&self) -> PyResult<bool> {
        Ok(self.d.get()?.ended.get())
    }

    /// Batches dropped without release() while views of them lived: held (never reused) until the
    /// views are let go, then given back.
    #[getter]
    fn deferred(&self) -> PyResult<usize> {
        let d = self.d.get()?;
        d.sweep();
        Ok(d.deferred.borrow().len())
    }

    /// Batches this drafter released after training them.
    #[getter]
    fn trained(&self) -> PyResult<u64> {
        Ok(self.d.get()?.report.borrow().items)
    }

    /// One group round: sums `data` (any float32 buffer: a numpy array, a CPU tensor's
    /// `.numpy()`) over the group's members, rank order, the same bits on every rank. `batch`
    /// is the batch this rank computed `data` from (None if it has none this step; the launcher
    /// then knows, should this rank die, whether that batch is in an applied update): while
    /// this rank holds a batch no committed round named, a round without `batch` is refused.
    /// `ended`: this rank saw the ring's end. Blocks with the interpreter lock released.
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
        epoch: Option<Bound<'_, PyAny>>,
    ) -> PyResult<crate::group::Reduced> {
        let d = self.d.get()?;
        let epoch = args::maybe_unsigned(
            "all_reduce()",
            "epoch",
            "a membership epoch (w.membership[0])",
            u64::from(u16::MAX),
            epoch.as_ref(),
        )?
        .map(|e| e as u16);
        crate::group::check_data(py, data)?;
        d.core.check_open()?;
        // A batch still held: once the round commits, it is trained (see `dropped.rs`).
        let held = match &batch {
            Some(b) => b.held.get()?.slot.is_some(),
            None => false,
        };
        let id = batch.map(|b| b.batch_id());
        // A round this rank left (interrupted) that the group has not decided: this call
        // finishes it, with the same contribution (see `dropped.rs`).
        let resume = d.before_round(id)?;
        if id.is_none() && resume.is_none() {
            d.no_batch_named()?;
        }
        let mine = resume.as_ref().map_or(id.filter(|_| held), |p| p.batch);
        let sent = resume.as_ref().map_or(id, |p| p.sent);
        let again = resume.as_ref().map(|p| &p.data[..]);
        let round =
            crate::group::all_reduce(&d.core, &d.group, py, data, sent, ended, epoch, again);
        let round = match round {
            // Not contributed: a round left before is still this rank's to finish.
            Err(e) => {
                *d.pending.borrow_mut() = resume;
                return Err(e);
            }
            Ok(round) => round,
        };
        match round {
            Round::Done(red) => {
                if let (Some(b), Some(step)) = (mine, d.group.last_step()) {
                    d.record_applied(b, step);
                }
                Ok(red)
            }
            Round::Mismatched(e) => {
                // Committed all the same: the launcher counts its batch applied.
                if let (Some(b), Some(step)) = (mine, d.group.last_step()) {
                    d.record_applied(b, step);
                }
                Err(e)
            }
            Round::Interrupted(e, data) => {
                // Whether it commits is up to the others now; its batch is undecided.
                *d.pending.borrow_mut() = d.group.arrival().map(|(epoch, step)| Pending {
                    batch: mine,
                    sent,
                    step,
                    epoch,
                    data,
                });
                Err(e)
            }
        }
    }

    /// A restarted rank joins the group: waits to be admitted by the leader and returns
    /// `(step, state)`, the leader's live state (uint32 words, as the leader passed them to
    /// `admit`); None for a rank that is a member already (a first incarnation) or if the group
    /// was empty (every rank gone): the group then goes on from `step`, that of the state this
    /// rank loads itself (its last checkpoint; 0 if None), or from the group's own last step if
    /// that is later (`membership` says which), so the steps the ledger records go on rising.
    /// The updates between were lost with the ranks that made them: recorded in the run
    /// directory's `lost-steps.jsonl`, their batches count as untrained (a resume trains them).
    #[pyo3(signature = (step=None))]
    fn join(
        &self,
        py: Python<'_>,
        step: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Option<(u64, View)>> {
        let d = self.d.get()?;
        // The group's steps are 32-bit.
        let step = args::maybe_unsigned(
            "join()",
            "step",
            "the step of the rank's saved weights",
            u64::from(u32::MAX),
            step.as_ref(),
        )?;
        crate::group::join(&d.core, &d.group, py, step)
    }

    /// The leader, between steps: admits ranks waiting to join, handing them `state` (any
    /// buffer). Returns how many joined (0 when none waits, or this rank is not the leader).
    /// Raises at every call for a state it could not hand over (too large, not a buffer).
    fn admit(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<u32> {
        crate::group::admit(&self.d.get()?.group, py, state)
    }

    /// The leader tells the launcher a step's loss and loss tokens (and acceptance length,
    /// learning rate): the monitor's line, `metrics.jsonl`, TensorBoard and the summary show
    /// it as they do our drafters'. `tokens` (the step's loss tokens over the group) weights
    /// the loss in the monitor's mean; a step of 0 tokens is one that trained nothing (as the
    /// end's empty rounds are), whose loss is recorded in `metrics.jsonl` but neither shown
    /// nor taken for the last loss. Without `tokens`, each step's loss weighs the same (an
    /// unweighted mean over steps): give `tokens` at every step or at none, since a step
    /// without it weighs as one token beside steps that weigh their thousands. `skipped=True`: the step's update was left out (a gradient
    /// that was not finite, as torch's GradScaler skips one), counted as ours are. Other ranks
    /// need not call it.
    #[pyo3(signature = (step, loss, tokens=None, tau=None, lr=None, skipped=false))]
    fn progress(
        &self,
        step: &Bound<'_, PyAny>,
        loss: &Bound<'_, PyAny>,
        tokens: Option<Bound<'_, PyAny>>,
        tau: Option<Bound<'_, PyAny>>,
        lr: Option<Bound<'_, PyAny>>,
        skipped: bool,
    ) -> PyResult<()> {
        crate::local::same_process()?;
        let m = "progress()";
        let step = args::unsigned(m, "step", "the group step (r.step)", u64::MAX, step)?;
        // A skipped update's loss may be what made it skipped (NaN, infinite).
        let loss = if skipped {
            loss.extract::<f32>().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "{m}: loss must be a number, got {}",
                    loss.get_type().name().map_or("?".into(), |n| n.to_string())
                ))
            })?
        } else {
            args::finite(m, "loss", loss).map_err(|e| {
                if !e.is_instance_of::<pyo3::exceptions::PyValueError>(loss.py()) {
                    return e;
                }
                pyo3::exceptions::PyValueError::new_err(format!(
                    "{} (a step whose loss is not finite left its update out: pass \
                     skipped=True)",
                    e.value(loss.py())
                ))
            })?
        };
        let tokens = args::maybe_unsigned(
            m,
            "tokens",
            "the step's loss tokens over the group",
            u64::MAX,
            tokens.as_ref(),
        )?;
        let tau = args::maybe_finite(m, "tau", tau.as_ref())?;
        let lr = args::maybe_finite(m, "lr", lr.as_ref())?;
        if let Some(tx) = &self.shared.setup.to_launcher {
            // Telemetry: a launcher that is going away is not an error here.
            let _ = tx.send(ToLauncher::Progress(proto::control::StepStats {
                step,
                tokens: tokens.unwrap_or(0),
                loss,
                tau,
                lr,
                eval_tau: None,
                skipped,
                tokens_unknown: tokens.is_none(),
            }));
        }
        Ok(())
    }

    /// Tells hspipe that the group's weights as of `step` (the step `all_reduce` returned for
    /// the update applied last) are saved whole in the drafter's own file: recorded in the run
    /// directory (replaced whole, synced before it returns), so `launcher --resume` goes on from
    /// that step, the batches trained up to it never trained again, and the resumed ranks are
    /// told it (`resume_step`). Call it after the file is in place (written, then renamed), and
    /// keep that file until a later step is recorded: a kill between the two leaves the earlier
    /// step recorded, and the resume loads its file. One rank calls it (the leader, which
    /// saves). Raises for a rank that is not a member (join first), a step after the last this
    /// rank applied, and a step before the one recorded.
    fn checkpointed(&self, step: &Bound<'_, PyAny>) -> PyResult<()> {
        let d = self.d.get()?;
        let step = args::unsigned(
            "checkpointed()",
            "step",
            "the step of the saved weights (r.step)",
            u64::MAX,
            step,
        )?;
        d.core.check_open()?;
        crate::group::checkpointed(&d.core, &d.group, step)
    }

    /// The step of the checkpoint `launcher --resume` resumed the run from (the last step
    /// `checkpointed` recorded), whose saved weights every first incarnation of a rank loads
    /// before the group's first round, the group going on from that step; None for a new run,
    /// and for a resume from the start (nothing recorded: the initial weights). The same for
    /// every incarnation of the launch: a rank restarted mid-run gets the live weights from
    /// `join()`.
    #[getter]
    fn resume_step(&self) -> Option<u64> {
        self.shared.setup.resume_step
    }

    /// The group now: (epoch, last committed step, member ranks).
    #[getter]
    fn membership(&self) -> PyResult<(u16, u64, Vec<u32>)> {
        Ok(crate::group::membership(&self.d.get()?.group))
    }

    /// Finishes: syncs the ledger and sends the launcher this drafter's report. Returns the
    /// exit code for the process (`sys.exit(w.close())`).
    #[pyo3(signature = (wait=None))]
    fn close(&self, py: Python<'_>, wait: Option<Bound<'_, PyAny>>) -> PyResult<i32> {
        let wait = args::seconds("close()", "wait", wait.as_ref())?;
        self.close_inner(py, wait, false)
    }
}

worker_methods!(Drafter);
