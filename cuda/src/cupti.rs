//! Which kernels a stretch of GPU work ran, how often and for how long: CUPTI's activity API
//! (kernel, copy and memset records, each with its start and end on the device's clock),
//! summed by name. `bench-dflash-step --trace` runs its traced gradient under a [`Profiler`], so
//! one device check says where a step's device time goes, kernel by kernel, where the trace's
//! pass times only say which pass.
//!
//! Five entry points of `libcupti` are loaded here at run time, not through cudarc's `cupti`
//! feature: in the CUDA build candle has cudarc link every library it binds, and a profile
//! must not make libcupti a library each CUDA binary needs before it can start. Here a machine
//! without it gets [`CudaError::NoCupti`] from [`Profiler::start`], which the caller reports
//! and goes on without. PyTorch's CUDA wheels bring it (`nvidia-cuda-cupti`), and
//! `scripts/cuda-env.sh` puts their directories on `LD_LIBRARY_PATH`.
//!
//! A record's fields are read at fixed offsets: every version of CUPTI's kernel record since
//! the fourth keeps `start`, `end` and `name` at bytes 16, 24 and 104, copies keep `bytes`,
//! `start` and `end` at 8, 16 and 24, memsets the same. The tests check them against the
//! layouts cudarc's bindings generated from NVIDIA's CUDA 13.0 headers (kernel records 4 to 10);
//! the records 11 to 13 of CUDA 13.1 to 13.4, which a CUPTI newer than the build may write, are
//! in the same bindings file (for those versions' features, which cannot be built beside 13.0's)
//! with the same fields ahead of `name`: read there, not tested. A record without timestamps
//! (a start or an end of 0) counts its launch and no time.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::{CudaError, Result};

/// The names the dynamic loader is asked for, newest first.
const LIBRARIES: [&str; 3] = ["libcupti.so.13", "libcupti.so", "libcupti.so.12"];

// CUpti_ActivityKind values (cupti_activity.h), the same in every CUPTI.
const KIND_MEMCPY: u32 = 1;
const KIND_MEMSET: u32 = 2;
const KIND_KERNEL: u32 = 3;
const KIND_CONCURRENT_KERNEL: u32 = 10;
/// The kinds recorded: kernels (concurrent: each kernel's own times, as the streams overlap
/// them), copies and memsets.
const KINDS: [u32; 3] = [KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET];
// CUptiResult values.
const SUCCESS: i32 = 0;
/// `cuptiActivityGetNextRecord`: no more records in the buffer.
const MAX_LIMIT_REACHED: i32 = 12;
/// `cuptiActivityFlushAll`'s flag: flush even records whose kernels have not completed.
const FLUSH_FORCED: u32 = 1;

// Byte offsets in a record (checked in the tests against cudarc's bindings).
const KERNEL_START: usize = 16;
const KERNEL_END: usize = 24;
const KERNEL_NAME: usize = 104;
const COPY_KIND: usize = 4;
const COPY_START: usize = 16;
const COPY_END: usize = 24;

/// The buffers CUPTI fills: 8 MiB, as its samples size them, aligned for its records.
const BUFFER: Layout = match Layout::from_size_align(8 << 20, 8) {
    Ok(layout) => layout,
    Err(_) => panic!("a buffer's size and alignment"),
};

type Requested = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type Completed = unsafe extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);

/// The entry points, resolved once for the process (CUPTI is one per process too).
struct Api {
    enable: unsafe extern "C" fn(u32) -> i32,
    disable: unsafe extern "C" fn(u32) -> i32,
    register: unsafe extern "C" fn(Requested, Completed) -> i32,
    flush_all: unsafe extern "C" fn(u32) -> i32,
    next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> i32,
    /// Keeps the functions above mapped.
    _lib: libloading::Library,
}

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
/// One profiler at a time: CUPTI's buffers and callbacks are the process's.
static RUNNING: AtomicBool = AtomicBool::new(false);
/// What the completed buffers held, by name: (launches, nanoseconds).
static TIMES: Mutex<Option<HashMap<String, (u64, u64)>>> = Mutex::new(None);

