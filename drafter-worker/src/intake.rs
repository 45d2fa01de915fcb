//! The rank's intake: this step's batch and the next one's, taken from the ring and verified on
//! the copy thread ([`gpu::prefetch`] with the [`gpu::in_place`] engine), so the checksum of
//! batch `s+1` runs under step `s`'s compute.

use std::time::Duration;

use anyhow::{bail, Context};
use gpu::in_place::InPlace;
use gpu::prefetch::{Prefetch, PushError};
use gpu::StepBuffer;
use proto::{BatchError, BatchView};
use shm_ring::{Phase, ReadSlot, Take};

use crate::taken::Taken;
use crate::{Held, Next, Rank};

/// Batches taken for this step and the next, each verified on the copy thread.
pub(crate) type Intake<'c> = Prefetch<Taken<'c>, InPlace<Result<(), BatchError>>>;

/// An empty intake.
pub(crate) fn intake<'c>() -> Intake<'c> {
    // SAFETY: the intake lives in its `Rank`, which is dropped normally (never leaked) before
    // the consumer and the ring its slots borrow; a held slot's payload is written by nobody
    // (it is READING, this consumer's).
    unsafe { Prefetch::in_place(verify) }
}

/// The copy-in of a batch: its header parsed and its checksum verified, in its slot.
fn verify(payload: &[u8]) -> Result<(), BatchError> {
    BatchView::parse(payload)?.verify()
}

/// This step's batch as the intake has it: verified, in prefetch buffer `usize`.
pub(crate) enum Got {
    Batch(usize),
    Nothing,
    End,
}

impl<'c> Rank<'c, '_> {
    /// The batch for this step, verified, and its gradient in `mine`: the batch prefetched
    /// during the last step, or one taken now from the preferred bucket (waiting while the
    /// targets may still publish, giving up at once once the ring is closed). A batch that fails
    /// its checksum is refused and another taken. Before computing, the next step's batch is
    /// prefetched. A batch whose content the backend refuses leaves this rank without a batch
    /// for the step.
    pub(crate) fn take_and_compute(&mut self, mine: &mut StepBuffer) -> anyhow::Result<Next<'c>> {
        let buf = match self.verified()? {
            Got::Batch(buf) => buf,
            Got::Nothing => return Ok(Next::Nothing),
            Got::End => return Ok(Next::End),
        };
        self.prefetch()?;
        let taken = self.intake.held(buf).expect("a batch is stepping in buf");
        // Parsed again on this thread (the header only; its checksum was verified).
        let view = BatchView::parse(taken.as_ref())?;
        self.consumer.enter(Phase::Compute);
        let got = self.backend.gradient(&view, mine);
        self.consumer.enter(Phase::Other);
        let spec = &view.header().spec;
        let (sample_ids, tokens) = (spec.sample_ids.clone(), spec.tokens());
        let slot = self.intake.end_step(buf)?.into_slot();
        match got {
            Ok(()) => Ok(Next::Batch(Held::new(slot, sample_ids, tokens))),
            Err(e) => {
                // Content the checksum did not catch: refuse it, train nothing from it.
                self.refuse(slot, &e)?;
                mine.clear();
                Ok(Next::Nothing)
            }
        }
    }

    /// This step's batch, verified, stepping in its prefetch buffer.
    fn verified(&mut self) -> anyhow::Result<Got> {
        let consumer = self.consumer;
        loop {
            if self.intake.is_empty() {
                // Closed: nothing more will be published, so a short look is enough; the
                // batches still held by other ranks are theirs.
                let closed = self.ring.is_closed();
                let timeout = Duration::from_millis(if closed { 1 } else { 200 });
                match consumer.take_timeout_preferring(self.prefer[0], timeout)? {
                    Take::Item(slot) => self.push(slot)?,
                    Take::End => return Ok(Got::End),
                    Take::TimedOut if closed => return Ok(Got::Nothing),
                    Take::TimedOut => continue,
                }
            }
            // Waiting here is waiting for the copy-in (the checksum, on the copy thread).
            consumer.enter(Phase::CopyIn);
            let buf = self.intake.begin_step();
            consumer.enter(Phase::Other);
            let buf = buf?.expect("a batch is held and none is stepping");
            match self.intake.engine().result(buf) {
                Some(Ok(())) => return Ok(Got::Batch(buf)),
                bad => {
                    let slot = self.intake.end_step(buf)?.into_slot();
                    let why = match bad {
                        Some(Err(e)) => e.to_string(),
                        _ => "the copy thread gave no verdict".to_string(),
                    };
                    self.refuse(slot, &why)?;
                }
            }
        }
    }

    /// Takes the next step's batch if one is READY now (never waits: this step's compute
    /// is due) and starts its verification.
    fn prefetch(&mut self) -> anyhow::Result<()> {
        if !self.prefetching || !self.intake.has_room() {
            return Ok(());
        }
        if let Take::Item(slot) =
            (self.consumer).take_timeout_preferring(self.prefer[1], Duration::ZERO)?
        {
            self.push(slot)?;
        }
        Ok(())
    }

    /// Hands a taken batch to the prefetch, which starts verifying it.
    fn push(&mut self, slot: ReadSlot<'c>) -> anyhow::Result<()> {
        match self.intake.push(Taken::new(slot)) {
            Ok(()) => Ok(()),
            // The batch goes back to the ring as the Taken drops.
            Err(PushError::Full(_)) => bail!("prefetch: both buffers hold batches"),
            Err(PushError::Engine(_, e)) => Err(e).context("prefetch: starting a copy-in"),
        }
    }
}
