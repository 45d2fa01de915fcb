//! The target worker: claims planned batches through the ring (faster targets claim more),
//! gathers the next batch while the current one computes, runs the target forward into the ring
//! slot (on a GPU, the forward of the next batch runs while the results of this one are copied
//! into its slot: `pipeline.rs`), marks the work item done and publishes. Calls `finish()` once every batch is
//! published (waiting meanwhile for batches other targets hold, which come back if they die), so
//! the last target to finish closes the ring.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use proto::control::{FinalReport, ToLauncher};
use proto::stop::EXIT_STOPPED;
use proto::{batch_len, BatchSpec};
use shm_ring::{Phase, Ring, Role, WorkClaim};
use worker_runtime::{setup, WorkerArgs};

use dataset::Dataset;
use proto::plan::{plan, PlannedBatch};

mod pipeline;
pub use pipeline::Pipeline;

/// Run one target model: claim planned batches from the ring's work table, compute hidden
/// states into ring slots, publish.
///
/// Started by the launcher with `--control`; standalone (for tests and debugging) with
/// `--ring`, `--run-dir` and optionally `--config`:
///
///   target-worker --index 0 --ring hspipe-run1 --run-dir runs/run1 --config run.toml
///
/// Exit codes: 0 when the data is done, 3 when stopped on request first, 1 on error.
#[derive(Parser, Debug)]
#[command(name = "target-worker", version, verbatim_doc_comment)]
pub struct Args {
    #[command(flatten)]
    pub common: WorkerArgs,
}

/// A batch the prefetch thread gathered: its samples' ids and masks copied out of the dataset,
/// ready to compute (the Python target's claims are these too).
pub struct Gathered {
    pub item: u64,
    pub spec: BatchSpec,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    pub bucket: u32,
    /// Its last target died with it (`WorkClaim::Returned`): run it alone.
    pub alone: bool,
}

/// Gathers planned batch `item` (`b`) from `data` for `producer`.
pub fn gather(
    item: u64,
    b: &PlannedBatch,
    data: &Dataset,
    s: &proto::PipelineConfig,
    producer: u32,
) -> Gathered {
    let mut input_ids = Vec::with_capacity(b.tokens as usize);
    let mut loss_mask = Vec::with_capacity(b.tokens as usize);
    let mut seq_lens = Vec::with_capacity(b.sample_ids.len());
    for &id in &b.sample_ids {
        // The plan holds only ids of the dataset it was computed from.
        let Some(sample) = data.sample(id) else {
            continue;
        };
        input_ids.extend_from_slice(&sample.input_ids);
        match sample.loss_mask {
            Some(m) => loss_mask.extend_from_slice(&m),
            None => loss_mask.resize(input_ids.len(), 1),
        }
        seq_lens.push(sample.input_ids.len() as u32);
        // Copied out: the folio around it need not stay in this process's resident size.
        data.unmap_resident();
    }
    Gathered {
        item,
        spec: BatchSpec {
            batch_id: item,
            producer,
            sample_ids: b.sample_ids.clone(),
            seq_lens,
            dtype: s.model.dtype,
            layers: s.model.layers,
            hidden: s.model.hidden,
        },
        input_ids,
        loss_mask,
        bucket: b.bucket,
        alone: false,
    }
}

/// The dataset a target reads: the one `cfg` names (`dataset::Dataset::load` over its `data`
/// fields). The launcher plans the run and sizes the ring with this same function, so the two
/// can never read different data from one config; and a file replaced at `data.prepared` since
/// (its key not `data.prepared_key`) is refused, not mapped in place of the run's.
pub fn load_dataset(cfg: &proto::PipelineConfig) -> Result<Dataset, dataset::DataError> {
    let d = &cfg.data;
    let synthetic = dataset::Synthetic {
        samples: d.synthetic_samples,
        min_len: d.min_len,
        max_len: d.max_len,
        seed: d.seed,
        vocab: d.synthetic_vocab.unwrap_or(dataset::SYNTHETIC_VOCAB),
        language: d.synthetic_language.unwrap_or(false),
    };
    Dataset::load(
        d.prepared.as_deref(),
        d.prepared_key.as_deref(),
        d.path.as_deref(),
        synthetic,
    )
}

