//! How a run is stopped, and how a worker says why it ended: a contract between the launcher,
//! the workers and the user (README, "Stopping a run").

/// The signals that ask for an ordered stop, in the launcher and in the workers alike: Ctrl-C,
/// `kill`, a closed terminal or dropped SSH session (SIGHUP), and Ctrl-\\ (SIGQUIT), as torchrun
/// treats them. A second one of any of them stops hard.
pub const STOP_SIGNALS: [std::ffi::c_int; 4] = {
    use rustix::process::Signal;
    [
        Signal::INT.as_raw(),
        Signal::TERM.as_raw(),
        Signal::HUP.as_raw(),
        Signal::QUIT.as_raw(),
    ]
};

/// Exit code of a worker that stopped on request before its part was complete (not a crash:
/// the launcher does not restart it).
pub const EXIT_STOPPED: i32 = 3;

/// What a worker the launcher started logs (an `ERROR` line, which the launcher quotes) when it
/// leaves the run on a stop signal the launcher did not send, then the signal and its sender
/// (`SIGTERM from pid 4242 (bash)`). It exits [`EXIT_STOPPED`] all the same: the launcher, which
/// did not ask it to stop, restarts it as after a crash.
pub const OUTSIDE_SIGNAL: &str = "stopped by a signal from outside the launcher: ";

/// Exit code of a worker stopped by a second stop signal.
pub const EXIT_SECOND_SIGNAL: i32 = 130;

#[cfg(test)]
mod tests {
    #[test]
    fn the_stop_signals_are_int_term_hup_quit() {
        // The numbers Linux gives them on every architecture hspipe builds for.
        assert_eq!(super::STOP_SIGNALS, [2, 15, 1, 3]);
    }
}
