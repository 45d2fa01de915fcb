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
//!
//! # The batch in hand
//!
//! The launcher holds a target's death against the batch it says it has in hand
//! (`Producer::set_in_hand`), and sets a batch aside that several deaths are held against. So a
//! batch is said to be in hand only while an error would be its own: while its forward is
//! issued and while its results are waited for, if it is alone on the device. A device reports
//! a kernel's fault at a later call, and every call after: with two batches in flight, an error
//! waiting for the older one may be the newer one's, and an error issuing the newer one may be
//! the older one's; in that case the older ones are committed first, and only if they are is the
//! error the newer one's (an out-of-memory at its own allocation). Nothing is held in hand when
//! it is not known whose the error is.
//!
//! So a batch whose fault the device reports late (a kernel's) kills its target unattributed.
//! Its work item comes back RETURNED (`shm_ring::WorkClaim::Returned`), and whoever claims it
//! next runs it alone: the batches before it are committed first, and it is committed before
//! the next one is issued, so it is in hand from its forward to its commit and the death it
//! causes is held against it.

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::Context;
use gpu::{DeviceClock, RawOut, TargetBackend, TargetOut};
use proto::{BatchSpec, BatchWriter};
use shm_ring::{CommitMeta, Phase, Producer, WriteSlot};

use crate::Gathered;

/// A batch whose forward was submitted and whose slot is not yet committed.
struct Submitted<'r> {
    slot: WriteSlot<'r>,
    spec: BatchSpec,
    item: u64,
    bucket: u32,
    /// Run alone: nothing else is issued until it is committed.
    alone: bool,
}

/// The batches in flight of one target; see the module.
pub struct Pipeline<'r, 'b> {
    producer: &'r Producer<'r>,
    backend: &'b mut (dyn TargetBackend + Send),
    in_flight: VecDeque<Submitted<'r>>,
    /// The device's timeline, for a backend that times its work on the device: its spans go
    /// into the ring after each commit.
    clock: Option<Arc<dyn DeviceClock>>,
    /// Batches it keeps in flight: the backend's depth, or `[target] depth` (`with_depth`).
    depth: usize,
    /// Faults injected into the forward, for any backend (`crash_on_sample`, `fail_on_sample`,
    /// `fault_on_sample`).
    faults: proto::config::Faults,
    /// An injected kernel fault: every call on the device fails from the one after it.
    faulted: Option<String>,
    /// Every batch committed, whichever call committed it (`commit_oldest`, or a drain
    /// before a batch run alone).
    totals: Totals,
}

