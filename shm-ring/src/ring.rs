//! The public handles: [`Ring`] (a mapped segment), [`Producer`] and [`Consumer`] (a registered
//! worker), and the slot guards [`WriteSlot`] and [`ReadSlot`] through which payloads are written
//! and read in place.
//!
//! Length: the public handles and their documentation; each method is a thin call into `core`.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use crate::core::{
    Claim, CommitMeta, CoreParams, ItemMeta, Recovered, RingRef, Settle, Settling, TakeState,
    Taken, WorkClaim,
};
use crate::error::RingError;
use crate::layout::{Lease, LEASE_START_MASK};
use crate::params::RingParams;
use crate::phase::Phase;
use crate::segment::{self, Creator, Segment, NO_GPU};
use crate::sync::Ordering;
use crate::sys;
use crate::worker::{Role, WorkerName};

/// A ring in a shared-memory segment, created by the supervisor and attached by workers.
///
/// `Ring` is `Send + Sync`: threads of one process may share it, each registering its own
/// producer or consumer.
pub struct Ring {
    seg: Segment,
    core: CoreParams,
}

/// Outcome of [`Consumer::take_timeout`].
pub enum Take<'c> {
    Item(ReadSlot<'c>),
    /// The ring is closed and drained: no item will ever come.
    End,
    TimedOut,
}

impl Ring {
    /// Creates `/dev/shm/<name>` exclusively (mode 0600) with all its memory reserved. The
    /// returned handle unlinks the name when dropped.
    pub fn create(name: &str, params: &RingParams) -> Result<Ring, RingError> {
        Ok(Ring::from_segment(Segment::create(name, params)?))
    }

    /// Attaches to an existing ring for reading and writing. Checks owner, size, magic, layout
    /// version and layout.
    pub fn attach(name: &str) -> Result<Ring, RingError> {
        Ok(Ring::from_segment(Segment::attach(name, true)?))
    }

    /// Attaches read-only: [`Ring::snapshot`] works, registering workers does not. Works on a
    /// segment the caller may only read.
    pub fn open_read_only(name: &str) -> Result<Ring, RingError> {
        Ok(Ring::from_segment(Segment::attach(name, false)?))
    }

    fn from_segment(seg: Segment) -> Ring {
        let p = *seg.params();
        let core = CoreParams {
            producers: p.producers,
            buckets: p.buckets,
            policy: p.policy,
        };
        Ring { seg, core }
    }

    pub fn name(&self) -> &str {
        self.seg.name()
    }

    pub fn params(&self) -> &RingParams {
        self.seg.params()
    }

    /// Bytes the segment occupies in `/dev/shm`.
    pub fn size_bytes(&self) -> u64 {
        self.seg.offsets().total
    }

    /// The payload arena: every slot's bytes, one page-aligned range (`slots × slot_stride`).
    /// For registering it with a device driver as pinned memory; the range stays mapped while
    /// this handle lives, and its bytes belong to whichever worker owns each slot.
    pub fn payload_arena(&self) -> (*mut u8, usize) {
        let p = self.seg.params();
        let len = u64::from(p.slots) * p.slot_stride();
        (self.seg.payload_ptr(0), len as usize)
    }

    /// The process that created the ring.
    pub fn creator(&self) -> Creator {
        self.seg.creator()
    }

    /// True if the ring's creator is known to be gone: nobody will clean it up, and `--gc` may
    /// remove it. False while it runs, and when this process cannot judge (another pid
    /// namespace; see [`Creator::liveness`]).
    pub fn is_stale(&self) -> bool {
        self.seg.creator().liveness() == Some(false)
    }

    /// True once every expected producer has finished or been retired.
    pub fn is_closed(&self) -> bool {
        self.core_ref().closed()
    }

    /// Keeps the name in `/dev/shm` when this (creating) handle is dropped.
    pub fn disown(&mut self) {
        self.seg.disown();
    }

    /// Removes the name from `/dev/shm` now. Processes that have it mapped keep their mapping.
    pub fn unlink(&self) -> Result<(), RingError> {
        self.seg.unlink()
    }

