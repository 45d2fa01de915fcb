//! The real target (the candle backend) end to end: a target worker writing a real model's
//! states into the ring, checked batch by batch against the model run in this process; the 5x3
//! launcher run on a tiny model; `launcher capture`; bad model inputs, a target computing NaN,
//! capture and eval stopped by a signal; the DFlash drafter
//! trained by the group, exported and decoded with; the README's DFlash demo as written.
//!
//! Length: about 1350 lines: each test runs a whole path (a worker, the launcher, capture,
//! eval) on a real model, and they share the model and config helpers at the top.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use model::make::{make_model, MakeSpec};
use model::{Decoder, Need};
use proto::plan::plan;
use proto::{BatchView, PipelineConfig, RunDir};
use shm_ring::Take;

use crate::launcher::{no_segment_of, Run};
use crate::support::{spawn, unique, workspace_bin, TestDir, WATCHDOG};

/// A tiny Qwen3 (8 layers, hidden 64, vocabulary 1024) in `dir`.
pub(crate) fn tiny(dir: &Path) -> PathBuf {
    let m = dir.join("tiny");
    make_model(&m, &MakeSpec::default()).unwrap();
    m
}

/// Short samples of the built-in language (400 of them make 60 batches) and a small DFlash
/// drafter, so that the tiny target and its drafter train a run in a few seconds. It ends in
/// the `[dflash]` table.
pub(crate) const SMALL_DFLASH: &str = r#"
[data]
synthetic_samples = 400
min_len = 16
max_len = 64
[target]
token_budget = 256
[dflash]
block_size = 8
num_anchors = 8
layers = 1
"#;

