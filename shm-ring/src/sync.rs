//! The ring's waits and wakes on its sequence words, and its telemetry stores, over
//! `shmem::sync`: the one facade for atomics and futex waits, which loom swaps for its own
//! (loom's atomics, and a futex modelled by a mutex and a condition variable that waits without
//! a timeout; see that module). The ring's modules take their atomics from here, so the whole
//! crate sees one set.
//!
//! What is the ring's own: [`bump`] and [`sleep`], the wake and the wait on a sequence word
//! with its waiter count; the spin before a sleep; and the clock and telemetry counters, which
//! loom models skip (they decide nothing and would only add states).
//!
//! Only the `shmem` crate is called here, never `sys.rs` (which is not built under loom).

use std::time::Duration;

pub(crate) use shmem::sync::{fence, AtomicU32, AtomicU64, Ordering};
use shmem::sync::{wait, wake_all};

/// Spins this many times (a few microseconds) watching a sequence word before a waiter sleeps.
#[cfg(not(loom))]
const SPINS: u32 = 256;

/// Watches `word` briefly; true if it moved away from `seen`.
#[cfg(not(loom))]
pub(crate) fn spin_until_changed(word: &AtomicU32, seen: u32) -> bool {
    for _ in 0..SPINS {
        // SYNC: Acquire pairs with the Release bump of the word, like the load before a scan.
        if word.load(Ordering::Acquire) != seen {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

/// loom explores waits through `wait`; spinning would only add states.
#[cfg(loom)]
pub(crate) fn spin_until_changed(_word: &AtomicU32, _seen: u32) -> bool {
    false
}

/// Nanoseconds on `CLOCK_MONOTONIC`, which is one clock for every process on the machine, so
/// heartbeats written by one worker can be compared with the time read by another.
#[cfg(not(loom))]
pub(crate) fn now_ns() -> u64 {
    shmem::monotonic_ns()
}

#[cfg(loom)]
pub(crate) fn now_ns() -> u64 {
    0
}

/// Adds to a telemetry counter. Counters never decide anything, so loom models skip them: each
/// atomic operation is a point where loom branches, and they would only slow the models down.
#[cfg(not(loom))]
pub(crate) fn tally(counter: &AtomicU64, v: u64) {
    counter.fetch_add(v, Ordering::Relaxed);
}

#[cfg(loom)]
pub(crate) fn tally(_counter: &AtomicU64, _v: u64) {}

/// Stores a telemetry value (see [`tally`]).
#[cfg(not(loom))]
pub(crate) fn record(word: &AtomicU64, v: u64) {
    word.store(v, Ordering::Relaxed);
}

#[cfg(loom)]
pub(crate) fn record(_word: &AtomicU64, _v: u64) {}

/// Bumps a futex word and wakes everyone sleeping on it.
///
/// The wake system call is skipped when nobody waits. SYNC (Dekker): the waker bumps the
/// word, then a SeqCst fence, then reads `waiters`; a sleeper (`sleep`) counts itself in
/// `waiters`, then a SeqCst fence, then reads the word (inside the futex). Of the two fences
/// one comes first: if the waker's, the sleeper sees the new word and does not sleep; if the
/// sleeper's, the waker sees the sleeper counted and wakes it. No wake-up is lost.
pub(crate) fn bump(word: &AtomicU32, waiters: &AtomicU32) {
    // SYNC: Release pairs with the Acquire load of the sequence before a waiter's scan.
    word.fetch_add(1, Ordering::Release);
    fence(Ordering::SeqCst);
    if waiters.load(Ordering::Relaxed) > 0 {
        wake_all(word);
    }
}

/// Sleeps while `word` still holds `seq` (see `bump` for the hand-shake with wakers). First
/// spins a few microseconds: at high rates the word usually moves sooner than a sleep and
/// wake-up would take.
pub(crate) fn sleep(word: &AtomicU32, waiters: &AtomicU32, seq: u32, max: Duration) {
    if spin_until_changed(word, seq) {
        return;
    }
    // A waiter killed while asleep leaves the count one too high: wakers then make the
    // system call needlessly, which is harmless.
    waiters.fetch_add(1, Ordering::Relaxed);
    fence(Ordering::SeqCst);
    wait(word, seq, max);
    waiters.fetch_sub(1, Ordering::Relaxed);
}
