//! The state machine on heap memory, and the loom models that check it.
//!
//! Length: the heap ring's helpers and the models that use them stay together, so each model
//! reads with the steps it is built from; every model is one scenario, standing alone.
//!
//! Run the models with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom cargo test -p shm-ring --release --lib model`.
//! Capacities are tiny (one or two slots) so loom can explore every interleaving. Each slot's
//! payload is a loom `UnsafeCell`: if the Release/Acquire pairs in `core.rs` did not order a
//! writer's payload stores before a reader's loads, loom would report a data race.
//!
//! A SIGKILL is modelled by a thread that stops between two ring operations without cleaning
//! up; the supervisor joins it (a process's exit happens before its reaping) and then recovers.
//! Kills inside one operation are covered by the deterministic tests in `crash_tests.rs`, which
//! do half an operation by hand.

use crate::core::{Claim, CommitMeta, CoreParams, RingRef, TakeState, Taken};
use crate::layout::{Control, Lease, SlotRecord, WorkWord, WorkerRecord};
use crate::params::TakePolicy;
use crate::sync::{AtomicU64, Ordering};

#[cfg(loom)]
use loom::cell::UnsafeCell;

/// A std stand-in with loom's `UnsafeCell` API, for the same models run as plain unit tests.
#[cfg(not(loom))]
#[derive(Default)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(v: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

pub(crate) struct HeapRing {
    params: CoreParams,
    pub(crate) ctl: Control,
    pub(crate) slots: Vec<SlotRecord>,
    pub(crate) workers: Vec<WorkerRecord>,
    pub(crate) work: Vec<AtomicU64>,
    payload: Vec<UnsafeCell<u64>>,
}

// SAFETY: payload cells are only touched by the owner of the slot under the state machine, which
// is exactly what these models check.
unsafe impl Sync for HeapRing {}
// SAFETY: as above.
unsafe impl Send for HeapRing {}

impl HeapRing {
    pub(crate) fn new(slots: usize, producers: u32, consumers: u32, policy: TakePolicy) -> Self {
        Self::with_work(slots, producers, consumers, policy, 0)
    }

    /// A ring with a work table of `items` items.
    pub(crate) fn with_work(
        slots: usize,
        producers: u32,
        consumers: u32,
        policy: TakePolicy,
        items: usize,
    ) -> Self {
        HeapRing {
            params: CoreParams {
                producers,
                buckets: 2,
                policy,
            },
            ctl: Control::default(),
            slots: (0..slots).map(|_| SlotRecord::default()).collect(),
            workers: (0..producers + consumers)
                .map(|_| WorkerRecord::default())
                .collect(),
            work: (0..items).map(|_| AtomicU64::new(0)).collect(),
            payload: (0..slots).map(|_| UnsafeCell::new(0)).collect(),
        }
    }

