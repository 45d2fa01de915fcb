//! The CUDA driver API for the data path, through cudarc (its driver API and NCCL, loaded at
//! run time). The users hold cudarc's own handles (a [`CudaContext`] per device, [`CudaStream`],
//! [`CudaEvent`], [`CudaSlice`], [`PinnedHostSlice`]); this crate adds what cudarc does not do
//! for hspipe:
//!
//! - **No panic without a driver.** cudarc loads its libraries at run time
//!   (`fallback-dynamic-loading`), so nothing is linked and every build compiles this crate
//!   without a CUDA toolkit. But cudarc panics at the first call into a library it cannot load,
//!   so [`Driver::load`] checks first that the library is there and exports what the load path
//!   calls, and returns [`CudaError::NoDriver`] (or [`CudaError::Symbol`]) instead. Nothing in
//!   cudarc is called before a `Driver` exists. The CUDA build is the exception: candle links
//!   the libraries (cudarc's `dynamic-linking` wins over the fallback), and `linked` says so
//!   (`present.rs`): the loader resolved them before `main`.
//! - **A driver new enough for the bindings.** cudarc is built for CUDA 13.0 (`cuda-13000`) and
//!   so calls 13.0's entry points (`cuEventElapsedTime_v2`, for one); an older driver lacks
//!   them and cudarc would panic at the first such call, so `Driver::load` refuses a driver for
//!   an older CUDA with [`CudaError::DriverTooOld`].
//! - **Host memory hspipe did not allocate.** [`Registered`] page-locks the ring's arena in
//!   place (`cuMemHostRegister`, which cudarc has no safe form of), and [`HostCopy`] queues
//!   copies between such memory and a [`CudaSlice`]. cudarc's safe copies take a Rust slice
//!   whose borrow ends when the call returns, while a copy from registered memory runs after
//!   that; so these are `unsafe fn`s: only the caller can promise the host range stays mapped
//!   and untouched until the stream passes the copy (a ring slot held until its step's event
//!   completes). The synchronous forms are safe.
//! - What the device's memory pool does with freed memory ([`pool`]: keep it, where the
//!   driver's default hands it back at every synchronize).
//! - Device time by kernel ([`cupti`]: CUPTI's activity records, libcupti loaded only when a
//!   profile is asked for).
//! - The target's fused causal attention ([`attention`]: one kernel per layer, the scores kept
//!   on chip) and the device check's kernels ([`probe`]) and the one communicator NCCL call the group needs
//!   ([`nccl`]: cudarc's own `Comm` panics if its abort fails on drop and cannot report
//!   asynchronous errors).
//!
//! The library paths are cudarc's: it asks the dynamic loader for `libcuda.so` (and the other
//! names of [`cudarc::get_lib_name_candidates`]), so a driver outside the loader's path is found
//! through `LD_LIBRARY_PATH`. cudarc cannot be told a path, so `HSPIPE_LIBCUDA` and
//! `HSPIPE_LIBNCCL`, which used to name one, are refused when set ([`CudaError::Retired`])
//! rather than silently ignored: a check would otherwise run against another library than the
//! one its user named.
//!
//! cudarc's per-buffer event tracking stays on (its default): the copy engines order their
//! streams with their own events, and the tracking is what makes dropping a [`CudaSlice`] wait
//! for every stream that used it before its memory is freed.

use std::ffi::OsString;
use std::sync::Arc;

pub use cudarc;
use cudarc::driver::sys;
pub use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError,
    PinnedHostSlice,
};

pub mod attention;
pub mod cupti;
pub mod nccl;
pub mod nccl_group;
pub mod pool;
mod present;
pub mod probe;

/// The CUDA version cudarc's bindings are built for (the `cuda-13000` feature), which the
/// driver must support.
pub const BUILT_FOR: (u32, u32) = (13, 0);

/// Formerly the path of the driver library to load; refused now, since cudarc cannot be told a
/// path (see the crate's documentation).
pub const LIBCUDA_ENV: &str = "HSPIPE_LIBCUDA";

