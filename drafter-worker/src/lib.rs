//! The drafter worker: one rank of the drafter group, which trains ONE model data-parallel.
//!
//! Length: the group step (take, verify, gradient, all-reduce, apply, ledger, release) and its
//! failure paths read top to bottom in one file.
//!
//! Each group step: take at most one batch from the ring, verify it, compute the gradient of its
//! summed loss, all-reduce with the other ranks (the `collective` crate), apply the identical
//! update, append one ledger line (step and weights digest), and only then release the slot: a
//! batch is held until the update that used it is applied. A rank with no batch (the ring is
//! closed and nothing is READY) contributes zeros and still takes part, so nobody waits for a
//! rank that left. The group stops at the first step in which every member saw the ring's end.
//! The leader (lowest live rank) writes the one group checkpoint every N steps and at the end.
//!
//! A restarted rank is no longer a member (the launcher removed it when it died): it asks to
//! join and gets the live weights and optimizer state from the leader at a step boundary.
//!
//! Ledger lines are written (one `write` each, no user-space buffer) before the slot is
//! released, so a crash never loses the line of a batch whose slot was freed; every rank syncs
//! its ledger at each checkpoint step.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use collective::{Collective, ShmGroup, NO_BATCH};
use gpu::{BackendKind, DrafterBackend};
use proto::control::{FinalReport, ToLauncher};
use proto::ledger::{Ledger, LedgerLine};
use proto::BatchView;
use shm_ring::{Consumer, Phase, ReadSlot, Ring, Role, Take};
use worker_runtime::{setup, WorkerArgs};

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

/// Writes the checkpoint atomically: a crash leaves either the old checkpoint or the new one,
/// never half of one.
fn checkpoint(backend: &dyn DrafterBackend, path: &Path) -> anyhow::Result<()> {
    atomic_file::replace_with(path, |tmp| -> anyhow::Result<()> { Ok(backend.save(tmp)?) })
        .with_context(|| format!("writing the checkpoint {}", path.display()))
}

/// What the reduced buffer carries after the backend's gradient: one slot that counts the ranks
/// that saw the ring's end, one where the leader puts the next step's bucket plus one (0: none).
const EXTRA: usize = 2;

/// The drafter group's sizes for `drafters` ranks under `cfg`, starting at `initial_step`
/// (the launcher creates the group with them; the buffer adds one slot to the backend's).
pub fn group_params(
    backend: BackendKind,
    cfg: &proto::PipelineConfig,
    drafters: u32,
    initial_step: u32,
) -> Result<collective::GroupParams, gpu::GpuError> {
    let (grad, state) = gpu::drafter_sizes(backend, cfg)?;
    Ok(collective::GroupParams {
        ranks: drafters,
        buf_len: grad as u64 + EXTRA as u64,
        state_len: state as u64,
        initial_step,
    })
}

/// What a rank brings to a step.
enum Next<'c> {
    /// A verified batch, held until the step's update is applied.
    Batch(ReadSlot<'c>),
    /// Nothing READY and the ring is closed, but batches are still held elsewhere.
    Dry,
    /// The ring has ended: nothing READY, written or held anywhere.
    End,
}

/// Takes the batch for this step, from bucket `prefer` if it has one READY: waits while the
/// targets may still publish, gives up at once once the ring is closed. Corrupt batches are
/// refused (released) and counted.
fn next_batch<'c>(
    ring: &Ring,
    consumer: &'c Consumer<'_>,
    prefer: Option<u32>,
    refused: &mut u64,
) -> anyhow::Result<Next<'c>> {
    loop {
        // Closed: nothing more will be published, so a short look is enough; the batches still
        // held by other ranks are theirs.
        let closed = ring.is_closed();
        let timeout = Duration::from_millis(if closed { 1 } else { 200 });
        let slot = match consumer.take_timeout_preferring(prefer, timeout)? {
            Take::Item(slot) => slot,
            Take::End => return Ok(Next::End),
            Take::TimedOut if closed => return Ok(Next::Dry),
            Take::TimedOut => continue,
        };
        // The mock's copy-in is parsing and checksumming the batch in place.
        consumer.enter(Phase::CopyIn);
        let ok = BatchView::parse(slot.payload()).and_then(|v| v.verify());
        consumer.enter(Phase::Other);
        match ok {
            Ok(()) => return Ok(Next::Batch(slot)),
            Err(e) => {
                tracing::error!(batch = slot.meta().batch_id, error = %e, "refusing a corrupt batch");
                *refused += 1;
                slot.release()?;
            }
        }
    }
}

