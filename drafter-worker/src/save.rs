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
