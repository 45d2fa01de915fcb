//! The run directory: a contract between the launcher (which lays it out), the workers (which
//! write their ledgers, the checkpoint and their logs into it), `shm-ring-stat --run-dir`,
//! `launcher report`, a later `--resume` and the tests. Every path in it is a method of
//! [`RunDir`], so no process spells a file name of its own; the README's "The run directory"
//! lists the same files for users.
//!
//! What a drafter's ledger holds, and every reading and writing of one, is `crate::ledger`'s.
//!
//! Length: past 500 lines with its tests: one method per file of the run directory, and the
//! rules of who may lay one out or clear what an earlier launch left, kept with those names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use shm_ring::WorkerName;

/// The file in a run directory that holds the name of the run's ring: the launcher writes it
/// ([`RunDir::write_ring_name`]) and `shm-ring-stat --run-dir` reads it ([`RunDir::ring_file`]).
pub const RUN_DIR_RING_FILE: &str = "ring";

/// How the TensorBoard event files in [`RunDir::tensorboard_dir`] are named:
/// `events.out.tfevents.<seconds>.<host>.<pid>`, TensorFlow's own naming (TensorBoard finds
/// files by `tfevents` in the name and reads a folder's files in name order, so by time).
pub const TB_EVENTS_PREFIX: &str = "events.out.tfevents.";

/// Where the earlier part of the log at `log` goes when the log is rotated: `log` with `.1`
/// appended (`target-0.log.1`), as logrotate names it.
pub fn rotated(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// A run directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDir(PathBuf);

/// The GPUs a run's workers use, in worker order (target `i` on `targets[i]`), as the run's
/// last launcher was given them: `launcher --resume RUN_DIR` alone resumes on these.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuLists {
    pub targets: Vec<u32>,
    pub drafters: Vec<u32>,
    /// Whether the lists were accepted with `--share-gpus` (a GPU may be in both): a resume on
    /// them as they are needs not be told again. None: a record of a build before it was kept,
    /// whose lists were checked when that run started, and are trusted so.
    #[serde(default)]
    pub share_gpus: Option<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{what} {path}: {cause}")]
    Io {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error(
        "run directory {dir} already holds a run ({sub} is not empty): pick another --run-dir, or continue that run if it did not finish: `launcher --resume {}`",
        shell_word(.dir)
    )]
    HoldsRun { dir: PathBuf, sub: PathBuf },
    #[error(
        "run directory {dir} is not empty and is not one hspipe laid out (it holds {entry}): its files would be overwritten; pick another --run-dir, a new or an empty one"
    )]
    NotEmpty { dir: PathBuf, entry: String },
    #[error("{path}: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error("run directory {dir} is {what}, not a directory: pick another --run-dir, a new or an empty directory")]
    NotADirectory { dir: PathBuf, what: &'static str },
}

/// `path` as a shell word, for a command printed to be copied (`launcher --resume DIR`): as it
/// is when it holds only characters a shell leaves alone, else in single quotes (a quote inside
/// closed, escaped and reopened), so a run directory with a space or a `$` runs as printed.
pub fn shell_word(path: &Path) -> String {
    let p = path.display().to_string();
    let plain = !p.is_empty()
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+,:@%=".contains(c));
    if plain {
        p
    } else {
        format!("'{}'", p.replace('\'', r"'\''"))
    }
}

fn io<'p>(what: &'static str, path: &'p Path) -> impl FnOnce(std::io::Error) -> RunDirError + 'p {
    move |source| RunDirError::Io {
        what,
        path: path.to_path_buf(),
        cause: source,
    }
}

