//! Pipeline balance: 5 mock targets and 3 mock drafters, through ONE shared ring (hspipe's
//! design) against per-drafter rings fed round-robin (target i → drafter i mod 3, the
//! predecessor's design, built from shm-ring for a fair comparison). Reports each drafter's busy
//! fraction, tokens/s, and the ideal min(target capacity, drafter capacity).
//!
//! Workers are threads here: what is compared is the queue topology, and mock GPUs spend their
//! time sleeping. Batches are the real plan of the default synthetic dataset; simulated speeds
//! keep the real ratio (4,500 and 5,800 tokens/s per GPU) scaled by `--scale`.
//!
//! `cargo run --release -p scripts --bin bench-balance -- [--runs 5] [--scale 20]`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu::mock::Sim;
use proto::config::Faults;
use proto::PipelineConfig;
use shm_ring::{CommitMeta, Ring, RingParams, TakePolicy};
use target_worker::data::{plan, Dataset, PlannedBatch};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Simulated speed multiplier (the real 4,500/5,800 tokens/s would take hours per run).
    #[arg(long, default_value_t = 50.0)]
    scale: f64,
    /// Samples of the synthetic dataset: enough batches that start-up and the final drain
    /// weigh little, as in a long training run.
    #[arg(long, default_value_t = 10_000)]
    samples: u64,
}

const TARGETS: usize = 5;
const DRAFTERS: usize = 3;

struct Result {
    wall_s: f64,
    tokens: u64,
    busy: [f64; DRAFTERS],
}

fn ring_params(producers: u32, policy: TakePolicy) -> RingParams {
    RingParams {
        slots: 60,
        slot_size: 4096,
        buckets: 6,
        producers,
        consumers: 1,
        held_per_consumer: 1,
        policy,
        seed: 7,
        work_items: 0,
    }
}

