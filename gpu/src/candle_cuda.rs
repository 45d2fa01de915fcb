//! The one place `gpu` reaches into candle's CUDA device: its compute stream, host bytes copied
//! on our copy stream into a new tensor, a tensor's device memory copied out on it, a flat f32
//! tensor's buffer lent out and a buffer taken as a tensor; the GPU target's write-back
//! ([`CopyOut`]) and the NCCL exchange's way to a gradient kept on the device
//! ([`CandleGradient`]) built on them.
//!
//! candle's CUDA types exist only in the build with `--features cuda` (its kernels need nvcc at
//! build time), so this module holds the crate's one `cfg`: without it each function says the
//! build has no CUDA device. It is kept to these five calls; the streams, events and copies
//! around them are cudarc's and the `cuda` crate's, compiled and linted in every build.
//! `scripts/build-cuda.sh` type-checks and builds the other branch.
//!
//! Ordering: a tensor's kernels run on candle's stream; our copies run on a copy stream of the
//! same context. cudarc's event tracking does not order them for candle's tensors: candle
//! passes its outputs to kernels as raw pointers (no write event), and several of its ops
//! record their reads on the slice's own stream. So the callers order the streams themselves:
//! the target's copy-out waits for an event recorded on candle's stream after the forward, and
//! the drafter keeps an uploaded tensor (allocated on the copy stream, freed there) alive until
//! candle's stream has passed every use of it (the step's gradient copied to the host, or, with
//! the gradient kept on the device, the update's digest).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use cuda::nccl_group::TransportError;
use cuda::{CudaEvent, CudaStream, Named};

use crate::device_time::{self, CudaTimeline, StreamId, Timeline};
use crate::{GpuError, RawOut};

/// candle's stream on `device`: every kernel of its tensors runs on it, in order.
pub fn stream(device: &Device) -> Result<Arc<CudaStream>, GpuError> {
    imp::stream(device)
}

/// A new stream in the context of candle's on `device`: where a worker's copies run, beside
/// candle's compute.
pub fn copy_stream(device: &Device) -> Result<Arc<CudaStream>, GpuError> {
    let compute = stream(device)?;
    Ok((compute.context().new_stream()).named("cuStreamCreate")?)
}

/// `src`, host bytes of little-endian `dtype` elements, copied on `copy` into a new tensor of
/// `shape` on `device`; returns once the copy is complete (so `src` is free again). Run on a
/// copy thread, it moves a batch to the GPU while candle's stream computes.
pub fn upload(
    copy: &Arc<CudaStream>,
    src: &[u8],
    dtype: DType,
    shape: Shape,
    device: &Device,
) -> Result<Tensor, GpuError> {
    let want = shape.elem_count() * dtype.size_in_bytes();
    if src.len() != want {
        return Err(GpuError::BufferSize {
            got: src.len(),
            want,
        });
    }
    imp::upload(copy, src, dtype, shape, device)
}

/// Queues a copy of contiguous tensor `t`'s `len` bytes into host memory at `dst` on `copy`
/// (after whatever last wrote `t`: see the module).
///
/// # Safety
/// `dst..dst+len` must stay mapped, and be neither read nor written by the host, until `copy`
/// has passed this copy; `t` must be kept alive until then too (its memory could otherwise be
/// given to another tensor while the copy reads it).
unsafe fn copy_out(
    copy: &CudaStream,
    t: &Tensor,
    dst: *mut u8,
    len: usize,
) -> Result<(), GpuError> {
    let want = t.elem_count() * t.dtype().size_in_bytes();
    if len != want {
        return Err(GpuError::BufferSize { got: len, want });
    }
    // SAFETY: the caller's promise, passed on.
    unsafe { imp::copy_out(copy, t, dst, len) }
}

/// A GPU target's write-back: each batch's results (the stacked states in the slot's dtype and
/// the greedy tokens, tensors of candle's) are copied into its ring slot on `copy`, after an
/// event that the forward on `compute` is done, so the next batch's forward runs while the copy
/// is in flight; the tensors are kept until the copy's event (their memory must not be given to
/// another tensor meanwhile). The gpu::writeback engines copy out of fixed device buffers, which
/// here would cost a device-to-device copy per batch: candle makes its own output tensors.
///
/// Each batch's forward and copy are timed on the device (`device_time`): the forward from a
/// mark before it is queued ([`CopyOut::begin`]) to the event the copy waits for, the copy
/// from a mark after that wait to the copy's event.
/// A batch whose copy is queued: the event after it, the tensors it reads, the slot it writes.
struct InFlight {
    copied: CudaEvent,
    _tensors: [Tensor; 2],
    out: RawOut,
}

