//! The pipeline's tests: a backend whose results land only at `complete` (as a copy stream's
//! would), driven as the worker drives it.
//!
//! Length: over 500 lines, one test per rule of the pipeline and its loop (overlap, the batch
//! in hand, batches run alone, the prefetch thread's end and heartbeat), each a short replay
//! over the one test backend at the top.
use std::sync::{mpsc, Arc, Mutex};

use std::time::Duration;

use gpu::GpuError;
use proto::control::FinalReport;
use proto::{BatchView, Dtype};
use shm_ring::{Ring, RingParams, TakePolicy};

use super::*;
use crate::Gathered;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Event {
    Submit(u8),
    Complete(u8),
    Quiesce,
}

/// A backend of depth `depth` whose results land in the slot only when `complete` is
/// called, as a copy stream's would: the batch's number in every hidden-state byte and
/// token. Logs every call.
struct Late {
    depth: usize,
    log: Arc<Mutex<Vec<Event>>>,
    submitted: VecDeque<(u8, RawOut)>,
    /// A device's timeline, if the backend times its device: batch `n`'s forward resolves
    /// at its completion as busy from `n x 10 ms` to 4 ms later (after the clock's start).
    clock: Option<(Arc<Spans>, u64)>,
    /// Fails issuing batch `n`'s forward (as an out-of-memory at its own allocation).
    fail_submit: Option<u8>,
    /// Fails waiting for batch `n` (as a device reports a kernel's fault late).
    fail_complete: Option<u8>,
    /// Panics issuing batch `n` (as a bug in a backend would).
    panic_submit: Option<u8>,
    /// Hangs issuing batch `n`: says so on the first channel, then waits on the second.
    hang_submit: Option<(u8, mpsc::Sender<()>, mpsc::Receiver<()>)>,
}

/// A device timeline the test writes: what `poll` returns next.
#[derive(Default)]
struct Spans(Mutex<Vec<shm_ring::DeviceSpan>>);

impl DeviceClock for Spans {
    fn poll(&self) -> Result<Vec<shm_ring::DeviceSpan>, GpuError> {
        Ok(std::mem::take(&mut *self.0.lock().unwrap()))
    }
    fn totals(&self) -> gpu::device_time::Totals {
        Default::default()
    }
}

impl Late {
    /// A backend of `depth`, and its log.
    fn new(depth: usize) -> (Late, Arc<Mutex<Vec<Event>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let late = Late {
            depth,
            log: log.clone(),
            submitted: VecDeque::new(),
            clock: None,
            fail_submit: None,
            fail_complete: None,
            panic_submit: None,
            hang_submit: None,
        };
        (late, log)
    }
}

impl TargetBackend for Late {
    fn forward(&mut self, _: &[u32], _: &[u32], _: TargetOut<'_>) -> Result<(), GpuError> {
        unreachable!("the pipeline submits")
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, ids: &[u32], _: &[u32], out: RawOut) -> Result<(), GpuError> {
        let n = ids[0] as u8;
        assert_ne!(
            self.panic_submit,
            Some(n),
            "injected: a panic issuing batch {n}"
        );
        if let Some((_, hanging, go_on)) = self.hang_submit.as_ref().filter(|h| h.0 == n) {
            hanging.send(()).unwrap();
            go_on.recv().unwrap();
        }
        if self.fail_submit == Some(n) {
            return Err(GpuError::Shape(format!(
                "injected: no memory for batch {n}"
            )));
        }
        self.log.lock().unwrap().push(Event::Submit(n));
        self.submitted.push_back((n, out));
        Ok(())
    }

