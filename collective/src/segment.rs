//! The group's shared-memory segment: created by the launcher, attached by every rank.
//!
//! Same rules as the ring's: exclusive create with mode 0600, every byte reserved up front
//! (`fallocate`, so a too-small `/dev/shm` fails here and not with SIGBUS mid-run), the magic
//! published last; attach checks owner, mode, size, magic and version (`shmem`'s checks, the
//! ring's too) and that the size fits the header. The creator's handle
//! unlinks the name when dropped.
//!
//! Layout (offsets from the start, each part 128-byte aligned):
//! `Header | Control | RankRec × ranks | buffers: ranks × 2 × buf_len u32 | state: state_len u32`.

use shmem::{Mapping, Refusal, Stamp};

use crate::group::{Control, Membership, Memory, RankRec, MAX_RANKS};
use crate::GroupError;
use shmem::sync::{AtomicU32, AtomicU64, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"hsgroup1");
/// Bumped on any change to the layout.
pub const LAYOUT_VERSION: u32 = 3;
/// What attach expects at the start of the header.
const STAMP: Stamp = Stamp {
    magic: MAGIC,
    version: LAYOUT_VERSION,
};

#[repr(C, align(128))]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    ranks: AtomicU32,
    buf_len: AtomicU64,
    state_len: AtomicU64,
    creator_pid: AtomicU32,
}

/// Sizes of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupParams {
    /// Ranks (drafter workers), at most 16.
    pub ranks: u32,
    /// f32 elements each rank contributes per step (gradients, plus whatever else is summed).
    pub buf_len: u64,
    /// u32 words of state a leader hands to a joining rank (weights and optimizer state).
    pub state_len: u64,
    /// The committed step the group starts from (0, or a resumed checkpoint's step).
    pub initial_step: u32,
}

struct Offsets {
    control: usize,
    ranks: usize,
    bufs: usize,
    state: usize,
    total: usize,
}

fn align(x: usize) -> usize {
    x.div_ceil(128) * 128
}

impl Offsets {
    fn of(ranks: u32, buf_len: u64, state_len: u64) -> Option<Offsets> {
        let control = align(std::mem::size_of::<Header>());
        let ranks_off = align(control + std::mem::size_of::<Control>());
        let bufs = align(ranks_off + std::mem::size_of::<RankRec>() * ranks as usize);
        let buf_bytes = (ranks as usize)
            .checked_mul(2)?
            .checked_mul(usize::try_from(buf_len).ok()?)?
            .checked_mul(4)?;
        let state = align(bufs.checked_add(buf_bytes)?);
        let total = state.checked_add(usize::try_from(state_len).ok()?.checked_mul(4)?)?;
        Some(Offsets {
            control,
            ranks: ranks_off,
            bufs,
            state,
            total: total.max(1).div_ceil(4096) * 4096,
        })
    }
}

/// A mapped group segment.
pub struct Segment {
    name: String,
    map: Mapping,
    ranks: u32,
    buf_len: usize,
    state_len: usize,
    off: Offsets,
    owner: bool,
}

fn seg_err(name: &str, why: impl std::fmt::Display) -> GroupError {
    GroupError::Segment {
        name: name.to_string(),
        why: why.to_string(),
    }
}

/// A refused segment, in the group's words.
fn refused(name: &str, r: Refusal) -> GroupError {
    let why = match r {
        Refusal::ForeignOwner { owner, .. } => format!("owned by uid {owner}, not us"),
        Refusal::InsecureMode { mode } => {
            format!("mode {mode:o} lets others in; a group segment is 0600")
        }
        Refusal::TooSmall { size, .. } => format!("{size} bytes: too small to be a group"),
        Refusal::Uninitialised | Refusal::BadMagic { .. } => {
            "not an hspipe group segment (bad magic)".to_string()
        }
        Refusal::Version { found, expected } => {
            format!("layout version {found}, this build reads {expected}")
        }
    };
    seg_err(name, why)
}

fn check_name(name: &str) -> Result<(), GroupError> {
    if name.is_empty() || name.len() > 200 || name.contains('/') {
        return Err(seg_err(
            name,
            "a segment name is 1-200 characters without '/'",
        ));
    }
    Ok(())
}

