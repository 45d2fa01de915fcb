//! The drafter group for Python ranks: the same `collective` group our drafters use (its
//! segment, membership epochs, one committed round per step, the launcher's removal of a dead
//! rank), with f32 buffers from Python.
//!
//! A Python rank's round buffer is the group's buffer (sized by the launcher from
//! `[drafter] params`) holding the caller's data first, then one word per rank of the group for
//! the length each contributed (rank `r` writes its own, the others leave it 0, so the sum holds
//! every member's), and, in its last word, whether the rank saw the ring's end: every rank then
//! knows when every member has. The collective sums whole buffers and knows nothing of the
//! caller's lengths: without those words, ranks that reduced buffers of different lengths got a
//! sum of misaligned parts, silently. With them, every member sees the same lengths in the
//! same sum, so every member refuses the round alike. A round contributed again
//! after a membership change is the collective's business, invisible here; the launcher
//! redelivers a dead rank's batch unless its update was applied.
//!
//! A round with `epoch` commits only with that epoch's members ([`Collective::commit_within`]):
//! the commit of ranks whose gradients went through torch.distributed (`hspipe.dist`).

use std::cell::{Cell, RefCell};

use collective::{Collective, GroupError, Membership, NO_BATCH};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::common::{err, Core, GroupChanged};
use crate::view::{self, Elem, View};

pub struct Group {
    c: Box<dyn Collective>,
    /// f32 words of a round's buffer; the last one is the "saw the end" flag.
    buf_len: usize,
    /// u32 words of the state a joining rank gets.
    state_len: usize,
    /// Ranks in the group (the run's drafters): the length words before the flag.
    ranks: usize,
    last_step: Cell<Option<u64>>,
}

impl Group {
    pub fn new(c: Box<dyn Collective>, buf_len: usize, state_len: usize, ranks: u32) -> Group {
        Group {
            c,
            buf_len,
            state_len,
            ranks: ranks as usize,
            last_step: Cell::new(None),
        }
    }

    /// The most f32 words a rank may reduce: the buffer less the length words and the flag.
    fn max_data(&self) -> usize {
        self.buf_len.saturating_sub(self.ranks + 1)
    }

    /// Where rank `rank`'s length word is.
    fn len_word(&self, rank: u32) -> usize {
        self.buf_len - 1 - self.ranks + rank as usize
    }

    pub fn last_step(&self) -> Option<u64> {
        self.last_step.get()
    }

    /// The group now: (epoch, last committed step).
    pub fn now(&self) -> (u16, u64) {
        let m = self.c.membership();
        (m.epoch, u64::from(m.step))
    }

    /// This rank's last contribution: (epoch, step it is for).
    pub fn arrival(&self) -> Option<(u16, u64)> {
        self.c.arrival().map(|(e, s)| (e, u64::from(s)))
    }

    /// Asks `check_signals` from inside a wait with the lock released; the first error stops
    /// the wait and is raised afterwards.
    fn stop_on_signal<'a>(
        core: &'a Core,
        raised: &'a RefCell<Option<PyErr>>,
    ) -> impl Fn() -> bool + 'a {
        move || {
            core.reg.heartbeat();
            match Python::attach(|py| py.check_signals()) {
                Ok(()) => false,
                Err(e) => {
                    *raised.borrow_mut() = Some(e);
                    true
                }
            }
        }
    }
}

/// What one group round gave.
#[pyclass(frozen, module = "hspipe")]
pub struct Reduced {
    /// The rank-order sum of every member's data (float32, read-only): the same bits on
    /// every rank.
    #[pyo3(get)]
    sum: Py<View>,
    /// The step this round committed as: record it in the ledger (`release()` does).
    #[pyo3(get)]
    step: u64,
    /// The membership epoch it committed under.
    #[pyo3(get)]
    epoch: u16,
    #[pyo3(get)]
    members: Vec<u32>,
    /// This rank is the group's leader (lowest member): it admits joiners and checkpoints.
    #[pyo3(get)]
    leader: bool,
    /// Every member saw the ring's end in this round: the group's last step.
    #[pyo3(get)]
    everyone_ended: bool,
}

