//! Where a worker's time goes: the phases of the telemetry in the segment, and [`PhaseMap`],
//! one value per phase, indexed by the enum so that a wrong phase does not compile.

use enum_map::{Enum, EnumMap};
use serde::{Deserialize, Serialize};

use crate::layout::PHASES;

/// Where a worker's time goes. Waits are recorded by the ring itself; workers record the rest.
/// The serde names (`wait_full`, ...) are the keys of `--json` and `metrics.jsonl`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Enum,
)]
#[serde(rename_all = "snake_case")]
#[repr(usize)]
pub enum Phase {
    /// A producer waiting for a free slot: the ring was full.
    WaitFull = 0,
    /// A consumer waiting for an item: the ring was empty or below `min_ready`.
    WaitEmpty = 1,
    /// Reading or preparing input (a target's dataset work).
    Load = 2,
    /// Moving data between host and device.
    CopyIn = 3,
    /// Model forward or train step.
    Compute = 4,
    /// Synchronisation with peers (e.g. gradient all-reduce).
    Sync = 5,
    /// Writing checkpoints and ledgers.
    Checkpoint = 6,
    /// Everything else the worker spends time on.
    Other = 7,
}

/// One value per phase (time in nanoseconds, or shares of an interval). Serialised as a map
/// from the phases' names.
pub type PhaseMap<V> = EnumMap<Phase, V>;

impl Phase {
    pub const ALL: [Phase; PHASES] = [
        Phase::WaitFull,
        Phase::WaitEmpty,
        Phase::Load,
        Phase::CopyIn,
        Phase::Compute,
        Phase::Sync,
        Phase::Checkpoint,
        Phase::Other,
    ];

    /// The name in JSON output and on screens (the serde name).
    pub fn name(self) -> &'static str {
        match self {
            Phase::WaitFull => "wait_full",
            Phase::WaitEmpty => "wait_empty",
            Phase::Load => "load",
            Phase::CopyIn => "copy_in",
            Phase::Compute => "compute",
            Phase::Sync => "sync",
            Phase::Checkpoint => "checkpoint",
            Phase::Other => "other",
        }
    }

    /// True for the phases in which the worker waits on the ring rather than working.
    pub fn is_wait(self) -> bool {
        matches!(self, Phase::WaitFull | Phase::WaitEmpty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_once_in_order_and_named_as_serde_names_it() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i);
            assert_eq!(p.into_usize(), i);
            assert_eq!(
                serde_json::to_string(p).unwrap(),
                format!("\"{}\"", p.name())
            );
        }
    }

    #[test]
    fn a_phase_map_is_a_json_map_by_phase_name() {
        let mut m = PhaseMap::<u64>::default();
        m[Phase::Sync] = 7;
        let json = serde_json::to_value(m).unwrap();
        assert_eq!(json["sync"], 7);
        assert_eq!(json["wait_full"], 0);
        let back: PhaseMap<u64> = serde_json::from_value(json).unwrap();
        assert_eq!(back, m);
    }
}
