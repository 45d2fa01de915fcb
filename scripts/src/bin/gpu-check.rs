//! The device check of the data path (`scripts/gpu-check.sh` runs it): on one GPU, with a real
//! ring in `/dev/shm`, it answers whether hidden states can cross from the ring to the GPU and
//! back at full speed while the GPU computes.
//!
//! Length: one program for one check a GPU machine runs at once; its parts share the ring, the
//! device, the streams and the timer.
//!
//! 1. The ring's payload arena is registered as pinned memory in place (`cuMemHostRegister`).
//! 2. Copy bandwidth, host-to-device and device-to-host, from a ring slot (registered), from
//!    ordinary pageable memory, and from the driver's own pinned memory (`cuMemAllocHost`, the
//!    reference): medians of CUDA-event times.
//! 3. The bytes of a batch taken from the ring arrive intact (summed on the device).
//! 4. Copies overlap compute: a kernel of about twice a copy's length runs on one stream while
//!    a slot is copied on another, in each direction; the share of the copy hidden under the
//!    kernel is measured from events, and so is the drafter's double-buffered loop (step `s`
//!    computing while batch `s+1` is copied in; `gpu::prefetch` on the CUDA engine, the logic
//!    the CPU tests check with a copy thread), as the GPU's busy share against the same loop
//!    on one stream; and the target's loop (the forward of batch `i+1` while batch `i` is
//!    copied out into its ring slot, committed once complete; `gpu::writeback`).
//! 5. NCCL, if found (`libnccl.so.2` on the loader's path): a one-rank communicator, an
//!    all-reduce that must return its input, an abort (one GPU is all a check can count on).
//!
//! The driver and NCCL are cudarc's, loaded at run time behind the `cuda` crate's presence
//! check: cudarc finds them by name through the dynamic loader (`LD_LIBRARY_PATH` for one
//! outside its path); `HSPIPE_LIBCUDA` and `HSPIPE_LIBNCCL`, which used to name a path, are
//! refused when set.
//!
//! Exit status: 0 every check passed; 1 a check failed (named); 2 no CUDA driver or device
//! (nothing was checked); 64 a usage error. `--json PATH` writes every figure.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Parser;
use cuda::nccl::Nccl;
use cuda::probe::Probe;
use cuda::{CudaContext, CudaEvent, CudaSlice, CudaStream, Driver, HostCopy, Named, Registered};
use gpu::cuda_copy::{CudaCopy, CudaCopyOut};
use gpu::prefetch::{Prefetch, PushError, StableBytes};
use gpu::timeline::Use;
use gpu::writeback::WriteBack;
use scripts::median;
use serde_json::json;
use shm_ring::{CommitMeta, Ring, RingParams, TakePolicy};

