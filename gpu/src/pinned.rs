//! The ring's payload arena page-locked for a cuda worker's GPU (`cuMemHostRegister`), so its
//! copies of batches into and out of slots run asynchronously at the copy engines' speed. The
//! registration borrows the ring: it cannot outlive the mapping it covers.

use std::marker::PhantomData;

use shm_ring::Ring;

use crate::BackendKind;

/// The arena's registration, unregistered on drop (before the ring it borrows goes).
pub struct PinnedArena<'r> {
    _registered: cuda::Registered,
    _ring: PhantomData<&'r Ring>,
}

/// `ring`'s payload arena pinned for device 0 of the worker, on the cuda backend; `None` on
/// the others, and when it fails, which is said once (the copies still run, from pageable
/// memory the driver stages: slower, and the host waits for them).
pub fn pin_arena(kind: BackendKind, ring: &Ring) -> Option<PinnedArena<'_>> {
    if kind != BackendKind::Cuda {
        return None;
    }
    let (ptr, len) = ring.payload_arena();
    let pinned = cuda::Driver::load().and_then(|d| {
        let ctx = d.open(0)?;
        // SAFETY: the arena is mapped, page-aligned, and stays mapped while `ring` lives, which
        // the returned registration's borrow of it outlasts.
        unsafe { cuda::Registered::new(&ctx, ptr, len) }
    });
    match pinned {
        Ok(r) => Some(PinnedArena {
            _registered: r,
            _ring: PhantomData,
        }),
        Err(e) => {
            tracing::warn!(error = %e, bytes = len, "the ring's arena is not page-locked: batches are copied from pageable memory");
            None
        }
    }
}
