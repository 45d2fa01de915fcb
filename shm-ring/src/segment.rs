//! The named segment under `/dev/shm`: its header, its layout, and how it is created, attached,
//! listed and removed.
//!
//! Length: create and attach check the same layout field by field, so they stay side by side,
//! and the listing judges staleness from what they read and refuse.
//!
//! Creation is two-phase: create exclusively (mode 0600), reserve all memory, map, initialise
//! every field, then publish the magic number last with a Release store. An attacher checks the
//! owner, the mode, the size, then the magic with an Acquire load (pairs with that store) and the
//! layout version (`shmem`'s checks, the drafter group's too), then the recorded layout before
//! it touches anything past the header.
//!
//! The listing judges each segment stale (its creator provably gone) by the creator its header
//! records, or, for a blank one that a creator killed inside `create` left, by its name alone
//! (`judge_blank`, which says why that is safe); any doubt leaves it unjudged.

use std::io;
use std::mem::size_of;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use serde::Serialize;
use shmem::{Refusal, Stamp};

use crate::error::RingError;
use crate::layout::{Control, SlotRecord, WorkerRecord, ROLE_CONSUMER, ROLE_PRODUCER};
use crate::params::{BucketPick, RingParams, TakePolicy, PAGE};
use crate::sys::{self, Mapping};

/// "hspipeR1" in ASCII.
const MAGIC: u64 = u64::from_be_bytes(*b"hspipeR1");
/// Bumped whenever any shared type changes shape or meaning. 2: worker leases, tagged work
/// words, the creator's pid namespace and boot. 3: no checksum in the slot record (the batch
/// carries its own, which drafters verify; nothing read the ring's copy). 4: the control block's
/// `work_seq` and `work_waiters`, on which producers wait for claimed work to come back. 5: each
/// worker's idle gaps (`gap_since`, `gaps`). 6: each worker's device timeline (`device_*`) and
/// phase log. 8: the control block's `set_aside` and each worker's `in_hand`. 9: SET_ASIDE work
/// words (an item a supervisor set aside, never claimed again). 10: RETURNED work words (a batch
/// a producer died with, run again alone). 11: each worker's phase clock is a seqlock
/// (`phase_clock.rs`). 12: the control block's `refused` (items freed unconsumed as corrupt).
pub const LAYOUT_VERSION: u32 = 12;
/// What attach expects at the start of the header.
const STAMP: Stamp = Stamp {
    magic: MAGIC,
    version: LAYOUT_VERSION,
};
/// Every hspipe ring's name starts with this; `--list` and `--gc` look for it.
pub const NAME_PREFIX: &str = "hspipe-";
/// A `gpu` field value meaning "not set".
pub(crate) const NO_GPU: u32 = u32::MAX;

/// The first bytes of a segment. Written once by the creator before the magic is published;
/// read-only afterwards.
#[repr(C)]
pub(crate) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    policy_kind: AtomicU32,
    total_size: AtomicU64,
    slot_size: AtomicU64,
    seed: AtomicU64,
    slots: AtomicU32,
    buckets: AtomicU32,
    producers: AtomicU32,
    consumers: AtomicU32,
    held: AtomicU32,
    min_ready: AtomicU32,
    pick: AtomicU32,
    creator_pid: AtomicU32,
    creator_uid: AtomicU32,
    _pad: AtomicU32,
    creator_start: AtomicU64,
    created_unix_ns: AtomicU64,
    control_off: AtomicU64,
    slots_off: AtomicU64,
    workers_off: AtomicU64,
    payload_off: AtomicU64,
    work_items: AtomicU64,
    work_off: AtomicU64,
    /// The creator's pid namespace inode and boot id (0: unknown): what a judge of the creator's
    /// liveness must share with it to trust `/proc`.
    creator_pidns: AtomicU64,
    creator_boot_hi: AtomicU64,
    creator_boot_lo: AtomicU64,
}

/// Byte offsets of each region, computed from the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offsets {
    pub control: u64,
    pub slots: u64,
    pub workers: u64,
    pub work: u64,
    pub payload: u64,
    pub total: u64,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl Offsets {
    pub(crate) fn of(p: &RingParams) -> Offsets {
        let control = align_up(size_of::<Header>() as u64, 128);
        let slots = align_up(control + size_of::<Control>() as u64, 128);
        let workers = align_up(
            slots + u64::from(p.slots) * size_of::<SlotRecord>() as u64,
            128,
        );
        let work = align_up(
            workers + u64::from(p.workers()) * size_of::<WorkerRecord>() as u64,
            128,
        );
        let payload = align_up(work + p.work_items * 8, PAGE);
        let total = payload + u64::from(p.slots) * p.slot_stride();
        Offsets {
            control,
            slots,
            workers,
            work,
            payload,
            total,
        }
    }
}

