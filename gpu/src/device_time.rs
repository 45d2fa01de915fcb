//! A backend's device work timed by the device itself: each stretch of work on a stream (a
//! forward, a backward, a copy) is bracketed by two timing events recorded on that stream, and
//! read once its end event has passed, asked without blocking (`cuEventQuery`), so timing never
//! stalls a stream or the host. The worker moves the resolved spans into the ring
//! ([`shm_ring::Producer::record_device`]), where they become the worker's busy share, its idle
//! gaps and what its host was doing in them (`shm-ring`'s `device.rs`).
//!
//! Clocks: an event's time is known only relative to another event (`cuEventElapsedTime`, in
//! milliseconds as an `f32`). Each stream has an *anchor*: an event on it whose time on the
//! host's `CLOCK_MONOTONIC` is known (the first one waited for once, when the stream is added).
//! A span's times are its events' offsets from its stream's anchor, so both are later on the
//! same stream and the offsets positive. An `f32` of milliseconds loses precision as the offset
//! grows (a quarter of a millisecond after an hour), so once the anchor is older than
//! [`REANCHOR_MS`] a resolved span's end becomes the stream's anchor: offsets stay under about a
//! minute (microseconds of rounding), and rounding adds up only once per re-anchoring.
//!
//! What the spans cannot see: gaps between the kernels inside one span (a forward whose host
//! launches kernels slower than the GPU runs them counts as busy throughout), and kernels of
//! other processes sharing the GPU.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};

use cuda::{CudaEvent, CudaStream, Named};
use shm_ring::{DeviceSpan, Phase};

use crate::GpuError;

/// A stream's anchor is replaced once it is this old (milliseconds of device time).
pub const REANCHOR_MS: f64 = 30_000.0;

/// An event recorded on a stream: CUDA's, or a test's.
pub trait Mark: Send {
    /// Whether the stream has passed it. Never blocks.
    fn passed(&self) -> Result<bool, GpuError>;
    /// Milliseconds from `earlier` to this mark, both passed and on one stream.
    fn ms_after(&self, earlier: &Self) -> Result<f64, GpuError>;
}

impl Mark for CudaEvent {
    fn passed(&self) -> Result<bool, GpuError> {
        Ok(self.try_is_complete().named("cuEventQuery")?)
    }
    fn ms_after(&self, earlier: &Self) -> Result<f64, GpuError> {
        Ok(f64::from(
            earlier.elapsed_ms(self).named("cuEventElapsedTime")?,
        ))
    }
}

/// A timing event recorded on `stream` now (cudarc's default events do not time).
pub fn mark(stream: &CudaStream) -> Result<CudaEvent, GpuError> {
    let flags = cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    Ok(stream.record_event(Some(flags)).named("cuEventRecord")?)
}

impl Timeline<CudaEvent> {
    /// Adds CUDA stream `stream`, anchored by a timing event recorded on it and waited for, at
    /// the host's time once it had passed (later than the event by the wait's wake-up:
    /// microseconds). Waits for the work queued on it so far: call it before work starts.
    pub fn add_cuda(&mut self, stream: &CudaStream) -> Result<StreamId, GpuError> {
        let m = mark(stream)?;
        m.synchronize().named("cuEventSynchronize")?;
        Ok(self.add_stream(m, shm_ring::monotonic_ns()))
    }
}

/// What a span of device work was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    /// Its name in the worker's log ("forward", "host-to-device").
    pub name: &'static str,
    /// Its phase in the ring.
    pub phase: Phase,
    /// Work of the compute stream (see [`DeviceSpan::busy`]).
    pub busy: bool,
}

pub const FORWARD: Work = Work {
    name: "forward",
    phase: Phase::Compute,
    busy: true,
};
pub const BACKWARD: Work = Work {
    name: "backward",
    phase: Phase::Compute,
    busy: true,
};
pub const HOST_TO_DEVICE: Work = Work {
    name: "host-to-device",
    phase: Phase::CopyIn,
    busy: false,
};
pub const DEVICE_TO_HOST: Work = Work {
    name: "device-to-host",
    phase: Phase::CopyIn,
    busy: false,
};

