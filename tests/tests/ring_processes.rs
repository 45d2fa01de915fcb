//! The ring across real processes: stress with exact accounting, crash recovery, stale segments.

use std::collections::HashMap;

use shm_ring::{Ring, RingError, RingParams, Role, TakePolicy, WorkerName};
use tests::batch_id;

use crate::support::{parse_got, ring_peer, spawn, unique, workspace_bin, Proc};

fn params(producers: u32, consumers: u32, slots: u32, slot_size: u64) -> RingParams {
    RingParams {
        slots,
        slot_size,
        buckets: 4,
        producers,
        consumers,
        held_per_consumer: 1,
        policy: TakePolicy::Fifo,
        seed: 9,
        work_items: 0,
    }
}

/// Counts deliveries per batch id across consumers' outputs.
fn tally(outputs: &[String]) -> HashMap<u64, Vec<u32>> {
    let mut seen: HashMap<u64, Vec<u32>> = HashMap::new();
    for out in outputs {
        for (id, delivery) in parse_got(out) {
            seen.entry(id).or_default().push(delivery);
        }
    }
    seen
}

fn expected(producers: u32, per: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..producers)
        .flat_map(|p| (0..per).map(move |s| batch_id(p, s)))
        .collect();
    v.sort();
    v
}

/// 5 producer and 3 consumer processes move 5,000 payloads of up to 64 KiB through 16 slots.
/// Every consumer verifies every byte; across them every item arrives exactly once, and the
/// ring's counters agree.
#[test]
fn five_by_three_processes_deliver_every_payload_exactly_once() {
    const PER: u64 = 1000;
    let name = unique("stress");
    let ring = Ring::create(&name, &params(5, 3, 16, 64 << 10)).unwrap();
    let per = PER.to_string();
    let consumers: Vec<Proc> = (0..3)
        .map(|i| ring_peer(&["consume", &name, &i.to_string()]))
        .collect();
    let producers: Vec<Proc> = (0..5)
        .map(|i| ring_peer(&["produce", &name, &i.to_string(), &per, "65536"]))
        .collect();
    for p in producers {
        p.finish();
    }
    let outputs: Vec<String> = consumers.into_iter().map(Proc::finish).collect();
    let seen = tally(&outputs);
    let mut ids: Vec<u64> = seen.keys().copied().collect();
    ids.sort();
    assert_eq!(ids, expected(5, PER), "every item delivered");
    assert!(
        seen.values().all(|d| d == &[0]),
        "each exactly once, first delivery"
    );
    let s = ring.snapshot();
    assert!(s.closed);
    assert_eq!(s.counters.published, 5 * PER);
    assert_eq!(s.counters.taken, 5 * PER);
    assert_eq!(s.counters.released, 5 * PER);
    assert_eq!(s.slots.free, 16);
    let consumed: u64 = s.workers_of(Role::Consumer).map(|w| w.items).sum();
    assert_eq!(consumed, 5 * PER);
}

