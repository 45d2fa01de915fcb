//! What training needs on candle: differentiable forms of the ops the inference path takes fused,
//! named f32 parameters flattened for the drafter group's all-reduce, and AdamW (on host f32
//! masters, or on the parameters' device) with warm-up then cosine decay, and global-norm
//! clipping.
//!
//! candle's fused `candle_nn::ops::rms_norm`, `softmax_last_dim` and `rotary_emb::rope*` have no
//! backward: gradients stop at them silently and a loss still falls. Everything trained here is
//! built from ops that have one (`sqr`, `mean`, `exp`, `narrow`, `cat`, `matmul`, ...); a test
//! checks every parameter gets a gradient.
//!
//! Length: past 500 lines with its tests: the parameters and both AdamWs (host and device, one
//! the other's oracle) share their layout and coefficients.

use candle_core::{backprop::GradStore, DType, Device, Tensor, Var, D};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::{ModelError, Result};

/// `x * w / sqrt(mean(x^2) + eps)` over the last dimension.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let r = (ms + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&r)?.broadcast_mul(w)?)
}

/// Softmax over the last dimension (the max subtracted is a constant: no gradient through it).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Softmax over the last dimension of `a` and `b` side by side, as if concatenated there (their
/// other dimensions equal), each one's share returned in its own shape: one max and one sum a
/// row over both, and no concatenated copy (the max subtracted is a constant, as in
/// [`softmax`]).
pub fn softmax_pair(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let m = (a.max_keepdim(D::Minus1)?)
        .maximum(&b.max_keepdim(D::Minus1)?)?
        .detach();
    let ea = a.broadcast_sub(&m)?.exp()?;
    let eb = b.broadcast_sub(&m)?.exp()?;
    let sum = (ea.sum_keepdim(D::Minus1)? + eb.sum_keepdim(D::Minus1)?)?;
    Ok((ea.broadcast_div(&sum)?, eb.broadcast_div(&sum)?))
}

/// `log(sum(exp(x)))` over the last dimension, kept as `[.., 1]`.
pub fn log_sum_exp(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let s = x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(s.broadcast_add(&m)?)
}

/// A frozen LM head's weighted cross-entropy over some rows, with its gradient at the rows.
pub struct HeadLoss {
    /// `sum(weight * (logsumexp(logits) - logits[label]))`, a scalar.
    pub loss: Tensor,
    /// The loss's gradient at the rows, `[rows, hidden]`.
    pub grad: Tensor,
    /// Each row's greedy token, `[rows]`.
    pub argmax: Tensor,
}

/// The weighted cross-entropy of rows `h` (`[rows, hidden]`) through the frozen head `w`
/// (`[vocab, hidden]`) against `labels` (`[rows]`, u32) weighted by `weights` (`[rows]`), and its
/// gradient at `h` written by hand, not by candle's backward:
/// `weight * (softmax(logits) - onehot(label)) · w` is `((e · w) * weight / sum(e)) -
/// weight * w[label]` with `e = exp(logits - max)`, so the one-hot and the probabilities are
/// never made. The logits see five passes (the max, the shift, the exponential, its sum, the
/// greedy pick) and the product back to the rows; candle's backward of the same ops made some
/// twenty, a scatter into a vocabulary-wide tensor of zeros among them.
pub fn head_loss(h: &Tensor, w: &Tensor, labels: &Tensor, weights: &Tensor) -> Result<HeadLoss> {
    let (h, w) = (h.detach(), w.detach());
    let logits = h.matmul(&w.t()?)?;
    let m = logits.max_keepdim(D::Minus1)?;
    let e = logits.broadcast_sub(&m)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let labels_col = labels.unsqueeze(1)?;
    // logsumexp - logits[label] = log(sum) - (logits[label] - max), one value a row.
    let picked = logits.gather(&labels_col, 1)?.broadcast_sub(&m)?;
    let nll = (sum.log()? - picked)?.squeeze(1)?;
    let loss = (nll * weights)?.sum_all()?;
    let wt = weights.unsqueeze(1)?;
    let grad = (e.matmul(&w)?.broadcast_mul(&(&wt / &sum)?)?
        - w.index_select(labels, 0)?.broadcast_mul(&wt)?)?;
    Ok(HeadLoss {
        loss,
        grad,
        argmax: logits.argmax(D::Minus1)?,
    })
}

/// The sum of every element of `t`, a scalar, with the same gradient as `t.sum_all()` but
/// spread over the device. candle's CUDA reduction gives each output value one thread block, so
/// `sum_all` of a tensor of millions of elements runs on one of a GPU's SMs (an H200 has 132);
/// the DFlash step's AdamW, whose norm summed a billion weights so, took 0.88 s there against
/// torch's 13 ms (BENCHMARKS, "The GPU path on an H200"). Here the dimensions are
/// split in two where the outer count is nearest the square root of the total
/// ([`sum_split`]), the inner part summed first (a block per outer row), then the outer. A tensor
/// of one dimension is not split (nor is one whose only split is 1 by n).
pub fn sum_all(t: &Tensor) -> Result<Tensor> {
    let (outer, inner) = sum_split(t.dims());
    if outer <= 1 || inner <= 1 {
        return Ok(t.sum_all()?);
    }
    Ok(t.reshape((outer, inner))?.sum(1)?.sum_all()?)
}

/// `(outer, inner)`: the products of `dims` before and from the split point whose outer
/// product is nearest (by ratio) the square root of the whole, so each of the two reductions
/// [`sum_all`] makes is a fair share of the work: `outer` blocks of `inner` elements each, then
/// one block of `outer`.
pub fn sum_split(dims: &[usize]) -> (usize, usize) {
    let n: usize = dims.iter().product();
    let root = (n as f64).sqrt().max(1.0);
    let mut best = (1, n);
    let mut outer = 1usize;
    for &d in dims {
        outer *= d;
        let off = |o: usize| (o.max(1) as f64 / root).ln().abs();
        if off(outer) < off(best.0) {
            best = (outer, n / outer.max(1));
        }
    }
    best
}

/// Rotary embedding in HF's rotate-half form: `x [.., n, d]` by `cos`, `sin` `[n, d/2]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let h = d / 2;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, h)?;
    let x2 = x.narrow(D::Minus1, h, h)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?)?)
}

/// How q and k heads are prepared: RMS-normed per head, then rotated (v heads get neither).
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub weight: &'a Tensor,
    pub eps: f64,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
}

/// A projection's output `[lead.., n * d]` as heads `[lead[..-1], n, lead[-1], d]` (rows
/// behind the head axis), contiguous; q and k also normed and rotated by `qk`.
pub fn heads(
    y: &Tensor,
    lead: &[usize],
    n: usize,
    d: usize,
    qk: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    let mut dims = lead.to_vec();
    dims.extend([n, d]);
    let y = y.reshape(dims)?;
    let y = match qk {
        Some(q) => rms_norm(&y, q.weight, q.eps)?,
        None => y,
    };
    let y = y.transpose(lead.len() - 1, lead.len())?.contiguous()?;
    match qk {
        Some(q) => rope(&y, q.cos, q.sin),
        None => Ok(y),
    }
}

