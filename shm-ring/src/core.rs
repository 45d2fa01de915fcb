//! The lock-free slot state machine, independent of where its memory lives (a shared-memory
//! segment in production, the heap in loom models and unit tests).
//!
//! Length: the transitions and the narration of their Release/Acquire pairs stay together; the
//! work table, recovery and take policy already live in `core/`.
//!
//! # States
//!
//! Every slot has one 64-bit state word `state | owner << 8 | generation << 24`:
//!
//! ```text
//!            reserve (producer p)          commit (p)
//!   FREE ─────────────────────────▶ WRITING(p) ───────────▶ READY ──────────┐
//!    ▲  ◀──────────────────────────────┘ abort (p)            ▲  take (c)   │
//!    │   recover(p): p died mid-write                          │            ▼
//!    └──────────────────── release (c) ────────────────── READING(c) ◀─────┘
//!                          recover(c), or requeue (c): back to READY, delivery + 1
//! ```
//!
//! Each arrow is ONE compare-and-swap of the whole word, and every CAS bumps the generation,
//! so a stale expectation (the slot moved and came back) never succeeds. Only the owner named
//! in the word moves a WRITING or READING slot, except recovery, which runs only while it holds
//! the owner's lease, taken from a process judged gone (see "Registration and recovery"); FREE
//! and READY slots are claimed by whoever wins the CAS. So at any time at most one process may
//! touch a slot's payload: the writer while WRITING, the reader while READING.
//!
//! # Memory ordering
//!
//! - commit's Release CAS (WRITING→READY) pairs with take's Acquire CAS (READY→READING): the
//!   reader sees the payload and metadata the writer stored.
//! - release's Release CAS (READING→FREE) pairs with reserve's Acquire CAS (FREE→WRITING): the
//!   reader's last look at the payload happens before the next writer overwrites it.
//! - requeue's Release CAS (READING→READY, by the owner) pairs with take's Acquire CAS, as
//!   recovery's does: the next reader sees the bumped delivery count.
//! - finish's AcqRel CAS of the producer's `finished` flag pairs with the Acquire loads of
//!   every flag in whichever finish (or retire) finds them all set; that call's AcqRel CAS of
//!   `closed` pairs with the consumers' Acquire load, so a consumer that sees the ring closed
//!   also sees every item ever committed. The flags, not a count, decide the close, so a
//!   producer killed inside `finish` is closed over by any later finish or retire; a SeqCst
//!   fence between writing one's flag and reading the others' keeps two last producers from
//!   both missing each other's flag.
//!
//! A stale incarnation (a process that lost its registration, e.g. one that hung, was
//! recovered, then woke) can never commit or release a slot that has since moved: its claim
//! holds the whole word, generation included, so its CAS fails with `Reclaimed`. `commit` and
//! `complete_work` compare that word before they write anything, so such a writer also changes
//! none of the slot's metadata or work link, which belong to the slot's new writer.
//!
//! FIFO is "the oldest ticket among the READY slots one scan saw": tickets are drawn just before
//! the commit CAS, so a ticket drawn earlier can become READY after a later one, or land in a
//! slot the scan had already passed. Across producers the order is approximately, not exactly,
//! publish order; a single producer whose commits all precede the take is served in order.
//!
//! # Work items
//!
//! See `work.rs`: the work table, by which producers claim planned batches.
//!
//! # Registration and recovery
//!
//! See `recovery.rs`: leases, registration, and recovery of a dead worker's slots and claims.
//!
//! # End of stream
//!
//! A consumer gets end-of-stream only when the ring is closed and no slot is READY, WRITING, or
//! READING by another consumer: a batch held by a consumer that then dies goes back to READY and
//! must still find a live consumer, so nobody leaves while one is in flight.

use std::time::{Duration, Instant};

use crate::layout::*;
use crate::params::TakePolicy;

mod recovery;
mod take;
mod work;

use crate::error::RingError;
use crate::phase::Phase;
use crate::sync::{self, AtomicU64, Ordering};
pub(crate) use recovery::Settling;
pub use recovery::{Recovered, Settle};
pub(crate) use take::{choose_bucket, TakeState};
use work::Undone;
pub use work::WorkClaim;

/// The longest a waiter sleeps before it looks again (bounded so that waiters notice stop
/// requests, closed rings and recovered slots even if a wake-up were lost): the one slice every
/// shared-memory waiter uses.
pub(crate) const MAX_SLEEP: Duration = shmem::sync::WAIT_SLICE;

