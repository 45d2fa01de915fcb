//! `ring-stat`: what an hspipe ring says about the run, for people and for the launcher.
//!
//! - [`analysis`]: rates over an interval, each worker's time by phase, and the verdict (the
//!   bottleneck, the worker at fault, stragglers, warnings) in hspipe's words: targets and
//!   drafters, a drafter group's `sync`. The launcher's monitor judges with the same
//!   [`analysis::Judge`], so its `metrics.jsonl` and `shm-ring-stat` say the same thing.
//! - [`report`]: one measurement (snapshot, interval, verdict), what the CLI prints and the
//!   screen draws.
//! - [`screen`]: the terminal screen of `shm-ring-stat` (live with `--watch`, or printed once).
//! - [`cli`]: the `shm-ring-stat` command line; `src/main.rs` only calls [`cli::main`].
//!
//! The ring itself (`shm-ring`) knows none of this: it only keeps the counters and the phase
//! times this crate reads through `Ring::snapshot`, which attaches read-only and never
//! disturbs the run.

pub mod analysis;
pub mod cli;
mod gc;
pub mod numbers;
pub mod report;
pub mod screen;

pub use report::{measure, Report};
