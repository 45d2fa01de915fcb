//! The take policy's choices: which bucket a bucketed take serves, and the seeded generator
//! that picks within it. Per consumer, never shared.

use crate::params::{BucketPick, MAX_BUCKETS};

/// Per-consumer state of the take policy (not shared).
#[derive(Clone, Debug)]
pub(crate) struct TakeState {
    pub next_bucket: u32,
    /// Smooth weighted round-robin credits of the proportional pick, per bucket.
    pub credit: [i64; MAX_BUCKETS as usize],
    pub rng: SplitMix64,
}

impl TakeState {
    pub(crate) fn new(seed: u64, id: u32) -> Self {
        TakeState {
            next_bucket: 0,
            credit: [0; MAX_BUCKETS as usize],
            rng: SplitMix64(seed ^ (u64::from(id) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        }
    }
}

/// A small seeded generator; the choice within a bucket needs spread, not cryptography.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % u64::from(n.max(1))) as u32
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
