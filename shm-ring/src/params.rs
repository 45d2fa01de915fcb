//! Ring parameters, the take policy, and the validation that refuses combinations that can
//! deadlock.

use serde::{Deserialize, Serialize};

/// The most workers one ring can have. A worker id is an owner in the slot state word and in
/// the work word (`layout.rs` asserts it fits both); the limits live here, with the validation,
/// so the layout depends on the parameters and not the other way.
pub const MAX_WORKERS: u32 = 1 << 10;
/// Most slots in one ring. A take scans every slot, which is cheap at this size.
pub const MAX_SLOTS: u32 = 1024;
/// Most length buckets.
pub const MAX_BUCKETS: u32 = 64;
/// Most work items (8 bytes each in the segment).
pub const MAX_WORK_ITEMS: u64 = 1 << 26;

/// How a consumer chooses among READY items.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TakePolicy {
    /// The oldest publish ticket among the READY items one scan sees; every item committed
    /// before the take began is seen. Tickets are drawn just before a commit, so across
    /// concurrent producers the order is approximate: a commit that lands during a take's scan
    /// can be passed over for a younger item, and a ticket drawn early can be committed late.
    Fifo,
    /// Serve only once `min_ready` items are READY (waived once the ring is closed), then choose a
    /// bucket by `pick` and a random item in it (seeded per consumer): more diverse batches and
    /// less padding than FIFO, as the predecessor found.
    Bucketed { min_ready: u32, pick: BucketPick },
}

/// Which non-empty bucket a bucketed take serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BucketPick {
    /// Buckets in proportion to their READY items (smooth weighted round-robin, per consumer):
    /// the trained mix of lengths follows the published mix, so no length class piles up in
    /// the ring and trains late in the run. The default.
    Proportional,
    /// The next non-empty bucket after the one this consumer served last. Serves buckets
    /// equally while they fill unequally: the common lengths pile up and train late.
    RoundRobin,
    /// The bucket with the most READY items.
    Fullest,
}

impl TakePolicy {
    /// The predecessor's settled depth (bucketed, `min_ready` 10), with buckets chosen in
    /// proportion to what is READY (its round-robin biased the order of lengths; see
    /// BENCHMARKS.md, "Length drift").
    pub const DEFAULT_BUCKETED: TakePolicy = TakePolicy::Bucketed {
        min_ready: 10,
        pick: BucketPick::Proportional,
    };
}

/// Everything fixed at ring creation. Stored in the segment header so every attacher and
/// `shm-ring-stat` sees the same values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingParams {
    /// Number of payload slots.
    pub slots: u32,
    /// Payload bytes of one slot (hspipe's one name for it: `slot_size`, also in JSON; the
    /// config file's key is `ring.slot_bytes`); the mapping rounds it up to whole pages.
    pub slot_size: u64,
    /// Number of length buckets an item can be filed under.
    pub buckets: u32,
    /// Producers to expect: the ring closes when this many have finished.
    pub producers: u32,
    /// Consumers that will attach.
    pub consumers: u32,
    /// Items one consumer may hold (taken, not yet released) at a time.
    pub held_per_consumer: u32,
    pub policy: TakePolicy,
    /// Seed of the consumers' random choice within a bucket.
    pub seed: u64,
    /// Units of work (e.g. planned batches) producers claim through the ring, so that faster
    /// producers take more and a dead producer's claims are redone. 0: no work table.
    #[serde(default)]
    pub work_items: u64,
}

#[cfg(test)]
impl RingParams {
    /// The smallest valid ring, for unit tests: one producer, one consumer, two 64-byte slots.
    pub(crate) fn tiny_fifo() -> RingParams {
        RingParams {
            slots: 2,
            slot_size: 64,
            buckets: 1,
            producers: 1,
            consumers: 1,
            held_per_consumer: 1,
            policy: TakePolicy::Fifo,
            seed: 1,
            work_items: 0,
        }
    }
}

impl Default for RingParams {
    fn default() -> Self {
        RingParams {
            slots: 60,
            slot_size: 1 << 20,
            buckets: 6,
            producers: 5,
            consumers: 3,
            held_per_consumer: 1,
            policy: TakePolicy::DEFAULT_BUCKETED,
            seed: 0x5eed,
            work_items: 0,
        }
    }
}

