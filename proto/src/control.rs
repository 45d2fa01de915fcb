//! The control plane between the launcher and a worker, over ipc-channel.
//!
//! The launcher opens a one-shot server and passes its name to the worker (`--control NAME`).
//! The worker connects and sends [`ToLauncher::Hello`] first, carrying the protocol version and
//! a sender for the launcher's replies; the launcher answers [`ToWorker::Welcome`] (ring, run
//! directory, config) or [`ToWorker::Refused`]. After that the launcher may send `Stop` or
//! `Checkpoint`, and the worker ends with [`ToLauncher::Report`].

use std::path::PathBuf;
use std::time::Duration;

use ipc_channel::ipc::{self, IpcReceiver, IpcSender};
use serde::{Deserialize, Serialize};

/// Bumped on any change to the messages below.
pub const PROTOCOL_VERSION: u32 = 1;

/// A worker's role on the control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerRole {
    Target,
    Drafter,
}

/// Worker → launcher.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToLauncher {
    Hello {
        version: u32,
        role: WorkerRole,
        index: u32,
        pid: u32,
        reply: IpcSender<ToWorker>,
    },
    Report(FinalReport),
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
    },
    Refused {
        why: String,
    },
    /// Finish gracefully: a target stops claiming and finishes, a drafter drains and checkpoints.
    Stop,
    /// Write a checkpoint now.
    Checkpoint,
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
    #[error("the launcher's first message was {0}, not Welcome")]
    Unexpected(String),
}

/// The worker's end after a successful handshake.
pub struct WorkerLink {
    pub to_launcher: IpcSender<ToLauncher>,
    pub from_launcher: IpcReceiver<ToWorker>,
    pub ring: String,
    pub run_dir: PathBuf,
    pub gpu: Option<u32>,
    pub config_toml: String,
}

/// Connects to the launcher's server `name`, says hello, and waits up to `timeout` for Welcome.
pub fn connect(
    name: &str,
    role: WorkerRole,
    index: u32,
    timeout: Duration,
) -> Result<WorkerLink, ControlError> {
    let to_launcher =
        IpcSender::<ToLauncher>::connect(name.to_string()).map_err(|e| ControlError::Connect {
            name: name.to_string(),
            why: e.to_string(),
        })?;
    let (reply, from_launcher) =
        ipc::channel::<ToWorker>().map_err(|e| ControlError::Channel(e.to_string()))?;
    to_launcher
        .send(ToLauncher::Hello {
            version: PROTOCOL_VERSION,
            role,
            index,
            pid: std::process::id(),
            reply,
        })
        .map_err(|e| ControlError::Channel(e.to_string()))?;
    let first = from_launcher
        .try_recv_timeout(timeout)
        .map_err(|e| match e {
            ipc::TryRecvError::Empty => ControlError::Timeout(timeout),
            ipc::TryRecvError::IpcError(e) => ControlError::Channel(format!("{e:?}")),
        })?;
    match first {
        ToWorker::Welcome {
            version,
            ring,
            run_dir,
            gpu,
            config_toml,
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
            })
        }
        ToWorker::Refused { why } => Err(ControlError::Refused(why)),
        other => Err(ControlError::Unexpected(format!("{other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipc_channel::ipc::IpcOneShotServer;

    /// Plays the launcher in a thread: accepts one worker and answers with `answer(version)`.
    fn launcher(answer: fn(u32) -> ToWorker) -> (String, std::thread::JoinHandle<WorkerRole>) {
        let (server, name) = IpcOneShotServer::<ToLauncher>::new().unwrap();
        let h = std::thread::spawn(move || {
            let (_rx, hello) = server.accept().unwrap();
            let ToLauncher::Hello {
                version,
                role,
                reply,
                ..
            } = hello
            else {
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
        });
        let link = connect(&name, WorkerRole::Drafter, 2, Duration::from_secs(30)).unwrap();
        assert_eq!((link.ring.as_str(), link.gpu), ("hspipe-x", Some(3)));
        assert_eq!(h.join().unwrap(), WorkerRole::Drafter);

        let (name, _h) = launcher(|v| ToWorker::Welcome {
            version: v + 1,
            ring: String::new(),
            run_dir: PathBuf::new(),
            gpu: None,
            config_toml: String::new(),
        });
        let err = connect(&name, WorkerRole::Target, 0, Duration::from_secs(30))
            .err()
            .unwrap();
        assert!(matches!(err, ControlError::Version { .. }), "{err}");

        let (name, _h) = launcher(|_| ToWorker::Refused {
            why: "index taken".into(),
        });
        let err = connect(&name, WorkerRole::Target, 0, Duration::from_secs(30))
            .err()
            .unwrap();
        assert!(err.to_string().contains("index taken"), "{err}");
    }

    #[test]
    fn a_bad_server_name_is_a_clear_error() {
        let err = connect(
            "no-such-server",
            WorkerRole::Target,
            0,
            Duration::from_secs(1),
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("no-such-server"), "{err}");
    }
}
