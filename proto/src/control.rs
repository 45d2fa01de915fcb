//! The control plane between the launcher and a worker: framed bincode messages over a Unix
//! stream socket in the abstract namespace (Linux).
//!
//! The launcher opens a one-shot [`Server`] and passes its name to the worker (`--control NAME`).
//! The worker connects and sends [`ToLauncher::Hello`] first, carrying the protocol version; the
//! launcher answers [`ToWorker::Welcome`] (ring, run directory, config) or
//! [`ToWorker::Refused`]. After that the launcher may send `Stop`, and the worker
//! ends with [`ToLauncher::Report`]. Both directions share the one connection.
//!
//! Why not a crate: ipc-channel (used before) is not packaged where this project's crates come
//! from (Debian), and what we need — one duplex connection, a few small messages — is a socket.
//! Abstract socket names are visible to every local process, so the server accepts only a peer
//! of its own uid (`SO_PEERCRED`) and answers one connection.
//!
//! A frame is a little-endian `u32` length, then that many bytes of bincode. Frames over
//! [`MAX_FRAME`] are refused (a config is a few KiB).
//!
//! Length: past 500 lines because the messages, the framing and the handshake (both ends, the
//! launcher's wait on a worker that may die before it connects) are one protocol, with its tests.

use std::io::{Read, Write};
use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use shm_ring::Role;

/// Bumped on any change to the messages below, the config they carry included (10:
/// [`ToLauncher::Saved`]; 9: Welcome's `resume_step`; 8: [`StepStats::skipped`]; 7: the
/// workers' config gained `command_dir`, which a worker of before refuses as unknown). A Python
/// wheel built earlier is told to rebuild by the version, not by a field.
pub const PROTOCOL_VERSION: u32 = 10;

/// The largest frame either side accepts.
/// A worker the launcher runs from a config's `command` (a Python worker) finds its control
/// server in this variable, and its name (`target-3`) in [`ENV_WORKER`]: its arguments stay
/// the user's own.
pub const ENV_CONTROL: &str = "HSPIPE_CONTROL";
/// See [`ENV_CONTROL`].
pub const ENV_WORKER: &str = "HSPIPE_WORKER";
pub const MAX_FRAME: u32 = 16 << 20;

/// Worker → launcher.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToLauncher {
    Hello {
        version: u32,
        role: Role,
        index: u32,
        pid: u32,
    },
    Report(FinalReport),
    /// The drafter group's leader, after each applied step (for the monitor and
    /// metrics.jsonl).
    Progress(StepStats),
    /// The drafter group's leader, after each checkpoint step: what it wrote, and what failed
    /// (the console says a failure, the summary a run that ended without its checkpoint).
    Saved(SaveReport),
}

/// What the group's leader wrote at the checkpoint of one step: each field an error, or None
/// where that part was written (or is not written by this drafter: the mock exports none).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SaveReport {
    pub step: u64,
    /// The checkpoint (`checkpoints/drafter.safetensors`).
    pub checkpoint: Option<String>,
    /// The export (`drafter/`).
    pub export: Option<String>,
    /// The kept export (`drafter-steps/step-S`), at a step `[drafter] keep_export_every` names.
    pub kept: Option<String>,
    /// This step's export was to be kept.
    pub keeping: bool,
}

/// What one applied step of the drafter group did, the same on every rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    pub step: u64,
    /// The step's loss tokens (over the whole group's batches).
    pub tokens: u64,
    /// The step's mean loss per loss token (the backend's unit: per channel for the mock, per
    /// weighted token for DFlash).
    pub loss: f32,
    /// The step's acceptance length over its blocks (1 + the leading block positions predicted
    /// right), for a drafter that drafts blocks.
    pub tau: Option<f32>,
    /// The learning rate the step was applied with, for a backend with a schedule.
    pub lr: Option<f32>,
    /// Mean tokens per target forward of speculative decoding on held-out prompts, when the
    /// leader evaluated after this step (`dflash.eval_every`).
    #[serde(default)]
    pub eval_tau: Option<f32>,
    /// The update was left out: the group's gradient was NaN or infinite, and the weights were
    /// left as they were (every rank's alike).
    #[serde(default)]
    pub skipped: bool,
    /// The drafter did not say how many loss tokens the step had (a Python leader's
    /// `progress(step, loss)` without `tokens=`): its loss counts as one token's in the
    /// monitor's mean, an unweighted mean over such steps, and `tokens` is 0.
    /// Always written: the control channel's bincode cannot skip a field (a skipped one made
    /// every frame of ours undecodable).
    #[serde(default)]
    pub tokens_unknown: bool,
}

