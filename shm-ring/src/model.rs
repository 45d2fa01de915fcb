//! The state machine on heap memory, and the loom models that check it.
//!
//! Run the models with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p shm-ring --release --lib model`.
//! Capacities are tiny (one or two slots) so loom can explore every interleaving. Each slot's
//! payload is a loom `UnsafeCell`: if the Release/Acquire pairs in `core.rs` did not order a
//! writer's payload stores before a reader's loads, loom would report a data race.

use crate::core::{CommitMeta, CoreParams, RingRef, TakeState, Taken};
use crate::layout::{heap, Control, SlotRecord, WorkerRecord};
use crate::params::TakePolicy;

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
    ctl: Control,
    slots: Vec<SlotRecord>,
    workers: Vec<WorkerRecord>,
    payload: Vec<UnsafeCell<u64>>,
}

// SAFETY: payload cells are only touched by the owner of the slot under the state machine, which
// is exactly what these models check.
unsafe impl Sync for HeapRing {}
// SAFETY: as above.
unsafe impl Send for HeapRing {}

impl HeapRing {
    pub(crate) fn new(slots: usize, producers: u32, consumers: u32, policy: TakePolicy) -> Self {
        HeapRing {
            params: CoreParams {
                producers,
                buckets: 2,
                policy,
            },
            ctl: heap::control(),
            slots: (0..slots).map(|_| heap::slot()).collect(),
            workers: (0..producers + consumers).map(|_| heap::worker()).collect(),
            payload: (0..slots).map(|_| UnsafeCell::new(0)).collect(),
        }
    }

    pub(crate) fn r(&self) -> RingRef<'_> {
        RingRef {
            params: self.params,
            ctl: &self.ctl,
            slots: &self.slots,
            workers: &self.workers,
            work: &[],
        }
    }

    /// Producer `id` publishes `value` (also its batch id), blocking while the ring is full.
    pub(crate) fn produce(&self, id: u32, value: u64) {
        let c = self.r().reserve(id, None).unwrap().unwrap();
        // SAFETY: slot `c.idx` is WRITING and owned by `id`.
        self.payload[c.idx].with_mut(|p| unsafe { *p = value });
        let meta = CommitMeta {
            bucket: (value % 2) as u32,
            tokens: 1,
            batch_id: value,
            checksum: value,
        };
        self.r().commit(id, c, 8, meta).unwrap();
    }

    /// Consumer `id` takes one item and checks its payload matches its metadata. Returns
    /// (batch id, delivery, claim) or None at end of stream. The caller releases (or "dies").
    pub(crate) fn consume(
        &self,
        id: u32,
        st: &mut TakeState,
    ) -> Option<(u64, u32, crate::core::Claim)> {
        match self.r().take(id, st, None) {
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
            ring.r().release(2, c).unwrap();
        }
        for p in producers {
            p.join().unwrap();
        }
        got.sort();
        assert_eq!(got, vec![10, 11]);
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
                ring.r().release(c, claim).unwrap();
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
                    ring.r().release(3, claim).unwrap();
                }
                got
            })
        };
        let r1 = ring.r().recover(1);
        assert_eq!((r1.freed, r1.requeued), (1, 0));
        assert!(
            ring.r().retire(1),
            "retiring the last producer closes the ring"
        );
        let ra = ring.r().recover(2);
        assert_eq!((ra.freed, ra.requeued), (0, 1));
        assert_eq!(b.join().unwrap(), vec![(30, 1)]);
    });
}
