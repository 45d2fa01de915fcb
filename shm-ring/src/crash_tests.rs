//! Deterministic reproductions of kills in the middle of a ring operation: the test does half
//! of the operation by hand, as a process SIGKILLed at that point would leave it, then lets the
//! ring recover and carry on. (Kills between operations, in every interleaving, are the loom
//! models' part: see `model.rs`.)
//!
//! Each test names the defect of issue #9 it reproduces. Every one of them failed on the code
//! before that issue (checked once, with the same steps against the old encoding) and passes now.
//!
//! Length: just past 500 lines: one test per defect, each a short replay, sharing the by-hand
//! half-operations at the top; later issues' defects (#29) are added here the same way.

use std::time::Duration;

use crate::core::{Claim, Recovered, WorkClaim};
use crate::error::RingError;
use crate::layout::{Lease, Word, WorkWord, READY, WORK_RETURNED, WRITING};
use crate::model::{process, HeapRing, SUPERVISOR};
use crate::params::RingParams;
use crate::params::TakePolicy;
use crate::sync::Ordering;

/// Two producers (0, 1), one consumer (2), `slots` slots, `items` work items; both producers
/// registered (epoch 1).
fn ring(slots: usize, items: usize) -> HeapRing {
    let r = HeapRing::with_work(slots, 2, 1, TakePolicy::Fifo, items);
    assert_eq!(r.register(0, 0), 1);
    assert_eq!(r.register(1, 0), 1);
    r
}

/// Producer `id` "reserves" slot `idx` and is killed right after the CAS: the slot is WRITING
/// with whatever its `work_item` held.
fn reserve_by_hand(r: &HeapRing, id: u32, idx: usize) -> Claim {
    let s = &r.slots[idx];
    let cur = Word(s.state.load(Ordering::Relaxed));
    let new = cur.next(WRITING, id);
    s.state
        .compare_exchange(cur.0, new.0, Ordering::Acquire, Ordering::Relaxed)
        .unwrap();
    Claim { idx, word: new }
}

/// Runs `f` on a thread; fails the test if it does not return within 20 s (a spin or a hang).
fn watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    testkit::watchdog(what, Duration::from_secs(20), f)
}

/// Defect 1a. Producer 0 takes item 0 from the cursor and is preempted before its CAS; producer
/// 1 claims item 1 and dies; recovery returns item 1; the restarted producer 1 takes item 0
/// (still FREE). Producer 0's CAS fails. The returned item 1 must still be claimed by someone:
/// the old code trusted a count of returned items, which the restart's claim of item 0 had used
/// up, so item 1 stayed FREE and was never published.
#[test]
fn a_returned_item_is_claimed_after_a_scan_took_a_fresh_one() {
    let r = ring(2, 2);
    // Producer 0's claim, first half: its cursor ticket.
    assert_eq!(r.ctl.work_cursor.fetch_add(1, Ordering::Relaxed), 0);
    assert_eq!(r.r().claim_work(1, 1), Some(1));
    r.recover(1);
    let e = r.register(1, 1);
    let mut got = vec![r.r().claim_work(1, e).unwrap()];
    // Producer 0's claim, second half: the CAS on item 0 fails, so it looks further.
    assert!(r.work[0]
        .compare_exchange(
            0,
            WorkWord::claimed(0, 1).0,
            Ordering::Relaxed,
            Ordering::Relaxed
        )
        .is_err());
    got.extend(r.r().claim_work(0, 1));
    got.extend(r.r().claim_work(1, e));
    got.sort();
    assert_eq!(got, vec![0, 1], "every item is claimed by someone");
}

