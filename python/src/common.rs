//! What both kinds of Python worker share: the connection (the launcher's handshake, through
//! `worker_runtime::connect`), the ring, telemetry by phase, and the waiting loop.
//!
//! Length: just past 500 lines: the methods both workers' classes get (`worker_methods!`, with
//! their docstrings, which are Python's `help()`) are generated from here, beside the state
//! they read.

use std::cell::Cell;

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use shm_ring::{Consumer, Phase, Producer, Ring};
use worker_runtime::Setup;

use crate::detach::{released, SLICE};
use crate::local::Local;

pyo3::create_exception!(
    hspipe,
    HspipeError,
    PyRuntimeError,
    "An hspipe operation failed: the ring, the group, a ledger, or a batch's content."
);

pyo3::create_exception!(
    hspipe,
    GroupChanged,
    HspipeError,
    "The drafter group's membership changed (a rank died or joined) before a round within one \
     epoch committed: nothing was committed; exchange again among the new members."
);

/// An hspipe error as a Python exception, with its whole chain of causes.
pub fn err(e: impl std::fmt::Display) -> PyErr {
    HspipeError::new_err(e.to_string())
}

/// A worker's registration in the ring, either role.
#[derive(Clone, Copy)]
pub enum Registered {
    Producer(&'static Producer<'static>),
    Consumer(&'static Consumer<'static>),
}

impl Registered {
    pub fn enter(self, phase: Phase) -> Option<Phase> {
        match self {
            Registered::Producer(p) => p.enter(phase),
            Registered::Consumer(c) => {
                // The group's reduction is not the batch's doing: a death in it (a timeout, a
                // lost peer) is not held against the batch in hand (see `drafter.rs`).
                if phase == Phase::Sync {
                    c.set_in_hand(None);
                }
                c.enter(phase)
            }
        }
    }
    pub fn heartbeat(self) {
        match self {
            Registered::Producer(p) => p.heartbeat(),
            Registered::Consumer(c) => c.heartbeat(),
        }
    }
    pub fn beat(self) -> shm_ring::Beat<'static> {
        match self {
            Registered::Producer(p) => p.beat(),
            Registered::Consumer(c) => c.beat(),
        }
    }
    fn set_in_hand(self, batch: Option<u64>) {
        match self {
            Registered::Producer(p) => p.set_in_hand(batch),
            Registered::Consumer(c) => c.set_in_hand(batch),
        }
    }
}

/// Whether `exception` is a `SystemExit` with code None or 0: the process ends cleanly.
pub fn clean_exit(exception: Option<&Bound<'_, PyAny>>) -> bool {
    use pyo3::exceptions::PySystemExit;
    let Some(e) = exception.filter(|e| e.is_instance_of::<PySystemExit>()) else {
        return false;
    };
    let code = e.getattr("code").ok();
    code.is_none_or(|c| c.is_none() || c.extract::<i64>().is_ok_and(|c| c == 0))
}

/// The batch a Python worker says it has in hand (`set_in_hand`, which the launcher holds a
/// death against): the last one taken or claimed, until that one is let go (so letting go of an
/// older one leaves a newer one's mark). An exception that drops it leaves it said.
pub struct InHand {
    reg: Registered,
    batch: Cell<Option<u64>>,
}

impl InHand {
    pub fn new(reg: Registered) -> InHand {
        InHand {
            reg,
            batch: Cell::new(None),
        }
    }

    /// `batch` is in hand now.
    pub fn hold(&self, batch: u64) {
        self.batch.set(Some(batch));
        self.reg.set_in_hand(Some(batch));
    }

    /// None is in hand (whose an error would be is not known).
    pub fn clear(&self) {
        self.batch.set(None);
        self.reg.set_in_hand(None);
    }

    /// `batch` is done with (released, committed, aborted); if it was the one in hand, none is.
    pub fn let_go(&self, batch: u64) {
        if self.batch.get() == Some(batch) {
            self.batch.set(None);
            self.reg.set_in_hand(None);
        }
    }
}

/// The connected worker: its Welcome and its ring, both kept for the whole process (slots
/// borrow the ring's handles, and views point into its mapping, which must never go away while
/// an export may live).
pub struct Core {
    pub setup: &'static Setup,
    pub ring: &'static Ring,
    pub reg: Registered,
    /// The launcher was told this worker's report (close() ran).
    pub closed: Cell<bool>,
}

