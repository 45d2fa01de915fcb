//! Conversations into training samples: the target's own tokenizer (`tokenizer.json`, HF's
//! `tokenizers`) and chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
//! `chat_template`, rendered by minijinja) make the `input_ids`, and the loss mask covers
//! exactly the assistant's tokens.
//!
//! Invariants:
//! - ids and mask equal transformers' `apply_chat_template(messages, tokenize=True,
//!   return_dict=True, return_assistant_tokens_mask=True)` on the same files: the rendered text
//!   is tokenized once, without added special tokens, and a character span becomes the tokens
//!   from the one holding its first character to the one holding its last, read from the
//!   tokenizer's character offsets (never by tokenizing prefixes again), quirks included (a
//!   span whose start no token holds stops the spans; one whose end token is the first runs to
//!   the end).
//! - The spans are the template's `{% generation %}` blocks where it has them, else what lies
//!   between the opening and end markers of each assistant turn (see `template::Markers`), the
//!   end marker included: its content and its end-of-turn token, not its role header.
//! - The `truncation` and `padding` a `tokenizer.json` may be saved with are ignored, as
//!   transformers ignores them unless asked: a sample is never cut or padded by the tokenizer.
//! - Texts need only the tokenizer: a directory without a usable template (a base model's)
//!   still loads, and its template's error is each conversation's.
//! - A text or a rendered conversation is tokenized only as far as the caller's tokens need
//!   (`data.max_len`): a long one a prefix at a time (`prefix`), so a record of hundreds of MB
//!   costs the tokenizer what its first tokens do, not some 20 bytes of bookkeeping for each of
//!   its bytes (which aborted the process on a 200 MB text). The ids, offsets and mask are
//!   exactly the first ones of the whole record's: a prefix keeps only the splits its end
//!   cannot change; a record that cannot be cut so within `prefix::UNCUT_MAX` bytes is refused.
//! - [`Chat::key`] hashes everything that changes ids or masks: the tokenizer file, the
//!   special tokens, the template and every option.
//!
//! We keep the template engine's glue (the generation tag, the markers) ourselves because no
//! crate renders HF templates with transformers' assistant spans; the rest is minijinja's and
//! tokenizers'.

mod prefix;
pub(crate) mod template;

use std::path::{Path, PathBuf};

use minijinja::value::Value;
use serde_json::Value as Json;
use tokenizers::Tokenizer;
use twox_hash::XxHash3_128;

use prefix::{Cuts, First};
pub use template::{Markers, Message};
use template::{Template, CLOSE, OPEN};

/// What the user chose about conversations (`[data]` in the pipeline config).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    /// Passed to the template as `enable_thinking` when set (Qwen3's templates read it).
    pub enable_thinking: Option<bool>,
    /// Train on the last assistant turn of each conversation only.
    pub train_only_last_turn: bool,
    /// Put first as a `system` message into conversations that have none.
    pub system_prompt: Option<String>,
    /// The time the template's `strftime_now` writes, in seconds since 1970 (UTC); None:
    /// [`template::TEMPLATE_DATE`], 26 Jul 2024.
    pub date: Option<i64>,
}

/// A tokenizer directory that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("reading {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: {why}")]
    Bad { path: PathBuf, why: String },
}

/// Where a conversation's trained spans come from.
enum Spans {
    Generation,
    Markers(Markers),
}

/// The target's tokenizer and template, ready to prepare records on many threads.
pub struct Chat {
    tokenizer: Tokenizer,
    /// The template and where its assistant spans come from, or why there are none.
    template: Result<(Template, Spans), ChatError>,
    options: ChatOptions,
    key: String,
    /// The tokenizer's own part of `key`: `tokenizer.json` and the special tokens.
    tokenizer_key: String,
    dir: PathBuf,
    /// How its long texts are cut (`prefix`).
    cuts: Cuts,
}

/// One record made into a sample: its first tokens, as many as were asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub mask: Vec<u8>,
    /// Assistant turns trained (spans in the mask, starting within `ids`).
    pub turns: u32,
    /// The record has more tokens than `ids` holds (more than were asked for).
    pub more: bool,
}

/// A special token of `tokenizer_config.json`: a string, or an added-token object.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// Calls `f` on every string of `v`, its objects' keys included.
pub(crate) fn each_str(v: &Json, f: &mut impl FnMut(&str)) {
    match v {
        Json::String(s) => f(s),
        Json::Array(items) => items.iter().for_each(|v| each_str(v, f)),
        Json::Object(m) => m.iter().for_each(|(k, v)| {
            f(k);
            each_str(v, f);
        }),
        Json::Null | Json::Bool(_) | Json::Number(_) => {}
    }
}

/// The special tokens transformers passes to templates.
const SPECIAL: &[&str] = &[
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Reads `path` whole, refusing what is not a regular file before opening it
/// ([`atomic_file::not_regular`]): a tokenizer.json that is a FIFO waited for a writer for ever.
fn read_regular(path: &Path) -> std::io::Result<Vec<u8>> {
    if let Some(what) = atomic_file::not_regular(&std::fs::metadata(path)?) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is {what}, not a regular file"),
        ));
    }
    std::fs::read(path)
}

