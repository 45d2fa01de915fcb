//! A batch a Python drafter took: read-only zero-copy views of its sections, and `release()`
//! after the update that used it (the ledger line, then the slot freed: `DrafterCore`). Dropped
//! unreleased, it is handed to its drafter (`DrafterCore::sweep`), which keeps it while views of
//! it live.

use std::rc::Rc;
use std::sync::Arc;

use proto::BatchHeader;
use pyo3::prelude::*;
use shm_ring::ReadSlot;

use crate::common::{close_views, err};
use crate::drafter::DrafterCore;
use crate::view::{Elem, Exports, View};

pub const SECTIONS: [&str; 4] = ["input_ids", "loss_mask", "target_tokens", "hidden_states"];

/// A batch taken from the ring: read-only views of its sections, then `release()` after the
/// update that used it.
#[pyclass(unsendable, module = "hspipe")]
pub struct Batch {
    pub(crate) d: Rc<DrafterCore>,
    pub(crate) slot: Option<ReadSlot<'static>>,
    pub(crate) header: BatchHeader,
    pub(crate) base: usize,
    pub(crate) exports: Arc<Exports>,
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
        let at = (self.base + s.offset as usize, s.len as usize);
        crate::view::of_slot(&self.exports, &SECTIONS, section, at, elem, shape, false)
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
            (self.d).dropped(slot, Arc::clone(&self.exports), self.header.clone());
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
        if self.slot.is_none() {
            return Err(err(format!("{what}: already released")));
        }
        close_views(&d.core, py, &self.exports, &what, wait)?;
        let step = step.or(d.group.last_step()).unwrap_or(d.releases.get() + 1);
        d.settle_trained(
            &mut self.slot,
            &self.header,
            step,
            digest.unwrap_or_default(),
        )
        .map_err(|e| err(format!("{what}: {e}")))
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
