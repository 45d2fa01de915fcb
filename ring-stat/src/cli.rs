//! `shm-ring-stat`: what a ring holds, where each worker's time goes, and which side is the
//! bottleneck. Attaches read-only and never disturbs the run.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{CommandFactory, Parser};
use proto::{RunDir, RUN_DIR_RING_FILE};
use shm_ring::{Phase, Ring, RingError, Snapshot, TakePolicy};

use crate::analysis::Judge;
use crate::report::{measure, measure_from, Presence, Report};
use crate::screen;

/// Show what an hspipe ring holds, where each worker's time goes, and which side is the
/// bottleneck. Attaches read-only and never disturbs the run.
///
/// Examples:
///   shm-ring-stat --list                  every hspipe ring in /dev/shm, live or stale
///   shm-ring-stat hspipe-1796030998-7785  one ring, measured over one second
///   shm-ring-stat --run-dir runs/exp1     the ring of a launcher run
///   shm-ring-stat RING --watch 2          refresh every 2 s
///   shm-ring-stat RING --json             the same as one JSON document
///   shm-ring-stat --gc                    remove rings whose creator has died
///   shm-ring-stat --gc RING               remove RING if its creator has died
#[derive(Parser, Debug)]
#[command(name = "shm-ring-stat", version, verbatim_doc_comment)]
pub struct Args {
    /// Ring name (the file name under /dev/shm).
    pub ring: Option<String>,
    /// A launcher's run directory: its ring is named in <run-dir>/ring.
    #[arg(long, conflicts_with = "ring")]
    pub run_dir: Option<PathBuf>,
    /// Print one JSON document instead of a table (with --watch, one document per line).
    #[arg(long)]
    pub json: bool,
    /// Refresh every SECS seconds until interrupted: on a terminal a live screen that fits it
    /// (trends, verdict, one row per worker; q quits), elsewhere one table after another,
    /// ending once the ring is removed (its run ended).
    #[arg(long, value_name = "SECS")]
    pub watch: Option<f64>,
    /// Seconds over which rates and the verdict are measured.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    pub interval: f64,
    /// List every hspipe ring with its creator pid and whether it is live or stale (only RING
    /// if named).
    #[arg(long, conflicts_with_all = ["gc", "watch", "interval", "run_dir"])]
    pub list: bool,
    /// Remove stale rings (creator dead) with their drafter groups (RING-group), or only RING if
    /// named; never removes a live one, nor one whose creator cannot be judged from here
    /// (another pid namespace).
    #[arg(long, conflicts_with_all = ["json", "watch", "interval", "run_dir"])]
    pub gc: bool,
}

impl Default for Args {
    /// The flags' defaults, for callers that build `Args` in code.
    fn default() -> Self {
        Args {
            ring: None,
            run_dir: None,
            json: false,
            watch: None,
            interval: 1.0,
            list: false,
            gc: false,
        }
    }
}

/// Runs the CLI; returns the process exit code: 0, or 1 on an error. A usage error exits 2
/// here, clap's way, as everywhere in hspipe.
pub fn main() -> i32 {
    let args = Args::parse();
    // Nothing named to look at is the command line's fault, not a ring's: a usage error, with
    // the usage line, as clap's own are.
    if args.ring.is_none() && args.run_dir.is_none() && !args.list && !args.gc {
        Args::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                NOTHING_NAMED,
            )
            .exit();
    }
    match run_on_stdout(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

/// Where the human output goes on a terminal: the live screen for `--watch`, the same layout
/// printed once otherwise, both fitted to the terminal's width. Piped output, `--json`,
/// `--list` and `--gc` print what `run` prints.
fn run_on_stdout(args: &Args) -> anyhow::Result<()> {
    let tty = std::io::stdout().is_terminal();
    if !tty || args.json || args.list || args.gc {
        return run(args, &mut std::io::stdout().lock());
    }
    let (ring, periods) = open(args)?;
    match periods.watch {
        Some(every) => screen::watch(&ring, every),
        None => {
            let (width, _) = ratatui::crossterm::terminal::size().unwrap_or((100, 24));
            let presence = Presence::of(&ring);
            let mut report = measure(&ring, periods.interval);
            if presence.removed() {
                report.mark_removed();
            }
            screen::print_once(&report, width, &mut std::io::stdout().lock())?;
            Ok(())
        }
    }
}

/// The periods `--interval` and `--watch` ask for.
struct Periods {
    interval: Duration,
    watch: Option<Duration>,
}

/// The shortest period measured: shorter ones are taken as this.
const MIN_PERIOD: Duration = Duration::from_millis(50);

/// A flag's seconds as a period: a positive number that a `Duration` holds (1e20 does not),
/// else an error naming the flag.
fn period(flag: &str, secs: f64) -> anyhow::Result<Duration> {
    // Huge values as 1e300, not in 301 digits.
    let got = if secs.abs() >= 1e9 {
        format!("{secs:e}")
    } else {
        secs.to_string()
    };
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if secs > 0.0 => Ok(d),
        _ => bail!(
            "{flag} must be a positive number of seconds, at most {:.1e}, got {got}",
            u64::MAX as f64
        ),
    }
}

