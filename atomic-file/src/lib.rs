//! Replacing a file so that a crash leaves the old one or the new one, never half of one: write
//! a temporary file in the same directory, sync it, rename it over the target, sync the
//! directory (without that last sync the rename itself may not survive a power loss). Used for
//! everything written whole: `summary.json`, the group checkpoint, a resumed run's ledgers, the
//! report's SVG, a prepared dataset and its input stamps. A crate of its own, below `dataset` and
//! `proto`, so that preparing a dataset needs none of hspipe's contracts.

use std::fs::File;
use std::io;
use std::path::Path;

/// Writes `path` atomically with `write`, which gets the temporary file's path (and may open it
/// as it likes). The temporary file is removed if anything fails.
pub fn replace_with<E>(path: &Path, write: impl FnOnce(&Path) -> Result<(), E>) -> Result<(), E>
where
    E: From<io::Error>,
{
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // Mode 0666 less the umask, as `std::fs::write` would create it (tempfile's own is 0600).
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .tempfile_in(dir)?;
    write(tmp.path())?;
    File::open(tmp.path())?.sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(sync_dir(dir)?)
}

/// Makes the entries of `dir` durable (a file created or renamed in it): without it, a file
/// synced itself may still be missing after a power loss.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes `bytes` to `path` atomically.
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace_with(path, |tmp| std::fs::write(tmp, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("summary.json");
        replace(&path, b"old").unwrap();
        let e = replace_with(&path, |tmp| {
            std::fs::write(tmp, b"half")?;
            Err(io::Error::other("killed"))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "killed");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        replace(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["summary.json"], "no temporary left");
    }
}
