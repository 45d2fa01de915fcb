//! Greedy speculative decoding with a DFlash drafter, as the DFlash authors run it: the drafter
//! proposes a block from the target's context features, the target verifies the block in one
//! forward, the accepted prefix and the target's own next token are appended, repeat.
//!
//! Each round recomputes the target over the whole sequence (no KV cache): the tiny and
//! mid-size models this runs on in CPU tests cost little, and a cache would be a second forward
//! to keep equal to the first. The output is, by construction, the target's greedy decoding;
//! [`greedy`] computes that directly so a caller can check it token for token.

use candle_core::{DType, Tensor};

use crate::dflash::{Dflash, SeqBlocks};
use crate::{Decoder, ModelError, Need, Result};

/// What one speculative generation did.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The generated tokens (after the prompt), at most `max_new`.
    pub tokens: Vec<u32>,
    /// Tokens appended per target forward after the prefill (accepted drafts + 1), one per
    /// verification.
    pub accept_lengths: Vec<usize>,
}

/// The captured layers of `ids` side by side, `[tokens, layers * hidden]`, and the greedy next
/// token after every position.
fn target_pass(
    target: &Decoder,
    layers: &[usize],
    ids: &[u32],
) -> Result<(Option<Tensor>, Vec<u32>)> {
    let out = target.forward(
        ids,
        &[ids.len() as u32],
        &Need {
            layers,
            final_hidden: false,
            tokens: true,
        },
    )?;
    // The drafter conditions on f32 states, whatever the target computes in (bf16 on a GPU).
    let ctx = (!layers.is_empty())
        .then(|| Tensor::cat(&out.layers, 1).and_then(|c| c.to_dtype(DType::F32)))
        .transpose()?;
    let tokens = out
        .token_ids()?
        .ok_or_else(|| ModelError::Input("the target produced no tokens".into()))?;
    Ok((ctx, tokens))
}

/// That a generation stays within the positions the target runs as HF does
/// ([`ArchConfig::positions`]): the prompt, the new tokens, and a block drafted past them.
/// RoPE computes any position, so past `max_position_embeddings` (or a sliding window) the
/// output would be wrong without a word. The error says how far it reaches.
pub fn check_reach(
    prompt_len: usize,
    max_new: usize,
    block_size: usize,
    target: &crate::ArchConfig,
) -> std::result::Result<(), String> {
    let reach = prompt_len
        .saturating_add(max_new)
        .saturating_add(block_size);
    if reach > target.positions() {
        return Err(format!(
            "a prompt of up to {prompt_len} tokens + {max_new} new tokens + a drafted block of {block_size} reach {reach} positions, past the target's {}",
            target.positions_bound()
        ));
    }
    Ok(())
}

/// The target's own greedy continuation of `prompt`, `max_new` tokens, one forward per token.
pub fn greedy(target: &Decoder, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
    let mut ids = prompt.to_vec();
    for _ in 0..max_new {
        let (_, tokens) = target_pass(target, &[], &ids)?;
        ids.push(*tokens.last().expect("a non-empty sequence"));
    }
    Ok(ids[prompt.len()..].to_vec())
}

/// `max_new` tokens after `prompt` by speculative decoding with `drafter` on `target`.
pub fn speculative(
    target: &Decoder,
    drafter: &Dflash,
    prompt: &[u32],
    max_new: usize,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(ModelError::Input("an empty prompt".into()));
    }
    // A drafter of another model would read layers or tokens the target does not have.
    (drafter.cfg)
        .check_target(target.config())
        .map_err(ModelError::Drafter)?;
    let layers = &drafter.cfg.target_layer_ids;
    let b = drafter.cfg.block_size;
    let mask = drafter.cfg.mask_token_id;
    // `ids` is verified; `next` is the target's token after it, verified but not yet run.
    let mut ids = prompt.to_vec();
    let (ctx, tokens) = target_pass(target, layers, &ids)?;
    let no_layers = || ModelError::Input("the drafter conditions on no target layer".into());
    let mut ctx = ctx.ok_or_else(no_layers)?;
    let mut next = *tokens.last().expect("a non-empty prompt");
    let mut out = Generation {
        tokens: Vec::new(),
        accept_lengths: Vec::new(),
    };
    while out.tokens.len() < max_new {
        let n = ids.len();
        let mut block = vec![mask; b];
        block[0] = next;
        let seqs = [SeqBlocks {
            ctx_start: 0,
            ctx_len: n,
            anchors: vec![n as u32],
        }];
        let drafted = drafter.predict(&ctx, &block, &seqs)?;
        block[1..].copy_from_slice(&drafted[1..]);
        let mut run = ids.clone();
        run.extend_from_slice(&block);
        let (feats, greedy) = target_pass(target, layers, &run)?;
        // Draft k (block position k >= 1) stands if every earlier one did and the target, after
        // the position before it, says the same.
        let accepted = (1..b)
            .take_while(|&k| block[k] == greedy[n + k - 1])
            .count();
        let appended = &block[..=accepted];
        ids.extend_from_slice(appended);
        out.tokens.extend_from_slice(appended);
        next = greedy[n + accepted];
        ctx = feats.ok_or_else(no_layers)?.narrow(0, 0, ids.len())?;
        out.accept_lengths.push(accepted + 1);
    }
    out.tokens.truncate(max_new);
    Ok(out)
}
