//! Replacing a file so that a crash leaves the old one or the new one, never half of one: write
//! a temporary file in the same directory, sync it, rename it over the target, sync the
//! directory (without that last sync the rename itself may not survive a power loss). Used for
//! everything written whole: `summary.json`, the group checkpoint, a resumed run's ledgers, the
//! report's SVG, a prepared dataset and its input stamps; and, with [`replace_dir_with`], the
//! drafter's export directory, each export kept along the run and `make-model`'s model directory. A crate of its own, below `dataset` and `proto`, so that
//! preparing a dataset needs none of hspipe's contracts. It also reads a config whole
//! ([`read_regular`]) without waiting on a FIFO.
//!
//! Only a regular file is replaced: the rename would put a file in place of whatever is at the
//! target, so a FIFO, a device (`-o /dev/null` as root) or a directory is refused with
//! [`NotAFile`]. A symbolic link is followed, and the file it points to is replaced, as the
//! shell's `>` would write it: renaming over the link would turn the user's link into a file
//! and leave the file it names stale.
//!
//! Length: past 500 lines, half of them tests: the file's and the directory's replacements share
//! the temporary names that the leftovers' rules read back, and are tested together.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// The target of a replace exists and is not a regular file: replacing it would destroy it.
/// Carried in an [`io::Error`] of kind `InvalidInput` (find it with `get_ref` and
/// `downcast_ref`).
#[derive(Debug)]
pub struct NotAFile {
    /// The path found (a link's, followed to its end).
    pub path: PathBuf,
    /// What it is, in words ([`not_regular`]): "a FIFO ...", "a directory", "a device"...
    pub kind: &'static str,
}

impl std::fmt::Display for NotAFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {}, not a regular file, and is left alone; name a new file or a regular one",
            self.path.display(),
            self.kind
        )
    }
}

impl std::error::Error for NotAFile {}

/// The file that [`replace_with`] writes for `path`: `path` itself, or where it is a symbolic
/// link, the file the link points to (followed to the end; it need not exist). Fails with
/// [`NotAFile`] where that exists and is not a regular file, so a caller can refuse a target
/// before the work of writing it.
pub fn target(path: &Path) -> io::Result<PathBuf> {
    let mut p = path.to_path_buf();
    // As many links as Linux follows (ELOOP after 40).
    for _ in 0..40 {
        let meta = match std::fs::symlink_metadata(&p) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(p),
            r => r?,
        };
        if !meta.file_type().is_symlink() {
            return match not_regular(&meta) {
                None => Ok(p),
                Some(kind) => Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    NotAFile { path: p, kind },
                )),
            };
        }
        // A relative link is relative to the link's directory (`join` keeps an absolute one).
        p = parent_of(&p).join(std::fs::read_link(&p)?);
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{}: too many levels of symbolic links", path.display()),
    ))
}

/// Writes `path` atomically with `write`, which gets the temporary file's path (and may open it
/// as it likes). The temporary file is removed if anything fails. `path` is resolved by
/// [`target`] first: a target that is not a regular file is refused before `write` runs.
pub fn replace_with<E>(path: &Path, write: impl FnOnce(&Path) -> Result<(), E>) -> Result<(), E>
where
    E: From<io::Error>,
{
    let path = &target(path)?;
    let dir = parent_of(path);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // Mode 0666 less the umask, as `std::fs::write` would create it (tempfile's own is 0600).
    // The pid in the name tells a writer at work from a killed one's leftover (`leftovers`).
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}.{}.", std::process::id()))
        .suffix(".tmp")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .tempfile_in(dir)?;
    write(tmp.path())?;
    File::open(tmp.path())?.sync_all()?;
    // Again, as late as can be: something may have been put there while `write` ran.
    target(path)?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(sync_dir(dir)?)
}

/// Makes the entries of `dir` durable (a file created or renamed in it): without it, a file
/// synced itself may still be missing after a power loss.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// What `meta` (not a symbolic link's: from [`std::fs::metadata`]) is when it is not a regular
/// file, in words ("a FIFO ..."); None for a regular file. Asked before opening a file read
/// whole: a FIFO's open waits for a writer, for ever if none comes, and a device such as
/// `/dev/zero` never ends.
pub fn not_regular(meta: &std::fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    Some(if t.is_file() {
        return None;
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (a named pipe, or a shell's <(...))"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "a socket"
    })
}

/// Reads `path` whole as text, refusing what is not a regular file before opening it (see
/// [`not_regular`]): a config, not a stream.
pub fn read_regular(path: &Path) -> io::Result<String> {
    if let Some(what) = not_regular(&std::fs::metadata(path)?) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {what}, not a regular file"),
        ));
    }
    std::fs::read_to_string(path)
}