impl StepStats {
    /// The weight of the step's loss in a mean over steps: its loss tokens, 1 for a step whose
    /// tokens the drafter did not say, and 0 for one that trained nothing (the end's empty
    /// rounds) or whose loss is not finite.
    pub fn loss_weight(&self) -> u64 {
        match (self.loss.is_finite(), self.tokens_unknown) {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => self.tokens,
        }
    }
}

/// Launcher → worker.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub enum ToWorker {
    Welcome {
        version: u32,
        ring: String,
        run_dir: PathBuf,
        gpu: Option<u32>,
        /// The pipeline config as TOML, validated again by the worker.
        config_toml: String,
        /// The compute backend the launcher chose for the run, by name (`gpu::BackendKind`
        /// spells and reads it: proto knows no backend).
        backend: String,
        /// The step of the checkpoint this launch resumed the run from (ours, or the one a
        /// drafter of the user's own recorded: [`crate::checkpointed`]), which such a drafter
        /// loads; None for a new run, and for a resume from the start (nothing checkpointed).
        resume_step: Option<u64>,
    },
    Refused {
        why: String,
    },
    /// Finish gracefully: a target stops claiming and finishes, a drafter drains and checkpoints.
    Stop,
}

/// What a worker did, sent just before it exits.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FinalReport {
    pub items: u64,
    pub tokens: u64,
    /// Batches a drafter refused (corrupt); always 0 for targets.
    pub refused: u64,
    /// True if the worker's part is complete (a target's data is done, a drafter saw the end).
    pub complete: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control channel {name:?}: {why}")]
    Connect { name: String, why: String },
    #[error("the launcher did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the launcher speaks control protocol {theirs}, this worker {ours}")]
    Version { theirs: u32, ours: u32 },
    #[error("the launcher refused this worker: {0}")]
    Refused(String),
    #[error("control channel: {0}")]
    Channel(String),
    #[error("control channel: the other side closed it")]
    Closed,
    #[error("control channel: a frame of {0} bytes is over the limit")]
    TooLarge(u64),
    /// A whole frame whose message could not be decoded: the stream is still in step, so the
    /// next frame reads on.
    #[error("control channel: a message this build cannot read: {0}")]
    Undecodable(String),
    #[error("control channel: refusing a peer of uid {theirs} (ours is {ours})")]
    ForeignPeer { theirs: u32, ours: u32 },
    #[error("the launcher's first message was {0}, not Welcome")]
    Unexpected(String),
}

/// The sending half of a connection; sends from several threads are serialised.
pub struct Sender<T> {
    stream: Mutex<UnixStream>,
    _msg: PhantomData<fn(T)>,
}

/// The receiving half of a connection.
pub struct Receiver<T> {
    stream: UnixStream,
    _msg: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("control::Sender")
    }
}

fn io_err(e: std::io::Error) -> ControlError {
    ControlError::Channel(e.to_string())
}

/// Splits one connection into its two typed halves.
fn split<S, R>(stream: UnixStream) -> Result<(Sender<S>, Receiver<R>), ControlError> {
    let write = stream.try_clone().map_err(io_err)?;
    Ok((
        Sender {
            stream: Mutex::new(write),
            _msg: PhantomData,
        },
        Receiver {
            stream,
            _msg: PhantomData,
        },
    ))
}

impl<T: Serialize> Sender<T> {
    /// Sends one message as one frame.
    pub fn send(&self, msg: T) -> Result<(), ControlError> {
        let body = bincode::serialize(&msg).map_err(|e| ControlError::Channel(e.to_string()))?;
        if body.len() as u64 > u64::from(MAX_FRAME) {
            return Err(ControlError::TooLarge(body.len() as u64));
        }
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        // A poisoned lock only means another sender panicked mid-frame; the stream is then
        // garbage for the peer, which will say so, so sending on is harmless.
        let mut s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        s.write_all(&frame).map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                ControlError::Closed
            }
            _ => io_err(e),
        })
    }
}

impl<T: DeserializeOwned> Receiver<T> {
    /// Waits for the next message; `Closed` once the peer has gone.
    pub fn recv(&self) -> Result<T, ControlError> {
        let mut s = &self.stream;
        let mut len = [0u8; 4];
        s.read_exact(&mut len).map_err(read_err)?;
        let len = u32::from_le_bytes(len);
        if len > MAX_FRAME {
            return Err(ControlError::TooLarge(len.into()));
        }
        let mut body = vec![0u8; len as usize];
        s.read_exact(&mut body).map_err(read_err)?;
        bincode::deserialize(&body).map_err(|e| ControlError::Undecodable(e.to_string()))
    }

