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
    /// Not glibc, or glibc refused a setting: the allocator is as it was.
    Unchanged,
}

/// The environment variables through which a user tunes glibc's malloc themselves.
const USER_KNOBS: [&str; 6] = [
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
];

/// The first of the user's malloc knobs that `var` says is set.
fn user_knob(var: impl Fn(&str) -> bool) -> Option<&'static str> {
    USER_KNOBS.into_iter().find(|k| var(k))
}

/// Makes glibc's malloc keep freed memory for reuse (see the module doc), unless the user's
/// environment tunes it. Call it first thing in the process, before any other thread
/// allocates (a thread that already has an arena of its own keeps it).
pub fn keep_freed_memory() -> Malloc {
    if let Some(k) = user_knob(|k| std::env::var_os(k).is_some()) {
        return Malloc::UserSet(k);
    }
    set()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() -> Malloc {
    // SAFETY: mallopt only changes the allocator's parameters, under its own lock; it reads and
    // writes no memory of ours. The values are the ones mallopt(3) documents: one arena, 0
    // disables mmap for large requests, -1 disables trimming.
    let ok = [
        (libc::M_ARENA_MAX, 1),
        (libc::M_MMAP_MAX, 0),
        (libc::M_TRIM_THRESHOLD, -1),
    ]
    .into_iter()
    .all(|(param, value)| unsafe { libc::mallopt(param, value) } == 1);
    if ok {
        Malloc::Kept
    } else {
        Malloc::Unchanged
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() -> Malloc {
    Malloc::Unchanged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_knob_the_user_set_is_named_and_none_is_none() {
        assert_eq!(
            user_knob(|k| k == "MALLOC_TRIM_THRESHOLD_"),
            Some("MALLOC_TRIM_THRESHOLD_")
        );
        assert_eq!(user_knob(|k| k == "GLIBC_TUNABLES"), Some("GLIBC_TUNABLES"));
        assert_eq!(user_knob(|k| k == "MALLOC_ARENA_MAX_"), None);
        assert_eq!(user_knob(|_| false), None);
    }
}