pub(crate) struct CopyOut {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    in_flight: VecDeque<InFlight>,
    timeline: CudaTimeline,
    /// The timeline's streams: candle's, the copy stream.
    on: [StreamId; 2],
}

impl CopyOut {
    pub(crate) fn new(device: &Device) -> Result<CopyOut, GpuError> {
        let (compute, copy) = (stream(device)?, copy_stream(device)?);
        let mut t = Timeline::new();
        let on = [t.add_cuda(&compute)?, t.add_cuda(&copy)?];
        Ok(CopyOut {
            compute,
            copy,
            in_flight: VecDeque::new(),
            timeline: Arc::new(Mutex::new(t)),
            on,
        })
    }

    /// The device's timeline of the forwards and copies.
    pub(crate) fn timeline(&self) -> CudaTimeline {
        self.timeline.clone()
    }

    /// A mark on candle's stream before a forward is queued: pass it to [`CopyOut::start`].
    pub(crate) fn begin(&self) -> Result<CudaEvent, GpuError> {
        device_time::mark(&self.compute)
    }

    /// Queues the copies of `states` and `tokens` into `out` after the work queued so far on
    /// candle's stream, the forward that made them having been queued after `began`. On an
    /// error nothing is in flight into `out`.
    pub(crate) fn start(
        &mut self,
        began: CudaEvent,
        states: Tensor,
        tokens: Tensor,
        out: RawOut,
    ) -> Result<(), GpuError> {
        let forward_done = device_time::mark(&self.compute)?;
        self.copy.wait(&forward_done).named("cuStreamWaitEvent")?;
        let copy_began = device_time::mark(&self.copy)?;
        let ((hp, hl), (tp, tl)) = (out.hidden_states(), out.target_tokens());
        // `out`'s memory stays valid and untouched until this batch completes or the target
        // quiesces (`RawOut::new`'s promise), and both wait for the copy stream; the tensors are
        // kept in `in_flight` as long.
        let queue = |t: &Tensor, (p, l): (*mut u8, usize)| {
            // SAFETY: as said above, for either section.
            unsafe { copy_out(&self.copy, t, p, l) }
        };
        let queued = queue(&states, (hp, hl))
            .and_then(|()| queue(&tokens, (tp, tl)))
            .and_then(|()| {
                Ok((
                    device_time::mark(&self.copy)?,
                    device_time::mark(&self.copy)?,
                ))
            });
        // The second mark is the one `complete` waits for, so the timed one has passed then.
        let (copy_timed, copied) = match queued {
            Ok(marks) => marks,
            Err(e) => {
                // Back to the caller with the error, but not while a copy writes into its slot.
                let _ = self.copy.synchronize();
                return Err(e);
            }
        };
        self.in_flight.push_back(InFlight {
            copied,
            _tensors: [states, tokens],
            out,
        });
        let mut t = self.timeline.lock().unwrap_or_else(|e| e.into_inner());
        t.push(self.on[0], device_time::FORWARD, began, forward_done);
        t.push(
            self.on[1],
            device_time::DEVICE_TO_HOST,
            copy_began,
            copy_timed,
        );
        Ok(())
    }

    /// Waits for the oldest batch's copy; an error if its forward computed NaN or infinities
    /// (its greedy tokens carry the mark: `Decoder::check_on_device`).
    pub(crate) fn complete(&mut self) -> Result<(), GpuError> {
        let Some(f) = self.in_flight.front() else {
            return Ok(());
        };
        f.copied.synchronize().named("cuEventSynchronize")?;
        let mut f = self
            .in_flight
            .pop_front()
            .expect("the front, waited for above");
        // Each stream's clock re-measured every 30 s: a wait for the next batch's work queued
        // on it then, once (telemetry: never the batch's failure).
        for (s, stream) in [(self.on[0], &self.compute), (self.on[1], &self.copy)] {
            if let Err(e) = device_time::reanchor_due(&self.timeline, s, stream) {
                tracing::warn!(error = %e, "re-anchoring the device's timeline");
            }
        }
        // SAFETY: the batch has not completed (this is its completion) and its copy has passed
        // (the event above), so nothing writes the slot: `RawOut::get`'s terms.
        let tokens = unsafe { f.out.get() }.target_tokens;
        if model::decoder::non_finite_marked(tokens) {
            return Err(model::decoder::non_finite_error().into());
        }
        Ok(())
    }