/// The target's main loop: takes the batches the prefetch thread gathered from `rx`, reserves a
/// slot for each, submits it to the pipeline and commits as the backend's depth allows, until
/// `rx` ends; returns whether it stopped on request (the claims it gave back unpublished).
/// Nothing submitted is left uncommitted: a held batch is committed before any wait (see
/// `pipeline.rs`).
pub fn produce(
    rx: &mpsc::Receiver<Gathered>,
    pipe: &mut Pipeline<'_, '_>,
    stopping: &dyn Fn() -> bool,
    report: &mut FinalReport,
) -> anyhow::Result<bool> {
    let producer = pipe.producer();
    let mut stopped = false;
    loop {
        let next = if pipe.in_flight() == 0 {
            // Waiting for the prefetch thread's next batch counts as loading. This thread beats
            // the heartbeat while it waits: the prefetch thread's claims do not.
            producer.enter(Phase::Load);
            let got = loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Err(mpsc::RecvTimeoutError::Timeout) => producer.heartbeat(),
                    got => break got,
                }
            };
            producer.enter(Phase::Other);
            match got {
                Ok(next) => next,
                Err(_) => break,
            }
        } else {
            match rx.try_recv() {
                Ok(next) => next,
                // Not gathered yet: commit before waiting (the prefetch thread may be
                // waiting for the batch held here to settle).
                Err(mpsc::TryRecvError::Empty) => {
                    pipe.commit_oldest()?;
                    continue;
                }
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        };
        if stopping() {
            // Stopping: give back what was claimed but not published.
            producer.unclaim_work(next.item)?;
            stopped = true;
            continue;
        }
        let len = batch_len(&next.spec)? as usize;
        // A slot at once if one is free; otherwise commit what is held (the drafters may
        // need it to free one), then wait, keeping an eye on stop requests: with every
        // drafter gone the ring stays full, and a stop must still get through.
        let mut slot = None;
        if pipe.in_flight() > 0 {
            slot = producer.reserve_timeout(len, Duration::ZERO)?;
            if slot.is_none() {
                while pipe.in_flight() > 0 {
                    pipe.commit_oldest()?;
                }
            }
        }
        while slot.is_none() {
            slot = producer.reserve_timeout(len, Duration::from_millis(200))?;
            if slot.is_none() && stopping() {
                break;
            }
        }
        let Some(slot) = slot else {
            producer.unclaim_work(next.item)?;
            stopped = true;
            continue;
        };
        pipe.submit(slot, next)?;
        while !pipe.has_room() {
            pipe.commit_oldest()?;
        }
    }
    while pipe.in_flight() > 0 {
        pipe.commit_oldest()?;
    }
    // Every batch the pipeline committed (a drain before a batch run alone commits some too).
    let t = pipe.totals();
    (report.items, report.tokens) = (t.items, t.tokens);
    Ok(stopped)
}

/// Runs the target's loop ([`produce`]) on `pipe` with a prefetch thread that claims the next
/// batch and gathers it (`gather`) while the current one computes; returns whether it stopped
/// on request. The channel holds one batch, so at most the backend's depth + 2 claims are
/// outstanding (submitted, in the channel, being gathered). Nothing FREE does not mean done: an
/// item another target holds comes back if it dies (and nobody may restart it), so the prefetch
/// thread waits for held items to settle, claiming what comes back, and looks at stop requests
/// between waits. It ends when the loop does, whichever way: an error in the loop while it
/// waited for held items (at the end of the data) once left it waiting for ever, and the worker
/// never exited; a panic too. Its waits do not beat the heartbeat (`claim_work_ahead`): the
/// loop's thread does, so a forward that hangs is seen as a hang even while this thread waits.
pub fn prefetching(
    pipe: &mut Pipeline<'_, '_>,
    gather: &(dyn Fn(u64) -> Gathered + Sync),
    stopping: &(dyn Fn() -> bool + Sync),
    report: &mut FinalReport,
) -> anyhow::Result<bool> {
    let producer = pipe.producer();
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<Gathered>(1);
        let done = &done;
        scope.spawn(move || {
            // Relaxed: the flag carries no data, only "stop asking".
            while !stopping() && !done.load(Ordering::Relaxed) {
                let (item, alone) = match producer.claim_work_ahead(Duration::from_millis(200)) {
                    WorkClaim::Item(item) => (item, false),
                    WorkClaim::Returned(item) => (item, true),
                    WorkClaim::Pending => continue,
                    WorkClaim::Settled => break,
                };
                if tx
                    .send(Gathered {
                        alone,
                        ..gather(item)
                    })
                    .is_err()
                {
                    break;
                }
            }
        });
        // Set however `produce` ends, a panic included (the scope joins the thread first).
        let _done = Done(done);
        produce(&rx, pipe, stopping, report)
    })
}