/// `x [n, in]` through an HF `[out, in]` weight.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal(0, std): projections.
    Normal(f32),
    /// All ones: norm weights.
    Ones,
}

/// Named f32 parameters in a fixed order: the order their gradients, weights and optimizer
/// moments are flattened in (the group sums the flat gradient word by word).
pub struct Params {
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    vars: Vec<Var>,
}

/// The gradient of `t` in `grads`, cut from the graph. candle's gradients are tensors like any
/// other, and candle detaches only those it passes on inside the backward: the gradient of a
/// leaf (a `Var`) that an op read directly is made from that op's other operand, so a leaf
/// multiplied by a forward tensor (`probs.matmul(&values)`) gets a gradient that keeps the
/// whole forward graph behind that tensor alive. A gradient kept past its backward (summed over
/// chunks, parts or steps) is taken through here. The DFlash drafter's cut context values are
/// such leaves: kept as they came, each part's graph lived until the sequence's last part, and
/// a 5-layer Qwen3-8B-shaped drafter at 512 blocks of 16 in 4096 tokens ran an H200 out of
/// memory (139 GiB) at every part size tried.
pub fn grad_of(grads: &GradStore, t: &Tensor) -> Option<Tensor> {
    grads.get(t).map(Tensor::detach)
}

/// `sum += t`, a sum not yet begun taking `t` as it is (gradients summed over chunks or parts,
/// which a parameter may have none of).
pub fn add_into(sum: &mut Option<Tensor>, t: Tensor) -> Result<()> {
    *sum = Some(match sum.take() {
        Some(s) => (s + t)?,
        None => t,
    });
    Ok(())
}

/// Values per parallel draw in [`Params::new`]: enough that a chunk's jump (a few hundred of the
/// generator's steps over its whole state) is small beside its 2^19 draws.
pub const DRAW_CHUNK: usize = 1 << 18;

impl Params {
    /// Parameters `specs` (name, shape, init), drawn from one stream seeded by `seed`, in
    /// order: the same seed gives the same bits on every rank.
    ///
    /// The draws are made in parallel, in chunks of [`DRAW_CHUNK`] values, each from the stream
    /// jumped ahead to its first value (every value takes two of the generator's 64-bit
    /// outputs, and xoshiro jumps any distance in a few hundred steps): the same bits as one
    /// thread drawing them in order, on any number of threads, in a fraction of the time (a
    /// 1B-weight drafter took half a minute to start on one thread).
    pub fn new(specs: &[(String, Vec<usize>, Init)], seed: u64, device: &Device) -> Result<Params> {
        use rayon::prelude::*;
        let start = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut values: Vec<(String, Vec<usize>, Vec<f32>)> = specs
            .iter()
            .map(|(name, shape, init)| {
                let n: usize = shape.iter().product();
                let fill = if matches!(init, Init::Ones) { 1.0 } else { 0.0 };
                (name.clone(), shape.clone(), vec![fill; n])
            })
            .collect();
        // Each chunk of a normal tensor, with its std and the index of its first value in the
        // stream (which runs through the normal tensors in order).
        let mut chunks = Vec::new();
        let mut first = 0u64;
        for ((_, _, data), (_, _, init)) in values.iter_mut().zip(specs) {
            if let Init::Normal(std) = *init {
                let n = data.len() as u64;
                for (i, chunk) in data.chunks_mut(DRAW_CHUNK).enumerate() {
                    chunks.push((chunk, std, first + (i * DRAW_CHUNK) as u64));
                }
                first += n;
            }
        }
        chunks.into_par_iter().for_each(|(chunk, std, at)| {
            let mut rng = start.clone();
            rng.jump_ce(2 * at, 0);
            for x in chunk {
                *x = normal(&mut rng) * std;
            }
        });
        Params::from_values(values, device)
    }

    /// Parameters with the given values, in order.
    pub fn from_values(
        values: Vec<(String, Vec<usize>, Vec<f32>)>,
        device: &Device,
    ) -> Result<Params> {
        let mut p = Params {
            names: Vec::new(),
            shapes: Vec::new(),
            vars: Vec::new(),
        };
        for (name, shape, data) in values {
            let t = Tensor::from_vec(data, shape.as_slice(), device)?;
            p.names.push(name);
            p.shapes.push(shape);
            p.vars.push(Var::from_tensor(&t)?);
        }
        Ok(p)
    }

