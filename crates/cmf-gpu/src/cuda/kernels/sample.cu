// sample.cu — choosing the next token on the device, so a decode step ends with a 4-byte
// readback instead of the V logits.
//
// Design. Two passes over the logits: SAMPLE_BLOCKS blocks each reduce a contiguous slice
// (argmax, or its k best by repeated arg-max over values held in registers), then one block
// merges the candidates, draws (top-k), writes the token where the next step's embedding
// reads it, and advances the device-side position. Ties go to the lower index (torch.argmax);
// NaN logits never win.
// RNG: splitmix64 of (seed, position) → u in [0, 1): counter-based, so a replay at the same
// position draws the same token.

#define SAMPLE_BLOCKS 256
#define SAMPLE_THREADS 256
#define SAMPLE_EPT 8   // V ≤ SAMPLE_BLOCKS·SAMPLE_THREADS·SAMPLE_EPT = 524288
#define TOPK_MAX 64

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block arg-max of (v, i) pairs; every thread gets the winner.
__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, v, o);
        int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF;
    i = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, v, o);
        int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// Grid SAMPLE_BLOCKS: each block's k best (value, index), best first, into cv/ci[block·k ..].
// k = 1 is the arg-max.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
topk_partial(const float* logits, int V, int k, float* cv, int* ci) {
    pdl_trigger();
    pdl_wait();
    const int per = (V + SAMPLE_BLOCKS - 1) / SAMPLE_BLOCKS;
    const int lo = blockIdx.x * per, hi = min(V, lo + per);
    float v[SAMPLE_EPT];
#pragma unroll
    for (int e = 0; e < SAMPLE_EPT; e++) {
        int i = lo + threadIdx.x + e * SAMPLE_THREADS;
        float x = i < hi ? logits[i] : NEG_INF;
        v[e] = x != x ? NEG_INF : x;  // NaN never wins
    }
    for (int r = 0; r < k; r++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int e = 0; e < SAMPLE_EPT; e++) {
            int i = lo + threadIdx.x + e * SAMPLE_THREADS;
            if (i < hi && better(v[e], i, bv, bi)) { bv = v[e]; bi = i; }
        }
        block_argmax(bv, bi);
        if (threadIdx.x == 0) {
            cv[blockIdx.x * k + r] = bv;
            ci[blockIdx.x * k + r] = bi < V ? bi : 0;
        }
#pragma unroll
        for (int e = 0; e < SAMPLE_EPT; e++)
            if (lo + threadIdx.x + e * SAMPLE_THREADS == bi) v[e] = -3.0e38f;  // taken (below any real logit)
    }
}

__device__ __forceinline__ float rng_uniform(u64 seed, u64 pos) {
    u64 z = seed + (pos + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// One block of 1024 threads. Merges SAMPLE_BLOCKS·k candidates; k = 1 → arg-max; else softmax
// of the k best / temperature, cut at top_p, draw. Writes the token to tok[0] (the next step's
// input), the pair (position, token) to slot position & ring_mask of `ring` (pinned host memory
// the host reads after the graph: llm/ahead.rs), and advances pos[0] by one.
extern "C" __global__ void __launch_bounds__(1024)
topk_final(const float* cv, const int* ci, int k, float temperature, float top_p, u64 seed, int* tok, int* pos,
           int* ring, int ring_mask) {
    pdl_trigger();
    pdl_wait();
    __shared__ float best_v[TOPK_MAX];
    __shared__ int best_i[TOPK_MAX];
    const int n = SAMPLE_BLOCKS * k;
    float v[(SAMPLE_BLOCKS * TOPK_MAX) / 1024];
    int id[(SAMPLE_BLOCKS * TOPK_MAX) / 1024];
    const int per = (n + 1023) / 1024;
#pragma unroll
    for (int e = 0; e < (SAMPLE_BLOCKS * TOPK_MAX) / 1024; e++) {
        int j = threadIdx.x + e * 1024;
        bool ok = e < per && j < n;
        v[e] = ok ? cv[j] : NEG_INF;
        id[e] = ok ? ci[j] : 0x7fffffff;
    }
    for (int r = 0; r < k; r++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff, be = -1;
#pragma unroll
        for (int e = 0; e < (SAMPLE_BLOCKS * TOPK_MAX) / 1024; e++)
            if (better(v[e], id[e], bv, bi)) { bv = v[e]; bi = id[e]; be = e; }
        int mine = bi;
        block_argmax(bv, bi);
#pragma unroll
        for (int e = 0; e < (SAMPLE_BLOCKS * TOPK_MAX) / 1024; e++)
            if (e == be && mine == bi) { v[e] = NEG_INF; id[e] = 0x7fffffff; }
        if (threadIdx.x == 0) { best_v[r] = bv; best_i[r] = bi; }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int chosen = best_i[0];
        if (k > 1 && temperature > 0.f) {
            float p[TOPK_MAX], sum = 0.f;
            for (int r = 0; r < k; r++) { p[r] = expf((best_v[r] - best_v[0]) / temperature); sum += p[r]; }
            int keep = k;
            float acc = 0.f;
            for (int r = 0; r < k; r++) {
                acc += p[r] / sum;
                if (acc >= top_p) { keep = r + 1; break; }
            }
            float tot = 0.f;
            for (int r = 0; r < keep; r++) tot += p[r];
            float u = rng_uniform(seed, (u64)pos[0]) * tot;
            chosen = best_i[keep - 1];
            float c = 0.f;
            for (int r = 0; r < keep; r++) {
                c += p[r];
                if (u < c) { chosen = best_i[r]; break; }
            }
        }
        const int p = pos[0];
        tok[0] = chosen;
        pos[0] = p + 1;
        ring[2 * (p & ring_mask)] = p;
        ring[2 * (p & ring_mask) + 1] = chosen;
    }
}
