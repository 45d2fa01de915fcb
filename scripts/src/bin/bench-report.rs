//! `launcher report` on a week-long run: a synthetic run directory in the shape a launcher
//! writes (`testkit::metrics`: 5 targets and 3 drafters, a tick a second for 7 days, stopped
//! after 3 and resumed; the drafters' ledgers of 1.2M batches), then the report drawn from it
//! `--runs` times: wall time and peak RSS (wait4's), and the medians.
//!
//! `cargo build --release -p launcher -p scripts --bin bench-report &&
//!  target/release/bench-report --runs 5`
//! `--launcher PATH` measures another build on the same files (`--keep` keeps them for it,
//! `--reuse` takes them as they are).

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use scripts::{median, wait_rusage};

#[derive(Parser)]
struct Args {
    /// The run directory written and drawn (removed after, unless --keep).
    #[arg(long, default_value = "/tmp/hspipe-bench-week")]
    dir: PathBuf,
    /// The launcher whose report is measured [default: `launcher` beside this program].
    #[arg(long)]
    launcher: Option<PathBuf>,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Batches in the ledgers, all drafters together.
    #[arg(long, default_value_t = 1_200_000)]
    batches: u64,
    /// Keep the run directory.
    #[arg(long)]
    keep: bool,
    /// Draw the run directory as it is, without writing it first.
    #[arg(long)]
    reuse: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let launcher = match &args.launcher {
        Some(l) => l.clone(),
        None => std::env::current_exe()?.with_file_name("launcher"),
    };
    let run = testkit::metrics::Run::week();
    let metrics = args.dir.join("metrics.jsonl");
    if !args.reuse {
        std::fs::create_dir_all(args.dir.join("ledger"))?;
        let mut w = BufWriter::new(std::fs::File::create(&metrics)?);
        let lines = run.write(&mut w)?;
        w.flush()?;
        let mut ledger_lines = 0;
        for d in 0..run.drafters {
            let path = args.dir.join(format!("ledger/drafter-{d}.jsonl"));
            let mut w = BufWriter::new(std::fs::File::create(&path)?);
            ledger_lines += testkit::metrics::ledger(&mut w, d, run.drafters, args.batches)?;
            w.flush()?;
        }
        eprintln!("wrote {lines} ticks and {ledger_lines} ledger lines");
    }
    let size = std::fs::metadata(&metrics)
        .with_context(|| format!("{}", metrics.display()))?
        .len();
    let ticks: u64 = run.launches.iter().sum();
    let days = ticks as f64 * run.period_s / 86_400.0;
    let ledgers: u64 = (0..run.drafters)
        .filter_map(|d| std::fs::metadata(args.dir.join(format!("ledger/drafter-{d}.jsonl"))).ok())
        .map(|m| m.len())
        .sum();
    println!(
        "metrics.jsonl: {:.1} MB ({:.1} MB a day, {:.0} bytes a tick); ledgers {:.1} MB",
        size as f64 / 1e6,
        size as f64 / 1e6 / days,
        size as f64 / ticks as f64,
        ledgers as f64 / 1e6
    );
    let svg = args.dir.join("report.svg");
    let (mut walls, mut rss) = (Vec::new(), Vec::new());
    for i in 0..args.runs {
        let start = Instant::now();
        let child = Command::new(&launcher)
            .arg("report")
            .arg(&args.dir)
            .arg("-o")
            .arg(&svg)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", launcher.display()))?;
        let pid = child.id();
        let (code, kib) = wait_rusage(pid)?;
        let wall = start.elapsed().as_secs_f64();
        if code != 0 {
            bail!("{} report exited with {code}", launcher.display());
        }
        let svg_size = std::fs::metadata(&svg)?.len();
        println!(
            "run {}: {wall:.2} s, peak RSS {:.1} MiB, picture {:.0} KB",
            i + 1,
            kib as f64 / 1024.0,
            svg_size as f64 / 1e3
        );
        walls.push(wall);
        rss.push(kib as f64 / 1024.0);
    }
    println!(
        "median of {}: {:.2} s, peak RSS {:.1} MiB",
        args.runs,
        median(walls),
        median(rss)
    );
    if !args.keep {
        std::fs::remove_dir_all(&args.dir)?;
    }
    Ok(())
}