/// One run. `shared`: one ring for all; otherwise ring k gets targets {i : i mod 3 == k}.
fn run_once(batches: &[PlannedBatch], seq_lens: &[Vec<u32>], shared: bool, scale: f64) -> Result {
    let policy = TakePolicy::DEFAULT_BUCKETED;
    let tag = format!("hspipe-bench-bal-{}", std::process::id());
    let rings: Vec<Ring> = if shared {
        vec![Ring::create(
            &tag,
            &RingParams {
                consumers: DRAFTERS as u32,
                ..ring_params(TARGETS as u32, policy)
            },
        )
        .unwrap()]
    } else {
        (0..DRAFTERS)
            .map(|k| {
                let producers = (0..TARGETS).filter(|i| i % DRAFTERS == k).count() as u32;
                // 20 slots each: the same 60 slots in all, and min_ready 10 as configured.
                Ring::create(
                    &format!("{tag}-{k}"),
                    &RingParams {
                        slots: 20,
                        ..ring_params(producers, policy)
                    },
                )
                .unwrap()
            })
            .collect()
    };
    // Where target i publishes, as (ring, producer index in it); drafter k reads (ring, index).
    let target_slot = |i: usize| {
        if shared {
            (0, i as u32)
        } else {
            (i % DRAFTERS, (i / DRAFTERS) as u32)
        }
    };
    let drafter_slot = |k: usize| if shared { (0, k as u32) } else { (k, 0) };
    let next = AtomicUsize::new(0);
    let t_speed = 4500.0 * scale;
    let d_speed = 5800.0 * scale;
    let start = Instant::now();
    let (tokens, busy) = thread::scope(|s| {
        for i in 0..TARGETS {
            let (rings, next) = (&rings, &next);
            s.spawn(move || {
                let (r, idx) = target_slot(i);
                let p = rings[r].producer(idx).unwrap();
                let sim = Sim::new(t_speed, Faults::default());
                // Dynamic claims in both designs: only the queue topology differs.
                loop {
                    let b = next.fetch_add(1, Ordering::Relaxed);
                    if b >= batches.len() {
                        break;
                    }
                    thread::sleep(sim.cost(&seq_lens[b]));
                    let w = p.reserve(64).unwrap();
                    w.commit(CommitMeta {
                        bucket: batches[b].bucket,
                        tokens: batches[b].tokens,
                        batch_id: b as u64,
                        checksum: 0,
                    })
                    .unwrap();
                }
                p.finish();
            });
        }
        let drafters: Vec<_> = (0..DRAFTERS)
            .map(|k| {
                let rings = &rings;
                s.spawn(move || {
                    let (r, idx) = drafter_slot(k);
                    let c = rings[r].consumer(idx).unwrap();
                    let sim = Sim::new(d_speed, Faults::default());
                    let mut busy = Duration::ZERO;
                    let mut tokens = 0;
                    while let Some(item) = c.take().unwrap() {
                        let b = item.meta().batch_id as usize;
                        let t = Instant::now();
                        thread::sleep(sim.cost(&seq_lens[b]));
                        busy += t.elapsed();
                        tokens += item.meta().tokens;
                        item.release().unwrap();
                    }
                    (tokens, busy)
                })
            })
            .collect();
        let mut tokens = 0;
        let mut busy = [Duration::ZERO; DRAFTERS];
        for (k, h) in drafters.into_iter().enumerate() {
            let (t, b) = h.join().unwrap();
            tokens += t;
            busy[k] = b;
        }
        (tokens, busy)
    });
    let wall = start.elapsed().as_secs_f64();
    Result {
        wall_s: wall,
        tokens,
        busy: busy.map(|b| b.as_secs_f64() / wall),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args = Args::parse();
    let mut cfg = PipelineConfig::default();
    cfg.data.synthetic_samples = args.samples;
    let data = Dataset::load(&cfg).unwrap();
    let batches = plan(&data, &cfg);
    let seq_lens: Vec<Vec<u32>> = batches
        .iter()
        .map(|b| {
            b.sample_ids
                .iter()
                .map(|&id| data.lengths()[id as usize])
                .collect()
        })
        .collect();
    // The ideal under the same cost model (linear plus the attention term): the slower side's
    // total simulated time, spread perfectly over its GPUs.
    let total_tokens: u64 = batches.iter().map(|b| b.tokens).sum();
    let side = |speed: f64, n: usize| {
        let sim = Sim::new(speed * args.scale, Faults::default());
        seq_lens
            .iter()
            .map(|l| sim.cost(l).as_secs_f64())
            .sum::<f64>()
            / n as f64
    };
    let ideal = total_tokens as f64 / side(4500.0, TARGETS).max(side(5800.0, DRAFTERS));
    println!(
        "{} batches, {total_tokens} tokens, speeds x {}; ideal = tokens / max(target time / 5, drafter time / 3) = {ideal:.0} tokens/s",
        batches.len(),
        args.scale,
    );
    println!("| design | tokens/s (scaled) | / ideal | drafter 0 busy | drafter 1 busy | drafter 2 busy |");
    println!("|---|---|---|---|---|---|");
    let mut results: Vec<(bool, Vec<Result>)> = vec![(true, Vec::new()), (false, Vec::new())];
    for _ in 0..args.runs {
        // Interleave the designs so both see the same machine conditions.
        for (shared, rs) in results.iter_mut() {
            rs.push(run_once(&batches, &seq_lens, *shared, args.scale));
        }
    }
    for (shared, rs) in &results {
        let tps = median(rs.iter().map(|r| r.tokens as f64 / r.wall_s).collect());
        let busy: Vec<f64> = (0..DRAFTERS)
            .map(|k| median(rs.iter().map(|r| r.busy[k]).collect()))
            .collect();
        println!(
            "| {} | {:.0} | {:.3} | {:.1}% | {:.1}% | {:.1}% |",
            if *shared {
                "shared ring (hspipe)"
            } else {
                "per-drafter rings, round-robin (predecessor)"
            },
            tps,
            tps / ideal,
            busy[0] * 100.0,
            busy[1] * 100.0,
            busy[2] * 100.0
        );
    }
}
