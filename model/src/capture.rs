//! Which target layers a drafter conditions on.

use crate::{ModelError, Result};

/// SpecForge's `build_target_layer_ids`: for a drafter of `draft_layers` layers on a target of
/// `target_layers`, `[L // 2]` for one layer, else `round(1 + i * (L - 4) / (n - 1))` for
/// `i = 0..n`, rounded as Python's `round` does (half to even). Qwen3-8B (36 layers) with 5
/// drafter layers gives `[1, 9, 17, 25, 33]`. A layer the rule gives twice is refused: the
/// drafter would see the same states twice and less of the target.
pub fn default_layer_ids(target_layers: usize, draft_layers: usize) -> Result<Vec<usize>> {
    if draft_layers == 0 {
        return Err(ModelError::Capture(
            "a drafter needs at least one layer".into(),
        ));
    }
    if draft_layers > target_layers {
        return Err(ModelError::Capture(format!(
            "{draft_layers} captured layers, but the model has {target_layers} decoder layers: capture at most {target_layers}"
        )));
    }
    if draft_layers == 1 {
        return Ok(vec![target_layers / 2]);
    }
    let span = target_layers as f64 - 4.0;
    let ids: Vec<f64> = (0..draft_layers)
        .map(|i| (1.0 + i as f64 * span / (draft_layers - 1) as f64).round_ties_even())
        .collect();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        if id < 0.0 || id >= target_layers as f64 || out.last() == Some(&(id as usize)) {
            return Err(ModelError::Capture(format!(
                "a target of {target_layers} decoder layers is too shallow for SpecForge's layer rule with {draft_layers} captured layers (it takes a layer twice or one the model lacks): set target_layer_ids, or fewer layers"
            )));
        }
        out.push(id as usize);
    }
    Ok(out)
}

/// Checks explicit layer ids against a target of `target_layers` layers: some, each in range
/// (what a capture needs; [`check_distinct`] is a choice's check besides).
pub fn check_layer_ids(ids: &[usize], target_layers: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(ModelError::Capture("target_layer_ids is empty".into()));
    }
    if let Some(&layer) = ids.iter().find(|&&l| l >= target_layers) {
        return Err(ModelError::Layer {
            layer,
            layers: target_layers,
        });
    }
    Ok(())
}

/// Checks that explicit layer ids name no layer twice: a drafter would see the same states
/// twice and less of the target. A capture runs with one twice; a new run does not choose it.
pub fn check_distinct(ids: &[usize]) -> Result<()> {
    if let Some((i, &layer)) = (ids.iter().enumerate()).find(|&(i, l)| ids[..i].contains(l)) {
        return Err(ModelError::Capture(format!(
            "target_layer_ids names layer {layer} twice (at {} and {i}): the drafter would see the same states twice",
            ids[..i].iter().position(|&l| l == layer).unwrap_or(0)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specforge_rule() {
        assert_eq!(default_layer_ids(36, 5).unwrap(), [1, 9, 17, 25, 33]);
        assert_eq!(default_layer_ids(36, 1).unwrap(), [18]);
        assert_eq!(default_layer_ids(8, 3).unwrap(), [1, 3, 5]);
        // 1 + 1.5 = 2.5 and 1 + 4.5 = 5.5 round half to even, as Python's round.
        assert_eq!(default_layer_ids(10, 5).unwrap(), [1, 2, 4, 6, 7]);
        assert!(default_layer_ids(2, 3).is_err());
        assert!(default_layer_ids(8, 0).is_err());
        // More captured layers than the model has, or a rule that takes one twice (8 layers,
        // 6 captured: 1 + 2 x 0.8 = 2.6 and 1 + 3 x 0.8 = 3.4 both round to 3).
        let err = default_layer_ids(8, 100).unwrap_err().to_string();
        assert!(
            err.contains("100 captured") && err.contains("has 8 decoder layers"),
            "{err}"
        );
        let err = default_layer_ids(8, 6).unwrap_err().to_string();
        assert!(err.contains("set target_layer_ids"), "{err}");
        assert_eq!(default_layer_ids(8, 5).unwrap(), [1, 2, 3, 4, 5]);
        let err = check_distinct(&[1, 2, 2]).unwrap_err().to_string();
        assert!(err.contains("layer 2 twice"), "{err}");
        check_layer_ids(&[1, 2, 2], 8).unwrap();
        check_layer_ids(&[2, 1], 8).unwrap();
        check_distinct(&[2, 1]).unwrap();
        assert!(matches!(
            check_layer_ids(&[1, 8], 8),
            Err(ModelError::Layer {
                layer: 8,
                layers: 8
            })
        ));
    }
}