/// A stream of a [`Timeline`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamId(usize);

struct Anchor<M> {
    mark: M,
    ns: u64,
}

struct Pending<M> {
    stream: StreamId,
    work: Work,
    start: M,
    end: M,
}

/// The spans recorded on a backend's streams, waiting for their events to pass.
pub struct Timeline<M> {
    anchors: Vec<Anchor<M>>,
    pending: VecDeque<Pending<M>>,
    totals: Totals,
}

/// What a timeline resolved so far: the worker logs it when it ends.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    /// Seconds of device time by [`Work::name`], in the order first seen.
    pub by_work: Vec<(&'static str, f64)>,
    /// Busy spans: the first start and the last end (host ns), busy seconds, the longest gap.
    first_ns: Option<u64>,
    last_ns: u64,
    busy_ns: u64,
    largest_gap_ns: u64,
}

impl Totals {
    fn add(&mut self, work: Work, start_ns: u64, end_ns: u64) {
        let secs = end_ns.saturating_sub(start_ns) as f64 / 1e9;
        match self.by_work.iter_mut().find(|(n, _)| *n == work.name) {
            Some((_, s)) => *s += secs,
            None => self.by_work.push((work.name, secs)),
        }
        if !work.busy {
            return;
        }
        if self.first_ns.is_none() {
            self.first_ns = Some(start_ns);
        } else if start_ns > self.last_ns {
            self.largest_gap_ns = self.largest_gap_ns.max(start_ns - self.last_ns);
        }
        self.busy_ns += end_ns.saturating_sub(start_ns.max(self.last_ns));
        self.last_ns = self.last_ns.max(end_ns);
    }

    /// Busy time over the time from the first busy span's start to the last one's end.
    pub fn busy_share(&self) -> Option<f64> {
        let wall = self.last_ns.saturating_sub(self.first_ns?);
        (wall > 0).then(|| self.busy_ns as f64 / wall as f64)
    }

    /// The longest stretch between two busy spans, in seconds.
    pub fn largest_gap_s(&self) -> f64 {
        self.largest_gap_ns as f64 / 1e9
    }
}

impl fmt::Display for Totals {
    /// "forward 12.1s, device-to-host 0.8s; busy 93.0%, largest gap 41.2ms".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = (self.by_work.iter())
            .map(|(n, s)| format!("{n} {s:.3}s"))
            .collect();
        write!(f, "{}", parts.join(", "))?;
        if let Some(b) = self.busy_share() {
            write!(
                f,
                "; busy {:.1}%, largest gap {:.1}ms",
                b * 100.0,
                self.largest_gap_s() * 1e3
            )?;
        }
        Ok(())
    }
}

impl<M: Mark> Default for Timeline<M> {
    fn default() -> Self {
        Timeline {
            anchors: Vec::new(),
            pending: VecDeque::new(),
            totals: Totals::default(),
        }
    }
}

