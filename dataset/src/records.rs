//! Records that are not token ids yet (`messages`, `conversations`, `text`), and the one
//! pipeline every input goes through: records are gathered in bounded chunks, made into samples
//! in parallel (rayon, all cores) and written in input order, so the prepared file is the same
//! whatever the number of threads and memory holds one chunk.
//!
//! Which field a record is read from: the first present (and not null) of `input_ids` (with
//! `loss_mask`), `messages`, `conversations`, `text` (with `loss_mask`); the others are
//! ignored. A message is `{role, content}` or ShareGPT's `{from, value}` (`human` is `user`,
//! `gpt` is `assistant`); roles are `system`, `user`, `assistant` and `tool`, content a
//! string (a list of parts, as multimodal datasets have, is refused), `reasoning_content`
//! (or `thinking`, `reasoning`) optional.
//!
//! A conversation's `tools` (its function definitions, OpenAI's `[{"type": "function",
//! "function": {...}}]`) reach the template as transformers' `apply_chat_template(messages,
//! tools=tools)` hands them over: a list of objects as the record gives it, or a string holding
//! one (HF datasets often store them as JSON text), parsed. They belong to the conversation:
//! with a `text` they are an error (a text is tokenized without the template, so they would be
//! lost), and with `input_ids` they are ignored as the record's `messages` are (the ids are the
//! sample as given, and nothing is rendered).
//!
//! Length: past 500 lines because a record's fields (read from a JSONL line or an Arrow row
//! alike) and the pipeline that parses and makes them in parallel chunks are one path, kept
//! together so that every input goes through the same checks.

use std::io::Write;
use std::sync::Arc;

use rayon::prelude::*;
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::chat::{Chat, Message};
use crate::writer::Writer;
use crate::{check_sample, TooLong};

/// Records per chunk made in parallel (and at most `CHUNK_BYTES` of input text).
const CHUNK_RECORDS: usize = 4096;
const CHUNK_BYTES: usize = 32 << 20;

/// What a record holds.
#[derive(Debug)]
pub enum Record {
    Ids {
        ids: Vec<u32>,
        mask: Option<Vec<u8>>,
    },
    Chat {
        messages: Vec<Message>,
        /// The function definitions, as the template gets them (`tools`); None: none given.
        tools: Option<Vec<Json>>,
    },
    Text {
        text: String,
        mask: Option<Vec<u8>>,
    },
}

impl Record {
    /// The bytes of text it holds (a chunk's bound on memory).
    pub fn text_bytes(&self) -> usize {
        match self {
            Record::Ids { ids, .. } => ids.len() * 4,
            Record::Chat { messages, tools } => {
                let mut n: usize = messages
                    .iter()
                    .map(|m| m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len))
                    .sum();
                // Tool definitions are often most of a record's text (JSON schemas).
                for t in tools.iter().flatten() {
                    crate::chat::each_str(t, &mut |s| n += s.len());
                }
                n
            }
            Record::Text { text, .. } => text.len(),
        }
    }
}

/// A JSONL line, typed: the fields we read (others are ignored). A field that is null is
/// `Some(null)` (`Some(None)` for `input_ids`), absent `None`, so an error can say which.
#[derive(Deserialize)]
struct Line {
    #[serde(default, deserialize_with = "given")]
    input_ids: Option<Option<Vec<u32>>>,
    #[serde(default)]
    loss_mask: Option<Vec<u8>>,
    #[serde(default, deserialize_with = "given")]
    messages: Option<Json>,
    #[serde(default, deserialize_with = "given")]
    conversations: Option<Json>,
    #[serde(default, deserialize_with = "given")]
    text: Option<Json>,
    #[serde(default)]
    tools: Option<Json>,
}

