//! `launcher --resume RUN_DIR`: continue a run that was stopped (Ctrl-C) or killed outright
//! (launcher and workers SIGKILLed) from its group checkpoint.
//!
//! The checkpoint holds the model and optimizer after step S. A ledger line with step <= S is
//! a batch whose update is in it: that batch is done and is never trained again (its work item
//! is marked DONE in the new ring). A line with a later step recorded an update that was lost
//! with the processes: it is dropped from the ledger and its batch is trained again. So is a line
//! in steps whose updates were lost while the run went on (every drafter died, and the group
//! went on from a checkpoint: `lost-steps.jsonl`), whatever its step. Torn lines go too. So do
//! the kept exports (`drafter-steps/step-<S>`) of steps after S, written before a checkpoint
//! that never came. Nothing in the run directory is changed until everything has been checked,
//! so a bad resume leaves the run as it was.
//!
//! A drafter of the user's own (`[drafter] command`) saves its weights itself, in a file hspipe
//! cannot read, and records the step they hold (`proto::checkpointed`): S is that step, and the
//! same rules hold. The resumed drafters are told S (Welcome's `resume_step`) and load their
//! file of it; the group goes on from S.
//!
//! The GPUs: the run directory records the lists its last launcher ran on (`gpus.json`), so
//! `--resume RUN_DIR` alone resumes on them, and a list given with it replaces the run's own.
//! Every message that tells the user how to continue a run prints [`command`].
//!
//! One launcher at a time: each holds its run directory ([`hold`]) for its whole life, so a
//! `--resume` of a run whose launcher still runs is refused before it changes anything.
//!
//! Length: about 720 lines, half of them tests: what a resume checks, rewrites and says is one
//! contract with the run directory's files, kept in one place.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use gpu::BackendKind;
use proto::{ledger, GpuLists, PipelineConfig, RunDir};

use crate::cli::{format_gpu_list, GpuList, UsageError};

/// The command that continues the run in `dir`, written so that a shell runs it as printed.
pub(crate) fn command(dir: &Path) -> String {
    format!("launcher --resume {}", proto::run_dir::shell_word(dir))
}

/// The error of a resume of the run in `dir` whose own config.toml fails `check`, one of this
/// build's checks: it says which run and file, the check's error, that a newer build may check
/// more than the one that started the run, and the two ways on. Editing the file is offered
/// only where that keeps what the run trains (a value out of bounds, say; not the layers or the
/// data, which its ledgers and checkpoint were made of, and whose change a resume refuses
/// anyway by the plan's fingerprint and the checkpoint's shape).
pub(crate) fn config_refused(dir: &Path, check: &anyhow::Error) -> anyhow::Error {
    let config = RunDir::new(dir).config();
    anyhow::anyhow!(
        "resuming {}: the run's config.toml ({}, written by the launch that started the run) fails a check of this build: {check:#}; a newer build may check more than the one that started the run: edit {} to pass the check where that keeps what the run trains, or finish the run with the build that started it",
        dir.display(),
        config.display(),
        config.display()
    )
}

/// The error for a resumed run's config.toml that is TOML but holds a field this build does not
/// know or a value of another type (`ConfigError::Parse`, which names the field and line). The
/// launch that started the run wrote only fields its build knew, so either the field was typed
/// in since (the likelier: README has users edit a stopped run's config, and a misspelt name or
/// a field outside its `[section]` is the common slip), or that build knew it and this one does
/// not. Not [`config_refused`], which blamed only the build.
pub(crate) fn config_unknown(dir: &Path, parse: &anyhow::Error) -> anyhow::Error {
    let config = RunDir::new(dir).config();
    anyhow::anyhow!(
        "resuming {}: {parse:#}\nThe launch that started the run wrote only fields its build knew, so this one was typed into {} since (misspelt, or outside its [section]? the fields: README, \"Running it\"), or the build that started the run knew it and this one does not: fix or remove it where that keeps what the run trains, or finish the run with the build that started it",
        dir.display(),
        config.display()
    )
}

