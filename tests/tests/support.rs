//! Process helpers: children that are killed when a test fails, and watchdogs against hangs.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A unique ring name for this test process.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "hspipe-it-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// How long any child may run before the test calls it hung.
pub const WATCHDOG: Duration = Duration::from_secs(120);

/// A child process that is SIGKILLed and reaped if the test ends early.
pub struct Proc {
    pub child: Child,
    pub what: String,
    out: Option<BufReader<ChildStdout>>,
    /// Stdout lines read by `line_starting` that did not match.
    before: String,
}

pub fn ring_peer(args: &[&str]) -> Proc {
    let what = format!("ring-peer {}", args.join(" "));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ring-peer"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
    let out = child.stdout.take().map(BufReader::new);
    Proc {
        child,
        what,
        out,
        before: String::new(),
    }
}

impl Proc {
    /// Reads the child's stdout until a line starting with `prefix` and returns that line;
    /// lines before it are kept for `finish`/`kill`. Bounded by the child: a child that never
    /// prints it exits or is killed by the test's other assertions.
    pub fn line_starting(&mut self, prefix: &str) -> String {
        loop {
            let mut s = String::new();
            let n = self
                .out
                .as_mut()
                .expect("stdout")
                .read_line(&mut s)
                .unwrap();
            assert!(n > 0, "{} ended without printing {prefix:?}", self.what);
            if s.starts_with(prefix) {
                return s.trim_end().to_string();
            }
            self.before.push_str(&s);
        }
    }

    /// Waits for exit, at most `WATCHDOG`; returns stdout. Panics (after killing the child) if
    /// it hangs or fails.
    pub fn finish(mut self) -> String {
        let deadline = Instant::now() + WATCHDOG;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut s = std::mem::take(&mut self.before);
                if let Some(o) = self.out.as_mut() {
                    o.read_to_string(&mut s).unwrap();
                }
                assert!(status.success(), "{} failed: {status}", self.what);
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("{} hung for {WATCHDOG:?}", self.what);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the child and reaps it, as a crash would end it. Returns what it printed.
    pub fn kill(mut self) -> String {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let mut s = std::mem::take(&mut self.before);
        if let Some(o) = self.out.as_mut() {
            o.read_to_string(&mut s).unwrap();
        }
        s
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Parses consumers' `got <batch_id> <delivery>` lines.
pub fn parse_got(out: &str) -> Vec<(u64, u32)> {
    out.lines()
        .filter_map(|l| {
            let mut it = l.strip_prefix("got ")?.split(' ');
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect()
}