/// A field that is present, null or not (serde's `Option` reads null as absent).
fn given<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// Parses one JSONL line into its record.
pub fn parse_line(line: &str) -> Result<Record, String> {
    if !line.trim_start().starts_with('{') {
        // serde would read a list as the record's fields in order, and say so confusingly.
        return Err(match serde_json::from_str::<Json>(line) {
            Ok(v) => format!(
                "not a sample: the line is {}, not a JSON object (one record per line)",
                kind(&v)
            ),
            Err(e) => format!("not a sample: {e}"),
        });
    }
    let l: Line = serde_json::from_str(line).map_err(|e| format!("not a sample: {e}"))?;
    if let Some(Some(ids)) = l.input_ids {
        return Ok(Record::Ids {
            ids,
            mask: l.loss_mask,
        });
    }
    let fields = Fields {
        messages: l.messages,
        conversations: l.conversations,
        text: l.text,
        tools: l.tools,
    };
    // `{"input_ids": null}`, as Parquet's null row says it.
    let other = [&fields.messages, &fields.conversations, &fields.text];
    if l.input_ids.is_some() && other.iter().all(|f| f.as_ref().is_none_or(Json::is_null)) {
        return Err("input_ids is null".into());
    }
    record_of(fields, l.loss_mask)
}

/// The fields of a record whose `input_ids` is absent (JSON values; None: absent).
pub struct Fields {
    pub messages: Option<Json>,
    pub conversations: Option<Json>,
    pub text: Option<Json>,
    pub tools: Option<Json>,
}

/// The record of a row whose `input_ids` is absent, from its other fields.
pub fn record_of(f: Fields, mask: Option<Vec<u8>>) -> Result<Record, String> {
    // The first field given as null, to say so if no field holds the sample.
    let null = [
        ("messages", &f.messages),
        ("conversations", &f.conversations),
        ("text", &f.text),
    ]
    .into_iter()
    .find(|(_, v)| v.as_ref().is_some_and(Json::is_null))
    .map(|(name, _)| name);
    let present = |v: Option<Json>| v.filter(|v| !v.is_null());
    let tools = tools(f.tools)?;
    if let Some((field, v)) = present(f.messages)
        .map(|v| ("messages", v))
        .or_else(|| present(f.conversations).map(|v| ("conversations", v)))
    {
        let messages = conversation(field, v)?;
        return Ok(Record::Chat { messages, tools });
    }
    match present(f.text) {
        // Never dropped without a word: the text is tokenized as it is, and nothing would
        // render the tools into it. An empty list loses nothing.
        Some(Json::String(_)) if tools.as_ref().is_some_and(|t| !t.is_empty()) => Err(
            "tools are given with a text: only a conversation (messages or conversations) is rendered through the chat template with its tools, and a text is tokenized as it is".into(),
        ),
        Some(Json::String(text)) => Ok(Record::Text { text, mask }),
        Some(v) => Err(format!("text is {}, not a string", kind(&v))),
        None => Err(match null {
            Some(name) => format!("{name} is null"),
            None => "not a sample: it has none of input_ids, messages, conversations, text".into(),
        }),
    }
}

/// A record's `tools`, as transformers' `apply_chat_template(messages, tools=...)` takes them
/// (a list of tool objects, handed to the template as they are): a list as it is, or a string
/// holding one in JSON, parsed (HF datasets often store them so, as an Arrow column of structs
/// would give every tool every other tool's fields). None when there are none: absent, null, an
/// empty string, or a string holding `null` (what `json.loads` makes `None`); transformers then
/// passes none and `{% if tools %}` is false. An empty list stays one, as transformers passes
/// it (Llama 3.1's template tests `tools is not none`).
fn tools(v: Option<Json>) -> Result<Option<Vec<Json>>, String> {
    let list = match v {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(list)) => list,
        Some(Json::String(s)) if s.trim().is_empty() => return Ok(None),
        Some(Json::String(s)) => match serde_json::from_str::<Json>(&s) {
            Ok(Json::Null) => return Ok(None),
            Ok(Json::Array(list)) => list,
            Ok(v) => {
                return Err(format!(
                    "tools is a string holding {}, not a list of tools",
                    kind(&v)
                ))
            }
            Err(e) => {
                return Err(format!(
                    "tools is a string that is not JSON ({e}): it must be a list of tools, or a string holding one"
                ))
            }
        },
        Some(v) => {
            return Err(format!(
                "tools is {}, not a list of tools (nor a string holding one)",
                kind(&v)
            ))
        }
    };
    if let Some((i, t)) = list.iter().enumerate().find(|(_, t)| !t.is_object()) {
        return Err(format!("tools[{i}] is {}, not a tool object", kind(t)));
    }
    Ok(Some(list))
}

fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// A role as the template knows it, from either spelling.
fn role(r: &str) -> Option<&'static str> {
    Some(match r {
        "system" => "system",
        "user" | "human" => "user",
        "assistant" | "gpt" => "assistant",
        "tool" => "tool",
        _ => return None,
    })
}

fn conversation(field: &str, v: Json) -> Result<Vec<Message>, String> {
    let Json::Array(items) = v else {
        return Err(format!("{field} is {}, not a list of messages", kind(&v)));
    };
    if items.is_empty() {
        return Err(format!("{field} is an empty conversation"));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, m)| message(m).map_err(|why| format!("{field}[{i}]: {why}")))
        .collect()
}

fn message(m: Json) -> Result<Message, String> {
    let Json::Object(mut m) = m else {
        return Err(format!("{}, not a message object", kind(&m)));
    };
    let take = |m: &mut Map<String, Json>, a: &str, b: &str| {
        m.remove(a)
            .filter(|v| !v.is_null())
            .or_else(|| m.remove(b).filter(|v| !v.is_null()))
    };
    let r = match take(&mut m, "role", "from") {
        Some(Json::String(r)) => r,
        Some(v) => return Err(format!("role is {}, not a string", kind(&v))),
        None => return Err("no role (nor ShareGPT's from)".into()),
    };
    let Some(role) = role(&r) else {
        return Err(format!(
            "unknown role {r:?} (known: system, user, assistant, tool; ShareGPT's human, gpt)"
        ));
    };
    let calls = m.get("tool_calls").is_some_and(|c| !c.is_null());
    let content = match take(&mut m, "content", "value") {
        Some(Json::String(c)) => c,
        Some(Json::Array(_)) => {
            return Err("content is a list of parts (multimodal), not a string: only text conversations are prepared".into())
        }
        Some(v) => return Err(format!("content is {}, not a string", kind(&v))),
        // An assistant turn that only calls tools (OpenAI's `"content": null`).
        None if calls => String::new(),
        None => return Err("no content (nor ShareGPT's value, nor tool_calls)".into()),
    };
    // The reasoning, by any of its names, as `reasoning_content` (what Qwen3's templates
    // read); a template that reads another name still finds it under that one.
    let reasoning = m
        .remove("reasoning_content")
        .filter(|v| !v.is_null())
        .or_else(|| {
            ["thinking", "reasoning"]
                .iter()
                .find_map(|k| m.get(*k).filter(|v| !v.is_null()).cloned())
        });
    let reasoning_content = match reasoning {
        Some(Json::String(s)) => Some(s),
        Some(v) => return Err(format!("reasoning_content is {}, not a string", kind(&v))),
        None => None,
    };
    Ok(Message {
        role: role.to_string(),
        content,
        reasoning_content,
        extra: m,
    })
}

/// How many dropped records' places [`ChatStats`] keeps, for each reason.
pub const PLACES_KEPT: usize = 5;

