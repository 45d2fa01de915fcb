//! `launcher report`'s reading of the ticks: each tick of `metrics.jsonl` is folded, as it is
//! read, into a bounded number of buckets of consecutive ticks, so a week at one tick a second
//! (604,800 lines, GBs) costs the memory of a few thousand buckets, not of every tick.
//!
//! A bucket keeps, for each run-wide series (the ring, tokens/s, the loss, ...), the mean, the
//! minimum and the maximum of its ticks, and for each worker the mean of its stacked phase
//! shares. While there are more than twice [`Series::keep`] buckets, neighbours are merged in
//! pairs (each then covers twice the ticks): the means stay exact and so do the extremes, so a
//! one-second stall or a ten-minute idle gap in a week is still drawn at its height. The picture
//! then merges the buckets of each of its columns (`Series::columns`), by time.
//!
//! Only the fields drawn are read from a line ([`ReadTick`]); the rest (`steps`, the verdict,
//! ...) is passed over without being kept. The fields keep the names and types of
//! `monitor::Tick`, the writer's type (a test holds them together).

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;
use shm_ring::Phase;

use super::PHASES;
use crate::monitor::EventTick;

/// The part of a tick that the report draws. Fields default as in `monitor::Tick` (older files
/// lack some); `t_s` is an option so that a line without it is told apart: no tick.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ReadTick {
    pub t_s: Option<f64>,
    pub launch_unix_ms: Option<u64>,
    pub tokens_per_s: f64,
    pub ring_ready: u32,
    pub ring_in_use: u32,
    pub ring_slots: u32,
    pub targets_busy: f64,
    pub drafters_busy: f64,
    pub workers: Vec<ReadWorker>,
    pub events: Vec<EventTick>,
    pub drafter_loss: Option<f64>,
    pub acceptance_length: Option<f64>,
}

/// The part of a tick's worker record that the report draws (`monitor::WorkerTick`'s fields).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ReadWorker {
    pub name: String,
    pub gpu: Option<u32>,
    pub restarts: u64,
    pub busy: f64,
    pub phases: BTreeMap<Phase, f64>,
    pub largest_gap_s: f64,
}

impl ReadTick {
    /// The longest idle gap of any drafter in the tick (`None` with no drafter record).
    pub fn drafter_gap(&self) -> Option<f64> {
        (self.workers.iter())
            .filter(|w| w.name.starts_with("drafter"))
            .map(|w| w.largest_gap_s)
            .reduce(f64::max)
    }
}

/// One series over some ticks: mean, minimum and maximum of the ticks that have a value.
#[derive(Clone, Copy, Debug)]
pub struct Agg {
    pub min: f64,
    pub max: f64,
    sum: f64,
    n: u32,
}

impl Default for Agg {
    fn default() -> Agg {
        Agg {
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            sum: 0.0,
            n: 0,
        }
    }
}

impl Agg {
    pub fn add(&mut self, v: f64) {
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.sum += v;
        self.n += 1;
    }

    pub fn merge(&mut self, o: &Agg) {
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.sum += o.sum;
        self.n += o.n;
    }

    /// The mean; None over no value.
    pub fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / f64::from(self.n))
    }

    /// Ticks with a value.
    pub fn count(&self) -> u32 {
        self.n
    }
}

/// The run-wide series, each an index into [`Bucket::series`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum S {
    Ready,
    InUse,
    /// Tokens/s, leaving out ticks much shorter than the period (a launch's last), whose rate is
    /// noise.
    Rate,
    TargetsBusy,
    DraftersBusy,
    Loss,
    Tau,
    /// The longest idle gap of any drafter.
    Gap,
}

const SERIES: usize = 8;

/// One worker over a bucket: sums over the ticks with its record (f32: a bucket sums at most
/// some thousands of shares, and a week's buckets are most of the report's memory).
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkerAgg {
    /// The running sums of its phase shares in [`PHASES`] order (compute at the bottom: a
    /// band draws them stacked), each at most 1 a tick.
    stacked: [f32; PHASES.len()],
    n: u32,
}