/// `DIR/NAME`: a config for the model in `model` with a small ring, then `body`.
fn write_config(dir: &Path, name: &str, model: &Path, body: &str) -> PathBuf {
    let text = format!(
        "[ring]\nslots = 16\nmin_ready = 2\n[model]\npath = \"{}\"\n{body}",
        model.display()
    );
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Short sequences: a forward of the tiny model is quick, the attention too.
fn config(dir: &Path, model: &Path, extra: &str) -> PathBuf {
    let body = format!(
        r#"
[data]
synthetic_samples = 60
min_len = 8
max_len = 96
[target]
token_budget = 384
[drafter]
tokens_per_s = 2000000.0
checkpoint_every = 4
{extra}
"#
    );
    write_config(dir, "model.toml", model, &body)
}

/// bf16 bits as f32.
fn bf16(b: &[u8]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

/// Greatest difference between the slot's bf16 states `[T, L, H]` and the model's layers.
fn states_diff(hidden: &[u8], layers: &[candle_core::Tensor], h: usize) -> f32 {
    let l = layers.len();
    let mut worst = 0f32;
    for (li, x) in layers.iter().enumerate() {
        let rows: Vec<Vec<f32>> = x.to_vec2().unwrap();
        for (t, row) in rows.iter().enumerate() {
            for (c, &want) in row.iter().enumerate() {
                let at = ((t * l + li) * h + c) * 2;
                worst = worst.max((bf16(&hidden[at..at + 2]) - want).abs());
            }
        }
    }
    worst
}

#[test]
fn a_real_target_worker_writes_the_models_layers_and_greedy_tokens_into_the_ring() {
    let dir = TestDir::new("mworker");
    let m = tiny(&dir.path(""));
    let cfg_path = config(&dir.path(""), &m, "");
    // What the launcher settles: the model's hidden size and SpecForge's 5 layers of 8.
    let mut cfg = PipelineConfig::load(&cfg_path).unwrap();
    gpu::settle(gpu::BackendKind::Candle, &mut cfg).unwrap();
    assert_eq!(cfg.model.hidden, 64);
    let ids: Vec<usize> = cfg
        .model
        .target_layer_ids
        .clone()
        .unwrap()
        .iter()
        .map(|&i| i as usize)
        .collect();
    assert_eq!(ids, model::capture::default_layer_ids(8, 5).unwrap());
    std::fs::write(&cfg_path, cfg.to_toml()).unwrap();

    let data = target_worker::load_dataset(&cfg).unwrap();
    let batches = plan(data.lengths(), &cfg).len() as u64;
    let name = unique("mworker");
    let ring = shm_ring::Ring::create(&name, &cfg.ring_params(1, 1, batches).unwrap()).unwrap();
    let target = spawn(
        &workspace_bin("target-worker"),
        &[
            "--index",
            "0",
            "--ring",
            &name,
            "--run-dir",
            dir.path("run").to_str().unwrap(),
            "--config",
            cfg_path.to_str().unwrap(),
            "--backend",
            "candle",
        ],
    );
    let decoder = Decoder::load(&m, &Device::Cpu, DType::F32).unwrap();
    let consumer = ring.consumer(0).unwrap();
    let started = Instant::now();
    let mut seen = 0u64;
    let mut tokens_checked = 0usize;
    loop {
        assert!(started.elapsed() < WATCHDOG, "the target worker hung");
        let slot = match consumer.take_timeout(Duration::from_millis(200)).unwrap() {
            Take::Item(s) => s,
            Take::End => break,
            Take::TimedOut => continue,
        };
        let b = BatchView::parse(slot.payload()).unwrap();
        b.verify().unwrap();
        let spec = &b.header().spec;
        assert_eq!((spec.layers, spec.hidden), (5, 64));
        let input: Vec<u32> = b.input_ids().collect();
        let out = decoder
            .forward(
                &input,
                &spec.seq_lens,
                &Need {
                    layers: &ids,
                    final_hidden: false,
                    tokens: true,
                },
            )
            .unwrap();
        // bf16 in the slot: half an ulp of bf16 at |x| < 8 is below 0.016.
        let diff = states_diff(b.hidden_states(), &out.layers, 64);
        assert!(
            diff < 0.02,
            "batch {}: states differ by {diff}",
            spec.batch_id
        );
        let greedy: Vec<u32> = b.target_tokens().collect();
        assert_eq!(
            Some(greedy),
            out.token_ids().unwrap(),
            "batch {}",
            spec.batch_id
        );
        tokens_checked += input.len();
        seen += 1;
        slot.release().unwrap();
    }
    assert_eq!(seen, batches, "every planned batch published once");
    assert_eq!(
        tokens_checked as u64,
        data.lengths().iter().map(|&l| u64::from(l)).sum::<u64>()
    );
    target.finish();
}

#[test]
fn a_five_by_three_run_on_a_real_target_trains_every_sample_once() {
    let run = Run::new("m5x3");
    // The model made through the command line, as the README makes it.
    let m = run.dir.join("tiny");
    let made = spawn(
        &workspace_bin("launcher"),
        &["make-model", m.to_str().unwrap()],
    )
    .finish();
    assert!(made.contains("qwen3 with 8 layers"), "{made}");
    let cfg = config(&run.dir, &m, "");
    let launcher = run.launch(&cfg, &["--model", m.to_str().unwrap()]);
    let pid = launcher.child.id();
    let out = launcher.finish();
    assert!(out.contains("exit code 0"), "{out}");
    assert!(out.contains("backend candle on the CPU"), "{out}");
    no_segment_of(pid);
    let s = run.summary();
    assert_eq!(s["ok"], true, "{s}");
    let lines = run.ledgers();
    let mut counts = std::collections::HashMap::new();
    for l in &lines {
        for &id in &l.sample_ids {
            *counts.entry(id).or_insert(0) += 1;
        }
    }
    assert_eq!(counts.len(), 60, "every sample trained");
    assert!(counts.values().all(|&c| c == 1), "none twice");
    // The run's config records what the model fixed, so a resume sizes the ring the same.
    let settled = PipelineConfig::load(&run.run_dir().join("config.toml")).unwrap();
    assert_eq!(settled.model.hidden, 64);
    assert_eq!(settled.model.target_layer_ids, Some(vec![1, 2, 3, 4, 5]));
    // Its synthetic data are the built-in language, below the model's vocabulary.
    assert_eq!(settled.data.synthetic_vocab, Some(1024));
    assert_eq!(settled.data.synthetic_language, Some(true));
    assert!(out.contains("synthetic language (60 samples"), "{out}");
}

#[test]
fn capture_writes_each_samples_layers_and_greedy_tokens_through_the_same_forward() {
    let dir = TestDir::new("mcapture");
    let m = tiny(&dir.path(""));
    let cfg = config(&dir.path(""), &m, "");
    let out = dir.path("caps");
    let run = |extra: &[&str], out: &Path| {
        let mut args = vec![
            "capture",
            "--model",
            m.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
            "--synthetic",
            "3",
            "--layers",
            "0,3,5",
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        spawn(&workspace_bin("launcher"), &args).finish()
    };
    let said = run(&[], &out);
    assert!(said.contains("3 samples"), "{said}");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["target_layer_ids"], serde_json::json!([0, 3, 5]));
    let shard = out.join(index["samples"]["1"].as_str().unwrap());
    let bytes = std::fs::read(&shard).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = st
        .tensor("1.input_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let hidden = st.tensor("1.hidden_states").unwrap();
    assert_eq!(hidden.shape(), [ids.len(), 3, 64]);
    let decoder = Decoder::load(&m, &Device::Cpu, DType::F32).unwrap();
    let want = decoder
        .forward(
            &ids,
            &[ids.len() as u32],
            &Need {
                layers: &[0, 3, 5],
                final_hidden: false,
                tokens: true,
            },
        )
        .unwrap();
    assert!(states_diff(hidden.data(), &want.layers, 64) < 0.02);
    let greedy: Vec<u32> = st
        .tensor("1.target_tokens")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(Some(greedy), want.token_ids().unwrap());

    // Without the tokens the forward stops early: the same states, tokens left zero.
    let out2 = dir.path("caps-no-tokens");
    run(&["--no-tokens"], &out2);
    let bytes2 = std::fs::read(out2.join(shard.file_name().unwrap())).unwrap();
    let st2 = safetensors::SafeTensors::deserialize(&bytes2).unwrap();
    assert_eq!(st2.tensor("1.hidden_states").unwrap().data(), hidden.data());
    assert!(st2
        .tensor("1.target_tokens")
        .unwrap()
        .data()
        .iter()
        .all(|&b| b == 0));

    // A capture of the model with `extra`, refused: its exit code and stderr.
    let refused = |extra: &[&str]| {
        let args = [&["capture", "--model", m.to_str().unwrap()][..], extra].concat();
        let (status, err) = spawn(&workspace_bin("launcher"), &args).wait_status_keep();
        (status.code(), err)
    };
    // An output directory in use is refused.
    let (code, err) = refused(&["-o", out.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("is not empty"), "{err}");
    // So is a file, by its name (before: "error: Not a directory (os error 20)" alone).
    let file = dir.path("caps-file");
    std::fs::write(&file, "").unwrap();
    let (code, err) = refused(&["-o", file.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(&format!(
            "-o {}: the output must be a directory",
            file.display()
        )),
        "{err}"
    );
    // A link to nowhere, by what it is (before: "creating ...: File exists"), and left as it is.
    let dangling = dir.path("caps-link");
    std::os::unix::fs::symlink(dir.path("nowhere"), &dangling).unwrap();
    let (code, err) = refused(&["-o", dangling.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(&format!("-o {}: a link to ", dangling.display()))
            && err.contains("which does not exist"),
        "{err}"
    );
    assert!(std::fs::symlink_metadata(&dangling).unwrap().is_symlink());
    // Data tokenized for a larger vocabulary: refused naming the sample before any shard is
    // written (before: shards of the samples before it, and no index), prepared into the
    // --data-cache given.
    let big = dir.path("big-ids.jsonl");
    std::fs::write(
        &big,
        "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 1500]}\n",
    )
    .unwrap();
    let (out3, cache) = (dir.path("caps-big"), dir.path("my-cache"));
    let (code, err) = refused(&[
        "--data",
        big.to_str().unwrap(),
        "--data-cache",
        cache.to_str().unwrap(),
        "-o",
        out3.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("sample 1: token id 1500 at position 7 is outside the model's vocabulary"),
        "{err}"
    );
    assert!(!out3.exists(), "no output directory for a capture refused");
    assert!(std::fs::read_dir(&cache).unwrap().next().is_some());
}

/// `capture --config` with a run's `config.toml`, which names the run's prepared data file
/// (`data.prepared`), captures the data the flags ask for: `--synthetic 3` is three synthetic
/// samples. Before, the prepared file named in the config was captured instead.
#[test]
fn capture_with_a_runs_config_captures_the_data_its_flags_name() {
    let dir = TestDir::new("mcaptureprep");
    let m = tiny(&dir.path(""));
    let data = dir.path("train.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n".repeat(5),
    )
    .unwrap();
    let prepared = dir.path("train.arrow");
    let made = std::process::Command::new(workspace_bin("launcher"))
        .args(["prepare", data.to_str().unwrap(), "-o"])
        .arg(&prepared)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    // As a run writes it: the input and the file it was prepared into.
    let cfg = write_config(
        &dir.path(""),
        "run.toml",
        &m,
        &format!(
            "[data]\npath = {:?}\nprepared = {:?}\nmin_len = 8\nmax_len = 64\n",
            data.display().to_string(),
            prepared.display().to_string()
        ),
    );
    let out = dir.path("caps");
    let said = spawn(
        &workspace_bin("launcher"),
        &[
            "capture",
            "--model",
            m.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
            "--synthetic",
            "3",
            "-o",
            out.to_str().unwrap(),
        ],
    )
    .finish();
    assert!(said.contains("capture: 3 samples of synthetic"), "{said}");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["samples"].as_object().unwrap().len(), 3, "{index}");
}

/// `--shard-mib` is the most tensor data a shard holds, as its help says; only a sample
/// larger than that alone is a shard of its own. Before, a shard was written once it had
/// reached the size, so it held up to a whole sample more (five samples, 2.6 MiB, in one shard
/// of "at most" 1 MiB).
#[test]
fn capture_shards_hold_at_most_shard_mib_of_tensor_data() {
    let dir = TestDir::new("mcaptureshards");
    let m = tiny(&dir.path(""));
    let out = dir.path("caps");
    spawn(
        &workspace_bin("launcher"),
        &[
            "capture",
            "--model",
            m.to_str().unwrap(),
            "--synthetic",
            "5",
            "--shard-mib",
            "1",
            "-o",
            out.to_str().unwrap(),
        ],
    )
    .finish();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap()).unwrap();
    let mut shards: Vec<&str> = index["samples"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    shards.sort_unstable();
    shards.dedup();
    let mut samples = 0;
    for name in &shards {
        let bytes = std::fs::read(out.join(name)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let data: usize = st.tensors().iter().map(|(_, t)| t.data().len()).sum();
        let held = st.len() / 3;
        samples += held;
        assert!(
            data <= 1 << 20 || held == 1,
            "{name}: {held} samples, {data} bytes of tensors"
        );
    }
    assert_eq!(samples, 5);
    assert!(shards.len() > 1, "{shards:?}");
}

#[test]
fn bad_model_inputs_are_clear_errors_before_any_worker_starts() {
    let run = Run::new("mbad");
    let m = tiny(&run.dir);
    let cfg = config(&run.dir, &m, "");
    let write = |name: &str, text: &str| {
        let p = run.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    // An MoE config, a capture layer past the model's 8, and a slot too small for hidden 64.
    let moe = run.dir.join("moe");
    make_model(&moe, &MakeSpec::default()).unwrap();
    let c = std::fs::read_to_string(moe.join("config.json")).unwrap();
    std::fs::write(
        moe.join("config.json"),
        c.replacen("{", "{\"num_experts\": 8,", 1),
    )
    .unwrap();
    let far = write(
        "far.toml",
        &format!(
            "[model]\npath = \"{}\"\ntarget_layer_ids = [1, 8]\n",
            m.display()
        ),
    );
    let small = write(
        "small.toml",
        &format!(
            "[model]\npath = \"{}\"\n[ring]\nslot_bytes = 65536\n",
            m.display()
        ),
    );
    // Broken weights: a tensor missing, one of another shape, one quantized. Found from the
    // files' headers at settle, before any target worker loads them (restarted to its limit).
    let missing = broken_weights(&m, &run.dir.join("missing"), |name, t| {
        (name != "model.layers.3.self_attn.k_proj.weight").then_some(t)
    });
    let reshaped = broken_weights(
        &m,
        &run.dir.join("reshaped"),
        |name, (dtype, shape, data)| {
            let shape = if name == "model.layers.5.mlp.down_proj.weight" {
                vec![shape[1], shape[0]]
            } else {
                shape
            };
            Some((dtype, shape, data))
        },
    );
    let quantized = broken_weights(
        &m,
        &run.dir.join("quantized"),
        |name, (dtype, shape, data)| {
            if name == "model.norm.weight" {
                let n = shape.iter().product();
                return Some((safetensors::Dtype::I8, shape, data[..n].to_vec()));
            }
            Some((dtype, shape, data))
        },
    );
    let with_model = |dir: &Path| -> Vec<String> {
        vec![
            "--config".into(),
            cfg.to_str().unwrap().into(),
            "--model".into(),
            dir.to_str().unwrap().into(),
        ]
    };
    // Data tokenized for a larger vocabulary than the model's 1024: its second sample.
    let big = write(
        "big-ids.jsonl",
        "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 1500]}\n",
    );
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--config".into(),
                cfg.to_str().unwrap().into(),
                "--data".into(),
                big.to_str().unwrap().into(),
            ],
            "sample 1: token id 1500 at position 7 is outside the model's vocabulary of 1024",
        ),
        (
            vec![
                "--config".into(),
                cfg.to_str().unwrap().into(),
                "--model".into(),
                "/nonexistent/model".into(),
            ],
            "/nonexistent/model: no such directory",
        ),
        (
            vec![
                "--config".into(),
                cfg.to_str().unwrap().into(),
                "--model".into(),
                moe.to_str().unwrap().into(),
            ],
            "num_experts = 8",
        ),
        (
            with_model(&missing),
            "model.layers.3.self_attn.k_proj.weight",
        ),
        (with_model(&reshaped), "model.layers.5.mlp.down_proj.weight"),
        (with_model(&quantized), "model.norm.weight is stored as I8"),
        (
            vec!["--config".into(), far.to_str().unwrap().into()],
            "capture layer 8 is out of range",
        ),
        (
            vec!["--config".into(), small.to_str().unwrap().into()],
            "ring.slot_bytes",
        ),
        (
            vec![
                "--config".into(),
                cfg.to_str().unwrap().into(),
                "--backend".into(),
                "mock".into(),
            ],
            "would ignore the model",
        ),
    ];
    for (i, (extra, want)) in cases.iter().enumerate() {
        let rd = run.dir.join(format!("run-{i}"));
        let mut args = vec![
            "--targets",
            "0-1",
            "--drafters",
            "2",
            "--run-dir",
            rd.to_str().unwrap(),
        ];
        args.extend(extra.iter().map(String::as_str));
        let p = spawn(&workspace_bin("launcher"), &args);
        let pid = p.child.id();
        let (status, err) = p.wait_status_keep();
        // `--backend mock` with a model: flags that contradict it, a usage error.
        let usage = extra.iter().any(|a| a == "--backend");
        assert_eq!(
            status.code(),
            Some(if usage { 2 } else { 1 }),
            "{extra:?}: {err}"
        );
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{extra:?}: {err}"
        );
        no_segment_of(pid);
    }
}

/// `--resume` refuses another target model at the run's model path (made again with another
/// seed, its config edited): the drafter learned the model as it was. The model restored, the
/// run resumes. Before, the resume trained on against whatever the path held.
#[test]
fn a_resume_with_the_target_model_changed_is_refused_naming_what_changed() {
    let run = Run::new("mresumemodel");
    let m = tiny(&run.dir);
    let cfg = write_config(&run.dir, "run.toml", &m, SMALL_DFLASH);
    let out = run.launch(&cfg, &["--model", m.to_str().unwrap()]).finish();
    assert!(out.contains("exit code 0"), "{out}");
    let rd = RunDir::new(run.run_dir());
    assert!(rd.model_record().is_file(), "a run with a model records it");
    // As a run killed before its summary left it.
    std::fs::remove_file(rd.summary()).unwrap();
    let resume = || {
        let out = std::process::Command::new(workspace_bin("launcher"))
            .args(["--resume", run.run_dir().to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!err.contains("panicked"), "{err}");
        (out.status.code(), err)
    };
    let keep = |name: &str| std::fs::read(m.join(name)).unwrap();
    let (weights, config_json) = (keep("model.safetensors"), keep("config.json"));

    // The same shapes, other values: made again with another seed.
    let other = run.dir.join("other");
    make_model(
        &other,
        &MakeSpec {
            seed: 7,
            ..MakeSpec::default()
        },
    )
    .unwrap();
    std::fs::copy(other.join("model.safetensors"), m.join("model.safetensors")).unwrap();
    let (code, err) = resume();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("the target model changed since this run started")
            && err.contains("model.safetensors: its weights' values changed"),
        "{err}"
    );
    std::fs::write(m.join("model.safetensors"), &weights).unwrap();

    // Its config edited.
    let edited =
        String::from_utf8(config_json.clone())
            .unwrap()
            .replacen('{', "{\"use_cache\": false,", 1);
    std::fs::write(m.join("config.json"), edited).unwrap();
    let (code, err) = resume();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("config.json changed"), "{err}");
    std::fs::write(m.join("config.json"), &config_json).unwrap();

    // Restored: the run resumes.
    let (code, err) = resume();
    assert_eq!(code, Some(0), "{err}");
}

/// A tensor of a model's weights: its dtype, shape and bytes.
type Stored = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// A copy of the model in `from` at `to`, each tensor of its weights passed through `edit`
/// (`None` leaves it out).
fn broken_weights(
    from: &Path,
    to: &Path,
    edit: impl Fn(&str, Stored) -> Option<Stored>,
) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, Stored)> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, v)| {
            let t = (v.dtype(), v.shape().to_vec(), v.data().to_vec());
            edit(&name, t).map(|t| (name, t))
        })
        .collect();
    let views = kept.iter().map(|(name, (dtype, shape, data))| {
        let v = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
        (name.clone(), v)
    });
    safetensors::serialize_to_file(views, None, &to.join("model.safetensors")).unwrap();
    to.to_path_buf()
}

