//! `shm-ring-stat`: a read-only view of live rings. This is the first cut (parameters, slot
//! states, counters, workers); the bottleneck verdict and `--watch` come with the stat issue.

use std::io::Write;

use anyhow::{bail, Context};
use clap::Parser;

use crate::{list_segments, Phase, Ring, Snapshot};

/// Show what an hspipe ring holds and where each worker's time goes. Attaches read-only and
/// never disturbs the run.
///
/// Examples:
///   shm-ring-stat --list             every hspipe ring in /dev/shm, live or stale
///   shm-ring-stat hspipe-run1        one ring, as a table
///   shm-ring-stat hspipe-run1 --json the same, as one JSON document
///   shm-ring-stat --gc               remove rings whose creator has died
#[derive(Parser, Debug)]
#[command(name = "shm-ring-stat", version, verbatim_doc_comment)]
pub struct Args {
    /// Ring name (the file name under /dev/shm, e.g. hspipe-run1).
    pub ring: Option<String>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    pub json: bool,
    /// List every hspipe ring with its creator pid and whether it is live or stale.
    #[arg(long)]
    pub list: bool,
    /// Remove stale rings (creator dead); never removes a live one.
    #[arg(long)]
    pub gc: bool,
}

/// Runs the CLI; returns the process exit code.
pub fn main() -> i32 {
    let args = Args::parse();
    match run(&args, &mut std::io::stdout().lock()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

pub fn run(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    if args.list || args.gc {
        let segs = list_segments().context("reading /dev/shm")?;
        if args.json && !args.gc {
            writeln!(out, "{}", serde_json::to_string_pretty(&segs)?)?;
            return Ok(());
        }
        for s in &segs {
            let status = match s.live {
                Some(true) => "live",
                Some(false) => "stale",
                None => "unreadable",
            };
            let pid = s.creator.map(|c| c.pid.to_string()).unwrap_or("-".into());
            if args.gc && s.live == Some(false) {
                Ring::unlink_name(&s.name).with_context(|| format!("removing {}", s.name))?;
                writeln!(out, "removed {} (creator pid {pid} is gone)", s.name)?;
            } else if !args.gc {
                let why = s.problem.as_deref().unwrap_or("");
                writeln!(
                    out,
                    "{:<32} {:>12} bytes  creator {pid:>8}  {status} {why}",
                    s.name, s.bytes
                )?;
            }
        }
        if segs.is_empty() && !args.gc {
            writeln!(out, "no hspipe rings in /dev/shm")?;
        }
        return Ok(());
    }
    let Some(name) = &args.ring else {
        bail!("name a ring (see --list), or pass --list or --gc");
    };
    let ring = Ring::open_read_only(name).with_context(|| format!("attaching to {name}"))?;
    let snap = ring.snapshot();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&snap)?)?;
    } else {
        human(&snap, out)?;
    }
    Ok(())
}

fn human(s: &Snapshot, out: &mut impl Write) -> std::io::Result<()> {
    let p = &s.params;
    writeln!(
        out,
        "ring {}  {} slots x {} bytes  {} buckets  policy {:?}  creator pid {}{}",
        s.name,
        p.slots,
        p.slot_size,
        p.buckets,
        p.policy,
        s.creator.pid,
        if s.creator_alive { "" } else { " (stale)" }
    )?;
    writeln!(
        out,
        "state {}  producers done {}/{}",
        if s.closed { "closed" } else { "open" },
        s.producers_done,
        s.producers_expected
    )?;
    writeln!(
        out,
        "slots free {}  writing {}  ready {}  reading {}   ready per bucket {:?}",
        s.slots.free, s.slots.writing, s.slots.ready, s.slots.reading, s.ready_per_bucket
    )?;
    let c = &s.counters;
    writeln!(
        out,
        "published {}  taken {}  released {}  redelivered {}  aborted {}",
        c.published, c.taken, c.released, c.redelivered, c.aborted
    )?;
    writeln!(
        out,
        "{:<9} {:>3} {:>4} {:>8} {:>6} {:>8} {:>9} {:>12}  time by phase (s)",
        "role", "idx", "gpu", "pid", "alive", "restarts", "items", "tokens"
    )?;
    for w in &s.workers {
        let phases: Vec<String> = Phase::ALL
            .iter()
            .map(|ph| format!("{} {:.2}", ph.name(), w.phase_ns[ph.name()] as f64 / 1e9))
            .collect();
        writeln!(
            out,
            "{:<9} {:>3} {:>4} {:>8} {:>6} {:>8} {:>9} {:>12}  {}",
            format!("{:?}", w.role).to_lowercase(),
            w.index,
            w.gpu.map(|g| g.to_string()).unwrap_or("-".into()),
            w.pid,
            w.alive,
            w.restarts,
            w.items,
            w.tokens,
            phases.join(", ")
        )?;
    }
    Ok(())
}
