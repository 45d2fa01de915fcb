//! `shm-ring-stat --list` and `--gc`: the hspipe segments in `/dev/shm`, and removing the stale
//! ones (rings whose creator is gone, with their drafter groups; a drafter group whose ring is
//! gone, by the launcher its ring's name names).

use std::io::Write;

use anyhow::{bail, Context};
use shm_ring::{list_segments, Ring};

use crate::cli::Args;

/// What `--list` prints (`--gc`: removes the stale and says so), of `args.ring` only if given.
pub(crate) fn list_or_gc(args: &Args, out: &mut impl Write) -> anyhow::Result<()> {
    let mut segs = list_segments().context("reading /dev/shm")?;
    if let Some(only) = &args.ring {
        segs.retain(|s| &s.name == only);
        if segs.is_empty() {
            bail!("{only} is not in /dev/shm (see --list)");
        }
    }
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&segs)?)?;
        return Ok(());
    }
    let in_shm = |name: &str| std::path::Path::new("/dev/shm").join(name).exists();
    for s in &segs {
        let status = match s.live {
            Some(true) => "live",
            Some(false) => "stale",
            None => "unknown",
        };
        let pid = s.creator.map(|c| c.pid.to_string()).unwrap_or("-".into());
        // A drafter group whose ring is gone: nothing removes it but this, and no header of
        // it says who made it: judged by the launcher its ring's name names.
        let orphan = group_of(&s.name)
            .filter(|ring| !in_shm(ring))
            .map(|ring| (ring, shm_ring::judge_orphan(ring, &s.name)));
        if let (true, Some((ring, (live, why)))) = (args.gc, &orphan) {
            if !in_shm(&s.name) {
                continue; // Removed with its ring, above.
            }
            if *live == Some(false) {
                Ring::unlink_name(&s.name).with_context(|| format!("removing {}", s.name))?;
                writeln!(
                    out,
                    "removed {} (the drafter group of {ring}, which is gone; {why})",
                    s.name
                )?;
            } else if args.ring.is_some() {
                writeln!(
                    out,
                    "not removed: {}: it is the drafter group of {ring}, which is gone; {why}",
                    s.name
                )?;
            }
            continue;
        }
        if args.gc {
            if s.is_stale() {
                Ring::unlink_name(&s.name).with_context(|| format!("removing {}", s.name))?;
                // A blank ring (never initialised) has no creator on record: its problem says
                // how its name proved it stale.
                let why = match (&s.creator, &s.problem) {
                    (None, Some(p)) => p.clone(),
                    _ => format!("creator pid {pid} is gone"),
                };
                writeln!(out, "removed {} ({why})", s.name)?;
                // The run's drafter group goes with its ring: nothing else would remove it.
                let group = proto::group_segment(&s.name);
                if in_shm(&group) {
                    Ring::unlink_name(&group).with_context(|| format!("removing {group}"))?;
                    writeln!(out, "removed {group} (the drafter group of {})", s.name)?;
                }
            } else if args.ring.is_some() {
                let why = match (&s.problem, group_of(&s.name)) {
                    (_, Some(ring)) => {
                        format!("it is the drafter group of {ring}, removed with it")
                    }
                    (Some(p), None) => p.clone(),
                    (None, None) => format!("its creator pid {pid} is live"),
                };
                writeln!(out, "not removed: {}: {why}", s.name)?;
            }
        } else {
            let (status, why) = match (&orphan, group_of(&s.name)) {
                (Some((ring, (live, why))), _) => (
                    if *live == Some(false) {
                        "stale"
                    } else {
                        status
                    },
                    format!("the drafter group of {ring}, which is gone; {why}"),
                ),
                (None, Some(ring)) => (status, format!("the drafter group of {ring}")),
                (None, None) => (status, s.problem.clone().unwrap_or_default()),
            };
            writeln!(
                out,
                "{:<36} {:>12} bytes  creator pid {pid:>8}  {status} {why}",
                s.name, s.bytes
            )?;
        }
    }
    if segs.is_empty() && !args.gc {
        writeln!(out, "no hspipe rings in /dev/shm")?;
    }
    Ok(())
}

/// The ring whose drafter group segment `name` is (`proto::group_segment`), if it is one.
fn group_of(name: &str) -> Option<&str> {
    name.strip_suffix(proto::group_segment("").as_str())
}
