//! Reclaiming what dead launchers left: their rings in `/dev/shm`, and the news that their runs
//! stopped without finishing.
//!
//! A launcher that is SIGKILLed or OOM-killed cannot clean up, and its ring can hold tens of GB
//! of the node's memory. So every launcher, at start, removes the `hspipe-*` segments of its
//! user whose creator is provably dead, one line each, and never a live one or another user's.
//!
//! To say *which run* stopped, each launcher records itself before it creates its ring: a file
//! `<ring>.json` (its pid, its run directory, its segments) in a private directory of the user
//! (`$XDG_RUNTIME_DIR/hspipe`, else `/tmp/hspipe-<uid>`, mode 0700, as tmux keeps its sockets),
//! holding an exclusive `flock` on it for its whole life, and removes it after its ring. The
//! kernel drops the lock when the launcher dies, however it dies, so "the lock can be taken"
//! proves the launcher dead, with no pid that could have been reused. The record is created
//! under a temporary name, locked, then renamed into place, so no reader sees it unlocked.
//!
//! At start: (1) every record whose lock can be taken names a dead launcher: its segments are
//! removed whatever their header says (even a ring half-created when the launcher died) and
//! its run directory is reported; (2) every other segment of this user whose header names a
//! creator that is gone is removed (rings of tests or standalone peers, and launchers of
//! before the records). A half-created segment without a record is left alone: nothing proves
//! its creator dead. `shm-ring-stat --gc` stays for manual use.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use proto::RunDir;
use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};
use shm_ring::Ring;

/// What a launcher records about itself while it runs.
#[derive(Serialize, Deserialize)]
struct Record {
    launcher_pid: u32,
    /// Absolute.
    run_dir: PathBuf,
    /// Every `/dev/shm` segment the launcher creates, the ring first.
    segments: Vec<String>,
}

fn uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The user's private directory for records, created if missing. Refuses a directory another
/// user could write to (or a symlink someone planted in /tmp).
fn records_dir() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("hspipe"),
        _ => PathBuf::from(format!("/tmp/hspipe-{}", uid())),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Err(e) if e.kind() != ErrorKind::AlreadyExists => {
            return Err(e).with_context(|| format!("creating {}", dir.display()))
        }
        _ => {}
    }
    let m =
        std::fs::symlink_metadata(&dir).with_context(|| format!("reading {}", dir.display()))?;
    if !m.is_dir() || m.uid() != uid() || m.mode() & 0o077 != 0 {
        bail!(
            "{} is not a private directory of this user (uid {})",
            dir.display(),
            uid()
        );
    }
    Ok(dir)
}

/// This launcher's record; removed (and its lock released) on drop. Drop it after the ring.
pub struct Registration {
    path: PathBuf,
    _locked: File,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Records this launcher, its run directory and its ring, before the ring is created.
pub fn register(ring: &str, others: &[String], run_dir: &Path) -> anyhow::Result<Registration> {
    let dir = records_dir()?;
    let record = Record {
        launcher_pid: std::process::id(),
        run_dir: std::path::absolute(run_dir)
            .with_context(|| format!("resolving {}", run_dir.display()))?,
        segments: std::iter::once(ring.to_string())
            .chain(others.iter().cloned())
            .collect(),
    };
    let tmp = dir.join(format!(".{ring}.json.tmp"));
    let path = dir.join(format!("{ring}.json"));
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    let written = flock(&f, FlockOperation::NonBlockingLockExclusive)
        .map_err(std::io::Error::from)
        .and_then(|()| f.write_all(&serde_json::to_vec(&record)?))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(Registration { path, _locked: f })
}

/// Removes what dead launchers of this user left and returns one line for each thing done.
/// Never fails: what cannot be done is a line too, and the run goes on.
pub fn reclaim(this: &This) -> Vec<String> {
    let mut lines = Vec::new();
    match records_dir() {
        Ok(dir) => reclaim_recorded(&dir, this, &mut lines),
        Err(e) => lines.push(format!(
            "warning: runs of dead launchers cannot be reported: {e:#}"
        )),
    }
    reclaim_stale_segments(this, &mut lines);
    lines
}

/// The run of the launcher that reclaims: a dead launcher's run may be this very one (resumed,
/// or started over where that launch trained nothing), which needs no advice to resume it.
pub struct This<'a> {
    pub run_dir: &'a Path,
    pub resuming: bool,
    /// This launch's resume of `run_dir` was refused (it reclaims before it exits): that run's
    /// line says so, not "continue it with `launcher --resume`", the command that just failed.
    pub refused: bool,
}

impl This<'_> {
    /// What to say of dead launcher's run `run`, and whether to note it in that run's log
    /// (not this run's own: everything this launcher prints goes there already).
    fn state_of(&self, run: &Path) -> (String, bool) {
        let same = (std::fs::canonicalize(run).ok())
            .is_some_and(|r| std::fs::canonicalize(self.run_dir).is_ok_and(|t| t == r));
        match (same, self.resuming) {
            (false, _) => (run_state(run), true),
            (true, true) if self.refused => (
                format!(
                    "the run in {} is the one this launch was to resume, which is refused (below)",
                    run.display()
                ),
                true,
            ),
            (true, true) => (
                format!(
                    "the run in {} is the one this launch resumes",
                    run.display()
                ),
                false,
            ),
            (true, false) => (
                format!(
                    "the run in {} trained nothing, and this launch starts a new one there",
                    run.display()
                ),
                false,
            ),
        }
    }
}

