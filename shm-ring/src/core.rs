//! The lock-free slot state machine, independent of where its memory lives (a shared-memory
//! segment in production, the heap in loom models and unit tests).
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
//!                                      recover(c): back to READY, delivery + 1
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
//! - finish's AcqRel increment of `producers_done` chains every producer's finish into one
//!   release sequence; the last producer's Release store of `closed` pairs with the consumers'
//!   Acquire load, so a consumer that sees the ring closed also sees every item ever committed.
//!
//! A stale incarnation (a process that lost its registration) can never commit or release a
//! slot that has since moved: its claim holds the whole word, generation included, so its CAS
//! fails with `Reclaimed`.
//!
//! FIFO is "the oldest ticket among the READY slots one scan saw": tickets are drawn just before
//! the commit CAS, so a ticket drawn earlier can become READY after a later one, or land in a
//! slot the scan had already passed. Across producers the order is approximately, not exactly,
//! publish order; a single producer whose commits all precede the take is served in order.
//!
//! # Work items
//!
//! Producers may also claim numbered units of work through the ring (a target claims planned
//! batches), so faster producers take more. Each item has one word in the work table (see
//! `WorkWord`): FREE → CLAIMED(p, epoch) → DONE(slot, generation), each step one CAS.
//!
//! - `claim_work` takes fresh items from a shared cursor, then makes ONE full scan for FREE
//!   items (given back by `unclaim_work`, `abort` or recovery, or fresh ones whose cursor holder
//!   lost them to such a scan) before it answers None. No count decides anything, so a producer
//!   killed anywhere cannot strand an item or make another spin; a producer that finds nothing
//!   finishes.
//! - `complete_work` records the item in its WRITING slot's `work_item`, then marks it
//!   DONE(slot, generation of that WRITING word); the producer commits next. Since the mark
//!   names the slot and its generation, it is undone only by whoever frees that very WRITING
//!   period: `abort` (the item goes back FREE) or recovery (likewise, if the producer died before
//!   its commit). One item per slot.
//! - Every CAS of a slot to FREE (release, abort, recovery) is preceded by clearing `work_item`,
//!   so a FREE slot carries no item and a new writer never inherits one.
//!
//! Invariants: an item is DONE exactly when its batch is committed, or its slot is WRITING by a
//! producer that has not yet committed or aborted; recovery of that producer makes it FREE. An
//! item is CLAIMED only by an incarnation that registered with that epoch; recovery frees every
//! claim of a dead id. Every FREE item is claimed by the next `claim_work` whose scan passes it.
//! So every item is published exactly once, provided some producer claims after the last
//! recovery (a restarted producer does).
//!
//! The work table carries no data: every change is one CAS, and each word's modification order
//! is the whole protocol, so its operations are Relaxed. What recovery reads of a dead producer
//! (its slots' `work_item`) is ordered by that producer's exit and the lease hand-over.
//!
//! # Registration and recovery
//!
//! Each worker id has a lease word (see `Lease`): a process registers by ONE CAS from the word it
//! saw, free or held by a process judged gone, to its own (pid, start time). Two registrants
//! cannot both win. The winner first cleans up whatever its predecessors left (`cleanup`), then
//! bumps the epoch. `recover` takes the same lease (refusing a live holder, the caller's own
//! process included), cleans up, and gives the lease back; it only restores invariants, so it is
//! correct when run again after being interrupted itself (a registrant that finds the lease
//! held by a dead supervisor cleans up again):
//!
//! - a WRITING slot: its item's DONE(slot, generation) mark is undone first (CAS to FREE; an
//!   interrupted recover finds it already undone, or claimed by someone else, and the CAS
//!   fails harmlessly), then `work_item` is cleared, then the slot is freed;
//! - a READING slot goes back to READY with delivery + 1 (a delivery interrupted between the two
//!   may be counted twice; it is telemetry);
//! - every item CLAIMED by the id, whatever its epoch, goes back FREE.
//!
//! # End of stream
//!
//! A consumer gets end-of-stream only when the ring is closed and no slot is READY, WRITING, or
//! READING by another consumer: a batch held by a consumer that then dies goes back to READY and
//! must still find a live consumer, so nobody leaves while one is in flight.