/// What preparing conversations and texts counted (the launcher's line).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatStats {
    pub conversations: u64,
    pub texts: u64,
    /// Assistant turns trained (in a sample cut to `max_len`, those that start in it).
    pub turns: u64,
    /// Tokens with mask 1 in the samples written from conversations and texts.
    pub trained_tokens: u64,
    pub tokens: u64,
    /// Samples longer than `max_len`: cut to it, or dropped.
    pub truncated: u64,
    pub dropped_too_long: u64,
    /// Samples with no trained token (after truncation), dropped.
    pub dropped_untrained: u64,
    /// Texts of no token at all (`"text": ""`), dropped.
    pub dropped_empty: u64,
    /// The places of the first dropped records, for each reason (at most [`PLACES_KEPT`]):
    /// JSONL lines counted from 1, or rows counted from 0 (`rows`). Files prepared before
    /// these were kept have none.
    pub too_long_at: Vec<u64>,
    pub untrained_at: Vec<u64>,
    pub empty_at: Vec<u64>,
    /// The places are rows of a table, not lines of JSONL.
    pub rows: bool,
}

impl ChatStats {
    /// The footer metadata they are kept in (`hspipe.chat.*`).
    pub fn to_meta(&self) -> Vec<(String, String)> {
        let v = [
            ("conversations", self.conversations),
            ("texts", self.texts),
            ("turns", self.turns),
            ("trained_tokens", self.trained_tokens),
            ("tokens", self.tokens),
            ("truncated", self.truncated),
            ("dropped_too_long", self.dropped_too_long),
            ("dropped_untrained", self.dropped_untrained),
            ("dropped_empty", self.dropped_empty),
        ];
        let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let places = [
            ("too_long_at", list(&self.too_long_at)),
            ("untrained_at", list(&self.untrained_at)),
            ("empty_at", list(&self.empty_at)),
            ("places", (if self.rows { "rows" } else { "lines" }).into()),
        ];
        v.iter()
            .map(|(k, n)| (format!("hspipe.chat.{k}"), n.to_string()))
            .chain(
                places
                    .into_iter()
                    .map(|(k, v)| (format!("hspipe.chat.{k}"), v)),
            )
            .collect()
    }

    /// Why a preparation that kept no sample failed.
    pub fn nothing_left(&self, max_len: u32) -> String {
        let mut why = format!(
            "no sample is left of its {} conversations and {} texts: {} longer than data.max_len {max_len} (data.too_long = \"truncate\" keeps them), {} with no assistant token to train",
            self.conversations, self.texts, self.dropped_too_long, self.dropped_untrained
        );
        if self.dropped_empty > 0 {
            why.push_str(&format!(", {} empty", self.dropped_empty));
        }
        why
    }

    /// `places` as the user finds them: "lines 2, 4, 6, ..." (JSONL) or "rows 1, 3" (a table);
    /// None when none were kept (a file prepared before they were).
    pub fn places(&self, places: &[u64], of: u64) -> Option<String> {
        let first = places.first()?;
        let what = match (self.rows, of) {
            (false, 1) => "line",
            (false, _) => "lines",
            (true, 1) => "row",
            (true, _) => "rows",
        };
        let mut out = format!("{what} {first}");
        for p in &places[1..] {
            out.push_str(&format!(", {p}"));
        }
        if of > places.len() as u64 {
            out.push_str(", ...");
        }
        Some(out)
    }

    /// Read back from a prepared file's metadata; None when it holds no conversations or texts.
    /// What earlier builds did not write (the empty texts, the places) reads as none.
    pub fn from_meta(get: impl Fn(&str) -> Option<String>) -> Option<ChatStats> {
        let n = |k: &str| -> Option<u64> { get(&format!("hspipe.chat.{k}"))?.parse().ok() };
        let list = |k: &str| -> Vec<u64> {
            (get(&format!("hspipe.chat.{k}")).unwrap_or_default())
                .split(',')
                .filter_map(|p| p.parse().ok())
                .collect()
        };
        Some(ChatStats {
            conversations: n("conversations")?,
            texts: n("texts")?,
            turns: n("turns")?,
            trained_tokens: n("trained_tokens")?,
            tokens: n("tokens")?,
            truncated: n("truncated")?,
            dropped_too_long: n("dropped_too_long")?,
            dropped_untrained: n("dropped_untrained")?,
            dropped_empty: n("dropped_empty").unwrap_or(0),
            too_long_at: list("too_long_at"),
            untrained_at: list("untrained_at"),
            empty_at: list("empty_at"),
            rows: get("hspipe.chat.places").as_deref() == Some("rows"),
        })
    }
}

