//! The CUDA [`CopyEngine`]: batches go host-to-device on a copy stream while steps run on a
//! compute stream; events order them on the device (a copy into a buffer waits for the step
//! that last used it, a step for its buffer's copy), so the host never waits in a step's path.
//! Pass the same stream as `copy` and `compute` to get the loop without overlap (the device
//! check's baseline). [`CudaCopyOut`] is the target's half: forwards on the compute stream,
//! copies out into ring slots on the copy stream.

use cuda::{Device, DeviceBuffer, Event, Stream};

use crate::prefetch::{CopyEngine, StableBytes, BUFFERS};
use crate::writeback::CopyOutEngine;
use crate::GpuError;

/// What both engines hold: the two streams, two device buffers, and per buffer an event after
/// its last copy and one after its last compute (a step, or a forward). Dropping it waits for
/// the copy stream, so it is declared before whatever the copies read or write.
struct Lanes<'d, 's> {
    copy: &'s Stream<'d>,
    compute: &'s Stream<'d>,
    bufs: [DeviceBuffer<'d>; BUFFERS],
    /// Recorded on the copy stream after each buffer's copy.
    copied: [Event<'d>; BUFFERS],
    /// Recorded on the compute stream after each buffer's step or forward.
    computed: [Event<'d>; BUFFERS],
}

impl<'d, 's> Lanes<'d, 's> {
    fn new(
        dev: &'d Device,
        copy: &'s Stream<'d>,
        compute: &'s Stream<'d>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(Lanes {
            copy,
            compute,
            bufs: [dev.alloc(len)?, dev.alloc(len)?],
            copied: [dev.event()?, dev.event()?],
            computed: [dev.event()?, dev.event()?],
        })
    }
}

impl Drop for Lanes<'_, '_> {
    fn drop(&mut self) {
        // No copy outlives the engine: what it reads or writes is dropped after this.
        let _ = self.copy.synchronize();
    }
}

/// Copy-stream prefetch into two device buffers.
pub struct CudaCopy<'d, 's> {
    lanes: Lanes<'d, 's>,
}

impl<'d, 's> CudaCopy<'d, 's> {
    /// Two device buffers of `len` bytes on `dev`.
    ///
    /// # Safety
    /// Neither the engine nor the [`crate::prefetch::Prefetch`] holding it may be leaked
    /// (`mem::forget`) while a copy is in flight: dropping it waits for the copies (before
    /// `Prefetch` drops the batches they read), forgetting it would let them go.
    pub unsafe fn new(
        dev: &'d Device,
        copy: &'s Stream<'d>,
        compute: &'s Stream<'d>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(CudaCopy {
            lanes: Lanes::new(dev, copy, compute, len)?,
        })
    }

    /// The device buffer a step computes on.
    pub fn buffer(&self, buf: usize) -> &DeviceBuffer<'d> {
        &self.lanes.bufs[buf]
    }

    /// The stream steps run on.
    pub fn compute(&self) -> &Stream<'d> {
        self.lanes.compute
    }
}

impl<H: AsRef<[u8]> + StableBytes> CopyEngine<H> for CudaCopy<'_, '_> {
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError> {
        let l = &self.lanes;
        let src = src.as_ref();
        // An event never recorded counts as complete, so the first copy into a buffer waits
        // for nothing.
        l.copy.wait(&l.computed[buf])?;
        // SAFETY: `Prefetch` owns the batch until `finish(buf)` returns, and `finish` waits for
        // this copy's event first; its bytes do not move with it (`StableBytes`), and nothing
        // writes a held ring slot.
        unsafe { l.copy.copy_h2d(&l.bufs[buf], 0, src.as_ptr(), src.len())? };
        if let Err(e) = l.copy.record(&l.copied[buf]) {
            // The batch goes back to the caller with the error: not while the copy reads it.
            let _ = l.copy.synchronize();
            return Err(e.into());
        }
        Ok(())
    }

    fn before_step(&mut self, buf: usize) -> Result<(), GpuError> {
        Ok(self.lanes.compute.wait(&self.lanes.copied[buf])?)
    }

    fn finish(&mut self, buf: usize) -> Result<(), GpuError> {
        let l = &self.lanes;
        l.compute.record(&l.computed[buf])?;
        Ok(l.copied[buf].synchronize()?)
    }
}

/// Copy-stream write-back from two device buffers into ring slots.
pub struct CudaCopyOut<'d, 's, H> {
    /// Declared first: dropping it waits for the copies into `held`.
    lanes: Lanes<'d, 's>,
    /// Each copy's destination while it is in flight.
    held: [Option<H>; BUFFERS],
}

impl<'d, 's, H> CudaCopyOut<'d, 's, H> {
    /// Two device buffers of `len` bytes on `dev`.
    ///
    /// # Safety
    /// The engine (and the [`crate::writeback::WriteBack`] holding it) may not be leaked while
    /// a copy is in flight: dropping it waits for the copies, forgetting it would not.
    pub unsafe fn new(
        dev: &'d Device,
        copy: &'s Stream<'d>,
        compute: &'s Stream<'d>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(CudaCopyOut {
            lanes: Lanes::new(dev, copy, compute, len)?,
            held: [None, None],
        })
    }

    /// The device buffer a forward writes into.
    pub fn buffer(&self, buf: usize) -> &DeviceBuffer<'d> {
        &self.lanes.bufs[buf]
    }
}

impl<H: AsMut<[u8]> + StableBytes> CopyOutEngine<H> for CudaCopyOut<'_, '_, H> {
    fn before_forward(&mut self, buf: usize) -> Result<(), GpuError> {
        Ok(self.lanes.compute.wait(&self.lanes.copied[buf])?)
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
        if let Err(e) = l
            .compute
            .record(&l.computed[buf])
            .and_then(|()| l.copy.wait(&l.computed[buf]))
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
        if let Err(e) = l.copy.record(&l.copied[buf]) {
            // Back to the caller with the error, but not while the copy writes into it.
            let _ = l.copy.synchronize();
            return Err((dst, e.into()));
        }
        self.held[buf] = Some(dst);
        Ok(())
    }

    fn complete(&mut self, buf: usize) -> Result<H, GpuError> {
        self.lanes.copied[buf].synchronize()?;
        self.held[buf]
            .take()
            .ok_or_else(|| GpuError::Shape(format!("write-back: no copy-out of buffer {buf}")))
    }
}
