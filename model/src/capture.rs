//! Which target layers a drafter conditions on.

use crate::{ModelError, Result};

/// SpecForge's `build_target_layer_ids`: for a drafter of `draft_layers` layers on a target of
/// `target_layers`, `[L // 2]` for one layer, else `round(1 + i * (L - 4) / (n - 1))` for
/// `i = 0..n`, rounded as Python's `round` does (half to even). Qwen3-8B (36 layers) with 5
/// drafter layers gives `[1, 9, 17, 25, 33]`.
pub fn default_layer_ids(target_layers: usize, draft_layers: usize) -> Result<Vec<usize>> {
    if draft_layers == 0 {
        return Err(ModelError::Input(
            "a drafter needs at least one layer".into(),
        ));
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
        if id < 0.0 || id >= target_layers as f64 {
            return Err(ModelError::Input(format!(
                "a target of {target_layers} decoder layers is too shallow for SpecForge's layer rule with {draft_layers} captured layers: set target_layer_ids"
            )));
        }
        out.push(id as usize);
    }
    Ok(out)
}

/// Checks explicit layer ids against a target of `target_layers` layers.
pub fn check_layer_ids(ids: &[usize], target_layers: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(ModelError::Input("target_layer_ids is empty".into()));
    }
    match ids.iter().find(|&&l| l >= target_layers) {
        Some(&layer) => Err(ModelError::Layer {
            layer,
            layers: target_layers,
        }),
        None => Ok(()),
    }
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
        assert!(matches!(
            check_layer_ids(&[1, 8], 8),
            Err(ModelError::Layer {
                layer: 8,
                layers: 8
            })
        ));
    }
}