/// Keeps `place` in `places` while they are fewer than [`PLACES_KEPT`].
fn keep(places: &mut Vec<u64>, place: u64) {
    if places.len() < PLACES_KEPT {
        places.push(place);
    }
}

/// How records become samples: the checks of pre-tokenized ones, and the tokenizer for the rest.
pub struct Maker {
    pub max_len: u32,
    pub too_long: TooLong,
    pub chat: Option<Arc<Chat>>,
    /// Without `chat`: the model directory that has no tokenizer.json.
    pub no_tokenizer_in: Option<std::path::PathBuf>,
}

/// A record made into a sample, or why not.
enum Made {
    Sample(Vec<u32>, Option<Vec<u8>>),
    /// From a conversation or text: counted.
    Tokenized(Vec<u32>, Vec<u8>, Tokenized),
}

#[derive(Clone, Copy)]
struct Tokenized {
    conversation: bool,
    turns: u32,
    /// It has more tokens than were made (more than max_len).
    more: bool,
}

impl Maker {
    fn chat(&self) -> Result<&Chat, String> {
        self.chat.as_deref().ok_or_else(|| match &self.no_tokenizer_in {
            Some(dir) => format!(
                "it holds a conversation or text, and the model directory {} has no tokenizer.json to make its ids: copy the target's tokenizer.json (with its tokenizer_config.json) there, or name a directory holding them with data.tokenizer = \"DIR\" in the config",
                dir.display()
            ),
            None => "it holds a conversation or text, and no tokenizer was loaded to make its ids: name a directory holding the target's tokenizer.json with --model DIR or data.tokenizer = \"DIR\"".to_string(),
        })
    }

    fn make(&self, r: Record) -> Result<Made, String> {
        match r {
            Record::Ids { ids, mask } => {
                check_sample(ids.len(), mask.as_deref(), self.max_len)?;
                Ok(Made::Sample(ids, mask))
            }
            // Tokenized only as far as max_len needs (`Chat::first_tokens`): a longer record is
            // dropped or cut to it all the same.
            Record::Chat { messages, tools } => {
                let want = self.max_len as usize;
                let e = self
                    .chat()?
                    .conversation(&messages, tools.as_deref(), want)?;
                Ok(Made::Tokenized(
                    e.ids,
                    e.mask,
                    Tokenized {
                        conversation: true,
                        turns: e.turns,
                        more: e.more,
                    },
                ))
            }
            Record::Text { text, mask } => {
                // A mask longer than max_len is still checked against the text's tokens.
                let given = mask.as_ref().map_or(0, Vec::len);
                let want = (self.max_len as usize).max(given);
                let (ids, more) = self.chat()?.text(&text, want)?;
                let mask = match mask {
                    Some(m) if more => {
                        return Err(format!(
                            "loss_mask has {} entries, the text has more than {want} tokens with this tokenizer",
                            m.len()
                        ))
                    }
                    Some(m) => {
                        check_sample(ids.len(), Some(&m), u32::MAX)
                            .map_err(|e| format!("{e} (the text's tokens, with this tokenizer)"))?;
                        m
                    }
                    None => vec![1; ids.len()],
                };
                Ok(Made::Tokenized(
                    ids,
                    mask,
                    Tokenized {
                        conversation: false,
                        turns: 0,
                        more,
                    },
                ))
            }
        }
    }
}

/// Gathers records with their place (line or row) and writes them in order, a chunk at a time.
pub struct Pipeline<'a, W: Write> {
    maker: &'a Maker,
    w: &'a mut Writer<W>,
    pending: Vec<(u64, Pending)>,
    pending_bytes: usize,
    pub stats: ChatStats,
}

/// A record waiting for its chunk: a JSONL line is parsed in parallel too.
enum Pending {
    Line(String),
    Parsed(Result<Record, String>),
}

