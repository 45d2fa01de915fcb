//! A worker's device as its own timeline tells it (CUDA events on its streams), beside the
//! host's phase clock: what the device did by phase, how long it computed, and, for each stretch
//! it sat idle between two computations, what the worker's host thread was doing meanwhile (from
//! the worker's last phase switches, which `enter` logs). That last figure is the answer to "why
//! is the GPU idle": "24% of the time idle while the group all-reduces, 7% while copying".
//!
//! The host's clock cannot say it: on a GPU the host queues work and moves on, so its `compute`
//! phase is the time spent queueing, and a gap between two of its `compute` phases may be
//! filled by work still running on the device (or the reverse). A worker that times its device
//! says so once ([`crate::Producer::set_device_timed`]); from then on its idle gaps are the
//! device's, and `enter` stops opening and closing them.

use serde::{Deserialize, Serialize};

use crate::core::RingRef;
use crate::layout::{peek, peek32, WorkerRecord, PHASES, PHASE_LOG};
use crate::phase::{Phase, PhaseMap};
use crate::sync::{tally, Ordering};

/// One stretch of a worker's device work, resolved from its two events, on the host's
/// `CLOCK_MONOTONIC` (nanoseconds), so it lines up with the phase switches and the gaps of every
/// other worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpan {
    /// What the device did: `compute` (forward, backward), `copy_in` (host to device or device
    /// to host), `sync` (a collective on the device).
    pub phase: Phase,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Work of the compute stream: counts toward the busy share, and the stretches between two
    /// such spans are the device's idle gaps. Spans on one stream arrive in the order they ran.
    pub busy: bool,
}

/// What a device-timed worker's device did, cumulative over its incarnations (as `phase_ns`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceTimes {
    /// Device time by phase (spans on any stream; copies overlap compute).
    pub phase_ns: PhaseMap<u64>,
    /// Time the compute stream was running work.
    pub busy_ns: u64,
    /// Time the compute stream sat idle between two busy spans, split by the phase the worker's
    /// host thread was in meanwhile (the time its phase log no longer covers counts as `other`).
    pub idle_ns: PhaseMap<u64>,
}

// A log entry keeps `phase + 1` in its low four bits (0 is a stopped clock).
const _: () = assert!(PHASES < 16, "a phase log entry has four bits for the phase");

/// Appends a phase switch to worker `w`'s log (only the worker itself switches its clock).
#[cfg(not(loom))]
pub(crate) fn log_switch(w: &WorkerRecord, now: u64, phase: Option<Phase>) {
    let n = w.phase_log_next.load(Ordering::Relaxed);
    let code = phase.map_or(0, |p| p as u64 + 1);
    w.phase_log.0[n as usize % PHASE_LOG].store(now << 4 | code, Ordering::Relaxed);
    w.phase_log_next.store(n + 1, Ordering::Relaxed);
}

/// Worker `w`'s phase log, oldest switch first.
fn read_log(w: &WorkerRecord) -> Vec<(u64, Option<Phase>)> {
    let n = w.phase_log_next.load(Ordering::Relaxed) as usize;
    (n.saturating_sub(PHASE_LOG)..n)
        .map(|i| w.phase_log.0[i % PHASE_LOG].load(Ordering::Relaxed))
        .map(|e| {
            let code = (e & 0xF) as usize;
            (
                e >> 4,
                code.checked_sub(1).and_then(|i| Phase::ALL.get(i).copied()),
            )
        })
        .collect()
}

impl RingRef<'_> {
    /// Marks worker `id` as timing its own device (see the module), or no longer.
    pub(crate) fn set_device_timed(&self, id: u32, on: bool) {
        let w = self.worker(id);
        w.device_timed.store(u32::from(on), Ordering::Relaxed);
        w.gap_since.store(0, Ordering::Relaxed);
    }

    /// Adds a span of worker `id`'s device work. Busy spans come from one stream, in the order
    /// they ran: a busy span that starts after the last one ended closes an idle gap, kept as
    /// the worker's gap of that second and split by the host's phases meanwhile.
    pub(crate) fn record_device(&self, id: u32, span: DeviceSpan) {
        let w = self.worker(id);
        let (start, end) = (span.start_ns, span.end_ns.max(span.start_ns));
        tally(&w.device_ns[span.phase as usize], end - start);
        if !span.busy {
            return;
        }
        let until = w.device_busy_until.load(Ordering::Relaxed);
        // Overlap with the last busy span counts once.
        tally(&w.device_busy_ns, end.saturating_sub(start.max(until)));
        if until != 0 && start > until {
            #[cfg(not(loom))]
            crate::core::keep_gap(w, start, start - until);
            for (p, ns) in split(&read_log(w), until, start) {
                tally(&w.device_idle_ns[p as usize], ns);
            }
        }
        w.device_busy_until.store(until.max(end), Ordering::Relaxed);
    }
}

