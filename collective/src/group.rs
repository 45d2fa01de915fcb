//! The group protocol on any memory (a segment in production, the heap in tests and loom).
//!
//! Length: the protocol and the narration of each of its CAS steps stay together.
//!
//! # The group word
//!
//! One 64-bit word holds everything the ranks must agree on, so that every decision is one CAS:
//! `epoch (16 bits) | committed step (32 bits) | members (16 bits, one per rank)`.
//! - A **commit** moves `step` from `s` to `s + 1`, keeping epoch and members. Any rank may do it
//!   once it sees every member's arrival tagged `(epoch, s + 1)`.
//! - A **membership change** moves `epoch` to `epoch + 1`, keeping `step`: the launcher removing
//!   a dead rank, or the leader admitting a rank that asked to join (at a step boundary).
//!
//! Because both go through the same word, a round is either committed before the membership
//! changed (every rank, and the launcher, sees the commit) or not at all (every rank sees the new
//! epoch first and contributes again, tagged with it; a round within one epoch, `commit_within`,
//! returns `EpochChanged` instead). There is no third outcome, so survivors
//! never disagree about which updates were applied, and the launcher knows exactly whether a
//! dead rank's batch went into an applied update ([`Removed::committed`]).
//!
//! # A round (rank side)
//!
//! 1. Read the word `(e, s, m)`. Write the contribution into the rank's buffer of parity
//!    `(s + 1) % 2`, then publish `arrived = tag(e, s + 1)` with Release.
//! 2. Wait until the word's step reaches `s + 1` (committed: sum the buffers of `m` in rank
//!    order, so every rank computes the same bits) or its epoch moves on (go to 1 with the new
//!    word and the same contribution). Whoever sees all of `m` arrived tries the commit CAS.
//!
//! Buffer reuse is safe without a second barrier: a rank writes parity `p` for step `t` only
//! after step `t - 1` committed, which needs every member's arrival at `t - 1`, which each made
//! only after it had finished summing step `t - 2` (the last use of parity `p`).
//!
//! # Joining
//!
//! A restarted rank clears its arrival, sets its `join` flag and waits to be a member. The
//! leader (lowest member), between steps, writes its state (weights and optimizer) into the
//! state area, records the step it is from, and admits the joiners with an epoch change. The
//! joiner reads the state and contributes from the next step on. The other members' pending
//! round (if any) sees the epoch change and is contributed again: nothing is recomputed.
//!
//! # Release/Acquire pairs
//!
//! - `arrived[r]` store (Release, in `contribute`) → load (Acquire, in `all_arrived`): the
//!   buffer stores before it are visible to whoever sees the tag.
//! - commit CAS (AcqRel) → `word` load (Acquire, in `wait_round`): a rank that sees the commit
//!   also sees every arrival the committer saw, hence every buffer it sums (happens-before is
//!   transitive through the committer).
//! - admission CAS (AcqRel, in `admit_joiners`) → `word` load (Acquire, in `join`): the joiner
//!   sees the state area written before the CAS.
//! - `ended` store (Release, in `mark_ended`) → load (Acquire, in `ended`): a rank that loads the
//!   mark sees the round it names committed. A joiner that finds the group empty sees the mark
//!   of every member that made it: each made it before it exited, and the launcher removed it
//!   (a CAS on the word, AcqRel) only once its process was gone, before the joiner's Acquire
//!   load of the word found the group empty.
//!
//! # The end round
//!
//! The group word counts rounds; a drafter's state counts updates. The round in which every
//! member saw the ring's end commits (it is the barrier at which the group agrees it is done)
//! but applies no update, so after it the state is one step behind the word. Every member that
//! sums it marks it (`mark_ended`: the round's step and the step of the state it left, one
//! word, the same from every member), and a rank that joins afterwards, alone in an emptied group
//! with only its checkpoint, reads there that the group's last round applied nothing
//! ([`Membership::state_step`]): it neither counts that round's step as an update lost nor moves
//! its state's step past it. A mark kept in the group, not in the word: the word has no bit to
//! spare, and only a joiner needs it. If every member dies between the round's commit and its
//! mark, none is made, and a joiner takes the round for a lost update (a step with no batch in
//! it: it costs the run a step number, never a batch).

use crate::GroupError;
use shmem::sync::{self, AtomicU32, AtomicU64, Ordering, WAIT_SLICE};

#[cfg(all(test, not(loom)))]
mod crash_search;

