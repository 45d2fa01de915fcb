//! The real-model commands: `launcher make-model` (a random-initialised model in the HF
//! layout) and `launcher capture` (a model's captured layers and greedy tokens for some data,
//! as safetensors, through the target workers' own forward).
//!
//! Length: about 650 lines: each command's flags are its `--help`; make-model's directory rule
//! and held signals, and capture's stop and cleanup, sit beside the command they serve.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use gpu::candle::CandleTarget;
use gpu::BackendKind;
use model::make::{ConfigStyle, MakeSpec, Stored};
use model::Family;
use proto::{Dtype, PipelineConfig};

use crate::signals::StopSignals;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModelType {
    Qwen3,
    Qwen2,
    Llama,
    /// Written with no sliding window, as Mistral 7B v0.3 is.
    Mistral,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum StoredDtype {
    Bf16,
    F16,
    F32,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Style {
    /// transformers 4: top-level rope_theta, rope_scaling and torch_dtype.
    Legacy,
    /// transformers 5: rope_parameters and dtype.
    V5,
}

/// Write a random-initialised dense decoder in the HF layout: config.json, model.safetensors
/// (or shards with model.safetensors.index.json), tokenizer.json (a byte-level BPE) and
/// tokenizer_config.json. The loader reads it as any HF checkpoint; it is for trying hspipe's
/// real-model path on a CPU, for tests and for benchmarks. Random weights give states a drafter
/// learns little from; --train first trains it on the built-in synthetic language.
///
/// Examples:
///   launcher make-model tiny                         the tiny Qwen3 of the tests (8 layers, hidden 64)
///   launcher make-model tiny --layers 2 --train      the README's DFlash demo target, trained
///   launcher make-model mid --layers 8 --hidden 512 --heads 8 --kv-heads 4 --head-dim 64 --intermediate 1536 --vocab 8192
///   launcher make-model l3 --model-type llama --llama3-scaling --untied
#[derive(Parser, Debug)]
#[command(name = "launcher make-model", verbatim_doc_comment)]
pub struct MakeModelArgs {
    /// Directory to write: a new or empty one; with --force, one holding only a model's files
    /// (it is replaced whole, symbolic links in it by files: what they name is left alone).
    pub dir: PathBuf,
    #[arg(long, value_enum, default_value_t = ModelType::Qwen3)]
    pub model_type: ModelType,
    #[arg(long, default_value_t = 8)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// Head size, written as its own field (Qwen3 style); 0 writes none (HF then takes 128
    /// for qwen3 and hidden / heads for the others).
    #[arg(long, default_value_t = 16)]
    pub head_dim: usize,
    #[arg(long, default_value_t = 128)]
    pub intermediate: usize,
    /// Vocabulary size (at least 261: 256 bytes and 5 special tokens).
    #[arg(long, default_value_t = 1024)]
    pub vocab: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Standard deviation of the weights (HF's initializer_range).
    #[arg(long, default_value_t = 0.02)]
    pub init_std: f32,
    /// How the weights are stored.
    #[arg(long, value_enum, default_value_t = StoredDtype::Bf16)]
    pub dtype: StoredDtype,
    /// Write lm_head.weight (default: tied to the embedding, no lm_head in the files).
    #[arg(long)]
    pub untied: bool,
    /// Split the weights into shards of at most this many MiB (at least 1), with an index.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_mib: Option<u64>,
    /// Which transformers' config.json style to write.
    #[arg(long, value_enum, default_value_t = Style::Legacy)]
    pub config_style: Style,
    #[arg(long, default_value_t = 1_000_000.0)]
    pub rope_theta: f64,
    /// Llama 3.1's rope scaling (factor 8, frequency factors 1 and 4, 8192 original positions).
    #[arg(long)]
    pub llama3_scaling: bool,
    /// Replace a model already in DIR (or DIR as a symbolic link): DIR is replaced whole, in one
    /// rename, and refused where it holds files that are not a model's.
    #[arg(long)]
    pub force: bool,
    /// Train the model on the built-in synthetic language (next-token cross-entropy, AdamW)
    /// before writing it: a target worth drafting for (qwen3 only; about a minute for a 2-layer
    /// tiny model on two cores, `--layers 2 --train`). Prints the loss as it goes and the
    /// trained model's held-out accuracy.
    #[arg(long)]
    pub train: bool,
    /// Training steps (with --train).
    #[arg(long, default_value_t = 1000, requires = "train")]
    pub train_steps: usize,
    /// Sequences per step, and tokens per sequence (with --train; at most the model's
    /// max_position_embeddings, 32768).
    #[arg(long, default_value_t = 8, requires = "train")]
    pub train_batch: usize,
    #[arg(long, default_value_t = 64, requires = "train")]
    pub train_len: usize,
    /// Peak learning rate (with --train).
    #[arg(long, default_value_t = 1e-2, requires = "train")]
    pub train_lr: f64,
}

/// `launcher make-model`.
///
/// DIR is written whole and at once: the model is drawn (and trained) in memory, then its files
/// are written into a fresh directory beside DIR and swapped in with one rename
/// ([`model::make::Made::write`]). So a stop or a crash leaves the old DIR (or none), never a
/// mix, and nothing is ever written through a symbolic link found there. Without --force DIR
/// must be new or an empty directory; with it, a directory of a model's files (or a link,
/// itself replaced), as [`model::make::check_dir`] says. Both are checked before any work.
///
/// A stop signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) while the model is drawn or trained ends
/// make-model by that signal, as by default: nothing is on disk yet. While the files are written
/// and swapped in (seconds at most) it is held, and acted on once the model is in place, so
/// no temporary directory is left beside DIR.
pub fn run_make_model(a: MakeModelArgs) -> anyhow::Result<i32> {
    if !a.force {
        refuse_in_use(&a.dir)?;
    }
    model::make::check_dir(&a.dir)?;
    let spec = MakeSpec {
        family: match a.model_type {
            ModelType::Qwen3 => Family::Qwen3,
            ModelType::Qwen2 => Family::Qwen2,
            ModelType::Llama => Family::Llama,
            ModelType::Mistral => Family::Mistral,
        },
        layers: a.layers,
        hidden: a.hidden,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: (a.head_dim > 0).then_some(a.head_dim),
        intermediate: a.intermediate,
        vocab: a.vocab,
        seed: a.seed,
        init_std: a.init_std,
        stored: match a.dtype {
            StoredDtype::Bf16 => Stored::Bf16,
            StoredDtype::F16 => Stored::F16,
            StoredDtype::F32 => Stored::F32,
        },
        tied: !a.untied,
        shard_bytes: a.shard_mib.map(|m| m.saturating_mul(1 << 20)),
        style: match a.config_style {
            Style::Legacy => ConfigStyle::Legacy,
            Style::V5 => ConfigStyle::V5,
        },
        rope_theta: a.rope_theta,
        llama3: a.llama3_scaling.then_some(model::config::Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }),
        attention_bias: false,
        train: a.train.then_some(model::pretrain::TrainSpec {
            steps: a.train_steps,
            batch: a.train_batch,
            seq_len: a.train_len,
            lr: a.train_lr,
        }),
    };
    let started = Instant::now();
    let mut last_line = Instant::now();
    let steps = a.train_steps;
    let mut progress = |step: usize, loss: f64| {
        if step == 1 || step == steps || last_line.elapsed() > Duration::from_secs(5) {
            println!(
                "train: step {step}/{steps} loss {loss:.3} ({:.0} s)",
                started.elapsed().as_secs_f64()
            );
            last_line = Instant::now();
        }
    };
    let made = model::make::build(&spec, &mut progress)
        .with_context(|| format!("making a model in {}", a.dir.display()))?;
    let held = HeldSignals::hold().context("holding the stop signals")?;
    let written = made.write(&a.dir);
    held.release();
    written.with_context(|| format!("writing the model as {}", a.dir.display()))?;
    println!(
        "{}: {} with {} layers, hidden {}, vocabulary {} (seed {})",
        a.dir.display(),
        spec.family.name(),
        spec.layers,
        spec.hidden,
        spec.vocab,
        spec.seed
    );
    if a.train {
        let fit = model::pretrain::evaluate(&a.dir, 16)
            .with_context(|| format!("evaluating {}", a.dir.display()))?;
        println!(
            "train: held-out next-token accuracy {:.1}% (chance {:.1}%, the language's likeliest successor {:.1}% of the time); greedy picks the likeliest successor at {:.1}% of positions and repeats the last token at {:.1}% of decoding steps",
            100.0 * fit.accuracy,
            100.0 * fit.chance,
            100.0 * dataset::language::likeliest_share(),
            100.0 * fit.follows_chain,
            100.0 * fit.greedy_repeats
        );
    }
    Ok(0)
}

/// Without --force, DIR is new or an empty directory: a model there is replaced only when asked,
/// and other files (a directory that is not a model, a link) are never replaced.
fn refuse_in_use(dir: &Path) -> anyhow::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return Ok(());
    };
    if meta.is_symlink() {
        bail!(
            "{} is a symbolic link; pass --force to replace the link with the model's directory (what it names is left alone)",
            dir.display()
        );
    }
    if !meta.is_dir() {
        // check_dir says what it is.
        return Ok(());
    }
    if std::fs::symlink_metadata(dir.join("config.json")).is_ok() {
        bail!(
            "{} already holds a model (config.json); pass --force to replace it",
            dir.display()
        );
    }
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {}", dir.display()))?;
    if !names.is_empty() {
        names.sort();
        let n = names.len();
        names.truncate(5);
        bail!(
            "{} is not empty (it holds {}{}) and has no config.json; make-model writes a new or empty directory",
            dir.display(),
            names.join(", "),
            if n > 5 { format!(" and {} more", n - 5) } else { String::new() }
        );
    }
    Ok(())
}

