"""cuda_native decode on D3-like batches (every request 2048 keys, Llama-3-8B-like heads, HND,
page 16, bf16) whose CTA count is a whole number of waves or a fraction more: is a gap a
last-wave effect or the steady state?

    python benchmarks/decode_waves.py [--batches 198 247 256 264 297] [--tactics] [--cudnn] [--reps 1]

Each row: batch size, waves at 3 CTAs/SM (396 slots on an H200, 8 KV heads), time, TB/s, the
plan's chunk and item count (more items than requests: the last wave was cut,
`geometry.decode_balance_tail`). ``--tactics`` adds five other decode shapes (stages, tiles, L2
hint); ``--cudnn`` adds cuDNN's non-deterministic plan. Method and inputs: ``cuda_native_bench``'s
`time_decode` (CUDA-graph replay, a 256 MB L2 flush before each call, median of 30).

On the H200: ``h200-decode-tail-waves-s8.log`` (default), ``h200-decode-shapes-whole-waves.log``
(``--batches 256 297 --tactics --cudnn --reps 2``). ``h200-decode-tail-waves.log`` came from this
script's first form, before the launch order and the tail cut (cuDNN there: its deterministic plan).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_native_bench import _dec, decode_inputs, decode_reference, time_decode

from tactix.autotune.policy import MeasurementPolicy
from tactix.bench import BenchCase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[198, 247, 248, 256, 264, 297, 300])
    parser.add_argument("--tactics", action="store_true", help="five other decode shapes beside the default")
    parser.add_argument("--cudnn", action="store_true", help="cuDNN's non-deterministic plan beside")
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    policy = MeasurementPolicy(warmup=3, repeat=30)
    tactics = [None]
    if args.tactics:
        tactics += [_dec(64, 4, 3), _dec(32, 2, 2), _dec(32, 2, 3), _dec(64, 4, 2, l2=2), _dec(128, 8, 2)]
    for _ in range(args.reps):
        for b in args.batches:
            case = BenchCase("D3b", "decode", f"b{b}", kv_lens=(2048,) * b)
            x = decode_inputs(case)
            ref = decode_reference(case, x)
            for tactic in tactics:
                r = time_decode(case, x, "cuda_native", tactic, ref, policy)
                print(f"b={b:4d} waves={b * 8 / 396:5.2f} {r['tactic']:70s} {r['us']:8.1f} us {r['tbs']:.3f} TB/s "
                      f"err {r['err']:.1e} {r['note']}", flush=True)  # fmt: skip
            if args.cudnn:
                r = time_decode(case, x, "cudnn", None, ref, policy, deterministic=False)
                print(f"b={b:4d} waves={b * 8 / 396:5.2f} {'cudnn ' + r['tactic']:70s} {r['us']:8.1f} us "
                      f"{r['tbs']:.3f} TB/s err {r['err']:.1e}", flush=True)  # fmt: skip
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
