//! The pipeline config: one serde struct, loadable from TOML, passed unchanged to every worker.
//!
//! Every field has a default, so an empty file (or none) is a valid config: the defaults run the
//! mock pipeline quickly on a laptop-sized machine while keeping the shape of the real problem
//! (5 captured layers, bf16, length-bucketed batches under a token budget).
//!
//! Length: about 800 lines, a third of them tests: each section's struct, its defaults and its
//! validation belong together, and validation across sections (the ring against the workers)
//! needs them all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shm_ring::{BucketPick, RingParams, Role, TakePolicy, WorkerName};

use crate::batch::{batch_len, BatchSpec, Dtype};

/// Everything a run is configured by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    pub ring: RingConfig,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub target: TargetConfig,
    pub drafter: DrafterConfig,
    /// The DFlash drafter the candle backend trains (the mock ignores it).
    pub dflash: DflashConfig,
    /// Faults to inject, by worker name (`target-1`, `drafter-0`): see [`Faults`] for who
    /// injects which.
    pub faults: BTreeMap<String, Faults>,
}

/// Faults to inject into one worker. The mock backend injects its own (`crash_after`,
/// `hang_after`, `slow`, `crash_at_start`, and a mock drafter's `crash_on_sample` and
/// `fail_on_sample`: crash or hang after N items, run slower by a factor, crash at start-up,
/// crash or fail as the device on a batch holding a sample; its `nan_gradient_from_step`, a
/// gradient that is NaN from a step on); the drafter worker injects the
/// four in the group protocol (`crash_in_sync_at`, `crash_after_commit_at`, `crash_in_join`,
/// `crash_in_end_round`), a failing checkpoint write (`checkpoint_fails_from`), a failing export
/// (`export_fails_at`) and a full disk under its ledger
/// (`ledger_full_for`), and our target worker `crash_on_sample`, `fail_on_sample` and `fault_on_sample` in its
/// forward, for any backend (a Python target injects none). Counted per process: a restarted worker starts
/// counting again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    pub crash_after: Option<u64>,
    pub hang_after: Option<u64>,
    /// Multiplies simulated time (absent: normal speed).
    pub slow: Option<f64>,
    /// Crash right after start-up, every time (a crash loop).
    pub crash_at_start: bool,
    /// Drafters: crash while waiting in the group's reduction of step N or later (after this
    /// rank contributed, before the step committed). First incarnation only.
    pub crash_in_sync_at: Option<u64>,
    /// Drafters: crash once the group applied step N (or later) and before this rank wrote its
    /// ledger line and released its batch. First incarnation only.
    pub crash_after_commit_at: Option<u64>,
    /// Drafters: crash while waiting to rejoin the group, once.
    pub crash_in_join: bool,
    /// Drafters: crash in the group's last round (every member saw the ring's end) once it
    /// committed, before this rank marked it as the end round (the others mark it). First
    /// incarnation only.
    pub crash_in_end_round: bool,
    /// Our targets (any backend) and mock drafters: crash computing any batch that holds sample N,
    /// in every incarnation (a batch that kills whoever computes it).
    pub crash_on_sample: Option<u64>,
    /// Our targets (any backend) and mock drafters: fail as a device fails (out of memory)
    /// computing any batch that holds sample N, in every incarnation.
    pub fail_on_sample: Option<u64>,
    /// Our targets (any backend): a kernel's fault on any batch that holds sample N, in every
    /// incarnation: its forward is issued, and every later call on the device fails (a device
    /// reports such a fault late, and for good).
    pub fault_on_sample: Option<u64>,
    /// Mock drafters: the rank's gradient holds a NaN at group step N and every later one, in
    /// every incarnation (a drafter that diverged: every update is skipped).
    pub nan_gradient_from_step: Option<u64>,
    /// Drafters: writing the checkpoint of group step N or any later one fails as on a full
    /// disk (ENOSPC, after part of the file was written), in every incarnation.
    pub checkpoint_fails_from: Option<u64>,
    /// Drafters whose backend exports (DFlash): the export of group step N fails once, as on a
    /// full disk (ENOSPC, after part of it was written), in every incarnation; the checkpoint is
    /// written all the same, and the export's next write (the next checkpoint step, or the
    /// end's) is not failed. Step 0 is never exported: N is 1 or more.
    pub export_fails_at: Option<u64>,
    /// Drafters: the rank's first N tries to write a ledger line fail as on a full disk
    /// (ENOSPC; the first after half the line was written, as a write the disk cut short), in
    /// every incarnation: a disk full for a while, which the rank waits out.
    pub ledger_full_for: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RingConfig {
    pub slots: u32,
    /// Bytes per slot (the ring's `slot_size`); 0 means "just enough for the largest batch the
    /// token budget allows". The TOML key is `slot_bytes`, as it always was; `slot_size` is
    /// accepted too.
    #[serde(rename = "slot_bytes", alias = "slot_size")]
    pub slot_size: u64,
    /// Length classes: bucket `b` holds batches whose longest sequence is in the b-th equal
    /// slice of `1..=max_len`.
    pub buckets: u32,
    /// `bucketed` (the predecessor's policy) or `fifo`.
    pub policy: PolicyName,
    pub min_ready: u32,
    pub pick: BucketPick,
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    Bucketed,
    Fifo,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            slots: 60,
            slot_size: 0,
            buckets: 6,
            policy: PolicyName::Bucketed,
            min_ready: 10,
            pick: BucketPick::Proportional,
            seed: 0x5eed,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The target: an HF model directory (`config.json`, safetensors weights, tokenizer), for
    /// the real-model backends (`--model DIR` sets it). None: the mock's made-up states.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Target layers captured per token (DFlash captures 5). With a model and no
    /// `target_layer_ids`, the layers are chosen by SpecForge's rule for this many.
    pub layers: u32,
    /// Decoder layers of the target to capture (HF's `hidden_states[i + 1]` for layer `i`);
    /// `layers` is then their number. None: SpecForge's rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_layer_ids: Option<Vec<u32>>,
    /// Hidden size. The real 27B target has 5120; the mock default is small so runs are quick.
    /// With a model, the model's own (set by the launcher).
    pub hidden: u32,
    pub dtype: Dtype,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            path: None,
            layers: 5,
            target_layer_ids: None,
            hidden: 64,
            dtype: Dtype::Bf16,
        }
    }
}

/// The most epochs a run may plan: past it, a typo would lay a plan of billions of batches.
pub const MAX_EPOCHS: u32 = 1000;

/// The most synthetic samples (2^26, the ring's most planned batches): every process holds
/// each sample's length, so a typo of a few more digits would take gigabytes in each (or
/// abort on the allocation) before a batch is trained.
pub const MAX_SYNTHETIC_SAMPLES: u64 = shm_ring::MAX_WORK_ITEMS;

/// The most sample passes a run plans (samples times epochs, 2^26): every process holds the
/// plan, a sample id per pass, so 1000 epochs of a million samples would take gigabytes in each
/// (or abort on the allocation) before a batch is trained.
pub const MAX_PLANNED_SAMPLES: u64 = shm_ring::MAX_WORK_ITEMS;

/// The most tokens in one batch (2^20): the ring's slot holds a batch's hidden states, so even
/// the mock's small shape needs a slot of 640 MiB at this budget; past it the sizing of the
/// largest batch alone would take gigabytes (or abort on the allocation).
pub const MAX_TOKEN_BUDGET: u32 = 1 << 20;