impl WorkerAgg {
    /// The mean share of phases `PHASES[..=k]`; None in a bucket without the worker's record.
    pub fn stacked(&self, k: usize) -> Option<f64> {
        (self.n > 0).then(|| f64::from(self.stacked[k]) / f64::from(self.n))
    }

    fn merge(&mut self, o: &WorkerAgg) {
        for (a, b) in self.stacked.iter_mut().zip(o.stacked) {
            *a += b;
        }
        self.n += o.n;
    }
}

/// Consecutive ticks, folded.
#[derive(Clone, Debug)]
pub struct Bucket {
    /// The time of its last tick (seconds since the run started, resumes included).
    pub t: f64,
    pub ticks: u32,
    series: [Agg; SERIES],
    /// By the worker's place in [`Series::workers`]; shorter when later workers have no record.
    workers: Vec<WorkerAgg>,
}

impl Bucket {
    fn new() -> Bucket {
        Bucket {
            t: 0.0,
            ticks: 0,
            series: [Agg::default(); SERIES],
            workers: Vec::new(),
        }
    }

    pub fn get(&self, s: S) -> &Agg {
        &self.series[s as usize]
    }

    /// Worker `w`'s figures (by its place in [`Series::workers`]).
    pub fn worker(&self, w: usize) -> WorkerAgg {
        self.workers.get(w).copied().unwrap_or_default()
    }

    fn merge(&mut self, o: &Bucket) {
        self.t = self.t.max(o.t);
        self.ticks += o.ticks;
        for (a, b) in self.series.iter_mut().zip(&o.series) {
            a.merge(b);
        }
        if self.workers.len() < o.workers.len() {
            self.workers.resize(o.workers.len(), WorkerAgg::default());
        }
        for (a, b) in self.workers.iter_mut().zip(&o.workers) {
            a.merge(b);
        }
    }
}

/// A worker seen in the run, in the order first seen.
#[derive(Clone, Debug, Default)]
pub struct WorkerInfo {
    pub name: String,
    /// Its GPU, from the first record that has one (a worker not registered yet has none).
    pub gpu: Option<u32>,
    pub restarts: u64,
    /// Its busy share over the run.
    pub busy: Agg,
}

/// Every tick of a run, folded into at most `2 * keep()` buckets.
#[derive(Debug, Default)]
pub struct Series {
    pub buckets: Vec<Bucket>,
    /// Ticks per bucket (the last may hold fewer): doubles at each halving.
    per: u32,
    pub workers: Vec<WorkerInfo>,
    by_name: HashMap<String, usize>,
    /// Over the whole run.
    totals: [Agg; SERIES],
    pub ticks: u64,
    /// The largest ring seen.
    pub slots: u32,
}

/// Buckets kept (between this and twice this): a column per bucket at the widest picture
/// (16,384 pixels, a column per two).
const KEEP: usize = 8192;

/// At most this many worker cells in the kept buckets (some 40 MB): a run of thousands of
/// workers keeps fewer buckets.
const CELLS: usize = 1 << 20;

impl Series {
    /// Buckets kept, for the workers seen so far.
    pub fn keep(&self) -> usize {
        (CELLS / self.workers.len().max(1)).clamp(64, KEEP)
    }

