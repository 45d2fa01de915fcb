//! Zero-copy views of a batch's sections, for Python: the buffer protocol (`memoryview`,
//! `numpy.asarray`) and DLPack (`numpy.from_dlpack`, `torch.from_dlpack`).
//!
//! A [`View`] names memory; it does not keep it. Memory is kept by *exports*: each buffer a
//! consumer holds (a `memoryview`, a numpy array, a torch tensor) owns an export, taken when the
//! consumer asks for the buffer and given back when it lets go (`__releasebuffer__`, or the
//! DLPack deleter, which may run on any thread, without the interpreter lock). Exports of a ring
//! slot are counted in its [`Exports`]; the slot is committed, released or given back only after
//! [`Exports::try_close`] succeeded, which happens only with no export alive and after which no
//! export can be taken. So no consumer can hold a pointer into a slot the ring may hand to
//! another process: a slot is never reused while a view of it lives. The ring's mapping itself
//! is never unmapped while the process lives (the package keeps it for the whole process), so
//! memory behind an export is always mapped.
//!
//! The package's unsafe code is here (filling a `Py_buffer`), in `dlpack.rs` (DLPack's C
//! structures) and in `detach.rs`.

use std::ffi::{c_int, c_void, CStr};
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// An element type of a section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    U8,
    U32,
    F16,
    Bf16,
    F32,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::F16 | Elem::Bf16 => 2,
            Elem::U32 | Elem::F32 => 4,
        }
    }

    /// The buffer protocol's format. bf16 has no `struct` code: it is exported as its raw 16-bit
    /// patterns (`<H`); DLPack carries it as bf16.
    fn format(self) -> &'static CStr {
        match self {
            Elem::U8 => c"B",
            Elem::U32 => c"<I",
            Elem::F16 => c"<e",
            Elem::Bf16 => c"<H",
            Elem::F32 => c"<f",
        }
    }

    /// DLPack's type code and bits (kDLUInt 1, kDLFloat 2, kDLBfloat 4).
    fn dlpack(self) -> crate::dlpack::DLDataType {
        let (code, bits) = match self {
            Elem::U8 => (1, 8),
            Elem::U32 => (1, 32),
            Elem::F16 => (2, 16),
            Elem::Bf16 => (4, 16),
            Elem::F32 => (2, 32),
        };
        crate::dlpack::DLDataType {
            code,
            bits,
            lanes: 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Elem::U8 => "uint8",
            Elem::U32 => "uint32",
            Elem::F16 => "float16",
            Elem::Bf16 => "bfloat16",
            Elem::F32 => "float32",
        }
    }

    pub fn of(dtype: proto::Dtype) -> Elem {
        match dtype {
            proto::Dtype::Bf16 => Elem::Bf16,
            proto::Dtype::F16 => Elem::F16,
            proto::Dtype::F32 => Elem::F32,
        }
    }
}

/// The live exports of one slot, by section, and whether the slot is closed to new ones.
pub struct Exports {
    state: Mutex<ExportState>,
}