    fn complete(&mut self) -> Result<(), GpuError> {
        let n = self.submitted.front().expect("a batch in flight").0;
        if self.fail_complete == Some(n) {
            return Err(GpuError::Shape(format!(
                "injected: a fault waiting for batch {n}"
            )));
        }
        let (n, mut out) = self.submitted.pop_front().expect("checked above");
        // SAFETY: the batch completes only now, and this backend queues no copy into it.
        let o = unsafe { out.get() };
        o.hidden_states.fill(n);
        o.target_tokens.fill(n);
        self.log.lock().unwrap().push(Event::Complete(n));
        if let Some((spans, t0)) = &self.clock {
            let start_ns = t0 + u64::from(n) * 10_000_000;
            spans.0.lock().unwrap().push(shm_ring::DeviceSpan {
                phase: Phase::Compute,
                start_ns,
                end_ns: start_ns + 4_000_000,
                busy: true,
            });
        }
        Ok(())
    }

    fn quiesce(&mut self) {
        self.submitted.clear();
        self.log.lock().unwrap().push(Event::Quiesce);
    }

    fn device_clock(&self) -> Option<Arc<dyn DeviceClock>> {
        let c: Arc<dyn DeviceClock> = self.clock.as_ref()?.0.clone();
        Some(c)
    }
}

fn ring(items: u64) -> Ring {
    Ring::create(
        &testkit::unique("pipeline"),
        &RingParams {
            slots: 4,
            slot_size: 4096,
            buckets: 1,
            producers: 1,
            consumers: 1,
            held_per_consumer: 1,
            policy: TakePolicy::Fifo,
            seed: 1,
            work_items: items,
        },
    )
    .unwrap()
}

fn spec(n: u64) -> BatchSpec {
    BatchSpec {
        batch_id: n,
        producer: 0,
        sample_ids: vec![n],
        seq_lens: vec![3],
        dtype: Dtype::Bf16,
        layers: 1,
        hidden: 8,
    }
}

/// Runs `items` batches through a pipeline over a backend of `depth` as the worker does
/// (submit, then commit while full, then drain); returns the backend's log and the batches
/// as a drafter takes them.
fn run(depth: usize, items: u64) -> (Vec<Event>, Vec<(u64, u8)>) {
    let ring = ring(items);
    let producer = ring.producer(0).unwrap();
    let (mut backend, log) = Late::new(depth);
    feed(&producer, &mut backend);
    assert!(producer.finish(), "the last producer closes the ring");
    let consumer = ring.consumer(0).unwrap();
    let mut got = Vec::new();
    while let Some(r) = consumer.take().unwrap() {
        let v = BatchView::parse(r.payload()).unwrap();
        v.verify().expect("checksummed after the results landed");
        got.push((v.header().spec.batch_id, v.hidden_states()[0]));
        r.release().unwrap();
    }
    let log = log.lock().unwrap().clone();
    (log, got)
}

/// Submits every batch of the ring through a pipeline over `backend` as the worker does
/// (submit, then commit while full, then drain).
fn feed(producer: &Producer<'_>, backend: &mut Late) {
    let mut pipe = Pipeline::new(producer, backend);
    drive(producer, &mut pipe, None).unwrap();
    while pipe.commit_oldest().unwrap() {}
}

/// Claims and submits every item left as the worker does, committing while the pipeline is
/// full, item `alone` run alone; leaves the last batches in flight.
fn drive<'r>(
    producer: &'r Producer<'r>,
    pipe: &mut Pipeline<'r, '_>,
    alone: Option<u64>,
) -> anyhow::Result<()> {
    while let Some(item) = producer.claim_work() {
        let slot = producer.reserve(proto::batch_len(&spec(item))? as usize)?;
        let alone = alone == Some(item);
        pipe.submit(
            slot,
            Gathered {
                alone,
                ..gathered(item)
            },
        )?;
        while !pipe.has_room() {
            pipe.commit_oldest()?;
        }
    }
    Ok(())
}

