//! What hspipe's processes agree on: the hidden-state batch layout inside a ring slot (written
//! and read in place, checksummed), the batch plan, the pipeline config, the launcher ↔ worker
//! control messages, the stop signals and exit codes (`stop`), the checkpoint format, and the step
//! a drafter of the user's own says its saved weights hold (`checkpointed`). How a
//! worker process runs (its flags, logging, signal handlers) is not a contract: that is the
//! `worker-runtime` crate.

pub mod batch;
pub mod checkpointed;
pub mod config;
pub mod control;
pub mod jsonl;
pub mod ledger;
pub mod plan;
pub mod run_dir;
pub mod stop;

pub use batch::{
    batch_len, BatchError, BatchHeader, BatchSpec, BatchView, BatchWriter, Dtype, Section,
    SectionsMut, ALIGN, BATCH_VERSION,
};
pub use config::{ConfigError, PipelineConfig, TooLong};
pub use ledger::LedgerLine;
pub use run_dir::{GpuLists, RunDir, RunDirError, RUN_DIR_RING_FILE};
/// A worker's name (`target-3`): the `[faults.*]` keys, file names and messages use it.
pub use shm_ring::{Role, WorkerName};

/// The drafter group's shared-memory segment of the run whose ring is `ring` (the launcher
/// creates it; drafters attach to it by this name).
pub fn group_segment(ring: &str) -> String {
    format!("{ring}-group")
}
