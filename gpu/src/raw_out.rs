//! [`RawOut`]: a batch's output sections as addresses, for a target whose copy into them
//! outlives the call that starts it ([`crate::TargetBackend::submit`]). The promise that the
//! memory stays valid is made once, where a `RawOut` is made.

use crate::TargetOut;

/// A batch's two output sections as addresses; see the module.
pub struct RawOut {
    hidden_states: (*mut u8, usize),
    target_tokens: (*mut u8, usize),
}

// SAFETY: a `RawOut` is two addresses whose validity `RawOut::new`'s caller promised until the
// batch completes; which thread holds them changes nothing of that, and the memory is reached
// only through `get` (`&mut self`) or by a copy the backend queues, never by two at once.
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

    /// The sections as slices, to write them on the host (no copy may be in flight into them:
    /// the backend's own business).
    pub fn get(&mut self) -> TargetOut<'_> {
        // SAFETY: valid and otherwise untouched while the batch is in flight (`new`'s promise);
        // each range came from a `&mut [u8]`, and `&mut self` makes this the only view.
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