#[derive(Parser)]
#[command(
    about = "Checks the CUDA data path on one GPU: pinned ring arena, copy bandwidth, overlap",
    after_help = "The NVIDIA driver (libcuda.so.1) and NCCL (libnccl.so.2) are found by name \
                  through the dynamic loader: put a directory outside its path on \
                  LD_LIBRARY_PATH. HSPIPE_LIBCUDA and HSPIPE_LIBNCCL no longer name a library \
                  and are refused when set.\n\nExit status: 0 every check passed, 1 a check \
                  failed, 2 no CUDA driver or GPU (nothing checked), 64 a usage error."
)]
struct Args {
    /// GPU ordinal (after CUDA_VISIBLE_DEVICES).
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Size of one ring slot, which is also the size of every copy, in MiB (the design's
    /// batches are 200-800 MiB).
    #[arg(long, default_value_t = 256)]
    slot_mib: u64,
    /// Timed repetitions of each copy; the report gives medians.
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// Steps of the double-buffered loop.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Writes every figure as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const MIB: usize = 1 << 20;

/// A usage error's exit status: not clap's 2, which here means "no driver or GPU".
const USAGE: u8 = 64;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        // --help and --version print and succeed.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(USAGE);
        }
    };
    let driver = match Driver::load() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu-check: {e}: nothing to check on this machine");
            return ExitCode::from(2);
        }
    };
    let dev = match driver.open(args.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu-check: {e}: nothing to check on this machine");
            return ExitCode::from(2);
        }
    };
    match check(&driver, &dev, &args) {
        Ok(failed) if failed.is_empty() => {
            println!("gpu-check: every check passed");
            ExitCode::SUCCESS
        }
        Ok(failed) => {
            for f in &failed {
                eprintln!("gpu-check: FAILED: {f}");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("gpu-check: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs every check; returns the failed ones by name.
fn check(driver: &Driver, dev: &Arc<CudaContext>, args: &Args) -> anyhow::Result<Vec<String>> {
    let mut failed = Vec::new();
    let (major, minor) = driver.version();
    println!(
        "device {}: {} (driver for CUDA {major}.{minor}, {} copy engines)",
        dev.ordinal(),
        dev.name().named("cuDeviceGetName")?,
        cuda::copy_engines(dev)?
    );
    let len = usize::try_from(args.slot_mib)
        .ok()
        .and_then(|m| m.checked_mul(MIB))
        .context("--slot-mib is too large for this machine")?;
    if len == 0 || args.reps == 0 || args.steps < 2 {
        bail!("--slot-mib and --reps must be positive and --steps at least 2");
    }

    // The ring, as a launcher makes it: one producer (this process) and one consumer holding
    // two batches (the one computing and the one being copied in).
    let name = format!("hspipe-gpucheck-{}", std::process::id());
    let ring = Ring::create(
        &name,
        &RingParams {
            slots: 4,
            slot_size: len as u64,
            buckets: 1,
            producers: 1,
            consumers: 1,
            held_per_consumer: 2,
            policy: TakePolicy::Fifo,
            seed: 0,
            work_items: 0,
        },
    )
    .with_context(|| format!("creating ring {name} of 4 x {} MiB", args.slot_mib))?;
    let (arena, arena_len) = ring.payload_arena();
    // SAFETY: the arena stays mapped while `ring` lives; `pinned` is declared after `ring` and
    // so dropped (unregistered) before it.
    let pinned = match unsafe { Registered::new(dev, arena, arena_len) } {
        Ok(p) => {
            println!("ring arena: {} MiB registered as pinned", arena_len / MIB);
            Some(p)
        }
        Err(e) => {
            println!("ring arena: NOT pinned ({e}); copies fall back to pageable speed");
            failed.push(format!("registering the ring arena as pinned memory: {e}"));
            None
        }
    };

    // Two batches published and taken, as a drafter holds them.
    let producer = ring.producer(0)?;
    let consumer = ring.consumer(0)?;
    let mut host_sums = Vec::new();
    for batch in 0..2u64 {
        let mut w = producer.reserve(len)?;
        let p = w.payload_mut();
        for (i, b) in p.iter_mut().enumerate() {
            *b = (i as u64 * 31 + batch * 7) as u8;
        }
        host_sums.push(p.iter().map(|&b| u64::from(b)).sum::<u64>());
        w.commit(CommitMeta {
            bucket: 0,
            tokens: 1,
            batch_id: batch,
        })?;
    }
    let taken = [
        consumer.take()?.context("batch 0 not READY")?,
        consumer.take()?.context("batch 1 not READY")?,
    ];
    if let Some(p) = &pinned {
        for t in &taken {
            if !p.covers(t.payload().as_ptr(), t.payload().len()) {
                failed.push(format!("slot {} lies outside the pinned range", t.slot()));
            }
        }
    }

    let probe = Probe::load(dev)?;
    let copy = dev.new_stream().named("cuStreamCreate")?;
    let compute = dev.new_stream().named("cuStreamCreate")?;
    let device_buffer = || {
        copy.alloc_zeros::<u8>(len)
            .named("allocating a device buffer")
    };
    let mut dbuf = [device_buffer()?, device_buffer()?];
    let timer = Timer::new(dev)?;

    // Bandwidth: ring slot, pageable, driver-pinned; each direction.
    let pageable = vec![1u8; len];
    let mut reference = cuda::alloc_pinned(dev, len, 1)?;
    let reference_src = reference.as_ptr().named("cuEventSynchronize")?;
    let gbs = |ms: f64| len as f64 / (ms / 1e3) / 1e9;
    let mut h2d = Vec::new();
    for (what, src) in [
        ("ring slot", taken[0].payload().as_ptr()),
        ("pageable", pageable.as_ptr()),
        ("cuMemAllocHost", reference_src),
    ] {
        let ms = timer.median(&copy, args.reps, || {
            // SAFETY: every source outlives the timed copy, which is synchronised before the
            // next one (Timer::median waits for each).
            unsafe { copy.copy_h2d(&mut dbuf[0], 0, src, len) }
        })?;
        h2d.push((what, ms, gbs(ms)));
    }
    // Device-to-host into a slot being written, as a target does.
    let mut slot_w = producer.reserve(len)?;
    let mut pageable_w = vec![0u8; len];
    let mut d2h = Vec::new();
    let dsts: [(&str, *mut u8); 3] = [
        ("ring slot", slot_w.payload_mut().as_mut_ptr()),
        ("pageable", pageable_w.as_mut_ptr()),
        (
            "cuMemAllocHost",
            reference.as_mut_ptr().named("cuEventSynchronize")?,
        ),
    ];
    for (what, dst) in dsts {
        let ms = timer.median(&copy, args.reps, || {
            // SAFETY: as above; nothing on the host touches the destination meanwhile.
            unsafe { copy.copy_d2h(dst, &dbuf[0], 0, len) }
        })?;
        d2h.push((what, ms, gbs(ms)));
    }
    println!(
        "copies of {} MiB (median of {}; GB/s):",
        args.slot_mib, args.reps
    );
    for (dir, rows) in [("host->device", &h2d), ("device->host", &d2h)] {
        let line: Vec<String> = rows
            .iter()
            .map(|(w, ms, g)| format!("{w} {g:.1} ({ms:.2} ms)"))
            .collect();
        println!("  {dir}: {}", line.join(", "));
    }
    let slot_vs_ref = |rows: &[(&str, f64, f64)]| rows[0].2 / rows[2].2;
    if pinned.is_some() {
        for (dir, rows) in [("host->device", &h2d), ("device->host", &d2h)] {
            if slot_vs_ref(rows) < 0.8 {
                failed.push(format!(
                    "{dir} from the pinned ring runs at {:.2}x of cuMemAllocHost memory",
                    slot_vs_ref(rows)
                ));
            }
        }
    }

    // Integrity: each taken batch, copied in, sums on the device to what the host wrote.
    let failures_before = failed.len();
    let mut sum = copy
        .alloc_zeros::<u64>(1)
        .named("allocating a device buffer")?;
    for (t, want) in taken.iter().zip(&host_sums) {
        copy.copy_h2d_sync(&mut dbuf[0], 0, t.payload())?;
        copy.memset_zeros(&mut sum).named("cuMemsetD8Async")?;
        probe.byte_sum(&copy, &dbuf[0], len, &mut sum)?;
        let got = copy.clone_dtoh(&sum).named("cuMemcpyDtoHAsync")?;
        copy.synchronize().named("cuStreamSynchronize")?;
        let got = got[0];
        if got != *want {
            failed.push(format!(
                "batch {} summed to {got} on the device, {want} on the host",
                t.meta().batch_id
            ));
        }
    }
    if failed.len() == failures_before {
        println!("integrity: both batches arrived intact (byte sums equal)");
    }

    // NCCL, the group's collective across GPUs: loaded, a one-rank communicator (one GPU is
    // all a check can count on), an all-reduce whose result must equal its input, an abort.
    let nccl = match nccl_check(dev, &copy, &timer, &mut dbuf, len, args.reps) {
        Ok(v) => v,
        Err(e) => {
            failed.push(format!("NCCL: {e:#}"));
            json!({"error": format!("{e:#}")})
        }
    };

    // A kernel about twice a copy long.
    let copy_ms = h2d[0].1;
    let cycles = timer.calibrate_spin(&probe, &compute, 2.0 * copy_ms)?;

    // Overlap of one copy with one kernel, each direction.
    let mut overlap = Vec::new();
    for dir in ["host->device", "device->host"] {
        let e = events(dev, 4)?;
        record(&e[0], &compute)?;
        probe.spin(&compute, cycles)?;
        record(&e[1], &compute)?;
        copy.wait(&e[0]).named("cuStreamWaitEvent")?;
        record(&e[2], &copy)?;
        if dir == "host->device" {
            // SAFETY: the slot is held until after the synchronise below.
            unsafe { copy.copy_h2d(&mut dbuf[1], 0, taken[1].payload().as_ptr(), len)? };
        } else {
            // SAFETY: the reserved slot is written by nothing else until the synchronise.
            unsafe { copy.copy_d2h(slot_w.payload_mut().as_mut_ptr(), &dbuf[1], 0, len)? };
        }
        record(&e[3], &copy)?;
        copy.synchronize().named("cuStreamSynchronize")?;
        compute.synchronize().named("cuStreamSynchronize")?;
        let (kernel, copy_end) = (ms(&e[0], &e[1])?, ms(&e[0], &e[3])?);
        let copy_len = ms(&e[2], &e[3])?;
        let began = ms(&e[0], &e[2])?;
        let hidden = ((kernel.min(copy_end) - began).max(0.0) / copy_len).min(1.0);
        println!(
            "overlap {dir}: copy {copy_len:.2} ms under a {kernel:.2} ms kernel, {:.0}% hidden \
             (copy began {began:.3} ms after the kernel, ended {copy_end:.2} ms after it began)",
            hidden * 100.0,
        );
        if hidden < 0.9 {
            failed.push(format!(
                "{dir} copy overlapped only {:.0}% with compute",
                hidden * 100.0
            ));
        }
        overlap.push(
            json!({"direction": dir, "copy_ms": copy_len, "kernel_ms": kernel,
            "hidden_share": hidden}),
        );
    }
    drop(slot_w);

    // The drafter's loop: step s computes while batch s+1 is copied in (two device buffers),
    // against the same loop on one stream. Busy share = kernel time / wall time.
    let step_cycles = timer.calibrate_spin(&probe, &compute, 1.5 * copy_ms)?;
    let serial = double_buffered(&probe, &compute, &compute, &taken, args.steps, step_cycles)?;
    let overlapped = double_buffered(&probe, &compute, &copy, &taken, args.steps, step_cycles)?;
    let per_step = |u: &Use| u.wall / args.steps as f64;
    println!(
        "double-buffered loop, {} steps: GPU busy {:.1}% with the copy on its own stream, \
         {:.1}% on one stream ({:.2} vs {:.2} ms per step; largest idle gap {:.3} vs {:.3} ms)",
        args.steps,
        overlapped.busy_share() * 100.0,
        serial.busy_share() * 100.0,
        per_step(&overlapped),
        per_step(&serial),
        overlapped.largest_gap,
        serial.largest_gap,
    );
    if overlapped.busy_share() < 0.9 {
        failed.push(format!(
            "double-buffered loop kept the GPU busy only {:.0}%",
            overlapped.busy_share() * 100.0
        ));
    }

    for t in taken {
        t.release()?;
    }

    // The target's loop: the forward of batch i+1 runs while batch i is copied out into its
    // ring slot; a slot is committed once its copy is complete.
    let (t_serial, bad_serial) = write_back(
        &probe,
        &compute,
        &compute,
        &producer,
        &consumer,
        args.steps,
        step_cycles,
        len,
        0,
    )?;
    let (t_overlapped, bad) = write_back(
        &probe,
        &compute,
        &copy,
        &producer,
        &consumer,
        args.steps,
        step_cycles,
        len,
        1 << 32,
    )?;
    println!(
        "double-buffered target loop, {} batches: GPU busy {:.1}% with the copy-out on its own \
         stream, {:.1}% on one stream ({:.2} vs {:.2} ms per batch); {}",
        args.steps,
        t_overlapped.busy_share() * 100.0,
        t_serial.busy_share() * 100.0,
        per_step(&t_overlapped),
        per_step(&t_serial),
        if bad.is_empty() && bad_serial.is_empty() {
            "every slot committed intact".to_string()
        } else {
            format!("{} slots wrong", bad.len() + bad_serial.len())
        },
    );
    failed.extend(bad_serial);
    failed.extend(bad);
    if t_overlapped.busy_share() < 0.9 {
        failed.push(format!(
            "double-buffered target loop kept the GPU busy only {:.0}%",
            t_overlapped.busy_share() * 100.0
        ));
    }
    let arena_pinned = pinned.is_some();
    drop(pinned);
    if let Some(path) = &args.json {
        let rows = |r: &[(&str, f64, f64)]| {
            r.iter()
                .map(|(w, ms, g)| json!({"source": w, "median_ms": ms, "gb_per_s": g}))
                .collect::<Vec<_>>()
        };
        let doc = json!({
            "device": dev.name().named("cuDeviceGetName")?,
            "driver_cuda": format!("{major}.{minor}"),
            "copy_mib": args.slot_mib, "reps": args.reps,
            "arena_pinned": arena_pinned,
            "h2d": rows(&h2d), "d2h": rows(&d2h), "overlap": overlap,
            "loop": {"steps": args.steps, "busy_overlapped": overlapped.busy_share(),
                     "busy_one_stream": serial.busy_share(),
                     "ms_per_step_overlapped": per_step(&overlapped),
                     "ms_per_step_one_stream": per_step(&serial),
                     "largest_gap_ms_overlapped": overlapped.largest_gap,
                     "largest_gap_ms_one_stream": serial.largest_gap},
            "target_loop": {"batches": args.steps,
                     "busy_overlapped": t_overlapped.busy_share(),
                     "busy_one_stream": t_serial.busy_share(),
                     "ms_per_batch_overlapped": per_step(&t_overlapped),
                     "ms_per_batch_one_stream": per_step(&t_serial)},
            "nccl": nccl,
            "failed": failed,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(failed)
}

/// Runs `steps` steps of the drafter's loop through `gpu::prefetch` (the logic the CPU tests
/// check) on the CUDA engine: batch `s+1` is copied into one device buffer on `copy` while step
/// `s` (a spin) computes on the other on `compute`. With `copy == compute` everything queues on
/// one stream, copies between steps.
fn double_buffered(
    probe: &Probe,
    compute: &Arc<CudaStream>,
    copy: &Arc<CudaStream>,
    taken: &[shm_ring::ReadSlot<'_>; 2],
    steps: usize,
    cycles: u64,
) -> anyhow::Result<Use> {
    let len = taken[0].payload().len().max(taken[1].payload().len());
    // SAFETY: the engine lives in `pf`, a local that is dropped (never leaked) before this
    // function returns, also on `?`.
    let mut pf = Prefetch::new(unsafe { CudaCopy::new(copy, compute, len)? });
    let dev = compute.context();
    let (starts, done) = (events(dev, steps)?, events(dev, steps)?);
    let batch = |s: usize| taken[s % 2].payload();
    let push = |pf: &mut Prefetch<_, _>, s: usize| {
        pf.push(batch(s)).map_err(|e| match e {
            PushError::Full(_) => anyhow::anyhow!("prefetch full at batch {s}"),
            PushError::Engine(_, e) => anyhow::Error::from(e).context(format!("batch {s}")),
        })
    };
    push(&mut pf, 0)?;
    let mut s = 0;
    while let Some(buf) = pf.begin_step()? {
        if s + 1 < steps {
            push(&mut pf, s + 1)?;
        }
        record(&starts[s], compute)?;
        probe.spin(compute, cycles)?;
        record(&done[s], compute)?;
        pf.end_step(buf)?;
        s += 1;
    }
    compute.synchronize().named("cuStreamSynchronize")?;
    // Step intervals from the first step's start: the first copy, before any step, is the same
    // in both loops.
    let mut steps_ms = Vec::with_capacity(steps);
    for s in 0..steps {
        steps_ms.push((ms(&starts[0], &starts[s])?, ms(&starts[0], &done[s])?));
    }
    Ok(Use::of(&steps_ms))
}

/// The NCCL part of the check; a machine without NCCL is reported, not failed (a group on one
/// node can use the shared-memory collective).
fn nccl_check(
    dev: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    timer: &Timer,
    dbuf: &mut [CudaSlice<u8>; 2],
    len: usize,
    reps: usize,
) -> anyhow::Result<serde_json::Value> {
    let nccl = match Nccl::load() {
        Ok(n) => n,
        Err(e) => {
            println!(
                "nccl: not checked ({e}; a library outside the loader's path is found through \
                 LD_LIBRARY_PATH)"
            );
            return Ok(json!({"checked": false, "why": e.to_string()}));
        }
    };
    let (a, b, c) = nccl.version();
    let comm = nccl.init_rank(dev, 1, &nccl.unique_id()?, 0)?;
    let count = len / 4;
    let input: Vec<u8> = (0..count)
        .flat_map(|i| ((i % 1_000_003) as f32 * 0.5).to_le_bytes())
        .collect();
    let [send, recv] = dbuf;
    stream.copy_h2d_sync(send, 0, &input)?;
    let ms = timer.median(stream, reps, || {
        comm.all_reduce_sum_f32(send, recv, count, stream)
    })?;
    comm.async_error()?;
    let mut out = vec![0u8; count * 4];
    stream.copy_d2h_sync(&mut out, recv, 0)?;
    if out != input {
        bail!("a one-rank all-reduce changed its input");
    }
    comm.abort()?;
    println!(
        "nccl {a}.{b}.{c}: one-rank all-reduce of {} MiB in {ms:.2} ms (median), result exact; \
         abort returned",
        len / MIB
    );
    Ok(json!({"checked": true, "version": format!("{a}.{b}.{c}"), "all_reduce_ms": ms}))
}

/// A reserved ring slot as the destination of a copy-out.
struct Out<'r>(shm_ring::WriteSlot<'r>);

impl AsMut<[u8]> for Out<'_> {
    fn as_mut(&mut self) -> &mut [u8] {
        self.0.payload_mut()
    }
}

// SAFETY: a slot's payload lies in the ring's shared mapping at a fixed place; moving the
// handle moves no byte of it.
unsafe impl StableBytes for Out<'_> {}

/// Runs `batches` batches of the target's loop through `gpu::writeback` on the CUDA engine:
/// the forward (a spin) of batch i+1 on `compute` while batch i is copied out into its
/// reserved ring slot on `copy`; each slot is committed once its copy is complete, then taken
/// and compared with what the device buffers hold. Returns the forwards' timeline and the
/// slots that arrived wrong.
#[allow(clippy::too_many_arguments)]
fn write_back(
    probe: &Probe,
    compute: &Arc<CudaStream>,
    copy: &Arc<CudaStream>,
    producer: &shm_ring::Producer<'_>,
    consumer: &shm_ring::Consumer<'_>,
    batches: usize,
    cycles: u64,
    len: usize,
    first_id: u64,
) -> anyhow::Result<(Use, Vec<String>)> {
    // SAFETY: the engine lives in `wb`, a local that is dropped (never leaked) before this
    // function returns, also on `?`.
    let mut wb = WriteBack::new(unsafe { CudaCopyOut::new(copy, compute, len)? });
    // The "captured layers": a known pattern in both device buffers, the batch's id stamped
    // into its first 8 bytes by the forward (ids start at `first_id`, so no batch looks like
    // one an earlier run left in the same slot).
    let pattern: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
    for b in 0..2 {
        copy.copy_h2d_sync(wb.engine_mut().buffer_mut(b), 0, &pattern)?;
    }
    let dev = compute.context();
    let (starts, ends) = (events(dev, batches)?, events(dev, batches)?);
    let mut bad = Vec::new();
    let mut next_commit = 0u64;
    // Slots committed inside the loop are checked at three pages (a whole compare of 256 MiB
    // would hold up the host, and with it the next forward); those committed after the last
    // forward, byte for byte.
    let mut commit = |slot: Out<'_>, whole: bool| -> anyhow::Result<()> {
        slot.0.commit(CommitMeta {
            bucket: 0,
            tokens: 1,
            batch_id: next_commit,
        })?;
        let r = consumer.take()?.context("a committed slot is not READY")?;
        let got = r.payload();
        let page = 4096.min(len);
        let same = |at: usize| got[at..at + page] == pattern[at..at + page];
        let intact = got.len() == len
            && got[..8] == (first_id + next_commit).to_le_bytes()
            && if whole {
                got[8..] == pattern[8..]
            } else {
                same(8.min(len - page)) && same((len - page) / 2) && same(len - page)
            };
        if r.meta().batch_id != next_commit || !intact {
            bad.push(format!(
                "target loop: batch {next_commit} arrived as batch {} or with other bytes",
                r.meta().batch_id
            ));
        }
        r.release()?;
        next_commit += 1;
        Ok(())
    };
    for i in 0..batches {
        let (buf, done) = wb.next_buffer()?;
        if let Some(slot) = done {
            commit(slot, false)?;
        }
        record(&starts[i], compute)?;
        probe.stamp(
            compute,
            wb.engine_mut().buffer_mut(buf),
            first_id + i as u64,
        )?;
        probe.spin(compute, cycles)?;
        record(&ends[i], compute)?;
        if let Err((_slot, e)) = wb.copy_out(buf, Out(producer.reserve(len)?)) {
            return Err(e).context(format!("copying out batch {i}"));
        }
    }
    while let Some(slot) = wb.complete_oldest()? {
        commit(slot, true)?;
    }
    if next_commit != batches as u64 {
        bad.push(format!(
            "target loop: {next_commit} of {batches} batches committed"
        ));
    }
    compute.synchronize().named("cuStreamSynchronize")?;
    let mut forwards = Vec::with_capacity(batches);
    for i in 0..batches {
        forwards.push((ms(&starts[0], &starts[i])?, ms(&starts[0], &ends[i])?));
    }
    Ok((Use::of(&forwards), bad))
}

/// `n` events that record GPU-clock time.
fn events(dev: &Arc<CudaContext>, n: usize) -> cuda::Result<Vec<CudaEvent>> {
    (0..n).map(|_| cuda::timing_event(dev)).collect()
}

/// Marks this point of `stream` in `ev`.
fn record(ev: &CudaEvent, stream: &CudaStream) -> cuda::Result<()> {
    ev.record(stream).named("cuEventRecord")
}

/// Milliseconds from `start` to `end`, both recorded (waits for both; GPU time, about half a
/// microsecond of resolution).
fn ms(start: &CudaEvent, end: &CudaEvent) -> cuda::Result<f64> {
    let ms = start.elapsed_ms(end).named("cuEventElapsedTime")?;
    Ok(f64::from(ms))
}

/// Times work on a stream with a pair of events.
struct Timer {
    start: CudaEvent,
    end: CudaEvent,
}

impl Timer {
    fn new(dev: &Arc<CudaContext>) -> anyhow::Result<Timer> {
        Ok(Timer {
            start: cuda::timing_event(dev)?,
            end: cuda::timing_event(dev)?,
        })
    }

    /// Median milliseconds of `work` queued `reps` times (one warm-up first), each waited for.
    fn median(
        &self,
        stream: &CudaStream,
        reps: usize,
        mut work: impl FnMut() -> cuda::Result<()>,
    ) -> anyhow::Result<f64> {
        let mut times = Vec::with_capacity(reps);
        for i in 0..=reps {
            record(&self.start, stream)?;
            work()?;
            record(&self.end, stream)?;
            self.end.synchronize().named("cuEventSynchronize")?;
            if i > 0 {
                times.push(ms(&self.start, &self.end)?);
            }
        }
        Ok(median(times))
    }

    /// Spin cycles that take about `ms` milliseconds on this GPU.
    fn calibrate_spin(&self, probe: &Probe, stream: &CudaStream, ms: f64) -> anyhow::Result<u64> {
        const TRIAL: u64 = 10_000_000;
        let per_cycle = self.median(stream, 3, || probe.spin(stream, TRIAL))? / TRIAL as f64;
        let cycles = ms / per_cycle;
        if !cycles.is_finite() || cycles <= 0.0 || cycles > 1e13 {
            bail!("calibrating the spin kernel gave {per_cycle} ms per cycle");
        }
        Ok((cycles as u64).max(1000))
    }
}