struct ExportState {
    closed: bool,
    live: Vec<(&'static str, usize)>,
}

impl Exports {
    pub fn new(sections: &[&'static str]) -> Arc<Exports> {
        Arc::new(Exports {
            state: Mutex::new(ExportState {
                closed: false,
                live: sections.iter().map(|&s| (s, 0)).collect(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, ExportState> {
        // A panic cannot happen while the lock is held (plain counter updates): a poisoned lock
        // still holds consistent counts.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An export of `section`, unless the slot is closed.
    fn acquire(self: &Arc<Self>, section: usize) -> Option<Guard> {
        let mut st = self.lock();
        if st.closed {
            return None;
        }
        st.live[section].1 += 1;
        Some(Guard {
            exports: Arc::clone(self),
            section,
        })
    }

    /// Closes the slot to new exports if none is alive; otherwise names the sections still
    /// exported, with their counts ("hidden_states (2)").
    pub fn try_close(&self) -> Result<(), Vec<String>> {
        let mut st = self.lock();
        let live: Vec<String> = (st.live.iter())
            .filter(|(_, n)| *n > 0)
            .map(|(s, n)| format!("{s} ({n})"))
            .collect();
        if live.is_empty() {
            st.closed = true;
            Ok(())
        } else {
            Err(live)
        }
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }
}

/// One live export; dropping it gives it back.
pub struct Guard {
    exports: Arc<Exports>,
    section: usize,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.exports.lock().live[self.section].1 -= 1;
    }
}

/// Memory owned by the package (a claim's ids and mask, a reduction's sum), 8-byte aligned.
pub struct Owned {
    words: Vec<u64>,
    len: usize,
}

impl Owned {
    pub fn from_bytes(bytes: &[u8]) -> Arc<Owned> {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (w, c) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            *w = u64::from_ne_bytes(b);
        }
        Arc::new(Owned {
            words,
            len: bytes.len(),
        })
    }
}

/// Where a view's bytes are.
pub enum Memory {
    /// Section `section` of a ring slot this process holds, at `addr` (`len` bytes).
    Slot {
        exports: Arc<Exports>,
        section: usize,
        addr: usize,
        len: usize,
    },
    Owned(Arc<Owned>),
}

/// What an export holds so its bytes stay valid.
pub enum Keep {
    Slot(#[allow(dead_code)] Guard),
    Owned(#[allow(dead_code)] Arc<Owned>),
}

/// A section of a batch (or a buffer the package made), to be viewed without a copy.
#[pyclass(frozen, module = "hspipe")]
pub struct View {
    mem: Memory,
    name: &'static str,
    elem: Elem,
    shape: Vec<usize>,
    writable: bool,
}

impl View {
    pub fn new(
        mem: Memory,
        name: &'static str,
        elem: Elem,
        shape: Vec<usize>,
        writable: bool,
    ) -> View {
        // Owned memory is shared between views, so it is never writable.
        let writable = writable && matches!(mem, Memory::Slot { .. });
        View {
            mem,
            name,
            elem,
            shape,
            writable,
        }
    }

    fn len(&self) -> usize {
        match &self.mem {
            Memory::Slot { len, .. } => *len,
            Memory::Owned(o) => o.len,
        }
    }

    /// An export: the bytes' address and what keeps them valid, or an error if the slot was
    /// committed or released.
    fn export(&self) -> PyResult<(*mut u8, Keep)> {
        if let Memory::Slot { .. } = self.mem {
            // A forked child's export would be invisible to the parent, which would reuse the
            // slot under it.
            crate::local::same_process()?;
        }
        match &self.mem {
            Memory::Slot {
                exports,
                section,
                addr,
                ..
            } => match exports.acquire(*section) {
                Some(g) => Ok((*addr as *mut u8, Keep::Slot(g))),
                None => Err(PyBufferError::new_err(format!(
                    "{}: its batch was committed or released, so its memory belongs to the ring again",
                    self.name
                ))),
            },
            Memory::Owned(o) => Ok((o.words.as_ptr() as *mut u8, Keep::Owned(Arc::clone(o)))),
        }
    }

    /// Row-major strides in elements.
    fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.shape.len()];
        for i in (0..self.shape.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.shape[i + 1];
        }
        s
    }
}

/// What a buffer-protocol export keeps until `__releasebuffer__` (its `internal`).
struct BufferExport {
    shape: Box<[isize]>,
    strides: Box<[isize]>,
    _keep: Keep,
}

#[pymethods]
impl View {
    /// The section's name (`hidden_states`, ...).
    #[getter]
    fn name(&self) -> &'static str {
        self.name
    }
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }
    /// The element type's name (`bfloat16`, `float32`, `uint32`, `uint8`, `float16`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.elem.name()
    }
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "<hspipe.View {} {:?} {}{}>",
            self.name,
            self.shape,
            self.elem.name(),
            if self.writable { "" } else { " read-only" }
        )
    }

    /// The buffer protocol. A writable buffer of a read-only view is refused.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("a null Py_buffer"));
        }
        let this = slf.get();
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE && !this.writable {
            return Err(PyBufferError::new_err(format!(
                "{} is read-only",
                this.name
            )));
        }
        let (addr, keep) = this.export()?;
        let size = this.elem.size();
        let export = Box::into_raw(Box::new(BufferExport {
            shape: this.shape.iter().map(|&d| d as isize).collect(),
            strides: (this.strides().iter())
                .map(|&s| (s * size) as isize)
                .collect(),
            _keep: keep,
        }));
        // SAFETY: `view` is the non-null Py_buffer the caller passed for us to fill, ours for
        // the duration of this call. `export` was just leaked from a Box and is reclaimed
        // exactly once, by `__releasebuffer__`; its shape and strides live on the heap until
        // then, as the protocol requires. `addr` points at `len` bytes kept valid by the export
        // (a held slot in the never-unmapped ring, or owned memory the export holds). `obj`
        // takes a new reference to `slf`, which PyBuffer_Release gives back.
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = addr.cast::<c_void>();
            (*view).len = this.len() as isize;
            (*view).readonly = c_int::from(!this.writable);
            (*view).itemsize = size as isize;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                this.elem.format().as_ptr().cast_mut()
            } else {
                ptr::null_mut()
            };
            (*view).ndim = this.shape.len() as c_int;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                (*export).shape.as_mut_ptr()
            } else {
                ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                (*export).strides.as_mut_ptr()
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = export.cast::<c_void>();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        if view.is_null() {
            return;
        }
        // SAFETY: `view` is a buffer `__getbuffer__` filled (Python calls this once per
        // successful export), so `internal` is the Box it leaked, reclaimed here exactly once.
        unsafe {
            let export = (*view).internal.cast::<BufferExport>();
            if !export.is_null() {
                drop(Box::from_raw(export));
                (*view).internal = ptr::null_mut();
            }
        }
    }

    /// DLPack's device: the CPU (kDLCPU 1, device 0). Ring slots are host memory.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (1, 0)
    }

    /// A DLPack capsule of the view, without a copy: versioned (1.0, with the read-only flag of
    /// a drafter's views) when the consumer asks for it, legacy otherwise.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream; // host memory: there is no stream to order against
        if dl_device.is_some_and(|d| d != (1, 0)) {
            return Err(PyBufferError::new_err(format!(
                "{}: only the CPU (1, 0) can view ring memory without a copy",
                self.name
            )));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(format!(
                "{}: hspipe's views do not copy; copy after viewing",
                self.name
            )));
        }
        let (addr, keep) = self.export()?;
        let tensor = crate::dlpack::Tensor {
            addr,
            shape: self.shape.iter().map(|&d| d as i64).collect(),
            strides: self.strides().iter().map(|&s| s as i64).collect(),
            dtype: self.elem.dlpack(),
            _keep: keep,
        };
        if max_version.is_some_and(|(major, _)| major >= 1) {
            crate::dlpack::versioned(py, tensor, !self.writable)
        } else {
            crate::dlpack::legacy(py, tensor)
        }
    }

    /// A numpy array over the view (`numpy.asarray(view)`; bf16 as its uint16 bit patterns,
    /// use DLPack for bf16 tensors).
    fn numpy<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let np = slf.py().import("numpy")?;
        np.call_method1("asarray", (slf,))
    }
}

