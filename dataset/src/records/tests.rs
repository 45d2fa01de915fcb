//! The records' tests: every key a message gives reaches its template, in its order.

use super::*;
use crate::chat::template::Template;

/// A message reaches the template with every key its record gives, as transformers hands
/// it over: an assistant turn that only calls a tool (OpenAI's `"content": null`) renders
/// its call, a tool's reply its `name`, and reasoning under its own name too. Before, the
/// call was dropped (an empty assistant turn, trained as such) and null content refused.
#[test]
fn a_message_reaches_the_template_with_every_key_of_its_record() {
    let turns = serde_json::json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "thinking": "look it up",
         "tool_calls": [{"type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "name": "get_weather", "content": "rain"},
    ]);
    let messages = conversation("messages", turns).unwrap();
    assert_eq!(messages[1].content, "");
    assert_eq!(messages[1].reasoning_content.as_deref(), Some("look it up"));
    let src = "{% for m in messages %}[{{ m.role }}|{{ m.content }}\
        {% if m.tool_calls %}|call {{ m.tool_calls[0].function.name }}\
        ({{ m.tool_calls[0].function.arguments.city }}){% endif %}\
        {% if m.name %}|from {{ m.name }}{% endif %}\
        {% if m.thinking %}|thought {{ m.thinking }}{% endif %}]{% endfor %}";
    let t = Template::new(src, vec![]).unwrap();
    let r = t.render(&messages, None, false).unwrap();
    assert_eq!(
        r.text,
        "[user|weather?][assistant||call get_weather(Oslo)|thought look it up]\
         [tool|rain|from get_weather]"
    );
    // Without content and without a call, a message is still refused, saying why.
    let e = message(serde_json::json!({"role": "assistant"})).unwrap_err();
    assert!(e.contains("nor tool_calls"), "{e}");
}

/// A tool call's arguments reach the template with their keys in the record's order, as
/// Python's dicts keep them: templates write them with `tojson` (Qwen's, Llama's), so an
/// order of our own is other ids than transformers'. Before, serde_json's map sorted the
/// keys: `{"unit": "C", "city": "Oslo"}` rendered as `{"city": "Oslo", "unit": "C"}`.
#[test]
fn a_tool_calls_arguments_keep_the_records_key_order() {
    let line = r#"{"messages": [{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
         "function": {"name": "get_weather", "arguments": {"unit": "C", "city": "Oslo"}}}]}]}"#;
    let Ok(Record::Chat { messages, .. }) = parse_line(&line.replace('\n', " ")) else {
        panic!("not a conversation");
    };
    let t = Template::new(
        "{{ messages[1].tool_calls[0].function.arguments | tojson }}",
        vec![],
    )
    .unwrap();
    let r = t.render(&messages, None, false).unwrap();
    assert_eq!(r.text, r#"{"unit": "C", "city": "Oslo"}"#);
}

/// A record's tools reach the template exactly as it gives them, whether a list or a string of
/// JSON: every key in the record's order (`tojson` writes them so, as Python's dicts keep
/// them), non-ASCII text as it is. Without tools, `tools` is none, as transformers renders
/// with `tools=None`. Before, `tools` was not read, and rendered as none.
#[test]
fn a_records_tools_reach_the_template_in_its_order_from_a_list_or_a_string() {
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Météo", "parameters": {"type": "object", "required": ["unit", "city"], "properties": {"unit": {"type": "string", "enum": ["C", "F"]}, "city": {"type": "string"}}}}}]"#;
    let turns = r#""messages": [{"role": "user", "content": "weather?"}]"#;
    let string = serde_json::Value::String(tools.into()).to_string();
    let t = Template::new(
        "{% if tools is none %}none{% else %}{{ tools | tojson }}{% endif %}{% if documents is not none %}, documents{% endif %}",
        vec![],
    )
    .unwrap();
    for (line, want) in [
        (format!("{{\"tools\": {tools}, {turns}}}"), tools),
        (format!("{{{turns}, \"tools\": {string}}}"), tools),
        (format!("{{{turns}}}"), "none"),
    ] {
        let Ok(Record::Chat { messages, tools }) = parse_line(&line) else {
            panic!("{line}: not a conversation");
        };
        let r = t.render(&messages, tools.as_deref(), false).unwrap();
        assert_eq!(r.text, want, "{line}");
    }
}

/// A field given as null is said to be null, as Parquet's null row is (`input_ids is null`);
/// before, `{"input_ids": null}` said the record had none of the fields. A record that lacks
/// them all still says so, and a null field beside one that holds the sample is ignored.
#[test]
fn a_null_field_is_said_to_be_null() {
    let err = |line: &str| match parse_line(line) {
        Err(e) => e,
        Ok(r) => panic!("{line}: {r:?}"),
    };
    assert_eq!(err(r#"{"input_ids": null}"#), "input_ids is null");
    assert_eq!(
        err(r#"{"input_ids": null, "loss_mask": [1]}"#),
        "input_ids is null"
    );
    assert_eq!(err(r#"{"messages": null}"#), "messages is null");
    assert_eq!(err(r#"{"conversations": null}"#), "conversations is null");
    assert_eq!(err(r#"{"text": null}"#), "text is null");
    assert_eq!(
        err(r#"{"id": 3}"#),
        "not a sample: it has none of input_ids, messages, conversations, text"
    );
    assert!(matches!(
        parse_line(r#"{"input_ids": null, "text": "hi"}"#),
        Ok(Record::Text { .. })
    ));
}