/// The DFlash drafter trained by the group on the real target's states: its loss falls, every
/// rank holds the same weights after every step, the export is what inference engines load
/// (checked by Python's `safetensors`), and `launcher eval` decodes speculatively to exactly the
/// target's greedy text.
#[test]
fn a_dflash_group_learns_exports_and_decodes_to_the_targets_greedy_text() {
    let run = Run::new("mdflash");
    // A target trained on the language (make-model --train), so the greedy text it must be
    // decoded to varies; its two layers are the context.
    let m = run.dir.join("trained");
    let spec = MakeSpec {
        layers: 2,
        train: Some(model::pretrain::TrainSpec {
            steps: 300,
            ..Default::default()
        }),
        ..MakeSpec::default()
    };
    make_model(&m, &spec).unwrap();
    let body = format!(
        "target_layer_ids = [0, 1]\nlayers = 2\n{SMALL_DFLASH}lr = 1e-2\nwarmup_ratio = 0.1\neval_every = 10\neval_prompts = 2\neval_new_tokens = 16\n[drafter]\ncheckpoint_every = 8\n"
    );
    let cfg = write_config(&run.dir, "dflash.toml", &m, &body);
    let launcher = run.launch(&cfg, &["--model", m.to_str().unwrap()]);
    let pid = launcher.child.id();
    let out = launcher.finish();
    assert!(out.contains("exit code 0"), "{out}");
    no_segment_of(pid);
    let summary = run.summary();
    assert_eq!(summary["ok"], true);
    // The leader's evaluations (every 10 steps and at the end) reach the summary.
    let e = summary["drafter"]["eval_tau"].as_f64().unwrap();
    assert!((1.0..=8.0).contains(&e), "{summary}");
    assert!(out.contains("tokens per target forward"), "{out}");

    // Every step's loss and tau reach metrics.jsonl; the loss falls.
    let metrics = std::fs::read_to_string(run.run_dir().join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .flat_map(|l| {
            let t: serde_json::Value = serde_json::from_str(l).unwrap();
            t["steps"].as_array().cloned().unwrap_or_default()
        })
        .filter(|s| s["tau"].is_number())
        .collect();
    assert!(steps.len() >= 12, "{} steps with blocks", steps.len());
    let loss = |s: &[serde_json::Value]| {
        s.iter().map(|s| s["loss"].as_f64().unwrap()).sum::<f64>() / s.len() as f64
    };
    let (first, last) = (loss(&steps[..3]), loss(&steps[steps.len() - 5..]));
    assert!(
        last < first - 0.1,
        "loss {first:.3} over the first steps, {last:.3} over the last"
    );
    assert!(steps.iter().all(|s| s["tau"].as_f64().unwrap() >= 1.0));
    // The evaluations reach the ticks (and so TensorBoard's eval/tau). The monitor never kept
    // them: every tick said none.
    let evals: Vec<f64> = (metrics.lines())
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|t| t["eval_acceptance_length"].as_f64())
        .collect();
    assert!(!evals.is_empty(), "no tick has an evaluation");
    assert!(evals.iter().all(|e| (1.0..=8.0).contains(e)), "{evals:?}");

    // One model: the ranks' ledger lines of one step name one digest.
    let mut by_step = std::collections::HashMap::new();
    for l in run.ledgers() {
        let d = by_step.entry(l.step).or_insert_with(|| l.digest.clone());
        assert_eq!(*d, l.digest, "step {}", l.step);
    }

    // The export, as SGLang and vLLM load it.
    let export = run.run_dir().join("drafter");
    let py = crate::data::python();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/py/check_dflash_export.py");
    let checked = std::process::Command::new(&py)
        .arg(script)
        .arg(&export)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );

    // Speculative decoding with it gives the target's own greedy text, trained or not.
    let json = run.dir.join("eval.json");
    let eval = spawn(
        &workspace_bin("launcher"),
        &[
            "eval",
            "--model",
            m.to_str().unwrap(),
            "--drafter",
            export.to_str().unwrap(),
            "--prompts",
            "3",
            "--max-new-tokens",
            "24",
            "--baseline",
            "--json",
            json.to_str().unwrap(),
        ],
    )
    .finish();
    assert!(
        eval.contains("output equals the target's greedy output"),
        "{eval}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for who in ["trained", "untrained"] {
        assert_eq!(r[who]["matches_greedy"], true, "{who}: {r}");
        assert_eq!(r[who]["tokens"], 3 * 24, "{who}: {r}");
        let tau = r[who]["mean_acceptance_length"].as_f64().unwrap();
        assert!((1.0..=8.0).contains(&tau), "{who}: {r}");
    }
}

