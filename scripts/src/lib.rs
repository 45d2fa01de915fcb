//! Helpers shared by the benchmark programs.

use std::collections::HashMap;

/// The median of `v` (`ring_stat::numbers::median`; NaN for none, which a table prints as
/// such): benchmarks quote medians of runs.
pub fn median(v: Vec<f64>) -> f64 {
    ring_stat::numbers::median(v).unwrap_or(f64::NAN)
}

/// Waits for `pid` and returns its exit code and peak RSS in KiB (the kernel's count).
pub fn wait_rusage(pid: u32) -> anyhow::Result<(i32, u64)> {
    let mut status = 0;
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: wait4 writes the status and the rusage struct, both valid for writes.
    let r = unsafe { libc::wait4(pid as i32, &mut status, 0, ru.as_mut_ptr()) };
    if r != pid as i32 {
        anyhow::bail!("wait4({pid}): {}", std::io::Error::last_os_error());
    }
    // SAFETY: wait4 succeeded, so it filled the struct (zeroed before in any case).
    let ru = unsafe { ru.assume_init() };
    Ok((libc::WEXITSTATUS(status), ru.ru_maxrss as u64))
}

/// CPU seconds this process has used so far, all threads, user and system (the kernel's
/// count, to the microsecond): on a shared machine a measure of work that waiting for a core
/// does not inflate, as wall time is.
pub fn cpu_seconds() -> anyhow::Result<f64> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes the rusage struct, valid for writes.
    let r = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if r != 0 {
        anyhow::bail!("getrusage: {}", std::io::Error::last_os_error());
    }
    // SAFETY: getrusage succeeded, so it filled the struct (zeroed before in any case).
    let ru = unsafe { ru.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Ok(secs(ru.ru_utime) + secs(ru.ru_stime))
}

/// How many kernels a kernel table lists, the longest first.
pub const KERNELS_LISTED: usize = 20;

/// Device time by kernel (`cuda::cupti`'s, as `name -> (launches, nanoseconds)`), for the work
/// `what` names: printed to stderr, and as JSON the total and the longest [`KERNELS_LISTED`]
/// (names cut at 160 characters: cuBLAS's run long).
pub fn kernel_table(what: &str, sums: HashMap<String, (u64, u64)>) -> serde_json::Value {
    let mut rows: Vec<(String, u64, u64)> = sums.into_iter().map(|(n, (l, t))| (n, l, t)).collect();
    rows.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    let total: u64 = rows.iter().map(|r| r.2).sum();
    let launches: u64 = rows.iter().map(|r| r.1).sum();
    eprintln!(
        "{what}: {:.3} s of device time in {launches} launches of {} kernels; the longest:",
        total as f64 * 1e-9,
        rows.len()
    );
    let listed: Vec<serde_json::Value> = (rows.iter().take(KERNELS_LISTED))
        .map(|(name, launches, nanos)| {
            let name: String = name.chars().take(160).collect();
            eprintln!(
                "  {:>8.3} s {:>5.1}% {launches:>7}x  {name}",
                *nanos as f64 * 1e-9,
                100.0 * *nanos as f64 / total.max(1) as f64
            );
            serde_json::json!({"name": name, "launches": launches, "s": *nanos as f64 * 1e-9})
        })
        .collect();
    serde_json::json!({
        "device_s": total as f64 * 1e-9,
        "launches": launches,
        "kernels": rows.len(),
        "longest": listed,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A pass's kernels: the total over all of them, the longest first, at most
    /// [`KERNELS_LISTED`], long names cut.
    #[test]
    fn a_pass_lists_its_longest_kernels_and_the_total_of_all() {
        let mut sums: HashMap<String, (u64, u64)> = (0..30)
            .map(|i| (format!("k{i:02}"), (2, 1_000_000 * (i + 1))))
            .collect();
        sums.insert("x".repeat(300), (1, 500_000_000));
        let t = kernel_table("backward", sums);
        let all: u64 = (1..=30).map(|i| 1_000_000 * i).sum::<u64>() + 500_000_000;
        assert!((t["device_s"].as_f64().unwrap() - all as f64 * 1e-9).abs() < 1e-12);
        assert_eq!(t["launches"], 61);
        assert_eq!(t["kernels"], 31);
        let longest = t["longest"].as_array().unwrap();
        assert_eq!(longest.len(), KERNELS_LISTED);
        assert_eq!(longest[0]["name"].as_str().unwrap().len(), 160);
        assert_eq!(longest[1]["name"], "k29");
        assert_eq!(longest[1]["launches"], 2);
        assert!((longest[1]["s"].as_f64().unwrap() - 0.03).abs() < 1e-12);
    }
}
