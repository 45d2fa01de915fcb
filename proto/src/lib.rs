//! Hidden-state batch layout, checksums, control messages and the pipeline config.
//!
//! Not built yet: this crate is a placeholder in the workspace layout of DESIGN.md §2 and is
//! filled by a later issue.