    pub(crate) fn r(&self) -> RingRef<'_> {
        RingRef {
            params: self.params,
            ctl: &self.ctl,
            slots: &self.slots,
            workers: &self.workers,
            work: &self.work,
        }
    }

    /// Registers worker `id` for incarnation `inc` (a stand-in process), whose predecessors are
    /// all gone; returns the epoch.
    pub(crate) fn register(&self, id: u32, inc: u32) -> u64 {
        self.r().register(id, process(id, inc), |_| false).unwrap()
    }

    /// The supervisor recovers worker `id`, whose process is gone.
    pub(crate) fn recover(&self, id: u32) -> crate::core::Recovered {
        self.r().recover(id, SUPERVISOR, |_| false, None).unwrap()
    }

    /// Producer `id` writes `item` into a slot it reserves.
    pub(crate) fn write(&self, id: u32, item: u64) -> Claim {
        let c = self.r().reserve(id, None).unwrap().unwrap();
        // SAFETY: slot `c.idx` is WRITING and owned by `id`.
        self.payload[c.idx].with_mut(|p| unsafe { *p = item });
        c
    }

    /// Producer `id` (incarnation `epoch`) publishes work item `item`, which it claimed.
    pub(crate) fn deliver(&self, id: u32, epoch: u64, item: u64) {
        let c = self.write(id, item);
        self.r().complete_work(id, epoch, c, item).unwrap();
        self.publish(id, c, item);
    }

    /// Publishes `item` from slot `c`.
    pub(crate) fn publish(&self, id: u32, c: Claim, item: u64) {
        let meta = CommitMeta {
            bucket: (item % 2) as u32,
            tokens: 1,
            batch_id: item,
        };
        self.r().commit(id, c, 8, meta).unwrap();
    }

    /// Producer `id` claims and publishes work items until none is left, following `script`
    /// for its first item. Returns false if the script killed it.
    pub(crate) fn produce_work(&self, id: u32, epoch: u64, script: Script) -> bool {
        self.produce_loop(id, epoch, script, || self.r().claim_work(id, epoch))
    }

    /// As `produce_work`, claiming as a target does: while items are held by others it waits
    /// for them to settle or come back, so when it returns true every item is settled.
    pub(crate) fn produce_work_waiting(&self, id: u32, epoch: u64, script: Script) -> bool {
        self.produce_loop(id, epoch, script, || {
            match self.r().claim_work_until(id, epoch, None) {
                crate::core::WorkClaim::Item(i) | crate::core::WorkClaim::Returned(i) => Some(i),
                crate::core::WorkClaim::Settled => None,
                crate::core::WorkClaim::Pending => unreachable!("no deadline"),
            }
        })
    }

    fn produce_loop(
        &self,
        id: u32,
        epoch: u64,
        mut script: Script,
        claim: impl Fn() -> Option<u64>,
    ) -> bool {
        while let Some(item) = claim() {
            let first = std::mem::replace(&mut script, Script::Normal);
            if first == Script::DieAfterClaim {
                return false;
            }
            let c = self.write(id, item);
            if first == Script::DieAfterReserve {
                return false;
            }
            self.r().complete_work(id, epoch, c, item).unwrap();
            match first {
                Script::DieAfterComplete => return false,
                Script::AbortAfterComplete => {
                    self.r().abort(c);
                    continue;
                }
                _ => {}
            }
            self.publish(id, c, item);
        }
        true
    }

    /// Batch ids in READY slots, sorted.
    pub(crate) fn ready_batches(&self) -> Vec<u64> {
        let mut v: Vec<u64> = (0..self.slots.len())
            .filter(|&i| {
                crate::layout::Word(self.slots[i].state.load(Ordering::Acquire)).state()
                    == crate::layout::READY
            })
            .map(|i| self.r().item_meta(i).batch_id)
            .collect();
        v.sort();
        v
    }

    /// True if every work item is DONE.
    pub(crate) fn all_work_done(&self) -> bool {
        self.work
            .iter()
            .all(|w| WorkWord(w.load(Ordering::Relaxed)).is_done())
    }

    /// Producer `id` publishes `value` (also its batch id), blocking while the ring is full.
    pub(crate) fn produce(&self, id: u32, value: u64) {
        let c = self.write(id, value);
        self.publish(id, c, value);
    }

    /// Consumer `id` takes one item and checks its payload matches its metadata. Returns
    /// (batch id, delivery, claim) or None at end of stream. The caller releases (or "dies").
    pub(crate) fn consume(
        &self,
        id: u32,
        st: &mut TakeState,
    ) -> Option<(u64, u32, crate::core::Claim)> {
        match self.r().take(id, st, None, None) {
            Taken::Item(c) => {
                // SAFETY: slot `c.idx` is READING and owned by `id`.
                let v = self.payload[c.idx].with(|p| unsafe { *p });
                let m = self.r().item_meta(c.idx);
                assert_eq!(v, m.batch_id, "payload and metadata disagree");
                Some((v, m.delivery, c))
            }
            Taken::End => None,
            Taken::TimedOut => unreachable!("no deadline"),
        }
    }
}

