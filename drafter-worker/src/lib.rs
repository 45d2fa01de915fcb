//! The drafter worker: one rank of the drafter group, which trains ONE model data-parallel.
//!
//! Each group step: take at most one batch from the ring, verify it, compute the gradient of its
//! summed loss, all-reduce with the other ranks (the `collective` crate), apply the identical
//! update, append one ledger line (step and weights digest), and only then release the slot: a
//! batch is held until the update that used it is applied.
//!
//! Prefetch: before a step computes, the rank takes the next step's batch (if one is READY; the
//! ring lets a drafter hold two) and verifies it on a copy thread ([`gpu::prefetch`] with the
//! [`gpu::in_place`] engine), so the checksum of batch `s+1` runs under step `s`'s compute
//! instead of in front of it. A batch prefetched and not trained goes back to the ring. A rank with no batch (the ring is
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
//!
//! Length: about 600 lines: the rank's step, its group duties, ledger and checkpoints are one
//! loop.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Parser;
use collective::split::{Board, SplitGroup};
use collective::{Collective, Membership, Reduced, NO_BATCH};
use cuda::nccl_group::NcclTransport;
use gpu::{BackendKind, DeviceClock, DrafterBackend, StepBuffer, StepStats};
use proto::config::CollectiveKind;
use proto::control::{FinalReport, ToLauncher};
use proto::ledger::{self, Ledger, LedgerError, LedgerLine, LostSteps};
use shm_ring::{Consumer, Phase, ReadSlot, Ring, Role};
use worker_runtime::{setup, Setup, WorkerArgs};

mod faults;
mod intake;
mod save;
mod taken;
use faults::InjectedFaults;
use intake::{intake, Intake};
use save::{save_step, Failing};

/// Train one drafter on batches from the ring.
///
/// Started by the launcher with `--control`; standalone (for tests and debugging) with
/// `--ring`, `--run-dir` and optionally `--config`:
///
///   drafter-worker --index 0 --ring hspipe-run1 --run-dir runs/run1
///
/// Writes <run-dir>/ledger/drafter-<i>.jsonl; the group's leader writes
/// <run-dir>/checkpoints/drafter.safetensors and, for a drafter an engine serves (DFlash), its
/// export <run-dir>/drafter/ (kept as <run-dir>/drafter-steps/step-<S>/ at the steps
/// `[drafter] keep_export_every` names).
/// A stop request (a stop signal, or Stop from the launcher) lets it drain: targets stop, the
/// ring closes, the drafter trains what is left, checkpoints and exits 0. Exit 1 on error.
#[derive(Parser, Debug)]
#[command(name = "drafter-worker", version, verbatim_doc_comment)]
pub struct Args {
    #[command(flatten)]
    pub common: WorkerArgs,
}

/// The drafter group's sizes for `drafters` ranks under `cfg`, starting at `initial_step`
/// (the launcher creates the group with them; the buffer is a [`StepBuffer`] for the backend's
/// gradient).
pub fn group_params(
    backend: BackendKind,
    cfg: &proto::PipelineConfig,
    drafters: u32,
    initial_step: u32,
) -> Result<collective::GroupParams, gpu::GpuError> {
    let (grad, state) = gpu::drafter_sizes(backend, cfg)?;
    // On NCCL the gradient goes between the GPUs; the segment's rounds carry the rest.
    let buf_len = match cfg.drafter.collective {
        CollectiveKind::Nccl => StepBuffer::tail_len(),
        CollectiveKind::Auto | CollectiveKind::Shm => StepBuffer::len_for(grad),
    };
    Ok(collective::GroupParams {
        ranks: drafters,
        buf_len: buf_len as u64,
        state_len: state as u64,
        initial_step,
    })
}

/// A batch this rank computed its gradient on, held until the step's update is applied.
/// Dropped without [`Rank::record`] (an error between the take and the ledger line: the worker
/// is exiting), its slot is left READING for the launcher's recovery, which retires the batch if
/// the group applied its update and redelivers it otherwise; released here, it would count as
/// consumed with no ledger line: lost.
struct Held<'c> {
    slot: Option<ReadSlot<'c>>,
    sample_ids: Vec<u64>,
    tokens: u64,
}

