//! The first tokens of a long text taken from a prefix of it, exactly the whole text's first
//! tokens, so that a record of hundreds of MB costs the tokenizer what its first tokens do, not
//! some 20 bytes of bookkeeping for each of its bytes (which aborted the process on a 200 MB
//! text).
//!
//! Why a prefix's tokens can be the whole text's: HF's `tokenizers` encodes in stages (its
//! `encode_single_sequence`), and the model sees each pre-tokenized split alone:
//! 1. the added tokens (`<|im_start|>`, ...) are found in the raw text, leftmost-longest (a
//!    `single_word` one judged by the characters around it, an `lstrip`/`rstrip` one taking the
//!    spaces beside it); the pieces between them are normalized, and normalized added tokens
//!    are found in those;
//! 2. the pre-tokenizer cuts each remaining piece into splits (a regex, Metaspace's `▁`,
//!    whitespace, ...);
//! 3. the model (BPE, Unigram, WordPiece, WordLevel alike) tokenizes each split's string on its
//!    own, and the encoding is the splits' tokens in order (a token's word id is its split's
//!    index).
//!
//! So where a prefix's first splits are the whole text's first splits, their tokens are the
//! whole text's first tokens. Every stage decides a split from the text at and a short way past
//! it (an added token's length, a regex's look-ahead: GPT-2's `'ll` or `\s+(?!\S)`, Llama-3's
//! and Qwen's alike), so a split is decided alike in the prefix and in the whole text unless
//! the prefix's end is within that look-ahead: a word cut in two, `we'll` cut to `we'l` (GPT-2's
//! pattern then makes `'` and `l` where the text has `'ll`: two splits changed, not one), an
//! added token cut short. Such a changed split may begin far before the end: a run of letters,
//! spaces or combining marks that reaches it (NFC composes the marks after the cut with the
//! letter before the run), or the spaces an `lstrip` added token took, which changes the split
//! before it.
//!
//! The rule ([`kept_splits`]): the first split of the prefix that reaches into its last
//! `margin` bytes, in the original text or in the normalized one, and every split after it are
//! dropped; so is every split ending less than `margin` bytes before that one begins (a split
//! whose look-ahead ran into it); the rest are kept, and their tokens are the whole text's
//! first tokens. The prefix's last split is never kept. `margin` is [`MARGIN`] bytes more than
//! the longest added token, far more than any released tokenizer's look-ahead. The limit of the
//! rule: a tokenizer whose pre-tokenizer pattern or normalizer decides a split from more than
//! that past it (no released one we know; `a+b|a` as a Split pattern would) is cut inexactly.
//!
//! A text with few splits (a tokenizer without a pre-tokenizer, as Llama-2's and Mistral's
//! SentencePiece BPE: the text between two added tokens is one split; or one pre-tokenizer piece
//! of megabytes) keeps few tokens from a prefix, so prefixes twice as long are tried, up to the
//! whole text, tokenized whole as it always was, exactly. Only a text longer than
//! [`UNCUT_MAX`] bytes (or than the first prefix, if longer) that has no place to be cut exactly
//! within them is refused, with an error: tokenizing it whole is what aborted the process, and
//! neither dropping nor cutting it could be told apart from the tokens the user asked for.

use tokenizers::{Encoding, OffsetReferential, OffsetType, PreTokenizer, Tokenizer};

/// Bytes of a long text tokenized first, per token wanted: more than most tokenizers' mean
/// (about 4 for English text), so that one prefix usually holds the tokens wanted.
const PREFIX_BYTES_PER_TOKEN: usize = 16;

/// The shortest prefix of a text tokenized alone: a text up to this long is tokenized whole.
const MIN_PREFIX: usize = 64 << 10;

/// Bytes before a prefix's end (besides the longest added token) within which a split is taken
/// to depend on where the prefix ends: look-aheads of released tokenizers are a few characters.
pub(super) const MARGIN: usize = 1 << 10;

/// The longest text tokenized whole (or as one prefix) when it cannot be cut exactly: some
/// 20 bytes of the tokenizer's bookkeeping per byte, 640 MB. Longer texts that cannot be cut
/// are refused.
pub(super) const UNCUT_MAX: usize = 32 << 20;

/// The first tokens of a text ([`first_tokens`]).
pub(super) struct First {
    pub ids: Vec<u32>,
    /// Character offsets of `ids`, when asked for.
    pub offsets: Vec<(usize, usize)>,
    /// The text has more tokens than `ids`.
    pub more: bool,
}

/// How a tokenizer's long texts are cut: its margin, the longest text tokenized uncut, and the
/// first prefix's length (tests shrink these to cut short texts at many places).
#[derive(Clone, Copy, Debug)]
pub(super) struct Cuts {
    pub margin: usize,
    pub uncut_max: usize,
    pub min_prefix: usize,
    pub bytes_per_token: usize,
}

impl Cuts {
    pub fn of(tokenizer: &Tokenizer) -> Cuts {
        let longest = tokenizer
            .get_added_vocabulary()
            .get_vocab()
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0);
        Cuts {
            margin: MARGIN + longest,
            uncut_max: UNCUT_MAX,
            min_prefix: MIN_PREFIX,
            bytes_per_token: PREFIX_BYTES_PER_TOKEN,
        }
    }
}