/// What went wrong, naming the driver call, library or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: {why}")]
    NoDriver { why: String },
    #[error(
        "{var} is set ({value}) but no longer read: cudarc loads the library by name through the \
         dynamic loader; unset {var} and put the library's directory on LD_LIBRARY_PATH"
    )]
    Retired { var: &'static str, value: String },
    #[error("the {library} found is not usable: it lacks {symbol} ({why})")]
    Symbol {
        library: &'static str,
        symbol: &'static str,
        why: String,
    },
    #[error(
        "the NVIDIA driver supports CUDA {}.{}, older than the CUDA {}.{} hspipe is built for \
         (cudarc's bindings call entry points it lacks): upgrade the driver",
        have.0, have.1, need.0, need.1
    )]
    DriverTooOld { have: (u32, u32), need: (u32, u32) },
    #[error("{call} failed: {name} ({code})")]
    Call {
        call: &'static str,
        code: i32,
        name: String,
    },
    #[error("no CUDA device {ordinal}: the driver sees {count}")]
    NoDevice { ordinal: u32, count: u32 },
    #[error("{what}: {len} bytes at offset {offset} overrun a buffer of {capacity} bytes")]
    Bounds {
        what: &'static str,
        offset: usize,
        len: usize,
        capacity: usize,
    },
    #[error("kernel {kernel:?} is not in the module: {name} ({code})")]
    NoKernel {
        kernel: &'static str,
        code: i32,
        name: String,
    },
    #[error("{0}")]
    Mismatch(String),
    #[error("no NCCL: {why}")]
    NoNccl { why: String },
    #[error("no kernel profile: {why}")]
    NoCupti { why: String },
    #[error("{call} failed: CUPTI's error {code}")]
    Cupti { call: &'static str, code: i32 },
    #[error("{call} failed: {name} ({code})")]
    Nccl {
        call: &'static str,
        code: i32,
        name: String,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

impl CudaError {
    /// `call` failed with `e`, named by the driver.
    pub fn call(call: &'static str, e: DriverError) -> CudaError {
        CudaError::Call {
            call,
            code: e.0 as i32,
            name: error_name(e),
        }
    }
}

/// Whether `ptx` holds no NUL byte. cudarc turns PTX text into a C string with an `unwrap`, so
/// a NUL byte in a shipped file would panic there; each module asserts this at compile time.
const fn has_no_nul(ptx: &str) -> bool {
    let b = ptx.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == 0 {
            return false;
        }
        i += 1;
    }
    true
}

/// Loads the PTX module `file` (`ptx`, its text) on `ctx`, and its `kernels` from it in order.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    file: &'static str,
    ptx: &'static str,
    kernels: &[&'static str],
) -> Result<Vec<cudarc::driver::CudaFunction>> {
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
        .map_err(|e| CudaError::Call {
            call: "cuModuleLoadData",
            code: e.0 as i32,
            name: format!("{} ({file})", error_name(e)),
        })?;
    kernels
        .iter()
        .map(|&kernel| {
            module
                .load_function(kernel)
                .map_err(|e| CudaError::NoKernel {
                    kernel,
                    code: e.0 as i32,
                    name: error_name(e),
                })
        })
        .collect()
}

/// The driver's name of an error ("CUDA_ERROR_INVALID_VALUE").
fn error_name(e: DriverError) -> String {
    match e.error_name() {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => "unknown error".to_string(),
    }
}

/// Names the call behind a cudarc error, so the message says what failed.
pub trait Named<T> {
    fn named(self, call: &'static str) -> Result<T>;
}

impl<T> Named<T> for std::result::Result<T, DriverError> {
    fn named(self, call: &'static str) -> Result<T> {
        self.map_err(|e| CudaError::call(call, e))
    }
}

/// A retired variable that is set is an error, not silently ignored.
fn refuse_retired(var: &'static str, value: Option<OsString>) -> Result<()> {
    match value {
        None => Ok(()),
        Some(v) => Err(CudaError::Retired {
            var,
            value: v.to_string_lossy().into_owned(),
        }),
    }
}

/// Reads a CUDA version number (1000 × major + 10 × minor) as (major, minor), refusing a
/// driver older than the bindings.
fn check_version(v: i32) -> Result<(u32, u32)> {
    let v = v.max(0) as u32;
    let have = (v / 1000, (v % 1000) / 10);
    if have < BUILT_FOR {
        return Err(CudaError::DriverTooOld {
            have,
            need: BUILT_FOR,
        });
    }
    Ok(have)
}

/// The entry points `Driver::load` calls before it knows the driver's version (after which the
/// version vouches for the rest), and those that name errors.
const LOAD_PATH: [&str; 4] = [
    "cuDriverGetVersion",
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// The loaded driver, initialised (`cuInit`) and for CUDA [`BUILT_FOR`] or newer. Only a
/// `Driver` opens devices, so nothing calls into cudarc's driver API before the presence check.
#[derive(Clone, Copy, Debug)]
pub struct Driver {
    version: (u32, u32),
}

impl Driver {
    /// Finds the driver where cudarc will look for it, checks it, and initialises it.
    pub fn load() -> Result<Driver> {
        Driver::load_with(std::env::var_os(LIBCUDA_ENV))
    }

    /// `load`, given the value of `HSPIPE_LIBCUDA` (the tests' way in, without touching the
    /// process's environment).
    fn load_with(retired: Option<OsString>) -> Result<Driver> {
        refuse_retired(LIBCUDA_ENV, retired)?;
        present::check(present::Lib::Driver, &LOAD_PATH)?;
        let mut v = 0;
        // SAFETY: writes one int through a valid pointer; allowed before cuInit.
        unsafe { sys::cuDriverGetVersion(&mut v) }
            .result()
            .named("cuDriverGetVersion")?;
        let version = check_version(v)?;
        cudarc::driver::result::init().named("cuInit")?;
        Ok(Driver { version })
    }

    /// The CUDA version the driver supports, as (major, minor).
    pub fn version(&self) -> (u32, u32) {
        self.version
    }

    /// How many devices this process may use (after `CUDA_VISIBLE_DEVICES`).
    pub fn device_count(&self) -> Result<u32> {
        let n = CudaContext::device_count().named("cuDeviceGetCount")?;
        Ok(n.max(0) as u32)
    }

    /// Opens device `ordinal`: retains its primary context (the one every library in the
    /// process shares) and makes it current on this thread.
    pub fn open(&self, ordinal: u32) -> Result<Arc<CudaContext>> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        CudaContext::new(ordinal as usize).named("retaining the device's primary context")
    }
}

/// Copy engines of `ctx`'s device that can run beside kernels (0: copies and kernels take
/// turns).
pub fn copy_engines(ctx: &CudaContext) -> Result<u32> {
    let n = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)
        .named("cuDeviceGetAttribute")?;
    Ok(n.max(0) as u32)
}

/// An event that records GPU-clock time (cudarc's default event does not time).
pub fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .named("cuEventCreate")
}

