//! The process identity the ring's staleness rule needs (start times, zombies, pid namespace,
//! boot id and boot time), from `/proc` and rustix; the shared memory and mapping calls are the
//! `shmem` crate's, re-exported here (the futex calls `sync.rs` makes itself). No `unsafe` in
//! this module.

use std::io;

pub(crate) use shmem::{
    euid, free_bytes as shm_free_bytes, is_out_of_space, monotonic_ns, open as shm_open,
    stat as fstat, unlink as shm_unlink, Mapping,
};

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
            let Some(p) = i32::try_from(pid)
                .ok()
                .and_then(rustix::process::Pid::from_raw)
            else {
                return true;
            };
            rustix::process::test_kill_process(p) != Err(rustix::io::Errno::SRCH)
        }
    }
}

/// True if a process with this pid and start time is running (a zombie does not count).
pub(crate) fn process_alive(pid: u32, start_ticks: u64) -> bool {
    holder_alive(pid, start_ticks, u64::MAX)
}

/// True if process `pid` provably is none that ran at `unix_secs` (wall clock): no process has
/// that pid ([`holder_alive`]'s rule: `/proc/<pid>` missing, a zombie, or `kill` finds none), or
/// the one that has it started more than `slack_s` seconds after `unix_secs`, so the pid was
/// recycled since. Its start time is the boot time plus its start ticks, so it follows the wall
/// clock as it is now; a clock stepped forward since `unix_secs` makes a process look started
/// later, which is what `slack_s` allows for. False whenever either time cannot be read. The
/// caller must know that `/proc` is its own pid namespace's ([`pid_namespace`]).
pub(crate) fn gone_since(pid: u32, unix_secs: u64, slack_s: u64) -> bool {
    if !holder_alive(pid, 0, 0) {
        return true;
    }
    let started = proc_stat(pid)
        .ok()
        .zip(boot_unix_secs())
        .map(|(st, boot)| boot + st.start_ticks / rustix::param::clock_ticks_per_second().max(1));
    started.is_some_and(|s| s > unix_secs.saturating_add(slack_s))
}

/// The boot time in whole seconds since the Unix epoch (`btime` in `/proc/stat`).
fn boot_unix_secs() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
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