/// The slowest simulated speed, tokens per second: the mock sleeps out a batch's simulated
/// time, which must be a `Duration` (under 2^64 s). With [`MAX_SLOW`] and the largest batch
/// (2^20 tokens of one sequence) it is under 10^14 s.
pub const MIN_TOKENS_PER_S: f64 = 1.0;

/// The largest `faults.slow` factor (see [`MIN_TOKENS_PER_S`]).
pub const MAX_SLOW: f64 = 1e6;

/// The most tokens in a DFlash block (SpecForge's default is 16): one block's attention scores
/// are heads x block x (context + block) elements, computed whole, so a block of 100,000 asked
/// for a 160 GB tensor.
pub const MAX_BLOCK_SIZE: u32 = 1024;

/// The most CPU threads a worker's model computes with: each worker starts this many, so a
/// typo of a few more digits would start hundreds of thousands of threads per worker.
pub const MAX_THREADS: u32 = 1024;

/// The most held-out prompts an evaluation decodes (`dflash.eval_prompts`, `launcher eval
/// --prompts`): they are made up front, and 2^32 of them asked for 103 GB.
pub const MAX_EVAL_PROMPTS: u32 = 1_000_000;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Training data: a JSONL file with `input_ids` (and optionally `loss_mask`) per line, a
    /// Parquet file, an HF `datasets` `save_to_disk` directory, or a prepared Arrow file; none
    /// means the built-in synthetic dataset. Records may hold `messages`, `conversations` or
    /// `text` instead (see `tokenizer`).
    pub path: Option<PathBuf>,
    /// The prepared (memory-mapped) file of `path` that every worker maps. The launcher sets
    /// it once it has prepared `path`; a user leaves it out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prepared: Option<PathBuf>,
    /// The content key of `prepared` (its `hspipe.key`), set with it: a worker that maps
    /// `prepared` (a target restarted mid-run) refuses a file of another key, since a file
    /// replaced at that path (`launcher prepare -o` again) is other data than the run planned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prepared_key: Option<String>,
    /// Samples in the synthetic dataset.
    pub synthetic_samples: u64,
    /// Token ids of the synthetic dataset are drawn below this; None: 32000, or the model's
    /// vocabulary when a model is given (the launcher sets it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synthetic_vocab: Option<u32>,
    /// Synthetic ids from the built-in language (a seeded order-2 Markov chain a model can
    /// learn) rather than uniform; None: the language when a model is given, else uniform.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synthetic_language: Option<bool>,
    pub min_len: u32,
    pub max_len: u32,
    pub seed: u64,
    /// Passes over the data: every sample is trained once per epoch, each epoch in its own
    /// order drawn from `seed` (the plan lays the epochs end to end).
    pub epochs: u32,
    /// The model directory whose `tokenizer.json` and chat template prepare records holding
    /// `messages`, `conversations` or `text`; None: the model's (`--model`), if it has a
    /// chat template.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Passed to the chat template as `enable_thinking` (Qwen3's); None: not passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_thinking: Option<bool>,
    /// Train on each conversation's last assistant turn only (the mask of the others is 0).
    pub train_only_last_turn: bool,
    /// A system message put first into conversations that have none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// The date a chat template's `strftime_now` writes ("2025-12-07", UTC, or with a time,
    /// "2025-12-07T14:00:00"; TOML's own unquoted date too); None: 26 Jul 2024 (see
    /// [`DataConfig::template_date_epoch`]).
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "date_or_string"
    )]
    pub template_date: Option<String>,
    /// A conversation or text longer than `max_len` tokens: "drop" it or "truncate" it (both
    /// counted). Pre-tokenized samples longer than that are an error.
    pub too_long: TooLong,
}

/// `template_date` as a string, whether the TOML quotes it or writes it as its own date
/// (`template_date = 2025-12-07`, which the toml crate hands serde as a datetime, not a string).
fn date_or_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Text(String),
        Date(toml::value::Datetime),
    }
    Ok(Option::<Given>::deserialize(d)?.map(|g| match g {
        Given::Text(s) => s,
        Given::Date(d) => d.to_string(),
    }))
}

