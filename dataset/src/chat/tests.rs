//! `Chat::load` on small model directories written by the tests: what a directory's files
//! change about the samples, and what they must not.

use std::path::{Path, PathBuf};

use super::{Chat, ChatOptions, Message};

mod long;
mod tools;

/// A model directory removed at the end of the test (kept when it fails, to look at).
struct ModelDir(PathBuf);

impl ModelDir {
    fn new(tag: &str) -> ModelDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("hspipe-chat-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        ModelDir(d)
    }
    fn file(&self, name: &str, text: &str) -> &ModelDir {
        std::fs::write(self.0.join(name), text).unwrap();
        self
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

const WORDS: &[&str] = &[
    "[UNK]",
    "[PAD]",
    "user",
    "assistant",
    "says",
    "end",
    "hello",
    "there",
    "how",
    "are",
    "you",
    "fine",
    "thanks",
    "tool",
    "weather",
    "time",
];

/// A word-level `tokenizer.json` (one token a word) saved with the given `truncation` and
/// `padding` (JSON, `null` for none).
fn tokenizer_json(truncation: &str, padding: &str) -> String {
    let vocab: Vec<String> = WORDS
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{w:?}: {i}"))
        .collect();
    format!(
        r#"{{"version": "1.0", "truncation": {truncation}, "padding": {padding},
  "added_tokens": [], "normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}},
  "post_processor": null, "decoder": null,
  "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
        vocab.join(", ")
    )
}

/// The assistant's words, and the " end" after them, are its generation span.
const TEMPLATE: &str = "{% for m in messages %}{{ m.role }} says {% if m.role == 'assistant' %}\
{% generation %}{{ m.content }} end{% endgeneration %}{% else %}{{ m.content }} end{% endif %} \
{% endfor %}";

fn model(tag: &str, truncation: &str, padding: &str) -> ModelDir {
    let d = ModelDir::new(tag);
    d.file("tokenizer.json", &tokenizer_json(truncation, padding))
        .file("chat_template.jinja", TEMPLATE);
    d
}

#[test]
fn a_tokenizer_saved_with_truncation_or_padding_neither_cuts_nor_pads_samples() {
    let conversation = [
        Message::new("user", "hello there how are you"),
        Message::new("assistant", "fine thanks"),
    ];
    let plain = model("plain", "null", "null");
    let truncating = model(
        "truncating",
        r#"{"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}"#,
        "null",
    );
    let padding = model(
        "padding",
        "null",
        r#"{"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 1, "pad_type_id": 0, "pad_token": "[PAD]"}"#,
    );
    let load = |d: &ModelDir| Chat::load(d.path(), ChatOptions::default()).unwrap();
    let want = load(&plain)
        .conversation(&conversation, None, usize::MAX)
        .unwrap();
    // user says hello there how are you end | assistant says [fine thanks end]
    assert_eq!(want.ids, [2, 4, 6, 7, 8, 9, 10, 5, 3, 4, 11, 12, 5]);
    assert_eq!(want.mask, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]);
    assert_eq!(want.turns, 1);
    let text = load(&plain).text("hello there how are you", 64).unwrap();
    assert_eq!(text, (vec![6, 7, 8, 9, 10], false));
    for d in [&truncating, &padding] {
        let chat = load(d);
        assert_eq!(
            chat.conversation(&conversation, None, usize::MAX).unwrap(),
            want,
            "{d:?}",
            d = d.0
        );
        assert_eq!(
            chat.text("hello there how are you", 64).unwrap(),
            text,
            "{d:?}",
            d = d.0
        );
    }
}

/// A JSONL file of `lines` prepared with the tokenizer of `dir`: the samples, or the error.
fn prepare(dir: &ModelDir, name: &str, lines: &str) -> Result<Vec<Vec<u32>>, String> {
    prepare_bytes(dir, name, lines.as_bytes())
}

/// A file of `bytes` named `name` (its format found as any input's) prepared with the
/// tokenizer of `dir`: the samples, or the error.
fn prepare_bytes(dir: &ModelDir, name: &str, bytes: &[u8]) -> Result<Vec<Vec<u32>>, String> {
    let input = dir.0.join(name);
    std::fs::write(&input, bytes).unwrap();
    let chat = Chat::load(dir.path(), ChatOptions::default()).map_err(|e| e.to_string())?;
    let options = crate::Options {
        chat: Some(std::sync::Arc::new(chat)),
        ..crate::Options::new(64)
    };
    let out = dir.0.join(format!("{name}.arrow"));
    crate::prepare_with(
        &input,
        &options,
        &dir.0.join("cache"),
        Some(&out),
        &mut crate::quiet,
    )
    .map_err(|e| e.to_string())?;
    let m = crate::Mapped::open(&out).unwrap();
    Ok((0..m.len())
        .map(|i| m.sample(i).unwrap().input_ids.to_vec())
        .collect())
}

const IDS: &str = "{\"input_ids\": [1, 2, 3]}\n";
const TEXT: &str = "{\"text\": \"hello there\"}\n";
const CONVERSATION: &str = "{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}, \
{\"role\": \"assistant\", \"content\": \"fine\"}]}\n";

#[test]
fn without_a_usable_template_ids_and_texts_are_prepared_and_conversations_say_why_not() {
    // A base model: a tokenizer and no template.
    let base = ModelDir::new("base");
    base.file("tokenizer.json", &tokenizer_json("null", "null"));
    // A template in which nothing opens an assistant turn: the user's text runs into it.
    let unmarked = model("unmarked", "null", "null");
    unmarked.file(
        "chat_template.jinja",
        "{% for m in messages %}{% if m.role == 'user' %}<u> {{ m.content }}\
         {% else %}{{ m.content }} end{% endif %}{% endfor %}",
    );
    // A template that does not parse.
    let broken = model("broken", "null", "null");
    broken.file("chat_template.jinja", "{%} oops");
    for (d, why) in [
        (&base, "no chat template"),
        (&unmarked, "its assistant turns cannot be found by markers"),
        (&broken, "the chat template does not parse"),
    ] {
        assert_eq!(prepare(d, "ids.jsonl", IDS).unwrap(), [[1, 2, 3]]);
        assert_eq!(prepare(d, "text.jsonl", TEXT).unwrap(), [[6, 7]]);
        let e = prepare(d, "chats.jsonl", &format!("{IDS}{CONVERSATION}")).unwrap_err();
        assert!(e.contains("chats.jsonl:2: ") && e.contains(why), "{e}");
        let chat = Chat::load(d.path(), ChatOptions::default()).unwrap();
        let e = chat.template_error().unwrap().to_string();
        assert!(
            e.contains(why) && e.contains(&d.path().display().to_string()),
            "{e}"
        );
    }
    // A usable template prepares the conversation.
    let good = model("good", "null", "null");
    assert!(Chat::load(good.path(), ChatOptions::default())
        .unwrap()
        .template_error()
        .is_none());
    assert_eq!(
        prepare(&good, "chats.jsonl", CONVERSATION).unwrap(),
        [[2, 4, 6, 5, 3, 4, 11, 5]]
    );
}

/// `columns` as an Arrow IPC file and stream of two record batches (the second's dictionary
/// replacing the first's in the stream) and as a Parquet file: `(name, bytes)` of each.
fn containers(columns: Vec<(&str, arrow_array::ArrayRef)>) -> [(&'static str, Vec<u8>); 3] {
    let batch = arrow_array::RecordBatch::try_from_iter(columns).unwrap();
    let n = batch.num_rows();
    let halves = [batch.slice(0, n / 2), batch.slice(n / 2, n - n / 2)];
    let mut ipc = Vec::new();
    let mut w = arrow_ipc::writer::FileWriter::try_new(&mut ipc, &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    drop(w);
    let mut stream = Vec::new();
    let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut stream, &batch.schema()).unwrap();
    for h in &halves {
        w.write(h).unwrap();
    }
    w.finish().unwrap();
    drop(w);
    let mut pq = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut pq, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    [("arrow", ipc), ("arrows", stream), ("parquet", pq)]
}

#[test]
fn dictionary_encoded_roles_and_texts_prepare_as_plain_strings() {
    use arrow_array::types::{Int32Type, Int8Type};
    use arrow_array::{Array, ArrayRef, DictionaryArray, ListArray, StringArray, StructArray};
    use arrow_buffer::OffsetBuffer;
    use arrow_schema::{DataType, Field};
    use std::sync::Arc;

    let d = model("dictionary", "null", "null");
    let texts = ["hello there", "how are you", "hello there"];
    let lines: String = texts
        .iter()
        .map(|t| format!("{{\"text\": {t:?}}}\n"))
        .collect();
    let want_texts = prepare(&d, "texts.jsonl", &lines).unwrap();
    let want_chats = prepare(&d, "chats.jsonl", &CONVERSATION.repeat(2)).unwrap();

    // pandas' categorical role, as `pa.Table.from_pandas` keeps it: list<struct<role:
    // dictionary<int8, string>, content: string>>, one dictionary for every row's roles.
    let roles: DictionaryArray<Int8Type> = ["user", "assistant", "user", "assistant"]
        .into_iter()
        .collect();
    let role = Field::new("role", roles.data_type().clone(), true);
    let messages = StructArray::from(vec![
        (Arc::new(role), Arc::new(roles) as ArrayRef),
        (
            Arc::new(Field::new("content", DataType::Utf8, true)),
            Arc::new(StringArray::from(vec!["hello", "fine", "hello", "fine"])) as ArrayRef,
        ),
    ]);
    let item = Arc::new(Field::new("item", messages.data_type().clone(), true));
    let chats = ListArray::new(
        item,
        OffsetBuffer::from_lengths([2, 2]),
        Arc::new(messages),
        None,
    );
    let text: DictionaryArray<Int32Type> = texts.into_iter().collect();
    for (kind, bytes) in containers(vec![("messages", Arc::new(chats) as ArrayRef)]) {
        let got = prepare_bytes(&d, &format!("chats.{kind}"), &bytes);
        assert_eq!(got.unwrap(), want_chats, "{kind}");
    }
    for (kind, bytes) in containers(vec![("text", Arc::new(text) as ArrayRef)]) {
        let got = prepare_bytes(&d, &format!("texts.{kind}"), &bytes);
        assert_eq!(got.unwrap(), want_texts, "{kind}");
    }
}

/// A tokenizer.json, tokenizer_config.json or chat_template.jinja that is a FIFO is refused
/// before it is opened: `launcher prepare t.jsonl --model DIR` waited for a writer for ever.
#[test]
fn a_tokenizer_file_that_is_a_fifo_is_refused_without_opening_it() {
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let e = testkit::fifo_refusal(name, move |d| {
            if name != "tokenizer.json" {
                std::fs::write(d.join("tokenizer.json"), tokenizer_json("null", "null")).unwrap();
            }
            Chat::load(d, ChatOptions::default())
                .err()
                .map(|e| e.to_string())
        });
        assert!(e.contains(name) && e.contains("FIFO"), "{name}: {e}");
    }
}

/// A text or conversation far longer than the tokens wanted is tokenized a prefix at a time
/// (a 200 MB text aborted the process in the tokenizer): what comes back is the whole record's
/// first tokens and mask, and says there were more, wherever the wanted tokens end.
#[test]
fn a_long_record_gives_its_whole_tokenizations_first_tokens() {
    let d = model("long", "null", "null");
    let chat = Chat::load(d.path(), ChatOptions::default()).unwrap();
    // Past MIN_PREFIX (64 KiB) many times over: several prefixes are tokenized.
    let long = "hello there how are you ".repeat(20_000);
    let (whole, more) = chat.text(&long, usize::MAX).unwrap();
    assert!(!more);
    assert_eq!(whole.len(), 100_000);
    for want in [1, 10, 5_000, 99_999] {
        assert_eq!(
            chat.text(&long, want).unwrap(),
            (whole[..want].to_vec(), true),
            "{want}"
        );
    }
    assert_eq!(chat.text(&long, 100_000).unwrap(), (whole.clone(), false));
    // The assistant's long turn straddles the cut: the mask runs to the end of what is kept.
    let conversation = [
        Message::new("user", "hello there"),
        Message::new("assistant", &long),
        Message::new("user", "how are you"),
        Message::new("assistant", "fine thanks"),
    ];
    let whole = chat.conversation(&conversation, None, usize::MAX).unwrap();
    assert!(!whole.more && whole.turns == 2);
    // user says hello there end assistant says [hello ...: the long turn's span starts at 7.
    for want in [3, 7, 8, 7_000] {
        let cut = chat.conversation(&conversation, None, want).unwrap();
        assert_eq!(cut.ids, whole.ids[..want], "{want}");
        assert_eq!(cut.mask, whole.mask[..want], "{want}");
        assert!(cut.more, "{want}");
        // The turns that start in what is kept.
        assert_eq!(cut.turns, u32::from(want > 7), "{want}");
    }
}
