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
