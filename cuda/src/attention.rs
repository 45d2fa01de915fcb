//! The target's causal attention as one kernel per layer (`attention.cu`, shipped as PTX in
//! `attention.ptx` and JIT-compiled by the driver when the module is loaded, so no build needs
//! nvcc): bf16 queries, keys and values of a batch of sequences packed one after another,
//! grouped-query heads, the scores never written to memory. `model`'s decoder queues it on
//! candle's stream for a bf16 target on the GPU; what it computes is checked on the CPU by
//! running the same source there (`tests/attention_host.cpp`), and on a GPU against candle's
//! matrix products by `scripts/gpu-check.sh`.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaView, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::{CudaContext, CudaError, CudaSlice, CudaStream, Named, Result};

/// `nvcc -ptx -arch=compute_80 attention.cu` with the source's digest on its first line (the
/// recipe is at the top of attention.cu; a test checks the digest).
pub const PTX: &str = include_str!("attention.ptx");

const _: () = assert!(crate::has_no_nul(PTX), "attention.ptx holds a NUL byte");

/// The head dimensions the kernel is built for, each its own entry point (see [`Loads`]).
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// How a kernel reads its key and value fragments from shared memory; each of [`HEAD_DIMS`] has
/// an entry point of each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loads {
    /// `ldmatrix`, four registers an instruction, the values' transposed on the way
    /// (`causal_bf16_ldsm_d{D}`): the one to prefer.
    Ldmatrix,
    /// 4-byte loads for keys, 2-byte loads paired for values (`causal_bf16_d{D}`): what a
    /// GPU on which [`Loads::Ldmatrix`]'s self-check does not pass keeps.
    Plain,
}

impl Loads {
    /// The forms to try, preferred first: what a GPU target runs unless told otherwise.
    pub const PREFERENCE: [Loads; 2] = [Loads::Ldmatrix, Loads::Plain];

    /// The entry point of each of [`HEAD_DIMS`], in order.
    fn kernels(self) -> [&'static str; 4] {
        match self {
            Loads::Ldmatrix => [
                "causal_bf16_ldsm_d16",
                "causal_bf16_ldsm_d32",
                "causal_bf16_ldsm_d64",
                "causal_bf16_ldsm_d128",
            ],
            Loads::Plain => [
                "causal_bf16_d16",
                "causal_bf16_d32",
                "causal_bf16_d64",
                "causal_bf16_d128",
            ],
        }
    }
}

/// Queries per block and keys per tile, as in attention.cu.
const ROWS: usize = 64;
/// Threads per block, as in attention.cu.
const THREADS: u32 = 128;
/// The grid: x heads (up to 2^31 - 1), y sequences and z query tiles (each up to 65535).
const GRID_X: usize = (1 << 31) - 1;
const GRID_YZ: usize = 65535;

/// The attention's heads: `heads` query heads over `kv_heads` key and value heads of
/// `head_dim` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    /// Whether the kernel is built for these heads (the caller otherwise computes the attention
    /// another way).
    pub fn supported(&self) -> bool {
        HEAD_DIMS.contains(&self.head_dim)
            && self.kv_heads > 0
            && self.heads > 0
            && self.heads.is_multiple_of(self.kv_heads)
            && self.heads <= GRID_X
    }
}

/// One launch, checked: which kernel, its grid, and the softmax scale in log2 units.
#[derive(Debug)]
struct Launch {
    kernel: usize,
    config: LaunchConfig,
    scale_log2: f32,
}

