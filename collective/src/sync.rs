//! One facade for the atomics and the waits, so loom can stand in for both.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The longest a waiter sleeps before it looks again (at a stop request, say).
pub(crate) const WAIT_SLICE: std::time::Duration = std::time::Duration::from_millis(100);

/// Sleeps while `word` still holds `seen`, at most [`WAIT_SLICE`]. Shared (not private)
/// futex: the word may live in a segment mapped by several processes.
#[cfg(not(loom))]
pub(crate) fn wait(word: &AtomicU32, seen: u32) {
    shmem::futex_wait(word, seen, WAIT_SLICE);
}

/// Wakes every waiter on `word`.
#[cfg(not(loom))]
pub(crate) fn wake_all(word: &AtomicU32) {
    shmem::futex_wake_all(word);
}

/// Under loom a wait is a yield: the model then explores every order of the re-checks, and a
/// protocol that relied on the timeout to make progress shows up as a livelock.
#[cfg(loom)]
pub(crate) fn wait(_word: &AtomicU32, _seen: u32) {
    loom::thread::yield_now();
}

#[cfg(loom)]
pub(crate) fn wake_all(_word: &AtomicU32) {}
