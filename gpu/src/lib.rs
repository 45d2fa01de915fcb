//! Compute backends: mock (CPU, deterministic, fault injection) and later cuda.
//!
//! Not built yet: this crate is a placeholder in the workspace layout of DESIGN.md §2 and is
//! filled by a later issue.