/// The lease of a stand-in process: incarnation `inc` of worker `id`.
pub(crate) fn process(id: u32, inc: u32) -> Lease {
    Lease::of(1 + id * 64 + inc, 0).unwrap()
}

/// The stand-in supervisor process.
pub(crate) const SUPERVISOR: Lease = Lease(1 << 63 | 99_999 << 41);

/// What a producer in a model does with its first work item: carry on, or stop (die) after a
/// step, or abort the slot after marking the item done and carry on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Script {
    Normal,
    DieAfterClaim,
    DieAfterReserve,
    DieAfterComplete,
    AbortAfterComplete,
}

#[cfg(loom)]
use loom::{sync::Arc, thread};

/// Runs a loom model. Waiters spin with `yield_now` under loom (there is no futex), so a model
/// legitimately takes more branches than loom's default allows; preemptions stay bounded by
/// `LOOM_MAX_PREEMPTIONS`.
#[cfg(loom)]
fn run_model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.max_branches = 100_000;
    b.check(f);
}

#[cfg(not(loom))]
fn run_model(f: impl Fn() + Sync + Send + 'static) {
    // Without loom, run each model many times on real threads.
    for _ in 0..200 {
        f();
    }
}
#[cfg(not(loom))]
use std::{sync::Arc, thread};

/// Two producers through ONE slot to one consumer: the slot is reused, so the reader's release
/// must happen before the second writer's stores (release → reserve pair), and each commit
/// before the read (commit → take pair). Every item arrives exactly once, then end of stream.
/// The first item is refused (`ReadSlot::refuse`), whose CAS frees the slot as a release does.
#[test]
fn slot_state_machine_reuses_one_slot_safely() {
    run_model(|| {
        let ring = Arc::new(HeapRing::new(1, 2, 1, TakePolicy::Fifo));
        let producers: Vec<_> = (0..2u32)
            .map(|p| {
                let ring = ring.clone();
                thread::spawn(move || {
                    ring.produce(p, 10 + u64::from(p));
                    ring.r().finish(p);
                })
            })
            .collect();
        let mut st = TakeState::new(1, 2);
        let mut got = Vec::new();
        while let Some((v, delivery, c)) = ring.consume(2, &mut st) {
            assert_eq!(delivery, 0);
            got.push(v);
            ring.r().release(2, c, got.len() == 1).unwrap();
        }
        for p in producers {
            p.join().unwrap();
        }
        got.sort();
        assert_eq!(got, vec![10, 11]);
        // Loom models skip the telemetry counters (`sync::tally`); the real threads count.
        if cfg!(not(loom)) {
            let ctl = &ring.r().ctl;
            let (released, refused) = (
                ctl.released.load(Ordering::Relaxed),
                ctl.refused.load(Ordering::Relaxed),
            );
            assert_eq!(
                (released, refused),
                (1, 1),
                "one item released, one refused"
            );
        }
    });
}

/// Close broadcast: producer 0 publishes one item and finishes while producer 1 finishes with
/// nothing; two consumers take until end of stream. Whichever producer finishes last closes the
/// ring and wakes both consumers; neither consumer ends before the item is taken, and it is
/// taken exactly once.
#[test]
fn close_broadcast_wakes_every_consumer_after_the_last_item() {
    run_model(|| {
        let ring = Arc::new(HeapRing::new(1, 2, 2, TakePolicy::Fifo));
        let p0 = {
            let ring = ring.clone();
            thread::spawn(move || {
                ring.produce(0, 20);
                ring.r().finish(0);
            })
        };
        let p1 = {
            let ring = ring.clone();
            thread::spawn(move || {
                ring.r().finish(1);
            })
        };
        let drain = |ring: &HeapRing, c: u32| {
            let mut st = TakeState::new(7, c);
            let mut got = Vec::new();
            while let Some((v, _, claim)) = ring.consume(c, &mut st) {
                got.push(v);
                ring.r().release(c, claim, false).unwrap();
            }
            got
        };
        let c3 = {
            let ring = ring.clone();
            thread::spawn(move || drain(&ring, 3))
        };
        let mut all = drain(&ring, 2);
        all.extend(c3.join().unwrap());
        p0.join().unwrap();
        p1.join().unwrap();
        assert_eq!(all, vec![20]);
        assert!(ring.r().closed());
    });
}

