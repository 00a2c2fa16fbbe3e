#!/usr/bin/env python3
"""bf16 against fp16 operands for the DiT's block GEMMs at the 700 W cap.

Hopper's tensor cores run both at the same nominal rate, but a step at the power cap runs as fast
as its energy allows, and fp16 carries 10 mantissa bits where bf16 carries 7. This times the four
block GEMMs of a 1024² layer (4128 rows: q|k|v, O, w1|w3, w2) back to back for a few seconds per
dtype, after a warm-up at the cap, alternating the dtypes over rounds. Random data (never zeros),
the same values rounded to each dtype. Prints TFLOP/s per dtype and round.
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4128)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--square", type=int, default=0,
                    help="one N x N x N GEMM instead of the layer's four (the usual peak figure)")
    a = ap.parse_args()
    R, D, FF = a.rows, 3840, 10240
    torch.manual_seed(0)
    shapes = [(3 * D, D), (D, D), (2 * FF, D), (D, FF)]  # (out, in)
    if a.square:
        R, shapes = a.square, [(a.square, a.square)]
    w32 = [torch.randn(n, k, device="cuda") * k**-0.5 for n, k in shapes]
    x32 = [torch.randn(R, k, device="cuda") for _, k in shapes]
    flop = sum(2 * R * n * k for n, k in shapes)
    sets = {}
    for dt in (torch.bfloat16, torch.float16):
        sets[dt] = ([w.to(dt) for w in w32], [x.to(dt) for x in x32],
                    [torch.empty(R, n, device="cuda", dtype=dt) for n, _ in shapes])
    print(f"{torch.cuda.get_device_name()}, rows {R}, {flop / 1e12:.3f} TFLOP a layer, "
          f"{a.seconds} s timed per dtype and round")

    def layer(dt):
        ws, xs, outs = sets[dt]
        for w, x, o in zip(ws, xs, outs):
            torch.mm(x, w.t(), out=o)

    for rnd in range(a.rounds):
        for dt in (torch.bfloat16, torch.float16) if rnd % 2 == 0 else (torch.float16, torch.bfloat16):
            t_end = time.time() + 1.0
            while time.time() < t_end:
                layer(dt)
                torch.cuda.synchronize()
            n = 0
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t_end = time.time() + a.seconds
            while time.time() < t_end:
                for _ in range(10):
                    layer(dt)
                n += 10
                torch.cuda.synchronize()
            e1.record()
            e1.synchronize()
            ms = e0.elapsed_time(e1)
            print(f"round {rnd} {str(dt):15s} {n * flop / ms / 1e9:7.1f} TFLOP/s "
                  f"({ms / n:.3f} ms a layer)", flush=True)


if __name__ == "__main__":
    main()
