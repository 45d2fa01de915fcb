//! The target's batches between the forward and the commit: up to the backend's
//! [`gpu::TargetBackend::depth`] submitted, each holding its reserved slot until its results are
//! in it, then checksummed, marked done and committed, oldest first. On a GPU (depth 2) batch
//! `i` is committed after batch `i+1`'s forward was issued, so the forward runs while `i`'s
//! results are copied into its slot; on the host (depth 1) each batch is committed at once.
//!
//! The loop never waits for something while holding a finished batch that the wait could
//! depend on: before waiting for the next gathered batch, or for a free slot, it commits what it
//! holds (the prefetch thread may be waiting for that batch's item to settle; the drafters may
//! need that batch to free a slot).

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::Context;
use gpu::{DeviceClock, RawOut, TargetBackend, TargetOut};
use proto::{BatchSpec, BatchWriter};
use shm_ring::{CommitMeta, Phase, Producer, WriteSlot};

/// A batch whose forward was submitted and whose slot is not yet committed.
struct Submitted<'r> {
    slot: WriteSlot<'r>,
    spec: BatchSpec,
    item: u64,
    bucket: u32,
}

/// The batches in flight of one target; see the module.
pub struct Pipeline<'r, 'b> {
    producer: &'r Producer<'r>,
    backend: &'b mut (dyn TargetBackend + Send),
    in_flight: VecDeque<Submitted<'r>>,
    /// The device's timeline, for a backend that times its work on the device: its spans go
    /// into the ring after each commit.
    clock: Option<Arc<dyn DeviceClock>>,
}

/// What a committed batch adds to the target's report.
pub struct Committed {
    pub tokens: u64,
}

impl<'r, 'b> Pipeline<'r, 'b> {
    pub fn new(producer: &'r Producer<'r>, backend: &'b mut (dyn TargetBackend + Send)) -> Self {
        let clock = backend.device_clock();
        if clock.is_some() {
            producer.set_device_timed(true);
        }
        Pipeline {
            producer,
            backend,
            in_flight: VecDeque::new(),
            clock,
        }
    }

    /// Moves the device's resolved spans into the ring.
    fn device_spans(&mut self) {
        let p = self.producer;
        gpu::device_time::drain_or_stop(
            &mut self.clock,
            |s| p.record_device(s),
            || p.set_device_timed(false),
        );
    }

    /// The producer the batches are written by.
    pub fn producer(&self) -> &'r Producer<'r> {
        self.producer
    }

    /// Batches submitted and not yet committed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether another batch may be submitted before the oldest is committed.
    pub fn has_room(&self) -> bool {
        self.in_flight.len() < self.backend.depth().max(1)
    }

    /// Writes the batch's ids and mask into `slot`, issues its forward (whose results may still
    /// be on their way when this returns) and keeps the slot until [`Pipeline::commit_oldest`].
    pub fn submit(
        &mut self,
        mut slot: WriteSlot<'r>,
        spec: BatchSpec,
        input_ids: &[u32],
        loss_mask: &[u8],
        item: u64,
        bucket: u32,
    ) -> anyhow::Result<()> {
        debug_assert!(self.has_room());
        let mut w = BatchWriter::new(slot.payload_mut(), &spec)?;
        let sections = w.sections_mut();
        for (dst, id) in sections.input_ids.chunks_exact_mut(4).zip(input_ids) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        sections.loss_mask.copy_from_slice(loss_mask);
        // SAFETY: the slot is kept in `in_flight` until `complete` returned for this batch, and
        // nothing here touches its payload meanwhile; on any way out without that (an error, a
        // stop, a panic) `Drop` quiesces the backend before the slots go. The payload lies in
        // the ring's mapping, which outlives this pipeline (`'r`), and does not move with the
        // slot handle.
        let out = unsafe {
            RawOut::new(TargetOut {
                hidden_states: sections.hidden_states,
                target_tokens: sections.target_tokens,
            })
        };
        self.producer.enter(Phase::Compute);
        let r = self.backend.submit(input_ids, &spec.seq_lens, out);
        self.producer.enter(Phase::Other);
        r.with_context(|| format!("the target's forward of batch {item}"))?;
        self.in_flight.push_back(Submitted {
            slot,
            spec,
            item,
            bucket,
        });
        Ok(())
    }

    /// Waits for the oldest batch's results, checksums and commits it; `None` if none is in
    /// flight.
    pub fn commit_oldest(&mut self) -> anyhow::Result<Option<Committed>> {
        if self.in_flight.is_empty() {
            return Ok(None);
        }
        // Waiting for the device's forward and copy of the batch.
        self.producer.enter(Phase::Compute);
        let r = self.backend.complete();
        self.producer.enter(Phase::Other);
        r.context("the target's copy of a batch into its slot")?;
        let Submitted {
            mut slot,
            spec,
            item,
            bucket,
        } = self.in_flight.pop_front().expect("checked above");
        BatchWriter::new(slot.payload_mut(), &spec)?.finish();
        slot.complete_work(item)?;
        let tokens = spec.tokens();
        slot.commit(CommitMeta {
            bucket,
            tokens,
            batch_id: item,
        })?;
        self.device_spans();
        Ok(Some(Committed { tokens }))
    }
}

impl Drop for Pipeline<'_, '_> {
    fn drop(&mut self) {
        // No copy may write a slot once it is given back (the slots drop after this body).
        if !self.in_flight.is_empty() {
            self.backend.quiesce();
        }
        self.device_spans();
        if let Some(c) = &self.clock {
            tracing::info!(device = %c.totals(), "the device's time");
        }
    }
}

#[cfg(test)]
mod tests;
