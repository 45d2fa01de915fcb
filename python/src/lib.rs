//! `hspipe`, the Python package: a user's own target or drafter (PyTorch, numpy) runs as an
//! hspipe worker. The launcher starts it from the config (`[target] command = ["python",
//! "my_target.py"]`); `hspipe.connect()` makes the same handshake as our workers
//! (`worker_runtime::connect`), attaches to the ring and registers, and returns a [`Target`] or
//! a [`Drafter`]. Everything after is our workers' code paths: the work table's claims and
//! `gather`, the batch layout's writer and checksum, take with verification, the ledger, the
//! group's collective, and the ring's telemetry by phase.
//!
//! Invariants (how each holds is in its module):
//! - A slot is never reused while a view of it lives (`view`): commit, release and give-back
//!   close a slot's views first, and refuse (naming the live ones) or defer while one lives.
//! - Memory behind a view is always mapped: the ring's handles are kept for the whole process.
//! - Every blocking call releases the interpreter lock in slices of at most 100 ms (`detach`),
//!   taking it back between slices for Ctrl-C and the launcher's stop.
//! - Python gets exceptions (`hspipe.HspipeError` and the standard ones), never a panic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;

use pyo3::prelude::*;
use shm_ring::{Ring, Role, WorkerName};
use worker_runtime::StopFlags;

mod args;
mod batch;
mod common;
mod detach;
mod dlpack;
mod drafter;
mod dropped;
mod group;
mod local;
mod slot;
mod target;
mod view;

use common::{err, Core, GroupChanged, HspipeError, Registered};

/// One worker per process: its ring handles are kept for the process's life.
static CONNECTED: AtomicBool = AtomicBool::new(false);

/// Connects this process, which the launcher started as a worker, to its run: the handshake
/// (the launcher's name for it, ring, run directory, GPU, config), the ring, the registration.
/// Returns a `Target` or a `Drafter`. Blocks (the interpreter lock released) for the
/// launcher's answer.
#[pyfunction]
fn connect(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let var = |name: &str| {
        std::env::var(name).map_err(|_| {
            err(format!(
                "{name} is not set: hspipe.connect() runs in a worker the launcher started, \
                 from the config's [target] or [drafter] command"
            ))
        })
    };
    let server = var(proto::control::ENV_CONTROL)?;
    let name: WorkerName = var(proto::control::ENV_WORKER)?.parse().map_err(err)?;
    // A child forked after connect() inherits the flag; its own connect() is refused too.
    local::same_process()?;
    if CONNECTED.swap(true, Ordering::SeqCst) {
        return Err(err(
            "this process is connected already: one worker per process",
        ));
    }
    worker_runtime::init_logging(&name.to_string());
    let stop = StopFlags::default();
    // On a thread of its own, waited for in slices: Ctrl-C gets through a handshake that
    // waits (up to its 30 s) for a launcher that does not answer.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(worker_runtime::connect(
            &server, name.role, name.index, stop,
        ));
    });
    let setup = loop {
        match detach::released(py, || rx.recv_timeout(detach::SLICE)) {
            Ok(setup) => break setup,
            // A KeyboardInterrupt raised here leaves this process connected (the handshake
            // may still complete): one worker per process, as before.
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(err("handshake with the launcher: its thread ended"))
            }
        }
    };
    let setup = setup.map_err(|e| {
        // Nothing was registered: a later call may try again.
        CONNECTED.store(false, Ordering::SeqCst);
        err(format!("handshake with the launcher: {e}"))
    })?;
    // From here on, the worker and everything of it are this process's (`local`).
    local::connected();
    let setup = Box::leak(Box::new(setup));
    let ring = Ring::attach(&setup.ring)
        .map_err(|e| err(format!("attaching to ring {}: {e}", setup.ring)))?;
    // Kept for the process: slots borrow these handles, and views point into the mapping.
    let ring: &'static Ring = Box::leak(Box::new(ring));
    match name.role {
        Role::Producer => {
            let producer = ring
                .producer(name.index)
                .map_err(|e| err(format!("registering as {name}: {e}")))?;
            let producer = Box::leak(Box::new(producer));
            producer.set_gpu(setup.gpu);
            let core = Core {
                setup,
                ring,
                reg: Registered::Producer(producer),
                closed: Default::default(),
            };
            let t = target::TargetCore::new(core, producer).map_err(err)?;
            tracing::info!(ring = %setup.ring, epoch = producer.epoch(), "attached");
            Ok(Py::new(py, target::Target::new(t))?.into_any())
        }
        Role::Consumer => {
            let (grad, state) = gpu::drafter_sizes(setup.backend, &setup.config).map_err(err)?;
            let group_name = proto::group_segment(&setup.ring);
            let c = collective::attach(&group_name, name.index)
                .map_err(|e| err(format!("attaching to the drafter group {group_name}: {e}")))?;
            // One rank per drafter, as the ring has one consumer per drafter.
            let ranks = ring.params().consumers;
            let group = group::Group::new(c, gpu::StepBuffer::len_for(grad), state, ranks);
            let consumer = ring
                .consumer(name.index)
                .map_err(|e| err(format!("registering as {name}: {e}")))?;
            let consumer = Box::leak(Box::new(consumer));
            consumer.set_gpu(setup.gpu);
            let core = Core {
                setup,
                ring,
                reg: Registered::Consumer(consumer),
                closed: Default::default(),
            };
            let d = drafter::DrafterCore::new(core, consumer, group).map_err(err)?;
            tracing::info!(ring = %setup.ring, epoch = consumer.epoch(), "attached");
            Ok(Py::new(py, drafter::Drafter::new(d))?.into_any())
        }
    }
}

/// Gives back, on this thread, what other threads let go of of this thread's worker (batches,
/// slots, claims: `local`). The worker's calls do it; `hspipe/__init__.py` registers it with
/// `atexit`, so the interpreter's exit does it too (on the main thread, the usual worker's).
#[pyfunction]
fn _bring_home() {
    local::bring_home();
}

/// The native half of the package (`hspipe._hspipe`); `hspipe/__init__.py` re-exports it, and
/// `hspipe/dist.py` (torch.distributed) is Python on top of it.
#[pymodule]
fn _hspipe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(connect, m)?)?;
    m.add_function(wrap_pyfunction!(_bring_home, m)?)?;
    m.add("HspipeError", m.py().get_type::<HspipeError>())?;
    m.add("GroupChanged", m.py().get_type::<GroupChanged>())?;
    m.add_class::<target::Target>()?;
    m.add_class::<target::Claim>()?;
    m.add_class::<slot::Slot>()?;
    m.add_class::<drafter::Drafter>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<view::View>()?;
    m.add_class::<group::Reduced>()?;
    m.add_class::<common::PhaseScope>()?;
    m.add_class::<common::Heartbeat>()?;
    Ok(())
}