/// Defect 1b. Producer 1 claims a returned item and is killed right after its CAS (before the
/// old code decremented its count of returned items, which then stayed one too high for good).
/// With every item claimed, another producer's claim must answer None, not spin for ever.
#[test]
fn a_producer_killed_in_a_claim_makes_nobody_spin() {
    let r = std::sync::Arc::new(ring(2, 1));
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    r.recover(0);
    // Producer 1's claim of the returned item: the CAS, then the kill.
    r.work[0]
        .compare_exchange(
            WORK_RETURNED,
            WorkWord::claimed(1, 1).0,
            Ordering::Relaxed,
            Ordering::Relaxed,
        )
        .unwrap();
    let e = r.register(0, 1);
    let r2 = r.clone();
    let got = watchdog("claim_work with every item claimed", move || {
        r2.r().claim_work(0, e)
    });
    assert_eq!(got, None);
}

/// Defect 2, first half. Item 0 is published through slot 0 and consumed. Producer 1 reserves
/// slot 0 and is killed before it could clear the slot's old `work_item` (the old code cleared
/// it only after its CAS). Recovery must not turn the published item back into work: the old
/// code wrote CLAIMED over its DONE, it was redone and published twice.
#[test]
fn a_stale_work_item_never_brings_a_published_batch_back() {
    let r = ring(1, 1);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    r.deliver(0, 1, 0);
    let mut st = crate::core::TakeState::new(1, 2);
    let (_, _, held) = r.consume(2, &mut st).unwrap();
    r.r().release(2, held, false).unwrap();
    // The kill: WRITING by producer 1, carrying item 0 as the old code's slot still did.
    reserve_by_hand(&r, 1, 0);
    r.slots[0].work_item.store(1, Ordering::Relaxed);
    let out = r.recover(1);
    assert_eq!((out.freed, out.work_returned), (1, 0));
    assert!(r.all_work_done(), "the published item stays done");
    assert_eq!(r.r().claim_work(0, 1), None, "nothing to redo");
    assert_eq!(r.slots[0].work_item.load(Ordering::Relaxed), 0);
}

/// Defect 2, second half. Producer 0 holds item 0 now; a dead producer 1's WRITING slot carries
/// item 0 (stale, as above). Recovery of producer 1 must leave producer 0's claim alone: the old
/// code stored CLAIMED(1) over it with a plain store, then freed it, and producer 0's
/// `complete_work` failed with NotClaimed.
#[test]
fn recovery_never_overwrites_a_live_producers_claim() {
    let r = ring(2, 1);
    reserve_by_hand(&r, 1, 1);
    r.slots[1].work_item.store(1, Ordering::Relaxed);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    r.recover(1);
    r.deliver(0, 1, 0);
    assert!(r.all_work_done());
    assert_eq!(r.ready_batches(), vec![0]);
}

