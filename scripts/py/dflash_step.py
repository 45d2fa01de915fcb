"""The DFlash drafter's training step written with torch: the oracle our candle drafter
(model/src/dflash.rs) is checked against, and the torch side of the speed comparison.

The same drafter as ours and SpecForge's: context = hidden_norm(fc(captured layers side by
side)); each anchor a drafts [token[a], MASK x (B-1)] embedded with the target's frozen
embed_tokens at RoPE positions a..a+B-1; Qwen3 decoder layers whose keys and values are
[kv(context); kv(block)], a block's queries seeing context positions j < a and their whole own
block; final norm, the target's frozen lm_head; loss = sum over block positions of
weight * cross-entropy.

    python3 dflash_step.py oracle DIR
        DIR from `bench-dflash-step --dump DIR`: recomputes our loss, acceptance and every
        parameter's gradient from the same weights and batch, in float64, and compares.
    python3 dflash_step.py bench --shape scripts/shapes/qwen3-8b --device cuda \
            --layers 5 --captured 5 --block 16 --anchors 512 --tokens 4096 --steps 5
        Times one step (forward, loss, backward, AdamW) on random weights, as our
        `bench-dflash-step` does, and prints the medians as JSON.

Needs torch (and safetensors for `oracle`): a benchmark or oracle venv, never CI.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# The most positions a group of a sequence's anchors spans, as ours (`CONTEXT_PER_GROUP` in
# model/src/dflash.rs).
CONTEXT_PER_GROUP = 512


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(positions, head_dim, theta, device):
    """cos and sin [n, head_dim / 2], angles in float32 as HF (and ours) compute them."""
    inv = torch.tensor(
        [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)], dtype=torch.float32
    ).to(device)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    """x [heads, n, d] rotated (rotate-half) by cos, sin [n, d/2]."""
    cos = torch.cat([cos, cos], -1).to(x.dtype)
    sin = torch.cat([sin, sin], -1).to(x.dtype)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


class Drafter:
    """Parameters by their export names; the target's frozen embed and lm_head."""

    def __init__(self, cfg, params, embed, lm_head, plain=False, span=CONTEXT_PER_GROUP):
        self.c = cfg
        self.span = span
        self.p = params
        self.embed = embed
        self.lm_head = lm_head
        # plain: each block's attention on its own, the textbook way (GQA by repeating the kv
        # heads; keys = the context before the anchor, then the block), not our batched form,
        # so that an error in our grouping of queries is not repeated here.
        self.plain = plain

    def heads(self, y, n, qk_norm, cos, sin):
        """[rows, n * d] -> [n, rows, d], q/k normed per head and rotated."""
        d = self.c["head_dim"]
        y = y.view(y.shape[0], n, d)
        if qk_norm is not None:
            y = rms_norm(y, qk_norm, self.c["rms_norm_eps"])
        y = y.transpose(0, 1)
        if qk_norm is not None:
            y = rope(y, cos, sin)
        return y

    def forward(self, ctx_in, block_ids, seqs):
        c, p = self.c, self.p
        eps, b = c["rms_norm_eps"], c["block_size"]
        dev = ctx_in.device
        # The context rows of the sequences with blocks, each sequence's rows from 0.
        rows = torch.cat([torch.arange(s["ctx_start"], s["ctx_start"] + s["ctx_len"]) for s in seqs])
        ctx_in = ctx_in[rows.to(dev)]
        starts, at = [], 0
        for s in seqs:
            starts.append(at)
            at += s["ctx_len"]
        ctx = rms_norm(ctx_in @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
        x = self.embed[block_ids]
        bpos = torch.cat([torch.arange(a, a + b) for s in seqs for a in s["anchors"]])
        cpos = torch.cat([torch.arange(s["ctx_len"]) for s in seqs])
        d, theta = c["head_dim"], c["rope_theta"]
        bcs = rope_tables(bpos.to(dev), d, theta, dev)
        ccs = rope_tables(cpos.to(dev), d, theta, dev)
        masks = []
        for s in seqs:
            a = torch.tensor(s["anchors"], device=dev)[:, None]
            j = torch.arange(s["ctx_len"], device=dev)[None, :]
            m = torch.zeros(a.shape[0], s["ctx_len"], dtype=x.dtype, device=dev)
            masks.append(m.masked_fill(j >= a, float("-inf"))[:, None, :])
        for l in range(c["num_hidden_layers"]):
            x = self.layer(l, x, ctx, bcs, ccs, seqs, starts, masks)
        return rms_norm(x, p["norm.weight"], eps)

    def layer(self, l, x, ctx, bcs, ccs, seqs, starts, masks):
        c = self.c
        w = lambda n: self.p[f"layers.{l}.{n}"]
        nh, nkv, d, b = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["block_size"]
        g, eps = nh // nkv, c["rms_norm_eps"]
        hn = rms_norm(x, w("input_layernorm.weight"), eps)
        qn, kn = w("self_attn.q_norm.weight"), w("self_attn.k_norm.weight")
        proj = lambda t, n: t @ w(f"self_attn.{n}_proj.weight").T
        q = self.heads(proj(hn, "q"), nh, qn, *bcs)
        kb = self.heads(proj(hn, "k"), nkv, kn, *bcs)
        vb = self.heads(proj(hn, "v"), nkv, None, None, None)
        kc = self.heads(proj(ctx, "k"), nkv, kn, *ccs)
        vc = self.heads(proj(ctx, "v"), nkv, None, None, None)
        scale = 1.0 / math.sqrt(d)
        outs, b0 = [], 0
        if self.plain:
            for s, start in zip(seqs, starts):
                for a in s["anchors"]:
                    qb = q[:, b0 : b0 + b]
                    k = torch.cat([kc[:, start : start + a], kb[:, b0 : b0 + b]], 1)
                    v = torch.cat([vc[:, start : start + a], vb[:, b0 : b0 + b]], 1)
                    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
                    pr = torch.softmax(qb @ k.transpose(1, 2) * scale, -1)
                    outs.append((pr @ v).transpose(0, 1).reshape(b, nh * d))
                    b0 += b
            x = x + torch.cat(outs) @ w("self_attn.o_proj.weight").T
            return self.mlp(l, x)
        for s, start, mask in zip(seqs, starts, masks):
            # The anchors in groups by position, each spanning fewer than `span` positions and
            # reading the context only up to its last anchor, by ours' rule (`by_position` in
            # model/src/dflash.rs). Ours applies it within each part of the batch, so a part's
            # boundary also starts a group there: in `bench` the two make close, not equal,
            # counts of scores; in `oracle` (one part) the same groups.
            anchors, first = s["anchors"], 0
            cuts = []
            for i in range(1, len(anchors) + 1):
                if i == len(anchors) or abs(anchors[i] - anchors[first]) >= self.span:
                    cuts.append((first, i))
                    first = i
            for g0, g1 in cuts:
                group = anchors[g0:g1]
                n, length = len(group), min(max(max(group), 1), s["ctx_len"])
                m = n * b
                qs = (
                    q[:, b0 : b0 + m]
                    .reshape(nkv, g, n, b, d)
                    .permute(0, 2, 1, 3, 4)
                    .reshape(nkv, n, g * b, d)
                )
                kcs, vcs = kc[:, start : start + length], vc[:, start : start + length]
                kbs = kb[:, b0 : b0 + m].reshape(nkv, n, b, d)
                vbs = vb[:, b0 : b0 + m].reshape(nkv, n, b, d)
                s_ctx = (qs.reshape(nkv, n * g * b, d) @ kcs.transpose(1, 2) * scale).reshape(
                    nkv, n, g * b, length
                ) + mask[g0 : g0 + n, :, :length]
                s_blk = qs @ kbs.transpose(2, 3) * scale
                pr = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1)
                o_ctx = (pr[..., :length].reshape(nkv, n * g * b, length) @ vcs).reshape(nkv, n, g * b, d)
                o = o_ctx + pr[..., length:] @ vbs
                outs.append(o.reshape(nkv, n, g, b, d).permute(1, 3, 0, 2, 4).reshape(m, nh * d))
                b0 += m
        x = x + torch.cat(outs) @ w("self_attn.o_proj.weight").T
        return self.mlp(l, x)

    def mlp(self, l, x):
        w = lambda n: self.p[f"layers.{l}.{n}"]
        hn = rms_norm(x, w("post_attention_layernorm.weight"), self.c["rms_norm_eps"])
        mlp = (F.silu(hn @ w("mlp.gate_proj.weight").T) * (hn @ w("mlp.up_proj.weight").T)) @ w(
            "mlp.down_proj.weight"
        ).T
        return x + mlp

    def loss(self, ctx_in, block_ids, seqs, labels, weights):
        """Sum of weight * cross-entropy, the weight sum, and the leading accepted positions."""
        h = self.forward(ctx_in, block_ids, seqs)
        rows = (weights > 0).nonzero().squeeze(1)
        logits = h[rows] @ self.lm_head.T
        nll = F.cross_entropy(logits, labels[rows], reduction="none")
        loss = (nll * weights[rows]).sum()
        predicted = torch.full_like(labels, -1)
        predicted[rows] = logits.argmax(-1)
        b = self.c["block_size"]
        ok = ((predicted == labels) & (weights > 0)).view(-1, b)[:, 1:]
        accepted = int(ok.to(torch.int64).cumprod(1).sum())
        return loss, float(weights.sum()), accepted