/// Runs the worker; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let s = setup(&args.common, Role::Consumer)?;
    let cfg = &s.config;
    for dir in [s.run_dir.ledger_dir(), s.run_dir.checkpoints_dir()] {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let ckpt = s.run_dir.checkpoint();
    let mut backend = gpu::drafter(s.backend, cfg, Some(s.name))?;
    let ledger_file = s.run_dir.ledger(s.index);
    let mut ledger = Ledger::open(&ledger_file)?;

    let ring = Ring::attach(&s.ring).with_context(|| format!("attaching to ring {}", s.ring))?;
    let group_name = proto::group_segment(&s.ring);
    let group = ShmGroup::attach(&group_name, s.index)
        .with_context(|| format!("attaching to the drafter group {group_name}"))?;
    let consumer = ring
        .consumer(s.index)
        .with_context(|| format!("registering as consumer {}", s.index))?;
    consumer.set_gpu(s.gpu);
    let epoch = consumer.epoch();
    // Injected faults that place a kill inside the group protocol (first incarnation only, so
    // the restarted rank gets through).
    let faults = cfg.faults_for(s.name);
    let first = epoch == 1;
    let die = |what: &str| -> ! {
        tracing::error!("injected crash {what}");
        std::process::abort();
    };
    let target_step = std::cell::Cell::new(0u64);
    // Waits in the group beat for us, so the launcher does not take a long sync for a hang.
    let beat = || {
        consumer.heartbeat();
        if first
            && faults
                .crash_in_sync_at
                .is_some_and(|n| target_step.get() >= n)
        {
            die("inside the reduction");
        }
        false
    };

    let start = group.membership();
    if start.contains(s.index) && !first {
        bail!(
            "restarted (incarnation {epoch}) but still a member of the drafter group: whoever \
             restarts a drafter must remove it from the group first"
        );
    }
    if start.contains(s.index) {
        // A first incarnation: every rank starts from the same state, the checkpoint's if any.
        if ckpt.exists() {
            backend
                .load(&ckpt)
                .with_context(|| "restoring the drafter; move the file away to start fresh")?;
        }
        if backend.step() != u64::from(start.step) {
            bail!(
                "the group starts at step {} but the drafter's state is at step {} ({}): \
                 a checkpoint from another run?",
                start.step,
                backend.step(),
                ckpt.display()
            );
        }
    } else {
        // Our own fallback, should nobody be left to hand us the live state: the checkpoint.
        if ckpt.exists() {
            backend.load(&ckpt)?;
        }
        consumer.enter(Phase::Sync);
        let mut state = vec![0u32; backend.state_len()];
        // Marker file: the join fault fires in one incarnation only.
        let marker = (s.run_dir.logs_dir()).join(format!(".{}-crashed-in-join", s.name));
        let joining = || {
            consumer.heartbeat();
            if faults.crash_in_join && !marker.exists() {
                let _ = std::fs::write(&marker, b"");
                die("while rejoining the group");
            }
            false
        };
        match group.join(&mut state, backend.step() as u32, &joining)? {
            (m, Some(step)) => {
                backend.import_state(&state)?;
                tracing::info!(
                    step,
                    epoch = m.epoch,
                    "joined the group with the leader's state"
                );
            }
            (m, None) => tracing::warn!(
                step = m.step,
                "the group was empty: it goes on from the last checkpoint; updates after it \
                 were lost with the ranks that made them"
            ),
        }
        consumer.enter(Phase::Other);
    }
    tracing::info!(ring = %s.ring, epoch, step = backend.step(), "attached");

    let n = backend.grad_len();
    // The summed buffer: the backend's gradient, loss sum and loss tokens, then `EXTRA`.
    let mut grad = vec![0f32; n + EXTRA];
    let mut sum = vec![0f32; n + EXTRA];
    let mut report = FinalReport::default();
    let buckets = ring.params().buckets;
    // The bucket of this step, drawn by the leader during the last one (None: the first step,
    // a step after the leader died, or `coherent` off).
    let mut prefer: Option<u32> = None;
    loop {
        let m = group.membership();
        let leader = m.leader() == Some(s.index);
        if leader && group.joiners_waiting() {
            consumer.enter(Phase::Sync);
            let admitted = group.admit_joiners(m.step, &backend.export_state())?;
            if admitted != 0 {
                tracing::info!(ranks = admitted, step = m.step, "admitted to the group");
            }
            consumer.enter(Phase::Other);
        }
        if s.stop.take_checkpoint_request() && leader {
            consumer.enter(Phase::Checkpoint);
            checkpoint(backend.as_ref(), &ckpt)?;
            consumer.enter(Phase::Other);
        }
        let next = next_batch(&ring, &consumer, prefer, &mut report.refused)?;
        let (slot, ended) = match next {
            Next::Batch(slot) => (Some(slot), false),
            Next::Dry => (None, false),
            Next::End => (None, true),
        };
        grad.fill(0.0);
        let mut held = None;
        let (mut batch, mut sample_ids, mut tokens) = (NO_BATCH, Vec::new(), 0);
        if let Some(slot) = slot {
            consumer.enter(Phase::Compute);
            let got = BatchView::parse(slot.payload())
                .map_err(|e| e.to_string())
                .and_then(|view| {
                    backend
                        .gradient(&view, &mut grad[..n])
                        .map_err(|e| e.to_string())?;
                    let spec = &view.header().spec;
                    Ok((spec.sample_ids.clone(), spec.tokens()))
                });
            consumer.enter(Phase::Other);
            match got {
                Ok((ids, t)) => {
                    (batch, sample_ids, tokens) = (slot.meta().batch_id, ids, t);
                    held = Some(slot);
                }
                Err(e) => {
                    // Content the checksum did not catch: refuse it, train nothing from it.
                    tracing::error!(batch = slot.meta().batch_id, error = %e, "refusing a corrupt batch");
                    report.refused += 1;
                    slot.release()?;
                    grad.fill(0.0);
                }
            }
        }
        grad[n] = if ended { 1.0 } else { 0.0 };
        // Length-coherent steps: the leader draws the next step's bucket now, in proportion to
        // what is READY, and the reduction hands it to every rank with the gradients (a redone
        // round carries it again; a round without the leader carries none).
        grad[n + 1] = 0.0;
        let m = group.membership();
        if cfg.drafter.coherent && m.leader() == Some(s.index) {
            if let Some(b) = consumer.draw_bucket(m.len()) {
                grad[n + 1] = (b + 1) as f32;
            }
        }
        consumer.enter(Phase::Sync);
        target_step.set(u64::from(group.membership().step) + 1);
        let red = group.all_reduce(&grad, batch, &mut sum, &beat)?;
        if first
            && held.is_some()
            && faults
                .crash_after_commit_at
                .is_some_and(|k| u64::from(red.step) >= k)
        {
            die("after the group applied this rank's batch, before its ledger line");
        }
        consumer.enter(Phase::Compute);
        let stats = backend.apply(&sum[..n]);
        consumer.enter(Phase::Other);
        if let Some(slot) = held {
            let meta = *slot.meta();
            let line = LedgerLine {
                batch_id: meta.batch_id,
                sample_ids,
                tokens,
                delivery: meta.delivery,
                ticket: meta.ticket,
                step: u64::from(red.step),
                digest: format!("{:016x}", backend.digest()),
                epoch,
            };
            ledger.append(&line)?;
            slot.release()?;
            report.items += 1;
            report.tokens += line.tokens;
        }
        tracing::debug!(
            step = red.step,
            loss = stats.loss,
            tokens = stats.tokens,
            "step"
        );
        if red.membership.leader() == Some(s.index) {
            if let Some(tx) = &s.to_launcher {
                // The launcher may be stopping and gone: the loss is telemetry, never fatal.
                let _ = tx.send(ToLauncher::Progress {
                    step: u64::from(red.step),
                    loss: stats.loss,
                    tokens: stats.tokens,
                });
            }
        }
        let everyone_ended = sum[n] as u32 == red.membership.len();
        // Two ranks that both thought they led (a membership change between their looks) sum
        // to a value that may name no bucket: then none is preferred.
        let drawn = sum[n + 1];
        prefer = (drawn >= 1.0 && drawn <= buckets as f32 && drawn.fract() == 0.0)
            .then(|| drawn as u32 - 1);
        let every = cfg.drafter.checkpoint_every.max(1);
        if everyone_ended || u64::from(red.step) % every == 0 {
            consumer.enter(Phase::Checkpoint);
            ledger.sync()?;
            if red.membership.leader() == Some(s.index) {
                checkpoint(backend.as_ref(), &ckpt)?;
            }
            consumer.enter(Phase::Other);
        }
        if everyone_ended {
            break;
        }
    }
    // The ring ended, so the drafter's part is complete even if a stop was requested.
    report.complete = true;
    tracing::info!(
        items = report.items,
        tokens = report.tokens,
        step = backend.step(),
        digest = format!("{:016x}", backend.digest()),
        "drained"
    );
    if let Some(tx) = &s.to_launcher {
        let _ = tx.send(ToLauncher::Report(report));
    }
    Ok(0)
}
