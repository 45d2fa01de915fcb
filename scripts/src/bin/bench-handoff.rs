//! BENCHMARKS.md, "Python workers": the Rust side of the hand-off. Run by the launcher as the
//! only drafter of a 1x1 run (`[drafter] command`, from `scripts/py/bench-handoff.sh`), it makes
//! the same handshake as a Python worker (`worker_runtime::connect`), and drains the ring as
//! `python/bench/handoff.py` does (filled, drained cold, filled again, drained warm), timing
//! each batch from take to release the way our drafters and `hspipe`'s `take()` and
//! `release()` do: take, parse and verify the batch (CRC-32C over every byte), its ledger line,
//! release. Writes `<run-dir>/handoff-rust.json` (`cold_take_release_s`, `warm_...`: seconds
//! per batch).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use proto::control::{FinalReport, ToLauncher};
use proto::ledger::{Ledger, LedgerLine};
use proto::BatchView;
use shm_ring::{Ring, Role, Take, WorkerName};
use worker_runtime::StopFlags;

fn main() -> anyhow::Result<()> {
    let var = |n: &str| {
        std::env::var(n)
            .with_context(|| format!("{n} is not set: run me from a launcher's [drafter] command"))
    };
    let server = var(proto::control::ENV_CONTROL)?;
    let name: WorkerName = var(proto::control::ENV_WORKER)?.parse()?;
    if name.role != Role::Consumer {
        bail!("bench-handoff is a drafter, started as {name}");
    }
    let setup = worker_runtime::connect(&server, name.role, name.index, StopFlags::default())
        .context("handshake with the launcher")?;
    let ring = Ring::attach(&setup.ring).context("attaching to the ring")?;
    let consumer = ring.consumer(name.index).context("registering")?;
    std::fs::create_dir_all(setup.run_dir.ledger_dir())?;
    let mut ledger = Ledger::open(&setup.run_dir.ledger(name.index))?;
    let fill: f64 = std::env::var("HANDOFF_FILL_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4.0);
    let slots = u64::from(setup.config.ring.slots);
    std::thread::sleep(Duration::from_secs_f64(fill));
    let (mut cold, mut warm, mut report) = (Vec::new(), Vec::new(), FinalReport::default());
    loop {
        if report.items == slots {
            std::thread::sleep(Duration::from_secs_f64(fill));
        }
        let t0 = Instant::now();
        let slot = match consumer.take_timeout(Duration::from_millis(100))? {
            Take::Item(slot) => slot,
            Take::End => break,
            Take::TimedOut => continue,
        };
        let view = BatchView::parse(slot.payload())?;
        view.verify()?;
        let spec = &view.header().spec;
        let meta = *slot.meta();
        report.items += 1;
        report.tokens += spec.tokens();
        ledger.append(&LedgerLine {
            batch_id: meta.batch_id,
            sample_ids: spec.sample_ids.clone(),
            tokens: spec.tokens(),
            delivery: meta.delivery,
            ticket: meta.ticket,
            step: report.items,
            digest: String::new(),
            epoch: consumer.epoch(),
        })?;
        slot.release()?;
        let times = if report.items <= slots {
            &mut cold
        } else {
            &mut warm
        };
        times.push(t0.elapsed().as_secs_f64());
    }
    ledger.sync()?;
    let out = serde_json::json!({ "cold_take_release_s": cold, "warm_take_release_s": warm });
    std::fs::write(
        setup.run_dir.path().join("handoff-rust.json"),
        out.to_string(),
    )?;
    report.complete = true;
    if let Some(tx) = &setup.to_launcher {
        let _ = tx.send(ToLauncher::Report(report));
    }
    Ok(())
}
