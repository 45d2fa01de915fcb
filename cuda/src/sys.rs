//! The raw driver API: the C types and one table of entry points resolved from `libcuda.so.1`
//! at run time. Nothing here is linked at build time, so a build needs no CUDA toolkit and a
//! machine with no driver gets an error from [`Api::load`], never a panic or a link failure.
//!
//! Every call into the table is `unsafe` (foreign functions); the safe wrappers in `lib.rs`
//! uphold each call's rules and say how in their `// SAFETY:` comments.
//!
//! Why our own table and not cudarc: crates.io is unreachable on the machines this project is
//! built on, and cudarc is packaged nowhere reachable (issue #13). The driver API is a stable C
//! ABI; the few dozen calls the data path needs are listed below with their `_v2` names, as
//! `cuda.h` maps them.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `CUresult`: 0 is success; other values are named by `cuGetErrorName`.
pub type CuResult = c_int;
pub type CuDevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CuDevicePtr = u64;
pub type CuContext = *mut c_void;
pub type CuStream = *mut c_void;
pub type CuEvent = *mut c_void;
pub type CuModule = *mut c_void;
pub type CuFunction = *mut c_void;

pub const CUDA_SUCCESS: CuResult = 0;
/// `cuEventQuery`: the work before the event has not finished yet.
pub const CUDA_ERROR_NOT_READY: CuResult = 600;
/// `cuStreamCreate`: do not synchronise with the legacy default stream.
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `cuEventCreate`: timing enabled, the waiting thread spins (the default).
pub const CU_EVENT_DEFAULT: c_uint = 0;
/// `cuMemHostRegister`: pinned for every context, not only the current one.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
/// `cuDeviceGetAttribute`: copy engines that can run beside kernels.
pub const CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: c_int = 40;

/// The library's file name: the driver's, not the toolkit's runtime.
pub const LIBCUDA: &str = "libcuda.so.1";

/// Why a table could not be loaded: the library (`symbol` None) or one entry point.
pub struct LoadError {
    pub path: String,
    pub symbol: Option<&'static str>,
    pub why: String,
}

/// Declares a table: one field per entry point, filled by `load` from the symbol of the same
/// name (fields are named as the C symbols, so a grep for a driver call finds its use).
macro_rules! api {
    ($table:ident { $($name:ident: fn($($arg:ty),*) -> $ret:ty;)* }) => {
        #[allow(non_snake_case)]
        pub struct $table {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            /// Keeps the library mapped while the pointers above are used.
            _lib: libloading::Library,
        }

        impl $table {
            /// Opens `path` and resolves every entry point; the first one missing is named.
            pub fn load(path: &str) -> Result<$table, LoadError> {
                let err = |symbol, e: libloading::Error| LoadError {
                    path: path.to_string(),
                    symbol,
                    why: e.to_string(),
                };
                // SAFETY: loading runs the library's initialisers. The driver's and NCCL's only
                // set up their own state; a library named by the user through the environment
                // is theirs.
                let lib = unsafe { libloading::Library::new(path) }.map_err(|e| err(None, e))?;
                Ok($table {
                    $(
                        // SAFETY: the symbol's C signature is the one declared here, as in
                        // cuda.h / nccl.h (CUDA 12 and 13 alike); the pointer is kept no longer
                        // than `_lib`, which this struct owns.
                        $name: *unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        }
                        .map_err(|e| err(Some(stringify!($name)), e))?,
                    )*
                    _lib: lib,
                })
            }
        }
    };
}

api! {
Api {
    cuInit: fn(c_uint) -> CuResult;
    cuDriverGetVersion: fn(*mut c_int) -> CuResult;
    cuGetErrorName: fn(CuResult, *mut *const c_char) -> CuResult;
    cuDeviceGetCount: fn(*mut c_int) -> CuResult;
    cuDeviceGet: fn(*mut CuDevice, c_int) -> CuResult;
    cuDeviceGetName: fn(*mut c_char, c_int, CuDevice) -> CuResult;
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CuDevice) -> CuResult;
    cuDevicePrimaryCtxRetain: fn(*mut CuContext, CuDevice) -> CuResult;
    cuDevicePrimaryCtxRelease_v2: fn(CuDevice) -> CuResult;
    cuCtxSetCurrent: fn(CuContext) -> CuResult;
    cuMemAlloc_v2: fn(*mut CuDevicePtr, usize) -> CuResult;
    cuMemFree_v2: fn(CuDevicePtr) -> CuResult;
    cuMemsetD8_v2: fn(CuDevicePtr, u8, usize) -> CuResult;
    cuMemAllocHost_v2: fn(*mut *mut c_void, usize) -> CuResult;
    cuMemFreeHost: fn(*mut c_void) -> CuResult;
    cuMemHostRegister_v2: fn(*mut c_void, usize, c_uint) -> CuResult;
    cuMemHostUnregister: fn(*mut c_void) -> CuResult;
    cuMemcpyHtoDAsync_v2: fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult;
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult;
    cuStreamCreate: fn(*mut CuStream, c_uint) -> CuResult;
    cuStreamDestroy_v2: fn(CuStream) -> CuResult;
    cuStreamSynchronize: fn(CuStream) -> CuResult;
    cuStreamWaitEvent: fn(CuStream, CuEvent, c_uint) -> CuResult;
    cuEventCreate: fn(*mut CuEvent, c_uint) -> CuResult;
    cuEventDestroy_v2: fn(CuEvent) -> CuResult;
    cuEventRecord: fn(CuEvent, CuStream) -> CuResult;
    cuEventQuery: fn(CuEvent) -> CuResult;
    cuEventSynchronize: fn(CuEvent) -> CuResult;
    cuEventElapsedTime: fn(*mut f32, CuEvent, CuEvent) -> CuResult;
    cuModuleLoadData: fn(*mut CuModule, *const c_void) -> CuResult;
    cuModuleUnload: fn(CuModule) -> CuResult;
    cuModuleGetFunction: fn(*mut CuFunction, CuModule, *const c_char) -> CuResult;
    cuLaunchKernel: fn(
        CuFunction,
        c_uint, c_uint, c_uint,
        c_uint, c_uint, c_uint,
        c_uint,
        CuStream,
        *mut *mut c_void,
        *mut *mut c_void
    ) -> CuResult;
}
}

/// `ncclResult_t`: 0 is success; `ncclGetErrorString` names the others.
pub type NcclResult = c_int;
/// `ncclComm_t`.
pub type NcclComm = *mut c_void;
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress`: a non-blocking call or an abort still running.
pub const NCCL_IN_PROGRESS: NcclResult = 7;
/// `ncclFloat32`.
pub const NCCL_FLOAT32: c_int = 7;
/// `ncclSum`.
pub const NCCL_SUM: c_int = 0;
/// NCCL's library, as its wheels and packages install it.
pub const LIBNCCL: &str = "libnccl.so.2";

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    pub internal: [c_char; 128],
}

api! {
NcclApi {
    ncclGetVersion: fn(*mut c_int) -> NcclResult;
    ncclGetErrorString: fn(NcclResult) -> *const c_char;
    ncclGetUniqueId: fn(*mut NcclUniqueId) -> NcclResult;
    ncclCommInitRank: fn(*mut NcclComm, c_int, NcclUniqueId, c_int) -> NcclResult;
    ncclAllReduce: fn(
        *const c_void, *mut c_void, usize, c_int, c_int, NcclComm, CuStream
    ) -> NcclResult;
    ncclCommGetAsyncError: fn(NcclComm, *mut NcclResult) -> NcclResult;
    ncclCommAbort: fn(NcclComm) -> NcclResult;
}
}