/// Checks a launch's buffers against `heads` and `seqs` sequences of at most `longest` tokens
/// (element counts: `q` and `out` `[tokens, heads, d]`, `k` and `v` `[tokens, kv_heads, d]`,
/// `starts` `seqs + 1` offsets) and plans its grid.
fn plan(heads: Heads, lens: [usize; 5], seqs: usize, longest: usize, scale: f32) -> Result<Launch> {
    let [q, k, v, out, starts] = lens;
    let Heads {
        heads: nh,
        kv_heads: nkv,
        head_dim: d,
    } = heads;
    let Some(kernel) = HEAD_DIMS.iter().position(|&x| x == d) else {
        return Err(CudaError::Mismatch(format!(
            "fused attention has no kernel for head dim {d} (it has {HEAD_DIMS:?})"
        )));
    };
    if !heads.supported() {
        return Err(CudaError::Mismatch(format!(
            "fused attention takes query heads that are a positive multiple of the kv heads: \
             {nh} over {nkv}"
        )));
    }
    if seqs == 0 || seqs > GRID_YZ {
        return Err(CudaError::Mismatch(format!(
            "fused attention takes 1 to {GRID_YZ} sequences, not {seqs}"
        )));
    }
    let tokens = q / (nh * d);
    let want = [
        ("queries", q, tokens * nh * d),
        ("keys", k, tokens * nkv * d),
        ("values", v, tokens * nkv * d),
        ("output", out, tokens * nh * d),
        ("sequence starts", starts, seqs + 1),
    ];
    for (what, got, want) in want {
        if got != want {
            return Err(CudaError::Mismatch(format!(
                "fused attention's {what} hold {got} elements, not {want} ({tokens} tokens, \
                 {nh} heads over {nkv}, head dim {d}, {seqs} sequences)"
            )));
        }
    }
    if longest == 0 || longest > tokens || longest.div_ceil(ROWS) > GRID_YZ {
        return Err(CudaError::Mismatch(format!(
            "fused attention's longest sequence is {longest} tokens, of {tokens} in all (at \
             most {} in one sequence)",
            GRID_YZ * ROWS
        )));
    }
    Ok(Launch {
        kernel,
        config: LaunchConfig {
            grid_dim: (nh as u32, seqs as u32, longest.div_ceil(ROWS) as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        scale_log2: scale * std::f32::consts::LOG2_E,
    })
}

/// The kernels of one [`Loads`], loaded on one device.
pub struct Causal {
    ctx: Arc<CudaContext>,
    kernels: Vec<CudaFunction>,
    loads: Loads,
}

impl Causal {
    pub fn load(ctx: &Arc<CudaContext>, loads: Loads) -> Result<Causal> {
        Ok(Causal {
            ctx: ctx.clone(),
            kernels: crate::load_kernels(ctx, "attention.ptx", PTX, &loads.kernels())?,
            loads,
        })
    }

    /// Which kernels these are.
    pub fn loads(&self) -> Loads {
        self.loads
    }

    /// Queues `out = softmax(q kᵀ · scale, causal) v` on `stream` for `seqs` sequences packed
    /// one after another, sequence `s` being token rows `starts[s]..starts[s + 1]`, the longest
    /// `longest` tokens. `q` and `out` are `[tokens, heads, d]`, `k` and `v`
    /// `[tokens, kv_heads, d]`, contiguous. The lengths are checked here; what is on the device
    /// is not.
    ///
    /// # Safety
    ///
    /// `starts` holds `seqs + 1` ascending offsets from 0 to the token count (the kernel reads
    /// and writes rows below `starts[seqs]`), and `k` and `v` start 16-byte aligned (they are
    /// read in 16-byte vectors; `q` and `out` in 4 bytes). A fresh candle tensor's buffer is
    /// (the driver aligns allocations to 256 bytes).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        heads: Heads,
        q: &CudaView<bf16>,
        k: &CudaView<bf16>,
        v: &CudaView<bf16>,
        starts: &CudaView<u32>,
        seqs: usize,
        longest: usize,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        if **stream.context() != *self.ctx {
            return Err(CudaError::Mismatch(format!(
                "attention kernels loaded on device {} were queued on a stream of device {}",
                self.ctx.ordinal(),
                stream.context().ordinal()
            )));
        }
        let p = plan(
            heads,
            [q.len(), k.len(), v.len(), out.len(), starts.len()],
            seqs,
            longest,
            scale,
        )?;
        let (nh, nkv) = (heads.heads as i32, heads.kv_heads as i32);
        let mut launch = stream.launch_builder(&self.kernels[p.kernel]);
        launch
            .arg(q)
            .arg(k)
            .arg(v)
            .arg(out)
            .arg(starts)
            .arg(&nh)
            .arg(&nkv)
            .arg(&p.scale_log2);
        // SAFETY: `causal_bf16_d{D}` and `causal_bf16_ldsm_d{D}` take (const u16* q,
        // const u16* k, const u16* v, u16* out, const u32* starts, int heads, int kv_heads,
        // float scale_log2): the arguments match in
        // order and type (bf16 is two bytes, as the kernel's u16). `plan` checked every buffer's
        // length against the heads, this kernel's head dim and the sequence count; the rows the
        // kernel touches are below `starts[seqs]`, the token count, and k and v start 16-byte
        // aligned (their rows are multiples of 16 bytes: d >= 16), both the caller's promise.
        unsafe { launch.launch(p.config) }.named("cuLaunchKernel causal attention")?;
        Ok(())
    }
}

/// Largest error [`Causal::self_check`] allows against f64: bf16 keeps 8 bits, and the kernel
/// rounds the probabilities and the output to it (about 0.004 relative each).
pub const SELF_CHECK_TOLERANCE: f64 = 0.02;

/// What [`Causal::self_check`] found: the kernel's largest error against f64 (NaN if it wrote a
/// NaN).
#[derive(Clone, Copy, Debug)]
pub struct SelfCheck {
    pub loads: Loads,
    pub head_dim: usize,
    pub worst: f64,
}

impl SelfCheck {
    /// Within [`SELF_CHECK_TOLERANCE`], and a number.
    pub fn passed(&self) -> bool {
        self.worst <= SELF_CHECK_TOLERANCE
    }
}

impl std::fmt::Display for SelfCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loads = match self.loads {
            Loads::Ldmatrix => "ldmatrix",
            Loads::Plain => "plain",
        };
        write!(
            f,
            "the fused attention kernel ({loads} loads, head dim {}) is within {:.4} of attention \
             in f64 (tolerance {SELF_CHECK_TOLERANCE})",
            self.head_dim, self.worst
        )
    }
}

