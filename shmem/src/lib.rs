//! POSIX shared-memory segments and shared futexes, over `rustix`: the one place hspipe asks the
//! kernel for shared memory. The ring (`shm-ring`) and the drafter group (`collective`) both
//! build their segments from these calls, so both follow one set of rules:
//!
//! - **Exclusive, private creation.** [`create`] fails if the name exists and leaves the
//!   object mode 0600 whatever the umask (shm_open's mode is filtered by it; an `fchmod`
//!   follows).
//! - **Every byte reserved up front.** [`create`] sizes the object and `fallocate`s it, so a
//!   `/dev/shm` too small fails there with `ENOSPC` instead of SIGBUS in a worker hours later.
//! - **Shared futexes.** [`futex_wait`]/[`futex_wake_all`] use the shared (not private) futex
//!   ops: waiters and wakers are different processes mapping one segment at different
//!   addresses, and a private futex is keyed by virtual address.
//! - **Checked before trusted.** [`check_file`] and [`Stamp::check`] are the owner, mode, size,
//!   magic and version checks every attacher makes.
//! - **One facade for loom.** [`sync`] gives both crates their atomics and futex waits, swapped
//!   by loom's under `cfg(loom)`.
//!
//! Why rustix: `nix` has no futex, and std has neither shared memory nor futexes. rustix makes
//! each call safe except `mmap`/`munmap`, which stay in [`Mapping`]. Errors keep their errno;
//! callers name the operation and the segment.

use std::io;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::fs::{FallocateFlags, Mode};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::shm::OFlags;

mod check;
pub mod sync;

pub use check::{check_file, Refusal, Stamp};

/// True if `e` says the filesystem (or the size limit) has no room: `/dev/shm` is too small
/// for the segment.
pub fn is_out_of_space(e: &io::Error) -> bool {
    let raw = e.raw_os_error();
    raw == Some(rustix::io::Errno::NOSPC.raw_os_error())
        || raw == Some(rustix::io::Errno::FBIG.raw_os_error())
}

/// Exclusively creates `/dev/shm/<name>` (mode 0600) of `len` bytes, all reserved now. On
/// failure after the create, the name is unlinked again: nothing is left behind.
pub fn create(name: &str, len: u64) -> io::Result<OwnedFd> {
    let fd = rustix::shm::open(
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(io::Error::from)?;
    let sized = rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR)
        .map_err(io::Error::from)
        .and_then(|()| rustix::fs::ftruncate(&fd, len).map_err(io::Error::from))
        .and_then(|()| {
            rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len).map_err(io::Error::from)
        });
    if let Err(e) = sized {
        let _ = rustix::shm::unlink(name);
        return Err(e);
    }
    Ok(fd)
}

/// Opens an existing `/dev/shm/<name>`.
pub fn open(name: &str, writable: bool) -> io::Result<OwnedFd> {
    let flags = if writable {
        OFlags::RDWR
    } else {
        OFlags::RDONLY
    };
    rustix::shm::open(name, flags, Mode::empty()).map_err(io::Error::from)
}

/// Removes the name `/dev/shm/<name>`; mappings stay valid until unmapped.
pub fn unlink(name: &str) -> io::Result<()> {
    rustix::shm::unlink(name).map_err(io::Error::from)
}

/// What an attacher checks before it trusts a segment.
#[derive(Clone, Copy, Debug)]
pub struct FileInfo {
    pub size: u64,
    pub uid: u32,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
}

pub fn stat(fd: &OwnedFd) -> io::Result<FileInfo> {
    let st = rustix::fs::fstat(fd).map_err(io::Error::from)?;
    Ok(FileInfo {
        size: st.st_size as u64,
        uid: st.st_uid,
        mode: st.st_mode & 0o7777,
    })
}

/// Free bytes on the filesystem that holds `/dev/shm`, for a "too small" error message.
pub fn free_bytes() -> Option<u64> {
    let st = rustix::fs::statvfs("/dev/shm").ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// This process's effective uid: segments are refused unless they are ours.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Nanoseconds on `CLOCK_MONOTONIC`, one clock for every process on the machine, so a
/// heartbeat one process writes compares with the time another reads.
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A shared mapping of a whole segment, unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; whoever reads or writes it through `as_ptr`
// synchronises with atomics or with an ownership protocol of its own (the ring's slot states,
// the group's rounds).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, read-only unless `writable`. The caller checked (or
    /// reserved) that `fd` holds at least `len` bytes.
    pub fn new(fd: &OwnedFd, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh shared mapping with a null hint, so the kernel picks an address and
        // no existing memory is replaced.
        let ptr =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0) }
                .map_err(io::Error::from)?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null pointer"))?;
        Ok(Mapping { ptr, len })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made by `Mapping::new`, unmapped only here; every
        // reference into it borrows `self` (or the owner holding `self`), so none outlives this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Sleeps while `word` still holds `expected`, at most `timeout`, as a shared futex. Returns on
/// a wake, a change, a signal or the timeout alike: callers re-check their condition.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::thread::futex::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // EAGAIN (the word moved), EINTR and ETIMEDOUT all mean: look again.
    let _ = rustix::thread::futex::wait(
        word,
        rustix::thread::futex::Flags::empty(),
        expected,
        Some(&ts),
    );
}

/// Wakes every waiter on `word`, in any process.
pub fn futex_wake_all(word: &AtomicU32) {
    let _ = rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), u32::MAX);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tag: &str) -> String {
        format!("hspipe-shmem-{tag}-{}", std::process::id())
    }

    #[test]
    fn a_segment_is_created_once_private_reserved_and_shared_between_mappings() {
        let n = name("create");
        let fd = create(&n, 8192).unwrap();
        let again = create(&n, 8192).unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::AlreadyExists, "{again}");
        let info = stat(&fd).unwrap();
        assert_eq!((info.size, info.mode, info.uid), (8192, 0o600, euid()));
        let a = Mapping::new(&fd, 8192, true).unwrap();
        let b = Mapping::new(&open(&n, false).unwrap(), 8192, false).unwrap();
        // SAFETY: both mappings are 8192 bytes of one segment; this test is their only user.
        unsafe {
            *a.as_ptr().add(4095) = 7;
            assert_eq!(*b.as_ptr().add(4095), 7, "one segment, two mappings");
        }
        unlink(&n).unwrap();
        assert_eq!(open(&n, false).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_segment_too_large_for_dev_shm_fails_at_creation_and_leaves_no_name() {
        let n = name("huge");
        let free = free_bytes().unwrap();
        let e = create(&n, free.saturating_mul(4).max(1 << 40)).unwrap_err();
        assert!(is_out_of_space(&e), "{e}");
        assert_eq!(open(&n, false).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_futex_wait_returns_when_the_word_is_not_the_expected_one() {
        let w = AtomicU32::new(1);
        // Would sleep an hour if the value were ignored.
        futex_wait(&w, 0, Duration::from_secs(3600));
        futex_wake_all(&w);
        assert!(monotonic_ns() > 0);
    }
}
