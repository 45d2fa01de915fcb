//! Cross-process micro-benchmark of shm-ring: hand-offs per second and GB/s between a producer
//! process that fills every byte of each slot and a consumer process that reads every byte,
//! side by side with an in-process memcpy of the same bytes (the limit).
//!
//! `cargo run --release -p scripts --bin bench-transport -- [--runs 5] [--sizes 4K,1M,64M]`
//! prints a Markdown table of medians (see BENCHMARKS.md).

use std::hint::black_box;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use shm_ring::{CommitMeta, Ring, RingParams, TakePolicy};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    child: Option<Child>,
    /// Runs per measurement; the table shows medians.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Payload sizes, with K/M/G suffixes.
    #[arg(long, value_delimiter = ',', default_value = "4K,1M,64M")]
    sizes: Vec<String>,
}

#[derive(Subcommand)]
enum Child {
    Produce {
        ring: String,
        items: u64,
        size: usize,
    },
    Consume {
        ring: String,
    },
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let (num, mul) = match s.chars().last() {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num
        .parse::<usize>()
        .with_context(|| format!("bad size {s:?}"))?
        * mul)
}

/// Waits for the parent's go byte on stdin, so process start-up is not timed.
fn wait_for_go() -> anyhow::Result<()> {
    let mut b = [0u8; 1];
    std::io::stdin().read_exact(&mut b)?;
    Ok(())
}

fn produce(ring: &str, items: u64, size: usize) -> anyhow::Result<()> {
    let ring = Ring::attach(ring)?;
    let p = ring.producer(0)?;
    wait_for_go()?;
    for i in 0..items {
        let mut w = p.reserve(size)?;
        w.payload_mut().fill(i as u8);
        w.commit(CommitMeta {
            batch_id: i,
            ..Default::default()
        })?;
    }
    p.finish();
    Ok(())
}

/// Reads every byte; prints the elapsed seconds from go to end of stream.
fn consume(ring: &str) -> anyhow::Result<()> {
    let ring = Ring::attach(ring)?;
    let c = ring.consumer(0)?;
    wait_for_go()?;
    let t0 = Instant::now();
    let mut sum = 0u64;
    while let Some(r) = c.take()? {
        sum = r.payload().chunks_exact(8).fold(sum, |s, ch| {
            s.wrapping_add(u64::from_le_bytes(ch.try_into().unwrap()))
        });
        r.release()?;
    }
    black_box(sum);
    println!("{}", t0.elapsed().as_secs_f64());
    Ok(())
}

/// One 1×1 run through the ring: seconds to hand off `items` payloads of `size` bytes.
fn ring_run(size: usize, items: u64) -> anyhow::Result<f64> {
    let name = format!("hspipe-bench-{}", std::process::id());
    let slots = if size >= 16 << 20 { 4 } else { 8 };
    let _ring = Ring::create(
        &name,
        &RingParams {
            slots,
            slot_size: size as u64,
            buckets: 1,
            producers: 1,
            consumers: 1,
            held_per_consumer: 1,
            policy: TakePolicy::Fifo,
            seed: 0,
            work_items: 0,
        },
    )?;
    let me = std::env::current_exe()?;
    let spawn = |args: Vec<String>| {
        Command::new(&me)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
    };
    let mut cons = spawn(vec!["consume".into(), name.clone()])?;
    let mut prod = spawn(vec![
        "produce".into(),
        name.clone(),
        items.to_string(),
        size.to_string(),
    ])?;
    // Both have attached and registered once they read stdin; give them a moment, then go.
    std::thread::sleep(Duration::from_millis(200));
    cons.stdin.take().unwrap().write_all(b"g")?;
    prod.stdin.take().unwrap().write_all(b"g")?;
    let out = cons.wait_with_output()?;
    let pst = prod.wait()?;
    if !out.status.success() || !pst.success() {
        bail!("benchmark child failed");
    }
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

/// Seconds to memcpy `items` buffers of `size` bytes in one process: the best case for moving
/// these bytes. The destination is written once before timing (no page faults inside the
/// loop) and starts 320 bytes past a page boundary: with source and destination at the same
/// offset in a page, 4K aliasing slows small copies here about 15-fold, which would flatter
/// the ring.
fn memcpy_run(size: usize, items: u64) -> f64 {
    let src = vec![7u8; size];
    let mut buf = vec![1u8; size + 4096];
    let dst = &mut buf[320..320 + size];
    let t0 = Instant::now();
    for _ in 0..items {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut *dst);
    }
    t0.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 30 => format!("{} GiB", s >> 30),
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s => format!("{} KiB", s >> 10),
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.child {
        Some(Child::Produce { ring, items, size }) => return produce(&ring, items, size),
        Some(Child::Consume { ring }) => return consume(&ring),
        None => {}
    }
    println!(
        "| payload | items/run | shm-ring items/s | shm-ring GB/s | memcpy GB/s | ring / memcpy |"
    );
    println!("|---|---|---|---|---|---|");
    for s in &args.sizes {
        let size = parse_size(s)?;
        // About 2 GiB per run, at least 20 items, at most 100k.
        let items = ((2u64 << 30) / size as u64).clamp(20, 100_000);
        let mut ring_t = Vec::new();
        let mut copy_t = Vec::new();
        for _ in 0..args.runs {
            // Interleave so both see the same machine conditions.
            ring_t.push(ring_run(size, items)?);
            copy_t.push(memcpy_run(size, items));
        }
        let (rt, ct) = (median(ring_t), median(copy_t));
        let bytes = (size as u64 * items) as f64;
        println!(
            "| {} | {} | {:.0} | {:.2} | {:.2} | {:.2} |",
            human(size),
            items,
            items as f64 / rt,
            bytes / rt / 1e9,
            bytes / ct / 1e9,
            ct / rt
        );
    }
    Ok(())
}
