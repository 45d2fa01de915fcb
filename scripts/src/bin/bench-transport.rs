//! Cross-process transport benchmark: shm-ring against the limit (an in-process memcpy of the
//! same bytes) and its peers — a Unix-domain socket and an in-process channel of `Vec<u8>`
//! between threads. (ipc-channel was measured here until its crate left the build: it is not
//! packaged where this project's crates come from; see BENCHMARKS.md.) Every producer
//! fills every byte of each payload; every consumer reads every byte.
//!
//! `cargo run --release -p scripts --bin bench-transport -- [--runs 5] [--sizes 4K,1M,64M,256M]`
//! prints Markdown tables of medians (see BENCHMARKS.md).

use std::hint::black_box;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use scripts::median;
use shm_ring::{CommitMeta, Ring, RingParams, TakePolicy};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    child: Option<ChildCmd>,
    /// Runs per measurement; tables show medians.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Payload sizes, with K/M/G suffixes.
    #[arg(long, value_delimiter = ',', default_value = "4K,1M,64M,256M")]
    sizes: Vec<String>,
    /// Only the transports whose name contains one of these words (memcpy always runs).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

#[derive(Subcommand)]
enum ChildCmd {
    RingProduce {
        ring: String,
        index: u32,
        items: u64,
        size: usize,
    },
    RingConsume {
        ring: String,
        index: u32,
    },
    UdsProduce {
        path: String,
        items: u64,
        size: usize,
    },
    UdsConsume {
        path: String,
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

fn wait_for_go() -> anyhow::Result<()> {
    let mut b = [0u8; 1];
    std::io::stdin().read_exact(&mut b)?;
    Ok(())
}

/// Reads every byte (a 64-bit sum the optimiser cannot skip).
fn read_all(buf: &[u8]) -> u64 {
    let s = buf.chunks_exact(8).fold(0u64, |s, c| {
        s.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()))
    });
    black_box(s)
}

fn child(cmd: ChildCmd) -> anyhow::Result<()> {
    let out = std::io::stdout();
    match cmd {
        ChildCmd::RingProduce {
            ring,
            index,
            items,
            size,
        } => {
            let ring = Ring::attach(&ring)?;
            let p = ring.producer(index)?;
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
        }
        ChildCmd::RingConsume { ring, index } => {
            let ring = Ring::attach(&ring)?;
            let c = ring.consumer(index)?;
            wait_for_go()?;
            while let Some(r) = c.take()? {
                read_all(r.payload());
                r.release()?;
            }
        }
        ChildCmd::UdsProduce { path, items, size } => {
            wait_for_go()?;
            let mut s = UnixStream::connect(&path)?;
            let mut buf = vec![0u8; size];
            for i in 0..items {
                buf.fill(i as u8);
                s.write_all(&(size as u64).to_le_bytes())?;
                s.write_all(&buf)?;
            }
            s.write_all(&0u64.to_le_bytes())?;
        }
        ChildCmd::UdsConsume { path } => {
            let l = UnixListener::bind(&path)?;
            writeln!(out.lock(), "listening")?;
            wait_for_go()?;
            let (mut s, _) = l.accept()?;
            let mut buf = Vec::new();
            loop {
                let mut len = [0u8; 8];
                s.read_exact(&mut len)?;
                let n = u64::from_le_bytes(len) as usize;
                if n == 0 {
                    break;
                }
                buf.resize(n, 0);
                s.read_exact(&mut buf)?;
                read_all(&buf);
            }
        }
    }
    Ok(())
}

fn spawn(args: &[String]) -> anyhow::Result<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?)
}

fn first_line(c: &mut Child) -> anyhow::Result<String> {
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap()).read_line(&mut line)?;
    Ok(line.trim().to_string())
}

