//! The mock backend: deterministic content, simulated speed, real drafter state, injected faults.
//!
//! Length: about 760 lines: the target, the drafter (a real learner, with its checkpoint
//! format and exact-gradient tests), their faults and the backend's `Maker` are one backend.
//!
//! A mock target's hidden state for (token, position, layer, channel) is a fixed function of
//! those four numbers ([`hidden_value`]), so a drafter verifies the content of every batch, not
//! just its checksum. Simulated time is `tokens / tokens_per_s` plus a term quadratic in each
//! sequence's length (attention), spent sleeping so that many mock GPUs run in parallel on few
//! cores.

use std::path::Path;
use std::time::{Duration, Instant};

use proto::{BatchView, Dtype};

use crate::{
    state, DrafterBackend, Faults, GpuError, Maker, StepBuffer, StepStats, TargetBackend, TargetOut,
};

/// The mock target's hidden state, as bf16 bits: a per-(token, channel) signal in [-0.5, 0.5)
/// plus position- and layer-dependent noise in [-0.125, 0.125), both from hashes of the
/// coordinates. The signal is what a mock drafter can learn (its loss falls from about 0.088 to
/// the noise's 0.0052); the whole value is what it verifies.
pub fn hidden_value(token: u32, position: u32, layer: u32, channel: u32) -> u16 {
    let signal = unit(hash(
        u64::from(token).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(channel) << 20),
    ));
    let noise = unit(hash(
        u64::from(token)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(u64::from(position).wrapping_mul(0xbf58_476d_1ce4_e5b9))
            .wrapping_add(u64::from(layer) << 40)
            .wrapping_add(u64::from(channel) << 20)
            ^ 0x5555,
    ));
    let f = signal + noise / 4.0;
    (f.to_bits() >> 16) as u16
}

/// The mock target's "greedy next token" after `token` at `position`: a hash, checked by the
/// mock drafter like the hidden states.
pub fn greedy_value(token: u32, position: u32) -> u32 {
    hash(u64::from(token).wrapping_mul(0xd6e8_feb8_6659_fd93) ^ u64::from(position) ^ 0x70c3) as u32
}

fn hash(mut x: u64) -> u64 {
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 29;
    x
}