    /// Removes segment `name` (for `--gc` of stale rings).
    pub fn unlink_name(name: &str) -> Result<(), RingError> {
        segment::unlink_name(name)
    }

    pub(crate) fn core_ref(&self) -> RingRef<'_> {
        RingRef {
            params: self.core,
            ctl: self.seg.control(),
            slots: self.seg.slots(),
            workers: self.seg.workers(),
            work: self.seg.work(),
        }
    }

    pub(crate) fn segment(&self) -> &Segment {
        &self.seg
    }

    fn id_of(&self, id: WorkerName) -> Result<u32, RingError> {
        let p = self.params();
        let (limit, base) = match id.role {
            Role::Producer => (p.producers, 0),
            Role::Consumer => (p.consumers, p.producers),
        };
        if id.index >= limit {
            return Err(RingError::NoSuchWorker {
                id,
                producers: p.producers,
                consumers: p.consumers,
            });
        }
        Ok(base + id.index)
    }

    fn writable(&self) -> Result<(), RingError> {
        if self.seg.writable() {
            Ok(())
        } else {
            Err(RingError::ReadOnly)
        }
    }

    /// Registers this process as worker `wid`: one CAS takes the id's lease (see
    /// `layout::Lease`), refused while another live process, or this one, holds it. Whatever
    /// earlier incarnations left (a dead one's slots and claims) is recovered first, so a
    /// restarted worker cleans up after its predecessor even without a supervisor.
    fn register(&self, wid: WorkerName) -> Result<Worker<'_>, RingError> {
        self.writable()?;
        let id = self.id_of(wid)?;
        let me = my_lease()?;
        let core = self.core_ref();
        let epoch =
            core.register(id, me, holder_alive)
                .map_err(|holder| RingError::WorkerBusy {
                    id: wid,
                    pid: holder.pid(),
                })?;
        let rec = core.worker(id);
        let r = Ordering::Relaxed;
        rec.pid.store(me.pid(), r);
        rec.pid_start
            .store(sys::process_start_ticks(me.pid()).unwrap_or(0), r);
        rec.registered_ns.store(sys::monotonic_ns(), r);
        core.heartbeat(id);
        // A new incarnation's clocks start now: the phase and idle gap a predecessor died in
        // and was never recovered from are not this one's (its load would count as compute
        // time or as one long idle gap). The predecessor's phase keeps its time, up to now
        // (when it died is not known), so its cumulative figures never go back; a recovered
        // predecessor's clock is already stopped and this adds nothing.
        core.enter(id, None);
        rec.device_busy_until.store(0, r);
        rec.device_timed.store(0, r);
        rec.in_hand.store(0, r);
        core.enter(id, Some(Phase::Other));
        Ok(Worker {
            ring: self,
            id,
            wid,
            lease: me,
            epoch,
        })
    }

    /// Registers producer `index` of this process.
    pub fn producer(&self, index: u32) -> Result<Producer<'_>, RingError> {
        Ok(Producer {
            w: self.register(WorkerName::producer(index))?,
        })
    }

    /// Registers consumer `index` of this process.
    pub fn consumer(&self, index: u32) -> Result<Consumer<'_>, RingError> {
        let w = self.register(WorkerName::consumer(index))?;
        let st = TakeState::new(self.params().seed, w.id);
        Ok(Consumer {
            w,
            st: RefCell::new(st),
            held: Cell::new(0),
        })
    }

    /// Slots worker `id` holds (WRITING or READING) by any of its incarnations: for a
    /// supervisor, to see whether a worker that exited cleanly left any behind.
    pub fn held_by(&self, id: WorkerName) -> Result<usize, RingError> {
        Ok(self.core_ref().held_by(self.id_of(id)?))
    }

    /// For the supervisor, once worker `id`'s process has exited: its WRITING slots become FREE
    /// (with the work items they carried), its READING slots READY again with delivery count +
    /// 1, and the work items it claimed FREE.
    ///
    /// Refuses ([`RingError::WorkerAlive`]) while the id is registered by a running process,
    /// and always while it is registered by this process: its handles may be in use, and
    /// freeing their slots would let two writers share a payload. A zombie (exited, not yet
    /// reaped) counts as gone. Safe to call again, also after a recovery that was itself
    /// interrupted.
    pub fn recover(&self, id: WorkerName) -> Result<Recovered, RingError> {
        self.recover_with(id, holder_alive)
    }

    /// [`Ring::recover`] without the liveness check: recovers worker `id` even if the process
    /// that registered it, this one included, still runs. For supervisors that know better than
    /// `/proc`, and for tests that stand in for a crash by forgetting a worker's handles.
    ///
    /// # Safety
    ///
    /// No handle of worker `id` ([`Producer`], [`Consumer`], [`WriteSlot`], [`ReadSlot`]) may be
    /// used after this call, in any process: its process has exited, or every such handle was
    /// leaked (`std::mem::forget`) and is unreachable. Otherwise a slot it still writes or reads
    /// can be handed to another worker, and two processes touch one payload at once.
    pub unsafe fn recover_unchecked(&self, id: WorkerName) -> Result<Recovered, RingError> {
        self.recover_with(id, |_| false)
    }

    /// [`Ring::recover`] for a consumer that may hold batches its supervisor settles instead of
    /// delivering them again, each as `settle` says: [`Settle::Retire`] for one whose training
    /// is known to be applied (a drafter group committed the update that used it before the
    /// consumer died), counted as released; [`Settle::SetAside`] for one that must not be
    /// delivered again (it killed the consumers that took it), counted as set aside. Each such
    /// slot is freed after `on_settled` has read how, its meta and payload (e.g. to write the
    /// line the dead consumer could not); one the consumer gave back (READY) is taken back for
    /// it first. A batch it does not hold (released, or taken by another) is not settled.
    /// Everything else is recovered as by [`Ring::recover`].
    pub fn recover_settling(
        &self,
        wid: WorkerName,
        settle: &[(u64, Settle)],
        mut on_settled: impl FnMut(Settle, &ItemMeta, &[u8]),
    ) -> Result<Recovered, RingError> {
        let mut before = |idx: usize, meta: ItemMeta, how: Settle| {
            // SAFETY: the slot is READING, owned by a consumer whose lease recovery holds (its
            // process is gone), so no process writes these bytes until the CAS that frees the
            // slot, which happens after this call returns.
            let payload = unsafe { self.held_payload(idx, &meta) };
            on_settled(how, &meta, payload);
        };
        let mut settling = Settling {
            batches: settle,
            before: &mut before,
            work: &[],
        };
        self.recover_inner(wid, holder_alive, Some(&mut settling))
    }

    /// For the supervisor, before it settles batch `batch_id` that dead consumer `wid` holds
    /// (see [`Ring::recover_settling`]) but after it must have recorded it: `read` sees the
    /// batch's meta and payload, and the slot stays held by `wid` (one it gave back, READY, is
    /// taken back for it, as the settling would). Nothing else is recovered. Returns whether
    /// `wid` holds the batch (not: released, or another consumer's). Refuses a live holder as
    /// [`Ring::recover`] does.
    pub fn read_held(
        &self,
        wid: WorkerName,
        batch_id: u64,
        mut read: impl FnMut(&ItemMeta, &[u8]),
    ) -> Result<bool, RingError> {
        self.writable()?;
        let id = self.id_of(wid)?;
        let me = my_lease()?;
        let mut show = |idx: usize, meta: ItemMeta| {
            // SAFETY: the slot is READING, owned by a consumer whose lease this call holds (its
            // process is gone), so no process writes these bytes until a recovery frees the
            // slot, which needs that lease, given back only after this call returns.
            let payload = unsafe { self.held_payload(idx, &meta) };
            read(&meta, payload);
        };
        (self.core_ref())
            .read_held(id, me, holder_alive, batch_id, &mut show)
            .map_err(|holder| RingError::WorkerAlive {
                id: wid,
                pid: holder.pid(),
            })
    }

    /// The payload of slot `idx`, held by a dead consumer, as `meta` gives its length (capped at
    /// the slot's size, so inside the mapping, which lives as long as `self`).
    ///
    /// # Safety
    ///
    /// No process writes the slot while the slice lives: it is READING by a consumer whose
    /// process is gone, and the caller holds that consumer's lease, which any recovery that
    /// frees the slot must take.
    unsafe fn held_payload(&self, idx: usize, meta: &ItemMeta) -> &[u8] {
        let seg = self.segment();
        let len = (meta.len as usize).min(seg.params().slot_size as usize);
        // SAFETY: `len` is within the slot, inside the mapping, which outlives `&self`; nobody
        // writes these bytes while the slice lives (the caller's promise).
        unsafe { std::slice::from_raw_parts(seg.payload_ptr(idx) as *const u8, len) }
    }

    /// [`Ring::recover`] for a producer that died computing work `items` its supervisor sets
    /// aside (they killed the producers that computed them): each item the dead producer holds
    /// (CLAIMED, or DONE in a batch it was still writing) is set aside instead of going back
    /// FREE: settled for good, never claimed or published, counted in the ring's `set_aside`
    /// ([`Recovered::work_set_aside`]). An item it does not hold (given back, another
    /// producer's, or published) is left as it is. Everything else is recovered as by
    /// [`Ring::recover`].
    pub fn recover_setting_aside_work(
        &self,
        wid: WorkerName,
        items: &[u64],
    ) -> Result<Recovered, RingError> {
        let mut settling = Settling {
            batches: &[],
            before: &mut |_, _, _| {},
            work: items,
        };
        self.recover_inner(wid, holder_alive, Some(&mut settling))
    }

    /// For the creator of a resumed run, before any producer starts: counts work `items` as
    /// done (their batches' training is in the checkpoint), so no producer claims them. Returns
    /// how many were newly marked; an item out of range is an error naming it.
    pub fn mark_work_done(&self, items: impl IntoIterator<Item = u64>) -> Result<u64, RingError> {
        self.writable()?;
        let core = self.core_ref();
        let mut n = 0;
        for item in items {
            n += u64::from(core.mark_done_before(item)?);
        }
        Ok(n)
    }

    fn recover_with(
        &self,
        wid: WorkerName,
        holder_alive: impl Fn(Lease) -> bool,
    ) -> Result<Recovered, RingError> {
        self.recover_inner(wid, holder_alive, None)
    }

    fn recover_inner(
        &self,
        wid: WorkerName,
        holder_alive: impl Fn(Lease) -> bool,
        settling: Option<&mut Settling<'_>>,
    ) -> Result<Recovered, RingError> {
        self.writable()?;
        let id = self.id_of(wid)?;
        let me = my_lease()?;
        self.core_ref()
            .recover(id, me, holder_alive, settling)
            .map_err(|holder| RingError::WorkerAlive {
                id: wid,
                pid: holder.pid(),
            })
    }

    /// For the supervisor: counts producer `index`, which will not come back, as finished so the
    /// ring still closes. Call [`Ring::recover`] first. Refuses a producer whose process runs.
    /// Returns true if this closed the ring.
    pub fn retire(&self, index: u32) -> Result<bool, RingError> {
        self.writable()?;
        let wid = WorkerName::producer(index);
        let id = self.id_of(wid)?;
        let core = self.core_ref();
        if let Some(holder) = core.live_holder(id, holder_alive) {
            return Err(RingError::WorkerAlive {
                id: wid,
                pid: holder.pid(),
            });
        }
        Ok(core.retire(id))
    }
}

