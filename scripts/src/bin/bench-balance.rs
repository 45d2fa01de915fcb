//! Pipeline balance: 5 mock targets and 3 mock drafters over the batch plan of the default
//! synthetic dataset, in five designs measured side by side:
//!
//! Length: over 500 lines because the five designs share the plan, the mock speeds and the
//! report; one program per table of BENCHMARKS.md.
//!
//! - independent drafters: ONE shared ring (hspipe's ring) against per-drafter rings fed
//!   round-robin (target i → drafter i mod 3, the predecessor's design, built from shm-ring for
//!   a fair comparison);
//! - a synchronous drafter GROUP (one model, data parallel: each step every rank trains at most
//!   one batch, then all-reduce through `collective::ShmGroup`), taking (a) length-coherently
//!   (the leader draws the step's bucket in proportion to what is READY, every rank prefers
//!   it: the drafter-worker's default), (b) each rank on its own under the bucketed policy, and
//!   (c) FIFO. A step lasts as long as its longest batch, so (b) and (c) wait in `sync`.
//!
//! Reports tokens/s against the ideal min(target capacity, drafter capacity), each drafter's
//! busy share (simulated compute / wall) and, for the group, its sync share (time in the
//! all-reduce / wall), and the length drift: the largest total-variation distance between the
//! token mix over length buckets of one tenth of the run (in training order) and the whole
//! run's. 0 means every tenth trains the same mix of lengths; round-robin bucket choice (the
//! old default, shown for reference) lets the common lengths pile up and train late.
//!
//! Workers are threads here: what is compared is the queue topology and the dispatch, and mock
//! GPUs spend their time sleeping. Simulated speeds keep the real ratio (4,500 and 5,800
//! tokens/s per GPU) scaled by `--scale`; the cost model has the attention term.
//!
//! `cargo run --release -p scripts --bin bench-balance -- [--runs 5] [--scale 50]`

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use collective::{Collective, GroupParams, ShmGroup, NO_BATCH};
use dataset::Dataset;
use gpu::mock::Sim;
use proto::config::Faults;
use proto::plan::PlannedBatch;
use proto::PipelineConfig;
use scripts::median;
use shm_ring::{BucketPick, CommitMeta, Consumer, Ring, RingParams, Take, TakePolicy};

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
    /// Also print each design's token mix over buckets per tenth of the run (pooled).
    #[arg(long)]
    show_tenths: bool,
    /// Skew the length mix: keep every sample of the longest bucket and a third of the others,
    /// so one length class arrives three times as often as each other (the mix the drift
    /// problem was seen with). The default synthetic data spreads tokens evenly over buckets.
    #[arg(long)]
    long_heavy: bool,
}

const TARGETS: usize = 5;
const DRAFTERS: usize = 3;
const BUCKETS: u32 = 6;

#[derive(Clone, Copy, PartialEq)]
enum Design {
    SharedRing,
    PerDrafterRings,
    Group { policy: TakePolicy, coherent: bool },
}

impl Design {
    fn name(self) -> String {
        match self {
            Design::SharedRing => "independent, shared ring (hspipe)".into(),
            Design::PerDrafterRings => "independent, per-drafter rings (predecessor)".into(),
            Design::Group {
                coherent: true,
                policy: _,
            } => "group (a) length-coherent steps".into(),
            Design::Group {
                policy: TakePolicy::Fifo,
                ..
            } => "group (c) FIFO".into(),
            Design::Group {
                policy: TakePolicy::Bucketed { pick, .. },
                ..
            } => format!("group (b) each rank on its own, {pick:?}").to_lowercase(),
        }
    }
}

struct Outcome {
    wall_s: f64,
    tokens: u64,
    busy: [f64; DRAFTERS],
    sync: [f64; DRAFTERS],
    /// Tokens per bucket in each tenth of the run, in training order.
    tenths: Tenths,
    /// For the group: the share of the ranks' time a step's unequal batches alone make them
    /// wait (each rank's simulated cost short of the step's longest), whatever the protocol.
    spread: f64,
}

