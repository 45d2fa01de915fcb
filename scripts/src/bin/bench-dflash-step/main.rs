//! One DFlash drafter step alone, for the comparison with the same step written in torch
//! (`scripts/py/dflash_step.py`), two ways:
//!
//! - `--dump DIR`: a tiny drafter (the project's tiny Qwen3 target, made in `DIR/target`), one
//!   batch, and what our step computes from it: the loss, the acceptance and every parameter's
//!   gradient, with the weights, frozen tensors, context and blocks, into `DIR/step.safetensors`
//!   and `DIR/step.json`. `dflash_step.py oracle DIR` recomputes them with torch.
//! - timing: a drafter of `--shape`'s target (its `config.json` only; weights, frozen tensors
//!   and context made up on the device), one sequence of `--tokens` with `--anchors` blocks of
//!   `--block`: each step is the worker's (the gradient over the batch's parts, then AdamW where
//!   the weights are, then the weights' digest for the ledger; on a GPU the gradient stays
//!   there, as with the NCCL group, on the CPU it is copied into the host's step buffer:
//!   `gradient_on`). Prints the median of each part as JSON.
//!
//! ```text
//! bench-dflash-step --dump /tmp/step
//! bench-dflash-step --shape scripts/shapes/qwen3-8b --device cuda --layers 5 --block 16 \
//!     --anchors 512 --tokens 4096 --steps 5
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use model::dflash::{
    mask_token_id, AttentionBackward, Dflash, DflashConfig, DraftBatch, Frozen, Label, Sampling,
};
use model::make::{make_model, MakeSpec};
use model::train::{AdamWConfig, DeviceAdamW};
use model::ArchConfig;

mod trace;
use trace::trace;

#[derive(Parser, Debug)]
struct Args {
    /// Write one tiny step's inputs and results here (for `dflash_step.py oracle`).
    #[arg(long, conflicts_with = "shape")]
    dump: Option<PathBuf>,
    /// A target's HF directory (only its config.json is read) to time a drafter of.
    #[arg(long, required_unless_present = "dump")]
    shape: Option<PathBuf>,
    /// Where the step computes: cpu, or cuda (the CUDA build).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Drafter decoder layers.
    #[arg(long, default_value_t = 5)]
    layers: usize,
    /// The target's captured layers (the context), chosen by SpecForge's rule.
    #[arg(long, default_value_t = 5)]
    captured: usize,
    #[arg(long, default_value_t = 16)]
    block: usize,
    #[arg(long, default_value_t = 512)]
    anchors: usize,
    /// Tokens of the one sequence.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Attend the anchors in groups by position each spanning fewer than this many positions
    /// (the drafter's default: 512); `--tokens` or more attends a part's anchors in one group.
    #[arg(long)]
    context_per_group: Option<usize>,
    /// Also time each step's gradient with every part run alone, its sequence's context projected
    /// again in each (the schedule before a context spanning parts was projected once),
    /// interleaved with the worker's step by step: `gradient_per_part_s`.
    #[arg(long)]
    per_part: bool,
    /// Leave glibc's malloc at its defaults; without it the step runs as a worker's does, freed
    /// memory kept for reuse (`worker_runtime::malloc`).
    #[arg(long)]
    glibc_malloc: bool,
    /// After the warm-up step, run one gradient pass by pass, the device synchronized after
    /// each, and print the time each pass of each part took and the memory after it (on a GPU
    /// the driver's count of the device's memory in use, which includes freed memory the pool
    /// keeps, and the pool's allocations: alive then, and the most alive during the pass; on the
    /// CPU the process's resident size, a high-water mark while freed memory is kept, as here
    /// without --glibc-malloc): where a step's time and memory go. The JSON's `traced` sums
    /// the times by pass (a little more than a gradient's: each synchronize idles the device
    /// while the host queues the next pass) and gives the peaks.
    #[arg(long, alias = "trace-memory")]
    trace: bool,
    /// Timed steps (after one warm-up).
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let malloc = match a.glibc_malloc {
        true => worker_runtime::malloc::Malloc::UserSet("--glibc-malloc"),
        false => worker_runtime::malloc::keep_freed_memory(),
    };
    eprintln!("malloc: {malloc:?}");
    match &a.dump {
        Some(dir) => dump(dir),
        None => time(&a),
    }
}