/// This process's lease word.
fn my_lease() -> Result<Lease, RingError> {
    let pid = sys::pid();
    Lease::of(pid, sys::process_start_ticks(pid).unwrap_or(0))
        .ok_or(RingError::UnsupportedPid { pid })
}

/// The staleness rule (see `sys::holder_alive`), with this process always counted alive: its
/// own registrations are live handles, whatever `/proc` says.
fn holder_alive(holder: Lease) -> bool {
    holder.pid() == sys::pid()
        || sys::holder_alive(holder.pid(), holder.start_ticks(), LEASE_START_MASK)
}

/// What producers and consumers share: a registration in the worker table.
struct Worker<'r> {
    ring: &'r Ring,
    id: u32,
    wid: WorkerName,
    /// This process's lease word, which holds the id while this handle lives.
    lease: Lease,
    /// The registration epoch; tags this incarnation's work claims.
    epoch: u64,
}

impl Worker<'_> {
    fn core(&self) -> RingRef<'_> {
        self.ring.core_ref()
    }
    fn add_phase(&self, phase: Phase, d: Duration) {
        self.core()
            .worker(self.id)
            .clock
            .add(phase, d.as_nanos() as u64);
    }
    fn set_gpu(&self, gpu: Option<u32>) {
        self.core()
            .worker(self.id)
            .gpu
            .store(gpu.unwrap_or(NO_GPU), Ordering::Relaxed);
    }
    fn epoch(&self) -> u64 {
        self.epoch
    }
}