/// Recovery: consumer A holds the only item when it dies; a producer died mid-write. While
/// consumer B waits, the supervisor recovers and retires the producer (which closes the ring) and
/// recovers A. B must not see end of stream while A's item is in flight: it must receive the item
/// again with delivery 1, and only then the end.
#[test]
fn recovery_redelivers_a_dead_consumers_item_and_frees_a_dead_writers_slot() {
    run_model(|| {
        // Producers 0 and 1, consumers 2 (A) and 3 (B).
        let ring = Arc::new(HeapRing::new(2, 2, 2, TakePolicy::Fifo));
        ring.produce(0, 30);
        ring.r().finish(0);
        // Producer 1 claims the other slot and dies before committing.
        let _lost = ring.r().reserve(1, None).unwrap().unwrap();
        // A takes the item and dies without releasing it.
        let mut st = TakeState::new(3, 2);
        let (v, delivery, _held) = ring.consume(2, &mut st).unwrap();
        assert_eq!((v, delivery), (30, 0));

        let b = {
            let ring = ring.clone();
            thread::spawn(move || {
                let mut st = TakeState::new(4, 3);
                let mut got = Vec::new();
                while let Some((v, delivery, claim)) = ring.consume(3, &mut st) {
                    got.push((v, delivery));
                    ring.r().release(3, claim, false).unwrap();
                }
                got
            })
        };
        let r1 = ring.recover(1);
        assert_eq!((r1.freed, r1.requeued), (1, 0));
        assert!(
            ring.r().retire(1),
            "retiring the last producer closes the ring"
        );
        let ra = ring.recover(2);
        assert_eq!((ra.freed, ra.requeued), (0, 1));
        assert_eq!(b.join().unwrap(), vec![(30, 1)]);
    });
}

/// A live consumer gives an item back (`requeue`, a batch it will not train) while another
/// consumer waits to take: the other takes it exactly once, payload intact, its delivery
/// counted. Fails without requeue's wake (checked once): the waiting consumer sleeps on.
#[test]
fn a_requeued_item_is_taken_once_by_another_consumer_with_its_delivery_counted() {
    run_model(|| {
        // Producer 0, consumers 1 (A) and 2 (B).
        let ring = Arc::new(HeapRing::new(1, 1, 2, TakePolicy::Fifo));
        ring.produce(0, 40);
        ring.r().finish(0);
        let b = {
            let ring = ring.clone();
            thread::spawn(move || {
                let mut st = TakeState::new(5, 2);
                let mut got = Vec::new();
                while let Some((v, delivery, claim)) = ring.consume(2, &mut st) {
                    got.push((v, delivery));
                    ring.r().release(2, claim, false).unwrap();
                }
                got
            })
        };
        // A takes once: the item, which it gives back (B, perhaps asleep, must be woken for
        // it), or the end of the stream when B was first.
        let mut st = TakeState::new(6, 2);
        let gave_back = match ring.consume(1, &mut st) {
            Some((40, 0, claim)) => {
                ring.r().requeue(claim).unwrap();
                true
            }
            Some(other) => panic!("A took {other:?}"),
            None => false,
        };
        let want = if gave_back { (40, 1) } else { (40, 0) };
        assert_eq!(b.join().unwrap(), vec![want]);
    });
}

