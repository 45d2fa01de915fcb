//! The public handles: [`Ring`] (a mapped segment), [`Producer`] and [`Consumer`] (a registered
//! worker), and the slot guards [`WriteSlot`] and [`ReadSlot`] through which payloads are written
//! and read in place.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use crate::core::{Claim, CommitMeta, CoreParams, ItemMeta, Recovered, RingRef, TakeState, Taken};
use crate::layout::{W_ALIVE, W_DONE};
use crate::segment::{self, Creator, Segment, NO_GPU};
use crate::sync::Ordering;
use crate::{sys, Phase, RingError, RingParams, Role, WorkerId};

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

    /// The process that created the ring.
    pub fn creator(&self) -> Creator {
        self.seg.creator()
    }

    /// True if the ring's creator has exited: nobody will clean it up, and `--gc` may remove it.
    pub fn is_stale(&self) -> bool {
        !self.seg.creator().alive()
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

    fn id_of(&self, id: WorkerId) -> Result<u32, RingError> {
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

    /// Registers this process as worker `id`. A worker record left ALIVE by a process that has
    /// since died is recovered first, so a restarted worker cleans up after its predecessor even
    /// without a supervisor.
    fn register(&self, wid: WorkerId) -> Result<Worker<'_>, RingError> {
        self.writable()?;
        let id = self.id_of(wid)?;
        let core = self.core_ref();
        let rec = core.worker(id);
        let me = sys::pid();
        let r = Ordering::Relaxed;
        if rec.state.load(r) == W_ALIVE {
            let pid = rec.pid.load(r);
            let start = rec.pid_start.load(r);
            if pid != me && sys::process_alive(pid, start) {
                return Err(RingError::WorkerBusy { id: wid, pid });
            }
            if pid != me {
                core.recover(id);
            }
        }
        rec.pid.store(me, r);
        rec.pid_start
            .store(sys::process_start_ticks(me).unwrap_or(0), r);
        rec.epoch.fetch_add(1, r);
        rec.registered_ns.store(sys::monotonic_ns(), r);
        rec.state.store(W_ALIVE, r);
        core.heartbeat(id);
        core.enter(id, Some(Phase::Other));
        Ok(Worker {
            ring: self,
            id,
            wid,
        })
    }

    /// Registers producer `index` of this process.
    pub fn producer(&self, index: u32) -> Result<Producer<'_>, RingError> {
        Ok(Producer {
            w: self.register(WorkerId::producer(index))?,
        })
    }

    /// Registers consumer `index` of this process.
    pub fn consumer(&self, index: u32) -> Result<Consumer<'_>, RingError> {
        let w = self.register(WorkerId::consumer(index))?;
        let st = TakeState::new(self.params().seed, w.id);
        Ok(Consumer {
            w,
            st: RefCell::new(st),
            held: Cell::new(0),
        })
    }

    /// For the supervisor, after worker `id`'s process has exited: its WRITING slots become FREE
    /// and its READING slots READY again, delivery count + 1.
    pub fn recover(&self, id: WorkerId) -> Result<Recovered, RingError> {
        self.writable()?;
        let id = self.id_of(id)?;
        Ok(self.core_ref().recover(id))
    }

    /// For the supervisor: counts producer `index`, which will not come back, as finished so the
    /// ring still closes. Call [`Ring::recover`] first. Returns true if this closed the ring.
    pub fn retire(&self, index: u32) -> Result<bool, RingError> {
        self.writable()?;
        let id = self.id_of(WorkerId::producer(index))?;
        Ok(self.core_ref().retire(id))
    }
}

/// What producers and consumers share: a registration in the worker table.
struct Worker<'r> {
    ring: &'r Ring,
    id: u32,
    wid: WorkerId,
}

impl Worker<'_> {
    fn core(&self) -> RingRef<'_> {
        self.ring.core_ref()
    }
    fn add_phase(&self, phase: Phase, d: Duration) {
        self.core().worker(self.id).phase_ns[phase as usize]
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
    fn set_gpu(&self, gpu: Option<u32>) {
        self.core()
            .worker(self.id)
            .gpu
            .store(gpu.unwrap_or(NO_GPU), Ordering::Relaxed);
    }
    fn epoch(&self) -> u64 {
        self.core().worker(self.id).epoch.load(Ordering::Relaxed)
    }
}