/// A drafter (seed 3) with the settings a drafter worker reads from the environment: the LM
/// head's chunk, and how the attention is differentiated (returned too, for the JSON).
fn drafter(cfg: DflashConfig, frozen: Frozen) -> anyhow::Result<(Dflash, AttentionBackward)> {
    let mut d = Dflash::new(cfg, frozen, 3).context("making the drafter")?;
    let attention = gpu::dflash::settings_from_env(&mut d)?;
    Ok((d, attention))
}

/// Token ids of a made-up sequence, below `vocab`.
fn ids(t: usize, vocab: usize, salt: u64) -> Vec<u32> {
    (0..t as u64)
        .map(|i| (dataset::mix(i ^ salt) % vocab as u64) as u32)
        .collect()
}

fn dump(dir: &Path) -> anyhow::Result<()> {
    let target = dir.join("target");
    let spec = MakeSpec {
        layers: 4,
        vocab: 300,
        ..MakeSpec::default()
    };
    make_model(&target, &spec).context("making the tiny target")?;
    let arch = ArchConfig::load(&target)?;
    let mask = mask_token_id(&target, arch.vocab_size, None)?;
    let cfg = DflashConfig::for_target(&arch, vec![1, 2], Some(2), 4, mask);
    let frozen = Frozen::load(&target, &Device::Cpu)?;
    let (mut d, _) = drafter(cfg, frozen)?;
    // Groups by position spanning 16 here, where the default (512) is longer than the tiny
    // sequences: the first sequence's blocks run in three groups, the second's in one (torch's
    // batched form groups the same way, from `context_per_group` in step.json).
    d.set_context_per_group(16);
    let lens = [48u32, 17];
    let t = lens.iter().sum::<u32>() as usize;
    let tok = ids(t, 290, 1);
    let greedy = ids(t, 290, 2);
    let mut loss_mask = vec![1u8; t];
    loss_mask[3] = 0;
    let sampling = Sampling {
        num_anchors: 24,
        gamma: 7.0,
        label: Label::Target,
        seed: 1,
    };
    let batch = DraftBatch::new(&d.cfg, &sampling, 9, &tok, &loss_mask, &greedy, &lens);
    let width = d.cfg.target_layer_ids.len() * d.cfg.hidden;
    let feats: Vec<f32> = (0..t * width)
        .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let ctx = Tensor::from_vec(feats, (t, width), &Device::Cpu)?;
    let mut grad = vec![0.0f32; d.params.flat()?.len()];
    let sums = d.loss_and_grads(&ctx, &batch, &mut grad)?;

    let mut out: HashMap<String, Tensor> = HashMap::new();
    let mut at = 0;
    for ((name, t), shape) in d.params.tensors().zip(d.params.shapes()) {
        out.insert(name.to_string(), t.clone());
        let n: usize = shape.iter().product();
        let g = Tensor::from_slice(&grad[at..at + n], shape.as_slice(), &Device::Cpu)?;
        out.insert(format!("grad.{name}"), g);
        at += n;
    }
    out.insert("frozen.embed".into(), d.frozen.embed.clone());
    out.insert("frozen.lm_head".into(), d.frozen.lm_head.clone());
    out.insert("ctx".into(), ctx);
    candle_core::safetensors::save(&out, dir.join("step.safetensors"))?;
    let seqs: Vec<_> = (batch.seqs.iter())
        .map(|s| serde_json::json!({"ctx_start": s.ctx_start, "ctx_len": s.ctx_len, "anchors": s.anchors}))
        .collect();
    let json = serde_json::json!({
        "config": d.cfg.to_json("float32"),
        "context_per_group": d.context_per_group(),
        "seqs": seqs,
        "block_ids": batch.block_ids,
        "labels": batch.labels,
        "weights": batch.weights,
        "loss": sums.loss,
        "weight": sums.weight,
        "accepted": sums.accepted,
        "blocks": sums.blocks,
    });
    std::fs::write(dir.join("step.json"), serde_json::to_string_pretty(&json)?)?;
    println!(
        "wrote {} (loss {:.6}, {} blocks)",
        dir.display(),
        sums.loss,
        sums.blocks
    );
    Ok(())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

fn time(a: &Args) -> anyhow::Result<()> {
    let shape = a
        .shape
        .as_ref()
        .expect("clap requires --shape without --dump");
    let kind = match a.device.as_str() {
        "cuda" => gpu::BackendKind::Cuda,
        _ => gpu::BackendKind::Candle,
    };
    let dev = gpu::candle::Placement::of(kind)?.device;
    let arch = ArchConfig::load(shape)?;
    let ids_l = model::capture::default_layer_ids(arch.num_hidden_layers, a.captured)?;
    let cfg = DflashConfig::for_target(
        &arch,
        ids_l,
        Some(a.layers),
        a.block,
        arch.vocab_size as u32 - 1,
    );
    let (v, h) = (cfg.vocab, cfg.hidden);
    let frozen = Frozen {
        embed: (Tensor::randn(0f32, 0.02, (v, h), &dev)?),
        lm_head: (Tensor::randn(0f32, 0.02, (v, h), &dev)?),
    };
    let made = Instant::now();
    let (mut d, attention) = drafter(cfg, frozen)?;
    if let Some(n) = a.context_per_group {
        d.set_context_per_group(n);
    }
    // Its weights drawn (Params::new, in parallel), as a drafter worker's start and restart.
    let init_s = made.elapsed().as_secs_f64();
    let width = d.cfg.target_layer_ids.len() * h;
    let ctx = Tensor::randn(0f32, 1.0, (a.tokens, width), &dev)?;
    let sampling = Sampling {
        num_anchors: a.anchors,
        gamma: 7.0,
        label: Label::Target,
        seed: 1,
    };
    let tok = ids(a.tokens, v, 1);
    let greedy = ids(a.tokens, v, 2);
    let mask = vec![1u8; a.tokens];
    let lens = [a.tokens as u32];
    let batch = DraftBatch::new(&d.cfg, &sampling, 0, &tok, &mask, &greedy, &lens);
    let adamw = AdamWConfig {
        lr: 6e-4,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        warmup_steps: 0,
        total_steps: 1000,
        min_lr_ratio: 0.1,
        clip: 1.0,
    };
    let mut opt = DeviceAdamW::new(adamw, &d.params).context("making AdamW's moments")?;
    // On the CPU, the GPU's form of the update (moments as tensors, candle's element-wise ops)
    // timed beside the host loop the CPU uses, on a copy of the weights.
    let mut shadow = match dev {
        Device::Cpu => {
            let values = (d.params.names().iter().cloned())
                .zip(d.params.shapes().iter().cloned())
                .zip(
                    d.params
                        .tensors()
                        .map(|(_, t)| t.flatten_all()?.to_vec1::<f32>()),
                )
                .map(|((n, s), w)| Ok((n, s, w?)))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let p = model::train::Params::from_values(values, &dev)?;
            let o = DeviceAdamW::with_tensors(adamw, &p)?;
            Some((p, o))
        }
        _ => None,
    };
    let mut tensor_updates = Vec::new();
    // What the worker runs: on a GPU the gradient stays there (the NCCL group reduces it on
    // the device), on the CPU it is the step buffer's, a host vector.
    let on_device = !dev.is_cpu();
    let mut grad = vec![0.0f32; if on_device { 0 } else { d.params.len() }];
    let (mut grads, mut updates, mut digests, mut total) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut digest = 0;
    let mut loss = 0.0;
    // A layer's attention scores in one gradient (the drafter's count).
    let mut scores = 0;
    // The parts the worker cuts the batch into; the sequence's context is projected once.
    let budget = gpu::dflash::scores_per_part(&dev);
    let parts = batch.split(&d.cfg, budget);
    eprintln!("{} parts of at most {budget} attention scores", parts.len());
    // One schedule's gradient, to where the worker's goes, the device done with it.
    let gradient = |grad: &mut Vec<f32>, schedule| -> anyhow::Result<_> {
        grad.fill(0.0);
        let out = if on_device {
            let (s, flat) = gpu::dflash::loss_and_flat_grads_in_parts(&d, &ctx, &batch, schedule)
                .with_context(|| format!("the gradient ({schedule:?})"))?;
            (s, Some(flat))
        } else {
            let s = gpu::dflash::loss_and_grads_in_parts(&d, &ctx, &batch, grad, schedule)
                .with_context(|| format!("the gradient ({schedule:?})"))?;
            (s, None)
        };
        dev.synchronize()?;
        Ok(out)
    };
    let mut traced = None;
    let mut per_part = Vec::new();
    // The gradient with every part run alone (`--per-part`), timed into `per_part`.
    let mut alone = |grad: &mut Vec<f32>, step: usize| -> anyhow::Result<()> {
        let t = Instant::now();
        gradient(grad, gpu::dflash::Schedule::Alone)?;
        if step > 0 {
            per_part.push(t.elapsed().as_secs_f64());
        }
        Ok(())
    };
    for step in 0..=a.steps {
        // Traced once warm (step 0 loaded the kernels and grew the pool), before the timed
        // steps, whose figures it leaves alone.
        if a.trace && step == 1 {
            traced = Some(trace(&d, &ctx, &parts, &dev)?);
        }
        // The two schedules take turns going first, so neither gains from the order.
        if a.per_part && step % 2 == 1 {
            alone(&mut grad, step)?;
        }
        let t0 = Instant::now();
        let made = d.scores_made();
        let (s, flat) = gradient(&mut grad, gpu::dflash::Schedule::Together)?;
        scores = d.scores_made() - made;
        let weight = s.weight;
        loss = s.loss;
        let t1 = Instant::now();
        let scale = 1.0 / weight.max(1.0) as f32;
        match &flat {
            Some(g) => opt.update_flat(&d.params, g, scale),
            None => opt.update(&d.params, &grad, scale),
        }
        .context("the update")?;
        dev.synchronize()?;
        let t2 = Instant::now();
        // The worker's digest for the ledger: on a GPU of the row sums made there, on the CPU
        // of the weights copied to the host.
        digest ^= if on_device {
            gpu::dflash::row_digest(&d.params)?
        } else {
            gpu::mock::digest(&d.params.flat()?)
        };
        let t3 = Instant::now();
        if let Some((p, o)) = &mut shadow {
            o.update(p, &grad, 1.0 / weight.max(1.0) as f32)?;
            if step > 0 {
                tensor_updates.push(t3.elapsed().as_secs_f64());
            }
        }
        if a.per_part && step % 2 == 0 {
            alone(&mut grad, step)?;
        }
        if step > 0 {
            grads.push((t1 - t0).as_secs_f64());
            updates.push((t2 - t1).as_secs_f64());
            digests.push((t3 - t2).as_secs_f64());
            total.push((t3 - t0).as_secs_f64());
        }
    }
    let json = serde_json::json!({
        "device": a.device,
        "params": d.params.len(),
        "tokens": a.tokens,
        "anchors": batch.blocks(),
        "parts": parts.len(),
        // A layer's attention scores a step, and what they would be with every block over the
        // whole context (as torch's step makes them, masked).
        "scores": scores,
        "scores_whole_context": batch.blocks() * d.cfg.heads * a.block * (a.tokens + a.block),
        "context_per_group": d.context_per_group(),
        "block": a.block,
        "layers": a.layers,
        "captured": d.cfg.target_layer_ids,
        "dtype": format!("{:?}", DType::F32),
        "init_s": init_s,
        "gradient_on": if on_device { "device" } else { "host" },
        // The f32 products on TF32 tensor cores (HSPIPE_CUDA_TF32=on; a GPU's only).
        "tf32": on_device && candle_core::cuda::gemm_reduced_precision_f32(),
        "attention": match attention {
            AttentionBackward::ByHand => "by-hand",
            AttentionBackward::Autograd => "autograd",
        },
        "step_s": median(total),
        "gradient_s": median(grads),
        "gradient_per_part_s": a.per_part.then(|| median(per_part)),
        "update_s": median(updates),
        // The GPU's form of the update on this CPU (null on a GPU, where it is update_s).
        "update_tensors_s": shadow.is_some().then(|| median(tensor_updates)),
        "digest_s": median(digests),
        "traced": traced,
        "digests": format!("{digest:016x}"),
        "last_loss": loss,
    });
    println!("{json}");
    Ok(())
}
