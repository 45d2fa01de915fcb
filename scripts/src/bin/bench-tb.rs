//! The size of a run's TensorBoard events (`<run-dir>/tb/`): the launcher's `Board` driven
//! directly with `--days` of monitor ticks `--monitor` seconds apart, 5 targets and 3 drafters
//! (the shape of `testkit::metrics`' synthetic week), with no clock to wait for. Twice: with
//! the training series (a group step every tick, with its loss, tau and lr, as a drafter
//! reports them), and with the pipeline's series alone, so the difference is the training
//! series' share. Only sizes are measured; the values are plausible, not a simulation (the
//! events' fields are fixed-size floats, so values do not change the size).
//!
//! `cargo build --release -p scripts --bin bench-tb && target/release/bench-tb --days 1`

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Parser;
use launcher::monitor::Tick;
use launcher::tensorboard::Board;
use proto::RunDir;
use ring_stat::analysis::{Interval, WorkerRates};
use shm_ring::{Phase, PhaseMap, Role, WorkerState};

#[derive(Parser)]
struct Args {
    /// Days of run time simulated.
    #[arg(long, default_value_t = 1.0)]
    days: f64,
    /// Seconds between ticks (the launcher's `--monitor`).
    #[arg(long, default_value_t = 1.0)]
    monitor: f64,
    /// Where the two run directories are written (removed after, unless --keep).
    #[arg(long, default_value = "/tmp/hspipe-bench-tb")]
    dir: PathBuf,
    /// Keep the run directories.
    #[arg(long)]
    keep: bool,
}

/// One worker's rates over a tick: shares by phase that add up to one.
fn worker(role: Role, index: u32, x: f64) -> WorkerRates {
    let mut phases = PhaseMap::default();
    let compute = 0.5 + 0.3 * x;
    phases[Phase::Compute] = compute;
    match role {
        Role::Producer => {
            phases[Phase::WaitFull] = 0.9 * (1.0 - compute);
            phases[Phase::Load] = 0.1 * (1.0 - compute);
        }
        Role::Consumer => {
            phases[Phase::Sync] = 0.8 * (1.0 - compute);
            phases[Phase::Other] = 0.2 * (1.0 - compute);
        }
    }
    WorkerRates {
        role,
        index,
        gpu: Some(index),
        pid: 1000 + index,
        alive: true,
        state: WorkerState::Alive,
        restarts: 0,
        items: 100,
        items_per_s: 2.0,
        tokens_per_s: 6000.0 + 1000.0 * x,
        busy: compute,
        waiting: 1.0 - compute,
        phases,
        device: None,
        largest_gap_s: 0.1 + 0.4 * x,
    }
}

/// Drives a board in `run_dir` over `ticks` ticks `period` apart, then finishes it; `train`: each tick
/// applied a group step. Returns the bytes of its `tb/`.
fn simulate(run_dir: &Path, ticks: u64, period: Duration, train: bool) -> anyhow::Result<u64> {
    let period_s = period.as_secs_f64();
    let run = RunDir::new(run_dir);
    let launch_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (mut board, said) = Board::open(&run, period);
    if let Some(msg) = said {
        bail!("{msg}");
    }
    for i in 1..=ticks {
        // A deterministic wobble in [0, 1).
        let x = (i.wrapping_mul(0x9e37_79b9) % 1000) as f64 / 1000.0;
        let workers = (0..5)
            .map(|w| worker(Role::Producer, w, x))
            .chain((0..3).map(|d| worker(Role::Consumer, d, x)))
            .collect();
        let iv = Interval {
            seconds: period_s,
            published_per_s: 6.0,
            released_per_s: 6.0,
            refused_per_s: 0.0,
            tokens_per_s: 31_000.0 + 4_000.0 * x,
            full_frac: 0.9,
            empty_frac: 0.0,
            short_frac: 0.0,
            workers,
        };
        let frac = i as f64 / ticks as f64;
        let t = Tick {
            t_s: i as f64 * period_s,
            launch_unix_ms: Some(launch_ms),
            tokens_per_s: iv.tokens_per_s,
            targets_busy: 0.5 + 0.1 * x,
            drafters_busy: 0.79 + 0.01 * x,
            targets_waiting: 0.45 + 0.1 * x,
            drafters_waiting: 0.0,
            group_step: train.then_some(2 * i),
            drafter_loss: train.then(|| 2.5 * (-3.0 * frac).exp() + 0.4),
            acceptance_length: train.then_some(1.5 + 2.0 * frac),
            lr: train.then_some(3e-4 * (1.0 - frac)),
            ..Tick::default()
        };
        if let Some(msg) = board.record(&t, &iv) {
            bail!("{msg}");
        }
    }
    if let Some(msg) = board.finish() {
        bail!("{msg}");
    }
    drop(board);
    let mut bytes = 0;
    let tb = run.tensorboard_dir();
    for e in std::fs::read_dir(&tb).with_context(|| format!("{}", tb.display()))? {
        bytes += e?.metadata()?.len();
    }
    Ok(bytes)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let period = Duration::try_from_secs_f64(args.monitor)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--monitor must be a positive number of seconds")?;
    let ticks = (args.days * 86_400.0 / period.as_secs_f64()).round() as u64;
    if ticks == 0 {
        bail!(
            "--days {} at --monitor {} is no tick",
            args.days,
            args.monitor
        );
    }
    if args.dir.exists() {
        bail!(
            "{} exists: remove it or choose another --dir",
            args.dir.display()
        );
    }
    let days = ticks as f64 * period.as_secs_f64() / 86_400.0;
    let with_train = simulate(&args.dir.join("train"), ticks, period, true)?;
    let pipeline = simulate(&args.dir.join("pipeline"), ticks, period, false)?;
    let line = |what: &str, bytes: u64| {
        println!(
            "{what:<40} {:>12} bytes  {:>8.2} MB a day  {:>7.1} bytes a tick",
            bytes,
            bytes as f64 / 1e6 / days,
            bytes as f64 / ticks as f64
        );
    };
    println!("{ticks} ticks, {} s apart ({days} days)", args.monitor);
    line("tb/, pipeline and training series", with_train);
    line("tb/, pipeline series alone", pipeline);
    line(
        "the training series (the difference)",
        with_train.saturating_sub(pipeline),
    );
    if !args.keep {
        std::fs::remove_dir_all(&args.dir)
            .with_context(|| format!("removing {}", args.dir.display()))?;
    }
    Ok(())
}
