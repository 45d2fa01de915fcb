//! What the group's leader writes: the checkpoint, the export and a kept export, each whole or
//! not at all.

use std::path::Path;
use std::sync::Once;

use anyhow::Context;
use gpu::DrafterBackend;
use proto::control::SaveReport;

/// The writes a fault fails, as a full disk would, once part of what they write is written.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Failing {
    /// The checkpoint's (`checkpoint_fails_from`).
    pub(crate) checkpoint: bool,
    /// The export's (`export_fails_at`).
    pub(crate) export: bool,
}

/// The injected full disk of fault `fault`: ENOSPC, 28 on every architecture Linux runs
/// hspipe on.
fn injected_full(fault: &'static str) -> anyhow::Error {
    anyhow::Error::new(std::io::Error::from_raw_os_error(28)).context(format!("injected: {fault}"))
}

/// Writes the checkpoint atomically: a crash, or a write that fails, leaves either the old
/// checkpoint or the new one, never half of one. `fail`: the injected full disk
/// (`checkpoint_fails_from`), once part of the file is written.
fn checkpoint(backend: &dyn DrafterBackend, path: &Path, fail: bool) -> anyhow::Result<()> {
    atomic_file::replace_with(path, |tmp| -> anyhow::Result<()> {
        backend.save(tmp)?;
        match fail {
            true => Err(injected_full("checkpoint_fails_from")),
            false => Ok(()),
        }
    })
    .with_context(|| format!("writing the checkpoint {}", path.display()))
}

/// Writes the export directory whole ([`atomic_file::replace_dir_with`]: synced, then swapped
/// in), so a reader, a crash or a power loss sees the old export or the new one, never a mix.
/// `fail`: the injected full disk (`export_fails_at`), once its files are written.
fn export(backend: &dyn DrafterBackend, dir: &Path, fail: bool) -> anyhow::Result<()> {
    if !backend.exports() {
        return Ok(());
    }
    atomic_file::replace_dir_with(dir, |tmp| -> anyhow::Result<()> {
        backend.export(tmp)?;
        match fail {
            true => Err(injected_full("export_fails_at")),
            false => Ok(()),
        }
    })
    .with_context(|| format!("exporting the drafter to {}", dir.display()))
}

/// What the leader writes at the checkpoint of `step`: the export, kept as `kept` where given
/// (`[drafter] keep_export_every`), then the checkpoint `ckpt` (`fail`: the writes that fail,
/// injected faults). The export and its keep first: a leader killed before the checkpoint leaves
/// the previous one, from which a resume trains up to this step again and writes both again, so
/// every kept step up to the checkpoint's has its kept export; killed after a checkpoint written
/// first, a kept step would have had none for ever.
///
/// Nothing that fails here fails the leader: each part's error is in the report (and the log),
/// and training goes on. The checkpoint is written even when the export failed (the device out
/// of memory for the bf16 copy of the weights, its directory unwritable), and a checkpoint that
/// fails (a full disk) leaves the previous one whole and is tried again at the next checkpoint
/// step. Either used to end the leader, whose restart trained the same steps again from the
/// previous checkpoint to fail at the same step, for as long as the run went on; the launcher
/// now says the failures, and a run that ends without its checkpoint ends degraded
/// (`launcher/src/supervisor/saves.rs`).
pub(crate) fn save_step(
    backend: &dyn DrafterBackend,
    step: u32,
    export_dir: &Path,
    kept: Option<&Path>,
    ckpt: &Path,
    fail: Failing,
) -> SaveReport {
    let said = |e: anyhow::Error| format!("{e:#}");
    let mut report = SaveReport {
        step: u64::from(step),
        keeping: kept.is_some() && backend.exports(),
        ..SaveReport::default()
    };
    let exported = export(backend, export_dir, fail.export);
    match (&exported, kept, backend.exports()) {
        (Ok(()), Some(kept), true) => match keep(export_dir, kept) {
            Ok(()) => tracing::info!(step, kept = %kept.display(), "kept the export"),
            Err(e) => {
                tracing::error!(
                    step,
                    error = format!("{e:#}"),
                    "the export of this step is not kept"
                );
                report.kept = Some(said(e));
            }
        },
        (Err(_), Some(_), true) => {
            report.kept = Some("its export failed".into());
        }
        _ => {}
    }
    if let Err(e) = exported {
        tracing::error!(
            step,
            error = format!("{e:#}"),
            "the export of this step failed"
        );
        report.export = Some(said(e));
    }
    if let Err(e) = checkpoint(backend, ckpt, fail.checkpoint) {
        tracing::error!(
            step,
            error = format!("{e:#}"),
            "the checkpoint of this step failed: the previous one stays; training goes on, and the next checkpoint step tries again"
        );
        report.checkpoint = Some(said(e));
    }
    report
}

