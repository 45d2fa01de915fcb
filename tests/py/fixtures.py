"""Fixtures and checks for the data tests (tests/tests/data.rs), run with the project's venv
(scripts/test.sh makes .venv with pyarrow and datasets).

  fixtures.py formats SAMPLES.json OUT_DIR   the same samples as Parquet (Snappy, and ZSTD) and as
                                             an HF datasets save_to_disk directory (3 shards)
  fixtures.py read FILE.arrow                pyarrow reads (and fully validates) an Arrow file;
                                             prints {"input_ids", "loss_mask", "metadata"}
  fixtures.py arrow OUT_DIR                  Arrow files as other programs write them
  fixtures.py bad OUT_DIR                    one bad file per case, named by the case
"""
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def hf_save(columns, types, out, shards=1):
    import datasets

    try:
        seq = datasets.List
    except AttributeError:
        seq = datasets.Sequence
    features = datasets.Features({k: seq(datasets.Value(types[k])) for k in columns})
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(out, num_shards=shards)


def formats(samples_path, out):
    samples = json.load(open(samples_path))
    ids = [s["input_ids"] for s in samples]
    mask = [s.get("loss_mask") for s in samples]
    # Parquet: int64 ids, int8 masks, small row groups (several of them), an extra column.
    t = pa.table(
        {
            "text": pa.array([f"sample {i}" for i in range(len(ids))]),
            "input_ids": pa.array(ids, pa.list_(pa.int64())),
            "loss_mask": pa.array(mask, pa.list_(pa.int8())),
        }
    )
    pq.write_table(t, os.path.join(out, "train.parquet"), row_group_size=37)
    pq.write_table(t, os.path.join(out, "train-zstd.parquet"), row_group_size=37, compression="zstd")
    # HF datasets: int32 ids, int64 masks, three shards.
    hf_save({"input_ids": ids, "loss_mask": mask}, {"input_ids": "int32", "loss_mask": "int64"}, os.path.join(out, "hf"), shards=3)


def read(path):
    with pa.memory_map(path) as src:
        r = pa.ipc.open_file(src)
        t = r.read_all()
        t.validate(full=True)
        meta = {k.decode(): v.decode() for k, v in (r.schema.metadata or {}).items()}
        print(json.dumps({"input_ids": t.column("input_ids").to_pylist(), "loss_mask": t.column("loss_mask").to_pylist(), "metadata": meta, "types": [str(f.type) for f in t.schema]}))


def arrow(out):
    schema = pa.schema([("text", pa.string()), ("input_ids", pa.list_(pa.uint32())), ("score", pa.float64()), ("loss_mask", pa.list_(pa.uint8()))])
    with pa.ipc.new_file(os.path.join(out, "pyarrow.arrow"), schema) as w:
        for k in range(3):
            n = 5 + k
            w.write_batch(
                pa.record_batch(
                    [
                        pa.array([f"t{k}-{i}" for i in range(n)]),
                        pa.array([[k * 100 + i + j for j in range(i + 1)] for i in range(n)], pa.list_(pa.uint32())),
                        pa.array([0.5] * n),
                        pa.array([None if i % 2 else [1] * (i + 1) for i in range(n)], pa.list_(pa.uint8())),
                    ],
                    schema=schema,
                )
            )
    # large_list<int16>, as an Arrow stream: converted, not mapped as it is.
    s = pa.schema([("input_ids", pa.large_list(pa.int16()))])
    with pa.ipc.new_stream(os.path.join(out, "stream.arrows"), s) as w:
        w.write_batch(pa.record_batch([pa.array([[7, 8], [9]], pa.large_list(pa.int16()))], schema=s))


def bad(out):
    def parquet(name, ids, mask=None, ids_type=pa.list_(pa.int64())):
        cols = {"input_ids": pa.array(ids, ids_type)}
        if mask is not None:
            cols["loss_mask"] = pa.array(mask, pa.list_(pa.int64()))
        pq.write_table(pa.table(cols), os.path.join(out, name + ".parquet"))

    ok = [[1, 2], [3]]
    parquet("negative", ok + [[4, -5]])
    parquet("too_big", ok + [[2**32]])
    parquet("empty", ok + [[]])
    parquet("null_row", ok + [None])
    parquet("null_id", ok + [[1, None]])
    parquet("too_long", ok + [list(range(9))])
    parquet("mask_length", ok + [[1, 2]], mask=[[1, 1], [1], [1]])
    parquet("mask_value", ok + [[1, 2]], mask=[[1, 1], [1], [1, 2]])
    parquet("float_ids", [[1.0, 2.5]], ids_type=pa.list_(pa.float64()))
    pq.write_table(pa.table({"ids": pa.array([[1]])}), os.path.join(out, "no_column.parquet"))
    with open(os.path.join(out, "not.parquet"), "w") as f:
        f.write("{}")
    # A codec hspipe leaves out (it reads uncompressed, Snappy and ZSTD Parquet).
    pq.write_table(pa.table({"input_ids": pa.array([[1]])}), os.path.join(out, "gzip.parquet"), compression="gzip")
    with open(os.path.join(out, "corrupt.parquet"), "wb") as f:
        f.write(b"PAR1" + b"\0" * 64 + b"PAR1")
    # HF datasets directories: the row counts across shards.
    hf_save({"input_ids": [[1]] * 5 + [[2**32 + 1]]}, {"input_ids": "int64"}, os.path.join(out, "hf_too_big"), shards=2)
    hf_save({"input_ids": [[1], [2], [3]], "loss_mask": [[1], [1], [3]]}, {"input_ids": "int32", "loss_mask": "int64"}, os.path.join(out, "hf_mask_value"))
    hf_save({"input_ids": [[1], [], [3]]}, {"input_ids": "int32"}, os.path.join(out, "hf_empty"))
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1]]}), "test": datasets.Dataset.from_dict({"input_ids": [[2]]})}).save_to_disk(os.path.join(out, "hf_dict"))


if __name__ == "__main__":
    cmd = sys.argv[1]
    {"formats": lambda: formats(sys.argv[2], sys.argv[3]), "read": lambda: read(sys.argv[2]), "arrow": lambda: arrow(sys.argv[2]), "bad": lambda: bad(sys.argv[2])}[cmd]()
