//! Long texts and conversations, tokenized a prefix at a time (`chat::prefix`): their ids and
//! masks are exactly the first ones of the whole record's tokenization, wherever the prefixes
//! are cut (the tests shrink the first prefix to cut short texts at many places); a
//! tokenizer that splits a text is handed a bounded prefix of it, and one that cannot cut a
//! text longer than its bound refuses it.

use serde_json::json;

use super::ModelDir;
use crate::chat::prefix::LONGEST;
use crate::chat::{Chat, ChatOptions, Message};

/// A `tokenizer.json` of `model` with the given added tokens, normalizer and pre-tokenizer.
fn tokenizer(
    added: serde_json::Value,
    normalizer: serde_json::Value,
    pre_tokenizer: serde_json::Value,
    model: serde_json::Value,
) -> String {
    json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": null,
        "decoder": null, "model": model})
    .to_string()
}

/// An added (special) token, as a `tokenizer.json` holds it.
fn added(id: u32, content: &str) -> serde_json::Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true})
}

/// A Unigram model that prefers `日日` (and `aa`) to two single characters: where a piece ends
/// decides its first tokens (an odd or even count of characters).
fn unigram() -> serde_json::Value {
    json!({"type": "Unigram", "unk_id": 0, "byte_fallback": false, "vocab": [
        ["<unk>", 0.0], ["a", -10.0], ["aa", -1.0], ["b", -1.0], ["▁", -2.0], ["日", -10.0],
        ["日日", -1.0], ["▁日", -3.0]]})
}

/// The model directory `tag` with `tokenizer` (and `template`, if any).
fn dir(tag: &str, tokenizer: &str, template: Option<&str>) -> ModelDir {
    let d = ModelDir::new(tag);
    d.file("tokenizer.json", tokenizer);
    if let Some(t) = template {
        d.file("chat_template.jinja", t);
    }
    d
}

fn load(d: &ModelDir) -> Chat {
    Chat::load(d.path(), ChatOptions::default()).unwrap()
}

/// `f`'s result, and the longest text it handed the tokenizer.
fn longest<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LONGEST.with(|l| l.set(0));
    let t = f();
    (t, LONGEST.with(std::cell::Cell::get))
}

/// A seeded pseudo-random sequence (xorshift), for texts that put every kind of boundary at
/// the prefixes' cuts.
struct Seq(u64);

impl Seq {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// A text of `len` bytes or a little more, of `pieces` in a seeded order.
fn text_of(pieces: &[&str], len: usize, seed: u64) -> String {
    let mut s = Seq(seed);
    let mut t = String::new();
    while t.len() < len {
        t.push_str(pieces[s.below(pieces.len())]);
    }
    t
}

/// The reviewer's case: no pre-tokenizer, so the text is one piece, and where a prefix ends
/// (an odd or even count of `a`) changes its first tokens. Two prefixes agreed on `[2, 2, 2,
/// 2]` (`aa` four times) and were taken, where the whole odd text begins `a`: `[1, 2, 2, 2]`.
#[test]
fn a_long_unigram_text_gives_its_whole_tokenizations_first_tokens() {
    let d = ModelDir::new("unigram");
    d.file(
        "tokenizer.json",
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
  "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": false,
            "vocab": [["<unk>", 0.0], ["a", -10.0], ["aa", -1.0], ["b", -1.0]]}}"#,
    );
    let chat = Chat::load(d.path(), ChatOptions::default()).unwrap();
    let text = "a".repeat(300_001);
    let (whole, _) = chat.text(&text, usize::MAX).unwrap();
    assert_eq!(chat.text(&text, 4).unwrap().0, whole[..4]);
}