impl<'c> Held<'c> {
    fn new(slot: ReadSlot<'c>, sample_ids: Vec<u64>, tokens: u64) -> Self {
        Held {
            slot: Some(slot),
            sample_ids,
            tokens,
        }
    }

    fn slot(&self) -> &ReadSlot<'c> {
        self.slot.as_ref().expect("held until recorded")
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            tracing::warn!(
                batch = slot.meta().batch_id,
                "leaving a batch in training to the launcher's recovery"
            );
            std::mem::forget(slot);
        }
    }
}

/// What a rank brings to a step.
enum Next<'c> {
    /// A verified batch and its gradient (in the step buffer).
    Batch(Held<'c>),
    /// No batch: nothing READY and the ring is closed but batches are still held elsewhere, or
    /// the batch taken was refused for its content.
    Nothing,
    /// The ring has ended: nothing READY, written or held anywhere.
    End,
}

/// One rank of the group: what it holds for the whole run.
struct Rank<'c, 'r> {
    s: &'c Setup,
    ring: &'r Ring,
    consumer: &'c Consumer<'r>,
    group: Box<dyn Collective>,
    backend: Box<dyn DrafterBackend + Send>,
    ledger: Ledger,
    ckpt: PathBuf,
    faults: InjectedFaults,
    report: FinalReport,
    /// Taken batches: this step's (computing) and the next one's (being verified).
    intake: Intake<'c>,
    /// Whether the ring lets this rank hold the next step's batch while it trains one.
    prefetching: bool,
    /// The buckets of this step and of the next, drawn by the leader in earlier steps' reductions
    /// (the next one's, when prefetching: its batch is taken during this step); None for the
    /// first steps, a step after the leader died, or `coherent` off.
    prefer: [Option<u32>; 2],
    /// The device's timeline of a backend that times its work there: drained after each step.
    clock: Option<Arc<dyn DeviceClock>>,
    /// The gradient's words in a step buffer: the backend's gradient, or none when it stays on
    /// the device for NCCL.
    grad_words: usize,
    /// The step of the last checkpoint this rank wrote.
    checkpointed: Option<u32>,
    /// The step of the last export that failed, until one is written: the end's checkpoint
    /// step writes it again even where its checkpoint was written.
    export_failed: Option<u32>,
    /// The step after which this rank (as leader) last evaluated the drafter.
    evaluated: Option<u64>,
}

/// Runs the worker; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let s = setup(&args.common, Role::Consumer)?;
    for dir in [s.run_dir.ledger_dir(), s.run_dir.checkpoints_dir()] {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut backend = gpu::drafter(s.backend, &s.config, Some(s.name))?;
    worker_runtime::model_loaded();
    let mut ledger = Ledger::open(&s.run_dir.ledger(s.index))?;
    if let Some(tries) = s.config.faults_for(s.name).ledger_full_for {
        ledger.inject_full(tries);
    }
    let ring = Ring::attach(&s.ring).with_context(|| format!("attaching to ring {}", s.ring))?;
    let _pinned = gpu::pin_arena(s.backend, &ring);
    let (group, grad_words) = attach_group(&s, backend.as_mut())?;
    let consumer = ring
        .consumer(s.index)
        .with_context(|| format!("registering as consumer {}", s.index))?;
    consumer.set_gpu(s.gpu);
    let stager = backend.stager();
    let clock = backend.device_clock();
    if clock.is_some() {
        consumer.set_device_timed(true);
    }
    let mut rank = Rank {
        s: &s,
        ring: &ring,
        consumer: &consumer,
        group,
        backend,
        ledger,
        ckpt: s.run_dir.checkpoint(),
        faults: InjectedFaults {
            faults: s.config.faults_for(s.name),
            first: consumer.epoch() == 1,
            reducing: Cell::new(0),
            join_marker: s.run_dir.join_crash_marker(s.name),
            export_failed: Cell::new(false),
        },
        report: FinalReport::default(),
        intake: intake(stager),
        prefetching: ring.params().held_per_consumer >= 2,
        prefer: [None, None],
        clock,
        grad_words,
        checkpointed: None,
        export_failed: None,
        evaluated: None,
    };
    rank.enter_group()?;
    tracing::info!(ring = %s.ring, epoch = consumer.epoch(), step = rank.backend.step(), "attached");
    if let Some(what) = rank.train()? {
        tracing::error!("{}{what}", proto::stop::OUTSIDE_SIGNAL);
        return Ok(proto::stop::EXIT_STOPPED);
    }
    rank.drained();
    Ok(0)
}

