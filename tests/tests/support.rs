//! Process helpers: children that are killed when a test fails, and watchdogs against hangs.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, Stdio};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

pub use testkit::unique;

/// A test's directory under the system temp dir: removed when the test passes, kept to look at
/// when it fails.
pub struct TestDir(pub PathBuf);

impl TestDir {
    pub fn new(tag: &str) -> TestDir {
        let d = std::env::temp_dir().join(unique(tag));
        std::fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl std::ops::Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Every launcher removes, at start, the segments of this user whose creator is dead. A test
/// that leaves a segment stale on purpose and then looks at it holds this exclusively
/// (`stale_segments_exclusive`); every test that starts a launcher holds it shared
/// (`stale_segments_shared`), for as long as its launchers may start.
static STALE_SEGMENTS: RwLock<()> = RwLock::new(());

pub fn stale_segments_shared() -> RwLockReadGuard<'static, ()> {
    // A test that failed while holding it poisons it; the lock itself is still good.
    STALE_SEGMENTS
        .read()
        .unwrap_or_else(PoisonError::into_inner)
}

pub fn stale_segments_exclusive() -> RwLockWriteGuard<'static, ()> {
    STALE_SEGMENTS
        .write()
        .unwrap_or_else(PoisonError::into_inner)
}

/// How long any child may run before the test calls it hung.
pub const WATCHDOG: Duration = Duration::from_secs(120);

/// Path of a binary of another workspace crate, in the directory above this test binary's
/// `deps/`. `cargo test` does not build other crates' binaries, so `scripts/test.sh` (the
/// README's test command) runs `cargo build --workspace --bins` first.
pub fn workspace_bin(name: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run scripts/test.sh, or `cargo build --workspace --bins` first",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

/// A child process that is SIGKILLed and reaped if the test ends early.
pub struct Proc {
    pub child: Child,
    pub what: String,
    out: Option<BufReader<ChildStdout>>,
    /// The child's stderr when the test reads it nowhere (`spawn_unread_stderr`).
    err_pipe: Option<ChildStderr>,
    /// The child's stderr, collected by a thread, shown when the child fails.
    err: std::sync::Arc<std::sync::Mutex<String>>,
    err_thread: Option<std::thread::JoinHandle<()>>,
    /// Stdout lines read by `line_starting` that did not match.
    before: String,
    /// How long a wait may take before the child counts as hung (`WATCHDOG` unless set).
    watchdog: Duration,
}

pub fn ring_peer(args: &[&str]) -> Proc {
    spawn(env!("CARGO_BIN_EXE_ring-peer"), args)
}

/// Spawns `bin` with its stdout piped, and its stderr piped to a thread that collects it.
pub fn spawn(bin: &str, args: &[&str]) -> Proc {
    spawn_with(bin, args, true, &[])
}

/// [`spawn`] with `env` added to the child's environment.
pub fn spawn_env(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    spawn_with(bin, args, true, env)
}

/// Spawns `bin` with stdout and stderr piped; stderr is left unread until `close_output`.
pub fn spawn_unread_stderr(bin: &str, args: &[&str]) -> Proc {
    spawn_with(bin, args, false, &[])
}

fn spawn_with(bin: &str, args: &[&str], collect_stderr: bool, env: &[(&str, &str)]) -> Proc {
    let short = std::path::Path::new(bin)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let what = format!("{short} {}", args.join(" "));
    let mut child = Command::new(bin)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
    let out = child.stdout.take().map(BufReader::new);
    let err = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let err_pipe = if collect_stderr {
        None
    } else {
        child.stderr.take()
    };
    let err_thread = child.stderr.take().map(|mut stderr| {
        let err = err.clone();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            err.lock().unwrap().push_str(&s);
        })
    });
    Proc {
        child,
        what,
        out,
        err_pipe,
        err,
        err_thread,
        before: String::new(),
        watchdog: WATCHDOG,
    }
}

impl Proc {
    /// A longer watchdog, for a child that does real work for minutes (the README's DFlash
    /// demo): still a hang check, never a speed assertion.
    pub fn watchdog(mut self, d: Duration) -> Proc {
        self.watchdog = d;
        self
    }

    /// Closes the read ends of the child's stdout and stderr, as a closed terminal or a reader
    /// that went away would: the child's next write to either fails (EPIPE).
    pub fn close_output(&mut self) {
        self.out = None;
        self.err_pipe = None;
    }

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

    /// Waits for exit, at most the watchdog; returns stdout. Panics (after killing the child) if
    /// it hangs or fails.
    pub fn finish(self) -> String {
        let (status, s, this) = self.finish_status();
        if !status.success() {
            // Give the stderr thread a moment to collect the last lines.
            std::thread::sleep(Duration::from_millis(100));
            panic!(
                "{} failed: {status}\n--- its stderr:\n{}",
                this.what,
                this.stderr()
            );
        }
        s
    }

    /// Waits for exit, at most the watchdog (panics, after killing the child, if it hangs);
    /// returns the status, stdout, and the process's record (its stderr so far).
    pub fn finish_status(mut self) -> (std::process::ExitStatus, String, Proc) {
        // Read while waiting: a child that prints more than a pipe holds (64 KiB: minutes of
        // monitor lines) would otherwise block on its stdout and never exit.
        let reader = self.out.take().map(|mut o| {
            std::thread::spawn(move || {
                let mut s = String::new();
                o.read_to_string(&mut s).map(|_| s)
            })
        });
        let status = self.wait_watchdog();
        let mut s = std::mem::take(&mut self.before);
        if let Some(r) = reader {
            s.push_str(&r.join().unwrap().unwrap());
        }
        (status, s, self)
    }

    /// Waits for exit, at most the watchdog; kills the child and panics if it hangs.
    fn wait_watchdog(&mut self) -> std::process::ExitStatus {
        use wait_timeout::ChildExt;
        match self.child.wait_timeout(self.watchdog).unwrap() {
            Some(status) => status,
            None => {
                let _ = self.child.kill();
                panic!("{} hung for {:?}", self.what, self.watchdog);
            }
        }
    }

    /// Waits like `wait_status` and also returns the child's stderr.
    pub fn wait_status_keep(mut self) -> (std::process::ExitStatus, String) {
        let err = self.err.clone();
        let thread = self.err_thread.take();
        let status = self.wait_status();
        // The stderr thread ends when the pipe closes at the child's exit.
        if let Some(t) = thread {
            let _ = t.join();
        }
        let s = err.lock().unwrap().clone();
        (status, s)
    }

    /// What the child wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    /// Waits for exit (at most `WATCHDOG`) and returns the status, success or not.
    pub fn wait_status(mut self) -> std::process::ExitStatus {
        self.wait_watchdog()
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

/// True once process `pid` catches SIGTERM (its handler is installed): read from
/// /proc/PID/status, whose SigCgt is a hex mask of the signals caught, bit N-1 for signal N.
pub fn catches_sigterm(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap_or(0);
    mask & (1 << (15 - 1)) != 0
}
