//! The launcher's side of the data: preparing `--data` once (with a progress bar on a
//! terminal, a line every 10 s otherwise), the `launcher prepare` command, and the record of
//! which prepared data a run uses (`<run-dir>/dataset.json`), so a resume refuses data that
//! changed. What preparing dropped is said on the data line, kept in the record and said
//! again at the run's end; a prepared file another tokenizer made is warned about.
//!
//! Length: about 760 lines, nearly half of them tests: the data line, the notes of dropped
//! records, the record and the resume's choice of data read one record format.

use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use dataset::{Progress, Stage, Unit};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use proto::{PipelineConfig, RunDir};
use serde::{Deserialize, Serialize};

use crate::signals::StopSignals;
use crate::{count, Interrupted};

/// Prepare training data once into the memory-mapped Arrow file every process of a run maps,
/// e.g. on a CPU machine, to copy beside the runs of a GPU machine.
///
/// The input is JSONL (one {"input_ids": [...], "loss_mask": [...]} per line, mask optional),
/// Parquet or an Arrow IPC file or stream with input_ids (and optionally loss_mask) list
/// columns, or an HF `datasets` save_to_disk directory. Parquet may be uncompressed or Snappy or
/// ZSTD compressed; no format needs Python. Records may hold conversations instead
/// ({"messages": [{"role": "user", "content": "..."}, ...]}, or ShareGPT's "conversations"
/// with from/value) or "text": the target's tokenizer and chat template (--model DIR, or
/// data.tokenizer) make their ids, and the loss mask covers the assistant's tokens.
///
/// The prepared file goes to the cache (DIR/<content key>.arrow), where a launcher whose run
/// directory is beside DIR finds it without converting again; or, with -o, to a file of your
/// choice that `launcher --data FILE` uses as it is.
///
/// Examples:
///   launcher prepare train.jsonl                       into runs/data-cache/
///   launcher prepare hf_dataset/train -o train.arrow   a file to copy to another machine
///   launcher prepare chats.jsonl --model Qwen3-8B      conversations, the target's template
///   launcher --targets 0-4 --drafters 5-7 --data train.arrow
#[derive(Parser, Debug)]
#[command(name = "launcher prepare", verbatim_doc_comment)]
pub struct PrepareArgs {
    /// The input: a JSONL, Parquet or Arrow file, or an HF datasets directory.
    pub input: PathBuf,
    /// Pipeline config: its data.max_len (which decides what is refused) and [data] chat options
    /// (system_prompt, enable_thinking, template_date, tokenizer, too_long).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Cache directory (default: runs/data-cache, the cache of runs under runs/).
    #[arg(long, value_name = "DIR", conflicts_with = "out")]
    pub data_cache: Option<PathBuf>,
    /// Write the prepared file here instead of the cache.
    #[arg(short, long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// The target's model directory, as the run's --model: its tokenizer.json and chat template
    /// prepare records holding messages, conversations or text, unless the config's
    /// data.tokenizer names another directory (as in the run).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
}

/// `launcher prepare`: exit code 0, or an error.
pub fn run_prepare(args: PrepareArgs) -> anyhow::Result<i32> {
    let cfg = prepare_config(&args)?;
    let cache = args
        .data_cache
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs").join("data-cache"));
    let options = options(&cfg, cfg.data.max_len)?;
    // Before the work of preparing: the file is renamed over `-o` once written.
    if let Some(out) = &args.out {
        atomic_file::target(out).with_context(|| format!("-o {}", out.display()))?;
    }
    // A stop signal stops the preparation, which leaves nothing partial behind.
    let signals = StopSignals::install().context("installing signal handlers")?;
    let (p, line) = prepare_dataset(
        &args.input,
        &options,
        &cache,
        args.out.as_deref(),
        Some(&signals),
    )?;
    println!("{line}");
    println!("{}", p.path.display());
    Ok(0)
}