#[cfg(test)]
thread_local! {
    /// The longest text this thread handed the tokenizer (tests bound what a record costs).
    pub(super) static LONGEST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Notes that the tokenizer is handed `len` bytes (tests only).
fn handed(_len: usize) {
    #[cfg(test)]
    LONGEST.with(|l| l.set(l.get().max(_len)));
}

/// Encodes `s` without special tokens: character offsets when `offsets`, else byte offsets when
/// `words` (for the word ids), else ids alone.
fn encode(tokenizer: &Tokenizer, s: &str, offsets: bool, words: bool) -> Result<Encoding, String> {
    handed(s.len());
    if offsets {
        tokenizer.encode_char_offsets(s, false)
    } else if words {
        tokenizer.encode(s, false)
    } else {
        tokenizer.encode_fast(s, false)
    }
    .map_err(|e| format!("the tokenizer failed: {e}"))
}

/// The first `want` tokens of `enc`.
fn first(enc: &Encoding, want: usize, offsets: bool, more: bool) -> First {
    let n = want.min(enc.len());
    First {
        ids: enc.get_ids()[..n].to_vec(),
        offsets: if offsets {
            enc.get_offsets()[..n].to_vec()
        } else {
            Vec::new()
        },
        more,
    }
}

/// The first `want` tokens of `text` (`what` names it in an error), with their character
/// offsets when `offsets`, and whether it has more, tokenizing as little of it as that takes.
///
/// A text longer than both [`MIN_PREFIX`] and `want` tokens' worth of bytes is tokenized a
/// prefix at a time, each twice as long as the one before, until the splits a prefix keeps
/// ([`kept_splits`]) hold more than `want` tokens; the whole text at the latest, if it is at
/// most `cuts.uncut_max` bytes (or the first prefix's length); else it is refused.
pub(super) fn first_tokens(
    tokenizer: &Tokenizer,
    cuts: Cuts,
    text: &str,
    want: usize,
    offsets: bool,
    what: &str,
) -> Result<First, String> {
    let start = want
        .saturating_add(1)
        .saturating_mul(cuts.bytes_per_token)
        .max(cuts.min_prefix);
    let limit = cuts.uncut_max.max(start);
    let mut len = start;
    loop {
        if len >= text.len() {
            let whole = encode(tokenizer, text, offsets, false)?;
            return Ok(first(&whole, want, offsets, whole.len() > want));
        }
        let mut cut = len;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let prefix = &text[..cut];
        let splits = kept_splits(tokenizer, prefix, cuts.margin)?;
        // A prefix that keeps no split is not handed to the model (a text of one piece).
        if splits > 0 {
            let enc = encode(tokenizer, prefix, offsets, true)?;
            let kept = enc
                .get_word_ids()
                .iter()
                .take_while(|w| w.is_some_and(|w| (w as usize) < splits))
                .count();
            if kept > want {
                return Ok(first(&enc, want, offsets, true));
            }
        }
        if len >= limit {
            let why = if tokenizer.get_pre_tokenizer().is_none() {
                "this tokenizer has no pre-tokenizer, so the text between two added tokens is one piece, tokenized whole"
            } else {
                "its tokenizer's pre-tokenizer leaves pieces too long"
            };
            return Err(format!(
                "{what} is {} bytes, and no place within its first {limit} bytes can be cut without changing its first {want} tokens ({why}): a text that long is refused rather than tokenized whole (the tokenizer keeps some 20 bytes for each of its bytes); split it into shorter records or leave it out",
                text.len()
            ));
        }
        len = len.saturating_mul(2).min(limit);
    }
}

/// How many of the splits `prefix` is tokenized in (the tokenizer's own added-token split,
/// normalizer and pre-tokenizer) are splits of any text it begins, with the same tokens: those
/// ending `margin` bytes before the first split that reaches into the prefix's last `margin`
/// bytes (the module's doc says why), in the original and in the normalized text.
fn kept_splits(tokenizer: &Tokenizer, prefix: &str, margin: usize) -> Result<usize, String> {
    handed(prefix.len());
    let mut pre = tokenizer
        .get_added_vocabulary()
        .extract_and_normalize(tokenizer.get_normalizer(), prefix);
    if let Some(p) = tokenizer.get_pre_tokenizer() {
        p.pre_tokenize(&mut pre)
            .map_err(|e| format!("the tokenizer's pre-tokenizer failed: {e}"))?;
    }
    // Each split's (original, normalized) byte ranges; the normalized text is the splits'
    // normalized strings one after another (what the pre-tokenizer removed, left out, so its
    // distances are at most the text's).
    let mut normalized = 0;
    let spans: Vec<((usize, usize), (usize, usize))> = pre
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, original, _)| {
            normalized += s.len();
            (original, (normalized - s.len(), normalized))
        })
        .collect();
    let Some(&(_, (_, n_end))) = spans.last() else {
        return Ok(0);
    };
    let o_end = prefix.len();
    let reach = spans
        .iter()
        .position(|&((_, o), (_, n))| o + margin > o_end || n + margin > n_end)
        .unwrap_or(spans.len() - 1);
    let ((o_from, _), (n_from, _)) = spans[reach];
    Ok(spans[..reach]
        .iter()
        .take_while(|&&((_, o), (_, n))| o + margin <= o_from && n + margin <= n_from)
        .count())
}
