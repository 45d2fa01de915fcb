//! The group with its gradient on a device transport (NCCL between GPUs): the big words of a
//! round go through a [`Transport`]'s communicator of the membership epoch's members, and the
//! step commits in the shared-memory group *within that epoch*, with the round's few other
//! words (loss, tokens, flags). [`SplitGroup`] is a [`Collective`] like any other: the drafter
//! does not know which it holds.
//!
//! Why it stays exactly once: a commit within epoch `E` means every member of `E` finished the
//! same exchange, so the update every rank applies and the batches the launcher counts as
//! trained are the same set. If the membership changes first, nothing commits
//! ([`GroupError::EpochChanged`]) and the ranks exchange again among the new members; the
//! launcher redelivers the dead rank's batch.
//!
//! Why a rank dying inside an exchange does not hang the others: every wait in a transport
//! (connecting, exchanging) asks `give_up` between short sleeps; it turns true when this
//! group's membership moves on (the launcher removes a dead rank once its process is gone; the
//! leader admits a joiner between steps) or the caller stops. The communicator is then aborted
//! (never destroyed: destroying waits for the dead peer) and a new one is made at the new epoch.
//! An exchange or a connection that fails (an NCCL error, a failed copy) ends the round with
//! [`GroupError::Transport`] at once: the others would not connect again within the same epoch,
//! so this rank cannot retry alone. Its worker exits, the launcher removes it (a membership
//! change: the others abandon their waits and go on without it) and restarts it.
//!
//! The rendezvous of an epoch's communicator (NCCL's unique id, drawn by the epoch's leader) is
//! a file per epoch ([`Board`]) in a directory new for every launch.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use crate::{Collective, Committed, Ended, GroupError, Membership, Reduced, Removed};

/// How often the waits of a transport ask `give_up`.
pub const POLL: Duration = Duration::from_millis(10);

/// Why an exchange or a connection did not complete.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TransportError {
    /// `give_up` turned true first; the communicator is unusable (abort it).
    #[error("abandoned: the group's membership moved on")]
    Abandoned,
    #[error("{0}")]
    Failed(String),
}

/// Makes the communicator of one membership epoch.
pub trait Transport: Send {
    type Comm: Exchange;
    /// Connects as `rank` (the position among the epoch's members, 0 for the leader) of
    /// `ranks`, for membership epoch `epoch`; waits until every member has connected, or until
    /// `give_up` turns true.
    fn connect(
        &mut self,
        epoch: u16,
        rank: u32,
        ranks: u32,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Self::Comm, TransportError>;
}

/// One epoch's communicator.
pub trait Exchange: Send {
    /// Sums `data` over the communicator's ranks into `out` (the same bits on every rank),
    /// unless `give_up` turns true first.
    fn all_reduce(
        &mut self,
        data: &[f32],
        out: &mut [f32],
        give_up: &dyn Fn() -> bool,
    ) -> Result<(), TransportError>;
    /// Abandons the communicator without waiting for any peer. An error: it may not have
    /// stopped (its kernels still running), so this rank must not go on.
    fn abort(self) -> Result<(), TransportError>;
}

/// Where an epoch's leader leaves the bytes its members connect with (NCCL's unique id): one
/// file per epoch, written whole (a temporary file renamed), read by the others once present.
/// The directory must be new for every launch (the ring's name is), so that no member meets
/// an old run's epoch.
#[derive(Clone, Debug)]
pub struct Board {
    dir: PathBuf,
}

impl Board {
    /// A board in `dir` (created).
    pub fn new(dir: &Path) -> Result<Board, TransportError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| TransportError::Failed(format!("creating {}: {e}", dir.display())))?;
        Ok(Board {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, epoch: u16) -> PathBuf {
        self.dir.join(format!("epoch-{epoch}.id"))
    }

    /// The leader's side.
    pub fn publish(&self, epoch: u16, bytes: &[u8]) -> Result<(), TransportError> {
        let path = self.path(epoch);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| TransportError::Failed(format!("writing {}: {e}", path.display())))
    }

    /// A member's side: waits for the leader's bytes of `epoch`.
    pub fn wait(&self, epoch: u16, give_up: &dyn Fn() -> bool) -> Result<Vec<u8>, TransportError> {
        let path = self.path(epoch);
        loop {
            match std::fs::read(&path) {
                Ok(b) => return Ok(b),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(TransportError::Failed(format!(
                        "reading {}: {e}",
                        path.display()
                    )))
                }
            }
            if give_up() {
                return Err(TransportError::Abandoned);
            }
            std::thread::sleep(POLL);
        }
    }
}

/// The current communicator and the epoch it is of.
struct Current<C> {
    epoch: u16,
    comm: C,
}

/// A group whose first `grad_len` words go through `T` and the rest through `commit` (see the
/// module). `commit`'s rounds are of the remaining words. With `grad_len` 0 the transport still
/// exchanges in every round, a redone one included: its gradient is elsewhere (on the device,
/// `cuda::nccl_group::OnDevice`), and each exchange is what leaves the rank its sum.
pub struct SplitGroup<T: Transport> {
    commit: Box<dyn Collective + Send>,
    grad_len: usize,
    transport: Mutex<(T, Option<Current<T::Comm>>)>,
    /// The failure that ended a round: every later round fails with it (a retry would connect
    /// alone within the epoch, and wait for ever).
    failed: Mutex<Option<String>>,
}

