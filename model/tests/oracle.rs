//! Our decoder against outside oracles on the same weights, and every loader variant.
//!
//! Oracles: candle-transformers' `qwen3::Model` and `qwen2::Model` (final normed state at every
//! position), `llama::Llama` and `mistral::Model` (logits at the last position, run on every
//! prefix); a hand-run
//! of the first layers written here with plain tensor operations (no fused kernel) for each
//! captured layer. Tolerance: 1e-4 absolute on f32 states of magnitude ~1 (the fused CPU
//! attention and candle's reference kernels sum in different orders; a wrong rope, norm or mask
//! moves states by 1e-2 or more).
//!
//! Length: one file for the oracles and the loader variants they judge; most of it is the
//! hand-run layer, written out step by step so it shares no code with the model.

use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use model::config::Llama3Scaling;
use model::make::{make_model, ConfigStyle, MakeSpec, Stored};
use model::{ArchConfig, Decoder, Family, ModelError, Need};

const TOL: f32 = 1e-4;

fn spec(family: Family) -> MakeSpec {
    MakeSpec {
        family,
        layers: 3,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: None,
        intermediate: 96,
        vocab: 320,
        seed: 7,
        // Larger than HF's 0.02 so attention and the MLPs move the state a lot: a wrong
        // detail shows far above the tolerance.
        init_std: 0.15,
        stored: Stored::F32,
        tied: false,
        ..MakeSpec::default()
    }
}

fn made(s: &MakeSpec) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    make_model(d.path(), s).unwrap();
    d
}

fn ours(dir: &Path) -> Decoder {
    Decoder::load(dir, &Device::Cpu, DType::F32).unwrap()
}

fn vb(dir: &Path) -> VarBuilder<'static> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    // SAFETY: the test's own temporary files, not written while mapped.
    unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap() }
}