impl RunDir {
    pub fn new(path: impl Into<PathBuf>) -> RunDir {
        RunDir(path.into())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `shm-ring-stat --run-dir`'s way to the run's ring: a file holding its name.
    pub fn ring_file(&self) -> PathBuf {
        self.0.join(RUN_DIR_RING_FILE)
    }

    /// The effective pipeline config (a resume reads it back).
    pub fn config(&self) -> PathBuf {
        self.0.join("config.toml")
    }

    /// The version of the batch plan the run was made with (`plan::PLAN_VERSION`, one line).
    pub fn plan_version(&self) -> PathBuf {
        self.0.join("plan-version")
    }

    /// Records the plan's version (this build's `plan::PLAN_VERSION`), its fingerprint and the
    /// config fields that decided it (`plan::plan_fields`, a JSON line), atomically: a crash
    /// leaves none or all. A build that reads only the first two lines reads this file too.
    pub fn write_plan_version(
        &self,
        plan: &crate::plan::PlanDigest,
        fields: &BTreeMap<String, String>,
    ) -> Result<(), RunDirError> {
        let p = self.plan_version();
        let fields = serde_json::to_string(fields).expect("a map of strings serialises");
        let text = format!(
            "{}\n{} {:08x}\n{fields}\n",
            crate::plan::PLAN_VERSION,
            plan.batches,
            plan.crc
        );
        atomic_file::replace(&p, text.as_bytes()).map_err(io("writing", &p))
    }

    /// Refuses to resume a run planned with another version of the plan (or, with no record,
    /// by a build from before versions were recorded: version 1), or whose config and data now
    /// plan other batches than the run started with (`now`; a record without a fingerprint is
    /// from a build before them, and not checked), naming the planning fields (`fields` now)
    /// whose values differ from the recorded ones.
    pub fn check_plan_version(
        &self,
        now: &crate::plan::PlanDigest,
        fields: &BTreeMap<String, String>,
    ) -> Result<(), RunDirError> {
        let p = self.plan_version();
        let (text, missing) = match std::fs::read_to_string(&p) {
            Ok(t) => (t, false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => ("1".into(), true),
            Err(e) => return Err(io("reading", &p)(e)),
        };
        let invalid = |why: String| RunDirError::Invalid {
            path: p.clone(),
            why,
        };
        let mut lines = text.lines();
        let first = lines.next().unwrap_or("").trim();
        let was = (first.parse::<u32>())
            .map_err(|_| invalid(format!("{first:?} is not a plan version")))?;
        if was != crate::plan::PLAN_VERSION {
            // No record: a build from before versions were recorded, or a file removed since.
            let planned = if missing {
                "the file is missing, so the run was planned by a build before plan versions (version 1) or the file was removed".to_string()
            } else {
                format!("the run was planned with plan version {was}")
            };
            return Err(invalid(format!(
                "{planned}, this build plans version {}: its ledgers name other batches, so resuming would train some samples twice and others never; finish it with the build that started it",
                crate::plan::PLAN_VERSION
            )));
        }
        let Some(second) = lines.next().map(str::trim).filter(|l| !l.is_empty()) else {
            return Ok(());
        };
        let recorded = second.split_once(' ').and_then(|(b, c)| {
            Some(crate::plan::PlanDigest {
                batches: b.parse().ok()?,
                crc: u32::from_str_radix(c, 16).ok()?,
            })
        });
        match recorded {
            None => Err(invalid(format!("{second:?} is not a plan's fingerprint"))),
            Some(was) if was != *now => {
                // A record from a build before the fields were kept names none.
                let then: BTreeMap<String, String> = (lines.next())
                    .and_then(|l| serde_json::from_str(l).ok())
                    .unwrap_or_default();
                let changed: Vec<String> = (then.iter())
                    .filter_map(|(k, v)| {
                        let n = fields.get(k)?;
                        (n != v).then(|| format!("{k} was {v} and is now {n}"))
                    })
                    .collect();
                // The data's content plans too, and no field records it.
                let why = if changed.is_empty() {
                    "the config or the data changed since".to_string()
                } else {
                    format!(
                        "{} in its config.toml (or the data changed since)",
                        changed.join(", ")
                    )
                };
                Err(invalid(format!(
                    "the run started with a plan of {was}, and its config.toml and data now plan {now}: {why}, so the ledgers would name other batches; resume with what the run started with (a resume cannot change what the run trains: start a new run for that)"
                )))
            }
            Some(_) => Ok(()),
        }
    }

    /// The GPU lists the run last ran on ([`GpuLists`], JSON).
    pub fn gpus(&self) -> PathBuf {
        self.0.join("gpus.json")
    }

    /// Records the GPU lists the run runs on, replacing the record atomically (a resume that
    /// changes the lists rewrites it, and a crash then must leave the old lists or the new).
    pub fn write_gpus(&self, lists: &GpuLists) -> Result<(), RunDirError> {
        let p = self.gpus();
        let text = serde_json::to_string(lists).expect("a GpuLists always serialises");
        atomic_file::replace(&p, format!("{text}\n").as_bytes()).map_err(io("writing", &p))
    }

    /// The GPU lists as [`write_gpus`](Self::write_gpus) left them, or `None` for a run
    /// directory without the record (made by a build from before it was kept).
    pub fn read_gpus(&self) -> Result<Option<GpuLists>, RunDirError> {
        let p = self.gpus();
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("reading", &p)(e)),
        };
        let lists: GpuLists = serde_json::from_str(&text).map_err(|e| RunDirError::Invalid {
            path: p.clone(),
            why: format!("not a record of GPU lists: {e}"),
        })?;
        if lists.targets.is_empty() || lists.drafters.is_empty() {
            return Err(RunDirError::Invalid {
                path: p,
                why: "a run needs at least one target GPU and one drafter GPU".into(),
            });
        }
        Ok(Some(lists))
    }