impl Drop for Worker<'_> {
    /// Leaves cleanly: the id is free for the next registration. Slots whose guards were leaked
    /// stay as they are until that registration, or a recovery, cleans them up.
    fn drop(&mut self) {
        self.core().unregister(self.id, self.lease);
    }
}

/// Methods every registered worker has.
macro_rules! worker_methods {
    () => {
        /// This worker's id in the ring.
        pub fn id(&self) -> WorkerName {
            self.w.wid
        }
        /// How many times this id has been registered (1 for the first run; restarts add one).
        pub fn epoch(&self) -> u64 {
            self.w.epoch()
        }
        /// Records the GPU this worker drives, for telemetry.
        pub fn set_gpu(&self, gpu: Option<u32>) {
            self.w.set_gpu(gpu)
        }
        /// Adds `d` to this worker's time in `phase` (for time measured elsewhere).
        pub fn add_phase(&self, phase: Phase, d: Duration) {
            self.w.add_phase(phase, d)
        }
        /// Records an idle gap of `d` ending now (for gaps measured elsewhere: a device's own
        /// timeline). `enter` records the gaps between `compute` phases by itself.
        pub fn add_gap(&self, d: Duration) {
            self.w.core().record_gap(self.w.id, d)
        }
        /// Says this worker times its device with its own timeline (CUDA events): from now on
        /// its busy time and idle gaps are the device's, put in with
        /// [`record_device`](Self::record_device), and `enter` no longer opens and closes gaps.
        /// `false` (the timeline failed): host-timed again from now. The idle gap kept for the
        /// second of a switch is the longer of that second's gaps of either kind.
        pub fn set_device_timed(&self, on: bool) {
            self.w.core().set_device_timed(self.w.id, on)
        }
        /// Adds a span of this worker's device work, resolved from its events.
        pub fn record_device(&self, span: crate::DeviceSpan) {
            self.w.core().record_device(self.w.id, span)
        }
        /// Starts counting this worker's time in `phase` (until the next `enter`); returns
        /// the phase it leaves. The ring switches to the wait phases by itself while a
        /// `reserve` or `take` blocks, and back afterwards.
        pub fn enter(&self, phase: Phase) -> Option<Phase> {
            self.w.core().enter(self.w.id, Some(phase))
        }
        /// Says which batch this worker is computing on now (a consumer: the batch's id; a
        /// producer: its work item), `None` between computations. Its supervisor reads it
        /// after the process died, to hold the death against that batch (one in hand at
        /// several deaths can be set aside: [`Ring::recover_settling`],
        /// [`Ring::recover_setting_aside_work`]); a hint, never used while the worker runs.
        pub fn set_in_hand(&self, batch: Option<u64>) {
            self.w.core().set_in_hand(self.w.id, batch)
        }
        /// Marks this worker alive now (ring operations do this too).
        pub fn heartbeat(&self) {
            self.w.core().heartbeat(self.w.id)
        }
        /// This worker's heartbeat as a handle any thread may hold and call (the worker itself
        /// is used from one thread): a Python worker's heartbeat thread.
        pub fn beat(&self) -> Beat<'r> {
            Beat {
                ring: self.w.ring,
                id: self.w.id,
            }
        }
        pub fn ring(&self) -> &Ring {
            self.w.ring
        }
    };
}

