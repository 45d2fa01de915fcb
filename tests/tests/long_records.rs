//! Long texts and conversations through make-model's tokenizer (a byte-level BPE with GPT-2's
//! pattern and ChatML's markers as added tokens): what `Chat` makes of them a prefix at a time
//! is exactly the first ids (and mask) of the whole record's tokenization, wherever the
//! prefixes' cuts fall (a contraction, a run of spaces, an added token, a 3-byte character).

use dataset::chat::Message;
use dataset::{Chat, ChatOptions};
use model::make::{make_model, MakeSpec};

use crate::support::TestDir;

/// What a cut may fall in.
const PIECES: &[&str] = &[
    " the quick brown fox",
    " we'll",
    "'s",
    "    ",
    "\n\n",
    " 12345",
    " 日本語",
    " e\u{301}",
    "<|im_start|>",
    "<|im_end|>\n",
    "<think>",
];

/// About `len` bytes of `pieces` in a seeded order, with `at` written so that the first
/// prefixes' cuts (64 KiB, twice, four times that) fall in it, `shift` bytes after its start.
fn text(pieces: &[&str], len: usize, at: &str, shift: usize) -> String {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ shift as u64;
    let mut t = String::new();
    for cut in [64 << 10, 128 << 10, 256 << 10, len] {
        while t.len() + shift < cut {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            t.push_str(pieces[(x % pieces.len() as u64) as usize]);
        }
        if cut < len {
            // Pad to the cut with spaces, then the piece it falls in.
            let mut end = cut - shift;
            while !t.is_char_boundary(end) {
                end -= 1;
            }
            t.truncate(end);
            t.push_str(&" ".repeat(cut - shift - t.len()));
            t.push_str(at);
        }
    }
    t
}

#[test]
fn a_long_text_or_conversation_gives_the_whole_ones_first_tokens_with_the_made_tokenizer() {
    let dir = TestDir::new("longtok");
    let m = dir.path("m");
    make_model(&m, &MakeSpec::default()).unwrap();
    let chat = Chat::load(&m, ChatOptions::default()).unwrap();
    let plain: Vec<&str> = PIECES
        .iter()
        .copied()
        .filter(|p| !p.contains('<'))
        .collect();
    for (pieces, at, shift) in [
        (PIECES, "we'll<|im_start|>", 3),
        (PIECES, "we'll<|im_start|>", 8),
        (&plain[..], " we'll", 3),
        (&plain[..], "        \n\n x", 5),
        (&plain[..], "日本語", 4),
    ] {
        let t = text(pieces, 320 << 10, at, shift);
        let (whole, more) = chat.text(&t, usize::MAX).unwrap();
        assert!(!more && whole.len() > 40_000, "{}", whole.len());
        for want in [1, 100, 4_095, 4_096, 9_000, 30_000, whole.len() - 1] {
            let got = chat.text(&t, want).unwrap();
            assert_eq!(got.0, whole[..want], "{at:?} at +{shift}, want {want}");
            assert!(got.1);
        }
        assert_eq!(chat.text(&t, whole.len()).unwrap(), (whole, false));
    }
    let long = |shift| text(&plain, 100 << 10, " we'll", shift);
    let conversation = [
        Message::new("user", &long(1)),
        Message::new("assistant", &long(2)),
        Message::new("user", "how are you"),
        Message::new("assistant", &long(3)),
    ];
    let whole = chat.conversation(&conversation, None, usize::MAX).unwrap();
    assert_eq!(whole.turns, 2);
    for want in [1, 2, 4_095, 20_000, 30_000, 60_000, whole.ids.len() - 1] {
        let cut = chat.conversation(&conversation, None, want).unwrap();
        assert_eq!(cut.ids, whole.ids[..want], "{want}");
        assert_eq!(cut.mask, whole.mask[..want], "{want}");
        assert!(cut.more, "{want}");
    }
}