fn members(m: Membership) -> Vec<u32> {
    m.ranks().collect()
}

/// How a round ended, for `all_reduce`.
pub enum Round {
    Done(Reduced),
    /// Committed, but the members reduced buffers of different lengths: every member gets this
    /// error instead of the sum (its batch is in the committed round all the same).
    Mismatched(PyErr),
    /// A signal's exception (KeyboardInterrupt) raised while this rank waited for the others,
    /// its contribution (the round's buffer) published: the round may still commit with it,
    /// once they arrive.
    Interrupted(PyErr, Vec<f32>),
}

/// The group methods of a drafter (in `Drafter`'s Python class). `again`: the contribution
/// of a round this rank left open, which this call finishes.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce(
    core: &Core,
    g: &Group,
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    batch: Option<u64>,
    ended: bool,
    epoch: Option<u16>,
    again: Option<&[f32]>,
) -> PyResult<Round> {
    let buf = PyBuffer::<f32>::get(data).map_err(|e| not_f32(py, data, e))?;
    let n = buf.item_count();
    if n > g.max_data() {
        return Err(err(format!(
            "all_reduce: {n} floats, but this run's group of {} ranks reduces at most {} (a \
             word per rank says its length): raise [drafter] params by at least {}",
            g.ranks,
            g.max_data(),
            n - g.max_data()
        )));
    }
    let mut mine = vec![0f32; g.buf_len];
    buf.copy_to_slice(py, &mut mine[..n])?;
    // Plus one: a member's word is never 0. Exact to 2^24 floats; past that, lengths that
    // differ by less than the float's step pass unseen.
    mine[g.len_word(g.c.rank())] = (n + 1) as f32;
    mine[g.buf_len - 1] = if ended { 1.0 } else { 0.0 };
    // Finishing a round left open: the same bits, or the others could sum a buffer half
    // rewritten.
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if again.is_some_and(|a| bits(a) != bits(&mine)) {
        return Err(err(
            "all_reduce: this rank left a round (interrupted) that is still open: finish it with \
             the same data (and ended flag) it contributed then",
        ));
    }
    let mut sum = vec![0f32; g.buf_len];
    let raised = RefCell::new(None);
    // Back to the caller's phase after (TorchGroup's `with w.phase("sync")` spans retries).
    let before = core.reg.enter(shm_ring::Phase::Sync);
    let red = crate::detach::released(py, || {
        let stop = Group::stop_on_signal(core, &raised);
        let batch = batch.unwrap_or(NO_BATCH);
        match epoch {
            None => g.c.all_reduce(&mine, batch, &mut sum, &stop),
            Some(e) => g.c.commit_within(e, &mine, batch, &mut sum, &stop),
        }
    });
    core.reg.enter(before.unwrap_or(shm_ring::Phase::Other));
    if let Some(e) = raised.into_inner() {
        // The collective asks to stop only once this rank's contribution is published.
        return Ok(Round::Interrupted(e, mine));
    }
    let red = red.map_err(|e| match e {
        GroupError::EpochChanged { .. } => GroupChanged::new_err(e.to_string()),
        e => err(e),
    })?;
    g.last_step.set(Some(u64::from(red.step)));
    let lens: Vec<(u32, f32)> = (red.membership.ranks())
        .map(|r| (r, sum[g.len_word(r)]))
        .collect();
    if lens
        .iter()
        .any(|&(_, l)| l.to_bits() != lens[0].1.to_bits())
    {
        let said: Vec<String> = lens
            .iter()
            .map(|&(r, l)| format!("rank {r}: {}", l as u64 - 1))
            .collect();
        // The round committed, so the launcher and the ledgers take its batches for applied,
        // but no rank applies a sum of unrelated values: the leader records the step as left
        // out (as a skipped update is), so its batches count untrained and a resume trains
        // them.
        if red.membership.leader() == Some(g.c.rank()) {
            let step = u64::from(red.step);
            let lost = proto::ledger::LostSteps {
                first: step,
                last: step,
                rank: None,
                skipped: true,
            };
            record_lost(core, &lost, "all_reduce() raises once it is written")?;
        }
        return Ok(Round::Mismatched(err(format!(
            "all_reduce: the ranks reduced buffers of different lengths ({} floats), so their \
             sum would add unrelated values: every rank must pass the same length (the same \
             model and layout) each round",
            said.join(", ")
        ))));
    }
    let bytes: Vec<u8> = sum[..n].iter().flat_map(|x| x.to_le_bytes()).collect();
    let everyone_ended = sum[g.buf_len - 1] as u32 == red.membership.len();
    Ok(Round::Done(Reduced {
        sum: Py::new(py, view::owned("sum", Elem::F32, vec![n], &bytes))?,
        step: u64::from(red.step),
        epoch: red.membership.epoch,
        members: members(red.membership),
        leader: red.membership.leader() == Some(g.c.rank()),
        everyone_ended,
    }))
}

