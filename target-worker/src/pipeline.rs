//! The target's batches between the forward and the commit: up to the backend's
//! [`gpu::TargetBackend::depth`] submitted, each holding its reserved slot until its results are
//! in it, then checksummed, marked done and committed, oldest first. On a GPU (depth 2) batch
//! `i` is committed after batch `i+1`'s forward was issued, so the forward runs while `i`'s
//! results are copied into its slot; on the host (depth 1) each batch is committed at once.
//!
//! The loop never waits for something while holding a finished batch that the wait could
//! depend on: before waiting for the next gathered batch, or for a free slot, it commits what it
//! holds (the prefetch thread may be waiting for that batch's item to settle; the drafters may
//! need that batch to free a slot).

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::Context;
use gpu::{DeviceClock, RawOut, TargetBackend, TargetOut};
use proto::{BatchSpec, BatchWriter};
use shm_ring::{CommitMeta, Phase, Producer, WriteSlot};

/// A batch whose forward was submitted and whose slot is not yet committed.
struct Submitted<'r> {
    slot: WriteSlot<'r>,
    spec: BatchSpec,
    item: u64,
    bucket: u32,
}

/// The batches in flight of one target; see the module.
pub struct Pipeline<'r, 'b> {
    producer: &'r Producer<'r>,
    backend: &'b mut (dyn TargetBackend + Send),
    in_flight: VecDeque<Submitted<'r>>,
    /// The device's timeline, for a backend that times its work on the device: its spans go
    /// into the ring after each commit.
    clock: Option<Arc<dyn DeviceClock>>,
}

/// What a committed batch adds to the target's report.
pub struct Committed {
    pub tokens: u64,
}

impl<'r, 'b> Pipeline<'r, 'b> {
    pub fn new(producer: &'r Producer<'r>, backend: &'b mut (dyn TargetBackend + Send)) -> Self {
        let clock = backend.device_clock();
        if clock.is_some() {
            producer.set_device_timed(true);
        }
        Pipeline {
            producer,
            backend,
            in_flight: VecDeque::new(),
            clock,
        }
    }

    /// Moves the device's resolved spans into the ring.
    fn device_spans(&mut self) {
        let p = self.producer;
        gpu::device_time::drain_or_stop(
            &mut self.clock,
            |s| p.record_device(s),
            || p.set_device_timed(false),
        );
    }

    /// The producer the batches are written by.
    pub fn producer(&self) -> &'r Producer<'r> {
        self.producer
    }

    /// Batches submitted and not yet committed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether another batch may be submitted before the oldest is committed.
    pub fn has_room(&self) -> bool {
        self.in_flight.len() < self.backend.depth().max(1)
    }

    /// Writes the batch's ids and mask into `slot`, issues its forward (whose results may still
    /// be on their way when this returns) and keeps the slot until [`Pipeline::commit_oldest`].
    pub fn submit(
        &mut self,
        mut slot: WriteSlot<'r>,
        spec: BatchSpec,
        input_ids: &[u32],
        loss_mask: &[u8],
        item: u64,
        bucket: u32,
    ) -> anyhow::Result<()> {
        debug_assert!(self.has_room());
        let mut w = BatchWriter::new(slot.payload_mut(), &spec)?;
        let sections = w.sections_mut();
        for (dst, id) in sections.input_ids.chunks_exact_mut(4).zip(input_ids) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        sections.loss_mask.copy_from_slice(loss_mask);
        // SAFETY: the slot is kept in `in_flight` until `complete` returned for this batch, and
        // nothing here touches its payload meanwhile; on any way out without that (an error, a
        // stop, a panic) `Drop` quiesces the backend before the slots go. The payload lies in
        // the ring's mapping, which outlives this pipeline (`'r`), and does not move with the
        // slot handle.
        let out = unsafe {
            RawOut::new(TargetOut {
                hidden_states: sections.hidden_states,
                target_tokens: sections.target_tokens,
            })
        };
        self.producer.enter(Phase::Compute);
        let r = self.backend.submit(input_ids, &spec.seq_lens, out);
        self.producer.enter(Phase::Other);
        r.with_context(|| format!("the target's forward of batch {item}"))?;
        self.in_flight.push_back(Submitted {
            slot,
            spec,
            item,
            bucket,
        });
        Ok(())
    }