/// Ranks in a group at most (one bit each in the group word).
pub const MAX_RANKS: usize = 16;
/// `batch` of a rank that contributed nothing (no data left).
pub const NO_BATCH: u64 = u64::MAX;

/// The group word, unpacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Membership {
    pub epoch: u16,
    /// The last committed step.
    pub step: u32,
    /// Bit `r` set: rank `r` is a member.
    pub members: u16,
}

impl Membership {
    pub(crate) fn pack(self) -> u64 {
        (u64::from(self.epoch) << 48) | (u64::from(self.step) << 16) | u64::from(self.members)
    }
    pub(crate) fn unpack(w: u64) -> Membership {
        Membership {
            epoch: (w >> 48) as u16,
            step: (w >> 16) as u32,
            members: w as u16,
        }
    }
    pub fn contains(self, rank: u32) -> bool {
        rank < MAX_RANKS as u32 && self.members & (1 << rank) != 0
    }
    /// Members in rank order.
    pub fn ranks(self) -> impl Iterator<Item = u32> {
        (0..MAX_RANKS as u32).filter(move |&r| self.members & (1 << r) != 0)
    }
    pub fn leader(self) -> Option<u32> {
        self.ranks().next()
    }
    pub fn len(self) -> u32 {
        self.members.count_ones()
    }
    pub fn is_empty(self) -> bool {
        self.members == 0
    }
    /// The step of the group's state once this membership's last committed round is applied:
    /// that round's step, unless `ended` says it was an end round, which applied nothing (see
    /// the module doc's *The end round*).
    pub fn state_step(self, ended: Option<Ended>) -> u32 {
        match ended {
            Some(e) if e.round == self.step => e.applied,
            _ => self.step,
        }
    }
}

/// The group's latest end round ([`Collective::mark_ended`](crate::Collective::mark_ended)):
/// every member saw the ring's end in it, so it committed and applied no update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    /// The step it committed as (the group word's).
    pub round: u32,
    /// The step of the state it left: the last update's.
    pub applied: u32,
}

impl Ended {
    fn pack(self) -> u64 {
        (u64::from(self.round) << 32) | u64::from(self.applied)
    }
    /// None for 0 (no end round yet: a round committing as step 0 does not exist).
    fn unpack(w: u64) -> Option<Ended> {
        (w != 0).then_some(Ended {
            round: (w >> 32) as u32,
            applied: w as u32,
        })
    }
}

/// The tag a rank publishes with its contribution to step `step` in epoch `epoch`.
fn tag(epoch: u16, step: u32) -> u64 {
    (u64::from(epoch) << 32) | u64::from(step)
}
fn tag_step(t: u64) -> u32 {
    t as u32
}

/// Shared fields of the group (see the module doc).
#[cfg_attr(not(loom), repr(C))]
#[derive(Default)]
pub(crate) struct Control {
    pub(crate) word: AtomicU64,
    /// Bumped after every arrival, commit, membership change and join request: the futex word.
    pub(crate) seq: AtomicU32,
    /// The step the state area holds.
    pub(crate) state_step: AtomicU64,
    /// The latest end round, packed (`Ended::pack`); 0 before any.
    pub(crate) ended: AtomicU64,
}

/// One rank's record.
#[cfg_attr(not(loom), repr(C, align(128)))]
#[derive(Default)]
pub(crate) struct RankRec {
    /// `tag(epoch, step)` of this rank's latest contribution; 0 before any.
    pub(crate) arrived: AtomicU64,
    /// The batch id of this rank's latest contribution that named one ([`NO_BATCH`] for none):
    /// a contribution with no batch leaves it, unless it is to the same step (the batch's
    /// round contributed again without it), which clears it.
    pub(crate) batch: AtomicU64,
    /// `tag(epoch, step)` of the contribution that named `batch`.
    pub(crate) batch_tag: AtomicU64,
    /// 1 while this rank asks to join.
    pub(crate) join: AtomicU32,
}

/// Where the group lives: a segment, or the heap.
pub(crate) trait Memory: Send + Sync {
    fn control(&self) -> &Control;
    fn rank(&self, r: u32) -> &RankRec;
    /// Rank `r`'s contribution buffer of parity `p` (f32 bits).
    fn buf(&self, r: u32, p: u32) -> &[AtomicU32];
    /// The state area for joiners.
    fn state(&self) -> &[AtomicU32];
    fn ranks(&self) -> u32;
}