impl Segment {
    /// Creates `/dev/shm/<name>` for a group of `p.ranks`, all ranks members.
    pub fn create(name: &str, p: &GroupParams) -> Result<Segment, GroupError> {
        check_name(name)?;
        if p.ranks == 0 || p.ranks as usize > MAX_RANKS {
            return Err(seg_err(
                name,
                format!("{} ranks; 1 to {MAX_RANKS} work", p.ranks),
            ));
        }
        let off = Offsets::of(p.ranks, p.buf_len, p.state_len)
            .ok_or_else(|| seg_err(name, "sizes overflow"))?;
        // Exclusive, 0600, every byte reserved (so a too-small /dev/shm fails here).
        let fd = shmem::create(name, off.total as u64).map_err(|e| {
            let free = shmem::free_bytes().unwrap_or(0);
            seg_err(
                name,
                format!("create ({} bytes; {free} free in /dev/shm): {e}", off.total),
            )
        })?;
        let map = Mapping::new(&fd, off.total, true).map_err(|e| {
            let _ = shmem::unlink(name);
            seg_err(name, format!("mapping {} bytes: {e}", off.total))
        })?;
        let seg = Segment {
            name: name.to_string(),
            map,
            ranks: p.ranks,
            buf_len: p.buf_len as usize,
            state_len: p.state_len as usize,
            off,
            owner: true,
        };
        let h = seg.header();
        h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        h.ranks.store(p.ranks, Ordering::Relaxed);
        h.buf_len.store(p.buf_len, Ordering::Relaxed);
        h.state_len.store(p.state_len, Ordering::Relaxed);
        h.creator_pid.store(std::process::id(), Ordering::Relaxed);
        let all = ((1u32 << p.ranks) - 1) as u16;
        seg.control().word.store(
            Membership {
                epoch: 1,
                step: p.initial_step,
                members: all,
            }
            .pack(),
            Ordering::Relaxed,
        );
        // SYNC: pairs with the Acquire load of the magic in attach(): the fields above are
        // initialised for whoever sees it.
        h.magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Attaches to an existing group segment.
    pub fn attach(name: &str) -> Result<Segment, GroupError> {
        check_name(name)?;
        let fd = shmem::open(name, true).map_err(|e| seg_err(name, format!("open: {e}")))?;
        let st = shmem::stat(&fd).map_err(|e| seg_err(name, format!("fstat: {e}")))?;
        shmem::check_file(&st, true, std::mem::size_of::<Header>() as u64)
            .map_err(|e| refused(name, e))?;
        let size = st.size as usize;
        let map = Mapping::new(&fd, size, true).map_err(|e| seg_err(name, format!("mmap: {e}")))?;
        let mut seg = Segment {
            name: name.to_string(),
            map,
            ranks: 0,
            buf_len: 0,
            state_len: 0,
            off: Offsets::of(0, 0, 0).expect("no sizes"),
            owner: false,
        };
        let h = seg.header();
        // SYNC: pairs with the Release store of the magic in create().
        let magic = h.magic.load(Ordering::Acquire);
        STAMP
            .check(magic, h.version.load(Ordering::Relaxed))
            .map_err(|e| refused(name, e))?;
        let ranks = h.ranks.load(Ordering::Relaxed);
        let buf_len = h.buf_len.load(Ordering::Relaxed);
        let state_len = h.state_len.load(Ordering::Relaxed);
        let off = Offsets::of(ranks, buf_len, state_len)
            .filter(|o| ranks as usize <= MAX_RANKS && o.total == size)
            .ok_or_else(|| seg_err(name, format!("{size} bytes do not fit its header")))?;
        seg.ranks = ranks;
        seg.buf_len = buf_len as usize;
        seg.state_len = state_len as usize;
        seg.off = off;
        Ok(seg)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least one page, page-aligned, and Header is all atomics.
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    /// `n` atomics of type T at byte offset `off`.
    fn slice<T>(&self, off: usize, n: usize) -> &[T] {
        assert!(off + n * std::mem::size_of::<T>() <= self.map.len());
        // SAFETY: in bounds (asserted), aligned (offsets are 128-aligned and sizes multiples of
        // T's alignment), and T is an atomic type, valid for any bit pattern and for shared
        // mutation through `&`.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off) as *const T, n) }
    }
}

impl Memory for Segment {
    fn control(&self) -> &Control {
        &self.slice::<Control>(self.off.control, 1)[0]
    }
    fn rank(&self, r: u32) -> &RankRec {
        &self.slice::<RankRec>(self.off.ranks, self.ranks as usize)[r as usize]
    }
    fn buf(&self, r: u32, p: u32) -> &[AtomicU32] {
        let i = (r * 2 + p) as usize;
        self.slice(self.off.bufs + i * self.buf_len * 4, self.buf_len)
    }
    fn state(&self) -> &[AtomicU32] {
        self.slice(self.off.state, self.state_len)
    }
    fn ranks(&self) -> u32 {
        self.ranks
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // The mapping unmaps itself; the name goes with the creator's handle.
        if self.owner {
            let _ = shmem::unlink(&self.name);
        }
    }
}
