//! DLPack's C structures (`dlpack.h`: the legacy `DLManagedTensor` and 1.0's
//! `DLManagedTensorVersioned`) and their capsules, for `View.__dlpack__`: one allocation holds
//! the managed tensor, its shape and strides and the view's export, freed once by the deleter
//! (the consumer's call, or the capsule's destructor if nobody consumed it).

use std::ffi::{c_void, CStr};
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::view::Keep;

/// A view's export as DLPack describes it.
pub struct Tensor {
    pub addr: *mut u8,
    pub shape: Box<[i64]>,
    pub strides: Box<[i64]>,
    pub dtype: DLDataType,
    pub _keep: Keep,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const FLAG_READ_ONLY: u64 = 1;

#[repr(C)]
struct Managed {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut Managed)>,
}

#[repr(C)]
struct ManagedVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// The managed tensor first, then what its pointers point into and what keeps its memory:
/// one allocation, freed by the deleter.
#[repr(C)]
struct Holder<M> {
    managed: M,
    tensor: Tensor,
}

fn dl_tensor(t: &mut Tensor) -> DLTensor {
    DLTensor {
        data: t.addr.cast::<c_void>(),
        device: DLDevice {
            device_type: 1,
            device_id: 0,
        },
        ndim: t.shape.len() as i32,
        dtype: t.dtype,
        shape: t.shape.as_mut_ptr(),
        strides: t.strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

unsafe extern "C" fn delete_legacy(m: *mut Managed) {
    if !m.is_null() {
        // SAFETY: `m` is the first field of a `Holder<Managed>` leaked by `legacy`
        // (#[repr(C)]: same address), and DLPack calls the deleter once.
        drop(unsafe { Box::from_raw(m.cast::<Holder<Managed>>()) });
    }
}

unsafe extern "C" fn delete_versioned(m: *mut ManagedVersioned) {
    if !m.is_null() {
        // SAFETY: as in `delete_legacy`, for `versioned`'s holder.
        drop(unsafe { Box::from_raw(m.cast::<Holder<ManagedVersioned>>()) });
    }
}

/// A capsule nobody consumed still owns its tensor (a consumer renames it `used_...` and
/// calls the deleter itself when done).
unsafe extern "C" fn capsule_legacy(capsule: *mut ffi::PyObject) {
    // SAFETY: Python passes the capsule being destroyed; IsValid checks its name (and
    // sets no error) before GetPointer reads it, and the pointer is then the `Managed`
    // `legacy` stored, whose deleter frees it once.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<Managed>();
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

unsafe extern "C" fn capsule_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `capsule_legacy`, for the versioned name and struct.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let m =
                ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()).cast::<ManagedVersioned>();
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

pub fn legacy(py: Python<'_>, mut tensor: Tensor) -> PyResult<Bound<'_, PyAny>> {
    let dl = dl_tensor(&mut tensor);
    let holder = Box::into_raw(Box::new(Holder {
        managed: Managed {
            dl_tensor: dl,
            manager_ctx: ptr::null_mut(),
            deleter: Some(delete_legacy),
        },
        tensor,
    }));
    // SAFETY: `holder` is a live allocation whose first field is the managed tensor; the
    // capsule owns it (its destructor or a consumer frees it through the deleter). If the
    // capsule cannot be made, we free it here, once.
    unsafe {
        let cap = ffi::PyCapsule_New(holder.cast(), LEGACY.as_ptr(), Some(capsule_legacy));
        if cap.is_null() {
            delete_legacy(holder.cast());
        }
        Bound::from_owned_ptr_or_err(py, cap)
    }
}

pub fn versioned(
    py: Python<'_>,
    mut tensor: Tensor,
    read_only: bool,
) -> PyResult<Bound<'_, PyAny>> {
    let dl = dl_tensor(&mut tensor);
    let holder = Box::into_raw(Box::new(Holder {
        managed: ManagedVersioned {
            version: [1, 0],
            manager_ctx: ptr::null_mut(),
            deleter: Some(delete_versioned),
            flags: if read_only { FLAG_READ_ONLY } else { 0 },
            dl_tensor: dl,
        },
        tensor,
    }));
    // SAFETY: as in `legacy`.
    unsafe {
        let cap = ffi::PyCapsule_New(holder.cast(), VERSIONED.as_ptr(), Some(capsule_versioned));
        if cap.is_null() {
            delete_versioned(holder.cast());
        }
        Bound::from_owned_ptr_or_err(py, cap)
    }
}
