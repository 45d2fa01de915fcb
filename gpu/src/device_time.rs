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
//! grows (a quarter of a millisecond after an hour), and the GPU's timer drifts from the host's
//! clock (which NTP slews): tens of parts per million, a tenth of a second an hour. So a backend
//! re-anchors a stream by measurement at a point where its work is done anyway ([`reanchor_due`]:
//! a mark waited for, its host time read, at most every [`REANCHOR_MS`]; it takes its place in
//! the stream's order, after the spans before it). A stream never re-anchored so (a copy
//! stream) takes a resolved span's end as its anchor once the anchor is older than
//! [`REANCHOR_MS`]: offsets stay under about a minute (microseconds of rounding), though drift
//! then adds up.
//!
//! What the spans cannot see: gaps between the kernels inside one span (a forward whose host
//! launches kernels slower than the GPU runs them counts as busy throughout), and kernels of
//! other processes sharing the GPU.
//!
//! Length: past 500 lines with its tests: the timeline, its anchors and its CUDA helpers are
//! one clock; the tests drive it with a mark of their own.

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
    what: What<M>,
}

enum What<M> {
    /// A span of `work`.
    Span { work: Work, start: M, end: M },
    /// A new anchor: `mark` passed at host time `ns`.
    Anchor { mark: M, ns: u64 },
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
        let what = What::Span { work, start, end };
        self.pending.push_back(Pending { stream, what });
    }

    /// Makes `mark`, recorded on `stream` and passed at host time `ns` (waited for), the
    /// stream's anchor once the spans pushed before it are resolved.
    pub fn reanchor(&mut self, stream: StreamId, mark: M, ns: u64) {
        let what = What::Anchor { mark, ns };
        self.pending.push_back(Pending { stream, what });
    }

    /// The host time of `stream`'s newest anchor, taken or pushed.
    fn anchored_ns(&self, stream: StreamId) -> u64 {
        let pushed = self.pending.iter().rev().find_map(|p| match &p.what {
            What::Anchor { ns, .. } if p.stream == stream => Some(*ns),
            _ => None,
        });
        pushed.unwrap_or(self.anchors[stream.0].ns)
    }

    /// Spans not resolved yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The spans whose end has passed, resolved, in the order they were pushed (so each
    /// stream's in the order they ran); the others stay. Never blocks. On an error the spans
    /// not resolved yet stay pending (the ones this call resolved before it are dropped with
    /// it: a worker stops timing its device on one, see [`drain_or_stop`]).
    pub fn poll(&mut self) -> Result<Vec<DeviceSpan>, GpuError> {
        let mut out = Vec::new();
        let mut kept = VecDeque::with_capacity(self.pending.len());
        // A span on a stream waits behind that stream's earlier span still pending: its end
        // could become the anchor, and an anchor must precede every later span on the stream.
        let mut blocked = vec![false; self.anchors.len()];
        while let Some(p) = self.pending.pop_front() {
            let s = p.stream.0;
            let a = &self.anchors[s];
            let at = |m: &M| -> Result<(f64, u64), GpuError> {
                let ms = m.ms_after(&a.mark)?.max(0.0);
                Ok((ms, a.ns + (ms * 1e6).round() as u64))
            };
            // `None`: not passed yet. An error leaves this entry and the rest pending, in
            // order: nothing is lost.
            let resolved = match (blocked[s], &p.what) {
                (true, _) => Ok(None),
                (false, What::Anchor { mark, .. }) => mark.passed().map(|ok| ok.then_some(None)),
                (false, What::Span { start, end, .. }) => end.passed().and_then(|ok| match ok {
                    true => Ok(Some(Some((at(start)?, at(end)?)))),
                    false => Ok(None),
                }),
            };
            let times = match resolved {
                Ok(Some(times)) => times,
                Ok(None) => {
                    blocked[s] = true;
                    kept.push_back(p);
                    continue;
                }
                Err(e) => {
                    kept.push_back(p);
                    kept.append(&mut self.pending);
                    self.pending = kept;
                    return Err(e);
                }
            };
            match (p.what, times) {
                (What::Anchor { mark, ns }, _) => self.anchors[s] = Anchor { mark, ns },
                (What::Span { work, end, .. }, Some(((_, start_ns), (end_ms, end_ns)))) => {
                    let end_ns = end_ns.max(start_ns);
                    self.totals.add(work, start_ns, end_ns);
                    out.push(DeviceSpan {
                        phase: work.phase,
                        start_ns,
                        end_ns,
                        busy: work.busy,
                    });
                    if end_ms > REANCHOR_MS {
                        self.anchors[s] = Anchor {
                            mark: end,
                            ns: end_ns,
                        };
                    }
                }
                (What::Span { .. }, None) => unreachable!("a span resolves with its times"),
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

/// [`drain`] for a worker, which goes on without its device's time if the timeline fails
/// (telemetry never fails a worker, nor comes between its work and its record of it): the
/// error is logged, `stop` is called (the worker's ring record is host-timed again) and the
/// clock dropped.
pub fn drain_or_stop(
    clock: &mut Option<Arc<dyn DeviceClock>>,
    record: impl Fn(DeviceSpan),
    stop: impl FnOnce(),
) {
    if let Err(e) = drain(clock.as_deref(), record) {
        tracing::warn!(error = %e, "reading the device's timeline failed: timing the host from now");
        stop();
        *clock = None;
    }
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

/// Re-anchors stream `id` of `timeline` by measurement if its newest anchor is
/// [`REANCHOR_MS`] old: a mark recorded on `stream` and waited for, with the host's time once
/// it passed. Call it where the stream's work is done anyway (the wait is then at once), or
/// accept one wait for the work queued on it every [`REANCHOR_MS`].
pub fn reanchor_due(
    timeline: &CudaTimeline,
    id: StreamId,
    stream: &CudaStream,
) -> Result<(), GpuError> {
    let now = shm_ring::monotonic_ns();
    let since = (timeline.lock().unwrap_or_else(|e| e.into_inner())).anchored_ns(id);
    if (now.saturating_sub(since) as f64) < REANCHOR_MS * 1e6 {
        return Ok(());
    }
    let m = mark(stream)?;
    m.synchronize().named("cuEventSynchronize")?;
    let ns = shm_ring::monotonic_ns();
    (timeline.lock().unwrap_or_else(|e| e.into_inner())).reanchor(id, m, ns);
    Ok(())
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

    /// A GPU timer that runs 1% slow against the host's clock: from the first anchor alone a
    /// span 60 s on is placed 0.6 s early; a measured anchor takes its place after the spans
    /// pushed before it (resolved from the old anchor, even when they pass later), and the
    /// spans after it are placed from it; an error reading a mark loses nothing.
    #[test]
    fn a_measured_anchor_corrects_drift_in_the_streams_order() {
        let host = |device_us: u64| device_us * 1010; // ns
        let mut t = Timeline::new();
        let s = t.add_stream(Fake::passed_at(0), host(0));
        let before = (Fake::passed_at(58_000_000), Fake::default());
        t.push(s, FORWARD, before.0.clone(), before.1.clone());
        t.reanchor(s, Fake::passed_at(59_000_000), host(59_000_000));
        t.push(
            s,
            BACKWARD,
            Fake::passed_at(60_000_000),
            Fake::passed_at(60_500_000),
        );
        assert_eq!(
            t.poll().unwrap(),
            [],
            "everything waits behind the open span"
        );
        before.1.at(58_500_000);
        let got = t.poll().unwrap();
        // The span before the new anchor: from the old one (drifted, as it must be).
        assert_eq!((got[0].start_ns, got[0].end_ns), (58_000 * MS, 58_500 * MS));
        // The span after it: from the measured anchor, 1 s and 1.5 s of device time on.
        assert_eq!(
            (got[1].start_ns, got[1].end_ns),
            (host(59_000_000) + 1_000 * MS, host(59_000_000) + 1_500 * MS)
        );
        assert_eq!(t.pending(), 0);
    }

    /// A mark whose state cannot be read: the span and every one after it stay pending.
    #[test]
    fn an_error_reading_a_mark_leaves_the_spans_pending() {
        struct Broken;
        impl Mark for Broken {
            fn passed(&self) -> Result<bool, GpuError> {
                Err(GpuError::Shape("the device is gone".into()))
            }
            fn ms_after(&self, _: &Self) -> Result<f64, GpuError> {
                unreachable!("never passed")
            }
        }
        let mut t = Timeline::new();
        let s = t.add_stream(Broken, 0);
        t.push(s, FORWARD, Broken, Broken);
        t.push(s, BACKWARD, Broken, Broken);
        assert!(t.poll().is_err());
        assert_eq!(t.pending(), 2);
    }
}
