//! A reserved ring slot of a Python target: writable views of its sections, then `commit()`
//! (or `abort()`). Dropped with neither, on any thread, it is handed to its target
//! (`TargetCore::dropped`; from another thread through `local`, at the target's next call),
//! which keeps it while views of it live, then gives it back with its work item, and raises at
//! its next call (`TargetCore::forgot`: a loop that never commits would spin for ever). Its data and
//! views may be had on any thread; `commit()` and `abort()` are its target's thread's.

use std::rc::Rc;
use std::sync::Arc;

use proto::{BatchSpec, BatchWriter};
use pyo3::prelude::*;
use shm_ring::{CommitMeta, WriteSlot};

use crate::common::{close_views, err};
use crate::local::Local;
use crate::target::{Forgotten, TargetCore, SECTIONS};
use crate::view::{self, Elem, Exports, View};

/// A reserved ring slot: views of its sections to fill, then `commit()`. Its data and views
/// answer on any thread, `commit()` and `abort()` on its target's; dropped uncommitted on any
/// thread, it is given back.
#[pyclass(module = "hspipe")]
pub struct Slot {
    item: u64,
    spec: BatchSpec,
    bucket: u32,
    exports: Arc<Exports>,
    /// Each section's address and length, in `SECTIONS` order.
    at: [(usize, usize); 4],
    held: Local<Held>,
}

/// What of a slot only its target's thread touches: the target and the ring slot.
struct Held {
    t: Rc<TargetCore>,
    /// None once committed or aborted.
    slot: Option<WriteSlot<'static>>,
    item: u64,
    exports: Arc<Exports>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Neither committed nor aborted: a bug in the target's loop, said and raised at
            // its next call (`TargetCore::forgot`); the slot is given back once nothing views
            // it.
            self.t.forgot(self.item, Forgotten::Slot);
            (self.t).dropped(slot, self.item, Arc::clone(&self.exports));
        }
    }
}

impl Slot {
    /// Slot `slot` of `t`'s, reserved for batch `item`; owned by this thread.
    pub(crate) fn new(
        t: Rc<TargetCore>,
        slot: WriteSlot<'static>,
        item: u64,
        spec: BatchSpec,
        bucket: u32,
        at: [(usize, usize); 4],
    ) -> Slot {
        let exports = Exports::new(&SECTIONS);
        let held = Held {
            t,
            slot: Some(slot),
            item,
            exports: Arc::clone(&exports),
        };
        Slot {
            item,
            spec,
            bucket,
            exports,
            at,
            held: Local::new("hspipe.Slot", held),
        }
    }

    fn view(
        &self,
        section: usize,
        elem: Elem,
        shape: Vec<usize>,
        writable: bool,
    ) -> PyResult<View> {
        // Closed before a commit or abort, and never opened again.
        if self.exports.is_closed() {
            return Err(err(format!(
                "batch {}: its slot was committed or aborted",
                self.item
            )));
        }
        let at = self.at[section];
        view::of_slot(&self.exports, &SECTIONS, section, at, elem, shape, writable)
    }

    fn n_tokens(&self) -> usize {
        self.spec.tokens() as usize
    }
}

#[pymethods]
impl Slot {
    /// The planned batch's id (its index in the plan).
    #[getter]
    fn batch_id(&self) -> u64 {
        self.item
    }
    /// The token ids, uint32 [T], read-only (already written).
    #[getter]
    fn input_ids(&self) -> PyResult<View> {
        self.view(0, Elem::U32, vec![self.n_tokens()], false)
    }
    /// The loss mask, uint8 [T], read-only (already written).
    #[getter]
    fn loss_mask(&self) -> PyResult<View> {
        self.view(1, Elem::U8, vec![self.n_tokens()], false)
    }
    /// The target's greedy next token after each position, uint32 [T], to write.
    #[getter]
    fn target_tokens(&self) -> PyResult<View> {
        self.view(2, Elem::U32, vec![self.n_tokens()], true)
    }
    /// The captured layers' hidden states, [T, L, H] in the run's dtype (bf16 by default), to
    /// write.
    #[getter]
    fn hidden_states(&self) -> PyResult<View> {
        let s = &self.spec;
        let shape = vec![self.n_tokens(), s.layers as usize, s.hidden as usize];
        self.view(3, Elem::of(s.dtype), shape, true)
    }

    /// Publishes the batch: checksums it, writes its header, marks its work item done and
    /// makes it READY. Raises, naming them, while views of it are alive (or waits up to `wait`
    /// seconds for them to go).
    #[pyo3(signature = (wait=None))]
    fn commit(&mut self, py: Python<'_>, wait: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let wait = crate::args::seconds("commit()", "wait", wait.as_ref())?;
        let what = format!("commit batch {}", self.item);
        let h = self.held.get_mut()?;
        if h.slot.is_none() {
            return Err(err(format!("{what}: already committed or aborted")));
        }
        close_views(&h.t.core, py, &h.exports, &what, wait)?;
        let mut slot = h.slot.take().expect("checked above");
        BatchWriter::new(slot.payload_mut(), &self.spec)
            .map_err(err)?
            .finish();
        slot.complete_work(self.item).map_err(err)?;
        let tokens = self.spec.tokens();
        slot.commit(CommitMeta {
            bucket: self.bucket,
            tokens,
            batch_id: self.item,
        })
        .map_err(err)?;
        h.t.committed(self.item, tokens);
        Ok(())
    }

    /// Gives the slot back unpublished, and its batch back to the work table.
    #[pyo3(signature = (wait=None))]
    fn abort(&mut self, py: Python<'_>, wait: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let wait = crate::args::seconds("abort()", "wait", wait.as_ref())?;
        let h = self.held.get_mut()?;
        if h.slot.is_none() {
            return Ok(());
        }
        close_views(
            &h.t.core,
            py,
            &h.exports,
            &format!("abort batch {}", h.item),
            wait,
        )?;
        drop(h.slot.take());
        h.t.aborted(h.item);
        Ok(())
    }
}