def oracle(dirname):
    from safetensors.torch import load_file

    meta = json.load(open(os.path.join(dirname, "step.json")))
    t = load_file(os.path.join(dirname, "step.safetensors"))
    cfg = meta["config"]
    names = [k for k in t if not k.startswith(("grad.", "frozen.")) and k != "ctx"]
    # float64: the reference is the exact math; ours (float32) is judged against it.
    params = {k: t[k].double().requires_grad_() for k in names}
    d = Drafter(cfg, params, t["frozen.embed"].double(), t["frozen.lm_head"].double(), plain=True)
    labels = torch.tensor(meta["labels"], dtype=torch.int64)
    weights = torch.tensor(meta["weights"], dtype=torch.float64)
    block_ids = torch.tensor(meta["block_ids"], dtype=torch.int64)
    loss, weight, accepted = d.loss(t["ctx"].double(), block_ids, meta["seqs"], labels, weights)
    loss.backward()
    # The batched form (the one `bench` times) gives the same loss.
    span = meta.get("context_per_group", CONTEXT_PER_GROUP)
    batched = Drafter(cfg, params, d.embed, d.lm_head, span=span).loss(t["ctx"].double(), block_ids, meta["seqs"], labels, weights)[0]
    report = {
        "loss_ours": meta["loss"],
        "loss_torch": float(loss.detach()),
        "loss_rel_diff": abs(meta["loss"] - float(loss.detach())) / abs(float(loss.detach())),
        "loss_torch_batched_rel_diff": abs(float(batched.detach()) - float(loss.detach())) / abs(float(loss.detach())),
        "weight": [meta["weight"], weight],
        "accepted": [meta["accepted"], accepted],
        "params": len(names),
    }
    worst = (0.0, "")
    for k in names:
        g_ref = params[k].grad
        g_ours = t[f"grad.{k}"].double()
        scale = g_ref.abs().max().item()
        rel = (g_ours - g_ref).abs().max().item() / scale if scale > 0 else 0.0
        worst = max(worst, (rel, k))
    report["grad_worst_rel_diff"], report["grad_worst_param"] = worst
    print(json.dumps(report))
    # Tolerances for float32 against float64: the loss to 1e-5, each gradient to 1e-4 of its
    # largest element.
    good = (
        report["loss_rel_diff"] < 1e-5
        and report["loss_torch_batched_rel_diff"] < 1e-12
        and abs(weight - meta["weight"]) < 1e-4
        and accepted == meta["accepted"]
        and worst[0] < 1e-4
    )
    if not good:
        print("oracle: our DFlash step differs from torch's beyond the tolerance", file=sys.stderr)
        sys.exit(1)
    print("oracle: our DFlash step equals torch's within the tolerance")