type Tenths = [[f64; BUCKETS as usize]; 10];

fn ring_params(producers: u32, consumers: u32, slots: u32, policy: TakePolicy) -> RingParams {
    RingParams {
        slots,
        slot_size: 4096,
        buckets: BUCKETS,
        producers,
        consumers,
        held_per_consumer: 1,
        policy,
        seed: 7,
        work_items: 0,
    }
}

/// What a drafter thread measured: tokens, compute time, sync time, and (order, batch) of
/// what it trained (order: the group step, or a global take counter for independent drafters).
type DrafterOut = (u64, Duration, Duration, Vec<(u64, usize)>);

/// An independent drafter: take, train, release, until the ring ends.
fn independent(
    c: &Consumer<'_>,
    sim: &Sim,
    seq_lens: &[Vec<u32>],
    order: &AtomicU64,
) -> DrafterOut {
    let (mut tokens, mut busy, mut trained) = (0, Duration::ZERO, Vec::new());
    while let Some(item) = c.take().unwrap() {
        let b = item.meta().batch_id as usize;
        trained.push((order.fetch_add(1, Ordering::Relaxed), b));
        let t = Instant::now();
        thread::sleep(sim.cost(&seq_lens[b]));
        busy += t.elapsed();
        tokens += item.meta().tokens;
        item.release().unwrap();
    }
    (tokens, busy, Duration::ZERO, trained)
}

/// A rank of the synchronous group, as the drafter-worker's step loop: at most one batch a
/// step (from the leader's drawn bucket if `coherent`), simulated compute, then the all-reduce
/// of [saw the end, next bucket + 1], then release. Stops when every member saw the end.
fn rank(
    ring: &Ring,
    c: &Consumer<'_>,
    group: &ShmGroup,
    coherent: bool,
    sim: &Sim,
    seq_lens: &[Vec<u32>],
) -> DrafterOut {
    let (mut tokens, mut busy, mut sync, mut trained) =
        (0, Duration::ZERO, Duration::ZERO, Vec::new());
    let mut prefer = None;
    let mut sum = [0f32; 2];
    loop {
        let (held, ended) = loop {
            let closed = ring.is_closed();
            let timeout = Duration::from_millis(if closed { 1 } else { 200 });
            match c.take_timeout_preferring(prefer, timeout).unwrap() {
                Take::Item(slot) => break (Some(slot), false),
                Take::End => break (None, true),
                Take::TimedOut if closed => break (None, false),
                Take::TimedOut => {}
            }
        };
        let mut batch = NO_BATCH;
        if let Some(slot) = &held {
            batch = slot.meta().batch_id;
            let t = Instant::now();
            thread::sleep(sim.cost(&seq_lens[batch as usize]));
            busy += t.elapsed();
        }
        let mut buf = [if ended { 1.0 } else { 0.0 }, 0.0];
        let m = group.membership();
        if coherent && m.leader() == Some(group.rank()) {
            buf[1] = c.draw_bucket(m.len()).map_or(0.0, |b| (b + 1) as f32);
        }
        let t = Instant::now();
        let red = group.all_reduce(&buf, batch, &mut sum, &|| false).unwrap();
        sync += t.elapsed();
        prefer = (sum[1] >= 1.0).then(|| sum[1] as u32 - 1);
        if let Some(slot) = held {
            trained.push((u64::from(red.step), batch as usize));
            tokens += slot.meta().tokens;
            slot.release().unwrap();
        }
        if sum[0] as u32 == red.membership.len() {
            break;
        }
    }
    (tokens, busy, sync, trained)
}

