//! shm-ring-stat's analysis on rings put into known states: each gives the right verdict and
//! figures. Phase times are injected with `add_phase`, and the interval is fixed at one second,
//! so the figures are exact whatever the machine's speed.
//!
//! Length: one test per ring state and verdict, each standing alone.

use std::time::Duration;

use crate::common::{fifo, unique};
use ring_stat::analysis::{interval, verdict, Bottleneck, Judge, Trend, Verdict};
use ring_stat::cli::{run, Args};
use shm_ring::{CommitMeta, Phase, Ring, SlotCounts, Snapshot, WorkerName};

fn ring(tag: &str, producers: u32, consumers: u32, slots: u32) -> Ring {
    Ring::create(&unique(tag), &fifo(producers, consumers, slots)).unwrap()
}

const SEC: Duration = Duration::from_secs(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The verdict for the interval from `a` to now, taken as exactly one second.
fn judge(
    ring: &Ring,
    a: &Snapshot,
    occupancy: &[SlotCounts],
) -> (Verdict, ring_stat::analysis::Interval) {
    let mut b = ring.snapshot();
    b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
    let iv = interval(a, &b, occupancy);
    (verdict(&b, &iv), iv)
}

fn publish(p: &shm_ring::Producer<'_>) {
    p.reserve(8).unwrap().commit(CommitMeta::default()).unwrap();
}

#[test]
fn a_full_ring_with_slow_drafters_names_the_drafters() {
    let r = ring("full", 2, 2, 4);
    let (p0, p1) = (r.producer(0).unwrap(), r.producer(1).unwrap());
    let (c0, c1) = (r.consumer(0).unwrap(), r.consumer(1).unwrap());
    for _ in 0..4 {
        publish(&p0);
    }
    let a = r.snapshot();
    // Over the second: targets blocked on the full ring, drafters computing.
    for p in [&p0, &p1] {
        p.add_phase(Phase::WaitFull, ms(900));
    }
    c0.add_phase(Phase::Compute, ms(950));
    c1.add_phase(Phase::Compute, ms(950));
    c0.take().unwrap().unwrap().release().unwrap();
    publish(&p1);
    let (v, iv) = judge(&r, &a, &[r.slot_counts(); 10]);
    assert_eq!(v.bottleneck, Bottleneck::Drafters);
    assert_eq!(
        v.line,
        "drafters are the bottleneck: ring full 100% of the time, targets waited 90% (drafters waited 0%)"
    );
    assert_eq!(iv.full_frac, 1.0);
    assert!(v.stragglers.is_empty() && v.warnings.is_empty(), "{v:?}");
}

#[test]
fn an_empty_ring_with_slow_targets_names_the_targets() {
    let r = ring("empty", 2, 2, 4);
    let (p0, p1) = (r.producer(0).unwrap(), r.producer(1).unwrap());
    let (c0, c1) = (r.consumer(0).unwrap(), r.consumer(1).unwrap());
    let a = r.snapshot();
    for p in [&p0, &p1] {
        p.add_phase(Phase::Compute, ms(980));
    }
    c0.add_phase(Phase::WaitEmpty, ms(700));
    c1.add_phase(Phase::WaitEmpty, ms(500));
    publish(&p0);
    c1.take().unwrap().unwrap().release().unwrap();
    let empty = SlotCounts {
        free: 4,
        ..SlotCounts::default()
    };
    let (v, iv) = judge(&r, &a, &[empty; 10]);
    assert_eq!(v.bottleneck, Bottleneck::Targets);
    assert_eq!(
        v.line,
        "targets are the bottleneck: ring empty 100% of the time, drafters waited 60% (targets waited 0%)"
    );
    assert_eq!(iv.workers[0].busy, 0.98);
}

/// Batches refused as corrupt leave the ring as released ones do: ten published and refused
/// in a second on an empty ring is the targets' ring, not one filling up. With refusals counted
/// apart from released, the trend took them for batches piling up and blamed the drafters
/// ("the ring fills (+10 batches ...)") in the very run whose drafters refuse every batch.
#[test]
fn batches_refused_as_corrupt_leave_the_ring_and_do_not_fill_it() {
    let r = ring("refusedflow", 1, 1, 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    let a = r.snapshot();
    p.add_phase(Phase::Compute, ms(980));
    c.add_phase(Phase::WaitEmpty, ms(700));
    for _ in 0..10 {
        publish(&p);
        c.take().unwrap().unwrap().refuse().unwrap();
    }
    let empty = SlotCounts {
        free: 4,
        ..SlotCounts::default()
    };
    let (v, _) = judge(&r, &a, &[empty; 10]);
    assert_eq!(v.bottleneck, Bottleneck::Targets, "{}", v.line);
    assert!(!v.line.contains("fills"), "{}", v.line);
}

#[test]
fn small_waits_on_both_sides_are_balanced() {
    let r = ring("bal", 1, 1, 4);
    let p = r.producer(0).unwrap();
    let c = r.consumer(0).unwrap();
    let a = r.snapshot();
    p.add_phase(Phase::Compute, ms(950));
    p.add_phase(Phase::WaitFull, ms(30));
    c.add_phase(Phase::Compute, ms(940));
    c.add_phase(Phase::WaitEmpty, ms(50));
    publish(&p);
    c.take().unwrap().unwrap().release().unwrap();
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Balanced);
    assert_eq!(
        v.line,
        "balanced: targets waited 3%, drafters waited 5%; the ring holds steady (0/4 ready)"
    );
}

#[test]
fn a_closed_ring_where_nothing_moves_is_finished() {
    let r = ring("closed", 1, 1, 2);
    r.producer(0).unwrap().finish();
    let a = r.snapshot();
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Idle);
    assert!(
        v.line.starts_with("finished: every producer is done (1/1)"),
        "{}",
        v.line
    );
}

