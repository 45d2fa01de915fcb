//! Behaviour of the ring on real shared-memory segments, with threads as workers.
//! (Multi-process stress and chaos tests live in the `tests` crate.)
//!
//! Length: one test per behaviour of the public API, each standing alone.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::thread;
use std::time::Duration;

use crate::common::{fifo, unique};
use shm_ring::{
    BucketPick, CommitMeta, ConfigError, DeviceSpan, Phase, Ring, RingError, RingParams, Take,
    TakePolicy, WorkerName, WorkerState,
};
use testkit::{batch_id, fill, thread_cpu, verify};

/// Runs `f` on a thread and fails the test, naming `what`, if it does not return in 60 s.
fn watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    testkit::watchdog(what, Duration::from_secs(60), f)
}

fn shm_exists(name: &str) -> bool {
    std::path::Path::new("/dev/shm").join(name).exists()
}

#[test]
fn creator_handle_unlinks_on_drop_and_segment_is_private() {
    let name = unique("life");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let mode = std::fs::metadata(format!("/dev/shm/{name}"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let other = Ring::attach(&name).unwrap();
    assert_eq!(other.params(), ring.params());
    drop(other);
    assert!(shm_exists(&name), "an attacher's drop must not unlink");
    drop(ring);
    assert!(!shm_exists(&name));
    assert!(matches!(
        Ring::attach(&name),
        Err(RingError::NotFound { .. })
    ));
}

#[test]
fn create_is_exclusive() {
    let name = unique("excl");
    let _ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let err = Ring::create(&name, &fifo(1, 1, 4)).err().unwrap();
    assert!(matches!(err, RingError::Exists { .. }), "{err}");
    assert!(err.to_string().contains(&name));
    // The existing ring is untouched.
    Ring::attach(&name).unwrap();
}

#[test]
fn bad_parameters_and_names_are_refused_without_leaving_a_segment() {
    let name = unique("badp");
    let p = RingParams {
        slots: 12,
        ..RingParams::default()
    };
    let err = Ring::create(&name, &p).err().unwrap();
    assert!(
        matches!(err, RingError::Config(ConfigError::Deadlock { .. })),
        "{err}"
    );
    assert!(!shm_exists(&name));
    for bad in ["", "a/b", ".hidden", "sp ace"] {
        let err = Ring::create(bad, &fifo(1, 1, 1)).err().unwrap();
        assert!(
            matches!(err, RingError::InvalidName { .. }),
            "{bad:?}: {err}"
        );
    }
    // A name read from a damaged file (a run's `ring` of 3 MB of NUL bytes printed a 9 MB
    // error): named by its start and length.
    let long = "\0".repeat(3 << 20);
    let err = Ring::open_read_only(&long).err().unwrap().to_string();
    assert!(
        err.len() < 600 && err.contains(&format!("({} bytes)", 3 << 20)),
        "{} bytes: {}",
        err.len(),
        &err[..err.len().min(600)]
    );
}

#[test]
fn too_small_dev_shm_fails_at_creation_not_later() {
    let name = unique("big");
    // 1024 slots of 32 GiB: far more than this machine's /dev/shm.
    let p = RingParams {
        slots: 1024,
        slot_size: 32 << 30,
        ..fifo(1, 1, 1)
    };
    let err = Ring::create(&name, &p).err().unwrap();
    match &err {
        RingError::ShmTooSmall { needed, .. } => assert!(*needed > 32 << 40),
        other => panic!("expected ShmTooSmall, got {other}"),
    }
    assert!(err.to_string().contains("/dev/shm"));
    assert!(
        !shm_exists(&name),
        "a failed create must not leave a segment"
    );
}

/// Writes raw bytes as a segment, to attach to.
fn raw_segment(name: &str, bytes: &[u8]) {
    std::fs::write(format!("/dev/shm/{name}"), bytes).unwrap();
    std::fs::set_permissions(
        format!("/dev/shm/{name}"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
}

struct Unlink(String);
impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

#[test]
fn attach_names_what_is_wrong_with_a_foreign_segment() {
    // Not a ring at all.
    let name = unique("junk");
    let _g = Unlink(name.clone());
    raw_segment(&name, &[0xAB; 8192]);
    let err = Ring::attach(&name).err().unwrap();
    assert!(matches!(err, RingError::BadMagic { .. }), "{err}");

    // All zeros: a creator died before publishing the magic.
    let name = unique("zero");
    let _g = Unlink(name.clone());
    raw_segment(&name, &[0; 8192]);
    let err = Ring::attach(&name).err().unwrap();
    assert!(err.to_string().contains("never initialised"), "{err}");

    // Smaller than a header.
    let name = unique("tiny");
    let _g = Unlink(name.clone());
    raw_segment(&name, &[0; 100]);
    let err = Ring::attach(&name).err().unwrap();
    assert!(
        err.to_string().contains("smaller than a ring header"),
        "{err}"
    );
}

#[test]
fn attach_detects_other_versions_truncation_and_foreign_owners() {
    let name = unique("ver");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let path = format!("/dev/shm/{name}");
    let good = std::fs::read(&path).unwrap();

    // Another layout version (the u32 after the 8-byte magic).
    let mut other = good.clone();
    other[8..12].copy_from_slice(&99u32.to_ne_bytes());
    std::fs::write(&path, &other).unwrap();
    let err = Ring::attach(&name).err().unwrap();
    assert!(
        matches!(err, RingError::VersionMismatch { found: 99, .. }),
        "{err}"
    );

    // Truncated: attaching must fail cleanly instead of faulting on a missing page.
    std::fs::write(&path, &good[..good.len() - 4096]).unwrap();
    let err = Ring::attach(&name).err().unwrap();
    assert!(matches!(err, RingError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("bytes"), "{err}");

    // Owned by another user (we may chown only as root; otherwise skip this part).
    std::fs::write(&path, &good).unwrap();
    if std::os::unix::fs::chown(&path, Some(12345), None).is_ok() {
        let err = Ring::attach(&name).err().unwrap();
        assert!(
            matches!(err, RingError::ForeignOwner { owner: 12345, .. }),
            "{err}"
        );
    }
    drop(ring);
}

#[test]
fn payload_is_written_and_read_in_place_in_page_aligned_slots() {
    let name = unique("zc");
    let ring = Ring::create(&name, &fifo(1, 1, 3)).unwrap();
    let p = ring.producer(0).unwrap();
    let c = ring.consumer(0).unwrap();

    let err = p.reserve(4097).err().unwrap();
    assert!(
        matches!(
            err,
            RingError::PayloadTooLarge {
                len: 4097,
                slot_size: 4096
            }
        ),
        "{err}"
    );

    let mut w = p.reserve(4096).unwrap();
    fill(w.payload_mut(), batch_id(0, 7));
    let write_ptr = w.payload_mut().as_ptr() as usize;
    assert_eq!(write_ptr % 4096, 0, "slots are page-aligned");
    w.commit(CommitMeta {
        bucket: 1,
        tokens: 5,
        batch_id: 7,
    })
    .unwrap();
    let r = c.take().unwrap().unwrap();
    assert_eq!(
        r.payload().as_ptr() as usize,
        write_ptr,
        "the reader sees the writer's bytes in place"
    );
    assert!(verify(r.payload(), batch_id(0, 7)), "the writer's bytes");
    let m = *r.meta();
    assert_eq!(
        (m.len, m.bucket, m.tokens, m.batch_id, m.delivery),
        (4096, 1, 5, 7, 0)
    );
    r.release().unwrap();
}

/// One producer commits everything before the first take, so each take's scan sees every item
/// and ticket order is exact. (Across concurrent producers FIFO is approximate: see
/// `TakePolicy::Fifo`. No test asserts more.)
#[test]
fn fifo_serves_in_publish_order_and_ends_after_the_last_item() {
    let name = unique("fifo");
    let ring = Ring::create(&name, &fifo(1, 1, 16)).unwrap();
    let p = ring.producer(0).unwrap();
    for i in 0..10u64 {
        let w = p.reserve(8).unwrap();
        w.commit(CommitMeta {
            batch_id: i,
            bucket: (i % 4) as u32,
            ..Default::default()
        })
        .unwrap();
    }
    assert!(p.finish(), "the only producer closes the ring");
    let c = ring.consumer(0).unwrap();
    let mut got = Vec::new();
    while let Some(r) = c.take().unwrap() {
        got.push(r.meta().batch_id);
    }
    assert_eq!(got, (0..10).collect::<Vec<_>>());
    // A closed ring refuses new writes.
    let p2 = ring.producer(0).unwrap();
    assert!(matches!(p2.reserve(8), Err(RingError::Finished)));
}

#[test]
fn dropping_an_uncommitted_slot_gives_it_back_and_bad_buckets_are_refused() {
    let name = unique("abort");
    let ring = Ring::create(&name, &fifo(1, 1, 1)).unwrap();
    let p = ring.producer(0).unwrap();
    drop(p.reserve(8).unwrap());
    let w = p.reserve(8).unwrap();
    let err = w
        .commit(CommitMeta {
            bucket: 4,
            ..Default::default()
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            RingError::BadBucket {
                bucket: 4,
                buckets: 4
            }
        ),
        "{err}"
    );
    // The single slot is free again for a valid commit.
    let w = p
        .reserve_timeout(8, Duration::from_secs(10))
        .unwrap()
        .expect("slot returned after a refused commit");
    w.commit(CommitMeta::default()).unwrap();
    let s = ring.snapshot();
    assert_eq!(
        (s.counters.published, s.counters.aborted, s.slots.ready),
        (1, 2, 1)
    );
}

#[test]
fn five_producers_three_consumers_threads_deliver_every_item_exactly_once() {
    const PER_PRODUCER: u64 = 400;
    let name = unique("5x3");
    let ring = std::sync::Arc::new(Ring::create(&name, &fifo(5, 3, 8)).unwrap());
    let got = watchdog("5x3 threads", move || {
        thread::scope(|s| {
            for pi in 0..5u32 {
                let ring = &ring;
                s.spawn(move || {
                    let p = ring.producer(pi).unwrap();
                    for seq in 0..PER_PRODUCER {
                        let len = 64 + (seq as usize * 37) % 4000;
                        let mut w = p.reserve(len).unwrap();
                        fill(w.payload_mut(), batch_id(pi, seq));
                        w.commit(CommitMeta {
                            bucket: (seq % 4) as u32,
                            tokens: len as u64,
                            batch_id: (u64::from(pi) << 32) | seq,
                        })
                        .unwrap();
                    }
                    p.finish();
                });
            }
            let consumers: Vec<_> = (0..3u32)
                .map(|ci| {
                    let ring = &ring;
                    s.spawn(move || {
                        let c = ring.consumer(ci).unwrap();
                        let mut seen = Vec::new();
                        while let Some(r) = c.take().unwrap() {
                            assert!(verify(r.payload(), r.meta().batch_id), "corrupt payload");
                            seen.push(r.meta().batch_id);
                            r.release().unwrap();
                        }
                        // End of stream only once everything is published and taken.
                        assert!(ring.is_closed());
                        seen
                    })
                })
                .collect();
            consumers
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    let mut count: HashMap<u64, u32> = HashMap::new();
    for id in got.iter().flatten() {
        *count.entry(*id).or_default() += 1;
    }
    assert_eq!(count.len() as u64, 5 * PER_PRODUCER, "every item delivered");
    assert!(count.values().all(|&n| n == 1), "no item delivered twice");
}

fn bucketed(min_ready: u32, pick: BucketPick) -> RingParams {
    RingParams {
        slots: 32,
        slot_size: 64,
        buckets: 3,
        producers: 1,
        consumers: 1,
        held_per_consumer: 1,
        policy: TakePolicy::Bucketed { min_ready, pick },
        seed: 42,
        work_items: 0,
    }
}

fn publish(p: &shm_ring::Producer<'_>, batch_id: u64, bucket: u32) {
    p.reserve(8)
        .unwrap()
        .commit(CommitMeta {
            bucket,
            batch_id,
            ..Default::default()
        })
        .unwrap();
}

#[test]
fn bucketed_waits_for_min_ready_until_the_ring_closes() {
    let name = unique("minr");
    let ring = Ring::create(&name, &bucketed(4, BucketPick::RoundRobin)).unwrap();
    let p = ring.producer(0).unwrap();
    let c = ring.consumer(0).unwrap();
    for i in 0..3 {
        publish(&p, i, 0);
    }
    assert!(
        matches!(
            c.take_timeout(Duration::from_millis(50)).unwrap(),
            Take::TimedOut
        ),
        "3 READY < min_ready 4: nothing is served"
    );
    publish(&p, 3, 0);
    let Take::Item(r) = c.take_timeout(Duration::from_secs(10)).unwrap() else {
        panic!("4 READY >= min_ready: an item is served");
    };
    r.release().unwrap();
    // Now 3 are READY again; closing the ring waives min_ready so the rest drain.
    assert!(p.finish());
    let mut n = 0;
    while c.take().unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, 3);
}

#[test]
fn bucketed_round_robin_visits_each_non_empty_bucket_in_turn() {
    let name = unique("rr");
    let ring = Ring::create(&name, &bucketed(1, BucketPick::RoundRobin)).unwrap();
    let p = ring.producer(0).unwrap();
    // Bucket 0 crowded, 1 empty, 2 with two items.
    for i in 0..6 {
        publish(&p, i, 0);
    }
    publish(&p, 100, 2);
    publish(&p, 101, 2);
    p.finish();
    let c = ring.consumer(0).unwrap();
    let mut buckets = Vec::new();
    while let Some(r) = c.take().unwrap() {
        buckets.push(r.meta().bucket);
    }
    assert_eq!(buckets, vec![0, 2, 0, 2, 0, 0, 0, 0]);
}

/// The mix a bucketed consumer trains follows the mix in the ring: with 24 READY in bucket 0
/// and 6 in bucket 2, the first 10 takes come mostly from bucket 0. Round-robin (the old
/// default) alternates, 5 and 5, so the crowded bucket piles up and trains late in the run.
#[test]
fn proportional_pick_serves_buckets_in_proportion_to_what_is_ready() {
    let first_ten = |pick| {
        let name = unique("prop");
        let ring = Ring::create(&name, &bucketed(1, pick)).unwrap();
        let p = ring.producer(0).unwrap();
        for i in 0..24 {
            publish(&p, i, 0);
        }
        for i in 0..6 {
            publish(&p, 100 + i, 2);
        }
        let c = ring.consumer(0).unwrap();
        let mut from_crowded = 0;
        for _ in 0..10 {
            let Take::Item(r) = c.take_timeout(Duration::from_secs(10)).unwrap() else {
                panic!("30 READY: an item is served");
            };
            from_crowded += u32::from(r.meta().bucket == 0);
        }
        from_crowded
    };
    let proportional = first_ten(BucketPick::Proportional);
    assert!(
        proportional >= 7,
        "expected about 8 of 10 from the bucket holding 80%, got {proportional}"
    );
    assert_eq!(first_ten(BucketPick::RoundRobin), 5);
}

/// The drafter group's take: the step's bucket is served while it has READY items, the
/// policy's own choice otherwise (never a wait for the preferred bucket).
#[test]
fn a_preferred_bucket_is_served_while_it_has_items() {
    let name = unique("pref");
    let ring = Ring::create(&name, &bucketed(1, BucketPick::Fullest)).unwrap();
    let p = ring.producer(0).unwrap();
    for i in 0..5 {
        publish(&p, i, 0);
    }
    publish(&p, 100, 1);
    publish(&p, 101, 1);
    let c = ring.consumer(0).unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        let Take::Item(r) = c
            .take_timeout_preferring(Some(1), Duration::from_secs(10))
            .unwrap()
        else {
            panic!("items are READY");
        };
        got.push(r.meta().bucket);
    }
    // Fullest alone would serve bucket 0 first.
    assert_eq!(got, vec![1, 1, 0, 0]);
    assert_eq!(c.draw_bucket(1), Some(0), "only bucket 0 has READY items");
    publish(&p, 102, 2);
    assert_eq!(c.draw_bucket(2), Some(0), "only bucket 0 has 2 READY");
    assert!(
        c.draw_bucket(4).is_some(),
        "none has 4: any bucket with an item"
    );
}

#[test]
fn random_choice_within_a_bucket_is_seeded() {
    let order = |seed: u64| {
        let name = unique("seed");
        let ring = Ring::create(
            &name,
            &RingParams {
                seed,
                ..bucketed(1, BucketPick::Fullest)
            },
        )
        .unwrap();
        let p = ring.producer(0).unwrap();
        for i in 0..20 {
            publish(&p, i, 1);
        }
        p.finish();
        let c = ring.consumer(0).unwrap();
        let mut got = Vec::new();
        while let Some(r) = c.take().unwrap() {
            got.push(r.meta().batch_id);
        }
        got
    };
    let a = order(7);
    assert_eq!(a, order(7), "same seed, same order");
    assert_ne!(a, (0..20).collect::<Vec<_>>(), "not FIFO within the bucket");
    assert_ne!(a, order(8), "another seed, another order");
}

#[test]
fn a_consumer_may_hold_only_held_per_consumer_items() {
    let name = unique("held");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let p = ring.producer(0).unwrap();
    publish(&p, 1, 0);
    publish(&p, 2, 0);
    let c = ring.consumer(0).unwrap();
    let first = c.take().unwrap().unwrap();
    assert!(matches!(c.take(), Err(RingError::TooManyHeld { held: 1 })));
    first.release().unwrap();
    assert_eq!(c.take().unwrap().unwrap().meta().batch_id, 2);
}

#[test]
fn recover_redelivers_held_items_frees_writes_and_restart_bumps_the_epoch() {
    let name = unique("recov");
    let ring = Ring::create(&name, &fifo(2, 2, 4)).unwrap();
    let p0 = ring.producer(0).unwrap();
    publish(&p0, 9, 0);
    // Producer 1 "dies" mid-write; consumer 0 "dies" holding item 9.
    let p1 = ring.producer(1).unwrap();
    std::mem::forget(p1.reserve(8).unwrap());
    let c0 = ring.consumer(0).unwrap();
    assert_eq!(c0.epoch(), 1);
    std::mem::forget(c0.take().unwrap().unwrap());
    std::mem::forget(c0);
    std::mem::forget(p1);

    let s = ring.snapshot();
    assert_eq!((s.slots.writing, s.slots.reading), (1, 1));

    // Both are registered by this (live) process: the checked recovery refuses them.
    assert!(matches!(
        ring.recover(WorkerName::producer(1)),
        Err(RingError::WorkerAlive { .. })
    ));
    // SAFETY: producer 1, consumer 0 and their slot guards were forgotten above and are never
    // used again, as if their processes had been killed.
    let r = unsafe { ring.recover_unchecked(WorkerName::producer(1)) }.unwrap();
    assert_eq!((r.freed, r.requeued), (1, 0));
    // SAFETY: as above.
    let r = unsafe { ring.recover_unchecked(WorkerName::consumer(0)) }.unwrap();
    assert_eq!((r.freed, r.requeued), (0, 1));
    let s = ring.snapshot();
    assert_eq!((s.slots.writing, s.slots.reading, s.slots.ready), (0, 0, 1));
    assert_eq!(s.counters.redelivered, 1);
    assert_eq!(
        s.worker(WorkerName::consumer(0)).unwrap().state,
        WorkerState::Dead
    );

    // The restarted consumer comes back under the same id, one epoch later, and gets the item
    // again with its delivery count.
    let c0 = ring.consumer(0).unwrap();
    assert_eq!(c0.epoch(), 2);
    let item = c0.take().unwrap().unwrap();
    assert_eq!((item.meta().batch_id, item.meta().delivery), (9, 1));
    item.release().unwrap();
    let s = ring.snapshot();
    assert_eq!(s.worker(WorkerName::consumer(0)).unwrap().restarts, 1);

    // Producer 1 will not come back: retiring it (with producer 0 finished) closes the ring.
    assert!(!p0.finish());
    assert!(ring.retire(1).unwrap());
    assert!(c0.take().unwrap().is_none());
    assert!(matches!(
        ring.recover(WorkerName::consumer(5)),
        Err(RingError::NoSuchWorker { .. })
    ));
}

#[test]
fn the_phase_a_worker_dies_in_keeps_its_time_after_recovery() {
    let name = unique("diesin");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let reader = Ring::open_read_only(&name).unwrap();
    let c0 = ring.consumer(0).unwrap();
    c0.add_phase(Phase::Compute, Duration::from_millis(5));
    c0.enter(Phase::Compute);
    // Long enough that the phase in progress shows in a live snapshot, whatever the clock's
    // resolution.
    thread::sleep(Duration::from_millis(20));
    let live = reader.snapshot();
    let live = live.worker(WorkerName::consumer(0)).unwrap();
    assert!(live.alive);
    assert!(live.phase_ns[Phase::Compute] > 5_000_000);
    // The consumer "dies" in compute (a hung drafter killed by its supervisor).
    std::mem::forget(c0);
    // SAFETY: consumer 0 was forgotten above and is never used again, as if its process had
    // been killed.
    unsafe { ring.recover_unchecked(WorkerName::consumer(0)) }.unwrap();
    let after = reader.snapshot();
    let after = after.worker(WorkerName::consumer(0)).unwrap();
    assert_eq!(after.state, WorkerState::Dead);
    // Cumulative: what a snapshot showed is never taken back, so a window's delta is never
    // negative and a run's summary counts the time the monitor saw.
    assert!(
        after.phase_ns[Phase::Compute] >= live.phase_ns[Phase::Compute],
        "compute time went back from {} ns to {} ns at recovery",
        live.phase_ns[Phase::Compute],
        after.phase_ns[Phase::Compute]
    );
    // Its clock stopped: later snapshots add nothing.
    let later = reader.snapshot();
    assert_eq!(
        later.worker(WorkerName::consumer(0)).unwrap().phase_ns,
        after.phase_ns
    );
}

#[test]
fn snapshot_reports_phases_counters_and_buckets_without_writing() {
    let name = unique("snap");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let reader = Ring::open_read_only(&name).unwrap();
    assert!(matches!(reader.producer(0), Err(RingError::ReadOnly)));
    let p = ring.producer(0).unwrap();
    p.set_gpu(Some(3));
    p.add_phase(Phase::Compute, Duration::from_millis(5));
    publish(&p, 1, 2);
    publish(&p, 2, 2);
    let s = reader.snapshot();
    assert_eq!(s.ready_per_bucket, vec![0, 0, 2, 0]);
    assert_eq!(s.counters.published, 2);
    let w = s.worker(WorkerName::producer(0)).unwrap();
    assert_eq!((w.gpu, w.items, w.alive, w.epoch), (Some(3), 2, true, 1));
    assert_eq!(w.phase_ns[Phase::Compute], 5_000_000);
    assert!(!s.closed && s.creator_alive);
}

#[test]
fn snapshot_finds_a_worker_by_name() {
    let name = unique("byname");
    let ring = Ring::create(&name, &fifo(2, 3, 4)).unwrap();
    let p1 = ring.producer(1).unwrap();
    p1.add_phase(Phase::Load, Duration::from_millis(2));
    let c2 = ring.consumer(2).unwrap();
    c2.add_phase(Phase::Sync, Duration::from_millis(3));
    let s = ring.snapshot();
    let t1 = s.worker("target-1".parse().unwrap()).unwrap();
    assert_eq!(
        (t1.name(), t1.state),
        (WorkerName::producer(1), WorkerState::Alive)
    );
    assert_eq!(t1.phase_ns[Phase::Load], 2_000_000);
    let d2 = s.worker(WorkerName::consumer(2)).unwrap();
    assert_eq!(d2.name().to_string(), "drafter-2");
    assert_eq!(d2.phase_ns[Phase::Sync], 3_000_000);
    assert_eq!(
        s.worker(WorkerName::consumer(0)).unwrap().state,
        WorkerState::Vacant
    );
    // Names the ring does not have.
    assert!(s.worker(WorkerName::producer(2)).is_none());
    assert!(s.worker(WorkerName::consumer(3)).is_none());
    let drafters: Vec<u32> = s
        .workers_of(shm_ring::Role::Consumer)
        .map(|w| w.index)
        .collect();
    assert_eq!(drafters, [0, 1, 2]);
}

/// A blocked worker sleeps in the kernel: over 1.5 s of blocking, it uses a small fraction of
/// one CPU (the bound is loose: the real figure is in BENCHMARKS.md).
#[test]
fn blocked_consumer_and_producer_burn_almost_no_cpu() {
    // Two rings: one stays empty (the consumer blocks), one stays full (the producer blocks).
    let empty = std::sync::Arc::new(Ring::create(&unique("idle-e"), &fifo(1, 1, 1)).unwrap());
    let full = std::sync::Arc::new(Ring::create(&unique("idle-f"), &fifo(1, 1, 1)).unwrap());
    let block = Duration::from_millis(1500);
    let (consumer_cpu, producer_cpu) = watchdog("idle test", move || {
        thread::scope(|s| {
            let consumer = s.spawn(|| {
                let c = empty.consumer(0).unwrap();
                let t0 = thread_cpu();
                assert!(matches!(c.take_timeout(block).unwrap(), Take::TimedOut));
                thread_cpu() - t0
            });
            let producer = s.spawn(|| {
                let p = full.producer(0).unwrap();
                p.reserve(8).unwrap().commit(CommitMeta::default()).unwrap();
                let t0 = thread_cpu();
                assert!(p.reserve_timeout(8, block).unwrap().is_none());
                thread_cpu() - t0
            });
            (consumer.join().unwrap(), producer.join().unwrap())
        })
    });
    // Under 5% of one CPU each.
    let limit = block / 20;
    assert!(
        consumer_cpu < limit,
        "blocked consumer used {consumer_cpu:?} CPU"
    );
    assert!(
        producer_cpu < limit,
        "blocked producer used {producer_cpu:?} CPU"
    );
}

fn with_work(items: u64) -> RingParams {
    RingParams {
        work_items: items,
        ..fifo(2, 1, 8)
    }
}

#[test]
fn producers_claim_every_work_item_exactly_once() {
    let name = unique("work");
    let ring = std::sync::Arc::new(Ring::create(&name, &with_work(500)).unwrap());
    let claimed = watchdog("work claims", move || {
        thread::scope(|s| {
            let hs: Vec<_> = (0..2u32)
                .map(|pi| {
                    let ring = &ring;
                    s.spawn(move || {
                        let p = ring.producer(pi).unwrap();
                        let mut mine = Vec::new();
                        while let Some(i) = p.claim_work() {
                            mine.push(i);
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    let mut all = claimed.clone();
    all.sort();
    assert_eq!(all, (0..500).collect::<Vec<_>>());
}

#[test]
fn a_dead_producers_claimed_and_unpublished_work_is_redone() {
    let name = unique("redo");
    let ring = Ring::create(&name, &with_work(4)).unwrap();
    let dead = ring.producer(0).unwrap();
    let a = dead.claim_work().unwrap();
    let b = dead.claim_work().unwrap();
    // Item a is published; its batch commits.
    let mut w = dead.reserve(8).unwrap();
    w.complete_work(a).unwrap();
    w.commit(CommitMeta::default()).unwrap();
    // Item b is marked done in a slot that is never committed: the producer dies mid-write.
    let c = dead.claim_work().unwrap();
    let mut w = dead.reserve(8).unwrap();
    w.complete_work(b).unwrap();
    std::mem::forget(w);
    std::mem::forget(dead);
    assert_eq!(ring.snapshot().work.done, 2, "b looks done until recovery");

    // SAFETY: producer 0 and its slot guard were forgotten above and are never used again.
    let r = unsafe { ring.recover_unchecked(WorkerName::producer(0)) }.unwrap();
    assert_eq!(
        (r.freed, r.work_returned),
        (1, 2),
        "b (unpublished) and c (claimed) return"
    );
    let s = ring.snapshot().work;
    assert_eq!((s.total, s.done, s.claimed), (4, 1, 0));

    // The live producer takes the fresh item first, then the returned ones.
    let p1 = ring.producer(1).unwrap();
    let mut got = Vec::new();
    while let Some(i) = p1.claim_work() {
        got.push(i);
    }
    got.sort();
    let mut want = vec![b, c, 3];
    want.sort();
    assert_eq!(got, want);

    // Only the holder may complete or give back an item.
    let mut w = p1.reserve(8).unwrap();
    assert!(matches!(
        w.complete_work(a),
        Err(RingError::NotClaimed { .. })
    ));
    assert!(matches!(
        w.complete_work(99),
        Err(RingError::NoSuchWorkItem { item: 99, items: 4 })
    ));
    drop(w);
    p1.unclaim_work(3).unwrap();
    assert_eq!(
        p1.claim_work(),
        Some(3),
        "a given-back item can be claimed again"
    );
}

/// Issue #9, defect 3: a slot whose batch completed a work item is aborted (dropped, or its
/// commit refused): the item must be claimable again, or its batch is never published. Before
/// the fix the item stayed DONE with its slot FREE, out of recovery's sight.
#[test]
fn an_aborted_slot_gives_its_work_item_back() {
    let name = unique("abortw");
    let ring = Ring::create(&name, &with_work(2)).unwrap();
    let p0 = ring.producer(0).unwrap();
    let p1 = ring.producer(1).unwrap();
    let a = p0.claim_work().unwrap();
    let mut w = p0.reserve(8).unwrap();
    w.complete_work(a).unwrap();
    drop(w);
    let b = p0.claim_work().unwrap();
    let mut w = p0.reserve(8).unwrap();
    w.complete_work(b).unwrap();
    assert!(w
        .commit(CommitMeta {
            bucket: 99,
            ..Default::default()
        })
        .is_err());
    assert_eq!(ring.snapshot().work.done, 0, "neither batch was published");
    let mut again = vec![p1.claim_work().unwrap(), p1.claim_work().unwrap()];
    again.sort();
    assert_eq!(again, vec![0, 1], "both items can be claimed again");
    assert_eq!(p1.claim_work(), None);
}

/// Issue #9, defect 4: recovery of a worker whose process runs (here: this one, mid-write) is
/// refused, so a second registration cannot be handed the same slot while the first writer
/// still holds it. Before the fix `recover` freed the slot and a new producer 0 reserved it:
/// two live `WriteSlot`s over one payload.
#[test]
fn recover_refuses_a_live_worker_so_no_two_writers_share_a_slot() {
    let name = unique("alive");
    let ring = Ring::create(&name, &fifo(1, 1, 1)).unwrap();
    let p0 = ring.producer(0).unwrap();
    let mut w = p0.reserve(8).unwrap();
    let err = ring.recover(WorkerName::producer(0)).unwrap_err();
    assert!(
        matches!(err, RingError::WorkerAlive { pid, .. } if pid == std::process::id()),
        "{err}"
    );
    assert!(err.to_string().contains("still running"), "{err}");
    assert!(matches!(ring.retire(0), Err(RingError::WorkerAlive { .. })));
    assert!(matches!(
        ring.producer(0),
        Err(RingError::WorkerBusy { .. })
    ));
    // The slot is still ours, and still the only one being written.
    w.payload_mut()[0] = 1;
    assert_eq!(ring.snapshot().slots.writing, 1);
    w.commit(CommitMeta::default()).unwrap();
    // Once the handle is gone (the worker left), recovery is allowed and finds nothing.
    drop(p0);
    let r = ring.recover(WorkerName::producer(0)).unwrap();
    assert_eq!((r.freed, r.requeued, r.work_returned), (0, 0, 0));
}

/// Issue #9, item 5: registration is one CAS on the id's lease. Even the registering process
/// cannot hold one id twice (before the fix, a second `producer(0)` in the same process
/// succeeded); once the first handle is dropped, the id is free again.
#[test]
fn one_id_cannot_be_registered_twice_even_by_one_process() {
    let name = unique("twice");
    let ring = Ring::create(&name, &fifo(1, 1, 2)).unwrap();
    let first = ring.consumer(0).unwrap();
    let err = ring.consumer(0).err().unwrap();
    assert!(
        matches!(err, RingError::WorkerBusy { pid, .. } if pid == std::process::id()),
        "{err}"
    );
    assert_eq!(first.epoch(), 1);
    drop(first);
    assert_eq!(ring.consumer(0).unwrap().epoch(), 2);
}

/// Issue #9, item 6: a ring whose mode lets group or other users open it is refused, for
/// reading and writing, naming the mode.
#[test]
fn attach_refuses_a_segment_that_group_or_others_may_open() {
    let name = unique("mode");
    let _ring = Ring::create(&name, &fifo(1, 1, 2)).unwrap();
    for mode in [0o640, 0o604, 0o660] {
        std::fs::set_permissions(
            format!("/dev/shm/{name}"),
            std::fs::Permissions::from_mode(mode),
        )
        .unwrap();
        for err in [
            Ring::attach(&name).err().unwrap(),
            Ring::open_read_only(&name).err().unwrap(),
        ] {
            assert!(
                matches!(err, RingError::InsecureMode { mode: m, .. } if m == mode),
                "{err}"
            );
            assert!(err.to_string().contains(&format!("{mode:03o}")), "{err}");
        }
    }
}

/// The payload arena a driver pins (`Ring::payload_arena`) is page-aligned and holds every
/// slot's payload, so registering it once covers every batch any worker writes or reads.
#[test]
fn the_payload_arena_covers_every_slot_and_is_page_aligned() {
    let mut p = fifo(1, 1, 4);
    p.slot_size = 5000; // not a page multiple: slots are a stride apart
    let ring = Ring::create(&unique("arena"), &p).unwrap();
    let (base, len) = ring.payload_arena();
    assert_eq!(base as usize % 4096, 0, "arena base not page-aligned");
    assert_eq!(len as u64, 4 * p.slot_stride(), "arena length");
    assert_eq!(len % 4096, 0, "arena length not whole pages");
    let prod = ring.producer(0).unwrap();
    let mut seen = Vec::new();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut w = prod.reserve(5000).unwrap();
        let at = w.payload_mut().as_ptr() as usize;
        assert!(
            at >= base as usize && at + 5000 <= base as usize + len,
            "slot {} payload at {at:#x} outside the arena {base:?}+{len}",
            w.slot()
        );
        seen.push(w.slot());
        held.push(w);
    }
    seen.sort();
    assert_eq!(seen, [0, 1, 2, 3], "every slot reserved once");
}

#[test]
fn a_requeued_item_is_taken_again_whole_with_its_delivery_counted() {
    let name = unique("requeue");
    let ring = Ring::create(&name, &fifo(1, 2, 4)).unwrap();
    let p = ring.producer(0).unwrap();
    let mut w = p.reserve(64).unwrap();
    fill(w.payload_mut(), 7);
    w.commit(CommitMeta {
        bucket: 0,
        tokens: 3,
        batch_id: 7,
    })
    .unwrap();
    let (a, b) = (ring.consumer(0).unwrap(), ring.consumer(1).unwrap());
    let first = a.take().unwrap().unwrap();
    assert_eq!(first.meta().delivery, 0);
    first.requeue().unwrap();
    // Given back, not consumed: another consumer takes it, payload intact, delivery counted,
    // and the first may take again (its hold was given back too).
    let again = b.take().unwrap().unwrap();
    assert_eq!((again.meta().batch_id, again.meta().delivery), (7, 1));
    assert!(verify(again.payload(), 7));
    assert_eq!(ring.snapshot().counters.redelivered, 1);
    again.release().unwrap();
    assert!(matches!(
        a.take_timeout(Duration::from_millis(1)).unwrap(),
        Take::TimedOut
    ));
}

#[test]
fn a_device_timed_worker_reports_its_devices_busy_time_and_why_it_sat_idle() {
    let name = unique("device");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let c = ring.consumer(0).unwrap();
    let now = shmem::monotonic_ns;
    c.set_device_timed(true);
    let span = |phase, start_ns, end_ns, busy| DeviceSpan {
        phase,
        start_ns,
        end_ns,
        busy,
    };
    // The first step computes on the device until `b`, after the host moved on to the
    // all-reduce (the switch to `sync` is logged before `b`); the next starts at `c`, before the
    // host leaves `sync` (logged after `c`). So the device's gap [b, c] lies wholly in `sync`.
    c.enter(Phase::Compute);
    let a = now();
    c.enter(Phase::Sync);
    let b = now();
    thread::sleep(Duration::from_millis(2));
    let c_ = now();
    c.enter(Phase::Other);
    c.record_device(span(Phase::Compute, a - 1_000_000, b, true));
    // A copy on another stream: device time, not busy.
    c.record_device(span(Phase::CopyIn, a, b, false));
    c.record_device(span(Phase::Compute, c_, c_ + 3_000_000, true));
    // Overlapping the last busy span: its overlap counts once.
    c.record_device(span(Phase::Compute, c_ + 2_000_000, c_ + 4_000_000, true));

    let s = ring.snapshot();
    let w = s.worker(WorkerName::consumer(0)).unwrap();
    let d = w
        .device
        .as_ref()
        .expect("a device-timed worker reports its device");
    let first = b - (a - 1_000_000);
    assert_eq!(d.busy_ns, first + 4_000_000);
    assert_eq!(w.busy_ns(), d.busy_ns, "busy is the device's");
    assert_eq!(d.phase_ns[Phase::Compute], first + 3_000_000 + 2_000_000);
    assert_eq!(d.phase_ns[Phase::CopyIn], b - a);
    assert_eq!(d.idle_ns[Phase::Sync], c_ - b, "{d:?}");
    assert_eq!(d.idle_ns.values().sum::<u64>(), c_ - b);
    // The device's gap is the worker's gap of that second (kept in microseconds); the host's
    // own stretch out of `compute` is not a gap.
    assert_eq!(
        w.idle_gaps,
        vec![(c_ / 1_000_000_000, (c_ - b) / 1000 * 1000)]
    );

    // The gap in progress is the device's since its last busy span ended, while the host is
    // out of compute (in compute, spans may be queued and not resolved yet): a drafter whose
    // GPU sits idle for a whole window shows it.
    let me = |r: &Ring| {
        r.snapshot()
            .worker(WorkerName::consumer(0))
            .unwrap()
            .clone()
    };
    c.enter(Phase::Compute);
    assert_eq!(me(&ring).idle_now_ns, None, "computing");
    c.enter(Phase::WaitEmpty);
    let until = c_ + 4_000_000;
    while now() <= until {
        thread::sleep(Duration::from_millis(1));
    }
    let before = now();
    let idle = me(&ring).idle_now_ns.expect("a device gap in progress");
    assert!(idle >= before - until, "{idle} < {}", before - until);

    // A timeline that fails makes the worker host-timed again; so does a new incarnation of
    // its id (it may run another backend).
    c.set_device_timed(false);
    assert!(me(&ring).device.is_none());
    c.set_device_timed(true);
    drop(c);
    let _again = ring.consumer(0).unwrap();
    assert!(me(&ring).device.is_none(), "a restart starts host-timed");

    // A host-timed worker has no device figures.
    let p = ring.producer(0).unwrap();
    p.enter(Phase::Compute);
    let s = ring.snapshot();
    assert!(s.worker(WorkerName::producer(0)).unwrap().device.is_none());
}

/// A worker's heartbeat handle beats from another thread (a Python worker's heartbeat thread,
/// while the worker itself stays on the thread that made it): the heartbeat's time moves on.
#[test]
fn a_beat_handle_marks_its_worker_alive_from_another_thread() {
    let name = unique("beat");
    let ring = Ring::create(&name, &fifo(1, 1, 4)).unwrap();
    let consumer = ring.consumer(0).unwrap();
    let beaten_at = |ring: &Ring| {
        let snap = ring.snapshot();
        let w = snap.worker(WorkerName::consumer(0)).unwrap();
        snap.taken_at_ns - w.heartbeat_age_ns.unwrap()
    };
    let registered = beaten_at(&ring);
    thread::sleep(Duration::from_millis(2));
    let beat = consumer.beat();
    thread::scope(|s| s.spawn(move || beat.heartbeat()).join().unwrap());
    assert!(beaten_at(&ring) > registered);
}
