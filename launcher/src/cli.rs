//! The launcher's command line: the run's options, its subcommands (`report`, `prepare`, and
//! the hidden worker subcommands through which the launcher starts its workers), GPU lists, the
//! checks clap cannot make, and the exit codes.
//!
//! Length: the flags' own documentation (what `--help` teaches) is most of it, and their tests.

use std::path::PathBuf;

use std::sync::OnceLock;
use std::time::Duration;

use clap::builder::PossibleValue;
use clap::{Parser, Subcommand, ValueEnum};
use gpu::BackendKind;

/// Exit codes (also in the README).
pub mod exit {
    /// Every sample was trained.
    pub const OK: i32 = 0;
    /// An error stopped the run (the message says which).
    pub const ERROR: i32 = 1;
    /// Bad command line.
    pub const USAGE: i32 = 2;
    /// The run ended but degraded: a worker gave up past its restart limit, samples were left
    /// untrained, or a batch was trained twice; `summary.json` says why.
    pub const DEGRADED: i32 = 3;
    /// Stopped by a stop signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) after draining cleanly, or
    /// while the data was prepared (nothing ran).
    pub const INTERRUPTED: i32 = 130;
    /// Stopped by a second stop signal: workers were killed.
    pub const KILLED: i32 = 131;
}

/// Train speculative-decoding drafters from frozen target models, one process per GPU.
///
/// Targets turn training text into hidden states; drafters learn from them; batches move
/// through a shared-memory ring. A crashed worker is restarted alone; Ctrl-C (or SIGTERM, or
/// SIGHUP from a closed terminal, or SIGQUIT) stops targets, lets drafters drain and
/// checkpoint, then exits (a second signal kills at once; `timeout`'s SIGTERM, sent twice, is
/// one). At start, rings left by dead launchers of the same user are removed, with a line
/// saying which run stopped.
///
/// Examples:
///   launcher --targets 0-4 --drafters 5-7                  mock GPUs, built-in synthetic data
///   launcher --targets 0,1 --drafters 2 --synthetic 500    a smaller run
///   launcher --targets 0-4 --drafters 5-7 --data train.jsonl --run-dir runs/exp1
///   launcher --targets 0 --drafters 0 --share-gpus         one GPU for both sides
///   launcher make-model tiny && launcher --targets 0-1 --drafters 2 --model tiny \
///       --config scripts/dflash-demo.toml --synthetic 200  a real (tiny) target on the CPU
///       (the default config is sized for GPUs: on a CPU one of its steps takes minutes)
///   launcher --resume runs/exp1                            continue a stopped or killed run
///   launcher report runs/exp1                              a picture of a run (report --help)
///   launcher prepare train.parquet                         prepare data only (prepare --help)
///
/// --data is prepared once into a memory-mapped Arrow file in the cache (--data-cache,
/// default data-cache beside the run directory), which every worker maps; the same input is
/// found there by its content and never converted again.
///
/// The run directory gets logs/, ledger/, checkpoints/, config.toml, dataset.json (file data),
/// gpus.json (the GPU lists, for --resume), launcher.log (all that is printed), metrics.jsonl
/// and summary.json. Watch a run from another terminal with
/// `shm-ring-stat --run-dir RUN_DIR --watch 1`.
#[derive(Parser, Debug)]
#[command(
    name = "launcher",
    version,
    verbatim_doc_comment,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    disable_help_subcommand = true
)]
pub struct Cli {
    /// Present unless a subcommand is given (clap then requires --targets and --drafters).
    #[command(flatten)]
    pub run: Option<Args>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

// The user's subcommands say what they are in `about` attributes, not doc comments: clap
// shows a variant's doc comment as the subcommand's own help too, in place of its Args' long
// doc (the examples), so `launcher report --help` would open by sending the reader to itself.
// An `about` alone is the line in `launcher --help` (and `-h`'s summary); `--help` keeps the
// subcommand's own text.
#[derive(Subcommand, Debug)]
pub enum Command {
    #[command(about = "A picture of a run (see `launcher report --help`).")]
    Report(crate::report::ReportArgs),
    #[command(about = "Prepare training data only (see `launcher prepare --help`).")]
    Prepare(crate::data::PrepareArgs),
    #[command(
        about = "Write a random-initialised model in the HF layout (see `launcher make-model --help`)."
    )]
    MakeModel(crate::model::MakeModelArgs),
    #[command(
        about = "Write a model's captured layers and greedy tokens for some data, as safetensors (see `launcher capture --help`)."
    )]
    Capture(crate::model::CaptureArgs),
    #[command(
        about = "Speculative decoding with a trained DFlash drafter: its acceptance length, and a check that the output is the target's greedy output (see `launcher eval --help`)."
    )]
    Eval(crate::eval::EvalArgs),
    /// A target worker: how the launcher starts one (`spawn`), never typed by a user.
    #[command(hide = true)]
    TargetWorker(target_worker::Args),
    /// A drafter worker: how the launcher starts one (`spawn`), never typed by a user.
    #[command(hide = true)]
    DrafterWorker(drafter_worker::Args),
}