impl Core {
    /// Waits with `attempt` (given at most [`SLICE`] each time, the interpreter lock released)
    /// until it answers, raising on Ctrl-C (or any signal handler's exception), after
    /// `timeout` seconds (`TimeoutError`; one past what a clock counts waits as None does), or,
    /// when `stop_ends` is set and a stop was asked for, returning None.
    pub fn wait<T>(
        &self,
        py: Python<'_>,
        what: &str,
        timeout: Option<f64>,
        stop_ends: bool,
        mut attempt: impl FnMut(std::time::Duration) -> PyResult<Option<T>>,
    ) -> PyResult<Option<T>> {
        let deadline = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(PyValueError::new_err(format!(
                    "{what}: timeout must be a number of seconds (0 or more), got {t}"
                )))
            }
            // Longer than any clock counts (1e300 s): no deadline, as for None.
            Some(t) => std::time::Duration::try_from_secs_f64(t)
                .ok()
                .and_then(|t| std::time::Instant::now().checked_add(t)),
            None => None,
        };
        loop {
            if stop_ends && self.setup.stop.stopping() {
                return Ok(None);
            }
            let slice = deadline.map_or(SLICE, |d| {
                d.saturating_duration_since(std::time::Instant::now())
                    .min(SLICE)
            });
            if let Some(x) = released(py, || attempt(slice))? {
                return Ok(Some(x));
            }
            py.check_signals()?;
            // What another thread let go of meanwhile may be what this wait waits for (a
            // target's own claim, a drafter's one batch): given back now.
            crate::local::bring_home();
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "{what}: nothing after {:.3} s",
                    timeout.unwrap_or(0.0)
                )));
            }
        }
    }

    /// At close: waits up to `wait` seconds (none by default) for the batches dropped while
    /// viewed to be given back (`pending` sweeps and counts them); raises while any remains.
    pub fn wait_deferred(
        &self,
        py: Python<'_>,
        wait: Option<f64>,
        pending: impl Fn() -> usize,
    ) -> PyResult<()> {
        if pending() == 0 {
            return Ok(());
        }
        let waited = self.wait(py, "close", wait.or(Some(0.0)), false, |slice| {
            if pending() == 0 {
                return Ok(Some(()));
            }
            std::thread::sleep(slice.min(std::time::Duration::from_millis(5)));
            Ok(None)
        });
        match waited {
            Ok(_) => Ok(()),
            Err(_) => Err(err(format!(
                "close: {} dropped batch(es) still have live views; let them go first",
                pending()
            ))),
        }
    }

    /// The worker is done: closed, and the launcher has its report.
    pub fn report(&self, report: proto::control::FinalReport) {
        self.closed.set(true);
        tracing::info!(
            items = report.items,
            tokens = report.tokens,
            complete = report.complete,
            "finished"
        );
        if let Some(tx) = &self.setup.to_launcher {
            let _ = tx.send(proto::control::ToLauncher::Report(report));
        }
    }

    pub fn phase(&self, name: &str) -> PyResult<Phase> {
        let wait = match self.reg {
            Registered::Producer(_) => Phase::WaitFull,
            Registered::Consumer(_) => Phase::WaitEmpty,
        };
        Ok(match name {
            "wait" => wait,
            "load" => Phase::Load,
            "copy" | "copy_in" => Phase::CopyIn,
            "compute" => Phase::Compute,
            "sync" => Phase::Sync,
            "checkpoint" => Phase::Checkpoint,
            "other" => Phase::Other,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "no phase {name:?}: wait, load, copy, compute, sync, checkpoint or other"
                )))
            }
        })
    }

    pub fn check_open(&self) -> PyResult<()> {
        if self.closed.get() {
            return Err(err(format!("{} is closed", self.setup.name)));
        }
        Ok(())
    }
}

/// Time inside `with w.phase("compute"):` counts as that phase in the ring's telemetry (what
/// `shm-ring-stat`, the screen and the verdict read); the phase before it resumes afterwards.
/// Its worker's thread's, as the worker.
#[pyclass(module = "hspipe")]
pub struct PhaseScope {
    scope: Local<Scope>,
}