/// Marks one worker alive from any thread ([`Producer::beat`], [`Consumer::beat`]): only the
/// ring and the worker's id, so it is `Send` and `Sync` where the worker is not. A beat after
/// the worker left writes a time no one reads until the id's next registration, which
/// writes its own.
#[derive(Clone, Copy)]
pub struct Beat<'r> {
    ring: &'r Ring,
    id: u32,
}

// Any thread may hold one: the point of it.
const _: () = {
    const fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<Beat<'static>>();
};

impl Beat<'_> {
    /// Marks the worker alive now.
    pub fn heartbeat(&self) {
        self.ring.core_ref().heartbeat(self.id)
    }
}

/// A registered producer.
pub struct Producer<'r> {
    w: Worker<'r>,
}

impl<'r> Producer<'r> {
    worker_methods!();

    /// Claims a free slot for a payload of `len` bytes, sleeping while the ring is full.
    pub fn reserve(&self, len: usize) -> Result<WriteSlot<'_>, RingError> {
        loop {
            if let Some(s) = self.reserve_until(len, None)? {
                return Ok(s);
            }
        }
    }

    /// As [`Producer::reserve`], giving up after `timeout` (returns `None`).
    pub fn reserve_timeout(
        &self,
        len: usize,
        timeout: Duration,
    ) -> Result<Option<WriteSlot<'_>>, RingError> {
        self.reserve_until(len, Some(Instant::now() + timeout))
    }

    fn reserve_until(
        &self,
        len: usize,
        deadline: Option<Instant>,
    ) -> Result<Option<WriteSlot<'_>>, RingError> {
        let slot_size = self.w.ring.params().slot_size;
        if len as u64 > slot_size {
            return Err(RingError::PayloadTooLarge {
                len: len as u64,
                slot_size,
            });
        }
        Ok(self
            .w
            .core()
            .reserve(self.w.id, deadline)?
            .map(|claim| WriteSlot {
                p: self,
                claim,
                len,
                done: false,
            }))
    }

    /// Claims the next unit of work (see [`RingParams::work_items`]): faster producers claim
    /// more, and items given back (by a dead producer's recovery, an aborted slot or
    /// [`Producer::unclaim_work`]) are claimed once the fresh ones run out. `None` when one scan
    /// of the table found every item claimed or done. It never blocks or spins.
    ///
    /// `None` does not mean the producer may finish: an item another producer holds may still
    /// come back (its holder dies and is given up) and then only a producer that has not
    /// finished can publish it. A producer's claim loop uses
    /// [`Producer::claim_work_timeout`], which says when finishing is safe.
    pub fn claim_work(&self) -> Option<u64> {
        self.w.core().claim_work(self.w.id, self.w.epoch)
    }

    /// As [`Producer::claim_work`], but while no item is FREE and some are still held (claimed,
    /// or marked done in a batch not yet committed, by any producer, this one included), sleeps
    /// (no CPU) for one to come back, at most `timeout`: [`WorkClaim::Pending`] then. It answers
    /// [`WorkClaim::Settled`] once every item's batch is committed (nothing can come back any
    /// more) or the ring is closed: only then should the producer finish. Items this producer
    /// holds count as held, so call it from a thread other than the one that will commit them
    /// (or with a timeout), and look at stop requests between calls.
    pub fn claim_work_timeout(&self, timeout: Duration) -> WorkClaim {
        self.w
            .core()
            .claim_work_until(self.w.id, self.w.epoch, Some(Instant::now() + timeout))
    }

    /// [`Producer::claim_work_timeout`] for a thread that claims ahead of the one doing the work
    /// (our target's prefetch thread): its waits do not beat the heartbeat. The worker is alive
    /// if its working thread is, which beats for itself; else a forward hung while this thread
    /// waits for held items would look alive for ever.
    pub fn claim_work_ahead(&self, timeout: Duration) -> WorkClaim {
        let deadline = Some(Instant::now() + timeout);
        (self.w.core()).claim_work_waiting(self.w.id, self.w.epoch, deadline, false)
    }

    /// Gives back a claimed item this producer will not do (e.g. it is stopping early).
    pub fn unclaim_work(&self, item: u64) -> Result<(), RingError> {
        self.w.core().unclaim_work(self.w.id, self.w.epoch, item)
    }

    /// Declares that this producer will publish nothing more. The last expected producer to
    /// finish closes the ring and wakes every consumer; returns true if this call closed it.
    pub fn finish(self) -> bool {
        self.w.core().finish(self.w.id)
    }

    /// As [`Producer::finish`], for a producer held by reference for the whole process (the
    /// Python package's, whose slots borrow it): the caller must claim and reserve nothing
    /// afterwards.
    pub fn finish_shared(&self) -> bool {
        self.w.core().finish(self.w.id)
    }
}