/// The options of a run (no subcommand).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// GPUs for target workers: 0-4, 0,2,4 or 0-2,6. Required, except with --resume, where
    /// the run's own are the default.
    #[arg(long, value_parser = gpu_list_arg, required_unless_present = "resume")]
    pub targets: Option<GpuList>,
    /// GPUs for drafter workers, same syntax. Required, except with --resume, where the run's
    /// own are the default.
    #[arg(long, value_parser = gpu_list_arg, required_unless_present = "resume")]
    pub drafters: Option<GpuList>,
    /// Allow a GPU in both lists (for machines with a single GPU).
    #[arg(long)]
    pub share_gpus: bool,
    /// Compute backend. auto: with a model (--model or [model] path), cuda when an NVIDIA
    /// driver is found and this launcher is the CUDA build, else candle; without one, mock. It
    /// says what it found. candle: the real target on the CPU and a DFlash drafter trained on
    /// it. cuda: the same on each worker's GPU, the target in bf16 (scripts/build-cuda.sh).
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// The target model: an HF model directory (config.json with model_type qwen3, qwen2,
    /// llama or mistral, safetensors weights, tokenizer.json). `launcher make-model DIR` makes a
    /// tiny one.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Pipeline config (TOML); every field has a default (README lists them). E.g. `[data]
    /// epochs = 3` trains every sample three times, once per epoch, each epoch in its own order
    /// (default 1; summary.json counts each epoch).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the stopped or killed run in RUN_DIR from its group checkpoint, with its own
    /// config and data: batches whose update is in the checkpoint are not trained again. Alone,
    /// it resumes on the GPUs the run last ran on; --targets or --drafters given with it replace
    /// that list (other GPUs, more or fewer targets, more drafters; never fewer drafters than
    /// the run had).
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["config", "data", "synthetic", "run_dir", "model"])]
    pub resume: Option<PathBuf>,
    /// Training data: JSONL with input_ids (and optional loss_mask) per line, Parquet or Arrow
    /// with input_ids (and optional loss_mask) list columns, an HF datasets save_to_disk
    /// directory, or a file `launcher prepare` made. Any of them may hold conversations
    /// (messages or conversations) or text instead, tokenized by the target's tokenizer.json
    /// and chat template (--model, or data.tokenizer).
    #[arg(long, conflicts_with = "synthetic")]
    pub data: Option<PathBuf>,
    /// Where prepared data is cached (default: data-cache beside the run directory).
    #[arg(long, value_name = "DIR")]
    pub data_cache: Option<PathBuf>,
    /// Use N samples of the built-in synthetic dataset (the default when --data is absent, with
    /// data.synthetic_samples, 2000 unless the config says otherwise); 1 to 67108864.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=proto::config::MAX_SYNTHETIC_SAMPLES))]
    pub synthetic: Option<u64>,
    /// Run directory (default: runs/<run id>). Must not hold an earlier run.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Restarts in a row allowed per worker before it is given up: restarts with no batch
    /// published (a target) or trained (a drafter) between them, a crash loop. A worker that
    /// finished a batch since its last restart starts counting again.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: u32,
    /// Deaths with one batch in hand (a target in its forward, a drafter in its gradient) after
    /// which that batch is set aside: never computed or delivered again, written to
    /// set-aside.jsonl, its samples left untrained (the run ends degraded; --resume tries them
    /// again). A death counts when the worker failed by itself (an error exit, a panic, a
    /// crash) or hung, not for a signal from outside (SIGKILL from the OOM killer or a person, a
    /// stop signal); deaths of workers that finish nothing between them are a crash loop
    /// (--max-restarts), not the batch's. 0: never.
    #[arg(long, default_value_t = 3, value_name = "DEATHS")]
    pub set_aside_after: u32,
    /// Updates skipped in a row after which the run stops: an update is skipped when the
    /// group's gradient is NaN or infinite (the weights left as they were), and a group that
    /// skips every one has diverged, training nothing more. The run then stops in order (the
    /// drafters checkpoint the weights of the last update applied) and ends degraded; the row's
    /// batches count as untrained (lost-steps.jsonl), so --resume trains them again. 0: never.
    #[arg(long, default_value_t = 100, value_name = "UPDATES")]
    pub stop_after_skipped: u32,
    /// Seconds without a heartbeat after which a running worker counts as hung: it is killed
    /// and restarted like a crashed one. Workers beat at every ring operation and every 100 ms
    /// while blocked on the ring, so only a step or checkpoint longer than this trips it.
    #[arg(
        long,
        default_value_t = 600.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub hang_timeout: f64,
    /// Seconds a worker may take from its start to registering in the ring (it loads its model
    /// and starts its GPU first) before it counts as hung: killed and restarted like a crashed
    /// one. Raise it for a model that loads longer.
    #[arg(
        long,
        default_value_t = 600.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub start_timeout: f64,
    /// The most a worker's log (logs/<worker>.log) holds: once a second, a log past it is moved
    /// to <worker>.log.1 (replacing the one before) and started again with a line saying so, so
    /// a worker that prints in a loop cannot fill the disk. Bytes, or with a unit: 64MiB, 512K,
    /// 1G; at least 64KiB. 0: no cap.
    #[arg(long, value_name = "SIZE", default_value = crate::log_cap::DEFAULT, value_parser = crate::log_cap::parse)]
    pub log_cap: u64,
    /// Seconds between monitor updates.
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    pub monitor: f64,
}