/// A ring with a work table of `items` planned batches, one producer and one consumer.
fn planned(tag: &str, items: u64) -> Ring {
    planned_by(tag, 1, 1, items)
}

fn planned_by(tag: &str, producers: u32, consumers: u32, items: u64) -> Ring {
    let params = shm_ring::RingParams {
        work_items: items,
        ..fifo(producers, consumers, 4)
    };
    Ring::create(&unique(tag), &params).unwrap()
}

/// Claims the next planned batch, publishes it as `batch_id` and has the consumer take it.
fn planned_batch<'c>(
    p: &shm_ring::Producer<'_>,
    c: &'c shm_ring::Consumer<'_>,
    batch_id: u64,
) -> shm_ring::ReadSlot<'c> {
    let item = p.claim_work().unwrap();
    let mut w = p.reserve(8).unwrap();
    w.complete_work(item).unwrap();
    w.commit(CommitMeta {
        batch_id,
        ..CommitMeta::default()
    })
    .unwrap();
    c.take().unwrap().unwrap()
}

/// Every planned batch published and trained: finished.
#[test]
fn a_run_that_trained_its_whole_plan_is_finished() {
    let r = planned("plandone", 2);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    for batch in 0..2 {
        planned_batch(&p, &c, batch).release().unwrap();
    }
    p.finish();
    let a = r.snapshot();
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(
        v.line,
        "finished: every producer is done (1/1) and every batch is trained"
    );
}

/// A stop (Ctrl-C: the targets finish early) closes the ring with planned batches never
/// published: the run ended, it did not train every batch, and the verdict says how many.
#[test]
fn a_stopped_run_ended_with_its_unpublished_batches_counted() {
    let r = planned("planstop", 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    planned_batch(&p, &c, 0).release().unwrap();
    p.finish();
    let a = r.snapshot();
    assert!(a.closed && a.slots.ready + a.slots.reading == 0);
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Idle);
    assert_eq!(
        v.line,
        "ended: the producers are done (1/1) with 3 of 4 planned batch(es) not published, \
         0 set aside (never trained); every other batch is trained"
    );
}

/// A batch set aside (it killed the drafters that took it) is never trained: "every batch is
/// trained" would be false even with the whole plan published. (Setting a batch aside takes a
/// dead process; the snapshot is given the count its recovery would leave.)
#[test]
fn a_run_with_a_batch_set_aside_ended_with_it_counted() {
    let r = planned("planaside", 2);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    for batch in 0..2 {
        planned_batch(&p, &c, batch).release().unwrap();
    }
    p.finish();
    let a = r.snapshot();
    let mut b = r.snapshot();
    b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
    b.counters.released -= 1;
    b.counters.set_aside += 1;
    let v = verdict(&b, &interval(&a, &b, &[]));
    assert_eq!(
        v.line,
        "ended: the producers are done (1/1) with 0 of 2 planned batch(es) not published, \
         1 set aside (never trained); every other batch is trained"
    );
}

/// A batch a drafter refused as corrupt (`ReadSlot::refuse`) is freed but not trained: the
/// ring counts it apart from the released ones, the consumer's items do not count it, and the
/// end says so. Before, a refusal was a release: the monitor's "trained" counted it and a run
/// whose drafters refused every batch read "every batch is trained".
#[test]
fn a_run_whose_drafter_refused_a_batch_ended_with_it_counted() {
    let r = planned("planrefused", 2);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    planned_batch(&p, &c, 0).release().unwrap();
    planned_batch(&p, &c, 1).refuse().unwrap();
    p.finish();
    let b = r.snapshot();
    assert_eq!((b.counters.released, b.counters.refused), (1, 1));
    let drafter = b.worker(WorkerName::consumer(0)).unwrap();
    assert_eq!(drafter.items, 1, "the refused batch is not one it trained");
    let (v, _) = judge(&r, &b, &[]);
    assert_eq!(
        v.line,
        "ended: the producers are done (1/1) with 0 of 2 planned batch(es) not published, \
         0 set aside (never trained), 1 refused as corrupt by the drafters (see their logs); \
         every other batch is trained"
    );
}

