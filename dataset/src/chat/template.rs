//! The chat template: HF's Jinja text rendered by minijinja as transformers renders it with
//! jinja2 (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that
//! does not escape HTML, Python's string methods through minijinja-contrib's pycompat), and where
//! the assistant's text is in the output.
//!
//! `{% generation %}...{% endgeneration %}` (transformers' own tag, which jinja2 knows through an
//! extension and minijinja does not) is rewritten before parsing into an `if` block around a
//! reserved character, U+FDD0 at the start and U+FDD1 at the end: two block tags in the place of
//! one keep the whitespace rules (`-`, `trim_blocks`, `lstrip_blocks`) exactly as the tag had
//! them. Rendering then drops the two characters and keeps where they were, in characters (code
//! points, as Python counts them), which is what transformers records.
//!
//! A template without the tag gives its assistant spans by markers: [`Markers::probe`] renders
//! two probe conversations and reads off the text that opens an assistant turn and the one that
//! ends it, and [`Markers::spans`] finds them in a rendered conversation.
//!
//! Length: past 500 lines with its tests, one for each of transformers' template behaviours it
//! reproduces (the tag, the markers, `tojson`, `raise_exception`, `strftime_now`); they share
//! the private helpers they test.

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

/// Opens a generation span in the rendered text (a Unicode noncharacter, never in text).
pub const OPEN: char = '\u{FDD0}';
/// Closes it.
pub const CLOSE: char = '\u{FDD1}';
/// Stands for probe contents while finding the markers.
const PROBE: [&str; 4] = ["\u{FDD2}", "\u{FDD3}", "\u{FDD4}", "\u{FDD5}"];

/// A message as the template sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// The assistant's reasoning, when the record gives it apart from the content (Qwen3's
    /// templates read `reasoning_content`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The record's other keys, as it gives them (`tool_calls`, `name`, `tool_call_id`, ...):
    /// transformers hands the template each message as it is, and templates render these.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
            reasoning_content: None,
            extra: serde_json::Map::new(),
        }
    }
}

/// A parsed template and the variables every rendering gets.
pub struct Template {
    env: Environment<'static>,
    /// The special tokens (`bos_token`, `eos_token`, ...) and the options (`enable_thinking`).
    globals: Vec<(String, Value)>,
    /// True when the template marks its assistant text with `{% generation %}`.
    pub has_generation: bool,
}

/// A rendered conversation: the text and its generation spans, in characters.
#[derive(Debug)]
pub struct Rendered {
    pub text: String,
    pub spans: Vec<(usize, usize)>,
}