    /// Folds in one tick, already moved to the run's time (resumes) as `t_s`; `rate` is its
    /// tokens/s unless the tick is too short for one.
    pub fn push(&mut self, tick: &ReadTick, t_s: f64, rate: Option<f64>) {
        self.per = self.per.max(1);
        if self.buckets.last().is_none_or(|b| b.ticks >= self.per) {
            self.buckets.push(Bucket::new());
        }
        let mut values = [None; SERIES];
        values[S::Ready as usize] = Some(f64::from(tick.ring_ready));
        values[S::InUse as usize] = Some(f64::from(tick.ring_in_use));
        values[S::Rate as usize] = rate;
        values[S::TargetsBusy as usize] = Some(tick.targets_busy);
        values[S::DraftersBusy as usize] = Some(tick.drafters_busy);
        values[S::Loss as usize] = tick.drafter_loss;
        values[S::Tau as usize] = tick.acceptance_length;
        values[S::Gap as usize] = tick.drafter_gap();
        let mut places = Vec::with_capacity(tick.workers.len());
        for w in &tick.workers {
            let at = match self.by_name.get(&w.name) {
                Some(&at) => at,
                None => {
                    self.by_name.insert(w.name.clone(), self.workers.len());
                    self.workers.push(WorkerInfo {
                        name: w.name.clone(),
                        ..WorkerInfo::default()
                    });
                    self.workers.len() - 1
                }
            };
            let info = &mut self.workers[at];
            info.gpu = info.gpu.or(w.gpu);
            info.restarts = info.restarts.max(w.restarts);
            info.busy.add(w.busy);
            places.push(at);
        }
        let bucket = self.buckets.last_mut().expect("a bucket");
        bucket.t = t_s;
        bucket.ticks += 1;
        for ((agg, total), v) in bucket.series.iter_mut().zip(&mut self.totals).zip(values) {
            if let Some(v) = v {
                agg.add(v);
                total.add(v);
            }
        }
        for (w, &at) in tick.workers.iter().zip(&places) {
            if bucket.workers.len() <= at {
                bucket.workers.resize(at + 1, WorkerAgg::default());
            }
            let agg = &mut bucket.workers[at];
            let mut sum = 0.0;
            for (k, (p, ..)) in PHASES.iter().enumerate() {
                sum += w.phases.get(p).copied().unwrap_or(0.0);
                agg.stacked[k] += sum.min(1.0) as f32;
            }
            agg.n += 1;
        }
        self.ticks += 1;
        self.slots = self.slots.max(tick.ring_slots);
        while self.buckets.len() > 2 * self.keep() {
            self.halve();
        }
    }

    /// Merges neighbouring buckets in pairs.
    fn halve(&mut self) {
        let old = std::mem::take(&mut self.buckets);
        let mut it = old.into_iter();
        while let Some(mut a) = it.next() {
            if let Some(b) = it.next() {
                a.merge(&b);
            }
            self.buckets.push(a);
        }
        self.per = self.per.saturating_mul(2);
    }

    /// Series `s` over the whole run.
    pub fn total(&self, s: S) -> &Agg {
        &self.totals[s as usize]
    }