/// Identity of the process that created a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Creator {
    pub pid: u32,
    pub uid: u32,
    #[serde(skip)]
    pub start_ticks: u64,
    pub created_unix_ns: u64,
    /// Inode of the creator's pid namespace (0: unknown).
    pub pid_namespace: u64,
    /// The creator's boot id (0: unknown).
    #[serde(skip)]
    pub boot_id: u128,
}

/// Whether this process's pid namespace and boot are those of a ring's creator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kinship {
    /// Same boot and pid namespace: `/proc` shows the creator's processes as they are.
    Same,
    /// Another boot: every process of the creator's boot is gone.
    OtherBoot,
    /// Another pid namespace: the creator's pids mean nothing here.
    OtherNamespace,
    /// This process or the creator could not read its boot or pid namespace.
    Unknown,
}

impl Creator {
    pub(crate) fn kinship(&self) -> Kinship {
        let (Some(boot), Some(ns)) = (sys::boot_id(), sys::pid_namespace()) else {
            return Kinship::Unknown;
        };
        if self.boot_id == 0 || self.pid_namespace == 0 {
            Kinship::Unknown
        } else if self.boot_id != boot {
            Kinship::OtherBoot
        } else if self.pid_namespace != ns {
            Kinship::OtherNamespace
        } else {
            Kinship::Same
        }
    }

    /// `Some(true)` if the creating process still runs, `Some(false)` if it is gone (exited,
    /// a zombie, its pid recycled, or it ran in an earlier boot), `None` if this process cannot
    /// judge: the ring was made in another pid namespace, or either side's is unknown.
    pub fn liveness(&self) -> Option<bool> {
        match self.kinship() {
            Kinship::Same => Some(sys::process_alive(self.pid, self.start_ticks)),
            Kinship::OtherBoot => Some(false),
            Kinship::OtherNamespace | Kinship::Unknown => None,
        }
    }

    /// False only when the creator is known to be gone (see [`Creator::liveness`]): a creator
    /// that cannot be judged counts as alive, so nothing removes its ring.
    pub fn alive(&self) -> bool {
        self.liveness() != Some(false)
    }
}

/// A mapped segment. The creator's handle unlinks the name when dropped.
pub(crate) struct Segment {
    name: String,
    map: Mapping,
    owner: bool,
    writable: bool,
    params: RingParams,
    offsets: Offsets,
}

