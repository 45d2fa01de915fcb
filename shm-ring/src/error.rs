//! Everything the ring can refuse, as one typed error naming the ring, slot, worker or value at
//! fault.

use crate::params::ConfigError;
use crate::worker::WorkerName;

/// Everything the ring can refuse, naming what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("invalid ring name {name:?}: {why}")]
    InvalidName { name: String, why: &'static str },
    #[error("ring parameters: {0}")]
    Config(#[from] ConfigError),
    #[error("ring {name:?} already exists in /dev/shm (a live run, or a stale one: see `shm-ring-stat --list` and `--gc`)")]
    Exists { name: String },
    #[error("ring {name:?} not found in /dev/shm")]
    NotFound { name: String },
    #[error("permission denied opening ring {name:?}")]
    PermissionDenied { name: String },
    #[error("ring {name:?} belongs to uid {owner}, not to this user (uid {me})")]
    ForeignOwner { name: String, owner: u32, me: u32 },
    #[error("/dev/shm has {available} bytes free but ring {name:?} needs {needed}: enlarge /dev/shm (mount -o remount,size=...) or use fewer or smaller slots")]
    ShmTooSmall {
        name: String,
        needed: u64,
        available: u64,
    },
    #[error("{name:?} is not an hspipe ring (magic {found:#x})")]
    BadMagic { name: String, found: u64 },
    #[error("ring {name:?} has layout version {found}, this program reads version {expected}")]
    VersionMismatch {
        name: String,
        found: u32,
        expected: u32,
    },
    #[error("ring {name:?} is corrupt or truncated: {what}")]
    Corrupt { name: String, what: String },
    /// What a creator killed inside `Ring::create` leaves (or one creating it now shows): the
    /// segment made but its header never published.
    #[error("ring {name:?} was never initialised: {what}")]
    Uninitialised { name: String, what: &'static str },
    #[error("{op} ring {name:?}: {cause}")]
    Io {
        op: &'static str,
        name: String,
        cause: std::io::Error,
    },
    #[error("payload of {len} bytes does not fit a slot of {slot_size} bytes")]
    PayloadTooLarge { len: u64, slot_size: u64 },
    #[error("bucket {bucket} is out of range: the ring has {buckets} buckets")]
    BadBucket { bucket: u32, buckets: u32 },
    #[error("{id} does not exist: the ring has {producers} producers and {consumers} consumers")]
    NoSuchWorker {
        id: WorkerName,
        producers: u32,
        consumers: u32,
    },
    #[error("{id} is already registered by live process {pid}")]
    WorkerBusy { id: WorkerName, pid: u32 },
    #[error("cannot recover {id}: it is registered by process {pid}, which is still running (recover a worker only once its process has exited)")]
    WorkerAlive { id: WorkerName, pid: u32 },
    #[error("process id {pid} does not fit the ring's lease word (Linux pids are below 2^22)")]
    UnsupportedPid { pid: u32 },
    #[error("slot {slot} already carries work item {item}: one work item per slot")]
    SlotCarriesWork { slot: usize, item: u64 },
    #[error("ring {name:?} has mode {mode:03o}: group or other users may open it, so its contents cannot be trusted (hspipe rings are 0600)")]
    InsecureMode { name: String, mode: u32 },
    #[error("ring {name:?} was created in another {what}: its workers' liveness cannot be judged from here")]
    ForeignNamespace { name: String, what: &'static str },
    #[error(
        "this consumer already holds {held} item(s), the most the ring allows (held_per_consumer)"
    )]
    TooManyHeld { held: u32 },
    #[error("the ring is closed: every producer has finished")]
    Closed,
    #[error("this producer has already finished")]
    Finished,
    #[error("slot {slot} was reclaimed by recovery: this worker was declared dead")]
    Reclaimed { slot: usize },
    #[error("work item {item} does not exist: the ring has {items}")]
    NoSuchWorkItem { item: u64, items: u64 },
    #[error("work item {item} is not claimed by this producer")]
    NotClaimed { item: u64 },
    #[error("the ring was attached read-only")]
    ReadOnly,
}
