#!/usr/bin/env bash
# CUDA 13.0's compiler and headers, from PyPI, into a private directory: what the `cuda` build
# needs at build time on a machine with no CUDA installed (CI's and ours).
#   scripts/cuda-toolkit.sh [DIR]     (default: target/cuda-13.0; prints DIR on its last line)
#
# Why 13.0 exactly: PTX made by a newer CUDA does not load on an older driver, and the GPU
# machines run driver 580 (CUDA 13.0). The wheels (about 45 MB) are nvcc, its nvvm (cicc), the
# runtime's headers and libcudart, the crt headers and CCCL, laid out as a toolkit under
# DIR/nvidia/cu13.
#
# The libraries a CUDA build links against (libcuda, cuBLAS, cuBLASLt, cuRAND, NVRTC, NCCL) are
# not downloaded: they are a GPU machine's, found there at run time (the driver's libcuda and
# the nvidia-* packages PyTorch installs; scripts/cuda-env.sh puts them on LD_LIBRARY_PATH). To
# link, the linker only needs their names, so DIR/lib/stubs holds generated stand-ins that
# define every entry point cudarc's bindings declare under each library's real soname
# (libcuda.so.1, libcublas.so.13, ...). A binary linked against them loads the real ones; the
# stubs are never loaded (they are not on any run-time path). This is how CUDA's own
# lib/stubs/libcuda.so works, for all the libraries, and saves a 700 MB download.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=$(realpath -m "${1:-target/cuda-13.0}")
home=$dir/nvidia/cu13
stamp=$dir/.complete-1
if [ -f "$stamp" ]; then
    echo "$home"
    exit 0
fi

wheels=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)
mkdir -p "$dir/wheels"
echo "== pip download ${wheels[*]}" >&2
python3 -m pip download -q --no-deps --only-binary=:all: \
    -d "$dir/wheels" "${wheels[@]}" >&2
echo "== unpacking into $dir" >&2
python3 - "$dir" "$dir"/wheels/*.whl <<'EOF'
import os, stat, sys, zipfile
dest = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, dest)
            mode = info.external_attr >> 16
            if mode & stat.S_IXUSR:
                os.chmod(path, os.stat(path).st_mode | 0o111)
EOF
"$home/bin/nvcc" --version | tail -2 >&2
# candle-kernels links libcudart by its unversioned name.
ln -sf libcudart.so.13 "$home/lib/libcudart.so"

# The stubs: one shared library per linked library, every `pub unsafe fn` of cudarc's bindings
# for it as an empty function (never called: never loaded).
# The cudarc the lock file names (cargo fetches it if needed), not the newest one on disk.
cudarc=$(cargo metadata --format-version 1 --locked 2>/dev/null | python3 -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(os.path.dirname(p["manifest_path"]))
        break')
if [ ! -f "$cudarc/src/driver/sys/mod.rs" ]; then
    echo "error: could not find cudarc's sources through cargo metadata (got \"$cudarc\")" >&2
    exit 1
fi
stubs=$home/lib/stubs
mkdir -p "$stubs"
stub() { # module soname link-name
    local c=$stubs/$3.c
    grep -ohE '^pub unsafe fn [A-Za-z0-9_]+' "$cudarc/src/$1/sys/mod.rs" | sort -u |
        sed -E 's/^pub unsafe fn (.*)/void \1(void) {}/' >"$c"
    cc -shared -fPIC -o "$stubs/lib$3.so" -Wl,-soname,"$2" "$c"
    rm "$c"
}
stub driver libcuda.so.1 cuda
stub cublas libcublas.so.13 cublas
stub cublaslt libcublasLt.so.13 cublasLt
stub curand libcurand.so.10 curand
stub nvrtc libnvrtc.so.13 nvrtc
stub nccl libnccl.so.2 nccl
touch "$stamp"
echo "$home"
