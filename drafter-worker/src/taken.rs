//! A batch taken from the ring for a coming step and not yet trained: what the prefetch holds
//! while the batch is prepared on the copy thread. Dropped unused (an error, a stop), it goes
//! back to the ring for another rank rather than counting as consumed: a batch is released only
//! once the update that used it is applied.

use shm_ring::ReadSlot;

pub struct Taken<'c>(Option<ReadSlot<'c>>);

impl<'c> Taken<'c> {
    pub fn new(slot: ReadSlot<'c>) -> Self {
        Taken(Some(slot))
    }

    pub fn slot(&self) -> &ReadSlot<'c> {
        self.0
            .as_ref()
            .expect("a Taken holds its slot until into_slot")
    }

    /// The slot, to be trained on (its owner now releases it).
    pub fn into_slot(mut self) -> ReadSlot<'c> {
        self.0
            .take()
            .expect("a Taken holds its slot until into_slot")
    }
}

impl AsRef<[u8]> for Taken<'_> {
    fn as_ref(&self) -> &[u8] {
        self.slot().payload()
    }
}

// SAFETY: the payload lies in the ring's shared mapping, at the slot's fixed place, and the
// mapping outlives the consumer the slot borrows; moving a `Taken` moves the handle, not the
// bytes.
unsafe impl gpu::prefetch::StableBytes for Taken<'_> {}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            let batch = slot.meta().batch_id;
            if let Err(e) = slot.requeue() {
                tracing::warn!(batch, error = %e, "giving back a prefetched batch");
            }
        }
    }
}
