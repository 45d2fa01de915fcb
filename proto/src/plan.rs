//! The batch plan: a contract between the launcher and every target.
//!
//! Planned batch `i` is work item `i` of the ring: the launcher sizes the ring's work table by
//! the plan's length, and targets claim items by index, so every process must compute the same
//! plan. It depends only on the samples' lengths (in dataset order) and the config: samples are
//! grouped by length class (bucket), shuffled within each class, packed greedily under the
//! token budget, and the batches shuffled so early work is not all one length; both shuffles
//! draw from one xoshiro256++ stream seeded by `data.seed`, buckets in order. Processes read the lengths from the memory-mapped prepared dataset (the list
//! offsets alone), so computing the plan never touches a token.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::PipelineConfig;

/// The plan's version: bumped whenever [`plan`] gives other batches for the same lengths and
/// config (1: hand-written SplitMix64 shuffles, until 2026-11-30; 2: `rand` 0.8's shuffle on
/// xoshiro256++; 3: `rand` 0.10's shuffle, which draws its indices differently, from 2026-12-01). A
/// run directory records the version it was planned with (`RunDir::plan_version`), and a
/// resume refuses another: the ledgers name batches by their index in the plan.
pub const PLAN_VERSION: u32 = 3;

/// One planned batch: samples of one length class, within the token budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedBatch {
    pub sample_ids: Vec<u64>,
    pub bucket: u32,
    pub tokens: u64,
}

/// The batch plan for samples of these lengths (sample id = index). Identical in every process
/// for the same lengths and config.
pub fn plan(lengths: &[u32], cfg: &PipelineConfig) -> Vec<PlannedBatch> {
    let buckets = cfg.ring.buckets.max(1);
    let budget = u64::from(cfg.target.token_budget);
    let mut by_bucket: Vec<Vec<u64>> = vec![Vec::new(); buckets as usize];
    for (id, &len) in lengths.iter().enumerate() {
        by_bucket[cfg.bucket_of(len) as usize].push(id as u64);
    }
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.data.seed);
    let mut out = Vec::new();
    for (b, mut ids) in by_bucket.into_iter().enumerate() {
        // Batches mix samples from across the dataset.
        ids.shuffle(&mut rng);
        let new = || PlannedBatch {
            sample_ids: Vec::new(),
            bucket: b as u32,
            tokens: 0,
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
    out.shuffle(&mut rng);
    out
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
}
