//! Kills injected into the group protocol (`[faults.drafter-N]`'s `crash_in_sync_at`,
//! `crash_in_join`, `crash_after_commit_at`, `crash_in_end_round`), a checkpoint that cannot be
//! written (`checkpoint_fails_from`) and an export that fails once (`export_fails_at`).

use std::cell::Cell;
use std::path::PathBuf;

use proto::config::Faults;

/// Kills injected into the group protocol: four places that only a drafter group has, so they
/// fire for any backend. They fire in the first incarnation only (the join fault once, by a
/// marker file), so the restarted rank gets through.
pub(crate) struct InjectedFaults {
    pub(crate) faults: Faults,
    pub(crate) first: bool,
    /// The step the reduction in progress would commit as.
    pub(crate) reducing: Cell<u64>,
    /// Present once the join fault fired.
    pub(crate) join_marker: PathBuf,
    /// Whether the export fault fired in this incarnation.
    pub(crate) export_failed: Cell<bool>,
}

impl InjectedFaults {
    fn die(what: &str) -> ! {
        tracing::error!("injected crash {what}");
        std::process::abort();
    }

    /// While waiting in the reduction (`crash_in_sync_at`).
    pub(crate) fn in_sync(&self) {
        if self.first && (self.faults.crash_in_sync_at).is_some_and(|n| self.reducing.get() >= n) {
            Self::die("inside the reduction");
        }
    }

    /// While waiting to rejoin the group (`crash_in_join`).
    pub(crate) fn in_join(&self) {
        if self.faults.crash_in_join && !self.join_marker.exists() {
            let _ = std::fs::write(&self.join_marker, b"");
            Self::die("while rejoining the group");
        }
    }

    /// Whether writing the checkpoint of `step` fails, as on a full disk
    /// (`checkpoint_fails_from`, in every incarnation: a disk stays full).
    pub(crate) fn checkpoint_fails(&self, step: u32) -> bool {
        (self.faults.checkpoint_fails_from).is_some_and(|n| u64::from(step) >= n)
    }

    /// Whether writing the export of `step` fails, as on a full disk (`export_fails_at`):
    /// once, so the export's next write (the end's, for the last step) is written.
    pub(crate) fn export_fails(&self, step: u32) -> bool {
        let fails =
            self.faults.export_fails_at == Some(u64::from(step)) && !self.export_failed.get();
        self.export_failed.set(self.export_failed.get() || fails);
        fails
    }

    /// Once the group applied `step` with this rank's batch, before its ledger line
    /// (`crash_after_commit_at`).
    pub(crate) fn after_commit(&self, step: u32, holding: bool) {
        if self.first
            && holding
            && (self.faults.crash_after_commit_at).is_some_and(|k| u64::from(step) >= k)
        {
            Self::die("after the group applied this rank's batch, before its ledger line");
        }
    }

    /// In the group's last round (every member saw the ring's end), once it committed and
    /// before this rank marked it as the end round (`crash_in_end_round`).
    pub(crate) fn in_end_round(&self) {
        if self.first && self.faults.crash_in_end_round {
            Self::die("in the group's last round, after its commit");
        }
    }
}