    /// Stops reading for good: the peer's next sends fail (`Closed`) instead of blocking once
    /// the socket's buffer is full. For a reader that cannot go on (the stream out of step).
    pub fn stop_reading(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Read);
    }

    /// Like [`Receiver::recv`], giving up with `Timeout` after `timeout`. Meant for a first
    /// message: after a timeout the connection is no longer usable.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<T, ControlError> {
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io_err)?;
        let got = self.recv().map_err(|e| match e {
            ControlError::Channel(ref why) if why.contains(TIMED_OUT) => {
                ControlError::Timeout(timeout)
            }
            e => e,
        });
        self.stream.set_read_timeout(None).map_err(io_err)?;
        got
    }
}

const TIMED_OUT: &str = "timed out";

fn read_err(e: std::io::Error) -> ControlError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
            ControlError::Closed
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            ControlError::Channel(TIMED_OUT.into())
        }
        _ => io_err(e),
    }
}

/// The launcher's two halves of a worker's connection.
pub type Halves = (Sender<ToWorker>, Receiver<ToLauncher>);

/// The launcher's end before a worker connects: one abstract socket name, one connection.
pub struct Server {
    listener: UnixListener,
    name: String,
}

impl Server {
    /// Opens a server under a fresh name (pid, a counter and the clock make it unique).
    pub fn new() -> Result<Server, ControlError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "hspipe-ctl-{}-{}-{nanos:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io_err)?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| ControlError::Connect {
            name: name.clone(),
            why: e.to_string(),
        })?;
        Ok(Server { listener, name })
    }

    /// The name a worker passes to [`connect`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for the worker, refuses peers of another uid (and goes on waiting), and returns
    /// the connection's two halves. Blocks until a worker of ours connects.
    pub fn accept(self) -> Result<Halves, ControlError> {
        loop {
            if let Some(halves) = self.accept_one()? {
                return Ok(halves);
            }
        }
    }

    /// [`accept`](Self::accept), unless the worker exits first: `worker` is a pidfd of the
    /// process started to connect here, readable once it has exited, and then this returns None.
    /// A worker that dies before it connects (a Python worker whose imports fail, a program
    /// that is not a worker) used to leave its handshake thread and this listening socket
    /// waiting for the launcher's whole life: one thread and one descriptor per such death, for
    /// as long as restarts go on.
    pub fn accept_unless_exited(
        self,
        worker: BorrowedFd<'_>,
    ) -> Result<Option<Halves>, ControlError> {
        use rustix::event::{poll, PollFd, PollFlags};
        loop {
            let mut fds = [
                PollFd::new(&self.listener, PollFlags::IN),
                PollFd::new(&worker, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(io_err(e.into())),
                Ok(_) => {}
            }
            let (connected, exited) = (!fds[0].revents().is_empty(), !fds[1].revents().is_empty());
            if let Some(done) = self.after_poll(connected, exited)? {
                return Ok(done);
            }
        }
    }

    /// What [`accept_unless_exited`](Self::accept_unless_exited) does once poll says a
    /// connection is queued (`connected`) or the worker has exited (`exited`): Some when it is
    /// done, None to poll again.
    ///
    /// poll looks at the listener, then at the pidfd: a worker that connects and exits between
    /// the two looks (its Hello sent, the launcher's answer never read) is seen as exited with
    /// no connection. Its connection is queued all the same, and the worker can make none after
    /// it has exited, so on an exit what is queued is taken without blocking: the handshake
    /// then reads its Hello and finds it gone when it answers, and says so, as it does when
    /// poll saw both; the death's line (the worker's exit status and the last error in its log)
    /// is the supervisor's either way. A worker says nothing on this connection before its
    /// Welcome but its Hello.
    fn after_poll(
        &self,
        connected: bool,
        exited: bool,
    ) -> Result<Option<Option<Halves>>, ControlError> {
        if connected {
            // A connection first: a worker that connected and then died is the handshake's to
            // find out. A stranger's is closed, and the wait goes on.
            return Ok(self.accept_one()?.map(Some));
        }
        if !exited {
            return Ok(None);
        }
        // Accepted sockets do not inherit the listener's O_NONBLOCK: the halves block as ever.
        self.listener.set_nonblocking(true).map_err(io_err)?;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Some(halves) = Self::ours(stream)? {
                        return Ok(Some(Some(halves)));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(Some(None)),
                Err(e) => return Err(io_err(e)),
            }
        }
    }

    /// One connection: its halves if the peer is of our uid; None for a stranger, whose
    /// connection is closed (it gets nothing).
    fn accept_one(&self) -> Result<Option<Halves>, ControlError> {
        let (stream, _) = self.listener.accept().map_err(io_err)?;
        Self::ours(stream)
    }

    /// An accepted connection's halves if the peer is of our uid; None for a stranger's,
    /// closed here.
    fn ours(stream: UnixStream) -> Result<Option<Halves>, ControlError> {
        let ours = rustix::process::geteuid().as_raw();
        let theirs = rustix::net::sockopt::socket_peercred(&stream)
            .map_err(|e| io_err(e.into()))?
            .uid
            .as_raw();
        if theirs == ours {
            return split(stream).map(Some);
        }
        Ok(None)
    }
}