/// The config `launcher prepare` prepares under: `--config`'s, with `--model` as the run's
/// `--model`, so that [`options`] picks the tokenizer as it does for the run (`data.tokenizer`
/// first). `--model` used to replace `data.tokenizer`, and prepare made ids the run would not.
fn prepare_config(args: &PrepareArgs) -> anyhow::Result<PipelineConfig> {
    let mut cfg = match &args.config {
        Some(p) => PipelineConfig::load(p)?,
        None => PipelineConfig::default(),
    };
    if let Some(m) = &args.model {
        cfg.model.path = Some(m.clone());
    }
    Ok(cfg)
}

/// How records become samples under `cfg`: with the tokenizer of `data.tokenizer` (which must
/// load), else of the model, when it has a `tokenizer.json`. A chat template is not needed to
/// load it: pre-tokenized records and texts are prepared without one, and a model without one
/// (a base model) is an error only at the first conversation. A model without a
/// `tokenizer.json` is named by the first conversation or text, which needs one.
pub fn options(cfg: &PipelineConfig, max_len: u32) -> anyhow::Result<dataset::Options> {
    let (dir, no_tokenizer_in) = match (&cfg.data.tokenizer, &cfg.model.path) {
        (Some(d), _) => (Some(d.clone()), None),
        (None, Some(m)) if m.join("tokenizer.json").is_file() => (Some(m.clone()), None),
        (None, m) => (None, m.clone()),
    };
    let chat = match dir {
        Some(d) => {
            let o = dataset::ChatOptions {
                enable_thinking: cfg.data.enable_thinking,
                train_only_last_turn: cfg.data.train_only_last_turn,
                system_prompt: cfg.data.system_prompt.clone(),
                date: cfg.data.template_date_epoch()?,
            };
            let c = dataset::Chat::load(&d, o)
                .with_context(|| format!("loading the tokenizer of {}", d.display()))?;
            Some(std::sync::Arc::new(c))
        }
        None => None,
    };
    Ok(dataset::Options {
        max_len,
        too_long: match cfg.data.too_long {
            proto::TooLong::Drop => dataset::TooLong::Drop,
            proto::TooLong::Truncate => dataset::TooLong::Truncate,
        },
        chat,
        no_tokenizer_in,
    })
}

/// What preparing conversations and texts counted, for the data line.
fn chat_part(s: &dataset::ChatStats, max_len: u32) -> String {
    let mut out = format!(
        "; {} ({} trained)",
        count(s.conversations, "conversation", "conversations"),
        count(s.turns, "assistant turn", "assistant turns")
    );
    if s.texts > 0 {
        out.push_str(&format!(" and {}", count(s.texts, "text", "texts")));
    }
    out.push_str(&format!(
        ", {} of their {} tokens trained",
        s.trained_tokens, s.tokens
    ));
    if s.truncated > 0 {
        out.push_str(&format!(
            ", {} truncated to data.max_len {max_len}",
            s.truncated
        ));
    }
    let at = |places: &[u64], n: u64| {
        s.places(places, n)
            .map_or(String::new(), |p| format!(" ({p})"))
    };
    if s.dropped_too_long > 0 {
        out.push_str(&format!(
            ", {} dropped: longer than data.max_len {max_len}{}",
            s.dropped_too_long,
            at(&s.too_long_at, s.dropped_too_long)
        ));
    }
    if s.dropped_untrained > 0 {
        out.push_str(&format!(
            ", {} dropped: no assistant token to train{}",
            s.dropped_untrained,
            at(&s.untrained_at, s.dropped_untrained)
        ));
    }
    if s.dropped_empty > 0 {
        out.push_str(&format!(
            ", {} dropped: empty (no token){}",
            s.dropped_empty,
            at(&s.empty_at, s.dropped_empty)
        ));
    }
    out
}

