//! glibc's malloc told to keep what a worker frees for its next allocation.
//!
//! A candle CPU step allocates and frees tensors of tens to hundreds of MB many times over. By
//! default glibc serves each one over its mmap threshold with a fresh `mmap` and gives it back
//! with `munmap` on free, and trims the heap's free top, so every step faults its memory in
//! again page by page: measured on the DFlash step (BENCHMARKS.md, "Freed memory kept"), the
//! kernel's page-fault time was most of the step. Three documented `mallopt` settings stop that:
//! `M_ARENA_MAX = 1` (every thread allocates from the one heap: a thread's own arena maps a
//! large block on its own whatever the rest say), `M_MMAP_MAX = 0` (large blocks come from the
//! heap, where freed ones are reused) and `M_TRIM_THRESHOLD = -1` (the heap's free top is
//! kept). A worker's resident memory then stays at its largest step's, as a GPU's caching
//! allocator does. A user who set glibc's own knobs in the environment keeps theirs.
//!
//! Ours, not a crate's: mimalloc and jemalloc as the global allocator were measured beside it
//! and fault far more on this load (they return freed pages to the kernel by design).

/// What [`keep_freed_memory`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Malloc {
    /// glibc keeps freed memory (every setting took).
    Kept,
    /// This environment variable sets glibc's malloc already; it is left as the user set it.
    UserSet(&'static str),
    /// glibc refused this setting; the ones before it took.
    Refused(&'static str),
    /// Not glibc: the allocator is as it was.
    NotGlibc,
}

/// The environment variables through which a user tunes glibc's malloc themselves
/// (`GLIBC_TUNABLES` only where it names a `glibc.malloc.` tunable).
pub const USER_KNOBS: [&str; 6] = [
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
];

/// The first of the user's malloc knobs set in `var` (an environment lookup).
fn user_knob(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<&'static str> {
    USER_KNOBS.into_iter().find(|&k| match var(k) {
        None => false,
        // Other tunables (a container's `glibc.cpu.` or `glibc.pthread.` ones) leave malloc be.
        Some(v) if k == "GLIBC_TUNABLES" => v.to_string_lossy().contains("glibc.malloc."),
        Some(_) => true,
    })
}

/// Makes glibc's malloc keep freed memory for reuse (see the module doc), unless the user's
/// environment tunes it. Call it first thing in the process, before any other thread
/// allocates (a thread that already has an arena of its own keeps it).
pub fn keep_freed_memory() -> Malloc {
    if let Some(k) = user_knob(|k| std::env::var_os(k)) {
        return Malloc::UserSet(k);
    }
    set()
}

/// The process's resident memory before and after [`give_back_freed`], in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GivenBack {
    pub resident_before: u64,
    pub resident_after: u64,
}

impl GivenBack {
    /// The bytes the kernel took back (0 if the process grew meanwhile: another thread).
    pub fn bytes(&self) -> u64 {
        self.resident_before.saturating_sub(self.resident_after)
    }
}

/// Gives the heap's free memory back to the kernel once (`malloc_trim(0)`): what a model's load
/// freed (a checkpoint's host copies, dtype conversions) would otherwise stay resident for the
/// worker's whole life, since kept memory is never trimmed by itself. Call it after the load;
/// the first step then faults its own memory in once. `None` where the resident size cannot be
/// read or the allocator is not glibc.
pub fn give_back_freed() -> Option<GivenBack> {
    let resident_before = resident()?;
    trim()?;
    Some(GivenBack {
        resident_before,
        resident_after: resident()?,
    })
}

/// The process's resident memory in bytes (`/proc/self/statm`'s second field, in pages).
pub fn resident() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() -> Option<()> {
    // SAFETY: malloc_trim returns free heap pages to the kernel under the allocator's lock; no
    // block in use is touched.
    unsafe { libc::malloc_trim(0) };
    Some(())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> Option<()> {
    None
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() -> Malloc {
    // The values are the ones mallopt(3) documents: one arena, 0 disables mmap for large
    // requests, -1 disables trimming.
    let settings = [
        ("M_ARENA_MAX", libc::M_ARENA_MAX, 1),
        ("M_MMAP_MAX", libc::M_MMAP_MAX, 0),
        ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, -1),
    ];
    for (name, param, value) in settings {
        // SAFETY: mallopt only changes the allocator's parameters, under its own lock; it reads
        // and writes no memory of ours.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return Malloc::Refused(name);
        }
    }
    Malloc::Kept
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() -> Malloc {
    Malloc::NotGlibc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malloc_knob_the_user_set_is_named_and_other_tunables_are_not() {
        let only = |name: &'static str, value: &'static str| {
            move |k: &str| (k == name).then(|| value.into())
        };
        let knob = |name| user_knob(only(name, "1"));
        assert_eq!(
            knob("MALLOC_TRIM_THRESHOLD_"),
            Some("MALLOC_TRIM_THRESHOLD_")
        );
        assert_eq!(knob("MALLOC_ARENA_MAX_"), None);
        assert_eq!(user_knob(|_| None), None);
        let tunables = |v| user_knob(only("GLIBC_TUNABLES", v));
        assert_eq!(
            tunables("glibc.cpu.hwcaps=-AVX512F:glibc.malloc.arena_max=4"),
            Some("GLIBC_TUNABLES")
        );
        assert_eq!(tunables("glibc.pthread.rseq=0"), None, "not malloc's");
    }
}
