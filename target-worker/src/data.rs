//! Training data: the built-in synthetic dataset and JSONL files, and the batch plan that every
//! target computes identically from them.
//!
//! The plan groups samples by length class (bucket), shuffles within each class (seeded), and
//! packs them greedily under the token budget. Planned batch `i` is work item `i` of the ring:
//! targets claim items, so the plan must be the same in every process, which it is because it
//! depends only on the data and the config.

use std::path::{Path, PathBuf};

use proto::PipelineConfig;
use serde::Deserialize;

/// One training sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub input_ids: Vec<u32>,
    /// 1 where the drafter learns from the token.
    pub loss_mask: Vec<u8>,
}

/// A dataset that cannot be used, naming the file and line at fault.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("reading dataset {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("dataset {path} has no samples")]
    Empty { path: PathBuf },
    #[error("{path}:{line}: {why}")]
    Line {
        path: PathBuf,
        line: usize,
        why: String,
    },
}

/// All samples of a run, in dataset order; a sample's id is its index.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub samples: Vec<Sample>,
    /// Where it came from, for messages.
    pub source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSample {
    input_ids: Vec<u32>,
    #[serde(default)]
    loss_mask: Option<Vec<u8>>,
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Dataset {
    /// The dataset the config names: its JSONL file, or the synthetic one.
    pub fn load(cfg: &PipelineConfig) -> Result<Dataset, DataError> {
        match &cfg.data.path {
            Some(p) => Dataset::jsonl(p, cfg.data.max_len),
            None => Ok(Dataset::synthetic(
                cfg.data.synthetic_samples,
                cfg.data.min_len,
                cfg.data.max_len,
                cfg.data.seed,
            )),
        }
    }

    /// `n` seeded samples with lengths spread log-uniformly over `min_len..=max_len` (many
    /// short, few long, as chat data is), token ids below 32,000, and the first fifth of each
    /// sample masked out as its prompt.
    pub fn synthetic(n: u64, min_len: u32, max_len: u32, seed: u64) -> Dataset {
        let (lo, hi) = (
            f64::from(min_len.max(1)).ln(),
            f64::from(max_len.max(1)).ln(),
        );
        let samples = (0..n)
            .map(|id| {
                let u = (mix(seed ^ mix(id)) >> 11) as f64 / (1u64 << 53) as f64;
                let len = ((lo + u * (hi - lo)).exp().round() as u32).clamp(min_len, max_len);
                let input_ids = (0..len)
                    .map(|pos| (mix(seed ^ (id << 20) ^ u64::from(pos)) % 32_000) as u32)
                    .collect();
                let prompt = len / 5;
                let loss_mask = (0..len).map(|pos| u8::from(pos >= prompt)).collect();
                Sample {
                    input_ids,
                    loss_mask,
                }
            })
            .collect();
        Dataset {
            samples,
            source: format!("synthetic ({n} samples, seed {seed})"),
        }
    }

    /// One JSON object per line: `{"input_ids": [...], "loss_mask": [...]}` (the mask is
    /// optional: all ones). Blank lines are skipped.
    pub fn jsonl(path: &Path, max_len: u32) -> Result<Dataset, DataError> {
        let text = std::fs::read_to_string(path).map_err(|e| DataError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        let bad = |line: usize, why: String| DataError::Line {
            path: path.to_path_buf(),
            line,
            why,
        };
        let mut samples = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            if line.trim().is_empty() {
                continue;
            }
            let s: JsonSample =
                serde_json::from_str(line).map_err(|e| bad(n, format!("not a sample: {e}")))?;
            if s.input_ids.is_empty() {
                return Err(bad(n, "input_ids is empty".into()));
            }
            if s.input_ids.len() > max_len as usize {
                return Err(bad(
                    n,
                    format!(
                        "{} tokens, more than data.max_len {max_len}",
                        s.input_ids.len()
                    ),
                ));
            }
            let loss_mask = match s.loss_mask {
                None => vec![1; s.input_ids.len()],
                Some(m) if m.len() != s.input_ids.len() => {
                    return Err(bad(
                        n,
                        format!(
                            "loss_mask has {} entries, input_ids has {}",
                            m.len(),
                            s.input_ids.len()
                        ),
                    ))
                }
                Some(m) if m.iter().any(|&b| b > 1) => {
                    return Err(bad(n, "loss_mask entries must be 0 or 1".into()))
                }
                Some(m) => m,
            };
            samples.push(Sample {
                input_ids: s.input_ids,
                loss_mask,
            });
        }
        if samples.is_empty() {
            return Err(DataError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Dataset {
            samples,
            source: path.display().to_string(),
        })
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// One planned batch: samples of one length class, within the token budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedBatch {
    pub sample_ids: Vec<u64>,
    pub bucket: u32,
    pub tokens: u64,
}

/// The batch plan of a run. Identical in every process for the same data and config.
pub fn plan(data: &Dataset, cfg: &PipelineConfig) -> Vec<PlannedBatch> {
    let buckets = cfg.ring.buckets.max(1);
    let budget = u64::from(cfg.target.token_budget);
    let mut by_bucket: Vec<Vec<u64>> = vec![Vec::new(); buckets as usize];
    for (id, s) in data.samples.iter().enumerate() {
        by_bucket[cfg.bucket_of(s.input_ids.len() as u32) as usize].push(id as u64);
    }
    let mut out = Vec::new();
    for (b, mut ids) in by_bucket.into_iter().enumerate() {
        // Seeded Fisher-Yates: batches mix samples from across the dataset.
        for i in (1..ids.len()).rev() {
            let j = (mix(cfg.data.seed ^ mix(b as u64 * 1_000_003 + i as u64)) % (i as u64 + 1))
                as usize;
            ids.swap(i, j);
        }
        let mut cur = PlannedBatch {
            sample_ids: Vec::new(),
            bucket: b as u32,
            tokens: 0,
        };
        for id in ids {
            let len = data.samples[id as usize].input_ids.len() as u64;
            if !cur.sample_ids.is_empty() && cur.tokens + len > budget {
                out.push(std::mem::replace(
                    &mut cur,
                    PlannedBatch {
                        sample_ids: Vec::new(),
                        bucket: b as u32,
                        tokens: 0,
                    },
                ));
            }
            cur.sample_ids.push(id);
            cur.tokens += len;
        }
        if !cur.sample_ids.is_empty() {
            out.push(cur);
        }
    }
    // Interleave classes so early work is not all one length.
    out.sort_by_key(|b| mix(cfg.data.seed ^ b.sample_ids[0]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PipelineConfig {
        PipelineConfig::default()
    }

    #[test]
    fn synthetic_data_is_seeded_and_spread_over_lengths() {
        let a = Dataset::synthetic(500, 32, 4096, 1);
        let b = Dataset::synthetic(500, 32, 4096, 1);
        assert_eq!(a.samples, b.samples);
        assert_ne!(a.samples, Dataset::synthetic(500, 32, 4096, 2).samples);
        let lens: Vec<usize> = a.samples.iter().map(|s| s.input_ids.len()).collect();
        assert!(lens.iter().all(|&l| (32..=4096).contains(&l)));
        assert!(
            lens.iter().filter(|&&l| l < 256).count() > 100,
            "many short"
        );
        assert!(lens.iter().any(|&l| l > 2048), "some long");
    }

    #[test]
    fn plan_covers_every_sample_once_within_budget_and_bucket() {
        let c = cfg();
        let d = Dataset::synthetic(1000, 32, 4096, 7);
        let p = plan(&d, &c);
        assert_eq!(p, plan(&d, &c), "deterministic");
        let mut ids: Vec<u64> = p.iter().flat_map(|b| b.sample_ids.clone()).collect();
        ids.sort();
        assert_eq!(ids, (0..1000).collect::<Vec<_>>());
        for b in &p {
            assert!(b.tokens <= u64::from(c.target.token_budget));
            for &id in &b.sample_ids {
                let len = d.samples[id as usize].input_ids.len() as u32;
                assert_eq!(c.bucket_of(len), b.bucket);
            }
        }
    }

    fn jsonl(text: &str) -> Result<Dataset, DataError> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("hspipe-data-{}-{n}.jsonl", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let r = Dataset::jsonl(&path, 8);
        std::fs::remove_file(&path).unwrap();
        r
    }

    #[test]
    fn jsonl_reads_samples_and_names_the_bad_line() {
        let d = jsonl("{\"input_ids\": [1,2,3]}\n\n{\"input_ids\": [4], \"loss_mask\": [0]}\n")
            .unwrap();
        assert_eq!(d.samples[0].loss_mask, vec![1, 1, 1]);
        assert_eq!(d.samples[1].loss_mask, vec![0]);

        let cases = [
            (
                "{\"input_ids\": [1]}\n{\"input_ids\": [1,\n",
                ":2: not a sample",
            ),
            ("{\"input_ids\": []}\n", ":1: input_ids is empty"),
            (
                "{\"input_ids\": [1,2], \"loss_mask\": [1]}\n",
                ":1: loss_mask has 1 entries",
            ),
            (
                "{\"input_ids\": [1,2,3,4,5,6,7,8,9]}\n",
                ":1: 9 tokens, more than data.max_len 8",
            ),
            ("{\"ids\": [1]}\n", ":1: not a sample"),
            ("\n\n", "has no samples"),
        ];
        for (text, want) in cases {
            let err = jsonl(text).unwrap_err().to_string();
            assert!(
                err.contains(want) && err.contains(".jsonl"),
                "{err:?} should contain {want:?}"
            );
        }
        let err = Dataset::jsonl(Path::new("/nonexistent/x.jsonl"), 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/x.jsonl"), "{err}");
    }
}