/// `[drafter] keep_export_every`: a run keeps the export of every multiple of it as
/// `drafter-steps/step-<S>/` beside the `drafter/` each checkpoint rewrites, each whole (no
/// temporary left) and the drafter of its step: training moved the weights since, so each
/// kept `model.safetensors` but the last step's differs from the final export's. The end's
/// lines and `summary.json` say which are kept and where, and `launcher eval --drafter` decodes
/// with one, to the target's greedy text. Before, every export replaced the last.
#[test]
fn kept_exports_hold_the_drafter_of_their_steps_and_eval_decodes_with_one() {
    let run = Run::new("mkeep");
    let m = tiny(&run.dir);
    let body = format!(
        "{SMALL_DFLASH}lr = 1e-2\n[drafter]\ncheckpoint_every = 2\nkeep_export_every = 4\n"
    );
    let cfg = write_config(&run.dir, "keep.toml", &m, &body);
    let out = run.launch(&cfg, &["--model", m.to_str().unwrap()]).finish();
    assert!(out.contains("exit code 0"), "{out}");
    let summary = run.summary();
    let last = summary["drafter"]["step"].as_u64().unwrap();
    let want: Vec<u64> = (1..=last).filter(|s| s % 4 == 0).collect();
    assert!(want.len() >= 2, "{last} steps: {summary}");
    assert_eq!(
        summary["kept_exports"],
        serde_json::json!(want),
        "{summary}"
    );
    let rd = RunDir::new(run.run_dir());
    let mut names: Vec<String> = std::fs::read_dir(rd.kept_exports_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want_names: Vec<String> = want.iter().map(|s| format!("step-{s}")).collect();
    want_names.sort();
    assert_eq!(names, want_names, "only whole kept exports");
    let line = format!(
        "kept exports: {} in {}",
        want.len(),
        rd.kept_exports_dir().display()
    );
    assert!(out.contains(&line), "{out}");

    // The group's last steps may train nothing (each rank saw the ring's end): they leave the
    // weights as they were, so a step kept after the last batch is the final drafter.
    let trained_to = run.ledgers().iter().map(|l| l.step).max().unwrap();
    assert!(want[0] < trained_to, "{trained_to}");
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    let last_export = weights(&rd.export_dir());
    for &step in &want {
        let kept = rd.kept_export(step);
        assert!(kept.join("config.json").is_file(), "step {step}");
        let moved_since = step < trained_to;
        assert_eq!(
            weights(&kept) != last_export,
            moved_since,
            "step {step}, batches trained up to step {trained_to}"
        );
    }
    assert!(weights(&rd.kept_export(want[0])) != weights(&rd.kept_export(want[1])));

    let kept = rd.kept_export(want[0]);
    let (m, kept) = (m.to_str().unwrap(), kept.to_str().unwrap());
    let args = ["--prompts", "1", "--max-new-tokens", "8"];
    let (code, said) =
        launcher_said(&[&["eval", "--model", m, "--drafter", kept][..], &args].concat());
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("output equals the target's greedy output"),
        "{said}"
    );
}

