//! The mock backend: deterministic content, simulated speed, real drafter state, injected faults.
//!
//! A mock target's hidden state for (token, position, layer, channel) is a fixed function of
//! those four numbers ([`hidden_value`]), so a drafter verifies the content of every batch, not
//! just its checksum. Simulated time is `tokens / tokens_per_s` plus a term quadratic in each
//! sequence's length (attention), spent sleeping so that many mock GPUs run in parallel on few
//! cores.

use std::path::Path;
use std::time::{Duration, Instant};

use proto::safetensors::{self, SafeTensors, StDtype, TensorRef};
use proto::{BatchView, Dtype};

use crate::{DrafterBackend, Faults, GpuError, StepStats, TargetBackend};

/// The mock target's hidden state, as bf16 bits: a value in [-0.5, 0.5) from a hash of its
/// coordinates.
pub fn hidden_value(token: u32, position: u32, layer: u32, channel: u32) -> u16 {
    let mut x = u64::from(token)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(position).wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(u64::from(layer) << 40)
        .wrapping_add(u64::from(channel) << 20);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    let f = (x % 1024) as f32 / 1024.0 - 0.5;
    (f.to_bits() >> 16) as u16
}

fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Simulated compute time and fault injection shared by both mock roles.
#[derive(Clone, Debug)]
pub struct Sim {
    pub tokens_per_s: f64,
    /// Extra seconds per squared token of each sequence (attention cost); 0 disables.
    pub quadratic_s: f64,
    pub faults: Faults,
    items: u64,
}

impl Sim {
    pub fn new(tokens_per_s: f64, faults: Faults) -> Self {
        Sim {
            tokens_per_s,
            quadratic_s: 1.0 / tokens_per_s / 16384.0,
            faults,
            items: 0,
        }
    }

    /// Seconds the simulated GPU takes for these sequences.
    pub fn cost(&self, seq_lens: &[u32]) -> Duration {
        let tokens: f64 = seq_lens.iter().map(|&l| f64::from(l)).sum();
        let quad: f64 = seq_lens.iter().map(|&l| f64::from(l) * f64::from(l)).sum();
        let slow = self.faults.slow.unwrap_or(1.0);
        Duration::from_secs_f64((tokens / self.tokens_per_s + quad * self.quadratic_s) * slow)
    }

