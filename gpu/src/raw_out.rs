//! [`RawOut`]: a batch's output sections as addresses, for a target whose copy into them
//! outlives the call that starts it ([`crate::TargetBackend::submit`]). The promise that the
//! memory stays valid is made once, where a `RawOut` is made.

use crate::{GpuError, TargetBackend, TargetOut};

/// A batch's two output sections as addresses; see the module.
pub struct RawOut {
    hidden_states: (*mut u8, usize),
    target_tokens: (*mut u8, usize),
}

// SAFETY: a `RawOut` is two addresses whose validity `RawOut::new`'s caller promised until the
// batch completes; which thread holds them changes nothing of that. The memory is reached only
// through `get`, an `unsafe fn` whose caller promises no copy is in flight into it, or by a copy
// the backend queues.
unsafe impl Send for RawOut {}

impl RawOut {
    /// `out`'s sections, kept beyond `out`'s borrow.
    ///
    /// # Safety
    /// The memory stays valid, and nothing but the backend given this `RawOut` reads or writes
    /// it, until that backend's [`crate::TargetBackend::complete`] has returned for the batch,
    /// or its [`crate::TargetBackend::quiesce`] has returned.
    pub unsafe fn new(out: TargetOut<'_>) -> RawOut {
        RawOut {
            hidden_states: (out.hidden_states.as_mut_ptr(), out.hidden_states.len()),
            target_tokens: (out.target_tokens.as_mut_ptr(), out.target_tokens.len()),
        }
    }

    /// `(address, length)` of the hidden states' section.
    pub fn hidden_states(&self) -> (*mut u8, usize) {
        self.hidden_states
    }

    /// `(address, length)` of the greedy tokens' section.
    pub fn target_tokens(&self) -> (*mut u8, usize) {
        self.target_tokens
    }

    /// The sections as slices, to write them on the host.
    ///
    /// # Safety
    /// The batch has not completed (so the memory is still its own: `new`'s promise), and no
    /// copy is in flight into the sections.
    pub unsafe fn get(&mut self) -> TargetOut<'_> {
        // SAFETY: valid and otherwise untouched while the batch is in flight (`new`'s promise),
        // nothing copies into it now (the caller's); each range came from a `&mut [u8]`, and
        // `&mut self` makes this the only view.
        unsafe {
            TargetOut {
                hidden_states: std::slice::from_raw_parts_mut(
                    self.hidden_states.0,
                    self.hidden_states.1,
                ),
                target_tokens: std::slice::from_raw_parts_mut(
                    self.target_tokens.0,
                    self.target_tokens.1,
                ),
            }
        }
    }
}

/// `backend`'s synchronous forward into `out`, which nothing copies into yet: the default
/// [`TargetBackend::submit`], and the host's path of a backend that also runs on a GPU.
pub(crate) fn forward_now<B: TargetBackend + ?Sized>(
    backend: &mut B,
    input_ids: &[u32],
    seq_lens: &[u32],
    mut out: RawOut,
) -> Result<(), GpuError> {
    // SAFETY: `out` was just submitted (not completed), and this backend queues no copy into it:
    // the forward writes it here and returns.
    backend.forward(input_ids, seq_lens, unsafe { out.get() })
}
