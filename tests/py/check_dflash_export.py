"""Checks a DFlash drafter export as SGLang's and vLLM's loaders read it: config keys, tensor
names, shapes and dtypes (safetensors + numpy; no torch). Usage: check_dflash_export.py DIR.
Prints "ok" and exits 0, or prints what is wrong and exits 1."""
import json
import sys

from safetensors import safe_open

d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
bad = []
want = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
}
for k, v in want.items():
    if cfg.get(k) != v:
        bad.append(f"config {k} = {cfg.get(k)!r}, want {v!r}")
for k in ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
          "max_position_embeddings", "block_size", "num_target_layers", "layer_types"]:
    if k not in cfg:
        bad.append(f"config has no {k}")
if "auto_map" in cfg:
    bad.append("config has auto_map")
dc = cfg.get("dflash_config", {})
if not isinstance(dc.get("mask_token_id"), int) or not isinstance(dc.get("target_layer_ids"), list):
    bad.append(f"dflash_config = {dc!r}")
n = cfg.get("num_hidden_layers", 0)
if cfg.get("layer_types") != ["full_attention"] * n:
    bad.append(f"layer_types = {cfg.get('layer_types')!r}")
h, hd, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
shapes = {
    "fc.weight": (h, len(dc.get("target_layer_ids", [])) * h),
    "hidden_norm.weight": (h,),
    "norm.weight": (h,),
}
for l in range(n):
    p = f"layers.{l}."
    shapes.update({
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    })
with safe_open(f"{d}/model.safetensors", framework="numpy") as f:
    names = set(f.keys())
    for k in sorted(names - set(shapes)):
        bad.append(f"unexpected tensor {k}")
    for k in sorted(set(shapes) - names):
        bad.append(f"missing tensor {k}")
    for k in sorted(names & set(shapes)):
        sl = f.get_slice(k)
        if tuple(sl.get_shape()) != shapes[k]:
            bad.append(f"{k} has shape {sl.get_shape()}, want {shapes[k]}")
        if sl.get_dtype() != "BF16":
            bad.append(f"{k} is {sl.get_dtype()}, want BF16")
print("\n".join(bad) if bad else "ok")
sys.exit(1 if bad else 0)