fn api() -> Result<&'static Api> {
    let loaded = API.get_or_init(|| {
        let mut tried = Vec::new();
        for name in LIBRARIES {
            // SAFETY: loading libcupti runs its initialisers, which only set up CUPTI's own
            // state; nothing of it is called until the symbols below are resolved.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return resolve(lib, name),
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(format!(
            "libcupti not found (PyTorch's CUDA wheels bring it, nvidia-cuda-cupti; put its \
             directory on LD_LIBRARY_PATH): {}",
            tried.join("; ")
        ))
    });
    loaded
        .as_ref()
        .map_err(|why| CudaError::NoCupti { why: why.clone() })
}

fn resolve(lib: libloading::Library, name: &str) -> std::result::Result<Api, String> {
    // SAFETY: each symbol is CUPTI's function of that name, whose C signature (cupti_activity.h)
    // the type it is read as spells out: enums and flags as 32-bit integers, the buffer
    // callbacks as `Requested` and `Completed`, the record as a byte pointer. The pointers stay
    // valid while `_lib` keeps the library mapped, and `Api` holds both.
    unsafe {
        Ok(Api {
            enable: symbol(&lib, name, "cuptiActivityEnable")?,
            disable: symbol(&lib, name, "cuptiActivityDisable")?,
            register: symbol(&lib, name, "cuptiActivityRegisterCallbacks")?,
            flush_all: symbol(&lib, name, "cuptiActivityFlushAll")?,
            next_record: symbol(&lib, name, "cuptiActivityGetNextRecord")?,
            _lib: lib,
        })
    }
}

/// `lib`'s function `symbol`, as `T`.
///
/// # Safety
/// `T` is the function's type; the value is valid while `lib` stays loaded.
unsafe fn symbol<T: Copy>(
    lib: &libloading::Library,
    name: &str,
    symbol: &str,
) -> std::result::Result<T, String> {
    // SAFETY: the caller's promise.
    (unsafe { lib.get::<T>(symbol) })
        .map(|s| *s)
        .map_err(|e| format!("{name} lacks {symbol}: {e}"))
}

fn check(call: &'static str, code: i32) -> Result<()> {
    match code {
        SUCCESS => Ok(()),
        code => Err(CudaError::Cupti { call, code }),
    }
}

/// Device time spent in one kernel (or kind of copy), summed over its launches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelTime {
    /// The kernel's name as the driver has it (C++ names mangled), or `memcpy <kind>`,
    /// `memset`.
    pub name: String,
    pub launches: u64,
    pub nanos: u64,
}

/// Kernel, copy and memset records from [`Profiler::start`] to [`Profiler::finish`].
pub struct Profiler {
    api: &'static Api,
}

impl Profiler {
    /// Starts recording every kernel, copy and memset the process's contexts run. Fails without
    /// a driver ([`CudaError::NoDriver`]: nothing of CUPTI's is touched), without libcupti
    /// ([`CudaError::NoCupti`]), while another profiler runs, or when CUPTI refuses (another
    /// CUPTI client, such as a profiler the process runs under).
    pub fn start() -> Result<Profiler> {
        // The driver first: libcupti 13.2 without one recurses in its own error path until the
        // stack overflows (seen on a machine with PyTorch's wheels and no GPU), where this is
        // `CudaError::NoDriver`.
        crate::Driver::load()?;
        let api = api()?;
        if RUNNING.swap(true, Ordering::AcqRel) {
            return Err(CudaError::Mismatch(
                "a kernel profile is already being recorded in this process".into(),
            ));
        }
        *TIMES.lock().unwrap_or_else(|e| e.into_inner()) = Some(HashMap::new());
        let started = (|| {
            // SAFETY: the callbacks are `extern "C"` functions of CUPTI's buffer-callback
            // signatures that live for the program.
            check("cuptiActivityRegisterCallbacks", unsafe {
                (api.register)(requested, completed)
            })?;
            for kind in KINDS {
                // SAFETY: a plain call with an activity kind CUPTI defines.
                check("cuptiActivityEnable", unsafe { (api.enable)(kind) })?;
            }
            Ok(())
        })();
        let profiler = Profiler { api };
        started.map(|()| profiler)
    }