/// `len` bytes of page-locked host memory from the driver, as `cuMemAllocHost` gives (not
/// write-combined, which cudarc's `alloc_pinned` asks for and which the host reads slowly), set
/// to `fill`: the reference a registered range is measured against.
pub fn alloc_pinned(ctx: &Arc<CudaContext>, len: usize, fill: u8) -> Result<PinnedHostSlice<u8>> {
    // SAFETY: flags 0 ask for plain page-locked memory. Its bytes are unset, and are set below
    // before any slice of them is made.
    let mut p = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }.named("cuMemHostAlloc")?;
    let ptr = p.as_mut_ptr().named("cuEventSynchronize")?;
    // SAFETY: `len` writable bytes owned by `p`, on which no copy is queued yet.
    unsafe { std::ptr::write_bytes(ptr, fill, len) };
    Ok(p)
}

fn bounds(what: &'static str, capacity: usize, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(CudaError::Bounds {
            what,
            offset,
            len,
            capacity,
        }),
    }
}

/// Copies between host memory and device buffers, queued on a stream. The device side is
/// bounds-checked (cudarc's own copies assert, which would panic) and goes through cudarc's
/// event tracking, so the buffer's other streams stay ordered with the copy. Offsets and lengths
/// are in bytes, whatever the buffer's element type (a batch's states are bytes on the host and
/// bf16 or f32 elements in a model's tensor).
pub trait HostCopy {
    /// Queues a copy of `len` host bytes at `src` into `dst` at byte `offset`.
    ///
    /// # Safety
    /// `src..src+len` must stay mapped and unwritten until the stream has passed this copy (a
    /// synchronize of the stream, or an event recorded after it that has completed).
    unsafe fn copy_h2d<T>(
        &self,
        dst: &mut CudaSlice<T>,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<()>;

    /// Queues a copy of `len` bytes of `src` at byte `offset` into host memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay mapped, and be neither read nor written by the host, until the
    /// stream has passed this copy.
    unsafe fn copy_d2h<T>(
        &self,
        dst: *mut u8,
        src: &CudaSlice<T>,
        offset: usize,
        len: usize,
    ) -> Result<()>;

    /// Copies `src` into `dst` at `offset` and waits for it.
    fn copy_h2d_sync(&self, dst: &mut CudaSlice<u8>, offset: usize, src: &[u8]) -> Result<()>;

    /// Copies `dst.len()` bytes of `src` at `offset` into `dst` and waits for it.
    fn copy_d2h_sync(&self, dst: &mut [u8], src: &CudaSlice<u8>, offset: usize) -> Result<()>;
}

impl HostCopy for CudaStream {
    unsafe fn copy_h2d<T>(
        &self,
        dst: &mut CudaSlice<T>,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        bounds("host-to-device copy", dst.num_bytes(), offset, len)?;
        self.context().bind_to_thread().named("cuCtxSetCurrent")?;
        // The guard records the buffer's write event once the copy is queued (at the end of
        // this function), after making the stream wait for the buffer's earlier uses.
        let (base, _written) = dst.device_ptr_mut(self);
        // SAFETY: the device range lies inside `dst` (checked above) and the stream belongs to
        // the context made current; the caller keeps the host range valid until the copy is
        // done.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(base + offset as u64, src.cast(), len, self.cu_stream())
        }
        .result()
        .named("cuMemcpyHtoDAsync")
    }

