//! Work items: producers claim numbered units of work through the ring (a target claims
//! planned batches), so faster producers take more.
//!
//! # States
//!
//! Each item has one word in the work table (see `WorkWord`), each step ONE CAS:
//!
//! ```text
//!          claim_work (p, epoch e)        complete_work (p, e)          commit (p)
//!   FREE ───────────────────────▶ CLAIMED(p, e) ──────────────▶ DONE(s, g) ─────────▶ settled
//!    ▲  ◀── unclaim_work (p, e) ───────┘  ▲                        │     (slot s leaves
//!    │  ◀── recovery of p ────────────────┘                        │      WRITING@g by its
//!    └───── abort of slot s, or recovery of p, in WRITING@g ◀──────┘      commit: for good)
//!
//!   recovery of p setting the item aside: CLAIMED(p, _) or DONE(s, g) in WRITING@g by p
//!   ──▶ SET_ASIDE (settled for good, never published)
//! ```
//!
//! FREE has two values: fresh (or given back by its live holder: `unclaim_work`, `abort`) and
//! RETURNED, which recovery of a dead holder writes. A claim takes either; one of a RETURNED
//! item says so (`WorkClaim::Returned`), and the claimer runs it alone: on a GPU a kernel's
//! fault shows at a later call, which with two batches in flight cannot say whose it was, so a
//! batch that kills its target that way is attributed the next time it is computed.
//!
//! - `claim_work` takes fresh items from a shared cursor, then makes ONE full scan for FREE
//!   items (given back by `unclaim_work`, `abort` or recovery, or fresh ones whose cursor holder
//!   lost them to such a scan) before it answers None. No count decides anything, so a producer
//!   killed anywhere cannot strand an item or make another spin.
//! - `complete_work` checks the slot's WRITING word and the item's claim, records the item in
//!   its WRITING slot's `work_item`, then marks it DONE(slot, generation of that WRITING word);
//!   the producer commits next. Since the mark names the slot and its generation, it is undone
//!   only by whoever frees that very WRITING period: `abort` (the item goes back FREE) or
//!   recovery (likewise, if the producer died before its commit). One item per slot.
//! - Every CAS of a slot to FREE (release, abort, recovery) is preceded by clearing `work_item`,
//!   so a FREE slot carries no item and a new writer never inherits one.
//! - A supervisor may set an item aside instead of returning it
//!   (`Ring::recover_setting_aside_work`: it killed the producers that computed it): recovery
//!   of its dead holder moves it from CLAIMED or DONE-in-WRITING to SET_ASIDE where it would
//!   have moved it to FREE (one the holder gave back is no longer its, and stays as it is).
//!   SET_ASIDE is settled for good: never claimed, never undone.
//!
//! An item is *held* while it is CLAIMED, or DONE(s, g) with slot s still WRITING@g: it may
//! still come back FREE (its holder unclaims, aborts or dies). It is *settled* once DONE and its
//! slot has left WRITING@g: only a commit moves it so while the mark stands (abort and recovery
//! undo the mark BEFORE they free the slot), and no later WRITING period has generation g, so a
//! settled item never comes back. A SET_ASIDE item is settled too, unpublished.
//!
//! # Waiting for returned work (`claim_work_until`)
//!
//! A producer that finds nothing FREE must not finish while items are held by others: a
//! holder that dies after this producer's last scan (and is then given up, so nobody restarts
//! it) would strand its items. So a producer finishes only once every item is settled, and
//! until then sleeps on `work_seq`, claiming whatever comes back. Who bumps `work_seq`: every
//! move that can end the wait, i.e. an item going back FREE (`unclaim_work`, `abort` that
//! unmarked an item, recovery that returned one), a commit of a slot that carries an item (held
//! → settled) and recovery that set one aside (held → settled); the close bumps it too. CLAIMED → DONE needs no wake: the item stays
//! held. The items a producer holds itself count as held, so a producer that claims ahead (the
//! target's prefetch thread) waits for its own commit, which wakes it.
//!
//! End of stream stays exact: a producer calls `finish()` only after it saw every item settled
//! (or it stops on request, or the ring closed), and a settled item never needs a producer
//! again, so no producer that finished is ever the one that should claim a returned item; the
//! last producer to finish (or be retired) still closes the ring. A waiter is woken by the
//! return of an item held by a dead producer when the supervisor recovers it, whether the dead
//! producer is then restarted or given up and retired. When every producer is given up, nobody
//! waits and the last retire closes the ring with the items left FREE: the run is degraded, as
//! it must be, and nothing hangs.
//!
//! Invariants: an item is DONE exactly when its batch is committed, or its slot is WRITING by a
//! producer that has not yet committed or aborted; recovery of that producer makes it FREE. An
//! item is CLAIMED only by an incarnation that registered with that epoch; recovery frees every
//! claim of a dead id. Every FREE item is claimed by the next `claim_work` whose scan passes it.
//! So every item is published exactly once while some producer that has not finished remains,
//! but for the items a supervisor sets aside, which are never published.
//!
//! # Memory ordering
//!
//! The work table carries no data: every change is one CAS, and each word's modification order
//! is the whole protocol, so its operations are Relaxed. What recovery reads of a dead producer
//! (its slots' `work_item`) is ordered by that producer's exit and the lease hand-over. The
//! wait's pairs:
//!
//! - the Release increment in `sync::bump(work_seq)`, after each waking move, pairs with the
//!   Acquire load of `work_seq` before a waiter's scan: a waiter that read the bumped value
//!   sees the move; one that read the old value sleeps only while the word still holds it (the
//!   futex compares), and the bump's Dekker hand-shake with `work_waiters` wakes it otherwise;
//! - the Acquire load of a DONE item's slot word pairs with the Release CAS that moved the slot
//!   out of WRITING@g (commit, abort or recovery, continued by later CASes' release sequence):
//!   if that was an abort or a recovery, its unmark, sequenced before, is visible to the
//!   re-read of the item word that follows, so a waiter never mistakes a returned item for a
//!   settled one. Only a slot word of a later generation than g proves the period over: the
//!   item's own load is Relaxed, so the slot word read after it may be older than WRITING@g,
//!   and is then taken as held (the period's end will bump `work_seq`).

