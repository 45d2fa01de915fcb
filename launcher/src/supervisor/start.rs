//! Starting a run: the ring and the drafter group (after reclaiming what dead launchers left),
//! the run's first lines, and the supervisor with its workers, none started yet.

use std::sync::mpsc;
use std::time::Instant;

use anyhow::Context;
use shm_ring::{Ring, WorkerName};

use super::{Supervisor, Worker};
use crate::cli::Args;
use crate::monitor::Monitor;
use crate::output::Tee;
use crate::signals::StopSignals;
use crate::spawn::{self, Welcome};
use crate::{count, reclaim, Settled};

impl<'a> Supervisor<'a> {
    /// Creates the ring and the drafter group (after reclaiming what dead launchers left),
    /// prints the run's first lines and lists the workers, none started yet.
    pub(crate) fn start(
        args: &'a Args,
        settled: Settled,
        tee: &Tee,
        signals: StopSignals,
    ) -> anyhow::Result<Self> {
        let Settled {
            cfg,
            backend,
            data,
            data_line,
            data_notes,
            batches,
            planned,
            epochs,
            params,
            run_id,
            run_dir,
            gpus,
            resume,
            held,
            said: _,
        } = settled;
        // What the run directory is, to tell it deleted or moved later (`place.rs`).
        let place = super::place::Place::of(run_dir.path())
            .with_context(|| format!("looking at {}", run_dir.path().display()))?;
        let (targets, drafters) = (&gpus.targets, &gpus.drafters);
        let (nt, nd) = (targets.len() as u32, drafters.len() as u32);
        // Frees what dead launchers hold before this ring takes its share of /dev/shm.
        let this = reclaim::This {
            run_dir: run_dir.path(),
            resuming: resume.is_some(),
            refused: false,
        };
        for line in reclaim::reclaim(&this) {
            println!("{line}");
        }
        let ring_name = format!("{}{run_id}", shm_ring::NAME_PREFIX);
        let group_name = proto::group_segment(&ring_name);
        // Made before the ring: while the ring exists, so does the record.
        let record = reclaim::register(
            &ring_name,
            std::slice::from_ref(&group_name),
            run_dir.path(),
        )
        .map_err(|e| println!("warning: this run is not recorded for reclaiming: {e:#}"))
        .ok();
        let ring = Ring::create(&ring_name, &params).context("creating the ring")?;
        // The step a resumed drafter of the user's own loads its weights of.
        let resume_step = resume.as_ref().filter(|r| r.checkpointed).map(|r| r.step);
        // A resumed run: the ledgers keep what the checkpoint holds, and those batches are done.
        let (start_step, done) = match &resume {
            Some(r) => {
                r.apply()?;
                crate::resume::sweep_leftovers(&run_dir);
                let n = ring
                    .mark_work_done(r.done.iter().copied())
                    .context("marking the checkpointed batches done")?;
                // No checkpoint (none written yet): every line is after it, trained again.
                let from = match (r.checkpointed, r.step) {
                    (false, _) | (true, 0) => "the start (no checkpoint was written)".to_string(),
                    (true, s) if cfg.drafter.command.is_some() => format!(
                        "its checkpoint at step {s} (the step its drafter recorded saved, {})",
                        run_dir.checkpointed_step().display()
                    ),
                    (true, s) => format!("its checkpoint at step {s}"),
                };
                // Without a checkpoint every line is dropped: "after the checkpoint" is no
                // reason then.
                let dropped = if r.checkpointed && r.step > 0 {
                    r.dropped.to_string()
                } else {
                    format!("{} ledger line(s) dropped", r.dropped.total())
                };
                println!(
                    "resuming {} from {from}: {n} batch(es) already trained, {dropped} (their batches are trained again)",
                    run_dir.path().display(),
                );
                (r.step, n)
            }
            None => (0, 0),
        };
        // The drafter group: one model trained by every drafter (see the collective crate).
        let group = collective::create(
            &group_name,
            &drafter_worker::group_params(backend.0, &cfg, nd, start_step)?,
        )
        .context("creating the drafter group")?;
        // For `shm-ring-stat --run-dir`.
        run_dir.write_ring_name(&ring_name)?;

        println!(
            "hspipe: {} ({}), {} ({}); backend {}",
            count(nt, "target", "targets"),
            gpus_said(targets),
            count(nd, "drafter", "drafters"),
            gpus_said(drafters),
            backend.1
        );
        if let Some(line) = &data_line {
            println!("{line}");
        }
        println!(
            "data: {}, {}; ring {ring_name} ({} slots x {} KiB); run dir {}",
            data.source,
            count(batches, "batch", "batches"),
            params.slots,
            params.slot_size / 1024,
            run_dir.path().display()
        );

        let welcome = Welcome {
            ring: ring_name.clone(),
            // Absolute: a worker command runs in its own directory (`command_dir`).
            run_dir: std::path::absolute(run_dir.path()).with_context(|| {
                format!("resolving the run directory {}", run_dir.path().display())
            })?,
            config_toml: cfg.to_toml(),
            backend: backend.0,
            threads: spawn::threads_per_worker(cfg.target.threads, targets.len() + drafters.len()),
            target_command: cfg.target.command.clone(),
            target_command_dir: cfg.target.command_dir.clone(),
            drafter_command: cfg.drafter.command.clone(),
            drafter_command_dir: cfg.drafter.command_dir.clone(),
            resume_step: resume_step.map(u64::from),
        };
        let workers = (targets.iter().enumerate())
            .map(|(i, &gpu)| Worker::new(WorkerName::producer(i as u32), gpu))
            .chain(
                (drafters.iter().enumerate())
                    .map(|(i, &gpu)| Worker::new(WorkerName::consumer(i as u32), gpu)),
            )
            .collect();
        let mon = Monitor::new(
            &run_dir,
            (batches, done),
            &epochs,
            args.monitor_period()?,
            tee,
        )?;
        let (events_tx, events) = mpsc::channel();
        Ok(Supervisor {
            args,
            ring,
            group,
            _record: record,
            _held: held,
            ring_name,
            run_dir,
            backend: backend.1,
            samples: data.len() as u64,
            epochs,
            welcome,
            workers,
            signals,
            events,
            events_tx,
            mon,
            notes: Vec::new(),
            data_notes,
            skipped: Default::default(),
            saves: super::saves::Saves::new(start_step),
            strikes: super::settle::Strikes::new(args.set_aside_after),
            planned,
            stopping: false,
            killed: false,
            place,
            gone: None,
            last_hang_check: Instant::now(),
            last_log_check: Instant::now(),
            last_place_check: Instant::now(),
            started: Instant::now(),
        })
    }
}

/// A side's GPUs on the run's first line: "GPU 5" for one, "GPUs [5, 6, 7]" for more.
fn gpus_said(gpus: &[u32]) -> String {
    match gpus {
        [one] => format!("GPU {one}"),
        many => format!("GPUs {many:?}"),
    }
}
