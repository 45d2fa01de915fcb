//! Idle cost: CPU seconds per wall second of a consumer process blocked on an empty ring and of
//! a producer process blocked on a full one (measured with getrusage around the blocking call).
//!
//! `cargo run --release -p scripts --bin bench-idle -- [--runs 5] [--seconds 3]`

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use scripts::median;
use shm_ring::{CommitMeta, Ring, RingParams, Take, TakePolicy};
use testkit::thread_cpu;

#[derive(Parser)]
struct Args {
    /// Child mode: `consume RING SECS` or `produce RING SECS`.
    #[arg(num_args = 0..=3)]
    child: Vec<String>,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
}

fn params() -> RingParams {
    RingParams {
        slots: 1,
        slot_size: 4096,
        buckets: 1,
        producers: 1,
        consumers: 1,
        held_per_consumer: 1,
        policy: TakePolicy::Fifo,
        seed: 0,
        work_items: 0,
    }
}

/// Blocks as `role` for `secs`; prints CPU seconds per wall second.
fn child(role: &str, ring: &str, secs: f64) -> anyhow::Result<()> {
    let ring = Ring::attach(ring)?;
    let d = Duration::from_secs_f64(secs);
    let (cpu, wall) = match role {
        "consume" => {
            let c = ring.consumer(0)?;
            let (t0, w0) = (thread_cpu(), Instant::now());
            if !matches!(c.take_timeout(d)?, Take::TimedOut) {
                bail!("the empty ring delivered an item");
            }
            (thread_cpu() - t0, w0.elapsed())
        }
        "produce" => {
            let p = ring.producer(0)?;
            p.reserve(8)?.commit(CommitMeta::default())?;
            let (t0, w0) = (thread_cpu(), Instant::now());
            if p.reserve_timeout(8, d)?.is_some() {
                bail!("the full ring had a free slot");
            }
            (thread_cpu() - t0, w0.elapsed())
        }
        other => bail!("unknown child role {other}"),
    };
    println!("{}", cpu.as_secs_f64() / wall.as_secs_f64());
    Ok(())
}

fn measure(role: &str, secs: f64) -> anyhow::Result<f64> {
    let name = format!("hspipe-bench-idle-{}-{role}", std::process::id());
    let _ring = Ring::create(&name, &params())?;
    let out = Command::new(std::env::current_exe()?)
        .args([role, &name, &secs.to_string()])
        .output()?;
    if !out.status.success() {
        bail!(
            "{role} child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout)?
        .trim()
        .parse()
        .context("parsing the child's figure")
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let [role, ring, secs] = args.child.as_slice() {
        return child(role, ring, secs.parse()?);
    }
    println!(
        "| blocked worker | CPU s per wall s (median of {}, {} s each) | max of the runs |",
        args.runs, args.seconds
    );
    println!("|---|---|---|");
    for (role, label) in [
        ("consume", "consumer on an empty ring"),
        ("produce", "producer on a full ring"),
    ] {
        let v: Vec<f64> = (0..args.runs)
            .map(|_| measure(role, args.seconds))
            .collect::<anyhow::Result<_>>()?;
        let max = v.iter().cloned().fold(0.0, f64::max);
        let m = median(v);
        println!(
            "| {label} | {m:.5} ({:.3}% of one CPU) | {max:.5} |",
            m * 100.0
        );
    }
    Ok(())
}
