//! Whether the drafter group's ranks held one model to the end: each ledger line carries a
//! digest of the weights after its step's update, which is the same on every rank for one step
//! (README, "The drafter group"). Our drafters hold to it by construction; a drafter of the
//! user's own (`[drafter] command`) may not (an update applied differently on one rank), and its
//! run used to end `ok` with ranks whose weights had drifted apart: every count agreed, and
//! nothing compared the digests.
//!
//! Compared at the end of a run, from the ledgers the summary reads anyway (one more pass over
//! them, a line of memory at a time, and a digest per step). Not live: a rank's lines of one
//! step reach the ledgers at its own pace, so a live check would keep every rank's recent
//! lines and read the ledgers' tails at every tick for what the end finds as well; a drift is a
//! bug of the drafter's, not a failure the run could recover from.
//!
//! What is compared: the readable lines of different ranks (ledger files) at one step. Left
//! out are lines with no digest (the launcher's line for a dead rank's applied batch, a Python
//! batch released without one) and lines of lost steps (`lost-steps.jsonl`: updates no weights
//! hold, skipped or lost with the ranks). Steps are never used twice for different weights: a
//! group that goes on after every rank died goes on from later steps, and a resume drops the
//! lines after its checkpoint's step, so the lines of one step are of one update, whichever
//! launch or incarnation wrote them.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use proto::ledger::{self, LedgerError, LostSteps};
use proto::RunDir;

/// The first step at which two ranks' ledgers name different weights.
#[derive(Debug, PartialEq, Eq)]
pub struct Drift {
    pub step: u64,
    /// (rank, digest) of the first line of that step, and of the first that differs from it.
    pub first: (u32, String),
    pub other: (u32, String),
    /// Steps at which some ranks differ, this one included.
    pub steps: u64,
}

impl Drift {
    /// The summary's note, which makes the run degraded.
    pub fn note(&self) -> String {
        let ((a, da), (b, db)) = (&self.first, &self.other);
        format!(
            "the drafters' weights differ from step {} on: its ledger lines record digest {da} \
             on drafter-{a} and {db} on drafter-{b} ({} step(s) differ in all), so the ranks \
             did not train one model: every rank of the group must apply the same update to the \
             same weights (a drafter of your own: the same sum, the same code; README, \"The \
             drafter group\")",
            self.step, self.steps
        )
    }
}

/// The first step at which the ranks' ledgers of `run_dir` record different weights, if any.
pub fn first_drift(run_dir: &RunDir) -> Result<Option<Drift>, LedgerError> {
    let lost = ledger::read_lost(run_dir)?;
    // The first digest seen at each step, with its rank; and each step where another differs.
    let mut seen: BTreeMap<u64, (u32, String)> = BTreeMap::new();
    let mut differ: BTreeMap<u64, (u32, String)> = BTreeMap::new();
    for rank in ledger::indices(run_dir)? {
        ledger::scan(run_dir, rank, |entry| {
            let Some(l) = entry.line else { return };
            if l.digest.is_empty() || LostSteps::any_has(&lost, &l) {
                return;
            }
            match seen.entry(l.step) {
                Entry::Vacant(v) => {
                    v.insert((rank, l.digest));
                }
                Entry::Occupied(o) => {
                    let (first, digest) = o.get();
                    if *first != rank && *digest != l.digest {
                        differ.entry(l.step).or_insert((rank, l.digest));
                    }
                }
            }
        })?;
    }
    let steps = differ.len() as u64;
    Ok(differ.into_iter().next().map(|(step, other)| Drift {
        step,
        first: seen.remove(&step).expect("seen before it differed"),
        other,
        steps,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run directory whose ledger of drafter `d` holds `(step, digest)` lines, one per item.
    fn run_dir(tag: &str, ledgers: &[&[(u64, &str)]]) -> (tempfile::TempDir, RunDir) {
        let tmp = tempfile::Builder::new().prefix(tag).tempdir().unwrap();
        let dir = RunDir::new(tmp.path());
        std::fs::create_dir_all(dir.ledger_dir()).unwrap();
        let mut batch = 0;
        for (d, lines) in ledgers.iter().enumerate() {
            let mut text = String::new();
            for &(step, digest) in lines.iter() {
                batch += 1;
                let line = ledger::LedgerLine {
                    batch_id: batch,
                    sample_ids: vec![batch],
                    tokens: 1,
                    delivery: 0,
                    ticket: batch,
                    step,
                    digest: digest.to_string(),
                    epoch: 1,
                };
                text += &(serde_json::to_string(&line).unwrap() + "\n");
            }
            std::fs::write(dir.ledger(d as u32), text).unwrap();
        }
        (tmp, dir)
    }

    #[test]
    fn ranks_recording_one_model_have_no_drift() {
        let (_t, dir) = run_dir("one", &[&[(1, "aa"), (2, "bb")], &[(1, "aa"), (2, "bb")]]);
        assert_eq!(first_drift(&dir).unwrap(), None);
    }

    #[test]
    fn the_first_step_whose_ranks_differ_is_named_with_both_ranks() {
        let (_t, dir) = run_dir(
            "drift",
            &[
                &[(1, "aa"), (2, "bb"), (3, "cc"), (4, "dd")],
                &[(1, "aa"), (2, "bb"), (3, "c2"), (4, "d2")],
            ],
        );
        let drift = first_drift(&dir).unwrap().expect("a drift");
        assert_eq!(
            drift,
            Drift {
                step: 3,
                first: (0, "cc".into()),
                other: (1, "c2".into()),
                steps: 2,
            }
        );
        let note = drift.note();
        assert!(
            note.contains("from step 3 on") && note.contains("drafter-1"),
            "{note}"
        );
    }

    /// The launcher's lines for a dead rank's applied batch have no digest, and lines of a lost
    /// step record weights no one holds: neither is compared.
    #[test]
    fn lines_without_a_digest_and_lines_of_lost_steps_are_not_compared() {
        let (_t, dir) = run_dir("left", &[&[(1, "aa"), (2, "bb")], &[(1, ""), (2, "zz")]]);
        let lost = LostSteps {
            first: 2,
            last: 2,
            rank: None,
            skipped: true,
        };
        ledger::record_lost(&dir, &lost, &mut |_| false).unwrap();
        assert_eq!(first_drift(&dir).unwrap(), None);
    }

    /// One rank's lines are never compared with each other: a rank whose ledger holds lines of
    /// one step from two incarnations is no drift between ranks.
    #[test]
    fn one_ranks_own_lines_are_not_compared() {
        let (_t, dir) = run_dir("own", &[&[(1, "aa"), (1, "ab")]]);
        assert_eq!(first_drift(&dir).unwrap(), None);
    }
}
