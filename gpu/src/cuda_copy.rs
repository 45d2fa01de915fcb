//! The CUDA [`CopyEngine`]: batches go host-to-device on a copy stream while steps run on a
//! compute stream; events order them on the device (a copy into a buffer waits for the step
//! that last used it, a step for its buffer's copy), so the host never waits in a step's path.
//! Pass the same stream as `copy` and `compute` to get the loop without overlap (the device
//! check's baseline). [`CudaCopyOut`] is the target's half: forwards on the compute stream,
//! copies out into ring slots on the copy stream.

use std::sync::Arc;

use cuda::{CudaEvent, CudaSlice, CudaStream, HostCopy, Named};

use crate::prefetch::{CopyEngine, StableBytes};
use crate::writeback::CopyOutEngine;
use crate::{GpuError, BUFFERS};

/// What both engines hold: the two streams, two device buffers, and per buffer an event after
/// its last copy and one after its last compute (a step, or a forward). Dropping it waits for
/// the copy stream, so it is declared before whatever the copies read or write.
struct Lanes {
    copy: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    bufs: [CudaSlice<u8>; BUFFERS],
    /// Recorded on the copy stream after each buffer's copy.
    copied: [CudaEvent; BUFFERS],
    /// Recorded on the compute stream after each buffer's step or forward.
    computed: [CudaEvent; BUFFERS],
}

impl Lanes {
    fn new(
        copy: &Arc<CudaStream>,
        compute: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Self, GpuError> {
        let ctx = copy.context();
        // Allocated (and zeroed) on the copy stream, which writes them first; cudarc's event
        // tracking makes the compute stream's first use wait for that.
        let buf = || {
            copy.alloc_zeros::<u8>(len)
                .named("allocating a device buffer")
        };
        // Events without timing: they only order the streams (and cost less to record).
        let event = || ctx.new_event(None).named("cuEventCreate");
        Ok(Lanes {
            copy: copy.clone(),
            compute: compute.clone(),
            bufs: [buf()?, buf()?],
            copied: [event()?, event()?],
            computed: [event()?, event()?],
        })
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        // No copy outlives the engine: what it reads or writes is dropped after this.
        let _ = self.copy.synchronize();
    }
}

/// Copy-stream prefetch into two device buffers.
pub struct CudaCopy {
    lanes: Lanes,
}

impl CudaCopy {
    /// Two device buffers of `len` bytes on the streams' device.
    ///
    /// # Safety
    /// Neither the engine nor the [`crate::prefetch::Prefetch`] holding it may be leaked
    /// (`mem::forget`) while a copy is in flight: dropping it waits for the copies (before
    /// `Prefetch` drops the batches they read), forgetting it would let them go.
    pub unsafe fn new(
        copy: &Arc<CudaStream>,
        compute: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(CudaCopy {
            lanes: Lanes::new(copy, compute, len)?,
        })
    }

    /// The device buffer a step computes on.
    pub fn buffer(&self, buf: usize) -> &CudaSlice<u8> {
        &self.lanes.bufs[buf]
    }

    /// The stream steps run on.
    pub fn compute(&self) -> &Arc<CudaStream> {
        &self.lanes.compute
    }
}

impl<H: AsRef<[u8]> + StableBytes> CopyEngine<H> for CudaCopy {
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError> {
        let l = &mut self.lanes;
        let src = src.as_ref();
        // An event never recorded counts as complete, so the first copy into a buffer waits
        // for nothing.
        l.copy.wait(&l.computed[buf]).named("cuStreamWaitEvent")?;
        // SAFETY: `Prefetch` owns the batch until `finish(buf)` returns, and `finish` waits for
        // this copy's event first; its bytes do not move with it (`StableBytes`), and nothing
        // writes a held ring slot.
        unsafe {
            l.copy
                .copy_h2d(&mut l.bufs[buf], 0, src.as_ptr(), src.len())?
        };
        if let Err(e) = l.copied[buf].record(&l.copy).named("cuEventRecord") {
            // The batch goes back to the caller with the error: not while the copy reads it.
            let _ = l.copy.synchronize();
            return Err(e.into());
        }
        Ok(())
    }