/// Batches committed so far, and their tokens: the target's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub items: u64,
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
            depth: backend.depth().max(1),
            backend,
            in_flight: VecDeque::new(),
            clock,
            faults: proto::config::Faults::default(),
            faulted: None,
            totals: Totals::default(),
        }
    }

    /// Keeps `depth` batches in flight (`[target] depth`), as far as the backend can hold them;
    /// 0: the backend's own depth.
    pub fn with_depth(mut self, depth: u32) -> Self {
        if depth > 0 {
            self.depth = (depth as usize).min(self.backend.max_depth()).max(1);
        }
        self
    }

    /// Injects `faults`' `crash_on_sample`, `fail_on_sample` and `fault_on_sample` into the
    /// forward of any batch holding that sample, whatever the backend.
    pub fn injecting(mut self, faults: proto::config::Faults) -> Self {
        self.faults = faults;
        self
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

    /// Batches committed so far, and their tokens.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Batches submitted and not yet committed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether another batch may be submitted before the oldest is committed (never while a
    /// batch run alone is in flight).
    pub fn has_room(&self) -> bool {
        self.in_flight.len() < self.depth && !self.in_flight.back().is_some_and(|s| s.alone)
    }

    /// Writes the batch's ids and mask into `slot`, issues its forward (whose results may still
    /// be on their way when this returns) and keeps the slot until [`Pipeline::commit_oldest`].
    /// A batch run `alone` has the batches in flight committed first, and nothing more is
    /// issued until it is committed (its last target died with it: see the module doc).
    pub fn submit(&mut self, mut slot: WriteSlot<'r>, batch: Gathered) -> anyhow::Result<()> {
        debug_assert!(self.has_room());
        let Gathered {
            item,
            spec,
            input_ids,
            loss_mask,
            bucket,
            alone,
        } = batch;
        if alone {
            tracing::info!(
                batch = item,
                "running batch {item} alone: its last target died with it"
            );
            self.drain()?;
        }
        let mut w = BatchWriter::new(slot.payload_mut(), &spec)?;
        let sections = w.sections_mut();
        for (dst, id) in sections.input_ids.chunks_exact_mut(4).zip(&input_ids) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        sections.loss_mask.copy_from_slice(&loss_mask);
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
        // The batch in hand while its forward is issued alone on the device, left set if that
        // fails: the death that follows is held against it (see "The batch in hand" in the
        // module doc). With older batches in flight, a crash or a hang while issuing it may be
        // theirs (an error is sorted out below).
        let alone_on_device = self.in_flight.is_empty();
        self.producer.set_in_hand(alone_on_device.then_some(item));
        self.producer.enter(Phase::Compute);
        let r = self.inject(&spec).and_then(|()| {
            self.backend.submit(&input_ids, &spec.seq_lens, out)?;
            Ok(())
        });
        self.producer.enter(Phase::Other);
        if let Err(e) = r {
            // With older batches in flight the error may be theirs, reported late: it is this
            // batch's own only if they all complete (and are published, not lost). Nothing is in
            // hand meanwhile (a wait that hangs is not theirs either).
            let e = e.context(format!("the target's forward of batch {item}"));
            if self.in_flight.is_empty() {
                return Err(e);
            }
            self.producer.set_in_hand(None);
            let drained = self.drain();
            self.producer.set_in_hand(drained.is_ok().then_some(item));
            return Err(match drained {
                Ok(()) => e,
                Err(older) => e.context(format!("after an earlier batch failed: {older:#}")),
            });
        }
        self.producer.set_in_hand(None);
        self.in_flight.push_back(Submitted {
            slot,
            spec,
            item,
            bucket,
            alone,
        });
        Ok(())
    }

    /// Waits for the oldest batch's results, checksums and commits it; false if none is in
    /// flight.
    pub fn commit_oldest(&mut self) -> anyhow::Result<bool> {
        self.commit_front(true)
    }

    /// [`Pipeline::commit_oldest`], saying the batch is in hand while it is waited for (if
    /// `say_in_hand` and it is alone on the device).
    fn commit_front(&mut self, say_in_hand: bool) -> anyhow::Result<bool> {
        if self.in_flight.is_empty() {
            return Ok(false);
        }
        // Waiting for the device's forward and copy of the batch, which stays in `in_flight`
        // until they are done (on an error, `Drop` quiesces the backend before its slot goes).
        // In hand only if it is alone on the device: otherwise an error may be the next one's.
        let item = self.in_flight.front().map_or(0, |s| s.item);
        let in_hand = say_in_hand && self.in_flight.len() == 1;
        if say_in_hand {
            self.producer.set_in_hand(in_hand.then_some(item));
        }
        self.producer.enter(Phase::Compute);
        let r = match &self.faulted {
            Some(f) => Err(anyhow::anyhow!("{f}")),
            None => self.backend.complete().map_err(anyhow::Error::from),
        };
        self.producer.enter(Phase::Other);
        r.with_context(|| {
            format!("batch {item}: the target's forward and its copy into its slot")
        })?;
        if say_in_hand {
            self.producer.set_in_hand(None);
        }
        let Submitted {
            mut slot,
            spec,
            item,
            bucket,
            ..
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
        self.totals.items += 1;
        self.totals.tokens += tokens;
        Ok(true)
    }

    /// Commits every batch in flight, oldest first, saying nothing of the batch in hand.
    fn drain(&mut self) -> anyhow::Result<()> {
        while self.commit_front(false)? {}
        Ok(())
    }
}

impl Pipeline<'_, '_> {
    /// The forward's injected faults (`[faults.target-N]`), before a batch's forward is issued:
    /// abort, or fail as a device fails, on a batch holding the sample named; or, for
    /// `fault_on_sample`, issue it and fail every call on the device from the next one on, as a
    /// device does after a kernel's fault (reported late, and sticky).
    fn inject(&mut self, spec: &BatchSpec) -> anyhow::Result<()> {
        if let Some(f) = &self.faulted {
            anyhow::bail!("{f}");
        }
        let holds = |n: Option<u64>| n.filter(|n| spec.sample_ids.contains(n));
        if let Some(n) = holds(self.faults.crash_on_sample) {
            tracing::error!(batch = spec.batch_id, "injected crash on sample {n}");
            std::process::abort();
        }
        if let Some(n) = holds(self.faults.fail_on_sample) {
            anyhow::bail!("injected device failure (out of memory) on sample {n}");
        }
        if let Some(n) = holds(self.faults.fault_on_sample) {
            self.faulted = Some(format!(
                "injected kernel fault on sample {n} (batch {}), reported late",
                spec.batch_id
            ));
        }
        Ok(())
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
