#!/usr/bin/env python3
"""Does hiding the DiT's row kernels behind its GEMMs pay at the 700 W cap?

A 1024² Z-Image DiT step is GEMMs (~64 ms), attention (~15 ms) and memory-bound row kernels
(~7 ms), one after the other on one stream, with the card at its power cap. This probe runs the
same per-layer work in PyTorch (cuBLAS GEMMs, SDPA, and two Triton row kernels shaped like ours:
residual + RMSNorm over 3840 columns, SwiGLU over 2 x 10240) for 30 layers of 4128 rows, and
times, at steady state (after 1.5 s of warm-up at the cap), four schedules of it:

  serial    every op over all rows on one stream (what cmf does today)
  chunked   the rows in two halves, still one stream (the cost of halving the GEMMs)
  overlap   two halves on two streams: GEMMs and attention on one, row kernels on the other,
            so the row kernel of one half runs beside the next GEMM of the other
  overlap+c the same with cuBLAS told to leave c SMs free (torch's SM carve-out, where it has one)

It needs only the device image's torch and triton; random bf16 data (never zeros). Prints one
line per schedule: ms per 30-layer step (median of the timed steps) and its ratio to serial.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def residual_norm_kernel(o_ptr, x_ptr, h_ptr, D: tl.constexpr, BLOCK: tl.constexpr):
    # x += rmsnorm(o) * 0.1; h = rmsnorm(x): reads o and x, writes x and h (bf16), as ours does.
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    o = tl.load(o_ptr + r * D + offs, mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r * D + offs, mask=m, other=0.0).to(tl.float32)
    x = x + o * tl.rsqrt(tl.sum(o * o, 0) / D + 1e-6) * 0.1
    tl.store(x_ptr + r * D + offs, x.to(tl.bfloat16), mask=m)
    h = x * tl.rsqrt(tl.sum(x * x, 0) / D + 1e-6)
    tl.store(h_ptr + r * D + offs, h.to(tl.bfloat16), mask=m)


@triton.jit
def swiglu_kernel(gu_ptr, s_ptr, FF: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(gu_ptr + r * 2 * FF + c).to(tl.float32)
    u = tl.load(gu_ptr + r * 2 * FF + FF + c).to(tl.float32)
    tl.store(s_ptr + r * FF + c, (g * tl.sigmoid(g) * u).to(tl.bfloat16))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4128)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warm-s", type=float, default=1.5)
    ap.add_argument("--carveouts", default="8,16")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    R, D, FF, H, HD = a.rows, 3840, 10240, 30, 128
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)

    def rnd(*s, scale=1.0):
        return torch.randn(*s, device=dev, dtype=dt) * scale

    # Three weight sets rotate, so no layer finds the previous layer's weights in L2 (a set is
    # 354 MB against 50 MB of L2; thirty sets would only cost memory).
    sets = [
        dict(qkv=rnd(3 * D, D, scale=D**-0.5), o=rnd(D, D, scale=D**-0.5),
             w13=rnd(2 * FF, D, scale=D**-0.5), w2=rnd(D, FF, scale=FF**-0.5))
        for _ in range(3)
    ]
    x = rnd(R, D)
    h = rnd(R, D)
    qkv = torch.empty(R, 3 * D, device=dev, dtype=dt)
    att = torch.empty(R, D, device=dev, dtype=dt)
    ob = torch.empty(R, D, device=dev, dtype=dt)
    gu = torch.empty(R, 2 * FF, device=dev, dtype=dt)
    s = torch.empty(R, FF, device=dev, dtype=dt)
    sA = torch.cuda.Stream()
    sB = torch.cuda.Stream()
    half = ((R // 2) // 128) * 128  # a tile boundary
    chunks = [(0, half), (half, R)]

    def resnorm(r0, r1):
        # every residual here reads the last GEMM's rows in ob
        residual_norm_kernel[(r1 - r0,)](ob[r0:r1], x[r0:r1], h[r0:r1], D=D, BLOCK=4096,
                                         num_warps=8)

    def swiglu(r0, r1):
        swiglu_kernel[(r1 - r0, FF // 1024)](gu[r0:r1], s[r0:r1], FF=FF, BLOCK=1024,
                                             num_warps=4)

    def attention():
        q, k, v = qkv.view(R, 3, H, HD).permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # [1, H, R, HD]
        att.view(R, H, HD).copy_(out[0].transpose(0, 1))

    def mm(a_, w, out, r0, r1):
        torch.mm(a_[r0:r1], w.t(), out=out[r0:r1])

    def layer_serial(w, parts):
        for r0, r1 in parts:
            mm(h, w["qkv"], qkv, r0, r1)
        attention()
        for r0, r1 in parts:
            mm(att, w["o"], ob, r0, r1)
            resnorm(r0, r1)
        for r0, r1 in parts:
            mm(h, w["w13"], gu, r0, r1)
            swiglu(r0, r1)
        for r0, r1 in parts:
            mm(s, w["w2"], ob, r0, r1)
            resnorm(r0, r1)

    # ready[c]: an event after which half c's rows of h are final (its last row kernel ran)
    ready = [None, None]

    def stage(a_, wm, out, row):
        # GEMM of each half on sA once that half's input is ready, its row kernel on sB
        for ci, (r0, r1) in enumerate(chunks):
            if ready[ci] is not None:
                sA.wait_event(ready[ci])
            with torch.cuda.stream(sA):
                mm(a_, wm, out, r0, r1)
                e = torch.cuda.Event()
                e.record(sA)
            if row is None:
                ready[ci] = None
                continue
            sB.wait_event(e)
            with torch.cuda.stream(sB):
                row(r0, r1)
                f = torch.cuda.Event()
                f.record(sB)
            ready[ci] = f

    def layer_overlap(w):
        stage(h, w["qkv"], qkv, None)
        with torch.cuda.stream(sA):
            attention()
        stage(att, w["o"], ob, resnorm)
        stage(h, w["w13"], gu, swiglu)
        stage(s, w["w2"], ob, resnorm)

    def step(kind):
        if kind == "overlap":
            sA.wait_stream(torch.cuda.current_stream())
            sB.wait_stream(torch.cuda.current_stream())
        for i in range(a.layers):
            w = sets[i % 3]
            if kind == "serial":
                layer_serial(w, [(0, R)])
            elif kind == "chunked":
                layer_serial(w, chunks)
            else:
                layer_overlap(w)

    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    kinds = [("serial", None), ("chunked", None), ("overlap", None)]
    if carve is not None:
        kinds += [("overlap", int(c)) for c in a.carveouts.split(",") if c]
    else:
        print("torch has no SM carve-out (torch._C._set_sm_carveout_experimental): skipped")
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"rows {R}, layers {a.layers}")

    def run(kind, c):
        if carve is not None:
            carve(c)
        torch.cuda.synchronize()
        t_end = time.time() + a.warm_s
        while time.time() < t_end:
            step(kind)
            torch.cuda.synchronize()
        times = []
        for _ in range(a.steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(kind)
            torch.cuda.current_stream().wait_stream(sA)
            torch.cuda.current_stream().wait_stream(sB)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        if carve is not None:
            carve(None)
        return statistics.median(times), min(times)

    # each op alone, for scale (ms, median of 20)
    def alone(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); fn(); e1.record(); e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return statistics.median(ts)

    w = sets[0]
    print("alone (ms): qkv %.3f  attention %.3f  o %.3f  w13 %.3f  w2 %.3f  resnorm %.4f  swiglu %.4f" % (
        alone(lambda: mm(h, w["qkv"], qkv, 0, R)), alone(attention), alone(lambda: mm(att, w["o"], ob, 0, R)),
        alone(lambda: mm(h, w["w13"], gu, 0, R)), alone(lambda: mm(s, w["w2"], ob, 0, R)),
        alone(lambda: resnorm(0, R)), alone(lambda: swiglu(0, R))))
    base = None
    for rnd_i in range(a.rounds):
        for kind, c in kinds:
            med, best = run(kind, c)
            if kind == "serial":
                base = med
            name = kind if c is None else f"{kind}+{c}"
            print(f"round {rnd_i}  {name:12s} {med:8.2f} ms/step (best {best:.2f})  x{med / base:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
