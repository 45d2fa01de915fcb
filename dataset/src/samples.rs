//! The dataset a run reads: the built-in synthetic one, or a prepared dataset mapped from disk.
//! The launcher, the targets and the benchmarks load it alike, and plan batches over its lengths
//! (`proto::plan`, a contract every process computes identically).
//!
//! A mapped dataset costs a process its lengths (4 bytes a sample) and the pages of the samples
//! it gathers; the file's pages are shared by every process that maps it. The synthetic one
//! costs its lengths alone: a sample is made when it is read.

use std::borrow::Cow;
use std::path::Path;

use crate::language::Language;
use crate::{DataError, Mapped};

/// SplitMix64's finaliser, a 64-bit hash: the synthetic data's lengths and tokens (and the batch
/// plan's tests) derive from it. Not a generator: seeded draws use `rand`.
pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The synthetic data's vocabulary when no model fixes one.
pub const SYNTHETIC_VOCAB: u32 = 32_000;

/// The synthetic dataset's shape (the config's `data.synthetic_samples`, `min_len`, `max_len`,
/// `seed` and `synthetic_vocab`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Synthetic {
    pub samples: u64,
    pub min_len: u32,
    pub max_len: u32,
    pub seed: u64,
    /// Token ids are drawn below this.
    pub vocab: u32,
    /// From the built-in language (`language.rs`), seeded by `seed`, rather than uniform.
    pub language: bool,
}

/// The synthetic samples, made on request: a sample is a pure function of its id, so a
/// process holds only the lengths (4 bytes a sample, as a mapped dataset does), not the
/// tokens. Made up front, `--synthetic 400000` (32-4,096 tokens a sample) was 1.6 GB in the
/// launcher and in every target worker, and each took seconds at every start (BENCHMARKS,
/// "The synthetic data made when read").
struct Made {
    shape: Synthetic,
    language: Option<Language>,
}

impl Made {
    /// Sample `id`'s length: log-uniform over `min_len..=max_len`.
    fn len(&self, id: u64) -> u32 {
        let s = &self.shape;
        let (lo, hi) = (
            f64::from(s.min_len.max(1)).ln(),
            f64::from(s.max_len.max(1)).ln(),
        );
        let u = (mix(s.seed ^ mix(id)) >> 11) as f64 / (1u64 << 53) as f64;
        ((lo + u * (hi - lo)).exp().round() as u32).clamp(s.min_len, s.max_len)
    }

    /// Sample `id` of length `len`: its ids, and its mask (the first fifth is the prompt).
    fn sample(&self, id: u64, len: u32) -> crate::Sample<'static> {
        let seed = self.shape.seed;
        let vocab = u64::from(self.shape.vocab.max(1));
        let input_ids = match &self.language {
            // The seed picks samples of the one language.
            Some(l) => l.sample(mix(seed) ^ id, len),
            None => (0..len)
                .map(|pos| (mix(seed ^ (id << 20) ^ u64::from(pos)) % vocab) as u32)
                .collect(),
        };
        let prompt = len / 5;
        let loss_mask = (0..len).map(|pos| u8::from(pos >= prompt)).collect();
        crate::Sample {
            input_ids: Cow::Owned(input_ids),
            loss_mask: Some(Cow::Owned(loss_mask)),
        }
    }
}

enum Samples {
    Synthetic(Made),
    Mapped(Mapped),
}

/// All samples of a run, in dataset order; a sample's id is its index.
pub struct Dataset {
    samples: Samples,
    lengths: Vec<u32>,
    /// Where it came from, for messages.
    pub source: String,
}

impl Dataset {
    /// The dataset a config names: the `prepared` file of the input `path` (the config's
    /// `data.prepared`, set by the launcher once it has prepared `data.path`), or, with neither,
    /// the synthetic one. An input that was not prepared is an error: only the launcher (or
    /// `launcher prepare`) converts data. With `key` (the run's `data.prepared_key`), a file
    /// whose `hspipe.key` is another is refused: the file at that path was replaced since the
    /// run was planned (a `launcher prepare -o` over it), and a worker mapping it now would train
    /// other data than the run's, under the run's sample ids.
    pub fn load(
        prepared: Option<&Path>,
        key: Option<&str>,
        path: Option<&Path>,
        synthetic: Synthetic,
    ) -> Result<Dataset, DataError> {
        match (prepared, path) {
            (Some(p), _) => Dataset::mapped_as(p, key),
            (None, Some(p)) => Err(DataError::Prepared {
                path: p.to_path_buf(),
                why: "it has not been prepared (the launcher prepares it, or `launcher prepare`; then set data.prepared)".into(),
            }),
            (None, None) => Ok(Dataset::synthetic(&synthetic)),
        }
    }