/// A slot being written. Dropping it without [`WriteSlot::commit`] gives the slot back
/// unpublished, and the work item it completed (if any) back to the work table.
pub struct WriteSlot<'p> {
    p: &'p Producer<'p>,
    claim: Claim,
    len: usize,
    done: bool,
}

impl WriteSlot<'_> {
    /// The payload, in place in shared memory: `len` bytes as reserved. Contents are whatever
    /// the slot held before; write all of it.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let ptr = self.p.w.ring.segment().payload_ptr(self.claim.idx);
        // SAFETY: the slot is WRITING and owned by this producer (the claim's CAS proved it),
        // so no other process reads or writes these bytes until we commit or abort; `len` is at
        // most the slot size, which lies inside the mapping; the mapping outlives `self`
        // (it borrows the ring), and `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(ptr, self.len) }
    }

    /// Index of the slot in the ring (for diagnostics).
    pub fn slot(&self) -> usize {
        self.claim.idx
    }

    /// Records that this slot's batch completes work item `item`, which this producer claimed.
    /// The item counts as done exactly when the batch is committed: if the slot is dropped
    /// (aborted) or the producer dies before [`WriteSlot::commit`], the item goes back to be
    /// claimed again, by any producer. One item per slot.
    pub fn complete_work(&mut self, item: u64) -> Result<(), RingError> {
        self.p
            .w
            .core()
            .complete_work(self.p.w.id, self.p.w.epoch, self.claim, item)
    }

    /// Publishes the payload as READY with its metadata.
    pub fn commit(mut self, meta: CommitMeta) -> Result<(), RingError> {
        self.done = true;
        self.p
            .w
            .core()
            .commit(self.p.w.id, self.claim, self.len as u64, meta)
    }
}