/// The stop signals, held while the model is put in place: each one received is recorded
/// and, once [`HeldSignals::release`]d, acted on as by default (the process ends by it).
/// Before `hold` they have their default action; after `release` they have it again (emulated
/// by signal-hook: the handlers stay installed).
struct HeldSignals {
    armed: Arc<AtomicBool>,
    got: Vec<(std::ffi::c_int, Arc<AtomicBool>)>,
}

impl HeldSignals {
    fn hold() -> std::io::Result<HeldSignals> {
        let armed = Arc::new(AtomicBool::new(false));
        let mut got = Vec::new();
        for sig in proto::stop::STOP_SIGNALS {
            let seen = Arc::new(AtomicBool::new(false));
            // The default action first: armed, it ends the process before `seen` is set.
            signal_hook::flag::register_conditional_default(sig, Arc::clone(&armed))?;
            signal_hook::flag::register(sig, Arc::clone(&seen))?;
            got.push((sig, seen));
        }
        Ok(HeldSignals { armed, got })
    }

    /// Arms the default action again, then acts on a signal received while held.
    fn release(self) {
        // SYNC: the handlers load both with SeqCst; a signal after this store ends the process
        // in its handler, one before it is seen below.
        self.armed.store(true, Ordering::SeqCst);
        for (sig, seen) in &self.got {
            if seen.load(Ordering::SeqCst) {
                let _ = signal_hook::low_level::emulate_default_handler(*sig);
            }
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OutDtype {
    Bf16,
    F16,
    F32,
}

/// Run a model over some data and write what a target worker would put in the ring: for each
/// sample, its captured layers and the target's greedy next tokens, as safetensors shards.
///
/// Each sample ID gives tensors `ID.hidden_states` [tokens, layers, hidden] (the decoder
/// layers of target_layer_ids, HF's hidden_states[i + 1] for layer i), `ID.target_tokens`
/// [tokens] u32 and `ID.input_ids` [tokens] u32; OUT/index.json names each sample's shard and
/// the layers. The forward is the target workers' own code.
///
/// Examples:
///   launcher capture --model tiny --synthetic 20 -o caps
///   launcher capture --model Qwen3-8B --data train.jsonl --layers 1,9,17,25,33 -o caps
#[derive(Parser, Debug)]
#[command(name = "launcher capture", verbatim_doc_comment)]
pub struct CaptureArgs {
    /// The HF model directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Training data, as for a run (JSONL, Parquet, Arrow, HF datasets directory).
    #[arg(long, conflicts_with = "synthetic")]
    pub data: Option<PathBuf>,
    /// Where --data is prepared, or found prepared (the runs' default: runs/data-cache).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "runs/data-cache",
        requires = "data"
    )]
    pub data_cache: PathBuf,
    /// N samples of the built-in synthetic dataset (default 16 when --data is absent); 1 to
    /// 67108864.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=proto::config::MAX_SYNTHETIC_SAMPLES))]
    pub synthetic: Option<u64>,
    /// Output directory (created; must be empty).
    #[arg(short, long, value_name = "DIR")]
    pub out: PathBuf,
    /// Pipeline config (data lengths, model.layers or model.target_layer_ids).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Decoder layers to capture, e.g. 1,9,17 (default: SpecForge's rule for model.layers).
    #[arg(long, value_delimiter = ',')]
    pub layers: Option<Vec<u32>>,
    /// Skip the greedy tokens: the forward stops after the last captured layer.
    #[arg(long)]
    pub no_tokens: bool,
    /// The hidden states' dtype.
    #[arg(long, value_enum, default_value_t = OutDtype::Bf16)]
    pub dtype: OutDtype,
    /// Most bytes of tensor data in one shard, in MiB (a sample larger than that is a shard of
    /// its own); at least 1.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_mib: u64,
    /// CPU threads to compute with, 1 to 1024 as the config's [target] threads (default:
    /// RAYON_NUM_THREADS, else every core).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=proto::config::MAX_THREADS as u64))]
    pub threads: Option<usize>,
}

/// One sample's tensors, encoded.
struct Captured {
    id: u64,
    tokens: usize,
    hidden: Vec<u8>,
    greedy: Vec<u8>,
    ids: Vec<u8>,
}

/// The config `launcher capture` runs with: `--config`'s (or the default) with the flags'
/// model, layers, dtype and data, the model's shape settled, checked.
fn capture_config(a: &CaptureArgs) -> anyhow::Result<PipelineConfig> {
    // Checked below, with the flags in: the file's data and epochs are a run's.
    let mut cfg = match &a.config {
        Some(p) => PipelineConfig::load_unchecked(p)?,
        None => PipelineConfig::default(),
    };
    cfg.model.path = Some(a.model.clone());
    if let Some(ids) = &a.layers {
        cfg.model.target_layer_ids = Some(ids.clone());
        cfg.model.layers = ids.len() as u32;
    }
    cfg.model.dtype = match a.dtype {
        OutDtype::Bf16 => Dtype::Bf16,
        OutDtype::F16 => Dtype::F16,
        OutDtype::F32 => Dtype::F32,
    };
    cfg.data.path = a.data.clone();
    // Prepared below from --data; a run's config.toml names its own prepared file, which would
    // otherwise be captured instead of --synthetic's samples.
    cfg.data.prepared = None;
    cfg.data.prepared_key = None;
    if a.data.is_none() {
        cfg.data.synthetic_samples = a.synthetic.unwrap_or(16);
    }
    // A capture passes over its data once: a run's epochs, and its plan's bound, are not its.
    cfg.data.epochs = 1;
    gpu::settle(BackendKind::Candle, &mut cfg)
        .context("checking the model (its config.json and weights)")?;
    cfg.validate().context("checking the config")?;
    Ok(cfg)
}

/// What `launcher capture` wrote, removed unless it completes ([`Output::keep`]): the output
/// directory if the capture made it, else what it put in it (it was empty).
///
/// A capture stopped or failed half-way leaves nothing rather than a partial result with its
/// index: a capture cannot be resumed, a part's index would read as a whole capture of fewer
/// samples to whoever finds it later, and an emptied `-o` takes the same command again.
struct Output {
    dir: PathBuf,
    made: bool,
    keep: bool,
}

impl Output {
    /// Removes what the capture wrote in `dir`; says what, for the user's line.
    fn remove(dir: &Path, made: bool) -> String {
        if made {
            let _ = std::fs::remove_dir_all(dir);
            return format!(": {} removed", dir.display());
        }
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let p = e.path();
                let _ = if e.file_type().is_ok_and(|t| t.is_dir()) {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
            }
        }
        format!(": {} emptied of what it wrote", dir.display())
    }

    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if !self.keep {
            Output::remove(&self.dir, self.made);
        }
    }
}

