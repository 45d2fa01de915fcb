//! What a device's timeline says about its use, from the intervals its work ran in (CUDA event
//! times, or host clocks on the CPU): the busy share (time inside any interval over the wall
//! time) and the largest idle gap, the two figures that tell "GPUs idle in big gaps" from
//! "GPUs slow".

/// Busy share and largest gap of a set of intervals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Use {
    /// From the earliest start to the latest end.
    pub wall: f64,
    /// Time covered by at least one interval (overlaps counted once).
    pub busy: f64,
    /// Longest stretch between two intervals with nothing running.
    pub largest_gap: f64,
}

impl Use {
    /// Of `intervals` as `(start, end)` pairs in any order, overlapping or not; a pair with
    /// `end < start` counts as empty.
    pub fn of(intervals: &[(f64, f64)]) -> Use {
        let mut v: Vec<(f64, f64)> = intervals.iter().map(|&(s, e)| (s, e.max(s))).collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let Some(&(first, _)) = v.first() else {
            return Use::default();
        };
        let (mut busy, mut gap) = (0.0f64, 0.0f64);
        let (mut cur_s, mut cur_e) = v[0];
        for &(s, e) in &v[1..] {
            if s > cur_e {
                busy += cur_e - cur_s;
                gap = gap.max(s - cur_e);
                (cur_s, cur_e) = (s, e);
            } else {
                cur_e = cur_e.max(e);
            }
        }
        busy += cur_e - cur_s;
        Use {
            wall: cur_e - first,
            busy,
            largest_gap: gap,
        }
    }

    /// `busy / wall` (1 for an empty or instantaneous timeline: nothing was waited for).
    pub fn busy_share(&self) -> f64 {
        if self.wall > 0.0 {
            self.busy / self.wall
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps_count_once_and_the_largest_gap_is_found() {
        // [0,2] and [1,3] overlap (busy 3); gap 3..5; [5,6]; gap 6..10 (the largest); [10,11].
        let u = Use::of(&[(10.0, 11.0), (1.0, 3.0), (0.0, 2.0), (5.0, 6.0)]);
        assert_eq!(u.wall, 11.0);
        assert_eq!(u.busy, 5.0);
        assert_eq!(u.largest_gap, 4.0);
        assert!((u.busy_share() - 5.0 / 11.0).abs() < 1e-12);
    }

    #[test]
    fn back_to_back_work_has_no_gap_and_nothing_is_fully_busy() {
        let u = Use::of(&[(0.0, 1.0), (1.0, 2.0), (2.0, 2.5)]);
        assert_eq!((u.busy, u.largest_gap, u.busy_share()), (2.5, 0.0, 1.0));
        assert_eq!(Use::of(&[]).busy_share(), 1.0);
        // A reversed pair is empty, not negative time.
        assert_eq!(Use::of(&[(3.0, 1.0)]).busy, 0.0);
    }
}