    /// Parameter `name` (a programming error if absent: names come from the model's own list).
    pub fn get(&self, name: &str) -> &Tensor {
        let i = self.names.iter().position(|n| n == name);
        match i {
            Some(i) => self.vars[i].as_tensor(),
            None => panic!("no parameter {name}"),
        }
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    pub fn tensors(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        (self.names.iter().map(String::as_str)).zip(self.vars.iter().map(Var::as_tensor))
    }

    /// Elements of all parameters.
    pub fn len(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The weights, flattened in order.
    pub fn flat(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.len());
        for v in &self.vars {
            out.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Each row's sum in f64, in order (a row: the last dimension; a vector is one row): a
    /// fingerprint of the weights made where they are, of which one f64 a row comes to the
    /// host, not four bytes a weight. Deterministic (the same kernels on the same bits), and a
    /// one-ulp change of a weight changes its row's sum unless the row's partial sums are more
    /// than 2^29 times that weight's magnitude (an f32's 24 bits inside an f64's 53).
    pub fn row_sums(&self) -> Result<Vec<f64>> {
        let rows = (self.vars.iter())
            .map(|v| {
                let t = v.as_tensor();
                let last = t.dims().last().copied().unwrap_or(1);
                Ok(t.to_dtype(DType::F64)?.reshape(((), last))?.sum(1)?)
            })
            .collect::<Result<Vec<Tensor>>>()?;
        Ok(Tensor::cat(&rows, 0)?.to_vec1::<f64>()?)
    }

    /// Sets the weights from `flat` (the layout of [`Params::flat`]).
    pub fn set_flat(&mut self, flat: &[f32]) -> Result<()> {
        if flat.len() != self.len() {
            return Err(ModelError::Input(format!(
                "{} weights given, the model has {}",
                flat.len(),
                self.len()
            )));
        }
        let mut at = 0;
        for (v, shape) in self.vars.iter().zip(&self.shapes) {
            let n: usize = shape.iter().product();
            let t = Tensor::from_slice(&flat[at..at + n], shape.as_slice(), v.device())?;
            v.set(&t)?;
            at += n;
        }
        Ok(())
    }

    /// A gradient of these parameters summed where they are (nothing yet).
    pub fn grads(&self) -> Grads {
        Grads(vec![None; self.vars.len()])
    }

    /// Adds the gradients in `grads` to `acc` on the parameters' device; a parameter without
    /// one adds nothing.
    pub fn accumulate(&self, grads: &GradStore, acc: &mut Grads) -> Result<()> {
        for (v, sum) in self.vars.iter().zip(&mut acc.0) {
            if let Some(g) = grad_of(grads, v.as_tensor()) {
                add_into(sum, g.to_dtype(DType::F32)?)?;
            }
        }
        Ok(())
    }

    /// Adds the gradients in `grads` to `out` (the layout of [`Params::flat`]); a parameter
    /// without one adds nothing.
    pub fn add_grads(&self, grads: &GradStore, out: &mut [f32]) -> Result<()> {
        let mut at = 0;
        for (v, shape) in self.vars.iter().zip(&self.shapes) {
            let n: usize = shape.iter().product();
            if let Some(g) = grads.get(v.as_tensor()) {
                let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                for (o, x) in out[at..at + n].iter_mut().zip(g) {
                    *o += x;
                }
            }
            at += n;
        }
        Ok(())
    }
}

/// A gradient summed on the parameters' device over a step's parts (see
/// [`Params::accumulate`]), copied to the host once by [`Grads::add_to`], or kept there as one
/// flat tensor by [`Grads::flat`].
#[derive(Clone, Debug)]
pub struct Grads(Vec<Option<Tensor>>);

impl Grads {
    /// The sum as one flat f32 tensor on the parameters' device (the layout of
    /// [`Params::flat`]; zeros for a parameter without a gradient): what a device-resident
    /// exchange reduces and [`DeviceAdamW::update_flat`] takes. One device-to-device copy of
    /// the gradient, no host copy.
    pub fn flat(&self, params: &Params) -> Result<Tensor> {
        if self.0.len() != params.vars.len() {
            return Err(ModelError::Input(format!(
                "a gradient of {} tensors for {} parameters",
                self.0.len(),
                params.vars.len()
            )));
        }
        let parts = (self.0.iter().zip(&params.vars))
            .map(|(g, var)| match g {
                Some(g) => Ok(g.flatten_all()?),
                None => Ok(var.as_tensor().flatten_all()?.zeros_like()?),
            })
            .collect::<Result<Vec<Tensor>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Adds the sum to `out` (the layout of [`Params::flat`] for `params`).
    pub fn add_to(&self, params: &Params, out: &mut [f32]) -> Result<()> {
        if out.len() != params.len() || self.0.len() != params.vars.len() {
            return Err(ModelError::Input(format!(
                "a gradient buffer of {} for {} weights",
                out.len(),
                params.len()
            )));
        }
        let mut at = 0;
        for (g, shape) in self.0.iter().zip(&params.shapes) {
            let n: usize = shape.iter().product();
            if let Some(g) = g {
                for (o, x) in out[at..at + n]
                    .iter_mut()
                    .zip(g.flatten_all()?.to_vec1::<f32>()?)
                {
                    *o += x;
                }
            }
            at += n;
        }
        Ok(())
    }
}

/// A standard normal draw (Box-Muller; u1 in (0, 1], so the log is finite).
pub(crate) fn normal(rng: &mut impl RngExt) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// The largest absolute value of `t` (tests' measure of how far two tensors are apart).
#[cfg(test)]
pub(crate) fn max_abs(t: &Tensor) -> f32 {
    let t = t.abs().unwrap().flatten_all().unwrap();
    t.max(0).unwrap().to_scalar().unwrap()
}

/// AdamW's settings and the schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Steps of linear warm-up from 0.
    pub warmup_steps: u64,
    /// The run's total steps: cosine decay from `lr` to `lr * min_lr_ratio` over the steps after
    /// the warm-up; later steps keep the floor.
    pub total_steps: u64,
    pub min_lr_ratio: f64,
    /// The global gradient norm is clipped to this (0: no clipping).
    pub clip: f64,
}

impl AdamWConfig {
    /// The learning rate of step `step` (1-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        let w = self.warmup_steps;
        if w > 0 && step <= w {
            return self.lr * step as f64 / w as f64;
        }
        let span = self.total_steps.saturating_sub(w).max(1);
        let t = (step.saturating_sub(w) as f64 / span as f64).min(1.0);
        let floor = self.lr * self.min_lr_ratio;
        floor + (self.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// One update's coefficients, the host's and the device's AdamW alike.
struct Step {
    /// The gradient's factor for clipping to the global norm.
    clip: f32,
    lr: f64,
    b1: f32,
    b2: f32,
    /// Bias corrections.
    c1: f32,
    c2: f32,
    lrf: f32,
    eps: f32,
    wd: f32,
}

impl AdamWConfig {
    /// The coefficients of update `step` (1-based) for a gradient of global norm `norm`.
    fn step(&self, step: u64, norm: f64) -> Step {
        let lr = self.lr_at(step);
        let t = step as i32;
        let (b1, b2) = (self.beta1 as f32, self.beta2 as f32);
        Step {
            clip: if self.clip > 0.0 && norm > self.clip {
                (self.clip / norm) as f32
            } else {
                1.0
            },
            lr,
            b1,
            b2,
            c1: 1.0 - b1.powi(t),
            c2: 1.0 - b2.powi(t),
            lrf: lr as f32,
            eps: self.eps as f32,
            wd: self.weight_decay as f32,
        }
    }
}

/// AdamW over flat f32 masters: moments in f32 whatever the weights' dtype, decoupled weight
/// decay, bias correction. Pure f32 arithmetic in a fixed order: the same gradient gives the same
/// bits on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// What one update did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Update {
    pub lr: f64,
    /// The gradient's global norm before clipping.
    pub grad_norm: f64,
    /// The gradient was NaN or infinite (its norm is not finite): the weights and moments were
    /// left as they were, as torch's GradScaler skips such a step. One such update would make
    /// every weight NaN, and every later step and checkpoint with them. The optimizer's step
    /// does not count it (its bias corrections and schedule go on from where they were, as
    /// torch's Adam does when GradScaler skips its `step()`), and the decision is every rank's
    /// alike: they update from the same summed gradient.
    pub skipped: bool,
}

impl Update {
    /// The update left out for a gradient of norm `grad_norm` that is not finite.
    fn skipped(lr: f64, grad_norm: f64) -> Update {
        Update {
            lr,
            grad_norm,
            skipped: true,
        }
    }
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, len: usize) -> AdamW {
        AdamW {
            cfg,
            step: 0,
            m: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    /// One update of `w` from the gradient `g` times `scale` (the loss normaliser), clipped to
    /// the global norm.
    pub fn update(&mut self, w: &mut [f32], g: &[f32], scale: f32) -> Update {
        let c = self.cfg;
        let norm = host_norm(g, scale);
        let st = c.step(self.step + 1, norm);
        if !norm.is_finite() {
            return Update::skipped(st.lr, norm);
        }
        self.step += 1;
        st.apply(w, &mut self.m, &mut self.v, g, scale);
        Update {
            lr: st.lr,
            grad_norm: norm,
            skipped: false,
        }
    }
}

/// The global norm of `g` times `scale`, summed in order in f64 (the host's form).
fn host_norm(g: &[f32], scale: f32) -> f64 {
    (g.iter().map(|&x| f64::from(x * scale).powi(2)).sum::<f64>()).sqrt()
}

impl Step {
    /// The update of weights `w` with moments `m`, `v` from gradient `g` times `scale`, an
    /// element at a time in one pass.
    fn apply(&self, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], scale: f32) {
        let st = self;
        for (((w, m), v), g) in w.iter_mut().zip(m).zip(v).zip(g) {
            let g = g * scale * st.clip;
            *m = st.b1 * *m + (1.0 - st.b1) * g;
            *v = st.b2 * *v + (1.0 - st.b2) * g * g;
            *w -= st.lrf * ((*m / st.c1) / ((*v / st.c2).sqrt() + st.eps) + st.wd * *w);
        }
    }
}

/// AdamW on the parameters' own device: the moments are tensors beside the weights, the
/// group's summed gradient is uploaded once per update (from the host, where the group reduced
/// it), and the weights are set in place, so nothing the size of the model crosses to the host
/// or is computed there. The same kernels on the same inputs give the same bits on every rank.
/// Against [`AdamW`] on the host it differs by rounding only: the element-wise ops are grouped
/// as candle's scalar ops allow, the norm is summed per parameter, and a GPU fuses
/// multiply-adds. (candle_nn's AdamW keeps its moments private: no checkpoint, no hand-over to a
/// joining rank.) On the CPU the device is the host: there the moments are flat host vectors
/// and each tensor is updated by [`AdamW`]'s own loop, bit for bit the host's form (one pass
/// over each tensor, copied out and set back; candle's element-wise ops made a dozen passes,
/// each allocating).
pub struct DeviceAdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    moments: Moments,
}

/// Where [`DeviceAdamW`] keeps its moments.
enum Moments {
    /// Tensors beside the weights, one per parameter (a GPU's form).
    Tensors { m: Vec<Tensor>, v: Vec<Tensor> },
    /// Flat on the host, the layout of [`Params::flat`] (the CPU's form).
    Host { m: Vec<f32>, v: Vec<f32> },
}

impl DeviceAdamW {
    /// Zero moments for `params`: on the host for CPU parameters, else tensors on their device.
    pub fn new(cfg: AdamWConfig, params: &Params) -> Result<DeviceAdamW> {
        if params.vars.iter().all(|v| v.device().is_cpu()) {
            let n = params.len();
            return Ok(DeviceAdamW {
                cfg,
                step: 0,
                moments: Moments::Host {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                },
            });
        }
        DeviceAdamW::with_tensors(cfg, params)
    }

    /// Zero moments as tensors beside `params` on any device (what a GPU's update runs; on the
    /// CPU, for its test and the step benchmark's figure side by side).
    pub fn with_tensors(cfg: AdamWConfig, params: &Params) -> Result<DeviceAdamW> {
        let zeros = || -> Result<Vec<Tensor>> {
            (params.vars.iter())
                .map(|v| Ok(v.as_tensor().zeros_like()?))
                .collect()
        };
        Ok(DeviceAdamW {
            cfg,
            step: 0,
            moments: Moments::Tensors {
                m: zeros()?,
                v: zeros()?,
            },
        })
    }

    /// One update of `params` from the flat gradient `g` (the layout of [`Params::flat`]) times
    /// `scale` (the loss normaliser), clipped to the global norm.
    pub fn update(&mut self, params: &Params, g: &[f32], scale: f32) -> Result<Update> {
        self.update_from(params, Gradient::Host(g), scale)
    }

    /// [`DeviceAdamW::update`] from a flat f32 gradient tensor on the parameters' device (see
    /// [`Grads::flat`]): on a GPU nothing of it comes to the host; the same bits as `update`
    /// given its values.
    pub fn update_flat(&mut self, params: &Params, g: &Tensor, scale: f32) -> Result<Update> {
        if g.dtype() != DType::F32 || g.rank() != 1 {
            return Err(ModelError::Input(format!(
                "a flat f32 gradient tensor, given {:?} of shape {:?}",
                g.dtype(),
                g.dims()
            )));
        }
        self.update_from(params, Gradient::Flat(g), scale)
    }

    fn update_from(&mut self, params: &Params, g: Gradient<'_>, scale: f32) -> Result<Update> {
        let (have, want) = match &self.moments {
            Moments::Tensors { m, .. } => (m.len(), params.vars.len()),
            Moments::Host { m, .. } => (m.len(), params.len()),
        };
        if g.len() != params.len() || have != want {
            return Err(ModelError::Input(format!(
                "a gradient of {} for {} weights in {} tensors (the optimizer has {have} moments \
                 for {want})",
                g.len(),
                params.len(),
                params.vars.len(),
            )));
        }
        // Counted once applied: a skipped update leaves the bias corrections where they were.
        let (c, step) = (self.cfg, self.step + 1);
        let u = match &mut self.moments {
            Moments::Tensors { m, v } => tensors_update(&c, step, params, m, v, g, scale),
            Moments::Host { m, v } => {
                // The CPU's form: a flat tensor there is host memory already.
                let flat;
                let g = match g {
                    Gradient::Host(g) => g,
                    Gradient::Flat(t) => {
                        flat = t.to_vec1::<f32>()?;
                        &flat
                    }
                };
                let norm = host_norm(g, scale);
                let st = c.step(step, norm);
                if !norm.is_finite() {
                    return Ok(Update::skipped(st.lr, norm));
                }
                let mut at = 0;
                for var in &params.vars {
                    let n = var.elem_count();
                    let mut w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
                    let r = at..at + n;
                    st.apply(&mut w, &mut m[r.clone()], &mut v[r.clone()], &g[r], scale);
                    var.set(&Tensor::from_vec(w, var.shape(), var.device())?)?;
                    at += n;
                }
                Ok(Update {
                    lr: st.lr,
                    grad_norm: norm,
                    skipped: false,
                })
            }
        }?;
        if !u.skipped {
            self.step = step;
        }
        Ok(u)
    }

    /// The moments `(m, v)`, flattened as [`Params::flat`] (copied to the host).
    pub fn moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let flat = |ts: &[Tensor]| -> Result<Vec<f32>> {
            let mut out = Vec::new();
            for t in ts {
                out.extend(t.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(out)
        };
        match &self.moments {
            Moments::Tensors { m, v } => Ok((flat(m)?, flat(v)?)),
            Moments::Host { m, v } => Ok((m.clone(), v.clone())),
        }
    }

    /// Sets the moments from flat `m` and `v` (the layout of [`Params::flat`] for `params`).
    pub fn set_moments(&mut self, params: &Params, m: &[f32], v: &[f32]) -> Result<()> {
        for (name, flat) in [("m", m), ("v", v)] {
            if flat.len() != params.len() {
                return Err(ModelError::Input(format!(
                    "{} AdamW moments ({name}) given, the model has {} weights",
                    flat.len(),
                    params.len()
                )));
            }
        }
        let tensors = |flat: &[f32]| -> Result<Vec<Tensor>> {
            let mut at = 0;
            (params.vars.iter().zip(&params.shapes))
                .map(|(var, shape)| {
                    let n: usize = shape.iter().product();
                    let t = Tensor::from_slice(&flat[at..at + n], shape.as_slice(), var.device());
                    at += n;
                    Ok(t?)
                })
                .collect()
        };
        self.moments = match self.moments {
            Moments::Tensors { .. } => Moments::Tensors {
                m: tensors(m)?,
                v: tensors(v)?,
            },
            Moments::Host { .. } => Moments::Host {
                m: m.to_vec(),
                v: v.to_vec(),
            },
        };
        Ok(())
    }
}

/// An update's gradient: flat on the host, or a flat tensor on the parameters' device.
#[derive(Clone, Copy)]
enum Gradient<'a> {
    Host(&'a [f32]),
    Flat(&'a Tensor),
}

impl Gradient<'_> {
    fn len(&self) -> usize {
        match self {
            Gradient::Host(g) => g.len(),
            Gradient::Flat(t) => t.elem_count(),
        }
    }

    /// Elements `at..at + n` as a tensor of `shape` on `device` (a view of a flat tensor).
    fn part(&self, at: usize, shape: &[usize], device: &Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        Ok(match self {
            Gradient::Host(g) => Tensor::from_slice(&g[at..at + n], shape, device)?,
            Gradient::Flat(t) => t.narrow(0, at, n)?.reshape(shape)?,
        })
    }
}

/// [`DeviceAdamW::update`] with moments beside the weights: each tensor's gradient uploaded (or
/// a view of the flat tensor on the device), the norm summed per tensor in f64 on the device
/// ([`sum_all`]) and the tensors' sums added there, the update in candle's element-wise ops.
fn tensors_update(
    c: &AdamWConfig,
    step: u64,
    params: &Params,
    m: &mut [Tensor],
    v: &mut [Tensor],
    g: Gradient<'_>,
    scale: f32,
) -> Result<Update> {
    let mut grads = Vec::with_capacity(params.vars.len());
    let mut squares = Vec::with_capacity(params.vars.len());
    let mut at = 0;
    for (var, shape) in params.vars.iter().zip(&params.shapes) {
        let n: usize = shape.iter().product();
        let t = g.part(at, shape, var.device())?;
        squares.push(sum_all(&t.to_dtype(DType::F64)?.sqr()?)?.reshape(1)?);
        grads.push(t);
        at += n;
    }
    // One value comes to the host, not one a tensor.
    let sq = match squares.is_empty() {
        true => 0.0,
        false => Tensor::cat(&squares, 0)?.sum_all()?.to_scalar::<f64>()?,
    };
    let norm = sq.sqrt() * f64::from(scale.abs());
    let st = c.step(step, norm);
    if !norm.is_finite() {
        return Ok(Update::skipped(st.lr, norm));
    }
    let k = f64::from(scale * st.clip);
    let f = f64::from;
    for (((var, m), v), g) in params.vars.iter().zip(m).zip(v).zip(grads) {
        let g = g.affine(k, 0.0)?;
        *m = (m.affine(f(st.b1), 0.0)? + g.affine(f(1.0 - st.b1), 0.0)?)?;
        *v = (v.affine(f(st.b2), 0.0)? + (g.affine(f(1.0 - st.b2), 0.0)? * &g)?)?;
        let step = (m.affine(f(1.0 / st.c1), 0.0)?
            / (v.affine(f(1.0 / st.c2), 0.0)?.sqrt()? + f(st.eps))?)?;
        let w = var.as_tensor();
        let next = (w.affine(f(1.0 - st.lrf * st.wd), 0.0)? - step.affine(f(st.lrf), 0.0)?)?;
        var.set(&next)?;
    }
    Ok(Update {
        lr: st.lr,
        grad_norm: norm,
        skipped: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AdamWConfig {
        AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_steps: 10,
            total_steps: 110,
            min_lr_ratio: 0.1,
            clip: 1.0,
        }
    }

    #[test]
    fn the_schedule_warms_up_then_decays_to_its_floor() {
        let c = cfg();
        assert!((c.lr_at(1) - 1e-3).abs() < 1e-12);
        assert!((c.lr_at(10) - 1e-2).abs() < 1e-12);
        assert!((c.lr_at(60) - 0.55e-2).abs() < 1e-9, "{}", c.lr_at(60));
        assert!((c.lr_at(110) - 1e-3).abs() < 1e-12);
        assert!((c.lr_at(500) - 1e-3).abs() < 1e-12);
    }

    #[test]
    fn a_large_gradient_is_clipped_to_norm_one() {
        let mut a = AdamW::new(cfg(), 2);
        let mut w = [0.0f32; 2];
        let u = a.update(&mut w, &[30.0, 40.0], 1.0);
        assert!((u.grad_norm - 50.0).abs() < 1e-9);
        // Adam's first step moves each weight by lr whatever the scale: the clip shows in m.
        assert!((a.m[0] - 0.1 * 0.6).abs() < 1e-6 && (a.m[1] - 0.1 * 0.8).abs() < 1e-6);
    }

    #[test]
    fn differentiable_ops_agree_with_candles_fused_ones() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, 8, &dev).unwrap();
        let want = candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap();
        let got = rms_norm(&x, &w, 1e-6).unwrap();
        let diff = |a: &Tensor, b: &Tensor| max_abs(&(a - b).unwrap());
        assert!(diff(&want, &got) < 1e-5);
        let want = candle_nn::ops::softmax_last_dim(&x).unwrap();
        assert!(diff(&want, &softmax(&x).unwrap()) < 1e-6);
        let lse = log_sum_exp(&x).unwrap();
        let want = x.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
        assert!(diff(&want, &lse) < 1e-5);
        let (cos, sin) = (
            Tensor::randn(0f32, 1.0, (3, 4), &dev).unwrap(),
            Tensor::randn(0f32, 1.0, (3, 4), &dev).unwrap(),
        );
        let x4 = x.reshape((1, 1, 3, 8)).unwrap();
        let want = candle_nn::rotary_emb::rope(&x4, &cos, &sin).unwrap();
        assert!(diff(&want, &rope(&x4, &cos, &sin).unwrap()) < 1e-5);
    }

    /// The oracle for the device's AdamW is the host's on the same weights and gradients:
    /// after five updates (one clipped, with weight decay and a warm-up) every weight and moment
    /// is within 1e-6 of the host's relative to the tensor's largest (rounding of a different
    /// grouping of the same f32 ops); the moments round-trip through the host exactly.
    #[test]
    fn adamw_on_the_device_agrees_with_the_hosts() {
        let specs = vec![
            ("a".to_string(), vec![3, 5], Init::Normal(0.5)),
            ("b".to_string(), vec![7], Init::Ones),
        ];
        let c = AdamWConfig {
            weight_decay: 0.1,
            warmup_steps: 2,
            ..cfg()
        };
        let params = Params::new(&specs, 3, &Device::Cpu).unwrap();
        let mut w = params.flat().unwrap();
        let (mut host, mut dev) = (
            AdamW::new(c, w.len()),
            DeviceAdamW::with_tensors(c, &params).unwrap(),
        );
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
        for step in 0..5 {
            // Step 2's gradient is large: clipped on both.
            let size = if step == 2 { 40.0 } else { 0.3 };
            let g: Vec<f32> = (0..w.len()).map(|_| normal(&mut rng) * size).collect();
            let a = host.update(&mut w, &g, 0.5);
            let b = dev.update(&params, &g, 0.5).unwrap();
            assert_eq!(a.lr, b.lr);
            assert!(
                (a.grad_norm - b.grad_norm).abs() <= 1e-6 * a.grad_norm,
                "{a:?} {b:?}"
            );
        }
        assert!(host.m.iter().any(|&m| m.abs() > 1e-3), "the moments moved");
        let close = |want: &[f32], got: &[f32], what: &str| {
            let scale = want.iter().fold(0f32, |s, x| s.max(x.abs()));
            for (i, (x, y)) in want.iter().zip(got).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-6 * scale,
                    "{what}[{i}]: {x} against {y}"
                );
            }
        };
        close(&w, &params.flat().unwrap(), "weights");
        let (m, v) = dev.moments().unwrap();
        close(&host.m, &m, "m");
        close(&host.v, &v, "v");
        let mut again = DeviceAdamW::with_tensors(c, &params).unwrap();
        again.set_moments(&params, &m, &v).unwrap();
        assert_eq!(again.moments().unwrap(), (m, v));
        assert!(again.set_moments(&params, &w[..3], &w).is_err());
        assert!(dev.update(&params, &w[..3], 1.0).is_err());
    }

    /// A softmax over two pieces is the softmax of their concatenation, in value and in
    /// gradient (to f32 rounding), a row whose first piece is masked out to -inf included.
    #[test]
    fn a_softmax_of_a_pair_is_the_softmax_of_its_concatenation() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(8);
        let mut draw = |dims: &[usize]| {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|_| 3.0 * normal(&mut rng)).collect();
            Var::from_vec(v, dims, &Device::Cpu).unwrap()
        };
        let (a, b, w) = (draw(&[2, 3, 5]), draw(&[2, 3, 4]), draw(&[2, 3, 9]));
        // Row (0, 1) of `a` masked out entirely, as an anchor at a sequence's start is.
        let mut mask = vec![0f32; 2 * 3 * 5];
        mask[5..10].fill(f32::NEG_INFINITY);
        let mask = Tensor::from_vec(mask, (2, 3, 5), &Device::Cpu).unwrap();
        let am = (a.as_tensor() + &mask).unwrap();
        let (pa, pb) = softmax_pair(&am, b.as_tensor()).unwrap();
        let got = Tensor::cat(&[&pa, &pb], 2).unwrap();
        let want = softmax(&Tensor::cat(&[&am, b.as_tensor()], 2).unwrap()).unwrap();
        let diff = |x: &Tensor, y: &Tensor| max_abs(&(x - y).unwrap());
        assert!(diff(&got, &want) < 1e-6, "{}", diff(&got, &want));
        let masked = pa.narrow(0, 0, 1).unwrap().narrow(1, 1, 1).unwrap();
        assert_eq!(masked.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        // A weighted sum's gradient reaches both pieces alike.
        let loss = |p: &Tensor| (p * w.as_tensor()).unwrap().sum_all().unwrap();
        let (g1, g2) = (
            loss(&got).backward().unwrap(),
            loss(&want).backward().unwrap(),
        );
        for v in [&a, &b] {
            let (x, y) = (g1.get(v).unwrap(), g2.get(v).unwrap());
            assert!(diff(x, y) < 1e-6, "gradient {}", diff(x, y));
        }
    }

