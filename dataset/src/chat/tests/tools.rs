//! A conversation's `tools` (its function definitions) through `Chat` on the tests' word-level
//! model: read from JSONL and from Arrow and Parquet rows, rendered by the template, refused
//! with the line or row and the field named when they are not tools; the key that keeps a cache
//! prepared without them from being reused.

use super::{containers, model, prepare, prepare_bytes, ModelDir, CONVERSATION, TEMPLATE};
use crate::chat::{Chat, ChatOptions};

/// A tools section that names each tool, as Qwen3's writes one into the system turn, before
/// `TEMPLATE`: `tool weather time end` for two tools, nothing without them.
const TOOLS_SECTION: &str =
    "{% if tools %}tool {% for t in tools %}{{ t.function.name }} {% endfor %}end {% endif %}";

/// Two function definitions, OpenAI's shape, as JSON.
const TOOLS: &str = r#"[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}, {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}]"#;

/// CONVERSATION's ids, after `tool weather time end` when it has the two tools.
const CONVERSATION_IDS: [u32; 8] = [2, 4, 6, 5, 3, 4, 11, 5];
const TOOLS_IDS: [u32; 4] = [13, 14, 15, 5];

fn with_tools(ids: &[u32]) -> Vec<u32> {
    TOOLS_IDS.iter().chain(ids).copied().collect()
}

fn tools_model(tag: &str) -> ModelDir {
    let d = model(tag, "null", "null");
    d.file("chat_template.jinja", &format!("{TOOLS_SECTION}{TEMPLATE}"));
    d
}

/// A conversation line with `tools` set to `tools` (JSON).
fn conversation_with(tools: &str) -> String {
    format!(
        "{{\"tools\": {tools}, {}",
        CONVERSATION.strip_prefix('{').unwrap().trim_end()
    )
}

/// A record's function definitions reach the template, as transformers'
/// `apply_chat_template(messages, tools=tools)` passes them: a list as it is, or a string of
/// JSON (as HF datasets store them) parsed. Without them, or with null or an empty string, there
/// is no tools section. Before, `tools` was not read: the target saw the conversation without
/// its tools, and the drafter trained on that.
#[test]
fn a_conversations_tools_reach_its_template_from_a_list_or_a_string_of_json() {
    let d = tools_model("tools");
    let string = serde_json::Value::String(TOOLS.into()).to_string();
    let lines = [
        conversation_with(TOOLS),
        conversation_with(&string),
        CONVERSATION.trim_end().to_string(),
        conversation_with("null"),
        conversation_with("\"\""),
    ];
    let got = prepare(&d, "tools.jsonl", &(lines.join("\n") + "\n")).unwrap();
    let plain = CONVERSATION_IDS.to_vec();
    assert_eq!(
        got,
        [
            with_tools(&CONVERSATION_IDS),
            with_tools(&CONVERSATION_IDS),
            plain.clone(),
            plain.clone(),
            plain
        ]
    );
    // ShareGPT's conversations take them too.
    let sharegpt = format!(
        "{{\"tools\": {TOOLS}, \"conversations\": [{{\"from\": \"human\", \"value\": \"hello\"}}, \
         {{\"from\": \"gpt\", \"value\": \"fine\"}}]}}\n"
    );
    let got = prepare(&d, "sharegpt.jsonl", &sharegpt).unwrap();
    assert_eq!(got, [with_tools(&CONVERSATION_IDS)]);
}

