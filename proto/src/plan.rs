//! The batch plan: a contract between the launcher and every target.
//!
//! Planned batch `i` is work item `i` of the ring: the launcher sizes the ring's work table by
//! the plan's length, and targets claim items by index, so every process must compute the same
//! plan. It depends only on the samples' lengths (in dataset order) and the config: samples are
//! grouped by length class (bucket), shuffled within each class, packed greedily under the
//! token budget, and the batches shuffled so early work is not all one length; both shuffles
//! draw from one xoshiro256++ stream seeded by `data.seed`, buckets in order. Processes read the
//! lengths from the memory-mapped prepared dataset (the list offsets alone), so computing the
//! plan never touches a token.
//!
//! Epochs (`data.epochs`): the plan is one such pass per epoch, laid end to end, so every sample
//! is in exactly one batch of each epoch and a batch's epoch follows from its index
//! ([`Epochs`]). Epoch `e` draws from the seed's stream long-jumped `e` times (2^192 draws
//! apart), so each epoch is ordered and packed differently and epoch 0 is exactly the plan of a
//! one-epoch run: adding epochs did not change `PLAN_VERSION`. Targets claim work items in
//! index order, so the epochs are trained in order, overlapping only by the batches in flight.

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::PipelineConfig;

/// The plan's version: bumped whenever [`plan`] gives other batches for the same lengths and
/// config (1: hand-written SplitMix64 shuffles, until 2026-11-30; 2: `rand` 0.8's shuffle on
/// xoshiro256++; 3: `rand` 0.10's shuffle, which draws its indices differently, from 2026-12-01). A
/// run directory records the version it was planned with (`RunDir::plan_version`), and a
/// resume refuses another: the ledgers name batches by their index in the plan. `data.epochs`
/// left it at 3: a one-epoch plan, and every plan's epoch 0, is what version 3 computed.
pub const PLAN_VERSION: u32 = 3;

/// A plan's fingerprint, recorded in the run directory when the run starts: a resume whose
/// config and data plan other batches (an edited or truncated `config.toml`) is refused, since
/// the ledgers name batches by their index in the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanDigest {
    pub batches: u64,
    /// CRC-32C of every batch's epoch, bucket and sample ids, in plan order.
    pub crc: u32,
}

impl PlanDigest {
    pub fn of(planned: &[PlannedBatch]) -> PlanDigest {
        let mut crc = 0;
        for b in planned {
            let head = [
                u64::from(b.epoch),
                u64::from(b.bucket),
                b.sample_ids.len() as u64,
            ];
            for x in head.iter().chain(&b.sample_ids) {
                crc = crc32c::crc32c_append(crc, &x.to_le_bytes());
            }
        }
        PlanDigest {
            batches: planned.len() as u64,
            crc,
        }
    }
}

impl std::fmt::Display for PlanDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} batches, crc {:08x}", self.batches, self.crc)
    }
}

/// The config's fields that decide the plan, by name, with their values as the config writes
/// them: recorded beside the plan's fingerprint when a run starts, so that a resume refused
/// for another plan names the field an edit of `config.toml` changed (and its old value, which
/// the edit overwrote). The data's content decides it too, and is no field.
pub fn plan_fields(cfg: &PipelineConfig) -> BTreeMap<String, String> {
    let d = &cfg.data;
    // The synthetic count only plans a synthetic run: a file's samples are its own.
    let (path, samples) = match d.path.as_deref() {
        Some(p) => (p.display().to_string(), None),
        None => ("none".to_string(), Some(d.synthetic_samples.to_string())),
    };
    [
        ("data.path", Some(path)),
        ("data.synthetic_samples", samples),
        ("data.min_len", Some(d.min_len.to_string())),
        ("data.max_len", Some(d.max_len.to_string())),
        ("data.seed", Some(d.seed.to_string())),
        ("data.epochs", Some(d.epochs.to_string())),
        ("ring.buckets", Some(cfg.ring.buckets.to_string())),
        (
            "target.token_budget",
            Some(cfg.target.token_budget.to_string()),
        ),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k.to_string(), v?)))
    .collect()
}

/// One planned batch: samples of one length class, within the token budget, in one epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedBatch {
    pub sample_ids: Vec<u64>,
    pub bucket: u32,
    pub tokens: u64,
    /// The pass over the data it belongs to (0-based).
    pub epoch: u32,
}

/// The batch plan for samples of these lengths (sample id = index): `data.epochs` passes, epoch
/// by epoch. Identical in every process for the same lengths and config.
pub fn plan(lengths: &[u32], cfg: &PipelineConfig) -> Vec<PlannedBatch> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.data.seed);
    let mut out = Vec::new();
    for epoch in 0..cfg.data.epochs.max(1) {
        // Each epoch from its own stream; the clone keeps the base stream for the next epoch.
        out.extend(plan_epoch(lengths, cfg, epoch, &mut rng.clone()));
        rng.long_jump();
    }
    out
}

/// One pass over the samples, drawing from `rng`.
fn plan_epoch(
    lengths: &[u32],
    cfg: &PipelineConfig,
    epoch: u32,
    rng: &mut Xoshiro256PlusPlus,
) -> Vec<PlannedBatch> {
    let buckets = cfg.ring.buckets.max(1);
    let budget = u64::from(cfg.target.token_budget);
    let mut by_bucket: Vec<Vec<u64>> = vec![Vec::new(); buckets as usize];
    for (id, &len) in lengths.iter().enumerate() {
        by_bucket[cfg.bucket_of(len) as usize].push(id as u64);
    }
    let mut out = Vec::new();
    for (b, mut ids) in by_bucket.into_iter().enumerate() {
        // Batches mix samples from across the dataset.
        ids.shuffle(rng);
        let new = || PlannedBatch {
            sample_ids: Vec::new(),
            bucket: b as u32,
            tokens: 0,
            epoch,
        };
        let mut cur = new();
        for id in ids {
            let len = u64::from(lengths[id as usize]);
            if !cur.sample_ids.is_empty() && cur.tokens + len > budget {
                out.push(std::mem::replace(&mut cur, new()));
            }
            cur.sample_ids.push(id);
            cur.tokens += len;
        }
        if !cur.sample_ids.is_empty() {
            out.push(cur);
        }
    }
    out.shuffle(rng);
    out
}

