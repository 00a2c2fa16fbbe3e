#!/usr/bin/env python3
"""Print the envelope, header JSON and tensor directory of a CMF v2 file (standard library only).

A diagnostic for comparing our writer with the reference CLI's (docs/reference-cli.md); layout as in
/work/shared/reference/CMF.md. Not a validating reader: use cmf-format for that.
usage: python3 scripts/cmf_dump.py FILE.cmf [--header-only] [--json]
"""
from __future__ import annotations

import json
import struct
import sys

DTYPES = {0: "f32", 1: "f16", 2: "bf16", 3: "q8_row", 4: "q4_block", 6: "u8", 9: "q8_2f", 11: "q4_tiled",
          15: "q4tp"}
SECTIONS = ["header", "directory", "data", "masks", "vocab", "index"]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit(__doc__)
    with open(args[0], "rb") as f:
        env = f.read(128)
        if env[:4] != b"CMF\x01":
            sys.exit(f"{args[0]}: not a CMF file (magic {env[:4]!r})")
        version, flags, features = struct.unpack_from("<III", env, 4)
        secs = {SECTIONS[i]: struct.unpack_from("<QQ", env, 16 + 16 * i) for i in range(6)}
        hoff, hlen = secs["header"]
        f.seek(hoff)
        header = json.loads(f.read(hlen))
        doff, dlen = secs["directory"]
        f.seek(doff)
        d = f.read(dlen)
    count, pool_off = struct.unpack_from("<QQ", d, 0)
    tensors = []
    for i in range(count):
        name_off, name_len, dtype, ndim = struct.unpack_from("<IHBB", d, 16 + 56 * i)
        shape = struct.unpack_from("<6I", d, 16 + 56 * i + 8)[:ndim]
        offset, nbytes, h = struct.unpack_from("<QQQ", d, 16 + 56 * i + 32)
        name = d[pool_off + name_off:pool_off + name_off + name_len].decode()
        tensors.append(dict(name=name, dtype=DTYPES.get(dtype, f"id{dtype}"), shape=list(shape), offset=offset,
                            nbytes=nbytes))
    if "--header-only" in sys.argv:
        tensors = []
    if "--json" in sys.argv:
        print(json.dumps(dict(version=version, flags=flags, required_features=features,
                              sections={k: list(v) for k, v in secs.items()}, header=header, tensors=tensors),
                         indent=1, ensure_ascii=False))
        return
    try:
        print_text(version, flags, features, secs, header, tensors)
    except BrokenPipeError:  # `| head`
        pass


def print_text(version, flags, features, secs, header, tensors) -> None:
    print(f"version {version}, flags {flags:#x}, required_features {features:#x}")
    for k, (o, n) in secs.items():
        print(f"  section {k:9s} offset {o:>10} length {n:>10}")
    print(json.dumps(header, indent=1, ensure_ascii=False))
    for t in tensors:
        print(f"{t['name']:60s} {t['dtype']:9s} {str(t['shape']):18s} off {t['offset']:>10} bytes {t['nbytes']}")


if __name__ == "__main__":
    main()
