//! NCCL, opened at run time like the driver (`$HSPIPE_LIBNCCL`, else `libnccl.so.2`): the
//! collective a drafter group spread over GPUs sums its gradients with. A communicator is made
//! from a [`UniqueId`] that one rank draws and the others receive over the control plane (it is
//! 128 plain bytes); every rank then receives the same reduced buffer, which is what keeps the
//! group's weights bitwise equal.
//!
//! A dropped [`Comm`] is aborted, not destroyed: `ncclCommDestroy` waits for peers that may be
//! dead, `ncclCommAbort` does not. A membership change aborts the communicator and makes a new
//! one at the new epoch. Not here yet: the non-blocking communicator config that lets a rank
//! give up on a peer dead inside `ncclCommInitRank` or a collective (a dead peer is today seen
//! through the launcher's membership change, which aborts).

use std::ffi::CStr;
use std::sync::Arc;

use crate::sys::{self, NcclApi, NcclComm, NcclResult};
use crate::{CudaError, Device, DeviceBuffer, Result, Stream};

/// Environment variable naming the NCCL library to load.
pub const LIBNCCL_ENV: &str = "HSPIPE_LIBNCCL";

/// The loaded NCCL library.
#[derive(Clone)]
pub struct Nccl {
    api: Arc<NcclApi>,
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
    /// Loads NCCL (`$HSPIPE_LIBNCCL`, else `libnccl.so.2`).
    pub fn load() -> Result<Nccl> {
        let path = std::env::var(LIBNCCL_ENV).unwrap_or_else(|_| sys::LIBNCCL.to_string());
        Nccl::load_from(&path)
    }

    pub fn load_from(path: &str) -> Result<Nccl> {
        let api = NcclApi::load(path).map_err(|e| CudaError::NoNccl {
            path: e.path,
            why: match e.symbol {
                None => e.why,
                Some(s) => format!("it lacks {s}: {}", e.why),
            },
        })?;
        Ok(Nccl { api: Arc::new(api) })
    }

    /// (major, minor, patch).
    pub fn version(&self) -> Result<(u32, u32, u32)> {
        let mut v = 0;
        // SAFETY: writes one int through a valid pointer.
        let r = unsafe { (self.api.ncclGetVersion)(&mut v) };
        self.check("ncclGetVersion", r)?;
        let v = v.max(0) as u32;
        Ok((v / 10000, (v % 10000) / 100, v % 100))
    }

    /// A fresh id for a new communicator (one rank draws it, the others are sent it).
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = sys::NcclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte struct through a valid pointer.
        let r = unsafe { (self.api.ncclGetUniqueId)(&mut id) };
        self.check("ncclGetUniqueId", r)?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// Joins communicator `id` as `rank` of `nranks` on `dev`; blocks until every rank has
    /// joined.
    pub fn init_rank<'d>(
        &self,
        dev: &'d Device,
        nranks: u32,
        id: &UniqueId,
        rank: u32,
    ) -> Result<Comm<'d>> {
        dev.bind()?;
        let mut comm: NcclComm = std::ptr::null_mut();
        let id = sys::NcclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: writes one communicator handle; the id is passed by value; NCCL uses the
        // device whose context `bind` made current. Released in Comm::drop.
        let r = unsafe { (self.api.ncclCommInitRank)(&mut comm, nranks as i32, id, rank as i32) };
        self.check("ncclCommInitRank", r)?;
        Ok(Comm {
            nccl: self.clone(),
            dev,
            raw: comm,
        })
    }

    fn check(&self, call: &'static str, r: NcclResult) -> Result<()> {
        if r == sys::NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any result code.
        let s = unsafe { (self.api.ncclGetErrorString)(r) };
        let name = if s.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a static, NUL-terminated string owned by NCCL.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(CudaError::Nccl {
            call,
            code: r,
            name,
        })
    }
}

/// One rank's communicator; aborted on drop.
pub struct Comm<'d> {
    nccl: Nccl,
    dev: &'d Device,
    raw: NcclComm,
}

impl Comm<'_> {
    /// Queues the sum over the ranks of `count` floats of `send` into `recv` on `stream`.
    pub fn all_reduce_sum_f32(
        &self,
        send: &DeviceBuffer<'_>,
        recv: &DeviceBuffer<'_>,
        count: usize,
        stream: &Stream<'_>,
    ) -> Result<()> {
        let bytes = count.saturating_mul(4);
        send.bounds("all-reduce input", 0, bytes)?;
        recv.bounds("all-reduce output", 0, bytes)?;
        self.dev.bind()?;
        // SAFETY: both device ranges hold `count` floats (checked); the stream and the
        // communicator are live and of this device.
        let r = unsafe {
            (self.nccl.api.ncclAllReduce)(
                send.ptr as *const std::ffi::c_void,
                recv.ptr as *mut std::ffi::c_void,
                count,
                sys::NCCL_FLOAT32,
                sys::NCCL_SUM,
                self.raw,
                stream.raw,
            )
        };
        self.nccl.check("ncclAllReduce", r)
    }

    /// An error NCCL met in the background (a peer gone, a network failure), if any.
    pub fn async_error(&self) -> Result<()> {
        let mut e = sys::NCCL_SUCCESS;
        // SAFETY: writes one result through a valid pointer; the communicator is live.
        let r = unsafe { (self.nccl.api.ncclCommGetAsyncError)(self.raw, &mut e) };
        self.nccl.check("ncclCommGetAsyncError", r)?;
        match e {
            sys::NCCL_IN_PROGRESS => Ok(()),
            e => self.nccl.check("a collective (async)", e),
        }
    }

    /// Aborts the communicator: outstanding collectives are abandoned, nothing waits for peers.
    pub fn abort(self) -> Result<()> {
        let raw = self.raw;
        let nccl = self.nccl.clone();
        std::mem::forget(self);
        // SAFETY: the communicator is live and aborted once (Drop will not run).
        let r = unsafe { (nccl.api.ncclCommAbort)(raw) };
        nccl.check("ncclCommAbort", r)
    }
}

impl Drop for Comm<'_> {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: the communicator is live; abort frees it without waiting for peers.
        unsafe { (self.nccl.api.ncclCommAbort)(self.raw) };
    }
}