struct Scope {
    reg: Registered,
    phase: Phase,
    before: Option<Phase>,
}

impl PhaseScope {
    pub fn new(reg: Registered, phase: Phase) -> PhaseScope {
        let scope = Scope {
            reg,
            phase,
            before: None,
        };
        PhaseScope {
            scope: Local::new("hspipe.PhaseScope", scope),
        }
    }
}

#[pymethods]
impl PhaseScope {
    fn __enter__(mut slf: PyRefMut<'_, Self>) -> PyResult<PyRefMut<'_, Self>> {
        let s = slf.scope.get_mut()?;
        s.before = s.reg.enter(s.phase);
        Ok(slf)
    }
    fn __exit__(
        &mut self,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let s = self.scope.get_mut()?;
        s.reg.enter(s.before.take().unwrap_or(Phase::Other));
        Ok(false)
    }
}

/// `beat = w.heartbeat_handle()`: `beat()` marks the worker alive, from any thread (what
/// changes a worker or its batches is the worker's thread's; a call from another raises).
#[pyclass(frozen, module = "hspipe")]
pub struct Heartbeat {
    beat: shm_ring::Beat<'static>,
}

impl Heartbeat {
    pub fn new(beat: shm_ring::Beat<'static>) -> Heartbeat {
        Heartbeat { beat }
    }
}

#[pymethods]
impl Heartbeat {
    fn __call__(&self) -> PyResult<()> {
        crate::local::same_process()?;
        self.beat.heartbeat();
        Ok(())
    }
}

/// The effective config, as Python dicts and lists (through JSON).
pub fn config<'py>(setup: &Setup, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
    let json = serde_json::to_string(&setup.config).map_err(err)?;
    py.import("json")?.call_method1("loads", (json,))
}

/// What of a worker any thread may read: its Welcome, its ring and its heartbeat.
pub struct Shared {
    pub setup: &'static Setup,
    pub ring: &'static Ring,
    pub beat: shm_ring::Beat<'static>,
}

impl Shared {
    pub fn of(core: &Core) -> Shared {
        Shared {
            setup: core.setup,
            ring: core.ring,
            beat: core.reg.beat(),
        }
    }
}