/// `--backend`: `auto`, or one backend by its name. The backends are `gpu::BackendKind`'s (the
/// one list of them), so a new one is a value here without a change in this file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// What this machine can run (today always the mock, saying what it found).
    Auto,
    /// This backend, or an error before the run if it cannot run here.
    Kind(BackendKind),
}

impl ValueEnum for Backend {
    fn value_variants<'a>() -> &'a [Self] {
        static ALL: OnceLock<Vec<Backend>> = OnceLock::new();
        ALL.get_or_init(|| {
            let kinds = BackendKind::value_variants()
                .iter()
                .map(|&k| Backend::Kind(k));
            std::iter::once(Backend::Auto).chain(kinds).collect()
        })
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        match self {
            Backend::Auto => Some(PossibleValue::new("auto")),
            Backend::Kind(k) => k.to_possible_value(),
        }
    }
}

/// A usage error: printed like clap's, exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

/// A stop signal ended the work before a run started (the data was being prepared): exit code
/// 130, as a run stopped in order. The message says what was stopped and what is left.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Interrupted {}

impl Args {
    /// The checks clap cannot make, but for the GPU lists (a resume may take them from the run
    /// directory: `check_gpus`); each failure is a usage error (exit code 2).
    pub fn check(&self) -> Result<(), UsageError> {
        for (flag, secs) in [
            ("--hang-timeout", self.hang_timeout),
            ("--start-timeout", self.start_timeout),
        ] {
            // Past 1e9 s (31 years) the nanoseconds the supervisor counts would overflow.
            if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
                return Err(UsageError(format!(
                    "{flag} must be a positive number of seconds (under 1e9), got {secs}"
                )));
            }
        }
        self.monitor_period()?;
        self.check_paths_are_text()
    }

    /// Refuses a path that is not UTF-8, naming its flag: the run writes its paths as text
    /// (config.toml, the workers' welcome, the reclaim record), and such a path panicked in the
    /// config's writing (`--data`, `--data-cache`) or crash-looped every worker on a welcome it
    /// could not send (`--run-dir`). A relative path is looked at from the current directory.
    fn check_paths_are_text(&self) -> Result<(), UsageError> {
        let cwd = std::env::current_dir().ok();
        for (flag, path) in [
            ("--model", &self.model),
            ("--resume", &self.resume),
            ("--data", &self.data),
            ("--data-cache", &self.data_cache),
            ("--run-dir", &self.run_dir),
            // The default run directory, runs/<id>, is under the current one.
            ("the current directory", &cwd),
        ] {
            let Some(p) = path else { continue };
            let whole = match &cwd {
                Some(cwd) if p.is_relative() => cwd.join(p),
                _ => p.clone(),
            };
            if whole.to_str().is_none() {
                return Err(UsageError(format!(
                    "{flag} {}: the path is not UTF-8, and a run writes its paths as text (config.toml, the workers' messages): rename it, or reach it through a link whose path is UTF-8",
                    p.display()
                )));
            }
        }
        Ok(())
    }

    /// `--monitor` as a period: a positive number of seconds that a `Duration` holds (1e20
    /// does not), else a usage error naming the flag.
    pub fn monitor_period(&self) -> Result<Duration, UsageError> {
        match Duration::try_from_secs_f64(self.monitor) {
            Ok(d) if self.monitor > 0.0 => Ok(d),
            _ => Err(UsageError(format!(
                "--monitor must be a positive number of seconds, at most {:.1e}, got {}",
                u64::MAX as f64,
                self.monitor
            ))),
        }
    }
}