/// Plain copies of the parameters the state machine needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CoreParams {
    pub producers: u32,
    pub buckets: u32,
    pub policy: TakePolicy,
}

/// A view of one ring's shared state.
#[derive(Clone, Copy)]
pub(crate) struct RingRef<'a> {
    pub params: CoreParams,
    pub ctl: &'a Control,
    pub slots: &'a [SlotRecord],
    pub workers: &'a [WorkerRecord],
    pub work: &'a [AtomicU64],
}

/// What a producer stores with an item.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitMeta {
    /// Length class of the item; must be below the ring's bucket count.
    pub bucket: u32,
    /// Tokens the item carries (telemetry and the consumers' accounting).
    pub tokens: u64,
    /// Caller's id for the item.
    pub batch_id: u64,
}

/// What a consumer learns about an item it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemMeta {
    pub len: u64,
    pub bucket: u32,
    pub tokens: u64,
    pub batch_id: u64,
    /// Position in publish order.
    pub ticket: u64,
    /// Earlier deliveries of this item to consumers that died holding it (0 the first time).
    pub delivery: u32,
    /// Worker id of the producer.
    pub producer: u32,
}

/// A slot claimed by a worker: its index and the state word that proves the claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    pub idx: usize,
    pub word: Word,
}

/// Outcome of one non-blocking take attempt.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TryTake {
    Item(Claim),
    /// Nothing to take now (empty, or fewer than `min_ready` READY while open).
    Wait,
    /// The ring is closed and drained.
    End,
}

/// Outcome of a blocking take.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Taken {
    Item(Claim),
    End,
    TimedOut,
}

