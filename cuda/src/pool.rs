//! The device's default memory pool, which candle allocates its tensors from: whether memory
//! freed into it is kept for reuse. cudarc has no safe form of the pool's attributes.

use std::sync::Arc;

use cudarc::driver::sys;

use crate::{CudaContext, Named, Result};

/// What the device's default memory pool, where candle's tensors are allocated
/// (`cuMemAllocAsync`: cudarc's way when the device has pools), does with memory freed into it:
/// keep it for the next allocation (`Keep`, what PyTorch's caching allocator does) or hand it
/// back to the driver at the next stream, event or context synchronize (`Release`, the
/// driver's default: a release threshold of 0). A training step synchronizes dozens of times
/// (each loss value read) and allocates gigabytes between, so `Release` maps them afresh after
/// each; `Release` suits a GPU shared with other programs, which get the memory back sooner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreedMemory {
    Keep,
    Release,
}

/// Sets what `ctx`'s device's default memory pool does with freed memory (its release
/// threshold: the most it holds past a synchronize). The pool is the device's, so the setting
/// holds for every context of the process on it. `false`: the device has no memory pools
/// (cudarc then allocates with `cuMemAlloc`, and nothing is pooled to keep or release).
pub fn set_freed_memory(ctx: &Arc<CudaContext>, freed: FreedMemory) -> Result<bool> {
    ctx.bind_to_thread().named("cuCtxSetCurrent")?;
    let pools = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        .named("cuDeviceGetAttribute")?;
    if pools == 0 {
        return Ok(false);
    }
    // SAFETY: the device of a live context (cudarc's handle, from cuDeviceGet).
    let pool = unsafe { cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device()) }
        .named("cuDeviceGetDefaultMemPool")?;
    let mut threshold: u64 = match freed {
        FreedMemory::Keep => u64::MAX,
        FreedMemory::Release => 0,
    };
    // SAFETY: the release threshold is a cuuint64_t, read through the pointer during the call;
    // `threshold` outlives it. `pool` is the device's default pool, never destroyed.
    unsafe {
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .named("cuMemPoolSetAttribute")?;
    Ok(true)
}
