//! The rank's intake: this step's batch and the next one's, taken from the ring and verified on
//! the copy thread ([`gpu::prefetch`] with the [`gpu::in_place`] engine), then staged there by
//! the backend's [`gpu::Stager`] (on a GPU: copied to the device on the drafter's copy stream),
//! so the checksum and the copy of batch `s+1` run under step `s`'s compute.

use std::time::Duration;

use anyhow::{bail, Context};
use gpu::in_place::InPlace;
use gpu::prefetch::{Prefetch, PushError};
use gpu::{GpuError, Staged, Stager, StepBuffer};
use proto::{BatchError, BatchView};
use shm_ring::{Phase, ReadSlot, Take};

use crate::taken::Taken;
use crate::{Held, Next, Rank};

/// What the copy thread made of a batch: verified, then staged if the backend stages (its
/// error is the step's: the batch is refused as content the backend cannot take).
type Prepared = Result<Option<Result<Staged, GpuError>>, BatchError>;

/// Batches taken for this step and the next, each verified and staged on the copy thread.
pub(crate) type Intake<'c> = Prefetch<Taken<'c>, InPlace<Prepared>>;

/// An empty intake, staging with `stager` (the backend's).
pub(crate) fn intake<'c>(stager: Option<Stager>) -> Intake<'c> {
    // SAFETY: the intake lives in its `Rank`, which is dropped normally (never leaked) before
    // the consumer and the ring its slots borrow; a held slot's payload is written by nobody
    // (it is READING, this consumer's).
    unsafe { Prefetch::in_place(move |payload| prepare(payload, stager.as_ref())) }
}

/// The copy-in of a batch: its header parsed and its checksum verified, in its slot, then
/// staged.
fn prepare(payload: &[u8], stager: Option<&Stager>) -> Prepared {
    let view = BatchView::parse(payload)?;
    view.verify()?;
    Ok(stager.map(|stage| stage(&view)))
}

/// This step's batch as the intake has it: verified, in prefetch buffer `usize`, with what the
/// backend staged of it.
pub(crate) enum Got {
    Batch(usize, Option<Result<Staged, GpuError>>),
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
        let (buf, staged) = match self.verified()? {
            Got::Batch(buf, staged) => (buf, staged),
            Got::Nothing => return Ok(Next::Nothing),
            Got::End => return Ok(Next::End),
        };
        if let Some(Err(e)) = &staged {
            if e.is_device_failure() {
                // The device failed, not the batch (out of memory, a lost context): this rank
                // fails, and its batches go back to the ring untrained as the intake drops.
                bail!("staging a batch on the device: {e}");
            }
        }
        self.prefetch()?;
        let taken = self.intake.held(buf).expect("a batch is stepping in buf");
        // Parsed again on this thread (the header only; its checksum was verified).
        let view = BatchView::parse(taken.as_ref())?;
        self.consumer.enter(Phase::Compute);
        // A death from here to the gradient's end is held against this batch by the launcher
        // (`--set-aside-after`): the batch, not the rank, may be what kills.
        self.consumer.set_in_hand(Some(view.header().spec.batch_id));
        let got = match staged {
            None => self.backend.gradient(&view, mine),
            Some(Ok(staged)) => self.backend.gradient_staged(&view, staged, mine),
            Some(Err(e)) => Err(e),
        };
        self.consumer.set_in_hand(None);
        self.consumer.enter(Phase::Other);
        let spec = &view.header().spec;
        let (batch_id, sample_ids, tokens) =
            (spec.batch_id, spec.sample_ids.clone(), spec.tokens());
        let slot = self.intake.end_step(buf)?.into_slot();
        match got {
            Ok(()) => Ok(Next::Batch(Held::new(slot, sample_ids, tokens))),
            Err(e) if e.is_device_failure() => {
                // The device failed on this batch (out of memory, a lost context): the rank
                // fails with the batch in hand, left READING for the launcher, which delivers it
                // again and sets it aside if it keeps killing drafters. Refused, it would be
                // lost to a fault that may be this GPU's alone.
                self.consumer.set_in_hand(Some(batch_id));
                drop(Held::new(slot, sample_ids, tokens));
                bail!("computing the gradient of batch {batch_id}: {e}");
            }
            Err(e) => {
                // Content the checksum did not catch (or a batch the backend cannot take):
                // refuse it, train nothing from it.
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
                Some(Ok(staged)) => return Ok(Got::Batch(buf, staged)),
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
