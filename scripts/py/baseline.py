#!/usr/bin/env python3
"""The predecessor's transport, as a baseline for BENCHMARKS.md.

5 producer threads and 3 consumer threads share one queue.Queue (the predecessor ran everything
as threads of one process), and the same with processes and multiprocessing.Queue. Producers fill
a buffer of the payload size (a C-speed slice copy), consumers read every byte (zlib.crc32, C
speed). Prints a Markdown table: medians of --runs runs, items/s and GB/s.

Standard library only: nothing to install beyond python3.
Usage: python3 scripts/py/baseline.py [--runs 5] [--sizes 4K,1M,64M]
"""
import argparse
import multiprocessing as mp
import queue
import statistics
import threading
import time
import zlib

PRODUCERS, CONSUMERS = 5, 3
STOP = None


def parse_size(s):
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(s[:-1] if mul > 1 else s) * mul


def items_for(size):
    return max(20, min(20000, (1 << 30) // size))


def producer(q, n, size):
    pattern = bytes([7]) * size
    for _ in range(n):
        buf = bytearray(size)
        buf[:] = pattern
        q.put(buf)


def consumer(q, out):
    total = 0
    while True:
        buf = q.get()
        if buf is STOP:
            break
        zlib.crc32(buf)
        total += 1
    out.put(total) if hasattr(out, "put") else out.append(total)


def run(kind, size, n_items):
    per = n_items // PRODUCERS
    if kind == "threads + queue.Queue":
        q, done = queue.Queue(maxsize=60), []
        mk = threading.Thread
        args_c = (q, done)
    else:
        q, done = mp.Queue(maxsize=60), mp.Queue()
        mk = mp.Process
        args_c = (q, done)
    cons = [mk(target=consumer, args=args_c) for _ in range(CONSUMERS)]
    prods = [mk(target=producer, args=(q, per, size)) for _ in range(PRODUCERS)]
    t0 = time.perf_counter()
    for w in cons + prods:
        w.start()
    for p in prods:
        p.join()
    for _ in cons:
        q.put(STOP)
    for c in cons:
        c.join()
    wall = time.perf_counter() - t0
    got = sum(done) if isinstance(done, list) else sum(done.get() for _ in cons)
    assert got == per * PRODUCERS, (got, per * PRODUCERS)
    return got, wall


def human(size):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="4K,1M,64M")
    a = ap.parse_args()
    print("| design | payload | items/run | items/s | GB/s |")
    print("|---|---|---|---|---|")
    for kind in ("threads + queue.Queue", "processes + multiprocessing.Queue"):
        for s in a.sizes.split(","):
            size = parse_size(s)
            n = items_for(size) // PRODUCERS * PRODUCERS
            rates = []
            for _ in range(a.runs):
                got, wall = run(kind, size, n)
                rates.append(got / wall)
            r = statistics.median(rates)
            print(f"| {kind} (5x3) | {human(size)} | {n} | {r:.0f} | {r * size / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
