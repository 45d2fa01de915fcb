//! The DFlash drafter's attention core, its gradient written by hand.
//!
//! A block's queries read two pieces of keys and values: the context (the sequence's projected
//! target states, masked to what precedes the block's anchor) and the block itself. Built from
//! candle ops, the core is about ten ops over the scores, and candle's backward costs each of
//! them several passes more: its gradient store starts every gradient from zeros and adds the
//! first contribution to them, and softmax's chain rule runs through the max, the shift, the
//! exponential, the sum and the division one by one.
//!
//! Here the forward runs on detached inputs and keeps only the probabilities; the graph gets
//! one node per piece, a [`CustomOp3`] over that piece's queries, keys and values whose forward
//! hands back the output computed already, and whose backward is FlashAttention's:
//! `dP = dO·Vᵀ`, `dS = P ⊙ (dP − rowsum(dO ⊙ O))`, `dQ = dS·K`, `dK = dSᵀ·Q`, `dV = Pᵀ·dO`,
//! with `O` the whole output (both pieces: the softmax spans them). Two passes over the scores
//! (the shift, the product with `P`) besides the four matrix products. The graph holds the
//! probabilities, where candle's ops kept five score-sized tensors for the context (the
//! product, the masked scores, the shifted ones, their exponentials, the probabilities) and four
//! for the block.
//!
//! candle keeps its graph's ops private (`Tensor::op`), so a backward of our own over the whole
//! graph is not possible from outside it; a custom op is the public way in.

use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Layout, Shape, Storage, Tensor};

use crate::train::softmax_pair;
use crate::Result;

/// How the attention's core is differentiated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backward {
    /// [`attend`]: the backward written by hand (the default).
    #[default]
    ByHand,
    /// [`attend_autograd`]: candle's autograd of the same ops, the way before the hand-written
    /// one (to compare the two, or to step around the custom op on a device where it fails).
    Autograd,
}

/// `softmax([q·kcᵀ + mask, q·kbᵀ]) · [vc; vb]` for every anchor's block, `[nkv, n, g·B, d]`.
///
/// - `q`: `[nkv, n, g·B, d]`, already scaled (each kv head's `g` query heads side by side);
/// - `kc`, `vc`: the context, `[nkv, len, d]`, shared by the `n` anchors;
/// - `mask`: added to the context scores, broadcast to `[nkv, n, g·B, len]` (`-inf` hides);
/// - `kb`, `vb`: each anchor's block, `[nkv, n, B, d]`, seen whole by the block's queries.
///
/// Its gradient reaches `q`, `kc`, `vc`, `kb` and `vb` (those the graph tracks), equal to the
/// gradient of the same expression in candle ops up to rounding (tested).
pub fn attend(
    q: &Tensor,
    (kc, vc): (&Tensor, &Tensor),
    mask: &Tensor,
    (kb, vb): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let (nkv, n, rows, d) = q.dims4()?;
    let qd = q.detach();
    let (kcd, vcd, kbd, vbd) = (kc.detach(), vc.detach(), kb.detach(), vb.detach());
    let f = forward(&qd, (&kcd, &vcd), mask, (&kbd, &vbd))?;
    let whole = (&f.o_ctx + &f.o_blk)?;
    if ![q, kc, vc, kb, vb].iter().any(|t| t.track_op()) {
        return Ok(whole);
    }
    let shape = q.shape().clone();
    let ctx = Piece {
        q: qd.reshape((nkv, n * rows, d))?,
        p: f.p_ctx,
        whole: whole.reshape((nkv, n * rows, d))?,
        out: Mutex::new(Some(f.o_ctx)),
        q_shape: shape.clone(),
    };
    let blk = Piece {
        q: qd,
        p: f.p_blk,
        whole: whole.clone(),
        out: Mutex::new(Some(f.o_blk)),
        q_shape: shape,
    };
    Ok((q.apply_op3(kc, vc, ctx)? + q.apply_op3(kb, vb, blk)?)?)
}

/// [`attend`] as candle ops, differentiated by candle's backward: the same forward, tracked.
pub fn attend_autograd(
    q: &Tensor,
    kv_ctx: (&Tensor, &Tensor),
    mask: &Tensor,
    kv_blk: (&Tensor, &Tensor),
) -> Result<Tensor> {
    let f = forward(q, kv_ctx, mask, kv_blk)?;
    Ok((f.o_ctx + f.o_blk)?)
}

/// The attention's forward: each piece's probabilities (the context's with its anchors'
/// queries stacked, `[nkv, n·g·B, len]`; the block's `[nkv, n, g·B, B]`) and output share
/// (`[nkv, n, g·B, d]` each).
struct Forward {
    p_ctx: Tensor,
    p_blk: Tensor,
    o_ctx: Tensor,
    o_blk: Tensor,
}