/// Said once a worker: the first kept export that had to be copied.
static COPYING_SAID: Once = Once::new();

/// Keeps the export just written to `export` as `kept` (`drafter-steps/step-<S>`), whole or not
/// at all: built as `.step-<S>.new-<pid>` beside it, synced, then renamed in (a kept export of
/// the same step, from updates a resume lost, is exchanged for it), so a crash leaves no
/// directory under a kept name that is not a whole export. Each file is hard-linked: the export
/// was just written in a new directory, so its files are new inodes that the next export does
/// not touch (it writes new ones and the old directory's names go), and a kept export costs no
/// copy and no space beyond the files the export would have freed. Where a link cannot be made
/// (`drafter-steps` a link to another file system, one without hard links) the file is copied,
/// said once in the log.
fn keep(export: &Path, kept: &Path) -> anyhow::Result<()> {
    let parent = kept.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    atomic_file::replace_dir_with(kept, |tmp| -> anyhow::Result<()> {
        let files = std::fs::read_dir(export).with_context(|| format!("reading {}", export.display()))?;
        for entry in files {
            let from = entry?.path();
            let Some(name) = from.file_name() else {
                continue;
            };
            let to = tmp.join(name);
            if let Err(e) = std::fs::hard_link(&from, &to) {
                std::fs::copy(&from, &to).with_context(|| {
                    format!("copying {} to {}", from.display(), to.display())
                })?;
                COPYING_SAID.call_once(|| {
                    tracing::warn!(
                        error = %e,
                        kept = %parent.display(),
                        "kept exports are copied, not hard-linked: each costs a copy's time and, until the next export, twice its space"
                    );
                });
            }
        }
        Ok(())
    })
    .with_context(|| format!("keeping the export as {}", kept.display()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn write_export(dir: &Path, weights: &str) {
        atomic_file::replace_dir_with(dir, |tmp| -> std::io::Result<()> {
            std::fs::write(tmp.join("config.json"), "{}")?;
            std::fs::write(tmp.join("model.safetensors"), weights)
        })
        .unwrap();
    }

    /// A drafter whose export fails (as the device out of memory for its bf16 copy would):
    /// its checkpoint is a file of its step.
    struct FailingExport;

    impl DrafterBackend for FailingExport {
        fn grad_len(&self) -> usize {
            0
        }
        fn gradient(
            &mut self,
            _: &proto::BatchView<'_>,
            _: &mut gpu::StepBuffer,
        ) -> Result<(), gpu::GpuError> {
            Ok(())
        }
        fn apply(&mut self, _: &gpu::StepBuffer) -> Result<gpu::StepStats, gpu::GpuError> {
            Ok(gpu::StepStats::default())
        }
        fn step(&self) -> u64 {
            8
        }
        fn skip_to(&mut self, _: u64) {}
        fn digest(&self) -> u64 {
            0
        }
        fn save(&self, path: &Path) -> Result<(), gpu::GpuError> {
            std::fs::write(path, "step 8").map_err(|e| gpu::GpuError::Config(e.to_string()))
        }
        fn load(&mut self, _: &Path) -> Result<(), gpu::GpuError> {
            Ok(())
        }
        fn state_len(&self) -> usize {
            0
        }
        fn export_state(&self) -> Result<Vec<u32>, gpu::GpuError> {
            Ok(Vec::new())
        }
        fn import_state(&mut self, _: &[u32]) -> Result<(), gpu::GpuError> {
            Ok(())
        }
        fn export(&self, _: &Path) -> Result<(), gpu::GpuError> {
            Err(gpu::GpuError::Config("out of memory".into()))
        }
        fn exports(&self) -> bool {
            true
        }
    }

    /// An export that fails does not keep the step's checkpoint from being written: a leader
    /// restarted from the previous checkpoint would fail the same way at the same step for as
    /// long as the run went on. The export's error is the step's report, and nothing is kept.
    #[test]
    fn a_failed_export_still_writes_the_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let p = |n: &str| root.path().join(n);
        let kept = p("drafter-steps/step-8");
        let r = save_step(
            &FailingExport,
            8,
            &p("drafter"),
            Some(&kept),
            &p("c.safetensors"),
            Failing::default(),
        );
        let e = r.export.unwrap_or_default();
        assert!(e.contains("out of memory"), "{e}");
        assert_eq!(r.checkpoint, None);
        assert_eq!(
            std::fs::read_to_string(p("c.safetensors")).unwrap(),
            "step 8"
        );
        assert!(!kept.exists());
        assert!(r.keeping && r.kept.is_some(), "{:?}", r.kept);
    }

    /// A checkpoint whose write fails (a full disk) leaves the previous one whole, and no
    /// temporary file beside it; the failure is the step's report, not the leader's end.
    #[test]
    fn a_failed_checkpoint_leaves_the_previous_one_whole() {
        let root = tempfile::tempdir().unwrap();
        let p = |n: &str| root.path().join(n);
        std::fs::write(p("c.safetensors"), "step 4").unwrap();
        let r = save_step(
            &FailingExport,
            8,
            &p("drafter"),
            None,
            &p("c.safetensors"),
            Failing {
                checkpoint: true,
                export: false,
            },
        );
        let e = r.checkpoint.unwrap_or_default();
        assert!(e.starts_with("writing the checkpoint "), "{e}");
        assert!(e.contains("No space left on device"), "{e}");
        assert_eq!(
            std::fs::read_to_string(p("c.safetensors")).unwrap(),
            "step 4"
        );
        let names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["c.safetensors"], "no temporary left");
    }

    /// A kept export holds the export's files as they were at its step, linked (no copy),
    /// and keeps them when the next export replaces `drafter/`; keeping a step again (a
    /// resumed run reaching a step whose kept export was of updates it lost) replaces it. A
    /// keep that fails leaves no directory under the kept name.
    #[test]
    fn a_kept_export_is_linked_outlives_the_next_export_and_is_replaced_whole() {
        let root = tempfile::tempdir().unwrap();
        let export = root.path().join("drafter");
        let kept = |s: u64| root.path().join("drafter-steps").join(format!("step-{s}"));
        write_export(&export, "weights of step 4");
        keep(&export, &kept(4)).unwrap();
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        let weights = |d: &Path| std::fs::read_to_string(d.join("model.safetensors")).unwrap();
        assert_eq!(
            ino(&kept(4).join("model.safetensors")),
            ino(&export.join("model.safetensors")),
            "hard-linked"
        );
        write_export(&export, "weights of step 8");
        keep(&export, &kept(8)).unwrap();
        assert_eq!(weights(&kept(4)), "weights of step 4");
        assert_eq!(weights(&kept(8)), "weights of step 8");
        assert!(kept(4).join("config.json").is_file());

        write_export(&export, "weights of step 8, trained again");
        keep(&export, &kept(8)).unwrap();
        assert_eq!(weights(&kept(8)), "weights of step 8, trained again");

        let e = keep(&root.path().join("missing"), &kept(12)).unwrap_err();
        assert!(format!("{e:#}").contains("step-12"), "{e:#}");
        let names: Vec<_> = std::fs::read_dir(root.path().join("drafter-steps"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}: only steps 4 and 8");
    }
}
