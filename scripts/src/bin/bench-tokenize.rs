//! BENCHMARKS.md, "Conversations": HF `tokenizers` as `launcher prepare` runs it (encode with
//! character offsets, no special tokens added), on one thread, over rendered texts: what the
//! preparing spends most of its time in. `scripts/py/bench_chat.py encode` runs it beside
//! Python's `tokenizers` on the same texts; built with `--features onig`, the pre-tokenizer's
//! regex is Oniguruma's (what Python's wheel uses) instead of fancy-regex.
//!
//! Usage: bench-tokenize TOKENIZER_JSON TEXTS_JSON (a JSON list of strings); prints
//! `{"seconds": .., "tokens": ..}`.

use std::time::Instant;

use anyhow::{anyhow, Context};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [tokenizer, texts] = args.as_slice() else {
        anyhow::bail!("usage: bench-tokenize TOKENIZER_JSON TEXTS_JSON");
    };
    let tok =
        tokenizers::Tokenizer::from_file(tokenizer).map_err(|e| anyhow!("{tokenizer}: {e}"))?;
    let texts: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(texts).with_context(|| format!("reading {texts}"))?,
    )?;
    let t = Instant::now();
    let mut tokens = 0;
    for text in &texts {
        let e = tok
            .encode_char_offsets(text.as_str(), false)
            .map_err(|e| anyhow!("encoding: {e}"))?;
        tokens += e.get_ids().len();
    }
    let seconds = t.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({ "seconds": seconds, "tokens": tokens })
    );
    Ok(())
}