/// Sends the go byte to every child, waits for all, returns the seconds in between.
fn go_and_wait(mut children: Vec<Child>) -> anyhow::Result<f64> {
    // Let every child finish attaching before the clock starts.
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    for c in &mut children {
        c.stdin.take().unwrap().write_all(b"g")?;
    }
    for mut c in children {
        if !c.wait()?.success() {
            bail!("a benchmark child failed");
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn s(x: impl ToString) -> String {
    x.to_string()
}

fn ring_run(size: usize, items: u64, producers: u32, consumers: u32) -> anyhow::Result<f64> {
    let name = format!("hspipe-bench-{}", std::process::id());
    let slots = if size >= 16 << 20 { 4 } else { 8 }.max(producers + consumers);
    let _ring = Ring::create(
        &name,
        &RingParams {
            slots,
            slot_size: size as u64,
            buckets: 1,
            producers,
            consumers,
            held_per_consumer: 1,
            policy: TakePolicy::Fifo,
            seed: 0,
            work_items: 0,
        },
    )?;
    let per = items / u64::from(producers);
    let mut children = Vec::new();
    for c in 0..consumers {
        children.push(spawn(&[s("ring-consume"), name.clone(), s(c)])?);
    }
    for p in 0..producers {
        children.push(spawn(&[
            s("ring-produce"),
            name.clone(),
            s(p),
            s(per),
            s(size),
        ])?);
    }
    go_and_wait(children)
}

fn uds_run(size: usize, items: u64) -> anyhow::Result<f64> {
    let path = std::env::temp_dir().join(format!("hspipe-bench-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let path_s = path.to_string_lossy().into_owned();
    let mut cons = spawn(&[s("uds-consume"), path_s.clone()])?;
    first_line(&mut cons)?;
    let prod = spawn(&[s("uds-produce"), path_s, s(items), s(size)])?;
    let t = go_and_wait(vec![cons, prod]);
    let _ = std::fs::remove_file(&path);
    t
}

/// Threads in one process, a bounded channel of Vec<u8> (5x3: consumers share the receiver).
fn inproc_run(size: usize, items: u64, producers: u64, consumers: u64) -> f64 {
    let cap = if size >= 16 << 20 { 4 } else { 8 };
    let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(cap);
    let rx = Arc::new(Mutex::new(rx));
    let t0 = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..producers {
            let tx = tx.clone();
            sc.spawn(move || {
                for i in 0..items / producers {
                    let mut v = vec![0u8; size];
                    v.fill(i as u8);
                    tx.send(v).unwrap();
                }
            });
        }
        drop(tx);
        for _ in 0..consumers {
            let rx = rx.clone();
            sc.spawn(move || loop {
                let v = rx.lock().unwrap().recv();
                match v {
                    Ok(v) => {
                        read_all(&v);
                    }
                    Err(_) => break,
                }
            });
        }
    });
    t0.elapsed().as_secs_f64()
}

/// The best case for moving these bytes: one memcpy per item in one process. The destination
/// is written once before timing and starts 320 bytes past a page boundary: with source and
/// destination at the same offset in a page, 4K aliasing slows small copies here ~15-fold,
/// which would flatter everything compared to it.
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

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 30 => format!("{} GiB", s >> 30),
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s => format!("{} KiB", s >> 10),
    }
}

type Runner<'a> = Box<dyn Fn(usize, u64) -> anyhow::Result<f64> + 'a>;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(c) = args.child {
        return child(c);
    }
    let mut transports: Vec<(&str, Runner)> = vec![
        (
            "memcpy, 1 thread (the limit)",
            Box::new(|s, n| Ok(memcpy_run(s, n))),
        ),
        ("shm-ring 1x1", Box::new(|s, n| ring_run(s, n, 1, 1))),
        ("shm-ring 5x3", Box::new(|s, n| ring_run(s, n, 5, 3))),
        ("Unix socket 1x1", Box::new(uds_run)),
        (
            "in-process channel of Vec 1x1",
            Box::new(|s, n| Ok(inproc_run(s, n, 1, 1))),
        ),
        (
            "in-process channel of Vec 5x3",
            Box::new(|s, n| Ok(inproc_run(s, n, 5, 3))),
        ),
    ];
    if !args.only.is_empty() {
        transports.retain(|(name, _)| {
            name.starts_with("memcpy") || args.only.iter().any(|w| name.contains(w.as_str()))
        });
    }
    for sz in &args.sizes {
        let size = parse_size(sz)?;
        // About 2 GiB per run (at least 30 items, at most 100k, a multiple of 15 for 5x3).
        let items = (((2u64 << 30) / size as u64).clamp(30, 100_000) / 15) * 15;
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); transports.len()];
        for _ in 0..args.runs {
            // Interleave transports so all see the same machine conditions.
            for (k, (_, run)) in transports.iter().enumerate() {
                times[k].push(run(size, items)?);
            }
        }
        let memcpy = median(times[0].clone());
        println!(
            "\n{} payloads, {items} items per run, median of {} runs\n",
            human(size),
            args.runs
        );
        println!("| transport | items/s | GB/s | x memcpy GB/s |");
        println!("|---|---|---|---|");
        for (k, (name, _)) in transports.iter().enumerate() {
            let t = median(times[k].clone());
            println!(
                "| {name} | {:.0} | {:.2} | {:.2} |",
                items as f64 / t,
                (size as u64 * items) as f64 / t / 1e9,
                memcpy / t
            );
        }
    }
    Ok(())
}
