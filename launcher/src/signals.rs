//! The launcher's stop signals (`proto::stop::STOP_SIGNALS`: SIGINT, SIGTERM, SIGHUP,
//! SIGQUIT). Unlike a worker, the launcher must not exit from a handler even on the second
//! signal: it still has to kill the workers, write the summary and remove the ring. So the
//! signals are only counted, by a thread reading signal-hook's self-pipe, and the supervision
//! loop decides what each one means: the first stops in order, the second kills.
//!
//! What counts as a second request is [`Requests`]: the same signal sent again by the same
//! process within [`REPEAT`] is one request. coreutils' `timeout` sends its SIGTERM to the
//! launcher and then to its whole process group, the launcher again; counted twice, a run
//! under `timeout` was killed instead of stopped in order whenever the two arrived apart (seen
//! here in one run of ten on a loaded machine).

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::stop::STOP_SIGNALS;
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;

/// How long a repeat from the same sender is taken as the same request. coreutils' `timeout`
/// sends its two copies microseconds apart (the second is read later only when this thread is
/// kept off the CPU). A person escalating with Ctrl-C again (sent by the kernel: no sender), a
/// different signal, or `kill -9` is never held back; a shell's builtin `kill`, sent twice
/// within this from the same shell, is one request.
pub const REPEAT: Duration = Duration::from_secs(1);

/// Stop signals received so far, as requests ([`Requests`]).
#[derive(Clone)]
pub struct StopSignals {
    count: Arc<AtomicU32>,
    last: Arc<AtomicI32>,
}

impl StopSignals {
    /// Replaces the default actions of the stop signals (which would kill the launcher and leak
    /// its ring) with counting.
    pub fn install() -> std::io::Result<StopSignals> {
        let mut signals = SignalsInfo::<WithOrigin>::new(STOP_SIGNALS)?;
        let s = StopSignals {
            count: Arc::new(AtomicU32::new(0)),
            last: Arc::new(AtomicI32::new(0)),
        };
        let seen = s.clone();
        std::thread::Builder::new()
            .name("stop-signals".into())
            .spawn(move || {
                let mut requests = Requests::default();
                for origin in signals.forever() {
                    let sender = origin.process.map(|p| p.pid);
                    if requests.is_new(origin.signal, sender, Instant::now()) {
                        seen.last.store(origin.signal, Ordering::Relaxed);
                        seen.count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })?;
        Ok(s)
    }

    /// Stop requests so far: 0, 1 (stop in order) or more (kill).
    pub fn received(&self) -> u32 {
        self.count.load(Ordering::Relaxed)
    }

    /// The name of the latest signal, e.g. `SIGHUP`.
    pub fn last_name(&self) -> &'static str {
        signal_hook::low_level::signal_name(self.last.load(Ordering::Relaxed)).unwrap_or("a signal")
    }

    /// For a command that polls [`StopSignals::received`] between steps that may each be long
    /// (`launcher capture`, `launcher eval`: a forward of a large model): a second request ends
    /// the process at once, exit 131, after `cleanup` (which removes what the command wrote) and
    /// a line saying so. Without it the stop signals, made non-fatal by `install`, could no
    /// longer end the process before the step in hand ends.
    pub fn exit_on_second(
        &self,
        what: &'static str,
        cleanup: impl Fn() -> String + Send + 'static,
    ) {
        let seen = self.clone();
        let spawned = std::thread::Builder::new()
            .name("stop-second".into())
            .spawn(move || loop {
                if seen.received() >= 2 {
                    let left = cleanup();
                    // Not eprintln!: it panics if the terminal is gone.
                    use std::io::Write;
                    let _ = writeln!(
                        std::io::stderr(),
                        "{what} stopped at once by a second signal ({}){left}",
                        seen.last_name()
                    );
                    std::process::exit(crate::exit::KILLED);
                }
                std::thread::sleep(Duration::from_millis(20));
            });
        // Without the thread a second signal is only late: the first still stops the command.
        drop(spawned);
    }

    /// [`Interrupted`](crate::Interrupted) saying `what` was stopped, once a stop was asked for.
    pub fn check(&self, what: impl FnOnce() -> String) -> Result<(), crate::Interrupted> {
        if self.received() == 0 {
            return Ok(());
        }
        Err(crate::Interrupted(format!(
            "stopped by {} {}",
            self.last_name(),
            what()
        )))
    }
}

/// Which signals are new requests: all but a repeat of the previous one, the same signal from
/// the same process (a pid; the kernel's, a terminal's Ctrl-C, have none and always count)
/// within [`REPEAT`] of it.
#[derive(Default)]
pub struct Requests {
    last: Option<(i32, i32, Instant)>,
}

impl Requests {
    pub fn is_new(&mut self, signal: i32, sender: Option<i32>, at: Instant) -> bool {
        let repeat = matches!((self.last, sender),
            (Some((sig, pid, when)), Some(from))
                if sig == signal && pid == from && at.saturating_duration_since(when) <= REPEAT);
        if !repeat {
            self.last = sender.map(|pid| (signal, pid, at));
        }
        !repeat
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use signal_hook::consts::{SIGINT, SIGQUIT, SIGTERM};

    /// `timeout`'s SIGTERM twice (to the launcher, then to its group) is one request; the same
    /// signal from another process, a different signal, the terminal's key pressed again, or
    /// the same sender after [`REPEAT`] are second requests, the kill.
    #[test]
    fn a_repeat_from_the_same_sender_is_one_request_and_every_other_signal_a_new_one() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let timeout = Some(4242);

        let mut r = Requests::default();
        assert!(r.is_new(SIGTERM, timeout, t0));
        assert!(
            !r.is_new(SIGTERM, timeout, ms(1)),
            "timeout's copy to the group"
        );
        assert!(!r.is_new(SIGTERM, timeout, ms(900)));
        assert!(
            r.is_new(SIGTERM, Some(77), ms(1600)),
            "another process's kill"
        );

        let mut r = Requests::default();
        assert!(r.is_new(SIGTERM, timeout, t0));
        assert!(r.is_new(SIGQUIT, timeout, ms(1)), "another signal");

        let mut r = Requests::default();
        assert!(r.is_new(SIGTERM, timeout, t0));
        assert!(r.is_new(SIGTERM, timeout, t0 + REPEAT + Duration::from_millis(1)));

        // Ctrl-C twice: the kernel sends both, no sender to compare.
        let mut r = Requests::default();
        assert!(r.is_new(SIGINT, None, t0));
        assert!(r.is_new(SIGINT, None, ms(1)));
    }
}
