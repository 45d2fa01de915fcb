//! `--trace`: one gradient pass by pass, each pass timed with the device synchronized after
//! it, the memory after it, and on a GPU its device time kernel by kernel (`cuda::cupti`).

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Context;
use candle_core::{Device, Tensor};
use model::dflash::{Dflash, DraftBatch};

const MIB: f64 = (1 << 20) as f64;

/// Memory, in MiB, once `dev` has finished its work: on a GPU `(driver, pool)`, the device's in
/// use as the driver counts it (total less free: the context, and the pool's reservation, which
/// holds freed memory unless HSPIPE_CUDA_FREED_MEMORY=release) and the pool's, allocations alive
/// now and the most alive since the last call (None on a GPU without pools); on the CPU this
/// process's resident size, and no pool.
fn memory(dev: &Device) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    dev.synchronize()?;
    if dev.is_cpu() {
        let rss = worker_runtime::malloc::resident().context("no resident size in /proc")?;
        return Ok((rss as f64 / MIB, None));
    }
    let (free, total) = cuda::cudarc::driver::result::mem_get_info()?;
    let ctx = gpu::candle_cuda::stream(dev)?.context().clone();
    let pool = cuda::pool::usage(&ctx)?;
    cuda::pool::reset_used_high(&ctx)?;
    let pool = pool.map(|u| (u.used as f64 / MIB, u.used_high as f64 / MIB));
    Ok(((total - free) as f64 / MIB, pool))
}

/// One gradient of `parts` (the worker's schedule), each pass of each part timed (the device
/// synchronized after it) and the memory after it printed to stderr; as JSON the times summed by
/// pass and the most memory seen (`peak_mib` the driver's count, `pool_peak_mib` the most the
/// pool's allocations held at once, inside a pass included).
pub(crate) fn trace(
    d: &Dflash,
    ctx: &Tensor,
    parts: &[DraftBatch],
    dev: &Device,
) -> anyhow::Result<serde_json::Value> {
    use model::dflash::Pass;
    let (before, _) = memory(dev)?;
    eprintln!("memory before the gradient: {before:.0} MiB in use");
    // On a GPU, each pass's device time kernel by kernel (CUPTI), where libcupti is found.
    let mut profiler = match dev.is_cpu() {
        true => None,
        false => match cuda::cupti::Profiler::start() {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("the trace goes on without kernel times: {e}");
                None
            }
        },
    };
    let mut kernels: [HashMap<String, (u64, u64)>; 3] = Default::default();
    let mut acc = d.params.grads();
    let (mut i, mut peak, mut pool_peak) = (0, before, None::<f64>);
    let mut by_pass = [
        (Pass::Forward, 0.0),
        (Pass::Loss, 0.0),
        (Pass::Backward, 0.0),
    ];
    d.loss_and_grads_parts(ctx, parts, &mut acc, |pass, f| -> anyhow::Result<()> {
        let t = Instant::now();
        f()?;
        let (mib, pool) = memory(dev)?;
        let s = t.elapsed().as_secs_f64();
        peak = peak.max(mib);
        // `memory` synchronized the device: the pass's kernels have run. A profile that
        // fails stops, not the trace.
        match profiler.as_mut().map(|p| p.take()) {
            Some(Ok(times)) => {
                let at = by_pass.iter().position(|(p, _)| *p == pass).unwrap_or(0);
                for k in times {
                    let e = kernels[at].entry(k.name).or_insert((0, 0));
                    (e.0, e.1) = (e.0 + k.launches, e.1 + k.nanos);
                }
            }
            Some(Err(e)) => {
                eprintln!("the trace goes on without kernel times: {e}");
                profiler = None;
            }
            None => {}
        }
        for (p, sum) in &mut by_pass {
            if *p == pass {
                *sum += s;
            }
        }
        let pool = match pool {
            Some((now, high)) => {
                pool_peak = Some(pool_peak.unwrap_or(0.0).max(high));
                format!("; allocated {now:.0} MiB, at most {high:.0} in the pass")
            }
            None => String::new(),
        };
        eprintln!(
            "part {i} of {}, {pass:?}: {:.1} ms, then {mib:.0} MiB in use{pool}",
            parts.len(),
            s * 1e3
        );
        if pass == Pass::Backward {
            i += 1;
        }
        Ok(())
    })?;
    eprintln!(
        "memory after the gradient: {:.0} MiB in use",
        memory(dev)?.0
    );
    let mut out = serde_json::json!({
        "forward_s": by_pass[0].1,
        "loss_s": by_pass[1].1,
        "backward_s": by_pass[2].1,
        "peak_mib": peak,
        "pool_peak_mib": pool_peak,
    });
    if let Some(p) = profiler {
        if let Err(e) = p.finish() {
            eprintln!("kernel times after the last pass lost: {e}");
        }
        let mut by = serde_json::Map::new();
        for ((pass, _), sums) in by_pass.iter().zip(kernels) {
            let pass = format!("{pass:?}").to_lowercase();
            by.insert(pass.clone(), scripts::kernel_table(&pass, sums));
        }
        out["kernels"] = by.into();
    }
    Ok(out)
}