impl<M: Mark> Timeline<M> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a stream, with a mark on it that has passed and the host's time (CLOCK_MONOTONIC
    /// ns) when it did.
    pub fn add_stream(&mut self, anchor: M, anchor_ns: u64) -> StreamId {
        self.anchors.push(Anchor {
            mark: anchor,
            ns: anchor_ns,
        });
        StreamId(self.anchors.len() - 1)
    }

    /// Adds a span of `work` on `stream` between marks `start` and `end` recorded on it.
    pub fn push(&mut self, stream: StreamId, work: Work, start: M, end: M) {
        self.pending.push_back(Pending {
            stream,
            work,
            start,
            end,
        });
    }

    /// Spans not resolved yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The spans whose end has passed, resolved, in the order they were pushed (so each
    /// stream's in the order they ran); the others stay. Never blocks.
    pub fn poll(&mut self) -> Result<Vec<DeviceSpan>, GpuError> {
        let mut out = Vec::new();
        let mut kept = VecDeque::with_capacity(self.pending.len());
        // A span on a stream waits behind that stream's earlier span still pending: its end
        // could become the anchor, and an anchor must precede every later span on the stream.
        let mut blocked = vec![false; self.anchors.len()];
        while let Some(p) = self.pending.pop_front() {
            let s = p.stream.0;
            if blocked[s] || !p.end.passed()? {
                blocked[s] = true;
                kept.push_back(p);
                continue;
            }
            let a = &self.anchors[s];
            let at = |m: &M| -> Result<(f64, u64), GpuError> {
                let ms = m.ms_after(&a.mark)?.max(0.0);
                Ok((ms, a.ns + (ms * 1e6).round() as u64))
            };
            let (_, start_ns) = at(&p.start)?;
            let (end_ms, end_ns) = at(&p.end)?;
            let end_ns = end_ns.max(start_ns);
            self.totals.add(p.work, start_ns, end_ns);
            out.push(DeviceSpan {
                phase: p.work.phase,
                start_ns,
                end_ns,
                busy: p.work.busy,
            });
            if end_ms > REANCHOR_MS {
                self.anchors[s] = Anchor {
                    mark: p.end,
                    ns: end_ns,
                };
            }
        }
        self.pending = kept;
        Ok(out)
    }

    pub fn totals(&self) -> &Totals {
        &self.totals
    }
}

/// A backend's timeline as the worker sees it: shared with the threads that record on it (the
/// drafter's copy thread stages batches on its own stream).
pub trait DeviceClock: Send + Sync {
    /// [`Timeline::poll`].
    fn poll(&self) -> Result<Vec<DeviceSpan>, GpuError>;
    /// What was resolved so far.
    fn totals(&self) -> Totals;
}

impl<M: Mark> DeviceClock for Mutex<Timeline<M>> {
    fn poll(&self) -> Result<Vec<DeviceSpan>, GpuError> {
        self.lock().unwrap_or_else(|e| e.into_inner()).poll()
    }
    fn totals(&self) -> Totals {
        (self.lock().unwrap_or_else(|e| e.into_inner()).totals()).clone()
    }
}

/// Moves `clock`'s resolved spans to `record` (a ring worker's `record_device`); nothing for a
/// backend without one.
pub fn drain(clock: Option<&dyn DeviceClock>, record: impl Fn(DeviceSpan)) -> Result<(), GpuError> {
    if let Some(c) = clock {
        c.poll()?.into_iter().for_each(record);
    }
    Ok(())
}

/// A CUDA backend's timeline, shared.
pub type CudaTimeline = Arc<Mutex<Timeline<CudaEvent>>>;

