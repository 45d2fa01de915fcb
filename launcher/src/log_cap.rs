//! A cap on each worker's log (`--log-cap`): a worker that prints in a loop wrote 53 MB in 8 s,
//! so a week's run could fill the disk. The supervisor rotates a log past the cap on its tick,
//! copytruncate-style, as logrotate's `copytruncate` does: the log's content is copied to
//! `<worker>.log.1` (replacing the one before, written whole), the log is truncated to nothing
//! and a line ([`ROTATED`]) says where its earlier part went and why. A worker writes its log
//! through the descriptor `spawn` opened with O_APPEND, so its next write lands at the new end
//! (not at its old offset, which would leave a hole as large as what was moved). The launcher
//! keeps a descriptor of that file too (`spawn` returns it) and rotates the file through it,
//! so a log deleted or moved away while its worker writes it is kept under the cap all the same.
//!
//! The price: a line the worker writes between the last read of the copy and the truncate is
//! in neither file. The bytes written while the copy is synced are appended to `.log.1` before
//! the truncate, so that window is a few system calls long, and a rotation happens only when a
//! log passes the cap. Why not a pipe through the launcher, which would lose nothing: every
//! line would then wait on the launcher. A launcher that stalls (Ctrl-Z stops it and not the
//! workers, which run in their own process groups; a rotation's copy holds its loop) would
//! fill the pipe's 64 KiB and block each worker at its next print, its GPU idle; and a launcher
//! that dies (SIGKILL, the OOM killer) would take the pipe's reader with it, so a worker still
//! finishing its step or checkpoint would die of SIGPIPE at its next line. A file the worker
//! writes itself needs nothing of the launcher.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The start of the line a rotated log begins with: [`crate::spawn::last_error`] reads the
/// rotated part too when the live log begins with it.
pub const ROTATED: &str = "--- launcher: this log passed --log-cap";

/// The default cap: a worker's log and its `.log.1` then take at most 128 MiB (and what it
/// writes in a second), however long the run.
pub const DEFAULT: &str = "64MiB";

/// The smallest cap but 0: a dead worker's reason is read from the last 64 KiB of its log, and a
/// cap below the rotation's own line would rotate every tick.
const MIN: u64 = 64 << 10;

/// Parses `--log-cap`: bytes, or a number with a binary unit (`64MiB`, `64M`, `1GiB`, `512K`;
/// any case), at least 64 KiB; 0 for no cap.
pub fn parse(s: &str) -> Result<u64, String> {
    // clap's message names the flag and the value; this says what is wrong with it.
    let not_a_size = || {
        format!("not a size: write a whole number of bytes, or of KiB, MiB or GiB (e.g. {DEFAULT}, 512K, 1G); 0 for no cap")
    };
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return Err(not_a_size()),
    };
    let bytes = (n.parse::<u64>().ok())
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(not_a_size)?;
    if bytes != 0 && bytes < MIN {
        return Err(
            "under the smallest cap, 64KiB (a dead worker's reason is read from the last 64 KiB of its log); 0 for no cap".into(),
        );
    }
    Ok(bytes)
}

/// `bytes` as a person reads a cap: in the largest binary unit that divides it.
fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

/// Rotates the log at `log`, which the worker writes and the launcher holds open as `live`, if
/// it holds more than `cap` bytes (0: no cap): see the module's doc. Returns how many bytes
/// went to `<log>.1`, or None when it was not rotated (under the cap). A failure (a full disk)
/// leaves the log as it was: nothing is truncated that was not copied.
///
/// The file rotated is the one the worker writes, reached through `live`, not the one at the
/// path: a log deleted (or moved) while its worker writes it went on growing without limit,
/// its space held and out of `du`'s sight (the rotation left a log gone from its path alone).
/// Its earlier part goes to `<log>.1` all the same.
pub fn rotate_past_cap(log: &Path, live: &File, cap: u64) -> io::Result<Option<u64>> {
    let len = live.metadata()?.len();
    if cap == 0 || len <= cap {
        return Ok(None);
    }
    let file = reopened(live);
    let rotated = proto::run_dir::rotated(log);
    make_dir_again(log)?;
    let mut moved = 0;
    atomic_file::replace_with(&rotated, |tmp| -> io::Result<()> {
        moved = std::fs::copy(&file, tmp)?;
        Ok(())
    })?;
    // Read and truncated through a descriptor with O_APPEND, so that the line below is written
    // at the end, as the worker's are.
    let mut live = OpenOptions::new().read(true).append(true).open(&file)?;
    live.seek(SeekFrom::Start(moved))?;
    let mut out = OpenOptions::new().append(true).open(&rotated)?;
    moved += io::copy(&mut live, &mut out)?;
    live.set_len(0)?;
    let name = rotated.file_name().unwrap_or_default().to_string_lossy();
    writeln!(
        live,
        "{ROTATED} {}: its earlier {moved} bytes are in {name} (the part before them is gone)",
        human(cap)
    )?;
    Ok(Some(moved))
}