/// The group on the heap: for tests and loom models.
#[cfg(any(test, loom))]
pub(crate) struct HeapMem {
    control: Control,
    ranks: Vec<RankRec>,
    bufs: Vec<Vec<AtomicU32>>,
    state: Vec<AtomicU32>,
}

#[cfg(any(test, loom))]
impl HeapMem {
    pub(crate) fn new(ranks: u32, buf_len: usize, state_len: usize, initial: Membership) -> Self {
        let zeros = |n: usize| (0..n).map(|_| AtomicU32::new(0)).collect::<Vec<_>>();
        let m = HeapMem {
            control: Control::default(),
            ranks: (0..ranks).map(|_| RankRec::default()).collect(),
            bufs: (0..ranks * 2).map(|_| zeros(buf_len)).collect(),
            state: zeros(state_len),
        };
        m.control.word.store(initial.pack(), Ordering::Relaxed);
        m
    }
}

#[cfg(any(test, loom))]
impl Memory for HeapMem {
    fn control(&self) -> &Control {
        &self.control
    }
    fn rank(&self, r: u32) -> &RankRec {
        &self.ranks[r as usize]
    }
    fn buf(&self, r: u32, p: u32) -> &[AtomicU32] {
        &self.bufs[(r * 2 + p) as usize]
    }
    fn state(&self) -> &[AtomicU32] {
        &self.state
    }
    fn ranks(&self) -> u32 {
        self.ranks.len() as u32
    }
}

/// What a committed round gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reduced {
    /// The step this round committed as.
    pub step: u32,
    /// The membership it committed with.
    pub membership: Membership,
    /// Times the round was contributed again because the membership changed under it.
    pub retries: u32,
}

/// What the launcher learns when it removes a dead rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removed {
    /// False if the rank was not a member (already removed, or never joined).
    pub was_member: bool,
    /// The last batch the rank named in a contribution, if that contribution is in a committed
    /// step: its update is applied. Rounds the rank contributed to since with no batch (a
    /// Python rank's reduction of its loss, before it releases the batch) do not hide it. If
    /// the dead rank still holds that batch (it died between the commit and its release), it
    /// must be retired, not redelivered; any other batch it holds was not in an applied update
    /// and goes back to the ring.
    pub committed: Option<Committed>,
    /// The membership after the removal.
    pub membership: Membership,
}

/// A dead rank's batch whose update the group applied ([`Removed::committed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Committed {
    pub batch: u64,
    /// The step that applied it.
    pub step: u32,
}

/// A rank's handle on the group protocol (any memory).
pub(crate) struct Protocol<M: Memory> {
    pub(crate) mem: M,
}

impl<M: Memory> Protocol<M> {
    fn bump(&self) {
        let c = self.mem.control();
        c.seq.fetch_add(1, Ordering::Release);
        sync::wake_all(&c.seq);
    }

    pub(crate) fn membership(&self) -> Membership {
        Membership::unpack(self.mem.control().word.load(Ordering::Acquire))
    }

    /// Rank `rank`'s published arrival: (epoch, step) of its last contribution, None if it
    /// has none (a joiner). A round the rank left (stopped) commits with that contribution
    /// only while the epoch stands: the step cannot reach it without the rank's arrival.
    pub(crate) fn arrival(&self, rank: u32) -> Option<(u16, u32)> {
        self.check_rank(rank).ok()?;
        let t = self.mem.rank(rank).arrived.load(Ordering::Relaxed);
        (t != 0).then_some(((t >> 32) as u16, tag_step(t)))
    }

    fn check_rank(&self, rank: u32) -> Result<(), GroupError> {
        if rank >= self.mem.ranks() {
            return Err(GroupError::Rank {
                rank,
                ranks: self.mem.ranks(),
            });
        }
        Ok(())
    }

    /// Writes `data` as `rank`'s contribution to step `w.step + 1` and publishes it.
    fn contribute(&self, rank: u32, w: Membership, data: &[f32], batch: u64) {
        let step = w.step.wrapping_add(1);
        let buf = self.mem.buf(rank, step % 2);
        for (dst, x) in buf.iter().zip(data) {
            dst.store(x.to_bits(), Ordering::Relaxed);
        }
        let r = self.mem.rank(rank);
        let t = tag(w.epoch, step);
        if batch != NO_BATCH {
            // The tag goes first, cleared, and comes back last: a rank killed between the
            // stores leaves no pair of a new batch and an old, committed tag (which would
            // retire a batch never trained), only a cleared tag (its batch in no round).
            // SYNC: the Release stores keep the three in this order (the launcher reads them
            // once the process is gone).
            r.batch_tag.store(0, Ordering::Relaxed);
            r.batch.store(batch, Ordering::Release);
            r.batch_tag.store(t, Ordering::Release);
        } else if tag_step(r.batch_tag.load(Ordering::Relaxed)) == step {
            // The batch's round, contributed again without it: it is in no round.
            r.batch_tag.store(0, Ordering::Relaxed);
            r.batch.store(NO_BATCH, Ordering::Release);
        }
        // SYNC: pairs with the Acquire load of `arrived` in all_arrived(): the buffer and batch
        // stores above are visible to whoever sees this tag.
        r.arrived.store(t, Ordering::Release);
        self.bump();
    }