/// Rewrites `{% generation %}` and `{% endgeneration %}` (with any whitespace control) into
/// blocks that print the span characters; returns the source and whether it had any.
fn rewrite(src: &str) -> (String, bool) {
    let mut out = String::with_capacity(src.len() + 64);
    let mut rest = src;
    let mut found = false;
    while let Some(at) = rest.find(['{']) {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        // A comment is copied as it is: a tag written in it is no tag.
        if tag.starts_with("{#") {
            let end = tag.find("#}").map_or(tag.len(), |e| e + 2);
            out.push_str(&tag[..end]);
            rest = &tag[end..];
            continue;
        }
        if !tag.starts_with("{%") {
            out.push('{');
            rest = &tag[1..];
            continue;
        }
        // The close is looked for after the `{%`: in `{%}` the `%` of the open is no close.
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            rest = "";
            break;
        };
        let inner = &tag[2..end];
        let (left, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, right) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        let mark = match body.trim() {
            "generation" => Some(OPEN),
            "endgeneration" => Some(CLOSE),
            _ => None,
        };
        match mark {
            Some(c) => {
                found = true;
                out.push_str(&format!("{{%{left} if true %}}{c}{{% endif {right}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    (out, found)
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// The time a template's `strftime_now` writes unless the user gives one
/// ([`super::ChatOptions::date`]): 26 Jul 2024, 00:00 UTC, the date Llama 3.1's template writes
/// and Llama 3.2's writes where `strftime_now` is not defined, so such templates render as they
/// did before it was.
pub const TEMPLATE_DATE: i64 = 1_721_952_000;

/// transformers' `strftime_now(format)`, at `at` (seconds since 1970, UTC) rather than now: as
/// Python's `datetime.now().strftime(format)` writes a time without a zone. Templates write
/// today's date with it (Llama 3.2's and Mistral Small's system prompts). Not the clock: a
/// record must give the same ids on every day, or data prepared again for a `--resume` would
/// be other lengths than the run's plan.
fn strftime_at(at: i64, format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write as _;
    let bad = |why: &str| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now({format:?}): {why}"),
        )
    };
    let python = as_python(format);
    let items: Vec<Item> = StrftimeItems::new(&python).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(bad("not a strftime format"));
    }
    let t =
        chrono::DateTime::from_timestamp(at, 0).ok_or_else(|| bad("the time is out of range"))?;
    let mut text = String::new();
    // Written, not `to_string()`, which panics where a code cannot be written.
    write!(
        text,
        "{}",
        t.naive_utc().format_with_items(items.into_iter())
    )
    .map_err(|_| bad("cannot be written"))?;
    Ok(text)
}

/// `format`'s codes where chrono's differ from Python's for a time without a zone: `%Z` and
/// `%z` write nothing (chrono cannot write them without a zone), and `%f` six digits
/// (chrono's writes nine). `%%` stays a `%`.
fn as_python(format: &str) -> String {
    let mut out = String::with_capacity(format.len());
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Z' | 'z') => {}
            Some('f') => out.push_str("%6f"),
            Some(n) => {
                out.push('%');
                out.push(n);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python's `json.dumps(x, ensure_ascii=False)` as transformers' `tojson` filter calls it
/// (separators `, ` and `: `, keys in their order; `indent` for pretty output), not minijinja's
/// HTML-safe one.
fn tojson(v: Value, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    // `indent` as HF templates pass it (`tojson(indent=4)`); the others are Python's defaults.
    let indent: Option<usize> = kwargs.get("indent")?;
    let mut out = String::new();
    python_json(&v, indent, 0, &mut out)?;
    Ok(out)
}

fn python_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    let string = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let map = v.kind() == ValueKind::Map;
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str(if map { "{}" } else { "[]" });
                return Ok(());
            }
            out.push(if map { '{' } else { '[' });
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                if map {
                    out.push_str(&string(&k.to_string()));
                    out.push_str(": ");
                    python_json(&v.get_item(k)?, indent, depth + 1, out)?;
                } else {
                    python_json(k, indent, depth + 1, out)?;
                }
            }
            newline(out, depth);
            out.push(if map { '}' } else { ']' });
        }
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::String => out.push_str(&string(v.as_str().unwrap_or_default())),
        _ => out.push_str(
            &serde_json::to_string(v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?,
        ),
    }
    Ok(())
}

impl Template {
    /// Parses `src`; `globals` are passed to every rendering; `strftime_now` writes
    /// [`TEMPLATE_DATE`].
    pub fn new(src: &str, globals: Vec<(String, Value)>) -> Result<Template, String> {
        Template::dated(src, globals, TEMPLATE_DATE)
    }

