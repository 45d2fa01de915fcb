//! The real target's forward + capture speed on the CPU (BENCHMARKS.md, "Real target on the
//! CPU"): the target worker's own code (`gpu::candle::CandleTarget::run`: the captured layers
//! written as bf16 `[tokens x layers x hidden]` and the greedy tokens), over batches of
//! equal-length sequences, timed in-process after one warm-up forward. Threads: candle reads
//! `RAYON_NUM_THREADS`. `scripts/py/bench_target.py` runs this beside PyTorch.
//!
//!   bench-target --model mid --seq-len 1024 --batch 4 --reps 3
//!
//! On a GPU (the CUDA build, `--device cuda`) the target computes in bf16, as the cuda backend's
//! does. With `--random`, only `--model`'s `config.json` is read and the weights are made on the
//! device (a Qwen3-8B shape, `scripts/shapes/qwen3-8b`, on a machine that cannot download one).
//! Its attention is the fused kernel unless `HSPIPE_TARGET_ATTENTION=blocked`; the JSON says
//! which ran. `--compare-attention` then also runs one forward with the blocked matrix products
//! and compares what the two captured (the fused kernel's check on a whole model).
//!
//! `--checks` times what the forward's NaN checks cost instead (BENCHMARKS.md, "The NaN
//! checks' cost"): forwards with the host's check, the device's and none, in turn.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use gpu::candle::CandleTarget;
use proto::PipelineConfig;

#[derive(Parser, Debug)]
struct Args {
    /// The HF model directory (with --random, only its config.json is read).
    #[arg(long)]
    model: PathBuf,
    /// Weights made up on the device (normal, std 0.02; norms ones) instead of read.
    #[arg(long)]
    random: bool,
    /// Where the target computes: cpu (f32) or cuda (bf16, the CUDA build).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Tokens of each sequence.
    #[arg(long)]
    seq_len: u32,
    /// Sequences per forward.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    /// Timed forwards (after one warm-up); the median is printed.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Skip the greedy tokens (the forward stops after the last captured layer).
    #[arg(long)]
    no_tokens: bool,
    /// Leave glibc's malloc at its defaults; without it the target runs as the worker's does,
    /// freed memory kept for reuse (`worker_runtime::malloc`).
    #[arg(long)]
    glibc_malloc: bool,
    /// After the timing, one forward with the fused attention and one with the blocked matrix
    /// products on the same tokens, cut into sequences of 1, 65, 100 and the rest (the kernel's
    /// masked edges): each captured layer's largest difference over its largest
    /// magnitude, and the share of greedy tokens that agree. Fails when a layer differs by more
    /// than 5% or fewer than 90% of the tokens agree (the bf16 target's tolerance against f32).
    #[arg(long)]
    compare_attention: bool,
    /// On a GPU, the device time of one more forward kernel by kernel (CUPTI; libcupti from
    /// PyTorch's CUDA wheels), printed to stderr; with --compare-attention, of the fused and
    /// the blocked forwards too: where a forward's time goes.
    #[arg(long)]
    kernels: bool,
    /// Instead of the timing above, forwards alternating the decoder's NaN checks: on the host
    /// (each layer's output, the final norm's and the logits: the CPU's default), on the device
    /// (the last layer's output and the logits, the tokens marked: the GPU's default) and none
    /// (a benchmark's knob). One warm-up round, then `--reps` rounds of one forward each, the
    /// order rotating round by round; prints each one's median wall and CPU seconds (all
    /// threads) and the medians of its per-round ratios to none.
    #[arg(long, conflicts_with_all = ["kernels", "compare_attention"])]
    checks: bool,
}

/// The NaN checks `--checks` compares, as the decoder is set for each.
const CHECKS: [&str; 3] = ["host", "device", "none"];