    fn all_arrived(&self, w: Membership) -> bool {
        let t = tag(w.epoch, w.step.wrapping_add(1));
        w.ranks()
            .all(|r| self.mem.rank(r).arrived.load(Ordering::Acquire) == t)
    }

    /// Sums `data` over the members, in rank order, into `out`; every member gets the same bits.
    /// `batch` is the id of the batch `data` came from ([`NO_BATCH`] for none). Contributes
    /// again by itself when the membership changes first. `stop` is asked at least every 100 ms
    /// while waiting.
    pub(crate) fn all_reduce(
        &self,
        rank: u32,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError> {
        self.round(rank, data, batch, out, stop, None)
    }

    /// A round that commits only with the members of epoch `epoch`: if the membership is or
    /// becomes another before the commit, it returns [`GroupError::EpochChanged`] instead of
    /// contributing again, and no commit holds this contribution (a commit in a later epoch
    /// needs an arrival tagged with it). For ranks that exchange their gradients elsewhere
    /// (torch.distributed among that epoch's members) and agree here on the step and its
    /// batches: a commit means every member of `epoch` finished that exchange.
    pub(crate) fn commit_within(
        &self,
        rank: u32,
        epoch: u16,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Reduced, GroupError> {
        self.round(rank, data, batch, out, stop, Some(epoch))
    }

    fn round(
        &self,
        rank: u32,
        data: &[f32],
        batch: u64,
        out: &mut [f32],
        stop: &dyn Fn() -> bool,
        within: Option<u16>,
    ) -> Result<Reduced, GroupError> {
        self.check_rank(rank)?;
        let len = self.mem.buf(rank, 0).len();
        if data.len() != len || out.len() != len {
            return Err(GroupError::Size {
                want: len,
                got: data.len().max(out.len()),
            });
        }
        let c = self.mem.control();
        let mut retries = 0;
        'round: loop {
            let w = self.membership();
            if !w.contains(rank) {
                return Err(GroupError::NotMember {
                    rank,
                    epoch: w.epoch,
                });
            }
            if let Some(expected) = within.filter(|&e| e != w.epoch) {
                return Err(GroupError::EpochChanged {
                    expected,
                    now: w.epoch,
                });
            }
            self.contribute(rank, w, data, batch);
            let target = w.step.wrapping_add(1);
            loop {
                let seen = c.seq.load(Ordering::Acquire);
                let now = self.membership();
                // The step cannot pass `target` without this rank, and a commit of `target` in a
                // later epoch would need this rank's arrival tagged with it: so this is our
                // round, committed with `w`'s members, even if the epoch has moved on since.
                if now.step == target {
                    self.sum(w, target % 2, out);
                    return Ok(Reduced {
                        step: target,
                        membership: w,
                        retries,
                    });
                }
                if now.epoch != w.epoch {
                    // A round within one epoch ends here (the check at the top of the loop
                    // returns EpochChanged); any other is contributed again.
                    retries += 1;
                    continue 'round;
                }
                if self.all_arrived(w) {
                    let next = Membership { step: target, ..w };
                    // SYNC: AcqRel; pairs with the Acquire loads of `word` in membership():
                    // ranks that see the commit see every arrival this rank saw.
                    if c.word
                        .compare_exchange(
                            w.pack(),
                            next.pack(),
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        )
                        .is_ok()
                    {
                        self.bump();
                    }
                    continue;
                }
                if stop() {
                    return Err(GroupError::Stopped);
                }
                sync::wait(&c.seq, seen, WAIT_SLICE);
            }
        }
    }

    fn sum(&self, w: Membership, parity: u32, out: &mut [f32]) {
        out.iter_mut().for_each(|x| *x = 0.0);
        for r in w.ranks() {
            for (o, x) in out.iter_mut().zip(self.mem.buf(r, parity)) {
                *o += f32::from_bits(x.load(Ordering::Relaxed));
            }
        }
    }

    /// [`Protocol::remove_settling`] with nothing to settle first (the tests' launcher).
    #[cfg(any(test, loom))]
    pub(crate) fn remove(&self, rank: u32) -> Result<Removed, GroupError> {
        self.remove_settling(rank, &mut |_| {})
    }

    /// The launcher's side: removes a dead `rank` with a membership change, and says whether
    /// its last contribution is in a committed step. Call only once the rank's process is gone.
    ///
    /// `settle` is shown that applied batch, if any, before the membership change: while the dead
    /// rank is still a member, no round after its last can commit, so no checkpoint can hold an
    /// update after it. The caller makes the batch's retirement durable there (its ledger line);
    /// once the removal is made, the survivors go on and the leader's next checkpoint may hold
    /// the update. `settle` may be called again (a membership change won the race and the
    /// removal is tried again), always with the same batch: a committed step stays committed.
    pub(crate) fn remove_settling(
        &self,
        rank: u32,
        settle: &mut dyn FnMut(Committed),
    ) -> Result<Removed, GroupError> {
        self.check_rank(rank)?;
        let c = self.mem.control();
        let r = self.mem.rank(rank);
        // A dead joiner's request dies with it. A leader may have seen the request already and
        // be about to admit it: the epoch bump below makes its CAS fail. (The leader loads the
        // word before the flags, so one that sees the bumped word sees the cleared flag.)
        let was_joining = r.join.swap(0, Ordering::AcqRel) != 0;
        loop {
            let w = self.membership();
            let member = w.contains(rank);
            if !member && !was_joining {
                return Ok(Removed {
                    was_member: false,
                    committed: None,
                    membership: w,
                });
            }
            // Decided from `w`, the word the CAS below replaces: the rank is gone, so its record
            // no longer changes, and up to `w` it was a member. A member arrives again in every
            // new epoch before a commit (and a joiner starts with no arrival), so the last
            // contribution naming its batch, tagged with step `s`, is in step `s` if `s` is
            // committed (`s <= w.step`): a later arrival for `s` would have named the batch
            // again (a new tag) or none (clearing it). An arrival for w.step + 1 is not
            // committed if the CAS below succeeds: that round is contributed again without it.
            let committed = if member {
                let t = r.batch_tag.load(Ordering::Acquire);
                let batch = r.batch.load(Ordering::Relaxed);
                let step = tag_step(t);
                let named = t != 0 && batch != NO_BATCH;
                (named && step != w.step.wrapping_add(1)).then_some(Committed { batch, step })
            } else {
                None
            };
            if let Some(applied) = committed {
                settle(applied);
            }
            let next = Membership {
                epoch: w.epoch.wrapping_add(1),
                members: w.members & !(1 << rank),
                ..w
            };
            // SYNC: AcqRel, like a commit: this CAS and a commit of step w.step + 1 are ordered
            // by the word, so exactly one of "committed with this rank" and "not" holds. A commit
            // that wins makes this CAS fail, and the next try decides from the committed word.
            if c.word
                .compare_exchange(w.pack(), next.pack(), Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            self.bump();
            return Ok(Removed {
                was_member: member,
                committed,
                membership: next,
            });
        }
    }

    /// A member that summed round `round` and found that every member saw the ring's end in
    /// it marks it as the group's end round, which left the state at step `applied` (see the
    /// module doc's *The end round*). Every member marks the same, so it is made if any one of
    /// them lives to; marks only grow (a later end round is one of a group that was emptied
    /// after this one, so its members' marks come after this one's).
    pub(crate) fn mark_ended(&self, round: u32, applied: u32) {
        let e = Ended { round, applied }.pack();
        // SYNC: Release; pairs with the Acquire load in ended(): whoever loads the mark sees the
        // round it names committed (this rank saw it, with Acquire).
        self.mem.control().ended.fetch_max(e, Ordering::Release);
    }

    /// The latest end round marked ([`Protocol::mark_ended`]), if any: whether it is the last
    /// committed round is [`Membership::state_step`]'s to tell.
    pub(crate) fn ended(&self) -> Option<Ended> {
        // SYNC: pairs with the Release in mark_ended().
        Ended::unpack(self.mem.control().ended.load(Ordering::Acquire))
    }

    /// The joiner's side: asks to join and waits until the leader admits it. Returns the
    /// membership it joined and the step of the state it was handed; `None` when the group was
    /// empty (every rank dead), so it admitted itself and nobody could hand it a state: the
    /// group then goes on from `own_step`, the step of the state the joiner can load itself
    /// (its last checkpoint), or from its own last step if that is later (the returned
    /// membership's step): the updates after `own_step` were lost.
    pub(crate) fn join(
        &self,
        rank: u32,
        state: &mut [u32],
        own_step: u32,
        stop: &dyn Fn() -> bool,
    ) -> Result<(Membership, Option<u64>), GroupError> {
        self.check_rank(rank)?;
        if state.len() != self.mem.state().len() {
            return Err(GroupError::Size {
                want: self.mem.state().len(),
                got: state.len(),
            });
        }
        let c = self.mem.control();
        let r = self.mem.rank(rank);
        // A previous incarnation's arrival must not count as this one's.
        r.arrived.store(0, Ordering::Relaxed);
        r.batch.store(NO_BATCH, Ordering::Relaxed);
        r.batch_tag.store(0, Ordering::Relaxed);
        r.join.store(1, Ordering::Release);
        self.bump();
        loop {
            let seen = c.seq.load(Ordering::Acquire);
            let w = self.membership();
            if w.contains(rank) {
                r.join.store(0, Ordering::Relaxed);
                let step = c.state_step.load(Ordering::Relaxed);
                for (dst, x) in state.iter_mut().zip(self.mem.state()) {
                    *dst = x.load(Ordering::Relaxed);
                }
                return Ok((w, Some(step)));
            }
            if w.is_empty() {
                // Nobody is left to hand over a state: admit ourselves. The group goes on from
                // its own last step if the joiner's state is older (the updates between were
                // lost with the ranks that made them): a step number is never used twice.
                let next = Membership {
                    epoch: w.epoch.wrapping_add(1),
                    step: own_step.max(w.step),
                    members: 1 << rank,
                };
                // SYNC: AcqRel, as every change of the group word.
                if c.word
                    .compare_exchange(w.pack(), next.pack(), Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    r.join.store(0, Ordering::Relaxed);
                    self.bump();
                    return Ok((next, None));
                }
                continue;
            }
            if stop() {
                r.join.store(0, Ordering::Relaxed);
                return Err(GroupError::Stopped);
            }
            sync::wait(&c.seq, seen, WAIT_SLICE);
        }
    }

    /// True if a rank outside the membership asks to join (cheap: the leader asks between
    /// steps before it exports its state).
    pub(crate) fn joiners_waiting(&self) -> bool {
        let w = self.membership();
        (0..self.mem.ranks())
            .any(|j| !w.contains(j) && self.mem.rank(j).join.load(Ordering::Acquire) == 1)
    }

    /// The leader's side, between steps: if any rank asks to join, hands it `state` (the
    /// leader's state after step `state_step`, which must be the last committed) and admits it. Returns the ranks admitted
    /// (none if this rank is not the leader, nobody asks, or the membership moved meanwhile).
    pub(crate) fn admit_joiners(
        &self,
        rank: u32,
        state_step: u32,
        state: &[u32],
    ) -> Result<u16, GroupError> {
        self.check_rank(rank)?;
        let c = self.mem.control();
        let w = self.membership();
        // Only the leader, and only at the boundary its state is from.
        if w.leader() != Some(rank) || w.step != state_step {
            return Ok(0);
        }
        let joiners = (0..self.mem.ranks())
            .filter(|&j| !w.contains(j) && self.mem.rank(j).join.load(Ordering::Acquire) == 1)
            .fold(0u16, |m, j| m | (1 << j));
        if joiners == 0 {
            return Ok(0);
        }
        if state.len() != self.mem.state().len() {
            return Err(GroupError::Size {
                want: self.mem.state().len(),
                got: state.len(),
            });
        }
        for (dst, x) in self.mem.state().iter().zip(state) {
            dst.store(*x, Ordering::Relaxed);
        }
        c.state_step.store(u64::from(w.step), Ordering::Relaxed);
        let next = Membership {
            epoch: w.epoch.wrapping_add(1),
            members: w.members | joiners,
            ..w
        };
        // SYNC: AcqRel; pairs with the Acquire load of `word` in join(): the state stores above
        // are visible to a joiner that sees itself a member.
        let ok = c
            .word
            .compare_exchange(w.pack(), next.pack(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if ok {
            self.bump();
        }
        Ok(if ok { joiners } else { 0 })
    }
}
