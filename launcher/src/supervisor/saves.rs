//! What the drafter group's leader wrote at its checkpoints, as it reports each one
//! (`ToLauncher::Saved`): the checkpoint, the export (`drafter/`) and a kept export
//! (`drafter-steps/step-S`).
//!
//! A write that fails (a full disk, a quota, the device out of memory for an export) no longer
//! ends the leader: training goes on, the previous checkpoint stays whole (each is written
//! atomically) and the next checkpoint step tries again. It ended the leader before, whose
//! restart trained the same steps again from the previous checkpoint to fail at the same one,
//! for as long as the run went on, each death starting the restart count again: a week of a
//! full disk left a week-old checkpoint and a run that ended `ok`. So the launcher says a
//! failure on the console, once for each streak of them (each failure is in the leader's log),
//! with the step the last good one is of, and says when one is written again; a run that ends
//! with the last one(s) failed ends with a note saying since when nothing was written, and so
//! degraded (exit code 3), because:
//!
//! - the weights it ended with are nowhere on disk: the checkpoint (and the export an engine
//!   loads) holds the model of step X, while the ledgers count every later batch as trained, so
//!   `ok: true` would tell whoever ships the model that it holds them;
//! - `launcher --resume` refuses a run whose summary says `ok: true` ("nothing to resume"), and
//!   a degraded one it resumes from the checkpoint of step X, training the batches after X
//!   again, which is how such a run is finished once the disk has room.
//!
//! A kept export that fails is said the same way; its step is never kept again, and the end's
//! note lists the steps not kept without making the run degraded (the weights are in the
//! checkpoint, and `drafter/` is the final export).

use proto::control::SaveReport;

/// One of the files the leader writes at a checkpoint, and its streak of failures.
#[derive(Debug, Default)]
struct Streak {
    /// The step of the last one written (None: none yet in this run, or its resume's
    /// checkpoint for the checkpoint).
    last_good: Option<u64>,
    /// The failures since: the first one's step and error, the latest one's step, and how many.
    failing: Option<Failing>,
}

#[derive(Debug)]
struct Failing {
    first_step: u64,
    error: String,
    last_step: u64,
    count: u32,
}

impl Streak {
    /// Takes in the write of `step` (`error`: its failure); the line to say, if any: the first
    /// failure of a streak, or the write that ends one.
    fn write(&mut self, what: &str, step: u64, error: Option<&str>) -> Option<String> {
        let Some(error) = error else {
            let ended = self.failing.take();
            self.last_good = Some(step);
            return ended.map(|f| {
                format!(
                    "{what} of step {step} written: the {} before it failed (steps {} to {})",
                    f.count, f.first_step, f.last_step
                )
            });
        };
        if let Some(f) = &mut self.failing {
            f.last_step = step;
            f.count += 1;
            return None;
        }
        self.failing = Some(Failing {
            first_step: step,
            error: error.to_string(),
            last_step: step,
            count: 1,
        });
        Some(format!(
            "{what} of step {step} failed: {error}; {}; training goes on, and each checkpoint step tries again (said again only once one is written; each failure is in the leader's log)",
            self.last_said(what)
        ))
    }

    /// `the last checkpoint written is of step 6`, or that there is none.
    fn last_said(&self, what: &str) -> String {
        match self.last_good {
            Some(step) => format!("the last {what} written is of step {step}"),
            None => format!("no {what} was written yet"),
        }
    }
}

/// The checkpoints, exports and kept exports the leader reported.
#[derive(Debug, Default)]
pub(super) struct Saves {
    checkpoint: Streak,
    export: Streak,
    /// The kept exports that failed: their steps and the first one's error.
    not_kept: Vec<u64>,
    kept_error: Option<String>,
    /// Whether the last keep failed: a streak of them is said once.
    keeping_fails: bool,
}

impl Saves {
    /// `checkpoint_step`: the step of the checkpoint the run starts from (a resume's; 0 for
    /// none).
    pub(super) fn new(checkpoint_step: u32) -> Saves {
        let mut saves = Saves::default();
        saves.checkpoint.last_good = (checkpoint_step > 0).then_some(u64::from(checkpoint_step));
        saves
    }

    /// Takes in the leader's report of one checkpoint step; the lines to say.
    pub(super) fn saved(&mut self, r: &SaveReport) -> Vec<String> {
        let mut lines = Vec::new();
        lines.extend(self.export.write("export", r.step, r.export.as_deref()));
        match &r.kept {
            Some(e) => {
                self.not_kept.push(r.step);
                self.kept_error.get_or_insert_with(|| e.clone());
                if !self.keeping_fails {
                    lines.push(format!(
                        "the export of step {} is not kept in drafter-steps/: {e} (the run goes on; said again only once one is kept)",
                        r.step
                    ));
                }
                self.keeping_fails = true;
            }
            None if r.keeping => self.keeping_fails = false,
            None => {}
        }
        lines.extend((self.checkpoint).write("checkpoint", r.step, r.checkpoint.as_deref()));
        lines
    }