/// A consumer gives its item back (`requeue`: a Python rank's batch dropped on an exception) and
/// dies; the supervisor sets the item aside, taking it back from READY, while another consumer
/// takes: the item goes to exactly one of them (trained once, or set aside once, never both
/// nor neither), and the payload the supervisor reads is the published one.
#[test]
fn a_given_back_item_is_either_taken_or_set_aside_never_both() {
    run_model(|| {
        // Producer 0, consumers 1 (A) and 2 (B).
        let ring = Arc::new(HeapRing::new(1, 1, 2, TakePolicy::Fifo));
        ring.produce(0, 50);
        ring.r().finish(0);
        let b = {
            let ring = ring.clone();
            thread::spawn(move || {
                let mut st = TakeState::new(7, 2);
                let mut got = Vec::new();
                while let Some((v, _, claim)) = ring.consume(2, &mut st) {
                    got.push(v);
                    ring.r().release(2, claim, false).unwrap();
                }
                got
            })
        };
        let mut st = TakeState::new(8, 1);
        let mut set_aside = 0;
        if let Some((50, 0, claim)) = ring.consume(1, &mut st) {
            ring.r().requeue(claim).unwrap();
            // A dies; the supervisor settles its batch.
            let mut seen = Vec::new();
            let mut before = |idx: usize, _: crate::core::ItemMeta, _| {
                // SAFETY: the slot is READING by A, whose lease recovery holds.
                seen.push(ring.payload[idx].with(|p| unsafe { *p }));
            };
            let mut settle = crate::core::Settling {
                batches: &[(50, crate::core::Settle::SetAside)],
                before: &mut before,
                work: &[],
            };
            let out = (ring.r())
                .recover(1, SUPERVISOR, |_| false, Some(&mut settle))
                .unwrap();
            set_aside = out.set_aside;
            assert_eq!(seen.len() as u32, set_aside);
            assert!(seen.iter().all(|&v| v == 50), "{seen:?}");
        }
        let got = b.join().unwrap();
        let taken = got.iter().filter(|&&v| v == 50).count() as u32;
        assert_eq!(
            taken + set_aside,
            1,
            "B took {got:?}, set aside {set_aside}"
        );
    });
}

/// The work table with a producer killed at each step (or aborting after `complete_work`) while
/// another producer claims and publishes, the supervisor recovering the victim as soon as it is
/// gone and restarting it: every item is published exactly once and ends DONE.
///
/// Fails on the code before issue #9 (checked once against it, LOOM_MAX_PREEMPTIONS=2): at
/// `DieAfterClaim` loom stops with "Model exceeded maximum number of branches": the count of
/// returned items that the old claim trusted went wrong when a redo scan took a fresh item whose
/// cursor holder was preempted before its CAS, and a producer spun in the redo loop (the same
/// scan is what strands an item in `crash_tests::a_returned_item_is_claimed_after_a_scan_took_a_fresh_one`);
/// `AbortAfterComplete` loses an item (the aborted slot went FREE with its item DONE).
#[test]
fn work_items_are_published_once_whatever_step_a_producer_dies_at() {
    for script in [
        Script::DieAfterClaim,
        Script::DieAfterReserve,
        Script::DieAfterComplete,
        Script::AbortAfterComplete,
    ] {
        run_model(move || {
            // Producers 0 and 1, no consumer; two slots hold both items.
            let ring = Arc::new(HeapRing::with_work(2, 2, 1, TakePolicy::Fifo, 2));
            let e0 = ring.register(0, 0);
            let e1 = ring.register(1, 0);
            let live = {
                let ring = ring.clone();
                thread::spawn(move || assert!(ring.produce_work(0, e0, Script::Normal)))
            };
            let victim = {
                let ring = ring.clone();
                thread::spawn(move || ring.produce_work(1, e1, script))
            };
            if !victim.join().unwrap() {
                ring.recover(1);
                let e = ring.register(1, 1);
                assert!(ring.produce_work(1, e, Script::Normal));
            }
            live.join().unwrap();
            assert_eq!(ring.ready_batches(), vec![0, 1], "{script:?}");
            assert!(ring.all_work_done(), "{script:?}");
        });
    }
}

