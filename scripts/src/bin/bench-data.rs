//! Data at scale (BENCHMARKS.md, "Data at scale"): a JSONL generator with a stated long-tailed
//! length distribution, and a harness that measures preparing it (`launcher prepare`: wall
//! time, peak RSS) and launching on it (time from the launcher's start to the first trained
//! batch, and every process's peak memory), against another launcher binary (the JSONL path
//! before the prepared data: every process parsed the whole file).
//!
//! ```text
//! bench-data gen --mb 600 --out /tmp/d600.jsonl
//! bench-data run --data /tmp/d600.jsonl --runs 3 --baseline /tmp/hspipe-base/target/release/launcher
//! bench-data run --data /tmp/d60.jsonl --runs 3 --baseline OLD/launcher --baseline-prepares
//! bench-data synthetic --samples 400000 --runs 3 --baseline OLD/launcher
//! ```
//!
//! With `--baseline-prepares` the baseline is an earlier build of the prepared-data path (e.g.
//! before a change to the data crate): both prepare the same input in turn, and both launch on
//! their own prepared data, side by side.
//!
//! `synthetic` launches on the built-in synthetic data alone (no file: the launcher and every
//! target make it), ours and a baseline in turn.
//!
//! Lengths: log-normal, median 512 tokens, sigma 1.0, clamped to 16..=4096 (mean about 790:
//! many short chats, a long tail of long documents); ids uniform below 151,936 (Qwen's
//! vocabulary); one sample in four has a loss_mask (its first fifth 0). About 7.7 bytes of
//! JSONL per token, so 600 MB is about 78M tokens in 99k samples.
//!
//! Length: past 500 lines: the generator, the launches' memory sampling and both harnesses
//! share one table of launches.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use scripts::{median, wait_rusage};
use shm_ring::WorkerName;

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Writes a JSONL dataset of about MB megabytes.
    Gen {
        #[arg(long)]
        mb: u64,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Measures preparing DATA and launching on it.
    Run {
        #[arg(long)]
        data: PathBuf,
        /// This tree's launcher.
        #[arg(long, default_value = "target/release/launcher")]
        launcher: PathBuf,
        /// A launcher to compare with (e.g. one built from the commit before the prepared data).
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Topology of the baseline's launches (its memory grows with the process count).
        #[arg(long, default_value = "0-4")]
        baseline_targets: String,
        #[arg(long, default_value = "5-7")]
        baseline_drafters: String,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Runs of the baseline (at most `runs`): at 3 GB each of its processes needs ~6 GB.
        #[arg(long)]
        baseline_runs: Option<usize>,
        /// The baseline prepares data too (an earlier build of the prepared-data path, not the
        /// JSONL-parsing one): its `launcher prepare` is measured beside ours, and its launches
        /// are the two prepared-data modes, each with its own cache.
        #[arg(long)]
        baseline_prepares: bool,
        /// Scratch directory (cache, run directories); emptied first.
        #[arg(long, default_value = "/tmp/hspipe-bench-data")]
        work: PathBuf,
    },
    /// Measures launching on SAMPLES samples of the built-in synthetic data.
    Synthetic {
        #[arg(long, default_value_t = 400_000)]
        samples: u64,
        /// This tree's launcher.
        #[arg(long, default_value = "target/release/launcher")]
        launcher: PathBuf,
        /// A launcher to compare with, launched in turn with ours.
        #[arg(long)]
        baseline: Option<PathBuf>,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Scratch directory (run directories); emptied first.
        #[arg(long, default_value = "/tmp/hspipe-bench-data")]
        work: PathBuf,
    },
}

