// Kernels of the device check (scripts/gpu-check.sh), compiled to PTX that the driver JITs at
// load time, so nothing here needs nvcc to build hspipe. Regenerate probe.ptx after a change
// (from cuda/src):
//   nvcc -ptx -arch=compute_75 -o probe.ptx probe.cu

// Stands in for a model step: one thread spins for `cycles` SM clock cycles, so a copy on
// another stream has something to overlap with and the timing does not depend on memory.
extern "C" __global__ void spin(unsigned long long cycles) {
    unsigned long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
}

// Sums `n` bytes into `out` (one block), so the check can prove that bytes copied from the ring's
// arena arrived intact on the device without copying them back.
extern "C" __global__ void byte_sum(const unsigned char* data, unsigned long long n,
                                    unsigned long long* out) {
    unsigned long long acc = 0;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        acc += data[i];
    }
    atomicAdd(out, acc);
}