    pub(crate) fn quiesce(&mut self) {
        let _ = self.copy.synchronize();
        self.in_flight.clear();
    }
}

impl Drop for CopyOut {
    fn drop(&mut self) {
        self.quiesce();
    }
}

/// A rank's gradient kept on its device between the step and the update (see
/// [`crate::DrafterBackend::gradient_on_device`]): the step leaves the rank's own in `mine` (a
/// flat f32 tensor; none for a step without a batch: the rank contributes zeros), the exchange
/// leaves the group's sum in `sum`, the update takes it.
#[derive(Default)]
pub(crate) struct DeviceGradient {
    pub(crate) mine: Option<Tensor>,
    pub(crate) sum: Option<Tensor>,
}

pub(crate) type SharedGradient = Arc<Mutex<DeviceGradient>>;

/// The NCCL exchange's way to a [`DeviceGradient`] of candle's tensors on a GPU.
///
/// Ordering: the rank's gradient is written on candle's stream, and the sum's buffer is
/// allocated there too (so it is freed there, after the update that reads it, when its tensor
/// drops); the exchange's stream waits for an event recorded on candle's stream after both. The
/// update reads the sum after the host saw the exchange complete.
pub(crate) struct CandleGradient {
    shared: SharedGradient,
    compute: Arc<CudaStream>,
    device: Device,
    len: usize,
    /// The sum's buffer of an exchange that failed: its communicator is aborted only after the
    /// error returns, and until then its kernels may still write here, so the buffer is freed at
    /// the next exchange, not before.
    abandoned: Mutex<Option<cuda::CudaSlice<f32>>>,
}

impl CandleGradient {
    /// The exchange's way to `shared`, a gradient of `len` f32 on GPU `device`.
    pub(crate) fn new(
        shared: SharedGradient,
        device: &Device,
        len: usize,
    ) -> Result<CandleGradient, GpuError> {
        Ok(CandleGradient {
            shared,
            compute: stream(device)?,
            device: device.clone(),
            len,
            abandoned: Mutex::new(None),
        })
    }
}

impl cuda::nccl_group::OnDevice for CandleGradient {
    fn exchange(
        &self,
        stream: &CudaStream,
        reduce: &mut cuda::nccl_group::Reduce<'_>,
    ) -> Result<(), TransportError> {
        let failed = |e: GpuError| TransportError::Failed(e.to_string());
        let mut g = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        g.sum = None;
        // A step without a batch adds zeros, kept like a gradient until the update (an aborted
        // exchange's kernels may still read them).
        if g.mine.is_none() {
            let zeros = Tensor::zeros(self.len, DType::F32, &self.device);
            g.mine = Some(zeros.map_err(|e| failed(e.into()))?);
        }
        let mine = g.mine.as_ref().expect("set above");
        // SAFETY: the buffer is read only once an exchange returned Ok, which wrote all of it
        // (NCCL's sum of `len` floats); a failed exchange's is stashed unread.
        let mut sum = unsafe { self.compute.alloc::<f32>(self.len) }
            .named("cuMemAlloc")
            .map_err(|e| failed(e.into()))?;
        let ready = device_time::mark(&self.compute).map_err(failed)?;
        stream
            .wait(&ready)
            .named("cuStreamWaitEvent")
            .map_err(|e| failed(e.into()))?;
        let reduced = imp::with_slice(mine, |mine| reduce(mine, &mut sum)).map_err(failed)?;
        let mut abandoned = self.abandoned.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = reduced {
            *abandoned = Some(sum);
            return Err(e);
        }
        // Any earlier failed exchange's communicator was aborted before this one was made.
        *abandoned = None;
        g.sum = Some(imp::tensor_of(sum, &self.device).map_err(failed)?);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;

    use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Device, Shape, Storage, Tensor};
    use cuda::cudarc::driver::DeviceRepr;
    use cuda::{CudaSlice, CudaStream, HostCopy, Named};

    use crate::GpuError;

    pub fn stream(device: &Device) -> Result<Arc<CudaStream>, GpuError> {
        Ok(device.as_cuda_device()?.cuda_stream())
    }

    fn typed<T: CudaDType + DeviceRepr>(
        copy: &Arc<CudaStream>,
        src: &[u8],
        dev: &CudaDevice,
    ) -> Result<CudaStorage, GpuError> {
        let n = src.len() / std::mem::size_of::<T>();
        // SAFETY: the buffer's elements are unset until the copy below fills every byte of it
        // (`upload` checked that `src` is exactly `n` elements), and nothing reads it before.
        let mut s = unsafe { copy.alloc::<T>(n) }.named("allocating a batch on the device")?;
        // SAFETY: `src` is borrowed until the synchronize below has returned.
        unsafe { copy.copy_h2d(&mut s, 0, src.as_ptr(), src.len())? };
        copy.synchronize().named("cuStreamSynchronize")?;
        Ok(CudaStorage::wrap_cuda_slice(s, dev.clone()))
    }

