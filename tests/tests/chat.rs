//! Conversations: our ids and masks equal transformers' `apply_chat_template(...,
//! return_assistant_tokens_mask=True)` for a Qwen-style and a Llama-3-style template, with
//! `{% generation %}` blocks and by markers, under every option; bad records are named and
//! nothing is prepared; too-long samples are dropped or cut and counted; the cache key follows
//! the tokenizer, template and options.
//!
//! The tokenizer, model directories, records and expected outputs come from
//! `tests/py/chat_oracle.py`, run with the tests' Python (transformers and tokenizers from PyPI,
//! no torch: `scripts/test.sh` installs them).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use dataset::{Chat, ChatOptions, Mapped, Options, TooLong};
use serde_json::Value;

use crate::support::TestDir;

/// The tests' Python, with transformers; panics saying how to get it.
fn python() -> String {
    let py = crate::data::python();
    let ok = Command::new(&py)
        .args(["-c", "import transformers, tokenizers"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "the conversation tests need transformers and tokenizers in {py}: run scripts/test.sh, which installs scripts/py/requirements.txt into .venv"
    );
    py
}

/// Makes the oracle's files in `dir` (once per test).
fn oracle(dir: &Path) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/py/chat_oracle.py");
    let out = Command::new(python())
        .arg(script)
        .arg("make")
        .arg(dir)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chat_oracle.py make failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

fn options(name: &str) -> ChatOptions {
    let mut o = ChatOptions::default();
    match name {
        "default" => {}
        "thinking-off" => o.enable_thinking = Some(false),
        "thinking-on" => o.enable_thinking = Some(true),
        "last-turn" => o.train_only_last_turn = true,
        "system" => o.system_prompt = Some("You are terse.".into()),
        other => panic!("no option set {other}"),
    }
    o
}

fn chat(model: &Path, o: ChatOptions) -> Arc<Chat> {
    Arc::new(Chat::load(model, o).unwrap())
}

fn prepare(
    input: &Path,
    chat: Option<Arc<Chat>>,
    max_len: u32,
    too_long: TooLong,
    cache: &Path,
) -> Result<dataset::Prepared, dataset::DataError> {
    let o = Options {
        max_len,
        too_long,
        chat,
    };
    dataset::prepare_with(input, &o, cache, None, &mut |_| {})
}

type Sample = (Vec<u32>, Vec<u8>);

fn read(path: &Path) -> Vec<Sample> {
    let m = Mapped::open(path).unwrap();
    (0..m.len())
        .map(|i| {
            let s = m.sample(i).unwrap();
            (s.input_ids.to_vec(), s.loss_mask.unwrap().to_vec())
        })
        .collect()
}

fn expected(v: &Value, key: &str) -> Vec<Sample> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no expected {key}"))
        .iter()
        .map(|s| serde_json::from_value::<(Vec<u32>, Vec<u8>)>(
            serde_json::json!([s["input_ids"], s["loss_mask"]]),
        ).unwrap())
        .collect()
}

#[test]
fn our_ids_and_masks_equal_transformers_for_qwen_and_llama_templates_under_every_option() {
    let d = TestDir::new("chat-oracle");
    let want = oracle(&d);
    let records = d.path("records.jsonl");
    let sets: &[(&str, &[&str])] = &[
        ("qwen", &["default", "thinking-off", "thinking-on", "last-turn", "system"]),
        ("llama", &["default", "last-turn", "system"]),
    ];
    for (model, opts) in sets {
        for dir in [model.to_string(), format!("{model}-markers")] {
            for opt in *opts {
                let c = chat(&d.path(&dir), options(opt));
                assert_eq!(c.markers().is_some(), dir.ends_with("-markers"), "{dir}");
                let p = prepare(&records, Some(c), 4096, TooLong::Drop, &d.path("cache")).unwrap();
                let got = read(&p.path);
                let exp = expected(&want, &format!("{model}/{opt}"));
                assert_eq!(got.len(), exp.len(), "{dir} {opt}: samples");
                for (i, (g, e)) in got.iter().zip(&exp).enumerate() {
                    assert_eq!(g.0, e.0, "{dir} {opt}: sample {i}'s ids");
                    assert_eq!(g.1, e.1, "{dir} {opt}: sample {i}'s mask");
                }
                let s = p.chat.unwrap();
                // 11 records; the one without an assistant turn has nothing to train.
                assert_eq!((s.conversations, s.dropped_untrained), (11, 1), "{dir} {opt}");
                let trained: u64 = exp.iter().map(|e| e.1.iter().map(|&b| u64::from(b)).sum::<u64>()).sum();
                assert_eq!(s.trained_tokens, trained, "{dir} {opt}");
                let turns = if *opt == "last-turn" { 10 } else { 14 };
                assert_eq!(s.turns, turns, "{dir} {opt}: assistant turns trained");
            }
        }
    }
}