    /// The data the run was planned from (`launcher::data::Record`).
    pub fn dataset_record(&self) -> PathBuf {
        self.0.join("dataset.json")
    }

    /// The target model the run trains its drafter for, by fingerprint (`model.json`, with a
    /// model only): a resume refuses another model at the same path.
    pub fn model_record(&self) -> PathBuf {
        self.0.join("model.json")
    }

    /// Everything the launcher printed.
    pub fn launcher_log(&self) -> PathBuf {
        self.0.join("launcher.log")
    }

    /// The monitor's ticks, one JSON line each.
    pub fn metrics(&self) -> PathBuf {
        self.0.join("metrics.jsonl")
    }

    /// The TensorBoard event files (`events.out.tfevents.*`), one per launcher: a resume adds
    /// one beside the earlier ones. `tensorboard --logdir` reads the folder.
    pub fn tensorboard_dir(&self) -> PathBuf {
        self.0.join("tb")
    }

    /// What the run did; `ok` true means every sample was trained once.
    pub fn summary(&self) -> PathBuf {
        self.0.join("summary.json")
    }

    pub fn logs_dir(&self) -> PathBuf {
        self.0.join("logs")
    }

    /// The log of worker `name` (`target-0`), all its incarnations (since its last rotation:
    /// [`rotated_log`](Self::rotated_log)).
    pub fn log(&self, name: WorkerName) -> PathBuf {
        self.logs_dir().join(format!("{name}.log"))
    }

    /// What the launcher moved out of worker `name`'s log when it last passed `--log-cap`
    /// (`target-0.log.1`): [`rotated`] of its [`log`](Self::log).
    pub fn rotated_log(&self, name: WorkerName) -> PathBuf {
        rotated(&self.log(name))
    }

    pub fn ledger_dir(&self) -> PathBuf {
        self.0.join("ledger")
    }

    /// Drafter `index`'s ledger.
    pub fn ledger(&self, index: u32) -> PathBuf {
        (self.ledger_dir()).join(format!("{}.jsonl", WorkerName::consumer(index)))
    }

    /// The drafters that have a ledger, in order. Not `0..n` up to the first missing file: a
    /// drafter opens its ledger only once its model loaded, so one given up before that (a
    /// model or GPU that never started) leaves a gap, and the ledgers after it are the run's as
    /// much as the ones before. No ledger directory is no ledgers; a directory that cannot be
    /// listed is an error, never taken for none (that would train every batch again).
    pub fn ledger_indices(&self) -> std::io::Result<Vec<u32>> {
        let entries = match self.ledger_dir().read_dir() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            r => r?,
        };
        let mut out = Vec::new();
        for e in entries {
            let name = e?.file_name();
            let Some(name) = name.to_str() else { continue };
            let worker = (name.strip_suffix(".jsonl")).and_then(|n| n.parse::<WorkerName>().ok());
            // Only the names a drafter writes: not `drafter-01.jsonl`, nor the temporary of a
            // ledger being rewritten.
            if let Some(w) = worker.filter(|w| w.role == shm_ring::Role::Consumer) {
                if self.ledger(w.index).file_name() == Some(name.as_ref()) {
                    out.push(w.index);
                }
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// The batches set aside (`--set-aside-after`), one JSON line each: never trained, named
    /// with their samples and the deaths held against them.
    pub fn set_aside(&self) -> PathBuf {
        self.0.join("set-aside.jsonl")
    }

    /// The group steps whose updates were lost when every drafter died, or skipped when the
    /// group diverged (`ledger::LostSteps`), one JSON line each.
    pub fn lost_steps(&self) -> PathBuf {
        self.0.join("lost-steps.jsonl")
    }

    /// The drafter's learning-rate schedule as the launcher worked it out for the run's last
    /// launch (its total steps, JSON), written only when the config sets none: a resume that
    /// works it out again says when it changed.
    pub fn schedule(&self) -> PathBuf {
        self.0.join("schedule.json")
    }

    pub fn checkpoints_dir(&self) -> PathBuf {
        self.0.join("checkpoints")
    }

    /// The group's one checkpoint: weights, optimizer state and step.
    pub fn checkpoint(&self) -> PathBuf {
        self.checkpoints_dir().join("drafter.safetensors")
    }

    /// The step a drafter of the user's own (`[drafter] command`) last said the group's weights
    /// are saved as of, in a file of its own (`checkpointed::record`): what `--resume` goes on
    /// from for such a run, as it does from [`checkpoint`](Self::checkpoint)'s step for ours.
    pub fn checkpointed_step(&self) -> PathBuf {
        self.checkpoints_dir().join("step.json")
    }

    /// The drafter as an inference engine loads it (`config.json`, `model.safetensors`),
    /// rewritten at every checkpoint by a drafter that exports (DFlash); the optimizer state
    /// stays in the checkpoint beside it, for `--resume`.
    pub fn export_dir(&self) -> PathBuf {
        self.0.join("drafter")
    }

    /// The exports kept along the run (`[drafter] keep_export_every`), one directory a step:
    /// [`kept_export`](Self::kept_export).
    pub fn kept_exports_dir(&self) -> PathBuf {
        self.0.join("drafter-steps")
    }

    /// The export of group step `step`, kept: `drafter-steps/step-<S>`, the step as every other
    /// place prints it (the monitor, `metrics.jsonl`, TensorBoard, the ledgers), not
    /// zero-padded, so the step a user saw a figure at names its directory as it reads.
    pub fn kept_export(&self, step: u64) -> PathBuf {
        self.kept_exports_dir().join(format!("step-{step}"))
    }

    /// The steps whose exports are kept, ascending: the directories named as
    /// [`kept_export`](Self::kept_export) names them. A writer's temporary directory
    /// (`.step-<S>.new-<pid>`, being built or left by a killed writer) is not one, and neither
    /// is any other name; none when the folder is missing or cannot be read.
    pub fn kept_export_steps(&self) -> Vec<u64> {
        let Ok(entries) = self.kept_exports_dir().read_dir() else {
            return Vec::new();
        };
        let mut steps: Vec<u64> = entries
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
                // `step-007` or `step-+7` are not names a writer makes.
                let canonical = name == format!("step-{step}");
                (canonical && e.file_type().ok()?.is_dir()).then_some(step)
            })
            .collect();
        steps.sort_unstable();
        steps
    }

