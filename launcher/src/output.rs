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
//! Output must not wait for the terminal either. A console that stops reading (Ctrl-S in a
//! terminal, `launcher | less` left on a page, a stalled SSH link, a journal that lags) blocked
//! the copier in its write, the pipe filled behind it, and the next `println!` blocked the
//! supervisor: no restart, no tick, not even Ctrl-C, for as long as the console did not read,
//! and `launcher.log` stopped too. So the copier hands what it read to a passer thread through a
//! bounded queue ([`QUEUED`] bytes) and never waits for it: what does not fit while the console
//! is stalled is not shown there (the log has it), and the passer says how much was left out
//! once the console takes output again. The progress bar draws on the terminal opened anew
//! without blocking (`O_NONBLOCK` on a description of its own, not the shell's): a frame the
//! terminal does not take is dropped, and the next one draws the whole bar.
//!
//! Invariant: while a `Tee` is installed, no write to fd 1 or 2 in this process can fail (the
//! pipes' reader is our own thread), whoever writes: the monitor, the summary table, a panic
//! message, and none waits for the console. Dropping the `Tee` points fds 1 and 2 back at the
//! original streams and waits for the copiers to drain (into the log: nothing written before is
//! lost there) and for the passers to pass the rest on, up to [`PASS_ON_AT_EXIT`].
//!
//! The progress bar is the exception: it redraws in place, so it must draw on the terminal
//! itself (`Tee::terminal`, the original stderr's terminal opened anew, not blocking; indicatif
//! ignores draw errors), and the monitor writes what the bar shows to the log with `Log::line`.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

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

/// Bytes a console that does not read may hold back before output is left out of it: hours of
/// monitor lines.
pub const QUEUED: usize = 1 << 20;

/// How long the launcher's exit waits for a console to take the output still queued for it.
pub const PASS_ON_AT_EXIT: Duration = Duration::from_secs(5);

/// The installed tee (see the module doc). Drop it to restore the original streams.
pub struct Tee {
    log: Log,
    /// The original fds 1 and 2, to restore.
    original: [Option<OwnedFd>; 2],
    copiers: Vec<JoinHandle<()>>,
    /// Ends (its sender dropped) once every passer has passed on all it was given.
    passed: Receiver<()>,
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
        // Each passer holds a clone of `passing` until it has passed on everything.
        let (passing, passed) = mpsc::channel();
        let mut passers = Vec::new();
        for pass in passes {
            passers.push(match pass {
                Some(out) => Some(Passer::start(out, passing.clone())?),
                None => None,
            });
        }
        drop(passing);
        // Rust's stdout buffers up to a newline; what it holds belongs to the old stream.
        let _ = std::io::stdout().flush();
        // From here on, an error drops `tee`, which restores both streams.
        let mut tee = Tee {
            log,
            original,
            copiers: Vec::new(),
            passed,
            on_terminal,
        };
        for ((stream, (read, write)), pass) in streams.into_iter().zip(pipes).zip(passers) {
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

    /// The terminal to draw a progress bar on, if stdout and stderr were both terminals: the
    /// original stderr's terminal opened anew, not blocking (see the module doc). `None` where
    /// it cannot be opened so: the monitor then writes plain lines, through the passers.
    pub fn terminal(&self) -> Option<console::Term> {
        if !self.on_terminal {
            return None;
        }
        let fd = self.original[1].as_ref()?;
        let w = open_nonblocking(fd).ok()?;
        let r = w.try_clone().ok()?;
        Some(console::Term::read_write_pair(r, w))
    }
}

/// The terminal `fd` is on, opened again: a new open file description, so `O_NONBLOCK` on it
/// leaves the shell's (the original fd's) as it was.
fn open_nonblocking(fd: &OwnedFd) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let flags = OFlags::RDWR | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let tty = rustix::fs::open(path.as_str(), flags, Mode::empty())?;
    let file = File::from(tty);
    if !file.is_terminal() {
        return Err(std::io::Error::other("not a terminal"));
    }
    Ok(file)
}

/// Passes output on to one original stream on a thread of its own, so that a console that does
/// not read holds back nobody but this thread (see the module doc).
struct Passer {
    queue: Arc<Queue>,
}

/// What the copier gave and the passer has not yet written.
#[derive(Default)]
struct Queued {
    bytes: Vec<u8>,
    /// Bytes left out, the queue full, since the passer last took the queue.
    left_out: u64,
    /// The copier is done: nothing more comes.
    closed: bool,
    /// Writing to the console failed: nothing more is passed on.
    gone: bool,
}

