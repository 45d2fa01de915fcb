"""A copy of a model directory whose one weight tensor is all +inf: a target that computes
infinities and NaN, for the device check (scripts/gpu-check.sh, step e2e) to see the GPU's
forward refuse it. Standard library only: it runs on the GPU machine's python3 and in CI.

    python3 scripts/py/infinite_weights.py MODEL_DIR OUT_DIR TENSOR_NAME

MODEL_DIR holds config.json and one model.safetensors (what `launcher make-model` writes); OUT_DIR
must not exist. Exit status 0 when written, 1 naming what is wrong.
"""

import json
import pathlib
import shutil
import struct
import sys

# +inf's bits in each float dtype safetensors names.
INF = {"F32": struct.pack("<I", 0x7F800000), "F16": struct.pack("<H", 0x7C00),
       "BF16": struct.pack("<H", 0x7F80)}


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__.strip().splitlines()[-3].strip())
    src, dst, name = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    data = bytearray((src / "model.safetensors").read_bytes())
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    if name not in header:
        sys.exit(f"error: {src}/model.safetensors has no tensor {name!r}")
    t = header[name]
    if t["dtype"] not in INF:
        sys.exit(f"error: tensor {name!r} is {t['dtype']}, not a float dtype")
    inf = INF[t["dtype"]]
    start, end = (8 + n + o for o in t["data_offsets"])
    data[start:end] = inf * ((end - start) // len(inf))
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    (dst / "model.safetensors").write_bytes(data)
    print(f"{dst}: {name} set to +inf")


if __name__ == "__main__":
    main()
