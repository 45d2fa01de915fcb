//! A batch a Python drafter took: read-only zero-copy views of its sections, and `release()`
//! after the update that used it (the ledger line, then the slot freed: `DrafterCore`). Dropped
//! unreleased, on any thread, it is handed to its drafter (`DrafterCore::dropped`; from another
//! thread through `local`, at the drafter's next call), which keeps it while views of it live.
//! Its data and views may be read from any thread; `release()` is its drafter's thread's.

use std::rc::Rc;
use std::sync::Arc;

use proto::BatchHeader;
use pyo3::prelude::*;
use shm_ring::{ItemMeta, ReadSlot};

use crate::common::{close_views, err};
use crate::drafter::DrafterCore;
use crate::local::Local;
use crate::view::{Elem, Exports, View};

pub const SECTIONS: [&str; 4] = ["input_ids", "loss_mask", "target_tokens", "hidden_states"];

/// A batch taken from the ring: read-only views of its sections, then `release()` after the
/// update that used it. Its data and views answer on any thread, `release()` on its drafter's;
/// dropped unreleased on any thread, it goes back to the ring (see the README).
#[pyclass(module = "hspipe")]
pub struct Batch {
    header: BatchHeader,
    meta: ItemMeta,
    /// The payload's address: the sections' offsets are from it.
    base: usize,
    exports: Arc<Exports>,
    pub(crate) held: Local<Held>,
}

/// What of a batch only its drafter's thread touches: the drafter and the ring slot.
pub(crate) struct Held {
    d: Rc<DrafterCore>,
    /// None once released.
    pub(crate) slot: Option<ReadSlot<'static>>,
    header: BatchHeader,
    exports: Arc<Exports>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let batch = self.header.spec.batch_id;
            self.d.taken.borrow_mut().retain(|&b| b != batch);
            (self.d).dropped(slot, Arc::clone(&self.exports), self.header.clone());
        }
    }
}

impl Batch {
    /// A batch of `d`'s, verified, its header `header`; owned by this thread.
    pub(crate) fn new(d: Rc<DrafterCore>, slot: ReadSlot<'static>, header: BatchHeader) -> Batch {
        let exports = Exports::new(&SECTIONS);
        Batch {
            meta: *slot.meta(),
            base: slot.payload().as_ptr() as usize,
            header: header.clone(),
            exports: Arc::clone(&exports),
            held: Local::new(
                "hspipe.Batch",
                Held {
                    d,
                    slot: Some(slot),
                    header,
                    exports,
                },
            ),
        }
    }

    fn view(&self, section: usize, elem: Elem, shape: Vec<usize>) -> PyResult<View> {
        // Closed before its release, and never opened again: a released batch's are.
        if self.exports.is_closed() {
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

#[pymethods]
impl Batch {
    /// The batch's id (its index in the run's plan), as its ledger line records it.
    #[getter(batch_id)]
    fn py_batch_id(&self) -> u64 {
        self.batch_id()
    }
    /// The ids of the samples in it (their rows in the dataset), one per sequence.
    #[getter]
    fn sample_ids(&self) -> Vec<u64> {
        self.header.spec.sample_ids.clone()
    }
    /// Tokens of each sequence; the sections hold them one after another.
    #[getter]
    fn seq_lens(&self) -> Vec<u32> {
        self.header.spec.seq_lens.clone()
    }
    /// Tokens in all (T: the sum of `seq_lens`).
    #[getter]
    fn tokens(&self) -> u64 {
        self.header.spec.tokens()
    }
    /// The length bucket the target published it in.
    #[getter]
    fn bucket(&self) -> u32 {
        self.meta.bucket
    }
    /// Earlier deliveries of this batch to drafters that died holding it (0 the first time).
    #[getter]
    fn delivery(&self) -> u32 {
        self.meta.delivery
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
    /// and the weights' digest after it), then frees its slot. The step is by default that of
    /// the committed round that named the batch (`all_reduce(..., batch=b)`), else this rank's
    /// last round's, or its count of releases for a rank that never took part in one; another
    /// step than the round's that named it, or one past the group's last, is refused (a resume
    /// keeps or trains a batch again by its line's step). Raises, naming them, while views of it
    /// are alive (or waits up to `wait` seconds for them to go).
    #[pyo3(signature = (step=None, digest=None, wait=None))]
    fn release(
        &mut self,
        py: Python<'_>,
        step: Option<Bound<'_, PyAny>>,
        digest: Option<String>,
        wait: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let step = crate::args::maybe_unsigned(
            "release()",
            "step",
            "the group step whose update used the batch (r.step)",
            u64::MAX,
            step.as_ref(),
        )?;
        let wait = crate::args::seconds("release()", "wait", wait.as_ref())?;
        let batch = self.batch_id();
        let what = format!("release batch {batch}");
        let h = self.held.get_mut()?;
        let d = Rc::clone(&h.d);
        if h.slot.is_none() {
            return Err(err(format!("{what}: already released")));
        }
        let step = (d.release_step(batch, step)).map_err(|e| err(format!("{what}: {e}")))?;
        close_views(&d.core, py, &h.exports, &what, wait)?;
        // A full disk is waited out; Ctrl-C (a KeyboardInterrupt) ends the wait, the batch
        // still held.
        let mut interrupt = None;
        let mut interrupted = || match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                interrupt = Some(e);
                true
            }
        };
        let settled = d.settle_trained(
            &mut h.slot,
            &h.header,
            step,
            digest.unwrap_or_default(),
            &mut interrupted,
        );
        if let Some(e) = interrupt {
            return Err(e);
        }
        settled.map_err(|e| err(format!("{what}: {e}")))
    }

    fn __repr__(&self) -> String {
        format!(
            "<hspipe.Batch {} of {} tokens{}>",
            self.batch_id(),
            self.n_tokens(),
            if self.exports.is_closed() {
                ", released"
            } else {
                ""
            }
        )
    }
}
