//! shm-ring-stat's command line on bad or awkward input: flags that cannot go together, output
//! that a reader stops reading, a ring that goes away while watched, and run directories that
//! hold no live ring. Each is an error naming what is wrong or a clean end, never a hang.

use std::time::Duration;

use clap::Parser;
use ring_stat::cli::{run, Args};
use shm_ring::Ring;
use testkit::watchdog;

use crate::common::{fifo, unique};

/// How long a command that should end is given before the test calls it a hang.
const HANG: Duration = Duration::from_secs(60);

fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
    Args::try_parse_from(std::iter::once("shm-ring-stat").chain(argv.iter().copied()))
}

/// `--list --gc` removed rings while the user asked for a list; `--gc --json` printed text (or
/// nothing) where JSON was asked for; `--watch`, `--interval` and `--run-dir` were ignored
/// beside `--list` and `--gc`. Each pair is refused, naming both flags.
#[test]
fn flags_that_cannot_go_together_are_refused_naming_both() {
    for argv in [
        &["--list", "--gc"][..],
        &["--list", "--watch", "1"],
        &["--list", "--interval", "2"],
        &["--list", "--run-dir", "runs/x"],
        &["--gc", "--json"],
        &["--gc", "--watch", "1"],
        &["--gc", "--interval", "2"],
        &["--gc", "--run-dir", "runs/x"],
        &["hspipe-x", "--run-dir", "runs/x"],
    ] {
        let err = parse(argv).expect_err(&format!("{argv:?} was accepted"));
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::ArgumentConflict,
            "{argv:?}: {err}"
        );
        let text = err.to_string();
        let flags: Vec<&str> = argv
            .iter()
            .copied()
            .filter(|a| a.starts_with("--"))
            .collect();
        assert!(
            flags.iter().all(|f| text.contains(f)) || argv[0] == "hspipe-x",
            "{argv:?}: {text}"
        );
    }
    // What goes together still does.
    for argv in [
        &["--list", "--json"][..],
        &["--gc", "hspipe-x"],
        &["hspipe-x", "--watch", "1", "--json"],
        &["--run-dir", "runs/x", "--interval", "2"],
    ] {
        parse(argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    }
}
