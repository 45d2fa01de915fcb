//! A ledger open for appending ([`Ledger`]), and how a line gets in whole, once, through a disk
//! that is full for a while ([`Ledger::append_waiting`]). The run's other JSON-lines records
//! that a writer appends to while the run goes on, `lost-steps.jsonl` and `set-aside.jsonl`,
//! are appended the same way ([`record_lost`], [`record_set_aside`]).
//!
//! A write that meets a full disk (ENOSPC, or the user's quota: EDQUOT) takes what fits of the
//! line and fails: the file ends with the start of the line. Written again whole, the line
//! would follow that start as a torn line of its own (after [`end_torn_line`]), or, appended
//! without the repair, be glued to it and read as one damaged line. So a try after a failed one
//! reads what of the line is in the file already and writes only the rest: the line is in the
//! file once, whole, whatever the number of tries. This is sound because each file has one
//! writer at a time: a ledger its drafter, or the launcher once that drafter is dead;
//! `lost-steps.jsonl` the one rank that found the group empty, or the launcher at the run's end;
//! `set-aside.jsonl` the launcher.
//!
//! [`record_lost`]: super::record_lost
//! [`record_set_aside`]: super::record_set_aside

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::jsonl::end_torn_line;

use super::{io, LedgerError};

/// How long [`Ledger::append_waiting`] waits between tries while the disk is full.
pub const FULL_RETRY: Duration = Duration::from_millis(100);

/// Whether `e` is the disk, or the user's quota, full: space may come back (a file deleted,
/// a log rotated), so a writer may wait for it. Any other error (EACCES, EROFS, EIO) will not
/// pass by waiting.
pub(super) fn is_full(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    matches!(
        Errno::from_io_error(e),
        Some(Errno::NOSPC) | Some(Errno::DQUOT)
    )
}

/// A ledger (or another of the run's JSON-lines records: see the module's doc) open for
/// appending.
pub struct Ledger {
    file: File,
    path: PathBuf,
    /// Tries to write a line that fail as on a full disk, still to come (injected:
    /// [`Ledger::inject_full`]).
    full_for: u32,
}

impl Ledger {
    /// Opens (or creates) the ledger at `path` for appending, and ends a line its last writer's
    /// kill tore. On a full disk that repair is left to the first append, which ends a torn
    /// line first anyway (and can wait for space, [`Ledger::append_waiting`]): a drafter
    /// restarted on a full disk used to die here, before any work, at every restart, until it
    /// was given up.
    pub fn open(path: &Path) -> Result<Ledger, LedgerError> {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)
            .map_err(io("opening", path))?;
        // Its batch was not released, so it is redelivered: the torn line stays unreadable.
        match end_torn_line(&mut file) {
            Err(e) if !is_full(&e) => return Err(io("repairing", path)(e)),
            _ => {}
        }
        Ok(Ledger {
            file,
            path: path.to_path_buf(),
            full_for: 0,
        })
    }

    /// The ledger's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fault injection (`[faults.drafter-N] ledger_full_for`): the next `tries` tries to write a
    /// line fail with ENOSPC, as on a full disk; a try that finds none of its line in the file
    /// writes half of it first, as a write cut short by the disk filling up does.
    pub fn inject_full(&mut self, tries: u32) {
        self.full_for = tries;
    }

    /// Appends `line` with one `write` (no user-space buffer), so a kill leaves the line whole
    /// or torn, never interleaved with another. A line an earlier append left torn (a write cut
    /// short by a full disk, its error caught by a Python drafter that went on) is ended first:
    /// otherwise this line would be glued to it, and the two read as one damaged line. Two
    /// system calls a trained batch. A full disk fails it at once
    /// ([`LedgerError::is_full`]); [`Ledger::append_waiting`] waits for space instead.
    pub fn append(&mut self, line: &impl Serialize) -> Result<(), LedgerError> {
        self.append_waiting(line, &mut |_| false).map(|_| ())
    }

    /// [`Ledger::append`], waiting for space while the disk (or the quota) is full: after each
    /// try that failed for it, `waiting` is called with that try's error, and says whether to
    /// go on waiting (a caller beats its heartbeat there, says the wait once, and gives up on a
    /// stop); the next try comes [`FULL_RETRY`] later. The line gets into the file once and
    /// whole, however many tries it takes: a try writes only what of it earlier tries did not
    /// (see the module's doc). Any other error is returned at once, as is the last one when
    /// `waiting` gives up; the file may then end with the start of the line, torn, which the
    /// next append ends. Returns the tries that failed for a full disk (0: written at the
    /// first).
    pub fn append_waiting(
        &mut self,
        line: &impl Serialize,
        waiting: &mut dyn FnMut(&LedgerError) -> bool,
    ) -> Result<u32, LedgerError> {
        let mut text = serde_json::to_vec(line)?;
        text.push(b'\n');
        // Where the line starts in the file, once a try got that far.
        let mut start = None;
        let mut failed = 0;
        loop {
            match self.try_write(&text, &mut start) {
                Ok(()) => return Ok(failed),
                Err(e) if e.is_full() => {
                    failed += 1;
                    if !waiting(&e) {
                        return Err(e);
                    }
                    std::thread::sleep(FULL_RETRY);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One try at getting `text` (a line) into the file: what of it is not there yet, if a
    /// line that starts at `start` is its start (an earlier try's); else the line whole, after
    /// ending a torn line, setting `start`.
    fn try_write(&mut self, text: &[u8], start: &mut Option<u64>) -> Result<(), LedgerError> {
        let written = match *start {
            Some(at) => self.written_of(text, at)?,
            None => None,
        };
        let from = match written {
            Some(n) => n,
            None => {
                let at = end_torn_line(&mut self.file).map_err(io("repairing", &self.path))?;
                *start = Some(at);
                0
            }
        };
        self.write_rest(&text[from..], from == 0)
            .map_err(io("appending to", &self.path))
    }

    /// How many bytes of `text` the file holds from `at` to its end, if they are the start of
    /// `text`; None if they are not (the file was changed under us: the line starts again).
    fn written_of(&mut self, text: &[u8], at: u64) -> Result<Option<usize>, LedgerError> {
        let reading = io("reading", &self.path);
        let len = self.file.seek(SeekFrom::End(0)).map_err(&reading)?;
        let Some(n) = len.checked_sub(at).filter(|&n| n <= text.len() as u64) else {
            return Ok(None);
        };
        let mut there = vec![0; n as usize];
        self.file.read_exact_at(&mut there, at).map_err(reading)?;
        Ok((there == text[..there.len()]).then_some(there.len()))
    }

    /// Writes `rest`, the rest of a line (`whole`: all of it), with one `write`; an injected
    /// full disk fails it, after writing half of a whole line.
    fn write_rest(&mut self, rest: &[u8], whole: bool) -> std::io::Result<()> {
        if self.full_for > 0 {
            self.full_for -= 1;
            if whole {
                self.file.write_all(&rest[..rest.len() / 2])?;
            }
            return Err(rustix::io::Errno::NOSPC.into());
        }
        self.file.write_all(rest)
    }

    /// Makes the lines written so far durable (a ledger's at every checkpoint step).
    pub fn sync(&self) -> Result<(), LedgerError> {
        self.file.sync_data().map_err(io("syncing", &self.path))
    }
}
