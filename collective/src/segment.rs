//! The group's shared-memory segment: created by the launcher, attached by every rank.
//!
//! Same rules as the ring's: exclusive create with mode 0600, every byte reserved up front
//! (`fallocate`, so a too-small `/dev/shm` fails here and not with SIGBUS mid-run), the magic
//! published last; attach checks owner, mode, magic, version and size. The creator's handle
//! unlinks the name when dropped.
//!
//! Layout (offsets from the start, each part 128-byte aligned):
//! `Header | Control | RankRec × ranks | buffers: ranks × 2 × buf_len u32 | state: state_len u32`.

use std::os::fd::OwnedFd;

use rustix::fs::Mode;
use rustix::mm::{MapFlags, ProtFlags};

use crate::group::{Control, Membership, Memory, RankRec, MAX_RANKS};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::GroupError;

const MAGIC: u64 = u64::from_le_bytes(*b"hsgroup1");
/// Bumped on any change to the layout.
pub const LAYOUT_VERSION: u32 = 1;

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
    ptr: *mut u8,
    len: usize,
    ranks: u32,
    buf_len: usize,
    state_len: usize,
    off: Offsets,
    owner: bool,
}

// SAFETY: the mapping is shared memory accessed only through atomics (see `Memory`); the raw
// pointer is never handed out, so moving or sharing the handle between threads is sound.
unsafe impl Send for Segment {}
// SAFETY: as above: all access through `&AtomicU*`.
unsafe impl Sync for Segment {}

fn seg_err(name: &str, why: impl std::fmt::Display) -> GroupError {
    GroupError::Segment {
        name: name.to_string(),
        why: why.to_string(),
    }
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

fn map(name: &str, fd: &OwnedFd, len: usize) -> Result<*mut u8, GroupError> {
    // SAFETY: a fresh shared mapping of `len` bytes of `fd`, which holds at least `len` bytes
    // (checked or reserved by the caller); no existing memory is replaced (null hint).
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .map_err(|e| seg_err(name, format!("mmap of {len} bytes: {e}")))?;
    Ok(p.cast())
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
        let fd = rustix::shm::shm_open(
            name,
            rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(|e| seg_err(name, format!("create: {e}")))?;
        let unlink = || {
            let _ = rustix::shm::shm_unlink(name);
        };
        if let Err(e) = rustix::fs::fallocate(
            &fd,
            rustix::fs::FallocateFlags::empty(),
            0,
            off.total as u64,
        ) {
            unlink();
            return Err(seg_err(
                name,
                format!("reserving {} bytes in /dev/shm: {e}", off.total),
            ));
        }
        let ptr = map(name, &fd, off.total).inspect_err(|_| unlink())?;
        let seg = Segment {
            name: name.to_string(),
            ptr,
            len: off.total,
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
        let fd = rustix::shm::shm_open(name, rustix::shm::OFlags::RDWR, Mode::empty())
            .map_err(|e| seg_err(name, format!("open: {e}")))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| seg_err(name, format!("fstat: {e}")))?;
        if st.st_uid != rustix::process::geteuid().as_raw() {
            return Err(seg_err(name, format!("owned by uid {}, not us", st.st_uid)));
        }
        if st.st_mode & 0o077 != 0 {
            return Err(seg_err(
                name,
                format!(
                    "mode {:o} lets others in; a group segment is 0600",
                    st.st_mode & 0o777
                ),
            ));
        }
        let size = st.st_size as usize;
        if size < std::mem::size_of::<Header>() {
            return Err(seg_err(
                name,
                format!("{size} bytes: too small to be a group"),
            ));
        }
        let ptr = map(name, &fd, size)?;
        let mut seg = Segment {
            name: name.to_string(),
            ptr,
            len: size,
            ranks: 0,
            buf_len: 0,
            state_len: 0,
            off: Offsets::of(0, 0, 0).expect("no sizes"),
            owner: false,
        };
        let h = seg.header();
        // SYNC: pairs with the Release store of the magic in create().
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(seg_err(name, "not an hspipe group segment (bad magic)"));
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(seg_err(
                name,
                format!("layout version {version}, this build reads {LAYOUT_VERSION}"),
            ));
        }
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
        unsafe { &*(self.ptr as *const Header) }
    }

    /// `n` atomics of type T at byte offset `off`.
    fn slice<T>(&self, off: usize, n: usize) -> &[T] {
        assert!(off + n * std::mem::size_of::<T>() <= self.len);
        // SAFETY: in bounds (asserted), aligned (offsets are 128-aligned and sizes multiples of
        // T's alignment), and T is an atomic type, valid for any bit pattern and for shared
        // mutation through `&`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off) as *const T, n) }
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
        // SAFETY: `ptr`/`len` are the mapping made in create()/attach(), unmapped only here;
        // every reference into it borrows `self`, so none outlives this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
        if self.owner {
            let _ = rustix::shm::shm_unlink(self.name.as_str());
        }
    }
}