impl DataConfig {
    /// `template_date` in seconds since 1970 (UTC); None when unset. A date alone is its
    /// midnight. Not the clock: a record gives the same ids on every day it is prepared, as a
    /// `--resume` that prepares the data again needs.
    pub fn template_date_epoch(&self) -> Result<Option<i64>, ConfigError> {
        let Some(s) = &self.template_date else {
            return Ok(None);
        };
        let at = (chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S").ok())
            .or_else(|| {
                let day = chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d").ok()?;
                day.and_hms_opt(0, 0, 0)
            })
            .ok_or_else(|| {
                invalid(
                    "data.template_date",
                    format!("must be a date, \"2025-12-07\", or a date and time, \"2025-12-07T14:00:00\" (UTC), got {s:?}"),
                )
            })?;
        Ok(Some(at.and_utc().timestamp()))
    }
}

/// What becomes of a conversation or text longer than `data.max_len` tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TooLong {
    #[default]
    Drop,
    Truncate,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: None,
            prepared: None,
            prepared_key: None,
            synthetic_samples: 2000,
            synthetic_vocab: None,
            synthetic_language: None,
            min_len: 32,
            max_len: 4096,
            seed: 1,
            epochs: 1,
            tokenizer: None,
            enable_thinking: None,
            train_only_last_turn: false,
            system_prompt: None,
            template_date: None,
            too_long: TooLong::Drop,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TargetConfig {
    /// Most tokens in one batch.
    pub token_budget: u32,
    /// Simulated forward speed of a mock target. The real ratio is 4,500 (target) to 5,800
    /// (drafter) tokens/s; the defaults are ten times both so a demo run takes seconds.
    pub tokens_per_s: f64,
    /// CPU threads each worker's model computes with; 0: the machine's cores shared out
    /// among the run's workers (at least one each).
    pub threads: u32,
    /// Batches each target keeps in flight on its device. 0: the backend's own, 2 on a GPU (the
    /// next batch's forward runs while the last one's results are copied out), 1 on the CPU.
    /// 1 on a GPU waits for each batch before issuing the next (every device error is then
    /// known to be that batch's, at the cost of the overlap); the mock backend takes any depth
    /// (a GPU's path on the CPU); others are capped at what they can hold.
    pub depth: u32,
    /// A program the launcher runs as each target instead of its own worker, e.g.
    /// `["python", "my_target.py"]`: a user's own model through the `hspipe` Python package.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// The directory `command` runs in. The launcher sets it to the directory the run was
    /// started from when absent, and the run's config.toml keeps it, so the command's relative
    /// paths (`my_target.py`) mean the same to a `--resume` run from anywhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command_dir: Option<PathBuf>,
}

impl Default for TargetConfig {
    fn default() -> Self {
        TargetConfig {
            token_budget: 16384,
            tokens_per_s: 45_000.0,
            threads: 0,
            depth: 0,
            command: None,
            command_dir: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DrafterConfig {
    /// Simulated training speed of a mock drafter.
    pub tokens_per_s: f64,
    /// Checkpoint every this many group steps (and at shutdown); a step trains up to one batch
    /// per drafter rank.
    pub checkpoint_every: u64,
    /// Keep the export of every step that is a multiple of this (a multiple of
    /// `checkpoint_every`, so every such step has a checkpoint and an export) as
    /// `<run-dir>/drafter-steps/step-<S>/`, beside the one `drafter/` every checkpoint rewrites:
    /// a week's run can go back to the drafter of any kept step. 0 (the default) keeps none.
    /// Only a drafter that exports (DFlash) keeps any: [`PipelineConfig::check_kept_exports`].
    /// Not written to a run's `config.toml` while 0, so a config.toml of a run that keeps none
    /// reads as it did before the field.
    #[serde(skip_serializing_if = "is_zero")]
    pub keep_export_every: u64,
    /// Weights of the mock drafter (f32; the gradient all-reduced each step is this size).
    pub params: u64,
    /// Length-coherent group steps: the leader draws each step's length bucket (in proportion
    /// to what is READY) and every rank prefers it, so a step waits less for its longest batch.
    /// Off: each rank takes under the ring's policy on its own.
    pub coherent: bool,
    /// Each drafter takes the next step's batch while it trains one and verifies it meanwhile
    /// (the ring lets a drafter hold two: the ring needs one more slot per drafter). Off: one
    /// batch at a time, its checksum in front of its step.
    pub prefetch: bool,
    /// How the group sums its gradients: `shm` (shared memory, on the host), `nccl` (NCCL
    /// between the drafters' GPUs; the cuda backend), or `auto` (NCCL for two or more cuda
    /// drafters when NCCL loads, else shm). The launcher writes down what `auto` became.
    pub collective: CollectiveKind,
    /// The run's group steps, for a learning-rate schedule: set by the launcher from the plan
    /// (batches / drafters) when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<u64>,
    /// A program the launcher runs as each drafter instead of its own worker (see
    /// [`TargetConfig::command`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// The directory `command` runs in (see [`TargetConfig::command_dir`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command_dir: Option<PathBuf>,
}

impl Default for DrafterConfig {
    fn default() -> Self {
        DrafterConfig {
            tokens_per_s: 58_000.0,
            checkpoint_every: 50,
            keep_export_every: 0,
            params: 1_048_576,
            coherent: true,
            prefetch: true,
            collective: CollectiveKind::Auto,
            total_steps: None,
            command: None,
            command_dir: None,
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl DrafterConfig {
    /// Whether the export written at the checkpoint of group step `step` is kept
    /// (`keep_export_every`): a step past 0 that is a multiple of it. The run's last step is
    /// kept by the same rule, like any other: `drafter/` holds it in any case.
    pub fn keeps_export(&self, step: u64) -> bool {
        let every = self.keep_export_every;
        every != 0 && step != 0 && step.is_multiple_of(every)
    }
}

/// How the drafter group sums its gradients (`[drafter] collective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Chosen by the launcher: NCCL for two or more drafters on the cuda backend, else shm.
    Auto,
    /// The shared-memory group, summing on the host.
    Shm,
    /// NCCL between the drafters' GPUs; the step commits in the shared-memory group.
    Nccl,
}

/// What a DFlash block position learns: the target's greedy token (what the target would
/// say) or the data's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DflashLabel {
    Target,
    Data,
}

/// The DFlash drafter (SpecForge's and the DFlash authors' defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DflashConfig {
    /// Tokens per drafted block: the anchor's token then `block_size - 1` masks.
    pub block_size: u32,
    /// Anchors (blocks) drawn per sequence, at most.
    pub num_anchors: u32,
    /// Drafter decoder layers; None: one per captured target layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    /// Block position k >= 1 weighs `exp(-(k-1)/gamma)`.
    pub gamma: f64,
    pub label: DflashLabel,
    /// The mask token; None: the tokenizer's mask token, else the vocabulary's last id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_token_id: Option<u32>,
    /// AdamW: peak learning rate, warm-up share of the run's steps, decoupled weight decay,
    /// global-norm clip.
    pub lr: f64,
    pub warmup_ratio: f64,
    pub weight_decay: f64,
    pub clip: f64,
    /// The initial weights' seed (every rank starts from the same).
    pub seed: u64,
    /// Every this many steps (and at the end) the group's leader decodes `eval_prompts`
    /// held-out prompts of the built-in language speculatively, `eval_new_tokens` each, and
    /// reports the mean tokens per target forward; 0: never. Runs on file data skip it (use
    /// `launcher eval --data`).
    pub eval_every: u64,
    pub eval_prompts: u32,
    pub eval_new_tokens: u32,
}

impl Default for DflashConfig {
    fn default() -> Self {
        DflashConfig {
            block_size: 16,
            num_anchors: 512,
            layers: None,
            gamma: 7.0,
            label: DflashLabel::Target,
            mask_token_id: None,
            lr: 6e-4,
            warmup_ratio: 0.04,
            weight_decay: 0.0,
            clip: 1.0,
            seed: 0,
            eval_every: 200,
            eval_prompts: 4,
            eval_new_tokens: 32,
        }
    }
}

/// A config that cannot be loaded or used, naming the file, field or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// Not TOML at all: cut short, damaged, or not a config.
    #[error("config {path} is not valid TOML: {cause}")]
    Syntax {
        path: PathBuf,
        cause: Box<toml::de::Error>,
    },
    /// TOML, but not a config of this build: a field it does not know, a value of another type.
    #[error("config {path}: {cause}")]
    Parse {
        path: PathBuf,
        cause: Box<toml::de::Error>,
    },
    #[error("config field {field}: {why}")]
    Invalid { field: &'static str, why: String },
    /// The ring's own error as the cause, not the source: the message says it already, and a
    /// source would print it twice in the launcher's error chain.
    #[error("ring settings: {0}")]
    Ring(shm_ring::ConfigError),
}

impl From<shm_ring::ConfigError> for ConfigError {
    fn from(e: shm_ring::ConfigError) -> Self {
        ConfigError::Ring(e)
    }
}

fn invalid(field: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        why: why.into(),
    }
}

impl PipelineConfig {
    /// Parses TOML text; `path` is only for messages.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg = Self::parse(text, path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses TOML text without checking the values.
    fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        // Syntax first, on its own: a file that is not TOML (a resumed run's, cut short) is
        // told apart from one this build reads otherwise than the build that wrote it.
        if let Err(e) = text.parse::<toml::Table>() {
            return Err(ConfigError::Syntax {
                path: path.to_path_buf(),
                cause: Box::new(e),
            });
        }
        let mut cfg: PipelineConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            cause: Box::new(e),
        })?;
        // Layers named: their number is the captured layers'.
        if let Some(ids) = &cfg.model.target_layer_ids {
            cfg.model.layers = ids.len() as u32;
        }
        Ok(cfg)
    }