/// A backend that times its device: the pipeline says so to the ring, and moves the spans
/// the device resolved into it as batches commit, so the worker's busy time and idle gaps
/// are the device's.
#[test]
fn a_device_timed_backends_spans_reach_the_ring() {
    let timed = ring(3);
    let producer = timed.producer(0).unwrap();
    let (mut backend, _) = Late::new(2);
    backend.clock = Some((Arc::default(), shm_ring::monotonic_ns()));
    feed(&producer, &mut backend);
    let s = timed.snapshot();
    let w = s.worker(shm_ring::WorkerName::producer(0)).unwrap();
    let d = w.device.as_ref().expect("the worker is device-timed");
    assert_eq!((d.busy_ns, w.busy_ns()), (12_000_000, 12_000_000));
    // Between the three forwards, two idle gaps of 6 ms (kept in microseconds).
    assert_eq!(d.idle_ns.values().sum::<u64>(), 12_000_000);
    let longest = w.idle_gaps.iter().map(|g| g.1).max();
    assert_eq!(longest, Some(6_000_000));
    // A host-timed backend is not.
    let host = ring(1);
    let producer = host.producer(0).unwrap();
    feed(&producer, &mut Late::new(1).0);
    assert!(host.snapshot().workers[0].device.is_none());
}

/// On a GPU's depth of two, batch i+1's forward is issued before batch i is waited for and
/// committed (by the order of the calls, not by time); every batch is committed once, in
/// order, checksummed with the results that landed at its completion.
#[test]
fn the_next_forward_is_issued_before_a_batch_is_committed() {
    use Event::*;
    let (log, got) = run(2, 3);
    assert_eq!(
        log,
        [
            Submit(0),
            Submit(1),
            Complete(0),
            Submit(2),
            Complete(1),
            Complete(2)
        ]
    );
    assert_eq!(got, [(0, 0), (1, 1), (2, 2)]);
    // On the host's depth of one, each batch is committed before the next forward.
    let (log, got) = run(1, 2);
    assert_eq!(log, [Submit(0), Complete(0), Submit(1), Complete(1)]);
    assert_eq!(got, [(0, 0), (1, 1)]);
}

/// The worker's loop at a GPU's depth of two, with the prefetch thread's claim loop: at the
/// end of the data that thread waits for the last batch's item to settle while the loop
/// holds that batch submitted. The loop commits it before waiting for another gathered
/// batch; waiting first (the old loop's order) hangs both, which the watchdog catches.
#[test]
fn the_loop_commits_a_held_batch_before_waiting_for_the_next() {
    let got = testkit::watchdog(
        "the target's loop at depth 2",
        Duration::from_secs(60),
        || {
            let items = 3;
            let ring = ring(items);
            let producer = ring.producer(0).unwrap();
            let (mut backend, log) = Late::new(2);
            let mut report = FinalReport::default();
            let mut pipe = Pipeline::new(&producer, &mut backend);
            let stopped = crate::prefetching(&mut pipe, &gathered, &|| false, &mut report);
            assert!(!stopped.unwrap());
            drop(pipe);
            let log = log.lock().unwrap().clone();
            (report.items, log)
        },
    );
    assert_eq!(got.0, 3, "every batch committed");
    assert!(got.1.contains(&Event::Complete(2)));
}

/// A pipeline dropped with a batch in flight (an error, a stop) quiesces the backend before
/// the slot is given back, so no copy writes a slot another batch may get; the batch is
/// never published.
#[test]
fn a_pipeline_dropped_in_flight_quiesces_before_its_slots_go() {
    let ring = ring(1);
    let producer = ring.producer(0).unwrap();
    let (mut backend, log) = Late::new(2);
    {
        let mut pipe = Pipeline::new(&producer, &mut backend);
        let item = producer.claim_work().unwrap();
        let slot = producer
            .reserve(proto::batch_len(&spec(item)).unwrap() as usize)
            .unwrap();
        pipe.submit(slot, gathered(item)).unwrap();
    }
    assert_eq!(*log.lock().unwrap(), [Event::Submit(0), Event::Quiesce]);
    let consumer = ring.consumer(0).unwrap();
    let nothing = consumer.take_timeout(std::time::Duration::ZERO).unwrap();
    assert!(
        matches!(nothing, shm_ring::Take::TimedOut),
        "nothing was published"
    );
}