/// A text of 3-byte characters, its prefixes cut at odd and even counts of them by turns (so no
/// two agreed, and the whole text was tokenized however long). With a pre-tokenizer (Metaspace)
/// the first prefix gives the whole text's first tokens exactly, and nothing longer is handed
/// to the tokenizer; without one the text is one piece: tokenized whole up to the bound, and
/// refused past it, the error saying why, having handed the tokenizer no more than the bound.
#[test]
fn a_long_text_of_three_byte_characters_is_cut_where_a_pre_tokenizer_splits_it_and_refused_past_the_bound_where_none_does(
) {
    let metaspace = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
        "split": true});
    let d = dir(
        "meta",
        &tokenizer(json!([]), json!(null), metaspace, unigram()),
        None,
    );
    let chat = load(&d);
    let words = ["日", "日日", "日日日", "日日日日日", "日日日日日日日 "];
    let words = words.map(|w| format!("{w} "));
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let text = text_of(&words, 3 << 20, 1);
    let (whole, more) = chat.text(&text, usize::MAX).unwrap();
    assert!(!more && whole.len() > 200_000, "{}", whole.len());
    for want in [1, 4, 4_095, 4_096, 50_000] {
        let (got, handed) = longest(|| chat.text(&text, want).unwrap());
        assert_eq!(got, (whole[..want].to_vec(), true), "{want}");
        let first = (64 << 10).max(16 * (want + 1));
        assert!(
            handed <= first,
            "{want}: {handed} bytes handed, {first} the first prefix"
        );
    }

    let d = dir(
        "nopre",
        &tokenizer(json!([]), json!(null), json!(null), unigram()),
        None,
    );
    let mut chat = load(&d);
    let text = "日".repeat(400_001);
    let (whole, _) = chat.text(&text, usize::MAX).unwrap();
    assert_eq!(whole[0], 5, "an odd count begins with one 日");
    assert_eq!(chat.text(&text, 4).unwrap(), (whole[..4].to_vec(), true));
    chat.cuts.uncut_max = 512 << 10;
    let (e, handed) = longest(|| chat.text(&text, 4).unwrap_err());
    assert!(
        e.contains("the text is 1200003 bytes")
            && e.contains("no pre-tokenizer")
            && e.contains("refused"),
        "{e}"
    );
    assert!(handed <= 512 << 10, "{handed}");
}

/// Qwen2's tokenizer, small: NFC, its split pattern (contractions, `\s+(?!\S)`, ...) and a
/// byte-level BPE whose merges make `'ll`, ` we`, runs of spaces and newlines one token each;
/// and ChatML's markers and `<think>` as added tokens.
fn qwen_like() -> String {
    let mut vocab: Vec<String> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .map(String::from)
        .collect();
    vocab.sort();
    let mut merges = Vec::new();
    for w in [
        "Ġthe", "Ġwe", "we", "'ll", "'s", "Ġhello", "ĠĠĠĠ", "ĊĊ", "123", "Ġ!!", "Ã©",
    ] {
        let mut chars = w.chars();
        let mut left = chars.next().unwrap().to_string();
        for c in chars {
            let joined = format!("{left}{c}");
            if !vocab.contains(&joined) {
                merges.push(json!([left, c.to_string()]));
                vocab.push(joined.clone());
            }
            left = joined;
        }
    }
    let n = vocab.len() as u32;
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .into_iter()
        .enumerate()
        .map(|(i, v)| (v, json!(i)))
        .collect();
    let pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    tokenizer(
        json!([
            added(n, "<|im_start|>"),
            added(n + 1, "<|im_end|>"),
            added(n + 2, "<think>")
        ]),
        json!({"type": "NFC"}),
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false}]}),
        json!({"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}),
    )
}

/// What the prefixes' cuts may fall in: contractions (GPT-2's and Qwen's patterns make `'` and
/// `l` of a cut `'l`), runs of spaces and newlines, numbers, 3-byte characters, an `e` and the
/// combining marks NFC composes with it (the acute after a mark below), added tokens.
const PIECES: &[&str] = &[
    "we'll",
    " we'll",
    " the",
    "'s",
    " hello",
    "    ",
    "  ",
    "\n",
    "\n\n",
    " \n ",
    "12345",
    "日本語",
    " e\u{316}\u{316}\u{301}",
    "e\u{301}",
    " !!",
    "<|im_start|>",
    "<|im_end|>\n",
    "<think>",
    "<|im_",
];

/// `d`'s tokenizer, its first prefix `want + 1` bytes long: each `want` cuts a text elsewhere.
fn cut_everywhere(d: &ModelDir) -> Chat {
    let mut chat = load(d);
    chat.cuts.min_prefix = 1;
    chat.cuts.bytes_per_token = 1;
    chat
}

/// [`PIECES`] but the added tokens.
fn plain_pieces() -> Vec<&'static str> {
    PIECES
        .iter()
        .copied()
        .filter(|p| !p.contains('<'))
        .collect()
}

