//! Where the launcher's human output goes: the terminal (or whatever stdout and stderr were), and
//! always `<run-dir>/launcher.log`.
//!
//! Output must not die with the terminal. A hung-up terminal answers writes with EIO and a pipe
//! whose reader has gone with EPIPE (Rust ignores SIGPIPE, so `println!` *panics* on it), and
//! either would abort an ordered stop halfway, leaking the ring. So once the run directory
//! exists, `Tee::install` makes the launcher's own fds 1 and 2 the write ends of two pipes. A
//! copier thread per pipe appends what it reads to `launcher.log`, then passes it on to the
//! original stream; the first error there ends the passing on, never the copying to the log.
//!
//! Invariant: while a `Tee` is installed, no write to fd 1 or 2 in this process can fail (the
//! pipes' reader is our own thread), whoever writes: the monitor, the summary table, a panic
//! message. Dropping the `Tee` points fds 1 and 2 back at the original streams and waits for the
//! copiers to drain, so nothing written before is lost.
//!
//! The progress bar is the exception: it redraws in place, so it must draw on the terminal
//! itself (`Tee::terminal`, a duplicate of the original stderr; indicatif ignores draw errors),
//! and the monitor writes what the bar shows to the log with `Log::line`.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::Context;

/// `launcher.log`, shared by the copiers and the monitor; writes to it are whole chunks.
#[derive(Clone)]
pub struct Log(Arc<Mutex<File>>);

impl Log {
    fn write(&self, bytes: &[u8]) {
        // A poisoned lock only means a copier panicked mid-write; the file is still usable.
        let mut f = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Nowhere left to report a failing log; the terminal may still show the output.
        let _ = f.write_all(bytes);
    }

    /// Appends one line to the log only (what the progress bar shows on the terminal).
    pub fn line(&self, s: &str) {
        self.write(format!("{s}\n").as_bytes());
    }
}

/// One of the two streams the tee takes over.
#[derive(Clone, Copy)]
enum Stream {
    Out,
    Err,
}

impl Stream {
    fn point_at(self, fd: impl AsFd) -> std::io::Result<()> {
        match self {
            Stream::Out => rustix::stdio::dup2_stdout(fd),
            Stream::Err => rustix::stdio::dup2_stderr(fd),
        }
        .map_err(std::io::Error::from)
    }

    /// A close-on-exec duplicate of the stream's fd; `None` if the launcher was started with it
    /// closed.
    fn duplicate(self) -> Option<OwnedFd> {
        match self {
            Stream::Out => std::io::stdout().as_fd().try_clone_to_owned(),
            Stream::Err => std::io::stderr().as_fd().try_clone_to_owned(),
        }
        .ok()
    }
}

/// The installed tee (see the module doc). Drop it to restore the original streams.
pub struct Tee {
    log: Log,
    /// The original fds 1 and 2, to restore.
    original: [Option<OwnedFd>; 2],
    copiers: Vec<JoinHandle<()>>,
    /// Both original streams were terminals when the tee was installed.
    on_terminal: bool,
}

impl Tee {
    /// Sends everything the launcher writes to fds 1 and 2 through `log` (created or appended
    /// to) on its way to the original streams.
    pub fn install(log: &Path) -> anyhow::Result<Tee> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let log = Log(Arc::new(Mutex::new(file)));
        let on_terminal = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
        let streams = [Stream::Out, Stream::Err];
        // What can fail without undoing anything comes first.
        let original = streams.map(Stream::duplicate);
        let mut pipes = Vec::new();
        for _ in streams {
            pipes.push(
                rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                    .context("creating the output pipes")?,
            );
        }
        let mut passes = Vec::new();
        for fd in &original {
            passes.push(match fd {
                Some(fd) => Some(File::from(
                    fd.try_clone().context("duplicating an output stream")?,
                )),
                None => None,
            });
        }
        // Rust's stdout buffers up to a newline; what it holds belongs to the old stream.
        let _ = std::io::stdout().flush();
        // From here on, an error drops `tee`, which restores both streams.
        let mut tee = Tee {
            log,
            original,
            copiers: Vec::new(),
            on_terminal,
        };
        for ((stream, (read, write)), pass) in streams.into_iter().zip(pipes).zip(passes) {
            // Replaces fd 1 (2) with the pipe's write end; `write` itself closes at the end of
            // this iteration, so fd 1 (2) is the pipe's only writer from here on.
            stream
                .point_at(&write)
                .context("redirecting the launcher's output")?;
            let log = tee.log.clone();
            tee.copiers.push(
                std::thread::Builder::new()
                    .name("output-tee".into())
                    .spawn(move || copy(File::from(read), pass, &log))
                    .context("starting the output thread")?,
            );
        }
        Ok(tee)
    }

    /// The log alone, for what does not go through fds 1 and 2.
    pub fn log(&self) -> Log {
        self.log.clone()
    }

    /// The terminal to draw a progress bar on, if stdout and stderr were both terminals.
    pub fn terminal(&self) -> Option<console::Term> {
        if !self.on_terminal {
            return None;
        }
        let fd = self.original[1].as_ref()?;
        let (r, w) = (fd.try_clone().ok()?, fd.try_clone().ok()?);
        Some(console::Term::read_write_pair(File::from(r), File::from(w)))
    }
}

/// Copies `from` to the log and to `pass` until end of file; stops passing on at `pass`'s first
/// error (the terminal or the reader is gone) but keeps logging.
fn copy(mut from: File, mut pass: Option<File>, log: &Log) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        log.write(&buf[..n]);
        if let Some(p) = &mut pass {
            if p.write_all(&buf[..n]).is_err() {
                pass = None;
            }
        }
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        let _ = std::io::stdout().flush();
        for (stream, fd) in [Stream::Out, Stream::Err]
            .into_iter()
            .zip(&mut self.original)
        {
            // Taking fd 1 (2) back closes the pipe's last write end: the copier reads end of
            // file once it has drained the pipe. A stream that was closed gets /dev/null.
            let restored = match fd.take() {
                Some(fd) => stream.point_at(&fd),
                None => File::open("/dev/null").and_then(|null| stream.point_at(&null)),
            };
            if restored.is_err() {
                // The copier would wait forever for an end of file; leave it running instead.
                return;
            }
        }
        for c in self.copiers.drain(..) {
            let _ = c.join();
        }
    }
}