/// What the prefetch thread gathers for `item` here: three tokens of the item's number.
fn gathered(item: u64) -> Gathered {
    Gathered {
        item,
        spec: spec(item),
        input_ids: vec![item as u32; 3],
        loss_mask: vec![1; 3],
        bucket: 0,
        alone: false,
    }
}

/// The loop fails at the last batch (its forward fails) while the prefetch thread, with
/// nothing left to claim, waits for that batch's item to settle. The prefetch thread ends with
/// the loop and the error comes back. Before, the thread waited for ever (the item stayed
/// claimed by its own process), the scope never ended, and the target never exited: the run
/// hung, since a target waiting for work beats its heartbeat.
#[test]
fn the_prefetch_thread_ends_when_the_loop_fails_at_the_last_batch() {
    let err = testkit::watchdog("a failing target's loop", Duration::from_secs(60), || {
        let ring = ring(2);
        let producer = ring.producer(0).unwrap();
        let (mut backend, _) = Late::new(1);
        backend.fail_submit = Some(1);
        let mut report = FinalReport::default();
        let mut pipe = Pipeline::new(&producer, &mut backend);
        let r = crate::prefetching(&mut pipe, &gathered, &|| false, &mut report);
        format!("{:#}", r.expect_err("the forward failed"))
    });
    assert!(err.contains("forward of batch 1"), "{err}");
}

/// Runs 3 batches over a backend of `depth` that fails as `fail` says, as the worker does,
/// until the first error; returns the batch in hand it leaves said in the ring and the batches
/// published.
fn after_failing(depth: usize, fail: impl FnOnce(&mut Late)) -> (Option<u64>, Vec<u64>) {
    failing(depth, None, Default::default(), fail)
}

/// [`after_failing`], running batch `alone` alone (a batch its last target died with), with
/// `faults` injected.
fn failing(
    depth: usize,
    alone: Option<u64>,
    faults: proto::config::Faults,
    fail: impl FnOnce(&mut Late),
) -> (Option<u64>, Vec<u64>) {
    let ring = ring(3);
    let producer = ring.producer(0).unwrap();
    let (mut backend, _) = Late::new(depth);
    fail(&mut backend);
    let mut pipe = Pipeline::new(&producer, &mut backend).injecting(faults);
    drive(&producer, &mut pipe, alone).expect_err("the backend fails");
    drop(pipe);
    let in_hand = (ring.snapshot().worker(shm_ring::WorkerName::producer(0)))
        .unwrap()
        .in_hand;
    let consumer = ring.consumer(0).unwrap();
    let mut published = Vec::new();
    while let shm_ring::Take::Item(r) = consumer.take_timeout(Duration::ZERO).unwrap() {
        published.push(r.meta().batch_id);
        r.release().unwrap();
    }
    (in_hand, published)
}

/// The launcher holds a target's death against the batch it says it has in hand, so a batch
/// is said to be in hand only when an error is known to be its own. Issuing batch 1 fails
/// while batch 0 is in flight: batch 0 completes (published, not lost), so the error is batch
/// 1's own. If batch 0 fails too, the error may be its, reported late: nothing is in hand.
/// Waiting for batch 0 fails with batch 1 in flight: whose is not known; alone, it is batch 0's.
#[test]
fn a_forward_error_is_held_against_a_batch_only_when_it_is_known_to_be_its_own() {
    let (in_hand, published) = after_failing(2, |b| b.fail_submit = Some(1));
    assert_eq!((in_hand, published), (Some(1), vec![0]));
    let both = |b: &mut Late| {
        b.fail_submit = Some(1);
        b.fail_complete = Some(0);
    };
    assert_eq!(after_failing(2, both), (None, vec![]));
    assert_eq!(
        after_failing(2, |b| b.fail_complete = Some(0)),
        (None, vec![])
    );
    assert_eq!(
        after_failing(1, |b| b.fail_complete = Some(0)),
        (Some(0), vec![])
    );
    assert_eq!(
        after_failing(1, |b| b.fail_submit = Some(0)),
        (Some(0), vec![])
    );
}

