//! Thin, safe wrappers over the few system calls the ring needs: POSIX shared memory, `mmap`,
//! `posix_fallocate`, shared futexes and process identity. Every `unsafe` block of the crate that
//! talks to the kernel is here.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::time::Duration;

use crate::sync::AtomicU32;

/// Opens (or exclusively creates) `/dev/shm/<name>`. `name` has no leading slash.
pub(crate) fn shm_open(name: &str, create: bool, writable: bool) -> io::Result<OwnedFd> {
    let path = CString::new(format!("/{name}"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains a NUL byte"))?;
    let mut flags = if writable {
        libc::O_RDWR
    } else {
        libc::O_RDONLY
    };
    if create {
        flags |= libc::O_CREAT | libc::O_EXCL;
    }
    flags |= libc::O_CLOEXEC;
    // SAFETY: `path` is a valid NUL-terminated string for the duration of the call.
    let fd = unsafe { libc::shm_open(path.as_ptr(), flags, 0o600 as libc::mode_t) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by a successful shm_open and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if create {
        // The mode passed to shm_open is filtered by the umask; set it exactly.
        // SAFETY: `fd` is an open descriptor.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

pub(crate) fn shm_unlink(name: &str) -> io::Result<()> {
    let path = CString::new(format!("/{name}"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains a NUL byte"))?;
    // SAFETY: `path` is a valid NUL-terminated string.
    if unsafe { libc::shm_unlink(path.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the size of the segment and reserves its memory now, so that a `/dev/shm` too small for
/// the ring fails here with `ENOSPC` instead of raising SIGBUS in a worker hours later.
pub(crate) fn reserve(fd: &OwnedFd, len: u64) -> io::Result<()> {
    let off = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: `fd` is an open descriptor of a shared-memory object.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), off) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above; posix_fallocate returns the error number instead of setting errno.
    let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, off) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

pub(crate) struct FileInfo {
    pub size: u64,
    pub uid: u32,
    pub mode: u32,
}

pub(crate) fn fstat(fd: &OwnedFd) -> io::Result<FileInfo> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is valid for writes of a `stat`; fstat fills it on success.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, so `st` is initialised.
    let st = unsafe { st.assume_init() };
    Ok(FileInfo {
        size: st.st_size as u64,
        uid: st.st_uid,
        mode: st.st_mode,
    })
}

/// Free bytes on the filesystem that holds `/dev/shm`, for the "too small" error message.
pub(crate) fn shm_free_bytes() -> Option<u64> {
    let path = CString::new("/dev/shm").ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `st` is valid for writes of a `statvfs`.
    if unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded, so `st` is initialised.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// A shared mapping of a whole segment. Unmapped on drop.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all concurrent access to it goes through atomics or
// through slots whose exclusive ownership the ring's state machine guarantees.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn new(fd: &OwnedFd, len: usize, writable: bool) -> io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Self { ptr, len })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping made by `Mapping::new` and not unmapped yet;
        // every reference into it borrows `self`, so none outlives this call.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// `FUTEX_WAIT` on a word that may be shared between processes.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit word for the whole call; FUTEX_WAIT only reads it.
    // EAGAIN (value changed), EINTR and ETIMEDOUT are all "go and look again" for the caller.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// `FUTEX_WAKE` of every waiter on `word`, in any process.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 32-bit word; FUTEX_WAKE does not access memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is valid for writes; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

pub(crate) fn pid() -> u32 {
    std::process::id()
}

/// Start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
/// Together with the pid it names a process uniquely, so a recycled pid is not taken for the
/// creator of a segment.
pub(crate) fn process_start_ticks(pid: u32) -> Option<u64> {
    proc_stat(pid).ok().map(|s| s.start_ticks)
}

/// What `/proc/<pid>/stat` says about a process.
struct ProcStat {
    /// Field 3: R, S, D, Z (zombie), X (dead), ...
    state: char,
    start_ticks: u64,
}

fn proc_stat(pid: u32) -> io::Result<ProcStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/<pid>/stat");
    // The command name (field 2) is in parentheses and may hold spaces; fields after it are
    // counted from the last ')'.
    let rest = &stat[stat.rfind(')').ok_or_else(bad)? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields
        .next()
        .and_then(|f| f.chars().next())
        .ok_or_else(bad)?;
    let start_ticks = fields
        .nth(18)
        .and_then(|f| f.parse().ok())
        .ok_or_else(bad)?;
    Ok(ProcStat { state, start_ticks })
}

/// True if process `pid`, started at `start_ticks` (0: unknown; compared on its low
/// `start_mask` bits), may still run. The staleness rule of the ring:
/// - no `/proc/<pid>`: gone;
/// - a zombie (or dead) process: gone, since it can never touch memory again, reaped or not;
/// - another start time: gone, the pid was recycled;
/// - `/proc/<pid>/stat` unreadable for another reason: `kill(pid, 0)` decides, and anything but
///   "no such process" counts as alive, since what cannot be seen is not judged gone.
pub(crate) fn holder_alive(pid: u32, start_ticks: u64, start_mask: u64) -> bool {
    match proc_stat(pid) {
        Ok(st) => {
            !matches!(st.state, 'Z' | 'X')
                && (start_ticks == 0 || st.start_ticks & start_mask == start_ticks & start_mask)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            let Ok(p) = libc::pid_t::try_from(pid) else {
                return true;
            };
            // SAFETY: kill with signal 0 only checks that the process exists.
            let rc = unsafe { libc::kill(p, 0) };
            !(rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH))
        }
    }
}

/// True if a process with this pid and start time is running (a zombie does not count).
pub(crate) fn process_alive(pid: u32, start_ticks: u64) -> bool {
    holder_alive(pid, start_ticks, u64::MAX)
}

/// Inode of this process's pid namespace (`/proc/self/ns/pid`), if `/proc` is this process's
/// own: `/proc/self` must name our pid, or `/proc` belongs to another pid namespace and nothing
/// read from it about pids can be trusted.
pub(crate) fn pid_namespace() -> Option<u64> {
    let me = std::fs::read_link("/proc/self").ok()?;
    if me.to_str()?.parse::<u32>().ok()? != pid() {
        return None;
    }
    use std::os::unix::fs::MetadataExt;
    Some(std::fs::metadata("/proc/self/ns/pid").ok()?.ino())
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), as a number; None if unreadable.
pub(crate) fn boot_id() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    u128::from_str_radix(&hex, 16).ok().filter(|&b| b != 0)
}