def captured_ids(target_layers, n):
    """SpecForge's rule (ours is model/src/capture.rs): round(1 + i * (L - 4) / (n - 1))."""
    if n == 1:
        return [target_layers // 2]
    return [round(1 + i * (target_layers - 4) / (n - 1)) for i in range(n)]


def bench(a):
    dev = torch.device(a.device)
    # Ours: HSPIPE_CUDA_TF32=on. Off by default on both sides.
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    arch = json.load(open(os.path.join(a.shape, "config.json")))
    h, v = arch["hidden_size"], arch["vocab_size"]
    nh, nkv = arch["num_attention_heads"], arch["num_key_value_heads"]
    d = arch.get("head_dim", h // nh)
    inter = arch["intermediate_size"]
    cfg = {
        "num_hidden_layers": a.layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": d,
        "rms_norm_eps": arch.get("rms_norm_eps", 1e-6),
        "rope_theta": arch.get("rope_theta", 1e6),
        "block_size": a.block,
    }
    ids = captured_ids(arch["num_hidden_layers"], a.captured)
    gen = torch.Generator(device=dev).manual_seed(3)
    rnd = lambda *s: (torch.randn(*s, generator=gen, device=dev) * 0.02).requires_grad_()
    ones = lambda n: torch.ones(n, device=dev).requires_grad_()
    p = {"fc.weight": rnd(h, len(ids) * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for l in range(a.layers):
        q, kv = nh * d, nkv * d
        p.update(
            {
                f"layers.{l}.input_layernorm.weight": ones(h),
                f"layers.{l}.self_attn.q_proj.weight": rnd(q, h),
                f"layers.{l}.self_attn.k_proj.weight": rnd(kv, h),
                f"layers.{l}.self_attn.v_proj.weight": rnd(kv, h),
                f"layers.{l}.self_attn.o_proj.weight": rnd(h, q),
                f"layers.{l}.self_attn.q_norm.weight": ones(d),
                f"layers.{l}.self_attn.k_norm.weight": ones(d),
                f"layers.{l}.post_attention_layernorm.weight": ones(h),
                f"layers.{l}.mlp.gate_proj.weight": rnd(inter, h),
                f"layers.{l}.mlp.up_proj.weight": rnd(inter, h),
                f"layers.{l}.mlp.down_proj.weight": rnd(h, inter),
            }
        )
    with torch.no_grad():
        embed = torch.randn(v, h, generator=gen, device=dev) * 0.02
        lm_head = torch.randn(v, h, generator=gen, device=dev) * 0.02
        ctx = torch.randn(a.tokens, len(ids) * h, generator=gen, device=dev)
    drafter = Drafter(cfg, p, embed, lm_head)
    # One sequence, anchors drawn without replacement from the positions with a next token.
    g = torch.Generator().manual_seed(1)
    anchors = sorted(torch.randperm(a.tokens - 1, generator=g)[: a.anchors].tolist())
    seqs = [{"ctx_start": 0, "ctx_len": a.tokens, "anchors": anchors}]
    tok = torch.randint(0, v, (a.tokens,), generator=g)
    block_ids = torch.full((len(anchors), a.block), v - 1, dtype=torch.int64)
    block_ids[:, 0] = tok[anchors]
    labels = torch.randint(0, v, (len(anchors) * a.block,), generator=g)
    k = torch.arange(a.block, dtype=torch.float64)
    pos = torch.tensor(anchors)[:, None] + torch.arange(a.block)[None, :]
    wts = torch.exp(-(k - 1) / 7.0)[None, :].expand(len(anchors), -1).clone()
    wts[:, 0] = 0
    wts[pos >= a.tokens] = 0
    block_ids, labels = block_ids.reshape(-1).to(dev), labels.to(dev)
    weights = wts.reshape(-1).to(torch.float32).to(dev)
    opt = torch.optim.AdamW(list(p.values()), lr=6e-4, weight_decay=0.0, fused=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, grads, last = [], [], 0.0
    for step in range(a.steps + 1):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, weight, _ = drafter.loss(ctx, block_ids, seqs, labels, weights)
        (loss / weight).backward()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()
        sync()
        t2 = time.perf_counter()
        last = float(loss.detach())
        if step > 0:
            times.append(t2 - t0)
            grads.append(t1 - t0)
    print(
        json.dumps(
            {
                "device": a.device,
                "torch": torch.__version__,
                "params": sum(x.numel() for x in p.values()),
                "tokens": a.tokens,
                "anchors": len(anchors),
                "block": a.block,
                "layers": a.layers,
                "captured": ids,
                "step_s": statistics.median(times),
                "gradient_s": statistics.median(grads),
                "tf32": a.tf32 and dev.type == "cuda",
                "last_loss": last,
                # torch's own peak (its caching allocator's live tensors), beside ours
                # (bench-dflash-step --trace: `pool_peak_mib`, the same measure).
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
            }
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("oracle", help="compare with bench-dflash-step --dump DIR")
    o.add_argument("dir")
    b = sub.add_parser("bench", help="time one step on random weights")
    b.add_argument("--shape", required=True, help="a target's HF directory (config.json only)")
    b.add_argument("--device", default="cpu")
    b.add_argument("--layers", type=int, default=5)
    b.add_argument("--captured", type=int, default=5)
    b.add_argument("--block", type=int, default=16)
    b.add_argument("--anchors", type=int, default=512)
    b.add_argument("--tokens", type=int, default=4096)
    b.add_argument("--steps", type=int, default=5)
    b.add_argument(
        "--tf32",
        action="store_true",
        help="f32 matrix products on TF32 tensor cores (torch's allow_tf32; ours: HSPIPE_CUDA_TF32=on)",
    )
    a = ap.parse_args()
    if a.cmd == "oracle":
        oracle(a.dir)
    else:
        bench(a)


if __name__ == "__main__":
    main()