    /// Maps a prepared dataset file.
    pub fn mapped(path: &Path) -> Result<Dataset, DataError> {
        Dataset::mapped_as(path, None)
    }

    /// Maps a prepared dataset file, which must hold the data of `key` when one is given.
    fn mapped_as(path: &Path, key: Option<&str>) -> Result<Dataset, DataError> {
        let m = Mapped::open(path)?;
        let has = m.meta("hspipe.key").unwrap_or("");
        if let Some(want) = key.filter(|k| *k != has) {
            return Err(DataError::Prepared {
                path: path.to_path_buf(),
                why: format!(
                    "it holds the data of key {}, not the run's key {want}: it was replaced since the run started (`launcher prepare -o` over it?), and its samples are not the ones the run planned. Restarting this worker does not help (the workers that mapped it before train on): put the run's prepared file (key {want}, named in the run's dataset.json) back at {} to go on with it, or start a new run on the new data",
                    if has.is_empty() { "none (no hspipe.key)" } else { has },
                    path.display()
                ),
            });
        }
        Ok(Dataset {
            lengths: m.lengths(),
            source: format!("{} (mapped, {} samples)", path.display(), m.len()),
            samples: Samples::Mapped(m),
        })
    }

    /// `n` seeded samples with lengths spread log-uniformly over `min_len..=max_len` (many
    /// short, few long, as chat data is), token ids below 32,000, and the first fifth of each
    /// sample masked out as its prompt. Only the lengths are computed here; each sample is
    /// made when [`sample`](Dataset::sample) reads it, the same each time.
    pub fn synthetic(s: &Synthetic) -> Dataset {
        let (n, seed) = (s.samples, s.seed);
        let made = Made {
            shape: *s,
            language: s
                .language
                .then(|| Language::new(0, s.vocab, crate::language::SEED)),
        };
        Dataset {
            lengths: (0..n).map(|id| made.len(id)).collect(),
            source: match &made.language {
                Some(l) => format!(
                    "synthetic language ({n} samples, seed {seed}, {:.2} bits/token)",
                    l.entropy_bits()
                ),
                None => format!("synthetic ({n} samples, seed {seed})"),
            },
            samples: Samples::Synthetic(made),
        }
    }

    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// Every sample's length, in dataset order.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }

    /// After a sample was copied out: lets go of the mapped pages they touched (see
    /// `Mapped::unmap_resident`), so a target's resident size stays its batches' (one `madvise`, a few microseconds).
    pub fn unmap_resident(&self) {
        if let Samples::Mapped(m) = &self.samples {
            m.unmap_resident();
        }
    }

    /// Sample `id`: its ids and its mask (None: learn from every token). None past the end.
    pub fn sample(&self, id: u64) -> Option<crate::Sample<'_>> {
        match &self.samples {
            Samples::Synthetic(made) => {
                let len = *self.lengths.get(usize::try_from(id).ok()?)?;
                Some(made.sample(id, len))
            }
            Samples::Mapped(m) => m.sample(id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_data_is_seeded_and_spread_over_lengths() {
        let s = |seed| Synthetic {
            samples: 500,
            min_len: 32,
            max_len: 4096,
            seed,
            vocab: 32_000,
            language: false,
        };
        let a = Dataset::synthetic(&s(1));
        let b = Dataset::synthetic(&s(1));
        let all = |d: &Dataset| {
            (0..d.len() as u64)
                .map(|i| d.sample(i).map(|s| s.input_ids.to_vec()))
                .collect::<Vec<_>>()
        };
        assert_eq!(all(&a), all(&b));
        assert_ne!(all(&a), all(&Dataset::synthetic(&s(2))));
        let lens = a.lengths();
        assert!(lens.iter().all(|&l| (32..=4096).contains(&l)));
        assert!(
            lens.iter().filter(|&&l| l < 256).count() > 100,
            "many short"
        );
        assert!(lens.iter().any(|&l| l > 2048), "some long");
    }

    #[test]
    fn a_path_that_was_not_prepared_is_an_error_naming_it() {
        let synthetic = Synthetic {
            samples: 1,
            min_len: 1,
            max_len: 1,
            seed: 1,
            vocab: 10,
            language: false,
        };
        let err = Dataset::load(None, None, Some(Path::new("train.jsonl")), synthetic)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("train.jsonl") && err.contains("not been prepared"),
            "{err}"
        );
    }
}