/// Brackets the work `f` queues on `stream` with two marks, pushed as a span of `work` on
/// `id` of `timeline`. A failure to record the marks is the device's: returned as any other.
pub fn timed<T>(
    timeline: &CudaTimeline,
    id: StreamId,
    stream: &CudaStream,
    work: Work,
    f: impl FnOnce() -> Result<T, GpuError>,
) -> Result<T, GpuError> {
    let start = mark(stream)?;
    let out = f()?;
    let end = mark(stream)?;
    (timeline.lock().unwrap_or_else(|e| e.into_inner())).push(id, work, start, end);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A test's mark: passed once the test sets its device time (microseconds + 1; 0 unset).
    #[derive(Clone, Default)]
    struct Fake(Arc<AtomicU64>);

    impl Fake {
        fn at(&self, us: u64) {
            self.0.store(us + 1, Ordering::Relaxed)
        }
        fn passed_at(us: u64) -> Fake {
            let f = Fake::default();
            f.at(us);
            f
        }
    }

    impl Mark for Fake {
        fn passed(&self) -> Result<bool, GpuError> {
            Ok(self.0.load(Ordering::Relaxed) != 0)
        }
        fn ms_after(&self, earlier: &Self) -> Result<f64, GpuError> {
            let (a, b) = (
                earlier.0.load(Ordering::Relaxed),
                self.0.load(Ordering::Relaxed),
            );
            assert!(a != 0 && b != 0, "elapsed time of a mark not passed");
            Ok((b as f64 - a as f64) / 1e3)
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn a_span_is_resolved_once_its_end_has_passed_on_the_hosts_clock() {
        let mut t = Timeline::new();
        // The stream's anchor passed at device time 0, host time 5 s.
        let s = t.add_stream(Fake::passed_at(0), 5_000 * MS);
        let (start, end) = (Fake::default(), Fake::default());
        t.push(s, FORWARD, start.clone(), end.clone());
        assert_eq!(t.poll().unwrap(), [], "nothing has run yet");
        start.at(2_000);
        assert_eq!(
            t.poll().unwrap(),
            [],
            "started, not ended: asked, not waited for"
        );
        end.at(9_500);
        let got = t.poll().unwrap();
        let want = DeviceSpan {
            phase: Phase::Compute,
            start_ns: 5_002 * MS,
            end_ns: 5_009 * MS + MS / 2,
            busy: true,
        };
        assert_eq!(got, [want]);
        assert_eq!(
            (t.pending(), t.poll().unwrap()),
            (0, vec![]),
            "resolved once"
        );
    }

    #[test]
    fn each_stream_keeps_its_order_and_its_own_anchor() {
        let mut t = Timeline::new();
        let compute = t.add_stream(Fake::passed_at(0), 1_000 * MS);
        // The copy stream's anchor passed at device time 100 ms, host time 2 s.
        let copy = t.add_stream(Fake::passed_at(100_000), 2_000 * MS);
        let (f1, f2) = (Fake::default(), Fake::default());
        t.push(compute, FORWARD, Fake::passed_at(0), f1.clone());
        t.push(copy, DEVICE_TO_HOST, Fake::passed_at(110_000), f2.clone());
        t.push(
            compute,
            BACKWARD,
            Fake::passed_at(10_000),
            Fake::passed_at(30_000),
        );
        // The copy ended, the first forward did not: the copy resolves; the backward (later on
        // the compute stream, its marks passed) waits behind the forward.
        f2.at(120_000);
        let got = t.poll().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].phase, got[0].start_ns, got[0].end_ns, got[0].busy),
            (Phase::CopyIn, 2_010 * MS, 2_020 * MS, false)
        );
        f1.at(10_000);
        let got = t.poll().unwrap();
        let times: Vec<(u64, u64)> = got.iter().map(|s| (s.start_ns, s.end_ns)).collect();
        assert_eq!(times, [(1_000 * MS, 1_010 * MS), (1_010 * MS, 1_030 * MS)]);
        let totals = t.totals();
        assert_eq!(totals.busy_share(), Some(1.0));
        assert_eq!(
            totals.by_work,
            [
                ("device-to-host", 0.01),
                ("forward", 0.01),
                ("backward", 0.02)
            ]
        );
    }

    #[test]
    fn an_old_anchor_is_replaced_by_a_resolved_span_and_times_stay_exact() {
        let mut t = Timeline::new();
        let s = t.add_stream(Fake::passed_at(0), 0);
        // A span ending 40 s after the anchor: its end becomes the anchor.
        let end = Fake::passed_at(40_000_000);
        t.push(s, FORWARD, Fake::passed_at(39_000_000), end);
        t.poll().unwrap();
        // Later spans are placed from the new anchor, whose host time was derived: the same.
        t.push(
            s,
            BACKWARD,
            Fake::passed_at(41_000_000),
            Fake::passed_at(41_500_000),
        );
        let got = t.poll().unwrap();
        assert_eq!((got[0].start_ns, got[0].end_ns), (41_000 * MS, 41_500 * MS));
        // Busy 1.5 s of the 2.5 s from the first start; the gap 40 s .. 41 s.
        assert_eq!(t.totals().busy_share(), Some(1.5 / 2.5));
        assert_eq!(t.totals().largest_gap_s(), 1.0);
        assert!(
            t.totals()
                .to_string()
                .ends_with("; busy 60.0%, largest gap 1000.0ms"),
            "{}",
            t.totals()
        );
    }
}