    /// [`new`](Self::new) with `strftime_now` writing `date` (seconds since 1970, UTC).
    pub fn dated(src: &str, globals: Vec<(String, Value)>, date: i64) -> Result<Template, String> {
        let (src, has_generation) = rewrite(src);
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: String| {
            strftime_at(date, &format).map(Value::from)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat_template", src)
            .map_err(|e| format!("the chat template does not parse: {e:#}"))?;
        Ok(Template {
            env,
            globals,
            has_generation,
        })
    }

    /// Renders `messages` with `tools` (the function definitions; None: `tools` is none, as
    /// transformers passes `tools=None`); the generation spans are empty for a template without
    /// the tag.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<Rendered, String> {
        let t = self
            .env
            .get_template("chat_template")
            .map_err(|e| e.to_string())?;
        let mut ctx: Vec<(String, Value)> = self.globals.clone();
        ctx.push((
            "messages".into(),
            Value::from(minijinja::value::Serde(messages)),
        ));
        // As the record gives them: objects keep their key order (serde_json's and minijinja's
        // `preserve_order`), which `tojson` writes. Without tools, `tools` is none, not
        // undefined, as transformers renders with `tools=None`: `{% if tools %}` is false and
        // `tools is defined` true there too.
        let tools = tools.map_or(Value::from(()), |t| Value::from(minijinja::value::Serde(t)));
        ctx.push(("tools".into(), tools));
        // Likewise `documents` (retrieval-augmented templates read it): hspipe's records carry
        // none, and transformers renders with `documents=None`.
        ctx.push(("documents".into(), Value::from(())));
        ctx.push(("add_generation_prompt".into(), add_generation_prompt.into()));
        let ctx: Value = ctx
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
            .into();
        let raw = t.render(ctx).map_err(|e| {
            let mut s = format!("the chat template failed: {e}");
            if let Some(d) = e.detail() {
                s.push_str(&format!(": {d}"));
            }
            s
        })?;
        Ok(split_spans(&raw))
    }
}

/// Drops the span characters from `raw`; their positions become spans (in characters). An
/// open without its close runs to the end.
fn split_spans(raw: &str) -> Rendered {
    if !raw.contains([OPEN, CLOSE]) {
        return Rendered {
            text: raw.to_string(),
            spans: Vec::new(),
        };
    }
    let mut text = String::with_capacity(raw.len());
    let mut spans = Vec::new();
    let (mut chars, mut open) = (0usize, None);
    for c in raw.chars() {
        match c {
            OPEN => open = Some(chars),
            CLOSE => {
                if let Some(s) = open.take() {
                    spans.push((s, chars));
                }
            }
            c => {
                text.push(c);
                chars += 1;
            }
        }
    }
    if let Some(s) = open {
        spans.push((s, chars));
    }
    Rendered { text, spans }
}

/// The text that opens an assistant turn and the text that ends it, as the template renders
/// them (for ChatML `<|im_start|>assistant\n` and `<|im_end|>`).
#[derive(Clone, Debug, PartialEq)]
pub struct Markers {
    pub open: String,
    pub end: String,
}

impl Markers {
    /// Renders `[user A, assistant B, user C, assistant D]`: the end marker is what follows
    /// both B and D (trailing whitespace dropped), the opening one what stands between A's end
    /// marker and B (ChatML's `<|im_start|>assistant\n`), or, where a user turn does not end
    /// with the end marker, all that stands between A and B (Mistral's and Llama 2's
    /// `[/INST]`: a user turn's close opens the assistant's, which ends with the end of
    /// sequence).
    pub fn probe(t: &Template) -> Result<Markers, String> {
        let [a, b, c, d] = PROBE;
        let two = t.render(
            &[
                Message::new("user", a),
                Message::new("assistant", b),
                Message::new("user", c),
                Message::new("assistant", d),
            ],
            None,
            false,
        )?;
        let s = &two.text;
        let fail = |why: &str| {
            format!("the chat template has no {{% generation %}} blocks, and its assistant turns cannot be found by markers: {why}")
        };
        let (Some(pa), Some(pb), Some(pc), Some(pd)) = (s.find(a), s.find(b), s.find(c), s.find(d))
        else {
            return Err(fail(
                "a probe conversation's contents are not in its rendering",
            ));
        };
        if !(pa < pb && pb < pc && pc < pd) {
            return Err(fail("it renders a conversation's messages out of order"));
        }
        let after_b = &s[pb + b.len()..pc];
        let after_d = &s[pd + d.len()..];
        let common = after_b
            .char_indices()
            .zip(after_d.chars())
            .find(|((_, x), y)| x != y)
            .map_or(after_b.len().min(after_d.len()), |((i, _), _)| i);
        let end = after_d[..common].trim_end().to_string();
        if end.is_empty() {
            return Err(fail("nothing marks the end of an assistant turn"));
        }
        let between = &s[pa + a.len()..pb];
        let open = match between.find(&end) {
            Some(at) => &between[at + end.len()..],
            None => between,
        };
        let open = open.trim_start().to_string();
        if open.is_empty() {
            return Err(fail("nothing marks the start of an assistant turn"));
        }
        Ok(Markers { open, end })
    }

