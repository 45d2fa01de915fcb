//! Updates lost with the group's state: every drafter rank died, and the first one back had no
//! live rank to hand it the weights, so it went on from its checkpoint (step C) while the group
//! had applied up to step M. The batches trained in steps C+1..=M have ledger lines, and their
//! slots were released, but their updates are not in the weights. The rank records the range
//! here (`RunDir::lost_steps`, one JSON line each, synced before it trains on) and the group
//! goes on from step M, so no step number is used twice and a range names its lines alone.
//!
//! The launcher records a range here too when the drafter group diverged (every update of a row
//! of steps skipped, its gradient NaN or infinite: `--stop-after-skipped`): those batches were
//! trained into no update either.
//!
//! A ledger line whose step is in a lost range does not count as trained: the run's summary
//! counts its samples untrained (the run ends degraded) and `--resume` trains them again.

use serde::{Deserialize, Serialize};

use super::{io, read_lines, Ledger, LedgerError, LedgerLine};
use crate::RunDir;

/// Steps `first..=last` whose updates were lost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostSteps {
    pub first: u64,
    pub last: u64,
    /// The drafter rank that went on from its checkpoint (of step `first - 1`); none for
    /// updates skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    /// The updates were skipped, the group's gradient NaN or infinite (the launcher's record
    /// of a group that diverged), rather than lost with every drafter.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

impl LostSteps {
    /// The steps a rank going on from its checkpoint of step `checkpoint` loses, when the group
    /// had applied up to step `group`; None when it loses none.
    pub fn between(rank: u32, checkpoint: u64, group: u64) -> Option<LostSteps> {
        (group > checkpoint).then_some(LostSteps {
            first: checkpoint + 1,
            last: group,
            rank: Some(rank),
            skipped: false,
        })
    }

    pub fn contains(&self, step: u64) -> bool {
        (self.first..=self.last).contains(&step)
    }

    /// Whether `line`'s update is lost in any of `lost`.
    pub fn any_has(lost: &[LostSteps], line: &LedgerLine) -> bool {
        lost.iter().any(|l| l.contains(line.step))
    }
}

impl std::fmt::Display for LostSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (first, last) = (self.first, self.last);
        match self.rank {
            _ if self.skipped => write!(
                f,
                "the updates of steps {first}..={last} were skipped, the group's gradient NaN or \
                 infinite: the drafters diverged"
            ),
            Some(rank) => write!(
                f,
                "the updates of steps {first}..={last} were lost when every drafter died: \
                 drafter-{rank} went on from its checkpoint of step {}",
                first.saturating_sub(1)
            ),
            None => write!(f, "the updates of steps {first}..={last} were lost"),
        }
    }
}

/// For a drafter (or the launcher, for a group that diverged): records `lost` and makes it
/// durable, before it trains on. A full disk is waited out as a ledger line's is (`waiting`:
/// [`Ledger::append_waiting`]): the range is in the file once, whole. Before, the rank died of
/// it, and each restart, finding the group empty again, died at the same line.
pub fn record_lost(
    run_dir: &RunDir,
    lost: &LostSteps,
    waiting: &mut dyn FnMut(&LedgerError) -> bool,
) -> Result<(), LedgerError> {
    let file = Ledger::open(&run_dir.lost_steps())?;
    write_lost(file, run_dir, lost, waiting)
}

/// [`record_lost`] to `file`, open on `lost-steps.jsonl` (a test injects a full disk there).
pub(super) fn write_lost(
    mut file: Ledger,
    run_dir: &RunDir,
    lost: &LostSteps,
    waiting: &mut dyn FnMut(&LedgerError) -> bool,
) -> Result<(), LedgerError> {
    file.append_waiting(lost, waiting)?;
    file.sync()?;
    atomic_file::sync_dir(run_dir.path()).map_err(io("syncing the directory of", file.path()))
}

/// The lost ranges of the run (none if the file is missing). A line cut short was torn by a
/// kill, before its rank trained on: it is skipped, and the rank's restart, finding the group
/// empty again, records the range again. A line that is not the start of one is an error: its
/// range's batches would count as trained.
pub fn read_lost(run_dir: &RunDir) -> Result<Vec<LostSteps>, LedgerError> {
    read_lines(
        &run_dir.lost_steps(),
        "deleting it would count its steps' batches trained, and a resume would never train \
         them: if it cannot be restored, write a range that covers every step it could have named",
    )
}