/// A `tools` that is not a list of tool objects, nor a string of JSON holding one, is the
/// record's error, naming its line and the field; so are tools given with a text (only a
/// conversation is rendered through the template) and tools holding the characters hspipe
/// reserves to find the assistant's text. Before, every one was prepared without its
/// tools, saying nothing.
#[test]
fn a_bad_tools_or_tools_with_a_text_is_named_by_line_and_field() {
    let d = tools_model("bad-tools");
    let cases = [
        (
            conversation_with("5"),
            "tools is a number, not a list of tools",
        ),
        (
            conversation_with("\"not json\""),
            "tools is a string that is not JSON",
        ),
        (
            conversation_with(r#""{\"type\": \"function\"}""#),
            "tools is a string holding an object, not a list of tools",
        ),
        (
            conversation_with(r#"{"type": "function"}"#),
            "tools is an object, not a list of tools",
        ),
        (
            conversation_with(r#"[{"type": "function"}, "time"]"#),
            "tools[1] is a string, not a tool object",
        ),
        (
            format!("{{\"text\": \"hello there\", \"tools\": {TOOLS}}}"),
            "tools are given with a text",
        ),
        (
            conversation_with(r#"[{"type": "function", "function": {"name": "\uFDD0"}}]"#),
            "tools[0] holds U+FDD0 or U+FDD1, which hspipe reserves",
        ),
    ];
    for (i, (line, want)) in cases.iter().enumerate() {
        let name = format!("bad{i}.jsonl");
        let Err(e) = prepare(&d, &name, &format!("{CONVERSATION}{line}\n")) else {
            panic!("{line}: prepared, saying nothing of its tools");
        };
        assert!(
            e.contains(&format!("{name}:2: ")) && e.contains(want),
            "{e:?} should name line 2 and say {want:?}"
        );
    }
    // A text with no tool (null, an empty list) loses nothing; pre-tokenized ids are the sample
    // as given, and their record's other fields (messages, tools) are not read.
    let fine = "{\"text\": \"hello there\", \"tools\": []}\n{\"text\": \"hello there\", \"tools\": null}\n\
                {\"input_ids\": [1, 2, 3], \"tools\": 5}\n";
    assert_eq!(
        prepare(&d, "fine.jsonl", fine).unwrap(),
        [vec![6, 7], vec![6, 7], vec![1, 2, 3]]
    );
}

/// A `messages` column of `n` copies of CONVERSATION, as pyarrow writes one.
fn messages_column(n: usize) -> arrow_array::ArrayRef {
    use arrow_array::{Array, ListArray, StringArray, StructArray};
    use arrow_buffer::OffsetBuffer;
    use arrow_schema::{DataType, Field};
    use std::sync::Arc;

    let strings = |v: Vec<&str>| Arc::new(StringArray::from(v)) as arrow_array::ArrayRef;
    let messages = StructArray::from(vec![
        (
            Arc::new(Field::new("role", DataType::Utf8, true)),
            strings(["user", "assistant"].repeat(n)),
        ),
        (
            Arc::new(Field::new("content", DataType::Utf8, true)),
            strings(["hello", "fine"].repeat(n)),
        ),
    ]);
    let item = Arc::new(Field::new("item", messages.data_type().clone(), true));
    Arc::new(ListArray::new(
        item,
        OffsetBuffer::from_lengths(vec![2; n]),
        Arc::new(messages),
        None,
    ))
}

/// A `tools` column of structs, as pyarrow and HF `datasets` write a list of tool dicts: row
/// 0 holds the two tools of TOOLS (a `description` that is None in every tool has pyarrow's
/// null type), row 1 none (null).
fn tools_struct_column() -> arrow_array::ArrayRef {
    use arrow_array::{Array, ArrayRef, ListArray, NullArray, StringArray, StructArray};
    use arrow_buffer::{NullBuffer, OffsetBuffer};
    use arrow_schema::Field;
    use std::sync::Arc;

    let field = |name: &str, a: &ArrayRef| Arc::new(Field::new(name, a.data_type().clone(), true));
    let names: ArrayRef = Arc::new(StringArray::from(vec!["weather", "time"]));
    let description: ArrayRef = Arc::new(NullArray::new(2));
    let function: ArrayRef = Arc::new(StructArray::from(vec![
        (field("name", &names), names),
        (field("description", &description), description),
    ]));
    let kinds: ArrayRef = Arc::new(StringArray::from(vec!["function", "function"]));
    let tools = StructArray::from(vec![
        (field("type", &kinds), kinds),
        (field("function", &function), function),
    ]);
    let item = Arc::new(Field::new("item", tools.data_type().clone(), true));
    Arc::new(ListArray::new(
        item,
        OffsetBuffer::from_lengths([2, 0]),
        Arc::new(tools),
        Some(NullBuffer::from(vec![true, false])),
    ))
}

/// Parquet, Arrow and HF `datasets` rows read `tools` as JSONL lines do: a column of structs
/// (what pyarrow makes of a list of dicts) or of JSON strings (what many HF datasets hold). A
/// bad one names its row and the field. Before, the column was not even read.
#[test]
fn a_rows_tools_reach_its_template_from_a_column_of_structs_or_of_json_strings() {
    use arrow_array::{ArrayRef, StringArray};
    use std::sync::Arc;

    let d = tools_model("row-tools");
    let want = vec![with_tools(&CONVERSATION_IDS), CONVERSATION_IDS.to_vec()];
    let strings: ArrayRef = Arc::new(StringArray::from(vec![Some(TOOLS), None]));
    for (form, tools) in [("structs", tools_struct_column()), ("strings", strings)] {
        let columns = vec![("messages", messages_column(2)), ("tools", tools)];
        for (kind, bytes) in containers(columns) {
            let got = prepare_bytes(&d, &format!("{form}.{kind}"), &bytes);
            assert_eq!(got.unwrap(), want, "{form} {kind}");
        }
    }
    let bad: ArrayRef = Arc::new(StringArray::from(vec![Some(TOOLS), Some("not json")]));
    for (kind, bytes) in containers(vec![("messages", messages_column(2)), ("tools", bad)]) {
        let name = format!("bad.{kind}");
        let e = prepare_bytes(&d, &name, &bytes).unwrap_err();
        assert!(
            e.contains(&format!(
                "{name}: row 1: tools is a string that is not JSON"
            )),
            "{e}"
        );
    }
}

/// The key of this crate's word-level model (`model(..)` with `TEMPLATE`) in the build before
/// `tools` reached the template ("hspipe chat 3").
const KEY_WITHOUT_TOOLS: &str = "43c750881993940349c23fb3e3da14f4";

/// A cache prepared by the build that dropped `tools` is not reused: its key covers how
/// conversations are rendered, and that changed. Before, the key was the same, and a dataset
/// prepared without its tools stayed in use.
#[test]
fn the_key_is_not_the_one_of_the_build_that_dropped_tools() {
    let d = model("key", "null", "null");
    let chat = Chat::load(d.path(), ChatOptions::default()).unwrap();
    assert_ne!(
        chat.key(),
        KEY_WITHOUT_TOOLS,
        "a cache prepared without the tools would be reused"
    );
}