impl Causal {
    /// Runs the kernel for `head_dim` on a small batch (sequences of 70 and 5 tokens, two query
    /// heads over one kv head) on `stream` and compares it with [`reference`]. A worker runs
    /// this once before trusting the kernel with a model (milliseconds). An error is the
    /// driver's: the device is then suspect (a fault in a kernel ends its context), unlike a
    /// check that ran and did not pass.
    pub fn self_check(&self, stream: &Arc<CudaStream>, head_dim: usize) -> Result<SelfCheck> {
        let heads = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim,
        };
        let starts = [0u32, 70, 75];
        let tokens = 75;
        let mut x = 0x9e37_79b9_u32;
        let mut draw = |n: usize, scale: f32| -> Vec<bf16> {
            (0..n)
                .map(|_| {
                    // A 32-bit LCG (Numerical Recipes'): plenty for inputs that only need to
                    // differ from one another.
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    bf16::from_f32(((x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * scale)
                })
                .collect()
        };
        let q = draw(tokens * 2 * head_dim, 2.0);
        let k = draw(tokens * head_dim, 1.0);
        let v = draw(tokens * head_dim, 1.0);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let on = |what, e| CudaError::call(what, e);
        let dq = stream.clone_htod(&q).map_err(|e| on("cuMemcpyHtoD", e))?;
        let dk = stream.clone_htod(&k).map_err(|e| on("cuMemcpyHtoD", e))?;
        let dv = stream.clone_htod(&v).map_err(|e| on("cuMemcpyHtoD", e))?;
        let ds = stream
            .clone_htod(&starts)
            .map_err(|e| on("cuMemcpyHtoD", e))?;
        let mut out = stream.alloc_zeros::<bf16>(q.len()).named("cuMemAlloc")?;
        // SAFETY: `starts` is 0, 70, 75, the token count; every buffer is a fresh allocation.
        unsafe {
            self.launch(
                stream,
                heads,
                &dq.slice(..),
                &dk.slice(..),
                &dv.slice(..),
                &ds.slice(..),
                2,
                70,
                scale,
                &mut out,
            )
        }?;
        let got = stream.clone_dtoh(&out).named("cuMemcpyDtoH")?;
        let want = reference(heads, &q, &k, &v, &starts, scale);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (f64::from(g.to_f32()) - w).abs())
            .fold(0.0, |a: f64, e| {
                if a.is_nan() || e.is_nan() {
                    f64::NAN
                } else {
                    a.max(e)
                }
            });
        Ok(SelfCheck {
            loads: self.loads,
            head_dim,
            worst,
        })
    }
}