pub(crate) fn check_name(name: &str) -> Result<(), RingError> {
    let bad = |why| {
        // Named as far as a message can hold it: a name read from a damaged file may be
        // megabytes long.
        let name = match name.char_indices().nth(64) {
            Some((cut, _)) => format!("{}... ({} bytes)", &name[..cut], name.len()),
            None => name.to_string(),
        };
        Err(RingError::InvalidName { name, why })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > 200 {
        return bad("it is longer than 200 bytes");
    }
    if name.starts_with('.') {
        return bad("it starts with a dot");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return bad("use only letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

fn io_err(op: &'static str, name: &str, e: io::Error) -> RingError {
    match e.kind() {
        io::ErrorKind::NotFound => RingError::NotFound {
            name: name.to_string(),
        },
        io::ErrorKind::PermissionDenied => RingError::PermissionDenied {
            name: name.to_string(),
        },
        io::ErrorKind::AlreadyExists => RingError::Exists {
            name: name.to_string(),
        },
        _ => RingError::Io {
            op,
            name: name.to_string(),
            cause: e,
        },
    }
}

/// A refused segment, in the ring's words.
fn refused(name: &str, r: Refusal) -> RingError {
    let name = name.to_string();
    match r {
        Refusal::ForeignOwner { owner, me } => RingError::ForeignOwner { name, owner, me },
        Refusal::InsecureMode { mode } => RingError::InsecureMode { name, mode },
        // Creation sizes the segment whole in one ftruncate: empty is a creator killed (or
        // caught) between its shm_open and its ftruncate, while any other short size is not
        // something a creator leaves.
        Refusal::TooSmall { size: 0, .. } => RingError::Uninitialised {
            name,
            what: "it is empty (its creator died before sizing it, or is sizing it now)",
        },
        Refusal::TooSmall { size, .. } => RingError::Corrupt {
            name,
            what: format!("it is {size} bytes, smaller than a ring header"),
        },
        Refusal::Uninitialised => RingError::Uninitialised {
            name,
            what: "its header is blank (its creator died while creating it, or is creating it now)",
        },
        Refusal::BadMagic { found } => RingError::BadMagic { name, found },
        Refusal::Version { found, expected } => RingError::VersionMismatch {
            name,
            found,
            expected,
        },
    }
}

/// Unlinks a half-made segment if creation fails part way.
struct UnlinkGuard<'a>(Option<&'a str>);

impl Drop for UnlinkGuard<'_> {
    fn drop(&mut self) {
        if let Some(name) = self.0 {
            let _ = sys::shm_unlink(name);
        }
    }
}

impl Segment {
    pub(crate) fn create(name: &str, params: &RingParams) -> Result<Segment, RingError> {
        check_name(name)?;
        params.validate()?;
        let offsets = Offsets::of(params);
        // Exclusive, 0600, every byte reserved (`shmem::create` unlinks what it made if the
        // reservation fails).
        let fd = shmem::create(name, offsets.total).map_err(|e| {
            if sys::is_out_of_space(&e) {
                RingError::ShmTooSmall {
                    name: name.to_string(),
                    needed: offsets.total,
                    available: sys::shm_free_bytes().unwrap_or(0),
                }
            } else {
                io_err("create", name, e)
            }
        })?;
        let mut guard = UnlinkGuard(Some(name));
        let map = map_whole(&fd, name, offsets.total, true)?;
        let seg = Segment {
            name: name.to_string(),
            map,
            owner: true,
            writable: true,
            params: *params,
            offsets,
        };
        seg.initialise();
        guard.0 = None;
        Ok(seg)
    }

    /// Fills a zeroed segment and publishes the magic last.
    fn initialise(&self) {
        let h = self.header();
        let p = &self.params;
        let (kind, min_ready, pick) = match p.policy {
            TakePolicy::Fifo => (0, 0, 0),
            TakePolicy::Bucketed { min_ready, pick } => (
                1,
                min_ready,
                match pick {
                    BucketPick::RoundRobin => 0,
                    BucketPick::Fullest => 1,
                    BucketPick::Proportional => 2,
                },
            ),
        };
        let r = Ordering::Relaxed;
        h.version.store(LAYOUT_VERSION, r);
        h.policy_kind.store(kind, r);
        h.total_size.store(self.offsets.total, r);
        h.slot_size.store(p.slot_size, r);
        h.seed.store(p.seed, r);
        h.slots.store(p.slots, r);
        h.buckets.store(p.buckets, r);
        h.producers.store(p.producers, r);
        h.consumers.store(p.consumers, r);
        h.held.store(p.held_per_consumer, r);
        h.min_ready.store(min_ready, r);
        h.pick.store(pick, r);
        let pid = sys::pid();
        h.creator_pid.store(pid, r);
        h.creator_uid.store(sys::euid(), r);
        h.creator_start
            .store(sys::process_start_ticks(pid).unwrap_or(0), r);
        let unix_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        h.created_unix_ns.store(unix_ns, r);
        h.control_off.store(self.offsets.control, r);
        h.slots_off.store(self.offsets.slots, r);
        h.workers_off.store(self.offsets.workers, r);
        h.payload_off.store(self.offsets.payload, r);
        h.work_items.store(p.work_items, r);
        h.work_off.store(self.offsets.work, r);
        h.creator_pidns.store(sys::pid_namespace().unwrap_or(0), r);
        let boot = sys::boot_id().unwrap_or(0);
        h.creator_boot_hi.store((boot >> 64) as u64, r);
        h.creator_boot_lo.store(boot as u64, r);
        for (i, w) in self.workers().iter().enumerate() {
            let i = i as u32;
            let (role, index) = if i < p.producers {
                (ROLE_PRODUCER, i)
            } else {
                (ROLE_CONSUMER, i - p.producers)
            };
            w.role.store(role, r);
            w.index.store(index, r);
            w.gpu.store(NO_GPU, r);
        }
        // SYNC: Release publishes every store above; pairs with the Acquire load in `attach`.
        h.magic.store(MAGIC, Ordering::Release);
    }

    pub(crate) fn attach(name: &str, writable: bool) -> Result<Segment, RingError> {
        check_name(name)?;
        let fd = sys::shm_open(name, writable).map_err(|e| io_err("open", name, e))?;
        let info = sys::fstat(&fd).map_err(|e| io_err("stat", name, e))?;
        shmem::check_file(&info, writable, PAGE).map_err(|r| refused(name, r))?;
        let corrupt = |what: String| RingError::Corrupt {
            name: name.to_string(),
            what,
        };
        let map = map_whole(&fd, name, info.size, writable)?;
        // SAFETY: the mapping is at least one page long, page-aligned, and `Header` is made of
        // atomics, valid for any bit pattern.
        let h = unsafe { &*map.as_ptr().cast::<Header>() };
        // SYNC: Acquire pairs with the Release store of the magic in `initialise`.
        let magic = h.magic.load(Ordering::Acquire);
        STAMP
            .check(magic, h.version.load(Ordering::Relaxed))
            .map_err(|r| refused(name, r))?;
        let params =
            read_params(h).map_err(|e| corrupt(format!("its parameters are invalid: {e}")))?;
        let offsets = Offsets::of(&params);
        let recorded = Offsets {
            control: h.control_off.load(Ordering::Relaxed),
            slots: h.slots_off.load(Ordering::Relaxed),
            workers: h.workers_off.load(Ordering::Relaxed),
            work: h.work_off.load(Ordering::Relaxed),
            payload: h.payload_off.load(Ordering::Relaxed),
            total: h.total_size.load(Ordering::Relaxed),
        };
        if recorded != offsets {
            return Err(corrupt(format!(
                "its header records layout {recorded:?}, its parameters give {offsets:?}"
            )));
        }
        if info.size != offsets.total {
            return Err(corrupt(format!(
                "its header says {} bytes but the segment has {}",
                offsets.total, info.size
            )));
        }
        let seg = Segment {
            name: name.to_string(),
            map,
            owner: false,
            writable,
            params,
            offsets,
        };
        // A writer judges other workers' liveness by pid: it must see the pids they see. (Where
        // either side cannot tell, as without /proc, liveness falls back to `kill(pid, 0)`.)
        if writable {
            let what = match seg.creator().kinship() {
                Kinship::OtherBoot => Some("boot"),
                Kinship::OtherNamespace => Some("pid namespace"),
                Kinship::Same | Kinship::Unknown => None,
            };
            if let Some(what) = what {
                return Err(RingError::ForeignNamespace {
                    name: name.to_string(),
                    what,
                });
            }
        }
        Ok(seg)
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }
    pub(crate) fn params(&self) -> &RingParams {
        &self.params
    }
    pub(crate) fn offsets(&self) -> Offsets {
        self.offsets
    }
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    /// Stops this handle from unlinking the name on drop (e.g. after handing ownership on).
    pub(crate) fn disown(&mut self) {
        self.owner = false;
    }

    fn header(&self) -> &Header {
        // SAFETY: offset 0 of a mapping at least a page long; atomics are valid for any bits.
        unsafe { &*self.map.as_ptr().cast::<Header>() }
    }

    pub(crate) fn creator(&self) -> Creator {
        let h = self.header();
        Creator {
            pid: h.creator_pid.load(Ordering::Relaxed),
            uid: h.creator_uid.load(Ordering::Relaxed),
            start_ticks: h.creator_start.load(Ordering::Relaxed),
            created_unix_ns: h.created_unix_ns.load(Ordering::Relaxed),
            pid_namespace: h.creator_pidns.load(Ordering::Relaxed),
            boot_id: u128::from(h.creator_boot_hi.load(Ordering::Relaxed)) << 64
                | u128::from(h.creator_boot_lo.load(Ordering::Relaxed)),
        }
    }

    pub(crate) fn control(&self) -> &Control {
        // SAFETY: `Offsets::of` places Control at a 128-aligned offset inside the mapping (the
        // size was checked against the file at attach), and it is made of atomics.
        unsafe { &*self.at(self.offsets.control).cast::<Control>() }
    }

    pub(crate) fn slots(&self) -> &[SlotRecord] {
        // SAFETY: `slots` records of 128-aligned `SlotRecord` lie inside the mapping at this
        // offset; they are made of atomics and live as long as `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.at(self.offsets.slots).cast::<SlotRecord>(),
                self.params.slots as usize,
            )
        }
    }

    pub(crate) fn workers(&self) -> &[WorkerRecord] {
        // SAFETY: as for `slots`, for the worker records.
        unsafe {
            std::slice::from_raw_parts(
                self.at(self.offsets.workers).cast::<WorkerRecord>(),
                self.params.workers() as usize,
            )
        }
    }

    pub(crate) fn work(&self) -> &[AtomicU64] {
        // SAFETY: `work_items` 8-byte atomics lie inside the mapping at this 128-aligned offset.
        unsafe {
            std::slice::from_raw_parts(
                self.at(self.offsets.work).cast::<AtomicU64>(),
                self.params.work_items as usize,
            )
        }
    }

    /// Start of slot `idx`'s payload.
    pub(crate) fn payload_ptr(&self, idx: usize) -> *mut u8 {
        self.at(self.offsets.payload + idx as u64 * self.params.slot_stride())
    }

    fn at(&self, off: u64) -> *mut u8 {
        debug_assert!(off < self.map.len() as u64);
        // SAFETY: every offset passed here is inside the mapping (checked at create/attach).
        unsafe { self.map.as_ptr().add(off as usize) }
    }

    pub(crate) fn unlink(&self) -> Result<(), RingError> {
        sys::shm_unlink(&self.name).map_err(|e| io_err("unlink", &self.name, e))
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner {
            let _ = sys::shm_unlink(&self.name);
        }
    }
}