impl<T: Transport> SplitGroup<T> {
    /// Words `..grad_len` of every round go through `transport`; `commit` is the group handle
    /// (rank, membership, joining) whose rounds carry the rest.
    pub fn new(commit: Box<dyn Collective + Send>, grad_len: usize, transport: T) -> Self {
        SplitGroup {
            commit,
            grad_len,
            transport: Mutex::new((transport, None)),
            failed: Mutex::new(None),
        }
    }

    /// One round, committed within the epoch it exchanged in; with `within`, only within that
    /// epoch (else [`GroupError::EpochChanged`]).
    fn round(
        &self,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
        within: Option<u16>,
    ) -> Result<Reduced, GroupError> {
        if data.len() < self.grad_len || out.len() != data.len() {
            return Err(GroupError::Size {
                want: data.len().max(self.grad_len),
                got: out.len(),
            });
        }
        let failed = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(e) = failed {
            return Err(GroupError::Transport(e));
        }
        let rank = self.commit.rank();
        let (grad, rest) = data.split_at(self.grad_len);
        let (grad_out, rest_out) = out.split_at_mut(self.grad_len);
        loop {
            let m = self.commit.membership();
            if let Some(e) = within.filter(|&e| e != m.epoch) {
                return Err(GroupError::EpochChanged {
                    expected: e,
                    now: m.epoch,
                });
            }
            if !m.contains(rank) {
                return Err(GroupError::NotMember {
                    rank,
                    epoch: m.epoch,
                });
            }
            let moved = || stop() || self.commit.membership().epoch != m.epoch;
            match self.exchange(m, grad, grad_out, &moved) {
                Ok(()) => {}
                Err(TransportError::Abandoned) if stop() => return Err(GroupError::Stopped),
                Err(TransportError::Abandoned) => continue,
                Err(TransportError::Failed(e)) => {
                    *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
                    return Err(GroupError::Transport(e));
                }
            }
            match self
                .commit
                .commit_within(m.epoch, rest, batch, rest_out, stop)
            {
                Err(GroupError::EpochChanged { .. }) if within.is_none() => continue,
                r => return r,
            }
        }
    }

    /// Sums `grad` into `out` among `m`'s members, on a communicator of `m.epoch` (made now if
    /// the last one was of another epoch, which is aborted). A communicator whose exchange did
    /// not complete is aborted.
    fn exchange(
        &self,
        m: Membership,
        grad: &[f32],
        out: &mut [f32],
        give_up: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        let mut t = self.transport.lock().unwrap_or_else(|p| p.into_inner());
        let (transport, current) = &mut *t;
        if current.as_ref().is_some_and(|c| c.epoch != m.epoch) {
            if let Some(old) = current.take() {
                old.comm.abort()?;
            }
        }
        if current.is_none() {
            let me = self.commit.rank();
            let position = m.ranks().position(|r| r == me).unwrap_or(0) as u32;
            let comm = transport.connect(m.epoch, position, m.len(), give_up)?;
            *current = Some(Current {
                epoch: m.epoch,
                comm,
            });
        }
        let c = current.as_mut().expect("connected above");
        let r = c.comm.all_reduce(grad, out, give_up);
        if r.is_err() {
            if let Some(c) = current.take() {
                // A failed abort is the worse news: its kernels may still be running.
                c.comm.abort()?;
            }
        }
        r
    }
}

impl<T: Transport> Collective for SplitGroup<T> {
    fn rank(&self) -> u32 {
        self.commit.rank()
    }
    fn membership(&self) -> Membership {
        self.commit.membership()
    }
    fn all_reduce(
        &self,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError> {
        self.round(data, batch, out, stop, None)
    }
    fn commit_within(
        &self,
        epoch: u16,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError> {
        self.round(data, batch, out, stop, Some(epoch))
    }
    fn join(
        &self,
        state: &mut [u32],
        own_step: u32,
        stop: &dyn Fn() -> bool,
    ) -> Result<(Membership, Option<u64>), GroupError> {
        self.commit.join(state, own_step, stop)
    }
    fn mark_ended(&self, round: u32, applied: u32) {
        self.commit.mark_ended(round, applied)
    }
    fn ended(&self) -> Option<Ended> {
        self.commit.ended()
    }
    fn arrival(&self) -> Option<(u16, u32)> {
        self.commit.arrival()
    }
    fn joiners_waiting(&self) -> bool {
        self.commit.joiners_waiting()
    }
    fn admit_joiners(&self, state_step: u32, state: &[u32]) -> Result<u16, GroupError> {
        self.commit.admit_joiners(state_step, state)
    }
    fn remove_settling(
        &self,
        rank: u32,
        settle: &mut dyn FnMut(Committed),
    ) -> Result<Removed, GroupError> {
        self.commit.remove_settling(rank, settle)
    }
}
