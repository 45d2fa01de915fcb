# Streams the input_ids and loss_mask columns of a Parquet file to stdout as an Arrow IPC
# stream, one row group's batches at a time (memory bounded by the file's row group size), for
# hspipe's dataset preparation (dataset/src/convert.rs runs it with `python3 -c`).
# Exit 3: pyarrow is missing; exit 4: no input_ids column. The total row count goes in the
# stream schema's metadata as hspipe.rows, for the progress bar.
import sys

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError as e:
    sys.stderr.write(f"{e}\n")
    sys.exit(3)

path = sys.argv[1]
f = pq.ParquetFile(path)
names = f.schema_arrow.names
if "input_ids" not in names:
    sys.stderr.write("no input_ids column (columns: " + (", ".join(names) or "none") + ")\n")
    sys.exit(4)
cols = [c for c in ("input_ids", "loss_mask") if c in names]
schema = pa.schema([f.schema_arrow.field(c) for c in cols]).with_metadata(
    {"hspipe.rows": str(f.metadata.num_rows)}
)
with pa.ipc.new_stream(sys.stdout.buffer, schema) as w:
    for b in f.iter_batches(batch_size=8192, columns=cols):
        w.write_batch(pa.RecordBatch.from_arrays(b.columns, schema=schema))
