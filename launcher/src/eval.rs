//! `launcher eval`: real greedy speculative decoding of held-out prompts with a trained DFlash
//! drafter on its target, reporting the mean tokens per target forward (the DFlash authors'
//! "average acceptance length"), the acceptance per block position, and whether the output
//! equals the target's own greedy decoding token for token (it must: a drafter never changes
//! the output).
//!
//! Length: past 500 lines with its tests, which build a model and a drafter each to check the
//! refusals before any decoding; the command itself is about 320 lines.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Parser;
use model::dflash::{Dflash, DflashConfig, Frozen};
use model::{spec, Decoder};
use serde::Serialize;

use crate::signals::StopSignals;

/// Speculative decoding of held-out prompts: the drafter proposes a block, the target verifies
/// it in one forward, the accepted prefix and the target's next token are appended. Prints the
/// mean acceptance length (tokens per target forward, 1..block size), the acceptance at each
/// block position, and checks the text equals the target's own greedy decoding.
///
/// Prompts: the built-in synthetic language (what real-model runs train on, held-out samples)
/// or --data (a prepared-able input; each sample's first --prompt-len tokens).
///
/// Examples:
///   launcher eval --model tiny --drafter runs/demo/drafter
///   launcher eval --model tiny --drafter runs/demo/drafter --baseline --json eval.json
/// Exit 0 when every generation equals the target's greedy output, 1 otherwise.
#[derive(Parser, Debug)]
#[command(name = "launcher eval", verbatim_doc_comment)]
pub struct EvalArgs {
    /// The target's HF model directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// The drafter's export (a run's <run-dir>/drafter).
    #[arg(long, value_name = "DIR")]
    pub drafter: PathBuf,
    /// Prompts from this data (JSONL, Parquet, Arrow, HF datasets directory).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Pipeline config whose [data] chat options (system_prompt, enable_thinking,
    /// template_date, tokenizer) and max_len prepare --data's conversations, as the run
    /// prepared its own: e.g. <run-dir>/config.toml. Default: none of them, and no length
    /// limit.
    #[arg(long, value_name = "FILE", requires = "data")]
    pub config: Option<PathBuf>,
    /// Where --data is prepared (cached), as the launcher's --data-cache: give the run's, with
    /// the run's --config, to reuse the file its launch prepared. Default: runs/data-cache,
    /// beside a run's directory under runs/ in the current directory.
    #[arg(long, value_name = "DIR", requires = "data")]
    pub data_cache: Option<PathBuf>,
    /// Prompts to decode, 1 to 1000000 (none would report no figure as if it were one; the
    /// held-out prompts are made before the first is decoded).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_PROMPTS), default_value_t = 8)]
    pub prompts: usize,
    /// Tokens of each prompt (at least 1); with the new tokens and a block they stay within
    /// the target's max_position_embeddings (and sliding window).
    #[arg(long, value_parser = at_least_one(), default_value_t = 32)]
    pub prompt_len: usize,
    /// Tokens to generate per prompt (at least 1).
    #[arg(long, value_parser = at_least_one(), default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Also decode with an untrained drafter of the same shape, for comparison.
    #[arg(long)]
    pub baseline: bool,
    /// Write the figures as JSON here too.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// The most `--prompts`: 2^32 of them were made up front, 103 GB, and the process aborted.
const MAX_PROMPTS: u64 = proto::config::MAX_EVAL_PROMPTS as u64;

/// A count flag of 1 or more: a zero would report figures over nothing.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// What one drafter achieved over the prompts.
#[derive(Debug, Serialize)]
pub struct Acceptance {
    /// Mean tokens per target forward (verification), 1..block size.
    pub mean_acceptance_length: f64,
    /// Share of verifications that accepted at least k drafted tokens, k = 1..block size - 1.
    pub per_position: Vec<f64>,
    pub verifications: usize,
    pub tokens: usize,
    /// Every prompt's output equals the target's greedy decoding.
    pub matches_greedy: bool,
}

#[derive(Debug, Serialize)]
pub struct EvalReport {
    pub model: PathBuf,
    pub drafter: PathBuf,
    /// Prompts decoded: `prompts_asked`, or fewer when --data holds fewer samples.
    pub prompts: usize,
    /// `--prompts`.
    pub prompts_asked: usize,
    pub max_new_tokens: usize,
    pub block_size: usize,
    pub trained: Acceptance,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untrained: Option<Acceptance>,
}

fn prompts(a: &EvalArgs, vocab: usize, stop: &StopSignals) -> anyhow::Result<Vec<Vec<u32>>> {
    let Some(input) = &a.data else {
        // Held-out samples of the one language real-model runs train on.
        return Ok(dataset::language::held_out(
            vocab as u32,
            a.prompts,
            a.prompt_len as u32,
        ));
    };
    let cache = (a.data_cache.clone()).unwrap_or_else(|| PathBuf::from("runs").join("data-cache"));
    // Conversations are prepared through the target's own template, as for training, with the
    // run's chat options when its config is given (its data and sizes are the run's, unread).
    let mut cfg = match &a.config {
        Some(p) => proto::PipelineConfig::load_unchecked(p)?,
        None => proto::PipelineConfig::default(),
    };
    cfg.model.path = Some(a.model.clone());
    // The run's max_len keys the data as the run keyed it, so its prepared file is found in
    // the cache, not the whole input prepared again to take a few prompts.
    let max_len = match &a.config {
        Some(_) => cfg.data.max_len,
        None => u32::MAX,
    };
    let options = crate::data::options(&cfg, max_len)?;
    let (p, line) = crate::data::prepare_dataset(input, &options, &cache, None, Some(stop))?;
    println!("{line}");
    let data = dataset::Dataset::mapped(&p.path)?;
    let mut out = Vec::new();
    for id in 0..data.len() as u64 {
        if out.len() == a.prompts {
            break;
        }
        if let Some(s) = data.sample(id) {
            let ids: Vec<u32> = s.input_ids.iter().take(a.prompt_len).copied().collect();
            // Named as capture names it: the file, and the sample (counted from 0).
            if let Some((pos, &bad)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                bail!(
                    "{}: sample {id}: token id {bad} at position {pos} is outside the target's vocabulary of {vocab} ({}): was the data tokenized for another model?",
                    input.display(),
                    a.model.display()
                );
            }
            if !ids.is_empty() {
                out.push(ids);
            }
        }
    }
    if out.is_empty() {
        bail!("{} holds no sample to prompt with", input.display());
    }
    if out.len() < a.prompts {
        // Not an error (the data is what it is), but never fewer without a word.
        eprintln!(
            "eval: {} holds {} samples to prompt with, fewer than --prompts {}: decoding {}",
            input.display(),
            out.len(),
            a.prompts,
            out.len()
        );
    }
    Ok(out)
}

/// Decodes `prompts` with `drafter` (named `label` in errors) on `target`; `greedy` is the
/// target's own output for each, which the speculative output must equal.
fn decode(
    target: &Decoder,
    (drafter, label): (&Dflash, &str),
    prompts: &[Vec<u32>],
    greedy: &[Vec<u32>],
    max_new: usize,
    stop: &StopSignals,
) -> anyhow::Result<Acceptance> {
    let b = drafter.cfg.block_size;
    let mut lengths = Vec::new();
    let mut matches = true;
    let mut tokens = 0;
    for (i, (p, want)) in prompts.iter().zip(greedy).enumerate() {
        stop.check(|| stopped_at("speculative decoding", i, prompts.len()))?;
        let g = spec::speculative(target, drafter, p, max_new).map_err(|e| {
            // The target's greedy decoding of the same prompt passed its NaN check.
            let what = match e {
                model::ModelError::NonFinite(_) => ": it cannot be scored; evaluate another export (a kept one, drafter-steps/step-S/, of a step before the training diverged) or train it again",
                _ => "",
            };
            anyhow::Error::from(e).context(format!("prompt {i}, drafted by {label}{what}"))
        })?;
        if &g.tokens != want {
            let at = g.tokens.iter().zip(want).position(|(x, y)| x != y);
            eprintln!("prompt {i}: the speculative output differs from the target's greedy output at token {at:?}");
            matches = false;
        }
        tokens += g.tokens.len();
        lengths.extend(g.accept_lengths);
    }
    let n = lengths.len().max(1) as f64;
    Ok(Acceptance {
        mean_acceptance_length: lengths.iter().sum::<usize>() as f64 / n,
        per_position: (1..b)
            .map(|k| lengths.iter().filter(|&&l| l > k).count() as f64 / n)
            .collect(),
        verifications: lengths.len(),
        tokens,
        matches_greedy: matches,
    })
}

fn line(name: &str, a: &Acceptance) -> String {
    let per: Vec<String> = a.per_position.iter().map(|p| format!("{p:.2}")).collect();
    format!(
        "eval: {name}: mean acceptance length {:.2} tokens per target forward ({} verifications, {} tokens); accepted at positions 1..: [{}]; output {} the target's greedy output",
        a.mean_acceptance_length,
        a.verifications,
        a.tokens,
        per.join(", "),
        if a.matches_greedy { "equals" } else { "DIFFERS FROM" }
    )
}

/// What a stop at prompt `i` of `n` says.
fn stopped_at(what: &str, i: usize, n: usize) -> String {
    format!("during {what}, at prompt {i} of {n}: no figure reported, no --json written")
}

/// The directories eval made for `--json`, deepest last: removed again (those still empty)
/// unless the report is written into them ([`MadeDirs::keep`]), so a stopped or failed eval
/// leaves no directory it made behind.
#[derive(Default)]
struct MadeDirs {
    dirs: Vec<PathBuf>,
    keep: bool,
}

impl MadeDirs {
    /// Makes `dir` and its missing parents.
    fn create(dir: &Path) -> std::io::Result<MadeDirs> {
        let mut dirs: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && std::fs::symlink_metadata(d).is_err())
            .map(Path::to_path_buf)
            .collect();
        dirs.reverse();
        let made = MadeDirs { dirs, keep: false };
        // Those made before a failure are removed (the drop).
        std::fs::create_dir_all(dir)?;
        Ok(made)
    }