/// The GPU lists a resume of `run_dir` runs on: each list given on the command line, the run's
/// own (its `gpus.json`) for a list not given. The flag says whether both are the run's own,
/// which a `--share-gpus` run that is resumed as it was needs not be told again (the record
/// says whether it was one). A run
/// directory without the record (from a build before it) needs both lists given: a usage
/// error otherwise.
pub(crate) fn gpu_lists(
    run_dir: &RunDir,
    targets: Option<&GpuList>,
    drafters: Option<&GpuList>,
) -> anyhow::Result<(GpuLists, bool)> {
    if let (Some(t), Some(d)) = (targets, drafters) {
        let lists = GpuLists {
            targets: t.0.clone(),
            drafters: d.0.clone(),
            share_gpus: None,
        };
        return Ok((lists, false));
    }
    let Some(own) = run_dir.read_gpus()? else {
        return Err(UsageError(format!(
            "{} does not record the GPUs its run ran on (no {}: it was started by an earlier build), so pass both lists: `{} --targets LIST --drafters LIST`, with at least as many drafters as the run had",
            run_dir.path().display(),
            run_dir.gpus().display(),
            command(run_dir.path())
        ))
        .into());
    };
    // The record can be edited by hand: its lists get the command line's checks, those the
    // command line does not replace.
    for (flag, list, given) in [
        ("--targets", &own.targets, targets.is_some()),
        ("--drafters", &own.drafters, drafters.is_some()),
    ] {
        if given {
            continue;
        }
        crate::cli::check_gpu_list(list).map_err(|why| {
            UsageError(format!(
                "{}, the GPU lists the run last ran on, has in its {} list: {why} (edited since the launcher wrote it?); fix the file, or give the list as {flag}",
                run_dir.gpus().display(),
                &flag[2..],
            ))
        })?;
    }
    let lists = GpuLists {
        targets: targets.map_or_else(|| own.targets.clone(), |t| t.0.clone()),
        drafters: drafters.map_or_else(|| own.drafters.clone(), |d| d.0.clone()),
        share_gpus: own.share_gpus,
    };
    Ok((lists, targets.is_none() && drafters.is_none()))
}

/// Holds `run_dir` for this launcher's life: an exclusive `flock` on its `.lock` file, which the
/// kernel drops when the launcher exits, however it exits (the file is close-on-exec, so no
/// worker keeps it). A regular file opened for writing, not the directory: NFS emulates
/// `flock` with a POSIX lock, which refuses an exclusive lock on a read-only descriptor. A second launcher on the directory, a `--resume` of a run whose launcher
/// still runs above all, is refused here: it would rewrite the ledgers under the live run's
/// drafters, and both groups would train the same batches into one checkpoint. A file system
/// without `flock` is a warning, not an error: the run goes on unguarded.
pub(crate) fn hold(run_dir: &RunDir) -> anyhow::Result<Option<File>> {
    let dir = run_dir.path();
    let path = run_dir.lock_file();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Some(f)),
        Err(rustix::io::Errno::WOULDBLOCK) => bail!(
            "{} is in use by another launcher that is still running (`shm-ring-stat --run-dir {}` shows it and its pid); stop it (Ctrl-C, or SIGINT to that pid) and wait for it to exit first, or give a new run another --run-dir",
            dir.display(),
            proto::run_dir::shell_word(dir)
        ),
        Err(e) => {
            println!(
                "warning: {} cannot be locked ({e}): nothing stops a second launcher on it",
                dir.display()
            );
            Ok(None)
        }
    }
}

/// What a resume will do, checked and not yet applied.
#[derive(Debug)]
pub struct Resume {
    /// The checkpoint's step (0 without a checkpoint): the group starts there.
    pub step: u32,
    /// There is a checkpoint: ours, or one a drafter of the user's own recorded
    /// (`proto::checkpointed`). Such a drafter is told its step in Welcome, to load its file of
    /// it.
    pub checkpointed: bool,
    /// Planned batches whose update is in the checkpoint.
    pub done: BTreeSet<u64>,
    /// Each ledger file and the lines it keeps.
    ledgers: Vec<(PathBuf, Vec<String>)>,
    /// Lines dropped, by why.
    pub dropped: Dropped,
    /// The run's record of lost steps: applied by the ledgers' rewrite, then removed.
    lost_steps: PathBuf,
    /// The kept exports of steps after the checkpoint's, removed.
    kept_after: Vec<PathBuf>,
    /// The last launch's summary.json, removed.
    summary: PathBuf,
}

/// The ledger lines a resume drops, whose batches are trained again: updates after the checkpoint,
/// updates in steps recorded lost (`lost-steps.jsonl`, before the checkpoint's step), and lines a
/// kill cut short.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    pub after: usize,
    pub lost: usize,
    pub torn: usize,
}

impl Dropped {
    pub fn total(&self) -> usize {
        self.after + self.lost + self.torn
    }
}

impl std::fmt::Display for Dropped {
    /// `3 ledger line(s) dropped (2 after the checkpoint, 1 in lost updates)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ledger line(s) dropped", self.total())?;
        let parts: Vec<String> = [
            (self.after, "after the checkpoint"),
            (self.lost, "in lost updates"),
            (self.torn, "cut short by a kill"),
        ]
        .into_iter()
        .filter(|&(n, _)| n > 0)
        .map(|(n, why)| format!("{n} {why}"))
        .collect();
        if !parts.is_empty() {
            write!(f, " ({})", parts.join(", "))?;
        }
        Ok(())
    }
}