/// Defect 2, ordering. Producer 1 marked item 0 DONE in slot 0 and died before committing. The
/// supervisor's recovery is itself killed after it undid the mark (item FREE) but before it
/// freed the slot; producer 0 claims the item meanwhile. Recovery run again must free the slot
/// and leave producer 0's claim alone, so the batch is published exactly once.
#[test]
fn a_recovery_cut_short_and_run_again_is_still_correct() {
    for cut_after_clear in [false, true] {
        let r = ring(2, 1);
        assert_eq!(r.r().claim_work(1, 1), Some(0));
        let c = r.write(1, 0);
        r.r().complete_work(1, 1, c, 0).unwrap();
        // The first recovery, by hand up to the kill: takes the lease, undoes the mark.
        r.r().take_lease(1, SUPERVISOR, |_| false).unwrap();
        r.work[0]
            .compare_exchange(
                WorkWord::done(c.idx, c.word.generation()).0,
                0,
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .unwrap();
        if cut_after_clear {
            r.slots[c.idx].work_item.store(0, Ordering::Relaxed);
        }
        assert_eq!(r.r().claim_work(0, 1), Some(0));
        // Recovery again, by a new supervisor: the dead one's lease does not stop it.
        let again = r
            .r()
            .recover(1, process(9, 9), |l| l != SUPERVISOR, None)
            .unwrap();
        assert_eq!(again.freed, 1);
        r.deliver(0, 1, 0);
        assert_eq!(
            r.ready_batches(),
            vec![0],
            "cut after clear: {cut_after_clear}"
        );
        assert!(r.all_work_done());
    }
}

/// Defect 3. A slot whose item was marked DONE is aborted (a refused commit, or the guard
/// dropped): the item must become claimable again. The old code left it DONE with the slot FREE,
/// so recovery never saw it and the batch was never published.
#[test]
fn an_aborted_slot_gives_its_item_back() {
    let r = ring(1, 1);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    let c = r.write(0, 0);
    r.r().complete_work(0, 1, c, 0).unwrap();
    r.r().abort(c);
    assert_eq!(r.r().claim_work(1, 1), Some(0), "any producer may claim it");
    r.deliver(1, 1, 0);
    assert_eq!(r.ready_batches(), vec![0]);
}

/// Issue #27 (a kernel's fault, reported late). Recovery returns a dead producer's items
/// RETURNED, both the one it claimed and the one DONE in its WRITING slot: the next claim of
/// each says so (`WorkClaim::Returned`: run it alone), and only that claim. Without it a batch
/// whose fault a GPU reports late is never attributed, and kills target after target. An item
/// a live producer gave back, or whose slot it aborted, comes back plain.
#[test]
fn a_dead_producers_items_come_back_to_be_run_alone() {
    let r = ring(2, 3);
    let claim = |id, epoch| {
        r.r()
            .claim_work_until(id, epoch, Some(std::time::Instant::now()))
    };
    assert_eq!(claim(1, 1), WorkClaim::Item(0));
    assert_eq!(claim(1, 1), WorkClaim::Item(1));
    let c = r.write(1, 0);
    r.r().complete_work(1, 1, c, 1).unwrap();
    assert_eq!(claim(0, 1), WorkClaim::Item(2));
    r.r().unclaim_work(0, 1, 2).unwrap();
    assert_eq!(claim(0, 1), WorkClaim::Item(2), "given back alive: plain");
    let c = r.write(0, 1);
    r.r().complete_work(0, 1, c, 2).unwrap();
    r.r().abort(c);
    assert_eq!(claim(0, 1), WorkClaim::Item(2), "aborted alive: plain");
    let out = r.recover(1);
    assert_eq!((out.work_returned, out.freed), (2, 1));
    let got = [claim(0, 1), claim(0, 1)];
    assert_eq!(got, [WorkClaim::Returned(0), WorkClaim::Returned(1)]);
    // Given back by its live claimer, a returned item is plain again.
    r.r().unclaim_work(0, 1, 0).unwrap();
    assert_eq!(claim(0, 1), WorkClaim::Item(0));
}

/// Defect 4 (claims). A stale incarnation of producer 0, one recovery has already replaced, can
/// neither complete nor give back the item its successor holds now: claims carry the epoch.
/// The old code's claims named only the worker id, so the stale incarnation's `complete_work`
/// succeeded on its successor's claim.
#[test]
fn a_stale_incarnation_cannot_act_on_its_successors_claim() {
    let r = ring(2, 1);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    r.recover(0);
    let e = r.register(0, 1);
    assert_eq!(r.r().claim_work(0, e), Some(0));
    let stale = r.write(0, 0);
    assert!(matches!(
        r.r().complete_work(0, 1, stale, 0),
        Err(RingError::NotClaimed { item: 0 })
    ));
    assert!(matches!(
        r.r().unclaim_work(0, 1, 0),
        Err(RingError::NotClaimed { item: 0 })
    ));
    r.r().abort(stale);
    r.deliver(0, e, 0);
    assert_eq!(r.ready_batches(), vec![0]);
}

/// A slot carries one item: a second `complete_work` on it is refused, so recovery, which undoes
/// the item a slot carries, can never miss one.
#[test]
fn a_slot_carries_at_most_one_work_item() {
    let r = ring(1, 2);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    assert_eq!(r.r().claim_work(0, 1), Some(1));
    let c = r.write(0, 0);
    r.r().complete_work(0, 1, c, 0).unwrap();
    assert!(matches!(
        r.r().complete_work(0, 1, c, 1),
        Err(RingError::SlotCarriesWork { slot: 0, item: 0 })
    ));
    // The slot still carries item 0, and publishes it.
    r.publish(0, c, 0);
    assert_eq!(
        Word(r.slots[0].state.load(Ordering::Relaxed)).state(),
        READY
    );
    assert_eq!(r.ready_batches(), vec![0]);
}

/// Item 5's staleness rule on a real ring: a lease held by a zombie (exited, not reaped) or by
/// a recycled pid (a live process with another start time) does not block the id; one held by a
/// live process does.
#[test]
fn a_zombie_or_a_recycled_pid_does_not_block_an_id_but_a_live_process_does() {
    use std::process::Command;
    let name = format!("hspipe-u-{}-lease", std::process::id());
    let ring = crate::ring::Ring::create(&name, &RingParams::tiny_fifo()).unwrap();
    let lease = |pid: u32, start: u64| {
        ring.core_ref()
            .worker(0)
            .lease
            .store(Lease::of(pid, start).unwrap().0, Ordering::Relaxed)
    };
    /// Kills and reaps a child even if the test fails.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let live = Reap(Command::new("sleep").arg("30").spawn().unwrap());
    let zombie = Reap(Command::new("true").spawn().unwrap());
    let (live_pid, zpid) = (live.0.id(), zombie.0.id());
    // Wait until it has exited (it stays a zombie: we have not reaped it).
    watchdog("a child to exit", move || loop {
        let stat = std::fs::read_to_string(format!("/proc/{zpid}/stat")).unwrap();
        if stat[stat.rfind(')').unwrap() + 1..]
            .trim_start()
            .starts_with('Z')
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    });
    let start = |pid| crate::sys::process_start_ticks(pid).unwrap();

    lease(zpid, start(zpid));
    drop(ring.producer(0).expect("a zombie holder is gone"));
    lease(live_pid, start(live_pid) + 1);
    drop(ring.producer(0).expect("a recycled pid is not the holder"));
    lease(live_pid, start(live_pid));
    assert!(matches!(
        ring.producer(0),
        Err(RingError::WorkerBusy { pid, .. }) if pid == live_pid
    ));
    assert!(matches!(
        ring.recover(crate::worker::WorkerName::producer(0)),
        Err(RingError::WorkerAlive { pid, .. }) if pid == live_pid
    ));
    drop(live);
    ring.recover(crate::worker::WorkerName::producer(0))
        .unwrap();
    drop(ring.producer(0).unwrap());
}

/// Consumer 2 (registered) takes both items of a two-item ring: the ring, and each item with
/// its claim.
fn two_taken() -> (HeapRing, [(u64, Claim); 2]) {
    let r = ring(3, 2);
    r.register(2, 0);
    for item in 0..2 {
        assert_eq!(r.r().claim_work(0, 1), Some(item));
        r.deliver(0, 1, item);
    }
    let mut st = crate::core::TakeState::new(1, 2);
    let (a, _, ca) = r.consume(2, &mut st).unwrap();
    let (b, _, cb) = r.consume(2, &mut st).unwrap();
    (r, [(a, ca), (b, cb)])
}

/// A consumer holding two batches dies; recovery settles the first (`how`) and redelivers the
/// other. `given_back`: the consumer put the first back READY before it died (a Python rank's
/// batch dropped on an exception). Returns the settled batch, what the caller was shown, and
/// the recovery's counts.
fn settle_one_of_two(
    how: crate::core::Settle,
    given_back: bool,
) -> (u64, Vec<(usize, u64)>, Recovered) {
    let (r, [(a, claim), (b, _)]) = two_taken();
    if given_back {
        r.r().requeue(claim).unwrap();
        assert_eq!(r.ready_batches(), [a]);
    }
    let mut seen = Vec::new();
    let mut before = |idx: usize, meta: crate::core::ItemMeta, _| seen.push((idx, meta.batch_id));
    let mut retire = crate::core::Settling {
        batches: &[(a, how)],
        before: &mut before,
        work: &[],
    };
    let out = r
        .r()
        .recover(2, SUPERVISOR, |_| false, Some(&mut retire))
        .unwrap();
    // Only the other batch comes back, once more delivered.
    assert_eq!(
        r.ready_batches(),
        [b],
        "the settled batch is not delivered again"
    );
    r.register(2, 1);
    let mut st = crate::core::TakeState::new(1, 2);
    let (again, delivery, _) = r.consume(2, &mut st).unwrap();
    assert_eq!((again, delivery), (b, 1));
    let released = r.r().ctl.released.load(Ordering::Relaxed);
    let set_aside = r.r().ctl.set_aside.load(Ordering::Relaxed);
    match how {
        crate::core::Settle::Retire => assert_eq!((released, set_aside), (1, 0)),
        crate::core::Settle::SetAside => assert_eq!((released, set_aside), (0, 1)),
    }
    (a, seen, out)
}

/// The drafter group's case: a consumer holding two batches dies after the update that used the
/// first was applied (a committed group step) but before it released it. Recovery retiring that
/// batch frees its slot as consumed (it must not be trained twice) after showing it to the
/// caller, and still redelivers the other one.
#[test]
fn recovery_retires_a_batch_whose_update_was_applied_and_redelivers_the_rest() {
    let (a, seen, out) = settle_one_of_two(crate::core::Settle::Retire, false);
    assert_eq!((out.retired, out.set_aside, out.requeued), (1, 0, 1));
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].1, a,
        "the caller saw the retired batch before its slot was freed"
    );
}

