//! Registration and recovery: who may act for a worker id, and how a dead worker's slots and
//! claims come back.
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
//!   may be counted twice; it is telemetry), unless the supervisor settles it (`Settling`): it is
//!   then freed, counted as released (its update was applied) or as set aside (it killed the
//!   consumers that took it); a batch to settle that the owner gave back (READY) is taken back
//!   for it first;
//! - every item CLAIMED by the id, whatever its epoch, goes back FREE;
//! - a work item the supervisor sets aside (`Settling::work`: it killed the producers that
//!   computed it) goes to SET_ASIDE wherever the two steps above would make it FREE; one the
//!   producer gave back before dying is no longer its, and is left as it is.

use super::*;

/// What `recover` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Slots the dead worker was writing, now FREE.
    pub freed: u32,
    /// Items the dead worker was reading, now READY again with delivery + 1.
    pub requeued: u32,
    /// Work items the dead producer had claimed (or marked done in an unpublished batch), now
    /// RETURNED: FREE for any producer, which runs each alone.
    pub work_returned: u64,
    /// Items the dead consumer was reading whose training is known to be applied (see
    /// `Ring::recover_settling`), now FREE as if released.
    pub retired: u32,
    /// Items the dead consumer was reading that the supervisor set aside
    /// (`Ring::recover_settling` with `Settle::SetAside`), now FREE, neither released nor
    /// delivered again.
    pub set_aside: u32,
    /// Work items the supervisor set aside (`Ring::recover_setting_aside_work`): settled for
    /// good, never claimed or published.
    pub work_set_aside: u64,
}

/// What recovery did, in words: `recovered 1 held batch(es), 0 slot(s), 2 work item(s)`, and
/// `, 1 set aside` when it set any aside.
impl std::fmt::Display for Recovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (r, s, w) = (self.requeued, self.freed, self.work_returned);
        write!(
            f,
            "recovered {r} held batch(es), {s} slot(s), {w} work item(s)"
        )?;
        match u64::from(self.set_aside) + self.work_set_aside {
            0 => Ok(()),
            n => write!(f, ", {n} set aside"),
        }
    }
}

/// How a supervisor settles one batch a dead consumer holds, instead of delivering it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Its training is applied (the group committed the update that used it): freed as a
    /// release would free it, counted as released.
    Retire,
    /// It is not to be delivered again (it killed the consumers that took it): freed unconsumed
    /// and counted as set aside.
    SetAside,
}

/// Batches a dead consumer holds that must not be delivered again, how each is settled, and
/// what to do with each before its slot is freed (the slot index, its meta, how); work items a
/// dead producer computed that are set aside instead of returned.
pub(crate) struct Settling<'f> {
    pub batches: &'f [(u64, Settle)],
    pub before: &'f mut dyn FnMut(usize, ItemMeta, Settle),
    pub work: &'f [u64],
}

impl Settling<'_> {
    /// How batch `batch_id` is settled, if it is one of these.
    fn how(&self, batch_id: u64) -> Option<Settle> {
        (self.batches.iter()).find_map(|&(b, how)| (b == batch_id).then_some(how))
    }
}

