//! Launcher: one process per GPU, supervision and restart, signals, monitor, summary.
//!
//! Not built yet: this crate is a placeholder in the workspace layout of DESIGN.md §2 and is
//! filled by a later issue.
