//! The drafter group's collective: the ranks (drafter workers) of one run train ONE model, so
//! each step they sum their gradients and apply the same update.
//!
//! [`Collective`] is the seam: all-reduce (sum) of f32 buffers, the membership, joining with the
//! group's state, and the launcher's removal of a dead rank. [`ShmGroup`] implements it on a
//! shared-memory segment for the CPU backends; the NCCL implementation (cudarc) plugs in behind
//! the same trait with the CUDA path. Nothing outside this crate assumes shared memory.
//!
//! Guarantees (see `group.rs` for the protocol and why each holds):
//! - **Same bits on every rank.** A committed round's result is the sum of every member's
//!   buffer in rank order, computed by each rank from the same bytes.
//! - **One outcome per round.** A round commits (every member's contribution in it) or the
//!   membership changes first and it is contributed again: never committed for some ranks and
//!   not for others, because commits and membership changes are CASes on one word.
//! - **The launcher knows** whether a dead rank's last batch is in an applied update
//!   ([`Removed::committed`]): retire it if so, redeliver it otherwise. Exactly once. It
//!   learns so before the removal lets the group go on ([`Collective::remove_settling`]), while
//!   no checkpoint can hold that update yet.
//! - **No busy spin.** Waiters sleep on a shared futex for at most `shmem::sync::WAIT_SLICE`
//!   (100 ms) at a time and ask their `stop` closure between sleeps. Atomics and waits come
//!   from `shmem::sync`, which loom swaps for its own (the ring's models use the same).
//!
//! Used by `drafter-worker` (one rank per worker) and the launcher (creates the segment,
//! removes a dead rank before recovering the ring).

#![cfg_attr(loom, allow(dead_code))]

mod group;
#[cfg(any(test, loom))]
mod model;
#[cfg(not(loom))]
mod segment;
#[cfg(not(loom))]
pub mod split;

pub use group::{Committed, Ended, Membership, Reduced, Removed, MAX_RANKS, NO_BATCH};
#[cfg(not(loom))]
pub use segment::{GroupParams, Segment, LAYOUT_VERSION};

/// What can go wrong in the group, naming the rank, size or segment at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GroupError {
    #[error("rank {rank} does not exist in a group of {ranks}")]
    Rank { rank: u32, ranks: u32 },
    #[error("buffer of {got} elements; the group was made for {want}")]
    Size { want: usize, got: usize },
    #[error("rank {rank} is not a member of the group (epoch {epoch}): it was removed")]
    NotMember { rank: u32, epoch: u16 },
    #[error(
        "the group's membership changed (epoch {expected} -> {now}) before the round committed"
    )]
    EpochChanged { expected: u16, now: u16 },
    #[error("stopped while waiting for the group")]
    Stopped,
    #[error("group segment {name:?}: {why}")]
    Segment { name: String, why: String },
    #[error("the gradient exchange failed: {0}")]
    Transport(String),
}