/// Registration is one CAS: two processes registering one id at once never both succeed, and
/// when the previous holder is dead exactly one takes over, cleaning up what it left (its
/// claimed item goes back once) and starting the next epoch.
///
/// Fails on the code before issue #9 (checked once, LOOM_MAX_PREEMPTIONS=2, against a
/// transcription of its check-then-store `Ring::register`): both registrants win.
#[test]
fn two_registrations_of_one_id_never_both_win() {
    for predecessor_dead in [false, true] {
        run_model(move || {
            let ring = Arc::new(HeapRing::with_work(1, 1, 1, TakePolicy::Fifo, 1));
            if predecessor_dead {
                let e = ring.register(0, 0);
                assert_eq!(ring.r().claim_work(0, e), Some(0));
                // It dies holding the claim and its lease; nobody has recovered it.
            }
            let dead = process(0, 0);
            let alive = move |l: Lease| l != dead;
            let contenders: Vec<_> = [1, 2]
                .into_iter()
                .map(|inc| {
                    let ring = ring.clone();
                    thread::spawn(move || ring.r().register(0, process(0, inc), alive).ok())
                })
                .collect();
            let won: Vec<u64> = contenders
                .into_iter()
                .filter_map(|t| t.join().unwrap())
                .collect();
            let first = u64::from(predecessor_dead) + 1;
            assert_eq!(
                won,
                vec![first],
                "exactly one registrant wins, with the next epoch"
            );
            // The winner may claim the item again: it went back exactly once.
            assert_eq!(ring.r().claim_work(0, first), Some(0));
            assert_eq!(ring.r().claim_work(0, first), None);
        });
    }
}

/// The work table through ONE slot with a consumer, so a batch reuses the slot the consumer
/// released (which clears its work-item link): producer 1 publishes one item, then dies after
/// reserving the slot again, or after marking its second item done in it; the supervisor
/// recovers and restarts it while the consumer drains. Both items are delivered exactly once,
/// then end of stream.
#[test]
fn work_items_survive_slot_reuse_with_a_consumer() {
    for script in [Script::DieAfterReserve, Script::DieAfterComplete] {
        run_model(move || {
            // Producer 1 only (producer 0 has finished), consumer 2, one slot, two items.
            let ring = Arc::new(HeapRing::with_work(1, 2, 1, TakePolicy::Fifo, 2));
            ring.r().finish(0);
            let e1 = ring.register(1, 0);
            let victim = {
                let ring = ring.clone();
                thread::spawn(move || {
                    let item = ring.r().claim_work(1, e1).unwrap();
                    ring.deliver(1, e1, item);
                    ring.produce_work(1, e1, script)
                })
            };
            let consumer = {
                let ring = ring.clone();
                thread::spawn(move || {
                    let mut st = TakeState::new(5, 2);
                    let mut got = Vec::new();
                    while let Some((v, _, c)) = ring.consume(2, &mut st) {
                        got.push(v);
                        ring.r().release(2, c, false).unwrap();
                    }
                    got
                })
            };
            assert!(!victim.join().unwrap());
            ring.recover(1);
            let e = ring.register(1, 1);
            assert!(ring.produce_work(1, e, Script::Normal));
            ring.r().finish(1);
            let mut got = consumer.join().unwrap();
            got.sort();
            assert_eq!(got, vec![0, 1], "{script:?}");
            assert!(ring.all_work_done(), "{script:?}");
        });
    }
}