impl Drop for WriteSlot<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.p.w.core().abort(self.claim);
        }
    }
}

/// A registered consumer. Not `Sync`: one thread takes with it.
pub struct Consumer<'r> {
    w: Worker<'r>,
    st: RefCell<TakeState>,
    held: Cell<u32>,
}

impl<'r> Consumer<'r> {
    worker_methods!();

    /// Takes the next item under the ring's policy, sleeping while there is none. `None` means
    /// end of stream: the ring is closed and every item has been taken and settled.
    pub fn take(&self) -> Result<Option<ReadSlot<'_>>, RingError> {
        loop {
            match self.take_until(None, None)? {
                Take::Item(s) => return Ok(Some(s)),
                Take::End => return Ok(None),
                Take::TimedOut => {}
            }
        }
    }

    /// As [`Consumer::take`], giving up after `timeout`.
    pub fn take_timeout(&self, timeout: Duration) -> Result<Take<'_>, RingError> {
        self.take_until(None, Some(Instant::now() + timeout))
    }

    /// As [`Consumer::take_timeout`], serving bucket `prefer` when it has a READY item (under
    /// a bucketed policy; the `min_ready` rule still holds). The drafter group uses it so the
    /// ranks of one step train batches of one length class.
    pub fn take_timeout_preferring(
        &self,
        prefer: Option<u32>,
        timeout: Duration,
    ) -> Result<Take<'_>, RingError> {
        self.take_until(prefer, Some(Instant::now() + timeout))
    }

    /// A bucket chosen in proportion to its READY items (as the proportional pick chooses),
    /// among the buckets holding at least
    /// `at_least` of them (among all if none does; None if nothing is READY), whatever the
    /// ring's `pick`. The drafter group's leader draws the next step's bucket with it, `at_least`
    /// the group's size: the ranks then take from one bucket, and the mix of lengths still
    /// follows what is published (a bucket short of items waits until it has enough, or until
    /// the fallback takes them when the drawn bucket runs out).
    pub fn draw_bucket(&self, at_least: u32) -> Option<u32> {
        let mut per_bucket = self.w.core().ready_per_bucket();
        if per_bucket.iter().all(|&n| n == 0) {
            return None;
        }
        if per_bucket.iter().any(|&n| n >= at_least) {
            per_bucket
                .iter_mut()
                .filter(|n| **n < at_least)
                .for_each(|n| *n = 0);
        }
        let mut st = self.st.borrow_mut();
        Some(crate::core::choose_bucket(
            &per_bucket,
            crate::BucketPick::Proportional,
            &mut st,
        ))
    }

    fn take_until(
        &self,
        prefer: Option<u32>,
        deadline: Option<Instant>,
    ) -> Result<Take<'_>, RingError> {
        let limit = self.w.ring.params().held_per_consumer;
        if self.held.get() >= limit {
            return Err(RingError::TooManyHeld {
                held: self.held.get(),
            });
        }
        let core = self.w.core();
        let taken = core.take(self.w.id, &mut self.st.borrow_mut(), prefer, deadline);
        Ok(match taken {
            Taken::Item(claim) => {
                let meta = core.item_meta(claim.idx);
                let slot = ReadSlot {
                    c: self,
                    claim,
                    meta,
                    done: false,
                };
                self.held.set(self.held.get() + 1);
                if meta.len > self.w.ring.params().slot_size {
                    let name = self.w.ring.name().to_string();
                    drop(slot);
                    return Err(RingError::Corrupt {
                        name,
                        what: format!("an item claims {} bytes, more than a slot", meta.len),
                    });
                }
                Take::Item(slot)
            }
            Taken::End => Take::End,
            Taken::TimedOut => Take::TimedOut,
        })
    }
}

