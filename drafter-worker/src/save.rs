//! What the group's leader writes: the checkpoint and the export, each whole or not at all.

use std::path::Path;

use anyhow::Context;
use gpu::DrafterBackend;

/// Writes the checkpoint atomically: a crash leaves either the old checkpoint or the new one,
/// never half of one.
pub(crate) fn checkpoint(backend: &dyn DrafterBackend, path: &Path) -> anyhow::Result<()> {
    atomic_file::replace_with(path, |tmp| -> anyhow::Result<()> { Ok(backend.save(tmp)?) })
        .with_context(|| format!("writing the checkpoint {}", path.display()))
}

/// Writes the export directory whole: into a fresh directory beside it, then swapped in, so a
/// reader (or a crash) sees the old export or the new one, never a mix.
pub(crate) fn export(backend: &dyn DrafterBackend, dir: &Path) -> anyhow::Result<()> {
    if !backend.exports() {
        return Ok(());
    }
    let tmp = dir.with_extension(format!("new-{}", std::process::id()));
    let old = dir.with_extension(format!("old-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    backend
        .export(&tmp)
        .with_context(|| format!("exporting the drafter to {}", tmp.display()))?;
    let had = dir.exists();
    if had {
        std::fs::rename(dir, &old).with_context(|| format!("moving {} aside", dir.display()))?;
    }
    std::fs::rename(&tmp, dir).with_context(|| format!("writing {}", dir.display()))?;
    if had {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}