/// A batch its last target died with is run alone: the batches before it are committed
/// before its forward is issued, and it is committed before the next one's (by the order of
/// the backend's calls).
#[test]
fn a_batch_run_alone_has_nothing_else_in_flight() {
    use Event::*;
    let ring = ring(4);
    let producer = ring.producer(0).unwrap();
    let (mut backend, log) = Late::new(2);
    let mut pipe = Pipeline::new(&producer, &mut backend);
    drive(&producer, &mut pipe, Some(2)).unwrap();
    while pipe.commit_oldest().unwrap() {}
    drop(pipe);
    let log = log.lock().unwrap().clone();
    let want = [
        Submit(0),
        Submit(1),
        Complete(0),
        Complete(1),
        Submit(2),
        Complete(2),
        Submit(3),
        Complete(3),
    ];
    assert_eq!(log, want);
}

/// A fault the device reports late (waiting for the batch) is held against no batch while
/// another is in flight, but against the batch when it runs alone: so a batch whose kernel
/// faults is attributed the next time, once its item came back RETURNED.
#[test]
fn a_late_fault_is_held_against_a_batch_run_alone() {
    let late = |b: &mut Late| b.fail_complete = Some(1);
    assert_eq!(failing(2, None, Default::default(), late), (None, vec![0]));
    assert_eq!(
        failing(2, Some(1), Default::default(), late),
        (Some(1), vec![0])
    );
}

/// `fault_on_sample`: the batch's forward is issued, and every call on the device fails from
/// the next one on (a kernel's fault, reported late and for good). At depth 2 the error shows
/// waiting for the batch before it, which is lost with it, and no batch is held to blame; run
/// alone, the batch is, and the one before it is published first.
#[test]
fn an_injected_kernel_fault_shows_at_the_next_call_and_is_held_against_a_batch_run_alone() {
    let faults = proto::config::Faults {
        fault_on_sample: Some(1),
        ..Default::default()
    };
    let none = |_: &mut Late| {};
    assert_eq!(failing(2, None, faults.clone(), none), (None, vec![]));
    assert_eq!(
        failing(2, Some(1), faults.clone(), none),
        (Some(1), vec![0])
    );
    // At depth 1 every batch is alone.
    assert_eq!(failing(1, None, faults, none), (Some(1), vec![0]));
}

/// A panic in the loop at the last batch (a bug in a backend) while the prefetch thread, with
/// nothing left to claim, waits for that batch's item to settle: the thread ends and the panic
/// comes back. Before, the thread was told to stop only when the loop returned, so the scope
/// waited for it for ever and the target never exited.
#[test]
fn the_prefetch_thread_ends_when_the_loop_panics_at_the_last_batch() {
    let panicked = testkit::watchdog("a panicking target's loop", Duration::from_secs(60), || {
        let ring = ring(2);
        let producer = ring.producer(0).unwrap();
        let (mut backend, _) = Late::new(1);
        backend.panic_submit = Some(1);
        let mut report = FinalReport::default();
        let mut pipe = Pipeline::new(&producer, &mut backend);
        let run = std::panic::AssertUnwindSafe(|| {
            crate::prefetching(&mut pipe, &gathered, &|| false, &mut report)
        });
        std::panic::catch_unwind(run).is_err()
    });
    assert!(panicked);
}