/// A rank's wait for space on a full disk to write `what` (`write`: an append that waits,
/// [`worker_runtime::space::wait_for_space`]): said once in its log, with the file, and once
/// more when the line is written; the rank beats its heartbeat meanwhile (the launcher would
/// kill a silent rank as hung). A stop signal from outside the launcher ends the wait with the
/// error, as a full disk used to end the rank ([`StopFlags::ends_wait`]); the launcher's
/// ordered stop does not, since it needs the line.
///
/// [`StopFlags::ends_wait`]: worker_runtime::StopFlags::ends_wait
fn wait_for_space<R>(
    s: &Setup,
    consumer: &Consumer<'_>,
    what: &str,
    meanwhile: &str,
    write: impl FnOnce(&mut dyn FnMut(&LedgerError) -> bool) -> Result<R, LedgerError>,
) -> anyhow::Result<R> {
    let launched = s.to_launcher.is_some();
    let mut beat = || {
        consumer.heartbeat();
        !s.stop.ends_wait(launched)
    };
    worker_runtime::space::wait_for_space(what, meanwhile, &mut beat, write).map_err(|e| {
        // A full disk's error is returned only once the wait was ended.
        if e.is_full() {
            anyhow::Error::new(e).context("a stop signal ended the wait for space")
        } else {
            e.into()
        }
    })
}

/// This rank's handle on the group: the shared-memory group, with the gradient on NCCL when the
/// run's `[drafter] collective` is (the launcher settled `auto`), kept on the device when the
/// backend can; and the gradient's words in a step buffer.
fn attach_group(
    s: &Setup,
    backend: &mut (dyn DrafterBackend + Send),
) -> anyhow::Result<(Box<dyn Collective>, usize)> {
    let name = proto::group_segment(&s.ring);
    let shm = collective::ShmGroup::attach(&name, s.index)
        .with_context(|| format!("attaching to the drafter group {name}"))?;
    if s.config.drafter.collective != CollectiveKind::Nccl {
        return Ok((Box::new(shm), backend.grad_len()));
    }
    let nccl = cuda::nccl::Nccl::load().context("[drafter] collective = \"nccl\"")?;
    // The worker's GPU is device 0 (CUDA_VISIBLE_DEVICES); its primary context, candle's too.
    let ctx = cuda::Driver::load()?.open(0)?;
    let board = Board::new(&s.run_dir.nccl_dir(&s.ring))?;
    let on_device = (backend.gradient_on_device()).context("keeping the gradient on the GPU")?;
    let words = if on_device.is_some() {
        0
    } else {
        backend.grad_len()
    };
    let transport = match on_device {
        Some(grad) => NcclTransport::on_device(nccl, ctx, board, grad),
        None => NcclTransport::new(nccl, ctx, board),
    };
    tracing::info!(
        version = ?nccl.version(),
        on_device = words == 0,
        "the group's gradients go through NCCL"
    );
    Ok((
        Box::new(SplitGroup::new(Box::new(shm), words, transport)),
        words,
    ))
}

impl<'c, 'r> Rank<'c, 'r> {
    fn is_leader(&self, m: &Membership) -> bool {
        m.leader() == Some(self.s.index)
    }

    /// Starts from the group's state: a first incarnation from the checkpoint (if any), which
    /// must be at the group's step; a restarted one by joining with the leader's live state.
    fn enter_group(&mut self) -> anyhow::Result<()> {
        let start = self.group.membership();
        let first = self.faults.first;
        if start.contains(self.s.index) && !first {
            bail!(
                "restarted (incarnation {}) but still a member of the drafter group: whoever \
                 restarts a drafter must remove it from the group first",
                self.consumer.epoch()
            );
        }
        if start.contains(self.s.index) {
            self.start_first(&start)
        } else {
            self.rejoin()
        }
    }