    /// The device time by name since the start or the last `take`, the longest first; the
    /// recording goes on. The caller synchronizes the device first: CUPTI records a kernel once
    /// it has run.
    pub fn take(&mut self) -> Result<Vec<KernelTime>> {
        // SAFETY: a plain call; CUPTI hands each buffer to `completed` before it returns.
        check("cuptiActivityFlushAll", unsafe {
            (self.api.flush_all)(FLUSH_FORCED)
        })?;
        let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
        let taken = times.as_mut().map(std::mem::take).unwrap_or_default();
        Ok(ranked(taken))
    }

    /// [`Profiler::take`], and the recording stops.
    pub fn finish(mut self) -> Result<Vec<KernelTime>> {
        self.take()
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        for kind in KINDS {
            // SAFETY: a plain call; disabling a kind that was never enabled is harmless.
            unsafe { (self.api.disable)(kind) };
        }
        // Buffers CUPTI still holds come back now, not into the next profiler's sums.
        // SAFETY: a plain call.
        unsafe { (self.api.flush_all)(FLUSH_FORCED) };
        *TIMES.lock().unwrap_or_else(|e| e.into_inner()) = None;
        RUNNING.store(false, Ordering::Release);
    }
}

/// The sums by name, the longest first (then by name, so equal times list the same way).
fn ranked(times: HashMap<String, (u64, u64)>) -> Vec<KernelTime> {
    let mut out: Vec<KernelTime> = (times.into_iter())
        .map(|(name, (launches, nanos))| KernelTime {
            name,
            launches,
            nanos,
        })
        .collect();
    out.sort_by(|a, b| b.nanos.cmp(&a.nanos).then_with(|| a.name.cmp(&b.name)));
    out
}

/// CUPTI asks for a buffer to fill.
unsafe extern "C" fn requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: the layout's size is not zero; the buffer is freed in `completed` with the same
    // layout. CUPTI passes valid pointers for the three outputs.
    unsafe {
        let p = std::alloc::alloc(BUFFER);
        *buffer = p;
        *size = if p.is_null() { 0 } else { BUFFER.size() };
        *max_records = 0; // as many as fit
    }
}

/// CUPTI hands back a buffer with `valid` bytes of records: summed into [`TIMES`], then freed.
unsafe extern "C" fn completed(_: *mut c_void, _: u32, buffer: *mut u8, _: usize, valid: usize) {
    if buffer.is_null() {
        return;
    }
    if let Some(Ok(api)) = API.get() {
        let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
        let mut record: *mut u8 = std::ptr::null_mut();
        loop {
            // SAFETY: `buffer` is one of ours that CUPTI filled with `valid` bytes of records;
            // `record` is where it writes the next one's address.
            let code = unsafe { (api.next_record)(buffer, valid, &mut record) };
            if code == MAX_LIMIT_REACHED {
                break; // the buffer's end
            }
            if code != SUCCESS || record.is_null() {
                // A corrupt buffer: what was read stands. (No panic here: it would abort,
                // unwinding out of a C callback.)
                break;
            }
            // SAFETY: CUPTI's record, whose kind says its layout (`decode`).
            if let (Some(map), Some((name, nanos))) = (times.as_mut(), unsafe { decode(record) }) {
                let e = map.entry(name).or_insert((0, 0));
                e.0 += 1;
                e.1 += nanos;
            }
        }
    }
    // SAFETY: allocated by `requested` with this layout, and CUPTI is done with it.
    unsafe { std::alloc::dealloc(buffer, BUFFER) };
}

