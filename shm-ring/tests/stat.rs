//! shm-ring-stat's analysis on rings put into known states: each gives the right verdict and
//! figures. Phase times are injected with `add_phase`, and the interval is fixed at one second,
//! so the figures are exact whatever the machine's speed.

use std::time::Duration;

use crate::common::{fifo, unique};
use shm_ring::analysis::{interval, verdict, Bottleneck, Verdict};
use shm_ring::stat_cli::{run, Args};
use shm_ring::{CommitMeta, Phase, Ring, SlotCounts, Snapshot, WorkerId};

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
) -> (Verdict, shm_ring::analysis::Interval) {
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
    assert_eq!(v.line, "balanced: targets waited 3%, drafters waited 5%");
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

#[test]
fn a_slow_target_is_named_with_its_dominant_phase() {
    let r = ring("strag", 3, 1, 6);
    let ps: Vec<_> = (0..3).map(|i| r.producer(i).unwrap()).collect();
    let c = r.consumer(0).unwrap();
    let a = r.snapshot();
    ps[0].add_phase(Phase::Compute, ms(970));
    ps[1].add_phase(Phase::Compute, ms(960));
    ps[2].add_phase(Phase::Compute, ms(410));
    ps[2].add_phase(Phase::Load, ms(520));
    c.add_phase(Phase::Compute, ms(900));
    publish(&ps[0]);
    c.take().unwrap().unwrap().release().unwrap();
    let (v, _) = judge(&r, &a, &[]);
    assert_eq!(
        v.stragglers,
        vec!["target 2 busy 41% vs peers 97%: 52% in load".to_string()]
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
    for _ in 0..3 {
        p.reserve(8)
            .unwrap()
            .commit(CommitMeta {
                tokens: 100,
                ..Default::default()
            })
            .unwrap();
    }
    let a = r.snapshot();
    for (i, c) in cs.iter().enumerate() {
        let (compute, sync) = if i == 2 { (900, 0) } else { (300, 600) };
        c.add_phase(Phase::Compute, ms(compute));
        c.add_phase(Phase::Sync, ms(sync));
        c.take().unwrap().unwrap().release().unwrap();
    }
    let (v, _) = judge(&r, &a, &[]);
    assert!(
        v.line.ends_with(
            "; drafters wait 60% in sync for drafter 2 (compute per token 3.0x the group median)"
        ),
        "{}",
        v.line
    );
    assert!(v.stragglers.is_empty(), "{:?}", v.stragglers);
}

#[test]
fn a_dead_worker_is_a_warning() {
    let r = ring("dead", 1, 2, 4);
    let c = r.consumer(1).unwrap();
    // The consumer "dies": its handle is leaked, as a killed process's would be.
    std::mem::forget(c);
    // SAFETY: the only handle of consumer 1 was forgotten above and is never used again.
    unsafe { r.recover_unchecked(WorkerId::consumer(1)) }.unwrap();
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

#[test]
fn stat_reads_a_segment_it_may_only_read() {
    let r = ring("ro", 1, 1, 2);
    let path = format!("/dev/shm/{}", r.name());
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
    let ro = Ring::open_read_only(r.name()).unwrap();
    assert_eq!(ro.snapshot().params.slots, 2);
}
