//! The drafter worker: takes batches from the ring under its policy, verifies checksum and
//! content, trains, appends one ledger line per trained batch, releases, and checkpoints
//! atomically every N steps and at the end. On start it restores its latest checkpoint.
//!
//! Ledger lines are written (one `write` each, no user-space buffer) before the slot is
//! released, so a crash never loses the line of a batch whose slot was freed; they are synced to
//! disk at each checkpoint.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use gpu::mock::{MockDrafter, Sim};
use gpu::DrafterBackend;
use proto::control::{FinalReport, ToLauncher, WorkerRole};
use proto::worker::{setup, WorkerArgs};
use proto::BatchView;
use serde::{Deserialize, Serialize};
use shm_ring::{Phase, Ring, Take};

/// Train one drafter on batches from the ring.
///
/// Started by the launcher with `--control`; standalone (for tests and debugging) with
/// `--ring`, `--run-dir` and optionally `--config`:
///
///   drafter-worker --index 0 --ring hspipe-run1 --run-dir runs/run1
///
/// Writes <run-dir>/ledger/drafter-<i>.jsonl and <run-dir>/checkpoints/drafter-<i>.safetensors.
/// A stop request (a stop signal, or Stop from the launcher) lets it drain: targets stop, the
/// ring closes, the drafter trains what is left, checkpoints and exits 0. Exit 1 on error.
#[derive(Parser, Debug)]
#[command(name = "drafter-worker", version, verbatim_doc_comment)]
pub struct Args {
    #[command(flatten)]
    pub common: WorkerArgs,
}

/// One line of a drafter's ledger: a batch it trained on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerLine {
    pub batch_id: u64,
    pub sample_ids: Vec<u64>,
    pub tokens: u64,
    /// Earlier deliveries of this batch to drafters that died holding it.
    pub delivery: u32,
    /// The ring's publish ticket of the batch: one per publication, kept across redeliveries.
    /// Two tickets for one batch id mean it was published twice.
    #[serde(default)]
    pub ticket: u64,
    /// The drafter's step after training on it.
    pub step: u64,
    /// The drafter's registration epoch (1 for the first run; restarts add one).
    pub epoch: u64,
}

pub fn ledger_path(run_dir: &Path, index: u32) -> PathBuf {
    run_dir
        .join("ledger")
        .join(format!("drafter-{index}.jsonl"))
}

/// Every drafter's ledger lines, and how many lines could not be read. A line that does not
/// parse was torn by a drafter killed in the middle of writing it: its batch was not released,
/// so the ring delivered it again and another line records it.
pub fn read_ledgers(run_dir: &Path, drafters: u32) -> anyhow::Result<(Vec<LedgerLine>, u64)> {
    let (mut lines, mut torn) = (Vec::new(), 0);
    for d in 0..drafters {
        let path = ledger_path(run_dir, d);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        for line in text.lines() {
            match serde_json::from_str(line) {
                Ok(l) => lines.push(l),
                Err(_) => torn += 1,
            }
        }
    }
    Ok((lines, torn))
}

/// What the ledgers say about exactly-once training.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accounting {
    /// Distinct samples in any line.
    pub samples_trained: u64,
    /// Batches whose training is recorded more than once by live drafters: published more than
    /// once (several tickets), or one delivery of a publication recorded twice. A line of an
    /// earlier delivery does not count: its drafter died holding the batch, which the ring
    /// delivered again (at-least-once delivery across a crash).
    pub duplicated: u64,
    /// Samples whose batch was trained by no live drafter or by more than one.
    pub samples_not_once: u64,
}