use super::*;

impl<'a> RingRef<'a> {
    /// Claims the next work item for producer `id` (registered with `epoch`): a fresh one from
    /// the cursor while they last, then the first FREE item of one full scan. None when that
    /// scan finds none: every item is held or settled (see `claim_work_until` before finishing).
    pub(crate) fn claim_work(&self, id: u32, epoch: u64) -> Option<u64> {
        self.claim_work_noting(id, epoch).map(|(item, _)| item)
    }

    /// [`RingRef::claim_work`], saying whether the item was RETURNED (its last holder died with
    /// it): the claimer runs it alone.
    pub(crate) fn claim_work_noting(&self, id: u32, epoch: u64) -> Option<(u64, bool)> {
        // A producer that has finished claims nothing: it could not publish the item (reserve
        // refuses it), and one killed inside `finish` is restarted with its flag still set, so
        // returned work must go to a producer that has not finished (found by the crash search).
        if self.worker(id).finished.load(Ordering::Relaxed) != 0 {
            return None;
        }
        let total = self.work.len() as u64;
        let mine = WorkWord::claimed(id, epoch).0;
        // The work table's operations are Relaxed: see "Work items" in the module doc. A CAS
        // from FREE reads the word's latest value; a RETURNED one is claimed by a second CAS
        // from that value (which fails only if someone else moved it meanwhile).
        let claim = |w: &AtomicU64| match w.compare_exchange(
            WORK_FREE,
            mine,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => Some(false),
            Err(WORK_RETURNED) => w
                .compare_exchange(WORK_RETURNED, mine, Ordering::Relaxed, Ordering::Relaxed)
                .ok()
                .map(|_| true),
            Err(_) => None,
        };
        loop {
            let i = self.ctl.work_cursor.fetch_add(1, Ordering::Relaxed);
            if i >= total {
                break;
            }
            if let Some(returned) = claim(&self.work[i as usize]) {
                return Some((i, returned));
            }
        }
        // Fresh items are handed out. The count of returned items is not kept: a kill between a
        // claim and its count update would skew it. One CAS per item reads each word's latest
        // value, so the scan misses no item that was FREE when it passed.
        let mut items = self.work.iter().enumerate();
        items.find_map(|(i, w)| claim(w).map(|returned| (i as u64, returned)))
    }

    /// Claims the next work item for producer `id` (incarnation `epoch`) as `claim_work` does,
    /// but while none is FREE and some are still held (by anyone, this producer included),
    /// sleeps on `work_seq` and claims what comes back, at most until `deadline`. `Settled` once
    /// every item is settled, or the ring closed or this producer finished: then it may finish.
    /// Beats the producer's heartbeat at every wake.
    pub(crate) fn claim_work_until(
        &self,
        id: u32,
        epoch: u64,
        deadline: Option<Instant>,
    ) -> WorkClaim {
        self.claim_work_waiting(id, epoch, deadline, true)
    }

