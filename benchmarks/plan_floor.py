"""What a plan cannot avoid on this host: the CUDA runtime calls of one metadata transfer, and
how fast this host runs Python (hosts lent here differ by up to 2x).

    python benchmarks/plan_floor.py [--json PATH]

A plan sends its metadata with one ``cudaMemcpyAsync`` from a pinned buffer, records an event
after it and queries an older buffer's event (`tactix.staging`); those three calls, torch's
current-stream lookup, and ``Staging.send`` as a whole are timed here (median of 2000, host
microseconds), beside a fixed pure-Python workload whose time compares hosts: divide a plan
time measured on this host by ``python_ref_us`` to compare it with another host's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch

from tactix import cudart
from tactix.staging import Staging


def timed(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(100):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def python_reference() -> int:
    """A fixed mix of what plan paths do: list arithmetic, dict and attribute lookups, calls."""
    values = list(range(64))
    steps = [b - a for a, b in itertools.pairwise(values)]
    table = {i: i * 3 for i in range(32)}
    total = sum(table[i % 32] for i in steps) + min(steps) + max(values)
    return total + len(str(total))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows: dict[str, float] = {"python_ref_us": timed(python_reference)}
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        rt = cudart.runtime()
        assert rt is not None, "the CUDA runtime torch loaded was not found"
        host = torch.zeros(512, dtype=torch.int32, pin_memory=True)
        dev = torch.zeros(512, dtype=torch.int32, device=device)
        event = rt.event(0)
        stream = cudart.raw_stream(0)
        rows["raw_stream_us"] = timed(lambda: cudart.raw_stream(0))
        rows["torch_current_stream_us"] = timed(lambda: torch.cuda.current_stream(device).cuda_stream)
        rows["memcpy_async_2kb_us"] = timed(lambda: rt.copy_to_device(dev.data_ptr(), host.data_ptr(), 2048, stream))
        rows["event_record_us"] = timed(lambda: rt.record(event, stream))
        torch.cuda.synchronize()
        rows["event_query_us"] = timed(lambda: rt.done(event))
        staging = Staging(device, 1024)
        rows["staging_send_2kb_us"] = timed(lambda: staging.send(staging.slot(False), 512, lambda dst: None))
        torch.cuda.synchronize()
        rt.destroy(event)
    for name, value in rows.items():
        print(f"{name:26} {value:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