/// Refuses a GPU in both lists unless `--share-gpus` allows it (a usage error, exit code 2).
pub fn check_gpus(targets: &[u32], drafters: &[u32], share_gpus: bool) -> Result<(), UsageError> {
    let workers = targets.len() + drafters.len();
    if workers > shm_ring::MAX_WORKERS as usize {
        return Err(UsageError(format!(
            "{} targets and {} drafters: a run has at most {} workers in all",
            targets.len(),
            drafters.len(),
            shm_ring::MAX_WORKERS
        )));
    }
    // The drafter group's segment has a place for each rank: more drafters failed later, at
    // "creating the drafter group", after the run directory was laid out.
    if drafters.len() > collective::MAX_RANKS {
        return Err(UsageError(format!(
            "--drafters lists {} GPUs: a drafter group has at most {} drafters; list fewer",
            drafters.len(),
            collective::MAX_RANKS
        )));
    }
    let shared = overlap(targets, drafters);
    if !shared.is_empty() && !share_gpus {
        return Err(UsageError(format!(
            "GPU(s) {shared:?} are in both --targets and --drafters; pass --share-gpus to allow that on a machine with few GPUs"
        )));
    }
    Ok(())
}

// GPU lists on the command line: `0-4`, `0,2,4`, `0-2,6`.

/// Most GPU index accepted.
const MAX_GPU: u32 = 1023;

/// GPU `n`, unless it is past [`MAX_GPU`].
fn in_range(n: u32) -> Result<u32, String> {
    match n {
        0..=MAX_GPU => Ok(n),
        _ => Err(format!("GPU {n} is out of range (at most {MAX_GPU})")),
    }
}

/// Checks a GPU list that was not parsed from the command line (a run's `gpus.json`, which can
/// be edited) as [`parse_gpu_list`] checks one that is: every GPU in range, none twice.
pub fn check_gpu_list(gpus: &[u32]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for &g in gpus {
        in_range(g)?;
        if !seen.insert(g) {
            return Err(format!("GPU {g} is listed twice"));
        }
    }
    Ok(())
}

/// A parsed GPU list, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuList(pub Vec<u32>);

/// clap's value parser for `--targets` and `--drafters`.
pub fn gpu_list_arg(s: &str) -> Result<GpuList, String> {
    parse_gpu_list(s).map(GpuList)
}

/// Parses a GPU list; the error says what is wrong with it.
pub fn parse_gpu_list(s: &str) -> Result<Vec<u32>, String> {
    if s.trim().is_empty() {
        return Err("the GPU list is empty (write e.g. 0-4, 0,2,4 or 0-2,6)".into());
    }
    let mut out: Vec<u32> = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("{s:?} has an empty entry between commas"));
        }
        let num = |t: &str| -> Result<u32, String> {
            let n: u32 = t
                .trim()
                .parse()
                .map_err(|_| format!("{t:?} in {s:?} is not a GPU number"))?;
            in_range(n)
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(part)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("range {part:?} is reversed (write {hi}-{lo})"));
        }
        for g in lo..=hi {
            if out.contains(&g) {
                return Err(format!("GPU {g} is listed twice in {s:?}"));
            }
            out.push(g);
        }
    }
    Ok(out)
}

