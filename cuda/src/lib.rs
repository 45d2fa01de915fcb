//! The CUDA driver API, loaded at run time, for the data path: one primary context per process,
//! host memory pinned in place (the ring's arena), copy streams, events that time and order the
//! work, and the device check's kernels.
//!
//! Length: one thin wrapper per driver call, each with its reason to be sound; split by handle
//! they would scatter the shared `check` and `bind`.
//!
//! - **No toolkit to build, no panic without a driver.** `libcuda.so.1` is opened by
//!   [`Driver::load`] and every entry point is resolved then (`sys`); a machine without it gets
//!   [`CudaError::NoDriver`], one without a symbol [`CudaError::Symbol`]. Nothing is linked, so
//!   every line here is compiled and linted by every build (no feature hides it).
//! - **Handles borrow what they need.** A [`Stream`], [`Event`], [`DeviceBuffer`] or
//!   [`Registered`] range borrows its [`Device`], so the context outlives them; dropping one
//!   releases it on the driver.
//! - **Asynchronous host copies are `unsafe`.** The driver reads or writes host memory after the
//!   call returns, until the stream passes the copy; only the caller can promise that memory
//!   stays mapped and untouched until then (a ring slot held until its step's event completes).
//!   The synchronous forms are safe.
//!
//! `unsafe` lives in `sys` (the table) and in the small wrappers below, one call each, with the
//! reason it holds beside it.

use std::ffi::{c_void, CStr, CString};
use std::sync::Arc;

mod sys;

pub mod nccl;
pub mod probe;

use sys::{Api, CuContext, CuDevice, CuDevicePtr, CuEvent, CuResult, CuStream, CUDA_SUCCESS};

/// Environment variable naming another driver library to load in place of `libcuda.so.1`
/// (a driver outside the loader's path, or a test's stand-in).
pub const LIBCUDA_ENV: &str = "HSPIPE_LIBCUDA";

/// What went wrong, naming the driver call, library or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: cannot load {path} ({why})")]
    NoDriver { path: String, why: String },
    #[error("{path} is not a usable CUDA driver: it lacks {name} ({why})")]
    Symbol {
        name: &'static str,
        path: String,
        why: String,
    },
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
    #[error("kernel {0:?} is not in the module")]
    NoKernel(String),
    #[error("{0}")]
    Mismatch(String),
    #[error("no NCCL: cannot load {path} ({why})")]
    NoNccl { path: String, why: String },
    #[error("{call} failed: {name} ({code})")]
    Nccl {
        call: &'static str,
        code: i32,
        name: String,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// The loaded driver, initialised.
#[derive(Clone)]
pub struct Driver {
    api: Arc<Api>,
}

impl Driver {
    /// Loads the driver (`$HSPIPE_LIBCUDA`, else `libcuda.so.1`) and initialises it.
    pub fn load() -> Result<Driver> {
        let path = std::env::var(LIBCUDA_ENV).unwrap_or_else(|_| sys::LIBCUDA.to_string());
        Driver::load_from(&path)
    }

    /// Loads the driver library at `path` and initialises it.
    pub fn load_from(path: &str) -> Result<Driver> {
        let api = Arc::new(Api::load(path).map_err(|e| match e.symbol {
            None => CudaError::NoDriver {
                path: e.path,
                why: e.why,
            },
            Some(name) => CudaError::Symbol {
                name,
                path: e.path,
                why: e.why,
            },
        })?);
        // SAFETY: cuInit takes flags (must be 0) and may be called any number of times.
        check(&api, "cuInit", unsafe { (api.cuInit)(0) })?;
        Ok(Driver { api })
    }

    /// The CUDA version the driver supports, as (major, minor).
    pub fn version(&self) -> Result<(u32, u32)> {
        let mut v = 0;
        // SAFETY: writes one int through a valid pointer.
        let r = unsafe { (self.api.cuDriverGetVersion)(&mut v) };
        check(&self.api, "cuDriverGetVersion", r)?;
        Ok(((v / 1000) as u32, ((v % 1000) / 10) as u32))
    }

    /// How many devices this process may use (after `CUDA_VISIBLE_DEVICES`).
    pub fn device_count(&self) -> Result<u32> {
        let mut n = 0;
        // SAFETY: writes one int through a valid pointer.
        let r = unsafe { (self.api.cuDeviceGetCount)(&mut n) };
        check(&self.api, "cuDeviceGetCount", r)?;
        Ok(n.max(0) as u32)
    }

    /// Opens device `ordinal`: retains its primary context (the one every library in the
    /// process shares) and makes it current on this thread.
    pub fn open(&self, ordinal: u32) -> Result<Device> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let api = self.api.clone();
        let mut dev: CuDevice = 0;
        // SAFETY: writes one device handle; the ordinal is below the count.
        check(&api, "cuDeviceGet", unsafe {
            (api.cuDeviceGet)(&mut dev, ordinal as i32)
        })?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: writes one context handle for a valid device; released in Device::drop.
        check(&api, "cuDevicePrimaryCtxRetain", unsafe {
            (api.cuDevicePrimaryCtxRetain)(&mut ctx, dev)
        })?;
        let device = Device {
            api,
            dev,
            ctx,
            ordinal,
        };
        device.bind()?;
        Ok(device)
    }
}