    /// A first incarnation: every rank starts from the same state, the checkpoint's if any.
    fn start_first(&mut self, start: &Membership) -> anyhow::Result<()> {
        if self.ckpt.exists() {
            self.backend
                .load(&self.ckpt)
                .with_context(|| "restoring the drafter; move the file away to start fresh")?;
        }
        if self.backend.step() != u64::from(start.step) {
            bail!(
                "the group starts at step {} but the drafter's state is at step {} ({}): \
                 a checkpoint from another run?",
                start.step,
                self.backend.step(),
                self.ckpt.display()
            );
        }
        Ok(())
    }

    /// A restarted rank asks to join and gets the leader's live state.
    fn rejoin(&mut self) -> anyhow::Result<()> {
        // Our own fallback, should nobody be left to hand us the live state: the checkpoint.
        if self.ckpt.exists() {
            self.backend.load(&self.ckpt)?;
        }
        self.consumer.enter(Phase::Sync);
        let mut state = vec![0u32; self.backend.state_len()];
        let joining = || {
            self.consumer.heartbeat();
            self.faults.in_join();
            false
        };
        let own = self.backend.step();
        match self.group.join(&mut state, own as u32, &joining)? {
            (m, Some(round)) => {
                // The state's own step is the leader's (one behind the round after an end
                // round, which applied nothing).
                self.backend.import_state(&state)?;
                tracing::info!(
                    step = self.backend.step(),
                    round,
                    epoch = m.epoch,
                    "joined the group with the leader's state"
                );
            }
            (m, None) => {
                // Alone now, nobody else writes the checkpoint: the one loaded before the join
                // may have been replaced since by a rank that then died. What is lost is what
                // the newest one lacks.
                if self.ckpt.exists() {
                    self.backend.load(&self.ckpt)?;
                }
                let own = self.backend.step();
                // The group's state is of its last committed round, unless that round was its
                // end, which applied nothing: then it is of the step before, and the round is
                // neither an update lost nor a step to move ours past (the end's checkpoint is
                // of that step, as the others wrote it).
                let group = u64::from(m.state_step(self.group.ended()));
                if group < u64::from(m.step) {
                    tracing::info!(
                        round = m.step,
                        step = group,
                        "the group's last round was its end, which applied no update"
                    );
                }
                if let Some(lost) = LostSteps::between(self.s.index, own, group) {
                    // Recorded before any update of ours: the summary counts those batches
                    // untrained, and a resume trains them again.
                    self.record_lost(&lost)?;
                    self.backend.skip_to(group);
                    tracing::warn!(checkpoint = own, "{lost}");
                } else {
                    tracing::warn!(step = own, "the group was empty: it goes on from our state");
                }
            }
        }
        self.consumer.enter(Phase::Other);
        Ok(())
    }

    /// Group steps until the first one in which every member saw the ring's end; or, on a stop
    /// signal the launcher did not send ([`StopFlags::outside_signal`]), until the step after
    /// it: the rank leaves the group between steps, as a crash would, and the launcher restarts
    /// it (it rejoins with the live state). Returns that signal, in words. A rank alone in the
    /// group checkpoints first, so that its restart, with no one to hand it the live state,
    /// loses no update. The launcher's own stop (its Stop) is drained as before: the ring
    /// closes, and the group trains what is left.
    ///
    /// [`StopFlags::outside_signal`]: worker_runtime::StopFlags::outside_signal
    fn train(&mut self) -> anyhow::Result<Option<String>> {
        let n = self.grad_words;
        let (mut mine, mut sum) = (StepBuffer::new(n), StepBuffer::new(n));
        let launched = self.s.to_launcher.is_some();
        while !self.step(&mut mine, &mut sum)? {
            let Some(what) = self.s.stop.outside_signal(launched) else {
                continue;
            };
            let m = self.group.membership();
            let step = self.backend.step() as u32;
            if m.len() == 1 && self.is_leader(&m) && self.checkpointed != Some(step) {
                self.consumer.enter(Phase::Checkpoint);
                self.ledger.sync()?;
                self.write_checkpoint(step);
                self.consumer.enter(Phase::Other);
            }
            return Ok(Some(what));
        }
        Ok(None)
    }