/// `launcher capture`.
pub fn run_capture(a: CaptureArgs) -> anyhow::Result<i32> {
    if let Some(n) = a.threads {
        // Read by candle's kernels when they first run; no other thread exists yet.
        std::env::set_var("RAYON_NUM_THREADS", n.max(1).to_string());
    }
    // Stops end the capture between samples (or its data's preparation), with nothing left.
    let signals = StopSignals::install().context("installing signal handlers")?;
    let mut cfg = capture_config(&a)?;
    // A link to nowhere is neither new nor a directory: said as what it is.
    if let (Ok(link), false) = (std::fs::read_link(&a.out), a.out.exists()) {
        bail!(
            "-o {}: a link to {}, which does not exist: make that directory, or name another output",
            a.out.display(),
            link.display()
        );
    }
    let in_use = a.out.exists()
        && std::fs::read_dir(&a.out)
            .with_context(|| format!("-o {}: the output must be a directory", a.out.display()))?
            .next()
            .is_some();
    if in_use {
        bail!(
            "{} is not empty; capture writes into an empty or new directory",
            a.out.display()
        );
    }
    let made = std::fs::symlink_metadata(&a.out).is_err();
    let (dir, made_) = (a.out.clone(), made);
    signals.exit_on_second("capture", move || Output::remove(&dir, made_));
    let stopped = |what: &str| signals.check(|| format!("{what}: nothing of the capture is left"));
    if let Some(input) = &a.data {
        let options = crate::data::options(&cfg, cfg.data.max_len)?;
        let (p, line) =
            crate::data::prepare_dataset(input, &options, &a.data_cache, None, Some(&signals))?;
        println!("{line}");
        cfg.data.prepared = Some(p.path);
        cfg.data.prepared_key = Some(p.key);
    }
    stopped("before the capture began")?;
    let data = target_worker::load_dataset(&cfg).context("loading the dataset")?;
    // Before any shard: data made for another tokenizer would stop the capture at its first
    // such sample, leaving shards without their index.
    if let Some(input) = &a.data {
        check_ids_fit(&data, &a.model, input)?;
    }
    stopped("before the capture began")?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let output = Output {
        dir: a.out.clone(),
        made,
        keep: false,
    };
    let target = CandleTarget::load(&a.model, &cfg)
        .with_context(|| format!("loading {}", a.model.display()))?;
    let layers = target.layers().to_vec();
    println!(
        "capture: {} samples of {} through {} (layers {layers:?}), {} threads",
        data.len(),
        data.source,
        a.model.display(),
        candle_threads(),
    );
    let (l, h, es) = (
        cfg.model.layers as usize,
        cfg.model.hidden as usize,
        cfg.model.dtype.size(),
    );
    let shard_max = a.shard_mib.max(1).saturating_mul(1 << 20);
    let mut shard: Vec<Captured> = Vec::new();
    let mut shard_bytes = 0u64;
    let mut index = BTreeMap::new();
    let mut shards = 0usize;
    let mut last_line = Instant::now();
    let started = Instant::now();
    let mut tokens_done = 0u64;
    for id in 0..data.len() as u64 {
        stopped(&format!("after {id} of {} samples", data.len()))?;
        let Some(s) = data.sample(id) else { continue };
        let ids = s.input_ids.into_owned();
        let t = ids.len();
        let mut hidden = vec![0u8; t * l * h * es];
        let mut greedy = vec![0u8; t * 4];
        let out = gpu::TargetOut {
            hidden_states: &mut hidden,
            target_tokens: &mut greedy,
        };
        target
            .run(&ids, &[t as u32], out, !a.no_tokens)
            .with_context(|| format!("running {} on sample {id}", a.model.display()))?;
        tokens_done += t as u64;
        let bytes = (hidden.len() + greedy.len() + t * 4) as u64;
        // The shard is written before it would pass --shard-mib; a sample larger than that
        // alone gets a shard of its own.
        if !shard.is_empty() && shard_bytes + bytes > shard_max {
            shards += 1;
            write_shard(&a.out, shards, &shard, (l, h), cfg.model.dtype, &mut index)?;
            shard.clear();
            shard_bytes = 0;
        }
        shard_bytes += bytes;
        shard.push(Captured {
            id,
            tokens: t,
            hidden,
            greedy,
            ids: ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
        });
        if last_line.elapsed() > Duration::from_secs(5) {
            println!(
                "capture: {} of {} samples, {:.0} tokens/s",
                id + 1,
                data.len(),
                tokens_done as f64 / started.elapsed().as_secs_f64()
            );
            last_line = Instant::now();
        }
    }
    if !shard.is_empty() {
        shards += 1;
        write_shard(&a.out, shards, &shard, (l, h), cfg.model.dtype, &mut index)?;
    }
    let meta = serde_json::json!({
        "model": std::path::absolute(&a.model)?,
        "target_layer_ids": layers,
        "dtype": cfg.model.dtype,
        "greedy_tokens": !a.no_tokens,
        "samples": index,
    });
    let p = a.out.join("index.json");
    stopped(&format!("after its {} samples", data.len()))?;
    atomic_file::replace(&p, serde_json::to_string_pretty(&meta)?.as_bytes())
        .with_context(|| format!("writing {}", p.display()))?;
    output.keep();
    println!(
        "capture: {} samples, {tokens_done} tokens in {shards} shards under {} ({:.0} tokens/s)",
        data.len(),
        a.out.display(),
        tokens_done as f64 / started.elapsed().as_secs_f64()
    );
    Ok(0)
}

