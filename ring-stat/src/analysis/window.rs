//! The window the verdict is judged over, as the figures its rules read: the waits of each
//! side, the ring's trend, what moved, the slow and the silent workers. Computed once per
//! verdict, so the rules stay small and agree on every number.

use super::pace::{pace, silent_worker, slow_workers, working, Slow};
use super::*;

/// The window's figures, computed once for every rule.
pub(super) struct Window<'a> {
    /// The window's end snapshot, and the rates over the window.
    pub(super) b: &'a Snapshot,
    pub(super) iv: &'a Interval,
    /// The previous verdict's class (hysteresis); whether the window holds the first take.
    pub(super) last: Option<Bottleneck>,
    pub(super) fresh: bool,
    /// Drafters that ever waited in `sync` are one synchronous group.
    pub(super) group: bool,
    /// Targets' mean waiting share; drafters' (a group's: its most waiting rank's, since a
    /// group steps at its slowest rank's pace and so waits for data while any rank does).
    pub(super) t_wait: Option<f64>,
    pub(super) d_wait: Option<f64>,
    /// Batches published and trained in the window.
    pub(super) published: f64,
    pub(super) released: f64,
    /// Batches that left the ring in the window: trained, or refused as corrupt (the ring's
    /// flow, which its trend is judged by).
    pub(super) freed: f64,
    pub(super) trend: Trend,
    /// Something was published or trained; some live worker did its own work.
    pub(super) moved: bool,
    pub(super) worked: bool,
    /// Workers far slower per token than their peers, slowest first.
    pub(super) slow: Vec<Slow>,
    /// The live drafters' mean share of the window in `sync`.
    pub(super) sync: f64,
    /// The least share of the window any live drafter spent in `sync` (0 with none live).
    pub(super) least_sync: f64,
    pub(super) drafters_live: usize,
    /// Drafters that ran and do not run now, without having left cleanly: dead, or
    /// restarting.
    pub(super) drafters_down: usize,
    /// Of those, the ones whose last heartbeat is within the window: a group may have waited
    /// for them in it (a rank given up long ago was removed from the group long ago).
    pub(super) drafters_down_lately: usize,
    /// Live drafters whose pace is known.
    pub(super) live_paces: usize,
    /// Batches still in the ring (READY or being trained).
    pub(super) left: u32,
    /// The live worker silent longest past its usual step, with its silence and usual step.
    pub(super) silent: Option<(&'a WorkerSnapshot, f64, Option<f64>)>,
    /// Batches released from the ring whose updates were lost or skipped (`Judge::set_lost`).
    pub(super) lost: u64,
}

impl<'a> Window<'a> {
    pub(super) fn new(
        b: &'a Snapshot,
        iv: &'a Interval,
        last: Option<Bottleneck>,
        fresh: bool,
        lost: u64,
    ) -> Window<'a> {
        let drafters = || b.workers.iter().filter(|w| w.role == Role::Consumer);
        let group = drafters().count() >= 2 && drafters().any(|w| w.phase_ns[Phase::Sync] > 0);
        let mut w = Window {
            b,
            iv,
            last,
            fresh,
            lost,
            group,
            t_wait: None,
            d_wait: None,
            published: (iv.published_per_s * iv.seconds).round(),
            released: (iv.released_per_s * iv.seconds).round(),
            freed: ((iv.released_per_s + iv.refused_per_s) * iv.seconds).round(),
            trend: Trend::Steady,
            moved: false,
            worked: false,
            slow: slow_workers(b),
            sync: 0.0,
            least_sync: 0.0,
            drafters_live: drafters().filter(|w| w.alive).count(),
            drafters_down: drafters()
                .filter(|w| w.epoch > 0 && !w.alive && w.state != WorkerState::Done)
                .count(),
            drafters_down_lately: drafters()
                .filter(|w| w.epoch > 0 && !w.alive && w.state != WorkerState::Done)
                .filter(|w| {
                    w.heartbeat_age_ns
                        .is_some_and(|age| (age as f64) < iv.seconds.max(1.0) * 2e9)
                })
                .count(),
            live_paces: drafters().filter(|w| w.alive && pace(w).is_some()).count(),
            left: b.slots.ready + b.slots.reading,
            silent: silent_worker(b),
        };
        w.t_wait = mean(w.live(Role::Producer).map(|r| r.waiting));
        w.d_wait = if group {
            w.live(Role::Consumer).map(|r| r.waiting).reduce(f64::max)
        } else {
            mean(w.live(Role::Consumer).map(|r| r.waiting))
        };
        w.trend = w.ring_trend();
        w.moved = w.published > 0.0 || w.freed > 0.0;
        w.worked = iv.workers.iter().filter(|r| r.alive).any(|r| {
            Phase::ALL
                .iter()
                .any(|p| working(*p) && r.phases[*p] > 0.01)
        });
        w.sync = mean(w.live(Role::Consumer).map(|r| r.phases[Phase::Sync])).unwrap_or(0.0);
        w.least_sync = w
            .live(Role::Consumer)
            .map(|r| r.phases[Phase::Sync])
            .reduce(f64::min)
            .unwrap_or(0.0);
        w
    }

    /// The live workers of `role` over the window.
    pub(super) fn live(&self, role: Role) -> impl Iterator<Item = &'a WorkerRates> {
        self.iv
            .workers
            .iter()
            .filter(move |w| w.role == role && w.alive)
    }

    /// The mean share of the window in `sync` of the live drafters other than `index`.
    pub(super) fn others_sync(&self, index: u32) -> Option<f64> {
        mean(
            self.live(Role::Consumer)
                .filter(|w| w.index != index)
                .map(|w| w.phases[Phase::Sync]),
        )
    }

    /// The slow rank a synchronous group waits for at every step, if there is one.
    pub(super) fn slow_rank(&self) -> Option<&Slow> {
        self.slow
            .iter()
            .find(|s| s.role == Role::Consumer && self.group)
    }

    /// Where the ring's occupancy went: filling (or emptying) when its net change is at least
    /// twice what the drafters hold at once (or `min_ready`, the gate's swing), and at least
    /// a share of what was published (trained); half the share keeps the side that was the
    /// bottleneck (hysteresis).
    fn ring_trend(&self) -> Trend {
        let p = &self.b.params;
        let share = |c| {
            if self.last == Some(c) {
                TREND_SHARE / 2.0
            } else {
                TREND_SHARE
            }
        };
        let gate = match p.policy {
            TakePolicy::Bucketed { min_ready, .. } => min_ready,
            TakePolicy::Fifo => 0,
        };
        let swing = (2 * p.consumers * p.held_per_consumer.max(1)).max(gate);
        let least = TREND_MIN.max(f64::from(swing));
        let net = self.published - self.freed;
        if net >= least && net >= share(Bottleneck::Drafters) * self.published {
            Trend::Filling
        } else if -net >= least && -net >= share(Bottleneck::Targets) * self.freed {
            Trend::Emptying
        } else {
            Trend::Steady
        }
    }
}
