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
//! letter before the run). And an `lstrip` added token past the cut, or cut short by it, takes
//! all the whitespace before it, however long the run: where the pre-tokenizer splits
//! whitespace (Metaspace makes each space a split of its own), the prefix has a split for each
//! space of the run, far from its end, where the whole text has none but the token.
//!
//! The rule ([`kept_splits`]): the first split of the prefix that its end may change is
//! dropped, with every split after it: the first that reaches into the prefix's last `margin`
//! bytes, in the original text or in the normalized one, or, where some added token has
//! `lstrip`, one before it that touches a run of whitespace reaching into those bytes, however
//! far back the run begins (a run of the raw text, where a token that is not normalized is
//! found, or of the normalized piece holding the margin's start, where a normalized one is). So
//! is every split ending less than `margin` bytes before that one begins (a split whose
//! look-ahead ran into it); the rest are kept, and their tokens are the whole text's first
//! tokens. The prefix's last split is never kept. An `rstrip` token needs nothing: the
//! whitespace after it goes into its own split, which begins where the token does (in the whole
//! text too), and reaches the prefix's last `margin` bytes if that whitespace does. `margin` is
//! [`MARGIN`] bytes more than the longest added token, far more than any released tokenizer's
//! look-ahead. The limit of the rule: a tokenizer whose pre-tokenizer pattern or normalizer
//! decides a split from more than that past it (no released one we know; `a+b|a` as a Split
//! pattern would) is cut inexactly.
//!
//! A text with few splits (a tokenizer without a pre-tokenizer, as Llama-2's and Mistral's
//! SentencePiece BPE: the text between two added tokens is one split; or one pre-tokenizer piece
//! of megabytes) keeps few tokens from a prefix, so prefixes twice as long are tried, up to the
//! whole text, tokenized whole as it always was, exactly. Only a text longer than
//! [`UNCUT_MAX`] bytes (or than the first prefix, if longer) whose prefix of that length keeps
//! no more than the tokens asked for is refused, with an error that says why (no
//! pre-tokenizer, one piece the pre-tokenizer does not split, a run of whitespace an `lstrip`
//! token may take, tokens few for their bytes, nothing to tokenize): tokenizing it whole is
//! what aborted the process, and neither dropping nor cutting it could be told apart from the
//! tokens the user asked for.

use tokenizers::normalizer::Range;
use tokenizers::{
    Encoding, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer,
};

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
    /// Some added token takes the whitespace before it (`lstrip`), so that a run of whitespace
    /// near a prefix's end is not kept (`rstrip` needs nothing: the module's doc says why).
    pub lstrip: bool,
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
            lstrip: lstrip_tokens(tokenizer).next().is_some(),
            uncut_max: UNCUT_MAX,
            min_prefix: MIN_PREFIX,
            bytes_per_token: PREFIX_BYTES_PER_TOKEN,
        }
    }
}

/// The added tokens that take the whitespace before them (`lstrip`), by id.
fn lstrip_tokens(tokenizer: &Tokenizer) -> impl Iterator<Item = &str> {
    let mut tokens: Vec<_> = tokenizer
        .get_added_vocabulary()
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.lstrip)
        .map(|(&id, t)| (id, t.content.as_str()))
        .collect();
    tokens.sort_unstable();
    tokens.into_iter().map(|(_, t)| t)
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
        let kept = kept_splits(tokenizer, prefix, cuts.margin, cuts.lstrip)?;
        // A prefix that keeps no split is not handed to the model (a text of one piece).
        let mut tokens = 0;
        if kept.splits > 0 {
            let enc = encode(tokenizer, prefix, offsets, true)?;
            tokens = enc
                .get_word_ids()
                .iter()
                .take_while(|w| w.is_some_and(|w| (w as usize) < kept.splits))
                .count();
            if tokens > want {
                return Ok(first(&enc, want, offsets, true));
            }
        }
        if len >= limit {
            let why = why_uncut(tokenizer, cuts, cut, kept.stop, tokens);
            return Err(format!(
                "{what} is {} bytes, and its first {want} tokens cannot be told from its first {cut} bytes alone: {why}. A text that long is refused rather than tokenized whole (the tokenizer keeps some 20 bytes for each of its bytes): leave it out, or split it into shorter records, of at most {cut} bytes each",
                text.len()
            ));
        }
        len = len.saturating_mul(2).min(limit);
    }
}

