//! The launcher's stop signals (`proto::stop::STOP_SIGNALS`: SIGINT, SIGTERM, SIGHUP,
//! SIGQUIT). Unlike a worker, the launcher must not exit from a handler even on the second
//! signal: it still has to kill the workers, write the summary and remove the ring. So the
//! signals are only counted, by a thread reading signal-hook's self-pipe, and the supervision
//! loop decides what each one means: the first stops in order, the second kills.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;

use proto::stop::STOP_SIGNALS;

/// Stop signals received so far.
#[derive(Clone)]
pub struct StopSignals {
    count: Arc<AtomicU32>,
    last: Arc<AtomicI32>,
}

impl StopSignals {
    /// Replaces the default actions of the stop signals (which would kill the launcher and leak
    /// its ring) with counting.
    pub fn install() -> std::io::Result<StopSignals> {
        let mut signals = signal_hook::iterator::Signals::new(STOP_SIGNALS)?;
        let s = StopSignals {
            count: Arc::new(AtomicU32::new(0)),
            last: Arc::new(AtomicI32::new(0)),
        };
        let seen = s.clone();
        std::thread::Builder::new()
            .name("stop-signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    seen.last.store(sig, Ordering::Relaxed);
                    seen.count.fetch_add(1, Ordering::Relaxed);
                }
            })?;
        Ok(s)
    }

    pub fn received(&self) -> u32 {
        self.count.load(Ordering::Relaxed)
    }

    /// The name of the latest signal, e.g. `SIGHUP`.
    pub fn last_name(&self) -> &'static str {
        signal_hook::low_level::signal_name(self.last.load(Ordering::Relaxed)).unwrap_or("a signal")
    }
}