    fn before_step(&mut self, buf: usize) -> Result<(), GpuError> {
        let l = &self.lanes;
        Ok(l.compute.wait(&l.copied[buf]).named("cuStreamWaitEvent")?)
    }

    fn finish(&mut self, buf: usize) -> Result<(), GpuError> {
        let l = &self.lanes;
        l.computed[buf].record(&l.compute).named("cuEventRecord")?;
        Ok(l.copied[buf].synchronize().named("cuEventSynchronize")?)
    }
}

/// Copy-stream write-back from two device buffers into ring slots.
pub struct CudaCopyOut<H> {
    /// Declared first: dropping it waits for the copies into `held`.
    lanes: Lanes,
    /// Each copy's destination while it is in flight.
    held: [Option<H>; BUFFERS],
}

impl<H> CudaCopyOut<H> {
    /// Two device buffers of `len` bytes on the streams' device.
    ///
    /// # Safety
    /// The engine (and the [`crate::writeback::WriteBack`] holding it) may not be leaked while
    /// a copy is in flight: dropping it waits for the copies, forgetting it would not.
    pub unsafe fn new(
        copy: &Arc<CudaStream>,
        compute: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(CudaCopyOut {
            lanes: Lanes::new(copy, compute, len)?,
            held: [None, None],
        })
    }

    /// The device buffer a forward writes into.
    pub fn buffer(&self, buf: usize) -> &CudaSlice<u8> {
        &self.lanes.bufs[buf]
    }

    /// The device buffer a forward writes into, to write it (a kernel, or a copy in).
    pub fn buffer_mut(&mut self, buf: usize) -> &mut CudaSlice<u8> {
        &mut self.lanes.bufs[buf]
    }
}

impl<H: AsMut<[u8]> + StableBytes> CopyOutEngine<H> for CudaCopyOut<H> {
    fn before_forward(&mut self, buf: usize) -> Result<(), GpuError> {
        let l = &self.lanes;
        Ok(l.compute.wait(&l.copied[buf]).named("cuStreamWaitEvent")?)
    }

    fn start_copy_out(&mut self, buf: usize, mut dst: H) -> Result<(), (H, GpuError)> {
        if self.held[buf].is_some() {
            let e = GpuError::Shape(format!("write-back: buffer {buf} has a copy in flight"));
            return Err((dst, e));
        }
        let l = &self.lanes;
        let (want, got) = (dst.as_mut().len(), l.bufs[buf].len());
        if want > got {
            return Err((dst, GpuError::BufferSize { got, want }));
        }
        if let Err(e) = l.computed[buf]
            .record(&l.compute)
            .and_then(|()| l.copy.wait(&l.computed[buf]))
            .named("ordering the copy-out after the forward")
        {
            return Err((dst, e.into()));
        }
        let d = dst.as_mut();
        // SAFETY: `dst` is held here (`held[buf]`) until `complete(buf)` has waited for this
        // copy's event, or until `Lanes`' drop has waited for the stream; its bytes do not move with it
        // (`StableBytes`), and nothing else touches a reserved ring slot.
        if let Err(e) = unsafe { l.copy.copy_d2h(d.as_mut_ptr(), &l.bufs[buf], 0, want) } {
            return Err((dst, e.into()));
        }
        if let Err(e) = l.copied[buf].record(&l.copy).named("cuEventRecord") {
            // Back to the caller with the error, but not while the copy writes into it.
            let _ = l.copy.synchronize();
            return Err((dst, e.into()));
        }
        self.held[buf] = Some(dst);
        Ok(())
    }

    fn complete(&mut self, buf: usize) -> Result<H, GpuError> {
        self.lanes.copied[buf]
            .synchronize()
            .named("cuEventSynchronize")?;
        self.held[buf]
            .take()
            .ok_or_else(|| GpuError::Shape(format!("write-back: no copy-out of buffer {buf}")))
    }
}