/// `--checks`: forwards of `ids` alternating [`CHECKS`], one warm-up round then `reps` rounds.
fn time_checks(
    a: &Args,
    target: &mut CandleTarget,
    ids: &[u32],
    lens: &[u32],
    out: (&mut [u8], &mut [u8]),
) -> anyhow::Result<()> {
    anyhow::ensure!(a.reps > 0, "--checks needs --reps of at least 1");
    let (hidden, tokens) = out;
    // Wall and CPU seconds of each check's forwards, by round.
    let mut secs = [(); 3].map(|_| Vec::with_capacity(a.reps));
    let mut cpu = [(); 3].map(|_| Vec::with_capacity(a.reps));
    for round in 0..=a.reps {
        for k in 0..CHECKS.len() {
            let which = (round + k) % CHECKS.len();
            let d = target.decoder_mut();
            d.check_on_device(CHECKS[which] == "device");
            d.skip_checks_for_benchmark(CHECKS[which] == "none");
            let (started, cpu_started) = (Instant::now(), scripts::cpu_seconds()?);
            let out = gpu::TargetOut {
                hidden_states: hidden,
                target_tokens: tokens,
            };
            target.run(ids, lens, out, !a.no_tokens)?;
            if round > 0 {
                secs[which].push(started.elapsed().as_secs_f64());
                cpu[which].push(scripts::cpu_seconds()? - cpu_started);
            }
        }
    }
    // Each round's ratio to none's forward in the same round, the median of them.
    let over_none = |v: &[Vec<f64>], which: usize| {
        scripts::median(v[which].iter().zip(&v[2]).map(|(x, n)| x / n).collect())
    };
    for (which, check) in CHECKS.iter().enumerate() {
        println!(
            "{{\"checks\": \"{check}\", \"seq_len\": {}, \"batch\": {}, \"rounds\": {}, \"median_s\": {:.4}, \"over_none\": {:.4}, \"median_cpu_s\": {:.4}, \"cpu_over_none\": {:.4}}}",
            a.seq_len,
            a.batch,
            a.reps,
            scripts::median(secs[which].clone()),
            over_none(&secs, which),
            scripts::median(cpu[which].clone()),
            over_none(&cpu, which),
        );
    }
    Ok(())
}