/// One run of `design`.
fn run_once(
    batches: &[PlannedBatch],
    seq_lens: &[Vec<u32>],
    design: Design,
    scale: f64,
) -> Outcome {
    let tag = format!("hspipe-bench-bal-{}", std::process::id());
    let rings: Vec<Ring> = match design {
        Design::SharedRing => vec![Ring::create(
            &tag,
            &ring_params(
                TARGETS as u32,
                DRAFTERS as u32,
                60,
                TakePolicy::DEFAULT_BUCKETED,
            ),
        )
        .unwrap()],
        Design::Group { policy, .. } => vec![Ring::create(
            &tag,
            &ring_params(TARGETS as u32, DRAFTERS as u32, 60, policy),
        )
        .unwrap()],
        Design::PerDrafterRings => (0..DRAFTERS)
            .map(|k| {
                let producers = (0..TARGETS).filter(|i| i % DRAFTERS == k).count() as u32;
                // 20 slots each: the same 60 slots in all, and min_ready 10 as configured.
                Ring::create(
                    &format!("{tag}-{k}"),
                    &ring_params(producers, 1, 20, TakePolicy::DEFAULT_BUCKETED),
                )
                .unwrap()
            })
            .collect(),
    };
    let group = match design {
        Design::Group { .. } => Some(
            ShmGroup::create(
                &format!("{tag}-group"),
                &GroupParams {
                    ranks: DRAFTERS as u32,
                    buf_len: 2,
                    state_len: 1,
                    initial_step: 0,
                },
            )
            .unwrap(),
        ),
        _ => None,
    };
    let split = design == Design::PerDrafterRings;
    // Where target i publishes, as (ring, producer index in it); drafter k reads (ring, index).
    let target_slot = |i: usize| {
        if split {
            (i % DRAFTERS, (i / DRAFTERS) as u32)
        } else {
            (0, i as u32)
        }
    };
    let drafter_slot = |k: usize| if split { (k, 0) } else { (0, k as u32) };
    let next = AtomicUsize::new(0);
    let order = AtomicU64::new(0);
    let t_speed = 4500.0 * scale;
    let d_speed = 5800.0 * scale;
    let start = Instant::now();
    let outs: Vec<DrafterOut> = thread::scope(|s| {
        for i in 0..TARGETS {
            let (rings, next) = (&rings, &next);
            s.spawn(move || {
                let (r, idx) = target_slot(i);
                let p = rings[r].producer(idx).unwrap();
                let sim = Sim::new(t_speed, Faults::default());
                // Dynamic claims in every design: only the queue topology and dispatch differ.
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
                    })
                    .unwrap();
                }
                p.finish();
            });
        }
        let drafters: Vec<_> = (0..DRAFTERS)
            .map(|k| {
                let (rings, order) = (&rings, &order);
                let group_name = format!("{tag}-group");
                s.spawn(move || {
                    let (r, idx) = drafter_slot(k);
                    let c = rings[r].consumer(idx).unwrap();
                    let sim = Sim::new(d_speed, Faults::default());
                    match design {
                        Design::Group { coherent, .. } => {
                            let g = ShmGroup::attach(&group_name, k as u32).unwrap();
                            rank(&rings[r], &c, &g, coherent, &sim, seq_lens)
                        }
                        _ => independent(&c, &sim, seq_lens, order),
                    }
                })
            })
            .collect();
        drafters.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(group);
    let wall = start.elapsed().as_secs_f64();
    let mut trained: Vec<(u64, usize)> = outs.iter().flat_map(|o| o.3.clone()).collect();
    trained.sort_unstable();
    let mut spread = 0.0;
    if matches!(design, Design::Group { .. }) {
        let sim = Sim::new(d_speed, Faults::default());
        for step in trained.chunk_by(|a, b| a.0 == b.0) {
            let costs: Vec<f64> = step
                .iter()
                .map(|&(_, b)| sim.cost(&seq_lens[b]).as_secs_f64())
                .collect();
            let max = costs.iter().copied().fold(0.0, f64::max);
            // A rank with no batch in the step (the end of the run) waits the whole step.
            spread +=
                costs.iter().map(|c| max - c).sum::<f64>() + max * (DRAFTERS - costs.len()) as f64;
        }
        spread /= wall * DRAFTERS as f64;
    }
    let order: Vec<usize> = trained.into_iter().map(|(_, b)| b).collect();
    Outcome {
        wall_s: wall,
        tokens: outs.iter().map(|o| o.0).sum(),
        busy: std::array::from_fn(|k| outs[k].1.as_secs_f64() / wall),
        sync: std::array::from_fn(|k| outs[k].2.as_secs_f64() / wall),
        tenths: tenths(&order, batches),
        spread,
    }
}

