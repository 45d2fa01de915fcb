//! The device check's kernels (`probe.cu`, shipped as PTX in `probe.ptx` and JIT-compiled by the
//! driver, so no build needs nvcc): `spin` stands in for a model step of a chosen length, and
//! `byte_sum` proves bytes copied from the ring arrived intact without copying them back.

use std::ffi::{c_void, CStr};

use crate::sys::CuFunction;
use crate::{CudaError, Device, DeviceBuffer, Module, Result, Stream};

/// `nvcc -ptx -arch=compute_75 probe.cu` (regenerate after editing probe.cu).
const PTX: &CStr = {
    match CStr::from_bytes_with_nul(concat!(include_str!("probe.ptx"), "\0").as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("probe.ptx holds a NUL byte"),
    }
};

/// The probe module, loaded on one device.
pub struct Probe<'d> {
    module: Module<'d>,
    spin: CuFunction,
    byte_sum: CuFunction,
}

impl<'d> Probe<'d> {
    pub fn load(dev: &'d Device) -> Result<Probe<'d>> {
        let module = dev.module(PTX)?;
        let spin = module.function("spin")?;
        let byte_sum = module.function("byte_sum")?;
        Ok(Probe {
            module,
            spin,
            byte_sum,
        })
    }

    /// Queues one thread that spins for `cycles` SM clock cycles.
    pub fn spin(&self, stream: &Stream<'_>, cycles: u64) -> Result<()> {
        let mut cycles = cycles;
        let mut params = [(&raw mut cycles).cast::<c_void>()];
        self.launch(stream, self.spin, 1, &mut params)
    }

    /// Queues the sum of the first `len` bytes of `data` into the u64 at the start of `out`
    /// (added to what is there: zero it first).
    pub fn byte_sum(
        &self,
        stream: &Stream<'_>,
        data: &DeviceBuffer<'_>,
        len: usize,
        out: &DeviceBuffer<'_>,
    ) -> Result<()> {
        data.bounds("byte_sum input", 0, len)?;
        out.bounds("byte_sum output", 0, 8)?;
        let (mut d, mut n, mut o) = (data.ptr, len as u64, out.ptr);
        let mut params = [
            (&raw mut d).cast::<c_void>(),
            (&raw mut n).cast::<c_void>(),
            (&raw mut o).cast::<c_void>(),
        ];
        self.launch(stream, self.byte_sum, 256, &mut params)
    }

    fn launch(
        &self,
        stream: &Stream<'_>,
        f: CuFunction,
        threads: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let dev = self.module.dev;
        if !std::ptr::eq(dev, stream.dev) {
            return Err(CudaError::NoKernel("stream of another device".into()));
        }
        dev.bind()?;
        // SAFETY: `f` belongs to this live module; `params` points at one value per kernel
        // parameter, of the kernel's types (probe.cu), read by the driver during the call; the
        // device buffers they name were bounds-checked above.
        let r = unsafe {
            (dev.api.cuLaunchKernel)(
                f,
                1,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream.raw,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        dev.check("cuLaunchKernel", r)
    }
}
