//! The step of the group checkpoint a drafter of the user's own (`[drafter] command`, a Python
//! drafter) saved. Such a drafter saves its weights itself, in a file of its own that hspipe
//! cannot read; the rank that wrote the file whole tells hspipe "the group's weights as of step S
//! are saved" (`Drafter.checkpointed(S)` in the Python package), and [`record`] writes S to
//! `RunDir::checkpointed_step`, replaced whole (a kill leaves the last step recorded or this
//! one). `launcher --resume` reads it ([`read`]) where it would read our checkpoint's step: a
//! ledger line of step <= S is a batch whose update the saved weights hold, never trained again;
//! the group starts at S, and the resumed drafters load their file of step S.
//!
//! The record is the drafter's promise that its file of step S exists, so it is written after
//! the file, and the drafter keeps that file until a later step is recorded: a rank killed
//! between writing the file of step T and recording T leaves S recorded, and the resume goes on
//! from S, training the updates of S+1..=T again, into the weights of S.
//!
//! What cannot be right is refused: a step the rank has not applied (the weights saved cannot
//! hold it), and a step before the one recorded (the ledger lines between were taken for
//! trained, in the weights, and a resume from the earlier step would drop them while their
//! samples stay in a saved file of the later step).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::RunDir;

/// The file's content.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    step: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointedError {
    #[error(
        "checkpointed({step}): this rank has applied the group's updates up to step {applied} only, so weights saved now cannot hold step {step}'s: pass the step of the update applied last (the step all_reduce returned)"
    )]
    NotApplied { step: u64, applied: u64 },
    #[error(
        "checkpointed({step}): step {recorded} was recorded saved already ({}), and a recorded step never goes back: the batches trained up to it are taken for trained into the saved weights (one rank, the leader, calls it, with the step of the weights it saved)",
        path.display()
    )]
    Backwards {
        step: u64,
        recorded: u64,
        path: PathBuf,
    },
    #[error(
        "{}: not a record hspipe wrote ({why}): it is replaced whole, so it was changed or damaged since; write the step of the saved weights the drafter's own file holds (`{{\"step\": S}}`) to resume from it, or remove the file to train the run from the start",
        path.display()
    )]
    Damaged { path: PathBuf, why: String },
    #[error("{what} {}: {cause}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
}

fn io<'p>(
    what: &'static str,
    path: &'p Path,
) -> impl FnOnce(std::io::Error) -> CheckpointedError + 'p {
    move |cause| CheckpointedError::Io {
        what,
        path: path.to_path_buf(),
        cause,
    }
}

/// The step recorded in `run_dir`, None when none is (a run of ours, or a drafter of one's own
/// that recorded none yet).
pub fn read(run_dir: &RunDir) -> Result<Option<u64>, CheckpointedError> {
    let path = run_dir.checkpointed_step();
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("reading", &path)(e)),
    };
    let record: Record =
        serde_json::from_slice(&bytes).map_err(|e| CheckpointedError::Damaged {
            path: path.clone(),
            why: e.to_string(),
        })?;
    Ok(Some(record.step))
}

/// Records that the group's weights as of `step` are saved, by a rank that has applied the
/// updates up to step `applied`: written whole and synced before it returns. The step recorded
/// already again is a no-op.
pub fn record(run_dir: &RunDir, step: u64, applied: u64) -> Result<(), CheckpointedError> {
    if step > applied {
        return Err(CheckpointedError::NotApplied { step, applied });
    }
    let path = run_dir.checkpointed_step();
    match read(run_dir)? {
        Some(recorded) if recorded > step => {
            return Err(CheckpointedError::Backwards {
                step,
                recorded,
                path,
            })
        }
        Some(recorded) if recorded == step => return Ok(()),
        _ => {}
    }
    let dir = run_dir.checkpoints_dir();
    std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let text = serde_json::to_string(&Record { step }).expect("a struct of one integer");
    atomic_file::replace(&path, format!("{text}\n").as_bytes()).map_err(io("writing", &path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step recorded is read back, from a later `read` (a resume's) too; steps go forward,
    /// and the same step again changes nothing.
    #[test]
    fn a_recorded_step_is_read_back_and_goes_forward() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        assert_eq!(read(&run).unwrap(), None);
        record(&run, 3, 3).unwrap();
        assert_eq!(read(&run).unwrap(), Some(3));
        record(&run, 3, 5).unwrap();
        record(&run, 6, 7).unwrap();
        assert_eq!(read(&run).unwrap(), Some(6));
        let text = std::fs::read_to_string(run.checkpointed_step()).unwrap();
        assert_eq!(text, "{\"step\":6}\n");
        // Replaced whole: no temporary left beside it.
        let names = std::fs::read_dir(run.checkpoints_dir()).unwrap().count();
        assert_eq!(names, 1);
    }

    /// A step the rank has not applied, and one before the step recorded, are refused with the
    /// steps and what to pass, and leave the record as it was.
    #[test]
    fn a_step_not_applied_or_going_back_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let e = record(&run, 4, 3).unwrap_err().to_string();
        assert!(
            e.contains("checkpointed(4)") && e.contains("up to step 3 only"),
            "{e}"
        );
        assert_eq!(read(&run).unwrap(), None);
        record(&run, 6, 6).unwrap();
        let e = record(&run, 5, 9).unwrap_err().to_string();
        assert!(
            e.contains("checkpointed(5)") && e.contains("step 6 was recorded saved already"),
            "{e}"
        );
        assert_eq!(read(&run).unwrap(), Some(6));
    }

    /// A record changed by hand into something else is an error naming the file and the way on,
    /// for a resume and for the next record alike: never taken for no record (a resume from
    /// the start would train every batch again on top of the saved weights' step).
    #[test]
    fn a_damaged_record_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::create_dir_all(run.checkpoints_dir()).unwrap();
        for bad in ["", "{\"step\": -1}", "{\"step\": 3, \"by\": 1}", "7"] {
            std::fs::write(run.checkpointed_step(), bad).unwrap();
            let e = read(&run).unwrap_err().to_string();
            assert!(
                e.contains("step.json: not a record hspipe wrote") && e.contains("remove the file"),
                "{bad}: {e}"
            );
            assert!(record(&run, 8, 8).is_err(), "{bad}");
        }
    }
}
