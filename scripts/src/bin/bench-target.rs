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
    gpu::settle(kind, &mut cfg)?;
    let place = gpu::candle::Placement::of(kind)?;
    let target = if a.random {
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
    secs.sort_by(f64::total_cmp);
    let median = secs[secs.len() / 2];
    println!(
        "{{\"impl\": \"hspipe-candle-{}\", \"seq_len\": {}, \"batch\": {}, \"tokens_per_s\": {:.1}, \"median_s\": {median:.4}}}",
        a.device,
        a.seq_len,
        a.batch,
        t as f64 / median
    );
    Ok(())
}