    /// [`RingRef::claim_work_until`], beating the heartbeat at every wake if `beat`.
    pub(crate) fn claim_work_waiting(
        &self,
        id: u32,
        epoch: u64,
        deadline: Option<Instant>,
        beat: bool,
    ) -> WorkClaim {
        loop {
            // SYNC: Acquire pairs with the Release increment in `sync::bump(work_seq)` after
            // every move that can end this wait (see "Memory ordering" in the module doc).
            let seq = self.ctl.work_seq.load(Ordering::Acquire);
            if self.closed() || self.worker(id).finished.load(Ordering::Relaxed) != 0 {
                return WorkClaim::Settled;
            }
            match self.claim_work_noting(id, epoch) {
                Some((i, false)) => return WorkClaim::Item(i),
                Some((i, true)) => return WorkClaim::Returned(i),
                None => {}
            }
            match self.work_left() {
                WorkLeft::Settled => return WorkClaim::Settled,
                // An item went FREE after the claim scan passed it: claim again at once.
                WorkLeft::Free => continue,
                WorkLeft::Held => {}
            }
            let Some(sleep) = sleep_for(deadline) else {
                return WorkClaim::Pending;
            };
            sync::sleep(&self.ctl.work_seq, &self.ctl.work_waiters, seq, sleep);
            // A producer waiting for work is alive: say so at every wake (unless another
            // thread of it does the work, and says so).
            if beat {
                self.heartbeat(id);
            }
        }
    }

    /// What one scan sees of the items that are not settled: any FREE, else any held, else
    /// none (every item settled for good).
    fn work_left(&self) -> WorkLeft {
        let mut left = WorkLeft::Settled;
        for w in self.work {
            let v = WorkWord(w.load(Ordering::Relaxed));
            if v.is_free() {
                return WorkLeft::Free;
            }
            if v.claimer().is_some() {
                left = WorkLeft::Held;
                continue;
            }
            if v == WorkWord::done_before() {
                // Done before the run started: no WRITING period can undo it.
                continue;
            }
            let Some(slot) = v
                .done_slot()
                .and_then(|i| self.slots.get(i).map(|s| (i, s)))
            else {
                continue;
            };
            // SYNC: Acquire pairs with the Release CAS that moved the slot out of the WRITING
            // period the mark names (see "Memory ordering" in the module doc).
            let cur = Word(slot.1.state.load(Ordering::Acquire));
            let period = v.done_generation();
            if cur.generation() <= period {
                // Still that WRITING period, or an older value of the slot word (the item's
                // Relaxed load does not order the slot's; loom found the stale read): held.
                // Its end, a commit or a return, bumps `work_seq`.
                left = WorkLeft::Held;
            } else if w.load(Ordering::Relaxed) != v.0 {
                // The slot left that period by an abort or a recovery, which unmarked the item
                // first: it came back (and may be claimed already). Look again.
                return WorkLeft::Free;
            }
        }
        left
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
        .map_err(|_| RingError::NotClaimed { item })?;
        // Producers waiting for held work claim it (see "Waiting for returned work").
        sync::bump(&self.ctl.work_seq, &self.ctl.work_waiters);
        Ok(())
    }

    /// Undoes the DONE mark of the item that WRITING slot `claim` carries, if the mark is this
    /// WRITING period's, and clears the link. The item goes back FREE, or is set aside if it is
    /// one of `aside` (a supervisor's recovery: see `Settling::work`). Returns what became of
    /// the item, if its mark was undone. Called by the slot's writer (abort: `recovery` None, the
    /// item goes back FREE) or by recovery once the writer is gone (`recovery` the items to set
    /// aside; any other goes back RETURNED, to be run alone).
    pub(super) fn unmark_work(&self, claim: Claim, recovery: Option<&[u64]>) -> Option<Undone> {
        let s = &self.slots[claim.idx];
        let item = s.work_item.load(Ordering::Relaxed);
        let undone = item.checked_sub(1).and_then(|i| {
            let w = self.work.get(i as usize)?;
            let (new, how) = match recovery {
                None => (WORK_FREE, Undone::Returned),
                Some(aside) if aside.contains(&i) => (WORK_SET_ASIDE, Undone::SetAside),
                Some(_) => (WORK_RETURNED, Undone::Returned),
            };
            let done = WorkWord::done(claim.idx, claim.word.generation()).0;
            (w.compare_exchange(done, new, Ordering::Relaxed, Ordering::Relaxed)).ok()?;
            Some(how)
        });
        s.work_item.store(0, Ordering::Relaxed);
        undone
    }
}

/// What undoing a work item's DONE mark made of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Undone {
    /// FREE again, for any producer.
    Returned,
    /// Set aside by a supervisor: settled for good.
    SetAside,
}

/// Outcome of a claim that waits for returned work ([`crate::Producer::claim_work_timeout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkClaim {
    /// This producer now holds this item.
    Item(u64),
    /// This producer now holds this item, which its last holder died with (a recovery returned
    /// it): compute it alone, nothing else in flight, so that an error it causes, even one a
    /// device reports late, is known to be its own (the launcher holds deaths against it).
    Returned(u64),
    /// None is FREE, but some are still held (by other producers, or by this one) and may come
    /// back: ask again (after looking at stop requests). Do not finish yet.
    Pending,
    /// Every item is committed or set aside (or the ring closed, or this producer finished):
    /// nothing can come back; finish.
    Settled,
}

/// What `work_left` saw.
enum WorkLeft {
    Free,
    Held,
    Settled,
}