/// Tokens per bucket in each tenth of `order`.
fn tenths(order: &[usize], batches: &[PlannedBatch]) -> Tenths {
    std::array::from_fn(|t| {
        let mut m = [0f64; BUCKETS as usize];
        for &b in &order[order.len() * t / 10..order.len() * (t + 1) / 10] {
            m[batches[b].bucket as usize] += batches[b].tokens as f64;
        }
        m
    })
}

/// The length drift of runs: pool their tenths (the runs' first tenths together, and so on:
/// a bias repeats from run to run, noise averages out), then the largest total-variation
/// distance between one pooled tenth's token mix over buckets and the whole's.
fn drift(runs: &[&Tenths]) -> f64 {
    let norm = |m: [f64; BUCKETS as usize]| {
        let total: f64 = m.iter().sum();
        m.map(|x| x / total.max(1.0))
    };
    let pooled: Vec<[f64; BUCKETS as usize]> = (0..10)
        .map(|t| std::array::from_fn(|b| runs.iter().map(|r| r[t][b]).sum()))
        .collect();
    let whole = norm(std::array::from_fn(|b| pooled.iter().map(|m| m[b]).sum()));
    pooled
        .iter()
        .map(|&m| {
            let m = norm(m);
            0.5 * (0..BUCKETS as usize)
                .map(|b| (m[b] - whole[b]).abs())
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}

/// The drift a random order has by chance, for `runs` runs: the median over 101 draws of
/// `runs` seeded shuffles of the plan. Steps of `clump` batches from one bucket (the group's
/// length-coherent steps) are shuffled as units, as they have fewer independent draws.
fn drift_floor(batches: &[PlannedBatch], runs: usize, clump: usize) -> f64 {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(0x5eed);
    // Clumps: consecutive batches of one bucket, `clump` at a time.
    let mut by_bucket: Vec<Vec<usize>> = vec![Vec::new(); BUCKETS as usize];
    for (i, b) in batches.iter().enumerate() {
        by_bucket[b.bucket as usize].push(i);
    }
    let units: Vec<Vec<usize>> = by_bucket
        .iter()
        .flat_map(|ids| ids.chunks(clump).map(<[usize]>::to_vec))
        .collect();
    let mut draws: Vec<f64> = (0..101)
        .map(|_| {
            let orders: Vec<Tenths> = (0..runs)
                .map(|_| {
                    let mut u = units.clone();
                    u.shuffle(&mut rng);
                    tenths(&u.concat(), batches)
                })
                .collect();
            drift(&orders.iter().collect::<Vec<_>>())
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    draws[50]
}

fn main() {
    let args = Args::parse();
    let mut cfg = PipelineConfig::default();
    cfg.data.synthetic_samples = args.samples;
    let d = &cfg.data;
    let data = Dataset::synthetic(&dataset::Synthetic {
        samples: d.synthetic_samples,
        min_len: d.min_len,
        max_len: d.max_len,
        seed: d.seed,
        vocab: dataset::SYNTHETIC_VOCAB,
        language: false,
    });
    let mut lengths = data.lengths().to_vec();
    if args.long_heavy {
        let longest = cfg.ring.buckets - 1;
        let mut i = 0u64;
        lengths.retain(|&len| {
            i += 1;
            cfg.bucket_of(len) == longest || i.is_multiple_of(3)
        });
    }
    let batches = proto::plan::plan(&lengths, &cfg);
    let seq_lens: Vec<Vec<u32>> = batches
        .iter()
        .map(|b| {
            b.sample_ids
                .iter()
                .map(|&id| lengths[id as usize])
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
        "{} batches, {total_tokens} tokens, speeds x {}; ideal = tokens / max(target time / 5, drafter time / 3) = {ideal:.0} tokens/s; medians of {} runs",
        batches.len(),
        args.scale,
        args.runs,
    );
    let bucketed = |pick| TakePolicy::Bucketed {
        min_ready: 10,
        pick,
    };
    let designs = [
        Design::SharedRing,
        Design::PerDrafterRings,
        Design::Group {
            policy: TakePolicy::DEFAULT_BUCKETED,
            coherent: true,
        },
        Design::Group {
            policy: TakePolicy::DEFAULT_BUCKETED,
            coherent: false,
        },
        Design::Group {
            policy: bucketed(BucketPick::RoundRobin),
            coherent: false,
        },
        Design::Group {
            policy: TakePolicy::Fifo,
            coherent: false,
        },
    ];
    let mut results: Vec<Vec<Outcome>> = designs.iter().map(|_| Vec::new()).collect();
    for _ in 0..args.runs {
        // Interleave the designs so all see the same machine conditions.
        for (d, rs) in designs.iter().zip(results.iter_mut()) {
            rs.push(run_once(&batches, &seq_lens, *d, args.scale));
        }
    }
    // Drift is measured on finite tenths, so even a random order has some: the floor.
    println!(
        "length drift a random order has by chance ({} runs pooled): {:.3} batch by batch, {:.3} in steps of {DRAFTERS} batches of one bucket",
        args.runs,
        drift_floor(&batches, args.runs, 1),
        drift_floor(&batches, args.runs, DRAFTERS),
    );
    println!("| design | tokens/s (scaled) | / ideal | busy (d0, d1, d2) | sync (d0, d1, d2) | of which unequal batches | length drift |");
    println!("|---|---|---|---|---|---|---|");
    let pct = |f: &dyn Fn(&Outcome) -> [f64; DRAFTERS], rs: &[Outcome]| {
        (0..DRAFTERS)
            .map(|k| {
                format!(
                    "{:.1}%",
                    100.0 * median(rs.iter().map(|r| f(r)[k]).collect())
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    if args.show_tenths {
        for (d, rs) in designs.iter().zip(&results) {
            println!(
                "{}: token share per bucket, each tenth of the run",
                d.name()
            );
            for t in 0..10 {
                let m: Vec<f64> = (0..BUCKETS as usize)
                    .map(|b| rs.iter().map(|r| r.tenths[t][b]).sum())
                    .collect();
                let total: f64 = m.iter().sum();
                let shares: Vec<String> = m.iter().map(|x| format!("{:.2}", x / total)).collect();
                println!("  {t}: [{}]", shares.join(", "));
            }
        }
    }
    for (d, rs) in designs.iter().zip(&results) {
        let tps = median(rs.iter().map(|r| r.tokens as f64 / r.wall_s).collect());
        let (sync, spread) = if matches!(d, Design::Group { .. }) {
            (
                pct(&|r| r.sync, rs),
                format!(
                    "{:.1}%",
                    100.0 * median(rs.iter().map(|r| r.spread).collect())
                ),
            )
        } else {
            ("-".into(), "-".into())
        };
        println!(
            "| {} | {tps:.0} | {:.3} | {} | {sync} | {spread} | {:.3} |",
            d.name(),
            tps / ideal,
            pct(&|r| r.busy, rs),
            drift(&rs.iter().map(|r| &r.tenths).collect::<Vec<_>>()),
        );
    }
}
