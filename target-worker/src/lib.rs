//! Target worker: dataset claims, length-bucketed batches, forward, publish into the ring.
//!
//! Not built yet: this crate is a placeholder in the workspace layout of DESIGN.md §2 and is
//! filled by a later issue.