/// A record's name and device time, for the kinds recorded; `None` for any other.
///
/// # Safety
/// `record` points at a whole CUPTI activity record of the kind its first four bytes say.
unsafe fn decode(record: *const u8) -> Option<(String, u64)> {
    let at64 = |offset: usize| {
        // SAFETY: `offset` is inside a record of the kind matched below (the caller's promise).
        unsafe { record.add(offset).cast::<u64>().read_unaligned() }
    };
    // SAFETY: every record starts with its kind, a 32-bit enum.
    let kind = unsafe { record.cast::<u32>().read_unaligned() };
    // CUPTI leaves a timestamp 0 where it has none: no time, rather than an end less 0.
    let span = |start, end| match (at64(start), at64(end)) {
        (0, _) | (_, 0) => 0,
        (s, e) => e.saturating_sub(s),
    };
    match kind {
        KIND_KERNEL | KIND_CONCURRENT_KERNEL => {
            // SAFETY: the kernel's name, a C string CUPTI owns and keeps while it runs.
            let name = unsafe {
                record
                    .add(KERNEL_NAME)
                    .cast::<*const c_char>()
                    .read_unaligned()
            };
            let name = match name.is_null() {
                true => "(unnamed kernel)".to_string(),
                // SAFETY: not null, so the C string above.
                false => unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            };
            Some((name, span(KERNEL_START, KERNEL_END)))
        }
        KIND_MEMCPY => {
            // SAFETY: a copy record's kind of copy, one byte.
            let copy = unsafe { *record.add(COPY_KIND) };
            Some((
                format!("memcpy {}", copy_kind(copy)),
                span(COPY_START, COPY_END),
            ))
        }
        KIND_MEMSET => Some(("memset".to_string(), span(COPY_START, COPY_END))),
        _ => None,
    }
}