impl Chat {
    /// Loads the tokenizer and template of the model directory `dir`. The tokenizer must load;
    /// a template that is missing or unusable (its assistant turns not found) is an error only
    /// for the first conversation ([`Chat::template_error`] says it before).
    pub fn load(dir: &Path, options: ChatOptions) -> Result<Chat, ChatError> {
        let read = |name: &str| {
            let path = dir.join(name);
            read_regular(&path).map_err(|source| ChatError::Read {
                path,
                cause: source,
            })
        };
        let bad = |name: &str, why: String| ChatError::Bad {
            path: dir.join(name),
            why,
        };
        let tok_bytes = read("tokenizer.json")?;
        let mut tokenizer = Tokenizer::from_bytes(&tok_bytes)
            .map_err(|e| bad("tokenizer.json", format!("not a tokenizers file: {e}")))?;
        // A tokenizer.json may be saved with `truncation` or `padding` set (by whoever last
        // called `enable_truncation`); transformers' `apply_chat_template` turns both off before
        // it encodes, so a sample is never cut to that length or padded with pad ids here either.
        tokenizer.with_truncation(None).map_err(|e| {
            bad(
                "tokenizer.json",
                format!("cannot turn its truncation off: {e}"),
            )
        })?;
        tokenizer.with_padding(None);
        let config: Json = match read_regular(&dir.join("tokenizer_config.json")) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| bad("tokenizer_config.json", format!("not JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(source) => {
                return Err(ChatError::Read {
                    path: dir.join("tokenizer_config.json"),
                    cause: source,
                })
            }
        };
        // A template that is missing or cannot be used is no error yet: pre-tokenized records
        // and texts need only the tokenizer (a base model has no template). It is the error of
        // the first conversation.
        let source: Result<String, ChatError> = match read_regular(&dir.join("chat_template.jinja"))
            .and_then(|b| {
                String::from_utf8(b)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            }) {
            Ok(s) => Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match config.get("chat_template") {
                        Some(Json::String(s)) => Ok(s.clone()),
                        Some(Json::Array(named)) => named
                            .iter()
                            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                            .and_then(|t| t.get("template")?.as_str())
                            .map(str::to_string)
                            .ok_or_else(|| {
                                bad(
                                    "tokenizer_config.json",
                                    "chat_template has no template named default".into(),
                                )
                            }),
                        _ => Err(ChatError::Bad {
                            path: dir.to_path_buf(),
                            why: "no chat template: neither chat_template.jinja nor a chat_template in tokenizer_config.json, so conversations cannot be prepared (texts and input_ids can)".into(),
                        }),
                    }
            }
            Err(source) => {
                return Err(ChatError::Read {
                    path: dir.join("chat_template.jinja"),
                    cause: source,
                })
            }
        };
        let mut globals: Vec<(String, Value)> = Vec::new();
        let mut h = XxHash3_128::with_seed(7);
        // 2: a message reaches the template with every key its record gives (tool calls).
        // 3: in the record's key order (a tool call's arguments were sorted before).
        // 4: the record's `tools` reach the template (they were dropped: no tools section), and
        //    without them `tools` is none, as transformers passes it (it was undefined); so is
        //    `documents`.
        // 5: a long record's first tokens are exactly the whole record's (two prefixes that
        //    agreed were taken, and could differ from it), and such a record may be refused.
        // 6: `strftime_now` is defined, writing `date` (a template that tested `is defined`
        //    wrote its own fallback date, and one that called it failed).
        //    And with an added token that takes the whitespace before it (`lstrip`), a prefix
        //    keeps no split of a run of whitespace near its end (they were kept, and differed
        //    from the whole record's when such a token followed the run).
        h.write(b"hspipe chat 6");
        let field = |h: &mut XxHash3_128, b: &[u8]| {
            h.write(&(b.len() as u64).to_le_bytes());
            h.write(b);
        };
        field(&mut h, &tok_bytes);
        // The tokenizer alone (its file and special tokens), to tell a prepared file made by
        // another tokenizer from one made by this tokenizer under another template or options.
        let mut t = XxHash3_128::with_seed(8);
        field(&mut t, &tok_bytes);
        for name in SPECIAL {
            if let Some(tok) = config.get(*name).and_then(token_text) {
                field(&mut t, name.as_bytes());
                field(&mut t, tok.as_bytes());
            }
        }
        // No template hashes as an empty one: neither prepares a conversation.
        field(&mut h, source.as_deref().unwrap_or("").as_bytes());
        for name in SPECIAL {
            if let Some(t) = config.get(*name).and_then(token_text) {
                field(&mut h, name.as_bytes());
                field(&mut h, t.as_bytes());
                globals.push((name.to_string(), t.into()));
            }
        }
        if let Some(t) = options.enable_thinking {
            globals.push(("enable_thinking".into(), t.into()));
        }
        field(&mut h, format!("{:?}", options.enable_thinking).as_bytes());
        field(&mut h, &[u8::from(options.train_only_last_turn)]);
        field(&mut h, format!("{:?}", options.system_prompt).as_bytes());
        let date = options.date.unwrap_or(template::TEMPLATE_DATE);
        field(&mut h, &date.to_le_bytes());
        let template = source.and_then(|source| {
            let bad = |why| ChatError::Bad {
                path: dir.to_path_buf(),
                why,
            };
            let template = Template::dated(&source, globals, date).map_err(bad)?;
            let spans = if template.has_generation {
                Spans::Generation
            } else {
                Spans::Markers(Markers::probe(&template).map_err(bad)?)
            };
            Ok((template, spans))
        });
        Ok(Chat {
            cuts: Cuts::of(&tokenizer),
            tokenizer,
            template,
            options,
            key: format!("{:032x}", h.finish_128()),
            tokenizer_key: format!("{:032x}", t.finish_128()),
            dir: dir.to_path_buf(),
        })
    }

    /// The hash of everything that changes ids or masks.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The hash of the tokenizer alone (`tokenizer.json` and the special tokens), without the
    /// template and options: [`key`](Self::key) less what renders conversations.
    pub fn tokenizer_key(&self) -> &str {
        &self.tokenizer_key
    }

    /// The model directory the tokenizer came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The markers a template without `{% generation %}` is read by (None: it has the tag, or
    /// there is no usable template).
    pub fn markers(&self) -> Option<&Markers> {
        match &self.template {
            Ok((_, Spans::Markers(m))) => Some(m),
            _ => None,
        }
    }

    /// Why conversations cannot be prepared (no template, or one whose assistant turns are not
    /// found); None when they can.
    pub fn template_error(&self) -> Option<&ChatError> {
        self.template.as_ref().err()
    }

    /// Tokenizes `text` as it is (no special tokens added), a `text` record: its first `want`
    /// tokens, and whether it has more (exactly as of the whole text, tokenizing a prefix of a
    /// long one: `prefix`).
    pub fn text(&self, text: &str, want: usize) -> Result<(Vec<u32>, bool), String> {
        let f = prefix::first_tokens(&self.tokenizer, self.cuts, text, want, false, "the text")?;
        Ok((f.ids, f.more))
    }

    /// Renders and tokenizes a conversation with its function definitions (`tools`, passed to
    /// the template as transformers passes them; None: `tools` is none, as `tools=None`); the
    /// mask covers its assistant spans. Its first `want` tokens (see [`Encoded::more`]).
    pub fn conversation(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        want: usize,
    ) -> Result<Encoded, String> {
        let (template, spans) = self.template.as_ref().map_err(|e| e.to_string())?;
        if messages.is_empty() {
            return Err("the conversation is empty".into());
        }
        for (i, m) in messages.iter().enumerate() {
            let reserved = |s: &str| s.contains([OPEN, CLOSE]);
            if reserved(&m.content) || m.reasoning_content.as_deref().is_some_and(reserved) {
                return Err(format!(
                    "message {i} holds U+FDD0 or U+FDD1, which hspipe reserves to find the assistant's text"
                ));
            }
        }
        for (i, t) in tools.into_iter().flatten().enumerate() {
            let mut reserved = false;
            each_str(t, &mut |s| reserved |= s.contains([OPEN, CLOSE]));
            if reserved {
                return Err(format!(
                    "tools[{i}] holds U+FDD0 or U+FDD1, which hspipe reserves to find the assistant's text"
                ));
            }
        }
        let with_system;
        let messages = match &self.options.system_prompt {
            Some(p) if messages[0].role != "system" => {
                with_system = std::iter::once(Message::new("system", p))
                    .chain(messages.iter().cloned())
                    .collect::<Vec<_>>();
                &with_system[..]
            }
            _ => messages,
        };
        let r = template.render(messages, tools, false)?;
        let mut spans = match spans {
            Spans::Generation => r.spans,
            Spans::Markers(m) => m.spans(&r.text),
        };
        if self.options.train_only_last_turn && spans.len() > 1 {
            spans.drain(..spans.len() - 1);
        }
        let First { ids, offsets, more } = prefix::first_tokens(
            &self.tokenizer,
            self.cuts,
            &r.text,
            want,
            true,
            "the conversation, rendered,",
        )?;
        let mut mask = vec![0u8; ids.len()];
        let mut turns = 0;
        // A span past the tokens kept starts at no token (it stops the spans), and one that
        // ends past them runs to their end: as in the whole conversation's tokens, cut.
        let token_of = |c: usize| offsets.iter().position(|&(s, e)| c >= s && c < e);
        for (s, e) in spans {
            // transformers' `char_to_token` on the span's first and last characters, as it
            // uses them (`end_token + 1 if end_token else len`).
            let Some(first) = token_of(s) else { break };
            let last = e.checked_sub(1).and_then(token_of);
            let stop = match last {
                Some(t) if t > 0 => t + 1,
                _ => ids.len(),
            };
            if first < stop {
                mask[first..stop].fill(1);
                turns += 1;
            }
        }
        Ok(Encoded {
            ids,
            mask,
            turns,
            more,
        })
    }
}

#[cfg(test)]
mod tests;
