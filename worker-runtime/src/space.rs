//! How a worker waits for space to write a line of the run's records (a ledger line, a lost
//! range) on a full disk: the same for the drafter worker and a Python drafter, whatever it
//! writes. The tries themselves are [`Ledger::append_waiting`]'s (the line is in the file once,
//! whole); what is here is what the worker does between them: it says the wait once in its log,
//! with the error (which names the file), beats its heartbeat (the launcher would kill a silent
//! worker as hung), and says once more when the line is written.
//!
//! [`Ledger::append_waiting`]: proto::ledger::Ledger::append_waiting

use std::path::PathBuf;
use std::time::Instant;

use proto::ledger::LedgerError;

/// Runs `write`, an append that waits for space on a full disk (it calls the waiting closure
/// it is given after each try that failed for it: [`Ledger::append_waiting`]), for `what`
/// (`the ledger line of batch 12`, said in the log; `meanwhile`: what the worker does while it
/// waits). After each failed try, `beat` beats the worker's heartbeat and says whether to go on
/// waiting (false: a stop ends the wait). A full disk's error returned means the wait was
/// ended so; any other error is the file's, at once.
///
/// [`Ledger::append_waiting`]: proto::ledger::Ledger::append_waiting
pub fn wait_for_space<R>(
    what: &str,
    meanwhile: &str,
    beat: &mut dyn FnMut() -> bool,
    write: impl FnOnce(&mut dyn FnMut(&LedgerError) -> bool) -> Result<R, LedgerError>,
) -> Result<R, LedgerError> {
    let mut since: Option<(Instant, Option<PathBuf>)> = None;
    let wrote = write(&mut |e| {
        if since.is_none() {
            let path = match e {
                LedgerError::Full { path, .. } | LedgerError::Io { path, .. } => Some(path.clone()),
                _ => None,
            };
            since = Some((Instant::now(), path));
            tracing::warn!("{e}: waiting for space to write {what} ({meanwhile})");
        }
        beat()
    });
    if let (Ok(_), Some((since, path))) = (&wrote, since) {
        let to = path.map_or_else(String::new, |p| format!(" to {}", p.display()));
        tracing::info!(
            "space again: {what} is written{to} after waiting {:.1}s",
            since.elapsed().as_secs_f64()
        );
    }
    wrote
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wait beats after each failed try and ends when `beat` says so, with the full disk's
    /// error; a write that needs no wait beats never.
    #[test]
    fn the_wait_beats_after_each_failed_try_and_a_stop_ends_it() {
        let full = |n: u32| LedgerError::Full {
            what: "appending to",
            path: PathBuf::from(format!("/r/{n}.jsonl")),
            cause: std::io::Error::from_raw_os_error(28),
        };
        let mut beats = 0;
        let got: Result<(), _> = wait_for_space(
            "a line",
            "beating",
            &mut || {
                beats += 1;
                beats < 3
            },
            |waiting| {
                for n in 0u32.. {
                    if !waiting(&full(n)) {
                        return Err(full(n));
                    }
                }
                unreachable!("the wait ends at the third beat")
            },
        );
        assert!(got.unwrap_err().is_full());
        assert_eq!(beats, 3);
        let mut beats = 0;
        let got = wait_for_space(
            "a line",
            "beating",
            &mut || {
                beats += 1;
                true
            },
            |waiting| {
                waiting(&full(0));
                Ok(7)
            },
        );
        assert_eq!((got.unwrap(), beats), (7, 1));
        let got = wait_for_space("a line", "", &mut || unreachable!(), |_| Ok(1));
        assert_eq!(got.unwrap(), 1);
    }
}