    /// Reads and checks the config at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let cfg = Self::load_unchecked(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the config at `path` without checking the values, for a caller that sets some of
    /// them and then calls [`PipelineConfig::validate`]: `launcher capture`, which uses neither
    /// the file's data nor its epochs.
    pub fn load_unchecked(path: &Path) -> Result<Self, ConfigError> {
        let text = atomic_file::read_regular(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            cause: e,
        })?;
        Self::parse(&text, path)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }

    /// That `samples` samples, `data.epochs` times over, fit a plan
    /// ([`MAX_PLANNED_SAMPLES`]); [`PipelineConfig::validate`] checks it for synthetic data, the
    /// launcher for a file's once it knows the count.
    pub fn check_plan_size(&self, samples: u64) -> Result<(), ConfigError> {
        let epochs = self.data.epochs.max(1);
        let passes = samples.saturating_mul(u64::from(epochs));
        if passes > MAX_PLANNED_SAMPLES {
            return Err(invalid(
                "data.epochs",
                format!(
                    "{epochs} epochs of {samples} samples plan {passes} sample passes, more than the {MAX_PLANNED_SAMPLES} a run plans (every process holds the plan): train fewer epochs or fewer samples"
                ),
            ));
        }
        Ok(())
    }

    /// Checks the values that do not depend on the number of workers.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        d.template_date_epoch()?;
        // Before min_len's check, which a max_len of 0 would fail in its name.
        if d.max_len == 0 {
            return Err(invalid(
                "data.max_len",
                "must be at least 1 (the longest sample, in tokens), got 0",
            ));
        }
        if d.min_len == 0 || d.min_len > d.max_len {
            return Err(invalid(
                "data.min_len",
                format!(
                    "must be between 1 and data.max_len ({}), got {}",
                    d.max_len, d.min_len
                ),
            ));
        }
        if d.epochs == 0 || d.epochs > MAX_EPOCHS {
            return Err(invalid(
                "data.epochs",
                format!(
                    "must be between 1 and {MAX_EPOCHS} (each epoch trains every sample once), got {}",
                    d.epochs
                ),
            ));
        }
        if d.path.is_none()
            && (d.synthetic_samples == 0 || d.synthetic_samples > MAX_SYNTHETIC_SAMPLES)
        {
            return Err(invalid(
                "data.synthetic_samples",
                format!(
                    "must be between 1 and {MAX_SYNTHETIC_SAMPLES}, got {}",
                    d.synthetic_samples
                ),
            ));
        }
        if d.path.is_none() {
            self.check_plan_size(d.synthetic_samples)?;
        }
        if self.target.token_budget > MAX_TOKEN_BUDGET {
            return Err(invalid(
                "target.token_budget",
                format!(
                    "must be at most {MAX_TOKEN_BUDGET} tokens per batch, got {}",
                    self.target.token_budget
                ),
            ));
        }
        if self.target.token_budget < d.max_len {
            return Err(invalid(
                "target.token_budget",
                format!(
                    "{} is below data.max_len {}: the longest sample would fit no batch",
                    self.target.token_budget, d.max_len
                ),
            ));
        }
        for (field, v) in [
            ("target.tokens_per_s", self.target.tokens_per_s),
            ("drafter.tokens_per_s", self.drafter.tokens_per_s),
        ] {
            if !(v.is_finite() && v >= MIN_TOKENS_PER_S) {
                return Err(invalid(
                    field,
                    format!(
                        "must be a finite number of at least {MIN_TOKENS_PER_S} (a batch's simulated time must be a duration), got {v:?}"
                    ),
                ));
            }
        }
        if self.target.threads > MAX_THREADS {
            return Err(invalid(
                "target.threads",
                format!(
                    "must be at most {MAX_THREADS} (each worker starts this many; 0 shares out the machine's cores), got {}",
                    self.target.threads
                ),
            ));
        }
        if self
            .model
            .target_layer_ids
            .as_ref()
            .is_some_and(Vec::is_empty)
        {
            // Else said as "layers ... must be at least 1", a field the user did not set.
            return Err(invalid(
                "model.target_layer_ids",
                "names no layer: name the decoder layers to capture, or leave it out for SpecForge's choice of model.layers of them",
            ));
        }
        if self.model.layers == 0 || self.model.hidden == 0 {
            return Err(invalid("model", "layers and hidden must be at least 1"));
        }
        if let Some(ids) = &self.model.target_layer_ids {
            if ids.len() != self.model.layers as usize {
                return Err(invalid(
                    "model.target_layer_ids",
                    format!(
                        "names {} layers but model.layers is {} (a config file's layers follow its ids)",
                        ids.len(),
                        self.model.layers
                    ),
                ));
            }
        }
        let f = &self.dflash;
        if f.block_size < 2 || f.num_anchors == 0 || f.layers == Some(0) {
            return Err(invalid(
                "dflash",
                "block_size must be at least 2, num_anchors and layers at least 1",
            ));
        }
        if f.block_size > MAX_BLOCK_SIZE {
            return Err(invalid(
                "dflash.block_size",
                format!(
                    "must be at most {MAX_BLOCK_SIZE} (a block's attention scores are computed whole, and grow with its square), got {}",
                    f.block_size
                ),
            ));
        }
        for (field, v, lo) in [
            ("dflash.gamma", f.gamma, false),
            ("dflash.lr", f.lr, false),
            ("dflash.warmup_ratio", f.warmup_ratio, true),
            ("dflash.weight_decay", f.weight_decay, true),
            ("dflash.clip", f.clip, true),
        ] {
            if !(v.is_finite() && (v > 0.0 || (lo && v == 0.0)))
                || (field == "dflash.warmup_ratio" && v >= 1.0)
            {
                return Err(invalid(field, format!("{v} is out of range")));
            }
        }
        if f.eval_prompts > MAX_EVAL_PROMPTS {
            // 0 stays accepted as it always was (an evaluation of no prompt: none).
            return Err(invalid(
                "dflash.eval_prompts",
                format!(
                    "must be at most {MAX_EVAL_PROMPTS} (the held-out prompts each evaluation decodes, made up front; dflash.eval_every = 0 turns evaluation off), got {}",
                    f.eval_prompts
                ),
            ));
        }
        if !(1..=shm_ring::MAX_BUCKETS).contains(&self.ring.buckets) {
            // Before the plan, which makes a list per bucket: 2^32 of them ran out of memory.
            return Err(invalid(
                "ring.buckets",
                format!(
                    "must be between 1 and {} (the length classes batches are planned in), got {}",
                    shm_ring::MAX_BUCKETS,
                    self.ring.buckets
                ),
            ));
        }
        let hidden = u64::from(self.model.hidden);
        if self.drafter.params < hidden || self.drafter.params > 1 << 28 {
            return Err(invalid(
                "drafter.params",
                format!(
                    "must be from model.hidden ({hidden}) to 268435456 (1 GiB of f32), got {}",
                    self.drafter.params
                ),
            ));
        }
        for (name, f) in &self.faults {
            if let Err(e) = name.parse::<WorkerName>() {
                return Err(invalid("faults", e.to_string()));
            }
            if f.export_fails_at == Some(0) {
                return Err(invalid(
                    "faults.export_fails_at",
                    format!(
                        "{name}: must be a group step from 1 (the first export is of step 1 at the earliest), got 0"
                    ),
                ));
            }
            if let Some(s) = f.slow.filter(|s| !(*s > 0.0 && *s <= MAX_SLOW)) {
                return Err(invalid(
                    "faults.slow",
                    format!(
                        "{name}: must be a factor above 0 and at most {MAX_SLOW} (a batch's simulated time must be a duration), got {s:?}"
                    ),
                ));
            }
        }
        for (field, command) in [
            ("target.command", &self.target.command),
            ("drafter.command", &self.drafter.command),
        ] {
            if command
                .as_ref()
                .is_some_and(|c| c.first().is_none_or(String::is_empty))
            {
                return Err(invalid(
                    field,
                    "must name a program, e.g. [\"python\", \"my_worker.py\"]",
                ));
            }
        }
        if self.drafter.checkpoint_every == 0 {
            return Err(invalid("drafter.checkpoint_every", "must be at least 1"));
        }
        let (keep, every) = (
            self.drafter.keep_export_every,
            self.drafter.checkpoint_every,
        );
        if !keep.is_multiple_of(every) {
            // A kept export is the export a checkpoint writes: a step without a checkpoint has
            // none to keep.
            return Err(invalid(
                "drafter.keep_export_every",
                format!(
                    "must be 0 or a multiple of drafter.checkpoint_every ({every}): an export is written only at a checkpoint, so only a checkpoint's step can be kept; got {keep}"
                ),
            ));
        }
        let need = self.largest_batch_bytes()?;
        if self.ring.slot_size != 0 && self.ring.slot_size < need {
            return Err(invalid(
                "ring.slot_bytes",
                format!(
                    "{} bytes cannot hold the largest batch ({need} bytes for a {}-token budget); raise it or set 0 for automatic",
                    self.ring.slot_size, self.target.token_budget
                ),
            ));
        }
        Ok(())
    }

    /// Refuses `drafter.keep_export_every` for a run whose drafter writes no export
    /// (`drafter_exports` false: the mock's, or a `[drafter] command`'s): nothing would ever be
    /// kept, and a user who asked for kept exports would find out a week later. The launcher
    /// calls it once the backend is chosen; [`validate`](Self::validate) cannot know it.
    pub fn check_kept_exports(&self, drafter_exports: bool) -> Result<(), ConfigError> {
        if self.drafter.keep_export_every == 0 || drafter_exports {
            return Ok(());
        }
        Err(invalid(
            "drafter.keep_export_every",
            format!(
                "is {}, but this run's drafter writes no export to keep (only the DFlash drafter of a run with a model exports; the mock drafter and a [drafter] command do not): set it to 0 or leave it out",
                self.drafter.keep_export_every
            ),
        ))
    }

    /// Refuses `model.dtype` other than bf16 for a run where the mock backend computes a side
    /// (`mock_target`, `mock_drafter`): the mock target writes bf16 whatever the field says, so
    /// f32 crash-looped every target on its buffer size and f16 had every batch refused by the
    /// mock drafter, and the run ended with nothing trained. The launcher calls it once the
    /// backend is chosen; a resume's config too (it was edited by hand, or is older).
    pub fn check_mock_dtype(
        &self,
        mock_target: bool,
        mock_drafter: bool,
    ) -> Result<(), ConfigError> {
        let side = match (mock_target, mock_drafter) {
            _ if self.model.dtype == Dtype::Bf16 => return Ok(()),
            (true, true) => "both sides",
            (true, false) => "the targets",
            (false, true) => "the drafters",
            (false, false) => return Ok(()),
        };
        Err(invalid(
            "model.dtype",
            format!(
                "is \"{}\", but this run has no model, so the mock backend computes {side}, and it computes bf16 only: leave model.dtype out (bf16), or give a model (--model DIR), whose backend takes f16 and f32",
                format!("{:?}", self.model.dtype).to_lowercase()
            ),
        ))
    }

    /// Refuses a `[dflash]` section set away from its defaults for a run whose drafter is not
    /// DFlash (`dflash_drafter` false: the mock's, in a run without a model): a config written
    /// for the DFlash drafter, run without `--model`, trained the mock and ended "done" with no
    /// export, which the user found out only at `launcher eval`. For a new run only: a resume
    /// runs what its run ran.
    pub fn check_dflash_used(&self, dflash_drafter: bool) -> Result<(), ConfigError> {
        if dflash_drafter || self.dflash == DflashConfig::default() {
            return Ok(());
        }
        let table = |d: &DflashConfig| toml::Table::try_from(d).unwrap_or_default();
        let (set, default) = (table(&self.dflash), table(&DflashConfig::default()));
        let changed: Vec<&str> = (set.iter())
            .filter(|(k, v)| default.get(k.as_str()) != Some(v))
            .map(|(k, _)| k.as_str())
            .collect();
        Err(invalid(
            "dflash",
            format!(
                "sets {}, but this run has no model, so its drafter is the mock's, not DFlash: give the target model (--model DIR, or [model] path), or leave [dflash] out for a mock run",
                changed.join(", ")
            ),
        ))
    }

    /// Bytes of the largest batch: the most tokens a batch holds (the token budget, or `n`
    /// samples of `data.max_len` where that is fewer) in as many sequences as the shortest
    /// length allows (`n`, the most header entries). Not `n` sequences of the shortest length
    /// alone: where it does not divide the budget they are fewer tokens than a full batch of
    /// longer ones (136 x 15 = 2040 < 4 x 512 = 2048), and every target crashed on such a
    /// batch. A batch's size depends only on its tokens and sequences, so the last sequence
    /// takes the rest. (File data: the launcher lowers `min_len` to the file's shortest, and a
    /// file's samples are at most `max_len`, or it is refused.)
    pub fn largest_batch_bytes(&self) -> Result<u64, ConfigError> {
        let (budget, shortest) = (self.target.token_budget, self.data.min_len.max(1));
        let n = (budget / shortest).max(1);
        let tokens = budget.min(n.saturating_mul(self.data.max_len.max(shortest)));
        let mut seq_lens = vec![shortest; n as usize];
        seq_lens[n as usize - 1] = tokens.saturating_sub((n - 1) * shortest).max(shortest);
        let spec = BatchSpec {
            batch_id: u64::MAX,
            producer: u32::MAX,
            sample_ids: vec![u64::MAX; n as usize],
            seq_lens,
            dtype: self.model.dtype,
            layers: self.model.layers,
            hidden: self.model.hidden,
        };
        batch_len(&spec).map_err(|e| invalid("model", e.to_string()))
    }

    /// The ring for `producers` targets, `consumers` drafters and `work_items` planned batches,
    /// validated (including the deadlock check of the bucketed policy).
    pub fn ring_params(
        &self,
        producers: u32,
        consumers: u32,
        work_items: u64,
    ) -> Result<RingParams, ConfigError> {
        let r = &self.ring;
        let slot_size = if r.slot_size == 0 {
            self.largest_batch_bytes()?
        } else {
            r.slot_size
        };
        let p = RingParams {
            slots: r.slots,
            slot_size,
            buckets: r.buckets,
            producers,
            consumers,
            // Our drafter workers prefetch; a `[drafter] command` takes its own way.
            held_per_consumer: 1 + u32::from(
                self.drafter.prefetch && self.drafter.command.is_none(),
            ),
            policy: match r.policy {
                PolicyName::Fifo => TakePolicy::Fifo,
                PolicyName::Bucketed => TakePolicy::Bucketed {
                    min_ready: r.min_ready,
                    pick: r.pick,
                },
            },
            seed: r.seed,
            work_items,
        };
        p.validate()?;
        Ok(p)
    }

    /// Refuses a `[faults.NAME]` for a worker this run does not have (`targets` targets,
    /// `drafters` drafters): a fault meant for a worker and silently never injected.
    pub fn check_faults(&self, targets: u32, drafters: u32) -> Result<(), ConfigError> {
        for key in self.faults.keys() {
            let Ok(name) = key.parse::<WorkerName>() else {
                continue; // `validate` names it.
            };
            let (n, side) = match name.role {
                Role::Producer => (targets, "target"),
                Role::Consumer => (drafters, "drafter"),
            };
            if name.index >= n {
                let have = match n {
                    1 => format!("1 {side} ({side}-0)"),
                    n => format!("{n} {side}s ({side}-0 to {side}-{})", n - 1),
                };
                return Err(invalid(
                    "faults",
                    format!("[faults.{key}]: this run has {have}; name one of its workers or remove the section"),
                ));
            }
        }
        Ok(())
    }

    /// The faults configured for worker `name` (the key `drafter-0`); none by default.
    pub fn faults_for(&self, name: WorkerName) -> Faults {
        self.faults
            .iter()
            .find(|(key, _)| key.parse() == Ok(name))
            .map(|(_, f)| f.clone())
            .unwrap_or_default()
    }

    /// The length class of a batch whose longest sequence has `max_seq` tokens.
    pub fn bucket_of(&self, max_seq: u32) -> u32 {
        let b = self.ring.buckets.max(1);
        let width = self.data.max_len.div_ceil(b).max(1);
        (max_seq.saturating_sub(1) / width).min(b - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every batch the plan can make (at most the token budget, of sequences of `data.min_len`
    /// to `data.max_len` tokens) fits the slot sized for it, whether or not `min_len` divides
    /// the budget; and the slot is no larger than the largest of them where every sample has
    /// one length (a slot is reserved whole in /dev/shm: one sized for a full budget of
    /// 1100-token samples, one to a batch, was twice what a batch could be).
    #[test]
    fn the_automatic_slot_holds_every_batch_the_plan_can_make_and_no_more() {
        let spec = |c: &PipelineConfig, seq_lens: Vec<u32>| BatchSpec {
            batch_id: 0,
            producer: 0,
            sample_ids: vec![0; seq_lens.len()],
            seq_lens,
            dtype: c.model.dtype,
            layers: c.model.layers,
            hidden: c.model.hidden,
        };
        for (budget, min_len, max_len) in [
            (2048, 15, 2048),
            (2048, 16, 512),
            (16384, 24, 16384),
            (1000, 7, 1000),
            (64, 64, 64),
            (2048, 700, 800),
            (2048, 1100, 1100),
        ] {
            let mut c = PipelineConfig::default();
            (c.target.token_budget, c.data.min_len, c.data.max_len) = (budget, min_len, max_len);
            let slot = c.largest_batch_bytes().unwrap();
            for len in min_len..=max_len {
                // As many of one length as the budget holds, and a short one in what is left.
                let mut seq_lens = vec![len; (budget / len) as usize];
                if budget % len >= min_len {
                    seq_lens.push(budget % len);
                }
                let need = batch_len(&spec(&c, seq_lens)).unwrap();
                assert!(
                    need <= slot,
                    "budget {budget}, lengths {min_len}..={max_len}, len {len}: {need} > {slot}"
                );
            }
            if min_len == max_len {
                let one_length = vec![min_len; (budget / min_len) as usize];
                assert_eq!(
                    slot,
                    batch_len(&spec(&c, one_length)).unwrap(),
                    "{budget} {min_len}"
                );
            }
        }
    }

    #[test]
    fn empty_toml_is_the_default_and_round_trips() {
        let c = PipelineConfig::from_toml("", Path::new("x.toml")).unwrap();
        assert_eq!(c, PipelineConfig::default());
        let again = PipelineConfig::from_toml(&c.to_toml(), Path::new("y.toml")).unwrap();
        assert_eq!(again, c);
        c.ring_params(5, 3, 100).unwrap();
    }

    /// `[drafter] keep_export_every`: the steps it keeps are the multiples of it (the run's
    /// last step by the same rule), a value that is no multiple of `checkpoint_every` would name
    /// steps with no export and is refused naming both fields, and a run whose drafter exports
    /// nothing is refused it. Left at 0 it keeps nothing and stays out of a run's config.toml.
    #[test]
    fn keep_export_every_keeps_checkpoint_steps_only() {
        let load = |t: &str| PipelineConfig::from_toml(t, Path::new("run.toml"));
        let c = load(
            "[drafter]
checkpoint_every = 50
keep_export_every = 200
",
        )
        .unwrap();
        let kept: Vec<u64> = (0..=1000).filter(|&s| c.drafter.keeps_export(s)).collect();
        assert_eq!(kept, [200, 400, 600, 800, 1000]);
        assert!(c.to_toml().contains("keep_export_every = 200"));
        c.check_kept_exports(true).unwrap();
        let err = c.check_kept_exports(false).unwrap_err().to_string();
        assert!(
            err.contains("drafter.keep_export_every") && err.contains("no export"),
            "{err}"
        );

        let err = load(
            "[drafter]
checkpoint_every = 50
keep_export_every = 120
",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("drafter.keep_export_every")
                && err.contains("drafter.checkpoint_every (50)")
                && err.contains("120"),
            "{err}"
        );

        let none = PipelineConfig::default();
        assert!((0..=1000).all(|s| !none.drafter.keeps_export(s)));
        assert!(!none.to_toml().contains("keep_export_every"));
        none.check_kept_exports(false).unwrap();
    }

    /// A `[dflash]` section set away from its defaults is refused to a run whose drafter is
    /// not DFlash, naming what it sets; left at its defaults (an effective config.toml taken
    /// as a config, which writes the section whole), it is not.
    #[test]
    fn a_dflash_section_without_a_dflash_drafter_is_refused() {
        let c = PipelineConfig::from_toml("[dflash]\nlr = 2e-2\nlayers = 2\n", Path::new("r.toml"))
            .unwrap();
        c.check_dflash_used(true).unwrap();
        let err = c.check_dflash_used(false).unwrap_err().to_string();
        assert!(
            err.contains("config field dflash: sets layers, lr, but this run has no model")
                && err.contains("--model DIR"),
            "{err}"
        );
        let whole = PipelineConfig::default().to_toml();
        assert!(whole.contains("[dflash]"), "{whole}");
        let written = PipelineConfig::from_toml(&whole, Path::new("config.toml")).unwrap();
        written.check_dflash_used(false).unwrap();
    }

    #[test]
    fn bad_values_name_the_file_and_field() {
        let err = PipelineConfig::from_toml("[ring]\nslotz = 3\n", Path::new("run.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("run.toml") && err.contains("slotz"), "{err}");

        let err = PipelineConfig::from_toml("[target]\ntoken_budget = 100\n", Path::new("a.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("target.token_budget"), "{err}");

        let err = PipelineConfig::from_toml("[ring]\nslot_bytes = 4096\n", Path::new("a.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ring.slot_bytes"), "{err}");
        // The ring's name for it works as a key too.
        let c = PipelineConfig::from_toml("[ring]\nslot_size = 16777216\n", Path::new("a.toml"))
            .unwrap();
        assert_eq!(c.ring.slot_size, 16 << 20);

        let err =
            PipelineConfig::from_toml("[drafter]\ntokens_per_s = -1.0\n", Path::new("a.toml"))
                .unwrap_err()
                .to_string();
        assert!(err.contains("drafter.tokens_per_s"), "{err}");
        // A max_len of 0 is named, not blamed on min_len (which it is below).
        let err = PipelineConfig::from_toml("[data]\nmax_len = 0\n", Path::new("a.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data.max_len") && !err.contains("min_len"),
            "{err}"
        );

        // Speeds whose simulated time would not be a `Duration` (the mock panicked on them).
        for (toml, field) in [
            ("[target]\ntokens_per_s = 1e-300\n", "target.tokens_per_s"),
            ("[drafter]\ntokens_per_s = 1e-300\n", "drafter.tokens_per_s"),
            ("[faults.target-0]\nslow = 1e300\n", "faults.slow"),
            ("[faults.target-0]\nslow = nan\n", "faults.slow"),
        ] {
            let err = PipelineConfig::from_toml(toml, Path::new("a.toml"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(field) && err.contains("duration"), "{err}");
            // As written, not 300 digits.
            assert!(err.len() < 300, "{err}");
        }

        // Sizes that crashed or starved the workers.
        for (toml, field, limit) in [
            (
                "[dflash]\nblock_size = 100000\n",
                "dflash.block_size",
                "1024",
            ),
            ("[target]\nthreads = 100000\n", "target.threads", "1024"),
        ] {
            let err = PipelineConfig::from_toml(toml, Path::new("a.toml"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(field) && err.contains(limit) && err.contains("100000"),
                "{err}"
            );
        }
        let c = PipelineConfig::from_toml(
            "[dflash]\nblock_size = 1024\n[target]\nthreads = 1024\n",
            Path::new("a.toml"),
        )
        .unwrap();
        assert_eq!((c.dflash.block_size, c.target.threads), (1024, 1024));

        for empty in ["[target]\ncommand = []\n", "[drafter]\ncommand = [\"\"]\n"] {
            let err = PipelineConfig::from_toml(empty, Path::new("a.toml"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(".command") && err.contains("program"), "{err}");
        }
        // A worker command reaches every worker through the config's TOML.
        let c = PipelineConfig::from_toml(
            "[target]\ncommand = [\"python\", \"t.py\"]\n",
            Path::new("a.toml"),
        )
        .unwrap();
        let again = PipelineConfig::from_toml(&c.to_toml(), Path::new("b.toml")).unwrap();
        assert_eq!(
            again.target.command,
            Some(vec!["python".into(), "t.py".into()])
        );

        let err = PipelineConfig::from_toml("[drafter]\nparams = 3\n", Path::new("a.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("drafter.params"), "{err}");

        let err = PipelineConfig::from_toml("[data]\nepochs = 0\n", Path::new("a.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data.epochs") && err.contains("between 1 and"),
            "{err}"
        );
        // A typo of a huge epoch count is refused before a plan of billions of batches is laid.
        let err = PipelineConfig::from_toml("[data]\nepochs = 100000\n", Path::new("a.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data.epochs") && err.contains("100000"),
            "{err}"
        );
        let c = PipelineConfig::from_toml("[data]\nepochs = 3\n", Path::new("a.toml")).unwrap();
        assert_eq!(c.data.epochs, 3);
    }

    /// A config that is a FIFO or a device is refused by what it is, naming it, before it is
    /// opened: a FIFO without a writer hung the launcher, `/dev/zero` read until memory ran out.
    /// data.template_date: a date is its midnight, UTC; with a time, that time; anything else
    /// is refused at load, naming the field and the value, not at the first conversation.
    #[test]
    fn a_template_date_is_a_date_or_refused() {
        let epoch = |v: &str| {
            let toml = format!("[data]\ntemplate_date = {v:?}\n");
            PipelineConfig::from_toml(&toml, Path::new("d.toml"))
                .map(|c| c.data.template_date_epoch().unwrap())
                .map_err(|e| e.to_string())
        };
        assert_eq!(epoch("2025-12-07"), Ok(Some(1_765_065_600)));
        // TOML's own date, unquoted (it was "invalid type: map, expected a string").
        let c =
            PipelineConfig::from_toml("[data]\ntemplate_date = 2025-12-07\n", Path::new("d.toml"))
                .unwrap();
        assert_eq!(c.data.template_date_epoch().unwrap(), Some(1_765_065_600));
        let c = PipelineConfig::from_toml(
            "[data]\ntemplate_date = 2024-12-07T14:00:00\n",
            Path::new("d.toml"),
        )
        .unwrap();
        assert_eq!(c.data.template_date_epoch().unwrap(), Some(1_733_580_000));
        assert_eq!(epoch("2024-12-07T14:00:00"), Ok(Some(1_733_580_000)));
        for bad in ["yesterday", "2025-13-01", "07 Dec 2025"] {
            let e = epoch(bad).unwrap_err();
            assert!(e.contains("data.template_date") && e.contains(bad), "{e}");
        }
        assert_eq!(
            PipelineConfig::default()
                .data
                .template_date_epoch()
                .unwrap(),
            None
        );
    }

    #[test]
    fn a_config_that_is_not_a_regular_file_is_refused_without_opening_it() {
        let e = testkit::fifo_refusal("run.toml", |d| {
            (PipelineConfig::load(&d.join("run.toml")).err()).map(|e| e.to_string())
        });
        assert!(
            e.contains("run.toml") && e.contains("FIFO") && e.contains("not a regular file"),
            "{e}"
        );
        let e = PipelineConfig::load(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("a device, not a regular file"),
            "{e}"
        );
    }

    /// A fault for a worker the run does not have was accepted and never injected.
    #[test]
    fn a_fault_for_a_worker_the_run_does_not_have_is_refused() {
        let c = PipelineConfig::from_toml(
            "[faults.target-99]\nslow = 2.0\n[faults.drafter-1]\ncrash_after = 1\n",
            Path::new("x.toml"),
        )
        .unwrap();
        let err = c.check_faults(1, 2).unwrap_err().to_string();
        assert!(
            err.contains("[faults.target-99]") && err.contains("1 target (target-0)"),
            "{err}"
        );
        let c = PipelineConfig::from_toml("[faults.drafter-2]\nslow = 2.0\n", Path::new("x.toml"))
            .unwrap();
        let err = c.check_faults(5, 2).unwrap_err().to_string();
        assert!(err.contains("2 drafters (drafter-0 to drafter-1)"), "{err}");
        assert!(c.check_faults(1, 3).is_ok());
    }

    /// The README's "config, with every default" block, saved as a file, is the default config
    /// and runs with any workers: users copy it to start their own. Its `[faults.drafter-1]`
    /// header was live, so a run with one drafter refused the file as it stood.
    #[test]
    fn the_readmes_config_with_every_default_is_the_default_for_any_run() {
        let readme = include_str!("../../README.md");
        let after = readme
            .split_once("The config, with every default")
            .expect("the README shows the config with every default")
            .1;
        let block = after
            .split_once("```toml\n")
            .and_then(|(_, rest)| rest.split_once("\n```"))
            .expect("the block is fenced as toml")
            .0;
        let c = PipelineConfig::from_toml(block, Path::new("README.md")).unwrap();
        c.check_faults(1, 1).unwrap();
        assert_eq!(c, PipelineConfig::default());
    }

    /// `export_fails_at`: a group step from 1; 0 (never exported, so the fault would never
    /// fire) and a value that is not a whole number are refused, naming the key.
    #[test]
    fn export_fails_at_is_a_step_from_1() {
        let c = PipelineConfig::from_toml(
            "[faults.drafter-0]\nexport_fails_at = 6\n",
            Path::new("f.toml"),
        )
        .unwrap();
        assert_eq!(
            c.faults_for(WorkerName::consumer(0)).export_fails_at,
            Some(6)
        );
        for (toml, says) in [
            (
                "export_fails_at = 0\n",
                "drafter-0: must be a group step from 1",
            ),
            ("export_fails_at = \"6\"\n", "invalid type: string"),
            ("export_fails_at = -1\n", "export_fails_at"),
        ] {
            let toml = format!("[faults.drafter-0]\n{toml}");
            let err = PipelineConfig::from_toml(&toml, Path::new("f.toml"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("export_fails_at") && err.contains(says),
                "{toml}: {err}"
            );
        }
    }

    #[test]
    fn fault_keys_are_worker_names() {
        let toml = "[faults.drafter-1]\ncrash_after = 4\n[faults.target-0]\nslow = 2.0\n";
        let c = PipelineConfig::from_toml(toml, Path::new("f.toml")).unwrap();
        assert_eq!(c.faults_for(WorkerName::consumer(1)).crash_after, Some(4));
        assert_eq!(c.faults_for(WorkerName::producer(0)).slow, Some(2.0));
        assert_eq!(c.faults_for(WorkerName::producer(1)), Faults::default());
        assert_eq!(c.faults_for(WorkerName::consumer(0)), Faults::default());

        for key in ["drafter", "producer-1", "target-x", "drafter-1-2"] {
            let toml = format!("[faults.{key}]\ncrash_after = 4\n");
            let err = PipelineConfig::from_toml(&toml, Path::new("f.toml"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("faults") && err.contains(&format!("{key:?} is not a worker name")),
                "{err}"
            );
        }
    }

    /// `crash_in_end_round` is a switch: `true` parses, anything else is refused naming the
    /// field and what it takes (the drafter would otherwise read a typo as "no fault").
    #[test]
    fn crash_in_end_round_is_true_or_false() {
        let parse = |v: &str| {
            let toml = format!("[faults.drafter-1]\ncrash_in_end_round = {v}\n");
            PipelineConfig::from_toml(&toml, Path::new("f.toml"))
        };
        let c = parse("true").unwrap();
        assert!(c.faults_for(WorkerName::consumer(1)).crash_in_end_round);
        assert!(!c.faults_for(WorkerName::consumer(0)).crash_in_end_round);
        for bad in ["1", "\"yes\"", "3.0"] {
            let err = chain(&parse(bad).unwrap_err());
            assert!(
                err.contains("crash_in_end_round") && err.contains("expected a boolean"),
                "{bad}: {err}"
            );
        }
    }

    /// The whole chain of `e`'s messages, as the launcher prints it (`{:#}`).
    fn chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            out.push_str(&format!(": {c}"));
            cause = c.source();
        }
        out
    }

    /// An empty list of layers to capture is named by its field, not as "layers and hidden
    /// must be at least 1", fields the user did not set.
    #[test]
    fn an_empty_target_layer_ids_is_named() {
        let err =
            PipelineConfig::from_toml("[model]\ntarget_layer_ids = []\n", Path::new("a.toml"))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("model.target_layer_ids: names no layer"),
            "{err}"
        );
    }

    /// The mock backend computes bf16 only: f32 crash-looped every mock target and f16 had
    /// every batch refused by the mock drafter, with nothing trained. A side of one's own
    /// (`[target] command` and `[drafter] command`) takes any dtype.
    #[test]
    fn a_dtype_the_mock_backend_does_not_compute_is_refused() {
        for dtype in ["f16", "f32"] {
            let toml = format!("[model]\ndtype = \"{dtype}\"\n");
            let c = PipelineConfig::from_toml(&toml, Path::new("a.toml")).unwrap();
            for (target, drafter, side) in [
                (true, true, "both sides"),
                (true, false, "the targets"),
                (false, true, "the drafters"),
            ] {
                let err = c.check_mock_dtype(target, drafter).unwrap_err().to_string();
                assert!(
                    err.contains("model.dtype")
                        && err.contains(&format!("is \"{dtype}\""))
                        && err.contains(side),
                    "{err}"
                );
            }
            c.check_mock_dtype(false, false).unwrap();
        }
        let bf16 = PipelineConfig::default();
        bf16.check_mock_dtype(true, true).unwrap();
    }

    /// A typo of a few digits too many is refused naming the field, never an abort on the
    /// allocation of every sample's length or of the largest batch's header.
    #[test]
    fn sizes_past_what_a_process_can_hold_are_refused() {
        for (toml, field) in [
            (
                "[data]\nsynthetic_samples = 100000000000\n",
                "data.synthetic_samples",
            ),
            ("[data]\nsynthetic_samples = 0\n", "data.synthetic_samples"),
            (
                "[data]\nmin_len = 1\n[target]\ntoken_budget = 4000000000\n",
                "target.token_budget",
            ),
            // The plan's list per bucket ran out of memory before the ring checked them.
            ("[ring]\nbuckets = 4294967295\n", "ring.buckets"),
            ("[ring]\nbuckets = 0\n", "ring.buckets"),
            // Every prompt was made up front in the drafter, which aborted at each start.
            (
                "[dflash]\neval_prompts = 4294967295\n",
                "dflash.eval_prompts",
            ),
            ("[dflash]\neval_prompts = 1000001\n", "dflash.eval_prompts"),
        ] {
            let err = PipelineConfig::from_toml(toml, Path::new("a.toml"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(field) && err.contains("at"), "{toml}: {err}");
        }
        let at_most = format!("[target]\ntoken_budget = {MAX_TOKEN_BUDGET}\n");
        let c = PipelineConfig::from_toml(&at_most, Path::new("a.toml")).unwrap();
        assert!(c.largest_batch_bytes().unwrap() > u64::from(MAX_TOKEN_BUDGET));
        // Samples times epochs: within both limits, past the plan's.
        let err = PipelineConfig::from_toml(
            "[data]\nsynthetic_samples = 1000000\nepochs = 1000\n",
            Path::new("a.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("data.epochs") && err.contains("1000 epochs of 1000000 samples"),
            "{err}"
        );
        let c = PipelineConfig::from_toml("[data]\nepochs = 2\n", Path::new("a.toml")).unwrap();
        c.check_plan_size(MAX_PLANNED_SAMPLES / 2).unwrap();
        assert!(c.check_plan_size(MAX_PLANNED_SAMPLES / 2 + 1).is_err());
        // A file's data has no synthetic samples to count.
        let file = "[data]\npath = \"t.jsonl\"\nsynthetic_samples = 100000000000\n";
        PipelineConfig::from_toml(file, Path::new("a.toml")).unwrap();
    }

    #[test]
    fn ring_params_refuse_a_deadlocking_slot_count() {
        let c = PipelineConfig::from_toml("[ring]\nslots = 12\n", Path::new("a.toml")).unwrap();
        let err = c.ring_params(5, 3, 100).unwrap_err();
        let said = chain(&err);
        assert!(said.contains("deadlock"), "{said}");
        // Said once: the ring's message is the cause, not a source printed again.
        assert_eq!(said.matches("deadlock").count(), 1, "{said}");
        // The automatic slot size holds the largest batch the budget allows.
        let p = PipelineConfig::default().ring_params(5, 3, 100).unwrap();
        assert!(p.slot_size >= 16384 * 5 * 64 * 2);
    }

    #[test]
    fn buckets_split_lengths_evenly() {
        let c = PipelineConfig::default(); // 6 buckets over 1..=4096
        assert_eq!(c.bucket_of(1), 0);
        assert_eq!(c.bucket_of(683), 0);
        assert_eq!(c.bucket_of(684), 1);
        assert_eq!(c.bucket_of(4096), 5);
        assert_eq!(c.bucket_of(99_999), 5);
    }
}