/// Sets its flag when dropped: the prefetch thread's "stop asking".
struct Done<'a>(&'a AtomicBool);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs the worker; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let mut s = setup(&args.common, Role::Producer)?;
    // Started standalone on a config naming data that nobody prepared: prepare it here, into
    // the cache a launcher would use (the launcher always passes the prepared file).
    if let (Some(path), None) = (&s.config.data.path, &s.config.data.prepared) {
        let p = dataset::prepare(
            path,
            s.config.data.max_len,
            &dataset::default_cache_dir(s.run_dir.path()),
            None,
            &mut dataset::quiet,
        )
        .context("preparing the dataset")?;
        s.config.data.prepared = Some(p.path);
        s.config.data.prepared_key = Some(p.key);
    }
    let s = s;
    let cfg = &s.config;
    // The model first: a backend that cannot start fails before this worker takes any work.
    let mut backend = gpu::target(s.backend, cfg, s.name)?;
    worker_runtime::model_loaded();
    let data = load_dataset(cfg).context("loading the dataset")?;
    let plan = plan(data.lengths(), cfg);
    let ring = Ring::attach(&s.ring).with_context(|| format!("attaching to ring {}", s.ring))?;
    if ring.params().work_items != plan.len() as u64 {
        bail!(
            "ring {} was made for {} batches but this dataset and config plan {}: the launcher and this worker disagree on the data or config",
            s.ring,
            ring.params().work_items,
            plan.len()
        );
    }
    let _pinned = gpu::pin_arena(s.backend, &ring);
    let producer = ring
        .producer(s.index)
        .with_context(|| format!("registering as producer {}", s.index))?;
    producer.set_gpu(s.gpu);
    tracing::info!(
        ring = %s.ring,
        epoch = producer.epoch(),
        batches = plan.len(),
        data = %data.source,
        "attached"
    );
    let mut report = FinalReport::default();

    let mut pipe = Pipeline::new(&producer, &mut *backend)
        .with_depth(cfg.target.depth)
        .injecting(cfg.faults_for(s.name));
    let gather = |item: u64| gather(item, &plan[item as usize], &data, cfg, s.index);
    let mut stopped = prefetching(&mut pipe, &gather, &|| s.stop.stopping(), &mut report)?;
    drop(pipe);
    stopped |= s.stop.stopping();
    // A stop signal the launcher did not send: this target leaves the run without counting
    // itself finished in the ring (which would be for good: the ring closes without it), and
    // the launcher, which did not stop it, restarts it as after a crash. The claims it gave back
    // go to the other targets meanwhile.
    if let Some(what) = (s.stop).wait_outside_signal(s.to_launcher.is_some()) {
        tracing::error!("{}{what}", proto::stop::OUTSIDE_SIGNAL);
        return Ok(EXIT_STOPPED);
    }
    // Count toward the close in either case: a stopping run still drains.
    producer.finish();
    report.complete = !stopped;
    tracing::info!(
        items = report.items,
        tokens = report.tokens,
        stopped,
        "finished"
    );
    if let Some(tx) = &s.to_launcher {
        let _ = tx.send(ToLauncher::Report(report));
    }
    Ok(if stopped { EXIT_STOPPED } else { 0 })
}
