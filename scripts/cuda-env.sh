# shellcheck shell=bash
# Sourced, not run: `source scripts/cuda-env.sh` puts the CUDA build's run-time libraries on
# LD_LIBRARY_PATH and says which it found. The CUDA build (scripts/build-cuda.sh) links
#   libcuda.so.1                  the NVIDIA driver's
#   libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libnccl.so.2
# and the GPU machines have them as PyTorch's CUDA 13 wheels install them: under python3's
# site-packages/nvidia/*/lib (nvidia-cuda-runtime, nvidia-cublas, nvidia-curand,
# nvidia-cuda-nvrtc, nvidia-nccl-cu13). Those directories are added (python3 is asked where its
# `nvidia` packages are; HSPIPE_PYTHON names another interpreter), then /usr/local/nvidia/lib64
# where the driver is mounted in containers. It never fails: a library still missing is named,
# and the binary's own message (or the loader's) says the rest.

hspipe_cuda_dirs=$("${HSPIPE_PYTHON:-python3}" - 2>/dev/null <<'PY'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
dirs = set()
for root in (spec.submodule_search_locations if spec else []) or []:
    for lib in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
PY
) || hspipe_cuda_dirs=""
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$d" ] && hspipe_cuda_dirs=${hspipe_cuda_dirs:+$hspipe_cuda_dirs:}$d
done
if [ -n "$hspipe_cuda_dirs" ]; then
    export LD_LIBRARY_PATH=$hspipe_cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
hspipe_cuda_missing=()
for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 \
    libnvrtc.so.13 libnccl.so.2; do
    found=""
    IFS=: read -ra hspipe_dirs <<<"${LD_LIBRARY_PATH:-}"
    for d in "${hspipe_dirs[@]}"; do
        [ -e "$d/$lib" ] && found=$d && break
    done
    if [ -z "$found" ] && ldconfig -p 2>/dev/null | grep -q " $lib "; then
        found="(the loader's cache)"
    fi
    [ -n "$found" ] || hspipe_cuda_missing+=("$lib")
done
if [ ${#hspipe_cuda_missing[@]} -eq 0 ]; then
    echo "cuda-env: every run-time library of the CUDA build found" >&2
else
    echo "cuda-env: not found (the CUDA build cannot start without them): ${hspipe_cuda_missing[*]}" >&2
fi
unset hspipe_cuda_dirs hspipe_cuda_missing hspipe_dirs found lib d