/// A batch that killed the consumers that took it: recovery setting it aside frees its slot
/// unconsumed (counted apart from the released ones, so "trained" stays true), shows it to the
/// caller first, and redelivers the other batch the dead consumer held.
#[test]
fn recovery_sets_a_batch_aside_uncounted_as_trained_and_redelivers_the_rest() {
    let (a, seen, out) = settle_one_of_two(crate::core::Settle::SetAside, false);
    assert_eq!((out.retired, out.set_aside, out.requeued), (0, 1, 1));
    assert_eq!(seen.iter().map(|s| s.1).collect::<Vec<_>>(), [a]);
}

/// Two batches settled by one recovery, each its own way (a Python rank holding the batch of an
/// applied update and the next one, which it died on): one released, one set aside, none back.
#[test]
fn one_recovery_settles_two_batches_each_its_own_way() {
    use crate::core::Settle;
    let (r, [(a, _), (b, _)]) = two_taken();
    let mut seen = Vec::new();
    let mut before = |_: usize, meta: crate::core::ItemMeta, how| seen.push((meta.batch_id, how));
    let mut retire = crate::core::Settling {
        batches: &[(a, Settle::Retire), (b, Settle::SetAside)],
        before: &mut before,
        work: &[],
    };
    let out = (r.r())
        .recover(2, SUPERVISOR, |_| false, Some(&mut retire))
        .unwrap();
    assert_eq!((out.retired, out.set_aside, out.requeued), (1, 1, 0));
    seen.sort_by_key(|s| s.0);
    assert_eq!(seen, [(a, Settle::Retire), (b, Settle::SetAside)]);
    assert!(r.ready_batches().is_empty());
}

