//! One measurement of a ring: the snapshot at the end of an interval, the interval's rates and
//! the verdict. The CLI prints it (a table or `--json`) and the screen draws it; both take it
//! from here, so neither depends on the other.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use shm_ring::{Ring, SlotCounts, Snapshot};

use crate::analysis::{self, Interval, Judge, Verdict};

/// Everything `--json` prints.
#[derive(Serialize)]
pub struct Report {
    pub snapshot: Snapshot,
    pub interval: Interval,
    pub verdict: Verdict,
}

/// Samples `ring` for `dur`: a snapshot at each end and slot counts every 10 ms between.
pub fn measure(ring: &Ring, dur: Duration) -> Report {
    measure_from(ring, ring.snapshot(), dur, &mut Judge::new())
}

/// Like `measure`, from snapshot `a` (the previous report's end), judged with `judge`'s
/// history.
pub(crate) fn measure_from(ring: &Ring, a: Snapshot, dur: Duration, judge: &mut Judge) -> Report {
    let start = Instant::now();
    let mut occ = Vec::new();
    while start.elapsed() < dur {
        occ.push(ring.slot_counts());
        std::thread::sleep(Duration::from_millis(10).min(dur));
    }
    Report::judged(judge, &a, ring.snapshot(), &occ)
}

impl Report {
    /// The report for the interval from snapshot `a` to `b`, with the slot counts sampled
    /// between them.
    pub fn between(a: &Snapshot, b: Snapshot, occupancy: &[SlotCounts]) -> Report {
        Report::judged(&mut Judge::new(), a, b, occupancy)
    }

    /// Like `between`, with the verdict judged over `judge`'s window of earlier intervals (the
    /// one before this started at `a`).
    pub fn judged(
        judge: &mut Judge,
        a: &Snapshot,
        b: Snapshot,
        occupancy: &[SlotCounts],
    ) -> Report {
        let interval = analysis::interval(a, &b, occupancy);
        let verdict = judge.verdict(a, &b, occupancy);
        Report {
            snapshot: b,
            interval,
            verdict,
        }
    }

    /// Says the ring is gone from `/dev/shm` (see [`Presence`]): this is its last state. The
    /// stale warning goes, and a stale verdict keeps only its first clause, as their advice
    /// (`--gc` removes it) no longer holds.
    pub fn mark_removed(&mut self) {
        let line = &mut self.verdict.line;
        if line.starts_with("stale:") {
            if let Some(end) = line.find("; nothing will move") {
                line.truncate(end);
            }
        }
        let w = &mut self.verdict.warnings;
        w.retain(|w| !w.starts_with("stale:"));
        w.insert(
            0,
            format!(
                "removed: {} is no longer in /dev/shm (its run has ended, or it was removed); this is its last state",
                self.snapshot.name
            ),
        );
    }
}

/// Whether a ring attached to is still in `/dev/shm`. A ring stays mapped after its name is
/// removed (the launcher removes it when its run ends), so reading it alone would never tell:
/// the name must still lead to the same file.
pub struct Presence {
    path: PathBuf,
    inode: Option<u64>,
}

impl Presence {
    /// The file `ring`'s name leads to now (just after attaching: the same one; none if it is
    /// already gone).
    pub fn of(ring: &Ring) -> Presence {
        let path = PathBuf::from("/dev/shm").join(ring.name());
        let inode = std::fs::metadata(&path).ok().map(|m| m.ino());
        Presence { path, inode }
    }

    /// True once the name is gone or leads to another file.
    pub fn removed(&self) -> bool {
        let now = std::fs::metadata(&self.path).ok().map(|m| m.ino());
        self.inode.is_none() || now != self.inode
    }
}
