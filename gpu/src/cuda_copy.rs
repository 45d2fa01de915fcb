//! The CUDA [`CopyEngine`]: batches go host-to-device on a copy stream while steps run on a
//! compute stream; events order them on the device (a copy into a buffer waits for the step
//! that last used it, a step for its buffer's copy), so the host never waits in a step's path.
//! Pass the same stream as `copy` and `compute` to get the loop without overlap (the device
//! check's baseline).

use cuda::{Device, DeviceBuffer, Event, Stream};

use crate::prefetch::{CopyEngine, BUFFERS};
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

impl<H: AsRef<[u8]>> CopyEngine<H> for CudaCopy<'_, '_> {
    fn start_copy(&mut self, buf: usize, src: &H) -> Result<(), GpuError> {
        let src = src.as_ref();
        // An event never recorded counts as complete, so the first copy into a buffer waits
        // for nothing.
        self.copy.wait(&self.stepped[buf])?;
        // SAFETY: `Prefetch` owns the batch `src` borrows from until `finish(buf)` returns,
        // and `finish` waits for this copy's event first; nothing writes a held ring slot.
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