/// Batches trained in updates that were lost (every drafter died, and the group went on from
/// its checkpoint) or skipped (the group diverged) were released: by the ring alone the end
/// said "every batch is trained" while the summary counted them untrained (exit code 3). Told
/// their count from `lost-steps.jsonl` (`Judge::set_lost`), the end says them delivered, not
/// trained, with the whole plan published and short of it alike; told none, it is unchanged.
#[test]
fn a_run_with_batches_in_lost_updates_ended_with_them_counted() {
    let later = |a: &Snapshot| {
        let mut b = a.clone();
        b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
        b
    };
    let r = planned("planlost", 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    for batch in 0..4 {
        planned_batch(&p, &c, batch).release().unwrap();
    }
    p.finish();
    let a = r.snapshot();
    let b = later(&a);
    let mut judge = Judge::new();
    assert_eq!(
        judge.verdict(&a, &b, &[]).line,
        "finished: every producer is done (1/1) and every batch is trained"
    );
    judge.set_lost(3);
    let c2 = later(&b);
    assert_eq!(
        judge.verdict(&b, &c2, &[]).line,
        "ended: every producer is done (1/1) and every batch was delivered, 3 of them in lost \
         updates (lost-steps.jsonl; a resume trains them)"
    );

    // Stopped short of the plan, one batch of it in a lost update.
    let r = planned("planlostshort", 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    planned_batch(&p, &c, 0).release().unwrap();
    p.finish();
    let a = r.snapshot();
    let mut judge = Judge::new();
    judge.set_lost(1);
    assert_eq!(
        judge.verdict(&a, &later(&a), &[]).line,
        "ended: the producers are done (1/1) with 3 of 4 planned batch(es) not published, \
         0 set aside (never trained); every other batch was delivered, 1 of them in lost updates \
         (lost-steps.jsonl; a resume trains them)"
    );
}

/// The end of the plan before the ring closes: every planned batch is published or claimed,
/// so the targets without one sit idle and the drafters wait on a near-empty ring. That is the
/// run draining, not targets too slow (no target is done yet: targets finish only when the
/// ring closes).
#[test]
fn with_every_planned_batch_claimed_or_published_it_is_draining() {
    let r = planned_by("planout", 2, 2, 6);
    let (p0, p1) = (r.producer(0).unwrap(), r.producer(1).unwrap());
    let (c0, c1) = (r.consumer(0).unwrap(), r.consumer(1).unwrap());
    for batch in 0..2 {
        planned_batch(&p0, &c0, batch).release().unwrap();
        planned_batch(&p1, &c1, 10 + batch).release().unwrap();
    }
    // The last two batches are being computed, one by each target.
    assert!(p0.claim_work().is_some() && p1.claim_work().is_some());
    let a = r.snapshot();
    p0.add_phase(Phase::Compute, ms(980));
    p1.add_phase(Phase::Compute, ms(980));
    c0.add_phase(Phase::WaitEmpty, ms(900));
    c1.add_phase(Phase::WaitEmpty, ms(900));
    let empty = SlotCounts {
        free: 4,
        ..SlotCounts::default()
    };
    let (v, _) = judge(&r, &a, &[empty; 10]);
    assert_eq!(a.producers_done, 0);
    assert_eq!(v.bottleneck, Bottleneck::Draining, "{v:?}");
    assert_eq!(
        v.line,
        "draining: every planned batch is handed out (4 of 6 published, 2 being computed by \
         the targets); the drafters train what the ring holds (0 ready, 0 held by drafters)"
    );
}

/// Asserts `got` says `want`, but for the pace figures ("3.0x", and a phase's share of the
/// working time, "(56% in"): a worker's phase in progress (`other`, since it registered) counts
/// the test's own real time into its pace, so those are checked within 0.3 and 15 points.
fn says(got: &str, want: &str) {
    fn split(s: &str) -> (String, Vec<f64>) {
        let mut figures = Vec::new();
        let words: Vec<String> = s
            .split(' ')
            .map(|w| {
                if let Some(x) = w.strip_suffix('x').and_then(|n| n.parse::<f64>().ok()) {
                    figures.push(x * 10.0);
                    "Rx".to_string()
                } else if let Some(p) = w
                    .strip_prefix('(')
                    .and_then(|w| w.strip_suffix('%'))
                    .and_then(|n| n.parse::<f64>().ok())
                {
                    figures.push(p / 5.0);
                    "(N%".to_string()
                } else {
                    w.to_string()
                }
            })
            .collect();
        (words.join(" "), figures)
    }
    let (g, gf) = split(got);
    let (w, wf) = split(want);
    assert_eq!(g, w, "{got}");
    assert_eq!(gf.len(), wf.len(), "{got}");
    for (a, b) in gf.iter().zip(&wf) {
        assert!((a - b).abs() <= 3.0, "{got}\nshould say about\n{want}");
    }
}

/// Publishes a batch of `tokens` tokens.
fn publish_tokens(p: &shm_ring::Producer<'_>, tokens: u64) {
    p.reserve(8)
        .unwrap()
        .commit(CommitMeta {
            tokens,
            ..Default::default()
        })
        .unwrap();
}

/// A target three times slower per token than its peers, most of it loading data, is named
/// with its figures and what it costs (nothing but its share: targets claim work as they go).
#[test]
fn a_slow_target_is_named_with_its_dominant_phase() {
    let r = ring("strag", 3, 1, 16);
    let ps: Vec<_> = (0..3).map(|i| r.producer(i).unwrap()).collect();
    let c = r.consumer(0).unwrap();
    let a = r.snapshot();
    for (i, p) in ps.iter().enumerate() {
        for _ in 0..5 {
            publish_tokens(p, 100);
        }
        p.add_phase(Phase::Compute, ms(if i == 2 { 410 } else { 300 }));
    }
    ps[2].add_phase(Phase::Load, ms(520));
    c.add_phase(Phase::Compute, ms(900));
    for _ in 0..15 {
        c.take().unwrap().unwrap().release().unwrap();
    }
    let (v, _) = judge(&r, &a, &[]);
    // The drafter keeps up (nobody waits, the ring holds): the slow target is the one to see.
    assert_eq!(v.bottleneck, Bottleneck::Balanced, "{v:?}");
    assert_eq!(v.stragglers.len(), 1, "{v:?}");
    says(
        &v.stragglers[0],
        "target 2 is slow: 3.1x its peers' time per token (56% in load, 5.0 items/s vs peers 5.0); \
         targets claim work as they go, so the others take more: it costs only its own share",
    );
    assert_eq!(v.worker, Some(WorkerName::producer(2)));
}

/// When the drafters are the bottleneck, a slow target holds nothing up: it is listed as a
/// straggler but the verdict blames no worker.
#[test]
fn a_slow_target_behind_slow_drafters_is_listed_not_blamed() {
    let r = ring("stragd", 2, 1, 16);
    let ps: Vec<_> = (0..2).map(|i| r.producer(i).unwrap()).collect();
    let c = r.consumer(0).unwrap();
    let a = r.snapshot();
    for (i, p) in ps.iter().enumerate() {
        for _ in 0..5 {
            publish_tokens(p, 100);
        }
        p.add_phase(Phase::Compute, ms(if i == 1 { 600 } else { 200 }));
        p.add_phase(Phase::WaitFull, ms(if i == 1 { 300 } else { 700 }));
    }
    c.add_phase(Phase::Compute, ms(950));
    for _ in 0..10 {
        c.take().unwrap().unwrap().release().unwrap();
    }
    let (v, _) = judge(&r, &a, &[r.slot_counts(); 4]);
    assert_eq!(v.bottleneck, Bottleneck::Drafters, "{v:?}");
    assert_eq!(v.worker, None, "{v:?}");
    assert!(serde_json::to_value(&v).unwrap()["worker"].is_null());
    assert_eq!(v.stragglers.len(), 1, "{v:?}");
    assert!(v.stragglers[0].starts_with("target 1 is slow: "), "{v:?}");
}

/// The question the design started from: the drafters are the bottleneck (the ring full, the
/// targets waiting), yet their GPUs sit idle part of the time. The verdict says how much and
/// where the time goes, largest first; busy drafters (95% computing, the full-ring test above)
/// get no such note.
#[test]
fn drafters_that_are_the_bottleneck_but_idle_are_told_where_the_time_goes() {
    let r = ring("idle", 1, 1, 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    for _ in 0..4 {
        publish(&p);
    }
    let a = r.snapshot();
    p.add_phase(Phase::WaitFull, ms(900));
    c.add_phase(Phase::Compute, ms(600));
    c.add_phase(Phase::Sync, ms(250));
    c.add_phase(Phase::CopyIn, ms(70));
    // Its gaps between computes (measured elsewhere, as a device's timeline would): the
    // longest is what the line names.
    c.add_gap(ms(120));
    c.add_gap(ms(330));
    c.add_gap(ms(45));
    c.take().unwrap().unwrap().release().unwrap();
    publish(&p);
    let (v, iv) = judge(&r, &a, &[r.slot_counts(); 10]);
    assert_eq!(iv.workers[1].largest_gap_s, 0.33, "{iv:?}");
    assert_eq!(
        iv.workers[0].largest_gap_s, 0.0,
        "the target never computed"
    );
    assert_eq!(v.bottleneck, Bottleneck::Drafters, "{v:?}");
    assert!(
        v.line
            .starts_with("drafters are the bottleneck: ring full 100% of the time"),
        "{}",
        v.line
    );
    assert!(
        v.line.contains(
            "; drafter GPUs idle 40% (longest gap 330ms): 25% in the all-reduce (sync), 7% copying batches in (copy_in)"
        ),
        "{}",
        v.line
    );
}

/// On a GPU the host's clock says little: it queues work and waits for results, so it is "in
/// compute" most of the time whatever the device does. A drafter that times its device (CUDA
/// events) is judged by the device: idle when its compute stream is, the time split by what the
/// host was doing meanwhile, and its gaps are the device's.
#[test]
fn a_device_timed_drafter_is_judged_by_its_devices_timeline() {
    let r = ring("devidle", 1, 1, 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    for _ in 0..4 {
        publish(&p);
    }
    c.set_device_timed(true);
    c.enter(Phase::Compute);
    // The host copies the next batch in while the device sits idle (the phase switch is
    // logged before the window starts, so the whole gap below falls in it).
    c.enter(Phase::CopyIn);
    let a = r.snapshot();
    p.add_phase(Phase::WaitFull, ms(900));
    c.add_phase(Phase::Compute, ms(950));
    let t = a.taken_at_ns;
    let busy = |from: u64, to: u64| shm_ring::DeviceSpan {
        phase: Phase::Compute,
        start_ns: t + from * 1_000_000,
        end_ns: t + to * 1_000_000,
        busy: true,
    };
    c.record_device(busy(0, 500));
    c.record_device(busy(900, 1000));
    c.take().unwrap().unwrap().release().unwrap();
    publish(&p);
    let (v, iv) = judge(&r, &a, &[r.slot_counts(); 10]);
    let d = iv.workers[1].device.as_ref().expect("device figures");
    assert_eq!((iv.workers[1].busy, d.busy), (0.6, 0.6), "{iv:?}");
    assert_eq!(d.idle[Phase::CopyIn], 0.4, "{d:?}");
    assert_eq!(iv.workers[1].largest_gap_s, 0.4, "{iv:?}");
    assert_eq!(v.bottleneck, Bottleneck::Drafters, "{v:?}");
    assert!(
        v.line.contains(
            "; drafter GPUs idle 40% (longest gap 400ms): 40% copying batches in (copy_in)"
        ),
        "{}",
        v.line
    );
}

/// The ring keeps each worker's idle gaps by itself, from its phase switches: leaving
/// `compute` starts one (in progress in a snapshot), other phases continue it, coming back ends
/// it (kept for its second); before the first compute there is none.
#[test]
fn leaving_compute_opens_an_idle_gap_and_coming_back_closes_it() {
    let r = ring("gaps", 1, 1, 2);
    let c = r.consumer(0).unwrap();
    let gap = || {
        let s = r.snapshot();
        let w = s.worker(WorkerName::consumer(0)).unwrap();
        (w.idle_now_ns.is_some(), w.idle_gaps.len())
    };
    c.enter(Phase::Sync);
    assert_eq!(gap(), (false, 0), "a gap before the first compute");
    c.enter(Phase::Compute);
    assert_eq!(gap(), (false, 0));
    c.enter(Phase::Sync);
    assert_eq!(gap(), (true, 0), "leaving compute opens a gap");
    c.enter(Phase::CopyIn);
    assert_eq!(gap(), (true, 0), "another phase continues it");
    c.enter(Phase::Compute);
    assert_eq!(gap(), (false, 1), "computing again closes and keeps it");
}

/// A worker that dies out of compute leaves its gap open in the record; the next incarnation
/// starts with none (its predecessor's death, restart and load are not one long idle gap of
/// its own), and so does a worker that left and registered again.
#[test]
fn a_new_incarnation_starts_without_its_predecessors_open_gap() {
    let r = ring("gapsrestart", 1, 1, 2);
    let idle_now = || {
        r.snapshot()
            .worker(WorkerName::consumer(0))
            .unwrap()
            .idle_now_ns
    };
    let c = r.consumer(0).unwrap();
    c.enter(Phase::Compute);
    c.enter(Phase::Sync);
    assert!(idle_now().is_some());
    // A crash in sync: the handles are gone without a word, and the supervisor recovers.
    std::mem::forget(c);
    // SAFETY: the only handle of consumer 0 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerName::consumer(0)) }.unwrap();
    let c = r.consumer(0).unwrap();
    assert_eq!(
        idle_now(),
        None,
        "the restarted worker inherited the dead one's gap"
    );
    // Leaving cleanly out of compute, then registering again: no gap either.
    c.enter(Phase::Compute);
    c.enter(Phase::Sync);
    drop(c);
    let _c = r.consumer(0).unwrap();
    assert_eq!(idle_now(), None, "a worker that left kept its gap open");
}

/// Independent drafters (no group, no `sync`): a slow one takes fewer batches, the others take
/// more; the ring absorbs it, and the verdict says so and that it costs only its share.
#[test]
fn a_slow_independent_drafter_is_absorbed_by_the_ring() {
    let r = ring("indep", 1, 3, 16);
    let p = r.producer(0).unwrap();
    let cs: Vec<_> = (0..3).map(|i| r.consumer(i).unwrap()).collect();
    let a = r.snapshot();
    p.add_phase(Phase::Compute, ms(950));
    for (i, c) in cs.iter().enumerate() {
        // Drafter 1 is three times slower per batch: 5 batches where the others do 15.
        let n = if i == 1 { 5 } else { 15 };
        for _ in 0..n {
            publish_tokens(&p, 100);
            c.take().unwrap().unwrap().release().unwrap();
        }
        c.add_phase(Phase::Compute, ms(900));
    }
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Balanced, "{v:?}");
    assert_eq!(v.worker, Some(WorkerName::consumer(1)));
    // Named in `--json` (and the monitor's metrics) as the logs name it.
    assert_eq!(serde_json::to_value(&v).unwrap()["worker"], "drafter-1");
    assert_eq!(v.stragglers.len(), 1, "{v:?}");
    says(
        &v.stragglers[0],
        "drafter 1 is slow: 3.0x its peers' time per token (100% in compute, 5.0 items/s vs peers 15.0); \
         the ring absorbs it: the other drafters take more batches, so it costs only its own share",
    );
}

/// The drafters are one synchronous group: ranks 0 and 1 wait in sync for rank 2, which is
/// three times slower per token. The verdict names rank 2 (not the fast ranks, whose busy
/// share is low only because they wait for it).
#[test]
fn the_group_names_the_rank_it_waits_for_not_the_ranks_that_wait() {
    let r = ring("group", 1, 3, 6);
    let p = r.producer(0).unwrap();
    let cs: Vec<_> = (0..3).map(|i| r.consumer(i).unwrap()).collect();
    let a = r.snapshot();
    // Five group steps: each rank trains one batch per step.
    for (i, c) in cs.iter().enumerate() {
        let (compute, sync) = if i == 2 { (900, 0) } else { (300, 600) };
        c.add_phase(Phase::Compute, ms(compute));
        c.add_phase(Phase::Sync, ms(sync));
        for _ in 0..5 {
            publish_tokens(&p, 100);
            c.take().unwrap().unwrap().release().unwrap();
        }
    }
    let (v, _) = judge(&r, &a, &[]);
    says(
        &v.line,
        "balanced: targets waited 0%, drafters waited 0%; the ring holds steady (0/6 ready); \
         drafters wait 60% in sync for drafter 2 (compute per token 3.0x the group median)",
    );
    assert_eq!(v.worker, Some(WorkerName::consumer(2)));
    assert_eq!(v.stragglers.len(), 1, "{:?}", v.stragglers);
    says(
        &v.stragglers[0],
        "drafter 2 is slow: 3.0x its peers' time per token (100% in compute, 5.0 items/s vs peers 5.0); \
         the group waits for it at every step: the other ranks wait 60% in sync",
    );
}

/// A group of two whose rank 1 died: rank 0, the one live rank, waits in sync for it (until its
/// removal, or its restart rejoins). With no second live rank to compare, that is not batches
/// of unequal time.
#[test]
fn a_lone_live_rank_waiting_in_sync_waits_for_the_rank_that_is_down() {
    let r = ring("lonerank", 1, 2, 6);
    let p = r.producer(0).unwrap();
    let (c0, c1) = (r.consumer(0).unwrap(), r.consumer(1).unwrap());
    // Both ranks trained, in lock-step, enough batches for their pace to be known.
    for c in [&c0, &c1] {
        c.add_phase(Phase::Compute, ms(300));
        c.add_phase(Phase::Sync, ms(100));
        for _ in 0..5 {
            publish_tokens(&p, 100);
            c.take().unwrap().unwrap().release().unwrap();
        }
    }
    std::mem::forget(c1);
    // SAFETY: the only handle of consumer 1 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerName::consumer(1)) }.unwrap();
    let a = r.snapshot();
    c0.add_phase(Phase::Compute, ms(300));
    c0.add_phase(Phase::Sync, ms(600));
    for _ in 0..5 {
        publish_tokens(&p, 100);
        c0.take().unwrap().unwrap().release().unwrap();
    }
    let (v, _) = judge(&r, &a, &[]);
    assert!(
        v.line
            .ends_with("; drafters wait 60% in sync for a dead or restarting rank"),
        "{}",
        v.line
    );
}

/// A group of three whose rank 2 is down: when both live ranks wait in sync, the group waited
/// for the rank that is down, not for unequal batches; when one live rank hardly waits, the
/// live ranks' batches took unequal time (a rank given up no longer holds the group).
#[test]
fn two_live_ranks_waiting_together_wait_for_the_rank_that_is_down() {
    for (sync1, long_ago, want) in [
        (
            600,
            false,
            "; drafters wait 60% in sync for a dead or restarting rank",
        ),
        (
            0,
            false,
            "; drafters wait 30% in sync: their batches take unequal time (no rank is slow per token)",
        ),
        // Down since before the window (given up, removed from the group long ago): not
        // whom the group waits for.
        (
            600,
            true,
            "; drafters wait 60% in sync: their batches take unequal time (no rank is slow per token)",
        ),
    ] {
        let r = ring(&format!("downrank{sync1}{long_ago}"), 1, 3, 8);
        let p = r.producer(0).unwrap();
        let (c0, c1, c2) = (
            r.consumer(0).unwrap(),
            r.consumer(1).unwrap(),
            r.consumer(2).unwrap(),
        );
        // Every rank trained, in lock-step, enough batches for its pace to be known.
        for c in [&c0, &c1, &c2] {
            c.add_phase(Phase::Compute, ms(300));
            c.add_phase(Phase::Sync, ms(100));
            for _ in 0..5 {
                publish_tokens(&p, 100);
                c.take().unwrap().unwrap().release().unwrap();
            }
        }
        std::mem::forget(c2);
        // SAFETY: the only handle of consumer 2 was forgotten above and is never used again.
        unsafe { r.recover_unchecked(WorkerName::consumer(2)) }.unwrap();
        if long_ago {
            // Its last heartbeat further back than the window reaches (two of its seconds).
            std::thread::sleep(Duration::from_millis(2100));
        }
        let a = r.snapshot();
        for (c, sync) in [(&c0, 600), (&c1, sync1)] {
            c.add_phase(Phase::Compute, ms(300));
            c.add_phase(Phase::Sync, ms(sync));
            for _ in 0..5 {
                publish_tokens(&p, 100);
                c.take().unwrap().unwrap().release().unwrap();
            }
        }
        let (v, _) = judge(&r, &a, &[]);
        assert!(v.line.ends_with(want), "{sync1}: {}", v.line);
    }
}

/// Publishes and trains one batch, so the run is past its start.
fn one_through(p: &shm_ring::Producer<'_>, c: &shm_ring::Consumer<'_>) {
    publish_tokens(p, 100);
    c.take().unwrap().unwrap().release().unwrap();
}

/// Issue #14's second row: nobody waits yet, but the targets publish far more than the drafters
/// train, so the ring fills: the drafters cannot keep up.
#[test]
fn a_filling_ring_with_nobody_waiting_names_the_drafters() {
    let r = ring("fill", 1, 1, 16);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    one_through(&p, &c);
    let a = r.snapshot();
    p.add_phase(Phase::Compute, ms(950));
    c.add_phase(Phase::Compute, ms(950));
    for _ in 0..9 {
        publish_tokens(&p, 100);
    }
    for _ in 0..3 {
        c.take().unwrap().unwrap().release().unwrap();
    }
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Drafters, "{v:?}");
    assert_eq!(v.trend, Trend::Filling);
    assert_eq!(
        v.line,
        "drafters are the bottleneck: the ring fills (+6 batches in 1.0s, now 6/16 ready): they \
         train 3.0/s of the 9.0/s published (targets waited 0%, drafters 0%)"
    );
}

/// The other way: the drafters train what the ring held faster than the targets refill it.
#[test]
fn an_emptying_ring_with_nobody_waiting_names_the_targets() {
    let r = ring("drain", 1, 1, 16);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    one_through(&p, &c);
    for _ in 0..10 {
        publish_tokens(&p, 100);
    }
    let a = r.snapshot();
    p.add_phase(Phase::Compute, ms(950));
    c.add_phase(Phase::Compute, ms(950));
    publish_tokens(&p, 100);
    for _ in 0..8 {
        c.take().unwrap().unwrap().release().unwrap();
    }
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Targets, "{v:?}");
    assert_eq!(v.trend, Trend::Emptying);
    assert!(
        v.line
            .starts_with("targets are the bottleneck: the ring empties (-7 batches"),
        "{}",
        v.line
    );
}

/// Issue #14's third row: a target computing a batch longer than the interval publishes
/// nothing in it, and the drafters wait: the targets are the bottleneck, not "idle". The
/// target's phase in progress counts up to the snapshot.
#[test]
fn a_batch_longer_than_the_interval_is_busy_not_idle() {
    let r = ring("long", 1, 1, 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    one_through(&p, &c);
    p.enter(Phase::Compute);
    let a = r.snapshot();
    std::thread::sleep(ms(50));
    c.add_phase(Phase::WaitEmpty, ms(900));
    let b = r.snapshot();
    let iv = interval(&a, &b, &[]);
    let v = verdict(&b, &iv);
    assert_eq!(v.bottleneck, Bottleneck::Targets, "{v:?}");
    assert!(iv.workers[0].busy > 0.5, "{:?}", iv.workers[0]);
}

/// Before the first take the drafters wait for the ring to fill: starting, not "targets are
/// the bottleneck".
#[test]
fn before_the_first_take_it_is_starting() {
    let r = ring("start", 1, 1, 4);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    let a = r.snapshot();
    p.add_phase(Phase::Compute, ms(950));
    c.add_phase(Phase::WaitEmpty, ms(950));
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Starting, "{v:?}");
    assert_eq!(
        v.line,
        "starting: the targets compute the first batches (0 being written)"
    );
}

/// A live worker silent for far longer than its steps take is named: stalled.
#[test]
fn a_silent_worker_is_stalled_and_named() {
    let r = ring("silent", 1, 2, 8);
    let p = r.producer(0).unwrap();
    let cs: Vec<_> = (0..2).map(|i| r.consumer(i).unwrap()).collect();
    for c in &cs {
        for _ in 0..5 {
            one_through(&p, c);
        }
        c.add_phase(Phase::Compute, ms(300));
    }
    let a = r.snapshot();
    // Drafter 1 has sent nothing for the 30 s it has been computing; its steps took 0.1 s.
    cs[1].add_phase(Phase::Compute, Duration::from_secs(30));
    let mut b = r.snapshot();
    b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
    drafter_mut(&mut b, 1).heartbeat_age_ns = Some(30_000_000_000);
    let v = verdict(&b, &interval(&a, &b, &[]));
    assert_eq!(v.bottleneck, Bottleneck::Stalled, "{v:?}");
    assert_eq!(v.worker, Some(WorkerName::consumer(1)));
    assert!(
        v.line.starts_with("stalled: drafter 1 (pid ")
            && v.line.contains("has sent no heartbeat for 30s")
            && v.line.contains("its steps take 0.1s"),
        "{}",
        v.line
    );
    // Silent for less than 10 of its steps (and 5 s): not stalled.
    drafter_mut(&mut b, 1).heartbeat_age_ns = Some(900_000_000);
    let v = verdict(&b, &interval(&a, &b, &[]));
    assert_ne!(v.bottleneck, Bottleneck::Stalled, "{v:?}");
}

/// A lone drafter stalled is said to hold everything up, not "the other drafters go on
/// without it" (there were none).
#[test]
fn a_lone_silent_drafter_is_said_to_be_the_only_one() {
    let r = ring("silent1", 1, 1, 8);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    for _ in 0..5 {
        one_through(&p, &c);
    }
    c.add_phase(Phase::Compute, ms(300));
    let a = r.snapshot();
    c.add_phase(Phase::Compute, Duration::from_secs(30));
    let mut b = r.snapshot();
    b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
    drafter_mut(&mut b, 0).heartbeat_age_ns = Some(30_000_000_000);
    let v = verdict(&b, &interval(&a, &b, &[]));
    assert_eq!(v.bottleneck, Bottleneck::Stalled, "{v:?}");
    assert!(
        v.line
            .ends_with("; it is the only live drafter: no batch is trained while it is silent")
            && !v.line.contains("go on without it"),
        "{}",
        v.line
    );
}

/// Hysteresis: once the drafters are the bottleneck, an interval in which the targets wait
/// 15% (under the 20% that made it so, over half of it) keeps the verdict; judged alone, the
/// same interval is balanced.
#[test]
fn the_verdict_does_not_flip_on_a_weaker_interval() {
    let r = ring("hyst", 1, 1, 16);
    let (p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    one_through(&p, &c);
    let mut judge_ = Judge::new();
    let mut a = r.snapshot();
    let mut step = |wait_full: u64| {
        p.add_phase(Phase::WaitFull, ms(wait_full));
        p.add_phase(Phase::Compute, ms(1000 - wait_full));
        c.add_phase(Phase::Compute, ms(990));
        // Enough ring events (48) that the window is this interval alone.
        for _ in 0..24 {
            one_through(&p, &c);
        }
        let mut b = r.snapshot();
        b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
        let alone = verdict(&b, &interval(&a, &b, &[]));
        let judged = judge_.verdict(&a, &b, &[]);
        a = b;
        (judged, alone)
    };
    let (first, _) = step(500);
    assert_eq!(first.bottleneck, Bottleneck::Drafters, "{first:?}");
    let (judged, alone) = step(150);
    assert_eq!(alone.bottleneck, Bottleneck::Balanced, "{alone:?}");
    assert_eq!(judged.bottleneck, Bottleneck::Drafters, "{judged:?}");
    // Under half the threshold, it changes.
    let (judged, _) = step(50);
    assert_eq!(judged.bottleneck, Bottleneck::Balanced, "{judged:?}");
}

/// With no drafter running (the only one died), nothing drains the ring: idle, and why.
#[test]
fn with_no_drafter_running_it_is_idle() {
    let r = ring("nodrafter", 1, 1, 4);
    let p = r.producer(0).unwrap();
    let c = r.consumer(0).unwrap();
    one_through(&p, &c);
    publish_tokens(&p, 100);
    std::mem::forget(c);
    // SAFETY: the only handle of consumer 0 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerName::consumer(0)) }.unwrap();
    let a = r.snapshot();
    p.add_phase(Phase::WaitFull, ms(900));
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Idle, "{v:?}");
    assert_eq!(
        v.line,
        "idle: no drafter is running; 1 batch(es) wait in the ring"
    );
    assert!(v.warnings[0].starts_with("drafter 0 died"), "{v:?}");
}

/// A drafter that died before its first take (a crash at start, given up): idle, not
/// "draining: the drafters are training the last batches", with no drafter alive to train them.
#[test]
fn with_the_only_drafter_dead_before_any_take_it_is_idle() {
    let r = ring("nodrafterfirst", 1, 1, 4);
    let p = r.producer(0).unwrap();
    let c = r.consumer(0).unwrap();
    publish_tokens(&p, 100);
    std::mem::forget(c);
    // SAFETY: the only handle of consumer 0 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerName::consumer(0)) }.unwrap();
    assert!(p.finish(), "the last producer closes the ring");
    let a = r.snapshot();
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.bottleneck, Bottleneck::Idle, "{v:?}");
    assert_eq!(
        v.line,
        "idle: no drafter is running; 1 batch(es) wait in the ring"
    );
}