impl RingRef<'_> {
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
        settling: Option<&mut Settling<'_>>,
    ) -> Result<Recovered, Lease> {
        self.take_lease(id, me, holder_alive)?;
        let out = self.cleanup(id, settling);
        let w = self.worker(id);
        // A dead worker's clock stops here: readers count no time past its recovery, and the
        // phase it died in keeps the time snapshots showed running until now (`enter` adds it,
        // on the same clock as the phase's start), so cumulative figures never go back.
        // `enter(None)` also closes any idle gap.
        self.enter(id, None);
        w.device_busy_until.store(0, Ordering::Relaxed);
        w.in_hand.store(0, Ordering::Relaxed);
        let _ = w
            .state
            .compare_exchange(W_ALIVE, W_DEAD, Ordering::Relaxed, Ordering::Relaxed);
        self.give_back_lease(id, me);
        Ok(out)
    }

    /// For a supervisor (process `me`) that records batch `batch_id` of dead worker `id` before
    /// it settles it (a drafter group's retire, written down before the group goes on): shows
    /// `read` the slot holding it and its meta, and leaves the slot as it is, held by `id` for
    /// the recovery that settles it. One the owner gave back (READY) is taken back for it
    /// first, as that recovery would. Returns whether `id` holds the batch (not: released, or
    /// another consumer's). Takes `id`'s lease for the reading and gives it back, refusing a
    /// live holder as `recover` does.
    pub(crate) fn read_held(
        &self,
        id: u32,
        me: Lease,
        holder_alive: impl Fn(Lease) -> bool,
        batch_id: u64,
        read: &mut dyn FnMut(usize, ItemMeta),
    ) -> Result<bool, Lease> {
        self.take_lease(id, me, holder_alive)?;
        self.take_back(id, batch_id);
        // The dead owner cannot move its READING slots, and only the lease holder recovers
        // them, so the slot found stays this batch's while `read` looks at it.
        let found = (0..self.slots.len()).find(|&idx| {
            let w = Word(self.slots[idx].state.load(Ordering::Acquire));
            w.state() == READING && w.owner() == id && self.item_meta(idx).batch_id == batch_id
        });
        if let Some(idx) = found {
            read(idx, self.item_meta(idx));
        }
        self.give_back_lease(id, me);
        Ok(found.is_some())
    }

    /// A batch to be settled that its owner gave back before it died (a Python rank's batch
    /// dropped on an exception is requeued at once) is READY, not READING: taken back here for
    /// `id`, by the CAS a take makes, so that the cleanup settles it instead of another
    /// consumer training it. The caller holds `id`'s lease, so it acts as `id`; a consumer that
    /// takes the batch first wins the CAS, and the batch is then its.
    fn take_back(&self, id: u32, batch_id: u64) {
        for s in self.slots {
            let cur = Word(s.state.load(Ordering::Acquire));
            // A stale `batch_id` (the slot moved on after the load above) fails the CAS: its
            // generation changed.
            if cur.state() == READY && s.batch_id.load(Ordering::Relaxed) == batch_id {
                // SYNC: Acquire, as the take's CAS in `try_take`: pairs with the Release CAS
                // that published the batch, so its meta and payload are seen.
                let _ = s.state.compare_exchange(
                    cur.0,
                    cur.next(READING, id).0,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// Slots WRITING or READING by worker `id` (any incarnation).
    pub(crate) fn held_by(&self, id: u32) -> usize {
        let held = |s: &&SlotRecord| {
            let w = Word(s.state.load(Ordering::Relaxed));
            (w.state() == WRITING || w.state() == READING) && w.owner() == id
        };
        self.slots.iter().filter(held).count()
    }

    /// Returns what earlier incarnations of worker `id` held: WRITING slots become FREE (the
    /// item each carried, if marked DONE in that slot, FREE again), READING slots READY again
    /// with delivery + 1 (at-least-once delivery), CLAIMED work items FREE. The caller holds
    /// `id`'s lease, so no incarnation of `id` runs. Idempotent: see "Registration and
    /// recovery" in the module doc for why an interrupted run is completed by the next.
    ///
    /// With `settling`, a READING slot holding one of `settling.batches` is instead freed, after
    /// `settling.before` has seen it, and counted as its `Settle` says: released (its batch counts
    /// as consumed) or set aside; a work item of `settling.work` that would go back FREE is set
    /// aside instead (counted as set aside too).
    pub(crate) fn cleanup(&self, id: u32, mut settling: Option<&mut Settling<'_>>) -> Recovered {
        let mut out = Recovered::default();
        for &(batch_id, _) in settling.as_ref().map_or(&[][..], |r| r.batches) {
            self.take_back(id, batch_id);
        }
        let aside: &[u64] = settling.as_ref().map_or(&[], |r| r.work);
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
            // How this slot's batch is settled, if it is one to settle (READING slots only).
            let settle = (settling.as_ref()).and_then(|r| r.how(self.item_meta(idx).batch_id));
            match cur.state() {
                WRITING => {
                    // The batch in this slot was never published: the item it completes, if
                    // marked DONE in this very WRITING period, is not done. Unmark first, free
                    // the slot last, so a recovery cut short in between still sees the slot.
                    match self.unmark_work(Claim { idx, word: cur }, Some(aside)) {
                        Some(Undone::Returned) => out.work_returned += 1,
                        Some(Undone::SetAside) => out.work_set_aside += 1,
                        None => {}
                    }
                    if cas(cur.next(FREE, 0)) {
                        out.freed += 1;
                    }
                }
                READING if settle.is_some() => {
                    // Settled, not delivered again. The dead owner cannot move the slot, so
                    // `before` reads a payload nobody else touches.
                    let how = settle.unwrap_or(Settle::Retire);
                    if let Some(r) = settling.as_mut() {
                        (r.before)(idx, self.item_meta(idx), how);
                    }
                    s.work_item.store(0, Ordering::Relaxed);
                    if cas(cur.next(FREE, 0)) {
                        match how {
                            Settle::Retire => {
                                out.retired += 1;
                                sync::tally(&self.ctl.released, 1);
                            }
                            Settle::SetAside => {
                                out.set_aside += 1;
                                sync::tally(&self.ctl.set_aside, 1);
                            }
                        }
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
        // Items still claimed by any incarnation of the id go back for another producer, or are
        // set aside. Only the dead producer's own: one it gave back is no longer its to settle.
        for (i, w) in self.work.iter().enumerate() {
            let v = WorkWord(w.load(Ordering::Relaxed));
            if v.claimer() != Some(id) {
                continue;
            }
            let set_aside = aside.contains(&(i as u64));
            let new = if set_aside {
                WORK_SET_ASIDE
            } else {
                WORK_RETURNED
            };
            if w.compare_exchange(v.0, new, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                match set_aside {
                    true => out.work_set_aside += 1,
                    false => out.work_returned += 1,
                }
            }
        }
        sync::tally(&self.ctl.set_aside, out.work_set_aside);
        sync::tally(&self.ctl.redelivered, u64::from(out.requeued));
        sync::tally(&self.ctl.aborted, u64::from(out.freed));
        let settled = out.retired + out.set_aside;
        if out.freed > 0 || settled > 0 {
            crate::sync::bump(&self.ctl.free_seq, &self.ctl.free_waiters);
        }
        if out.work_returned > 0 || out.work_set_aside > 0 {
            // Producers waiting for held work claim what came back, or see it settled (see
            // `work.rs`).
            crate::sync::bump(&self.ctl.work_seq, &self.ctl.work_waiters);
        }
        if out.requeued > 0 || settled > 0 || self.closed() {
            crate::sync::bump(&self.ctl.ready_seq, &self.ctl.ready_waiters);
        }
        out
    }
}