/// Checks that `run_dir` can be resumed with `cfg` (its own config) and `drafters` drafters,
/// whose plan has `batches` batches, and works out what is done.
pub fn check(
    run_dir: &RunDir,
    cfg: &PipelineConfig,
    backend: BackendKind,
    drafters: u32,
    batches: u64,
) -> anyhow::Result<Resume> {
    let summary = run_dir.summary();
    if let Ok(bytes) = std::fs::read(&summary) {
        // Written whole (atomically) by the launcher, so a summary that is not JSON was changed
        // or damaged since; it only says whether the run finished, which the user can tell.
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            anyhow::anyhow!(
                "{} is not JSON ({e}): the launcher writes it whole, so it was changed or damaged since; it only says whether the run finished (the ledgers say what was trained), so if the run did not finish, move it away and resume again",
                summary.display()
            )
        })?;
        if v["ok"] == true {
            bail!(
                "{} finished: every sample was trained ({}); nothing to resume",
                run_dir.path().display(),
                summary.display()
            );
        }
    }
    let ckpt = run_dir.checkpoint();
    let kept = run_dir.kept_export_steps();
    let recorded = proto::checkpointed::read(run_dir)?;
    let ours = ckpt.exists();
    let checkpointed = ours || recorded.is_some();
    // Which drafter wrote the run's checkpoint is told by its file, not by config.toml: a
    // [drafter] command may wrap hspipe's own drafter worker, which writes ours. Both files, or
    // a recorded step for hspipe's own drafter (config.toml's [drafter] command edited since),
    // would resume from a step whose weights the drafter does not load, or from the start with
    // those batches counted trained.
    match (ours, recorded, cfg.drafter.command.is_some()) {
        (true, Some(s), _) => bail!(
            "{} (hspipe's own drafter's checkpoint) and {} (step {s}, recorded by a drafter of your own) are both there, but a run has one kind of drafter: move away the one the run's drafter did not write, and resume again",
            ckpt.display(),
            run_dir.checkpointed_step().display()
        ),
        (false, Some(s), false) => bail!(
            "{} records step {s} saved by a drafter of your own ([drafter] command), but the run's drafter is hspipe's own, which does not load that drafter's file: was [drafter] command changed in {} since? Put it back to resume the run as it was trained",
            run_dir.checkpointed_step().display(),
            run_dir.config().display()
        ),
        _ => {}
    }
    let step = match recorded {
        // The drafter saved its weights of this step (its own file), and said so last.
        Some(s) => u32::try_from(s).with_context(|| {
            format!(
                "{}: step {s} is past the group's last (2^32 - 1)",
                run_dir.checkpointed_step().display()
            )
        })?,
        None if ours => {
            let mut d = gpu::drafter(backend, cfg, None)?;
            d.load(&ckpt).with_context(|| {
                "the checkpoint does not load, so the run cannot resume from it (move it away to start the drafter over)".to_string()
            })?;
            u32::try_from(d.step()).context("checkpoint step out of range")?
        }
        None => {
            // A drafter without its checkpoint starts over from step 0 (the checkpoint moved
            // away, as a failed load says to): the kept exports are another drafter's, which it
            // would remove as after its checkpoint, or replace as it kept their steps again. A
            // week's exports are the user's to keep or delete, not the resume's. One alone is
            // what a leader killed between its first keep and its first checkpoint leaves (a
            // kept step is a checkpoint step): removed below as after step 0, as a kill at any
            // later keep is.
            if kept.len() > 1 {
                let steps: Vec<String> = kept.iter().map(|s| format!("step-{s}")).collect();
                bail!(
                "{} holds kept exports ({}) but the run has no checkpoint ({}), so the resumed drafter starts over from step 0 and would remove or replace them; move {} out of the run directory to keep them (each stays a drafter `launcher eval --drafter` takes), or delete it, and resume again",
                run_dir.kept_exports_dir().display(),
                steps.join(", "),
                ckpt.display(),
                run_dir.kept_exports_dir().display()
            );
            }
            0
        }
    };
    let lost = ledger::read_lost(run_dir)?;
    let mut ledgers = Vec::new();
    let (mut done, mut dropped) = (BTreeSet::new(), Dropped::default());
    // The run had at least as many drafters as its highest ledger with a line says: a drafter
    // given up before its model loaded has none, one given up before it trained an empty one
    // (the worker creates it at start: counted, a run that lost a GPU to a drafter that never
    // trained could not be resumed without it), and those after it still count.
    let mut had = 0;
    for d in ledger::indices(run_dir)? {
        let path = run_dir.ledger(d);
        let Some(entries) = ledger::read(run_dir, d)? else {
            continue;
        };
        if !entries.is_empty() {
            had = d + 1;
        }
        let mut keep = Vec::new();
        for (n, entry) in entries.into_iter().enumerate() {
            // Dropped as torn, a damaged line would send its batch to be trained again on top
            // of the update the checkpoint may hold: its samples twice in the weights, and
            // nothing would say so.
            if let (None, Some(why)) = (&entry.line, ledger::damaged(&entry.text)) {
                bail!(
                    "{}:{}: not a ledger line, nor the start of one a kill cut short ({why}): the file was changed or damaged, and which batch the line recorded cannot be told; restore the line, or delete it to train its batch again (if its update is in the checkpoint, that batch's samples are then trained twice)",
                    path.display(),
                    n + 1
                );
            }
            match entry.line {
                Some(l) if l.step <= u64::from(step) && !ledger::LostSteps::any_has(&lost, &l) => {
                    if l.batch_id >= batches {
                        bail!(
                            "{} names batch {}, but the run's plan has {batches}: did its data change?",
                            path.display(),
                            l.batch_id
                        );
                    }
                    done.insert(l.batch_id);
                    keep.push(entry.text);
                }
                Some(l) if l.step > u64::from(step) => dropped.after += 1,
                Some(_) => dropped.lost += 1,
                None => dropped.torn += 1,
            }
        }
        ledgers.push((path, keep));
    }
    if had > drafters {
        // Where the run's own lists are recorded and fit, the command that uses them is the
        // way out; a run without the record needs the lists spelled out.
        let own = run_dir.read_gpus().ok().flatten();
        let hint = match own {
            Some(own) if own.drafters.len() as u32 >= had => format!(
                "; `{}` alone resumes on the run's own GPUs (--targets {} --drafters {})",
                command(run_dir.path()),
                format_gpu_list(&own.targets),
                format_gpu_list(&own.drafters)
            ),
            _ => String::new(),
        };
        bail!(
            "the run had {had} drafters (its ledgers go up to {}); resume it with at least as many --drafters, not {drafters}{hint}",
            run_dir.ledger(had - 1).display()
        );
    }
    // The leader keeps a step's export before it writes the step's checkpoint: one killed in
    // between left a kept export of updates that are lost, as the ledger lines after the
    // checkpoint are. The resumed run would replace it only if it kept that step again, which
    // it may never do (more drafters train the same batches in fewer steps; another
    // keep_export_every), and the summary would list it as the drafter of that step.
    let kept_after = (kept.into_iter())
        .filter(|&s| s > u64::from(step))
        .map(|s| run_dir.kept_export(s))
        .collect();
    Ok(Resume {
        step,
        checkpointed,
        done,
        ledgers,
        dropped,
        lost_steps: run_dir.lost_steps(),
        kept_after,
        summary,
    })
}