/// Which epoch each planned batch belongs to, from the plan's index alone (ledger lines name
/// batches by index): epoch `e` is batches `starts[e]..starts[e + 1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Epochs {
    starts: Vec<u64>,
}

impl Epochs {
    /// The epochs of `plan` (as [`plan`] lays them out, epoch by epoch).
    pub fn of(plan: &[PlannedBatch]) -> Epochs {
        let mut starts = vec![0];
        for (i, w) in plan.windows(2).enumerate() {
            if w[1].epoch != w[0].epoch {
                starts.push(i as u64 + 1);
            }
        }
        Epochs { starts }
    }

    /// One epoch holding every batch.
    pub fn one() -> Epochs {
        Epochs { starts: vec![0] }
    }

    /// How many epochs the plan has.
    pub fn count(&self) -> u32 {
        self.starts.len() as u32
    }

    /// The epoch of planned batch `batch_id` (a batch past the plan counts in the last epoch).
    pub fn of_batch(&self, batch_id: u64) -> u32 {
        (self.starts.partition_point(|&s| s <= batch_id) - 1) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataset::mix;

    #[test]
    fn the_plan_covers_every_sample_once_within_budget_and_bucket() {
        let c = PipelineConfig::default();
        let lens: Vec<u32> = (0..1000u64).map(|i| 32 + (mix(i) % 4000) as u32).collect();
        let p = plan(&lens, &c);
        assert_eq!(p, plan(&lens, &c), "deterministic");
        let mut ids: Vec<u64> = p.iter().flat_map(|b| b.sample_ids.clone()).collect();
        ids.sort();
        assert_eq!(ids, (0..1000).collect::<Vec<_>>());
        for b in &p {
            assert!(b.tokens <= u64::from(c.target.token_budget));
            for &id in &b.sample_ids {
                assert_eq!(c.bucket_of(lens[id as usize]), b.bucket);
            }
        }
    }

    /// The plan is a contract between processes and across versions: a run resumed by a newer
    /// build must plan as the old one did. Pinned to the plan of rand 0.10's shuffle on
    /// xoshiro256++ (issue #22): each move of the shuffles moved every seeded plan once, and
    /// `PLAN_VERSION` with it, so a run started by an earlier build (version 1, the
    /// hand-written SplitMix64 Fisher-Yates, digest 0xfeae_d1f0_e20f_7e4c; version 2, rand
    /// 0.8's shuffle, 16 batches, digest 0x3b9f_3175_7531_a481) cannot be resumed by this one.
    #[test]
    fn the_plan_is_the_one_every_earlier_build_computed() {
        let mut c = PipelineConfig::default();
        c.target.token_budget = 300;
        let lens: Vec<u32> = (0..40u64).map(|i| 1 + (mix(i) % 200) as u32).collect();
        let p = plan(&lens, &c);
        let digest = p.iter().fold(0u64, |h, b| {
            b.sample_ids.iter().fold(
                mix(h ^ u64::from(b.bucket) ^ b.tokens),
                |h, &id| mix(h ^ id),
            )
        });
        assert_eq!((p.len(), digest), (PINNED_LEN, PINNED_DIGEST));
    }
    const PINNED_LEN: usize = 15;
    const PINNED_DIGEST: u64 = 0x8694_a7cc_6610_ec62;

    /// `data.epochs = 3`: each epoch covers every sample once within budget and bucket, epoch 0
    /// is the one-epoch plan (so a run planned before epochs existed resumes unchanged), the
    /// epochs are ordered and packed differently, and `Epochs` maps each index to its epoch.
    #[test]
    fn each_epoch_covers_every_sample_once_in_its_own_order() {
        let mut c = PipelineConfig::default();
        let lens: Vec<u32> = (0..1000u64).map(|i| 32 + (mix(i) % 4000) as u32).collect();
        let one = plan(&lens, &c);
        c.data.epochs = 3;
        let p = plan(&lens, &c);
        assert_eq!(p, plan(&lens, &c), "deterministic");
        let epochs = Epochs::of(&p);
        assert_eq!(epochs.count(), 3);
        let mut orders = Vec::new();
        for e in 0..3 {
            let batches: Vec<&PlannedBatch> = p.iter().filter(|b| b.epoch == e).collect();
            let mut ids: Vec<u64> = batches.iter().flat_map(|b| b.sample_ids.clone()).collect();
            orders.push(ids.clone());
            ids.sort();
            assert_eq!(ids, (0..1000).collect::<Vec<_>>(), "epoch {e}");
            for b in &batches {
                assert!(b.tokens <= u64::from(c.target.token_budget));
                for &id in &b.sample_ids {
                    assert_eq!(c.bucket_of(lens[id as usize]), b.bucket);
                }
            }
        }
        assert_eq!(&p[..one.len()], &one[..], "epoch 0 is the one-epoch plan");
        assert!(orders[0] != orders[1] && orders[1] != orders[2] && orders[0] != orders[2]);
        // Epochs are laid end to end: a batch's index alone gives its epoch.
        for (i, b) in p.iter().enumerate() {
            assert_eq!(epochs.of_batch(i as u64), b.epoch, "batch {i}");
        }
        assert_eq!(Epochs::of(&one), Epochs::one());
    }
}
