//! The device's default memory pool, which candle allocates its tensors from: whether memory
//! freed into it is kept for reuse. cudarc has no safe form of the pool's attributes.

use std::sync::Arc;

use cudarc::driver::sys;

use crate::{CudaContext, Named, Result};

/// What the device's default memory pool, where candle's tensors are allocated
/// (`cuMemAllocAsync`: cudarc's way when the device has pools), does with memory freed into it:
/// keep it for the next allocation (`Keep`, what PyTorch's caching allocator does) or hand it
/// back to the driver at the next stream, event or context synchronize (`Release`, the
/// driver's default: a release threshold of 0). A DFlash step synchronizes about thirty-five
/// times (two values read a part) and allocates gigabytes between, so `Release` maps them afresh after
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
    let Some(pool) = default_pool(ctx)? else {
        return Ok(false);
    };
    let threshold = match freed {
        FreedMemory::Keep => u64::MAX,
        FreedMemory::Release => 0,
    };
    set_u64(
        pool,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        threshold,
    )?;
    Ok(true)
}

/// The default memory pool of `ctx`'s device, `None` where the device has none (cudarc then
/// allocates with `cuMemAlloc`).
fn default_pool(ctx: &Arc<CudaContext>) -> Result<Option<sys::CUmemoryPool>> {
    ctx.bind_to_thread().named("cuCtxSetCurrent")?;
    let pools = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        .named("cuDeviceGetAttribute")?;
    if pools == 0 {
        return Ok(None);
    }
    // SAFETY: the device of a live context (cudarc's handle, from cuDeviceGet).
    let pool = unsafe { cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device()) }
        .named("cuDeviceGetDefaultMemPool")?;
    Ok(Some(pool))
}

/// Sets one of `pool`'s cuuint64_t attributes.
fn set_u64(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute, value: u64) -> Result<()> {
    let mut v = value;
    // SAFETY: `attr` is one of the pool's cuuint64_t attributes (the callers' own), read
    // through the pointer during the call; `v` outlives it. `pool` is a device's default pool,
    // never destroyed.
    unsafe {
        cudarc::driver::result::mem_pool::set_attribute(pool, attr, (&mut v as *mut u64).cast())
    }
    .named("cuMemPoolSetAttribute")
}

/// What the device's default pool holds, in bytes: `used` by live allocations, `used_high` the
/// most used since the last [`reset_used_high`], `reserved` from the driver (with freed memory
/// kept, what the driver counts as in use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    pub used: u64,
    pub used_high: u64,
    pub reserved: u64,
}

/// `ctx`'s device's default pool's [`PoolUsage`]; `None` where the device has no pools.
pub fn usage(ctx: &Arc<CudaContext>) -> Result<Option<PoolUsage>> {
    use sys::CUmemPool_attribute::*;
    let Some(pool) = default_pool(ctx)? else {
        return Ok(None);
    };
    let read = |attr| -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: these attributes are cuuint64_t, written through the pointer during the call;
        // `v` outlives it. `pool` is the device's default pool, never destroyed.
        unsafe {
            cudarc::driver::result::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast())
        }
        .named("cuMemPoolGetAttribute")?;
        Ok(v)
    };
    Ok(Some(PoolUsage {
        used: read(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        used_high: read(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        reserved: read(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
    }))
}

/// Restarts `used_high` of [`usage`] from what is used now (nothing where there are no pools).
pub fn reset_used_high(ctx: &Arc<CudaContext>) -> Result<()> {
    if let Some(pool) = default_pool(ctx)? {
        set_u64(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        )?;
    }
    Ok(())
}