/// Two sequences of a batch, ids below `vocab`.
fn batch(vocab: u32) -> (Vec<u32>, Vec<u32>) {
    let ids: Vec<u32> = (0..19u32).map(|i| (i * 37 + 11) % vocab).collect();
    (ids, vec![7, 12])
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn final_hidden(d: &Decoder, ids: &[u32], lens: &[u32]) -> Tensor {
    d.forward(
        ids,
        lens,
        &Need {
            final_hidden: true,
            ..Need::default()
        },
    )
    .unwrap()
    .final_hidden
    .unwrap()
}

/// Each sequence run alone by `oracle` (returning `[1, L, H]`), concatenated.
fn per_sequence(ids: &[u32], lens: &[u32], mut oracle: impl FnMut(&Tensor) -> Tensor) -> Tensor {
    let mut out = vec![];
    let mut start = 0;
    for &l in lens {
        let x = Tensor::new(&ids[start..start + l as usize], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        out.push(oracle(&x).squeeze(0).unwrap());
        start += l as usize;
    }
    Tensor::cat(&out, 0).unwrap()
}

fn qwen3_oracle(dir: &Path, ids: &[u32], lens: &[u32]) -> Tensor {
    use candle_transformers::models::qwen3;
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg: qwen3::Config = serde_json::from_str(&text).unwrap();
    // A fresh model per sequence: its kv cache cannot be cleared from outside.
    per_sequence(ids, lens, |x| {
        let mut m = qwen3::Model::new(&cfg, vb(dir)).unwrap();
        m.forward(x, 0).unwrap()
    })
}

#[test]
fn qwen3_final_state_equals_candle_transformers() {
    for head_dim in [None, Some(32)] {
        // head_dim 32 x 4 heads = 128 features against hidden 64: Qwen3-32B's shape.
        let s = MakeSpec {
            head_dim: head_dim.or(Some(16)),
            ..spec(Family::Qwen3)
        };
        let d = made(&s);
        let m = ours(d.path());
        assert_eq!(m.config().q_dim(), s.heads * s.head_dim.unwrap());
        let (ids, lens) = batch(s.vocab as u32);
        let got = final_hidden(&m, &ids, &lens);
        let want = qwen3_oracle(d.path(), &ids, &lens);
        assert_eq!(got.dims(), want.dims());
        let diff = max_diff(&got, &want);
        assert!(
            diff < TOL,
            "head_dim {head_dim:?}: max |ours - oracle| = {diff}"
        );
    }
}

#[test]
fn qwen2_with_its_biases_equals_candle_transformers() {
    use candle_transformers::models::qwen2;
    let s = spec(Family::Qwen2);
    let d = made(&s);
    let m = ours(d.path());
    assert!(m.config().qkv_bias && !m.config().qk_norm);
    let (ids, lens) = batch(s.vocab as u32);
    let got = final_hidden(&m, &ids, &lens);
    let text = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    let cfg: qwen2::Config = serde_json::from_str(&text).unwrap();
    let mut o = qwen2::Model::new(&cfg, vb(d.path())).unwrap();
    let want = per_sequence(&ids, &lens, |x| {
        let h = o.forward(x, 0, None).unwrap();
        o.clear_kv_cache();
        h
    });
    let diff = max_diff(&got, &want);
    assert!(diff < TOL, "max |ours - oracle| = {diff}");
}

/// Logits at every position of one sequence, from candle-transformers' Llama run on each
/// prefix (it returns the last position's logits only).
fn llama_oracle(dir: &Path, ids: &[u32]) -> Tensor {
    use candle_transformers::models::llama;
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let cfg: llama::LlamaConfig = serde_json::from_str(&text).unwrap();
    let cfg = cfg.into_config(false);
    let m = llama::Llama::load(vb(dir), &cfg).unwrap();
    let rows: Vec<Tensor> = (1..=ids.len())
        .map(|n| {
            let mut cache = llama::Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
            let x = Tensor::new(&ids[..n], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            m.forward(&x, 0, &mut cache).unwrap().squeeze(0).unwrap()
        })
        .collect();
    Tensor::stack(&rows, 0).unwrap()
}

#[test]
fn llama_with_and_without_llama3_scaling_equals_candle_transformers() {
    let scaling = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        // Small, so the scaled band covers this model's frequencies.
        original_max_position_embeddings: 64.0,
    };
    let mut outs = vec![];
    for llama3 in [None, Some(scaling)] {
        let s = MakeSpec {
            llama3,
            rope_theta: 500000.0,
            ..spec(Family::Llama)
        };
        let d = made(&s);
        let m = ours(d.path());
        let ids: Vec<u32> = (0..12u32).map(|i| (i * 53 + 5) % s.vocab as u32).collect();
        let h = final_hidden(&m, &ids, &[ids.len() as u32]);
        let got = h.matmul(&m.lm_head().t().unwrap()).unwrap();
        let want = llama_oracle(d.path(), &ids);
        let diff = max_diff(&got, &want);
        assert!(
            diff < TOL,
            "llama3 {llama3:?}: max |ours - oracle| = {diff}"
        );
        outs.push(got);
    }
    // The scaling is exercised: it moves the logits.
    assert!(max_diff(&outs[0], &outs[1]) > 1e-3);
}

/// Mistral within its sliding window: ours (full attention) against candle-transformers'
/// Mistral (which masks by the window) on a sequence as long as the window, logits at every
/// position from each prefix. Equal: within the window, the window masks nothing.
#[test]
fn mistral_within_its_window_equals_candle_transformers() {
    use candle_transformers::models::mistral;
    let s = MakeSpec {
        rope_theta: 10000.0,
        ..spec(Family::Mistral)
    };
    let d = made(&s);
    let n = 14;
    edit_config(d.path(), |c| c["sliding_window"] = n.into());
    let m = ours(d.path());
    assert_eq!(
        (m.config().family, m.config().positions()),
        (Family::Mistral, n)
    );
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| (i * 41 + 3) % s.vocab as u32)
        .collect();
    let h = final_hidden(&m, &ids, &[n as u32]);
    let got = h.matmul(&m.lm_head().t().unwrap()).unwrap();
    let text = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    let cfg: mistral::Config = serde_json::from_str(&text).unwrap();
    let mut o = mistral::Model::new(&cfg, vb(d.path())).unwrap();
    let rows: Vec<Tensor> = (1..=n)
        .map(|k| {
            o.clear_kv_cache();
            let x = Tensor::new(&ids[..k], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            o.forward(&x, 0)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .squeeze(0)
                .unwrap()
        })
        .collect();
    let want = Tensor::stack(&rows, 0).unwrap();
    let diff = max_diff(&got, &want);
    assert!(diff < TOL, "max |ours - oracle| = {diff}");
}

/// Where a Mistral's window bounds the sequences: `positions()`, the bound the settle checks
/// hold data and evaluations to, is exactly as long as HF's window lets our full attention be.
/// Layer 0, ours against the textbook's layer masked by HF's window rule: equal on `positions()`
/// tokens (the window masks nothing yet); on one more, the last token's row differs (HF's
/// window drops the first token from it) where the earlier rows still agree. A bound one too
/// long fails the first. candle-transformers' Mistral sees `w + 1` tokens, so its oracle cannot
/// tell.
#[test]
fn a_mistral_window_bounds_the_positions_exactly_where_hf_begins_to_mask() {
    let s = MakeSpec {
        rope_theta: 10000.0,
        ..spec(Family::Mistral)
    };
    let d = made(&s);
    let w = 6;
    edit_config(d.path(), |c| c["sliding_window"] = w.into());
    let m = ours(d.path());
    // The bound the settle checks hold data and evaluations to.
    let p = m.config().positions();
    let emb = candle_core::safetensors::load(d.path().join("model.safetensors"), &Device::Cpu)
        .unwrap()["model.embed_tokens.weight"]
        .clone();
    for n in [p, p + 1] {
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| (i * 41 + 3) % s.vocab as u32)
            .collect();
        let need = Need {
            layers: &[0],
            ..Need::default()
        };
        let ours = m.forward(&ids, &[n as u32], &need).unwrap();
        let x = emb
            .index_select(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(), 0)
            .unwrap();
        let hf = hand_layer(d.path(), m.config(), 0, &x, &[n as u32], Some(w));
        let first = max_diff(
            &ours.layers[0].narrow(0, 0, p).unwrap(),
            &hf.narrow(0, 0, p).unwrap(),
        );
        assert!(first < TOL, "n = {n}: the first {p} rows differ by {first}");
        if n > p {
            let last = max_diff(
                &ours.layers[0].narrow(0, p, 1).unwrap(),
                &hf.narrow(0, p, 1).unwrap(),
            );
            assert!(last > 1e-3, "n = {n}: the window masked nothing ({last})");
        }
    }
}

/// One decoder layer by the textbook: plain tensor operations, no fused kernel, each
/// sequence alone. `window`: HF's sliding window, by its rule (transformers' `masking_utils`:
/// a query at `i` sees a key at `j` when `j > i - window`, so `window` tokens itself included).
fn hand_layer(
    dir: &Path,
    cfg: &ArchConfig,
    l: usize,
    x: &Tensor,
    lens: &[u32],
    window: Option<usize>,
) -> Tensor {
    let w = |n: &str| {
        let all =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        all[&format!("model.layers.{l}.{n}")].clone()
    };
    let eps = cfg.rms_norm_eps;
    let rms = |x: &Tensor, g: &Tensor| {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        x.broadcast_div(&(ms + eps).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(g)
            .unwrap()
    };
    let lin = |x: &Tensor, n: &str| x.matmul(&w(&format!("{n}.weight")).t().unwrap()).unwrap();
    let (nh, nkv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let h = rms(x, &w("input_layernorm.weight"));
    let mut outs = vec![];
    let mut start = 0;
    for &len in lens {
        let len = len as usize;
        let hs = h.narrow(0, start, len).unwrap();
        let heads = |n: &str, k: usize, norm: &str| {
            let t = lin(&hs, n).reshape((len, k, hd)).unwrap();
            let t = if cfg.qk_norm { rms(&t, &w(norm)) } else { t };
            t.transpose(0, 1).unwrap() // [k, len, hd]
        };
        let q = heads("self_attn.q_proj", nh, "self_attn.q_norm.weight");
        let k = heads("self_attn.k_proj", nkv, "self_attn.k_norm.weight");
        let v = lin(&hs, "self_attn.v_proj")
            .reshape((len, nkv, hd))
            .unwrap()
            .transpose(0, 1)
            .unwrap();
        // Rope, rotate-half form, positions 0..len.
        let half = hd / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / (cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)) as f32)
            .collect();
        let ang: Vec<f32> = (0..len)
            .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
            .collect();
        let ang = Tensor::from_vec(ang, (len, half), &Device::Cpu).unwrap();
        let ang = Tensor::cat(&[&ang, &ang], 1).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let rot = |t: &Tensor| {
            let a = t.narrow(2, 0, half).unwrap();
            let b = t.narrow(2, half, half).unwrap();
            let rh = Tensor::cat(&[&b.neg().unwrap(), &a], 2).unwrap();
            (t.broadcast_mul(&cos).unwrap() + rh.broadcast_mul(&sin).unwrap()).unwrap()
        };
        let (q, k) = (rot(&q), rot(&k));
        let g = nh / nkv;
        let mut head_out = vec![];
        for head in 0..nh {
            let qh = q.get(head).unwrap();
            let kh = k.get(head / g).unwrap();
            let vh = v.get(head / g).unwrap();
            let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
            let s = s.to_vec2::<f32>().unwrap();
            let p: Vec<f32> = s
                .iter()
                .enumerate()
                .flat_map(|(i, row)| {
                    let seen = |j: usize| j <= i && window.is_none_or(|w| j + w > i);
                    let m = (0..len)
                        .filter(|&j| seen(j))
                        .map(|j| row[j])
                        .fold(f32::MIN, f32::max);
                    let e: Vec<f32> = (0..len)
                        .map(|j| if seen(j) { (row[j] - m).exp() } else { 0.0 })
                        .collect();
                    let z: f32 = e.iter().sum();
                    e.into_iter().map(move |x| x / z)
                })
                .collect();
            let p = Tensor::from_vec(p, (len, len), &Device::Cpu).unwrap();
            head_out.push(p.matmul(&vh).unwrap());
        }
        let a = Tensor::cat(&head_out, 1).unwrap(); // [len, nh*hd]
        outs.push(lin(&a, "self_attn.o_proj"));
        start += len;
    }
    let x = (x + Tensor::cat(&outs, 0).unwrap()).unwrap();
    let h = rms(&x, &w("post_attention_layernorm.weight"));
    let gate = lin(&h, "mlp.gate_proj");
    let silu = (&gate * candle_nn::ops::sigmoid(&gate).unwrap()).unwrap();
    let m = (silu * lin(&h, "mlp.up_proj")).unwrap();
    (x + lin(&m, "mlp.down_proj")).unwrap()
}

#[test]
fn every_captured_layer_equals_a_hand_run_and_the_forward_stops_after_the_last() {
    let s = MakeSpec {
        head_dim: Some(16),
        ..spec(Family::Qwen3)
    };
    let d = made(&s);
    let m = ours(d.path());
    let (ids, lens) = batch(s.vocab as u32);
    let all = m
        .forward(
            &ids,
            &lens,
            &Need {
                layers: &[0, 1, 2],
                final_hidden: false,
                tokens: true,
            },
        )
        .unwrap();
    let emb = candle_core::safetensors::load(d.path().join("model.safetensors"), &Device::Cpu)
        .unwrap()["model.embed_tokens.weight"]
        .clone();
    let mut x = emb
        .index_select(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(), 0)
        .unwrap();
    for l in 0..3 {
        x = hand_layer(d.path(), m.config(), l, &x, &lens, None);
        let diff = max_diff(&all.layers[l], &x);
        assert!(diff < TOL, "layer {l}: max |ours - hand| = {diff}");
    }
    // Asked for layer 1 only, in another order with a repeat: the same tensors.
    let some = m
        .forward(
            &ids,
            &lens,
            &Need {
                layers: &[1, 0, 1],
                ..Need::default()
            },
        )
        .unwrap();
    assert!(some.tokens.is_none() && some.final_hidden.is_none());
    assert_eq!(some.layers.len(), 3);
    for (got, want) in some.layers.iter().zip([1, 0, 1]) {
        assert_eq!(max_diff(got, &all.layers[want]), 0.0);
    }
}

#[test]
fn greedy_tokens_are_the_argmax_of_the_head_in_any_chunking_and_sequences_do_not_mix() {
    let s = spec(Family::Qwen3);
    let d = made(&s);
    let mut m = ours(d.path());
    let (ids, lens) = batch(s.vocab as u32);
    let need = Need {
        final_hidden: true,
        tokens: true,
        ..Need::default()
    };
    let out = m.forward(&ids, &lens, &need).unwrap();
    let logits = out
        .final_hidden
        .as_ref()
        .unwrap()
        .matmul(&m.lm_head().t().unwrap())
        .unwrap();
    let want: Vec<u32> = logits.argmax(D::Minus1).unwrap().to_vec1().unwrap();
    assert_eq!(out.token_ids().unwrap().as_deref(), Some(&want[..]));
    m.set_logit_chunk(3 * s.vocab);
    assert_eq!(
        m.forward(&ids, &lens, &need).unwrap().token_ids().unwrap(),
        Some(want)
    );
    // The second sequence run alone gives its rows of the batch: no attention across.
    let alone = final_hidden(&m, &ids[7..], &lens[1..]);
    let batched = out.final_hidden.unwrap().narrow(0, 7, 12).unwrap();
    assert!(max_diff(&alone, &batched) < 1e-6);
    // Candle's fused CPU attention agrees with our blocked matrix products, and blocks of
    // queries smaller than a sequence (4 heads x 16 rows) change nothing.
    let blocked = final_hidden(&ours(d.path()), &ids, &lens);
    m.set_fused_attention(true);
    let fused = final_hidden(&m, &ids, &lens);
    assert!(max_diff(&blocked, &fused) < 1e-5);
    let mut small = ours(d.path());
    small.set_score_block(4 * 16 * 12);
    assert!(max_diff(&final_hidden(&small, &ids, &lens), &blocked) < 1e-5);
}

#[test]
fn every_loader_variant_loads_the_same_model() {
    let (ids, lens) = batch(320);
    let base = MakeSpec {
        tied: true,
        head_dim: Some(16),
        ..spec(Family::Qwen3)
    };
    let reference = {
        let d = made(&base);
        // Tied: the files hold no lm_head.weight, and the head is the embedding.
        let text = std::fs::read(d.path().join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&text).unwrap();
        assert!(st.tensor("lm_head.weight").is_err());
        let m = ours(d.path());
        assert_eq!(max_diff(m.lm_head(), m.embed_tokens()), 0.0);
        final_hidden(&m, &ids, &lens)
    };
    // Sharded with an index, and the transformers 5 config style: the same bits.
    for variant in [
        MakeSpec {
            shard_bytes: Some(40_000),
            ..base.clone()
        },
        MakeSpec {
            style: ConfigStyle::V5,
            ..base.clone()
        },
    ] {
        let d = made(&variant);
        if variant.shard_bytes.is_some() {
            assert!(d.path().join("model.safetensors.index.json").exists());
            assert!(!d.path().join("model.safetensors").exists());
        }
        let got = final_hidden(&ours(d.path()), &ids, &lens);
        assert_eq!(max_diff(&got, &reference), 0.0, "{variant:?}");
    }
    // Stored bf16 (and f16): converted to f32 on load, as the oracle's loader converts.
    for stored in [Stored::Bf16, Stored::F16] {
        let d = made(&MakeSpec {
            stored,
            ..base.clone()
        });
        let got = final_hidden(&ours(d.path()), &ids, &lens);
        let want = qwen3_oracle(d.path(), &ids, &lens);
        assert!(max_diff(&got, &want) < TOL, "{stored:?}");
        // bf16 weights are a different model: the test would notice a loader that ignored
        // the stored dtype.
        assert!(max_diff(&got, &reference) > 1e-4, "{stored:?}");
    }
}

/// A directory with both `model.safetensors` and an index (a stale one, say) reads
/// `model.safetensors`, as transformers' `from_pretrained` does.
#[test]
fn model_safetensors_wins_over_an_index_as_in_transformers() {
    let (ids, lens) = batch(320);
    let sharded = made(&MakeSpec {
        shard_bytes: Some(40_000),
        ..spec(Family::Qwen3)
    });
    let single = made(&MakeSpec {
        seed: 8,
        ..spec(Family::Qwen3)
    });
    std::fs::copy(
        single.path().join("model.safetensors"),
        sharded.path().join("model.safetensors"),
    )
    .unwrap();
    let got = final_hidden(&ours(sharded.path()), &ids, &lens);
    let want = final_hidden(&ours(single.path()), &ids, &lens);
    assert_eq!(max_diff(&got, &want), 0.0);
}

fn load_err(dir: &Path) -> String {
    match Decoder::load(dir, &Device::Cpu, DType::F32) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn bad_model_directories_are_clear_errors() {
    let e = load_err(Path::new("/nonexistent/model"));
    assert!(e.contains("/nonexistent/model: no such directory"), "{e}");

    let d = made(&spec(Family::Qwen3));
    edit_config(d.path(), |v| v["model_type"] = "gemma3".into());
    let e = load_err(d.path());
    assert!(
        e.contains("model_type = \"gemma3\" is not supported"),
        "{e}"
    );

    // The config claims a layer the weights do not have.
    let d = made(&spec(Family::Qwen3));
    edit_config(d.path(), |v| v["num_hidden_layers"] = 4.into());
    let e = load_err(d.path());
    assert!(
        e.contains("no weights file holds tensor model.layers.3.input_layernorm.weight"),
        "{e}"
    );

    // The config disagrees with a tensor's shape: the file and the tensor are named.
    let d = made(&spec(Family::Qwen3));
    edit_config(d.path(), |v| v["intermediate_size"] = 100.into());
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], the config says [100, 64]"),
        "{e}"
    );

    // Untied by the config, but the checkpoint has no head: the error says where tying is set.
    let d = made(&MakeSpec {
        tied: true,
        ..spec(Family::Qwen3)
    });
    edit_config(d.path(), |v| v["tie_word_embeddings"] = false.into());
    let e = load_err(d.path());
    assert!(
        e.contains("tensor lm_head.weight") && e.contains("tie_word_embeddings is false"),
        "{e}"
    );

    // No weights at all; then a damaged weights file.
    let d = made(&spec(Family::Qwen3));
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(load_err(d.path()).contains("no model.safetensors"));
    std::fs::write(d.path().join("model.safetensors"), b"\x08\0\0\0\0\0\0\0{}").unwrap();
    assert!(load_err(d.path()).contains("model.safetensors: not a safetensors file"));

    // An index naming a shard that is not there.
    let d = made(&MakeSpec {
        shard_bytes: Some(40_000),
        ..spec(Family::Qwen3)
    });
    let shard = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.to_string_lossy().ends_with("-of-00002.safetensors")
                || p.to_string_lossy().contains("00001-of-")
        })
        .unwrap();
    std::fs::remove_file(shard).unwrap();
    assert!(load_err(d.path()).contains("which does not exist"));

    // A capture layer out of range, and a token outside the vocabulary.
    let d = made(&spec(Family::Qwen3));
    let m = ours(d.path());
    let need = Need {
        layers: &[3],
        ..Need::default()
    };
    let e = m.forward(&[1, 2], &[2], &need).err().unwrap();
    assert!(
        matches!(
            e,
            ModelError::Layer {
                layer: 3,
                layers: 3
            }
        ),
        "{e}"
    );
    let e = m.forward(&[1, 320], &[2], &Need::default()).err().unwrap();
    assert!(e.to_string().contains("token 320 at position 1"), "{e}");
    let e = m.forward(&[1, 2], &[3], &Need::default()).err().unwrap();
    assert!(e.to_string().contains("sum to 3"), "{e}");
}