/// A slot being read. Dropping it releases the slot, as [`ReadSlot::release`] does.
pub struct ReadSlot<'c> {
    c: &'c Consumer<'c>,
    claim: Claim,
    meta: ItemMeta,
    done: bool,
}

impl ReadSlot<'_> {
    /// The payload, in place in shared memory.
    pub fn payload(&self) -> &[u8] {
        let ptr = self.c.w.ring.segment().payload_ptr(self.claim.idx);
        // SAFETY: the slot is READING and owned by this consumer, so no producer writes it until
        // we release; `meta.len` was checked against the slot size in `take_until`; the
        // mapping outlives `self`.
        unsafe { std::slice::from_raw_parts(ptr, self.meta.len as usize) }
    }

    pub fn meta(&self) -> &ItemMeta {
        &self.meta
    }

    /// Index of the slot in the ring (for diagnostics).
    pub fn slot(&self) -> usize {
        self.claim.idx
    }

    /// Frees the slot for producers.
    pub fn release(mut self) -> Result<(), RingError> {
        self.release_inner(false)
    }

    /// Frees the slot without consuming the item, whose content the consumer refuses as corrupt:
    /// not delivered again (another consumer would refuse the same bytes), counted in the
    /// ring's `refused` rather than `released`, so nothing reads it as trained.
    pub fn refuse(mut self) -> Result<(), RingError> {
        self.release_inner(true)
    }

    /// Gives the item back unconsumed: READY again for any consumer, its delivery count plus
    /// one (as if this consumer had died holding it). For a batch this consumer will not train.
    pub fn requeue(mut self) -> Result<(), RingError> {
        self.done = true;
        self.c.held.set(self.c.held.get().saturating_sub(1));
        self.c.w.core().requeue(self.claim)
    }

    fn release_inner(&mut self, refused: bool) -> Result<(), RingError> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        self.c.held.set(self.c.held.get().saturating_sub(1));
        self.c.w.core().release(self.c.w.id, self.claim, refused)
    }
}

impl Drop for ReadSlot<'_> {
    fn drop(&mut self) {
        let _ = self.release_inner(false);
    }
}