    /// The notes of a run that ends with its last checkpoint or export failed: it ends degraded
    /// (see the module's doc). `resume`: the command that continues the run.
    pub(super) fn at_the_end(&self, resume: &str) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(f) = &self.checkpoint.failing {
            let since = match self.checkpoint.last_good {
                Some(step) => format!("since step {step}"),
                None => "written in this run".to_string(),
            };
            let from = self.checkpoint.last_good.unwrap_or(0);
            notes.push(format!(
                "no checkpoint {since}: {} ({} failed, steps {} to {}): the weights the run ended with are not on disk; once a checkpoint can be written, `{resume}` trains the batches after step {from} again",
                f.error, f.count, f.first_step, f.last_step
            ));
        }
        if let Some(f) = &self.export.failing {
            let since = match self.export.last_good {
                Some(step) => format!("since step {step}"),
                None => "written in this run".to_string(),
            };
            notes.push(format!(
                "no export {since}: {} ({} failed, steps {} to {}): drafter/ does not hold the run's last weights",
                f.error, f.count, f.first_step, f.last_step
            ));
        }
        notes
    }

    /// The steps whose export was not kept, for the summary's notes (not a degraded run).
    pub(super) fn not_kept(&self) -> Option<String> {
        let e = self.kept_error.as_ref()?;
        let steps: Vec<String> = self.not_kept.iter().map(u64::to_string).collect();
        Some(format!(
            "the exports of step(s) {} were not kept in drafter-steps/: {e}",
            steps.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, checkpoint: Option<&str>) -> SaveReport {
        SaveReport {
            step,
            checkpoint: checkpoint.map(String::from),
            ..SaveReport::default()
        }
    }

    const FULL: &str =
        "writing the checkpoint c.safetensors: No space left on device (os error 28)";

    /// A full disk from step 9 on: said once (with the error and the last good step), not at
    /// every checkpoint; the run that ends so has a note naming the step it could resume from.
    #[test]
    fn a_streak_of_failed_checkpoints_is_said_once_and_noted_at_the_end() {
        let mut s = Saves::new(0);
        assert!(s.saved(&report(3, None)).is_empty());
        assert!(s.saved(&report(6, None)).is_empty());
        let said = s.saved(&report(9, Some(FULL)));
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].starts_with("checkpoint of step 9 failed: writing the checkpoint"),
            "{said:?}"
        );
        assert!(said[0].contains("No space left on device"), "{said:?}");
        assert!(
            said[0].contains("the last checkpoint written is of step 6"),
            "{said:?}"
        );
        assert!(
            s.saved(&report(12, Some(FULL))).is_empty(),
            "said once a streak"
        );
        assert!(s.saved(&report(14, Some(FULL))).is_empty());
        let notes = s.at_the_end("launcher --resume runs/x");
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].starts_with(&format!(
                "no checkpoint since step 6: {FULL} (3 failed, steps 9 to 14)"
            )),
            "{notes:?}"
        );
        assert!(
            notes[0].contains("`launcher --resume runs/x` trains the batches after step 6 again"),
            "{notes:?}"
        );
    }

    /// A streak that ends (the disk freed) is said as ended, leaves no note, and a new streak
    /// is said again; a resumed run's last good checkpoint is its resume's.
    #[test]
    fn a_checkpoint_written_again_ends_the_streak_and_leaves_no_note() {
        let mut s = Saves::new(30);
        let said = s.saved(&report(33, Some(FULL)));
        assert!(
            said[0].contains("the last checkpoint written is of step 30"),
            "{said:?}"
        );
        s.saved(&report(36, Some(FULL)));
        let said = s.saved(&report(39, None));
        assert_eq!(
            said,
            ["checkpoint of step 39 written: the 2 before it failed (steps 33 to 36)"]
        );
        assert!(s.at_the_end("r").is_empty());
        assert_eq!(s.saved(&report(42, Some("quota"))).len(), 1, "a new streak");
        let notes = s.at_the_end("r");
        assert!(
            notes[0].starts_with("no checkpoint since step 39: quota"),
            "{notes:?}"
        );

        let mut fresh = Saves::new(0);
        fresh.saved(&report(3, Some(FULL)));
        assert!(fresh.at_the_end("r")[0].starts_with("no checkpoint written in this run: "));
    }

    /// An export that fails is said and noted as a checkpoint is, apart from it (the checkpoint
    /// is written all the same); a kept export that fails is said once a streak and listed,
    /// without a note that degrades the run.
    #[test]
    fn failed_exports_and_keeps_are_said_apart_from_the_checkpoint() {
        let mut s = Saves::new(0);
        let oom = SaveReport {
            step: 4,
            export: Some("exporting the drafter: out of memory".into()),
            kept: Some("keeping the export: No space left on device".into()),
            keeping: true,
            ..SaveReport::default()
        };
        let said = s.saved(&oom);
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(said[0].starts_with("export of step 4 failed: exporting the drafter: out of memory; no export was written yet"), "{said:?}");
        assert!(
            said[1].starts_with("the export of step 4 is not kept in drafter-steps/: keeping"),
            "{said:?}"
        );
        assert!(
            s.saved(&SaveReport {
                step: 8,
                ..oom.clone()
            })
            .is_empty(),
            "{s:?}"
        );
        let notes = s.at_the_end("r");
        assert_eq!(notes.len(), 1, "the checkpoints were written: {notes:?}");
        assert!(notes[0].starts_with("no export written in this run: exporting the drafter: out of memory (2 failed, steps 4 to 8)"), "{notes:?}");
        assert_eq!(
            s.not_kept().as_deref(),
            Some("the exports of step(s) 4, 8 were not kept in drafter-steps/: keeping the export: No space left on device")
        );
        let kept = SaveReport {
            step: 12,
            keeping: true,
            ..SaveReport::default()
        };
        assert_eq!(s.saved(&kept).len(), 1, "the export's streak ended: {s:?}");
        assert!(s.at_the_end("r").is_empty());
    }
}
