//! Work items: producers claim numbered units of work through the ring (a target claims
//! planned batches), so faster producers take more.
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

use super::*;

impl<'a> RingRef<'a> {
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
        // Both claims first, before any write: a stale incarnation (recovered while it hung,
        // then woken) must change nothing in a slot that is now another writer's, nor in the
        // work table. The slot word names this WRITING period (its generation moves at every
        // CAS), and only recovery moves it away from a live writer, which is excluded while the
        // writer runs: so a check that passes here stays true until our own commit or abort.
        if Word(s.state.load(Ordering::Relaxed)) != claim.word {
            return Err(RingError::Reclaimed { slot: claim.idx });
        }
        let mine = WorkWord::claimed(id, epoch).0;
        if w.load(Ordering::Relaxed) != mine {
            return Err(RingError::NotClaimed { item });
        }
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
        if w.compare_exchange(mine, done.0, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            // Only recovery takes a claim from its holder, which the check above excludes for
            // a running one; should it happen anyway, undo only our own link.
            let _ = s
                .work_item
                .compare_exchange(item + 1, 0, Ordering::Relaxed, Ordering::Relaxed);
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
    pub(super) fn unmark_work(&self, claim: Claim) -> bool {
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
}