/// SIGKILL a consumer holding an item and a producer in the middle of a write; the supervisor's
/// recovery puts the item back (delivery 1) and frees the half-written slot; both restart under
/// their ids. Nothing is lost, nothing is stuck, and only the held item is delivered twice.
#[test]
fn sigkilled_consumer_and_mid_write_producer_lose_nothing() {
    const PER: u64 = 300;
    let name = unique("chaos");
    let ring = Ring::create(&name, &params(2, 2, 6, 16 << 10)).unwrap();
    let per = PER.to_string();

    let mut victim_c = ring_peer(&["consume", &name, "0", "--hang-holding", "20"]);
    let survivor_c = ring_peer(&["consume", &name, "1"]);
    let mut victim_p = ring_peer(&[
        "produce",
        &name,
        "0",
        &per,
        "16384",
        "--hang-in-write",
        "150",
    ]);
    let survivor_p = ring_peer(&["produce", &name, "1", &per, "16384"]);

    let held: u64 = victim_c
        .line_starting("holding ")
        .strip_prefix("holding ")
        .expect("victim consumer reports the item it holds")
        .parse()
        .unwrap();
    assert_eq!(victim_p.line_starting("writing"), "writing 150");
    let busy = ring.snapshot();
    assert!(busy.slots.reading >= 1 && busy.slots.writing >= 1);

    // A live worker's id cannot be taken over, nor recovered while its process runs.
    assert!(matches!(
        ring.consumer(0),
        Err(RingError::WorkerBusy { .. })
    ));
    for (id, who) in [
        (WorkerName::consumer(0), &victim_c),
        (WorkerName::producer(0), &victim_p),
    ] {
        assert!(matches!(
            ring.recover(id),
            Err(RingError::WorkerAlive { pid, .. }) if pid == who.child.id()
        ));
    }

    let victim_out = victim_c.kill();
    victim_p.kill();
    let rc = ring.recover(WorkerName::consumer(0)).unwrap();
    let rp = ring.recover(WorkerName::producer(0)).unwrap();
    assert_eq!((rc.freed, rc.requeued), (0, 1), "the held item goes back");
    assert_eq!(
        (rp.freed, rp.requeued),
        (1, 0),
        "the half-written slot is freed"
    );

    // Restart both under the same ids; the producer resumes at the item it was writing.
    let restarted_c = ring_peer(&["consume", &name, "0"]);
    let restarted_p = ring_peer(&["produce", &name, "0", &per, "16384", "--start", "150"]);
    survivor_p.finish();
    restarted_p.finish();
    let outputs = vec![victim_out, survivor_c.finish(), restarted_c.finish()];

    let seen = tally(&outputs);
    let mut ids: Vec<u64> = seen.keys().copied().collect();
    ids.sort();
    assert_eq!(ids, expected(2, PER), "nothing lost");
    for (id, deliveries) in &seen {
        let want: &[u32] = if *id == held { &[1] } else { &[0] };
        assert_eq!(deliveries, want, "batch {id:#x}");
    }
    let s = ring.snapshot();
    assert_eq!(s.counters.redelivered, 1);
    assert_eq!((s.slots.free, s.closed), (6, true), "nothing stuck");
    let epoch = |name| s.worker(name).unwrap().epoch;
    assert_eq!(
        epoch(WorkerName::producer(0)),
        2,
        "producer 0 re-registered"
    );
    assert_eq!(
        epoch(WorkerName::consumer(0)),
        2,
        "consumer 0 re-registered"
    );
}

/// A producer killed mid-write that will not come back is retired: the ring still closes and
/// consumers end after draining what was published.
#[test]
fn retiring_a_dead_producer_still_closes_the_ring() {
    let name = unique("retire");
    let ring = Ring::create(&name, &params(2, 1, 4, 4096)).unwrap();
    let consumer = ring_peer(&["consume", &name, "0"]);
    let mut dying = ring_peer(&["produce", &name, "1", "100", "4096", "--hang-in-write", "5"]);
    let good = ring_peer(&["produce", &name, "0", "50", "4096"]);
    assert_eq!(dying.line_starting("writing"), "writing 5");
    dying.kill();
    ring.recover(WorkerName::producer(1)).unwrap();
    good.finish();
    ring.retire(1).unwrap();
    let seen = tally(&[consumer.finish()]);
    let mut ids: Vec<u64> = seen.keys().copied().collect();
    ids.sort();
    let mut want: Vec<u64> = (0..50).map(|s| batch_id(0, s)).collect();
    want.extend((0..5).map(|s| batch_id(1, s)));
    want.sort();
    assert_eq!(ids, want);
}

/// What a check of a stale ring found: it held, or the ring was gone before the check removed
/// it, taken by another hand.
enum Stale {
    Checked,
    TakenElsewhere,
}

/// Runs `check` on a fresh ring whose creator is dead, until no launcher outside this test took
/// it first: every launcher that starts removes such rings (another test binary's, a user's on
/// the same machine), and nothing a test does can stop one; the lock only holds this binary's
/// launchers off. `check` says [`Stale::TakenElsewhere`] when it finds the ring gone where only
/// its own `--gc` could have removed it; five such runs in a row fail.
fn with_stale_ring(tag: &str, mut check: impl FnMut(&str) -> Stale) {
    let _alone = crate::support::stale_segments_exclusive();
    for _ in 0..5 {
        let stale = unique(tag);
        ring_peer(&["create", &stale, "1", "1", "2", "4096"]).finish();
        if let Stale::Checked = check(&stale) {
            return;
        }
    }
    panic!(
        "five stale rings in a row were gone before the check could see them removed: by another launcher, or by this --gc without its `removed` line"
    );
}

fn in_shm(name: &str) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(name)
}