    /// The NCCL group's rendezvous files of ring `ring` (`epoch-<n>.id`, `collective = "nccl"`).
    pub fn nccl_dir(&self, ring: &str) -> PathBuf {
        self.0.join("nccl").join(ring)
    }

    /// The marker a drafter's injected `crash_in_join` fault leaves, so only its first
    /// incarnation crashes there (a hidden file among the logs).
    pub fn join_crash_marker(&self, name: WorkerName) -> PathBuf {
        self.logs_dir().join(format!(".{name}-crashed-in-join"))
    }

    /// The file a launcher holds locked for its whole life (`flock`): one launcher a run.
    pub fn lock_file(&self) -> PathBuf {
        self.0.join(".lock")
    }

    /// `launcher report`'s picture, by default.
    pub fn report_svg(&self) -> PathBuf {
        self.0.join("report.svg")
    }

    /// Whether a new run may be laid out here: a directory that is missing or empty, or one an
    /// earlier launcher laid out (`ledger/` and `checkpoints/`, made first) and that ended
    /// before it trained anything (what that launch left goes: [`clear_earlier_launch`]).
    /// Refused: one that holds a run, whose ledgers, checkpoint or export would be silently
    /// reused or lost, and any other directory with something in it (a project's folder,
    /// `/`), whose `config.toml` or `logs/` a run would overwrite. `made`: a folder this launch
    /// made in it before laying it out (a `--data-cache` inside it), which does not count.
    ///
    /// [`clear_earlier_launch`]: Self::clear_earlier_launch
    pub fn check_new(&self, made: Option<&Path>) -> Result<(), RunDirError> {
        let entries = match self.0.read_dir() {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // A file named as the directory is said to be one: "reading notes.txt: Not a
            // directory" reads as a fault inside a directory.
            Err(e) => match std::fs::metadata(&self.0) {
                Ok(meta) if !meta.is_dir() => {
                    return Err(RunDirError::NotADirectory {
                        dir: self.0.clone(),
                        what: atomic_file::not_regular(&meta).unwrap_or("a file"),
                    })
                }
                _ => return Err(io("reading", &self.0)(e)),
            },
        };
        let made = made.and_then(|m| std::fs::canonicalize(m).ok());
        let holds_made = |e: &std::fs::DirEntry| {
            let m = made.as_ref();
            m.is_some_and(|m| std::fs::canonicalize(e.path()).is_ok_and(|p| m.starts_with(p)))
        };
        let mut first = None;
        for e in entries {
            let e = e.map_err(io("reading", &self.0))?;
            if !holds_made(&e) {
                first = Some(e);
                break;
            }
        }
        let Some(first) = first else {
            return Ok(());
        };
        // A run first, however little of one is left: that is the better thing to say. An
        // export without a checkpoint (moved away, as a resume that cannot load one advises)
        // is still a trained drafter.
        let run = [
            self.ledger_dir(),
            self.checkpoints_dir(),
            self.export_dir(),
            self.kept_exports_dir(),
        ];
        for sub in run {
            if sub.read_dir().is_ok_and(|mut d| d.next().is_some()) {
                return Err(RunDirError::HoldsRun {
                    dir: self.0.clone(),
                    sub,
                });
            }
        }
        if !(self.ledger_dir().is_dir() && self.checkpoints_dir().is_dir()) {
            return Err(RunDirError::NotEmpty {
                dir: self.0.clone(),
                entry: first.file_name().to_string_lossy().into_owned(),
            });
        }
        Ok(())
    }