/// A value in [-0.5, 0.5) on a 1/1024 grid (exact in bf16 once scaled by 1/4 and added).
fn unit(x: u64) -> f32 {
    (x % 1024) as f32 / 1024.0 - 0.5
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
    pub(crate) fn finish_item(&mut self, seq_lens: &[u32], started: Instant) {
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

/// The mock's start-up fault: a worker that dies as it starts (a crash loop).
pub(crate) fn start(faults: &Faults) {
    if faults.crash_at_start {
        tracing::error!("injected crash at start");
        std::process::abort();
    }
}

/// A mock target model.
pub struct MockTarget {
    pub layers: u32,
    pub hidden: u32,
    pub sim: Sim,
}

impl MockTarget {
    /// Worker `name`'s target under `cfg`: its shape, speed and faults.
    pub fn new(cfg: &proto::PipelineConfig, name: proto::WorkerName) -> MockTarget {
        let faults = cfg.faults_for(name);
        start(&faults);
        MockTarget {
            layers: cfg.model.layers,
            hidden: cfg.model.hidden,
            sim: Sim::new(cfg.target.tokens_per_s, faults),
        }
    }
}

impl TargetBackend for MockTarget {
    /// Any: its forward is done when `submit` returns, so a depth of 2 walks a GPU's pipelined
    /// path (`[target] depth`) on the CPU.
    fn max_depth(&self) -> usize {
        usize::MAX
    }

    fn forward(
        &mut self,
        input_ids: &[u32],
        seq_lens: &[u32],
        out: TargetOut<'_>,
    ) -> Result<(), GpuError> {
        let started = Instant::now();
        let (l, h) = (self.layers as usize, self.hidden as usize);
        out.check(input_ids.len(), l, h, 2)?;
        let (hidden, tokens) = (out.hidden_states, out.target_tokens);
        let mut i = 0;
        let mut t = 0;
        for &len in seq_lens {
            for pos in 0..len {
                let tok = input_ids[t];
                tokens[t * 4..t * 4 + 4].copy_from_slice(&greedy_value(tok, pos).to_le_bytes());
                for layer in 0..self.layers {
                    for ch in 0..self.hidden {
                        hidden[i..i + 2]
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

/// Adam's settings for the mock drafter (lr is high: a run has only tens of steps).
const LR: f32 = 0.05;
const BETA1: f32 = 0.9;
const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

/// A mock drafter that really learns: a table `E` of `rows x hidden` f32 weights predicts each
/// captured layer's hidden state of token `t` as `E[t % rows]`. The loss is the squared error
/// summed over loss-masked tokens, layers and channels; its gradient is exact; Adam applies the
/// update. Simulated GPU time is still slept, so many mock drafters share few cores.
///
/// Its gradient ([`DrafterBackend::grad_len`]) is the weights' gradient; the loss sum and the
/// loss-token count go in the step buffer's parts, so one all-reduce sums all three.
pub struct MockDrafter {
    pub sim: Sim,
    pub step: u64,
    /// Check every hidden state and greedy token against the mock target's functions; off when
    /// the batches come from a real target (the checksum is then the content check).
    pub verify_content: bool,
    hidden: usize,
    rows: usize,
    pub weights: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl MockDrafter {
    /// About `params` weights (rounded down to whole rows of `hidden`, at least one row).
    pub fn new(sim: Sim, params: usize, hidden: u32) -> Self {
        let hidden = hidden.max(1) as usize;
        let rows = (params / hidden).max(1);
        let n = rows * hidden;
        MockDrafter {
            sim,
            step: 0,
            verify_content: true,
            hidden,
            rows,
            weights: vec![0.0; n],
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// Worker `name`'s drafter under `cfg`: its size, speed and faults (none for `None`).
    pub fn for_worker(cfg: &proto::PipelineConfig, name: Option<proto::WorkerName>) -> MockDrafter {
        let faults = name.map(|n| cfg.faults_for(n)).unwrap_or_default();
        start(&faults);
        MockDrafter::new(
            Sim::new(cfg.drafter.tokens_per_s, faults),
            cfg.drafter.params as usize,
            cfg.model.hidden,
        )
    }

    /// `(grad_len, state_words)` of a drafter built with `new(_, params, hidden)`, without
    /// building one (the launcher sizes the group segment with it).
    pub fn sizes(params: usize, hidden: u32) -> (usize, usize) {
        let hidden = hidden.max(1) as usize;
        let n = (params / hidden).max(1) * hidden;
        (n, 3 * n + 2)
    }
}

/// XXH3-64 over the bits of `xs` (in this machine's byte order): equal digests mean (all but
/// surely) equal weights. A DFlash drafter's weights are hashed once per step (every ledger
/// line carries the digest), so the hash is a word-parallel one rather than a byte-at-a-time
/// FNV-1a.
pub fn digest(xs: &[f32]) -> u64 {
    twox_hash::XxHash3_64::oneshot(zerocopy::IntoBytes::as_bytes(xs))
}

impl DrafterBackend for MockDrafter {
    fn grad_len(&self) -> usize {
        self.weights.len()
    }

    fn state_len(&self) -> usize {
        Self::sizes(self.weights.len(), self.hidden as u32).1
    }

    fn gradient(&mut self, batch: &BatchView<'_>, out: &mut StepBuffer) -> Result<(), GpuError> {
        let started = Instant::now();
        let spec = &batch.header().spec;
        if spec.dtype != Dtype::Bf16 {
            return Err(GpuError::Dtype(spec.dtype));
        }
        let grad = out.gradient_mut();
        if grad.len() != self.grad_len() {
            return Err(GpuError::BufferSize {
                got: grad.len(),
                want: self.grad_len(),
            });
        }
        if spec.hidden as usize != self.hidden {
            return Err(GpuError::Shape(format!(
                "batch hidden size {} but this drafter was built for {}",
                spec.hidden, self.hidden
            )));
        }
        if let Some(n) = (self.sim.faults.crash_on_sample).filter(|n| spec.sample_ids.contains(n)) {
            tracing::error!(batch = spec.batch_id, "injected crash on sample {n}");
            std::process::abort();
        }
        if let Some(n) = (self.sim.faults.fail_on_sample).filter(|n| spec.sample_ids.contains(n)) {
            let oom = format!("injected device failure (out of memory) on sample {n}");
            return Err(GpuError::Candle(candle_core::Error::Msg(oom)));
        }
        grad.fill(0.0);
        let ids: Vec<u32> = batch.input_ids().collect();
        let mask = batch.loss_mask();
        let hs = batch.hidden_states();
        let greedy: Vec<u32> = batch.target_tokens().collect();
        let (layers, hidden) = (spec.layers, spec.hidden);
        let (mut loss, mut count) = (0f64, 0u64);
        let mut i = 0;
        let mut t = 0;
        for &len in &spec.seq_lens {
            for pos in 0..len {
                let row = (ids[t] as usize % self.rows) * self.hidden;
                let want = greedy_value(ids[t], pos);
                if self.verify_content && greedy[t] != want {
                    return Err(GpuError::GreedyToken {
                        batch_id: spec.batch_id,
                        token: t,
                        got: greedy[t],
                        want,
                    });
                }
                let learn = mask.get(t).is_some_and(|&m| m != 0);
                count += u64::from(learn);
                for layer in 0..layers {
                    for ch in 0..hidden {
                        let got = u16::from_le_bytes([hs[i], hs[i + 1]]);
                        let want = hidden_value(ids[t], pos, layer, ch);
                        if self.verify_content && got != want {
                            return Err(GpuError::Content {
                                batch_id: spec.batch_id,
                                token: t,
                                layer,
                                channel: ch,
                                got,
                                want,
                            });
                        }
                        if learn {
                            // d/dE (E - y)^2 = 2 (E - y)
                            let k = row + ch as usize;
                            let e = self.weights[k] - bf16_to_f32(got);
                            grad[k] += 2.0 * e;
                            loss += f64::from(e * e);
                        }
                        i += 2;
                    }
                }
                t += 1;
            }
        }
        // The step this gradient is for is the next one applied (a rank's step is the group's).
        if (self.sim.faults.nan_gradient_from_step).is_some_and(|n| self.step + 1 >= n) {
            grad[0] = f32::NAN;
        }
        out.set_loss(loss as f32);
        out.set_loss_tokens(count as f32);
        self.sim.finish_item(&spec.seq_lens, started);
        Ok(())
    }

    fn apply(&mut self, summed: &StepBuffer) -> Result<StepStats, GpuError> {
        let (loss, tokens) = (summed.loss(), summed.loss_tokens());
        self.step += 1;
        // Normalise by the step's loss tokens x layers x channels (the group's, not one rank's).
        // A sum that is NaN or infinite is skipped, as our real drafters skip it (the weights
        // and moments left as they were): each rank sees the same sum, so each skips alike.
        let skipped = tokens > 0.0 && !summed.gradient().iter().all(|g| g.is_finite());
        if tokens > 0.0 && !skipped {
            let scale = 1.0 / tokens;
            let t = self.step as i32;
            let (c1, c2) = (1.0 - BETA1.powi(t), 1.0 - BETA2.powi(t));
            let params = self.weights.iter_mut().zip(&mut self.m).zip(&mut self.v);
            for (((w, m), v), g) in params.zip(summed.gradient()) {
                let g = g * scale;
                *m = BETA1 * *m + (1.0 - BETA1) * g;
                *v = BETA2 * *v + (1.0 - BETA2) * g * g;
                *w -= LR * (*m / c1) / ((*v / c2).sqrt() + EPS);
            }
        }
        let per = tokens as f64 * self.hidden as f64;
        Ok(StepStats {
            step: self.step,
            tokens: tokens as u64,
            loss: if per > 0.0 {
                (f64::from(loss) / per) as f32
            } else {
                0.0
            },
            tau: None,
            lr: None,
            eval_tau: None,
            skipped,
            tokens_unknown: false,
        })
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn skip_to(&mut self, step: u64) {
        self.step = self.step.max(step);
    }

    fn digest(&self) -> u64 {
        digest(&self.weights)
    }

    fn save(&self, path: &Path) -> Result<(), GpuError> {
        let shape = vec![self.rows, self.hidden];
        state::save(
            path,
            &state::State {
                tables: vec![
                    ("embed.weight", shape.clone(), &self.weights),
                    ("adam.m", shape.clone(), &self.m),
                    ("adam.v", shape, &self.v),
                ],
                counters: vec![self.step],
                metadata: Vec::new(),
            },
        )
    }

    fn load(&mut self, path: &Path) -> Result<(), GpuError> {
        let (t, c) = state::load(
            path,
            &["embed.weight", "adam.m", "adam.v"],
            &[self.rows, self.hidden],
            1,
            "a different [drafter] params or hidden size?",
        )?;
        let [w, m, v]: [Vec<f32>; 3] = t.try_into().expect("three tables");
        (self.weights, self.m, self.v, self.step) = (w, m, v, c[0]);
        Ok(())
    }

    fn export_state(&self) -> Result<Vec<u32>, GpuError> {
        Ok(state::words(
            &[&self.weights, &self.m, &self.v],
            &[self.step],
        ))
    }

    fn import_state(&mut self, words: &[u32]) -> Result<(), GpuError> {
        let (t, c) = state::from_words(words, self.weights.len(), 3, 1)?;
        let [w, m, v]: [Vec<f32>; 3] = t.try_into().expect("three tables");
        (self.weights, self.m, self.v, self.step) = (w, m, v, c[0]);
        Ok(())
    }
}

/// What builds the mock's models ([`crate::BackendKind::Mock`]).
pub struct Mock;

impl Maker for Mock {
    fn built(&self) -> bool {
        true
    }
    fn target(
        &self,
        cfg: &proto::PipelineConfig,
        name: proto::WorkerName,
    ) -> Result<Box<dyn TargetBackend + Send>, GpuError> {
        Ok(Box::new(MockTarget::new(cfg, name)))
    }
    fn drafter(
        &self,
        cfg: &proto::PipelineConfig,
        name: Option<proto::WorkerName>,
    ) -> Result<Box<dyn DrafterBackend + Send>, GpuError> {
        Ok(Box::new(MockDrafter::for_worker(cfg, name)))
    }
    fn drafter_sizes(&self, cfg: &proto::PipelineConfig) -> Result<(usize, usize), GpuError> {
        Ok(MockDrafter::sizes(
            cfg.drafter.params as usize,
            cfg.model.hidden,
        ))
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
        let s = w.sections_mut();
        for (c, id) in s.input_ids.chunks_exact_mut(4).zip(&ids) {
            c.copy_from_slice(&id.to_le_bytes());
        }
        s.loss_mask.fill(1);
        let mut target = MockTarget {
            layers: 2,
            hidden: 8,
            sim: fast(),
        };
        let out = TargetOut {
            hidden_states: s.hidden_states,
            target_tokens: s.target_tokens,
        };
        target.forward(&ids, &spec.seq_lens, out).unwrap();
        if corrupt {
            s.hidden_states[37] ^= 1;
        }
        w.finish().0
    }

    fn drafter() -> MockDrafter {
        MockDrafter::new(fast(), 4096, 8)
    }

    #[test]
    fn drafter_verifies_content_and_its_state_moves() {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let mut d = drafter();
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

    /// The gradient is the true one: a finite difference of the loss agrees with it.
    #[test]
    fn the_gradient_is_the_derivative_of_the_loss() {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let view = BatchView::parse(&buf[..len]).unwrap();
        let mut d = drafter();
        d.train_step(&view).unwrap(); // move off zero
        let mut g = StepBuffer::new(d.grad_len());
        d.gradient(&view, &mut g).unwrap();
        let k = (100 % d.rows) * d.hidden + 3; // token 100, channel 3
        let loss_at = |d: &mut MockDrafter, x: f32| {
            d.weights[k] = x;
            let mut g = StepBuffer::new(d.grad_len());
            d.gradient(&view, &mut g).unwrap();
            f64::from(g.loss())
        };
        let x = d.weights[k];
        let h = 1e-2;
        let fd = (loss_at(&mut d, x + h) - loss_at(&mut d, x - h)) / f64::from(2.0 * h);
        assert!(
            (fd - f64::from(g.gradient()[k])).abs() < 1e-2 * fd.abs().max(1.0),
            "{fd} vs {}",
            g.gradient()[k]
        );
        assert_eq!(g.loss_tokens(), 10.0, "ten loss tokens");
    }

    /// Trained on the same batches again and again, the loss falls well below where it started.
    #[test]
    fn the_loss_falls() {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let view = BatchView::parse(&buf[..len]).unwrap();
        let mut d = drafter();
        let first = d.train_step(&view).unwrap().loss;
        let last = (0..100)
            .map(|_| d.train_step(&view).unwrap().loss)
            .last()
            .unwrap();
        assert!(last < first / 5.0, "loss {first} -> {last}");
    }

    /// A drafter whose gradient turns NaN (`nan_gradient_from_step`) reports its updates
    /// skipped from that step on, its weights left as they were, as our real drafters do; the
    /// launcher's `--stop-after-skipped` relies on the mock saying so.
    #[test]
    fn a_nan_gradient_is_skipped_and_the_weights_stay() {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let view = BatchView::parse(&buf[..len]).unwrap();
        let faults = Faults {
            nan_gradient_from_step: Some(3),
            ..Faults::default()
        };
        let mut d = MockDrafter::new(Sim::new(1e9, faults), 4096, 8);
        let steps: Vec<StepStats> = (0..4).map(|_| d.train_step(&view).unwrap()).collect();
        let skipped: Vec<bool> = steps.iter().map(|s| s.skipped).collect();
        assert_eq!(skipped, [false, false, true, true], "{steps:?}");
        assert_eq!(
            steps[3].step, 4,
            "a skipped update still counts as the group's step"
        );
        let before = d.weights.clone();
        d.train_step(&view).unwrap();
        assert_eq!(
            d.weights, before,
            "a skipped update leaves the weights alone"
        );
        assert!(d.weights.iter().all(|w| w.is_finite()));
    }

    /// Two ranks applying the same summed buffer stay bitwise equal; the state hand-over
    /// reproduces a rank exactly.
    #[test]
    fn same_sum_same_bits_and_the_state_hands_over() {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let view = BatchView::parse(&buf[..len]).unwrap();
        let (mut a, mut b) = (drafter(), drafter());
        let mut g = StepBuffer::new(a.grad_len());
        for _ in 0..3 {
            a.gradient(&view, &mut g).unwrap();
            let mut h = StepBuffer::new(b.grad_len());
            b.gradient(&view, &mut h).unwrap();
            let mut sum = StepBuffer::new(a.grad_len());
            for (s, (x, y)) in sum
                .words_mut()
                .iter_mut()
                .zip(g.words().iter().zip(h.words()))
            {
                *s = x + y;
            }
            a.apply(&sum).unwrap();
            b.apply(&sum).unwrap();
            assert_eq!(a.digest(), b.digest());
        }
        let mut c = drafter();
        c.import_state(&a.export_state().unwrap()).unwrap();
        assert_eq!((c.digest(), c.step), (a.digest(), 3));
        assert!(c.import_state(&[1, 2, 3]).is_err());
    }

    /// A drafter after three steps on `batch`.
    fn trained() -> MockDrafter {
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let mut d = drafter();
        for _ in 0..3 {
            d.train_step(&BatchView::parse(&buf[..len]).unwrap())
                .unwrap();
        }
        d
    }

    #[test]
    fn checkpoint_restores_the_exact_state_and_bad_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("hspipe-gpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = trained();
        let path = dir.join("ckpt.safetensors");
        d.save(&path).unwrap();
        let mut e = drafter();
        e.load(&path).unwrap();
        assert_eq!(
            (e.step, e.export_state().unwrap()),
            (3, d.export_state().unwrap())
        );

        std::fs::write(dir.join("bad"), b"not a checkpoint").unwrap();
        let err = e.load(&dir.join("bad")).unwrap_err().to_string();
        assert!(err.contains("bad") && err.contains("safetensors"), "{err}");
        let err = e.load(&dir.join("missing")).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        let err = MockDrafter::new(fast(), 8192, 8)
            .load(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("embed.weight"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A byte flipped on disk inside a checkpoint's tensors (the weights, an optimizer moment,
    /// the step) leaves a file that still parses; it is refused, naming the file and saying it
    /// is damaged, instead of a resume going on from weights no step made.
    #[test]
    fn a_checkpoint_with_a_byte_changed_on_disk_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = trained();
        let path = dir.path().join("ckpt.safetensors");
        d.save(&path).unwrap();
        let whole = std::fs::read(&path).unwrap();
        // The data follows the 8-byte length and the header; flip a byte at the data's start
        // (the step, the smallest alignment first, or a table), middle and end.
        let header = 8 + u64::from_le_bytes(whole[..8].try_into().unwrap()) as usize;
        for at in [header, (header + whole.len()) / 2, whole.len() - 1] {
            let mut bad = whole.clone();
            bad[at] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let err = drafter().load(&path).unwrap_err().to_string();
            assert!(
                err.contains("ckpt.safetensors") && err.contains("damaged"),
                "byte {at}: {err}"
            );
        }
        std::fs::write(&path, &whole).unwrap();
        drafter().load(&path).unwrap();
    }

    /// A checkpoint written before checkpoints went through the `safetensors` crate (by our own
    /// writer of the format, 2026-11; 64 parameters after two steps on `batch`) still loads, to
    /// the state the same two steps give today: a run checkpointed by that build resumes.
    #[test]
    fn a_checkpoint_written_by_the_earlier_writer_still_loads() {
        let old = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/mock-drafter-before-safetensors-crate.safetensors"
        );
        let mut buf = vec![0u8; 8192];
        let len = batch(&mut buf, false);
        let mut want = MockDrafter::new(fast(), 64, 8);
        for _ in 0..2 {
            want.train_step(&BatchView::parse(&buf[..len]).unwrap())
                .unwrap();
        }
        let mut got = MockDrafter::new(fast(), 64, 8);
        got.load(Path::new(old)).unwrap();
        assert_eq!(
            (got.step, got.export_state().unwrap()),
            (2, want.export_state().unwrap())
        );
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

    /// The slowest speed and factor a config may set, on the largest batch, still cost a
    /// duration (validation's bounds are what keep `cost` from panicking).
    #[test]
    fn the_slowest_valid_config_costs_a_duration() {
        let s = Sim::new(
            proto::config::MIN_TOKENS_PER_S,
            Faults {
                slow: Some(proto::config::MAX_SLOW),
                ..Faults::default()
            },
        );
        let most = proto::config::MAX_TOKEN_BUDGET;
        assert!(s.cost(&[most]) > Duration::from_secs(1));
    }
}