    /// Sleeps out whatever is left of the simulated time after `started`, then applies faults.
    fn finish_item(&mut self, seq_lens: &[u32], started: Instant) {
        let cost = self.cost(seq_lens);
        if let Some(left) = cost.checked_sub(started.elapsed()) {
            std::thread::sleep(left);
        }
        self.items += 1;
        if self.faults.crash_after.is_some_and(|n| self.items >= n) {
            eprintln!("mock gpu: injected crash after {} items", self.items);
            std::process::abort();
        }
        if self.faults.hang_after.is_some_and(|n| self.items >= n) {
            eprintln!("mock gpu: injected hang after {} items", self.items);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
}

/// A mock target model.
pub struct MockTarget {
    pub layers: u32,
    pub hidden: u32,
    pub sim: Sim,
}

impl TargetBackend for MockTarget {
    fn forward(
        &mut self,
        input_ids: &[u32],
        seq_lens: &[u32],
        out: &mut [u8],
    ) -> Result<(), GpuError> {
        let started = Instant::now();
        let (l, h) = (self.layers as usize, self.hidden as usize);
        let want = input_ids.len() * l * h * 2;
        if out.len() != want {
            return Err(GpuError::BufferSize {
                got: out.len(),
                want,
            });
        }
        let mut i = 0;
        let mut t = 0;
        for &len in seq_lens {
            for pos in 0..len {
                let tok = input_ids[t];
                for layer in 0..self.layers {
                    for ch in 0..self.hidden {
                        out[i..i + 2]
                            .copy_from_slice(&hidden_value(tok, pos, layer, ch).to_le_bytes());
                        i += 2;
                    }
                }
                t += 1;
            }
        }
        self.sim.finish_item(seq_lens, started);
        Ok(())
    }
}

/// Number of weights in the mock drafter.
pub const WEIGHTS: usize = 16;

/// A mock drafter with real state: a step count and a weight vector moved by the data.
pub struct MockDrafter {
    pub sim: Sim,
    pub step: u64,
    pub weights: [f32; WEIGHTS],
}

impl MockDrafter {
    pub fn new(sim: Sim) -> Self {
        MockDrafter {
            sim,
            step: 0,
            weights: [0.0; WEIGHTS],
        }
    }
}

impl DrafterBackend for MockDrafter {
    fn train_step(&mut self, batch: &BatchView<'_>) -> Result<StepStats, GpuError> {
        let started = Instant::now();
        let spec = &batch.header().spec;
        if spec.dtype != Dtype::Bf16 {
            return Err(GpuError::Dtype(spec.dtype));
        }
        let ids: Vec<u32> = batch.input_ids().collect();
        let hs = batch.hidden_states();
        let (layers, hidden) = (spec.layers, spec.hidden);
        let mut grad = [0f32; WEIGHTS];
        let mut i = 0;
        let mut t = 0;
        for &len in &spec.seq_lens {
            for pos in 0..len {
                for layer in 0..layers {
                    for ch in 0..hidden {
                        let got = u16::from_le_bytes([hs[i], hs[i + 1]]);
                        let want = hidden_value(ids[t], pos, layer, ch);
                        if got != want {
                            return Err(GpuError::Content {
                                batch_id: spec.batch_id,
                                token: t,
                                layer,
                                channel: ch,
                                got,
                                want,
                            });
                        }
                        grad[ch as usize % WEIGHTS] += bf16_to_f32(got);
                        i += 2;
                    }
                }
                t += 1;
            }
        }
        let n = (ids.len().max(1) * layers as usize) as f32;
        let mut loss = 0.0;
        for (w, g) in self.weights.iter_mut().zip(grad) {
            let g = g / n - *w;
            *w += 0.1 * g;
            loss += g * g;
        }
        self.step += 1;
        self.sim.finish_item(&spec.seq_lens, started);
        Ok(StepStats {
            step: self.step,
            tokens: ids.len() as u64,
            loss,
        })
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn save(&self, path: &Path) -> Result<(), GpuError> {
        let err = |why: String| GpuError::Checkpoint {
            path: path.display().to_string(),
            why,
        };
        let w: Vec<u8> = self.weights.iter().flat_map(|f| f.to_le_bytes()).collect();
        let s = self.step.to_le_bytes();
        let tensors = [
            TensorRef {
                name: "weights",
                dtype: StDtype::F32,
                shape: &[WEIGHTS],
                data: &w,
            },
            TensorRef {
                name: "step",
                dtype: StDtype::U64,
                shape: &[1],
                data: &s,
            },
        ];
        let bytes = safetensors::serialize(&tensors, &Default::default())
            .map_err(|e| err(e.to_string()))?;
        std::fs::write(path, bytes).map_err(|e| err(e.to_string()))
    }

    fn load(&mut self, path: &Path) -> Result<(), GpuError> {
        let err = |why: String| GpuError::Checkpoint {
            path: path.display().to_string(),
            why,
        };
        let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let st = SafeTensors::parse(&bytes).map_err(|e| err(e.to_string()))?;
        let w = st
            .tensor("weights")
            .map_err(|e| err(format!("no weights: {e}")))?;
        let s = st
            .tensor("step")
            .map_err(|e| err(format!("no step: {e}")))?;
        if w.dtype != StDtype::F32
            || w.shape != [WEIGHTS]
            || s.dtype != StDtype::U64
            || s.shape != [1]
        {
            return Err(err(format!(
                "expected weights F32[{WEIGHTS}] and step U64[1]"
            )));
        }
        for (dst, c) in self.weights.iter_mut().zip(w.data.chunks_exact(4)) {
            *dst = f32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        self.step = u64::from_le_bytes(s.data.try_into().expect("8 bytes"));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{BatchSpec, BatchWriter};

    fn fast() -> Sim {
        Sim::new(1e9, Faults::default())
    }

    fn batch(buf: &mut [u8], corrupt: bool) -> usize {
        let spec = BatchSpec {
            batch_id: 3,
            producer: 0,
            sample_ids: vec![1, 2],
            seq_lens: vec![4, 6],
            dtype: Dtype::Bf16,
            layers: 2,
            hidden: 8,
        };
        let mut w = BatchWriter::new(buf, &spec).unwrap();
        let ids: Vec<u32> = (100..110).collect();
        let (id_bytes, mask, hid) = w.sections_mut();
        for (c, id) in id_bytes.chunks_exact_mut(4).zip(&ids) {
            c.copy_from_slice(&id.to_le_bytes());
        }
        mask.fill(1);
        let mut target = MockTarget {
            layers: 2,
            hidden: 8,
            sim: fast(),
        };
        target.forward(&ids, &spec.seq_lens, hid).unwrap();
        if corrupt {
            hid[37] ^= 1;
        }
        w.finish().0
    }

    #[test]
    fn drafter_verifies_content_and_its_state_moves() {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let mut d = MockDrafter::new(fast());
        let s = d
            .train_step(&BatchView::parse(&buf[..len]).unwrap())
            .unwrap();
        assert_eq!((s.step, s.tokens), (1, 10));
        assert!(d.weights.iter().any(|&w| w != 0.0));

        // A flipped bit that the checksum would also catch is caught by content too.
        let len = batch(&mut buf, true);
        let err = d
            .train_step(&BatchView::parse(&buf[..len]).unwrap())
            .unwrap_err();
        assert!(
            matches!(err, GpuError::Content { batch_id: 3, .. }),
            "{err}"
        );
    }

    #[test]
    fn checkpoint_restores_the_exact_state_and_bad_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("hspipe-gpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let mut d = MockDrafter::new(fast());
        for _ in 0..3 {
            d.train_step(&BatchView::parse(&buf[..len]).unwrap())
                .unwrap();
        }
        let path = dir.join("ckpt.safetensors");
        d.save(&path).unwrap();
        let mut e = MockDrafter::new(fast());
        e.load(&path).unwrap();
        assert_eq!((e.step, e.weights), (3, d.weights));

        std::fs::write(dir.join("bad"), b"not a checkpoint").unwrap();
        let err = e.load(&dir.join("bad")).unwrap_err().to_string();
        assert!(err.contains("bad") && err.contains("safetensors"), "{err}");
        let err = e.load(&dir.join("missing")).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn simulated_cost_grows_with_tokens_and_length_and_slowdown() {
        let s = Sim::new(1000.0, Faults::default());
        let short = s.cost(&[100, 100]);
        let long = s.cost(&[200]);
        assert!(long > short, "same tokens in one longer sequence cost more");
        let slow = Sim::new(
            1000.0,
            Faults {
                slow: Some(3.0),
                ..Faults::default()
            },
        );
        let ratio = slow.cost(&[200]).as_secs_f64() / long.as_secs_f64();
        assert!((ratio - 3.0).abs() < 1e-6, "slow x3 costs 3x, got {ratio}");
    }
}
