//! Conversations: our ids and masks equal transformers' `apply_chat_template(...,
//! return_assistant_tokens_mask=True)` for a Qwen-style and a Llama-3-style template, with
//! `{% generation %}` blocks and by markers, under every option, with tools and without; bad
//! records are named and nothing is prepared; too-long samples are dropped or cut and counted;
//! the cache key follows the tokenizer, template and options.
//!
//! The tokenizer, model directories, records and expected outputs come from
//! `tests/py/chat_oracle.py`, run with the tests' Python (transformers and tokenizers from PyPI,
//! no torch: `scripts/test.sh` installs them).
//!
//! Length: one test per behaviour a user relies on (the oracle, the containers, tools, bad
//! records, too-long samples, the key, two end-to-end runs), each standing alone.

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
    run_oracle("make", dir);
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

/// Runs `chat_oracle.py COMMAND DIR`.
fn run_oracle(command: &str, dir: &Path) {
    run_oracle_with(command, dir, &[]);
}

/// [`run_oracle`] with more arguments.
fn run_oracle_with(command: &str, dir: &Path, args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/py/chat_oracle.py");
    let out = Command::new(python())
        .arg(script)
        .arg(command)
        .arg(dir)
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chat_oracle.py {command} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
        ..Options::default()
    };
    dataset::prepare_with(input, &o, cache, None, &mut dataset::quiet)
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
        .map(|s| {
            serde_json::from_value::<(Vec<u32>, Vec<u8>)>(serde_json::json!([
                s["input_ids"],
                s["loss_mask"]
            ]))
            .unwrap()
        })
        .collect()
}

#[test]
fn our_ids_and_masks_equal_transformers_for_qwen_and_llama_templates_under_every_option() {
    let d = TestDir::new("chat-oracle");
    let want = oracle(&d);
    let records = d.path("records.jsonl");
    let sets: &[(&str, &[&str])] = &[
        (
            "qwen",
            &[
                "default",
                "thinking-off",
                "thinking-on",
                "last-turn",
                "system",
            ],
        ),
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
                // 12 records; the one without an assistant turn has nothing to train.
                assert_eq!(
                    (s.conversations, s.dropped_untrained),
                    (12, 1),
                    "{dir} {opt}"
                );
                let trained: u64 = exp
                    .iter()
                    .map(|e| e.1.iter().map(|&b| u64::from(b)).sum::<u64>())
                    .sum();
                assert_eq!(s.trained_tokens, trained, "{dir} {opt}");
                let turns = if *opt == "last-turn" { 11 } else { 16 };
                assert_eq!(s.turns, turns, "{dir} {opt}: assistant turns trained");
            }
        }
    }
}

/// A template that dates its system prompt with `strftime_now` (as Llama 3.2's and Mistral
/// Small's do) renders the date transformers renders: `launcher prepare --model`'s ids and masks
/// under `data.template_date` equal transformers' with its clock at that time. Before, a
/// template calling `strftime_now` failed to render, and one testing `strftime_now is defined`
/// wrote its fallback date whatever the clock.
#[test]
fn a_template_that_writes_the_date_renders_the_date_transformers_renders() {
    let d = TestDir::new("chat-dated");
    // 2024-12-07 14:00 UTC, a Saturday: another day than the template's fallback 26 Jul 2024.
    run_oracle_with("dated", &d, &["1733580000"]);
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(d.path("expected.json")).unwrap()).unwrap();
    let cfg = d.path("dated.toml");
    std::fs::write(&cfg, "[data]\ntemplate_date = \"2024-12-07T14:00:00\"\n").unwrap();
    let out = d.path("dated.arrow");
    let p = Command::new(crate::support::workspace_bin("launcher"))
        .arg("prepare")
        .arg(d.path("dated.jsonl"))
        .arg("--model")
        .arg(d.path("dated"))
        .arg("--config")
        .arg(&cfg)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        p.status.success(),
        "launcher prepare failed:\n{}",
        String::from_utf8_lossy(&p.stderr)
    );
    let got = read(&out);
    let exp = expected(&want, "dated");
    assert_eq!(got.len(), exp.len(), "samples");
    for (i, (g, e)) in got.iter().zip(&exp).enumerate() {
        assert_eq!(g, e, "sample {i}");
    }
    // The oracle's text holds the date asked for: a wrong one would be other ids.
    let text = want["dated_text"].as_str().unwrap();
    assert!(
        text.contains("Today Date: 07 Dec 2024 (2024-12-07, a Saturday)"),
        "{text}"
    );
}

