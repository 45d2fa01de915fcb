//! Helpers shared by the benchmark programs.

/// The median of `v` (the upper one of an even count; NaN for none): benchmarks quote medians
/// of runs.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