/// What is said when the command line names no ring and asks for no list.
const NOTHING_NAMED: &str = "name a ring (see --list) or a --run-dir, or pass --list or --gc";

/// Checks the flags and attaches to the ring they name.
fn open(args: &Args) -> anyhow::Result<(Ring, Periods)> {
    let run = args.run_dir.as_deref().map(RunDir::new);
    let name = match (&args.ring, &run) {
        (Some(r), _) => r.clone(),
        (None, Some(run)) => ring_name(run)?,
        (None, None) => bail!(NOTHING_NAMED),
    };
    let periods = Periods {
        interval: period("--interval", args.interval)?,
        watch: (args.watch.map(|w| period("--watch", w)))
            .transpose()?
            .map(|w| w.max(MIN_PERIOD)),
    };
    let ring = match (Ring::open_read_only(&name), &run) {
        (Err(RingError::NotFound { .. }), Some(run)) => {
            let d = run.path().display();
            // Copied into a shell, a path with a space must stay one word.
            let w = proto::run_dir::shell_word(run.path());
            let summary = run.summary();
            if summary.exists() {
                bail!(
                    "the run in {d} has ended: its ring {name} is gone; {} and `launcher report {w}` tell how it went",
                    summary.display()
                )
            }
            bail!(
                "the run in {d} is not running: its ring {name} is not in /dev/shm, and it has no summary.json (its launcher was killed, or is only starting); `launcher --resume {w}` continues a stopped run"
            )
        }
        (got, _) => got.with_context(|| format!("attaching to {name}"))?,
    };
    Ok((ring, periods))
}

/// The name of `run`'s ring, from the file its launcher writes; an error says what the
/// directory is when it has none.
fn ring_name(run: &RunDir) -> anyhow::Result<String> {
    let (d, p) = (run.path(), run.ring_file());
    if !d.is_dir() {
        bail!(
            "run directory {} does not exist (or is not a directory)",
            d.display()
        );
    }
    if !p.exists() {
        bail!(
            "{} is not a launcher run directory: it has no {} file naming the run's ring (a launcher writes it once its ring exists)",
            d.display(),
            RUN_DIR_RING_FILE
        );
    }
    let name = std::fs::read_to_string(&p)
        .with_context(|| format!("reading the ring name from {}", p.display()))?
        .trim()
        .to_string();
    if name.is_empty() {
        bail!("{} is empty: it names no ring", p.display());
    }
    Ok(name)
}

/// The plain output: a table (or JSON) per interval, one after another with `--watch` (JSON
/// then one document per line), until the ring is removed. What pipes and files get; on a
/// terminal, `main` shows the screen instead. A reader that stops reading (`| head`) ends it
/// without an error.
pub fn run(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    match print(args, out) {
        Err(e) if is_broken_pipe(&e) => Ok(()),
        done => done,
    }
}

/// The output's reader has gone: a pipe whose other end closed.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    (e.downcast_ref::<std::io::Error>()).is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
}

fn print(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    if args.list || args.gc {
        return crate::gc::list_or_gc(args, out);
    }
    let (ring, periods) = open(args)?;
    let presence = Presence::of(&ring);
    let mut judge = Judge::new();
    let mut start = ring.snapshot();
    loop {
        let dur = periods.watch.unwrap_or(periods.interval).max(MIN_PERIOD);
        let mut report = measure_from(&ring, start, dur, &mut judge);
        start = report.snapshot.clone();
        let removed = presence.removed();
        if removed {
            report.mark_removed();
        }
        if args.json && args.watch.is_some() {
            writeln!(out, "{}", serde_json::to_string(&report)?)?;
        } else if args.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        } else {
            human(&report, out)?;
        }
        out.flush()?;
        if args.watch.is_none() || removed {
            return Ok(());
        }
    }
}

fn bar(s: &Snapshot, width: usize) -> String {
    let total = s.params.slots.max(1) as f64;
    let part = |n: u32| ((f64::from(n) / total) * width as f64).round() as usize;
    let (r, rd, w) = (
        part(s.slots.reading),
        part(s.slots.ready),
        part(s.slots.writing),
    );
    let used = (r + rd + w).min(width);
    format!(
        "[{}{}{}{}]",
        "r".repeat(r),
        "R".repeat(rd),
        "W".repeat(w),
        ".".repeat(width - used)
    )
}