/// An export that fails at its step (injected: `export_fails_at`, as a full disk would) is said
/// on the console and in the leader's log, the checkpoint written all the same; failed at the
/// last step, it is written again at the end, so the run ends `ok` with `drafter/` whole, the
/// export of that step, and the console says the export written again. The only data is one
/// batch, so the group's last step is 1, and `checkpoint_every = 1` has its commit write it
/// first (`Rank::checkpoint_before_update`). No fault failed an export before, and this retry
/// had no test.
#[test]
fn an_export_failed_at_the_last_step_is_written_again_at_the_end() {
    let run = Run::new("mexportfail");
    let m = tiny(&run.dir);
    let body = SMALL_DFLASH.replace("synthetic_samples = 400", "synthetic_samples = 1")
        + "[drafter]\ncheckpoint_every = 1\n[faults.drafter-0]\nexport_fails_at = 1\n";
    let cfg = write_config(&run.dir, "exportfail.toml", &m, &body);
    let out = run.launch(&cfg, &["--model", m.to_str().unwrap()]).finish();
    assert!(out.contains("exit code 0"), "{out}");
    let summary = run.summary();
    assert_eq!(summary["ok"], true, "{summary}");
    assert_eq!(
        summary["drafter"]["step"], 1,
        "one batch, one step: {summary}"
    );
    let rd = RunDir::new(run.run_dir());
    let failed = format!(
        "export of step 1 failed: exporting the drafter to {}: injected: export_fails_at: No space left on device",
        rd.export_dir().display()
    );
    assert!(out.contains(&failed), "{failed:?} in\n{out}");
    assert!(
        out.contains("export of step 1 written: the 1 before it failed (steps 1 to 1)"),
        "{out}"
    );
    let leader = std::fs::read_to_string(rd.log(proto::WorkerName::consumer(0))).unwrap();
    let said: Vec<&str> = (leader.lines())
        .filter(|l| l.contains("the export of this step failed"))
        .collect();
    assert_eq!(said.len(), 1, "{leader}");
    assert!(said[0].contains("injected: export_fails_at"), "{said:?}");
    for file in ["config.json", "model.safetensors"] {
        assert!(rd.export_dir().join(file).is_file(), "{file} in drafter/");
    }
    let left: Vec<String> = std::fs::read_dir(run.run_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("drafter") && n != "drafter")
        .collect();
    assert!(left.is_empty(), "no temporary export left: {left:?}");
}