impl<'a> RingRef<'a> {
    pub(crate) fn worker(&self, id: u32) -> &'a WorkerRecord {
        &self.workers[id as usize]
    }

    pub(crate) fn closed(&self) -> bool {
        // SYNC: pairs with the AcqRel CAS of `closed` in `finish_inner`.
        self.ctl.closed.load(Ordering::Acquire) != 0
    }

    /// Switches worker `id`'s phase clock to `phase` (None: stop counting), adding the time
    /// since the last switch to the phase it leaves, which it returns. Only the worker itself
    /// (or the supervisor once it is dead) switches its clock.
    #[cfg(not(loom))]
    pub(crate) fn enter(&self, id: u32, phase: Option<Phase>) -> Option<Phase> {
        let w = self.worker(id);
        let now = sync::now_ns();
        let prev = w.clock.switch(now, phase);
        crate::device::log_switch(w, now, phase);
        // Idle gaps: leaving compute starts one, coming back ends it. Only the worker writes
        // these, and readers only report them (telemetry: Relaxed). A worker that times its
        // device has the device's gaps instead (`device.rs`).
        let (was, is) = (prev == Some(Phase::Compute), phase == Some(Phase::Compute));
        if w.device_timed.load(Ordering::Relaxed) != 0 {
            w.gap_since.store(0, Ordering::Relaxed);
        } else if phase.is_none() {
            // The clock stops (the worker leaves): no gap stays open.
            w.gap_since.store(0, Ordering::Relaxed);
        } else if was && !is {
            w.gap_since.store(now, Ordering::Relaxed);
        } else if is && !was {
            let start = w.gap_since.swap(0, Ordering::Relaxed);
            if start != 0 {
                keep_gap(w, now, now.saturating_sub(start));
            }
        }
        prev
    }

    /// Records an idle gap of `len` ending now for worker `id` (the tests' way to put gaps of
    /// known length in a ring).
    #[cfg(not(loom))]
    pub(crate) fn record_gap(&self, id: u32, len: Duration) {
        keep_gap(self.worker(id), sync::now_ns(), len.as_nanos() as u64);
    }

    /// Telemetry only: loom models skip it.
    #[cfg(loom)]
    pub(crate) fn record_gap(&self, _id: u32, _len: Duration) {}

    /// Telemetry only: loom models skip it.
    #[cfg(loom)]
    pub(crate) fn enter(&self, _id: u32, _phase: Option<Phase>) -> Option<Phase> {
        None
    }

    pub(crate) fn heartbeat(&self, id: u32) {
        sync::record(&self.worker(id).heartbeat_ns, sync::now_ns());
    }

    /// Worker `id`'s batch in hand (`set_in_hand`), stored + 1 (0: none); Relaxed: only read
    /// once the worker is dead, ordered by its exit.
    pub(crate) fn set_in_hand(&self, id: u32, batch: Option<u64>) {
        let word = batch.map_or(0, |b| b.wrapping_add(1));
        self.worker(id).in_hand.store(word, Ordering::Relaxed);
    }

    // ---- producer side -------------------------------------------------------------------

    /// One attempt to claim a FREE slot for producer `id`.
    pub(crate) fn try_reserve(&self, id: u32) -> Result<Option<Claim>, RingError> {
        if self.worker(id).finished.load(Ordering::Relaxed) != 0 {
            return Err(RingError::Finished);
        }
        if self.closed() {
            return Err(RingError::Closed);
        }
        let n = self.slots.len();
        // Under loom every producer starts at slot 0: the hint only spreads load.
        #[cfg(not(loom))]
        let start = self.ctl.reserve_hint.fetch_add(1, Ordering::Relaxed) as usize;
        #[cfg(loom)]
        let start = 0;
        for k in 0..n {
            let idx = (start + k) % n;
            let cur = Word(self.slots[idx].state.load(Ordering::Relaxed));
            if cur.state() != FREE {
                continue;
            }
            let new = cur.next(WRITING, id);
            // SYNC: Acquire pairs with the Release CAS in `release`/`abort`/`recover`, so the
            // previous owner's use of the payload happens before we overwrite it.
            if self.slots[idx]
                .state
                .compare_exchange(cur.0, new.0, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                // A FREE slot carries no work item (cleared before every CAS to FREE).
                return Ok(Some(Claim { idx, word: new }));
            }
        }
        Ok(None)
    }

    /// Claims a FREE slot, sleeping on `free_seq` while none is free, at most until `deadline`.
    pub(crate) fn reserve(
        &self,
        id: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<Claim>, RingError> {
        let mut waited: Option<Option<Phase>> = None;
        let out = loop {
            let seq = self.ctl.free_seq.load(Ordering::Acquire);
            if let Some(c) = self.try_reserve(id)? {
                break Some(c);
            }
            let Some(sleep) = sleep_for(deadline) else {
                break None;
            };
            if waited.is_none() {
                waited = Some(self.enter(id, Some(Phase::WaitFull)));
            }
            sync::sleep(&self.ctl.free_seq, &self.ctl.free_waiters, seq, sleep);
            // A worker blocked on the ring is alive: say so at every wake.
            self.heartbeat(id);
        };
        if let Some(prev) = waited {
            self.enter(id, prev);
        }
        self.heartbeat(id);
        Ok(out)
    }

    /// Publishes a WRITING slot as READY.
    pub(crate) fn commit(
        &self,
        id: u32,
        claim: Claim,
        len: u64,
        meta: CommitMeta,
    ) -> Result<(), RingError> {
        if meta.bucket >= self.params.buckets {
            // Give the slot back: the item is not published.
            self.abort(claim);
            return Err(RingError::BadBucket {
                bucket: meta.bucket,
                buckets: self.params.buckets,
            });
        }
        let s = &self.slots[claim.idx];
        // The claim first, before any write: a stale incarnation must not overwrite the
        // metadata of the writer that holds the slot now (see `complete_work`).
        if Word(s.state.load(Ordering::Relaxed)) != claim.word {
            return Err(RingError::Reclaimed { slot: claim.idx });
        }
        s.len.store(len, Ordering::Relaxed);
        s.bucket.store(meta.bucket, Ordering::Relaxed);
        s.tokens.store(meta.tokens, Ordering::Relaxed);
        s.batch_id.store(meta.batch_id, Ordering::Relaxed);
        s.producer.store(id, Ordering::Relaxed);
        s.delivery.store(0, Ordering::Relaxed);
        // Our own slot's link, read while we still own it: a commit that settles an item wakes
        // the producers waiting for held work.
        let settles = s.work_item.load(Ordering::Relaxed) != 0;
        let ticket = self.ctl.next_ticket.fetch_add(1, Ordering::Relaxed);
        s.ticket.store(ticket, Ordering::Relaxed);
        // SYNC: Release pairs with the Acquire CAS in `try_take`: the metadata above and the
        // payload written in place become visible to the consumer that takes this slot.
        s.state
            .compare_exchange(
                claim.word.0,
                claim.word.next(READY, 0).0,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .map_err(|_| RingError::Reclaimed { slot: claim.idx })?;
        sync::tally(&self.ctl.published, 1);
        let w = self.worker(id);
        sync::tally(&w.items, 1);
        sync::tally(&w.tokens, meta.tokens);
        sync::tally(&w.bytes, len);
        self.heartbeat(id);
        sync::bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        if settles {
            sync::bump(&self.ctl.work_seq, &self.ctl.work_waiters);
        }
        Ok(())
    }

    /// Gives a WRITING slot back without publishing it. A work item it carried goes back FREE,
    /// so the batch is redone rather than lost.
    pub(crate) fn abort(&self, claim: Claim) {
        let s = &self.slots[claim.idx];
        if Word(s.state.load(Ordering::Relaxed)) != claim.word {
            // Reclaimed by recovery: not ours to touch any more.
            return;
        }
        let returned = self.unmark_work(claim, None).is_some();
        // SYNC: Release pairs with the Acquire CAS in `try_reserve`, and with the Acquire load
        // of the slot word in `work_left` (which then sees the unmark above).
        if s.state
            .compare_exchange(
                claim.word.0,
                claim.word.next(FREE, 0).0,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            sync::tally(&self.ctl.aborted, 1);
            sync::bump(&self.ctl.free_seq, &self.ctl.free_waiters);
        }
        if returned {
            // The item is FREE again: producers waiting for held work claim it.
            sync::bump(&self.ctl.work_seq, &self.ctl.work_waiters);
        }
    }

    /// Producer `id` has published everything it will. The producer that brings the count to
    /// the expected number closes the ring and wakes every consumer. Returns true if this call
    /// closed the ring. Idempotent per producer.
    pub(crate) fn finish(&self, id: u32) -> bool {
        self.finish_inner(id, W_DONE)
    }

    /// Counts a producer that will not come back as finished (after `recover`), so the close
    /// broadcast still fires.
    pub(crate) fn retire(&self, id: u32) -> bool {
        self.finish_inner(id, W_RETIRED)
    }

    fn finish_inner(&self, id: u32, state: u32) -> bool {
        let w = self.worker(id);
        w.state.store(state, Ordering::Relaxed);
        // SYNC: the Release half pairs with the Acquire loads of the flags below, in whichever
        // call finds every producer finished: it then sees everything this producer committed.
        if w.finished
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // Telemetry only (the snapshot's "producers done"); the close is decided below.
            self.ctl.producers_done.fetch_add(1, Ordering::Relaxed);
        }
        // The close is decided by the flags themselves, not by one increment per producer: a
        // producer killed between its flag and a count would otherwise leave the ring open for
        // ever, since every later finish or retire of its id finds the flag already set (found
        // by the crash search, #29). So every call, a repeated one too, looks at all the flags.
        // SYNC: each finishing producer writes its own flag, then reads the others': a Dekker
        // pattern, so a SeqCst fence between the two in every call; with Acquire/Release alone
        // two last producers could each miss the other's flag and neither close (loom's close
        // model deadlocks without it). Of any two calls, the later fence sees the earlier flag.
        sync::fence(Ordering::SeqCst);
        let all = (0..self.params.producers)
            // SYNC: pairs with each producer's AcqRel CAS of its flag above.
            .all(|p| self.worker(p).finished.load(Ordering::Acquire) != 0);
        // SYNC: the Release half pairs with the Acquire load in `closed()`, so a consumer that
        // sees the ring closed sees every item ever committed; the CAS makes one call the closer.
        if all
            && self
                .ctl
                .closed
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            sync::bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
            // Producers of a closed ring have nothing to wait for either.
            sync::bump(&self.ctl.free_seq, &self.ctl.free_waiters);
            sync::bump(&self.ctl.work_seq, &self.ctl.work_waiters);
            true
        } else {
            false
        }
    }

    // ---- consumer side -------------------------------------------------------------------

    /// One attempt to take an item for consumer `id` under the ring's policy. A bucketed policy
    /// serves bucket `prefer` if it has a READY item (the drafter group's bucket of the step).
    pub(crate) fn try_take(&self, id: u32, st: &mut TakeState, prefer: Option<u32>) -> TryTake {
        let buckets = self.params.buckets as usize;
        loop {
            // Read `closed` before scanning: if it is set, every item ever committed is visible
            // to the scan below (see the module doc).
            let closed = self.closed();
            let mut per_bucket = [0u32; crate::params::MAX_BUCKETS as usize];
            let mut ready = 0u32;
            let mut in_flight = false;
            let mut oldest: Option<(u64, Claim)> = None;
            for (idx, s) in self.slots.iter().enumerate() {
                let w = Word(s.state.load(Ordering::Acquire));
                match w.state() {
                    READY => {
                        ready += 1;
                        let b = (s.bucket.load(Ordering::Relaxed) as usize).min(buckets - 1);
                        per_bucket[b] += 1;
                        let t = s.ticket.load(Ordering::Relaxed);
                        if oldest.is_none_or(|(ot, _)| t < ot) {
                            oldest = Some((t, Claim { idx, word: w }));
                        }
                    }
                    WRITING => in_flight = true,
                    READING if w.owner() != id => in_flight = true,
                    _ => {}
                }
            }
            if ready == 0 {
                return if closed && !in_flight {
                    TryTake::End
                } else {
                    TryTake::Wait
                };
            }
            let pick = match self.params.policy {
                TakePolicy::Fifo => oldest.map(|(_, c)| c),
                TakePolicy::Bucketed { min_ready, pick } => {
                    if !closed && ready < min_ready {
                        return TryTake::Wait;
                    }
                    let b = match prefer {
                        Some(b) if per_bucket.get(b as usize).is_some_and(|&n| n > 0) => b,
                        _ => choose_bucket(&per_bucket[..buckets], pick, st),
                    };
                    self.nth_ready_in_bucket(b, st.below(per_bucket[b as usize]))
                }
            };
            let Some(c) = pick else { continue };
            // SYNC: Acquire pairs with the Release CAS in `commit` (and in `recover`).
            if self.slots[c.idx]
                .state
                .compare_exchange(
                    c.word.0,
                    c.word.next(READING, id).0,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                sync::tally(&self.ctl.taken, 1);
                return TryTake::Item(Claim {
                    idx: c.idx,
                    word: c.word.next(READING, id),
                });
            }
            // Somebody else won this slot; look again.
        }
    }

    fn nth_ready_in_bucket(&self, bucket: u32, n: u32) -> Option<Claim> {
        let mut seen = 0;
        for (idx, s) in self.slots.iter().enumerate() {
            let w = Word(s.state.load(Ordering::Acquire));
            if w.state() == READY && s.bucket.load(Ordering::Relaxed) == bucket {
                if seen == n {
                    return Some(Claim { idx, word: w });
                }
                seen += 1;
            }
        }
        None
    }

    /// READY items per bucket, as one scan sees them (`buckets` entries).
    pub(crate) fn ready_per_bucket(&self) -> Vec<u32> {
        let buckets = self.params.buckets as usize;
        let mut per_bucket = vec![0u32; buckets];
        for s in self.slots {
            if Word(s.state.load(Ordering::Acquire)).state() == READY {
                per_bucket[(s.bucket.load(Ordering::Relaxed) as usize).min(buckets - 1)] += 1;
            }
        }
        per_bucket
    }

    /// Takes an item, sleeping on `ready_seq` while there is none, at most until `deadline`.
    pub(crate) fn take(
        &self,
        id: u32,
        st: &mut TakeState,
        prefer: Option<u32>,
        deadline: Option<Instant>,
    ) -> Taken {
        let mut waited: Option<Option<Phase>> = None;
        let out = loop {
            let seq = self.ctl.ready_seq.load(Ordering::Acquire);
            match self.try_take(id, st, prefer) {
                TryTake::Item(c) => break Taken::Item(c),
                TryTake::End => break Taken::End,
                TryTake::Wait => {}
            }
            let Some(sleep) = sleep_for(deadline) else {
                break Taken::TimedOut;
            };
            if waited.is_none() {
                waited = Some(self.enter(id, Some(Phase::WaitEmpty)));
            }
            sync::sleep(&self.ctl.ready_seq, &self.ctl.ready_waiters, seq, sleep);
            self.heartbeat(id);
        };
        if let Some(prev) = waited {
            self.enter(id, prev);
        }
        self.heartbeat(id);
        out
    }

    pub(crate) fn item_meta(&self, idx: usize) -> ItemMeta {
        let s = &self.slots[idx];
        ItemMeta {
            len: s.len.load(Ordering::Relaxed),
            bucket: s.bucket.load(Ordering::Relaxed),
            tokens: s.tokens.load(Ordering::Relaxed),
            batch_id: s.batch_id.load(Ordering::Relaxed),
            ticket: s.ticket.load(Ordering::Relaxed),
            delivery: s.delivery.load(Ordering::Relaxed),
            producer: s.producer.load(Ordering::Relaxed),
        }
    }

    /// Puts a slot its consumer is reading back to READY for another take, its delivery count
    /// plus one: what recovery does for a dead consumer's slot, done by the live owner (a batch
    /// it will not train, e.g. one a Python drafter dropped unreleased).
    pub(crate) fn requeue(&self, claim: Claim) -> Result<(), RingError> {
        let s = &self.slots[claim.idx];
        if Word(s.state.load(Ordering::Relaxed)) != claim.word {
            return Err(RingError::Reclaimed { slot: claim.idx });
        }
        // We own the slot (READING by us), so nobody reads `delivery` before the CAS below
        // publishes it, as in recovery.
        s.delivery.fetch_add(1, Ordering::Relaxed);
        // SYNC: Release pairs with the Acquire CAS in `try_take`: the delivery count and our
        // reads of the payload happen before the next consumer's take.
        if s.state
            .compare_exchange(
                claim.word.0,
                claim.word.next(READY, 0).0,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_err()
        {
            s.delivery.fetch_sub(1, Ordering::Relaxed);
            return Err(RingError::Reclaimed { slot: claim.idx });
        }
        sync::tally(&self.ctl.redelivered, 1);
        sync::bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        Ok(())
    }

    /// Frees a slot consumer `id` has finished reading; `refused`: it did not consume the item,
    /// whose content it refused as corrupt (counted apart, not in `released` nor in the
    /// consumer's items and tokens, which are what it trained).
    pub(crate) fn release(&self, id: u32, claim: Claim, refused: bool) -> Result<(), RingError> {
        let s = &self.slots[claim.idx];
        let (tokens, len) = (
            s.tokens.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
        );
        if Word(s.state.load(Ordering::Relaxed)) != claim.word {
            return Err(RingError::Reclaimed { slot: claim.idx });
        }
        // A FREE slot carries no work item (the item stays DONE: its batch was published).
        s.work_item.store(0, Ordering::Relaxed);
        // SYNC: Release pairs with the Acquire CAS in `try_reserve`: our reads of the payload
        // and the clearing above happen before the next producer's writes.
        s.state
            .compare_exchange(
                claim.word.0,
                claim.word.next(FREE, 0).0,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .map_err(|_| RingError::Reclaimed { slot: claim.idx })?;
        let w = self.worker(id);
        if refused {
            sync::tally(&self.ctl.refused, 1);
        } else {
            sync::tally(&self.ctl.released, 1);
            sync::tally(&w.items, 1);
            sync::tally(&w.tokens, tokens);
            sync::tally(&w.bytes, len);
        }
        self.heartbeat(id);
        sync::bump(&self.ctl.free_seq, &self.ctl.free_waiters);
        // Consumers draining a closed ring wait for in-flight items like this one to settle, so
        // a release wakes them too. (Waking only when the ring is closed would race with the
        // close: we could see it open while a drainer already saw it closed and this slot busy.
        // loom found that lost wake-up.) Releases are few per second; the extra wake is cheap.
        sync::bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        Ok(())
    }
}

/// How long to sleep before looking again, or None if the deadline has passed.
fn sleep_for(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        None => Some(MAX_SLEEP),
        Some(d) => {
            let left = d.checked_duration_since(Instant::now())?;
            if left.is_zero() {
                None
            } else {
                Some(left.min(MAX_SLEEP))
            }
        }
    }
}

/// Keeps `len`, an idle gap that ended at `end_ns`, if it is the longest of its second.
#[cfg(not(loom))]
pub(crate) fn keep_gap(w: &WorkerRecord, end_ns: u64, len: u64) {
    let second = end_ns / 1_000_000_000;
    let slot = &w.gaps[(second % GAP_SECONDS as u64) as usize];
    let old = GapWord(slot.load(Ordering::Relaxed));
    let len = if old.second() == second & 0xFFFF_FFFF {
        len.max(old.gap_ns())
    } else {
        len
    };
    slot.store(GapWord::new(second, len).0, Ordering::Relaxed);
}