/// A batch to settle that its consumer gave back (READY) before it died is taken back and
/// settled all the same: not trained twice after an applied update, not delivered again once
/// set aside. Before, recovery looked only at the dead consumer's READING slots.
#[test]
fn recovery_settles_a_batch_its_consumer_gave_back_before_it_died() {
    for how in [crate::core::Settle::Retire, crate::core::Settle::SetAside] {
        let (a, seen, out) = settle_one_of_two(how, true);
        assert_eq!(out.retired + out.set_aside, 1, "{how:?}: {out:?}");
        assert_eq!(seen.iter().map(|s| s.1).collect::<Vec<_>>(), [a], "{how:?}");
    }
}

/// The drafter group's retire written down before the group goes on: the supervisor reads a
/// dead consumer's batch first (to record it), and the batch stays held for the recovery that
/// settles it, not delivered again in between; one the consumer gave back is taken back for
/// it. A batch it does not hold is not shown.
#[test]
fn a_dead_consumers_batch_read_before_its_settling_stays_held_for_it() {
    use crate::core::Settle;
    for given_back in [false, true] {
        let (r, [(a, claim), (b, _)]) = two_taken();
        if given_back {
            r.r().requeue(claim).unwrap();
        }
        let mut seen = Vec::new();
        let mut read = |_: usize, meta: crate::core::ItemMeta| seen.push(meta.batch_id);
        let held = (r.r()).read_held(2, SUPERVISOR, |_| false, a, &mut read);
        assert_eq!(held, Ok(true), "given back: {given_back}");
        assert_eq!(seen, [a]);
        assert!(r.ready_batches().is_empty(), "given back: {given_back}");
        let other = (r.r()).read_held(2, SUPERVISOR, |_| false, b + a + 1, &mut |_, _| {
            panic!("shown a batch the consumer does not hold")
        });
        assert_eq!(other, Ok(false));
        let mut retire = crate::core::Settling {
            batches: &[(a, Settle::Retire)],
            before: &mut |_, _, _| {},
            work: &[],
        };
        let out = (r.r())
            .recover(2, SUPERVISOR, |_| false, Some(&mut retire))
            .unwrap();
        assert_eq!(
            (out.retired, out.requeued),
            (1, 1),
            "given back: {given_back}"
        );
        assert_eq!(r.ready_batches(), [b]);
    }
}