/// The README's DFlash demo as written there: `make-model --layers 2 --train`, the 5x3 run on
/// `scripts/dflash-demo.toml`, then `launcher eval --baseline`. The group's loss ends well below
/// its plateau (the steps after the first ones' fall from the untrained head's large logits),
/// and the trained drafter decodes the target's greedy text with more than 2 tokens per target
/// forward, well above the untrained drafter's.
#[test]
fn the_readme_dflash_demo_trains_a_drafter_well_above_an_untrained_one() {
    // Minutes of real training on two cores: a watchdog for hangs, not a speed check.
    let long = Duration::from_secs(30 * 60);
    let run = Run::new("mdemo");
    let launcher = workspace_bin("launcher");
    let m = run.dir.join("tiny");
    let m_arg = m.to_str().unwrap();
    let made = spawn(
        &launcher,
        &["make-model", m_arg, "--layers", "2", "--train"],
    )
    .watchdog(long)
    .finish();
    assert!(made.contains("held-out next-token accuracy"), "{made}");
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/dflash-demo.toml");
    let out = run
        .launch(&cfg, &["--model", m_arg])
        .watchdog(long)
        .finish();
    assert!(out.contains("exit code 0"), "{out}");
    assert_eq!(run.summary()["ok"], true);

    let metrics = std::fs::read_to_string(run.run_dir().join("metrics.jsonl")).unwrap();
    let losses: Vec<f64> = (metrics.lines())
        .flat_map(|l| {
            let t: serde_json::Value = serde_json::from_str(l).unwrap();
            t["steps"].as_array().cloned().unwrap_or_default()
        })
        .map(|s| s["loss"].as_f64().unwrap())
        .collect();
    assert!(losses.len() > 500, "{} steps", losses.len());
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (plateau, last) = (mean(&losses[30..80]), mean(&losses[losses.len() - 50..]));
    assert!(
        last < plateau - 0.5,
        "loss {plateau:.3} over steps 30-80, {last:.3} over the last 50"
    );
    // One model: the ranks' ledger lines of one step name one digest.
    let mut by_step = std::collections::HashMap::new();
    for l in run.ledgers() {
        let d = by_step.entry(l.step).or_insert_with(|| l.digest.clone());
        assert_eq!(*d, l.digest, "step {}", l.step);
    }

    let json = run.dir.join("eval.json");
    let drafter = run.run_dir().join("drafter");
    let eval = spawn(
        &launcher,
        &[
            "eval",
            "--model",
            m_arg,
            "--drafter",
            drafter.to_str().unwrap(),
            "--baseline",
            "--json",
            json.to_str().unwrap(),
        ],
    )
    .watchdog(long)
    .finish();
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let tau = |who: &str| {
        assert_eq!(r[who]["matches_greedy"], true, "{who}: {eval}");
        r[who]["mean_acceptance_length"].as_f64().unwrap()
    };
    let (trained, untrained) = (tau("trained"), tau("untrained"));
    assert!(
        trained > 2.0 && trained > untrained + 0.5,
        "trained {trained:.2}, untrained {untrained:.2}: {eval}"
    );
}

/// `launcher make-model` with `args`: its exit status and stderr.
fn make_model_cli(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut all = vec!["make-model"];
    all.extend_from_slice(args);
    spawn(&workspace_bin("launcher"), &all).wait_status_keep()
}

/// Bad training flags are refused before any work and leave no directory: a --train-* flag
/// without --train is a usage error (it was ignored), and a --train-len past the model's
/// positions is named with its bound (it aborted after 14 s, leaving an empty directory).
#[test]
fn make_model_refuses_bad_training_flags_before_any_work() {
    let dir = TestDir::new("mkflags");
    let m = dir.path("m");
    let m_arg = m.to_str().unwrap();
    let (status, err) = make_model_cli(&[m_arg, "--train-steps", "5"]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("--train"), "{err}");
    let (status, err) = make_model_cli(&[m_arg, "--train", "--train-len", "40000"]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("--train-len 40000 is past the model's max_position_embeddings, 32768"),
        "{err}"
    );
    assert!(!m.exists(), "{} was made", m.display());
}

/// Without --force the model goes to a new or empty directory: a directory of other files, or
/// a link, is refused and left alone (before, the model was written into it, through its
/// links). The link here points into the test's own directory.
#[test]
fn make_model_without_force_refuses_a_directory_in_use() {
    let dir = TestDir::new("mkinuse");
    let d = dir.path("d");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("notes.txt"), "mine").unwrap();
    let (status, err) = make_model_cli(&[d.to_str().unwrap(), "--layers", "1"]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("is not empty (it holds notes.txt)"), "{err}");
    let link = dir.path("link");
    std::os::unix::fs::symlink(&d, &link).unwrap();
    let (status, err) = make_model_cli(&[link.to_str().unwrap(), "--layers", "1"]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("is a symbolic link; pass --force"), "{err}");
    let names: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["notes.txt"]);
    // An empty directory is filled.
    let empty = dir.path("empty");
    std::fs::create_dir(&empty).unwrap();
    let (status, err) = make_model_cli(&[empty.to_str().unwrap(), "--layers", "1"]);
    assert!(status.success(), "{err}");
    assert!(empty.join("config.json").is_file());
}

