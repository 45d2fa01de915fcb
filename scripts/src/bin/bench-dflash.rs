//! The DFlash pipeline without the ring (BENCHMARKS.md, "The DFlash drafter on the CPU"): the
//! same target and drafter code the workers run, in one process, one batch after another, over
//! the batches a run with `--config` plans: write the batch (ids and mask), the target's
//! forward into it, seal it (checksum), parse and verify it (what a drafter's copy-in does),
//! the drafter's gradient, its update. Prints the median of each part per batch and the
//! tokens/s of the whole, as JSON, for `scripts/bench-dflash.sh` to set beside a launcher run.
//!
//!   bench-dflash --model tiny --config scripts/dflash-demo.toml --batches 200

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use gpu::candle::CandleTarget;
use gpu::StepBuffer;
use proto::{BatchSpec, BatchView, BatchWriter, PipelineConfig};

#[derive(Parser, Debug)]
struct Args {
    /// The target's HF model directory.
    #[arg(long)]
    model: PathBuf,
    /// The run's pipeline config (data, target budget, [dflash]).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Batches of the plan to run (after one warm-up batch); 0: all.
    #[arg(long, default_value_t = 0)]
    batches: usize,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    // Memory as the worker keeps it (freed blocks reused, not faulted in again).
    worker_runtime::malloc::keep_freed_memory();
    let mut cfg = match &a.config {
        Some(p) => PipelineConfig::load(p)?,
        None => PipelineConfig::default(),
    };
    cfg.model.path = Some(a.model.clone());
    gpu::settle(gpu::BackendKind::Candle, &mut cfg)?;
    let data = target_worker::load_dataset(&cfg).context("the data")?;
    let plan = proto::plan::plan(data.lengths(), &cfg);
    cfg.drafter.total_steps.get_or_insert(plan.len() as u64);
    let target = CandleTarget::load(&a.model, &cfg).context("loading the target")?;
    let mut drafter = gpu::drafter(gpu::BackendKind::Candle, &cfg, None)?;
    let n = if a.batches == 0 {
        plan.len()
    } else {
        (a.batches + 1).min(plan.len())
    };
    let mut sum = StepBuffer::new(drafter.grad_len());
    let parts = ["write", "target", "seal", "verify", "gradient", "update"];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); parts.len()];
    let (mut tokens, mut total) = (0u64, 0.0f64);
    for (i, b) in plan.iter().take(n).enumerate() {
        let t0 = Instant::now();
        let samples: Vec<_> = b
            .sample_ids
            .iter()
            .map(|&id| data.sample(id).expect("planned"))
            .collect();
        let spec = BatchSpec {
            batch_id: i as u64,
            producer: 0,
            sample_ids: b.sample_ids.clone(),
            seq_lens: samples.iter().map(|s| s.input_ids.len() as u32).collect(),
            dtype: cfg.model.dtype,
            layers: cfg.model.layers,
            hidden: cfg.model.hidden,
        };
        let mut buf = vec![0u8; proto::batch::batch_len(&spec)? as usize];
        let mut w = BatchWriter::new(&mut buf, &spec)?;
        let ids: Vec<u32> = samples
            .iter()
            .flat_map(|s| s.input_ids.iter().copied())
            .collect();
        let s = w.sections_mut();
        for (c, id) in s.input_ids.chunks_exact_mut(4).zip(&ids) {
            c.copy_from_slice(&id.to_le_bytes());
        }
        let mask: Vec<u8> = (samples.iter())
            .flat_map(|s| match &s.loss_mask {
                Some(m) => m.to_vec(),
                None => vec![1; s.input_ids.len()],
            })
            .collect();
        s.loss_mask.copy_from_slice(&mask);
        let t1 = Instant::now();
        let out = gpu::TargetOut {
            hidden_states: s.hidden_states,
            target_tokens: s.target_tokens,
        };
        target.run(&ids, &spec.seq_lens, out, true)?;
        let t2 = Instant::now();
        let len = w.finish().0;
        let t3 = Instant::now();
        let view = BatchView::parse(&buf[..len])?;
        view.verify()?;
        let t4 = Instant::now();
        sum.clear();
        drafter.gradient(&view, &mut sum)?;
        let t5 = Instant::now();
        drafter.apply(&sum)?;
        let t6 = Instant::now();
        if i == 0 {
            continue; // warm-up
        }
        let marks = [t0, t1, t2, t3, t4, t5, t6];
        for (k, m) in marks.windows(2).enumerate() {
            times[k].push((m[1] - m[0]).as_secs_f64());
        }
        tokens += spec.tokens();
        total += (t6 - t0).as_secs_f64();
    }
    let mut med = serde_json::Map::new();
    for (p, t) in parts.iter().zip(times) {
        med.insert((*p).into(), median(t).into());
    }
    let out = serde_json::json!({
        "batches": n.saturating_sub(1),
        "tokens": tokens,
        "seconds": total,
        "tokens_per_s": tokens as f64 / total.max(1e-9),
        "median_s": med,
    });
    println!("{out}");
    Ok(())
}