/// One GPU's primary context, retained while this lives.
pub struct Device {
    api: Arc<Api>,
    dev: CuDevice,
    ctx: CuContext,
    ordinal: u32,
}

// SAFETY: a context handle may be used from any thread once made current there (`bind`); the
// driver API is thread-safe.
unsafe impl Send for Device {}
// SAFETY: as above; every method makes the context current on the calling thread first.
unsafe impl Sync for Device {}

impl Device {
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        let mut buf = [0u8; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into the buffer.
        let r = unsafe {
            (self.api.cuDeviceGetName)(buf.as_mut_ptr().cast(), buf.len() as i32, self.dev)
        };
        self.check("cuDeviceGetName", r)?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// Copy engines that can run beside kernels (0: copies and kernels take turns).
    pub fn copy_engines(&self) -> Result<u32> {
        let mut n = 0;
        // SAFETY: writes one int for a valid device and attribute.
        let r = unsafe {
            (self.api.cuDeviceGetAttribute)(
                &mut n,
                sys::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT,
                self.dev,
            )
        };
        self.check("cuDeviceGetAttribute", r)?;
        Ok(n.max(0) as u32)
    }

    /// Makes this device's context current on the calling thread. Every method does it first,
    /// so threads need not.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained until `self` drops.
        let r = unsafe { (self.api.cuCtxSetCurrent)(self.ctx) };
        self.check("cuCtxSetCurrent", r)
    }