    /// One group step: take at most one batch and compute its gradient, all-reduce, apply the
    /// update, write the ledger line, release. Returns true once every member saw the end.
    fn step(&mut self, mine: &mut StepBuffer, sum: &mut StepBuffer) -> anyhow::Result<bool> {
        self.between_steps()?;
        mine.clear();
        let next = self.take_and_compute(mine)?;
        mine.set_ended(matches!(next, Next::End));
        let held = match next {
            Next::Batch(h) => Some(h),
            Next::Nothing | Next::End => None,
        };
        self.draw_next_bucket(mine);
        let batch = held.as_ref().map_or(NO_BATCH, |h| h.slot().meta().batch_id);
        if mine.ended_ranks() > 0 {
            // The group's last round may be this one: the checkpoint written after it must
            // not hold an update whose line is not durable yet.
            self.ledger.sync()?;
        }
        let red = self.reduce(mine, batch, sum)?;
        self.faults.after_commit(red.step, held.is_some());
        let everyone_ended = sum.ended_ranks() == red.membership.len();
        if everyone_ended {
            self.faults.in_end_round();
            // Marked first thing, by every member: a rank that dies in this round and joins
            // the emptied group later learns there that the round applied nothing.
            (self.group).mark_ended(red.step, self.backend.step() as u32);
        }
        self.checkpoint_before_update(&red)?;
        let mut stats = if everyone_ended {
            // The group's last round: every member saw the ring's end, so none brought a batch.
            // It is the barrier at which the group agrees it is done, not a training step: no
            // update, and the weights, the end's checkpoint and its export stay those of the
            // last step. (Applied as an empty step, each launch's end added one: a run stopped
            // and resumed numbered its steps, kept exports and schedule one further per launch
            // than a run never stopped.)
            StepStats {
                step: self.backend.step(),
                ..StepStats::default()
            }
        } else {
            self.consumer.enter(Phase::Compute);
            let stats = (self.backend.apply(sum)).context("applying the group's update")?;
            self.consumer.enter(Phase::Other);
            stats
        };
        if let Some(h) = held {
            self.record(h, red.step)?;
        }
        self.device_spans();
        let eval_due = if everyone_ended {
            self.evaluated != Some(stats.step)
        } else {
            self.backend.eval_due(stats.step)
        };
        if self.is_leader(&red.membership) && eval_due {
            self.evaluated = Some(stats.step);
            // Telemetry: an evaluation that fails is said, never fatal. It beats before and
            // after (the launcher's hang timeout is for longer than any evaluation here).
            // The decoding is model work on the device: compute, as the step's.
            self.consumer.heartbeat();
            self.consumer.enter(Phase::Compute);
            let eval = self.backend.evaluate();
            self.consumer.enter(Phase::Other);
            self.consumer.heartbeat();
            match eval {
                Ok(tau) => stats.eval_tau = tau,
                Err(e) => tracing::warn!(error = %e, "evaluating the drafter"),
            }
        }
        if !everyone_ended || stats.eval_tau.is_some() {
            // The last round's report is only its evaluation's: its step is the last one's.
            self.progress(&red, &stats);
        }
        // The draw is for the next batch taken in every rank's step order: the next step's, or,
        // when the next step's was prefetched already, the one after.
        let drawn = sum.bucket(self.ring.params().buckets);
        self.prefer = if self.prefetching {
            [self.prefer[1], drawn]
        } else {
            [drawn, drawn]
        };
        self.checkpoint_if_due(&red, everyone_ended)?;
        Ok(everyone_ended)
    }

    /// The leader's duty between steps: admit restarted ranks. (Checkpoints are written only
    /// where the ledgers allow: [`Rank::checkpoint_before_update`], [`Rank::checkpoint_if_due`].)
    fn between_steps(&mut self) -> anyhow::Result<()> {
        let m = self.group.membership();
        let leader = self.is_leader(&m);
        if leader && self.group.joiners_waiting() {
            self.consumer.enter(Phase::Sync);
            let state = (self.backend.export_state()).context("exporting the group's state")?;
            let admitted = (self.group).admit_joiners(m.step, &state)?;
            if admitted != 0 {
                tracing::info!(ranks = admitted, step = m.step, "admitted to the group");
            }
            self.consumer.enter(Phase::Other);
        }
        Ok(())
    }

    /// Frees a corrupt batch unused (the ring counts it refused, not trained), and counts it.
    fn refuse(&mut self, slot: ReadSlot<'c>, e: &dyn std::fmt::Display) -> anyhow::Result<()> {
        tracing::error!(batch = slot.meta().batch_id, error = %e, "refusing a corrupt batch");
        self.report.refused += 1;
        slot.refuse()?;
        Ok(())
    }