/// A GPU list as the command line takes it, runs of consecutive GPUs as ranges: `0-2,6`.
pub fn format_gpu_list(gpus: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < gpus.len() {
        // The longest run of consecutive GPUs from i.
        let mut j = i;
        while j + 1 < gpus.len() && gpus[j].checked_add(1) == Some(gpus[j + 1]) {
            j += 1;
        }
        parts.push(if j == i {
            gpus[i].to_string()
        } else {
            format!("{}-{}", gpus[i], gpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// GPUs in both lists, if any.
pub fn overlap(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().copied().filter(|g| b.contains(g)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ranges_lists_and_mixes() {
        assert_eq!(parse_gpu_list("0-4").unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(parse_gpu_list("0,2,4").unwrap(), vec![0, 2, 4]);
        assert_eq!(parse_gpu_list("0-2,6").unwrap(), vec![0, 1, 2, 6]);
        assert_eq!(parse_gpu_list("7").unwrap(), vec![7]);
    }

    /// What `format_gpu_list` writes parses back to the same list, in the same order.
    #[test]
    fn a_formatted_list_parses_back_to_itself() {
        let cases: [(&[u32], &str); 5] = [
            (&[0, 1, 2, 3, 4], "0-4"),
            (&[0, 2, 4], "0,2,4"),
            (&[0, 1, 2, 6], "0-2,6"),
            (&[7], "7"),
            (&[5, 3, 4], "5,3-4"),
        ];
        for (gpus, text) in cases {
            assert_eq!(format_gpu_list(gpus), text);
            assert_eq!(parse_gpu_list(text).unwrap(), gpus);
        }
    }

    #[test]
    fn refuses_bad_lists_saying_why() {
        let cases = [
            ("", "empty"),
            ("  ", "empty"),
            ("4-0", "reversed"),
            ("a", "not a GPU number"),
            ("1-", "not a GPU number"),
            ("-3", "not a GPU number"),
            ("0,,1", "empty entry"),
            ("0,0", "listed twice"),
            ("0-2,1", "listed twice"),
            ("5000", "out of range"),
        ];
        for (s, want) in cases {
            let err = parse_gpu_list(s).unwrap_err();
            assert!(err.contains(want), "{s:?}: {err:?} should say {want:?}");
        }
    }

    #[test]
    fn the_command_line_is_a_run_or_one_subcommand() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let parse = |args: &[&str]| Cli::try_parse_from([&["launcher"], args].concat());
        let run = parse(&["--targets", "0-1", "--drafters", "2"]).unwrap();
        assert!(run.command.is_none());
        assert_eq!(run.run.unwrap().drafters, Some(GpuList(vec![2])));
        // A resume may take either list, or both, from the run directory.
        let resume = parse(&["--resume", "runs/1"]).unwrap().run.unwrap();
        assert_eq!((resume.targets, resume.drafters), (None, None));
        let resume = parse(&["--resume", "runs/1", "--drafters", "3"]).unwrap();
        assert_eq!(resume.run.unwrap().drafters, Some(GpuList(vec![3])));
        let worker = parse(&["target-worker", "--index", "3", "--control", "c"]).unwrap();
        assert!(
            matches!(&worker.command, Some(Command::TargetWorker(a)) if a.common.index == 3),
            "{worker:?}"
        );
        assert!(worker.run.is_none());
        assert!(matches!(
            parse(&["drafter-worker", "--index", "0", "--control", "c"])
                .unwrap()
                .command,
            Some(Command::DrafterWorker(_))
        ));
        assert!(matches!(
            parse(&["report", "runs/1"]).unwrap().command,
            Some(Command::Report(_))
        ));
        // Neither a run nor a subcommand, or both: usage errors.
        for bad in [
            &[][..],
            &["--targets", "0", "report", "runs/1"],
            &["--targets", "0"],
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
        // The worker subcommands are the launcher's own business: not in --help.
        let help = Cli::command().render_long_help().to_string();
        assert!(
            help.contains("report") && !help.contains("target-worker"),
            "{help}"
        );
    }

    /// A subcommand's `--help` is its own text, examples included; it opened with the one-line
    /// summary of `launcher --help`, which sends the reader to `launcher report --help`, the
    /// very page shown, and the examples were not there.
    #[test]
    fn a_subcommands_help_is_its_own_text_not_a_pointer_to_itself() {
        for name in ["report", "prepare", "make-model", "capture", "eval"] {
            let e = Cli::try_parse_from(["launcher", name, "--help"]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{name}: {e}");
            let help = e.to_string();
            assert!(
                !help.contains(&format!("see `launcher {name} --help`")),
                "{name}: {help}"
            );
            assert!(
                help.contains(&format!("Examples:\n  launcher {name} ")),
                "{name}: {help}"
            );
        }
        // The list of subcommands still points at each one's page.
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("see `launcher report --help`"), "{help}");
    }

    /// A number a flag refuses is refused naming that flag, as a usage error: a negative
    /// period by the launcher's own check (not clap's "unexpected argument '-1'"), a sample
    /// count out of range by the flag's range (not the config field it sets).
    /// A path that is not UTF-8 is a usage error naming its flag: `--data` panicked writing
    /// config.toml, `--run-dir` crash-looped every worker on a welcome it could not send.
    #[test]
    fn a_path_that_is_not_utf8_is_refused_by_its_flag() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let odd = OsString::from_vec(b"bad\xffname".to_vec());
        for flag in ["--data", "--data-cache", "--run-dir", "--model"] {
            let args: Vec<OsString> = ["launcher", "--targets", "0", "--drafters", "1", flag]
                .into_iter()
                .map(OsString::from)
                .chain([odd.clone()])
                .collect();
            let run = Cli::try_parse_from(args).unwrap().run.unwrap();
            let err = run.check().unwrap_err().0;
            assert!(
                err.starts_with(&format!("{flag} bad\u{FFFD}name: the path is not UTF-8")),
                "{err}"
            );
        }
    }

    #[test]
    fn out_of_range_numbers_name_their_flag() {
        let parse = |extra: &[&str]| {
            let args = [&["launcher", "--targets", "0", "--drafters", "1"], extra].concat();
            Cli::try_parse_from(args).map(|c| c.run.unwrap())
        };
        // A size that is not one, or too small to hold a dead worker's last words.
        for bad in ["12Q", "1000"] {
            let e = parse(&["--log-cap", bad]).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            let said = e.to_string();
            assert!(said.contains("--log-cap") && said.contains(bad), "{said}");
        }
        assert_eq!(parse(&[]).unwrap().log_cap, 64 << 20, "the default");
        assert_eq!(parse(&["--log-cap", "0"]).unwrap().log_cap, 0);
        for flag in ["--hang-timeout", "--start-timeout", "--monitor"] {
            let args = parse(&[flag, "-1"]).unwrap();
            let e = args.check().unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains("-1"), "{e}");
        }
        for n in ["0", "100000000000"] {
            let e = parse(&["--synthetic", n]).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            let said = e.to_string();
            assert!(said.contains("--synthetic") && said.contains(n), "{said}");
        }
        assert_eq!(
            parse(&["--synthetic", "67108864"]).unwrap().synthetic,
            Some(1 << 26)
        );
        // capture's too (before, 0 reached the config's check, named data.synthetic_samples).
        for n in ["0", "100000000000"] {
            let args = [
                "launcher",
                "capture",
                "--model",
                "m",
                "-o",
                "o",
                "--synthetic",
                n,
            ];
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains("--synthetic"), "{e}");
        }
    }

    #[test]
    fn overlap_names_shared_gpus() {
        assert_eq!(overlap(&[0, 1, 2], &[2, 3]), vec![2]);
        assert!(overlap(&[0, 1], &[2, 3]).is_empty());
    }

    /// Shared GPUs allow more workers than GPUs; more than the ring holds is the flags' fault
    /// (exit 2), said before the config is sized (it was "sizing the ring", exit 1).
    #[test]
    fn more_workers_than_a_run_holds_is_a_usage_error() {
        let all: Vec<u32> = (0..=MAX_GPU).collect();
        let e = check_gpus(&all, &all, true).unwrap_err().to_string();
        assert!(
            e.contains("1024 targets and 1024 drafters") && e.contains("at most 1024 workers"),
            "{e}"
        );
        assert!(check_gpus(&all[..1000], &all[..16], true).is_ok());
    }

    /// More drafters than a group has ranks is the flag's fault (exit 2), said before anything
    /// is created; it was "creating the drafter group: group segment ...: 17 ranks" (exit 1),
    /// after the run directory was laid out.
    #[test]
    fn more_drafters_than_a_group_holds_is_a_usage_error() {
        let e = check_gpus(&[0], &(1..=17).collect::<Vec<_>>(), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--drafters lists 17 GPUs") && e.contains("at most 16 drafters"),
            "{e}"
        );
        assert!(check_gpus(&[0], &(1..=16).collect::<Vec<_>>(), false).is_ok());
    }
}