#[derive(Default)]
struct Queue {
    state: Mutex<Queued>,
    ready: std::sync::Condvar,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        // A poisoned lock only means a thread panicked holding it; the bytes are still bytes.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Passer {
    fn start(out: File, passing: mpsc::Sender<()>) -> anyhow::Result<Passer> {
        let queue = Arc::new(Queue::default());
        let theirs = queue.clone();
        std::thread::Builder::new()
            .name("output-pass".into())
            .spawn(move || {
                pass_on(&theirs, out);
                drop(passing);
            })
            .context("starting the output thread")?;
        Ok(Passer { queue })
    }

    /// Queues `bytes` for the console, never waiting (what does not fit in [`QUEUED`] is left
    /// out and counted); false once the console is gone (an error writing to it).
    fn give(&self, bytes: &[u8]) -> bool {
        let mut q = self.queue.lock();
        if q.gone {
            return false;
        }
        // Once some is left out, all is until the passer takes the queue: the note it writes
        // after what was queued stands where the output left out was.
        if q.left_out == 0 && q.bytes.len() + bytes.len() <= QUEUED {
            q.bytes.extend_from_slice(bytes);
        } else {
            q.left_out += bytes.len() as u64;
        }
        self.queue.ready.notify_one();
        true
    }
}

impl Drop for Passer {
    fn drop(&mut self) {
        self.queue.lock().closed = true;
        self.queue.ready.notify_one();
    }
}

/// Writes what is queued to `out`, then how much was left out after it; returns once
/// the queue is closed and empty, or at `out`'s first error (the terminal or the reader is
/// gone).
fn pass_on(queue: &Queue, mut out: File) {
    loop {
        let (bytes, left_out) = {
            let mut q = queue.lock();
            while q.bytes.is_empty() && q.left_out == 0 && !q.closed {
                q = queue.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.bytes.is_empty() && q.left_out == 0 {
                return;
            }
            (
                std::mem::take(&mut q.bytes),
                std::mem::take(&mut q.left_out),
            )
        };
        let mut written = out.write_all(&bytes);
        if left_out > 0 && written.is_ok() {
            let note = format!(
                "\n[launcher: {left_out} bytes of output not shown here: the console did not take them in time; launcher.log has all of it]\n"
            );
            written = out.write_all(note.as_bytes());
        }
        if written.is_err() {
            queue.lock().gone = true;
            return;
        }
    }
}

/// Copies `from` to the log and hands it to `pass` until end of file; stops passing on once
/// the console is gone, but keeps logging. Never waits for the console.
fn copy(mut from: File, mut pass: Option<Passer>, log: &Log) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        log.write(&buf[..n]);
        if pass.as_ref().is_some_and(|p| !p.give(&buf[..n])) {
            pass = None;
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
        // The copiers are done, so the passers' queues are closed: wait for a console that
        // reads to be given the rest, and not for ever for one that does not.
        let _ = self.passed.recv_timeout(PASS_ON_AT_EXIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A console (a 4 KiB pipe) that does not read while 2.4 MB are given: giving never waits,
    /// what fits in the queue is shown whole and in order once the console reads, and then one
    /// note says how many bytes were left out, so shown and left out add up to what was given.
    #[test]
    fn a_console_that_does_not_read_is_given_what_fits_then_told_what_was_left_out() {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        rustix::pipe::fcntl_setpipe_size(&write, 4096).unwrap();
        let (passing, passed) = mpsc::channel();
        let passer = Passer::start(File::from(write), passing).unwrap();
        let given: Vec<u8> = (0..300 * 8192u32).map(|i| b'a' + (i % 26) as u8).collect();
        for chunk in given.chunks(8192) {
            assert!(passer.give(chunk));
        }
        drop(passer);
        let mut shown = Vec::new();
        File::from(read).read_to_end(&mut shown).unwrap();
        assert!(passed.recv().is_err(), "the passer ended");
        let text = String::from_utf8(shown).unwrap();
        let (data, note) = text.split_once("\n[launcher: ").expect("a note");
        let left_out: usize = note.split(' ').next().unwrap().parse().unwrap();
        assert!(note.ends_with("launcher.log has all of it]\n"), "{note}");
        assert_eq!(data.as_bytes(), &given[..data.len()], "in order, whole");
        assert!(
            data.len() >= QUEUED - 8192,
            "the queue held its {QUEUED} bytes"
        );
        assert_eq!(data.len() + left_out, given.len());
    }

    /// A console that reads gets everything, and no note.
    #[test]
    fn a_console_that_reads_gets_everything() {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let (passing, _passed) = mpsc::channel();
        let passer = Passer::start(File::from(write), passing).unwrap();
        let reader = std::thread::spawn(move || {
            let mut shown = Vec::new();
            File::from(read).read_to_end(&mut shown).unwrap();
            shown
        });
        let given: Vec<u8> = (0..100_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for chunk in given.chunks(1000) {
            assert!(passer.give(chunk));
            std::thread::yield_now();
        }
        drop(passer);
        let shown = reader.join().unwrap();
        assert_eq!(shown.len(), given.len(), "no note");
        assert_eq!(shown, given);
    }
}
