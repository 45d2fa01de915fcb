# shellcheck shell=bash
# Sourced, not run: `source scripts/cuda-env.sh` puts the CUDA build's run-time libraries on
# LD_LIBRARY_PATH and says which it found. The CUDA build (scripts/build-cuda.sh) links
#   libcuda.so.1                  the NVIDIA driver's
#   libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libnccl.so.2
# and the GPU machines have them as PyTorch's CUDA 13 wheels install them: under python3's
# site-packages/nvidia/*/lib (nvidia-cuda-runtime, nvidia-cublas, nvidia-curand,
# nvidia-cuda-nvrtc, nvidia-nccl-cu13). Those directories are added (python3 is asked where its
# `nvidia` packages are; HSPIPE_PYTHON names another interpreter), after /usr/local/nvidia/lib64
# where the driver is mounted in containers. It never fails: a library still missing is named,
# and listed in HSPIPE_CUDA_MISSING.

# The driver's directories first: no wheel's library may shadow the driver's libcuda.
hspipe_cuda_dirs=""
for hspipe_d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$hspipe_d" ] && hspipe_cuda_dirs=${hspipe_cuda_dirs:+$hspipe_cuda_dirs:}$hspipe_d
done
hspipe_wheels=$("${HSPIPE_PYTHON:-python3}" - 2>/dev/null <<'PY'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
dirs = set()
for root in (spec.submodule_search_locations if spec else []) or []:
    for lib in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
PY
) || hspipe_wheels=""
hspipe_cuda_dirs=$hspipe_cuda_dirs${hspipe_wheels:+${hspipe_cuda_dirs:+:}$hspipe_wheels}
if [ -n "$hspipe_cuda_dirs" ]; then
    export LD_LIBRARY_PATH=$hspipe_cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# What is still missing, for the caller (scripts/gpu-check.sh: no libcuda.so.1 is "no driver").
HSPIPE_CUDA_MISSING=""
hspipe_cache=$({ ldconfig -p 2>/dev/null || true; } | awk '{print $1}')
for hspipe_lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 \
    libcurand.so.10 libnvrtc.so.13 libnccl.so.2; do
    hspipe_found=""
    IFS=: read -ra hspipe_dirs <<<"${LD_LIBRARY_PATH:-}"
    for hspipe_d in ${hspipe_dirs[@]+"${hspipe_dirs[@]}"}; do
        [ -e "$hspipe_d/$hspipe_lib" ] && hspipe_found=$hspipe_d && break
    done
    if [ -z "$hspipe_found" ] && printf '%s\n' "$hspipe_cache" | grep -qxF "$hspipe_lib"; then
        hspipe_found="(the loader's cache)"
    fi
    [ -n "$hspipe_found" ] || HSPIPE_CUDA_MISSING="${HSPIPE_CUDA_MISSING:+$HSPIPE_CUDA_MISSING }$hspipe_lib"
done
export HSPIPE_CUDA_MISSING
if [ -z "$HSPIPE_CUDA_MISSING" ]; then
    echo "cuda-env: every run-time library of the CUDA build found" >&2
else
    echo "cuda-env: not found (the CUDA build cannot start without them): $HSPIPE_CUDA_MISSING" >&2
fi
unset hspipe_cuda_dirs hspipe_wheels hspipe_cache hspipe_lib hspipe_found hspipe_dirs hspipe_d
true
