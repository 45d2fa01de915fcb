//! Helpers shared by the benchmark programs.

/// The median of `v` (`ring_stat::numbers::median`; NaN for none, which a table prints as
/// such): benchmarks quote medians of runs.
pub fn median(v: Vec<f64>) -> f64 {
    ring_stat::numbers::median(v).unwrap_or(f64::NAN)
}