/// CUpti_ActivityMemcpyKind, as a name.
fn copy_kind(kind: u8) -> &'static str {
    match kind {
        1 => "host to device",
        2 => "device to host",
        3 => "host to array",
        4 => "array to host",
        5 => "array to array",
        6 => "array to device",
        7 => "device to array",
        8 => "device to device",
        9 => "host to host",
        10 => "peer to peer",
        _ => "of another kind",
    }
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use cudarc::cupti::sys;

    use super::*;

    /// Every kernel record version the bindings have keeps start, end and name where `decode`
    /// reads them; so do the copy and memset records.
    #[test]
    fn the_offsets_read_are_those_of_nvidias_record_layouts() {
        macro_rules! kernel {
            ($($t:ident),*) => {$(
                assert_eq!(offset_of!(sys::$t, start), KERNEL_START, stringify!($t));
                assert_eq!(offset_of!(sys::$t, end), KERNEL_END, stringify!($t));
                assert_eq!(offset_of!(sys::$t, name), KERNEL_NAME, stringify!($t));
            )*};
        }
        kernel!(
            CUpti_ActivityKernel4,
            CUpti_ActivityKernel5,
            CUpti_ActivityKernel6,
            CUpti_ActivityKernel7,
            CUpti_ActivityKernel8,
            CUpti_ActivityKernel9,
            CUpti_ActivityKernel10
        );
        macro_rules! copy {
            ($($t:ident),*) => {$(
                assert_eq!(offset_of!(sys::$t, start), COPY_START, stringify!($t));
                assert_eq!(offset_of!(sys::$t, end), COPY_END, stringify!($t));
            )*};
        }
        copy!(
            CUpti_ActivityMemcpy5,
            CUpti_ActivityMemcpy6,
            CUpti_ActivityMemset4
        );
        assert_eq!(offset_of!(sys::CUpti_ActivityMemcpy6, copyKind), COPY_KIND);
        use sys::CUpti_ActivityKind as K;
        assert_eq!(K::CUPTI_ACTIVITY_KIND_MEMCPY as u32, KIND_MEMCPY);
        assert_eq!(K::CUPTI_ACTIVITY_KIND_MEMSET as u32, KIND_MEMSET);
        assert_eq!(K::CUPTI_ACTIVITY_KIND_KERNEL as u32, KIND_KERNEL);
        assert_eq!(
            K::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32,
            KIND_CONCURRENT_KERNEL
        );
        assert_eq!(sys::CUptiResult::CUPTI_SUCCESS as i32, SUCCESS);
        assert_eq!(
            sys::CUptiResult::CUPTI_ERROR_MAX_LIMIT_REACHED as i32,
            MAX_LIMIT_REACHED
        );
        assert_eq!(
            sys::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32,
            FLUSH_FORCED
        );
        assert_eq!(
            sys::CUpti_ActivityMemcpyKind::CUPTI_ACTIVITY_MEMCPY_KIND_HTOD as u8,
            1
        );
        assert_eq!(
            sys::CUpti_ActivityMemcpyKind::CUPTI_ACTIVITY_MEMCPY_KIND_DTOD as u8,
            8
        );
    }

    /// Records built with NVIDIA's layouts decode to their name and device time.
    #[test]
    fn records_decode_to_their_name_and_device_time() {
        let name = c"ucopy_f32";
        // SAFETY: all-zero bytes are a valid record of plain integers and null pointers.
        let mut k: sys::CUpti_ActivityKernel10 = unsafe { std::mem::zeroed() };
        k.kind = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        (k.start, k.end, k.name) = (1_000, 4_500, name.as_ptr());
        // SAFETY: a whole kernel record.
        let got = unsafe { decode((&raw const k).cast()) };
        assert_eq!(got, Some(("ucopy_f32".to_string(), 3_500)));
        // Without a start (CUPTI's 0), the launch counts and no time: not 4.5 microseconds.
        k.start = 0;
        // SAFETY: as above.
        let got = unsafe { decode((&raw const k).cast()) };
        assert_eq!(got, Some(("ucopy_f32".to_string(), 0)));

        // SAFETY: as above.
        let mut c: sys::CUpti_ActivityMemcpy6 = unsafe { std::mem::zeroed() };
        c.kind = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMCPY;
        c.copyKind = sys::CUpti_ActivityMemcpyKind::CUPTI_ACTIVITY_MEMCPY_KIND_DTOH as u8;
        (c.start, c.end, c.bytes) = (10, 70, 1 << 20);
        // SAFETY: a whole copy record.
        let got = unsafe { decode((&raw const c).cast()) };
        assert_eq!(got, Some(("memcpy device to host".to_string(), 60)));

        // SAFETY: as above.
        let mut m: sys::CUpti_ActivityMemset4 = unsafe { std::mem::zeroed() };
        m.kind = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_MEMSET;
        (m.start, m.end) = (5, 6);
        // SAFETY: a whole memset record.
        let got = unsafe { decode((&raw const m).cast()) };
        assert_eq!(got, Some(("memset".to_string(), 1)));

        // Another kind is not counted.
        m.kind = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_DRIVER;
        // SAFETY: a record at least as long as any field read (none is, for this kind).
        assert_eq!(unsafe { decode((&raw const m).cast()) }, None);
    }

    #[test]
    fn times_rank_longest_first_then_by_name() {
        let times = HashMap::from([
            ("b".to_string(), (2, 50)),
            ("a".to_string(), (1, 50)),
            ("c".to_string(), (7, 900)),
        ]);
        let names: Vec<String> = ranked(times).into_iter().map(|k| k.name).collect();
        assert_eq!(names, ["c", "a", "b"]);
    }

    /// A machine without libcupti gets an error naming it and what to do, not a panic, and can
    /// ask again.
    #[test]
    fn without_libcupti_a_profile_is_an_error_that_says_where_it_comes_from() {
        if api().is_ok() {
            return; // a machine with CUPTI: nothing to show here
        }
        for _ in 0..2 {
            let said = api().err().expect("no libcupti here").to_string();
            assert!(said.contains("libcupti.so.13"), "{said}");
            assert!(said.contains("LD_LIBRARY_PATH"), "{said}");
        }
    }

    /// Without a driver a profile is refused before CUPTI is touched (libcupti 13.2 without
    /// one overflows the stack), and the error says it is the driver.
    #[test]
    fn without_a_driver_a_profile_is_refused_before_cupti_is_called() {
        if crate::Driver::load().is_ok() {
            return; // a machine with a driver: nothing to show here
        }
        let e = Profiler::start().err().expect("no driver here");
        assert!(matches!(e, CudaError::NoDriver { .. }), "{e}");
        assert!(!RUNNING.load(Ordering::Acquire));
    }
}