#[test]
fn a_dead_worker_is_a_warning() {
    let r = ring("dead", 1, 2, 4);
    let c = r.consumer(1).unwrap();
    // The consumer "dies": its handle is leaked, as a killed process's would be.
    std::mem::forget(c);
    // SAFETY: the only handle of consumer 1 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerName::consumer(1)) }.unwrap();
    let a = r.snapshot();
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(v.warnings.len(), 1, "{v:?}");
    assert!(v.warnings[0].starts_with("drafter 1 died"), "{v:?}");
}

#[test]
fn the_cli_prints_the_table_and_json_and_names_a_missing_ring() {
    let r = ring("cli", 1, 1, 4);
    let p = r.producer(0).unwrap();
    p.set_gpu(Some(3));
    publish(&p);
    let args = Args {
        ring: Some(r.name().to_string()),
        interval: 0.05,
        ..Args::default()
    };
    let mut out = Vec::new();
    run(&args, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    for want in [
        "state open",
        "producers done 0/1",
        "ready 1",
        "verdict:",
        "target     0    3",
    ] {
        assert!(text.contains(want), "{want:?} missing from\n{text}");
    }
    let mut out = Vec::new();
    run(&Args { json: true, ..args }, &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["snapshot"]["slots"]["ready"], 1);
    assert!(v["verdict"]["line"].is_string());
    assert_eq!(v["interval"]["workers"][0]["gpu"], 3);

    let missing = Args {
        ring: Some("hspipe-no-such-ring".into()),
        ..Args::default()
    };
    let err = format!("{:#}", run(&missing, &mut Vec::new()).unwrap_err());
    assert!(
        err.contains("hspipe-no-such-ring") && err.contains("not found"),
        "{err}"
    );

    // A file that is not a ring.
    let junk = unique("junk");
    std::fs::write(format!("/dev/shm/{junk}"), [7u8; 8192]).unwrap();
    std::fs::set_permissions(
        format!("/dev/shm/{junk}"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let err = format!(
        "{:#}",
        run(
            &Args {
                ring: Some(junk.clone()),
                ..Args::default()
            },
            &mut Vec::new()
        )
        .unwrap_err()
    );
    std::fs::remove_file(format!("/dev/shm/{junk}")).unwrap();
    assert!(err.contains("not an hspipe ring"), "{err}");
}

/// A period a duration cannot hold (`--watch 1e20`) is bad input like a negative one: an
/// error naming the flag, never a panic.
#[test]
fn periods_out_of_range_are_refused_naming_the_flag() {
    let r = ring("periods", 1, 1, 4);
    for secs in [1e20, 1e300, f64::INFINITY, f64::NAN, 0.0, -1.0] {
        for (flag, args) in [
            (
                "--watch",
                Args {
                    watch: Some(secs),
                    ..Args::default()
                },
            ),
            (
                "--interval",
                Args {
                    interval: secs,
                    ..Args::default()
                },
            ),
        ] {
            let args = Args {
                ring: Some(r.name().to_string()),
                ..args
            };
            let got = std::panic::catch_unwind(|| run(&args, &mut Vec::new()));
            let err = got.unwrap_or_else(|_| panic!("{flag} {secs} panicked"));
            let err = format!("{:#}", err.unwrap_err());
            assert!(
                err.contains(flag) && err.contains("positive number of seconds"),
                "{flag} {secs}: {err}"
            );
            // The value as given, not 1e300 written out in 301 digits.
            assert!(err.len() < 120, "{flag} {secs}: {err}");
        }
    }
}

#[test]
fn stat_reads_a_segment_it_may_only_read() {
    let r = ring("ro", 1, 1, 2);
    let path = format!("/dev/shm/{}", r.name());
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
    let ro = Ring::open_read_only(r.name()).unwrap();
    assert_eq!(ro.snapshot().params.slots, 2);
}

/// Worker `drafter-i` of a snapshot, to edit.
fn drafter_mut(s: &mut Snapshot, i: u32) -> &mut shm_ring::WorkerSnapshot {
    let name = WorkerName::consumer(i);
    s.workers.iter_mut().find(|w| w.name() == name).unwrap()
}

/// A ring whose launcher is gone (its workers died with it) is stale whatever its figures say:
/// here drafters that waited a whole second for a first batch, which read "starting" before.
#[test]
fn a_ring_whose_launcher_is_gone_is_stale_not_starting() {
    let r = ring("stale", 1, 1, 4);
    let (_p, c) = (r.producer(0).unwrap(), r.consumer(0).unwrap());
    let a = r.snapshot();
    c.add_phase(Phase::WaitEmpty, SEC);
    let (live, _) = judge(&r, &a, &[]);
    assert_ne!(live.bottleneck, Bottleneck::Idle, "{}", live.line);
    let mut b = r.snapshot();
    b.taken_at_ns = a.taken_at_ns + SEC.as_nanos() as u64;
    b.creator_alive = false;
    let v = verdict(&b, &interval(&a, &b, &[]));
    assert_eq!(v.bottleneck, Bottleneck::Idle);
    let said = format!("stale: the launcher (pid {}) is gone", std::process::id());
    assert!(v.line.starts_with(&said), "{}", v.line);
    assert!(v.line.contains("--gc"), "{}", v.line);
    // Once the ring is removed, its advice (`--gc` removes it) goes with it.
    let mut report = ring_stat::report::Report::between(&a, b, &[]);
    report.mark_removed();
    let line = &report.verdict.line;
    assert!(line.starts_with(&said) && !line.contains("--gc"), "{line}");
}
