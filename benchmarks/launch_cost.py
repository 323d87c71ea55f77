"""cuda_native's two launch paths in one process: host time of ``run()`` with the driver called
directly (`tactix_cuda_native.launch`, the default) against ``cuda.core.launch``, and whether
both write the same output bit for bit.

    python benchmarks/launch_cost.py [--calls 300] [--blocks 15] [--json PATH]

Per row (the shapes of ``run_time.py``: decode b8 and b64, prefill 4 x 64, GEMM m4 4096^2), the
same planned wrapper is timed in alternating blocks of ``--calls`` eager calls (enqueue only, no
sync inside a block), one block per path in turn, ``--blocks`` each; the report gives each
path's median and the median of the per-pair ratios. A plan whose arguments include tensor maps
(the Hopper GEMM, TMA decode tactics) goes through cuda.core on both sides, which the report
says. Needs a GPU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_time import attention_call, gemm_call, per_call_us

ROWS = ("decode b8", "decode b64", "prefill b4x64", "gemm m4 4096^2")


def _launcher(call: Any) -> Any:
    """The `Launch` of the plan behind a ``run_time`` call (its wrapper is the lambda's closure)."""
    names = inspect.getclosurevars(call).nonlocals
    if "g" in names:  # a tactix.Gemm: its bound run method's plan
        return names["g"]._run.__self__._launcher
    return names["wrapper"]._bound.plan._launcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for row in ROWS:
        call = gemm_call("cuda_native", dev) if row.startswith("gemm") else attention_call(
            "cuda_native", row.split()[0], int(row.split()[1][1:].split("x")[0]), dev)  # fmt: skip
        launch = _launcher(call)
        direct_fn = launch._fn
        outputs = []
        for fn in (direct_fn, None):  # the same output from both paths
            launch._fn = fn
            out = call()
            torch.cuda.synchronize()
            outputs.append(out.clone())
        same = bool(torch.equal(outputs[0], outputs[1]))
        times: dict[str, list[float]] = {"direct": [], "cuda.core": []}
        for b in range(2 * args.blocks + 2):
            name = ("direct", "cuda.core")[(b + b // 2) % 2]  # ABBA
            launch._fn = direct_fn if name == "direct" else None
            us = per_call_us(call, args.calls)
            if b >= 2:  # the first pair warms up
                times[name].append(us)
        launch._fn = direct_fn
        ratios = sorted(d / c for d, c in zip(times["direct"], times["cuda.core"], strict=True))
        rows.append({
            "row": row, "direct_us": statistics.median(times["direct"]),
            "cuda_core_us": statistics.median(times["cuda.core"]),
            "ratio": statistics.median(ratios), "ratio_low": ratios[len(ratios) // 4],
            "ratio_high": ratios[3 * len(ratios) // 4], "same_output": same,
            "direct_path": direct_fn is not None and launch._fmt is not None,
        })  # fmt: skip
    lines = ["| row | direct (us) | cuda.core (us) | direct/cuda.core | quartiles | same output | direct path |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['row']} | {r['direct_us']:.2f} | {r['cuda_core_us']:.2f} | {r['ratio']:.3f} | "
                     f"{r['ratio_low']:.3f}-{r['ratio_high']:.3f} | {r['same_output']} | "
                     f"{r['direct_path']} |")  # fmt: skip
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
