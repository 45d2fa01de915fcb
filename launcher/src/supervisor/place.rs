//! Whether the run directory is still where the run started it. A directory deleted (`rm -rf`)
//! or moved mid-run used to go unnoticed: the launcher and the workers write through files they
//! hold open (`launcher.log`, `metrics.jsonl`, the ledgers, the logs), so only the first
//! checkpoint failed, said as a failed checkpoint, and the run trained on to its end for
//! nothing, for days on a run of a week, while those open files held disk space `du` could not
//! see. So the supervisor compares, once a second, the directory's identity at the start (its
//! device and inode) with a `stat` of its path, and a run whose directory is gone or replaced
//! ends, its workers killed (`Supervisor::place`).

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The run directory as found at the start: its path and its identity.
#[derive(Debug)]
pub(super) struct Place {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

/// What became of the run directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gone {
    /// Nothing is at its path (deleted, or moved away; or a directory above it was).
    Missing,
    /// Another directory (or file) is at its path: it was deleted or moved, and another made.
    Replaced,
}

impl Gone {
    /// In words, after the directory's path.
    pub(super) fn said(self) -> &'static str {
        match self {
            Gone::Missing => "is gone (deleted, or moved away)",
            Gone::Replaced => "was replaced (deleted or moved away, and another made at its path)",
        }
    }
}

impl Place {
    /// The identity of the directory at `path` now.
    pub(super) fn of(path: &Path) -> io::Result<Place> {
        let m = std::fs::metadata(path)?;
        Ok(Place {
            path: path.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Whether the directory is still at its path; `None` while it is, or while its path
    /// cannot be looked at for another reason (a permission, an I/O error): only a directory
    /// certainly gone stops a run.
    pub(super) fn gone(&self) -> Option<Gone> {
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == (self.dev, self.ino) => None,
            Ok(_) => Some(Gone::Replaced),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Some(Gone::Missing),
            // A file where a directory above it was.
            Err(e) if e.kind() == io::ErrorKind::NotADirectory => Some(Gone::Missing),
            Err(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory left alone is there; deleted, moved away or replaced, it is gone, and says
    /// which; a file put in place of a directory above it counts as gone.
    #[test]
    fn a_run_directory_deleted_moved_or_replaced_is_gone() {
        let top = tempfile::tempdir().unwrap();
        let run = top.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let place = Place::of(&run).unwrap();
        assert_eq!(place.gone(), None);
        std::fs::write(run.join("launcher.log"), "x").unwrap();
        assert_eq!(place.gone(), None, "its content changes nothing");

        std::fs::rename(&run, top.path().join("moved")).unwrap();
        assert_eq!(place.gone(), Some(Gone::Missing));
        std::fs::create_dir(&run).unwrap();
        assert_eq!(place.gone(), Some(Gone::Replaced));
        std::fs::remove_dir(&run).unwrap();
        assert_eq!(place.gone(), Some(Gone::Missing));

        let nested = top.path().join("a/run");
        std::fs::create_dir_all(&nested).unwrap();
        let place = Place::of(&nested).unwrap();
        std::fs::remove_dir_all(top.path().join("a")).unwrap();
        std::fs::write(top.path().join("a"), "a file").unwrap();
        assert_eq!(place.gone(), Some(Gone::Missing));
    }
}