use std::time::{Duration, Instant};

use crate::layout::*;
use crate::params::{BucketPick, TakePolicy};
use crate::sync::{self, fence, AtomicU32, AtomicU64, Ordering};
use crate::{Phase, RingError};

/// The longest a waiter sleeps before it looks again. Bounded so that waiters notice stop
/// requests, closed rings and recovered slots even if a wake-up were lost.
pub(crate) const MAX_SLEEP: Duration = Duration::from_millis(100);

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
    /// Caller's checksum of the payload; the ring stores it and never computes it.
    pub checksum: u64,
}

/// What a consumer learns about an item it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemMeta {
    pub len: u64,
    pub bucket: u32,
    pub tokens: u64,
    pub batch_id: u64,
    pub checksum: u64,
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

/// Per-consumer state of the take policy (not shared).
#[derive(Clone, Debug)]
pub(crate) struct TakeState {
    pub next_bucket: u32,
    pub rng: SplitMix64,
}

impl TakeState {
    pub(crate) fn new(seed: u64, id: u32) -> Self {
        TakeState {
            next_bucket: 0,
            rng: SplitMix64(seed ^ (u64::from(id) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        }
    }
}

/// A small seeded generator; the choice within a bucket needs spread, not cryptography.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n.max(1))) as u32
    }
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

/// What `recover` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Slots the dead worker was writing, now FREE.
    pub freed: u32,
    /// Items the dead worker was reading, now READY again with delivery + 1.
    pub requeued: u32,
    /// Work items the dead producer had claimed (or marked done in an unpublished batch), now
    /// FREE for any producer.
    pub work_returned: u64,
    /// Items the dead consumer was reading whose training is known to be applied (see
    /// `Ring::recover_retiring`), now FREE as if released.
    pub retired: u32,
}

/// A batch a dead consumer holds that must count as trained, not be delivered again, and what
/// to do with it before its slot is freed (the slot index and its meta).
pub(crate) struct Retire<'f> {
    pub batch_id: u64,
    pub before: &'f mut dyn FnMut(usize, ItemMeta),
}