    /// Waits for the oldest batch's results, checksums and commits it; `None` if none is in
    /// flight.
    pub fn commit_oldest(&mut self) -> anyhow::Result<Option<Committed>> {
        if self.in_flight.is_empty() {
            return Ok(None);
        }
        // Waiting for the device's forward and copy of the batch.
        self.producer.enter(Phase::Compute);
        let r = self.backend.complete();
        self.producer.enter(Phase::Other);
        r.context("the target's copy of a batch into its slot")?;
        let Submitted {
            mut slot,
            spec,
            item,
            bucket,
        } = self.in_flight.pop_front().expect("checked above");
        BatchWriter::new(slot.payload_mut(), &spec)?.finish();
        slot.complete_work(item)?;
        let tokens = spec.tokens();
        slot.commit(CommitMeta {
            bucket,
            tokens,
            batch_id: item,
        })?;
        self.device_spans();
        Ok(Some(Committed { tokens }))
    }
}

impl Drop for Pipeline<'_, '_> {
    fn drop(&mut self) {
        // No copy may write a slot once it is given back (the slots drop after this body).
        if !self.in_flight.is_empty() {
            self.backend.quiesce();
        }
        self.device_spans();
        if let Some(c) = &self.clock {
            tracing::info!(device = %c.totals(), "the device's time");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use std::sync::mpsc;
    use std::time::Duration;

    use gpu::GpuError;
    use proto::control::FinalReport;
    use proto::{BatchView, Dtype};
    use shm_ring::{Ring, RingParams, TakePolicy, WorkClaim};

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
            self.log.lock().unwrap().push(Event::Submit(n));
            self.submitted.push_back((n, out));
            Ok(())
        }

        fn complete(&mut self) -> Result<(), GpuError> {
            let (n, mut out) = self.submitted.pop_front().expect("a batch in flight");
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
        feed(&producer, &mut backend, items);
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

    /// Submits `items` batches through a pipeline over `backend` as the worker does (submit,
    /// then commit while full, then drain).
    fn feed(producer: &Producer<'_>, backend: &mut Late, items: u64) {
        let mut pipe = Pipeline::new(producer, backend);
        for _ in 0..items {
            let item = producer.claim_work().unwrap();
            let spec = spec(item);
            let slot = producer
                .reserve(proto::batch_len(&spec).unwrap() as usize)
                .unwrap();
            let ids = [item as u32; 3];
            pipe.submit(slot, spec, &ids, &[1; 3], item, 0).unwrap();
            while !pipe.has_room() {
                pipe.commit_oldest().unwrap();
            }
        }
        while pipe.commit_oldest().unwrap().is_some() {}
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
        feed(&producer, &mut backend, 3);
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
        feed(&producer, &mut Late::new(1).0, 1);
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
                let (tx, rx) = mpsc::sync_channel::<Gathered>(1);
                let mut report = FinalReport::default();
                std::thread::scope(|scope| {
                    let p = &producer;
                    scope.spawn(move || loop {
                        match p.claim_work_timeout(Duration::from_millis(20)) {
                            WorkClaim::Item(item) => {
                                let g = Gathered {
                                    item,
                                    spec: spec(item),
                                    input_ids: vec![item as u32; 3],
                                    loss_mask: vec![1; 3],
                                    bucket: 0,
                                };
                                if tx.send(g).is_err() {
                                    break;
                                }
                            }
                            WorkClaim::Pending => continue,
                            WorkClaim::Settled => break,
                        }
                    });
                    let mut pipe = Pipeline::new(&producer, &mut backend);
                    let stopped = crate::produce(&rx, &mut pipe, &|| false, &mut report).unwrap();
                    assert!(!stopped);
                });
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
            pipe.submit(slot, spec(item), &[0; 3], &[1; 3], item, 0)
                .unwrap();
        }
        assert_eq!(*log.lock().unwrap(), [Event::Submit(0), Event::Quiesce]);
        let consumer = ring.consumer(0).unwrap();
        let nothing = consumer.take_timeout(std::time::Duration::ZERO).unwrap();
        assert!(
            matches!(nothing, shm_ring::Take::TimedOut),
            "nothing was published"
        );
    }
}