/// What a producer's claim loop does next: publish an item, wait (items are still held by
/// others and may come back), or finish (nothing can come back any more).
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Item(u64),
    Wait,
    Finish,
}

/// One look by producer `id` (incarnation `epoch`) at the work table, without sleeping: what
/// the target's claim loop would do now.
fn next_work(r: &HeapRing, id: u32, epoch: u64) -> Next {
    match r
        .r()
        .claim_work_until(id, epoch, Some(std::time::Instant::now()))
    {
        WorkClaim::Item(i) | WorkClaim::Returned(i) => Next::Item(i),
        WorkClaim::Pending => Next::Wait,
        WorkClaim::Settled => Next::Finish,
    }
}

/// Producer `id` runs its claim loop until it must wait or finishes; returns true if it
/// finished.
fn claim_loop(r: &HeapRing, id: u32, epoch: u64) -> bool {
    loop {
        match next_work(r, id, epoch) {
            Next::Item(i) => r.deliver(id, epoch, i),
            Next::Wait => return false,
            Next::Finish => {
                r.r().finish(id);
                return true;
            }
        }
    }
}

/// Issue #29, item 1. Producer 0 publishes its share while producer 1 holds item 1; then
/// producer 1 dies, is recovered (item 1 FREE) and given up (retired). Producer 0, whose GPU
/// is fine, must publish item 1: the old protocol let it finish at its last scan (item 1 was
/// claimed then), the retire closed the ring, and item 1 was never published.
#[test]
fn a_claim_returned_after_the_others_last_scan_is_still_published() {
    let r = ring(2, 2);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    assert_eq!(r.r().claim_work(1, 1), Some(1));
    r.deliver(0, 1, 0);
    let finished = claim_loop(&r, 0, 1);
    r.recover(1);
    r.r().retire(1);
    if !finished {
        assert!(
            claim_loop(&r, 0, 1),
            "nothing is held any more: it finishes"
        );
    }
    assert!(r.r().closed());
    assert_eq!(r.ready_batches(), vec![0, 1], "every item is published");
    assert!(r.all_work_done());
}