impl<'a> RingRef<'a> {
    pub(crate) fn worker(&self, id: u32) -> &'a WorkerRecord {
        &self.workers[id as usize]
    }

    pub(crate) fn closed(&self) -> bool {
        // SYNC: pairs with the Release store in `finish_inner`.
        self.ctl.closed.load(Ordering::Acquire) != 0
    }

    /// Switches worker `id`'s phase clock to `phase` (None: stop counting), adding the time
    /// since the last switch to the phase it leaves, which it returns. Only the worker itself
    /// (or the supervisor once it is dead) switches its clock.
    #[cfg(not(loom))]
    pub(crate) fn enter(&self, id: u32, phase: Option<Phase>) -> Option<Phase> {
        let w = self.worker(id);
        let now = sync::now_ns();
        let new = phase.map_or(0, |p| p as u32 + 1);
        let prev = w.phase_cur.swap(new, Ordering::Relaxed);
        let since = w.phase_since.swap(now, Ordering::Relaxed);
        let prev = (prev as usize)
            .checked_sub(1)
            .and_then(|i| Phase::ALL.get(i).copied());
        if let Some(p) = prev {
            sync::tally(&w.phase_ns[p as usize], now.saturating_sub(since));
        }
        prev
    }

    /// Telemetry only: loom models skip it.
    #[cfg(loom)]
    pub(crate) fn enter(&self, _id: u32, _phase: Option<Phase>) -> Option<Phase> {
        None
    }

    pub(crate) fn heartbeat(&self, id: u32) {
        sync::record(&self.worker(id).heartbeat_ns, sync::now_ns());
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
            self.sleep(&self.ctl.free_seq, &self.ctl.free_waiters, seq, sleep);
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
            self.abort(id, claim);
            return Err(RingError::BadBucket {
                bucket: meta.bucket,
                buckets: self.params.buckets,
            });
        }
        let s = &self.slots[claim.idx];
        s.len.store(len, Ordering::Relaxed);
        s.bucket.store(meta.bucket, Ordering::Relaxed);
        s.tokens.store(meta.tokens, Ordering::Relaxed);
        s.batch_id.store(meta.batch_id, Ordering::Relaxed);
        s.checksum.store(meta.checksum, Ordering::Relaxed);
        s.producer.store(id, Ordering::Relaxed);
        s.delivery.store(0, Ordering::Relaxed);
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
        self.bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        Ok(())
    }

    /// Claims the next work item for producer `id` (registered with `epoch`): a fresh one from
    /// the cursor while they last, then the first FREE item of one full scan. None when that
    /// scan finds none: every item is claimed or done, and the caller should finish.
    pub(crate) fn claim_work(&self, id: u32, epoch: u64) -> Option<u64> {
        let total = self.work.len() as u64;
        let mine = WorkWord::claimed(id, epoch).0;
        // The work table's operations are Relaxed: see "Work items" in the module doc.
        let claim = |w: &AtomicU64| {
            w.compare_exchange(WORK_FREE, mine, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        };
        loop {
            let i = self.ctl.work_cursor.fetch_add(1, Ordering::Relaxed);
            if i >= total {
                break;
            }
            if claim(&self.work[i as usize]) {
                return Some(i);
            }
        }
        // Fresh items are handed out. The count of returned items is not kept: a kill between a
        // claim and its count update would skew it. One CAS per item reads each word's latest
        // value, so the scan misses no item that was FREE when it passed.
        self.work.iter().position(claim).map(|i| i as u64)
    }

    /// Marks FREE work `item` DONE for good, before any producer runs. Returns false if it was
    /// not FREE.
    pub(crate) fn mark_done_before(&self, item: u64) -> Result<bool, RingError> {
        let w = self.work_word(item)?;
        Ok(w.compare_exchange(
            WORK_FREE,
            WorkWord::done_before().0,
            Ordering::Relaxed,
            Ordering::Relaxed,
        )
        .is_ok())
    }

    fn work_word(&self, item: u64) -> Result<&'a AtomicU64, RingError> {
        self.work
            .get(item as usize)
            .ok_or(RingError::NoSuchWorkItem {
                item,
                items: self.work.len() as u64,
            })
    }

    /// Marks work item `item` DONE on behalf of the batch in WRITING slot `claim`; the caller
    /// commits the slot next. Fails if `id`'s incarnation `epoch` does not hold the item, or if
    /// the slot already carries one.
    pub(crate) fn complete_work(
        &self,
        id: u32,
        epoch: u64,
        claim: Claim,
        item: u64,
    ) -> Result<(), RingError> {
        let w = self.work_word(item)?;
        let s = &self.slots[claim.idx];
        let carried = s.work_item.load(Ordering::Relaxed);
        if carried != 0 {
            return Err(RingError::SlotCarriesWork {
                slot: claim.idx,
                item: carried - 1,
            });
        }
        // The link first, then the mark: recovery of a producer killed in between finds the
        // item still CLAIMED and returns it by its claim.
        s.work_item.store(item + 1, Ordering::Relaxed);
        let done = WorkWord::done(claim.idx, claim.word.generation());
        if w.compare_exchange(
            WorkWord::claimed(id, epoch).0,
            done.0,
            Ordering::Relaxed,
            Ordering::Relaxed,
        )
        .is_err()
        {
            s.work_item.store(0, Ordering::Relaxed);
            return Err(RingError::NotClaimed { item });
        }
        Ok(())
    }

    /// Gives back a claimed work item that producer `id` (incarnation `epoch`) will not do.
    pub(crate) fn unclaim_work(&self, id: u32, epoch: u64, item: u64) -> Result<(), RingError> {
        let w = self.work_word(item)?;
        w.compare_exchange(
            WorkWord::claimed(id, epoch).0,
            WORK_FREE,
            Ordering::Relaxed,
            Ordering::Relaxed,
        )
        .map(drop)
        .map_err(|_| RingError::NotClaimed { item })
    }

    /// Undoes the DONE mark of the item that WRITING slot `claim` carries, if the mark is this
    /// WRITING period's, and clears the link. The item goes back FREE. Returns true if an item
    /// went back. Called by the slot's writer (abort) or by recovery once the writer is gone.
    fn unmark_work(&self, claim: Claim) -> bool {
        let s = &self.slots[claim.idx];
        let item = s.work_item.load(Ordering::Relaxed);
        let undone = item
            .checked_sub(1)
            .and_then(|i| self.work.get(i as usize))
            .is_some_and(|w| {
                w.compare_exchange(
                    WorkWord::done(claim.idx, claim.word.generation()).0,
                    WORK_FREE,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
            });
        s.work_item.store(0, Ordering::Relaxed);
        undone
    }

    /// Gives a WRITING slot back without publishing it. A work item it carried goes back FREE,
    /// so the batch is redone rather than lost.
    pub(crate) fn abort(&self, id: u32, claim: Claim) {
        let _ = id;
        let s = &self.slots[claim.idx];
        if Word(s.state.load(Ordering::Relaxed)) != claim.word {
            // Reclaimed by recovery: not ours to touch any more.
            return;
        }
        self.unmark_work(claim);
        // SYNC: Release pairs with the Acquire CAS in `try_reserve`.
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
            self.bump(&self.ctl.free_seq, &self.ctl.free_waiters);
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
        if w.finished
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // SYNC: AcqRel makes every producer's finish part of one release sequence that the last
        // producer acquires before it publishes `closed`.
        let done = self.ctl.producers_done.fetch_add(1, Ordering::AcqRel) + 1;
        if done == self.params.producers {
            // SYNC: pairs with the Acquire load in `closed()`.
            self.ctl.closed.store(1, Ordering::Release);
            self.bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
            // Producers of a closed ring have nothing to wait for either.
            self.bump(&self.ctl.free_seq, &self.ctl.free_waiters);
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
                    self.nth_ready_in_bucket(b, st.rng.below(per_bucket[b as usize]))
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
            self.sleep(&self.ctl.ready_seq, &self.ctl.ready_waiters, seq, sleep);
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
            checksum: s.checksum.load(Ordering::Relaxed),
            ticket: s.ticket.load(Ordering::Relaxed),
            delivery: s.delivery.load(Ordering::Relaxed),
            producer: s.producer.load(Ordering::Relaxed),
        }
    }

    /// Frees a slot consumer `id` has finished reading.
    pub(crate) fn release(&self, id: u32, claim: Claim) -> Result<(), RingError> {
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
        sync::tally(&self.ctl.released, 1);
        let w = self.worker(id);
        sync::tally(&w.items, 1);
        sync::tally(&w.tokens, tokens);
        sync::tally(&w.bytes, len);
        self.heartbeat(id);
        self.bump(&self.ctl.free_seq, &self.ctl.free_waiters);
        // Consumers draining a closed ring wait for in-flight items like this one to settle, so
        // a release wakes them too. (Waking only when the ring is closed would race with the
        // close: we could see it open while a drainer already saw it closed and this slot busy.
        // loom found that lost wake-up.) Releases are few per second; the extra wake is cheap.
        self.bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        Ok(())
    }

    // ---- supervisor side -----------------------------------------------------------------

    /// The holder of worker `id`'s lease, if one holds it and `holder_alive` judges it alive.
    pub(crate) fn live_holder(
        &self,
        id: u32,
        holder_alive: impl Fn(Lease) -> bool,
    ) -> Option<Lease> {
        let cur = Lease(self.worker(id).lease.load(Ordering::Acquire));
        (cur.is_held() && holder_alive(cur)).then_some(cur)
    }

    /// Takes worker `id`'s lease for process `me` by one CAS from the word seen: free, or held by
    /// a process `holder_alive` judges gone. Refuses a live holder, returning it; `holder_alive`
    /// must call the caller's own process alive, so one process never holds an id twice. A
    /// failed CAS means another process won the lease: it is judged again.
    pub(crate) fn take_lease(
        &self,
        id: u32,
        me: Lease,
        holder_alive: impl Fn(Lease) -> bool,
    ) -> Result<(), Lease> {
        let lease = &self.worker(id).lease;
        // SYNC: Acquire pairs with the Release CAS in `give_back_lease` (and with the Release
        // half of a predecessor's `take_lease`): what the previous holder did to the ring happens
        // before the cleanup the new holder does next.
        let mut cur = Lease(lease.load(Ordering::Acquire));
        loop {
            if cur.is_held() && holder_alive(cur) {
                return Err(cur);
            }
            // SYNC: AcqRel: Acquire as the load above; Release so that a holder that takes over
            // from this one (if this process dies) sees what it did.
            match lease.compare_exchange(cur.0, me.0, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) => cur = Lease(now),
            }
        }
    }

    /// Gives worker `id`'s lease back if `me` holds it.
    pub(crate) fn give_back_lease(&self, id: u32, me: Lease) {
        // SYNC: Release pairs with the Acquire in `take_lease`.
        let _ = self.worker(id).lease.compare_exchange(
            me.0,
            Lease::FREE.0,
            Ordering::Release,
            Ordering::Relaxed,
        );
    }

    /// Registers process `me` as worker `id`: takes the lease, cleans up what earlier
    /// incarnations left, and starts a new epoch, which it returns. Refuses a live holder.
    pub(crate) fn register(
        &self,
        id: u32,
        me: Lease,
        holder_alive: impl Fn(Lease) -> bool,
    ) -> Result<u64, Lease> {
        self.take_lease(id, me, holder_alive)?;
        self.cleanup(id, None);
        let w = self.worker(id);
        // Only the lease holder bumps the epoch, so Relaxed suffices.
        let epoch = w.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        w.state.store(W_ALIVE, Ordering::Relaxed);
        Ok(epoch)
    }

    /// A registered worker leaves cleanly: it stops its clock and gives its lease back.
    pub(crate) fn unregister(&self, id: u32, me: Lease) {
        self.enter(id, None);
        let _ = self.worker(id).state.compare_exchange(
            W_ALIVE,
            W_DONE,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.give_back_lease(id, me);
    }

    /// For a supervisor (process `me`): returns what worker `id` held once its process is gone.
    /// Takes `id`'s lease (refusing a holder `holder_alive` judges alive, the caller's own
    /// process included), cleans up, marks the worker dead and gives the lease back.
    pub(crate) fn recover(
        &self,
        id: u32,
        me: Lease,
        holder_alive: impl Fn(Lease) -> bool,
        retire: Option<&mut Retire<'_>>,
    ) -> Result<Recovered, Lease> {
        self.take_lease(id, me, holder_alive)?;
        let out = self.cleanup(id, retire);
        let w = self.worker(id);
        // A dead worker's clock stops: readers must not count time past its death.
        w.phase_cur.store(0, Ordering::Relaxed);
        let _ = w
            .state
            .compare_exchange(W_ALIVE, W_DEAD, Ordering::Relaxed, Ordering::Relaxed);
        self.give_back_lease(id, me);
        Ok(out)
    }

    /// Returns what earlier incarnations of worker `id` held: WRITING slots become FREE (the
    /// item each carried, if marked DONE in that slot, FREE again), READING slots READY again
    /// with delivery + 1 (at-least-once delivery), CLAIMED work items FREE. The caller holds
    /// `id`'s lease, so no incarnation of `id` runs. Idempotent: see "Registration and
    /// recovery" in the module doc for why an interrupted run is completed by the next.
    ///
    /// With `retire`, a READING slot holding `retire.batch_id` is instead freed as a release
    /// would free it (its batch counts as consumed), after `retire.before` has seen it.
    pub(crate) fn cleanup(&self, id: u32, mut retire: Option<&mut Retire<'_>>) -> Recovered {
        let mut out = Recovered::default();
        for (idx, s) in self.slots.iter().enumerate() {
            let cur = Word(s.state.load(Ordering::Acquire));
            if cur.owner() != id {
                continue;
            }
            // SYNC: both CASes are Release: freeing pairs with the Acquire CAS in `try_reserve`,
            // requeueing with the Acquire CAS in `try_take`.
            let cas = |new: Word| {
                s.state
                    .compare_exchange(cur.0, new.0, Ordering::Release, Ordering::Relaxed)
                    .is_ok()
            };
            match cur.state() {
                WRITING => {
                    // The batch in this slot was never published: the item it completes, if
                    // marked DONE in this very WRITING period, is not done. Unmark first, free
                    // the slot last, so a recovery cut short in between still sees the slot.
                    if self.unmark_work(Claim { idx, word: cur }) {
                        out.work_returned += 1;
                    }
                    if cas(cur.next(FREE, 0)) {
                        out.freed += 1;
                    }
                }
                READING
                    if retire
                        .as_ref()
                        .is_some_and(|r| self.item_meta(idx).batch_id == r.batch_id) =>
                {
                    // Its update is applied: consumed, like a release. The dead owner cannot
                    // move the slot, so `before` reads a payload nobody else touches.
                    if let Some(r) = retire.as_mut() {
                        (r.before)(idx, self.item_meta(idx));
                    }
                    s.work_item.store(0, Ordering::Relaxed);
                    if cas(cur.next(FREE, 0)) {
                        out.retired += 1;
                        sync::tally(&self.ctl.released, 1);
                    }
                }
                READING => {
                    // The dead owner cannot move the slot, so nobody reads `delivery` before the
                    // CAS below publishes it.
                    s.delivery.fetch_add(1, Ordering::Relaxed);
                    if cas(cur.next(READY, 0)) {
                        out.requeued += 1;
                    } else {
                        s.delivery.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                _ => {}
            }
        }
        // Items still claimed by any incarnation of the id go back for another producer.
        for w in self.work {
            let v = WorkWord(w.load(Ordering::Relaxed));
            if v.claimer() == Some(id)
                && w.compare_exchange(v.0, WORK_FREE, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                out.work_returned += 1;
            }
        }
        sync::tally(&self.ctl.redelivered, u64::from(out.requeued));
        sync::tally(&self.ctl.aborted, u64::from(out.freed));
        if out.freed > 0 || out.retired > 0 {
            self.bump(&self.ctl.free_seq, &self.ctl.free_waiters);
        }
        if out.requeued > 0 || out.retired > 0 || self.closed() {
            self.bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        }
        out
    }

    /// Bumps a futex word and wakes everyone sleeping on it.
    ///
    /// The wake system call is skipped when nobody waits. SYNC (Dekker): the waker bumps the
    /// word, then a SeqCst fence, then reads `waiters`; a sleeper (`sleep`) counts itself in
    /// `waiters`, then a SeqCst fence, then reads the word (inside the futex). Of the two fences
    /// one comes first: if the waker's, the sleeper sees the new word and does not sleep; if the
    /// sleeper's, the waker sees the sleeper counted and wakes it. No wake-up is lost.
    fn bump(&self, word: &AtomicU32, waiters: &AtomicU32) {
        // SYNC: Release pairs with the Acquire load of the sequence before a waiter's scan.
        word.fetch_add(1, Ordering::Release);
        fence(Ordering::SeqCst);
        if waiters.load(Ordering::Relaxed) > 0 {
            sync::wake_all(word);
        }
    }

    /// Sleeps while `word` still holds `seq` (see `bump` for the hand-shake with wakers). First
    /// spins a few microseconds: at high rates the word usually moves sooner than a sleep and
    /// wake-up would take.
    fn sleep(&self, word: &AtomicU32, waiters: &AtomicU32, seq: u32, max: Duration) {
        if sync::spin_until_changed(word, seq) {
            return;
        }
        // A waiter killed while asleep leaves the count one too high: wakers then make the
        // system call needlessly, which is harmless.
        waiters.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        sync::wait(word, seq, max);
        waiters.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) fn choose_bucket(per_bucket: &[u32], pick: BucketPick, st: &mut TakeState) -> u32 {
    let n = per_bucket.len() as u32;
    match pick {
        BucketPick::Proportional => {
            let total: u32 = per_bucket.iter().sum();
            let mut r = st.rng.below(total);
            for (b, &c) in per_bucket.iter().enumerate() {
                if r < c {
                    return b as u32;
                }
                r -= c;
            }
            0
        }
        BucketPick::RoundRobin => {
            for k in 0..n {
                let b = (st.next_bucket + k) % n;
                if per_bucket[b as usize] > 0 {
                    st.next_bucket = (b + 1) % n;
                    return b;
                }
            }
            0
        }
        BucketPick::Fullest => (0..n).max_by_key(|&b| per_bucket[b as usize]).unwrap_or(0),
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
