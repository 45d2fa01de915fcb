//! The take policy's choices: which bucket a bucketed take serves, and the seeded generator
//! that picks within it. Per consumer, never shared.

use crate::params::BucketPick;

/// Per-consumer state of the take policy (not shared).
#[derive(Clone, Debug)]
pub(crate) struct TakeState {
    pub next_bucket: u32,
    pub rng: SplitMix64,
}

impl TakeState {
    pub(crate) fn new(seed: u64, id: u32) -> Self {
        TakeState {
            next_bucket: 0,
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
        BucketPick::Proportional => {
            let total: u32 = per_bucket.iter().sum();
            let mut r = st.rng.below(total);
            for (b, &c) in per_bucket.iter().enumerate() {
                if r < c {
                    return b as u32;
                }
                r -= c;
            }
            0
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