/// Raises unless `data` is a float32 buffer, before the round (and anything of it) begins.
pub fn check_data(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
    PyBuffer::<f32>::get(data)
        .map(drop)
        .map_err(|e| not_f32(py, data, e))
}

/// pyo3's refusal `e` of `data` as an f32 buffer, naming the element type it has (pyo3 says
/// only "buffer contents are not compatible with f32"), or, for no buffer at all, its type
/// (Python says only "a bytes-like object is required, not 'NoneType'", which the launcher
/// printed as the death's reason); any other error is left as it is.
fn not_f32(py: Python<'_>, data: &Bound<'_, PyAny>, e: PyErr) -> PyErr {
    if e.is_instance_of::<PyTypeError>(py) {
        let ty = data.get_type().name().map_or("?".into(), |n| n.to_string());
        return PyTypeError::new_err(format!(
            "all_reduce(): data must be a float32 buffer (a numpy.float32 array, a CPU \
             tensor's .numpy()), got {ty}"
        ));
    }
    if !e.is_instance_of::<PyBufferError>(py) {
        return e;
    }
    let format = py
        .import("builtins")
        .and_then(|b| b.getattr("memoryview")?.call1((data,)))
        .and_then(|m| m.getattr("format")?.extract::<String>());
    let Ok(format) = format else {
        return e;
    };
    // numpy's name for it (`float64`), where the object has one.
    let got = match data.getattr("dtype").and_then(|d| d.str()) {
        Ok(dtype) => format!("{dtype} ('{format}')"),
        Err(_) => format!("format '{format}'"),
    };
    PyBufferError::new_err(format!(
        "all_reduce: data must be float32, got {got}: pass numpy.float32 (x.astype(numpy.float32))"
    ))
}

/// A restarted rank: waits to be admitted and returns (step, the leader's state as uint32
/// words); None if the group was empty (it goes on from this rank's own state). A rank that
/// is a member already (a first incarnation) returns None at once.
pub fn join(
    core: &Core,
    g: &Group,
    py: Python<'_>,
    own_step: Option<u64>,
) -> PyResult<Option<(u64, View)>> {
    if g.c.membership().contains(g.c.rank()) {
        return Ok(None);
    }
    // The group's steps are 32-bit.
    let asked = own_step.unwrap_or(0);
    let own_step = u32::try_from(asked).map_err(|_| {
        err(format!(
            "join: step {asked} is past the group's last (2^32 - 1)"
        ))
    })?;
    let mut state = vec![0u32; g.state_len];
    let raised = RefCell::new(None);
    core.reg.enter(shm_ring::Phase::Sync);
    let got = crate::detach::released(py, || {
        let stop = Group::stop_on_signal(core, &raised);
        g.c.join(&mut state, own_step, &stop)
    });
    core.reg.enter(shm_ring::Phase::Other);
    if let Some(e) = raised.into_inner() {
        return Err(e);
    }
    let (m, step) = got.map_err(err)?;
    tracing::info!(epoch = m.epoch, step = ?step, "joined the group");
    let lost = proto::ledger::LostSteps::between(g.c.rank(), asked, u64::from(m.step));
    // Recorded also when the ring is drained or the group's end round committed: the rank
    // alone goes on from its own state, and a script saves that state as the run's model
    // (the example does, at its end round), so the updates since its step are in no model.
    // (Skipped once for a drained ring, "the others finished and saved": a lone rank with no
    // checkpoint, back after the last batch, ended the run done with its initial weights
    // saved as the model; one back after a leader that died before its end save, with that
    // leader's older file.)
    if let (None, Some(lost)) = (step, lost) {
        // Admitted alone, with an older state than the group's: recorded before any update of
        // this rank's (the summary counts those batches untrained; a resume trains them).
        record_lost(core, &lost, "join() returns once it is written")?;
        tracing::warn!(checkpoint = asked, "{lost}");
    }
    Ok(step.map(|s| {
        let bytes: Vec<u8> = state.iter().flat_map(|w| w.to_le_bytes()).collect();
        (
            s,
            view::owned("state", Elem::U32, vec![state.len()], &bytes),
        )
    }))
}