/// Writes `bytes` to `path` atomically.
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace_with(path, |tmp| std::fs::write(tmp, bytes))
}

/// Writes the directory `dir` whole with `write`, which gets an empty directory beside it to
/// fill: every file in it is synced, then it is swapped in for `dir` with one atomic exchange
/// (`renameat2`'s `RENAME_EXCHANGE`) and the parent synced, so a reader or a crash sees the old
/// directory or the new one, never a mix and never none. Where the file system cannot exchange,
/// the old directory is moved aside first (a crash between the two renames leaves it as
/// `.<name>.old-<pid>`, and no `dir`). The temporary directory is `.<name>.new-<pid>`; what a
/// killed writer leaves is for [`leftovers`] to find.
pub fn replace_dir_with<E>(dir: &Path, write: impl FnOnce(&Path) -> Result<(), E>) -> Result<(), E>
where
    E: From<io::Error>,
{
    let parent = parent_of(dir);
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let tmp = new_dir_name(dir);
    match std::fs::remove_dir_all(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }
    std::fs::create_dir(&tmp)?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    for entry in std::fs::read_dir(&tmp)? {
        let path = entry?.path();
        if path.is_file() {
            File::open(&path)?.sync_all()?;
        }
    }
    sync_dir(&tmp)?;
    // Not `exists()`, which follows a link: a dangling link at `dir` is exchanged (the link,
    // not what it names, is replaced), as a link to a directory is; renamed over, it fails.
    if std::fs::symlink_metadata(dir).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
        std::fs::rename(&tmp, dir)?;
        return Ok(sync_dir(parent)?);
    }
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    use rustix::io::Errno;
    match renameat_with(CWD, &tmp, CWD, dir, RenameFlags::EXCHANGE) {
        Ok(()) => {}
        // A file system, or a kernel, that cannot exchange.
        Err(e) if [Errno::INVAL, Errno::NOSYS, Errno::NOTSUP, Errno::OPNOTSUPP].contains(&e) => {
            let old = parent.join(format!(".{name}.old-{}", std::process::id()));
            std::fs::rename(dir, &old)?;
            std::fs::rename(&tmp, dir)?;
            sync_dir(parent)?;
            let _ = std::fs::remove_dir_all(&old);
            return Ok(());
        }
        Err(e) => return Err(io::Error::from(e).into()),
    }
    sync_dir(parent)?;
    // The old directory, now at the temporary name.
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}

/// `.<name>.new-<pid>` beside `dir`: this process's temporary for it, which [`leftovers`]
/// finds once the process is gone.
fn new_dir_name(dir: &Path) -> PathBuf {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    parent_of(dir).join(format!(".{name}.new-{}", std::process::id()))
}

/// Removes the directory `dir` whole or not at all, as far as a reader of its name can tell:
/// renamed to this process's temporary name first (the parent synced after), then removed, so a
/// kill in the middle leaves a temporary for [`leftovers`] to find, never a part of `dir` under
/// its name.
pub fn remove_dir(dir: &Path) -> io::Result<()> {
    let aside = new_dir_name(dir);
    std::fs::rename(dir, &aside)?;
    std::fs::remove_dir_all(&aside)?;
    sync_dir(parent_of(dir))
}

/// What killed writers left beside `path` (a file of [`replace_with`], a directory of
/// [`replace_dir_with`]): temporary files and directories, and a directory moved aside. Each
/// name holds its writer's pid; one whose process still runs is a writer at work, and is not
/// listed (a temporary file of an older build, with no pid, is). Safe to call while writers
/// run, in this process or others.
pub fn leftovers(path: &Path) -> io::Result<Vec<std::path::PathBuf>> {
    // Beside the file a link points to, where `replace_with` writes.
    let path = &target(path).unwrap_or_else(|_| path.to_path_buf());
    let parent = parent_of(path);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let ours = format!(".{name}.");
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(parent) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        r => r?,
    };
    for entry in entries {
        let entry = entry?;
        let n = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = n.strip_prefix(&ours) else {
            continue;
        };
        let dir_of = |p: &str| rest.strip_prefix(p).and_then(|p| p.parse::<u32>().ok());
        let writer = match rest.strip_suffix(".tmp") {
            // `<pid>.<random>` (an older build's: `<random>`).
            Some(t) => Some(
                t.split_once('.')
                    .and_then(|(pid, _)| pid.parse::<u32>().ok()),
            ),
            None => dir_of("new-").or_else(|| dir_of("old-")).map(Some),
        };
        let gone = |pid: u32| !Path::new(&format!("/proc/{pid}")).exists();
        match writer {
            Some(Some(pid)) if !gone(pid) => {}
            Some(_) => out.push(entry.path()),
            None => {}
        }
    }
    Ok(out)
}

