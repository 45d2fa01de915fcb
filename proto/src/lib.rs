//! What hspipe's processes agree on: the hidden-state batch layout inside a ring slot (written
//! and read in place, checksummed), and — with the workers issue — the pipeline config and the
//! launcher ↔ worker control messages.

pub mod atomic_file;
pub mod batch;
pub mod config;
pub mod control;
pub mod plan;
pub mod safetensors;
pub mod worker;

pub use batch::{
    batch_len, BatchError, BatchHeader, BatchSpec, BatchView, BatchWriter, Dtype, Section, ALIGN,
    BATCH_VERSION,
};
pub use config::{ConfigError, PipelineConfig};
/// A worker's name (`target-3`): the `[faults.*]` keys, file names and messages use it.
pub use shm_ring::{Role, WorkerName};

/// The drafter group's shared-memory segment of the run whose ring is `ring` (the launcher
/// creates it; drafters attach to it by this name).
pub fn group_segment(ring: &str) -> String {
    format!("{ring}-group")
}