    /// Removes the directories made (`dirs`) that are still empty: `remove_dir` removes no
    /// other.
    fn remove(dirs: &[PathBuf]) {
        for d in dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }

    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for MadeDirs {
    fn drop(&mut self) {
        if !self.keep {
            MadeDirs::remove(&self.dirs);
        }
    }
}

/// What is wrong with `--drafter DIR` where DIR is a run's directory rather than its export,
/// the folder of its kept exports rather than one of them, or the export of a run that has
/// written none yet: the path to give, or why there is none.
/// Both read as a `config.json` missing from a path the user never typed.
fn run_dir_as_drafter(drafter: &Path) -> Option<String> {
    let no_export = "the group's leader writes it at every checkpoint (every drafter.checkpoint_every steps), at a stop and at the end; a run without --model trains the mock drafter, which exports none";
    let run = proto::RunDir::new(drafter);
    if run.config().is_file() {
        let export = run.export_dir();
        return Some(if export.join("config.json").is_file() {
            format!(
                "a run directory, not a drafter's export: give --drafter {}",
                export.display()
            )
        } else {
            format!(
                "a run directory that holds no drafter export ({}) yet: {no_export}",
                export.display()
            )
        });
    }
    let parent = drafter.parent().filter(|p| !p.as_os_str().is_empty())?;
    let run = proto::RunDir::new(parent);
    if run.config().is_file() && run.kept_exports_dir() == drafter {
        let steps: Vec<String> = (run.kept_export_steps().iter())
            .map(|s| format!("step-{s}"))
            .collect();
        return Some(match steps.last() {
            Some(last) => format!(
                "the folder of a run's kept exports, not an export: give one of them, e.g. --drafter {} (kept: {})",
                drafter.join(last).display(),
                steps.join(", ")
            ),
            None => format!(
                "the folder of a run's kept exports, which holds none yet (drafter.keep_export_every keeps one at each multiple of it): give --drafter {}",
                run.export_dir().display()
            ),
        });
    }
    (!drafter.exists() && run.config().is_file() && run.export_dir() == drafter).then(|| {
        format!(
            "no such directory: the run in {} has written no drafter export yet: {no_export}",
            parent.display()
        )
    })
}

/// `launcher eval`.
pub fn run_eval(a: EvalArgs) -> anyhow::Result<i32> {
    // Before the work of decoding: the report is renamed over `--json` once written.
    let mut made = MadeDirs::default();
    if let Some(p) = &a.json {
        let to = atomic_file::target(p).with_context(|| format!("--json {}", p.display()))?;
        // Its directory made now, as `launcher prepare -o` makes its own: a missing one was
        // found only after the decoding, named by the temporary file's path.
        if let Some(dir) = to.parent().filter(|d| !d.as_os_str().is_empty()) {
            made = MadeDirs::create(dir)
                .with_context(|| format!("--json {}: creating {}", p.display(), dir.display()))?;
        }
    }
    // Stops end the evaluation between prompts (or its data's preparation); --json is written
    // only at the end, so nothing is left, the directories made for it included.
    let signals = StopSignals::install().context("installing signal handlers")?;
    let dirs = made.dirs.clone();
    signals.exit_on_second("eval", move || {
        MadeDirs::remove(&dirs);
        ": no --json written".into()
    });
    if let Some(why) = run_dir_as_drafter(&a.drafter) {
        bail!("--drafter {}: {why}", a.drafter.display());
    }
    let target = Decoder::load(&a.model, &Device::Cpu, DType::F32)
        .with_context(|| format!("loading the target {}", a.model.display()))?;
    // The drafter's config first: a drafter of another model is named as such, before its
    // weights are read or a prompt is run.
    let cfg = DflashConfig::load(&a.drafter)
        .with_context(|| format!("loading the drafter {}", a.drafter.display()))?;
    if let Err(why) = cfg.check_target(target.config()) {
        bail!(
            "the drafter {} does not fit the target {}: {why}",
            a.drafter.display(),
            a.model.display()
        );
    }
    if let Err(why) = spec::check_reach(
        a.prompt_len,
        a.max_new_tokens,
        cfg.block_size,
        target.config(),
    ) {
        bail!(
            "--prompt-len {} and --max-new-tokens {}: {why}",
            a.prompt_len,
            a.max_new_tokens
        );
    }
    let frozen = || {
        Frozen::load(&a.model, &Device::Cpu).with_context(|| {
            format!(
                "loading the target's embedding and head from {}",
                a.model.display()
            )
        })
    };
    let drafter = Dflash::load_export(&a.drafter, frozen()?)
        .with_context(|| format!("loading the drafter {}", a.drafter.display()))?;
    let vocab = target.config().vocab_size;
    let prompts = prompts(&a, vocab, &signals)?;
    println!(
        "eval: {} prompts of up to {} tokens, {} new tokens each, block size {}",
        prompts.len(),
        a.prompt_len,
        a.max_new_tokens,
        drafter.cfg.block_size
    );
    let greedy: Vec<Vec<u32>> = (prompts.iter().enumerate())
        .map(|(i, p)| {
            signals.check(|| stopped_at("the target's greedy decoding", i, prompts.len()))?;
            spec::greedy(&target, p, a.max_new_tokens).with_context(|| {
                format!(
                    "the target {}'s greedy decoding of prompt {i}",
                    a.model.display()
                )
            })
        })
        .collect::<Result<_, _>>()?;
    let trained = decode(
        &target,
        (&drafter, &format!("the drafter {}", a.drafter.display())),
        &prompts,
        &greedy,
        a.max_new_tokens,
        &signals,
    )?;
    println!("{}", line("trained", &trained));
    let untrained = if a.baseline {
        let fresh = Dflash::new(drafter.cfg.clone(), frozen()?, 0)?;
        let u = decode(
            &target,
            (&fresh, "the untrained drafter"),
            &prompts,
            &greedy,
            a.max_new_tokens,
            &signals,
        )?;
        println!("{}", line("untrained", &u));
        Some(u)
    } else {
        None
    };
    let ok = trained.matches_greedy && untrained.as_ref().is_none_or(|u| u.matches_greedy);
    let report = EvalReport {
        model: a.model.clone(),
        drafter: a.drafter.clone(),
        prompts: prompts.len(),
        prompts_asked: a.prompts,
        max_new_tokens: a.max_new_tokens,
        block_size: drafter.cfg.block_size,
        trained,
        untrained,
    };
    if let Some(p) = &a.json {
        atomic_file::replace(p, serde_json::to_string_pretty(&report)?.as_bytes())
            .with_context(|| format!("writing --json {}", p.display()))?;
        made.keep();
    }
    Ok(if ok { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::dflash::{mask_token_id, DflashConfig};
    use model::make::{make_model, MakeSpec};
    use model::ArchConfig;

    fn args(model: &std::path::Path, drafter: &std::path::Path, extra: &[&str]) -> EvalArgs {
        let mut argv = vec![
            "launcher eval".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--drafter".into(),
            drafter.display().to_string(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        EvalArgs::try_parse_from(argv).unwrap()
    }

    /// A small target in `dir/m` and an untrained drafter's export for it in `dir/drafter`.
    fn model_and_drafter(dir: &Path) -> (PathBuf, PathBuf) {
        let m = dir.join("m");
        let spec = MakeSpec {
            layers: 2,
            vocab: 300,
            ..MakeSpec::default()
        };
        make_model(&m, &spec).unwrap();
        let arch = ArchConfig::load(&m).unwrap();
        let mask = mask_token_id(&m, arch.vocab_size, None).unwrap();
        let cfg = DflashConfig::for_target(&arch, vec![0, 1], Some(1), 4, mask);
        let drafter = dir.join("drafter");
        let frozen = Frozen::load(&m, &Device::Cpu).unwrap();
        Dflash::new(cfg, frozen, 0)
            .unwrap()
            .export(&drafter)
            .unwrap();
        (m, drafter)
    }

    /// One prompt of 8 tokens, 2 new tokens: an eval that decodes little.
    const QUICK: [&str; 6] = [
        "--prompts",
        "1",
        "--prompt-len",
        "8",
        "--max-new-tokens",
        "2",
    ];

    /// A drafter whose weights are NaN (a diverged training's export) is refused, naming its
    /// directory and what to do, as a target computing NaN is: it was scored "mean acceptance
    /// length 1.00", exit 0, a figure that is no score.
    #[test]
    fn a_drafter_whose_output_is_not_finite_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (m, drafter) = model_and_drafter(dir.path());
        let st = drafter.join("model.safetensors");
        let weights = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
        let nan: std::collections::HashMap<_, _> = (weights.into_iter())
            .map(|(name, t)| (name, t.affine(0.0, f64::NAN).unwrap()))
            .collect();
        candle_core::safetensors::save(&nan, &st).unwrap();
        let e = format!("{:#}", run_eval(args(&m, &drafter, &QUICK)).unwrap_err());
        for want in [
            &format!("prompt 0, drafted by the drafter {}", drafter.display()),
            "NaN or infinite values in the drafter's output",
            "evaluate another export",
        ] {
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
    }

    /// `--json` in a directory that does not exist is written there, the directory made (as
    /// `prepare -o` makes its own); one under a regular file is refused before any decoding,
    /// naming it. Before, the first failed after the decoding, naming the temporary file.
    #[test]
    fn json_in_a_missing_directory_is_made_and_one_under_a_file_refused_first() {
        let dir = tempfile::tempdir().unwrap();
        let (m, drafter) = model_and_drafter(dir.path());
        let json = dir.path().join("nodir").join("x.json");
        let quick = |json: &std::path::Path| {
            let j = json.display().to_string();
            let mut v: Vec<&str> = QUICK.to_vec();
            v.extend(["--json", &j]);
            run_eval(args(&m, &drafter, &v))
        };
        assert_eq!(quick(&json).unwrap(), 0);
        assert!(json.is_file());
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let e = format!("{:#}", quick(&file.join("x.json")).unwrap_err());
        assert!(e.contains("file/x.json") && !e.contains(".x.json"), "{e}");
    }

    /// A run directory given as `--drafter` (the README's `runs/dflash` for
    /// `runs/dflash/drafter`) is told the export's path; a run with no export yet, and its
    /// missing `drafter/`, say why there is none. All three said only that a `config.json` was
    /// missing from a path the user never typed.
    #[test]
    fn a_run_directory_as_drafter_names_its_export_or_why_it_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join("drafter")).unwrap();
        std::fs::write(run.join("config.toml"), "[data]\n").unwrap();
        let e = |d: &Path| format!("{:#}", run_eval(args(Path::new("m"), d, &[])).unwrap_err());
        // No export yet: the run directory given, or its missing `drafter/`.
        let said = e(&run);
        assert!(said.contains("holds no drafter export"), "{said}");
        std::fs::remove_dir(run.join("drafter")).unwrap();
        let said = e(&run.join("drafter"));
        assert!(said.contains("has written no drafter export yet"), "{said}");
        std::fs::create_dir(run.join("drafter")).unwrap();
        std::fs::write(run.join("drafter").join("config.json"), "{}").unwrap();
        let said = e(&run);
        let want = format!("give --drafter {}", run.join("drafter").display());
        assert!(said.contains(&want), "{said}");
        // The folder of kept exports, for one of them: the newest kept, or the export while
        // none is.
        let kept = run.join("drafter-steps");
        std::fs::create_dir(&kept).unwrap();
        let said = e(&kept);
        assert!(
            said.contains("holds none yet") && said.contains(&want),
            "{said}"
        );
        for s in ["step-40", "step-80"] {
            std::fs::create_dir(kept.join(s)).unwrap();
        }
        let said = e(&kept);
        let want = format!(
            "--drafter {} (kept: step-40, step-80)",
            kept.join("step-80").display()
        );
        assert!(said.contains(&want), "{said}");
    }

    /// A zero count is refused by its flag: `--prompts 0` or `--max-new-tokens 0` reported a
    /// mean acceptance length of 0.00 (outside 1..B) and exit 0; `--prompt-len 0` an empty
    /// batch.
    #[test]
    fn zero_counts_are_refused_by_their_flag() {
        for flag in ["--prompts", "--prompt-len", "--max-new-tokens"] {
            let argv = ["launcher eval", "--model", "m", "--drafter", "d", flag, "0"];
            let e = EvalArgs::try_parse_from(argv).unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains("0"), "{flag}: {e}");
        }
        // Too many: 2^32 prompts were made up front (103 GB) and the process aborted.
        let argv = [
            "launcher eval",
            "--model",
            "m",
            "--drafter",
            "d",
            "--prompts",
            "4294967296",
        ];
        let e = EvalArgs::try_parse_from(argv).unwrap_err().to_string();
        assert!(e.contains("--prompts") && e.contains("1..=1000000"), "{e}");
    }

    /// A drafter of another target (its number of layers here), and a generation reaching past
    /// the target's positions, are errors naming them before any prompt runs: both used to
    /// decode and report figures, exit 0.
    #[test]
    fn a_drafter_of_another_target_or_a_generation_past_its_positions_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (small, big) = (dir.path().join("m2"), dir.path().join("m3"));
        for (m, layers) in [(&small, 2), (&big, 3)] {
            let spec = MakeSpec {
                layers,
                vocab: 300,
                ..MakeSpec::default()
            };
            make_model(m, &spec).unwrap();
        }
        let arch = ArchConfig::load(&small).unwrap();
        let mask = mask_token_id(&small, arch.vocab_size, None).unwrap();
        let cfg = DflashConfig::for_target(&arch, vec![0, 1], Some(1), 4, mask);
        let frozen = Frozen::load(&small, &Device::Cpu).unwrap();
        let drafter = dir.path().join("drafter");
        Dflash::new(cfg, frozen, 0)
            .unwrap()
            .export(&drafter)
            .unwrap();
        let quick = [
            "--prompts",
            "1",
            "--prompt-len",
            "8",
            "--max-new-tokens",
            "4",
        ];
        assert_eq!(run_eval(args(&small, &drafter, &quick)).unwrap(), 0);

        let e = format!("{:#}", run_eval(args(&big, &drafter, &quick)).unwrap_err());
        assert!(
            e.contains("does not fit") && e.contains("decoder layers 2 (the target's: 3)"),
            "{e}"
        );

        // The target's positions cut short by hand: 8 + 4 + a block of 4 reach 16.
        let path = small.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        c["max_position_embeddings"] = 15.into();
        std::fs::write(&path, c.to_string()).unwrap();
        let e = format!(
            "{:#}",
            run_eval(args(&small, &drafter, &quick)).unwrap_err()
        );
        assert!(
            e.contains("--prompt-len 8") && e.contains("max_position_embeddings = 15"),
            "{e}"
        );
    }
}