/// Accounts for `lines` (see [`Accounting`]).
pub fn account(lines: &[LedgerLine]) -> Accounting {
    use std::collections::{BTreeMap, HashMap, HashSet};
    // batch id -> ticket -> deliveries recorded
    let mut batches: HashMap<u64, BTreeMap<u64, Vec<u32>>> = HashMap::new();
    let mut samples: HashMap<u64, HashSet<(u64, u64)>> = HashMap::new();
    for l in lines {
        batches
            .entry(l.batch_id)
            .or_default()
            .entry(l.ticket)
            .or_default()
            .push(l.delivery);
        for &s in &l.sample_ids {
            samples.entry(s).or_default().insert((l.batch_id, l.ticket));
        }
    }
    let twice = |deliveries: &Vec<u32>| {
        let mut d = deliveries.clone();
        d.sort_unstable();
        d.windows(2).any(|w| w[0] == w[1])
    };
    let duplicated: HashSet<u64> = batches
        .iter()
        .filter(|(_, tickets)| tickets.len() > 1 || tickets.values().any(twice))
        .map(|(&b, _)| b)
        .collect();
    Accounting {
        samples_trained: samples.len() as u64,
        duplicated: duplicated.len() as u64,
        samples_not_once: samples
            .values()
            .filter(|pubs| pubs.len() != 1 || pubs.iter().any(|(b, _)| duplicated.contains(b)))
            .count() as u64,
    }
}

pub fn checkpoint_path(run_dir: &Path, index: u32) -> PathBuf {
    run_dir
        .join("checkpoints")
        .join(format!("drafter-{index}.safetensors"))
}