fn map_whole(fd: &OwnedFd, name: &str, len: u64, writable: bool) -> Result<Mapping, RingError> {
    let len = usize::try_from(len).map_err(|_| RingError::Corrupt {
        name: name.to_string(),
        what: format!("its size {len} does not fit the address space"),
    })?;
    Mapping::new(fd, len, writable).map_err(|e| io_err("map", name, e))
}

fn read_params(h: &Header) -> Result<RingParams, crate::params::ConfigError> {
    let r = Ordering::Relaxed;
    let policy = match h.policy_kind.load(r) {
        0 => TakePolicy::Fifo,
        _ => TakePolicy::Bucketed {
            min_ready: h.min_ready.load(r),
            pick: match h.pick.load(r) {
                1 => BucketPick::Fullest,
                2 => BucketPick::Proportional,
                _ => BucketPick::RoundRobin,
            },
        },
    };
    let p = RingParams {
        slots: h.slots.load(r),
        slot_size: h.slot_size.load(r),
        buckets: h.buckets.load(r),
        producers: h.producers.load(r),
        consumers: h.consumers.load(r),
        held_per_consumer: h.held.load(r),
        policy,
        seed: h.seed.load(r),
        work_items: h.work_items.load(r),
    };
    p.validate()?;
    Ok(p)
}