fn human(rep: &Report, out: &mut impl Write) -> std::io::Result<()> {
    let (s, iv, v) = (&rep.snapshot, &rep.interval, &rep.verdict);
    let p = &s.params;
    let policy = match p.policy {
        TakePolicy::Fifo => "fifo".to_string(),
        TakePolicy::Bucketed { min_ready, pick } => {
            format!("bucketed (min_ready {min_ready}, {pick:?})").to_lowercase()
        }
    };
    writeln!(
        out,
        "ring {}  {} slots x {} KiB  {} buckets  policy {policy}  creator pid {} ({})",
        s.name,
        p.slots,
        p.slot_size / 1024,
        p.buckets,
        s.creator.pid,
        if s.creator_alive { "live" } else { "stale" }
    )?;
    writeln!(
        out,
        "state {}  producers done {}/{}  work {}/{} done",
        if s.closed { "closed" } else { "open" },
        s.producers_done,
        s.producers_expected,
        s.work.done,
        s.work.total
    )?;
    writeln!(
        out,
        "slots {}  free {}  writing {}  ready {}  reading {}",
        bar(s, 40),
        s.slots.free,
        s.slots.writing,
        s.slots.ready,
        s.slots.reading
    )?;
    let buckets: Vec<String> = s
        .ready_per_bucket
        .iter()
        .enumerate()
        .map(|(i, n)| format!("b{i}:{n}"))
        .collect();
    writeln!(out, "ready per bucket  {}", buckets.join("  "))?;
    let c = &s.counters;
    writeln!(
        out,
        "over {:.1}s: published {:.1}/s  trained {:.1}/s  {:.0} tok/s  ring full {:.0}% empty {:.0}%   totals: published {} taken {} released {} redelivered {} set aside {} refused {}",
        iv.seconds,
        iv.published_per_s,
        iv.released_per_s,
        iv.tokens_per_s,
        iv.full_frac * 100.0,
        iv.empty_frac * 100.0,
        c.published,
        c.taken,
        c.released,
        c.redelivered,
        c.set_aside,
        c.refused
    )?;
    writeln!(out, "verdict: {}", v.line)?;
    for st in &v.stragglers {
        writeln!(out, "straggler: {st}")?;
    }
    for w in &v.warnings {
        writeln!(out, "warning: {w}")?;
    }
    writeln!(out)?;

    write!(
        out,
        "{:<8} {:>3} {:>4} {:>8} {:>5} {:>8} {:>7} {:>9} {:>5} {:>5} {:>5} |",
        "role", "idx", "gpu", "pid", "alive", "restarts", "items", "tok/s", "busy", "wait", "gap"
    )?;
    for ph in Phase::ALL {
        write!(out, " {:>10}", ph.name())?;
    }
    writeln!(out)?;
    for w in &iv.workers {
        write!(
            out,
            "{:<8} {:>3} {:>4} {:>8} {:>5} {:>8} {:>7} {:>9.0} {:>4.0}% {:>4.0}% {:>5} |",
            w.role,
            w.index,
            w.gpu.map(|g| g.to_string()).unwrap_or("-".into()),
            w.pid,
            if w.alive { "yes" } else { "no" },
            w.restarts,
            w.items,
            w.tokens_per_s,
            w.busy * 100.0,
            w.waiting * 100.0,
            crate::screen::short_duration(w.largest_gap_s)
        )?;
        for ph in Phase::ALL {
            write!(out, " {:>9.0}%", w.phases[ph] * 100.0)?;
        }
        writeln!(out)?;
        if let Some(d) = &w.device {
            writeln!(out, "{}", device_line(d))?;
        }
    }
    Ok(())
}

/// A device-timed worker's device, under its row: "  device: busy 62%; time compute 62%,
/// copy_in 12%; idle 38% while sync 24%, copy_in 7%, other 7%".
fn device_line(d: &crate::analysis::DeviceRates) -> String {
    let list = |m: &shm_ring::PhaseMap<f64>| {
        let v: Vec<String> = (Phase::ALL.iter())
            .filter(|&&p| m[p] >= 0.005)
            .map(|&p| format!("{} {}", p.name(), crate::numbers::pct(m[p])))
            .collect();
        if v.is_empty() {
            "-".to_string()
        } else {
            v.join(", ")
        }
    };
    let idle: f64 = d.idle.values().sum();
    format!(
        "  device: busy {}; time {}; idle {} while {}",
        crate::numbers::pct(d.busy),
        list(&d.phases),
        crate::numbers::pct(idle),
        list(&d.idle)
    )
}

#[cfg(test)]
mod tests {
    use shm_ring::PhaseMap;

    use super::*;
    use crate::analysis::DeviceRates;

    #[test]
    fn a_device_line_says_what_the_device_did_and_why_it_sat_idle() {
        let mut d = DeviceRates {
            busy: 0.62,
            phases: PhaseMap::default(),
            idle: PhaseMap::default(),
        };
        d.phases[Phase::Compute] = 0.62;
        d.phases[Phase::CopyIn] = 0.12;
        d.idle[Phase::Sync] = 0.24;
        d.idle[Phase::CopyIn] = 0.07;
        d.idle[Phase::Other] = 0.07;
        assert_eq!(
            device_line(&d),
            "  device: busy 62%; time copy_in 12%, compute 62%; idle 38% while copy_in 7%, sync 24%, other 7%"
        );
        // Nothing idle.
        let d = DeviceRates {
            busy: 1.0,
            phases: PhaseMap::default(),
            idle: PhaseMap::default(),
        };
        assert_eq!(
            device_line(&d),
            "  device: busy 100%; time -; idle 0% while -"
        );
    }
}