/// A Mistral-style template, whose user turns are not closed as its assistant turns are
/// (`[INST]...[/INST]`, then the answer and the end of sequence): with its `{% generation %}`
/// tags and without them (turns found by markers), our ids and masks equal transformers' with
/// the tags. Before, the markers were refused ("a user turn does not end with ...").
#[test]
fn a_mistral_style_templates_turns_are_found_with_and_without_its_tags() {
    let d = TestDir::new("chat-mistral");
    run_oracle_with("dated", &d, &["1733580000"]);
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(d.path("expected.json")).unwrap()).unwrap();
    let exp = expected(&want, "mistral");
    for dir in ["mistral", "mistral-markers"] {
        let c = chat(&d.path(dir), ChatOptions::default());
        assert_eq!(c.markers().is_some(), dir.ends_with("-markers"), "{dir}");
        let cache = d.path(&format!("cache-{dir}"));
        let p = prepare(&d.path("dated.jsonl"), Some(c), 4096, TooLong::Drop, &cache).unwrap();
        let got = read(&p.path);
        assert_eq!(got.len(), exp.len(), "{dir}: samples");
        for (i, (g, e)) in got.iter().zip(&exp).enumerate() {
            assert_eq!(g, e, "{dir}: sample {i}");
        }
    }
}

