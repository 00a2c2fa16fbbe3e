#!/usr/bin/env python3
"""PSNR (dB) between two 8-bit RGB/RGBA PNGs of the same size, without PIL (the GPU machine has
numpy but no imaging library). usage: psnr.py a.png b.png"""
import sys
import zlib

import numpy as np


def read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            depth, ctype, interlace = body[8], body[9], body[12]
            assert depth == 8 and ctype in (2, 6) and interlace == 0, f"{path}: unsupported PNG"
            ch = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + w * ch)
    out = np.zeros((h, w * ch), dtype=np.int32)
    prev = np.zeros(w * ch, dtype=np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: a running sum per channel
            cur = (np.cumsum(line.reshape(w, ch), axis=0) & 255).reshape(-1)
        elif f == 2:  # Up
            cur = (line + prev) & 255
        else:
            cur = unfilter_slow(f, line, prev, ch)
        out[y], prev = cur, cur
    return out.reshape(h, w, ch)[:, :, :3].astype(np.float64)


def unfilter_slow(f, line, prev, ch):
    """Average (3) and Paeth (4): sequential along the row."""
    cur = np.zeros(len(line), dtype=np.int32)
    for x in range(len(line)):
            a = cur[x - ch] if x >= ch else 0
            b = prev[x]
            c = prev[x - ch] if x >= ch else 0
            if f == 3:
                p = (a + b) // 2
            else:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            cur[x] = (line[x] + p) & 255
    return cur


a, b = read_png(sys.argv[1]), read_png(sys.argv[2])
mse = max(((a - b) ** 2).mean(), 1e-12)
print("PSNR %.1f dB" % (10 * np.log10(255 ** 2 / mse)))