fn forward(
    q: &Tensor,
    (kc, vc): (&Tensor, &Tensor),
    mask: &Tensor,
    (kb, vb): (&Tensor, &Tensor),
) -> Result<Forward> {
    let (nkv, n, rows, d) = q.dims4()?;
    let len = kc.dim(1)?;
    // The context's scores as one product per kv head: the anchors' queries stacked.
    let s_ctx = (q.reshape((nkv, n * rows, d))?.matmul(&kc.t()?)?)
        .reshape((nkv, n, rows, len))?
        .broadcast_add(mask)?;
    let s_blk = q.matmul(&kb.t()?)?;
    let (p_ctx, p_blk) = softmax_pair(&s_ctx, &s_blk)?;
    drop((s_ctx, s_blk));
    let p_ctx = p_ctx.reshape((nkv, n * rows, len))?;
    let o_ctx = p_ctx.matmul(vc)?.reshape((nkv, n, rows, d))?;
    let o_blk = p_blk.matmul(vb)?;
    Ok(Forward {
        p_ctx,
        p_blk,
        o_ctx,
        o_blk,
    })
}

/// One piece of keys and values: the node whose forward is `out` and whose backward is the
/// piece's share of the attention's gradient. `q`, `p` and `whole` are shaped for the piece's
/// keys (`[nkv, n·g·B, ..]` for the context, `[nkv, n, g·B, ..]` for a block).
struct Piece {
    q: Tensor,
    p: Tensor,
    whole: Tensor,
    /// The piece's output, until the forward hands it to the node (the graph keeps the node).
    out: Mutex<Option<Tensor>>,
    q_shape: Shape,
}

impl Piece {
    /// The output's values in storage of their own, laid out contiguously (a custom op hands
    /// back storage it owns), and its shape; the piece lets go of the output.
    fn take_out(&self) -> candle_core::Result<(Storage, Shape)> {
        let out = (self.out.lock().unwrap_or_else(|e| e.into_inner()).take()).ok_or_else(|| {
            candle_core::Error::Msg("an attention piece ran forward twice".into())
        })?;
        let (storage, layout) = out.storage_and_layout();
        let own = match &*storage {
            Storage::Cpu(s) => Storage::Cpu(copied(s, layout)?),
            Storage::Cuda(s) => Storage::Cuda(copied(s, layout)?),
            Storage::Metal(_) => {
                let why = "the DFlash attention runs on the CPU or CUDA";
                return Err(candle_core::Error::Msg(why.into()));
            }
        };
        Ok((own, out.shape().clone()))
    }
}

/// `layout`'s elements of `s`, in a buffer of exactly their count.
fn copied<S>(s: &S, layout: &Layout) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut dst = s.device().zeros_impl(layout.shape(), s.dtype())?;
    s.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