/// The threads candle computes with (`RAYON_NUM_THREADS`, else the cores).
fn candle_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn write_shard(
    dir: &Path,
    n: usize,
    samples: &[Captured],
    (l, h): (usize, usize),
    dtype: Dtype,
    index: &mut BTreeMap<String, String>,
) -> anyhow::Result<()> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype as S;
    let name = format!("capture-{n:05}.safetensors");
    let st = match dtype {
        Dtype::Bf16 => S::BF16,
        Dtype::F16 => S::F16,
        Dtype::F32 => S::F32,
    };
    let mut views = Vec::with_capacity(samples.len() * 3);
    for s in samples {
        let t = s.tokens;
        views.push((
            format!("{}.hidden_states", s.id),
            TensorView::new(st, vec![t, l, h], &s.hidden)?,
        ));
        views.push((
            format!("{}.target_tokens", s.id),
            TensorView::new(S::U32, vec![t], &s.greedy)?,
        ));
        views.push((
            format!("{}.input_ids", s.id),
            TensorView::new(S::U32, vec![t], &s.ids)?,
        ));
        index.insert(s.id.to_string(), name.clone());
    }
    let p = dir.join(&name);
    let bytes = safetensors::serialize(views, None)?;
    atomic_file::replace(&p, &bytes).with_context(|| format!("writing {}", p.display()))?;
    Ok(())
}

/// Every token id of `data` is inside the vocabulary of the model in `dir`: a file made for
/// another tokenizer is refused here, naming the sample, before any worker starts (a target
/// worker would otherwise fail on it mid-run, again at each restart). One pass over the mapped
/// ids, whose pages are let go of after it.
pub fn check_ids_fit(data: &dataset::Dataset, dir: &Path, input: &Path) -> anyhow::Result<()> {
    let vocab = model::ArchConfig::load(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .vocab_size;
    for id in 0..data.len() as u64 {
        let Some(s) = data.sample(id) else { break };
        if let Some(pos) = s.input_ids.iter().position(|&t| t as usize >= vocab) {
            bail!(
                "{}: sample {id}: token id {} at position {pos} is outside the model's vocabulary of {vocab} ({}): was the data tokenized for another model?",
                input.display(),
                s.input_ids[pos],
                dir.display()
            );
        }
    }
    data.unmap_resident();
    Ok(())
}

#[cfg(test)]
mod tests;