    /// Length-coherent steps: the leader draws the next step's bucket now, in proportion to what
    /// is READY, and the reduction hands it to every rank with the gradients (a redone round
    /// carries it again; a round without the leader carries none).
    fn draw_next_bucket(&self, mine: &mut StepBuffer) {
        let m = self.group.membership();
        let drawn = if self.s.config.drafter.coherent && self.is_leader(&m) {
            self.consumer.draw_bucket(m.len())
        } else {
            None
        };
        mine.set_bucket(drawn);
    }

    /// The all-reduce of this step; waits in it beat for us, so the launcher does not take a
    /// long sync for a hang.
    fn reduce(
        &self,
        mine: &StepBuffer,
        batch: u64,
        sum: &mut StepBuffer,
    ) -> anyhow::Result<Reduced> {
        self.consumer.enter(Phase::Sync);
        (self.faults.reducing).set(u64::from(self.group.membership().step) + 1);
        let beat = || {
            self.consumer.heartbeat();
            self.faults.in_sync();
            false
        };
        Ok(self
            .group
            .all_reduce(mine.words(), batch, sum.words_mut(), &beat)?)
    }

    /// Writes the batch's ledger line (one `write`), then releases its slot: a batch whose slot
    /// was released has its line in the file.
    fn record(&mut self, mut held: Held<'c>, step: u32) -> anyhow::Result<()> {
        let meta = *held.slot().meta();
        let line = LedgerLine {
            batch_id: meta.batch_id,
            sample_ids: std::mem::take(&mut held.sample_ids),
            tokens: held.tokens,
            delivery: meta.delivery,
            ticket: meta.ticket,
            step: u64::from(step),
            digest: format!("{:016x}", self.backend.digest()),
            epoch: self.consumer.epoch(),
        };
        self.append_waiting(&line)?;
        held.slot.take().expect("held until recorded").release()?;
        self.report.items += 1;
        self.report.tokens += line.tokens;
        Ok(())
    }

    /// Appends `line` to the ledger, waiting for space while the disk is full
    /// ([`Ledger::append_waiting`]: the line gets in once and whole). The rank holds the batch
    /// meanwhile, as any step does until its line is written; the other ranks wait for this
    /// one in the next reduction. See [`wait_for_space`].
    fn append_waiting(&mut self, line: &LedgerLine) -> anyhow::Result<()> {
        let what = format!("the ledger line of batch {}", line.batch_id);
        let meanwhile = "the rank holds the batch and beats meanwhile; the group waits for it";
        let ledger = &mut self.ledger;
        wait_for_space(self.s, self.consumer, &what, meanwhile, |waiting| {
            ledger.append_waiting(line, waiting)
        })?;
        Ok(())
    }

    /// Records the steps `lost` (`lost-steps.jsonl`), waiting for space while the disk is full
    /// as a ledger line does: before, a full disk ended the rank there, and each restart,
    /// finding the group empty again, died at the same line.
    fn record_lost(&self, lost: &LostSteps) -> anyhow::Result<()> {
        let what = format!("the record of lost steps {}..={}", lost.first, lost.last);
        let meanwhile = "the rank beats meanwhile and trains on once it is written";
        let run_dir = &self.s.run_dir;
        (wait_for_space(self.s, self.consumer, &what, meanwhile, |waiting| {
            ledger::record_lost(run_dir, lost, waiting)
        }))
        .context("recording the group's lost updates")
    }

    /// The leader sends the step and its loss to the launcher.
    fn progress(&self, red: &Reduced, stats: &StepStats) {
        tracing::debug!(
            step = red.step,
            loss = stats.loss,
            tokens = stats.tokens,
            "step"
        );
        if self.is_leader(&red.membership) {
            if let Some(tx) = &self.s.to_launcher {
                // The launcher may be stopping and gone: the loss is telemetry, never fatal.
                let _ = tx.send(ToLauncher::Progress(*stats));
            }
        }
    }