/// `f`'s device time by kernel, printed as `what`'s (with `--kernels` on a GPU; nothing else).
/// A profile that cannot start is said, and `f` runs anyway.
fn profiled<T>(a: &Args, what: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    if !a.kernels || a.device == "cpu" {
        return f();
    }
    let profiler = match cuda::cupti::Profiler::start() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{what}: no kernel times: {e}");
            return f();
        }
    };
    let out = f()?;
    // `f` read its results back to the host: its kernels have run.
    match profiler.finish() {
        Ok(times) => {
            let sums = times.into_iter().map(|k| (k.name, (k.launches, k.nanos)));
            scripts::kernel_table(what, sums.collect());
        }
        Err(e) => eprintln!("{what}: no kernel times: {e}"),
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    // Memory as the target worker keeps it (freed blocks reused, not faulted in again).
    if !a.glibc_malloc {
        worker_runtime::malloc::keep_freed_memory();
    }
    let mut cfg = PipelineConfig::default();
    cfg.model.path = Some(a.model.clone());
    let kind = match a.device.as_str() {
        "cuda" => gpu::BackendKind::Cuda,
        _ => gpu::BackendKind::Candle,
    };
    // A shape (`--random`) has no weights files for settle to check.
    match a.random {
        true => gpu::settle_shape(kind, &mut cfg)?,
        false => gpu::settle(kind, &mut cfg)?,
    }
    let place = gpu::candle::Placement::of(kind)?;
    let mut target = if a.random {
        CandleTarget::random(&a.model, &cfg, &place).context("making the model")?
    } else {
        CandleTarget::load_at(&a.model, &cfg, &place).context("loading the model")?
    };
    // As the worker does after its load (`worker_runtime::model_loaded`).
    if let Some(g) = worker_runtime::malloc::give_back_freed() {
        eprintln!(
            "loaded: {} MiB freed while loading given back, {} MiB resident",
            g.bytes() >> 20,
            g.resident_after >> 20
        );
    }
    let vocab = target.decoder().config().vocab_size as u64;
    let t = (a.seq_len * a.batch) as usize;
    let ids: Vec<u32> = (0..t as u64)
        .map(|i| (dataset::mix(i) % vocab) as u32)
        .collect();
    let lens = vec![a.seq_len; a.batch as usize];
    let (l, h) = (cfg.model.layers as usize, cfg.model.hidden as usize);
    let mut hidden = vec![0u8; t * l * h * cfg.model.dtype.size()];
    let mut tokens = vec![0u8; t * 4];
    if a.checks {
        return time_checks(&a, &mut target, &ids, &lens, (&mut hidden, &mut tokens));
    }
    let mut secs = Vec::with_capacity(a.reps);
    for rep in 0..=a.reps {
        let started = Instant::now();
        let out = gpu::TargetOut {
            hidden_states: &mut hidden,
            target_tokens: &mut tokens,
        };
        target.run(&ids, &lens, out, !a.no_tokens)?;
        if rep > 0 {
            secs.push(started.elapsed().as_secs_f64());
        }
    }
    // (With --compare-attention, its two forwards are the ones profiled.)
    if a.kernels && !a.compare_attention {
        profiled(&a, "one forward", || {
            let out = gpu::TargetOut {
                hidden_states: &mut hidden,
                target_tokens: &mut tokens,
            };
            Ok(target.run(&ids, &lens, out, !a.no_tokens)?)
        })?;
    }
    secs.sort_by(f64::total_cmp);
    let median = secs[secs.len() / 2];
    let fused = target.decoder().uses_gpu_attention();
    println!(
        "{{\"impl\": \"hspipe-candle-{}\", \"attention\": \"{}\", \"seq_len\": {}, \"batch\": {}, \"tokens_per_s\": {:.1}, \"median_s\": {median:.4}}}",
        a.device,
        match target.decoder().gpu_attention_loads() {
            Some(cuda::attention::Loads::Ldmatrix) => "fused-ldmatrix",
            Some(cuda::attention::Loads::Plain) => "fused-plain",
            None => "blocked",
        },
        a.seq_len,
        a.batch,
        t as f64 / median
    );
    if a.compare_attention {
        anyhow::ensure!(fused, "--compare-attention: the fused attention is not in use here (a CUDA device with a bf16 model, HSPIPE_TARGET_ATTENTION unset)");
        // The same tokens cut into sequences of uneven lengths: one token, one past a 64-query
        // block, a partial block, and the rest (the kernel's masked edges).
        let uneven: Vec<u32> = match t as u32 {
            t if t > 166 => vec![1, 65, 100, t - 166],
            _ => lens.clone(),
        };
        let mut run = |target: &CandleTarget| -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
            let out = gpu::TargetOut {
                hidden_states: &mut hidden,
                target_tokens: &mut tokens,
            };
            target.run(&ids, &uneven, out, true)?;
            Ok((hidden.clone(), tokens.clone()))
        };
        let (fused_hidden, fused_tokens) =
            profiled(&a, "the forward, fused attention", || run(&target))?;
        target.decoder_mut().stop_gpu_attention();
        let (blocked_hidden, blocked_tokens) =
            profiled(&a, "the forward, blocked attention", || run(&target))?;
        let values = |b: &[u8]| gpu::dflash::values_f32(cfg.model.dtype, b);
        let (f, b) = (values(&fused_hidden), values(&blocked_hidden));
        // [tokens, layers, hidden]: each captured layer's largest difference over its largest
        // magnitude.
        let mut layers = Vec::with_capacity(l);
        for li in 0..l {
            let (mut diff, mut size) = (0f32, 0f32);
            for ti in 0..t {
                let at = (ti * l + li) * h;
                for (x, y) in f[at..at + h].iter().zip(&b[at..at + h]) {
                    // f32::max drops a NaN: a NaN written by either side is an infinite
                    // difference.
                    let d = (x - y).abs();
                    diff = if d.is_nan() {
                        f32::INFINITY
                    } else {
                        diff.max(d)
                    };
                    size = size.max(y.abs());
                }
            }
            layers.push(if size > 0.0 { diff / size } else { diff });
        }
        let agree = fused_tokens
            .chunks_exact(4)
            .zip(blocked_tokens.chunks_exact(4))
            .filter(|(x, y)| x == y)
            .count() as f64
            / t as f64;
        let worst = layers.iter().copied().fold(0f32, f32::max);
        let lens_shown = format!("{uneven:?}");
        println!(
            "{{\"compare\": \"fused against blocked attention\", \"seq_lens\": {lens_shown}, \"layer_difference\": {layers:?}, \"tokens_agree\": {agree:.4}}}"
        );
        anyhow::ensure!(
            worst.is_finite() && worst <= 0.05 && agree >= 0.9,
            "the fused attention's forward differs from the blocked one's: a captured layer by {worst} of its magnitude (at most 0.05), {:.1}% of greedy tokens agree (at least 90%)",
            agree * 100.0
        );
    }
    Ok(())
}