/// The common attributes of both workers (`name`, `role`, `index`, `gpu`, `config`, ...),
/// generated into each worker's methods: those of `self.shared` from any thread, those of
/// `self.core()` from the worker's.
macro_rules! worker_methods {
    ($t:ty) => {
        #[pyo3::pymethods]
        impl $t {
            /// The worker's name (`target-0`, `drafter-2`): its log, ledger and telemetry name.
            #[getter]
            fn name(&self) -> String {
                self.shared.setup.name.to_string()
            }
            /// `"target"` or `"drafter"`.
            #[getter]
            fn role(&self) -> &'static str {
                match self.shared.setup.name.role {
                    shm_ring::Role::Producer => "target",
                    shm_ring::Role::Consumer => "drafter",
                }
            }
            /// This worker's index among its kind (a drafter's rank in the group).
            #[getter]
            fn index(&self) -> u32 {
                self.shared.setup.index
            }
            /// The GPU the launcher gave this worker (also in `CUDA_VISIBLE_DEVICES`, so the
            /// process sees it as device 0).
            #[getter]
            fn gpu(&self) -> Option<u32> {
                self.shared.setup.gpu
            }
            /// The run's effective config (every field, defaults filled), as a dict.
            #[getter]
            fn config<'py>(
                &self,
                py: pyo3::Python<'py>,
            ) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::PyAny>> {
                $crate::common::config(self.shared.setup, py)
            }
            /// The run directory (absolute): its logs, ledgers, checkpoints; a drafter of your
            /// own saves its model here.
            #[getter]
            fn run_dir(&self) -> std::path::PathBuf {
                self.shared.setup.run_dir.path().to_path_buf()
            }
            /// The ring's name (its shared-memory segment, `shm-ring-stat`'s argument).
            #[getter]
            fn ring(&self) -> &str {
                self.shared.ring.name()
            }
            /// The backend the launcher was asked for (`mock`, `candle`, ...).
            #[getter]
            fn backend(&self) -> String {
                self.shared.setup.backend.to_string()
            }
            /// True once a stop was asked for (the launcher's stop, or it went away).
            #[getter]
            fn stopping(&self) -> pyo3::PyResult<bool> {
                $crate::local::same_process()?;
                Ok(self.shared.setup.stop.stopping())
            }
            /// Tells the launcher this worker is alive (ring operations and phases do too);
            /// call it in work that runs longer than the launcher's hang timeout. Any thread
            /// may (not a forked child).
            fn heartbeat(&self) -> pyo3::PyResult<()> {
                $crate::local::same_process()?;
                self.shared.beat.heartbeat();
                Ok(())
            }
            /// `beat = w.heartbeat_handle()`: `beat()` is `w.heartbeat()`, from any thread (a
            /// thread that beats while long work runs), kept apart from the worker.
            fn heartbeat_handle(&self) -> pyo3::PyResult<$crate::common::Heartbeat> {
                $crate::local::same_process()?;
                Ok($crate::common::Heartbeat::new(self.shared.beat))
            }
            /// `with w.phase("compute"):` times the block as that phase: `wait`, `load`,
            /// `copy`, `compute`, `sync`, `checkpoint` or `other`.
            fn phase(&self, name: &str) -> pyo3::PyResult<$crate::common::PhaseScope> {
                let core = self.core()?;
                let p = core.phase(name)?;
                Ok($crate::common::PhaseScope::new(core.reg, p))
            }
            fn __enter__(slf: pyo3::PyRef<'_, Self>) -> pyo3::PyRef<'_, Self> {
                slf
            }
            fn __exit__(
                &self,
                py: pyo3::Python<'_>,
                ty: Option<pyo3::Bound<'_, pyo3::PyAny>>,
                _value: Option<pyo3::Bound<'_, pyo3::PyAny>>,
                _tb: Option<pyo3::Bound<'_, pyo3::PyAny>>,
            ) -> pyo3::PyResult<bool> {
                // Leaving on an exception still tells the launcher what was done, but does
                // not finish a target (its restart has work to do); the exception goes on (and
                // the process exits non-zero: a crash, restarted). `sys.exit()` or
                // `sys.exit(0)` is a clean exit, which finishes. A forked child leaving the
                // parent's `with` has nothing to close: the worker is the parent's.
                if $crate::local::forked_from().is_some() {
                    return Ok(false);
                }
                if !self.core()?.closed.get() {
                    let failing = ty.is_some() && !$crate::common::clean_exit(_value.as_ref());
                    let r = self.close_inner(py, None, failing);
                    if ty.is_none() {
                        r?;
                    }
                }
                Ok(false)
            }
            fn __repr__(&self) -> String {
                format!(
                    "<hspipe worker {} on ring {}>",
                    self.shared.setup.name,
                    self.shared.ring.name()
                )
            }
        }
    };
}
pub(crate) use worker_methods;

/// Closes a slot's views before it is committed or released (`what`: "commit batch 3"): at
/// once, or, with `wait`, once every export is let go within that many seconds. With a view
/// still alive it raises, naming them, and the slot stays this worker's.
pub fn close_views(
    core: &Core,
    py: Python<'_>,
    exports: &crate::view::Exports,
    what: &str,
    wait: Option<f64>,
) -> PyResult<()> {
    let live = match exports.try_close() {
        Ok(()) => return Ok(()),
        Err(live) => live,
    };
    let refuse = |live: Vec<String>| {
        err(format!(
            "{what}: views of it are still alive: {}; let them go first (del the arrays or \
             tensors), or pass wait=SECONDS to wait for another thread to",
            live.join(", ")
        ))
    };
    if wait.is_none() {
        return Err(refuse(live));
    }
    let waited = core.wait(py, what, wait, false, |slice| {
        if exports.try_close().is_ok() {
            return Ok(Some(()));
        }
        std::thread::sleep(slice.min(std::time::Duration::from_millis(5)));
        Ok(None)
    });
    match waited {
        Ok(_) => Ok(()),
        Err(e) if e.is_instance_of::<PyTimeoutError>(py) => match exports.try_close() {
            Ok(()) => Ok(()),
            Err(live) => Err(refuse(live)),
        },
        Err(e) => Err(e),
    }
}
