//! NCCL through cudarc, loaded at run time like the driver (cudarc asks the dynamic loader for
//! `libnccl.so`, then `libnccl.so.2` and its other names): the collective a drafter group
//! spread over GPUs sums its gradients with. A communicator is made from a [`UniqueId`] that one
//! rank draws and the others receive over the control plane (it is 128 plain bytes); every rank
//! then receives the same reduced buffer, which is what keeps the group's weights bitwise equal.
//!
//! [`Nccl::load`] is the presence check (cudarc panics at the first call into a library it
//! cannot load). The communicator is our own [`Comm`] over cudarc's `result` layer rather than
//! cudarc's `Comm`, whose drop also aborts but panics if the abort fails, and which has no way
//! to ask for an asynchronous error or to abort with an answer.
//!
//! A dropped [`Comm`] is aborted, not destroyed: `ncclCommDestroy` waits for peers that may be
//! dead, `ncclCommAbort` does not. A membership change aborts the communicator and makes a new
//! one at the new epoch; how a rank gives up on a peer dead inside `ncclCommInitRank` or a
//! collective is `nccl_group`'s.

use std::ffi::{c_void, CStr, OsString};
use std::sync::Arc;

use cudarc::nccl::{result, sys};

use crate::{bounds, refuse_retired, CudaContext, CudaError, CudaSlice, CudaStream, Named};
use crate::{DevicePtr, DevicePtrMut, Result};

/// Formerly the path of the NCCL library to load; refused now, as `HSPIPE_LIBCUDA` is.
pub const LIBNCCL_ENV: &str = "HSPIPE_LIBNCCL";

/// Every NCCL entry point this module calls, looked up before the first call (a library that
/// lacks one is refused by name instead of making cudarc panic).
const ENTRY_POINTS: [&str; 7] = [
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclAllReduce",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
];

/// NCCL, found and checked. Only an `Nccl` makes communicators, so nothing calls into
/// cudarc's NCCL before the presence check.
#[derive(Clone, Copy, Debug)]
pub struct Nccl {
    version: (u32, u32, u32),
}

/// The bytes every rank of one communicator must share.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}..)", &self.0[..8])
    }
}

impl Nccl {
    /// Finds NCCL where cudarc will look for it and checks that it has what this module calls.
    pub fn load() -> Result<Nccl> {
        Nccl::load_with(std::env::var_os(LIBNCCL_ENV))
    }

    pub(crate) fn load_with(retired: Option<OsString>) -> Result<Nccl> {
        refuse_retired(LIBNCCL_ENV, retired)?;
        crate::present::check(crate::present::Lib::Nccl, &ENTRY_POINTS)?;
        let v = result::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", e))?;
        let v = v.max(0) as u32;
        Ok(Nccl {
            version: (v / 10000, (v % 10000) / 100, v % 100),
        })
    }

    /// (major, minor, patch).
    pub fn version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// A fresh id for a new communicator (one rank draws it, the others are sent it).
    pub fn unique_id(&self) -> Result<UniqueId> {
        let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// Joins communicator `id` as `rank` of `nranks` on `ctx`'s device; blocks until every
    /// rank has joined.
    pub fn init_rank(
        &self,
        ctx: &Arc<CudaContext>,
        nranks: u32,
        id: &UniqueId,
        rank: u32,
    ) -> Result<Comm> {
        // NCCL uses the device of the current context.
        ctx.bind_to_thread().named("cuCtxSetCurrent")?;
        let id = sys::ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the id is passed by value. Aborted in
        // `Comm::abort` or `Comm::drop`, once.
        unsafe { result::comm_init_rank(&mut raw, nranks as i32, id, rank as i32) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(Comm {
            ctx: ctx.clone(),
            raw,
        })
    }
}

/// One rank's communicator; aborted on drop.
pub struct Comm {
    ctx: Arc<CudaContext>,
    raw: sys::ncclComm_t,
}

// SAFETY: an NCCL communicator is not tied to the thread that made it (NCCL's docs: calls on
// one communicator must not run concurrently, which `Comm` not being `Sync` ensures; the
// context is bound to the calling thread before every call). The connect thread makes it and
// hands it to the rank's thread.
unsafe impl Send for Comm {}

impl Comm {
    /// Queues the sum over the ranks of `count` floats of `send` into `recv` on `stream`
    /// (buffers of any element type: the f32 words are their bytes).
    pub fn all_reduce_sum_f32<T>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        count: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let bytes = count.saturating_mul(4);
        bounds("all-reduce input", send.num_bytes(), 0, bytes)?;
        bounds("all-reduce output", recv.num_bytes(), 0, bytes)?;
        if **stream.context() != *self.ctx {
            return Err(CudaError::Mismatch(
                "an all-reduce was queued on a stream of another device than its communicator's"
                    .into(),
            ));
        }
        self.ctx.bind_to_thread().named("cuCtxSetCurrent")?;
        // The guards record the buffers' read and write events once the collective is queued
        // (at the end of this function), so their other streams stay ordered with it.
        let (src, _read) = send.device_ptr(stream);
        let (dst, _written) = recv.device_ptr_mut(stream);
        // SAFETY: both device ranges hold `count` floats (checked above); the stream and the
        // communicator are live and of this device.
        unsafe {
            result::all_reduce(
                src as *const c_void,
                dst as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.raw,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| nccl_error("ncclAllReduce", e))?;
        Ok(())
    }

    /// An error NCCL met in the background (a peer gone, a network failure), if any.
    pub fn async_error(&self) -> Result<()> {
        // Read as a plain integer: a value outside cudarc's enum (a newer NCCL's) must not be
        // stored into the enum type.
        let mut e: u32 = 0;
        // SAFETY: NCCL writes one `ncclResult_t` (a C int) through the pointer; the
        // communicator is live.
        let r = unsafe { sys::ncclCommGetAsyncError(self.raw, (&raw mut e).cast()) };
        r.result()
            .map_err(|err| nccl_error("ncclCommGetAsyncError", err))?;
        match e {
            // ncclSuccess, and ncclInProgress (a non-blocking operation still running).
            0 | 7 => Ok(()),
            code => Err(CudaError::Nccl {
                call: "a collective (async)",
                code: code as i32,
                name: format!("NCCL error {code}"),
            }),
        }
    }

    /// Aborts the communicator: outstanding collectives are abandoned, nothing waits for peers.
    pub fn abort(mut self) -> Result<()> {
        // Null tells the drop that the communicator is gone.
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is live and aborted once: the drop sees null.
        let r = unsafe { result::comm_abort(raw) };
        r.map(|_| ()).map_err(|e| nccl_error("ncclCommAbort", e))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is live; abort frees it without waiting for peers. A failed
        // abort has no one to tell in a drop, and must not panic.
        let _ = unsafe { result::comm_abort(self.raw) };
    }
}

/// `call` failed with `e`, named by NCCL.
fn nccl_error(call: &'static str, e: result::NcclError) -> CudaError {
    // SAFETY: NCCL returns a static string for any result code (or null).
    let s = unsafe { sys::ncclGetErrorString(e.0) };
    let name = if s.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: a static, NUL-terminated string owned by NCCL.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    };
    CudaError::Nccl {
        call,
        code: e.0 as i32,
        name,
    }
}