/// Issue #29, item 1, the abort case. Producer 1 marks item 1 done in its slot and aborts after
/// producer 0's last scan (a refused commit): the item goes back FREE and producer 0 must still
/// publish it before it finishes, while producer 1 finishes with nothing left to claim.
#[test]
fn an_item_aborted_after_the_others_last_scan_is_still_published() {
    let r = ring(2, 2);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    assert_eq!(r.r().claim_work(1, 1), Some(1));
    let c = r.write(1, 1);
    r.r().complete_work(1, 1, c, 1).unwrap();
    r.deliver(0, 1, 0);
    let finished = claim_loop(&r, 0, 1);
    r.r().abort(c);
    // Producer 1 gives up on the item (it stops) and finishes.
    r.r().finish(1);
    if !finished {
        assert!(claim_loop(&r, 0, 1));
    }
    assert!(r.r().closed());
    assert_eq!(r.ready_batches(), vec![0, 1], "every item is published");
}

/// The fields of slot `idx` a writer stores before its commit.
fn slot_fields(r: &HeapRing, idx: usize) -> [u64; 6] {
    let s = &r.slots[idx];
    [
        s.len.load(Ordering::Relaxed),
        u64::from(s.bucket.load(Ordering::Relaxed)),
        s.tokens.load(Ordering::Relaxed),
        s.batch_id.load(Ordering::Relaxed),
        u64::from(s.producer.load(Ordering::Relaxed)),
        s.work_item.load(Ordering::Relaxed),
    ]
}

/// Issue #29, item 3. Producer 0's incarnation hangs in a write to slot 0 and is recovered
/// (the launcher judged it gone); producer 1 reserves slot 0 and writes its own batch. The
/// stale incarnation wakes, claims a fresh item and tries to complete it in, then commit, the
/// slot it lost: both must fail and change nothing in the slot or the work table. The old
/// `complete_work` linked its item into producer 1's slot and marked it DONE, and the old
/// `commit` overwrote producer 1's metadata, before either looked at the claim.
#[test]
fn a_stale_writer_changes_nothing_in_a_slot_it_no_longer_owns() {
    let r = ring(1, 2);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    let stale = r.write(0, 0);
    r.recover(0);
    // Producer 1 takes the fresh item 1 first; item 0 is FREE again.
    assert_eq!(r.r().claim_work(1, 1), Some(1));
    let fresh = r.write(1, 1);
    let (slot_before, work_before) = (
        slot_fields(&r, 0),
        WorkWord(r.work[1].load(Ordering::Relaxed)),
    );

    // The stale incarnation wakes: it claims item 0 again and goes on with its lost slot.
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    let item0 = r.work[0].load(Ordering::Relaxed);
    assert!(matches!(
        r.r().complete_work(0, 1, stale, 0),
        Err(RingError::Reclaimed { slot: 0 })
    ));
    let meta = crate::core::CommitMeta {
        bucket: 1,
        tokens: 77,
        batch_id: 99,
    };
    assert!(matches!(
        r.r().commit(0, stale, 5, meta),
        Err(RingError::Reclaimed { slot: 0 })
    ));
    assert_eq!(slot_fields(&r, 0), slot_before, "the slot is untouched");
    assert_eq!(WorkWord(r.work[1].load(Ordering::Relaxed)), work_before);
    assert_eq!(
        r.work[0].load(Ordering::Relaxed),
        item0,
        "item 0 stays claimed"
    );

    // Producer 1's batch is published as it wrote it.
    r.r().complete_work(1, 1, fresh, 1).unwrap();
    r.publish(1, fresh, 1);
    assert_eq!(r.ready_batches(), vec![1]);
    assert_eq!(r.r().item_meta(0).producer, 1);
}