/// A read-only view of owned bytes, for arrays the package returns (a claim's `input_ids`).
pub fn owned(name: &'static str, elem: Elem, shape: Vec<usize>, bytes: &[u8]) -> View {
    View::new(
        Memory::Owned(Owned::from_bytes(bytes)),
        name,
        elem,
        shape,
        false,
    )
}

/// A view of section `section` (named `names[section]`) of a ring slot whose exports are
/// `exports`: `len` bytes at `addr`, as `shape` of `elem`.
#[allow(clippy::too_many_arguments)]
pub fn of_slot(
    exports: &Arc<Exports>,
    names: &[&'static str; 4],
    section: usize,
    (addr, len): (usize, usize),
    elem: Elem,
    shape: Vec<usize>,
    writable: bool,
) -> PyResult<View> {
    crate::local::same_process()?;
    check_shape(names[section], elem, &shape, len)?;
    let memory = Memory::Slot {
        exports: Arc::clone(exports),
        section,
        addr,
        len,
    };
    Ok(View::new(memory, names[section], elem, shape, writable))
}

/// Raises if `shape` does not hold `len` bytes of `elem` (a bug of ours, never the user's).
pub fn check_shape(name: &str, elem: Elem, shape: &[usize], len: usize) -> PyResult<()> {
    if shape.iter().product::<usize>() * elem.size() != len {
        return Err(PyValueError::new_err(format!(
            "{name}: {len} bytes do not make a {shape:?} array of {}",
            elem.name()
        )));
    }
    Ok(())
}