    /// A stream that does not wait for the legacy default stream.
    pub fn stream(&self) -> Result<Stream<'_>> {
        self.bind()?;
        let mut s: CuStream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in Stream::drop.
        let r = unsafe { (self.api.cuStreamCreate)(&mut s, sys::CU_STREAM_NON_BLOCKING) };
        self.check("cuStreamCreate", r)?;
        Ok(Stream { dev: self, raw: s })
    }

    /// An event that records timing.
    pub fn event(&self) -> Result<Event<'_>> {
        self.bind()?;
        let mut e: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed in Event::drop.
        let r = unsafe { (self.api.cuEventCreate)(&mut e, sys::CU_EVENT_DEFAULT) };
        self.check("cuEventCreate", r)?;
        Ok(Event { dev: self, raw: e })
    }

    /// `len` bytes of device memory, contents undefined (zeroing would run on the legacy
    /// stream, unordered with the non-blocking streams hspipe uses).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer<'_>> {
        self.bind()?;
        let mut p: CuDevicePtr = 0;
        // SAFETY: writes one device address; freed in DeviceBuffer::drop.
        let r = unsafe { (self.api.cuMemAlloc_v2)(&mut p, len.max(1)) };
        self.check("cuMemAlloc", r)?;
        Ok(DeviceBuffer {
            dev: self,
            ptr: p,
            len,
        })
    }

    /// `len` bytes of page-locked host memory from the driver (`cuMemAllocHost`): the reference
    /// a registered range is measured against.
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer<'_>> {
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one host address; freed in PinnedBuffer::drop.
        let r = unsafe { (self.api.cuMemAllocHost_v2)(&mut p, len.max(1)) };
        self.check("cuMemAllocHost", r)?;
        // SAFETY: the driver returned `len` writable bytes; zero them so the slice is
        // initialised.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        Ok(PinnedBuffer {
            dev: self,
            ptr: p.cast(),
            len,
        })
    }

    /// Page-locks `len` bytes at `ptr` in place (`cuMemHostRegister`, portable), so copies
    /// from and to it run at full speed and asynchronously. Undone when the result drops.
    ///
    /// # Safety
    /// The range must be mapped, page-aligned, and stay mapped until the returned value drops
    /// (drop it before unmapping: for the ring, before the `Ring` handle).
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Registered<'_>> {
        self.bind()?;
        // SAFETY: the caller promises the range is mapped until the registration drops.
        let r = unsafe {
            (self.api.cuMemHostRegister_v2)(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        self.check("cuMemHostRegister", r)?;
        Ok(Registered {
            dev: self,
            ptr,
            len,
        })
    }

    /// Loads a module of PTX (JIT-compiled by the driver for this device).
    pub fn module(&self, ptx: &CStr) -> Result<Module<'_>> {
        self.bind()?;
        let mut m: sys::CuModule = std::ptr::null_mut();
        // SAFETY: the image is a NUL-terminated PTX text, read during the call only.
        let r = unsafe { (self.api.cuModuleLoadData)(&mut m, ptx.as_ptr().cast()) };
        self.check("cuModuleLoadData", r)?;
        Ok(Module { dev: self, raw: m })
    }

    fn check(&self, call: &'static str, r: CuResult) -> Result<()> {
        check(&self.api, call, r)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Driver::open`; every handle borrowing `self` is gone.
        unsafe { (self.api.cuDevicePrimaryCtxRelease_v2)(self.dev) };
    }
}

/// A queue of device work; work on different streams may overlap.
pub struct Stream<'d> {
    dev: &'d Device,
    raw: CuStream,
}

impl Stream<'_> {
    /// Queues a copy of `len` host bytes at `src` into `dst` at `offset`.
    ///
    /// # Safety
    /// `src..src+len` must stay mapped and unwritten until the stream has passed this copy (a
    /// [`Stream::synchronize`], or an event recorded after it that has completed).
    pub unsafe fn copy_h2d(
        &self,
        dst: &DeviceBuffer<'_>,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        dst.bounds("host-to-device copy", offset, len)?;
        self.dev.bind()?;
        // SAFETY: the device range is inside `dst` (checked); the caller keeps the host range
        // valid until the copy is done.
        let r = unsafe {
            (self.dev.api.cuMemcpyHtoDAsync_v2)(dst.ptr + offset as u64, src.cast(), len, self.raw)
        };
        self.dev.check("cuMemcpyHtoDAsync", r)
    }

    /// Queues a copy of `len` bytes of `src` at `offset` into host memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay mapped, and be neither read nor written by the host, until the
    /// stream has passed this copy.
    pub unsafe fn copy_d2h(
        &self,
        dst: *mut u8,
        src: &DeviceBuffer<'_>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        src.bounds("device-to-host copy", offset, len)?;
        self.dev.bind()?;
        // SAFETY: the device range is inside `src` (checked); the caller keeps the host range
        // valid and untouched until the copy is done.
        let r = unsafe {
            (self.dev.api.cuMemcpyDtoHAsync_v2)(dst.cast(), src.ptr + offset as u64, len, self.raw)
        };
        self.dev.check("cuMemcpyDtoHAsync", r)
    }

    /// Copies `src` into `dst` at `offset` and waits for it.
    pub fn copy_h2d_sync(&self, dst: &DeviceBuffer<'_>, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is borrowed until the synchronize below has returned.
        unsafe { self.copy_h2d(dst, offset, src.as_ptr(), src.len())? };
        self.synchronize()
    }

    /// Copies `dst.len()` bytes of `src` at `offset` into `dst` and waits for it.
    pub fn copy_d2h_sync(
        &self,
        dst: &mut [u8],
        src: &DeviceBuffer<'_>,
        offset: usize,
    ) -> Result<()> {
        // SAFETY: `dst` is borrowed mutably until the synchronize below has returned.
        unsafe { self.copy_d2h(dst.as_mut_ptr(), src, offset, dst.len())? };
        self.synchronize()
    }

    /// Marks this point of the stream in `ev` (its time, once the stream reaches it).
    pub fn record(&self, ev: &Event<'_>) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: both handles are live and of this device.
        let r = unsafe { (self.dev.api.cuEventRecord)(ev.raw, self.raw) };
        self.dev.check("cuEventRecord", r)
    }

    /// Makes later work on this stream wait (on the device) for `ev`.
    pub fn wait(&self, ev: &Event<'_>) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: both handles are live and of this device.
        let r = unsafe { (self.dev.api.cuStreamWaitEvent)(self.raw, ev.raw, 0) };
        self.dev.check("cuStreamWaitEvent", r)
    }

    /// Blocks until everything queued on the stream is done. Needs no current context, so
    /// nothing can make it return before the stream is idle but the driver's own error.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream is live.
        let r = unsafe { (self.dev.api.cuStreamSynchronize)(self.raw) };
        self.dev.check("cuStreamSynchronize", r)
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: the stream is live; queued work completes before the driver frees it.
        unsafe { (self.dev.api.cuStreamDestroy_v2)(self.raw) };
    }
}

/// A point in a stream's work: waited on, queried, or timed against another.
pub struct Event<'d> {
    dev: &'d Device,
    raw: CuEvent,
}

impl Event<'_> {
    /// Blocks until the work before the recorded point is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        let r = unsafe { (self.dev.api.cuEventSynchronize)(self.raw) };
        self.dev.check("cuEventSynchronize", r)
    }

    /// True once the work before the recorded point is done (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        // SAFETY: the event is live.
        let r = unsafe { (self.dev.api.cuEventQuery)(self.raw) };
        match r {
            sys::CUDA_ERROR_NOT_READY => Ok(false),
            r => self.dev.check("cuEventQuery", r).map(|()| true),
        }
    }

    /// Milliseconds from `start` to this event, both recorded and complete (GPU time, about
    /// half a microsecond of resolution).
    pub fn since(&self, start: &Event<'_>) -> Result<f64> {
        let mut ms = 0f32;
        // SAFETY: writes one float; both events are live.
        let r = unsafe { (self.dev.api.cuEventElapsedTime)(&mut ms, start.raw, self.raw) };
        self.dev.check("cuEventElapsedTime", r)?;
        Ok(f64::from(ms))
    }
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        // SAFETY: the event is live.
        unsafe { (self.dev.api.cuEventDestroy_v2)(self.raw) };
    }
}

/// Device memory, freed on drop.
pub struct DeviceBuffer<'d> {
    dev: &'d Device,
    ptr: CuDevicePtr,
    len: usize,
}

impl DeviceBuffer<'_> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn bounds(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::Bounds {
                what,
                offset,
                len,
                capacity: self.len,
            }),
        }
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: allocated by cuMemAlloc in `Device::alloc`, freed once. Device memory only:
        // a kernel or copy still using it can corrupt device data, never host memory. (The
        // driver synchronises cuMemFree in practice; hspipe's users synchronise first.)
        unsafe { (self.dev.api.cuMemFree_v2)(self.ptr) };
    }
}

/// Page-locked host memory from the driver.
pub struct PinnedBuffer<'d> {
    dev: &'d Device,
    ptr: *mut u8,
    len: usize,
}

impl std::ops::Deref for PinnedBuffer<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by this buffer until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer<'_> {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: allocated by cuMemAllocHost in `Device::alloc_pinned`, freed once.
        unsafe { (self.dev.api.cuMemFreeHost)(self.ptr.cast()) };
    }
}

/// A host range page-locked in place; unregistered on drop.
pub struct Registered<'d> {
    dev: &'d Device,
    ptr: *mut u8,
    len: usize,
}

impl Registered<'_> {
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

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: registered in `Device::register`; the caller keeps it mapped until now.
        unsafe { (self.dev.api.cuMemHostUnregister)(self.ptr.cast()) };
    }
}

/// A loaded module of kernels.
pub struct Module<'d> {
    dev: &'d Device,
    raw: sys::CuModule,
}

impl Module<'_> {
    fn function(&self, name: &str) -> Result<sys::CuFunction> {
        let c = CString::new(name).map_err(|_| CudaError::NoKernel(name.to_string()))?;
        let mut f: sys::CuFunction = std::ptr::null_mut();
        // SAFETY: writes one function handle of this live module; the name is NUL-terminated.
        let r = unsafe { (self.dev.api.cuModuleGetFunction)(&mut f, self.raw, c.as_ptr()) };
        self.dev.check("cuModuleGetFunction", r)?;
        Ok(f)
    }
}

impl Drop for Module<'_> {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: loaded in `Device::module`, unloaded once.
        unsafe { (self.dev.api.cuModuleUnload)(self.raw) };
    }
}

fn check(api: &Api, call: &'static str, r: CuResult) -> Result<()> {
    if r == CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: writes a pointer to a static string owned by the driver, or leaves it null.
    let named = unsafe { (api.cuGetErrorName)(r, &mut s) } == CUDA_SUCCESS && !s.is_null();
    let name = if named {
        // SAFETY: the driver's static, NUL-terminated name of `r`.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    } else {
        "unknown error".to_string()
    };
    Err(CudaError::Call {
        call,
        code: r,
        name,
    })
}

#[cfg(test)]
mod tests;
