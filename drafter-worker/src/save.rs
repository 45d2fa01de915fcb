//! What the group's leader writes: the checkpoint, the export and a kept export, each whole or
//! not at all.

use std::path::Path;
use std::sync::Once;

use anyhow::Context;
use gpu::DrafterBackend;

/// Writes the checkpoint atomically: a crash leaves either the old checkpoint or the new one,
/// never half of one.
pub(crate) fn checkpoint(backend: &dyn DrafterBackend, path: &Path) -> anyhow::Result<()> {
    atomic_file::replace_with(path, |tmp| -> anyhow::Result<()> { Ok(backend.save(tmp)?) })
        .with_context(|| format!("writing the checkpoint {}", path.display()))
}

/// Writes the export directory whole ([`atomic_file::replace_dir_with`]: synced, then swapped
/// in), so a reader, a crash or a power loss sees the old export or the new one, never a mix.
pub(crate) fn export(backend: &dyn DrafterBackend, dir: &Path) -> anyhow::Result<()> {
    if !backend.exports() {
        return Ok(());
    }
    atomic_file::replace_dir_with(dir, |tmp| -> anyhow::Result<()> {
        Ok(backend.export(tmp)?)
    })
    .with_context(|| format!("exporting the drafter to {}", dir.display()))
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
pub(crate) fn keep(export: &Path, kept: &Path) -> anyhow::Result<()> {
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
