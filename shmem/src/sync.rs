//! The one facade for atomics and futex waits, so that loom can swap both: the ring
//! (`shm-ring`) and the drafter group (`collective`) take their atomics and their waits from
//! here, and their loom models run on the same model of a futex.
//!
//! Normally the atomics are `core`'s and a wait is a *shared* futex ([`futex_wait`]): waiters
//! and wakers live in different processes that map one segment at different addresses, and a
//! private futex is keyed by virtual address, so it would never see the other process's wake.
//!
//! Under `cfg(loom)` the atomics are loom's, and every futex word is modelled by one loom mutex
//! and condition variable: a waiter checks the word and sleeps while holding the mutex, and a
//! waker takes the mutex before it notifies, so no wake-up is lost between the check and the
//! sleep. The model waits WITHOUT a timeout: if a protocol relied on the timeout
//! ([`WAIT_SLICE`]) to make progress, loom would report a deadlock instead of passing.
//!
//! [`futex_wait`]: crate::futex_wait

use std::time::Duration;

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// The longest a waiter sleeps before it looks again: bounded so that waiters notice stop
/// requests, closed rings, dead peers and recovered slots even if a wake-up were lost.
pub const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Sleeps while `word` still holds `expected`, at most `timeout`.
///
/// Spurious returns are allowed: every caller re-checks its condition in a loop, and the
/// bounded timeout is what lets waiters notice stop requests and dead peers.
#[cfg(not(loom))]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    crate::futex_wait(word, expected, timeout);
}

/// Wakes every waiter sleeping on `word`, in any process.
#[cfg(not(loom))]
pub fn wake_all(word: &AtomicU32) {
    crate::futex_wake_all(word);
}

#[cfg(loom)]
loom::lazy_static! {
    static ref FUTEX: (loom::sync::Mutex<()>, loom::sync::Condvar) =
        (loom::sync::Mutex::new(()), loom::sync::Condvar::new());
}

/// The model of a futex wait (see the module doc): no timeout.
#[cfg(loom)]
pub fn wait(word: &AtomicU32, expected: u32, _timeout: Duration) {
    let guard = FUTEX.0.lock().unwrap();
    if word.load(Ordering::SeqCst) == expected {
        drop(FUTEX.1.wait(guard).unwrap());
    }
}

/// The model of a futex wake: every waiter on any word wakes and re-checks its own.
#[cfg(loom)]
pub fn wake_all(_word: &AtomicU32) {
    drop(FUTEX.0.lock().unwrap());
    FUTEX.1.notify_all();
}