/// Issue #29, item 1: a producer that finds nothing FREE waits while the other holds the only
/// item, and publishes it if it comes back. Producer 1 claims it first (or not, as loom
/// schedules) and runs normally, dies after its claim, or dies after marking it done in its
/// slot; the supervisor then recovers and retires it (given up, never restarted). The item is
/// published exactly once, both producers count toward the close, the ring closes, and no
/// wait loses its wake-up (loom's futex has no timeout: a lost wake is a deadlock).
#[test]
fn a_waiting_producer_publishes_an_item_given_back_by_a_retired_one() {
    for script in [
        Script::Normal,
        Script::DieAfterClaim,
        Script::DieAfterComplete,
    ] {
        run_model(move || {
            // Producers 0 and 1, no consumer; one slot, one item.
            let ring = Arc::new(HeapRing::with_work(1, 2, 1, TakePolicy::Fifo, 1));
            let e0 = ring.register(0, 0);
            let e1 = ring.register(1, 0);
            let live = {
                let ring = ring.clone();
                thread::spawn(move || {
                    assert!(ring.produce_work_waiting(0, e0, Script::Normal));
                    ring.r().finish(0);
                })
            };
            let victim = {
                let ring = ring.clone();
                thread::spawn(move || {
                    let lived = ring.produce_work_waiting(1, e1, script);
                    if lived {
                        ring.r().finish(1);
                    }
                    lived
                })
            };
            if !victim.join().unwrap() {
                ring.recover(1);
                ring.r().retire(1);
            }
            live.join().unwrap();
            assert_eq!(ring.ready_batches(), vec![0], "{script:?}");
            assert!(ring.all_work_done(), "{script:?}");
            assert!(ring.r().closed(), "{script:?}");
        });
    }
}

/// A work item that kills the producers that compute it is set aside by the supervisor when it
/// recovers the dead one, while the other producer waits for that item to settle or come back.
/// Producer 1 dies holding it (claimed, or marked done in its slot): it is set aside, and
/// producer 0 finishes (the set-aside item counts as settled, and its wake is not lost: loom's
/// futex has no timeout). Or producer 1 gives it back first: it is no longer the dead one's,
/// so it is not set aside, and producer 0 publishes it, whenever the recovery runs. Either way
/// the ring closes.
#[test]
fn a_waiting_producer_finishes_once_the_item_another_died_on_is_set_aside() {
    /// Where producer 1 dies: holding its claim, with the item marked done in its slot, or
    /// after giving it back.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Death {
        Claimed,
        Marked,
        GaveBack,
    }
    for death in [Death::Claimed, Death::Marked, Death::GaveBack] {
        run_model(move || {
            let ring = Arc::new(HeapRing::with_work(1, 2, 1, TakePolicy::Fifo, 1));
            let e0 = ring.register(0, 0);
            let e1 = ring.register(1, 0);
            // Producer 1 holds the item first, so the model is about its death.
            assert_eq!(ring.r().claim_work(1, e1), Some(0));
            let victim = {
                let ring = ring.clone();
                thread::spawn(move || match death {
                    Death::Claimed => {}
                    Death::Marked => {
                        let c = ring.write(1, 0);
                        ring.r().complete_work(1, e1, c, 0).unwrap();
                    }
                    Death::GaveBack => ring.r().unclaim_work(1, e1, 0).unwrap(),
                })
            };
            let live = {
                let ring = ring.clone();
                thread::spawn(move || {
                    assert!(ring.produce_work_waiting(0, e0, Script::Normal));
                    ring.r().finish(0);
                })
            };
            victim.join().unwrap();
            let mut settle = crate::core::Settling {
                batches: &[],
                before: &mut |_, _, _| {},
                work: &[0],
            };
            let out = (ring.r())
                .recover(1, SUPERVISOR, |_| false, Some(&mut settle))
                .unwrap();
            ring.r().retire(1);
            live.join().unwrap();
            let published = ring.ready_batches();
            let want = match death {
                Death::GaveBack => (vec![0], 0),
                _ => (vec![], 1),
            };
            assert_eq!((published, out.work_set_aside), want, "{death:?}");
            assert!(ring.r().closed(), "{death:?}");
        });
    }
}
