//! `summary.json`: what the run did, from the drafters' ledgers (what was trained) and the
//! ring's telemetry (what moved, and where each worker's time went).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use drafter_worker::{ledger_path, LedgerLine};
use serde::Serialize;
use shm_ring::{Role, Snapshot};

#[derive(Debug, Serialize)]
pub struct WorkerSummary {
    pub role: &'static str,
    pub index: u32,
    pub gpu: Option<u32>,
    pub restarts: u32,
    pub items: u64,
    pub tokens: u64,
    /// Fraction of the run's wall time spent in compute (the GPU doing model work).
    pub busy_frac: f64,
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub ok: bool,
    pub exit_code: i32,
    pub samples_total: u64,
    /// Distinct samples in the drafters' ledgers.
    pub samples_trained: u64,
    pub batches_total: u64,
    pub batches_published: u64,
    /// Ledger lines: batches trained, a redelivered one counted each time it was trained.
    pub batches_trained: u64,
    pub redelivered: u64,
    pub tokens_trained: u64,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub backend: String,
    pub ring: String,
    pub notes: Vec<String>,
    pub workers: Vec<WorkerSummary>,
}

#[allow(clippy::too_many_arguments)]
pub fn build(
    run_dir: &Path,
    ring: &str,
    backend: &str,
    snap: &Snapshot,
    samples_total: u64,
    drafters: u32,
    wall: Duration,
    restarts: &HashMap<String, u32>,
) -> anyhow::Result<Summary> {
    let mut samples = HashSet::new();
    let (mut batches, mut tokens) = (0u64, 0u64);
    for d in 0..drafters {
        let path = ledger_path(run_dir, d);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            let l: LedgerLine = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: unreadable ledger line", path.display(), i + 1))?;
            samples.extend(l.sample_ids);
            batches += 1;
            tokens += l.tokens;
        }
    }
    let wall_s = wall.as_secs_f64();
    let workers = snap
        .workers
        .iter()
        .map(|w| {
            let (role, name) = match w.role {
                Role::Producer => ("target", format!("target-{}", w.index)),
                Role::Consumer => ("drafter", format!("drafter-{}", w.index)),
            };
            WorkerSummary {
                role,
                index: w.index,
                gpu: w.gpu,
                restarts: restarts.get(&name).copied().unwrap_or(0),
                items: w.items,
                tokens: w.tokens,
                busy_frac: if wall_s > 0.0 {
                    (w.busy_ns() as f64 / 1e9 / wall_s).min(1.0)
                } else {
                    0.0
                },
            }
        })
        .collect();
    Ok(Summary {
        ok: false,
        exit_code: 0,
        samples_total,
        samples_trained: samples.len() as u64,
        batches_total: snap.work.total,
        batches_published: snap.counters.published,
        batches_trained: batches,
        redelivered: snap.counters.redelivered,
        tokens_trained: tokens,
        wall_s,
        tokens_per_s: if wall_s > 0.0 {
            tokens as f64 / wall_s
        } else {
            0.0
        },
        backend: backend.to_string(),
        ring: ring.to_string(),
        notes: Vec::new(),
        workers,
    })
}

pub fn finalise(mut s: Summary, exit_code: i32, notes: Vec<String>) -> Summary {
    s.exit_code = exit_code;
    s.ok = exit_code == 0;
    s.notes = notes;
    s
}

/// Writes summary.json atomically (temp file, then rename).
pub fn write(run_dir: &Path, s: &Summary) -> anyhow::Result<()> {
    let path = run_dir.join("summary.json");
    let tmp = run_dir.join(".summary.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(s)? + "\n")
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

pub fn print(s: &Summary) {
    println!();
    println!(
        "{} in {:.1}s: {}/{} samples trained, {} batches ({} redelivered), {:.0} tokens/s",
        if s.ok { "done" } else { "ended" },
        s.wall_s,
        s.samples_trained,
        s.samples_total,
        s.batches_trained,
        s.redelivered,
        s.tokens_per_s
    );
    println!(
        "{:<8} {:>3} {:>4} {:>8} {:>7} {:>10} {:>6}",
        "role", "idx", "gpu", "restarts", "items", "tokens", "busy"
    );
    for w in &s.workers {
        println!(
            "{:<8} {:>3} {:>4} {:>8} {:>7} {:>10} {:>5.0}%",
            w.role,
            w.index,
            w.gpu.map(|g| g.to_string()).unwrap_or("-".into()),
            w.restarts,
            w.items,
            w.tokens,
            w.busy_frac * 100.0
        );
    }
    for n in &s.notes {
        println!("note: {n}");
    }
    println!("exit code {}", s.exit_code);
}