    /// The assistant spans of `text`, in characters: from after each opening marker to the end
    /// of the end marker that follows it (or the end of the text).
    pub fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        let mut spans = Vec::new();
        let mut from = 0;
        while let Some(at) = text[from..].find(&self.open) {
            let start = from + at + self.open.len();
            let stop = text[start..]
                .find(&self.end)
                .map_or(text.len(), |e| start + e + self.end.len());
            spans.push((start, stop));
            from = stop;
        }
        // Bytes to characters, in one pass over the text.
        let bytes: Vec<usize> = spans.iter().flat_map(|&(s, e)| [s, e]).collect();
        byte_to_char(text, &bytes)
            .chunks(2)
            .map(|p| (p[0], p[1]))
            .collect()
    }
}

/// The character index of each byte offset of `text` (`offsets` ascending).
fn byte_to_char(text: &str, offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let (mut chars, mut last) = (0usize, 0usize);
    for &o in offsets {
        chars += text[last..o].chars().count();
        last = o;
        out.push(chars);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_span_characters_with_their_whitespace_control() {
        let (s, found) =
            rewrite("a{%- generation -%} b {% endgeneration %}\nc{% if x %}{% endif %}");
        assert_eq!(
            rewrite("{# no {% generation %} here #}{{ x }}"),
            ("{# no {% generation %} here #}{{ x }}".into(), false)
        );
        assert!(found);
        assert_eq!(
            s,
            "a{%- if true %}\u{FDD0}{% endif -%} b {% if true %}\u{FDD1}{% endif %}\nc{% if x %}{% endif %}"
        );
        let t = Template::new("{% for m in messages %}<{{ m.role }}>{% generation %}\n{{ m.content }}{% endgeneration %}\n{% endfor %}", vec![]).unwrap();
        let r = t
            .render(
                &[Message::new("user", "é"), Message::new("assistant", "x")],
                None,
                false,
            )
            .unwrap();
        assert_eq!(r.text, "<user>é<assistant>x");
        assert_eq!(r.spans, vec![(6, 7), (18, 19)]);
    }

    #[test]
    fn a_tag_whose_close_overlaps_its_open_is_a_parse_error() {
        for src in ["{%} oops", "a {%}", "{%-}{{ x }}"] {
            let Err(e) = Template::new(src, vec![]) else {
                panic!("{src:?} parsed");
            };
            assert!(
                e.contains("the chat template does not parse"),
                "{src:?}: {e}"
            );
        }
    }

    #[test]
    fn markers_are_found_for_chatml() {
        let t = Template::new("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}", vec![]).unwrap();
        let m = Markers::probe(&t).unwrap();
        assert_eq!(
            m,
            Markers {
                open: "<|im_start|>assistant\n".into(),
                end: "<|im_end|>".into()
            }
        );
        let text = "<|im_start|>user\nhé<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n";
        assert_eq!(m.spans(text), vec![(52, 64)]);
    }

    /// A Mistral-style template (written here): a user turn is `[INST]...[/INST]`, an assistant
    /// turn its content and the end of sequence, with nothing closing the user's turn as the
    /// assistant's is closed. The turn opens after `[/INST]` and ends with its end of sequence.
    /// Before, the probe refused it ("a user turn does not end with ...").
    #[test]
    fn markers_are_found_for_a_mistral_style_template() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}{% else %}{{ ' ' + m.content + eos_token }}{% endif %}{% endfor %}";
        let specials = vec![
            ("bos_token".to_string(), Value::from("<s>")),
            ("eos_token".to_string(), Value::from("</s>")),
        ];
        let t = Template::new(src, specials).unwrap();
        let m = Markers::probe(&t).unwrap();
        assert_eq!(
            m,
            Markers {
                open: "[/INST] ".into(),
                end: "</s>".into()
            }
        );
        let text = t
            .render(
                &[
                    Message::new("user", "hé"),
                    Message::new("assistant", "ok"),
                    Message::new("user", "and?"),
                    Message::new("assistant", "done"),
                ],
                None,
                false,
            )
            .unwrap()
            .text;
        let spans: Vec<String> = (m.spans(&text).iter())
            .map(|&(s, e)| text.chars().skip(s).take(e - s).collect())
            .collect();
        assert_eq!(spans, ["ok</s>", "done</s>"], "{text}");
    }

    /// `strftime_now` is there as in transformers, writing a fixed date by Python's codes (by
    /// default Llama 3.1's, so a template that guards it with `is defined` renders as it did
    /// without it); a format chrono cannot read is an error naming it, not a panic. (That it
    /// writes the date transformers writes is the tests crate's
    /// `a_template_that_writes_the_date_renders_the_date_transformers_renders`.)
    #[test]
    fn strftime_now_writes_a_fixed_date_and_a_bad_format_is_an_error() {
        let render = |t: &Template| t.render(&[Message::new("user", "a")], None, false);
        let src = "{% if strftime_now is defined %}{{ strftime_now('%d %b %Y|%Y-%m-%d %H:%M|%-d %A') }}{% endif %}";
        let t = Template::new(src, vec![]).unwrap();
        assert_eq!(
            render(&t).unwrap().text,
            "26 Jul 2024|2024-07-26 00:00|26 Friday"
        );
        // 2024-12-07 14:00 UTC.
        let t = Template::dated(src, vec![], 1_733_580_000).unwrap();
        assert_eq!(
            render(&t).unwrap().text,
            "07 Dec 2024|2024-12-07 14:00|7 Saturday"
        );
        let t = Template::new("{{ strftime_now('%Q') }}", vec![]).unwrap();
        let e = render(&t).unwrap_err();
        assert!(
            e.contains("strftime_now(\"%Q\"): not a strftime format"),
            "{e}"
        );
        // Python's codes where chrono's differ: no zone for a time without one (chrono's
        // `%Z` failed to write), six digits of microseconds (chrono writes nine); `%%Z` is text.
        let t = Template::new("{{ strftime_now('[%Z%z] %f %%Z') }}", vec![]).unwrap();
        assert_eq!(render(&t).unwrap().text, "[] 000000 %Z");
    }

    #[test]
    fn raise_exception_and_python_methods_work_as_in_hf_templates() {
        let t = Template::new("{{ messages[0].content.strip().split(',')[1] | tojson }}{% if messages|length > 1 %}{{ raise_exception('only one') }}{% endif %}", vec![]).unwrap();
        assert_eq!(
            t.render(&[Message::new("user", " a,<b> ")], None, false)
                .unwrap()
                .text,
            "\"<b>\""
        );
        let e = t
            .render(
                &[Message::new("user", "a"), Message::new("user", "b")],
                None,
                false,
            )
            .unwrap_err();
        assert!(e.contains("only one"), "{e}");
        let t = Template::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            vec![],
        )
        .unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "é")], None, false).unwrap().text,
            "{\"role\": \"user\", \"content\": \"é\"}|{\n  \"role\": \"user\",\n  \"content\": \"é\"\n}"
        );
    }
}