/// One hspipe segment found in `/dev/shm`.
#[derive(Clone, Debug, Serialize)]
pub struct SegmentInfo {
    pub name: String,
    pub bytes: u64,
    /// The creator, if the header could be read.
    pub creator: Option<Creator>,
    /// `Some(true)` if the creator runs, `Some(false)` if it is gone (stale), `None` if this
    /// process cannot tell (another pid namespace: see [`Creator::liveness`]; an unreadable
    /// header, unless it is a blank one whose name proves it stale: see `judge_blank`).
    pub live: Option<bool>,
    /// Why the creator could not be judged, or why a blank segment was judged by its name.
    pub problem: Option<String>,
}

impl SegmentInfo {
    /// True when the creator is known to be gone: what `shm-ring-stat --gc` removes. A segment
    /// whose creator cannot be judged (an unreadable header, another pid namespace) is never
    /// stale, so nothing removes a ring that may still be in use; a blank one (never
    /// initialised) is stale only when its name proves its creator gone (`judge_blank`).
    pub fn is_stale(&self) -> bool {
        self.live == Some(false)
    }
}

/// Every `hspipe-*` segment in `/dev/shm`, sorted by name.
pub fn list_segments() -> io::Result<Vec<SegmentInfo>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/dev/shm")? {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !name.starts_with(NAME_PREFIX) {
            continue;
        }
        let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
        let info = match Segment::attach(&name, false) {
            Ok(seg) => {
                let c = seg.creator();
                let live = c.liveness();
                SegmentInfo {
                    name,
                    bytes,
                    creator: Some(c),
                    live,
                    problem: live.is_none().then(|| {
                        "made in another pid namespace (or one this process cannot read): its creator's liveness cannot be judged here".to_string()
                    }),
                }
            }
            Err(RingError::Uninitialised { what, .. }) => {
                let (live, why) = judge_blank(&name);
                SegmentInfo {
                    name,
                    bytes,
                    creator: None,
                    live,
                    problem: Some(format!("never initialised: {what}; {why}")),
                }
            }
            Err(e) => SegmentInfo {
                name,
                bytes,
                creator: None,
                live: None,
                problem: Some(e.to_string()),
            },
        };
        out.push(info);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// How long a blank segment must have gone unchanged before its name may judge it. A creator
