# host-side read rates for a large file: pread vs copying out of a fresh mmap, T threads,
# each thread filling its own reused 32 MiB buffer (like the staging ring)
import mmap, os, sys, threading, time
import numpy as np
path = sys.argv[1]; size = os.path.getsize(path); CH = 32 << 20
def run(kind, T):
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if kind == "mmap" else None
    src = np.frombuffer(mm, dtype=np.uint8) if mm else None
    chunks = list(range(0, size, CH)); lock = threading.Lock(); idx = [0]
    def worker():
        buf = np.ones(CH, dtype=np.uint8)
        while True:
            with lock:
                if idx[0] >= len(chunks): return
                off = chunks[idx[0]]; idx[0] += 1
            n = min(CH, size - off)
            if kind == "pread": os.preadv(fd, [memoryview(buf)[:n]], off)
            else: np.copyto(buf[:n], src[off:off + n])
    t0 = time.perf_counter(); ths = [threading.Thread(target=worker) for _ in range(T)]
    [t.start() for t in ths]; [t.join() for t in ths]; dt = time.perf_counter() - t0
    del src
    if mm: mm.close()
    os.close(fd)
    print(f"{kind:5s} {T:2d} threads: {size/dt/1e9:6.1f} GB/s ({dt:.2f} s for {size/1e9:.1f} GB)", flush=True)
for T in (1, 4, 8, 16):
    for kind in ("mmap", "pread"): run(kind, T)