impl Drop for Worker<'_> {
    fn drop(&mut self) {
        self.core().enter(self.id, None);
        let _ = self.core().worker(self.id).state.compare_exchange(
            W_ALIVE,
            W_DONE,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
}

/// Methods every registered worker has.
macro_rules! worker_methods {
    () => {
        /// This worker's id in the ring.
        pub fn id(&self) -> WorkerId {
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
        /// Starts counting this worker's time in `phase` (until the next `enter`); returns
        /// the phase it leaves. The ring switches to the wait phases by itself while a
        /// `reserve` or `take` blocks, and back afterwards.
        pub fn enter(&self, phase: Phase) -> Option<Phase> {
            self.w.core().enter(self.w.id, Some(phase))
        }
        /// Marks this worker alive now (ring operations do this too).
        pub fn heartbeat(&self) {
            self.w.core().heartbeat(self.w.id)
        }
        pub fn ring(&self) -> &Ring {
            self.w.ring
        }
    };
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
        let capacity = self.w.ring.params().slot_size;
        if len as u64 > capacity {
            return Err(RingError::PayloadTooLarge {
                len: len as u64,
                capacity,
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
    /// more, and items a dead producer held come back once the fresh ones run out. `None` when
    /// every item is claimed or done.
    pub fn claim_work(&self) -> Option<u64> {
        self.w.core().claim_work(self.w.id)
    }

    /// Gives back a claimed item this producer will not do (e.g. it is stopping early).
    pub fn unclaim_work(&self, item: u64) -> Result<(), RingError> {
        self.w.core().unclaim_work(self.w.id, item)
    }

    /// Declares that this producer will publish nothing more. The last expected producer to
    /// finish closes the ring and wakes every consumer; returns true if this call closed it.
    pub fn finish(self) -> bool {
        self.w.core().finish(self.w.id)
    }
}

/// A slot being written. Dropping it without [`WriteSlot::commit`] gives the slot back unpublished.
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
        // most the slot capacity, which lies inside the mapping; the mapping outlives `self`
        // (it borrows the ring), and `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(ptr, self.len) }
    }

    /// Index of the slot in the ring (for diagnostics).
    pub fn slot(&self) -> usize {
        self.claim.idx
    }

    /// Records that this slot's batch completes work item `item`, which this producer claimed.
    /// The item counts as done exactly when the batch is committed: if the producer dies before
    /// [`WriteSlot::commit`], recovery returns the item to be claimed again.
    pub fn complete_work(&mut self, item: u64) -> Result<(), RingError> {
        self.p.w.core().complete_work(self.p.w.id, self.claim, item)
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
            self.p.w.core().abort(self.p.w.id, self.claim);
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
            match self.take_until(None)? {
                Take::Item(s) => return Ok(Some(s)),
                Take::End => return Ok(None),
                Take::TimedOut => {}
            }
        }
    }

    /// As [`Consumer::take`], giving up after `timeout`.
    pub fn take_timeout(&self, timeout: Duration) -> Result<Take<'_>, RingError> {
        self.take_until(Some(Instant::now() + timeout))
    }

    fn take_until(&self, deadline: Option<Instant>) -> Result<Take<'_>, RingError> {
        let limit = self.w.ring.params().held_per_consumer;
        if self.held.get() >= limit {
            return Err(RingError::TooManyHeld {
                held: self.held.get(),
            });
        }
        let core = self.w.core();
        let taken = core.take(self.w.id, &mut self.st.borrow_mut(), deadline);
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
        // we release; `meta.len` was checked against the slot capacity in `take_until`; the
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
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<(), RingError> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        self.c.held.set(self.c.held.get().saturating_sub(1));
        self.c.w.core().release(self.c.w.id, self.claim)
    }
}

impl Drop for ReadSlot<'_> {
    fn drop(&mut self) {
        let _ = self.release_inner();
    }
}