/// changes its segment all through `Segment::create`: the ftruncate that sizes it, the
/// fallocate that reserves it (the kernel stamps the mtime as it returns), then its first store
/// to the header page (a first write through a shared mapping of tmpfs stamps it too), and only
/// stores to that page follow until the magic: a live creator's blank segment is microseconds
/// past its last change, unless the creator is stopped right there, or on a kernel that does
/// not stamp the fallocate, whose length then counts too. A minute covers both with room.
const BLANK_GRACE: std::time::Duration = std::time::Duration::from_secs(60);
/// How much later than the time in a ring's name the process with the name's pid may have
/// started and still be its creator: the name's time and the start time read from `/proc` are
/// both in whole seconds, and a wall clock stepped forward since the name was taken makes the
/// creator look started later.
const NAME_START_SLACK_S: u64 = 60;

/// The time (Unix seconds) and pid in a launcher's ring name, `hspipe-<unix secs>-<pid>` (the
/// launcher's run id, formed in `launcher/src/lib.rs`, after [`NAME_PREFIX`]): the launcher
/// takes both from itself before it creates the ring, so its pid ran at that time. Anything
/// else (a drafter group's `-group`, a test's or a user's own name) is `None`.
fn launcher_ring_name(name: &str) -> Option<(u64, u32)> {
    let (secs, pid) = name.strip_prefix(NAME_PREFIX)?.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(secs) || !digits(pid) {
        return None;
    }
    let (secs, pid): (u64, u32) = (secs.parse().ok()?, pid.parse().ok()?);
    (secs > 0 && pid > 0).then_some((secs, pid))
}

/// Judges a blank segment (never initialised: no header says who made it) by its name alone:
/// `(Some(false), why)` when its creator is provably gone, `(None, why)` otherwise. Stale only
/// when every one of these holds, in this order, each a doubt otherwise:
/// - the name is a launcher's ring name ([`launcher_ring_name`]), so it names its creator's pid
///   and a time at which that pid ran;
/// - the segment is this user's: the creator made it, so it had this uid, and `/proc` shows a
///   user's own processes even where it hides others' (`hidepid`);
/// - it has gone unchanged for [`BLANK_GRACE`], so no creator is in the middle of making it;
/// - `/proc` is this process's pid namespace's ([`sys::pid_namespace`]);
/// - no process has the named pid, or the one that has it started after the name's time (with
///   [`NAME_START_SLACK_S`]): the pid was recycled, so the launcher that named the ring is gone.
///
/// The pid namespace. An initialised header records its creator's, and a ring of another one
/// is never judged; a blank header records nothing, so the name's pid is read as one of this
/// namespace. A creator of another namespace (one sharing this `/dev/shm`) that is dead loses
/// nothing. One that runs and whose pid means nothing here could lose its segment only while
/// it is blank, that is inside `Segment::create`, which changes the segment up to its last
/// microseconds before the magic: so only a creator stopped there for the whole grace. The
/// same holds for a creator that named its ring after another pid, which no hspipe program
/// does. A launcher of this namespace is protected by its pid whatever it does, since it is
/// alive and started before the name's time. Once a header is published, the header decides.
fn judge_blank(name: &str) -> (Option<bool>, String) {
    judge_by_name(name, name)
}

/// Judges segment `segment`, which belongs to ring `ring` (its drafter group: the launcher
/// makes both and records both), by the launcher named in the ring's name, with the rule of a
/// blank ring ([`judge_blank`]): for a ring that is gone, whose segments nobody but its
/// launcher removes, and no header of which says who made it. Removing the name of a segment a
/// process still maps takes nothing from that process (its mapping stays); with its launcher
/// gone no process attaches anew (the launcher hands out the name), and its drafters end
/// themselves as their control channel closes.
pub fn judge_orphan(ring: &str, segment: &str) -> (Option<bool>, String) {
    judge_by_name(ring, segment)
}

