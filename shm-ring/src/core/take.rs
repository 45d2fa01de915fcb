//! The take policy's choices: which bucket a bucketed take serves, and the seeded generator
//! that picks within it. Per consumer, never shared.

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::params::{BucketPick, MAX_BUCKETS};

/// Per-consumer state of the take policy (not shared).
#[derive(Clone, Debug)]
pub(crate) struct TakeState {
    pub next_bucket: u32,
    /// Smooth weighted round-robin credits of the proportional pick, per bucket.
    pub credit: [i64; MAX_BUCKETS as usize],
    /// Picks the item within a bucket: the choice needs spread, not cryptography.
    pub rng: Xoshiro256PlusPlus,
}

impl TakeState {
    /// Worker `id`'s state under the ring's `seed`: the seed's xoshiro stream, jumped `id`
    /// times (2^128 draws each), so consumers draw from non-overlapping streams.
    pub(crate) fn new(seed: u64, id: u32) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        for _ in 0..id {
            rng.jump();
        }
        TakeState {
            next_bucket: 0,
            credit: [0; MAX_BUCKETS as usize],
            rng,
        }
    }

    /// A uniform index below `n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u32) -> u32 {
        self.rng.random_range(0..n.max(1))
    }
}

pub(crate) fn choose_bucket(per_bucket: &[u32], pick: BucketPick, st: &mut TakeState) -> u32 {
    let n = per_bucket.len() as u32;
    match pick {
        // Smooth weighted round-robin (nginx's), the weights being the READY counts: every
        // bucket gains its weight in credit, the richest non-empty one is served and pays the
        // total. Over any stretch each bucket is served in proportion to what waits in it, like
        // a random draw by those weights, without the draw's noise; a bucket with one READY
        // item among many still comes up, so nothing starves.
        BucketPick::Proportional => {
            let total: i64 = per_bucket.iter().map(|&c| i64::from(c)).sum();
            let mut best: Option<usize> = None;
            for (b, &c) in per_bucket.iter().enumerate() {
                if c == 0 {
                    continue;
                }
                st.credit[b] += i64::from(c);
                if best.is_none_or(|x| st.credit[b] > st.credit[x]) {
                    best = Some(b);
                }
            }
            let Some(b) = best else { return 0 };
            st.credit[b] -= total;
            b as u32
        }
        BucketPick::RoundRobin => {
            for k in 0..n {
                let b = (st.next_bucket + k) % n;
                if per_bucket[b as usize] > 0 {
                    st.next_bucket = (b + 1) % n;
                    return b;
                }
            }
            0
        }
        BucketPick::Fullest => (0..n).max_by_key(|&b| per_bucket[b as usize]).unwrap_or(0),
    }
}
