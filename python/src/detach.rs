//! Blocking calls with the interpreter lock released: a ring or group wait is cut into attempts
//! of at most 100 ms, each run with the lock released, and between attempts the lock is taken
//! back to let Ctrl-C (`Python::check_signals`) and the launcher's stop through.

use pyo3::prelude::*;
use std::time::Duration;

/// At most this long with the lock released before Ctrl-C and stop requests are looked at.
pub const SLICE: Duration = Duration::from_millis(100);

/// A value used only by the thread that made it, moved into [`Python::detach`]'s closure.
/// The ring's handles (a `Consumer` is not `Sync`) cannot cross threads, and need not: `detach`
/// runs its closure on the calling thread.
struct SameThread<T>(T);

// SAFETY: `SameThread` is only made in `released`, which hands it to `Python::detach`; detach
// runs the closure synchronously on the calling thread and returns its result there, so the
// value never reaches another thread.
unsafe impl<T> Send for SameThread<T> {}

/// Runs `f` with the interpreter lock released, on this thread.
pub fn released<R>(py: Python<'_>, f: impl FnOnce() -> R) -> R {
    let f = SameThread(f);
    let r = py.detach(move || {
        let f = f;
        SameThread((f.0)())
    });
    r.0
}