/// A path that opens the file the launcher holds as `live` anew (a descriptor of its own, with
/// its own offset; the worker's and `live` share one), even once no path names it.
pub fn reopened(live: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", live.as_raw_fd()))
}

/// Makes the directory of `log` (the run's `logs/`) again if it is gone (`rm -rf logs/` while
/// the run goes on), so that a rotation has somewhere to put `.log.1` and a worker's next start
/// somewhere to open its log; returns whether it was made. Only that directory, never the run
/// directory above it: a run directory gone ends the run (`place.rs`), and one made again here
/// would be taken for the run's. Before, every rotation failed and said so, each log grew
/// without limit (out of `du`'s sight), and a worker that died could not be started again.
pub fn make_dir_again(log: &Path) -> io::Result<bool> {
    let Some(dir) = log.parent() else {
        return Ok(false);
    };
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// The log at `log` is no longer the file the worker writes (`live`): deleted, or moved away
/// (and maybe another made at its path). False when the path cannot be looked at otherwise.
pub fn gone(log: &Path, live: &File) -> bool {
    let (Ok(now), Ok(held)) = (std::fs::metadata(log), live.metadata()) else {
        return std::fs::metadata(log).is_err_and(|e| e.kind() == io::ErrorKind::NotFound);
    };
    (now.dev(), now.ino()) != (held.dev(), held.ino())
}

#[cfg(test)]
mod tests {
    use super::{gone, make_dir_again, parse, rotate_past_cap, ROTATED};
    use std::io::Write;

    /// A worker that writes past the cap: its log is rotated while it still writes (through
    /// its own O_APPEND descriptor, as `spawn` gives it), so the live log holds the note and
    /// what came after, under the cap, and `.log.1` the earlier part whole. Before, the log
    /// grew without end.
    #[test]
    fn a_log_past_its_cap_is_rotated_and_the_worker_writes_on_at_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("drafter-0.log");
        let mut worker = (std::fs::OpenOptions::new().create(true).append(true))
            .open(&log)
            .unwrap();
        let cap = 64 << 10;
        let early = "step 1 loss 3.2 and more words to fill the line\n".repeat(2000);
        worker.write_all(early.as_bytes()).unwrap();
        let moved = rotate_past_cap(&log, &worker, cap).unwrap();
        assert_eq!(moved, Some(early.len() as u64));
        worker.write_all(b"error: after the rotation\n").unwrap();

        let rotated = std::fs::read_to_string(dir.path().join("drafter-0.log.1")).unwrap();
        assert_eq!(rotated, early, "the earlier part, whole");
        let live = std::fs::read_to_string(&log).unwrap();
        let (note, rest) = live.split_once('\n').unwrap();
        assert!(
            note.starts_with(ROTATED)
                && note.contains("64 KiB")
                && note.contains(&format!(
                    "earlier {} bytes are in drafter-0.log.1",
                    early.len()
                )),
            "{note}"
        );
        assert_eq!(rest, "error: after the rotation\n", "no hole before it");
        assert!((live.len() as u64) < cap);
        // Under the cap again: left alone. Past it again: the older `.log.1` is replaced.
        assert_eq!(rotate_past_cap(&log, &worker, cap).unwrap(), None);
        worker.write_all(early.as_bytes()).unwrap();
        assert!(rotate_past_cap(&log, &worker, cap).unwrap().is_some());
        let rotated = std::fs::read_to_string(dir.path().join("drafter-0.log.1")).unwrap();
        assert!(rotated.starts_with(note) && rotated.ends_with(&early));
        assert_eq!(
            rotated.matches("step 1").count(),
            2000,
            "the older part is gone"
        );
    }

    /// A log deleted while its worker writes it (or moved away) is still the worker's, and
    /// kept under the cap through the launcher's descriptor of it, its earlier part in
    /// `.log.1` as ever; found gone, while a log in its place is not. Before, the rotation
    /// passed over a log gone from its path, which grew without limit, its space held and
    /// out of `du`'s sight.
    #[test]
    fn a_log_deleted_while_its_worker_writes_it_is_still_kept_under_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("target-0.log");
        let mut worker = (std::fs::OpenOptions::new().create(true).append(true))
            .open(&log)
            .unwrap();
        let live = worker.try_clone().unwrap();
        assert!(!gone(&log, &live));
        std::fs::remove_file(&log).unwrap();
        assert!(gone(&log, &live));
        let cap = 64 << 10;
        let chatty = "a line a worker prints in a loop\n".repeat(4000);
        worker.write_all(chatty.as_bytes()).unwrap();
        let moved = rotate_past_cap(&log, &live, cap).unwrap();
        assert_eq!(moved, Some(chatty.len() as u64));
        worker.write_all(b"after\n").unwrap();
        let held = live.metadata().unwrap().len();
        assert!(held < cap, "the deleted log holds {held} bytes");
        let rotated = std::fs::read_to_string(dir.path().join("target-0.log.1")).unwrap();
        assert_eq!(rotated, chatty);
        assert!(!log.exists(), "no log made at its path");
        std::fs::write(&log, "another file").unwrap();
        assert!(gone(&log, &live), "another file at its path");
    }

    /// `rm -rf logs/` while the run goes on: the rotation of a worker's log (deleted with it,
    /// still written) makes `logs/` again and puts the earlier part in `.log.1` there, and the
    /// directory is there for the worker's next start; a run directory gone is not made again.
    /// Before, each rotation failed (`.log.1` had no directory) and the log grew on.
    #[test]
    fn a_logs_directory_deleted_mid_run_is_made_again_at_the_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        std::fs::create_dir(&logs).unwrap();
        let log = logs.join("drafter-1.log");
        let mut worker = (std::fs::OpenOptions::new().create(true).append(true))
            .open(&log)
            .unwrap();
        std::fs::remove_dir_all(&logs).unwrap();
        let chatty = "a line a worker prints in a loop\n".repeat(4000);
        worker.write_all(chatty.as_bytes()).unwrap();
        let moved = rotate_past_cap(&log, &worker, 64 << 10).unwrap();
        assert_eq!(moved, Some(chatty.len() as u64));
        let rotated = std::fs::read_to_string(logs.join("drafter-1.log.1")).unwrap();
        assert_eq!(rotated, chatty);
        assert!(!make_dir_again(&log).unwrap(), "there already");

        let run = dir.path().join("run");
        let gone = run.join("logs").join("target-0.log");
        assert!(make_dir_again(&gone).is_err());
        assert!(!run.exists(), "the run directory is not made again");
    }

    /// `--log-cap 0` leaves a log alone however large.
    #[test]
    fn no_cap_leaves_a_log_alone() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("target-0.log");
        let text = "x".repeat(1 << 20);
        std::fs::write(&log, &text).unwrap();
        assert_eq!(parse("0"), Ok(0));
        let live = std::fs::File::open(&log).unwrap();
        assert_eq!(rotate_past_cap(&log, &live, 0).unwrap(), None);
        assert_eq!(std::fs::read_to_string(&log).unwrap(), text);
        assert!(!dir.path().join("target-0.log.1").exists());
    }

    #[test]
    fn a_cap_is_bytes_or_a_binary_unit_and_a_bad_one_says_why() {
        for (s, want) in [
            ("64MiB", 64 << 20),
            ("64m", 64 << 20),
            ("1G", 1 << 30),
            ("512 KiB", 512 << 10),
            ("65536", 65536),
        ] {
            assert_eq!(parse(s), Ok(want), "{s}");
        }
        for (s, says) in [
            ("12Q", "not a size"),
            ("MiB", "not a size"),
            ("-1", "not a size"),
            ("99999999999GiB", "not a size"),
            ("1000", "under the smallest cap"),
        ] {
            let e = parse(s).unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }
}