impl Resume {
    /// Rewrites the ledgers to the lines kept (atomically: a crash leaves the old ledger or
    /// the new one), then removes the record of lost steps, whose lines are gone: the resumed
    /// run may use those step numbers again. A crash between the two leaves the record for the
    /// next resume, which drops nothing more. Then removes the kept exports of steps after the
    /// checkpoint's, saying so.
    pub fn apply(&self) -> anyhow::Result<()> {
        // The last launch's summary is not this one's: left, a kill of this launch had the
        // next launcher say the run "had finished" and `launcher report` draw the last launch's
        // outcome as the run's. This launch writes its own at its end.
        match std::fs::remove_file(&self.summary) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", self.summary.display()));
            }
            _ => {}
        }
        self.rewrite_ledgers()?;
        for dir in &self.kept_after {
            match atomic_file::remove_dir(dir) {
                Ok(()) => println!(
                    "removed {}: kept after the checkpoint's step ({}), its updates are trained again",
                    dir.display(),
                    self.step
                ),
                Err(e) => println!("warning: removing {}: {e}", dir.display()),
            }
        }
        Ok(())
    }

    /// The ledgers and the record of lost steps, as [`apply`](Self::apply) says.
    fn rewrite_ledgers(&self) -> anyhow::Result<()> {
        for (path, keep) in &self.ledgers {
            let mut text = keep.join("\n");
            if !text.is_empty() {
                text.push('\n');
            }
            atomic_file::replace(path, text.as_bytes())
                .with_context(|| format!("replacing {}", path.display()))?;
        }
        let lost = &self.lost_steps;
        match std::fs::remove_file(lost) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            removed => removed
                .and_then(|()| atomic_file::sync_dir(lost.parent().unwrap_or(Path::new("."))))
                .with_context(|| format!("removing {}", lost.display())),
        }
    }
}