/// A stop signal while make-model trains ends it (by the signal: nothing is on disk yet) and
/// leaves neither the directory nor a temporary beside it. Before, it left an empty directory.
#[test]
fn make_model_stopped_while_training_leaves_nothing() {
    use std::os::unix::process::ExitStatusExt;
    let dir = TestDir::new("mkstop");
    let m = dir.path("m");
    let mut p = spawn(
        &workspace_bin("launcher"),
        &[
            "make-model",
            m.to_str().unwrap(),
            "--layers",
            "1",
            "--train",
            "--train-steps",
            "1000000",
        ],
    );
    p.line_starting("train: step 1/");
    crate::launcher::kill(p.child.id(), rustix::process::Signal::TERM);
    let (status, err) = p.wait_status_keep();
    assert_eq!(status.signal(), Some(15), "{status}: {err}");
    let left: Vec<_> = std::fs::read_dir(dir.path(""))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A 2-layer model in `dir/m` and an untrained drafter of it in `dir/drafter`.
fn model_and_untrained_drafter(dir: &TestDir) -> (PathBuf, PathBuf) {
    let m = dir.path("m");
    let spec = MakeSpec {
        layers: 2,
        ..MakeSpec::default()
    };
    make_model(&m, &spec).unwrap();
    let drafter = untrained_drafter(&m, &dir.path("drafter"));
    (m, drafter)
}

/// An untrained DFlash drafter (block 8, one layer) of the 2-layer model in `m`, exported to
/// `to`.
fn untrained_drafter(m: &Path, to: &Path) -> PathBuf {
    use model::dflash::{mask_token_id, Dflash, DflashConfig, Frozen};
    let arch = model::ArchConfig::load(m).unwrap();
    let mask = mask_token_id(m, arch.vocab_size, None).unwrap();
    let cfg = DflashConfig::for_target(&arch, vec![0, 1], Some(1), 8, mask);
    Dflash::new(cfg, Frozen::load(m, &Device::Cpu).unwrap(), 0)
        .unwrap()
        .export(to)
        .unwrap();
    to.to_path_buf()
}

/// An export's weights are as readable as its config (0666 less the umask): safetensors wrote
/// them 0600, which a server running as another user could not load.
#[test]
fn an_exports_weights_are_as_readable_as_its_config() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TestDir::new("mmode");
    let (_, drafter) = model_and_untrained_drafter(&dir);
    let mode = |f: &str| {
        let m = std::fs::metadata(drafter.join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        format!("{m:o}")
    };
    assert_eq!(mode("model.safetensors"), mode("config.json"));
    assert_ne!(
        mode("config.json"),
        "600",
        "the test's umask hides the difference"
    );
}

/// A target that computes NaN or infinities is an error naming the model and where it went
/// wrong, for `capture` and `eval` alike, and a config.json with a negative `rms_norm_eps` (the
/// usual cause) is refused by its field. Before, capture wrote all-NaN states and greedy tokens
/// of 0 (exit 0), and eval scored any drafter as perfect (8.00 tokens per target forward,
/// "output equals the target's greedy output", exit 0).
#[test]
fn a_target_computing_nan_is_an_error_of_capture_and_eval_not_a_perfect_score() {
    let dir = TestDir::new("mnan");
    let (m, drafter) = model_and_untrained_drafter(&dir);

    // Layer 1's down projection all infinities (bf16 0x7f80).
    let inf = broken_weights(&m, &dir.path("inf"), |name, (dtype, shape, data)| {
        if name != "model.layers.1.mlp.down_proj.weight" {
            return Some((dtype, shape, data));
        }
        assert_eq!(dtype, safetensors::Dtype::BF16);
        let data = data
            .chunks(2)
            .flat_map(|_| 0x7f80u16.to_le_bytes())
            .collect();
        Some((dtype, shape, data))
    });
    // The same weights with RMSNorm's epsilon negative.
    let eps = broken_weights(&m, &dir.path("eps"), |_, t| Some(t));
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(eps.join("config.json")).unwrap()).unwrap();
    c["rms_norm_eps"] = (-1).into();
    std::fs::write(eps.join("config.json"), c.to_string()).unwrap();

    let launcher = |args: &[&str]| {
        let (status, out, p) = spawn(&workspace_bin("launcher"), args).finish_status();
        // The stderr thread's last lines.
        std::thread::sleep(Duration::from_millis(100));
        (status.code(), format!("{out}{}", p.stderr()))
    };
    for (model, want) in [
        (&inf, "NaN or infinite values in decoder layer 1's output"),
        (&eps, "rms_norm_eps = -1: must be a positive number"),
    ] {
        let out = dir.path(&format!(
            "caps-{}",
            model.file_name().unwrap().to_str().unwrap()
        ));
        let (code, said) = launcher(&[
            "capture",
            "--model",
            model.to_str().unwrap(),
            "--synthetic",
            "2",
            "--layers",
            "0,1",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, Some(1), "{said}");
        assert!(
            said.contains(want) && said.contains(model.to_str().unwrap()),
            "{said}"
        );
        assert!(!out.join("index.json").exists(), "{said}");
        let json = dir.path("eval.json");
        let (code, said) = launcher(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--drafter",
            drafter.to_str().unwrap(),
            "--prompts",
            "1",
            "--prompt-len",
            "8",
            "--max-new-tokens",
            "4",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert_eq!(code, Some(1), "{said}");
        assert!(
            said.contains(want) && said.contains(model.to_str().unwrap()),
            "{said}"
        );
        assert!(!said.contains("mean acceptance length"), "{said}");
        assert!(!json.exists(), "{said}");
    }
}

/// A stop signal ends `capture` and `eval` between samples or prompts, or while their `--data`
/// is prepared: exit 130 and a line saying what was stopped, nothing partial in the data cache,
/// capture's output directory removed (or, given empty, left empty), eval's `--json` unwritten
/// and the directories eval made for it removed (they were left, empty). Before, both died of
/// the signal: capture left shards without an index in a directory a
/// re-run refused as not empty, and a preparation its `.tmp` in the cache. The work cannot end
/// first (100000 samples, prompts or JSONL lines); where the stop lands (the preparation or
/// after it) both outcomes are checked the same.
#[test]
fn a_stop_signal_ends_capture_and_eval_with_130_leaving_nothing() {
    use rustix::process::Signal;
    let dir = TestDir::new("mstop");
    let (m, drafter) = model_and_untrained_drafter(&dir);
    let lines: String = (0..100_000u32)
        .map(|i| {
            let ids: Vec<u32> = (0..48).map(|k| (i * 7 + k * 13) % 1000).collect();
            format!("{{\"input_ids\": {ids:?}}}\n")
        })
        .collect();
    let big = dir.path("big.jsonl");
    std::fs::write(&big, lines).unwrap();
    let cache = dir.path("cache");
    let empty = dir.path("given-empty");
    std::fs::create_dir(&empty).unwrap();
    // In directories eval makes for it.
    let json = dir.path("evals").join("new").join("eval.json");
    let (m, big, cache) = (
        m.to_str().unwrap(),
        big.to_str().unwrap(),
        cache.to_str().unwrap(),
    );
    let new_out = dir.path("caps");
    let (new_out_s, empty_s) = (new_out.to_str().unwrap(), empty.to_str().unwrap());
    let runs: Vec<(Vec<&str>, Signal)> = vec![
        (
            vec![
                "capture",
                "--model",
                m,
                "--synthetic",
                "100000",
                "--layers",
                "0,1",
                "-o",
                new_out_s,
            ],
            Signal::TERM,
        ),
        (
            vec![
                "capture",
                "--model",
                m,
                "--data",
                big,
                "--data-cache",
                cache,
                "--layers",
                "0,1",
                "-o",
                empty_s,
            ],
            Signal::INT,
        ),
        (
            vec![
                "eval",
                "--model",
                m,
                "--drafter",
                drafter.to_str().unwrap(),
                "--prompts",
                "100000",
                "--prompt-len",
                "8",
                "--max-new-tokens",
                "8",
                "--json",
                json.to_str().unwrap(),
            ],
            Signal::HUP,
        ),
    ];
    for (args, signal) in runs {
        let p = spawn(&workspace_bin("launcher"), &args);
        let pid = p.child.id();
        let t0 = Instant::now();
        while !crate::support::catches_sigterm(pid) {
            assert!(t0.elapsed() < WATCHDOG, "{args:?} never caught SIGTERM");
            std::thread::sleep(Duration::from_millis(2));
        }
        crate::launcher::kill(pid, signal);
        let (status, out, p) = p.finish_status();
        std::thread::sleep(Duration::from_millis(100));
        let said = format!("{out}{}", p.stderr());
        assert_eq!(status.code(), Some(130), "{args:?}: {status}\n{said}");
        assert!(said.contains("stopped by SIG"), "{args:?}: {said}");
        assert!(
            !said.contains("error:") && !said.contains("panicked"),
            "{said}"
        );
        eprintln!("{}: {}", args[0], said.lines().last().unwrap_or(""));
    }
    assert!(!new_out.exists(), "capture's new output directory is left");
    let left: Vec<_> = std::fs::read_dir(&empty).unwrap().collect();
    assert!(
        left.is_empty(),
        "capture left {left:?} in the directory given empty"
    );
    assert!(!json.exists(), "eval wrote --json");
    assert!(
        !dir.path("evals").exists(),
        "eval left the directories it made for --json"
    );
    let partial: Vec<_> = std::fs::read_dir(cache)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        partial
            .iter()
            .all(|n| !n.to_string_lossy().ends_with(".tmp")),
        "a partial preparation is left in the cache: {partial:?}"
    );
}

/// `launcher` with `args`: its exit code, and what it printed (stdout, then stderr).
fn launcher_said(args: &[&str]) -> (Option<i32>, String) {
    let (status, out, p) = spawn(&workspace_bin("launcher"), args).finish_status();
    // The stderr thread's last lines.
    std::thread::sleep(Duration::from_millis(100));
    (status.code(), format!("{out}{}", p.stderr()))
}

/// `capture --model DIR --data` of texts, where DIR has no tokenizer.json, names DIR and what
/// it lacks, and what to do. Before, it said to name a tokenizer's directory "with --model DIR",
/// which the user had done.
#[test]
fn capture_of_texts_with_a_model_without_a_tokenizer_says_the_model_lacks_one() {
    let dir = TestDir::new("mnotok");
    let m = dir.path("m");
    make_model(&m, &MakeSpec::default()).unwrap();
    std::fs::remove_file(m.join("tokenizer.json")).unwrap();
    let texts = dir.path("texts.jsonl");
    std::fs::write(&texts, "{\"text\": \"hello there\"}\n").unwrap();
    let out = dir.path("caps");
    let (code, said) = launcher_said(&[
        "capture",
        "--model",
        m.to_str().unwrap(),
        "--data",
        texts.to_str().unwrap(),
        "--data-cache",
        dir.path("cache").to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{said}");
    let lacks = format!("the model directory {} has no tokenizer.json", m.display());
    assert!(
        said.contains("texts.jsonl:1: ")
            && said.contains(&lacks)
            && said.contains("copy the target's tokenizer.json")
            && !said.contains("--model DIR"),
        "{said}"
    );
    assert!(!out.exists(), "{said}");
}

/// `eval --data`: a token id outside the target's vocabulary is named with its file and sample
/// (it named the sample alone), and data with fewer samples than `--prompts` says how many it
/// decodes, on stderr and in `--json` (it decoded fewer without a word).
#[test]
fn eval_data_names_its_file_and_says_when_it_has_fewer_prompts_than_asked() {
    let dir = TestDir::new("mevdata");
    let (m, drafter) = model_and_untrained_drafter(&dir);
    let (m, drafter) = (m.to_str().unwrap(), drafter.to_str().unwrap());
    // In the test's directory: eval prepares --data into runs/data-cache there.
    let eval_with = |data: &Path, more: &[&str]| {
        let mut args = vec!["eval", "--model", m, "--drafter", drafter, "--data"];
        args.push(data.to_str().unwrap());
        args.extend_from_slice(more);
        crate::launcher::launch_in(&dir, &args)
    };
    let eval = |data: &Path, json: &Path| {
        let json = json.to_str().unwrap();
        let short = [
            "--prompts",
            "5",
            "--prompt-len",
            "8",
            "--max-new-tokens",
            "2",
        ];
        eval_with(data, &[&short[..], &["--json", json]].concat())
    };
    let foreign = dir.path("foreign.jsonl");
    std::fs::write(
        &foreign,
        "{\"input_ids\": [1, 2, 3, 4]}\n{\"input_ids\": [5, 6, 5000, 7]}\n",
    )
    .unwrap();
    let json = dir.path("foreign.json");
    let (code, said) = eval(&foreign, &json);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(&format!(
            "{}: sample 1: token id 5000 at position 2 is outside the target's vocabulary of 1024",
            foreign.display()
        )),
        "{said}"
    );
    assert!(!json.exists(), "{said}");
    let two = dir.path("two.jsonl");
    std::fs::write(
        &two,
        "{\"input_ids\": [1, 2, 3, 4]}\n{\"input_ids\": [5, 6, 7, 8, 9]}\n",
    )
    .unwrap();
    let json = dir.path("two.json");
    let (code, said) = eval(&two, &json);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains(&format!(
            "eval: {} holds 2 samples to prompt with, fewer than --prompts 5: decoding 2",
            two.display()
        )),
        "{said}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        (&report["prompts"], &report["prompts_asked"]),
        (&2.into(), &5.into()),
        "{report}"
    );
    // Prepared into runs/data-cache by default, into --data-cache's directory when given (a
    // run's own, to reuse what its launch prepared).
    let prepared_in = |d: &Path| {
        std::fs::read_dir(d).map_or(0, |e| {
            e.filter(|e| e.as_ref().unwrap().path().extension() == Some("arrow".as_ref()))
                .count()
        })
    };
    assert_eq!(
        prepared_in(&dir.path("runs/data-cache")),
        2,
        "foreign and two"
    );
    let cache = dir.path("my-cache");
    let more = [
        "--max-new-tokens",
        "2",
        "--data-cache",
        cache.to_str().unwrap(),
    ];
    let (code, said) = eval_with(&two, &more);
    assert_eq!(code, Some(0), "{said}");
    assert_eq!(prepared_in(&cache), 1, "{said}");
    // With a run's --config, its max_len keys the data as the run's launch keyed it: the file
    // that launch prepared is found, not the whole input prepared again for a few prompts.
    let run_cfg = dir.path("run.toml");
    std::fs::write(&run_cfg, "[data]\nmax_len = 64\n").unwrap();
    let run_cache = dir.path("run-cache");
    let (run_cfg, run_cache) = (run_cfg.to_str().unwrap(), run_cache.to_str().unwrap());
    let (code, said) = crate::launcher::launch_in(
        &dir,
        &[
            "prepare",
            two.to_str().unwrap(),
            "--model",
            m,
            "--config",
            run_cfg,
            "--data-cache",
            run_cache,
        ],
    );
    assert_eq!(code, Some(0), "{said}");
    let (code, said) = eval_with(
        &two,
        &[
            "--max-new-tokens",
            "2",
            "--config",
            run_cfg,
            "--data-cache",
            run_cache,
        ],
    );
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("was prepared before"), "{said}");
    assert_eq!(prepared_in(Path::new(run_cache)), 1, "{said}");
    // `--config` (a run's config.toml): its [data] chat options prepare the prompts, here its
    // tokenizer directory, which has none (before, eval had no --config: a run's system prompt,
    // thinking option and template date were not the prompts').
    let elsewhere = dir.path("no-tokenizer");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let cfg = dir.path("run-config.toml");
    std::fs::write(
        &cfg,
        format!("[data]\ntokenizer = {:?}\n", elsewhere.to_str().unwrap()),
    )
    .unwrap();
    let chats = dir.path("chats.jsonl");
    std::fs::write(
        &chats,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n",
    )
    .unwrap();
    let (code, said) = eval_with(&chats, &["--config", cfg.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains(elsewhere.to_str().unwrap()), "{said}");
}