/// Writes the state to a temporary file, syncs it, renames it over the checkpoint and syncs
/// the directory: a crash leaves either the old checkpoint or the new one, never half of one.
fn checkpoint(backend: &MockDrafter, ledger: &File, path: &Path) -> anyhow::Result<()> {
    ledger.sync_data().context("syncing the ledger")?;
    let tmp = path.with_extension("safetensors.tmp");
    backend.save(&tmp)?;
    File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// A predecessor killed in the middle of writing a line (a write that crossed a page of the file)
/// left it without its newline: end it, so it stays one unreadable line (its batch was not
/// released, so it is redelivered) instead of swallowing our first line.
fn end_torn_line(ledger: &mut File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let len = ledger.seek(SeekFrom::End(0))?;
    if len == 0 {
        return Ok(());
    }
    ledger.seek(SeekFrom::End(-1))?;
    let mut last = [0u8];
    ledger.read_exact(&mut last)?;
    if last[0] != b'\n' {
        ledger.write_all(b"\n")?;
    }
    Ok(())
}

/// Runs the worker; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let s = setup(&args.common, WorkerRole::Drafter)?;
    let cfg = &s.config;
    for dir in ["ledger", "checkpoints"] {
        std::fs::create_dir_all(s.run_dir.join(dir))
            .with_context(|| format!("creating {}", s.run_dir.join(dir).display()))?;
    }
    let ckpt = checkpoint_path(&s.run_dir, s.index);
    let mut backend = MockDrafter::new(
        Sim::new(cfg.drafter.tokens_per_s, cfg.faults_for(&s.name)),
        cfg.drafter.params as usize,
        cfg.model.hidden,
    );
    if ckpt.exists() {
        backend
            .load(&ckpt)
            .with_context(|| "restoring the drafter; move the file away to start fresh")?;
        tracing::info!(step = backend.step(), path = %ckpt.display(), "restored checkpoint");
    }
    let ledger_file = ledger_path(&s.run_dir, s.index);
    let mut ledger = OpenOptions::new()
        .create(true)
        .append(true)
        .read(true)
        .open(&ledger_file)
        .with_context(|| format!("opening ledger {}", ledger_file.display()))?;
    end_torn_line(&mut ledger)
        .with_context(|| format!("repairing ledger {}", ledger_file.display()))?;

    let ring = Ring::attach(&s.ring).with_context(|| format!("attaching to ring {}", s.ring))?;
    let consumer = ring
        .consumer(s.index)
        .with_context(|| format!("registering as consumer {}", s.index))?;
    consumer.set_gpu(s.gpu);
    let epoch = consumer.epoch();
    tracing::info!(ring = %s.ring, epoch, step = backend.step(), "attached");

    let mut report = FinalReport::default();
    let mut since_ckpt = 0u64;
    loop {
        if s.stop.take_checkpoint_request() {
            consumer.enter(Phase::Checkpoint);
            checkpoint(&backend, &ledger, &ckpt)?;
            consumer.enter(Phase::Other);
        }
        // A short timeout keeps checkpoint requests prompt; the wait is recorded by the ring.
        let slot = match consumer.take_timeout(Duration::from_millis(200))? {
            Take::Item(slot) => slot,
            Take::End => break,
            Take::TimedOut => continue,
        };
        let meta = *slot.meta();
        // The mock's copy-in is parsing and checksumming the batch in place; the backend then
        // checks the content as it trains. Either failure refuses the batch.
        consumer.enter(Phase::CopyIn);
        let view = BatchView::parse(slot.payload()).and_then(|v| v.verify().map(|()| v));
        let trained = match view {
            Ok(view) => {
                consumer.enter(Phase::Compute);
                let stats = backend.train_step(&view).map_err(|e| e.to_string());
                stats.map(|st| (st, view.header().spec.sample_ids.clone()))
            }
            Err(e) => Err(e.to_string()),
        };
        consumer.enter(Phase::Other);
        let (stats, sample_ids) = match trained {
            Ok(x) => x,
            Err(e) => {
                tracing::error!(batch = meta.batch_id, error = %e, "refusing a corrupt batch");
                report.refused += 1;
                slot.release()?;
                continue;
            }
        };
        let line = LedgerLine {
            batch_id: meta.batch_id,
            sample_ids,
            tokens: stats.tokens,
            delivery: meta.delivery,
            ticket: meta.ticket,
            step: stats.step,
            epoch,
        };
        let mut text = serde_json::to_string(&line)?;
        text.push('\n');
        ledger
            .write_all(text.as_bytes())
            .with_context(|| format!("appending to {}", ledger_file.display()))?;
        slot.release()?;
        report.items += 1;
        report.tokens += stats.tokens;
        since_ckpt += 1;
        if since_ckpt >= cfg.drafter.checkpoint_every {
            consumer.enter(Phase::Checkpoint);
            checkpoint(&backend, &ledger, &ckpt)?;
            consumer.enter(Phase::Other);
            since_ckpt = 0;
        }
    }
    consumer.enter(Phase::Checkpoint);
    checkpoint(&backend, &ledger, &ckpt)?;
    consumer.enter(Phase::Other);
    // The ring ended, so the drafter's part is complete even if a stop was requested.
    report.complete = true;
    tracing::info!(
        items = report.items,
        tokens = report.tokens,
        step = backend.step(),
        "drained"
    );
    if let Some(tx) = &s.to_launcher {
        let _ = tx.send(ToLauncher::Report(report));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(batch_id: u64, ticket: u64, delivery: u32, samples: &[u64]) -> LedgerLine {
        LedgerLine {
            batch_id,
            sample_ids: samples.to_vec(),
            tokens: 1,
            delivery,
            ticket,
            step: 0,
            epoch: 1,
        }
    }

    #[test]
    fn a_redelivery_after_a_crash_is_not_a_duplicate_but_a_second_training_is() {
        // Batch 1 trained by a drafter that died before releasing it, then again on its
        // redelivery: at-least-once across a crash, not a duplicate.
        let redelivered = [line(1, 5, 0, &[10, 11]), line(1, 5, 1, &[10, 11])];
        assert_eq!(
            account(&redelivered),
            Accounting {
                samples_trained: 2,
                duplicated: 0,
                samples_not_once: 0
            }
        );
        // Published twice (two tickets), or one delivery trained twice: duplicated, and the
        // distinct-sample count alone would not show it.
        for twice in [
            [line(1, 5, 0, &[10, 11]), line(1, 6, 0, &[10, 11])],
            [line(1, 5, 0, &[10, 11]), line(1, 5, 0, &[10, 11])],
        ] {
            let a = account(&twice);
            assert_eq!((a.samples_trained, a.duplicated), (2, 1), "{twice:?}");
            assert_eq!(a.samples_not_once, 2);
        }
    }

    #[test]
    fn a_torn_ledger_line_is_ended_so_the_next_line_stays_readable() {
        let dir = std::env::temp_dir().join(format!("hspipe-ledger-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("ledger")).unwrap();
        let path = ledger_path(&dir, 0);
        let whole = serde_json::to_string(&line(1, 1, 0, &[1])).unwrap();
        std::fs::write(&path, format!("{whole}\n{}", &whole[..10])).unwrap();
        let mut f = OpenOptions::new()
            .append(true)
            .read(true)
            .open(&path)
            .unwrap();
        end_torn_line(&mut f).unwrap();
        f.write_all(format!("{whole}\n").as_bytes()).unwrap();
        let (lines, torn) = read_ledgers(&dir, 1).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!((lines.len(), torn), (2, 1));
    }
}