    /// Every `checkpoint_every` steps and at the end: every rank syncs its ledger (before it
    /// contributes to another round). The leader writes the group's checkpoint at the end
    /// here; a periodic one once the next round commits ([`Rank::checkpoint_before_update`]).
    fn checkpoint_if_due(&mut self, red: &Reduced, everyone_ended: bool) -> anyhow::Result<()> {
        if everyone_ended || self.checkpoint_step(red.step) {
            self.consumer.enter(Phase::Checkpoint);
            self.ledger.sync()?;
            // A lone rank's own line is the only one: it need not wait for the next round,
            // which a crash or a hang of its own may never let come. The end's checkpoint is of
            // the last step (the last round applied nothing), unless that step's commit wrote
            // it already ([`Rank::checkpoint_before_update`]).
            let alone = red.membership.len() == 1;
            let step = self.backend.step() as u32;
            let written = self.checkpointed == Some(step)
                && !(everyone_ended && self.export_failed == Some(step));
            if (everyone_ended || alone) && self.is_leader(&red.membership) && !written {
                self.write_checkpoint(step);
            }
            self.consumer.enter(Phase::Other);
        }
        Ok(())
    }

    /// The checkpoint of step S is written once round S + 1 commits, before its update: the
    /// weights are still S's, and every member of the round had synced its ledger line of S
    /// before contributing to it (a rank that died instead was removed first, its line the
    /// launcher's). Written right after S, it could hold the update of a batch whose line a
    /// slower rank had not yet made durable: a resume from it, not finding the line, trained
    /// that batch a second time. Whoever leads at the commit writes it (a rank admitted at S
    /// holds S's weights too).
    fn checkpoint_before_update(&mut self, red: &Reduced) -> anyhow::Result<()> {
        let done = red.step.wrapping_sub(1);
        if !self.checkpoint_step(done)
            || !self.is_leader(&red.membership)
            || self.backend.step() != u64::from(done)
            || self.checkpointed == Some(done)
        {
            return Ok(());
        }
        self.consumer.enter(Phase::Checkpoint);
        self.write_checkpoint(done);
        self.consumer.enter(Phase::Other);
        Ok(())
    }

    /// Whether a periodic checkpoint is due after `step` (`[drafter] checkpoint_every`).
    fn checkpoint_step(&self, step: u32) -> bool {
        let every = self.s.config.drafter.checkpoint_every.max(1);
        step > 0 && u64::from(step) % every == 0
    }

    /// Writes the export of step `step` (the weights' now), keeps it where
    /// `[drafter] keep_export_every` says, then writes the checkpoint ([`save_step`]: in that
    /// order, and the checkpoint even where the export failed), and tells the launcher what it
    /// wrote. A part that fails does not end the rank: training goes on, and a checkpoint that
    /// failed is tried again at the next checkpoint step.
    fn write_checkpoint(&mut self, step: u32) {
        let kept = (self.s.config.drafter.keeps_export(u64::from(step)))
            .then(|| self.s.run_dir.kept_export(u64::from(step)));
        let report = save_step(
            self.backend.as_ref(),
            step,
            &self.s.run_dir.export_dir(),
            kept.as_deref(),
            &self.ckpt,
            Failing {
                checkpoint: self.faults.checkpoint_fails(step),
                export: self.faults.export_fails(step),
            },
        );
        if report.checkpoint.is_none() {
            self.checkpointed = Some(step);
        }
        self.export_failed = report.export.is_some().then_some(step);
        if let Some(tx) = &self.s.to_launcher {
            // The launcher may be stopping and gone: the report is for its console and summary.
            let _ = tx.send(ToLauncher::Saved(report));
        }
    }

    /// Moves the device's resolved spans into the ring.
    fn device_spans(&mut self) {
        let c = self.consumer;
        gpu::device_time::drain_or_stop(
            &mut self.clock,
            |s| c.record_device(s),
            || c.set_device_timed(false),
        );
    }

    /// The ring ended, so the drafter's part is complete even if a stop was requested.
    fn drained(mut self) {
        self.device_spans();
        if let Some(c) = &self.clock {
            tracing::info!(device = %c.totals(), "the device's time");
        }
        self.report.complete = true;
        tracing::info!(
            items = self.report.items,
            tokens = self.report.tokens,
            step = self.backend.step(),
            digest = format!("{:016x}", self.backend.digest()),
            "drained"
        );
        if let Some(tx) = &self.s.to_launcher {
            let _ = tx.send(ToLauncher::Report(self.report));
        }
    }
}