    /// The buckets merged into at most `n` columns of equal time up to `t_max`, each at the
    /// time of its last tick; columns without a tick are left out.
    pub fn columns(&self, n: usize, t_max: f64) -> Vec<Bucket> {
        let n = n.max(1);
        let mut out: Vec<(usize, Bucket)> = Vec::new();
        for b in &self.buckets {
            let col = ((b.t / t_max.max(1e-9)) * n as f64).floor() as usize;
            let col = col.min(n - 1);
            match out.last_mut() {
                Some((c, last)) if *c == col => last.merge(b),
                _ => out.push((col, b.clone())),
            }
        }
        out.into_iter().map(|(_, b)| b).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{ReadTick, Series, KEEP, S};
    use crate::monitor::{EventTick, Tick, WorkerTick};
    use shm_ring::Phase;

    /// The report reads a tick through its own type: every field it draws has the name and
    /// meaning of the writer's (`monitor::Tick`), so a renamed field fails here, not silently.
    #[test]
    fn a_tick_reads_back_what_the_monitor_wrote() {
        let tick = Tick {
            t_s: 12.5,
            launch_unix_ms: Some(7),
            tokens_per_s: 1234.0,
            ring_ready: 5,
            ring_in_use: 9,
            ring_slots: 24,
            targets_busy: 0.5,
            drafters_busy: 0.75,
            workers: vec![WorkerTick {
                name: "drafter-1".into(),
                gpu: Some(6),
                restarts: 2,
                busy: 0.75,
                phases: [(Phase::Compute, 0.75), (Phase::Sync, 0.25)].into(),
                largest_gap_s: 0.125,
                ..WorkerTick::default()
            }],
            events: vec![EventTick {
                t_s: 12.0,
                text: "stopping: SIGINT".into(),
            }],
            drafter_loss: Some(0.5),
            acceptance_length: Some(3.5),
            ..Tick::default()
        };
        let line = serde_json::to_string(&tick).unwrap();
        let read: ReadTick = serde_json::from_str(&line).unwrap();
        assert_eq!(
            (read.t_s, read.launch_unix_ms, read.tokens_per_s),
            (Some(12.5), Some(7), 1234.0)
        );
        assert_eq!(
            (read.ring_ready, read.ring_in_use, read.ring_slots),
            (5, 9, 24)
        );
        assert_eq!((read.targets_busy, read.drafters_busy), (0.5, 0.75));
        assert_eq!(
            (read.drafter_loss, read.acceptance_length),
            (Some(0.5), Some(3.5))
        );
        assert_eq!(
            (read.events[0].t_s, read.events[0].text.as_str()),
            (12.0, "stopping: SIGINT")
        );
        let w = &read.workers[0];
        assert_eq!(
            (w.name.as_str(), w.gpu, w.restarts),
            ("drafter-1", Some(6), 2)
        );
        assert_eq!((w.busy, w.phases.len(), w.largest_gap_s), (0.75, 2, 0.125));
        assert_eq!(read.drafter_gap(), Some(0.125));
    }

    /// A week of ticks folds into a bounded number of buckets, and then columns, with the
    /// means exact and a one-tick stall and a one-tick gap as tall as they were: averaged, or
    /// thinned to every other tick (as the report did), they vanished.
    #[test]
    fn a_long_run_folds_into_bounded_buckets_keeping_its_extremes() {
        let mut series = Series::default();
        let ticks = 5 * KEEP as u64 + 123;
        let spike = 3 * KEEP as u64 + 1;
        let mut tick = ReadTick {
            workers: vec![Default::default(), Default::default()],
            ..ReadTick::default()
        };
        tick.workers[0].name = "target-0".into();
        tick.workers[1].name = "drafter-0".into();
        tick.workers[1].phases = [(Phase::Compute, 0.5), (Phase::Sync, 0.25)].into();
        let mut sum = 0.0;
        for i in 0..ticks {
            let stalled = i == spike;
            tick.tokens_per_s = if stalled {
                0.0
            } else {
                1000.0 + (i % 2) as f64
            };
            tick.workers[1].largest_gap_s = if stalled { 600.0 } else { 0.5 };
            sum += tick.tokens_per_s;
            series.push(&tick, i as f64, Some(tick.tokens_per_s));
        }
        assert_eq!(series.ticks, ticks);
        assert!(series.buckets.len() <= 2 * KEEP, "{}", series.buckets.len());
        let held: u64 = series.buckets.iter().map(|b| u64::from(b.ticks)).sum();
        assert_eq!(held, ticks);
        let cols = series.columns(600, ticks as f64);
        assert!(cols.len() <= 600 && cols.len() > 590, "{}", cols.len());
        let gap = cols.iter().map(|c| c.get(S::Gap).max).fold(0.0, f64::max);
        let rate = cols
            .iter()
            .map(|c| c.get(S::Rate).min)
            .fold(f64::MAX, f64::min);
        assert_eq!((gap, rate), (600.0, 0.0));
        // Only the column with the stall reaches it.
        assert_eq!(cols.iter().filter(|c| c.get(S::Gap).max > 1.0).count(), 1);
        let mean = series.total(S::Rate).mean().unwrap();
        assert!((mean - sum / ticks as f64).abs() < 1e-9, "{mean}");
        // The drafter's stacked shares: compute, then with every phase up to sync.
        let d = cols[10].worker(1);
        assert_eq!(
            (d.stacked(0), d.stacked(5), d.stacked(7)),
            (Some(0.5), Some(0.75), Some(0.75))
        );
    }

    /// Thousands of workers keep fewer buckets: the memory stays bounded by the cells.
    #[test]
    fn many_workers_keep_fewer_buckets() {
        let mut series = Series::default();
        let tick = ReadTick {
            workers: (0..4000)
                .map(|i| super::ReadWorker {
                    name: format!("target-{i}"),
                    ..Default::default()
                })
                .collect(),
            ..ReadTick::default()
        };
        for i in 0..1000 {
            series.push(&tick, f64::from(i), None);
        }
        assert!(series.buckets.len() <= 2 * series.keep());
        assert!(series.buckets.len() * 4000 <= 2 * super::CELLS);
    }
}