#[test]
fn make_model_is_deterministic_and_its_tokenizer_encodes_any_text() {
    let s = MakeSpec::default();
    let (a, b) = (made(&s), made(&s));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let (x, y) = (
            std::fs::read(a.path().join(f)).unwrap(),
            std::fs::read(b.path().join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs between two makes of one seed");
    }
    let tok = tokenizers::Tokenizer::from_file(a.path().join("tokenizer.json")).unwrap();
    let n = tok.get_vocab_size(true);
    assert!(
        n <= s.vocab && n > 600,
        "tokenizer has {n} tokens for a vocabulary of {}",
        s.vocab
    );
    let text = "<|im_start|>user\nWhy is the river long? Ünïcödé 42<|im_end|>";
    let enc = tok.encode(text, false).unwrap();
    assert_eq!(enc.get_ids()[0], tok.token_to_id("<|im_start|>").unwrap());
    assert!(enc.get_ids().iter().all(|&id| (id as usize) < s.vocab));
    assert!(
        enc.get_ids().len() < text.len(),
        "merges make tokens of several bytes"
    );
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
    // The default model loads.
    let m = ours(a.path());
    assert_eq!(m.config().family, Family::Qwen3);
}

/// Sets every element of tensor `name` in `dir`'s (single, f32) model.safetensors to +inf, in
/// place.
fn infinite_tensor(dir: &Path, name: &str) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let (header, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let info = meta.info(name).unwrap();
    assert_eq!(info.dtype, safetensors::Dtype::F32);
    let (start, end) = info.data_offsets;
    let at = 8 + header;
    for v in bytes[at + start..at + end].chunks_exact_mut(4) {
        v.copy_from_slice(&f32::INFINITY.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
}

/// A GPU's forward checks for NaN and infinities on the device, where it cannot stop at the
/// layer that made them without waiting for the device: it marks every greedy token, and
/// reading the tokens is the error. Run here on the CPU (`check_on_device`), on the same ops:
/// a healthy model's tokens are unmarked and the CPU check's; a model whose layer 1 computes
/// infinities has every token marked; the CPU's own
/// check names the layer.
#[test]
fn a_forward_checked_on_the_device_marks_its_tokens_when_it_computes_nan() {
    use model::decoder::{non_finite_marked, NON_FINITE};
    let s = spec(Family::Qwen3);
    let dir = made(&s);
    let (ids, lens) = batch(s.vocab as u32);
    let need = Need {
        layers: &[0, 2],
        final_hidden: false,
        tokens: true,
    };
    let mut d = ours(dir.path());
    let want = d.forward(&ids, &lens, &need).unwrap().token_ids().unwrap();
    d.check_on_device(true);
    let got = d.forward(&ids, &lens, &need).unwrap().token_ids().unwrap();
    assert_eq!(
        got, want,
        "the device's check changed a healthy model's tokens"
    );

    infinite_tensor(dir.path(), "model.layers.1.mlp.down_proj.weight");
    let mut d = ours(dir.path());
    d.check_on_device(true);
    let out = d.forward(&ids, &lens, &need).unwrap();
    let tokens = out.tokens.as_ref().unwrap().to_vec1::<u32>().unwrap();
    assert!(tokens.iter().all(|&t| t == NON_FINITE), "{tokens:?}");
    let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert!(non_finite_marked(&le));
    let e = out.token_ids().unwrap_err();
    assert!(
        matches!(e, ModelError::NonFinite(_)) && e.to_string().contains("NaN or infinite"),
        "{e}"
    );
    d.check_on_device(false);
    let e = d.forward(&ids, &lens, &need).err().unwrap();
    assert!(e.to_string().contains("decoder layer 1's output"), "{e}");
}

/// The CPU's check says where NaN or infinities first appear, though it reads only the last
/// layer's output, the final norm's and the logits: a model whose layer 1 computes infinities
/// fails naming layer 1, whichever later layers are asked for and whether or not the tokens
/// are; a broken final norm or LM head is named as such; a healthy model passes.
#[test]
fn the_cpu_check_names_the_first_layer_or_part_that_is_not_finite() {
    let s = spec(Family::Qwen3);
    let (ids, lens) = batch(s.vocab as u32);
    let need = |layers, tokens| Need {
        layers,
        final_hidden: false,
        tokens,
    };
    let healthy = made(&s);
    for want in [need(&[2], false), need(&[0], true)] {
        ours(healthy.path()).forward(&ids, &lens, &want).unwrap();
    }
    let cases: [(&str, &[Need<'_>], &str); 3] = [
        (
            "model.layers.1.mlp.down_proj.weight",
            &[need(&[2], false), need(&[1], false), need(&[0], true)],
            "decoder layer 1's output",
        ),
        (
            "model.norm.weight",
            &[need(&[], true)],
            "the final norm's output",
        ),
        (
            "lm_head.weight",
            &[need(&[0], true)],
            "the LM head's logits",
        ),
    ];
    for (tensor, needs, named) in cases {
        let dir = made(&s);
        infinite_tensor(dir.path(), tensor);
        let d = ours(dir.path());
        for n in needs {
            let e = d.forward(&ids, &lens, n).err().unwrap();
            assert!(
                matches!(e, ModelError::NonFinite(_)) && e.to_string().contains(named),
                "{tensor} infinite, layers {:?}: {e}",
                n.layers
            );
        }
    }
}