/// The directories in `parent` that [`replace_dir_with`] has a temporary or moved-aside
/// directory for (`.<name>.new-<pid>`, `.<name>.old-<pid>`), read from those names, each once:
/// where the directories written whole are not known by name beforehand (the kept exports,
/// one a step), what to ask [`restore_dir`] and [`leftovers`] about. A writer at work's are
/// listed too; [`leftovers`] leaves them out. None when `parent` is missing.
pub fn replaced_dirs_in(parent: &Path) -> io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(parent) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        r => r?,
    };
    let mut out = Vec::new();
    for entry in entries {
        let n = entry?.file_name().to_string_lossy().into_owned();
        let Some((name, kind)) = n.strip_prefix('.').and_then(|n| n.rsplit_once('.')) else {
            continue;
        };
        let pid = kind
            .strip_prefix("new-")
            .or_else(|| kind.strip_prefix("old-"));
        if name.is_empty() || pid.is_none_or(|p| p.parse::<u32>().is_err()) {
            continue;
        }
        let dir = parent.join(name);
        if !out.contains(&dir) {
            out.push(dir);
        }
    }
    out.sort();
    Ok(out)
}

/// Puts back the directory [`replace_dir_with`] had moved aside when it was killed before it
/// could swap the new one in (only where the file system cannot exchange): `dir` missing and a
/// killed writer's `.<name>.old-<pid>` beside it, the last complete version. Returns where it
/// was; call before removing [`leftovers`].
pub fn restore_dir(dir: &Path) -> io::Result<Option<std::path::PathBuf>> {
    if dir.exists() {
        return Ok(None);
    }
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let old = format!(".{name}.old-");
    let moved = leftovers(dir)?.into_iter().find(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(&old))
    });
    let Some(moved) = moved else {
        return Ok(None);
    };
    std::fs::rename(&moved, dir)?;
    sync_dir(parent_of(dir))?;
    Ok(Some(moved))
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pid of a process that has ended: a killed writer's.
    fn ended_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        child.id()
    }

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

    #[test]
    fn a_directory_is_replaced_whole_and_a_failed_write_leaves_the_old_one() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("drafter");
        let write =
            |text: &'static str| move |tmp: &Path| std::fs::write(tmp.join("config.json"), text);
        replace_dir_with(&dir, write("one")).unwrap();
        replace_dir_with(&dir, write("two")).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("config.json")).unwrap(),
            "two"
        );
        let e = replace_dir_with(&dir, |tmp: &Path| {
            std::fs::write(tmp.join("config.json"), "half")?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "disk full");
        assert_eq!(
            std::fs::read_to_string(dir.join("config.json")).unwrap(),
            "two"
        );
        let names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["drafter"], "no temporary or old directory left");
    }

    #[test]
    fn leftovers_are_what_killed_writers_leave_and_nothing_else() {
        let root = tempfile::tempdir().unwrap();
        let p = |n: &str| root.path().join(n);
        // A process that has ended, and this one, which runs.
        let (dead, live) = (ended_pid(), std::process::id());
        std::fs::create_dir(p("drafter")).unwrap();
        std::fs::create_dir(p(&format!(".drafter.new-{dead}"))).unwrap();
        std::fs::create_dir(p(&format!(".drafter.old-{dead}"))).unwrap();
        std::fs::create_dir(p(&format!(".drafter.new-{live}"))).unwrap();
        std::fs::write(p("model.safetensors"), "").unwrap();
        std::fs::write(p(&format!(".model.safetensors.{dead}.a1B2c3.tmp")), "").unwrap();
        std::fs::write(p(&format!(".model.safetensors.{live}.d4E5f6.tmp")), "").unwrap();
        std::fs::write(p(".model.safetensors.g7H8i9.tmp"), "").unwrap();
        std::fs::write(p(".drafter.notes"), "").unwrap();
        let sorted = |mut v: Vec<std::path::PathBuf>| {
            v.sort();
            v
        };
        let found = sorted(leftovers(&p("drafter")).unwrap());
        let want = sorted(vec![
            p(&format!(".drafter.new-{dead}")),
            p(&format!(".drafter.old-{dead}")),
        ]);
        assert_eq!(found, want);
        let found = sorted(leftovers(&p("model.safetensors")).unwrap());
        let want = sorted(vec![
            p(&format!(".model.safetensors.{dead}.a1B2c3.tmp")),
            p(".model.safetensors.g7H8i9.tmp"),
        ]);
        assert_eq!(found, want);
        assert!(leftovers(&p("missing/x")).unwrap().is_empty());
    }

    /// In a folder of directories written whole, those a writer has temporaries for are
    /// found by the temporaries' names, each once; other names are not.
    #[test]
    fn replaced_dirs_are_found_by_their_temporaries() {
        let root = tempfile::tempdir().unwrap();
        let p = |n: &str| root.path().join(n);
        let dead = ended_pid();
        for d in [
            "step-8".to_string(),
            format!(".step-12.new-{dead}"),
            format!(".step-16.new-{dead}"),
            format!(".step-16.old-{dead}"),
            ".step-20.new-x".to_string(),
            ".notes".to_string(),
        ] {
            std::fs::create_dir(p(&d)).unwrap();
        }
        assert_eq!(
            replaced_dirs_in(root.path()).unwrap(),
            [p("step-12"), p("step-16")]
        );
        assert_eq!(
            leftovers(&p("step-12")).unwrap(),
            [p(&format!(".step-12.new-{dead}"))]
        );
        assert!(replaced_dirs_in(&p("missing")).unwrap().is_empty());
    }

    /// Killed between moving the old directory aside and renaming the new one in (a file
    /// system that cannot exchange): the old one is the last complete version, put back.
    #[test]
    fn a_directory_moved_aside_by_a_killed_writer_is_put_back() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("drafter");
        let dead = ended_pid();
        let old = root.path().join(format!(".drafter.old-{dead}"));
        let new = root.path().join(format!(".drafter.new-{dead}"));
        for d in [&old, &new] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(old.join("config.json"), "old").unwrap();
        assert_eq!(restore_dir(&dir).unwrap(), Some(old.clone()));
        assert_eq!(
            std::fs::read_to_string(dir.join("config.json")).unwrap(),
            "old"
        );
        assert_eq!(leftovers(&dir).unwrap(), [new]);
        assert_eq!(
            restore_dir(&dir).unwrap(),
            None,
            "nothing to put back with the dir there"
        );
    }

    /// `-o fifo` (or `/dev/null`, as root): the rename would have put a file in its place.
    #[test]
    fn a_target_that_is_not_a_regular_file_is_refused_and_left_as_it_is() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let via_link = dir.path().join("link");
        std::os::unix::fs::symlink("fifo", &via_link).unwrap();
        // The link is named by the FIFO it points to.
        let fifo_said = "a FIFO (a named pipe, or a shell's <(...))";
        let cases = [
            (&fifo, &fifo, fifo_said),
            (&sub, &sub, "a directory"),
            (&via_link, &fifo, fifo_said),
        ];
        for (path, found, kind) in cases {
            let mut wrote = false;
            let e = replace_with(path, |tmp| {
                wrote = true;
                std::fs::write(tmp, b"data")
            })
            .unwrap_err();
            assert!(!wrote, "refused before the work of writing");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            let not = e.get_ref().unwrap().downcast_ref::<NotAFile>().unwrap();
            assert_eq!((&not.path, not.kind), (found, kind));
            assert!(
                e.to_string()
                    .contains(&format!("is {kind}, not a regular file")),
                "{e}"
            );
        }
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        assert!(std::fs::symlink_metadata(&via_link).unwrap().is_symlink());
        assert!(sub.is_dir());
    }

    /// A link to a regular file stays a link; the file it points to gets the new contents.
    #[test]
    fn a_link_is_followed_and_the_file_it_points_to_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let file = data.join("train.arrow");
        std::fs::write(&file, b"old").unwrap();
        let link = dir.path().join("train.arrow");
        std::os::unix::fs::symlink("data/train.arrow", &link).unwrap();
        replace(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        // A dangling link: the file it names is made, as `>` would.
        let dangling = dir.path().join("eval.json");
        std::os::unix::fs::symlink("data/eval.json", &dangling).unwrap();
        replace(&dangling, b"{}").unwrap();
        assert_eq!(std::fs::read(data.join("eval.json")).unwrap(), b"{}");
    }

    #[test]
    fn a_writer_at_work_is_not_a_leftover() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("summary.json");
        replace_with(&path, |tmp| {
            assert!(leftovers(&path)?.is_empty(), "{}", tmp.display());
            std::fs::write(tmp, "{}")
        })
        .unwrap();
    }
}