/// The leader between steps: admits ranks waiting to join, handing them `state` (any buffer,
/// at most the group's state size). Returns how many were admitted. The state is checked at
/// every call, not only when a rank waits: one that cannot be handed over would otherwise fail
/// the leader only when a rank restarts, hours into the run.
pub fn admit(g: &Group, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<u32> {
    // Any buffer, as its bytes (C order, a strided one too).
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((state,))?;
    let nbytes: usize = view.getattr("nbytes")?.extract()?;
    if nbytes > g.state_len * 4 {
        return Err(err(format!(
            "admit: a state of {nbytes} bytes, but this run's group hands over at most {}",
            g.state_len * 4
        )));
    }
    if !g.c.joiners_waiting() {
        return Ok(0);
    }
    let m = g.c.membership();
    if m.leader() != Some(g.c.rank()) {
        return Ok(0);
    }
    let bytes = view.call_method0("tobytes")?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    let mut words = vec![0u32; g.state_len];
    for (w, c) in words.iter_mut().zip(bytes.chunks(4)) {
        let mut b = [0u8; 4];
        b[..c.len()].copy_from_slice(c);
        *w = u32::from_le_bytes(b);
    }
    let admitted = g.c.admit_joiners(m.step, &words).map_err(err)?;
    Ok(admitted.count_ones())
}

/// `Drafter.checkpointed(step)`: records in the run directory that the group's weights as of
/// `step` are saved (`proto::checkpointed`), for `launcher --resume` to go on from. Refused
/// for a rank that is not a member (a restarted rank before its `join()`: its weights are not
/// the group's yet) and for a step after the last this rank has applied: its last round's, or,
/// before any round, the group's step it started or joined at (no round commits without a
/// member).
pub fn checkpointed(core: &Core, g: &Group, step: u64) -> PyResult<()> {
    let m = g.c.membership();
    if !m.contains(g.c.rank()) {
        return Err(err(format!(
            "checkpointed({step}): this rank is not a member of the group (a restarted rank \
             joins first: join()), so the weights it holds are not the group's"
        )));
    }
    let applied = g.last_step().unwrap_or(u64::from(m.step));
    proto::checkpointed::record(&core.setup.run_dir, step, applied).map_err(err)
}

/// (epoch, last committed step, members) of the group now.
pub fn membership(g: &Group) -> (u16, u64, Vec<u32>) {
    let m = g.c.membership();
    (m.epoch, u64::from(m.step), members(m))
}

/// Records the steps `lost` (`lost-steps.jsonl`), waiting out a full disk as `release()` does
/// for a ledger line: said once in the log, the heartbeat beaten meanwhile (`meanwhile` says
/// what the caller does once it is written), Ctrl-C ending the wait with KeyboardInterrupt.
fn record_lost(core: &Core, lost: &proto::ledger::LostSteps, meanwhile: &str) -> PyResult<()> {
    let raised = RefCell::new(None);
    let stop = Group::stop_on_signal(core, &raised);
    let what = format!("the record of lost steps {}..={}", lost.first, lost.last);
    let wrote = worker_runtime::space::wait_for_space(&what, meanwhile, &mut || !stop(), |w| {
        proto::ledger::record_lost(&core.setup.run_dir, lost, w)
    });
    drop(stop);
    if let Some(e) = raised.into_inner() {
        return Err(e);
    }
    wrote.map_err(err)
}