/// Why a text's first tokens cannot be told from its prefix of `cut` bytes, the longest
/// tokenized: its splits kept hold only `tokens` tokens, for `stop` ([`Kept::stop`]).
fn why_uncut(
    tokenizer: &Tokenizer,
    cuts: Cuts,
    cut: usize,
    stop: Option<Stop>,
    tokens: usize,
) -> String {
    let told = |before: usize| match tokens {
        0 => "none of its tokens can be told".to_string(),
        n => format!("only the {n} tokens before byte {before} can be told"),
    };
    match stop {
        None => format!(
            "its tokenizer's normalizer and pre-tokenizer leave nothing of its first {cut} bytes to tokenize (whitespace that a pre-tokenizer drops, say), so no token can be told from them"
        ),
        Some(Stop::Whitespace { split, run }) => {
            let mut lstrip = lstrip_tokens(tokenizer);
            let first = lstrip.next().unwrap_or_default();
            let tokens = match lstrip.count() {
                0 => format!("added token {first:?} takes the whitespace before it"),
                n => format!("added tokens {first:?} and {n} more take the whitespace before them"),
            };
            format!(
                "it is all whitespace from byte {run} to within {} bytes of byte {cut} (in the text or once normalized), and its tokenizer's {tokens} (lstrip): one after the run would take the run whole, so the run's tokens depend on what follows it, and {}",
                cuts.margin,
                told(split)
            )
        }
        Some(Stop::End { from, to }) => {
            let bytes = match to == cut {
                true => format!("bytes {from} to {to} and maybe past"),
                false => format!("bytes {from} to {to}"),
            };
            if tokenizer.get_pre_tokenizer().is_none() {
                format!(
                    "its tokenizer has no pre-tokenizer (as Llama-2's and Mistral's), so the text between two added tokens is one piece, tokenized whole, and {bytes} are one such piece; {}",
                    told(from)
                )
            } else if to.saturating_sub(from) > cuts.margin {
                format!(
                    "its tokenizer's pre-tokenizer does not split {bytes} (a run of one letter, say), and a piece's tokens depend on where it ends; {}",
                    told(from)
                )
            } else {
                format!(
                    "its tokens are few for its length: {}, about one for every {} bytes, and the pieces after them may change with where it is cut",
                    told(from),
                    from / tokens.max(1)
                )
            }
        }
    }
}

/// What a prefix keeps of its splits ([`kept_splits`]).
struct Kept {
    /// How many of its first splits are splits of any text it begins, with the same tokens.
    splits: usize,
    /// Why the next split is not kept; None: the prefix has no split.
    stop: Option<Stop>,
}

/// Why a split of a prefix and all after it are not kept ([`kept_splits`]).
#[derive(Clone, Copy)]
enum Stop {
    /// It is bytes `from` to `to` of the prefix, and reaches into its last `margin` bytes (in
    /// the text or normalized).
    End { from: usize, to: usize },
    /// It begins at byte `split` and touches a run of whitespace (in the text or normalized)
    /// from byte `run` into the prefix's last `margin` bytes, which an `lstrip` added token may
    /// take.
    Whitespace { split: usize, run: usize },
}

