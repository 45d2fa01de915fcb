//! The live monitor: a progress bar on a terminal, plain periodic lines otherwise, and one JSON
//! line per tick in `metrics.jsonl`. `launcher.log` gets the plain lines either way.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use shm_ring::analysis::{self, Interval};
use shm_ring::{Ring, SlotCounts, Snapshot};

use crate::output::{Log, Tee};

/// One monitor tick, as written to metrics.jsonl.
#[derive(Serialize)]
struct Tick {
    t_s: f64,
    tokens_per_s: f64,
    batches_trained: u64,
    batches_total: u64,
    ring_ready: u32,
    ring_in_use: u32,
    ring_slots: u32,
    ready_per_bucket: Vec<u32>,
    targets_busy: f64,
    drafters_busy: f64,
    targets_waiting: f64,
    drafters_waiting: f64,
    restarts: u32,
    closed: bool,
    /// shm-ring-stat's verdict over the period.
    verdict: String,
}

pub struct Monitor {
    metrics: File,
    total: u64,
    every: Duration,
    last: Option<(Instant, Snapshot)>,
    /// Slot counts sampled since the last tick, for the ring-full/empty shares.
    occupancy: Vec<SlotCounts>,
    /// On a terminal: the bar, and the log for what the bar shows (plain lines reach the log
    /// through stdout).
    bar: Option<(ProgressBar, Log)>,
}

/// Mean (busy, waiting) shares of the live workers of one role over an interval.
fn shares(iv: &Interval, role: &str) -> (f64, f64) {
    let ws: Vec<_> = iv
        .workers
        .iter()
        .filter(|w| w.role == role && w.alive)
        .collect();
    if ws.is_empty() {
        return (0.0, 0.0);
    }
    let n = ws.len() as f64;
    (
        ws.iter().map(|w| w.busy).sum::<f64>() / n,
        ws.iter().map(|w| w.waiting).sum::<f64>() / n,
    )
}

impl Monitor {
    pub fn new(run_dir: &Path, total: u64, every: Duration, tee: &Tee) -> anyhow::Result<Monitor> {
        let path = run_dir.join("metrics.jsonl");
        let metrics =
            // Appended: a resumed run adds to what the run wrote before.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
        let bar = tee.terminal().map(|term| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::term(term, 20));
            b.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] {pos}/{len} batches  {msg}  ETA {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            (b, tee.log())
        });
        Ok(Monitor {
            metrics,
            total,
            every,
            last: None,
            occupancy: Vec::new(),
            bar,
        })
    }

    /// Prints an event line without breaking the progress bar.
    pub fn say(&self, msg: &str) {
        match &self.bar {
            Some((b, log)) => {
                b.println(msg);
                log.line(msg);
            }
            None => println!("{msg}"),
        }
    }

    pub fn tick(&mut self, ring: &Ring, restarts: u32, started: Instant) -> anyhow::Result<()> {
        let now = Instant::now();
        let Some((at, prev)) = &self.last else {
            self.last = Some((now, ring.snapshot()));
            return Ok(());
        };
        self.occupancy.push(ring.slot_counts());
        if now.duration_since(*at) < self.every {
            return Ok(());
        }
        let snap = ring.snapshot();
        let iv = analysis::interval(prev, &snap, &self.occupancy);
        let verdict = analysis::verdict(&snap, &iv);
        self.occupancy.clear();
        let (tb, tw) = shares(&iv, "target");
        let (db, dw) = shares(&iv, "drafter");
        let t = Tick {
            t_s: started.elapsed().as_secs_f64(),
            tokens_per_s: iv.tokens_per_s,
            batches_trained: snap.counters.released,
            batches_total: self.total,
            ring_ready: snap.slots.ready,
            ring_in_use: snap.slots.ready + snap.slots.writing + snap.slots.reading,
            ring_slots: snap.params.slots,
            ready_per_bucket: snap.ready_per_bucket.clone(),
            targets_busy: tb,
            drafters_busy: db,
            targets_waiting: tw,
            drafters_waiting: dw,
            restarts,
            closed: snap.closed,
            verdict: verdict.line,
        };
        writeln!(self.metrics, "{}", serde_json::to_string(&t)?)?;
        let rate = if t.tokens_per_s >= 1000.0 {
            format!("{:.1}k tok/s", t.tokens_per_s / 1000.0)
        } else {
            format!("{:.0} tok/s", t.tokens_per_s)
        };
        let line = format!(
            "[{:6.1}s] {rate:>12}  trained {}/{}  ring {}/{} ready {:?}  busy: targets {:.0}% drafters {:.0}%  restarts {restarts}  | {}",
            t.t_s,
            t.batches_trained,
            t.batches_total,
            t.ring_ready,
            t.ring_slots,
            t.ready_per_bucket,
            tb * 100.0,
            db * 100.0,
            t.verdict
        );
        match &self.bar {
            Some((b, log)) => {
                b.set_position(t.batches_trained);
                b.set_message(format!(
                    "{rate}  ring {}/{}  busy T {:.0}% D {:.0}%  restarts {restarts}",
                    t.ring_ready,
                    t.ring_slots,
                    tb * 100.0,
                    db * 100.0
                ));
                log.line(&line);
            }
            None => println!("{line}"),
        }
        self.last = Some((now, snap));
        Ok(())
    }

    pub fn finish(&self) {
        if let Some((b, _)) = &self.bar {
            b.finish_and_clear();
        }
    }
}
