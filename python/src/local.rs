//! What of a Python object only its worker's thread may touch, and what becomes of it when the
//! object is let go of on another thread.
//!
//! A worker, its claims, slots and batches hold the ring's handles (not `Sync`) and the
//! worker's `Rc`-shared state (`RefCell`s): only the thread that made them may use or drop
//! them. Python, though, lets go of an object on whatever thread drops its last reference: a
//! pool's or a DataLoader's thread, or the garbage collector wherever it runs. pyo3 cannot run
//! the Drop of an `unsendable` class there and leaks the object, so a batch or a slot dropped on
//! another thread kept its ring slot for the life of the process. Our classes are therefore
//! plain (Send and Sync) classes whose thread-bound part is a [`Local`]:
//!
//! - On its owner's thread, [`Local::get`] gives the value; on another, an `HspipeError`
//!   saying whose it is (pyo3's own check panicked, a `PanicException`).
//! - Dropped on its owner's thread, the value is dropped at once (its Drop gives a batch or slot
//!   back, as before). Dropped on another, the value is moved, untouched, into the strays, a
//!   process-wide list; [`bring_home`], run by the owner at its next call into the ring (every
//!   sweep, every wait's slice, close, and the interpreter's exit), drops it there, which gives
//!   it back as if it had been dropped there. A stray never runs any code off its thread: it is
//!   moved, as bytes, never used.
//!
//! The objects' plain data (ids, lengths, the worker's name and config) and their views live
//! outside the `Local`, so any thread may read them. A worker made on a thread that ended
//! before its strays were brought home leaves them held: the launcher's recovery settles them
//! when the process ends, as for any held slot.
//!
//! A forked child inherits all of it, thread id included, but the connection is its parent's:
//! a child that took a batch in the parent's name left it held for ever, and its empty rounds
//! and heartbeats kept the launcher from seeing anything wrong. So `connect()` records its pid
//! ([`connected`]), and [`same_process`] refuses every call from another process: `Local::get`
//! and the calls outside a `Local` that touch the ring, the group or the launcher (a heartbeat,
//! a view's export). A `Local` dropped in a child is leaked, never dropped (its Drop would give
//! the parent's slot back), and the child brings no strays home.

use std::any::Any;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread::{self, ThreadId};

use pyo3::PyResult;

use crate::common::err;

/// The pid of the process that connected the worker (0 before `connect()`).
static CONNECTED_PID: AtomicU32 = AtomicU32::new(0);

/// `connect()` made this process's worker.
pub fn connected() {
    CONNECTED_PID.store(std::process::id(), Ordering::Relaxed);
}

/// The pid that connected, if this process is another one: a child forked after `connect()`.
pub fn forked_from() -> Option<u32> {
    let owner = CONNECTED_PID.load(Ordering::Relaxed);
    (owner != 0 && owner != std::process::id()).then_some(owner)
}

/// An error in a child forked after `connect()`: the worker and everything of it belong to
/// the process that connected.
pub fn same_process() -> PyResult<()> {
    match forked_from() {
        None => Ok(()),
        Some(owner) => Err(err(format!(
            "this worker's connection belongs to pid {owner}; a forked child (pid {}) cannot use \
             it: its ring, group and launcher connection are the parent's, so a batch taken or a \
             heartbeat sent here would be the parent's (start such processes with \
             multiprocessing's \"spawn\" or \"forkserver\", and hand them copies of the data)",
            std::process::id()
        ))),
    }
}

/// A value only the thread that made it may use or drop; any thread may hold it and let it go.
pub struct Local<T: 'static> {
    owner: ThreadId,
    /// What the value is part of, for the error (`hspipe.Batch`).
    what: &'static str,
    /// Taken only by Drop.
    value: Option<T>,
}

// SAFETY: a `Local` hands its value out only on its owner's thread (`get`, `get_mut` check the
// thread first and touch nothing else otherwise), and drops it only there: on another thread,
// Drop moves it, untouched, to the strays, which `bring_home` drops on the owner's thread. So
// no code of `T` ever runs off its thread, whichever thread holds or drops the `Local`; moving
// `T`'s bytes (an `Rc`'s pointer, a slot's handle) changes nothing they point to.
unsafe impl<T: 'static> Send for Local<T> {}
// SAFETY: as for Send: a `&Local` on another thread reads only `owner` and `what`.
unsafe impl<T: 'static> Sync for Local<T> {}

impl<T: 'static> Local<T> {
    /// `value`, owned by this thread; `what` names it in errors (`hspipe.Batch`).
    pub fn new(what: &'static str, value: T) -> Local<T> {
        Local {
            owner: thread::current().id(),
            what,
            value: Some(value),
        }
    }

    fn here(&self) -> PyResult<()> {
        same_process()?;
        if thread::current().id() == self.owner {
            return Ok(());
        }
        Err(err(format!(
            "{}: called from another thread: a worker, its claims, slots and batches are used \
             from the thread that connected it (their data and views may be read from any \
             thread, any thread may let go of them, and w.heartbeat_handle() beats from any)",
            self.what
        )))
    }

    /// The value, on its owner's thread; an error on another.
    pub fn get(&self) -> PyResult<&T> {
        self.here()?;
        Ok(self.value.as_ref().expect("taken only by Drop"))
    }

    /// The value, mutably, on its owner's thread; an error on another.
    pub fn get_mut(&mut self) -> PyResult<&mut T> {
        self.here()?;
        Ok(self.value.as_mut().expect("taken only by Drop"))
    }
}

impl<T: 'static> Drop for Local<T> {
    fn drop(&mut self) {
        let Some(value) = self.value.take() else {
            return;
        };
        if forked_from().is_some() {
            // The parent's: its Drop would give the parent's slot or claim back from here.
            std::mem::forget(value);
        } else if thread::current().id() == self.owner {
            drop(value);
        } else {
            let stray = Stray {
                owner: self.owner,
                _value: Box::new(value),
            };
            strays().push(stray);
        }
    }
}

/// A value let go of off its thread, waiting for that thread.
struct Stray {
    owner: ThreadId,
    /// Dropped only by `bring_home`, on `owner`.
    _value: Box<dyn Any>,
}

// SAFETY: a stray's value is never used, only moved, and dropped by `bring_home` on its owner's
// thread (the static list is never dropped): see `Local`'s Send.
unsafe impl Send for Stray {}

static STRAYS: Mutex<Vec<Stray>> = Mutex::new(Vec::new());

fn strays() -> std::sync::MutexGuard<'static, Vec<Stray>> {
    // Nothing panics while it is held (a push, a partition): a poisoned list is whole.
    STRAYS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Drops, here, the values of this thread that other threads let go of: a batch goes back to
/// its drafter, a slot or a claim to its target (their Drops). Call it with no `RefCell` of a
/// worker borrowed: those Drops borrow them.
pub fn bring_home() {
    // A forked child's strays are copies of its parent's: never dropped here.
    if forked_from().is_some() {
        return;
    }
    let here = thread::current().id();
    let mine: Vec<Stray> = {
        let mut all = strays();
        if !all.iter().any(|s| s.owner == here) {
            return;
        }
        let (mine, others) = std::mem::take(&mut *all)
            .into_iter()
            .partition(|s| s.owner == here);
        *all = others;
        mine
    };
    // Outside the lock: their Drops may let go of more (and come back here).
    drop(mine);
}