/// The notes a run's end says about `input`'s records that preparing it dropped (`p`, prepared
/// under `max_len`): they are in no batch of the plan, so the end's count of samples ("3/3
/// trained") is of the others, and only these lines say they were left out.
pub fn dropped_notes(input: &Path, p: &dataset::Prepared, max_len: u32) -> Vec<String> {
    let Some(s) = &p.chat else {
        return Vec::new();
    };
    let max_len = p.max_len.unwrap_or(max_len);
    let reasons = [
        (
            s.dropped_too_long,
            &s.too_long_at,
            format!("longer than data.max_len {max_len}"),
        ),
        (
            s.dropped_untrained,
            &s.untrained_at,
            "no assistant token to train".to_string(),
        ),
        (s.dropped_empty, &s.empty_at, "empty".to_string()),
    ];
    reasons
        .into_iter()
        .filter(|(n, ..)| *n > 0)
        .map(|(n, places, why)| {
            let at = s
                .places(places, n)
                .map_or(String::new(), |p| format!("; {p}"));
            format!(
                "{} of {} {} dropped at preparation ({why}{at}): not in the plan, so not trained",
                count(n, "record", "records"),
                input.display(),
                if n == 1 { "was" } else { "were" }
            )
        })
        .collect()
}

/// Prepares `input` (or finds it prepared); returns the outcome and a line for the user. With
/// `stop`, a stop signal ends the work at its next progress report with [`Interrupted`].
pub fn prepare_dataset(
    input: &Path,
    options: &dataset::Options,
    cache: &Path,
    out: Option<&Path>,
    stop: Option<&StopSignals>,
) -> anyhow::Result<(dataset::Prepared, String)> {
    let started = Instant::now();
    let mut show = Show::new(input);
    let stopped = || stop.is_some_and(|s| s.received() > 0);
    let p = dataset::prepare_with(input, options, cache, out, &mut |pr| {
        show.update(pr);
        if stopped() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    show.done();
    let mut p = match (p, stop) {
        (Err(dataset::DataError::Cancelled { path }), Some(s)) => {
            let left = match out {
                Some(o) => format!("{} is left as it was", o.display()),
                None => "nothing of it is left in the data cache (the next run prepares it again)"
                    .to_string(),
            };
            return Err(Interrupted(format!(
                "stopped by {} while preparing {}: {left}",
                s.last_name(),
                path.display()
            ))
            .into());
        }
        (p, _) => p.context("preparing the dataset")?,
    };
    p.path =
        std::path::absolute(&p.path).with_context(|| format!("resolving {}", p.path.display()))?;
    let what = format!(
        "{} ({}, {}, {:.1}M tokens{})",
        input.display(),
        p.kind.name(),
        count(p.samples, "sample", "samples"),
        p.tokens as f64 / 1e6,
        p.chat
            .as_ref()
            .map(|s| chat_part(s, p.max_len.unwrap_or(options.max_len)))
            .unwrap_or_default()
    );
    let secs = started.elapsed().as_secs_f64();
    let line = if p.reused && p.kind == (dataset::Kind::ArrowFile { prepared: true }) {
        format!("dataset: {what} is prepared; mapped as it is")
    } else if p.reused {
        let how = if p.key_from_stamp {
            "its files unchanged since hashed"
        } else {
            "its content hashed"
        };
        format!(
            "dataset: {what} was prepared before (content key {}, {how}, in {secs:.1} s): mapping {}",
            p.key,
            p.path.display()
        )
    } else {
        format!(
            "dataset: {what} prepared in {secs:.1} s into {}",
            p.path.display()
        )
    };
    let line = match other_tokenizer(&p, options) {
        Some(w) => format!("{line}\n{w}"),
        None => line,
    };
    Ok((p, line))
}

/// A warning when `p`'s conversations and texts were tokenized otherwise than this run would
/// tokenize them: a prepared file given as it is (`--data train.arrow`), made with another
/// model's tokenizer, or with this one under another chat template or options. Only a warning:
/// two copies of one tokenizer may differ in their file's bytes. None when they agree, when the
/// run loads no tokenizer, or when the file does not say (pre-tokenized data has no tokenizer;
/// a file of an earlier build did not record it).
fn other_tokenizer(p: &dataset::Prepared, options: &dataset::Options) -> Option<String> {
    let (chat, file) = (options.chat.as_ref()?, p.path.display());
    if p.tokenizer.as_deref()? != chat.tokenizer_key() {
        return Some(format!(
            "warning: {file} was prepared with another tokenizer than the one of {} (tokenizer fingerprint {}, this run's {}): its token ids may be another vocabulary's, and the drafter would learn the wrong tokens. Prepare the input again for this model (`launcher prepare INPUT --model {}`), or name the tokenizer it was prepared with (data.tokenizer)",
            chat.dir().display(),
            p.tokenizer.as_deref().unwrap_or_default(),
            chat.tokenizer_key(),
            chat.dir().display()
        ));
    }
    if p.chat_key.as_deref().is_some_and(|k| k != chat.key()) {
        return Some(format!(
            "warning: {file} was prepared with the tokenizer of {}, but under another chat template or other [data] chat options (enable_thinking, train_only_last_turn, system_prompt, template_date) than this run's: its conversations are not rendered as this config renders them. Prepare the input again under this config if that is not what you meant",
            chat.dir().display()
        ));
    }
    None
}

/// Progress of a preparation: a bar on a terminal, a line every 10 s otherwise.
struct Show {
    what: String,
    terminal: bool,
    /// Made at the first update, with the style of its unit (never drawn empty).
    bar: Option<ProgressBar>,
    stage: Option<Stage>,
    last_line: Instant,
}

impl Show {
    fn new(input: &Path) -> Show {
        Show {
            what: input.display().to_string(),
            terminal: std::io::stderr().is_terminal(),
            bar: None,
            stage: None,
            last_line: Instant::now(),
        }
    }

    fn update(&mut self, p: Progress) {
        let verb = match p.stage {
            Stage::Hashing => "checking",
            Stage::Converting => "preparing",
        };
        if self.terminal && self.bar.is_none() {
            self.bar = Some(ProgressBar::with_draw_target(
                Some(p.total.max(p.done)),
                ProgressDrawTarget::stderr(),
            ));
        }
        if let Some(bar) = &self.bar {
            if self.stage != Some(p.stage) {
                let template = match p.unit {
                    Unit::Bytes => {
                        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}"
                    }
                    Unit::Rows => "{msg} [{bar:30}] {pos}/{len} rows {per_sec} eta {eta}",
                };
                if let Ok(style) = ProgressStyle::with_template(template) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_message(format!("{verb} {}", self.what));
                bar.reset();
            }
            bar.set_length(p.total.max(p.done));
            bar.set_position(p.done);
        } else if self.last_line.elapsed() >= Duration::from_secs(10) {
            self.last_line = Instant::now();
            let unit = if p.unit == Unit::Bytes {
                "MB"
            } else {
                "k rows"
            };
            let scale = if p.unit == Unit::Bytes { 1e6 } else { 1e3 };
            println!(
                "dataset: {verb} {}: {:.0} of {:.0} {unit}",
                self.what,
                p.done as f64 / scale,
                p.total as f64 / scale
            );
        }
        self.stage = Some(p.stage);
    }

    fn done(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// `<run-dir>/dataset.json`: the data a run was planned from, and what its preparation left
/// out of it (records of conversations and texts dropped, or cut; none for token ids, and
/// for a file prepared by a build that did not count them).
#[derive(Serialize, Deserialize)]
pub struct Record {
    pub input: PathBuf,
    pub prepared: PathBuf,
    pub key: String,
    pub samples: u64,
    pub tokens: u64,
    #[serde(default)]
    pub dropped_too_long: u64,
    #[serde(default)]
    pub dropped_untrained: u64,
    #[serde(default)]
    pub dropped_empty: u64,
    #[serde(default)]
    pub truncated: u64,
}

pub fn write_record(run_dir: &RunDir, input: &Path, p: &dataset::Prepared) -> anyhow::Result<()> {
    let s = p.chat.clone().unwrap_or_default();
    let r = Record {
        input: input.to_path_buf(),
        prepared: p.path.clone(),
        key: p.key.clone(),
        samples: p.samples,
        tokens: p.tokens,
        dropped_too_long: s.dropped_too_long,
        dropped_untrained: s.dropped_untrained,
        dropped_empty: s.dropped_empty,
        truncated: s.truncated,
    };
    let path = run_dir.dataset_record();
    std::fs::write(&path, serde_json::to_string_pretty(&r)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

/// The data a resume of `run_dir` trains: `input` prepared again when it is the data the run was
/// planned from, else the prepared file the run was planned from, if it is still there with its
/// key. A key differs when the input changed, and also when this hspipe keys it otherwise (an
/// upgrade that renders conversations differently, another tokenizer file): either way the run
/// goes on as it was planned, saying so, and a new run trains the new data. An input that is
/// gone is not prepared at all: the planned file is the run's data. Refused only when neither
/// is the run's data.
pub fn resume_data(
    run_dir: &RunDir,
    input: &Path,
    options: &dataset::Options,
    cache: &Path,
    stop: &StopSignals,
) -> anyhow::Result<(dataset::Prepared, String)> {
    let path = run_dir.dataset_record();
    let was: Option<Record> = match std::fs::read_to_string(&path) {
        Ok(text) => Some(
            serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?,
        ),
        Err(_) => None,
    };
    // A prepared file: mapped as it is, no work to stop.
    let planned = |was: &Record| {
        let (p, line) = prepare_dataset(&was.prepared, options, cache, None, None).ok()?;
        (was.prepared.is_file() && p.key == was.key).then_some((p, line))
    };
    if let Some(was) = was.as_ref().filter(|_| !input.exists()) {
        if let Some((p, line)) = planned(was) {
            let note = format!(
                "{line}\nnote: {} is gone: the resume trains the prepared file the run was planned from",
                input.display()
            );
            return Ok((p, note));
        }
        bail!(
            "{} is gone, and so is the prepared file the run was planned from ({}, key {}), or it holds other data: restore either",
            input.display(),
            was.prepared.display(),
            was.key
        );
    }
    let now = prepare_dataset(input, options, cache, None, Some(stop))?;
    let Some(was) = was else {
        return Ok(now);
    };
    if was.key == now.0.key {
        return Ok(now);
    }
    if let Some((p, line)) = planned(&was) {
        let note = format!(
            "{line}\nnote: {} has content key {} now, not the run's {} (the data changed, or this hspipe keys it otherwise): the resume trains the prepared file the run was planned from; a new run trains the data as it is now",
            was.input.display(),
            now.0.key,
            was.key
        );
        return Ok((p, note));
    }
    bail!(
        "the data changed since this run started: {} has content key {} now, the run was planned from key {}, and its prepared file {} is gone or another; resuming would follow another plan. Restore the data or that prepared file",
        was.input.display(),
        now.0.key,
        was.key,
        was.prepared.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One conversation with one assistant turn is counted in the singular on the data line
    /// ("1 conversations (1 assistant turns trained)" it said; the chat tests see the plural).
    #[test]
    fn the_data_lines_counts_agree_with_their_number() {
        let one = dataset::ChatStats {
            conversations: 1,
            turns: 1,
            texts: 1,
            trained_tokens: 14,
            tokens: 48,
            ..Default::default()
        };
        assert_eq!(
            chat_part(&one, 64),
            "; 1 conversation (1 assistant turn trained) and 1 text, 14 of their 48 tokens trained"
        );
    }

    /// A base model's directory: a word-level `tokenizer.json` and no chat template.
    fn base_model(dir: &Path) {
        base_model_of(dir, &["[UNK]", "hello", "there"]);
    }

    /// A base model's directory whose tokenizer knows `words`.
    fn base_model_of(dir: &Path, words: &[&str]) {
        let vocab = words
            .iter()
            .enumerate()
            .map(|(i, w)| format!("{w:?}: {i}"))
            .collect::<Vec<_>>()
            .join(", ");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("tokenizer.json"),
            format!(
                r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null,
  "decoder": null, "model": {{"type": "WordLevel", "vocab": {{{vocab}}}, "unk_token": "[UNK]"}}}}"#
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "there"}"#,
        )
        .unwrap();
    }

    /// Prepares `text` (a JSONL file) under `cfg`: the samples, or the error chain.
    fn prepare(cfg: &PipelineConfig, dir: &Path, text: &str) -> Result<u64, String> {
        let input = dir.join("input.jsonl");
        std::fs::write(&input, text).unwrap();
        let out = dir.join("out.arrow");
        let options = options(cfg, 64).map_err(|e| format!("{e:#}"))?;
        prepare_dataset(&input, &options, &dir.join("cache"), Some(&out), None)
            .map(|(p, _)| p.samples)
            .map_err(|e| format!("{e:#}"))
    }

    #[test]
    fn a_base_model_without_a_chat_template_prepares_ids_and_texts() {
        let t = tempfile::tempdir().unwrap();
        let base = t.path().join("base");
        base_model(&base);
        let ids = "{\"input_ids\": [1, 2]}\n";
        let text = "{\"text\": \"hello there\"}\n";
        let chat = "{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}\n";
        // `launcher --model base` and `launcher prepare --model base` (data.tokenizer).
        let mut by_model = PipelineConfig::default();
        by_model.model.path = Some(base.clone());
        let mut by_tokenizer = PipelineConfig::default();
        by_tokenizer.data.tokenizer = Some(base.clone());
        for cfg in [&by_model, &by_tokenizer] {
            assert_eq!(prepare(cfg, t.path(), ids), Ok(1));
            assert_eq!(prepare(cfg, t.path(), text), Ok(1));
            let e = prepare(cfg, t.path(), &format!("{ids}{chat}")).unwrap_err();
            assert!(
                e.contains("input.jsonl:2: ") && e.contains("no chat template"),
                "{e}"
            );
        }
    }

    /// `launcher prepare --model M --config C` takes C's data.tokenizer over M's tokenizer, as a
    /// run on the same flags does, and fails where that run fails (a data.tokenizer that does
    /// not exist). Before, --model replaced data.tokenizer: prepare made ids the run would not.
    #[test]
    fn prepare_takes_the_configs_tokenizer_over_the_models_as_a_run_does() {
        use clap::Parser;
        let t = tempfile::tempdir().unwrap();
        let (base, bare) = (t.path().join("base"), t.path().join("bare"));
        base_model(&base);
        std::fs::create_dir(&bare).unwrap();
        let cfg_of = |model: &Path, tokenizer: &Path| {
            let toml = t.path().join("c.toml");
            std::fs::write(
                &toml,
                format!("[data]\ntokenizer = {:?}\n", tokenizer.to_str().unwrap()),
            )
            .unwrap();
            let args = [
                Path::new("in.jsonl"),
                Path::new("--config"),
                &toml,
                Path::new("--model"),
                model,
            ];
            prepare_config(
                &PrepareArgs::try_parse_from([Path::new("prepare")].iter().chain(&args)).unwrap(),
            )
            .unwrap()
        };
        // The model has no tokenizer.json; the config's tokenizer prepares the text.
        let text = "{\"text\": \"hello there\"}\n";
        assert_eq!(prepare(&cfg_of(&bare, &base), t.path(), text), Ok(1));
        let missing = t.path().join("missing");
        let e = format!(
            "{:#}",
            options(&cfg_of(&base, &missing), 64)
                .err()
                .expect("refused")
        );
        assert!(
            e.contains(&format!("loading the tokenizer of {}", missing.display())),
            "{e}"
        );
    }

    /// A text with no tokenizer says what is missing and what to do: with no model named, to
    /// name one; with a model named (`--model DIR`, as capture and eval have it) that has no
    /// tokenizer.json, that DIR lacks it. Before, the second also said to name one with
    /// --model DIR, which the user had done.
    #[test]
    fn text_without_a_tokenizer_says_what_is_missing_whether_or_not_a_model_is_named() {
        let t = tempfile::tempdir().unwrap();
        let text = "{\"text\": \"hello there\"}\n";
        let e = prepare(&PipelineConfig::default(), t.path(), text).unwrap_err();
        assert!(
            e.contains("input.jsonl:1: ")
                && e.contains("no tokenizer was loaded")
                && e.contains("a directory holding the target's tokenizer.json"),
            "{e}"
        );
        let weights_only = t.path().join("weights-only");
        std::fs::create_dir_all(&weights_only).unwrap();
        let mut named = PipelineConfig::default();
        named.model.path = Some(weights_only.clone());
        let e = prepare(&named, t.path(), text).unwrap_err();
        let lacks = format!(
            "the model directory {} has no tokenizer.json",
            weights_only.display()
        );
        assert!(
            e.contains("input.jsonl:1: ")
                && e.contains(&lacks)
                && e.contains("copy the target's tokenizer.json")
                && e.contains("data.tokenizer")
                && !e.contains("--model"),
            "{e}"
        );
    }

    /// A prepared file given as it is (`--data train.arrow`) whose texts another tokenizer made
    /// is said to be so, as is one of this tokenizer under other chat options; the same
    /// tokenizer and options, and pre-tokenized data (no tokenizer made it), say nothing.
    /// Before, nothing recorded the tokenizer, and only ids past the vocabulary were caught.
    #[test]
    fn a_prepared_file_of_another_tokenizer_is_warned_about() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        base_model(&a);
        base_model_of(&b, &["[UNK]", "there", "hello"]);
        let with = |dir: &Path, thinking: Option<bool>| {
            let mut cfg = PipelineConfig::default();
            cfg.data.tokenizer = Some(dir.to_path_buf());
            cfg.data.enable_thinking = thinking;
            options(&cfg, 64).unwrap()
        };
        let made = |text: &str, name: &str| {
            let input = t.path().join(format!("{name}.jsonl"));
            std::fs::write(&input, text).unwrap();
            let out = t.path().join(format!("{name}.arrow"));
            prepare_dataset(
                &input,
                &with(&a, None),
                &t.path().join("c"),
                Some(&out),
                None,
            )
            .unwrap();
            out
        };
        let texts = made("{\"text\": \"hello there\"}\n", "texts");
        let ids = made("{\"input_ids\": [1, 2]}\n", "ids");
        let line = |file: &Path, o: &dataset::Options| {
            prepare_dataset(file, o, &t.path().join("c"), None, None)
                .unwrap()
                .1
        };
        let same = line(&texts, &with(&a, None));
        assert!(!same.contains("warning"), "{same}");
        let other = line(&texts, &with(&b, None));
        assert!(
            other.contains(&format!(
                "warning: {} was prepared with another tokenizer than the one of {}",
                texts.display(),
                b.display()
            )),
            "{other}"
        );
        let options = line(&texts, &with(&a, Some(false)));
        assert!(
            options.contains("under another chat template or other [data] chat options"),
            "{options}"
        );
        let pre = line(&ids, &with(&b, None));
        assert!(!pre.contains("warning"), "{pre}");
    }

    /// An empty text is dropped as empty, not as a record with "no assistant token to train"
    /// (it has no token at all), and the data line names its line.
    #[test]
    fn an_empty_text_is_dropped_as_empty_and_its_line_named() {
        let t = tempfile::tempdir().unwrap();
        let base = t.path().join("base");
        base_model(&base);
        let mut cfg = PipelineConfig::default();
        cfg.data.tokenizer = Some(base);
        let input = t.path().join("texts.jsonl");
        std::fs::write(&input, "{\"text\": \"hello\"}\n{\"text\": \"\"}\n").unwrap();
        let o = options(&cfg, 64).unwrap();
        let (p, line) = prepare_dataset(&input, &o, &t.path().join("c"), None, None).unwrap();
        assert!(
            line.contains(", 1 dropped: empty (no token) (line 2)")
                && !line.contains("no assistant token"),
            "{line}"
        );
        assert_eq!(p.samples, 1);
        let notes = dropped_notes(&input, &p, 64);
        assert_eq!(
            notes,
            [format!(
                "1 record of {} was dropped at preparation (empty; line 2): not in the plan, so not trained",
                input.display()
            )]
        );
    }
}