/// `n` conversations in the words of the made model's corpus: multi-turn, with and without a
/// system message, ShareGPT keys, thinking.
fn chats(n: usize) -> String {
    let words = ["the", "river", "city", "house", "left", "water", "light", "small"];
    let say = |i: usize, k: usize| -> String {
        (0..3 + (i + k) % 5)
            .map(|j| words[(i * 7 + k * 3 + j) % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    (0..n)
        .map(|i| {
            let v = match i % 3 {
                0 => serde_json::json!({"messages": [
                    {"role": "user", "content": say(i, 0)},
                    {"role": "assistant", "content": say(i, 1)}]}),
                1 => serde_json::json!({"conversations": [
                    {"from": "system", "value": say(i, 2)},
                    {"from": "human", "value": say(i, 0)},
                    {"from": "gpt", "value": say(i, 1)},
                    {"from": "human", "value": say(i, 3)},
                    {"from": "gpt", "value": say(i, 4)}]}),
                _ => serde_json::json!({"messages": [
                    {"role": "user", "content": say(i, 0)},
                    {"role": "assistant", "content": format!("<think>{}</think>{}", say(i, 5), say(i, 1))}]}),
            };
            v.to_string() + "\n"
        })
        .collect()
}

/// Every sample of a run trained exactly once, by the ledgers.
fn every_sample_once(run: &crate::launcher::Run, samples: u64) {
    let mut counts = std::collections::BTreeMap::new();
    for l in run.ledgers() {
        for id in l.sample_ids {
            *counts.entry(id).or_insert(0u32) += 1;
        }
    }
    assert_eq!(counts.len() as u64, samples, "every sample trained");
    assert!(counts.values().all(|&c| c == 1), "none twice");
}

#[test]
fn the_launcher_trains_from_conversations_on_the_mock_backend_with_the_models_tokenizer() {
    let run = crate::launcher::Run::new("chat-mock");
    let m = crate::model::tiny(&run.dir);
    let data = run.dir.path("chats.jsonl");
    std::fs::write(&data, chats(90)).unwrap();
    let cfg = run.dir.path("mock.toml");
    std::fs::write(
        &cfg,
        format!(
            "[ring]\nslots = 24\nmin_ready = 4\n[model]\nlayers = 2\nhidden = 16\n[data]\nmin_len = 8\nmax_len = 512\ntokenizer = \"{}\"\n[target]\ntoken_budget = 1024\ntokens_per_s = 400000.0\n[drafter]\ntokens_per_s = 400000.0\n",
            m.display()
        ),
    )
    .unwrap();
    let out = run
        .launch(&cfg, &["--backend", "mock", "--data", data.to_str().unwrap()])
        .finish();
    assert!(
        out.contains("90 samples") && out.contains("90 conversations (120 assistant turns trained)"),
        "{out}"
    );
    assert_eq!(run.summary()["ok"], true);
    every_sample_once(&run, 90);
}

#[test]
fn the_launcher_trains_the_real_tiny_target_from_conversations_through_its_chat_template() {
    let run = crate::launcher::Run::new("chat-candle");
    let m = run.dir.path("tiny");
    let made = crate::support::spawn(
        &crate::support::workspace_bin("launcher"),
        &["make-model", m.to_str().unwrap()],
    )
    .finish();
    assert!(made.contains("qwen3"), "{made}");
    let data = run.dir.path("chats.jsonl");
    std::fs::write(&data, chats(30)).unwrap();
    let cfg = run.dir.path("candle.toml");
    std::fs::write(
        &cfg,
        format!(
            "[ring]\nslots = 16\nmin_ready = 2\n[model]\npath = \"{}\"\n[data]\nmin_len = 8\nmax_len = 96\n[target]\ntoken_budget = 384\n[drafter]\ntokens_per_s = 2000000.0\n[dflash]\nblock_size = 8\nnum_anchors = 8\nlayers = 1\n",
            m.display()
        ),
    )
    .unwrap();
    let out = run
        .launch(
            &cfg,
            &["--model", m.to_str().unwrap(), "--data", data.to_str().unwrap()],
        )
        .finish();
    assert!(out.contains("backend candle"), "{out}");
    assert!(out.contains("30 conversations (40 assistant turns trained)"), "{out}");
    assert_eq!(run.summary()["ok"], true);
    every_sample_once(&run, 30);
}