/// Opens and locks a record if its launcher is dead; `None` while it lives, or if another
/// launcher reclaimed it first.
fn take_if_dead(path: &Path) -> Option<File> {
    let f = File::open(path).ok()?;
    flock(&f, FlockOperation::NonBlockingLockExclusive).ok()?;
    // Another launcher may have reclaimed and removed it between our open and our lock.
    let same = std::fs::metadata(path).ok()?.ino() == f.metadata().ok()?.ino();
    same.then_some(f)
}

fn reclaim_recorded(dir: &Path, this: &This, lines: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    paths.sort();
    for path in paths {
        let Some(f) = take_if_dead(&path) else {
            continue;
        };
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with('.') {
            // A record being written, which its launcher locks right after creating it. One
            // that is unlocked and old was left by a launcher that died before making a ring.
            let old = f
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(60));
            if old {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        let record: Record = match std::io::read_to_string(&f)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
        {
            Some(r) => r,
            None => {
                lines.push(format!(
                    "removed an unreadable run record {}",
                    path.display()
                ));
                let _ = std::fs::remove_file(&path);
                continue;
            }
        };
        let removed: Vec<String> = record
            .segments
            .iter()
            .filter_map(|s| remove_segment(s, lines))
            .collect();
        let run = &record.run_dir;
        let pid = record.launcher_pid;
        if run.is_dir() {
            let what = if removed.is_empty() {
                format!("launcher pid {pid} is gone (its ring was already removed)")
            } else {
                format!(
                    "reclaimed {} left by launcher pid {pid}, which is gone",
                    removed.join(", ")
                )
            };
            let (state, note) = this.state_of(run);
            lines.push(format!("{what}: {state}"));
            if note {
                note_in_run_log(run, &what);
            }
        } else if !removed.is_empty() {
            lines.push(format!(
                "reclaimed {} left by launcher pid {pid}, which is gone (its run directory {} no longer exists)",
                removed.join(", "),
                run.display()
            ));
        }
        let _ = std::fs::remove_file(&path);
        drop(f);
    }
}

/// Removes segment `name` of this user if it exists; returns how to name it in a message.
fn remove_segment(name: &str, lines: &mut Vec<String>) -> Option<String> {
    let path = Path::new("/dev/shm").join(name);
    let m = std::fs::symlink_metadata(&path).ok()?;
    if m.uid() != uid() {
        return None;
    }
    match Ring::unlink_name(name) {
        Ok(()) => Some(format!("{name} ({})", mib(m.len()))),
        // Another launcher starting at the same time removed it first.
        Err(_) if !path.exists() => None,
        Err(e) => {
            lines.push(format!("could not remove {name}: {e}"));
            None
        }
    }
}

/// Segments of this user whose recorded creator is gone (and that no record named).
fn reclaim_stale_segments(this: &This, lines: &mut Vec<String>) {
    let segs = match shm_ring::list_segments() {
        Ok(s) => s,
        Err(e) => {
            lines.push(format!("warning: cannot list /dev/shm: {e}"));
            return;
        }
    };
    for s in segs {
        let Some(c) = s.creator else { continue };
        if s.live != Some(false) || c.uid != uid() {
            continue;
        }
        let Some(what) = remove_segment(&s.name, lines) else {
            continue;
        };
        let what = format!(
            "reclaimed stale segment {what}: its creator, pid {}, is gone",
            c.pid
        );
        // A launcher of before the records: its run is `runs/<run id>` if it used the default.
        let run = s
            .name
            .strip_prefix(shm_ring::NAME_PREFIX)
            .map(|id| Path::new("runs").join(id))
            .filter(|run| RunDir::new(run).read_ring_name().is_ok_and(|r| r == s.name));
        match run {
            Some(run) => {
                let (state, note) = this.state_of(&run);
                lines.push(format!("{what}: {state}"));
                if note {
                    note_in_run_log(&run, &what);
                }
            }
            None => lines.push(what),
        }
    }
}

/// What a dead launcher's run directory holds, for the next launcher's message.
fn run_state(run: &Path) -> String {
    let run_dir = RunDir::new(run);
    if run_dir.summary().exists() {
        return format!(
            "the run in {} had finished (see its summary.json)",
            run.display()
        );
    }
    let ckpt = run_dir.checkpoint();
    let recorded = proto::checkpointed::read(&run_dir).ok().flatten();
    let last = if ckpt.exists() {
        format!("its group checkpoint is {}", ckpt.display())
    } else if let Some(step) = recorded {
        format!(
            "its drafter recorded its weights of step {step} saved ({})",
            run_dir.checkpointed_step().display()
        )
    } else {
        "it wrote no checkpoint yet (a resume trains it from the start)".to_string()
    };
    format!(
        "the run in {} stopped without finishing; {last}; continue it with `{}`",
        run.display(),
        crate::resume::command(run)
    )
}

/// Leaves a line in the dead run's own `launcher.log`, so its directory tells what happened.
fn note_in_run_log(run: &Path, what: &str) {
    if let Ok(mut f) = OpenOptions::new()
        .append(true)
        .open(RunDir::new(run).launcher_log())
    {
        let _ = writeln!(
            f,
            "--- launcher pid {} found this run's launcher gone: {what}",
            std::process::id()
        );
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
