//! The device check's kernels (`probe.cu`, shipped as PTX in `probe.ptx` and JIT-compiled by the
//! driver when cudarc loads the module, so no build needs nvcc): `spin` stands in for a model
//! step of a chosen length, `byte_sum` proves bytes copied from the ring arrived intact without
//! copying them back, and `stamp` writes a batch id into a device buffer. Launched through
//! cudarc's launch builder, so the buffers' event tracking sees every kernel that uses them.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use crate::{bounds, CudaContext, CudaError, CudaSlice, CudaStream, Named, Result};

/// `nvcc -ptx -arch=compute_75 probe.cu` (regenerate after editing probe.cu).
const PTX: &str = include_str!("probe.ptx");

const _: () = assert!(crate::has_no_nul(PTX), "probe.ptx holds a NUL byte");

/// The probe's kernels, in the order [`Probe`] keeps them.
const KERNELS: [&str; 3] = ["spin", "byte_sum", "stamp"];
const SPIN: usize = 0;
const BYTE_SUM: usize = 1;
const STAMP: usize = 2;

/// The probe module, loaded on one device.
pub struct Probe {
    ctx: Arc<CudaContext>,
    kernels: Vec<CudaFunction>,
}

impl Probe {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Probe> {
        Ok(Probe {
            ctx: ctx.clone(),
            kernels: crate::load_kernels(ctx, "probe.ptx", PTX, &KERNELS)?,
        })
    }

    /// Queues one thread that spins for `cycles` SM clock cycles.
    pub fn spin(&self, stream: &CudaStream, cycles: u64) -> Result<()> {
        self.same_device(stream)?;
        let mut launch = stream.launch_builder(&self.kernels[SPIN]);
        launch.arg(&cycles);
        // SAFETY: `spin(unsigned long long)` takes one u64, passed by reference to a local that
        // outlives the call (the driver copies parameters when the launch is queued).
        unsafe { launch.launch(threads(1)) }.named("cuLaunchKernel spin")?;
        Ok(())
    }

    /// Queues the sum of the first `len` bytes of `data` into `out[0]` (added to what is there:
    /// zero it first).
    pub fn byte_sum(
        &self,
        stream: &CudaStream,
        data: &CudaSlice<u8>,
        len: usize,
        out: &mut CudaSlice<u64>,
    ) -> Result<()> {
        self.same_device(stream)?;
        bounds("byte_sum input", data.len(), 0, len)?;
        bounds("byte_sum output", out.num_bytes(), 0, 8)?;
        let n = len as u64;
        let mut launch = stream.launch_builder(&self.kernels[BYTE_SUM]);
        launch.arg(data).arg(&n).arg(out);
        // SAFETY: `byte_sum(const uchar*, ull n, ull* out)` reads `n` bytes of `data` and adds
        // into one u64 of `out`, both bounds-checked above; the arguments match its parameters
        // in order and type.
        unsafe { launch.launch(threads(256)) }.named("cuLaunchKernel byte_sum")?;
        Ok(())
    }

    /// Queues a write of `v` into the first 8 bytes of `buf`.
    pub fn stamp(&self, stream: &CudaStream, buf: &mut CudaSlice<u8>, v: u64) -> Result<()> {
        self.same_device(stream)?;
        bounds("stamp", buf.len(), 0, 8)?;
        let mut launch = stream.launch_builder(&self.kernels[STAMP]);
        launch.arg(buf).arg(&v);
        // SAFETY: `stamp(ull* p, ull v)` writes 8 bytes at `p`, which `buf` holds (checked
        // above); device allocations are aligned for any variable, as the u64 store needs.
        unsafe { launch.launch(threads(1)) }.named("cuLaunchKernel stamp")?;
        Ok(())
    }

    /// The module is loaded in one context; a kernel queued on another's stream would fail
    /// on the driver with a less telling error.
    fn same_device(&self, stream: &CudaStream) -> Result<()> {
        if **stream.context() != *self.ctx {
            return Err(CudaError::Mismatch(format!(
                "a probe kernel loaded on device {} was queued on a stream of device {}",
                self.ctx.ordinal(),
                stream.context().ordinal()
            )));
        }
        Ok(())
    }
}

/// One block of `n` threads.
fn threads(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (n, 1, 1),
        shared_mem_bytes: 0,
    }
}