/// [`judge_blank`]'s rule: the launcher is named by `named_by` (a ring's name), the file
/// judged (its owner and last change) is `/dev/shm/<segment>`.
fn judge_by_name(named_by: &str, segment: &str) -> (Option<bool>, String) {
    use std::os::unix::fs::MetadataExt;
    let unjudged = |why: String| (None, format!("not judged: {why}"));
    let Some((secs, pid)) = launcher_ring_name(named_by) else {
        return unjudged(format!(
            "its name is not a launcher's ({NAME_PREFIX}<unix secs>-<pid>), so nothing names its creator"
        ));
    };
    let meta = match std::fs::symlink_metadata(std::path::Path::new("/dev/shm").join(segment)) {
        Ok(m) => m,
        Err(e) => return unjudged(format!("reading it: {e}")),
    };
    if meta.uid() != sys::euid() {
        return unjudged(format!(
            "it belongs to uid {}: only this user's own are judged by their name",
            meta.uid()
        ));
    }
    // Read after the attach found it blank: a change made before that is seen.
    let unchanged = meta.modified().ok().and_then(|t| t.elapsed().ok());
    if unchanged.is_none_or(|d| d < BLANK_GRACE) {
        return unjudged(format!(
            "it changed under {} s ago, so its creator may be creating it now (it is judged by its name, pid {pid}, once unchanged that long)",
            BLANK_GRACE.as_secs()
        ));
    }
    if sys::pid_namespace().is_none() {
        return unjudged(format!(
            "/proc is not this process's pid namespace's, so whether pid {pid} (named in it) runs cannot be seen"
        ));
    }
    if sys::gone_since(pid, secs, NAME_START_SLACK_S) {
        (
            Some(false),
            format!("stale by its name: launcher pid {pid}, named in it, is gone (no process has that pid, or the one that has it started after the name's time)"),
        )
    } else {
        unjudged(format!(
            "launcher pid {pid}, named in it, still runs and may be creating it"
        ))
    }
}

