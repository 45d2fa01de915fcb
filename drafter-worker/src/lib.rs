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
        .open(&ledger_file)
        .with_context(|| format!("opening ledger {}", ledger_file.display()))?;

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