/// A Metaspace tokenizer (each space a split of its own) whose added tokens take the whitespace
/// before them (`lstrip`): `<m>` in the raw text, `<n>` in the normalized one, where `_` is
/// made a space. A WordLevel model: a word it does not know is `[UNK]`, one token.
fn lstrip_like(pre_tokenizer: serde_json::Value) -> String {
    let strip = |id: u32, content: &str, normalized: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": true,
            "rstrip": false, "normalized": normalized, "special": true})
    };
    tokenizer(
        json!([strip(5, "<m>", false), strip(6, "<n>", true)]),
        json!({"type": "Replace", "pattern": {"String": "_"}, "content": " "}),
        pre_tokenizer,
        json!({"type": "WordLevel", "unk_token": "[UNK]",
            "vocab": {"[UNK]": 0, "▁a": 1, "▁": 2, "▁bb": 3, "a": 4}}),
    )
}

fn metaspace() -> serde_json::Value {
    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true})
}

/// What the prefixes' cuts may fall in with [`lstrip_like`]: runs of spaces (and of `_`, spaces
/// once normalized) longer than the margin, which `<m>` (or `<n>`) after them takes whole.
fn lstrip_pieces() -> Vec<String> {
    let mut pieces: Vec<String> = [
        "a", " a", " bb", " ", "   ", "_", "<m>", "<n>", " <m>", "\n",
    ]
    .map(String::from)
    .into();
    pieces.extend([
        format!("{}<m>", " ".repeat(3_000)),
        format!("{}<n>", "_".repeat(3_000)),
        " ".repeat(3_000),
        "_".repeat(1_500),
    ]);
    pieces
}

/// A text cut at a hundred places and more (the first prefix shrunk to `want + 1` bytes, so each
/// `want` cuts elsewhere): its first tokens are the whole text's, with special tokens in it
/// and without; and with a tokenizer whose added tokens take the whitespace before them, cuts
/// falling in long runs of it.
#[test]
fn a_text_gives_its_whole_first_tokens_wherever_it_is_cut() {
    let qwen = dir("qwen", &qwen_like(), None);
    let lstrip = dir("lstripcut", &lstrip_like(metaspace()), None);
    let plain = plain_pieces();
    let strips = lstrip_pieces();
    let strips: Vec<&str> = strips.iter().map(String::as_str).collect();
    for (d, pieces, seed) in [
        (&qwen, PIECES, 2),
        (&qwen, &plain[..], 3),
        (&lstrip, &strips[..], 4),
    ] {
        let chat = cut_everywhere(d);
        let text = text_of(pieces, 48 << 10, seed);
        let (whole, _) = chat.text(&text, usize::MAX).unwrap();
        assert!(whole.len() > 6_000, "{}", whole.len());
        for want in (1..6_000).step_by(61) {
            let got = chat.text(&text, want).unwrap();
            assert_eq!(got.0, whole[..want], "want {want}, seed {seed}");
            assert!(got.1, "{want}");
        }
    }
}

/// The reviewer's case: `a`, ten thousand spaces, then `<m>`, which takes them all, so the text
/// is `▁a <m>`. A prefix cut in the spaces made each of them a split `▁`, and those far enough
/// from its end were kept: `▁a ▁` was taken for the text's first two tokens. So with `_`, which
/// the normalizer makes a space, before `<n>`.
#[test]
fn a_run_of_whitespace_that_an_lstrip_added_token_may_take_is_not_kept_from_a_prefix() {
    let d = dir("lstrip", &lstrip_like(metaspace()), None);
    let mut chat = load(&d);
    for (space, token, id) in [(" ", "<m>", 5), ("_", "<n>", 6)] {
        let text = format!("a{}{token}", space.repeat(10_000));
        let (whole, more) = chat.text(&text, usize::MAX).unwrap();
        assert_eq!((&whole[..], more), (&[1, id][..], false), "{token}");
        for cut in (1..text.len()).step_by(97) {
            chat.cuts.min_prefix = cut;
            chat.cuts.bytes_per_token = 0;
            assert_eq!(
                chat.text(&text, 1).unwrap(),
                (vec![1], true),
                "{token} {cut}"
            );
            assert_eq!(
                chat.text(&text, 2).unwrap(),
                (whole.clone(), false),
                "{token} {cut}"
            );
        }
    }
}