/// Producer 1 is killed inside `finish`, after its `finished` flag and before the count of
/// finished producers; it is recovered and restarted, finds nothing to claim and finishes again
/// (a no-op for its flag), then producer 0 finishes. The ring must close: before #29 the close
/// was one increment per producer, which the killed producer never made, so the ring stayed
/// open for ever and every consumer waited (found by the crash search).
#[test]
fn a_producer_killed_inside_finish_does_not_leave_the_ring_open() {
    let r = ring(2, 1);
    assert_eq!(r.register(2, 0), 1);
    assert_eq!(r.r().claim_work(0, 1), Some(0));
    // Killed inside finish: the flag is set, nothing else.
    r.workers[1].finished.store(1, Ordering::Relaxed);
    r.recover(1);
    let e = r.register(1, 1);
    assert_eq!(r.r().claim_work(1, e), None);
    assert!(
        !r.r().finish(1),
        "producer 0 has not finished: the ring stays open"
    );
    assert!(!r.r().closed());
    r.deliver(0, 1, 0);
    assert!(
        r.r().finish(0),
        "the last producer's finish closes the ring"
    );
    assert!(r.r().closed());
    assert!(!r.r().retire(1), "the ring is closed once");
}

/// Recovers dead producer `id` as the supervisor does when it sets work item `item` aside (it
/// killed the producers that computed it).
fn recover_setting_aside(r: &HeapRing, id: u32, item: u64) -> Recovered {
    let mut settle = crate::core::Settling {
        batches: &[],
        before: &mut |_, _, _| {},
        work: &[item],
    };
    (r.r())
        .recover(id, SUPERVISOR, |_| false, Some(&mut settle))
        .unwrap()
}

/// A poison work item: producer 1 dies computing item 1 (holding its claim, or with the item
/// marked done in its slot), with item 2 claimed beside it. Recovery sets item 1 aside and
/// returns item 2: producer 0 publishes item 2, never item 1, and finishes with item 1 counted
/// as settled; the ring closes. Before, recovery returned item 1 FREE and the next producer to
/// claim it died on it in turn. An item the dead producer gave back is no longer its: not set
/// aside (a stale word of what it had in hand cannot set an innocent FREE item aside).
#[test]
fn a_work_item_set_aside_in_recovery_is_never_claimed_again_and_counts_as_settled() {
    for how in ["claimed", "marked"] {
        let r = ring(2, 3);
        assert_eq!(r.r().claim_work(0, 1), Some(0));
        assert_eq!(r.r().claim_work(1, 1), Some(1));
        assert_eq!(r.r().claim_work(1, 1), Some(2));
        if how == "marked" {
            let c = r.write(1, 1);
            r.r().complete_work(1, 1, c, 1).unwrap();
        }
        r.deliver(0, 1, 0);
        let out = recover_setting_aside(&r, 1, 1);
        assert_eq!((out.work_set_aside, out.work_returned), (1, 1), "{how}");
        assert_eq!(r.r().ctl.set_aside.load(Ordering::Relaxed), 1, "{how}");
        assert_eq!(
            recover_setting_aside(&r, 1, 1),
            Recovered::default(),
            "{how}: a recovery run again changes nothing"
        );
        assert!(claim_loop(&r, 0, 1), "{how}: nothing is held any more");
        r.r().retire(1);
        assert!(r.r().closed(), "{how}");
        assert_eq!(r.ready_batches(), vec![0, 2], "{how}");
    }
    let r = ring(2, 2);
    assert_eq!(r.r().claim_work(1, 1), Some(0));
    r.r().unclaim_work(1, 1, 0).unwrap();
    assert_eq!(recover_setting_aside(&r, 1, 0).work_set_aside, 0);
    assert!(claim_loop(&r, 0, 1));
    assert_eq!(r.ready_batches(), vec![0, 1], "published");
}