/// The worker's end after a successful handshake.
pub struct WorkerLink {
    pub to_launcher: Sender<ToLauncher>,
    pub from_launcher: Receiver<ToWorker>,
    pub ring: String,
    pub run_dir: PathBuf,
    pub gpu: Option<u32>,
    pub config_toml: String,
    pub backend: String,
    pub resume_step: Option<u64>,
}

/// Connects to the launcher's server `name`, says hello, and waits up to `timeout` for Welcome.
pub fn connect(
    name: &str,
    role: Role,
    index: u32,
    timeout: Duration,
) -> Result<WorkerLink, ControlError> {
    let connect_err = |why: String| ControlError::Connect {
        name: name.to_string(),
        why,
    };
    let addr =
        SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| connect_err(e.to_string()))?;
    let stream = UnixStream::connect_addr(&addr).map_err(|e| connect_err(e.to_string()))?;
    let (to_launcher, from_launcher) = split::<ToLauncher, ToWorker>(stream)?;
    to_launcher.send(ToLauncher::Hello {
        version: PROTOCOL_VERSION,
        role,
        index,
        pid: std::process::id(),
    })?;
    match from_launcher.recv_timeout(timeout)? {
        ToWorker::Welcome {
            version,
            ring,
            run_dir,
            gpu,
            config_toml,
            backend,
            resume_step,
        } => {
            if version != PROTOCOL_VERSION {
                return Err(ControlError::Version {
                    theirs: version,
                    ours: PROTOCOL_VERSION,
                });
            }
            Ok(WorkerLink {
                to_launcher,
                from_launcher,
                ring,
                run_dir,
                gpu,
                config_toml,
                backend,
                resume_step,
            })
        }
        ToWorker::Refused { why } => Err(ControlError::Refused(why)),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plays the launcher in a thread: accepts one worker and answers with `answer(version)`.
    fn launcher(answer: fn(u32) -> ToWorker) -> (String, std::thread::JoinHandle<Role>) {
        let server = Server::new().unwrap();
        let name = server.name().to_string();
        let h = std::thread::spawn(move || {
            let (reply, rx) = server.accept().unwrap();
            let ToLauncher::Hello { version, role, .. } = rx.recv().unwrap() else {
                panic!("first message must be Hello");
            };
            reply.send(answer(version)).unwrap();
            role
        });
        (name, h)
    }

    #[test]
    fn handshake_carries_the_run_and_checks_the_version() {
        let (name, h) = launcher(|v| ToWorker::Welcome {
            version: v,
            ring: "hspipe-x".into(),
            run_dir: "/tmp/run".into(),
            gpu: Some(3),
            config_toml: String::new(),
            backend: "mock".into(),
            resume_step: Some(12),
        });
        let link = connect(&name, Role::Consumer, 2, Duration::from_secs(30)).unwrap();
        assert_eq!((link.ring.as_str(), link.gpu), ("hspipe-x", Some(3)));
        assert_eq!(link.resume_step, Some(12));
        assert_eq!(h.join().unwrap(), Role::Consumer);

        let (name, _h) = launcher(|v| ToWorker::Welcome {
            version: v + 1,
            ring: String::new(),
            run_dir: PathBuf::new(),
            gpu: None,
            config_toml: String::new(),
            backend: "mock".into(),
            resume_step: None,
        });
        let err = connect(&name, Role::Producer, 0, Duration::from_secs(30))
            .err()
            .unwrap();
        assert!(matches!(err, ControlError::Version { .. }), "{err}");

        let (name, _h) = launcher(|_| ToWorker::Refused {
            why: "index taken".into(),
        });
        let err = connect(&name, Role::Producer, 0, Duration::from_secs(30))
            .err()
            .unwrap();
        assert!(err.to_string().contains("index taken"), "{err}");
    }

    /// A worker connects, says Hello and exits between poll's look at the listener and its
    /// look at the pidfd: poll reports the exit alone. The connection is taken all the same,
    /// with what the worker said; with nothing queued, an exit ends the wait at once.
    #[test]
    fn a_worker_that_connected_just_before_it_exited_is_still_accepted() {
        let server = Server::new().unwrap();
        let addr = SocketAddr::from_abstract_name(server.name().as_bytes()).unwrap();
        let stream = UnixStream::connect_addr(&addr).unwrap();
        let (to_launcher, _from) = split::<ToLauncher, ToWorker>(stream).unwrap();
        to_launcher
            .send(ToLauncher::Hello {
                version: PROTOCOL_VERSION,
                role: Role::Producer,
                index: 4,
                pid: 1,
            })
            .unwrap();
        let (_reply, rx) = (server.after_poll(false, true).unwrap())
            .expect("an exit ends the wait")
            .expect("the queued connection is the worker's");
        let ToLauncher::Hello { index, .. } = rx.recv().unwrap() else {
            panic!("first message must be Hello");
        };
        assert_eq!(index, 4);

        let server = Server::new().unwrap();
        assert!(matches!(server.after_poll(false, true), Ok(Some(None))));
        assert!(matches!(server.after_poll(false, false), Ok(None)));
    }

    #[test]
    fn a_bad_server_name_is_a_clear_error() {
        let err = connect("no-such-server", Role::Producer, 0, Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(err.to_string().contains("no-such-server"), "{err}");
    }

    #[test]
    fn a_silent_launcher_times_out_and_a_gone_one_reads_as_closed() {
        let server = Server::new().unwrap();
        let name = server.name().to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            let halves = server.accept().unwrap();
            // Hold the connection until the worker timed out, then close it.
            rx.recv().unwrap();
            drop(halves);
        });
        let err = connect(&name, Role::Producer, 0, Duration::from_millis(50))
            .err()
            .unwrap();
        assert!(matches!(err, ControlError::Timeout(_)), "{err}");
        tx.send(()).unwrap();
        h.join().unwrap();

        let (a, b) = UnixStream::pair().unwrap();
        let (_, rx) = split::<ToWorker, ToWorker>(a).unwrap();
        drop(b);
        assert!(matches!(rx.recv(), Err(ControlError::Closed)));
    }

    /// Every field of a step's stats crosses the channel: a field the encoding skipped
    /// (`skip_serializing_if`, which bincode cannot follow) made every frame of ours
    /// undecodable, and the launcher's reader stopped. A frame that cannot be decoded is said
    /// and the next one reads on.
    #[test]
    fn a_steps_stats_cross_whole_and_an_undecodable_frame_is_skipped() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut raw = a.try_clone().unwrap();
        let (tx, _) = split::<ToLauncher, ToLauncher>(a).unwrap();
        let (_, rx) = split::<ToLauncher, ToLauncher>(b).unwrap();
        let got = |rx: &Receiver<ToLauncher>| match rx.recv() {
            Ok(ToLauncher::Progress(s)) => s,
            other => panic!("{other:?}"),
        };
        for tokens_unknown in [false, true] {
            let s = StepStats {
                step: 3,
                tokens: 7,
                loss: 0.5,
                tokens_unknown,
                ..StepStats::default()
            };
            tx.send(ToLauncher::Progress(s)).unwrap();
            assert_eq!(got(&rx), s);
        }
        raw.write_all(&3u32.to_le_bytes()).unwrap();
        raw.write_all(&[0xff; 3]).unwrap();
        assert!(matches!(rx.recv(), Err(ControlError::Undecodable(_))));
        let s = StepStats::default();
        tx.send(ToLauncher::Progress(s)).unwrap();
        assert_eq!(got(&rx), s);
        // A reader that stops: the sender is told, never blocked.
        rx.stop_reading();
        let sent = (0..100_000)
            .map(|_| tx.send(ToLauncher::Progress(s)))
            .find(Result::is_err);
        assert!(matches!(sent, Some(Err(ControlError::Closed))), "{sent:?}");
    }

    #[test]
    fn an_oversized_frame_is_refused_not_allocated() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let (_, rx) = split::<ToWorker, ToWorker>(a).unwrap();
        b.write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(matches!(rx.recv(), Err(ControlError::TooLarge(_))));
    }
}