/// Removes what killed writers left in `run_dir` (a checkpoint's temporary file, an export's
/// temporary or moved-aside directory, a kept export's, a worker log's rotated part's:
/// `atomic_file::leftovers`) and says what it removed: at a resume's start and at the run's
/// end. A checkpoint's temporary is as big as the checkpoint, and nothing else would ever remove
/// it; a kept export's temporary is never taken for a kept export (`RunDir::kept_export_steps`),
/// but it holds the drafter's size.
pub(crate) fn sweep_leftovers(run_dir: &RunDir) {
    let kept = atomic_file::replaced_dirs_in(&run_dir.kept_exports_dir()).unwrap_or_else(|e| {
        println!(
            "warning: looking for leftovers in {}: {e}",
            run_dir.kept_exports_dir().display()
        );
        Vec::new()
    });
    let dirs: Vec<PathBuf> = std::iter::once(run_dir.export_dir()).chain(kept).collect();
    for dir in &dirs {
        match atomic_file::restore_dir(dir) {
            Ok(Some(from)) => println!(
                "put {} back from {}, where a writer that was killed had moved it",
                dir.display(),
                from.display()
            ),
            Ok(None) => {}
            Err(e) => println!("warning: putting back {}: {e}", dir.display()),
        }
    }
    // A worker log's rotated part (`log_cap`), as large as `--log-cap`: beside each log there.
    let logs = std::fs::read_dir(run_dir.logs_dir()).into_iter().flatten();
    let rotated = (logs.filter_map(|e| e.ok().map(|e| e.path())))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .map(|p| proto::run_dir::rotated(&p));
    for path in std::iter::once(run_dir.checkpoint())
        .chain(dirs)
        .chain(rotated)
    {
        let found = match atomic_file::leftovers(&path) {
            Ok(found) => found,
            Err(e) => {
                println!(
                    "warning: looking for leftovers beside {}: {e}",
                    path.display()
                );
                continue;
            }
        };
        for p in found {
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            match removed {
                Ok(()) => println!("removed {}, left by a writer that was killed", p.display()),
                Err(e) => println!("warning: removing {}: {e}", p.display()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proto::{PipelineConfig, RunDir};

    /// The run in a new directory whose drafter-0 ledger is `text`, resumed with one drafter
    /// (no checkpoint: step 0, and every line below is of step 0).
    fn resume(text: &[u8]) -> anyhow::Result<super::Resume> {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::create_dir_all(run.ledger(0).parent().unwrap()).unwrap();
        std::fs::write(run.ledger(0), text).unwrap();
        super::check(
            &run,
            &PipelineConfig::default(),
            gpu::BackendKind::Mock,
            1,
            10,
        )
    }

    /// A resume removes the last launch's summary.json as it starts: a kill of the resumed
    /// launch left it, and the next launcher said the run "had finished", `launcher report`
    /// drew the last launch's outcome as the run's.
    #[test]
    fn a_resume_removes_the_last_launchs_summary() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::write(run.summary(), r#"{"ok": false, "exit_code": 130}"#).unwrap();
        let cfg = PipelineConfig::default();
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10).unwrap();
        assert!(run.summary().exists(), "checked, not yet applied");
        r.apply().unwrap();
        assert!(!run.summary().exists());
    }

    /// A summary.json that is not JSON (edited, damaged) refuses the resume, naming the file
    /// and the way on; one whose bytes are not even UTF-8 was taken for no summary at all.
    #[test]
    fn a_damaged_summary_says_what_to_do() {
        for bad in [&b"{\"ok\": tr"[..], b"\xff{\"ok\": true}"] {
            let dir = tempfile::tempdir().unwrap();
            let run = RunDir::new(dir.path());
            std::fs::write(run.summary(), bad).unwrap();
            let err = super::check(
                &run,
                &PipelineConfig::default(),
                gpu::BackendKind::Mock,
                1,
                10,
            )
            .map(|_| ())
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("summary.json is not JSON") && err.contains("move it away"),
                "{err}"
            );
        }
    }

    /// A leader killed while it kept an export left `.step-<S>.new-<pid>`, looking like a
    /// directory of the export's files: it is no kept export, and the sweep a resume's start and
    /// every run's end make removes it (and puts back a kept export it had moved aside), leaving
    /// the whole kept exports as they are.
    #[test]
    fn a_killed_keepers_temporary_is_no_kept_export_and_is_swept() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let kept = run.kept_exports_dir();
        let dead = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            child.wait().unwrap();
            child.id()
        };
        let export = |d: &std::path::Path| {
            std::fs::create_dir_all(d).unwrap();
            for f in ["config.json", "model.safetensors"] {
                std::fs::write(d.join(f), f).unwrap();
            }
        };
        export(&run.kept_export(4));
        export(&kept.join(format!(".step-8.new-{dead}")));
        // Moved aside by a writer that could not exchange (step 12 being kept again after a
        // resume), then killed before the new one went in.
        export(&kept.join(format!(".step-12.old-{dead}")));
        export(&kept.join(format!(".step-12.new-{dead}")));
        assert_eq!(run.kept_export_steps(), [4]);
        super::sweep_leftovers(&run);
        let mut names: Vec<String> = std::fs::read_dir(&kept)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["step-12", "step-4"]);
        assert_eq!(run.kept_export_steps(), [4, 12]);
        assert!(run.kept_export(12).join("model.safetensors").is_file());
    }

    /// A launcher killed while it rotated a worker's log (`log_cap`) left the rotated part's
    /// temporary, as large as `--log-cap`: swept with the others, the log left as it is.
    #[test]
    fn a_killed_rotations_temporary_is_swept() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        run.lay_out().unwrap();
        let name = shm_ring::WorkerName::consumer(0);
        std::fs::write(run.log(name), "its log\n").unwrap();
        let dead = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            child.wait().unwrap();
            child.id()
        };
        let tmp = run
            .logs_dir()
            .join(format!(".drafter-0.log.1.{dead}.x1y2.tmp"));
        std::fs::write(&tmp, "half a copy").unwrap();
        super::sweep_leftovers(&run);
        assert!(!tmp.exists());
        assert_eq!(std::fs::read_to_string(run.log(name)).unwrap(), "its log\n");
    }

    /// A leader killed between keeping step 12's export and writing its checkpoint left
    /// `step-12` of updates the resume from step 8 trains again: the resume removes it (the run
    /// may never keep step 12 again), and keeps those of the checkpoint's step and before.
    #[test]
    fn a_resume_removes_the_kept_exports_after_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let cfg = PipelineConfig::default();
        let mut d = gpu::drafter(gpu::BackendKind::Mock, &cfg, None).unwrap();
        d.skip_to(8);
        std::fs::create_dir_all(run.checkpoints_dir()).unwrap();
        d.save(&run.checkpoint()).unwrap();
        for step in [4, 8, 12] {
            kept_export(&run, step);
        }
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10).unwrap();
        assert_eq!(r.step, 8);
        assert_eq!(run.kept_export_steps(), [4, 8, 12], "check changes nothing");
        r.apply().unwrap();
        assert_eq!(run.kept_export_steps(), [4, 8]);
        let names = std::fs::read_dir(run.kept_exports_dir()).unwrap().count();
        assert_eq!(names, 2, "no temporary left");
    }

    /// A drafter given up before its model loaded never opens its ledger, while those after it
    /// train: ledgers 0 and 2, none for 1. Their batches are all trained (read up to the first
    /// missing file, drafter-2's were trained again on top of their updates, and its lines
    /// after the checkpoint were kept), and the run had three drafters, so a resume with fewer
    /// is refused.
    #[test]
    fn a_ledger_after_a_drafter_that_never_trained_still_counts() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::create_dir_all(run.ledger_dir()).unwrap();
        std::fs::write(run.ledger(0), format!("{}\n{}\n", line(0), line(1))).unwrap();
        let after = line(5).replace(r#""step":0"#, r#""step":1"#);
        std::fs::write(
            run.ledger(2),
            format!("{}\n{}\n{after}\n", line(2), line(3)),
        )
        .unwrap();
        // Not ledgers: a name no drafter writes, and a rewrite's temporary. An empty one is a
        // drafter's that never trained: not one more the resume needs.
        std::fs::write(run.ledger_dir().join("drafter-01.jsonl"), line(7)).unwrap();
        std::fs::write(run.ledger(3), "").unwrap();
        std::fs::write(run.ledger_dir().join(".drafter-0.jsonl.new-1"), line(8)).unwrap();
        let cfg = PipelineConfig::default();
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 3, 10).unwrap();
        assert_eq!(r.done.iter().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(r.dropped.after, 1, "drafter-2's line after the checkpoint");
        assert_eq!(r.dropped.total(), 1);
        r.apply().unwrap();
        let two = std::fs::read_to_string(run.ledger(2)).unwrap();
        assert_eq!(two, format!("{}\n{}\n", line(2), line(3)));
        let err = super::check(&run, &cfg, gpu::BackendKind::Mock, 2, 10)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the run had 3 drafters") && err.contains("drafter-2.jsonl"),
            "{err}"
        );
    }

    /// Without its checkpoint (moved away, as a failed load says to) the drafter starts over:
    /// the kept exports are refused, left as they were, not removed as after step 0 (a week's
    /// drafters gone before the run had started again). One alone is a kill's between the first
    /// keep and the first checkpoint, and is removed as before.
    #[test]
    fn a_resume_without_a_checkpoint_leaves_the_kept_exports_and_says_to_move_them() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let keep = |step: u64| kept_export(&run, step);
        // One kept export and no checkpoint: the leader was killed between its first keep and
        // its first checkpoint. Removed as after step 0, as before.
        keep(6);
        let cfg = PipelineConfig::default();
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10).unwrap();
        assert_eq!(r.step, 0);
        r.apply().unwrap();
        assert_eq!(run.kept_export_steps(), Vec::<u64>::new());
        for step in [6, 12] {
            keep(step);
        }
        let err = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("kept exports (step-6, step-12) but the run has no checkpoint")
                && err.contains("move"),
            "{err}"
        );
        assert_eq!(run.kept_export_steps(), [6, 12]);
    }

    /// A kept export of `step` in `run` (its config alone: the resume looks at directories).
    fn kept_export(run: &RunDir, step: u64) {
        std::fs::create_dir_all(run.kept_export(step)).unwrap();
        std::fs::write(run.kept_export(step).join("config.json"), "{}").unwrap();
    }

    fn line(batch: u64) -> String {
        line_of(batch, 0)
    }

    /// The ledger line of `batch`, trained in group step `step`.
    fn line_of(batch: u64, step: u64) -> String {
        format!(
            r#"{{"batch_id":{batch},"sample_ids":[{batch}],"tokens":1,"delivery":0,"ticket":{batch},"step":{step},"digest":"","epoch":1}}"#
        )
    }

    /// A run whose drafter is a command of the user's own (a Python drafter).
    fn own_drafter() -> PipelineConfig {
        let mut cfg = PipelineConfig::default();
        cfg.drafter.command = Some(vec!["python".into(), "drafter.py".into()]);
        cfg
    }

    /// A drafter of one's own that recorded step 4 saved: the resume goes on from step 4,
    /// keeping the lines of steps up to it (their batches done, never trained again) and
    /// dropping the later ones, as from our checkpoint. Before, such a run had no checkpoint
    /// hspipe knew of: it resumed at step 0, every batch trained again.
    #[test]
    fn a_resume_goes_on_from_the_step_a_drafter_of_ones_own_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::create_dir_all(run.ledger_dir()).unwrap();
        let lines = [line_of(0, 1), line_of(1, 4), line_of(2, 5), line_of(3, 6)];
        std::fs::write(run.ledger(0), lines.join("\n") + "\n").unwrap();
        let cfg = own_drafter();
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10).unwrap();
        assert_eq!((r.step, r.checkpointed), (0, false), "nothing recorded yet");
        proto::checkpointed::record(&run, 4, 5).unwrap();
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10).unwrap();
        assert_eq!((r.step, r.checkpointed), (4, true));
        assert_eq!(r.done.iter().copied().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(r.dropped.after, 2);
        r.apply().unwrap();
        let kept = std::fs::read_to_string(run.ledger(0)).unwrap();
        assert_eq!(kept, format!("{}\n{}\n", lines[0], lines[1]));
    }

    /// A resume's line says why each dropped ledger line is dropped: a run whose lone drafter
    /// lost steps 2..=3 (recorded lost, before the checkpoint at 4) and trained step 5 after it.
    /// The lost updates' lines were counted as "after the checkpoint" before.
    #[test]
    fn a_resume_says_which_dropped_lines_were_after_the_checkpoint_and_which_lost() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::create_dir_all(run.ledger_dir()).unwrap();
        let lines = [line_of(0, 1), line_of(1, 2), line_of(2, 3), line_of(3, 5)];
        std::fs::write(run.ledger(0), lines.join("\n") + "\n").unwrap();
        let lost = proto::ledger::LostSteps::between(0, 1, 3).unwrap();
        proto::ledger::record_lost(&run, &lost, &mut |_| false).unwrap();
        let cfg = own_drafter();
        proto::checkpointed::record(&run, 4, 5).unwrap();
        let r = super::check(&run, &cfg, gpu::BackendKind::Mock, 1, 10).unwrap();
        assert_eq!(r.done.iter().copied().collect::<Vec<_>>(), [0]);
        let want = super::Dropped {
            after: 1,
            lost: 2,
            torn: 0,
        };
        assert_eq!(r.dropped, want);
        assert_eq!(
            r.dropped.to_string(),
            "3 ledger line(s) dropped (1 after the checkpoint, 2 in lost updates)"
        );
    }

    /// The run's checkpoints were written by one kind of drafter: our checkpoint beside a
    /// drafter of one's own, or a step recorded by one beside ours (config.toml's `[drafter]
    /// command` edited since), is refused, naming the file and what to do, not resumed from a
    /// step whose weights the drafter does not load.
    #[test]
    fn a_checkpoint_of_the_other_kind_of_drafter_is_refused() {
        let refused = |cfg: &PipelineConfig, run: &RunDir| {
            super::check(run, cfg, gpu::BackendKind::Mock, 1, 10)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        proto::checkpointed::record(&run, 3, 3).unwrap();
        let e = refused(&PipelineConfig::default(), &run);
        assert!(
            e.contains("step.json records step 3 saved by a drafter of your own")
                && e.contains("[drafter] command changed"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let cfg = PipelineConfig::default();
        let d = gpu::drafter(gpu::BackendKind::Mock, &cfg, None).unwrap();
        std::fs::create_dir_all(run.checkpoints_dir()).unwrap();
        d.save(&run.checkpoint()).unwrap();
        // Our checkpoint beside a [drafter] command: the command wraps our drafter worker
        // (as `uv run` does), which wrote it; the resume goes on from it. It was refused as a
        // checkpoint the command could not load, and the resume the launcher printed failed.
        let r = super::check(&run, &own_drafter(), gpu::BackendKind::Mock, 1, 10).unwrap();
        assert!(r.checkpointed);
        // Both kinds of checkpoint: one run has one kind of drafter.
        proto::checkpointed::record(&run, 3, 3).unwrap();
        let e = refused(&own_drafter(), &run);
        assert!(
            e.contains("drafter.safetensors (hspipe's own drafter's checkpoint) and")
                && e.contains("are both there"),
            "{e}"
        );
    }

    /// A line a kill cut short (the start of a line, or a crash's NUL bytes), ended by the
    /// next writer and followed by more lines, is dropped; a line changed by hand or damaged
    /// in the middle of a ledger is an error naming the file and line, since dropping it would
    /// train its batch again on top of its update in the checkpoint.
    #[test]
    fn a_damaged_ledger_line_is_refused_and_a_torn_one_dropped() {
        let torn = format!("{}\n{}\n\0\0\0\0\n{}\n", line(0), &line(1)[..25], line(2));
        let r = resume(torn.as_bytes()).unwrap();
        assert_eq!((r.done.len(), r.dropped.torn, r.dropped.total()), (2, 2, 2));
        for bad in [
            b"garbage{{{".to_vec(),
            b"\xff\xfe not text".to_vec(),
            br#"{"batch_id":1}"#.to_vec(),
        ] {
            let mut text = format!("{}\n", line(0)).into_bytes();
            text.extend_from_slice(&bad);
            text.extend_from_slice(format!("\n{}\n", line(2)).as_bytes());
            let err = format!("{:#}", resume(&text).unwrap_err());
            assert!(
                err.contains("drafter-0.jsonl:2: not a ledger line"),
                "{err}"
            );
        }
    }

    /// The GPU lists `launcher --resume DIR [more]` runs on, where DIR's `gpus.json` is
    /// `record`; the error, with its chain, if they are refused (as a usage error).
    fn lists_of(record: &str, more: &[&str]) -> Result<proto::GpuLists, String> {
        use clap::Parser;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(RunDir::new(dir.path()).gpus(), record).unwrap();
        let resume = ["launcher", "--resume", dir.path().to_str().unwrap()];
        let cli = crate::Cli::try_parse_from([&resume[..], more].concat()).unwrap();
        crate::gpu_lists(&cli.run.unwrap()).map_err(|e| {
            assert!(e.downcast_ref::<crate::UsageError>().is_some(), "{e:#}");
            format!("{e:#}")
        })
    }

    /// `gpus.json` can be edited: a resume checks its lists as the command line's (GPUs 0 to
    /// 1023, none twice, at most 16 drafters, a GPU in both lists only with --share-gpus),
    /// naming the file. Before, the record was taken as it was: an overlap ran without
    /// --share-gpus and GPU 99999999 got a worker. A run started with --share-gpus says so in
    /// its record, and resumes on it without the flag.
    #[test]
    fn a_resume_checks_the_recorded_gpu_lists_as_the_command_lines() {
        for (record, says) in [
            (
                r#"{"targets":[0,1],"drafters":[1],"share_gpus":false}"#,
                "GPU(s) [1] are in both --targets and --drafters; pass --share-gpus",
            ),
            (
                r#"{"targets":[99999999],"drafters":[1]}"#,
                "in its targets list: GPU 99999999 is out of range (at most 1023)",
            ),
            (
                r#"{"targets":[0],"drafters":[1,1]}"#,
                "in its drafters list: GPU 1 is listed twice",
            ),
            (
                r#"{"targets":[0],"drafters":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#,
                "--drafters lists 17 GPUs",
            ),
        ] {
            let e = lists_of(record, &[]).unwrap_err();
            assert!(e.contains("gpus.json") && e.contains(says), "{record}: {e}");
        }
        let overlap = r#"{"targets":[0,1],"drafters":[1],"share_gpus":false}"#;
        let shared = lists_of(overlap, &["--share-gpus"]).unwrap();
        assert_eq!(shared.share_gpus, Some(true), "{shared:?}");
        let recorded = r#"{"targets":[0,1],"drafters":[1],"share_gpus":true}"#;
        assert_eq!(lists_of(recorded, &[]).unwrap(), shared);
        // An earlier build's record says nothing of --share-gpus: its lists were checked when
        // the run started, and its printed `launcher --resume DIR` must still work.
        let earlier = r#"{"targets":[0,1],"drafters":[1]}"#;
        assert_eq!(lists_of(earlier, &[]).unwrap(), shared);
        // A bad list the command line replaces is no obstacle (the error says to give it).
        let bad = r#"{"targets":[99999999],"drafters":[1],"share_gpus":false}"#;
        let given = lists_of(bad, &["--targets", "0"]).unwrap();
        assert_eq!((given.targets, given.drafters), (vec![0], vec![1]));
    }
}