/// A standard normal draw (Box-Muller; `1 - u` keeps the logarithm's argument above 0).
fn normal(rng: &mut impl RngExt) -> f64 {
    let (u, v): (f64, f64) = (rng.random(), rng.random());
    (-2.0 * (1.0 - u).ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

fn gen(mb: u64, out: &Path, seed: u64) -> anyhow::Result<()> {
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, f);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let target = mb * 1_000_000;
    let (mut bytes, mut samples, mut tokens) = (0u64, 0u64, 0u64);
    let mut line = String::with_capacity(1 << 16);
    while bytes < target {
        let len = ((512f64.ln() + normal(&mut rng)).exp().round() as u64).clamp(16, 4096);
        line.clear();
        line.push_str("{\"input_ids\": [");
        for i in 0..len {
            if i > 0 {
                line.push_str(", ");
            }
            line.push_str(&rng.random_range(0..151_936u32).to_string());
        }
        line.push(']');
        if rng.random_ratio(1, 4) {
            line.push_str(", \"loss_mask\": [");
            for i in 0..len {
                line.push_str(if i == 0 { "" } else { ", " });
                line.push(if i < len / 5 { '0' } else { '1' });
            }
            line.push(']');
        }
        line.push_str("}\n");
        w.write_all(line.as_bytes())?;
        bytes += line.len() as u64;
        samples += 1;
        tokens += len;
    }
    w.flush()?;
    println!(
        "{}: {:.1} MB, {samples} samples, {:.1}M tokens (mean {:.0} tokens a sample)",
        out.display(),
        bytes as f64 / 1e6,
        tokens as f64 / 1e6,
        tokens as f64 / samples as f64
    );
    Ok(())
}

/// Peak figures of one process, in KiB: VmHWM (the kernel's peak RSS, with shared pages),
/// and the largest RssAnon (private memory), RssFile (mapped files: the binary and the
/// prepared data) and RssShmem (the ring's slots it touched) seen.
#[derive(Clone, Copy, Debug, Default)]
struct Mem {
    hwm: u64,
    anon: u64,
    file: u64,
    shm: u64,
}

fn status_of(pid: u32) -> Option<(String, u32, Mem)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let (mut name, mut ppid, mut m) = (String::new(), 0, Mem::default());
    for l in text.lines() {
        let v = |l: &str| {
            l.split_whitespace()
                .nth(1)
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        match l.split(':').next() {
            Some("Name") => name = l.split_whitespace().nth(1).unwrap_or("").to_string(),
            Some("PPid") => ppid = v(l) as u32,
            Some("VmHWM") => m.hwm = v(l),
            Some("RssAnon") => m.anon = v(l),
            Some("RssFile") => m.file = v(l),
            Some("RssShmem") => m.shm = v(l),
            _ => {}
        }
    }
    Some((name, ppid, m))
}

/// One launch: seconds to the first published and the first trained batch, and each
/// process's peak memory.
struct Launch {
    first_published_s: f64,
    first_batch_s: f64,
    procs: BTreeMap<u32, (String, Mem)>,
}

fn launch(launcher: &Path, args: &[String], run_dir: &Path) -> anyhow::Result<Launch> {
    let started = Instant::now();
    let mut child = Command::new(launcher)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", launcher.display()))?;
    let lpid = child.id();
    let mut procs: BTreeMap<u32, (String, Mem)> = BTreeMap::new();
    let mut first: Option<f64> = None;
    let mut published: Option<f64> = None;
    let mut ring: Option<shm_ring::Ring> = None;
    let mut signalled = 0;
    loop {
        if let Some(st) = child.try_wait()? {
            if first.is_none() {
                bail!(
                    "{} exited ({st}) before training a batch",
                    launcher.display()
                );
            }
            break;
        }
        // The launcher's children (the workers), from the kernel's lists of each of its
        // threads: no /proc scan.
        let mut pids = vec![lpid];
        for t in std::fs::read_dir(format!("/proc/{lpid}/task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                pids.extend(c.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
        for pid in pids {
            if let Some((name, _, m)) = status_of(pid) {
                // The name seen last: a child is named after the launcher until it execs, and
                // until then its pages are the launcher's, shared copy-on-write but counted as
                // its own: what was seen under another name is dropped.
                let e = procs.entry(pid).or_insert((String::new(), Mem::default()));
                if e.0 != name {
                    e.1 = Mem::default();
                }
                e.0 = name;
                e.1.hwm = e.1.hwm.max(m.hwm);
                e.1.anon = e.1.anon.max(m.anon);
                e.1.file = e.1.file.max(m.file);
                e.1.shm = e.1.shm.max(m.shm);
            }
        }
        let t = started.elapsed().as_secs_f64();
        if ring.is_none() {
            if let Ok(name) = proto::RunDir::new(run_dir).read_ring_name() {
                ring = shm_ring::Ring::open_read_only(&name).ok();
            }
        }
        if published.is_none()
            && ring
                .as_ref()
                .is_some_and(|r| r.snapshot().counters.published > 0)
        {
            published = Some(t);
        }
        if first.is_none() {
            let trained = (0..8).any(|d| {
                std::fs::metadata(run_dir.join(format!("ledger/{}.jsonl", WorkerName::consumer(d))))
                    .is_ok_and(|m| m.len() > 0)
            });
            if trained {
                first = Some(t);
            }
        }
        // Two seconds of training after the first batch, then stop hard: two signals, of two
        // kinds (the launcher counts a repeat of one signal by one sender within 1 s as one).
        if let Some(f) = first {
            if t > f + 2.0 && signalled < 2 {
                let sig = [rustix::process::Signal::TERM, rustix::process::Signal::INT][signalled];
                // The child is ours and not reaped, so its pid still names it.
                if let Some(pid) = rustix::process::Pid::from_raw(lpid as i32) {
                    let _ = rustix::process::kill_process(pid, sig);
                }
                signalled += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if started.elapsed() > Duration::from_secs(900) {
            let _ = child.kill();
            bail!("launch hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(Launch {
        first_published_s: published.unwrap_or(f64::NAN),
        first_batch_s: first.unwrap_or(f64::NAN),
        procs,
    })
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Medians over the runs of: first batch, launcher peak, largest target and drafter peaks
/// (VmHWM and private), and the sum of every process's peak.
fn summarise(name: &str, ls: &[Launch]) {
    let pick = |l: &Launch, who: &str, f: fn(&Mem) -> u64| {
        l.procs
            .values()
            .filter(|(n, _)| n.starts_with(who))
            .map(|(_, m)| f(m))
            .max()
            .unwrap_or(0)
    };
    let med = |f: &dyn Fn(&Launch) -> f64| median(ls.iter().map(f).collect());
    println!(
        "| {name} | {:.2} | {:.2} | {:.0} / {:.0} | {:.0} / {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} |",
        med(&|l| l.first_published_s),
        med(&|l| l.first_batch_s),
        med(&|l| mib(pick(l, "launcher", |m| m.hwm))),
        med(&|l| mib(pick(l, "launcher", |m| m.anon))),
        med(&|l| mib(pick(l, "target", |m| m.hwm))),
        med(&|l| mib(pick(l, "target", |m| m.anon))),
        med(&|l| mib(pick(l, "target", |m| m.file))),
        med(&|l| mib(pick(l, "target", |m| m.shm))),
        med(&|l| mib(pick(l, "drafter", |m| m.hwm))),
        med(&|l| mib(pick(l, "drafter", |m| m.anon))),
        med(&|l| mib(l.procs.values().map(|(_, m)| m.hwm).sum())),
        med(&|l| mib(l.procs.values().map(|(_, m)| m.anon).sum())),
    );
}

/// One `launcher prepare` of `data` into a cold `cache`: seconds, peak RSS (MiB) and the
/// prepared file.
fn prepare_once(launcher: &Path, data: &Path, cache: &Path) -> anyhow::Result<(f64, f64, PathBuf)> {
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let _ = std::fs::remove_dir_all(cache);
    let t = Instant::now();
    let child = Command::new(launcher)
        .args(["prepare", &s(data), "--data-cache", &s(cache)])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let pid = child.id();
    let (code, kib) = wait_rusage(pid)?;
    let secs = t.elapsed().as_secs_f64();
    if code != 0 {
        bail!("{} prepare exited {code}", launcher.display());
    }
    let prepared = std::fs::read_dir(cache)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "arrow"))
        .context("no prepared file")?;
    Ok((secs, mib(kib), prepared))
}

#[allow(clippy::too_many_arguments)]
fn run(
    data: &Path,
    launcher: &Path,
    baseline: Option<&Path>,
    bt: &str,
    bd: &str,
    runs: usize,
    baseline_runs: usize,
    baseline_prepares: bool,
    work: &Path,
) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let size = std::fs::metadata(data)?.len() as f64 / 1e6;
    let s = |p: &Path| p.to_string_lossy().into_owned();
    // Preparing: a cold cache each time (the input itself is in the page cache after the
    // first read, as on a re-run); a baseline that prepares too goes in turn with ours.
    let mut preparers = vec![("", launcher, work.join("cache"))];
    if let Some(b) = baseline.filter(|_| baseline_prepares) {
        preparers.push((" (baseline)", b, work.join("cache-baseline")));
    }
    let mut figures: Vec<(Vec<f64>, Vec<f64>, PathBuf)> = preparers
        .iter()
        .map(|_| (Vec::new(), Vec::new(), PathBuf::new()))
        .collect();
    for r in 0..runs {
        for (k, (_, exe, cache)) in preparers.iter().enumerate() {
            if k > 0 && r >= baseline_runs {
                continue;
            }
            let (secs, rss, prepared) = prepare_once(exe, data, cache)?;
            figures[k].0.push(secs);
            figures[k].1.push(rss);
            figures[k].2 = prepared;
        }
    }
    for ((tag, exe, _), (secs, rss, prepared)) in preparers.iter().zip(&figures) {
        let psize = std::fs::metadata(prepared)?.len() as f64 / 1e6;
        let n = secs.len();
        println!(
            "{}{tag}: {size:.0} MB of JSONL; prepared file {psize:.0} MB; {} prepare: {:.2} s, peak RSS {:.0} MiB (medians of {n})",
            data.display(),
            exe.display(),
            median(secs.clone()),
            median(rss.clone())
        );
    }
    let (cache, prepared) = (preparers[0].2.clone(), figures[0].2.clone());
    // Launches, interleaved so every mode sees the same machine.
    let mut modes: Vec<(&str, PathBuf, Vec<String>)> = vec![
        (
            "prepared data, --data the JSONL (its key from the stamp)",
            launcher.to_path_buf(),
            vec!["--data".into(), s(data), "--data-cache".into(), s(&cache)],
        ),
        (
            "prepared data, --data the prepared file",
            launcher.to_path_buf(),
            vec!["--data".into(), s(&prepared)],
        ),
    ];
    // For scale: the same launch on the built-in synthetic data (no file at all), so the mock
    // pipeline's own time to a first batch (simulated compute, min_ready) shows apart.
    modes.push((
        "built-in synthetic data, 2000 samples (made in each process)",
        launcher.to_path_buf(),
        vec!["--synthetic".into(), "2000".into()],
    ));
    match (baseline, preparers.get(1), figures.get(1)) {
        (Some(b), Some((_, _, bcache)), Some((_, _, bprepared))) => {
            modes.push((
                "baseline: prepared data, --data the JSONL (its key from the stamp)",
                b.to_path_buf(),
                vec!["--data".into(), s(data), "--data-cache".into(), s(bcache)],
            ));
            modes.push((
                "baseline: prepared data, --data the prepared file",
                b.to_path_buf(),
                vec!["--data".into(), s(bprepared)],
            ));
        }
        (Some(b), _, _) => modes.push((
            "every process parses the JSONL (before)",
            b.to_path_buf(),
            vec!["--data".into(), s(data)],
        )),
        _ => {}
    }
    let mut results: Vec<Vec<Launch>> = modes.iter().map(|_| Vec::new()).collect();
    for r in 0..runs {
        for (k, (name, exe, extra)) in modes.iter().enumerate() {
            if exe != launcher && r >= baseline_runs {
                continue;
            }
            // A baseline that prepares runs the same topology as ours (its memory does not grow
            // with the data).
            let before = exe != launcher && !baseline_prepares;
            let (t, d) = if before { (bt, bd) } else { ("0-4", "5-7") };
            let run_dir = work.join(format!("run-{k}-{r}"));
            let l = launch_on(exe, t, d, extra, &run_dir)
                .with_context(|| format!("{name}, run {r}"))?;
            results[k].push(l);
        }
    }
    table(&modes, &results);
    let _ = std::fs::remove_dir_all(work);
    Ok(())
}

/// Launches on the synthetic data: `samples` samples, `launcher` and `baseline` in turn.
fn synthetic(
    samples: u64,
    launcher: &Path,
    baseline: Option<&Path>,
    runs: usize,
    work: &Path,
) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let extra = vec!["--synthetic".to_string(), samples.to_string()];
    let mut modes = vec![(
        format!("built-in synthetic data, {samples} samples"),
        launcher.to_path_buf(),
        extra.clone(),
    )];
    if let Some(b) = baseline {
        modes.push((format!("baseline: {}", modes[0].0), b.to_path_buf(), extra));
    }
    let mut results: Vec<Vec<Launch>> = modes.iter().map(|_| Vec::new()).collect();
    for r in 0..runs {
        for (k, (name, exe, extra)) in modes.iter().enumerate() {
            let run_dir = work.join(format!("run-{k}-{r}"));
            let l = launch_on(exe, "0-4", "5-7", extra, &run_dir)
                .with_context(|| format!("{name}, run {r}"))?;
            results[k].push(l);
        }
    }
    table(&modes, &results);
    let _ = std::fs::remove_dir_all(work);
    Ok(())
}

/// One launch on targets `t` and drafters `d` with the `extra` arguments, its run directory
/// removed after.
fn launch_on(
    exe: &Path,
    t: &str,
    d: &str,
    extra: &[String],
    run_dir: &Path,
) -> anyhow::Result<Launch> {
    let mut args: Vec<String> = [
        "--targets",
        t,
        "--drafters",
        d,
        "--monitor",
        "5",
        "--run-dir",
    ]
    .map(String::from)
    .to_vec();
    args.push(run_dir.to_string_lossy().into_owned());
    args.extend(extra.iter().cloned());
    let l = launch(exe, &args, run_dir);
    let _ = std::fs::remove_dir_all(run_dir);
    l
}

/// The launches' table: a row of medians for each mode.
fn table<S: AsRef<str>>(modes: &[(S, PathBuf, Vec<String>)], results: &[Vec<Launch>]) {
    println!("| launch | first batch published (s) | first batch trained (s) | launcher peak / private (MiB) | largest target peak / private / files / ring (MiB) | largest drafter peak / private (MiB) | all processes: sum of peaks / private (MiB) |");
    println!("|---|---|---|---|---|---|---|");
    for ((name, _, _), r) in modes.iter().zip(results) {
        summarise(name.as_ref(), r);
    }
}

fn main() -> anyhow::Result<()> {
    match Args::parse().cmd {
        Cmd::Gen { mb, out, seed } => gen(mb, &out, seed),
        Cmd::Run {
            data,
            launcher,
            baseline,
            baseline_targets,
            baseline_drafters,
            runs,
            baseline_runs,
            baseline_prepares,
            work,
        } => run(
            &data,
            &launcher,
            baseline.as_deref(),
            &baseline_targets,
            &baseline_drafters,
            runs,
            baseline_runs.unwrap_or(runs),
            baseline_prepares,
            &work,
        ),
        Cmd::Synthetic {
            samples,
            launcher,
            baseline,
            runs,
            work,
        } => synthetic(samples, &launcher, baseline.as_deref(), runs, &work),
    }
}
