//! A built-in synthetic language with structure a model can learn and a drafter can exploit
//! several tokens ahead: a seeded sparse Markov chain of order 2 over [`ACTIVE`] ids of the
//! vocabulary.
//!
//! Each context (the previous token, and the class of the one before it, one of [`CLASSES`]) has
//! [`SUCCESSORS`] likely next tokens, drawn from a hash of the context and the seed (no table),
//! taken with the skewed probabilities [`WEIGHTS`]; with probability [`NOISE`] the next token is
//! instead uniform over the active ids. Tokens below `first` (a tokenizer's special tokens)
//! never occur. [`Language::entropy_bits`] is the exact entropy per token of that rule.
//!
//! Why so few contexts (`ACTIVE x CLASSES` = 1024): a model of hidden size 64 learns them in a
//! minute on two CPU cores, so `make-model --train` gives a target whose greedy text follows the
//! chain, and a drafter can learn the chain's next steps. A hash of the whole pair over the
//! whole vocabulary (a million contexts at 1024 ids) is beyond any model trained that briefly.

use crate::samples::mix;

/// Likely next tokens per context.
pub const SUCCESSORS: usize = 4;
/// Their probabilities, most likely first (before the noise is mixed in).
pub const WEIGHTS: [f64; SUCCESSORS] = [0.6, 0.25, 0.1, 0.05];
/// Probability that a token is uniform over the active ids instead.
pub const NOISE: f64 = 0.05;
/// Ids the language uses (from `first`), at most.
pub const ACTIVE: u32 = 256;
/// Classes of the earlier token of a context (its id modulo this).
pub const CLASSES: u32 = 4;
/// The seed of the one language every real-model run, `make-model --train` and `launcher eval`
/// use: a run's `data.seed` picks samples of it, never another language.
pub const SEED: u64 = 0x1a46_5eed;

/// The language over ids `first..vocab`, seeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Language {
    pub first: u32,
    pub vocab: u32,
    pub seed: u64,
}

/// Sample ids of held-out text, `HELD_OUT + i` (what `launcher eval` and a run's evaluations
/// prompt with): a run's samples are `mix(data.seed) ^ id`, `make-model --train`'s another stream.
pub const HELD_OUT: u64 = 1 << 40;

/// How often the likeliest successor comes: what a model that knows the chain scores as its
/// next-token accuracy.
pub fn likeliest_share() -> f64 {
    (1.0 - NOISE) * WEIGHTS[0] + NOISE / f64::from(ACTIVE)
}

/// `n` held-out prompts of `len` tokens of the one language over `vocab` ids.
pub fn held_out(vocab: u32, n: usize, len: u32) -> Vec<Vec<u32>> {
    let lang = Language::new(0, vocab, SEED);
    (0..n as u64)
        .map(|i| lang.sample(HELD_OUT + i, len))
        .collect()
}

impl Language {
    /// The language over `first..vocab` (at least `SUCCESSORS + 1` ids; the first [`ACTIVE`]
    /// of them used).
    pub fn new(first: u32, vocab: u32, seed: u64) -> Language {
        let vocab = vocab.max(first + SUCCESSORS as u32 + 1);
        Language { first, vocab, seed }
    }

    fn span(&self) -> u64 {
        u64::from((self.vocab - self.first).min(ACTIVE))
    }

    /// Successor `k` of the context `(a, b)` (`b` the latest token).
    pub fn successor(&self, a: u32, b: u32, k: usize) -> u32 {
        let h = mix(self.seed ^ mix(u64::from(a % CLASSES) << 32 | u64::from(b)) ^ (k as u64 + 1));
        self.first + (h % self.span()) as u32
    }

    /// The most likely next token after `(a, b)`.
    pub fn likeliest(&self, a: u32, b: u32) -> u32 {
        self.successor(a, b, 0)
    }

    /// Sample `id`'s `len` tokens: its first two uniform, then the chain. Seeded by the
    /// language's seed and `id` only.
    pub fn sample(&self, id: u64, len: u32) -> Vec<u32> {
        let mut state = mix(self.seed ^ mix(id ^ 0x1a4e));
        let mut next = || {
            state = mix(state);
            state
        };
        let mut out = Vec::with_capacity(len as usize);
        for i in 0..len as usize {
            let u = next();
            let tok = if i < 2 {
                self.first + (u % self.span()) as u32
            } else {
                // The top 53 bits as a uniform draw in [0, 1).
                let p = (u >> 11) as f64 / (1u64 << 53) as f64;
                if p < NOISE {
                    self.first + (next() % self.span()) as u32
                } else {
                    let mut x = (p - NOISE) / (1.0 - NOISE);
                    let mut k = SUCCESSORS - 1;
                    for (j, w) in WEIGHTS.iter().enumerate() {
                        if x < *w {
                            k = j;
                            break;
                        }
                        x -= w;
                    }
                    self.successor(out[i - 2], out[i - 1], k)
                }
            };
            out.push(tok);
        }
        out
    }

    /// Entropy per token, in bits, of the rule (past the first two tokens; successors of a
    /// context taken as distinct, which they are but for rare hash collisions).
    pub fn entropy_bits(&self) -> f64 {
        let n = self.span() as f64;
        let uniform = NOISE / n;
        let mut h = 0.0;
        for w in WEIGHTS {
            let p = (1.0 - NOISE) * w + uniform;
            h -= p * p.log2();
        }
        let rest = n - SUCCESSORS as f64;
        if rest > 0.0 {
            h -= rest * uniform * uniform.log2();
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_follow_the_chain_and_are_seeded() {
        let l = Language::new(5, 1024, 7);
        let a = l.sample(3, 4000);
        assert_eq!(a, l.sample(3, 4000));
        assert_ne!(a, l.sample(4, 4000));
        assert_ne!(a, Language::new(5, 1024, 8).sample(3, 4000));
        assert!(a.iter().all(|&t| (5..5 + ACTIVE).contains(&t)));
        // Order 2: the earlier token's class changes the successors.
        assert_ne!(l.likeliest(5, 9), l.likeliest(6, 9));
        assert_eq!(l.likeliest(5, 9), l.likeliest(5 + CLASSES, 9));
        // The likeliest successor comes about 0.95 x 0.6 of the time, any of the four about
        // 0.95; uniform ids would give 1 / 256 and 4 / 256.
        let (mut top, mut any) = (0, 0);
        for w in a.windows(3) {
            top += usize::from(w[2] == l.likeliest(w[0], w[1]));
            any += usize::from((0..SUCCESSORS).any(|k| w[2] == l.successor(w[0], w[1], k)));
        }
        let n = (a.len() - 2) as f64;
        assert!(
            (top as f64 / n - 0.57).abs() < 0.04,
            "top {}",
            top as f64 / n
        );
        assert!(any as f64 / n > 0.93, "any {}", any as f64 / n);
        // 2.09 bits per token against log2(256) = 8 for uniform active ids.
        let h = l.entropy_bits();
        assert!((1.5..2.5).contains(&h), "{h}");
    }
}