impl CustomOp3 for Piece {
    fn name(&self) -> &'static str {
        "dflash-attention-piece"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take_out()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => Err(candle_core::Error::Msg(
                "a CPU op's output is not on the CPU".into(),
            )),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        match self.take_out()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => Err(candle_core::Error::Msg(
                "a CUDA op's output is not on CUDA".into(),
            )),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let tracked = [q.track_op(), k.track_op(), v.track_op()];
        let k = k.detach();
        let d_o = grad.reshape(self.whole.shape())?;
        // rowsum(dO ⊙ O): the softmax's shift, one value a query row.
        let shift = (&d_o * &self.whole)?.sum_keepdim(candle_core::D::Minus1)?;
        let d_p = d_o.matmul(&v.detach().t()?)?;
        let d_p = d_p.broadcast_sub(&shift)?; // the product's buffer freed here
        let d_s = (d_p * &self.p)?;
        let d_q = match tracked[0] {
            true => Some(d_s.matmul(&k)?.reshape(&self.q_shape)?),
            false => None,
        };
        let d_k = match tracked[1] {
            true => Some(d_s.t()?.matmul(&self.q)?),
            false => None,
        };
        let d_v = match tracked[2] {
            true => Some(self.p.t()?.matmul(&d_o)?),
            false => None,
        };
        Ok((d_q, d_k, d_v))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};
    use rand::SeedableRng;
    use rand_xoshiro::Xoshiro256PlusPlus;

    use super::*;
    use crate::train::{max_abs, normal, softmax};

    /// The same attention as textbook candle ops: both pieces' scores concatenated, one
    /// softmax, the product with the context's values (the same for every anchor) stacked over
    /// each block's.
    fn textbook(
        q: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
        mask: &Tensor,
        kb: &Tensor,
        vb: &Tensor,
    ) -> Tensor {
        let (nkv, n, rows, d) = q.dims4().unwrap();
        let len = kc.dim(1).unwrap();
        let s_ctx = (q.reshape((nkv, n * rows, d)).unwrap())
            .matmul(&kc.t().unwrap())
            .unwrap()
            .reshape((nkv, n, rows, len))
            .unwrap()
            .broadcast_add(mask)
            .unwrap();
        let s_blk = q.matmul(&kb.t().unwrap()).unwrap();
        let p = softmax(&Tensor::cat(&[&s_ctx, &s_blk], 3).unwrap()).unwrap();
        let vc = (vc
            .unsqueeze(1)
            .unwrap()
            .broadcast_as((nkv, n, len, d))
            .unwrap())
        .contiguous()
        .unwrap();
        p.matmul(&Tensor::cat(&[&vc, vb], 2).unwrap()).unwrap()
    }

    /// A piece's output handed to its node is its values alone, in order, whatever its
    /// layout: a transposed view, and a narrowed one from the middle of a larger buffer.
    #[test]
    fn an_output_is_copied_as_its_values_alone() {
        let t = Tensor::arange(0f32, 24.0, &Device::Cpu).unwrap();
        let t = t.reshape((2, 3, 4)).unwrap();
        for view in [
            t.transpose(1, 2).unwrap(),
            t.narrow(1, 1, 2).unwrap(),
            t.clone(),
        ] {
            let (storage, layout) = view.storage_and_layout();
            let Storage::Cpu(s) = &*storage else {
                panic!("not on the CPU")
            };
            let got = copied(s, layout).unwrap();
            let want: Vec<f32> = view.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got.as_slice::<f32>().unwrap(), &want[..]);
        }
    }

    /// How far `x` is from `y`, relative to `y`'s largest value.
    fn worst(x: &Tensor, y: &Tensor) -> f32 {
        max_abs(&(x - y).unwrap()) / max_abs(y).max(1e-30)
    }

    /// The hand-written backward is the chain rule through candle's ops, within f32 rounding
    /// (1e-5 of each gradient's largest value), for grouped heads over several anchors, an
    /// anchor that sees none of the context included; a piece the graph does not track gets no
    /// gradient; untracked inputs give the value alone.
    #[test]
    fn the_hand_written_backward_is_the_chain_rule_through_candles_ops() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
        let mut draw = |dims: &[usize]| {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|_| normal(&mut rng)).collect();
            Var::from_vec(v, dims, &Device::Cpu).unwrap()
        };
        // 2 kv heads of 2 query heads each, 3 anchors, blocks of 3, head dim 4, 5 context rows.
        let (nkv, n, rows, d, len, b) = (2, 3, 6, 4, 5, 3);
        let q = draw(&[nkv, n, rows, d]);
        // The context as the drafter reads it: a sequence's rows narrowed out of the rows of
        // several (an offset, and each head's rows further apart than `len`).
        let (kc_all, vc_all) = (draw(&[nkv, len + 3, d]), draw(&[nkv, len + 3, d]));
        let (kb, vb) = (draw(&[nkv, n, b, d]), draw(&[nkv, n, b, d]));
        let w = draw(&[nkv, n, rows, d]);
        // Anchor 0 sees no context, anchor 1 two rows, anchor 2 four.
        let mut mask = vec![f32::NEG_INFINITY; n * len];
        for (a, seen) in [0, 2, 4].into_iter().enumerate() {
            mask[a * len..a * len + seen].fill(0.0);
        }
        let mask = Tensor::from_vec(mask, (n, 1, len), &Device::Cpu).unwrap();
        let t = |v: &Var| v.as_tensor().clone();
        let (q, kb, vb, w) = (t(&q), t(&kb), t(&vb), t(&w));
        let kc = kc_all.as_tensor().narrow(1, 2, len).unwrap();
        let vc = vc_all.as_tensor().narrow(1, 2, len).unwrap();

        let want = textbook(&q, &kc, &vc, &mask, &kb, &vb);
        let loss = |o: &Tensor| (o * &w).unwrap().sum_all().unwrap();
        let g_want = loss(&want).backward().unwrap();
        let (kc_all, vc_all) = (kc_all.as_tensor(), vc_all.as_tensor());
        let inputs = [
            ("q", &q),
            ("kc", kc_all),
            ("vc", vc_all),
            ("kb", &kb),
            ("vb", &vb),
        ];
        // Both ways of differentiating it: by hand, and candle's autograd of `attend`'s ops.
        for f in [attend, attend_autograd] {
            let got = f(&q, (&kc, &vc), &mask, (&kb, &vb)).unwrap();
            assert!(worst(&got, &want) < 1e-5, "value {}", worst(&got, &want));
            let g_got = loss(&got).backward().unwrap();
            for (name, v) in inputs {
                let (x, y) = (g_got.get(v).unwrap(), g_want.get(v).unwrap());
                assert!(worst(x, y) < 1e-5, "gradient of {name}: {}", worst(x, y));
            }
        }

        // The context frozen: no gradient for it, the others' unchanged.
        let (kc0, vc0) = (kc.detach(), vc.detach());
        let got = attend(&q, (&kc0, &vc0), &mask, (&kb, &vb)).unwrap();
        let g = loss(&got).backward().unwrap();
        assert!(g.get(kc_all).is_none() && g.get(vc_all).is_none());
        for (name, v) in [("q", &q), ("kb", &kb), ("vb", &vb)] {
            let (x, y) = (g.get(v).unwrap(), g_want.get(v).unwrap());
            assert!(
                worst(x, y) < 1e-5,
                "{name}, context frozen: {}",
                worst(x, y)
            );
        }

        // Nothing tracked: the value alone, equal to the tracked one.
        let d = |x: &Tensor| x.detach();
        let plain = attend(&d(&q), (&d(&kc), &d(&vc)), &mask, (&d(&kb), &d(&vb))).unwrap();
        assert!(!plain.track_op());
        assert!(worst(&plain, &want) < 1e-5);
    }
}