/// A crash or a hang issuing a batch while an older one is in flight may be the older one's
/// (its kernel's fault, reported late): no batch is said to be in hand. Alone on the device,
/// the batch is. (Before, the newer batch was in hand: the innocent one was struck.)
#[test]
fn a_crash_issuing_a_batch_is_held_against_it_only_when_it_is_alone_on_the_device() {
    let in_hand_at_panic = |depth: usize, panic_on: u8| {
        let ring = ring(3);
        let producer = ring.producer(0).unwrap();
        let (mut backend, _) = Late::new(depth);
        backend.panic_submit = Some(panic_on);
        let mut pipe = Pipeline::new(&producer, &mut backend);
        let run = std::panic::AssertUnwindSafe(|| drive(&producer, &mut pipe, None));
        assert!(std::panic::catch_unwind(run).is_err());
        drop(pipe);
        let snap = ring.snapshot();
        snap.worker(shm_ring::WorkerName::producer(0))
            .unwrap()
            .in_hand
    };
    assert_eq!(in_hand_at_panic(2, 1), None, "batch 0 in flight");
    assert_eq!(in_hand_at_panic(2, 0), Some(0));
    assert_eq!(in_hand_at_panic(1, 1), Some(1));
}

/// A forward that hangs while the prefetch thread waits for held items (the last batches of
/// the run): nothing beats the worker's heartbeat, so the launcher sees the hang and kills the
/// target. Before, the prefetch thread's waits beat it every 200 ms: the hung target looked
/// alive for ever and the run never ended. (The check is a lower bound: with no beat the
/// heartbeat's age is at least the time waited.)
#[test]
fn a_forward_hung_while_the_prefetch_thread_waits_lets_the_heartbeat_age() {
    let waited = Duration::from_millis(600);
    let age = testkit::watchdog("a hung forward", Duration::from_secs(60), move || {
        let ring = ring(2);
        let producer = ring.producer(0).unwrap();
        let (mut backend, _) = Late::new(1);
        let ((hanging, hung), (go_on, wait)) = (mpsc::channel(), mpsc::channel());
        backend.hang_submit = Some((1, hanging, wait));
        std::thread::scope(|scope| {
            let mut pipe = Pipeline::new(&producer, &mut backend);
            scope.spawn(move || {
                let mut report = FinalReport::default();
                crate::prefetching(&mut pipe, &gathered, &|| false, &mut report).unwrap()
            });
            hung.recv().unwrap();
            std::thread::sleep(waited);
            let snap = ring.snapshot();
            let w = snap.worker(shm_ring::WorkerName::producer(0)).unwrap();
            let age = w.heartbeat_age_ns.unwrap();
            go_on.send(()).unwrap();
            age
        })
    });
    assert!(
        age >= waited.as_nanos() as u64,
        "the heartbeat was beaten {} ms ago, during the hung forward",
        age / 1_000_000
    );
}

/// The report counts every batch committed, also those a drain commits before a batch run
/// alone. The loop gets batches 2 and 0, then 1 to run alone (its last target died with it):
/// at depth 2 it commits 2, drains 0, then runs 1. Before, a drain's commits were not
/// counted: the report said 2 of 3.
#[test]
fn the_report_counts_the_batches_a_drain_commits() {
    let ring = ring(3);
    let producer = ring.producer(0).unwrap();
    let (tx, rx) = mpsc::channel();
    assert_eq!(
        [
            producer.claim_work(),
            producer.claim_work(),
            producer.claim_work()
        ],
        [Some(0), Some(1), Some(2)]
    );
    for item in [2, 0, 1] {
        tx.send(Gathered {
            alone: item == 1,
            ..gathered(item)
        })
        .unwrap();
    }
    drop(tx);
    let (mut backend, log) = Late::new(2);
    let mut report = FinalReport::default();
    let mut pipe = Pipeline::new(&producer, &mut backend);
    assert!(!crate::produce(&rx, &mut pipe, &|| false, &mut report).unwrap());
    drop(pipe);
    use Event::*;
    let log = log.lock().unwrap().clone();
    let want = [
        Submit(2),
        Submit(0),
        Complete(2),
        Complete(0),
        Submit(1),
        Complete(1),
    ];
    assert_eq!(log, want);
    assert_eq!(report.items, 3);
}