    unsafe fn copy_d2h<T>(
        &self,
        dst: *mut u8,
        src: &CudaSlice<T>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        bounds("device-to-host copy", src.num_bytes(), offset, len)?;
        self.context().bind_to_thread().named("cuCtxSetCurrent")?;
        // As in `copy_h2d`: the guard records the buffer's read event after the copy.
        let (base, _read) = src.device_ptr(self);
        // SAFETY: the device range lies inside `src` (checked above); the caller keeps the host
        // range valid and untouched until the copy is done.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), base + offset as u64, len, self.cu_stream())
        }
        .result()
        .named("cuMemcpyDtoHAsync")
    }

    fn copy_h2d_sync(&self, dst: &mut CudaSlice<u8>, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is borrowed until the synchronize below has returned.
        unsafe { self.copy_h2d(dst, offset, src.as_ptr(), src.len())? };
        self.synchronize().named("cuStreamSynchronize")
    }

    fn copy_d2h_sync(&self, dst: &mut [u8], src: &CudaSlice<u8>, offset: usize) -> Result<()> {
        // SAFETY: `dst` is borrowed mutably until the synchronize below has returned.
        unsafe { self.copy_d2h(dst.as_mut_ptr(), src, offset, dst.len())? };
        self.synchronize().named("cuStreamSynchronize")
    }
}

/// A host range page-locked in place (`cuMemHostRegister`, portable), so copies from and to it
/// run at full speed and asynchronously; unregistered on drop. cudarc pins only memory it
/// allocates itself; the ring's arena is a shared mapping made before any driver exists.
pub struct Registered {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

impl Registered {
    /// Page-locks `len` bytes at `ptr` for every context of the process.
    ///
    /// # Safety
    /// The range must be mapped, page-aligned, and stay mapped until the returned value drops
    /// (drop it before unmapping: for the ring, before the `Ring` handle).
    pub unsafe fn new(ctx: &Arc<CudaContext>, ptr: *mut u8, len: usize) -> Result<Registered> {
        ctx.bind_to_thread().named("cuCtxSetCurrent")?;
        // SAFETY: the caller promises the range is mapped until the registration drops.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .named("cuMemHostRegister")?;
        Ok(Registered {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if `[ptr, ptr+len)` lies inside the registered range.
    pub fn covers(&self, ptr: *const u8, len: usize) -> bool {
        let (start, end) = (self.ptr as usize, self.ptr as usize + self.len);
        let p = ptr as usize;
        p >= start && p.checked_add(len).is_some_and(|e| e <= end)
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in `Registered::new`; the caller keeps it mapped until now.
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr.cast()) };
    }
}

#[cfg(test)]
mod tests;