    pub fn upload(
        copy: &Arc<CudaStream>,
        src: &[u8],
        dtype: DType,
        shape: Shape,
        device: &Device,
    ) -> Result<Tensor, GpuError> {
        let dev = device.as_cuda_device()?;
        let storage = match dtype {
            DType::BF16 => typed::<half::bf16>(copy, src, dev)?,
            DType::F16 => typed::<half::f16>(copy, src, dev)?,
            DType::F32 => typed::<f32>(copy, src, dev)?,
            DType::U32 => typed::<u32>(copy, src, dev)?,
            other => return Err(GpuError::Shape(format!("no upload of {other:?} elements"))),
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            BackpropOp::none(),
            false,
        ))
    }

    pub fn with_slice<R>(t: &Tensor, f: impl FnOnce(&CudaSlice<f32>) -> R) -> Result<R, GpuError> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(GpuError::Shape("a gradient not on a GPU".into()));
        };
        let s = cs.as_cuda_slice::<f32>()?;
        if layout.contiguous_offsets() != Some((0, t.elem_count())) || s.len() != t.elem_count() {
            return Err(GpuError::Shape(
                "a gradient tensor that is not the whole of its buffer".into(),
            ));
        }
        Ok(f(s))
    }

    pub fn tensor_of(s: CudaSlice<f32>, device: &Device) -> Result<Tensor, GpuError> {
        let n = s.len();
        let storage = CudaStorage::wrap_cuda_slice(s, device.as_cuda_device()?.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            n,
            BackpropOp::none(),
            false,
        ))
    }

    pub unsafe fn copy_out(
        copy: &CudaStream,
        t: &Tensor,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), GpuError> {
        let (storage, layout) = t.storage_and_layout();
        let Some((start, _)) = layout.contiguous_offsets() else {
            return Err(GpuError::Shape(
                "copy-out of a non-contiguous tensor".into(),
            ));
        };
        let Storage::Cuda(cs) = &*storage else {
            return Err(GpuError::Shape("copy-out of a tensor not on a GPU".into()));
        };
        let at = start * t.dtype().size_in_bytes();
        // SAFETY: the caller keeps `dst` and `t` as `copy_out` requires, whatever the dtype.
        unsafe {
            match t.dtype() {
                DType::BF16 => copy.copy_d2h(dst, cs.as_cuda_slice::<half::bf16>()?, at, len)?,
                DType::F16 => copy.copy_d2h(dst, cs.as_cuda_slice::<half::f16>()?, at, len)?,
                DType::F32 => copy.copy_d2h(dst, cs.as_cuda_slice::<f32>()?, at, len)?,
                DType::U32 => copy.copy_d2h(dst, cs.as_cuda_slice::<u32>()?, at, len)?,
                other => {
                    return Err(GpuError::Shape(format!(
                        "no copy-out of {other:?} elements"
                    )))
                }
            }
        }
        Ok(())
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use std::sync::Arc;

    use candle_core::{DType, Device, Shape, Tensor};
    use cuda::{CudaSlice, CudaStream};

    use crate::GpuError;

    fn none() -> GpuError {
        GpuError::Config(
            "this build has no CUDA device: build with scripts/build-cuda.sh (the launcher's `cuda` feature)".into(),
        )
    }

    pub fn stream(_: &Device) -> Result<Arc<CudaStream>, GpuError> {
        Err(none())
    }

    pub fn upload(
        _: &Arc<CudaStream>,
        _: &[u8],
        _: DType,
        _: Shape,
        _: &Device,
    ) -> Result<Tensor, GpuError> {
        Err(none())
    }

    pub unsafe fn copy_out(
        _: &CudaStream,
        _: &Tensor,
        _: *mut u8,
        _: usize,
    ) -> Result<(), GpuError> {
        Err(none())
    }

    pub fn with_slice<R>(_: &Tensor, _: impl FnOnce(&CudaSlice<f32>) -> R) -> Result<R, GpuError> {
        Err(none())
    }

    pub fn tensor_of(_: CudaSlice<f32>, _: &Device) -> Result<Tensor, GpuError> {
        Err(none())
    }
}