    /// Lays out a new run directory (logs, ledger, checkpoints) where [`check_new`](Self::check_new)
    /// allows one.
    pub fn lay_out(&self) -> Result<(), RunDirError> {
        self.lay_out_with(None)
    }

    /// [`lay_out`](Self::lay_out), `made` being a folder this launch made in the directory
    /// first (see [`check_new`](Self::check_new)).
    pub fn lay_out_with(&self, made: Option<&Path>) -> Result<(), RunDirError> {
        self.check_new(made)?;
        for sub in [self.logs_dir(), self.ledger_dir(), self.checkpoints_dir()] {
            std::fs::create_dir_all(&sub).map_err(io("creating", &sub))?;
        }
        Ok(())
    }

    /// Removes what an earlier launch left in a directory [`check_new`](Self::check_new)
    /// allows a new run in (one that launch laid out and trained nothing in: stopped before its
    /// workers started, or failed as they started), so that the new run starts clean; returns
    /// what it removed, relative to the directory. Call it with the directory held (the
    /// launcher's `flock`), so that no launcher runs in it; it checks again that nothing was
    /// trained.
    ///
    /// Why removed, not kept or refused: what the launcher appends to (`metrics.jsonl`, the
    /// logs, `launcher.log`) would show the earlier launch's ticks, deaths and lines as this
    /// run's, so `launcher report` drew a run resumed, and `tb/`'s earlier event file moved the
    /// pipeline series' origin to that launch; `summary.json`, `set-aside.jsonl` or
    /// `lost-steps.jsonl` would be read as this run's until it rewrote them, if it did.
    /// Refusing the directory would make the usual way on after a launch that failed at start
    /// (fix the config, run the same command again) an error, and `--resume` is no way on for
    /// it: it runs the earlier launch's config, not the one given now. Nothing of worth goes:
    /// the earlier launch trained nothing. Only the files named by this type's methods go
    /// (the worker logs and their rotated parts by worker name, `tb/` by [`TB_EVENTS_PREFIX`],
    /// `nccl/` by its `epoch-` files), then their folders if that left them empty (not `logs/`,
    /// `ledger/` and `checkpoints/`, which the new run uses); anything else is left as it is.
    pub fn clear_earlier_launch(&self) -> Result<Vec<PathBuf>, RunDirError> {
        self.check_new(None)?;
        let mut removed = Vec::new();
        let mut remove = |p: PathBuf| -> Result<(), RunDirError> {
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io("removing", &p)(e)),
                Ok(()) => {
                    let rel = p.strip_prefix(&self.0).map(Path::to_path_buf);
                    removed.push(rel.unwrap_or(p));
                    Ok(())
                }
            }
        };
        for p in [
            self.config(),
            self.plan_version(),
            self.gpus(),
            self.dataset_record(),
            self.model_record(),
            self.ring_file(),
            self.launcher_log(),
            self.metrics(),
            self.summary(),
            self.set_aside(),
            self.lost_steps(),
            self.schedule(),
            self.report_svg(),
        ] {
            remove(p)?;
        }
        let is_worker = |n: &str| n.parse::<WorkerName>().is_ok();
        for p in entries(&self.logs_dir(), |n| {
            let log = (n.strip_suffix(".log").or_else(|| n.strip_suffix(".log.1")))
                .is_some_and(is_worker);
            let marker = (n.strip_prefix('.'))
                .and_then(|n| n.strip_suffix("-crashed-in-join"))
                .is_some_and(is_worker);
            log || marker
        })? {
            remove(p)?;
        }
        let tb = self.tensorboard_dir();
        for p in entries(&tb, |n| n.starts_with(TB_EVENTS_PREFIX))? {
            remove(p)?;
        }
        let nccl = self.0.join("nccl");
        for ring in entries(&nccl, |_| true)? {
            if ring.is_dir() {
                for p in entries(&ring, |n| n.starts_with("epoch-"))? {
                    remove(p)?;
                }
                remove_if_empty(&ring)?;
            }
        }
        for dir in [tb, nccl] {
            remove_if_empty(&dir)?;
        }
        if !removed.is_empty() {
            atomic_file::sync_dir(&self.0).map_err(io("syncing", &self.0))?;
        }
        Ok(removed)
    }

    /// Records the name of the run's ring (for `shm-ring-stat --run-dir`).
    pub fn write_ring_name(&self, ring: &str) -> Result<(), RunDirError> {
        let p = self.ring_file();
        std::fs::write(&p, format!("{ring}\n")).map_err(io("writing", &p))
    }

    /// The name of the run's ring, as [`write_ring_name`](Self::write_ring_name) left it.
    pub fn read_ring_name(&self) -> Result<String, RunDirError> {
        let p = self.ring_file();
        let text = std::fs::read_to_string(&p).map_err(io("reading", &p))?;
        Ok(text.trim().to_string())
    }
}