/// What worker record `w` says of its device, if it times it.
pub(crate) fn times(w: &WorkerRecord) -> Option<DeviceTimes> {
    (peek32(&w.device_timed) != 0).then(|| DeviceTimes {
        phase_ns: PhaseMap::from_fn(|p: Phase| peek(&w.device_ns[p as usize])),
        busy_ns: peek(&w.device_busy_ns),
        idle_ns: PhaseMap::from_fn(|p: Phase| peek(&w.device_idle_ns[p as usize])),
    })
}

/// Splits `[from, to)` by the phases of `log`: phase switches `(time, phase entered)` in time
/// order, `None` for a stopped clock. Time before the log's first switch, or under a stopped
/// clock, counts as `other`.
pub(crate) fn split(log: &[(u64, Option<Phase>)], from: u64, to: u64) -> PhaseMap<u64> {
    // The worker writes its log and reads it on its own thread, but the supervisor also stops
    // the clock of a hung worker that is still alive: a read racing that write round the ring
    // would find a newer switch among older ones. Put in time order, each part still goes to
    // its phase and the split sums to the stretch.
    let mut log = log.to_vec();
    log.sort_by_key(|&(at, _)| at);
    let mut out = PhaseMap::default();
    let mut t = from;
    // The phase at `from`: the last switch at or before it.
    let mut cur = log
        .iter()
        .rev()
        .find(|(at, _)| *at <= from)
        .and_then(|&(_, p)| p);
    for &(at, p) in log.iter().filter(|(at, _)| *at > from) {
        if at >= to {
            break;
        }
        out[cur.unwrap_or(Phase::Other)] += at - t;
        (t, cur) = (at, p);
    }
    if to > t {
        out[cur.unwrap_or(Phase::Other)] += to - t;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stretch_is_split_by_the_phases_switched_to_within_it() {
        let log = [
            (100, Some(Phase::Compute)),
            (200, Some(Phase::Sync)),
            (250, Some(Phase::Other)),
            (290, Some(Phase::Compute)),
        ];
        let s = split(&log, 200, 300);
        assert_eq!(s[Phase::Sync], 50);
        assert_eq!(s[Phase::Other], 40);
        assert_eq!(s[Phase::Compute], 10);
        assert_eq!(s.values().sum::<u64>(), 100);
        // Starting mid-phase: the phase switched to before `from` holds until its next switch.
        let s = split(&log, 220, 260);
        assert_eq!((s[Phase::Sync], s[Phase::Other]), (30, 10));
    }

    #[test]
    fn time_the_log_does_not_cover_is_other() {
        // The log's oldest switch is after `from` (older ones were overwritten), and a stopped
        // clock (None) within the stretch.
        let log = [(150, Some(Phase::WaitEmpty)), (180, None)];
        let s = split(&log, 100, 200);
        assert_eq!(s[Phase::Other], 50 + 20);
        assert_eq!(s[Phase::WaitEmpty], 30);
        assert_eq!(split(&[], 5, 5).values().sum::<u64>(), 0);
    }

    #[test]
    fn a_log_read_while_its_writer_wrapped_still_splits_the_whole_stretch() {
        // The slot of the oldest switch was overwritten by a newer one (at 170) between the
        // reader's count and its read: in time order, each part still goes to its phase.
        let log = [
            (100, Some(Phase::Compute)),
            (170, Some(Phase::Sync)),
            (140, Some(Phase::WaitEmpty)),
            (160, Some(Phase::Compute)),
        ];
        let s = split(&log, 120, 200);
        assert_eq!(s.values().sum::<u64>(), 80);
        assert_eq!(
            (s[Phase::Compute], s[Phase::WaitEmpty], s[Phase::Sync]),
            (30, 20, 30)
        );
    }
}
