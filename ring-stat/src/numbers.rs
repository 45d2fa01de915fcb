//! The few numeric helpers that the verdict, the screen, `launcher report` and the benchmark
//! programs share, written once. They live here because every one of those users already
//! depends on `ring-stat` (or, for the benchmarks, may: they ship nowhere), and neither the
//! transport nor the contracts crate is a place for arithmetic on reports.

/// The median of `values` (the upper one of an even count); None for none.
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// A share (0..=1) as a whole percentage: `0.426` is `43%`.
pub fn pct(share: f64) -> String {
    format!("{:.0}%", share * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_upper_middle_and_none_of_nothing() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(std::iter::empty()), None);
        assert_eq!(pct(0.426), "43%");
    }
}
