//! The target worker: claims planned batches through the ring, runs the target forward into the
//! slot, and publishes. See `run`.

pub mod data;