/// Causal attention in f64, per sequence and head, on the bf16 inputs: what the kernel computes,
/// written plainly (`q`, `out` `[tokens, heads, d]`; `k`, `v` `[tokens, kv_heads, d]`).
pub fn reference(
    heads: Heads,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    starts: &[u32],
    scale: f32,
) -> Vec<f64> {
    let Heads {
        heads: nh,
        kv_heads: nkv,
        head_dim: d,
    } = heads;
    let f = |x: &bf16| f64::from(x.to_f32());
    let mut out = vec![0.0; q.len()];
    for w in starts.windows(2) {
        let (start, end) = (w[0] as usize, w[1] as usize);
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let row = |t: usize, n: usize, h: usize| (t * n + h) * d..(t * n + h + 1) * d;
            for i in start..end {
                let qi = &q[row(i, nh, h)];
                let scores: Vec<f64> = (start..=i)
                    .map(|j| {
                        let kj = &k[row(j, nkv, kvh)];
                        qi.iter().zip(kj).map(|(a, b)| f(a) * f(b)).sum::<f64>() * f64::from(scale)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                let o = &mut out[row(i, nh, h)];
                for (j, w) in (start..=i).zip(&weights) {
                    for (o, x) in o.iter_mut().zip(&v[row(j, nkv, kvh)]) {
                        *o += w / sum * f(x);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: Heads = Heads {
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
    };

    /// The grid of a Qwen3-8B-shaped batch: blocks of 64 queries up to the longest sequence, one
    /// per head and sequence; the scale in log2 units for exp2.
    #[test]
    fn a_launch_covers_every_query_of_every_head_and_sequence() {
        let (tokens, seqs) = (3 * 2048 + 100, 4);
        let q = tokens * 32 * 128;
        let kv = tokens * 8 * 128;
        let p = plan(H, [q, kv, kv, q, seqs + 1], seqs, 2048, 0.125).unwrap();
        assert_eq!(p.kernel, 3);
        assert_eq!(p.config.grid_dim, (32, 4, 32));
        assert_eq!(p.config.block_dim, (128, 1, 1));
        assert!((p.scale_log2 - 0.125 * std::f32::consts::LOG2_E).abs() < 1e-7);
        // A longest sequence one past a block takes one more.
        let p = plan(H, [q, kv, kv, q, seqs + 1], seqs, 2049, 0.125).unwrap();
        assert_eq!(p.config.grid_dim.2, 33);
    }

    #[test]
    fn each_head_dim_has_its_entry_point_of_each_kind() {
        for (loads, kind) in [(Loads::Plain, ""), (Loads::Ldmatrix, "ldsm_")] {
            for (d, k) in HEAD_DIMS.iter().zip(loads.kernels()) {
                assert_eq!(k, format!("causal_bf16_{kind}d{d}"));
            }
        }
    }

    /// What the kernel cannot take is an error naming the value, before anything is queued.
    #[test]
    fn a_launch_the_kernel_cannot_take_is_refused_by_name() {
        let (tokens, seqs) = (1000, 2);
        let q = tokens * 32 * 128;
        let kv = tokens * 8 * 128;
        let lens = [q, kv, kv, q, seqs + 1];
        let msg = |heads, lens, seqs, longest| {
            plan(heads, lens, seqs, longest, 1.0)
                .expect_err("refused")
                .to_string()
        };
        let odd = Heads { head_dim: 96, ..H };
        assert!(msg(odd, lens, seqs, 500).contains("head dim 96"));
        let uneven = Heads { kv_heads: 5, ..H };
        assert!(msg(uneven, lens, seqs, 500).contains("32 over 5"));
        assert!(msg(H, [q, kv, kv - 1, q, seqs + 1], seqs, 500).contains("values hold"));
        assert!(msg(H, [q, kv, kv, q, seqs], seqs, 500).contains("sequence starts hold 2"));
        assert!(msg(H, lens, 0, 500).contains("not 0"));
        assert!(msg(H, lens, seqs, 1001).contains("1001 tokens"));
        assert!(!Heads { kv_heads: 0, ..H }.supported());
        let none = Heads { heads: 0, ..H };
        assert!(!none.supported());
        assert!(msg(none, lens, seqs, 500).contains("0 over 8"));
    }

    /// The self-check's reference: a token alone sees only itself, a token after one with the
    /// same key averages the two values, and sequences do not see one another.
    #[test]
    fn the_reference_attends_causally_within_each_sequence() {
        let heads = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
        };
        let b = |x: &[f32]| x.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        // Tokens 0 and 1 form a sequence, token 2 another.
        let q = b(&[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        let k = b(&[0.5, 0.5, 0.5, 0.5, 9.0, 9.0]);
        let v = b(&[2.0, 4.0, 6.0, 8.0, -1.0, 3.0]);
        let out = reference(heads, &q, &k, &v, &[0, 2, 3], 1.0);
        let want = [2.0, 4.0, 2.0, 4.0, 4.0, 6.0, 4.0, 6.0, -1.0, 3.0, -1.0, 3.0];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-12, "{out:?}");
        }
    }
}