/// Removes a segment by name, whoever created it (the caller decided it is stale).
pub(crate) fn unlink_name(name: &str) -> Result<(), RingError> {
    check_name(name)?;
    sys::shm_unlink(name).map_err(|e| io_err("unlink", name, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead pid: a child that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        c.wait().unwrap();
        c.id()
    }

    /// What `shm-ring-stat --gc RING` does (ring-stat's CLI, over this crate's listing): remove
    /// RING if the listing judges it stale. Only this test's ring, so other tests' rings are not
    /// touched.
    fn gc(name: &str) -> String {
        let mut out = String::new();
        for s in list_segments().unwrap() {
            if s.name == name && s.is_stale() {
                unlink_name(&s.name).unwrap();
                out.push_str(&format!("removed {}\n", s.name));
            }
        }
        out
    }

    /// Unlinks a test's segment when the test ends, passed or failed.
    struct Unlink(String);

    impl Drop for Unlink {
        fn drop(&mut self) {
            let _ = sys::shm_unlink(&self.0);
        }
    }

    fn unix_now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    /// What a launcher SIGKILLed inside `Ring::create` leaves: a 0600 segment under its ring's
    /// name (`hspipe-<secs>-<pid>`), `len` zero bytes (made and ftruncate'd, the header never
    /// written), last changed `age` ago.
    fn blank_ring(secs: u64, pid: u32, len: u64, age: std::time::Duration) -> Unlink {
        blank(format!("{NAME_PREFIX}{secs}-{pid}"), len, age)
    }

    /// A blank segment `name` of `len` zero bytes, last changed `age` ago.
    fn blank(name: String, len: u64, age: std::time::Duration) -> Unlink {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(std::path::Path::new("/dev/shm").join(&name))
            .unwrap();
        let guard = Unlink(name);
        f.set_len(len).unwrap();
        f.set_modified(std::time::SystemTime::now() - age).unwrap();
        guard
    }

    fn listed(name: &str) -> SegmentInfo {
        let all = list_segments().unwrap();
        all.into_iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} is not listed"))
    }

    const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);

    /// A launcher SIGKILLed inside `Ring::create` (between the segment's shm_open and the magic)
    /// leaves a blank segment that no header names a creator of: `--gc` left it for ever
    /// (`live: None`). Its name does: `hspipe-<unix secs>-<launcher pid>`. With that pid gone
    /// and the segment unchanged for long, it is stale and `--gc` removes it, whether the kill
    /// came before the ftruncate (empty) or after it (zeros).
    #[test]
    fn a_blank_ring_whose_named_launcher_is_gone_is_stale_and_collected() {
        for len in [0, 4 * PAGE] {
            let ring = blank_ring(unix_now() - 3600, dead_pid(), len, HOUR);
            let name = ring.0.clone();
            let s = listed(&name);
            assert_eq!(s.live, Some(false), "{len} bytes: {s:?}");
            assert!(s.is_stale() && s.creator.is_none(), "{s:?}");
            let problem = s.problem.unwrap();
            assert!(
                problem.contains("never initialised") && problem.contains("is gone"),
                "{problem}"
            );
            let out = gc(&name);
            assert!(out.contains(&name), "{out}");
            assert!(!std::path::Path::new("/dev/shm").join(&name).exists());
        }

        // The named pid runs, but started after the name was taken (2001): it was recycled, and
        // the launcher that named the ring is gone.
        let ring = blank_ring(1_000_000_000, std::process::id(), 4 * PAGE, HOUR);
        let s = listed(&ring.0);
        assert!(s.is_stale(), "{s:?}");
        assert!(gc(&ring.0).contains(&ring.0));
    }

    /// A blank ring is judged by its name only when nothing is in doubt: while the launcher
    /// named in it runs (it may be creating it now), while it changed recently (a creator may be
    /// in the middle of making it), or when its name names no launcher, it is not judged, and
    /// `--gc` leaves it.
    #[test]
    fn a_blank_ring_is_not_judged_while_its_creator_may_be_making_it() {
        let in_doubt = |ring: &Unlink, why: &str| {
            let s = listed(&ring.0);
            assert_eq!(s.live, None, "{s:?}");
            let problem = s.problem.as_deref().unwrap();
            assert!(
                problem.contains("not judged") && problem.contains(why),
                "{problem}"
            );
            assert_eq!(gc(&ring.0), "");
            assert!(std::path::Path::new("/dev/shm").join(&ring.0).exists());
        };
        // Named by this process, which runs and started before the name's time.
        let mine = blank_ring(unix_now(), std::process::id(), 4 * PAGE, HOUR);
        in_doubt(&mine, "still runs");
        // Its launcher gone, but changed a moment ago.
        let fresh = blank_ring(unix_now() - 3600, dead_pid(), 4 * PAGE, Default::default());
        in_doubt(&fresh, "may be creating it now");
        // Not a launcher's name: nothing names its creator.
        let other = blank(
            format!("{NAME_PREFIX}u-{}-blank", dead_pid()),
            4 * PAGE,
            HOUR,
        );
        in_doubt(&other, "not a launcher's");
    }

    #[test]
    fn only_a_launchers_ring_name_names_a_creator() {
        assert_eq!(
            launcher_ring_name("hspipe-1796046264-5282"),
            Some((1796046264, 5282))
        );
        for name in [
            "hspipe-1796046264-5282-group",
            "hspipe-u-5282-pidns",
            "hspipe-1796046264-",
            "hspipe--5282",
            "hspipe-+1-5282",
            "hspipe-0-5282",
            "hspipe-1796046264-0",
            "hspipe-1796046264-99999999999",
            "other-1796046264-5282",
        ] {
            assert_eq!(launcher_ring_name(name), None, "{name}");
        }
    }

    /// Issue #9, item 6: the creator's pid namespace and boot are recorded. A ring whose creator
    /// pid is gone HERE but which was made in another pid namespace is not judged (its creator
    /// may run there): `--gc` leaves it and writers may not attach. In this namespace it is stale
    /// and `--gc` removes it; made in an earlier boot, it is stale whatever its namespace.
    #[test]
    fn a_ring_of_another_pid_namespace_is_never_judged_stale_nor_collected() {
        let name = format!("hspipe-u-{}-pidns", std::process::id());
        let seg = Segment::create(&name, &RingParams::tiny_fifo()).unwrap();
        let h = seg.header();
        let r = Ordering::Relaxed;
        assert_eq!(seg.creator().liveness(), Some(true));
        assert_ne!(
            h.creator_pidns.load(r),
            0,
            "the creator's namespace is recorded"
        );
        h.creator_pid.store(dead_pid(), r);
        let mine = h.creator_pidns.load(r);
        h.creator_pidns.store(mine ^ 1, r);

        assert_eq!(seg.creator().liveness(), None);
        let listed = list_segments().unwrap();
        let me = listed.iter().find(|s| s.name == name).unwrap();
        assert_eq!(me.live, None);
        assert!(me.problem.as_deref().unwrap().contains("pid namespace"));
        assert!(!gc(&name).contains(&name));
        assert!(std::path::Path::new("/dev/shm").join(&name).exists());
        let err = Segment::attach(&name, true).err().unwrap();
        assert!(
            matches!(
                err,
                RingError::ForeignNamespace {
                    what: "pid namespace",
                    ..
                }
            ),
            "{err}"
        );
        assert!(Segment::attach(&name, false).is_ok(), "reading is harmless");

        // Another boot: every process of it is gone.
        h.creator_boot_lo.store(h.creator_boot_lo.load(r) ^ 1, r);
        assert_eq!(seg.creator().liveness(), Some(false));
        h.creator_boot_lo.store(h.creator_boot_lo.load(r) ^ 1, r);

        h.creator_pidns.store(mine, r);
        assert_eq!(seg.creator().liveness(), Some(false));
        let out = gc(&name);
        // A launcher starting elsewhere meanwhile may reclaim it first: stale is stale.
        assert!(
            !std::path::Path::new("/dev/shm").join(&name).exists(),
            "{out}"
        );
    }
}
