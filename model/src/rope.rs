//! Rotary position embeddings as HF computes them: inverse frequencies `1 / theta^(2i/d)` in
//! f32, scaled by Llama 3.1's rule where configured, and `cos`/`sin` of `position * inv_freq`
//! (the rotate-half form; HF concatenates the half with itself, candle's kernels take the half).

use candle_core::{Device, Tensor};

use crate::config::{ArchConfig, RopeScaling};
use crate::Result;

pub(crate) struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Unscaled frequencies for heads of `head_dim` and base `theta` (a Qwen3 drafter's).
    pub(crate) fn plain(head_dim: usize, theta: f64) -> Rope {
        let inv_freq = (0..head_dim)
            .step_by(2)
            .map(|i| (1.0 / theta.powf(i as f64 / head_dim as f64)) as f32)
            .collect();
        Rope { inv_freq }
    }

    pub(crate) fn new(cfg: &ArchConfig) -> Rope {
        let Rope { mut inv_freq } = Rope::plain(cfg.head_dim, cfg.rope_theta);
        if let RopeScaling::Llama3(s) = cfg.rope_scaling {
            // transformers' `_compute_llama3_parameters`: long wavelengths are divided by the
            // factor, short ones kept, the band between blended smoothly.
            let old = s.original_max_position_embeddings;
            let low_wavelen = old / s.low_freq_factor;
            let high_wavelen = old / s.high_freq_factor;
            for f in &mut inv_freq {
                let freq = f64::from(*f);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let scaled = if wavelen > low_wavelen {
                    freq / s.factor
                } else if wavelen < high_wavelen {
                    freq
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / s.factor + smooth * freq
                };
                *f = scaled as f32;
            }
        }
        Rope { inv_freq }
    }

    /// `(cos, sin)`, each `[positions, head_dim / 2]` f32, for the given positions.
    pub(crate) fn tables(&self, positions: &[u32], device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let shape = (positions.len(), half);
        Ok((
            Tensor::from_vec(cos, shape, device)?,
            Tensor::from_vec(sin, shape, device)?,
        ))
    }
}