/// A record that could not be made into a sample: its place and why.
pub type Refused = (u64, String);

/// Why a chunk stopped: a refused record, or the writer's error.
pub enum Stop {
    Record(Refused),
    Write(std::io::Error),
}

impl<'a, W: Write> Pipeline<'a, W> {
    pub fn new(maker: &'a Maker, w: &'a mut Writer<W>) -> Self {
        Pipeline {
            maker,
            w,
            pending: Vec::new(),
            pending_bytes: 0,
            stats: ChatStats::default(),
        }
    }

    /// Adds the record at `place` (its size in input bytes, for the chunk's bound).
    pub fn push(
        &mut self,
        place: u64,
        r: Result<Record, String>,
        bytes: usize,
    ) -> Result<(), Stop> {
        self.pending.push((place, Pending::Parsed(r)));
        self.pending_bytes += bytes;
        if self.pending.len() >= CHUNK_RECORDS || self.pending_bytes >= CHUNK_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Adds a JSONL line, parsed with the rest of its chunk in parallel.
    pub fn push_line(&mut self, place: u64, line: String) -> Result<(), Stop> {
        let bytes = line.len();
        self.pending.push((place, Pending::Line(line)));
        self.pending_bytes += bytes;
        if self.pending.len() >= CHUNK_RECORDS || self.pending_bytes >= CHUNK_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// The writer, for rows that need no making (everything pending written first).
    pub fn writer(&mut self) -> Result<&mut Writer<W>, Stop> {
        self.flush()?;
        Ok(self.w)
    }

    pub fn maker(&self) -> &Maker {
        self.maker
    }

    /// Makes and writes what is pending.
    pub fn flush(&mut self) -> Result<(), Stop> {
        let maker = self.maker;
        let made: Vec<(u64, Result<Made, String>)> = std::mem::take(&mut self.pending)
            .into_par_iter()
            .map(|(place, p)| {
                let r = match p {
                    Pending::Line(l) => parse_line(&l),
                    Pending::Parsed(r) => r,
                };
                (place, r.and_then(|r| maker.make(r)))
            })
            .collect();
        self.pending_bytes = 0;
        for (place, m) in made {
            match m.map_err(|why| Stop::Record((place, why)))? {
                Made::Sample(ids, mask) => self.w.push(&ids, mask.as_deref()),
                Made::Tokenized(ids, mask, t) => self.tokenized(place, ids, mask, t),
            }
            .map_err(Stop::Write)?;
        }
        Ok(())
    }

    /// Writes the sample made of the record at `place`, or drops it (counted, and its place
    /// kept among the first few): too long, or nothing in it to train.
    fn tokenized(
        &mut self,
        place: u64,
        mut ids: Vec<u32>,
        mut mask: Vec<u8>,
        t: Tokenized,
    ) -> std::io::Result<()> {
        let s = &mut self.stats;
        if t.conversation {
            s.conversations += 1;
        } else {
            s.texts += 1;
        }
        if ids.is_empty() {
            s.dropped_empty += 1;
            keep(&mut s.empty_at, place);
            return Ok(());
        }
        let max = self.maker.max_len as usize;
        if t.more || ids.len() > max {
            match self.maker.too_long {
                TooLong::Drop => {
                    s.dropped_too_long += 1;
                    keep(&mut s.too_long_at, place);
                    return Ok(());
                }
                TooLong::Truncate => {
                    s.truncated += 1;
                    ids.truncate(max);
                    mask.truncate(max);
                }
            }
        }
        let trained = mask.iter().map(|&b| u64::from(b)).sum::<u64>();
        if trained == 0 {
            s.dropped_untrained += 1;
            keep(&mut s.untrained_at, place);
            return Ok(());
        }
        s.turns += u64::from(t.turns);
        s.trained_tokens += trained;
        s.tokens += ids.len() as u64;
        self.w.push(&ids, Some(&mask))
    }
}

#[cfg(test)]
mod tests;