/// The entries of `dir` whose names `keep` takes (none where `dir` is missing or not a folder),
/// in name order.
fn entries(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>, RunDirError> {
    let read = match dir.read_dir() {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(Vec::new())
        }
        r => r.map_err(io("reading", dir))?,
    };
    let mut out = Vec::new();
    for e in read {
        let e = e.map_err(io("reading", dir))?;
        if e.file_name().to_str().is_some_and(&keep) {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

/// Removes the folder `dir` if it is empty; leaves it (or nothing) otherwise.
fn remove_if_empty(dir: &Path) -> Result<(), RunDirError> {
    match std::fs::remove_dir(dir) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::DirectoryNotEmpty
                    | std::io::ErrorKind::NotADirectory
            ) =>
        {
            Ok(())
        }
        r => r.map_err(io("removing", dir)),
    }
}

impl AsRef<Path> for RunDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_a_shell_would_split_or_expand_is_quoted() {
        let w = |p: &str| shell_word(Path::new(p));
        assert_eq!(w("runs/exp-1.2"), "runs/exp-1.2");
        assert_eq!(w("/home/me/my runs/a"), "'/home/me/my runs/a'");
        assert_eq!(w("it's $HOME"), r"'it'\''s $HOME'");
        assert_eq!(w(""), "''");
    }

    #[test]
    fn a_new_run_dir_is_laid_out_and_a_used_one_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path().join("run"));
        run.lay_out().unwrap();
        for d in [run.logs_dir(), run.ledger_dir(), run.checkpoints_dir()] {
            assert!(d.is_dir(), "{}", d.display());
        }
        // Laid out twice while still empty: fine (a run that failed before training).
        run.lay_out().unwrap();
        std::fs::write(run.checkpoint(), b"weights").unwrap();
        let e = run.lay_out().unwrap_err();
        let e = e.to_string();
        assert!(e.contains("already holds a run"), "{e}");
        // The way on for a run that was stopped, not only another directory.
        let resume = format!("`launcher --resume {}`", shell_word(run.path()));
        assert!(e.contains(&resume), "{e}");
    }

    /// A directory an earlier launch laid out and trained nothing in: a new run there removes
    /// what that launch wrote, by name, and leaves what it did not (a user's notes, a data cache,
    /// a file in `logs/` or `tb/` that no launch names so), so it starts clean. Before, its
    /// `metrics.jsonl`, logs and event files were appended to and read as the new run's. One
    /// that holds a run (a ledger line, a checkpoint, an export) is refused and left alone.
    #[test]
    fn an_earlier_launch_that_trained_nothing_is_cleared_and_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path().join("run"));
        run.lay_out().unwrap();
        let w = |p: PathBuf| {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"earlier launch\n").unwrap();
        };
        let ours = [
            run.config(),
            run.plan_version(),
            run.gpus(),
            run.dataset_record(),
            run.model_record(),
            run.ring_file(),
            run.launcher_log(),
            run.metrics(),
            run.summary(),
            run.set_aside(),
            run.lost_steps(),
            run.schedule(),
            run.report_svg(),
            run.log(WorkerName::producer(0)),
            run.log(WorkerName::consumer(11)),
            run.rotated_log(WorkerName::consumer(11)),
            run.join_crash_marker(WorkerName::consumer(1)),
            run.tensorboard_dir()
                .join(format!("{TB_EVENTS_PREFIX}1796595282.vm.9660")),
            run.nccl_dir("hspipe-1-2").join("epoch-0.id"),
        ];
        for p in &ours {
            w(p.clone());
        }
        let theirs = [
            run.path().join("notes.md"),
            run.path().join("data-cache/abc.arrow"),
            run.logs_dir().join("mine.log"),
            run.tensorboard_dir().join("projector_config.pbtxt"),
        ];
        for p in &theirs {
            w(p.clone());
        }
        run.lay_out().unwrap();
        let mut removed = run.clear_earlier_launch().unwrap();
        removed.sort();
        let mut want: Vec<PathBuf> = (ours.iter())
            .map(|p| p.strip_prefix(run.path()).unwrap().to_path_buf())
            .collect();
        want.sort();
        assert_eq!(removed, want);
        for p in &ours {
            assert!(!p.exists(), "{} is left", p.display());
        }
        for p in &theirs {
            assert!(p.is_file(), "{} is gone", p.display());
        }
        assert!(!run.path().join("nccl").exists(), "an emptied folder goes");
        assert!(
            run.tensorboard_dir().is_dir(),
            "a folder with a user's file stays"
        );
        for d in [run.logs_dir(), run.ledger_dir(), run.checkpoints_dir()] {
            assert!(d.is_dir(), "{}", d.display());
        }
        assert_eq!(run.clear_earlier_launch().unwrap(), Vec::<PathBuf>::new());

        // A trained run is no earlier launch's leftovers: refused, and nothing removed.
        for trained in [
            run.ledger(0),
            run.checkpoint(),
            run.export_dir().join("config.json"),
            run.kept_export(8).join("config.json"),
        ] {
            w(run.config());
            w(trained.clone());
            let e = run.clear_earlier_launch().unwrap_err();
            assert!(matches!(e, RunDirError::HoldsRun { .. }), "{e}");
            assert!(run.lay_out().is_err());
            assert!(run.config().is_file() && trained.is_file());
            std::fs::remove_file(&trained).unwrap();
        }
    }

    /// The kept exports are the `step-<S>` directories, in step order (not the names' order);
    /// a writer's temporary directory, a file, or a name no writer makes is none.
    #[test]
    fn kept_export_steps_are_the_whole_kept_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path());
        assert_eq!(run.kept_export_steps(), Vec::<u64>::new());
        for step in [1000, 200, 40] {
            std::fs::create_dir_all(run.kept_export(step)).unwrap();
        }
        assert_eq!(
            run.kept_export(200),
            tmp.path().join("drafter-steps/step-200")
        );
        let d = run.kept_exports_dir();
        for name in [".step-1200.new-4242", "step-007", "step-x", "notes"] {
            std::fs::create_dir(d.join(name)).unwrap();
        }
        std::fs::write(d.join("step-1400"), b"a file").unwrap();
        assert_eq!(run.kept_export_steps(), [40, 200, 1000]);
    }

    /// `--run-dir notes.txt` on an existing file was refused as "reading notes.txt: Not a
    /// directory", which reads as a fault inside a directory: it is said to be a file, and is
    /// left as it was.
    #[test]
    fn a_file_given_as_the_run_directory_is_refused_as_a_file() {
        let tmp = tempfile::tempdir().unwrap();
        let notes = tmp.path().join("notes.txt");
        std::fs::write(&notes, "mine\n").unwrap();
        let e = RunDir::new(&notes).lay_out().unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "run directory {} is a file, not a directory: pick another --run-dir, a new or an empty directory",
                notes.display()
            )
        );
        assert_eq!(std::fs::read_to_string(&notes).unwrap(), "mine\n");
    }

    /// `--run-dir proj` on a project's folder, or `--run-dir /`, wrote hspipe's `config.toml`,
    /// `logs/` and `ledger/` among its files: now a directory with something in it that hspipe
    /// did not lay out is refused, and left as it was.
    #[test]
    fn a_directory_that_is_not_a_run_and_not_empty_is_refused_and_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let proj = tmp.path().join("proj");
        std::fs::create_dir(&proj).unwrap();
        std::fs::write(proj.join("config.toml"), "[tool]\n").unwrap();
        let e = RunDir::new(&proj).lay_out().unwrap_err();
        assert!(matches!(&e, RunDirError::NotEmpty { entry, .. } if entry == "config.toml"));
        assert!(e.to_string().contains("pick another --run-dir"), "{e}");
        assert_eq!(
            std::fs::read_to_string(proj.join("config.toml")).unwrap(),
            "[tool]\n"
        );
        let names: Vec<_> = std::fs::read_dir(&proj)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["config.toml"], "nothing laid out");
        // An empty directory is a new run's, and so is one holding only the data cache this
        // launch prepared into it (`--data-cache` inside the run directory).
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        RunDir::new(&empty).lay_out().unwrap();
        let cached = tmp.path().join("cached");
        std::fs::create_dir_all(cached.join("cache/sub")).unwrap();
        let run = RunDir::new(&cached);
        assert!(matches!(run.lay_out(), Err(RunDirError::NotEmpty { .. })));
        run.lay_out_with(Some(&cached.join("cache/sub"))).unwrap();
    }

    /// A run planned by this build resumes; one with no record (a build from before plan
    /// versions: its shuffles were others) or another version is refused, naming why, and so
    /// is one whose plan now differs from the one recorded (not one whose record has none).
    #[test]
    fn a_resume_refuses_a_run_planned_with_another_plan_version_or_plan() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path());
        let plan = crate::plan::PlanDigest {
            batches: 35,
            crc: 0xdead_beef,
        };
        let cfg = crate::PipelineConfig::default();
        let fields = crate::plan::plan_fields(&cfg);
        let e = run
            .check_plan_version(&plan, &fields)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the file is missing") && e.contains("(version 1)"),
            "{e}"
        );
        run.write_plan_version(&plan, &fields).unwrap();
        run.check_plan_version(&plan, &fields).unwrap();
        let edited = crate::plan::PlanDigest {
            batches: 36,
            ..plan
        };
        // The config's epochs edited: named, with the value it had.
        let mut more = cfg.clone();
        more.data.epochs = 2;
        let now = crate::plan::plan_fields(&more);
        let e = run
            .check_plan_version(&edited, &now)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("35 batches, crc deadbeef")
                && e.contains("36 batches")
                && e.contains("data.epochs was 1 and is now 2 in its config.toml"),
            "{e}"
        );
        // A file's samples are its own: the synthetic count plans nothing there.
        let mut file = cfg.clone();
        file.data.path = Some("train.jsonl".into());
        let planning = crate::plan::plan_fields(&file);
        assert!(
            !planning.contains_key("data.synthetic_samples"),
            "{planning:?}"
        );
        assert_eq!(planning["data.path"], "train.jsonl");
        // No field changed: the data did, or a record from before the fields says none.
        let e = run
            .check_plan_version(&edited, &fields)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the config or the data changed since"), "{e}");
        let version = crate::plan::PLAN_VERSION;
        std::fs::write(run.plan_version(), format!("{version}\n35 deadbeef\n")).unwrap();
        let e = run
            .check_plan_version(&edited, &now)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the config or the data changed since"), "{e}");
        std::fs::write(run.plan_version(), format!("{version}\n")).unwrap();
        run.check_plan_version(&edited, &fields).unwrap();
        let other = version - 1;
        std::fs::write(run.plan_version(), format!("{other}\n")).unwrap();
        let e = run
            .check_plan_version(&plan, &fields)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("plan version {other}")) && e.contains("twice"),
            "{e}"
        );
        std::fs::write(run.plan_version(), "two\n").unwrap();
        let e = run
            .check_plan_version(&plan, &fields)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"two\""), "{e}");
        std::fs::write(run.plan_version(), format!("{version}\n35 x\n")).unwrap();
        let e = run
            .check_plan_version(&plan, &fields)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a plan's fingerprint"), "{e}");
    }

    /// The GPU lists read back as written (a rewrite replaces them); no record is `None`, and
    /// a damaged one an error naming the file.
    #[test]
    fn the_gpu_lists_read_back_and_a_missing_record_is_none() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path());
        assert_eq!(run.read_gpus().unwrap(), None);
        let lists = GpuLists {
            targets: vec![0, 1, 2, 6],
            drafters: vec![7],
            share_gpus: Some(false),
        };
        run.write_gpus(&lists).unwrap();
        assert_eq!(run.read_gpus().unwrap(), Some(lists));
        let other = GpuLists {
            targets: vec![3],
            drafters: vec![4, 5],
            share_gpus: Some(true),
        };
        run.write_gpus(&other).unwrap();
        assert_eq!(run.read_gpus().unwrap(), Some(other));
        for bad in ["{\"targets\": [0]", "{\"targets\": [], \"drafters\": [1]}"] {
            std::fs::write(run.gpus(), bad).unwrap();
            let e = run.read_gpus().unwrap_err().to_string();
            assert!(e.contains("gpus.json"), "{e}");
        }
    }

    #[test]
    fn the_ring_name_reads_back() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::new(tmp.path());
        run.lay_out().unwrap();
        run.write_ring_name("hspipe-1").unwrap();
        assert_eq!(run.read_ring_name().unwrap(), "hspipe-1");
        let e = RunDir::new(tmp.path().join("none"))
            .read_ring_name()
            .unwrap_err();
        assert!(e.to_string().contains("none"), "{e}");
    }
}