/// A text past the bound that cannot be cut within it is refused, the error naming what keeps
/// its first tokens from being told: pieces of few tokens each (words the model does not know:
/// one `[UNK]` for 900 bytes), nothing to tokenize at all (whitespace the pre-tokenizer drops),
/// one piece the pre-tokenizer does not split, a run of whitespace an `lstrip` token may take.
/// The old error blamed pieces too long for the first two, which have no long piece (the last
/// was not refused, but cut wrongly).
#[test]
fn a_text_that_cannot_be_cut_within_the_bound_is_refused_saying_why() {
    let lstrip = dir("lstripwhy", &lstrip_like(metaspace()), None);
    let model = json!({"type": "WordLevel", "unk_token": "[UNK]", "vocab": {"[UNK]": 0, "a": 1}});
    let words = dir(
        "words",
        &tokenizer(
            json!([]),
            json!(null),
            json!({"type": "WhitespaceSplit"}),
            model,
        ),
        None,
    );
    let spaces = format!("a{}<m>", " ".repeat(600_000));
    let letters = "a".repeat(600_000);
    let unknown = format!("{} ", "b".repeat(900)).repeat(700);
    let blank = format!("{}a", " ".repeat(600_000));
    for (d, text, says) in [
        (
            &words,
            &unknown,
            &["its tokens are few for its length: only the 578 tokens before byte 522580 can be told"][..],
        ),
        (
            &words,
            &blank,
            &["leave nothing of its first 524288 bytes to tokenize"],
        ),
        (
            &lstrip,
            &letters,
            &["pre-tokenizer does not split bytes 0 to 524288 and maybe past"],
        ),
        (
            &lstrip,
            &spaces,
            &[
                "the text is 600004 bytes",
                "its first 4096 tokens cannot be told from its first 524288 bytes alone",
                "it is all whitespace from byte 1 to within 1027 bytes of byte 524288",
                "added tokens \"<m>\" and 1 more take the whitespace before them (lstrip)",
                "none of its tokens can be told",
            ],
        ),
    ] {
        let mut chat = load(d);
        chat.cuts.uncut_max = 512 << 10;
        let e = chat.text(text, 4_096).unwrap_err();
        for said in says.iter().chain(&["refused", "leave it out, or split it"]) {
            assert!(e.contains(said), "{said:?} not in {e}");
        }
    }
}

/// ChatML with `{% generation %}` spans around the assistant's content and end marker.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\
{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}";

/// A conversation cut at a hundred places and more: its ids and mask are the whole conversation's
/// first ones, the mask running to the cut in a turn cut in two; the turns counted are those
/// that start in what is kept.
#[test]
fn a_long_conversations_ids_and_mask_at_every_cut_are_the_whole_ones() {
    let d = dir("qwenchat", &qwen_like(), Some(CHATML));
    let chat = cut_everywhere(&d);
    let plain = plain_pieces();
    let long = |seed| text_of(&plain, 6 << 10, seed);
    let conversation = [
        Message::new("user", &long(4)),
        Message::new("assistant", &long(5)),
        Message::new("user", &long(6)),
        Message::new("assistant", &long(7)),
    ];
    let whole = chat.conversation(&conversation, None, usize::MAX).unwrap();
    assert_eq!(whole.turns, 2);
    for want in (1..whole.ids.len()).step_by(71) {
        let cut = chat.conversation(&conversation, None, want).unwrap();
        assert_eq!(cut.ids, whole.ids[..want], "{want}");
        assert_eq!(cut.mask, whole.mask[..want], "{want}");
        assert!(cut.more, "{want}");
        let starts = (0..want)
            .filter(|&i| whole.mask[i] == 1 && (i == 0 || whole.mask[i - 1] == 0))
            .count();
        assert_eq!(cut.turns as usize, starts, "{want}");
    }
}

/// An added token that is the start of a longer one (`<x>` and `<x>!!!!`), cut short by a
/// prefix: the prefix makes `<x>`, `!`, `!` where the text has `<x>!!!!`, two splits before
/// the last one changed. Keeping all but a prefix's last split gave `<x>` as the text's.
#[test]
fn an_added_token_cut_short_changes_no_token_kept() {
    let model = json!({"type": "WordLevel", "vocab": {"[UNK]": 0, "x": 1, "!": 2},
        "unk_token": "[UNK]"});
    let d = dir(
        "overlap",
        &tokenizer(
            json!([added(3, "<x>"), added(4, "<x>!!!!")]),
            json!(null),
            json!({"type": "Punctuation", "behavior": "Isolated"}),
            model,
        ),
        None,
    );
    let mut chat = load(&d);
    let text = "<x>!!!!".repeat(2_000);
    let (whole, _) = chat.text(&text, usize::MAX).unwrap();
    assert_eq!(whole, [4; 2_000]);
    for want in [1, 2, 10, 500] {
        // The first prefix ends `<x>!!`, after want - 1 whole ones.
        chat.cuts.min_prefix = 7 * (want - 1) + 5;
        chat.cuts.bytes_per_token = 0;
        assert_eq!(chat.text(&text, want).unwrap().0, whole[..want], "{want}");
    }
}