/// The group operations a drafter rank and the launcher need, whatever the transport.
pub trait Collective {
    /// This handle's rank.
    fn rank(&self) -> u32;
    /// The current membership (epoch, last committed step, members).
    fn membership(&self) -> Membership;
    /// Sums `data` over the members into `out` (identical bits on every member), for the
    /// step after the last committed one. `batch` names the batch `data` came from
    /// ([`NO_BATCH`] if none). Contributes again by itself when the membership changes first.
    fn all_reduce(
        &self,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError>;
    /// Like [`Collective::all_reduce`], but commits only with the members of membership epoch
    /// `epoch`: if the membership changes first, returns [`GroupError::EpochChanged`] and no
    /// commit holds this contribution. For ranks whose real data go through another collective
    /// (a torch.distributed group of that epoch's members) and who commit the step here.
    fn commit_within(
        &self,
        epoch: u16,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError>;
    /// A restarted rank: waits to be admitted, then fills `state` with the leader's state and
    /// returns the membership and the step that state is from; `None` if the group was empty
    /// and it admitted itself: the group then goes on from `own_step`, the step of the state it
    /// loads itself (its last checkpoint), or from the group's own last step if that is later
    /// (the membership's step): the updates after `own_step` were lost, and no step number is
    /// used twice (`proto::ledger::LostSteps`).
    fn join(
        &self,
        state: &mut [u32],
        own_step: u32,
        stop: &dyn Fn() -> bool,
    ) -> Result<(Membership, Option<u64>), GroupError>;
    /// Marks committed round `round` as the group's end round (every member saw the ring's end
    /// in it, so it applied no update and the state stays that of step `applied`): every
    /// member that sums such a round marks it, so that a rank joining an emptied group after it
    /// neither takes it for an update lost nor moves its state's step past it.
    fn mark_ended(&self, round: u32, applied: u32);
    /// The latest end round marked, if any; [`Membership::state_step`] tells whether it is the
    /// membership's last committed round.
    fn ended(&self) -> Option<Ended>;
    /// This rank's published arrival: (epoch, step) of its last contribution, None if it has
    /// none. After a round it left (stopped), that contribution commits only in that epoch:
    /// the round is applied once the step reaches it, and never once the epoch moves on first.
    fn arrival(&self) -> Option<(u16, u32)>;
    /// True if some rank asks to join (the leader checks between steps).
    fn joiners_waiting(&self) -> bool;
    /// The leader between steps: admits ranks asking to join, handing them `state` (from
    /// `state_step`, the last committed step). Returns the bit set of ranks admitted.
    fn admit_joiners(&self, state_step: u32, state: &[u32]) -> Result<u16, GroupError>;
    /// The launcher's side: removes dead `rank` (call only once its process is gone).
    fn remove(&self, rank: u32) -> Result<Removed, GroupError> {
        self.remove_settling(rank, &mut |_| {})
    }
    /// [`Collective::remove`], showing `settle` the dead rank's batch whose update the group
    /// applied ([`Removed::committed`]) before the removal lets the group go on: the one moment
    /// no checkpoint can hold that update yet, so the caller records the batch as trained
    /// there. Possibly more than once, always with the same batch.
    fn remove_settling(
        &self,
        rank: u32,
        settle: &mut dyn FnMut(Committed),
    ) -> Result<Removed, GroupError>;
}

/// The one place a run's collective is chosen: the launcher creates the group with [`create`]
/// and every drafter rank attaches with [`attach`]; both hold a `dyn Collective` and never name
/// the implementation. Today that is always [`ShmGroup`]; the NCCL group, once built, is chosen
/// here beside it.
#[cfg(not(loom))]
pub fn create(name: &str, params: &GroupParams) -> Result<Box<dyn Collective>, GroupError> {
    Ok(Box::new(ShmGroup::create(name, params)?))
}

/// Attaches to the group `name` as `rank` (see [`create`]).
#[cfg(not(loom))]
pub fn attach(name: &str, rank: u32) -> Result<Box<dyn Collective>, GroupError> {
    Ok(Box::new(ShmGroup::attach(name, rank)?))
}

/// A rank's (or the launcher's) handle on a shared-memory group.
#[cfg(not(loom))]
pub struct ShmGroup {
    proto: group::Protocol<Segment>,
    rank: u32,
}

#[cfg(not(loom))]
impl ShmGroup {
    /// Creates the group segment (the launcher does this; its handle removes it on drop).
    pub fn create(name: &str, params: &GroupParams) -> Result<ShmGroup, GroupError> {
        Ok(ShmGroup {
            proto: group::Protocol {
                mem: Segment::create(name, params)?,
            },
            rank: u32::MAX,
        })
    }

    /// Attaches as `rank`.
    pub fn attach(name: &str, rank: u32) -> Result<ShmGroup, GroupError> {
        let mem = Segment::attach(name)?;
        use group::Memory;
        if rank >= mem.ranks() {
            return Err(GroupError::Rank {
                rank,
                ranks: mem.ranks(),
            });
        }
        Ok(ShmGroup {
            proto: group::Protocol { mem },
            rank,
        })
    }
}

#[cfg(not(loom))]
impl Collective for ShmGroup {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn membership(&self) -> Membership {
        self.proto.membership()
    }
    fn all_reduce(
        &self,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError> {
        self.proto.all_reduce(self.rank, data, batch, out, stop)
    }
    fn commit_within(
        &self,
        epoch: u16,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError> {
        self.proto
            .commit_within(self.rank, epoch, data, batch, out, stop)
    }
    fn join(
        &self,
        state: &mut [u32],
        own_step: u32,
        stop: &dyn Fn() -> bool,
    ) -> Result<(Membership, Option<u64>), GroupError> {
        self.proto.join(self.rank, state, own_step, stop)
    }
    fn mark_ended(&self, round: u32, applied: u32) {
        self.proto.mark_ended(round, applied)
    }
    fn ended(&self) -> Option<Ended> {
        self.proto.ended()
    }
    fn arrival(&self) -> Option<(u16, u32)> {
        self.proto.arrival(self.rank)
    }
    fn joiners_waiting(&self) -> bool {
        self.proto.joiners_waiting()
    }
    fn admit_joiners(&self, state_step: u32, state: &[u32]) -> Result<u16, GroupError> {
        self.proto.admit_joiners(self.rank, state_step, state)
    }
    fn remove_settling(
        &self,
        rank: u32,
        settle: &mut dyn FnMut(Committed),
    ) -> Result<Removed, GroupError> {
        self.proto.remove_settling(rank, settle)
    }
}