/// `n` conversations in the words of the made model's corpus: multi-turn, with and without a
/// system message, ShareGPT keys, thinking.
fn chats(n: usize) -> String {
    let words = [
        "the", "river", "city", "house", "left", "water", "light", "small",
    ];
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

/// Launches `run` on the mock backend over `data`, prepared with the tokenizer of model `m`
/// under `max_len`; returns what it printed (it must succeed).
fn launch_mock(run: &crate::launcher::Run, m: &Path, max_len: u32, data: &Path) -> String {
    let cfg = run.dir.path("mock.toml");
    std::fs::write(
        &cfg,
        format!(
            "[ring]\nslots = 24\nmin_ready = 4\n[model]\nlayers = 2\nhidden = 16\n[data]\nmin_len = 8\nmax_len = {max_len}\ntokenizer = \"{}\"\n[target]\ntoken_budget = 1024\ntokens_per_s = 400000.0\n[drafter]\ntokens_per_s = 400000.0\n",
            m.display()
        ),
    )
    .unwrap();
    run.launch(
        &cfg,
        &["--backend", "mock", "--data", data.to_str().unwrap()],
    )
    .finish()
}

#[test]
fn the_launcher_trains_from_conversations_on_the_mock_backend_with_the_models_tokenizer() {
    let run = crate::launcher::Run::new("chat-mock");
    let m = crate::model::tiny(&run.dir);
    let data = run.dir.path("chats.jsonl");
    std::fs::write(&data, chats(90)).unwrap();
    let out = launch_mock(&run, &m, 512, &data);
    assert!(
        out.contains("90 samples")
            && out.contains("90 conversations (120 assistant turns trained)"),
        "{out}"
    );
    assert_eq!(run.summary()["ok"], true);
    every_sample_once(&run, 90);
}

/// Records dropped at preparation (longer than max_len) are in no batch of the plan: the start
/// line names their lines, and the end says they were left out (a note in summary.json, the
/// counts in dataset.json). The end said `3/3 samples trained`, summary.json `notes: []` and
/// dataset.json nothing: the three records were lost from the record. The run is still `ok`:
/// it trained what it planned.
#[test]
fn records_dropped_at_preparation_are_named_at_the_start_and_in_the_ends_notes() {
    let run = crate::launcher::Run::new("chat-dropped");
    let m = crate::model::tiny(&run.dir);
    let data = run.dir.path("train.jsonl");
    let long = "the river ".repeat(40);
    let text: String = (0..6)
        .map(|i| {
            let answer = if i % 2 == 1 {
                long.as_str()
            } else {
                "the city"
            };
            serde_json::json!({"messages": [
                {"role": "user", "content": "the house"},
                {"role": "assistant", "content": answer}]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, text).unwrap();
    let out = launch_mock(&run, &m, 64, &data);
    assert!(
        out.contains("3 dropped: longer than data.max_len 64 (lines 2, 4, 6)"),
        "{out}"
    );
    let note = format!(
        "3 records of {} were dropped at preparation (longer than data.max_len 64; lines 2, 4, 6): not in the plan, so not trained",
        data.display()
    );
    assert!(
        out.contains(&format!("note: {note}")) && out.contains("exit code 0"),
        "{out}"
    );
    let s = run.summary();
    assert_eq!(
        (s["ok"].clone(), s["samples_total"].clone()),
        (true.into(), 3.into())
    );
    assert_eq!(s["notes"], serde_json::json!([note]), "{s}");
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(run.run_dir().join("dataset.json")).unwrap())
            .unwrap();
    assert_eq!(
        (
            record["dropped_too_long"].clone(),
            record["samples"].clone()
        ),
        (3.into(), 3.into()),
        "{record}"
    );
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
            &[
                "--model",
                m.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
            ],
        )
        .finish();
    assert!(out.contains("backend candle"), "{out}");
    assert!(
        out.contains("30 conversations (40 assistant turns trained)"),
        "{out}"
    );
    assert_eq!(run.summary()["ok"], true);
    every_sample_once(&run, 30);
}

fn arrow_files(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "arrow"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn conversations_in_parquet_arrow_and_a_datasets_directory_prepare_as_in_jsonl() {
    let d = TestDir::new("chat-containers");
    let want = oracle(&d);
    run_oracle("containers", &d);
    let exp = expected(&want, "qwen/default");
    let c = chat(&d.path("qwen"), ChatOptions::default());
    for input in ["chats.parquet", "chats.arrow", "chats.arrows", "chats_hf"] {
        let p = prepare(
            &d.path(input),
            Some(c.clone()),
            4096,
            TooLong::Drop,
            &d.path("cache"),
        )
        .unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(read(&p.path), exp, "{input}");
        assert_eq!(p.chat.unwrap().conversations, 12, "{input}");
    }
    // A pandas categorical `text` column, dictionary-encoded in the file.
    let e = &want["qwen/text"][0];
    let ids: Vec<u32> = serde_json::from_value(e["input_ids"].clone()).unwrap();
    let p = prepare(
        &d.path("texts_categorical.parquet"),
        Some(c.clone()),
        4096,
        TooLong::Drop,
        &d.path("cache"),
    )
    .unwrap();
    let n = ids.len();
    assert_eq!(read(&p.path), vec![(ids, vec![1; n]); 2]);
    let err = prepare(
        &d.path("bad_role.parquet"),
        Some(c),
        4096,
        TooLong::Drop,
        &d.path("cache2"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("bad_role.parquet: row 2: messages[0]: unknown role \"robot\""),
        "{err}"
    );
    assert!(
        arrow_files(&d.path("cache2")).is_empty(),
        "nothing prepared"
    );
}

/// A conversation's `tools` render as transformers' `apply_chat_template(messages,
/// tools=tools)` renders them, with a Qwen3-style template (a tools section in the system turn,
/// each tool `tojson`) and a Llama-3.1-style one (in the first user turn, `tojson(indent=4)`,
/// an empty list too), by generation tags and by markers, with and without a system prompt
/// added; from JSONL (a list, or a string of JSON), and from Parquet and an HF datasets
/// directory (a column of JSON strings, or of structs as pyarrow reads them back). Before,
/// `tools` was not read, and every one of these was prepared without its tools.
#[test]
fn a_conversations_tools_render_as_transformers_renders_them_from_every_container() {
    let d = TestDir::new("chat-tools");
    let want = oracle(&d);
    run_oracle("containers", &d);
    // The samples `input` is prepared into with the model directory `dir`.
    let samples = |input: &str, dir: &str, o: ChatOptions| {
        let p = prepare(
            &d.path(input),
            Some(chat(&d.path(dir), o)),
            4096,
            TooLong::Drop,
            &d.path("cache"),
        );
        read(&p.unwrap_or_else(|e| panic!("{input} with {dir}: {e}")).path)
    };
    for model in ["qwen", "llama"] {
        for dir in [model.to_string(), format!("{model}-markers")] {
            for opt in ["default", "system"] {
                let exp = expected(&want, &format!("{model}/tools/{opt}"));
                assert_eq!(exp.len(), 5, "every record has a sample");
                assert_eq!(
                    samples("tools.jsonl", &dir, options(opt)),
                    exp,
                    "{dir} {opt}"
                );
            }
        }
    }
    let containers: Value =
        serde_json::from_str(&std::fs::read_to_string(d.path("tools_expected.json")).unwrap())
            .unwrap();
    for input in [
        "tools_strings.parquet",
        "tools_structs.parquet",
        "tools_structs_hf",
    ] {
        let got = samples(input, "qwen", ChatOptions::default());
        assert_eq!(got, expected(&containers, input), "{input}");
    }
}

#[test]
fn a_text_record_is_tokenized_whole_and_trained_whole() {
    let d = TestDir::new("chat-text");
    let want = oracle(&d);
    for model in ["qwen", "llama"] {
        let e = &want[format!("{model}/text")][0];
        let input = d.path(&format!("{model}-text.jsonl"));
        std::fs::write(
            &input,
            serde_json::json!({"text": e["text"]}).to_string() + "\n",
        )
        .unwrap();
        let c = chat(&d.path(model), ChatOptions::default());
        let p = prepare(&input, Some(c), 4096, TooLong::Drop, &d.path("cache")).unwrap();
        let ids: Vec<u32> = serde_json::from_value(e["input_ids"].clone()).unwrap();
        let n = ids.len();
        assert_eq!(read(&p.path), vec![(ids, vec![1; n])], "{model}");
        assert_eq!(p.chat.unwrap().texts, 1);
    }
}

#[test]
fn every_bad_conversation_is_named_by_file_and_line_and_nothing_is_prepared() {
    let d = TestDir::new("chat-bad");
    oracle(&d);
    let good = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#;
    let cases = [
        (
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
            "messages[0]: unknown role \"robot\"",
        ),
        (
            r#"{"conversations": [{"from": "bot", "value": "x"}]}"#,
            "conversations[0]: unknown role \"bot\"",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "image"}]}]}"#,
            "messages[0]: content is a list of parts (multimodal)",
        ),
        (
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            "messages[0]: content is a number, not a string",
        ),
        (
            r#"{"messages": [{"role": "user"}]}"#,
            "messages[0]: no content",
        ),
        (
            r#"{"messages": [{"content": "x"}]}"#,
            "messages[0]: no role",
        ),
        (r#"{"messages": []}"#, "messages is an empty conversation"),
        (
            r#"{"conversations": {"from": "human"}}"#,
            "conversations is an object, not a list of messages",
        ),
        (r#"{"text": 7}"#, "text is a number, not a string"),
        (
            r#"{"id": 3}"#,
            "not a sample: it has none of input_ids, messages, conversations, text",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}"#,
            "the system message must come first",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"\u{FDD0}\"}]}",
            "hspipe reserves",
        ),
    ];
    let c = chat(&d.path("qwen"), ChatOptions::default());
    for (i, (bad, want)) in cases.iter().enumerate() {
        let input = d.path(&format!("bad{i}.jsonl"));
        std::fs::write(&input, format!("{good}\n\n{bad}\n{good}\n")).unwrap();
        let cache = d.path(&format!("cache{i}"));
        let err = prepare(&input, Some(c.clone()), 4096, TooLong::Drop, &cache)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("bad{i}.jsonl:3: ")) && err.contains(want),
            "{err:?} should name line 3 and say {want:?}"
        );
        assert!(arrow_files(&cache).is_empty(), "{bad}: nothing prepared");
    }
    // Conversations without a tokenizer: how to give one.
    let input = d.path("no_tokenizer.jsonl");
    std::fs::write(&input, format!("{good}\n")).unwrap();
    let err = prepare(&input, None, 4096, TooLong::Drop, &d.path("c"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no_tokenizer.jsonl:1: ") && err.contains("--model DIR or data.tokenizer"),
        "{err}"
    );
    // A model directory without a template, and a template that does not parse: the tokenizer
    // loads (texts and ids need nothing more), and each conversation says why it cannot be.
    let bare = d.path("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(d.path("qwen/tokenizer.json"), bare.join("tokenizer.json")).unwrap();
    let c = Chat::load(&bare, ChatOptions::default()).unwrap();
    let err = c.template_error().unwrap().to_string();
    assert!(err.contains("no chat template"), "{err}");
    let err = prepare(&input, Some(Arc::new(c)), 4096, TooLong::Drop, &d.path("c"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no_tokenizer.jsonl:1: ") && err.contains("no chat template"),
        "{err}"
    );
    std::fs::write(bare.join("chat_template.jinja"), "{% for m in messages %}").unwrap();
    let c = Chat::load(&bare, ChatOptions::default()).unwrap();
    let err = c.template_error().unwrap().to_string();
    assert!(err.contains("does not parse"), "{err}");
    let err = Chat::load(&d.path("nowhere"), ChatOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("nowhere/tokenizer.json"), "{err}");
}

#[test]
fn too_long_conversations_are_dropped_or_truncated_and_counted() {
    let d = TestDir::new("chat-long");
    let want = oracle(&d);
    let exp = expected(&want, "qwen/default");
    let records = d.path("records.jsonl");
    let max = 40;
    let c = chat(&d.path("qwen"), ChatOptions::default());
    let p = prepare(
        &records,
        Some(c.clone()),
        max,
        TooLong::Drop,
        &d.path("cache"),
    )
    .unwrap();
    let kept: Vec<Sample> = exp
        .iter()
        .filter(|e| e.0.len() <= max as usize)
        .cloned()
        .collect();
    assert!(
        !kept.is_empty() && kept.len() < exp.len(),
        "the set has both"
    );
    assert_eq!(read(&p.path), kept);
    let s = p.chat.unwrap();
    assert_eq!(
        (s.dropped_too_long, s.truncated),
        ((exp.len() - kept.len()) as u64, 0)
    );

    let p = prepare(&records, Some(c), max, TooLong::Truncate, &d.path("cache")).unwrap();
    let cut: Vec<Sample> = exp
        .iter()
        .map(|(i, m)| {
            (
                i[..i.len().min(max as usize)].to_vec(),
                m[..m.len().min(max as usize)].to_vec(),
            )
        })
        .filter(|(_, m)| m.contains(&1))
        .collect();
    assert_eq!(read(&p.path), cut);
    let s = p.chat.unwrap();
    assert_eq!(s.truncated, (exp.len() - kept.len()) as u64);
    assert_eq!(
        s.dropped_untrained,
        1 + (exp.len() - cut.len()) as u64,
        "cut to no assistant token: dropped"
    );
}

#[test]
fn the_cache_key_follows_the_tokenizer_the_template_and_every_option() {
    let d = TestDir::new("chat-key");
    oracle(&d);
    let records = d.path("records.jsonl");
    let cache = d.path("cache");
    let key = |model: &str, o: ChatOptions, too_long: TooLong| {
        let p = prepare(
            &records,
            Some(chat(&d.path(model), o)),
            4096,
            too_long,
            &cache,
        )
        .unwrap();
        (p.key, p.reused)
    };
    let (base, reused) = key("qwen", ChatOptions::default(), TooLong::Drop);
    assert!(!reused);
    assert_eq!(
        key("qwen", ChatOptions::default(), TooLong::Drop),
        (base.clone(), true)
    );
    let mut keys = std::collections::BTreeSet::from([base]);
    for (model, opt, too_long) in [
        ("qwen", "thinking-off", TooLong::Drop),
        ("qwen", "thinking-on", TooLong::Drop),
        ("qwen", "last-turn", TooLong::Drop),
        ("qwen", "system", TooLong::Drop),
        ("qwen", "default", TooLong::Truncate),
        ("qwen-markers", "default", TooLong::Drop),
        ("llama", "default", TooLong::Drop),
    ] {
        let (k, reused) = key(model, options(opt), too_long);
        assert!(!reused, "{model} {opt} {too_long:?}: prepared again");
        assert!(
            keys.insert(k),
            "{model} {opt} {too_long:?}: a key of its own"
        );
    }
    // Another tokenizer (the same with one merge less) with the same template.
    let other = d.path("qwen-other");
    std::fs::create_dir_all(&other).unwrap();
    for f in ["chat_template.jinja", "tokenizer_config.json"] {
        std::fs::copy(d.path("qwen").join(f), other.join(f)).unwrap();
    }
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(d.path("qwen/tokenizer.json")).unwrap())
            .unwrap();
    tok["model"]["merges"].as_array_mut().unwrap().pop();
    std::fs::write(other.join("tokenizer.json"), tok.to_string()).unwrap();
    let (k, reused) = key("qwen-other", ChatOptions::default(), TooLong::Drop);
    assert!(!reused && keys.insert(k), "another tokenizer: another key");
}

#[test]
fn the_prepared_file_is_the_same_on_one_thread_and_on_many_and_a_late_bad_line_is_named() {
    let d = TestDir::new("chat-threads");
    oracle(&d);
    // More records than one parallel chunk (4096), in the order written.
    let one: Vec<String> = std::fs::read_to_string(d.path("records.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let lines: Vec<&str> = (0..5000).map(|i| one[i % one.len()].as_str()).collect();
    let input = d.path("many.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let c = chat(&d.path("llama"), ChatOptions::default());
    let on = |threads: usize, out: &str| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let o = Options {
            max_len: 4096,
            too_long: TooLong::Drop,
            chat: Some(c.clone()),
            ..Options::default()
        };
        let out = d.path(out);
        pool.install(|| {
            dataset::prepare_with(
                &input,
                &o,
                &d.path("cache"),
                Some(&out),
                &mut dataset::quiet,
            )
        })
        .unwrap();
        std::fs::read(out).unwrap()
    };
    let (a, b) = (on(1, "one.arrow"), on(4, "four.arrow"));
    assert!(a == b, "the same bytes on 1 and 4 threads");
    let m = Mapped::open(&d.path("four.arrow")).unwrap();
    // Every 12th record has no assistant turn: dropped.
    assert_eq!(m.len(), (0..5000).filter(|i| i % 12 != 11).count() as u64);
    let mut bad = lines.clone();
    bad[4499] = r#"{"messages": [{"role": "narrator", "content": "x"}]}"#;
    std::fs::write(&input, bad.join("\n") + "\n").unwrap();
    let o = Options {
        max_len: 4096,
        too_long: TooLong::Drop,
        chat: Some(c),
        ..Options::default()
    };
    let err = dataset::prepare_with(&input, &o, &d.path("cache"), None, &mut dataset::quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("many.jsonl:4500: messages[0]: unknown role \"narrator\""),
        "{err}"
    );
}