/// A ring whose creator died is reported stale, and garbage collection removes it, never a
/// live one.
#[test]
fn a_dead_creators_ring_is_stale_and_gc_removes_only_it() {
    let live = unique("live");
    let live_ring = Ring::create(&live, &params(1, 1, 2, 4096)).unwrap();
    with_stale_ring("stale", |stale| {
        let r = match Ring::open_read_only(stale) {
            Err(RingError::NotFound { .. }) => return Stale::TakenElsewhere,
            r => r.unwrap(),
        };
        assert!(r.is_stale());
        assert!(!live_ring.is_stale());
        // shm-ring-stat says so in its verdict.
        let report = ring_stat::measure(&r, std::time::Duration::from_millis(20));
        assert!(
            report.verdict.warnings[0].starts_with("stale: creator pid"),
            "{:?}",
            report.verdict
        );
        drop(r);
        let list = shm_ring::list_segments().unwrap();
        let find = |n: &str| list.iter().find(|s| s.name == n).map(|s| s.live);
        assert_eq!(find(&live), Some(Some(true)));
        match find(stale) {
            None => return Stale::TakenElsewhere,
            found => assert_eq!(found, Some(Some(false))),
        }

        let args = ring_stat::cli::Args {
            gc: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        ring_stat::cli::run(&args, &mut out).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(in_shm(&live).exists(), "{out}");
        if !out.contains(&format!("removed {stale}")) && !in_shm(stale).exists() {
            return Stale::TakenElsewhere;
        }
        assert!(out.contains(&format!("removed {stale}")), "{out}");
        assert!(!in_shm(stale).exists());
        Stale::Checked
    });
}

/// `--gc RING` of a killed launcher's ring removes its drafter group segment too: it left
/// `RING-group` (20 MiB, more with a real model's state) in /dev/shm for good, and `--list`
/// called it "not an hspipe ring". Named, a ring it does not remove (live, or not there) is
/// said, not passed over in silence.
#[test]
fn gc_of_a_stale_ring_removes_its_drafter_group_and_says_what_it_leaves() {
    /// Removes what the test made, even when it fails.
    struct Unlink(Vec<std::path::PathBuf>);
    impl Drop for Unlink {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let live = Ring::create(&unique("live-gc"), &params(1, 1, 2, 4096)).unwrap();
    let stat = |gc: bool, list: bool, ring: &str| {
        let args = ring_stat::cli::Args {
            gc,
            list,
            ring: Some(ring.to_string()),
            ..Default::default()
        };
        let mut out = Vec::new();
        let got = ring_stat::cli::run(&args, &mut out).map_err(|e| format!("{e:#}"));
        (got, String::from_utf8(out).unwrap())
    };
    with_stale_ring("stale-group", |stale| {
        let group = proto::group_segment(stale);
        let _unlink = Unlink(vec![in_shm(stale), in_shm(&group)]);
        std::fs::write(in_shm(&group), [0u8; 4096]).unwrap();
        std::fs::set_permissions(
            in_shm(&group),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();

        let (_, out) = stat(false, true, &group);
        if !in_shm(stale).exists() {
            return Stale::TakenElsewhere;
        }
        assert!(
            out.contains(&format!("the drafter group of {stale}")),
            "{out}"
        );
        let (got, out) = stat(true, false, live.name());
        assert_eq!(got, Ok(()));
        assert!(
            out.contains("not removed") && out.contains("is live"),
            "{out}"
        );
        assert!(in_shm(live.name()).exists());

        let (got, out) = stat(true, false, stale);
        if got.is_err() && !in_shm(stale).exists() {
            return Stale::TakenElsewhere;
        }
        assert_eq!(got, Ok(()));
        assert!(out.contains(&format!("removed {group}")), "{out}");
        assert!(!in_shm(stale).exists() && !in_shm(&group).exists(), "{out}");

        let (got, _) = stat(true, false, stale);
        let err = got.unwrap_err();
        assert!(
            err.contains(stale) && err.contains("not in /dev/shm"),
            "{err}"
        );
        Stale::Checked
    });
}

/// `shm-ring-stat` with nothing to look at is a usage error: exit 2 with the usage line, as
/// every other command line mistake (README, "Exit codes"); it exited 1, as a ring's failure.
#[test]
fn shm_ring_stat_naming_nothing_is_a_usage_error() {
    let (status, err) = spawn(&workspace_bin("shm-ring-stat"), &[]).wait_status_keep();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error: name a ring (see --list) or a --run-dir") && err.contains("Usage:"),
        "{err}"
    );
}