/// A parameter set the ring refuses, with the reason in words.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("slots must be between 1 and {MAX_SLOTS}, got {0}")]
    Slots(u32),
    #[error("slot_size must be at least 1 byte")]
    SlotSize,
    #[error("buckets must be between 1 and {MAX_BUCKETS}, got {0}")]
    Buckets(u32),
    #[error("producers and consumers must each be at least 1 and together at most {MAX_WORKERS}, got {producers} producers and {consumers} consumers")]
    Workers { producers: u32, consumers: u32 },
    #[error("held_per_consumer must be at least 1")]
    Held,
    #[error(
        "min_ready must be at least 1 for the bucketed policy (use fifo to serve items one by one)"
    )]
    MinReadyZero,
    #[error(
        "{slots} slots can deadlock with min_ready {min_ready}: when each of {consumers} consumers holds {held} item(s) \
         and each of {producers} producers is mid-write, fewer than min_ready slots are left to fill, so consumers would \
         wait for items that can never be published; need slots >= min_ready + producers + consumers x held = {needed}"
    )]
    Deadlock {
        slots: u32,
        min_ready: u32,
        producers: u32,
        consumers: u32,
        held: u32,
        needed: u64,
    },
    #[error("work_items must be at most {MAX_WORK_ITEMS}, got {0}: claim larger units of work")]
    WorkItems(u64),
    #[error("ring of {slots} slots x {slot_size} bytes is too large to map")]
    TooLarge { slots: u32, slot_size: u64 },
}

pub(crate) const PAGE: u64 = 4096;

impl RingParams {
    /// Checks the parameters; the error says which one is wrong and why.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(ConfigError::Slots(self.slots));
        }
        if self.slot_size == 0 {
            return Err(ConfigError::SlotSize);
        }
        if self.buckets == 0 || self.buckets > MAX_BUCKETS {
            return Err(ConfigError::Buckets(self.buckets));
        }
        let workers = u64::from(self.producers) + u64::from(self.consumers);
        if self.producers == 0 || self.consumers == 0 || workers > u64::from(MAX_WORKERS) {
            return Err(ConfigError::Workers {
                producers: self.producers,
                consumers: self.consumers,
            });
        }
        if self.held_per_consumer == 0 {
            return Err(ConfigError::Held);
        }
        if let TakePolicy::Bucketed { min_ready, .. } = self.policy {
            if min_ready == 0 {
                return Err(ConfigError::MinReadyZero);
            }
            let needed = u64::from(min_ready)
                + u64::from(self.producers)
                + u64::from(self.consumers) * u64::from(self.held_per_consumer);
            if u64::from(self.slots) < needed {
                return Err(ConfigError::Deadlock {
                    slots: self.slots,
                    min_ready,
                    producers: self.producers,
                    consumers: self.consumers,
                    held: self.held_per_consumer,
                    needed,
                });
            }
        }
        if self.work_items > MAX_WORK_ITEMS {
            return Err(ConfigError::WorkItems(self.work_items));
        }
        self.slot_stride()
            .checked_mul(u64::from(self.slots))
            .filter(|&b| b <= isize::MAX as u64 / 2)
            .ok_or(ConfigError::TooLarge {
                slots: self.slots,
                slot_size: self.slot_size,
            })?;
        Ok(())
    }

    /// Bytes between the starts of two payload slots: the slot size rounded up to whole pages.
    pub fn slot_stride(&self) -> u64 {
        self.slot_size.div_ceil(PAGE).saturating_mul(PAGE)
    }

    pub(crate) fn workers(&self) -> u32 {
        self.producers + self.consumers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        RingParams::default().validate().unwrap();
    }

    #[test]
    fn deadlocking_min_ready_is_refused_with_the_arithmetic() {
        let p = RingParams {
            slots: 12,
            policy: TakePolicy::DEFAULT_BUCKETED,
            producers: 5,
            consumers: 3,
            ..RingParams::default()
        };
        let err = p.validate().unwrap_err();
        assert_eq!(
            err,
            ConfigError::Deadlock {
                slots: 12,
                min_ready: 10,
                producers: 5,
                consumers: 3,
                held: 1,
                needed: 18
            }
        );
        assert!(err
            .to_string()
            .contains("need slots >= min_ready + producers + consumers x held = 18"));
        // The same slot count is fine under FIFO, which serves items one by one.
        RingParams {
            policy: TakePolicy::Fifo,
            ..p
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn each_bad_field_is_named() {
        let ok = RingParams::default();
        let cases = [
            (RingParams { slots: 0, ..ok }, "slots"),
            (RingParams { slots: 5000, ..ok }, "slots"),
            (RingParams { slot_size: 0, ..ok }, "slot_size"),
            (RingParams { buckets: 0, ..ok }, "buckets"),
            (RingParams { buckets: 65, ..ok }, "buckets"),
            (RingParams { producers: 0, ..ok }, "producers"),
            (
                RingParams {
                    held_per_consumer: 0,
                    ..ok
                },
                "held_per_consumer",
            ),
            (
                RingParams {
                    policy: TakePolicy::Bucketed {
                        min_ready: 0,
                        pick: BucketPick::RoundRobin,
                    },
                    ..ok
                },
                "min_ready",
            ),
            (
                RingParams {
                    slot_size: u64::MAX / 2,
                    ..ok
                },
                "too large",
            ),
        ];
        for (p, word) in cases {
            let msg = p.validate().unwrap_err().to_string();
            assert!(msg.contains(word), "{msg:?} should name {word}");
        }
    }

    #[test]
    fn slots_are_page_aligned() {
        let p = RingParams {
            slot_size: 4097,
            ..RingParams::default()
        };
        assert_eq!(p.slot_stride(), 8192);
    }
}
