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

/// Copy-stream prefetch into two device buffers.
pub struct CudaCopy<'d, 's> {
    copy: &'s Stream<'d>,
    compute: &'s Stream<'d>,
    bufs: [DeviceBuffer<'d>; BUFFERS],
    /// Recorded on the copy stream after each buffer's copy.
    copied: [Event<'d>; BUFFERS],
    /// Recorded on the compute stream after each buffer's step.
    stepped: [Event<'d>; BUFFERS],
}

impl<'d, 's> CudaCopy<'d, 's> {
    /// Two device buffers of `len` bytes on `dev`.
    pub fn new(
        dev: &'d Device,
        copy: &'s Stream<'d>,
        compute: &'s Stream<'d>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(CudaCopy {
            copy,
            compute,
            bufs: [dev.alloc(len)?, dev.alloc(len)?],
            copied: [dev.event()?, dev.event()?],
            stepped: [dev.event()?, dev.event()?],
        })
    }

    /// The device buffer a step computes on.
    pub fn buffer(&self, buf: usize) -> &DeviceBuffer<'d> {
        &self.bufs[buf]
    }

    /// The stream steps run on.
    pub fn compute(&self) -> &Stream<'d> {
        self.compute
    }
}

impl<H: AsRef<[u8]> + StableBytes> CopyEngine<H> for CudaCopy<'_, '_> {
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError> {
        let src = src.as_ref();
        // An event never recorded counts as complete, so the first copy into a buffer waits
        // for nothing.
        self.copy.wait(&self.stepped[buf])?;
        // SAFETY: `Prefetch` owns the batch until `finish(buf)` returns, and `finish` waits for
        // this copy's event first; its bytes do not move with it (`StableBytes`), and nothing
        // writes a held ring slot.
        unsafe {
            self.copy
                .copy_h2d(&self.bufs[buf], 0, src.as_ptr(), src.len())?
        };
        self.copy.record(&self.copied[buf])?;
        Ok(())
    }

    fn before_step(&mut self, buf: usize) -> Result<(), GpuError> {
        Ok(self.compute.wait(&self.copied[buf])?)
    }

    fn finish(&mut self, buf: usize) -> Result<(), GpuError> {
        self.compute.record(&self.stepped[buf])?;
        Ok(self.copied[buf].synchronize()?)
    }
}

/// Copy-stream write-back from two device buffers into ring slots.
pub struct CudaCopyOut<'d, 's, H> {
    copy: &'s Stream<'d>,
    compute: &'s Stream<'d>,
    bufs: [DeviceBuffer<'d>; BUFFERS],
    /// Recorded on the compute stream after each buffer's forward.
    forwarded: [Event<'d>; BUFFERS],
    /// Recorded on the copy stream after each buffer's copy-out.
    copied: [Event<'d>; BUFFERS],
    /// Each copy's destination while it is in flight.
    held: [Option<H>; BUFFERS],
}

impl<'d, 's, H> CudaCopyOut<'d, 's, H> {
    /// Two device buffers of `len` bytes on `dev`.
    pub fn new(
        dev: &'d Device,
        copy: &'s Stream<'d>,
        compute: &'s Stream<'d>,
        len: usize,
    ) -> Result<Self, GpuError> {
        Ok(CudaCopyOut {
            copy,
            compute,
            bufs: [dev.alloc(len)?, dev.alloc(len)?],
            forwarded: [dev.event()?, dev.event()?],
            copied: [dev.event()?, dev.event()?],
            held: [None, None],
        })
    }

    /// The device buffer a forward writes into.
    pub fn buffer(&self, buf: usize) -> &DeviceBuffer<'d> {
        &self.bufs[buf]
    }
}

impl<H: AsMut<[u8]> + StableBytes> CopyOutEngine<H> for CudaCopyOut<'_, '_, H> {
    fn before_forward(&mut self, buf: usize) -> Result<(), GpuError> {
        Ok(self.compute.wait(&self.copied[buf])?)
    }

    fn start_copy_out(&mut self, buf: usize, mut dst: H) -> Result<(), GpuError> {
        self.compute.record(&self.forwarded[buf])?;
        self.copy.wait(&self.forwarded[buf])?;
        let d = dst.as_mut();
        let len = d.len().min(self.bufs[buf].len());
        // SAFETY: `dst` is held here (`held[buf]`) until `complete(buf)` has waited for this
        // copy's event; its bytes do not move with it (`StableBytes`), and nothing else
        // touches a reserved ring slot.
        unsafe {
            self.copy
                .copy_d2h(d.as_mut_ptr(), &self.bufs[buf], 0, len)?
        };
        self.copy.record(&self.copied[buf])?;
        self.held[buf] = Some(dst);
        Ok(())
    }

    fn complete(&mut self, buf: usize) -> Result<H, GpuError> {
        self.copied[buf].synchronize()?;
        self.held[buf]
            .take()
            .ok_or_else(|| GpuError::Shape(format!("write-back: no copy-out of buffer {buf}")))
    }
}