/// How many of the splits `prefix` is tokenized in (the tokenizer's own added-token split,
/// normalizer and pre-tokenizer) are splits of any text it begins, with the same tokens: those
/// ending `margin` bytes before the first split that reaches into the prefix's last `margin`
/// bytes (the module's doc says why), in the original and in the normalized text, or, where
/// `lstrip`, that touches a run of whitespace reaching into them.
fn kept_splits(
    tokenizer: &Tokenizer,
    prefix: &str,
    margin: usize,
    lstrip: bool,
) -> Result<Kept, String> {
    handed(prefix.len());
    let mut pre = tokenizer
        .get_added_vocabulary()
        .extract_and_normalize(tokenizer.get_normalizer(), prefix);
    let o_end = prefix.len();
    let whitespace = if lstrip {
        whitespace_reaching(&mut pre, prefix, o_end.saturating_sub(margin))?
    } else {
        o_end
    };
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
        return Ok(Kept {
            splits: 0,
            stop: None,
        });
    };
    let reach = spans
        .iter()
        .position(|&((_, o), (_, n))| o + margin > o_end || n + margin > n_end)
        .unwrap_or(spans.len() - 1);
    // A split touching the run of whitespace goes with it, even one that begins before it: in
    // the whole text the added token's piece begins where the run does.
    let taken = spans
        .iter()
        .position(|&((_, o), _)| o > whitespace)
        .filter(|&t| t < reach);
    let first = taken.unwrap_or(reach);
    let ((o_from, o_to), (n_from, _)) = spans[first];
    Ok(Kept {
        splits: spans[..first]
            .iter()
            .take_while(|&&((_, o), (_, n))| o + margin <= o_from && n + margin <= n_from)
            .count(),
        stop: Some(match taken {
            Some(_) => Stop::Whitespace {
                split: o_from,
                run: whitespace,
            },
            None => Stop::End {
                from: o_from,
                to: o_to,
            },
        }),
    })
}

/// Where the run of whitespace reaching byte `zone` of `prefix` begins (a byte of the prefix;
/// `prefix.len()` if none does), in the original text or in the normalized one: an `lstrip`
/// added token found past `zone` in the whole text (one cut short, or past the prefix's end)
/// takes the whitespace before it however far it runs, in the raw text if it is matched there,
/// in its normalized piece if it is a normalized one. `pre` is the prefix with its added tokens
/// found and its pieces normalized, not yet pre-tokenized.
///
/// The raw text before `zone` is the whole text's, and so is each normalized piece ending
/// before it (a piece is normalized alone, and one that ends at an added token before `zone`
/// ends there in the whole text too); but the normalized text of the piece holding `zone` may
/// differ after it (a normalizer's look-ahead), so a run is taken to reach `zone` if it comes
/// to it, wherever it goes after. (An `rstrip` token needs nothing: the module's doc says why.)
fn whitespace_reaching(
    pre: &mut PreTokenizedString,
    prefix: &str,
    zone: usize,
) -> Result<usize, String> {
    let mut zone = zone;
    while !prefix.is_char_boundary(zone) {
        zone -= 1;
    }
    let mut from = prefix[..zone].trim_end_matches(char::is_whitespace).len();
    if from == zone {
        from = prefix.len();
    }
    // The piece holding `zone`, normalized: a pass that leaves every piece as it is.
    pre.split(|_, piece| {
        let (start, end) = piece.offsets_original();
        if start < zone && zone < end {
            let s = piece.get();
            let z = piece
                .convert_offsets(Range::Original(zone - start..end - start))
                .map_or(s.len(), |r| r.start);
            let mut z = z.min(s.len());
            while !s.is_char_boundary(z) {
                z -= 1;
            }
            let q = s[..z].trim_end_matches(char::is_whitespace).len();
            if q < z {
                if let Some(r) = piece.convert_offsets(Range::Normalized(q..z)) {
                    from = from.min(start + r.start);
                }
            }
        }
        Ok::<_, tokenizers::Error>(std::iter::once(piece))
    })
    .map_err(|e| format!("the tokenizer failed: {e}"))?;
    Ok(from)
}