    /// The head's loss and its hand-written gradient are those of candle's ops on the same
    /// expression (the logits, logsumexp less the label's logit, weighted and summed) through
    /// candle's backward, within f32 rounding: a zero weight, a repeated label and rows far
    /// apart in scale included; the greedy tokens are the logits' argmax.
    #[test]
    fn the_heads_loss_and_gradient_are_candles_chain_rule() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(21);
        let (rows, hidden, vocab) = (5, 6, 11);
        let mut draw = |n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| scale * normal(&mut rng)).collect()
        };
        let mut hv = draw(rows * hidden, 1.0);
        hv[..hidden].iter_mut().for_each(|x| *x *= 20.0);
        let h = Var::from_vec(hv, (rows, hidden), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(draw(vocab * hidden, 1.0), (vocab, hidden), &Device::Cpu).unwrap();
        let labels = Tensor::from_vec(vec![3u32, 0, 10, 3, 7], rows, &Device::Cpu).unwrap();
        let weights =
            Tensor::from_vec(vec![1.0f32, 0.5, 0.0, 2.0, 1.0], rows, &Device::Cpu).unwrap();

        let got = head_loss(h.as_tensor(), &w, &labels, &weights).unwrap();
        let logits = h.as_tensor().matmul(&w.t().unwrap()).unwrap();
        let picked = logits.gather(&labels.unsqueeze(1).unwrap(), 1).unwrap();
        let nll = (log_sum_exp(&logits).unwrap() - picked)
            .unwrap()
            .squeeze(1)
            .unwrap();
        let want = (nll * &weights).unwrap().sum_all().unwrap();
        let g = want.backward().unwrap();
        let want_grad = g.get(h.as_tensor()).unwrap();

        let (a, b) = (
            got.loss.to_scalar::<f32>().unwrap(),
            want.to_scalar::<f32>().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} against {b}");
        let worst = |x: &Tensor, y: &Tensor| max_abs(&(x - y).unwrap()) / max_abs(y);
        assert!(
            worst(&got.grad, want_grad) < 1e-5,
            "gradient {}",
            worst(&got.grad, want_grad)
        );
        // The zero-weight row gets no gradient.
        let row2 = got.grad.get(2).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(row2.to_scalar::<f32>().unwrap(), 0.0);
        assert_eq!(
            got.argmax.to_vec1::<u32>().unwrap(),
            logits.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap()
        );
    }

    /// `sum_all` is candle's `sum_all` in value (within f32 rounding of another grouping) and in
    /// gradient, for every rank and for a transposed view; and it splits the DFlash step's
    /// tensors so both of its reductions have work for many thread blocks (candle's one
    /// `sum_all` block per tensor is what it replaces).
    #[test]
    fn a_spread_sum_is_candles_sum_with_many_blocks() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(4);
        for dims in [
            vec![],
            vec![7],
            vec![3, 5],
            vec![6, 40, 16],
            vec![2, 3, 4, 5],
        ] {
            let n: usize = dims.iter().product();
            let values: Vec<f32> = (0..n).map(|_| normal(&mut rng)).collect();
            let var = Var::from_vec(values, dims.as_slice(), &Device::Cpu).unwrap();
            let x = var.as_tensor();
            let views = [
                x.clone(),
                if dims.len() >= 2 {
                    x.t().unwrap()
                } else {
                    x.clone()
                },
            ];
            for t in views {
                let want = t.sum_all().unwrap().to_scalar::<f32>().unwrap();
                let s = (sum_all(&t).unwrap() * 3.0).unwrap();
                let got = s.to_scalar::<f32>().unwrap() / 3.0;
                let size: f32 = t.abs().unwrap().sum_all().unwrap().to_scalar().unwrap();
                assert!(
                    (got - want).abs() <= 1e-6 * size,
                    "{dims:?}: {got} against {want}"
                );
                let g = s.backward().unwrap();
                let g = g
                    .get(x)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                assert!(g.iter().all(|&v| v == 3.0), "{dims:?}: gradient {g:?}");
            }
        }
        // A weight of fc, of the MLP, a context's keys per kv head, a part's last states.
        for (dims, want) in [
            (vec![4096, 20480], (4096, 20480)),
            (vec![12288, 4096], (12288, 4096)),
            (vec![8, 4096, 128], (32768, 128)),
            (vec![480, 4096], (480, 4096)),
        ] {
            let (outer, inner) = sum_split(&dims);
            assert_eq!((outer, inner), want, "{dims:?}");
            assert!(outer >= 256 && inner >= 128, "{dims:?}: {outer} x {inner}");
        }
        assert_eq!(sum_split(&[]), (1, 1));
        assert_eq!(
            sum_split(&[1 << 20]),
            (1, 1 << 20),
            "no split of one dimension"
        );
    }

    /// Row sums tell weights one ulp apart wherever the ulp is (a matrix's first, middle and
    /// last weight, a norm vector's), and equal weights give equal sums.
    #[test]
    fn row_sums_tell_weights_one_ulp_apart() {
        let specs = vec![
            ("a".to_string(), vec![8, 16], Init::Normal(0.02)),
            ("b".to_string(), vec![5], Init::Ones),
        ];
        let p = Params::new(&specs, 2, &Device::Cpu).unwrap();
        let base = p.row_sums().unwrap();
        assert_eq!(base.len(), 8 + 1);
        assert_eq!(
            Params::new(&specs, 2, &Device::Cpu)
                .unwrap()
                .row_sums()
                .unwrap(),
            base
        );
        let w = p.flat().unwrap();
        for at in [0, 67, 127, 128, 132] {
            let mut changed = w.clone();
            changed[at] = f32::from_bits(changed[at].to_bits() + 1);
            let mut q = Params::new(&specs, 2, &Device::Cpu).unwrap();
            q.set_flat(&changed).unwrap();
            let sums = q.row_sums().unwrap();
            let row = if at < 128 { at / 16 } else { 8 };
            for (r, (x, y)) in base.iter().zip(&sums).enumerate() {
                assert_eq!(x == y, r != row, "weight {at}, row {r}: {x} against {y}");
            }
        }
    }

    /// A gradient summed past its backward holds no forward graph: a leaf read directly by a
    /// matmul with a forward tensor (as the DFlash drafter's attention reads its cut context
    /// values) gets from candle a gradient that keeps that tensor, and so the graph, alive; the
    /// one `grad_of` and `accumulate` keep is cut from it, and sums the same values.
    #[test]
    fn a_summed_gradient_holds_no_forward_graph() {
        let specs = vec![
            ("a".to_string(), vec![3, 2], Init::Normal(0.5)),
            ("b".to_string(), vec![3, 2], Init::Normal(0.5)),
        ];
        let params = Params::new(&specs, 7, &Device::Cpu).unwrap();
        let x = Tensor::new(&[[1f32, -2.0], [0.5, 0.25]], &Device::Cpu).unwrap();
        let y = linear(&x, params.get("a"))
            .unwrap()
            .exp()
            .unwrap()
            .matmul(params.get("b"))
            .unwrap();
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let raw = grads.get(params.get("b")).unwrap();
        assert!(
            raw.track_op(),
            "candle's gradient of b keeps the graph (the premise)"
        );
        assert!(!grad_of(&grads, params.get("b")).unwrap().track_op());
        let mut acc = params.grads();
        params.accumulate(&grads, &mut acc).unwrap();
        params.accumulate(&grads, &mut acc).unwrap();
        for g in acc.0.iter() {
            assert!(
                !g.as_ref().unwrap().track_op(),
                "a summed gradient holds a graph"
            );
        }
        let twice = (raw * 2.0)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = acc.0[1].as_ref().unwrap().flatten_all().unwrap();
        assert_eq!(b.to_vec1::<f32>().unwrap(), twice);
    }

    /// A gradient kept on the device (one flat tensor, what the NCCL exchange reduces in
    /// place of a host buffer) updates the weights and moments as the same values from the
    /// host do, bit for bit, in either form of the moments; and the flat tensor holds what the
    /// host copy holds, zeros for a parameter the loss does not reach.
    #[test]
    fn a_flat_gradient_tensor_updates_as_its_host_values_do() {
        let specs = vec![
            ("a".to_string(), vec![2, 3], Init::Normal(0.5)),
            ("b".to_string(), vec![4], Init::Ones),
        ];
        let params = Params::new(&specs, 6, &Device::Cpu).unwrap();
        let x = Tensor::new(&[[1f32, -2.0, 3.0], [0.5, 0.25, -1.0]], &Device::Cpu).unwrap();
        let loss = (params.get("a") * &x)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let mut acc = params.grads();
        params
            .accumulate(&loss.backward().unwrap(), &mut acc)
            .unwrap();
        let flat = acc.flat(&params).unwrap();
        let mut host = vec![0f32; params.len()];
        acc.add_to(&params, &mut host).unwrap();
        assert_eq!(flat.to_vec1::<f32>().unwrap(), host);
        assert!(host[..6].iter().all(|&g| g != 0.0) && host[6..] == [0.0; 4]);

        let c = AdamWConfig {
            weight_decay: 0.1,
            ..cfg()
        };
        type Make = fn(AdamWConfig, &Params) -> Result<DeviceAdamW>;
        for make in [DeviceAdamW::new as Make, DeviceAdamW::with_tensors] {
            let (by_host, by_tensor) = (
                Params::new(&specs, 6, &Device::Cpu).unwrap(),
                Params::new(&specs, 6, &Device::Cpu).unwrap(),
            );
            let (mut a, mut b) = (make(c, &by_host).unwrap(), make(c, &by_tensor).unwrap());
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(8);
            for step in 0..3 {
                let size = if step == 1 { 40.0 } else { 0.3 };
                let g: Vec<f32> = (0..host.len()).map(|_| normal(&mut rng) * size).collect();
                let t = Tensor::from_slice(&g, g.len(), &Device::Cpu).unwrap();
                assert_eq!(
                    a.update(&by_host, &g, 0.5).unwrap(),
                    b.update_flat(&by_tensor, &t, 0.5).unwrap()
                );
            }
            assert_eq!(by_host.flat().unwrap(), by_tensor.flat().unwrap());
            assert_eq!(a.moments().unwrap(), b.moments().unwrap());
            let short = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
            assert!(b.update_flat(&by_tensor, &short, 1.0).is_err());
            let wide = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
            assert!(b.update_flat(&by_tensor, &wide, 1.0).is_err());
        }
    }

    #[test]
    fn adamw_on_the_cpu_is_the_hosts_bit_for_bit() {
        let specs = vec![
            ("a".to_string(), vec![4, 3], Init::Normal(0.5)),
            ("b".to_string(), vec![5], Init::Ones),
        ];
        let c = AdamWConfig {
            weight_decay: 0.1,
            ..cfg()
        };
        let params = Params::new(&specs, 4, &Device::Cpu).unwrap();
        let mut w = params.flat().unwrap();
        let (mut host, mut cpu) = (
            AdamW::new(c, w.len()),
            DeviceAdamW::new(c, &params).unwrap(),
        );
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
        for step in 0..4 {
            let size = if step == 1 { 40.0 } else { 0.3 };
            let g: Vec<f32> = (0..w.len()).map(|_| normal(&mut rng) * size).collect();
            assert_eq!(
                host.update(&mut w, &g, 0.5),
                cpu.update(&params, &g, 0.5).unwrap()
            );
        }
        assert_eq!(params.flat().unwrap(), w);
        assert_eq!(cpu.moments().unwrap(), (host.m.clone(), host.v.clone()));
        // Resumed from a checkpoint's weights, moments and step, the next update is the same.
        let mut resumed = Params::new(&specs, 99, &Device::Cpu).unwrap();
        resumed.set_flat(&w).unwrap();
        let mut again = DeviceAdamW::new(c, &resumed).unwrap();
        again.set_moments(&resumed, &host.m, &host.v).unwrap();
        again.step = cpu.step;
        let g: Vec<f32> = (0..w.len()).map(|_| normal(&mut rng) * 0.3).collect();
        assert_eq!(
            cpu.update(&params, &g, 0.5).unwrap(),
            again.update(&resumed, &g, 0.5).unwrap()
        );
        assert_eq!(resumed.flat().unwrap(), params.flat().unwrap());
        assert_eq!(again.moments().unwrap(), cpu.moments().unwrap());
        assert!(cpu.update(&params, &w[..3], 1.0).is_err());
    }

    /// A gradient with a NaN or an infinity in it leaves the weights, moments and step as they
    /// were, in every form of AdamW (the host's, the CPU's, the tensors'), and says it skipped;
    /// the next finite gradient updates as it would have without it, bit for bit.
    #[test]
    fn a_gradient_that_is_not_finite_is_skipped_leaving_weights_and_moments_alone() {
        let specs = vec![
            ("a".to_string(), vec![3, 2], Init::Normal(0.5)),
            ("b".to_string(), vec![4], Init::Ones),
        ];
        let params = || Params::new(&specs, 7, &Device::Cpu).unwrap();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
        let n = params().len();
        let g: Vec<f32> = (0..n).map(|_| normal(&mut rng)).collect();
        for bad in [f32::NAN, f32::INFINITY] {
            let mut b = g.clone();
            b[n - 1] = bad;
            // `host` meets the bad gradient between two good ones, `clean` sees the good ones.
            let (mut w, mut clean_w) = (params().flat().unwrap(), params().flat().unwrap());
            let (mut host, mut clean) = (AdamW::new(cfg(), n), AdamW::new(cfg(), n));
            host.update(&mut w, &g, 1.0);
            clean.update(&mut clean_w, &g, 1.0);
            let (w1, m1, v1) = (w.clone(), host.m.clone(), host.v.clone());
            let u = host.update(&mut w, &b, 1.0);
            assert!(u.skipped && !u.grad_norm.is_finite(), "{u:?}");
            assert_eq!((&w, &host.m, &host.v), (&w1, &m1, &v1));
            assert_eq!(host.step, 1);
            assert!(!host.update(&mut w, &g, 1.0).skipped);
            clean.update(&mut clean_w, &g, 1.0);
            assert_eq!(
                w, clean_w,
                "the update after the skipped one is not the clean run's"
            );
            type Make = fn(AdamWConfig, &Params) -> Result<DeviceAdamW>;
            for make in [DeviceAdamW::new as Make, DeviceAdamW::with_tensors] {
                let p = params();
                let mut opt = make(cfg(), &p).unwrap();
                opt.update(&p, &g, 1.0).unwrap();
                let (w1, moments) = (p.flat().unwrap(), opt.moments().unwrap());
                let t = Tensor::from_slice(&b, n, &Device::Cpu).unwrap();
                for u in [
                    opt.update(&p, &b, 1.0).unwrap(),
                    opt.update_flat(&p, &t, 1.0).unwrap(),
                ] {
                    assert!(u.skipped, "{u:?}");
                }
                assert_eq!(p.flat().unwrap(), w1);
                assert_eq!(opt.moments().unwrap(), moments);
                assert_eq!(opt.step, 1);
            }
        }
    }

    /// The parallel draws are the stream one thread draws in order: tensors that start and end
    /// inside chunks, with ones between them, and 3 threads drawing.
    #[test]
    fn parameters_drawn_in_parallel_are_the_bits_one_thread_draws_in_order() {
        let specs = vec![
            (
                "a".to_string(),
                vec![3, DRAW_CHUNK / 2 + 17],
                Init::Normal(0.5),
            ),
            ("b".to_string(), vec![7], Init::Ones),
            ("c".to_string(), vec![DRAW_CHUNK + 1], Init::Normal(0.02)),
            ("d".to_string(), vec![5], Init::Normal(1.0)),
        ];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
        let mut want = Vec::new();
        for (_, shape, init) in &specs {
            let n: usize = shape.iter().product();
            match *init {
                Init::Ones => want.extend(std::iter::repeat_n(1.0f32, n)),
                Init::Normal(std) => want.extend((0..n).map(|_| normal(&mut rng) * std)),
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let got = pool.install(|| Params::new(&specs, 11, &Device::Cpu).unwrap());
        let got = got.flat().unwrap();
        assert_eq!(got.len(), want.len());
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "a parallel draw differs from the sequential stream");
    }

    #[test]
    fn params_flatten_and_set_back_in_order() {
        let specs = vec![
            ("a".to_string(), vec![2, 3], Init::Normal(0.02)),
            ("b".to_string(), vec![4], Init::Ones),
        ];
        let mut p = Params::new(&specs, 7, &Device::Cpu).unwrap();
        let q = Params::new(&specs, 7, &Device::Cpu).unwrap();
        assert_eq!(p.flat().unwrap(), q.flat().unwrap(), "one seed, one start");
        assert_eq!(p.len(), 10);
        let flat: Vec<f32> = (0..10).map(|i| i as f32).collect();
        p.set_flat(&flat).unwrap();
        assert_eq!(p.flat().unwrap(), flat);
        assert_eq!(p.get("b").to_vec1::<f32>().unwrap(), [6.0, 7.0, 8.0, 9.0]);
        assert!(p.set_flat(&flat[..3]).is_err());
    }
}
