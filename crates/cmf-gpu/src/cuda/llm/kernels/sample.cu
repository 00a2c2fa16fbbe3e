// sample.cu — choosing the next token on the device, so a decode step ends with a 4-byte
// readback instead of the V logits. The algorithm is cmf_gpu::llm::sample (the host sampler
// runs that code; its module notes define every step and the rounding); this file computes the
// same thing in parallel. Ties rank the lower id first (torch.argmax); NaN logits never win.
//
// `penalize` (one block, only for specs with penalties) edits the logits of the window's ids in
// place. Then one of two chains (the host picks it from the spec when it captures the graph:
// cuda/llm/sampler.rs):
//
// - Greedy and top-k specs: `topk_partial` (SAMPLE_BLOCKS blocks) reduces a contiguous slice
//   each to its k best; `sample_final` (one block) merges them and takes the arg-max, or draws
//   among the k best after top-p and min-p. Nothing past the merged candidates is read.
// - Every other sampled spec needs the whole vocabulary (top-p's total, min-p, the draw), so its
//   passes are spread over SAMPLE_BLOCKS blocks, each owning the same contiguous slice in every
//   pass, with partial results in a small scratch `sc` (SC_* words below):
//     sample_max      each slice's arg-max; zeroes the histograms and the total
//     sample_weights  the weights e = exp((l - M)/T) into wbuf, the total, radix digit 1's histogram
//     sample_radix    (top-p only; twice) narrows the cut to one digit bin, histograms the next
//     sample_kept     (narrows to the cut key) each slice's kept weight and its ties of the cut key
//     sample_draw     one block: how many ties of the cut key survive, the slice holding the
//                     draw's target, then the token inside that slice, in vocabulary order
//   Each grid kernel recomputes the previous pass's plan itself (a scan of <= 2048 bins) instead
//   of a single-block kernel between the passes; block 0 stores it for the next kernel.
//   A single block walking the vocabulary (the earlier design) took ~0.85 ms a token on a 152k
//   vocabulary at top-p 0.9 over a flat distribution: one SM's bandwidth and latency. That
//   design first merged the 64 best and skipped the radix select when they reached top-p; here
//   top-p always takes the radix passes, whose cost does not depend on where the cut falls,
//   since the 64-candidate topk_partial alone took 0.055 ms a token (H100, ncu) before its merge.
//   If the passes show up in a profile: the first histogram's shared-memory atomics (a flat
//   distribution puts a slice's ~600 tokens in a few bins) and the launches themselves
//   (5-6 dependent launches) are where the time would be.
//
// Weights are 40-bit fixed point in u64, so every sum is an integer sum: parallel sums and
// global atomics equal the host's sequential loops whatever their order. The top-p cut is the
// first token, in rank order, whose cumulative weight reaches top_p of the total: a radix
// select over the logits' order keys (digits of 11, 11 and 10 bits; each pass's histogram holds
// the weight per digit among the keys matching the digits chosen so far) finds its key; the
// tokens of that key (exact ties, all of the same weight) survive in id order up to the count
// that reaches top_p, which the per-slice tie counts place without another pass.

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
__device__ void topk_slice(const float* logits, int V, int k, float* cv, int* ci) {
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

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
topk_partial(const float* logits, int V, int k, float* cv, int* ci) {
    pdl_trigger();
    pdl_wait();
    topk_slice(logits, V, k, cv, ci);
}

#define FIN_THREADS 1024
#define RADIX_BINS 2048

// The draw's uniform integer in [0, 2^24) for (seed, position): splitmix64's finaliser
// (sample.rs: uniform24).
__device__ __forceinline__ u64 uniform24(u64 seed, u64 pos) {
    u64 z = seed + (pos + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z >> 40;
}

__device__ __forceinline__ u64 fixed_weight(float e) { return (u64)((double)e * 1099511627776.0); }

__device__ __forceinline__ bool reaches(u64 cum, float top_p, u64 total) {
    return (double)cum >= (double)top_p * (double)total;
}

// floor(u24 * total / 2^24) without overflow (sample.rs: draw_target).
__device__ __forceinline__ u64 draw_target(u64 u24, u64 total) {
    return (total >> 24) * u24 + (((total & 0xffffffull) * u24) >> 24);
}

// Order key of a logit: ascending key = descending logit (NaN is skipped by every caller).
// -0 takes +0's key: equal logits must tie (and rank by id) as on the host.
__device__ __forceinline__ u32 order_key(float l) {
    u32 u = __float_as_uint(l);
    if ((u & 0x7fffffffu) == 0) u = 0;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}
__device__ __forceinline__ float key_value(u32 key) {
    u32 u = ~key;
    u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
    return __uint_as_float(u);
}

// Grid ceil(V / 256) blocks of 256, one token per thread: sets to -inf the logits of the tokens
// whose bit in `allowed` (bit i % 32 of word i / 32, V / 32 words rounded up) is clear. The mask
// is a grammar's, computed on the host; it runs before `penalize` and the draw, as the host
// applies its mask before sampling (llm/sample.rs `apply_token_mask`).
extern "C" __global__ void __launch_bounds__(256)
apply_token_mask(float* logits, int V, const unsigned* allowed) {
    pdl_trigger();
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < V && ((allowed[i >> 5] >> (i & 31)) & 1u) == 0u) logits[i] = NEG_INF;
}

// One block of 1024 with one entry per thread; edits the logits of the ids in the penalty window
// (positions pos-n+1 ..= pos, n = min(last_n, pos + 1)): divide a positive logit by `repeat`,
// multiply a negative one, subtract presence + frequency · count; each id once. The window's
// older ids come from the ring `hist` (the prefill and earlier steps wrote them); the token at
// `pos` is this step's input, recorded in the ring here.
// The edit itself over the n ids in `win` (shared memory, filled by the caller before a barrier).
__device__ void penalize_window(float* logits, int V, const int* win, int n, float repeat, float presence,
                                float frequency) {
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int id = win[j];
        bool first = true;
        int count = 0;
        for (int m = 0; m < n; m++) {
            if (win[m] == id) {
                count++;
                if (m < j) first = false;
            }
        }
        if (first && id >= 0 && id < V) {
            float l = logits[id];
            if (repeat != 1.f) l = l > 0.f ? l / repeat : l * repeat;
            logits[id] = l - (presence + frequency * (float)count);
        }
    }
}

extern "C" __global__ void __launch_bounds__(FIN_THREADS)
penalize(float* logits, int V, int* hist, int hist_mask, const int* tok, const int* pos, int last_n,
         float repeat, float presence, float frequency) {
    pdl_trigger();
    pdl_wait();
    __shared__ int win[FIN_THREADS];
    const int p = pos[0];
    const int n = min(min(last_n, p + 1), FIN_THREADS);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int q = p - n + 1 + j;
        win[j] = q == p ? tok[0] : hist[q & hist_mask];
    }
    __syncthreads();
    penalize_window(logits, V, win, n, repeat, presence, frequency);
    if (threadIdx.x == 0) hist[p & hist_mask] = tok[0];
}

__device__ __forceinline__ u64 warp_sum_u64(u64 x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    return x;
}

__device__ __forceinline__ u64 warp_incl_scan_u64(u64 x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

// Exclusive prefix sum of one u64 per thread in thread order (blockDim a multiple of 32, at most
// 1024); every thread gets the block's sum in *total. Integer adds: the result does not depend on
// the reduction's shape. All threads must call it.
__device__ u64 block_excl_scan_u64(u64 x, u64* total) {
    __shared__ u64 warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u64 incl = warp_incl_scan_u64(x);
    __syncthreads();  // warp_sums may still be read by a previous call
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const u64 w = warp_incl_scan_u64(lane < nw ? warp_sums[lane] : 0);
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    *total = warp_sums[nw - 1];
    return (warp == 0 ? 0 : warp_sums[warp - 1]) + incl - x;
}

__device__ __forceinline__ u64 block_sum_u64(u64 x) {
    u64 total;
    block_excl_scan_u64(x, &total);
    return total;
}

// One block of 1024, for greedy and top-k specs (the host sends every other sampled spec to
// the vocabulary passes below). Merges SAMPLE_BLOCKS·k candidates (the k best in rank order;
// k = 1 for greedy specs), then, unless greedy, the draw of sample.rs among the k best: top-p
// over their weight, min-p, the survivors walked in id order. Writes the token to tok[0] (the
// next step's input), the pair (position, token) to slot position & ring_mask of `ring` (pinned
// host memory the host reads after the graph: llm/ahead.rs), this step's input token to the
// penalty ring `hist`, and advances pos[0].
// The merge and the draw (u24: the draw's uniform integer); thread 0 gets the token, the
// others -1.
__device__ int final_choice(const float* cv, const int* ci, int k, float temperature, int top_k, float top_p,
                            float min_p, u64 u24, int V) {
    __shared__ float best_v[TOPK_MAX];
    __shared__ int best_i[TOPK_MAX];
    const int n = SAMPLE_BLOCKS * k;
    float v[(SAMPLE_BLOCKS * TOPK_MAX) / 1024];
    int id[(SAMPLE_BLOCKS * TOPK_MAX) / 1024];
    const int per_c = (n + 1023) / 1024;
#pragma unroll
    for (int e = 0; e < (SAMPLE_BLOCKS * TOPK_MAX) / 1024; e++) {
        int j = threadIdx.x + e * 1024;
        bool ok = e < per_c && j < n;
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
        if (threadIdx.x == 0) { best_v[r] = bv; best_i[r] = bi < V ? bi : 0; }
    }
    __syncthreads();
    if (threadIdx.x != 0) return -1;
    int chosen = best_i[0];
    const float M = best_v[0];
    const bool greedy = temperature <= 0.f || top_k == 1 || !(M > NEG_INF && M < -NEG_INF);
    if (!greedy) {
        // The survivors: the k best up to the first reaching top_p of their weight, passing min-p;
        // drawn in id order.
        const float inv_t = 1.f / temperature;
        u64 total = 0;
        for (int r = 0; r < k; r++) total += fixed_weight(expf((best_v[r] - M) * inv_t));
        int last = k - 1;
        if (top_p < 1.f) {
            u64 cum = 0;
            for (int r = 0; r < k; r++) {
                cum += fixed_weight(expf((best_v[r] - M) * inv_t));
                if (reaches(cum, top_p, total)) { last = r; break; }
            }
        }
        int ids[TOPK_MAX];
        u64 ws[TOPK_MAX];
        int m = 0;
        u64 sum = 0;
        for (int r = 0; r <= last; r++) {
            const float e = expf((best_v[r] - M) * inv_t);
            const u64 w = fixed_weight(e);
            if ((min_p > 0.f && !(e >= min_p)) || w == 0) continue;
            int j = m++;
            for (; j > 0 && ids[j - 1] > best_i[r]; j--) {
                ids[j] = ids[j - 1];
                ws[j] = ws[j - 1];
            }
            ids[j] = best_i[r];
            ws[j] = w;
            sum += w;
        }
        if (sum > 0) {
            const u64 target = draw_target(u24, sum);
            u64 acc = 0;
            for (int j = 0; j < m; j++) {
                acc += ws[j];
                if (target < acc) { chosen = ids[j]; break; }
            }
        }
    }
    return chosen;
}

extern "C" __global__ void __launch_bounds__(FIN_THREADS)
sample_final(const float* cv, const int* ci, int k, float temperature, int top_k, float top_p, float min_p,
             u64 seed, int V, int* tok, int* pos, int* ring, int ring_mask, int* hist, int hist_mask) {
    pdl_trigger();
    pdl_wait();
    const int p = pos[0];  // read by every thread before final_choice's barriers; thread 0 writes it last
    const int chosen = final_choice(cv, ci, k, temperature, top_k, top_p, min_p, uniform24(seed, (u64)p), V);
    if (threadIdx.x != 0) return;
    hist[p & hist_mask] = tok[0];
    tok[0] = chosen;
    pos[0] = p + 1;
    ring[2 * (p & ring_mask)] = p;
    ring[2 * (p & ring_mask) + 1] = chosen;
}

// ---- The vocabulary passes (sampled specs without top-k) ---------------------------------------

#define VOCAB_THREADS 256
#define RADIX_PASSES 3
// The scratch `sc`, in u64 words (cuda/llm/sampler.rs mirrors this layout and sizes the buffer):
#define SC_HIST 0                                   // RADIX_PASSES histograms of RADIX_BINS weights
#define SC_TOTAL (RADIX_PASSES * RADIX_BINS)        // the weight of every token
#define SC_MAX (SC_TOTAL + 1)                       // float bits of the best logit M
#define SC_PLAN (SC_MAX + 1)                        // per pass: prefix | mask << 32, weight before
#define SC_ARG (SC_PLAN + 2 * RADIX_PASSES)         // per slice: arg-max, value bits << 32 | id
#define SC_KEPT (SC_ARG + SAMPLE_BLOCKS)            // per slice: kept weight (the cut key's ties aside)
#define SC_TIES (SC_KEPT + SAMPLE_BLOCKS)           // per slice: tokens of the cut key
#define SC_WORDS (SC_TIES + SAMPLE_BLOCKS)
#if SAMPLE_BLOCKS > FIN_THREADS
#error sample_draw gives one thread to each slice's partials
#endif

// The contiguous slice of the vocabulary block b owns in every vocabulary pass (topk_partial's).
__device__ __forceinline__ void vocab_slice(int V, int b, int* lo, int* hi) {
    const int per = (V + SAMPLE_BLOCKS - 1) / SAMPLE_BLOCKS;
    *lo = min(V, b * per);
    *hi = min(V, *lo + per);
}

__device__ __forceinline__ int radix_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__device__ __forceinline__ u32 radix_bins(int pass) { return pass == 2 ? 1024u : 2048u; }
__device__ __forceinline__ bool finite(float x) { return x > NEG_INF && x < -NEG_INF; }

// The best (logit, id) over the slices' arg-maxes; every thread gets it.
__device__ __forceinline__ void slices_argmax(const u64* sc, float& v, int& i) {
    v = NEG_INF;
    i = 0x7fffffff;
    for (int b = threadIdx.x; b < SAMPLE_BLOCKS; b += blockDim.x) {
        const u64 w = sc[SC_ARG + b];
        const float bv = __uint_as_float((u32)(w >> 32));
        const int bi = (int)(u32)w;
        if (better(bv, bi, v, i)) { v = bv; i = bi; }
    }
    block_argmax(v, i);
}

// Where the top-p cut stands after some radix passes: the key bits chosen (`prefix` under
// `mask`) and the weight of every token whose key sorts before them.
struct RadixState {
    u32 prefix, mask;
    u64 before;
};

// Narrows the cut by pass `pass`'s histogram: the first bin, in key order, whose cumulative
// weight (from the state after the previous pass, read from SC_PLAN) reaches top_p of the
// total. Every thread of the block calls it and gets the same state; block 0 stores it at
// SC_PLAN for the next kernel.
__device__ RadixState radix_narrow(u64* sc, int pass, float top_p) {
    __shared__ u64 s_before;
    __shared__ u32 s_bin;
    RadixState st = {0u, 0u, 0ull};
    if (pass > 0) {
        const u64 w = sc[SC_PLAN + 2 * (pass - 1)];
        st.prefix = (u32)w;
        st.mask = (u32)(w >> 32);
        st.before = sc[SC_PLAN + 2 * (pass - 1) + 1];
    }
    const u64 total = sc[SC_TOTAL];
    const u64* hist = sc + SC_HIST + pass * RADIX_BINS;
    const u32 nb = radix_bins(pass);
    const int per = nb / blockDim.x;  // contiguous bins per thread (blockDim = VOCAB_THREADS)
    const int b0 = threadIdx.x * per;
    u64 mine = 0;
    for (int j = 0; j < per; j++) mine += hist[b0 + j];
    if (threadIdx.x == 0) {
        // Overwritten by the one thread whose bins cross the target (always one: the previous
        // pass's bin reached it, and these bins sum to that bin's weight).
        s_bin = nb - 1;
        s_before = st.before;
    }
    u64 all;
    u64 acc = st.before + block_excl_scan_u64(mine, &all);  // (its barriers order s_bin's init)
    if (!reaches(acc, top_p, total) && reaches(acc + mine, top_p, total)) {
        for (int j = 0; j < per; j++) {
            const u64 h = hist[b0 + j];
            if (reaches(acc + h, top_p, total)) {
                s_bin = b0 + j;
                s_before = acc;
                break;
            }
            acc += h;
        }
    }
    __syncthreads();
    const int shift = radix_shift(pass);
    st.prefix |= s_bin << shift;
    st.mask |= (nb - 1) << shift;
    st.before = s_before;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        sc[SC_PLAN + 2 * pass] = (u64)st.prefix | ((u64)st.mask << 32);
        sc[SC_PLAN + 2 * pass + 1] = st.before;
    }
    return st;
}

// Adds the block's histogram (shared memory) into the scratch's, skipping empty bins.
__device__ __forceinline__ void flush_bins(const u64* bins, u32 nb, u64* out) {
    __syncthreads();
    for (u32 b = threadIdx.x; b < nb; b += blockDim.x)
        if (bins[b]) atomicAdd(&out[b], bins[b]);
}

// Grid SAMPLE_BLOCKS: each slice's arg-max (NaN never wins, ties to the lowest id) into SC_ARG;
// zeroes the words the later passes accumulate into (SC_HIST .. SC_ARG).
__device__ void vocab_max(const float* logits, int V, u64* sc) {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < SC_ARG; j += gridDim.x * blockDim.x) sc[j] = 0;
    int lo, hi;
    vocab_slice(V, blockIdx.x, &lo, &hi);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float x = logits[i];
        x = x != x ? NEG_INF : x;
        if (better(x, i, bv, bi)) { bv = x; bi = i; }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) sc[SC_ARG + blockIdx.x] = ((u64)__float_as_uint(bv) << 32) | (u32)bi;
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_max(const float* logits, int V, u64* sc) {
    pdl_trigger();
    pdl_wait();
    vocab_max(logits, V, sc);
}

// Grid SAMPLE_BLOCKS: M (the best logit, stored at SC_MAX), each token's weight
// e = exp((l - M) / T) into wbuf (NaN weighs 0), their fixed-point total into SC_TOTAL and,
// when `radix` (top-p < 1), the weight per top digit of the order keys into pass 0's histogram.
// With M not finite the host's rule is the arg-max: nothing to weigh (sample_draw takes it).
__device__ void vocab_weights(const float* logits, int V, float temperature, int radix, float* wbuf, u64* sc) {
    __shared__ u64 bins[RADIX_BINS];
    float M;
    int best;
    slices_argmax(sc, M, best);
    if (blockIdx.x == 0 && threadIdx.x == 0) sc[SC_MAX] = __float_as_uint(M);
    if (!finite(M)) return;
    if (radix)
        for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x) bins[b] = 0;
    __syncthreads();
    const float inv_t = 1.f / temperature;
    int lo, hi;
    vocab_slice(V, blockIdx.x, &lo, &hi);
    u64 sum = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float l = logits[i];
        const float e = l == l ? expf((l - M) * inv_t) : 0.f;
        wbuf[i] = e;
        const u64 w = fixed_weight(e);
        sum += w;
        if (radix && w) atomicAdd(&bins[order_key(l) >> radix_shift(0)], w);
    }
    sum = block_sum_u64(sum);
    if (threadIdx.x == 0 && sum) atomicAdd(&sc[SC_TOTAL], sum);
    if (radix) flush_bins(bins, RADIX_BINS, sc + SC_HIST);
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_weights(const float* logits, int V, float temperature, int radix, float* wbuf, u64* sc) {
    pdl_trigger();
    pdl_wait();
    vocab_weights(logits, V, temperature, radix, wbuf, sc);
}

// Grid SAMPLE_BLOCKS, pass 1 or 2: narrows the cut by the previous pass's histogram, then
// histograms this pass's digit over the tokens whose keys match the digits chosen so far.
__device__ void vocab_radix(const float* logits, const float* wbuf, int V, float top_p, int pass, u64* sc) {
    __shared__ u64 bins[RADIX_BINS];
    if (!finite(__uint_as_float((u32)sc[SC_MAX]))) return;
    const RadixState st = radix_narrow(sc, pass - 1, top_p);
    const u32 nb = radix_bins(pass);
    const int shift = radix_shift(pass);
    for (u32 b = threadIdx.x; b < nb; b += blockDim.x) bins[b] = 0;
    __syncthreads();
    int lo, hi;
    vocab_slice(V, blockIdx.x, &lo, &hi);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float l = logits[i];
        if (l != l) continue;
        const u32 key = order_key(l);
        if ((key & st.mask) != st.prefix) continue;
        const u64 w = fixed_weight(wbuf[i]);
        if (w) atomicAdd(&bins[(key >> shift) & (nb - 1)], w);
    }
    flush_bins(bins, nb, sc + SC_HIST + pass * RADIX_BINS);
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_radix(const float* logits, const float* wbuf, int V, float top_p, int pass, u64* sc) {
    pdl_trigger();
    pdl_wait();
    vocab_radix(logits, wbuf, V, top_p, pass, sc);
}

// Grid SAMPLE_BLOCKS: with `radix`, narrows the cut to its whole key (the last pass); then each
// slice's weight of the tokens that survive for sure (ranking before the cut key, or every
// token without a cut; min-p applied) into SC_KEPT, and its count of the cut key's ties
// (min-p aside: top-p counts them before min-p is applied) into SC_TIES.
__device__ void vocab_kept(const float* logits, const float* wbuf, int V, float top_p, float min_p, int radix,
                           u64* sc) {
    if (!finite(__uint_as_float((u32)sc[SC_MAX]))) return;
    const u32 cut = radix ? radix_narrow(sc, RADIX_PASSES - 1, top_p).prefix : 0u;
    int lo, hi;
    vocab_slice(V, blockIdx.x, &lo, &hi);
    u64 kept = 0, ties = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float l = logits[i];
        if (l != l) continue;
        if (radix) {
            const u32 key = order_key(l);
            if (key == cut) {
                ties++;
                continue;
            }
            if (key > cut) continue;
        }
        const float e = wbuf[i];
        if (min_p > 0.f && !(e >= min_p)) continue;
        kept += fixed_weight(e);
    }
    kept = block_sum_u64(kept);
    ties = block_sum_u64(ties);
    if (threadIdx.x == 0) {
        sc[SC_KEPT + blockIdx.x] = kept;
        sc[SC_TIES + blockIdx.x] = ties;
    }
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_kept(const float* logits, const float* wbuf, int V, float top_p, float min_p, int radix, u64* sc) {
    pdl_trigger();
    pdl_wait();
    vocab_kept(logits, wbuf, V, top_p, min_p, radix, sc);
}

// How many of the cut key's ties (each of weight wt, after `before`) top-p keeps: the fewest
// reaching top_p of the total, at least one, at most all of them.
__device__ __forceinline__ u64 ties_needed(u64 before, u64 wt, u64 all_ties, float top_p, u64 total) {
    u64 c = 1;
    if (wt > 0) {
        const double need = (double)top_p * (double)total - (double)before;
        c = need > 0 ? (u64)ceil(need / (double)wt) : 1;
        if (c < 1) c = 1;
        while (c > 1 && reaches(before + (c - 1) * wt, top_p, total)) c--;
        while (c < all_ties && !reaches(before + c * wt, top_p, total)) c++;
    }
    return c < all_ties ? c : all_ties;
}

// One block of FIN_THREADS: the draw over the survivors of the vocabulary passes. The kept
// ties of each slice follow from the tie counts (the first `need` ties in id order survive);
// the slice whose kept weight holds the target is walked in id order to the token. Then the
// bookkeeping of sample_final (token, ring, penalty ring, position).
// The draw itself (u24: the draw's uniform integer); every thread gets the token.
__device__ int vocab_draw(const float* logits, const float* wbuf, int V, float temperature, float top_p,
                          float min_p, int radix, u64 u24, const u64* sc) {
    __shared__ int s_chosen, s_slice;
    __shared__ u64 s_target, s_slice_ties;
    float M;
    int best;
    slices_argmax(sc, M, best);
    if (threadIdx.x == 0) {
        s_chosen = best < V ? best : 0;
        s_slice = -1;
    }
    if (finite(M)) {
        const float inv_t = 1.f / temperature;
        // The cut key, and the weight and min-p verdict its ties share.
        u32 cut = 0;
        u64 before = 0, wt = 0;
        bool ties_pass_min_p = false;
        if (radix) {
            cut = (u32)sc[SC_PLAN + 2 * (RADIX_PASSES - 1)];
            before = sc[SC_PLAN + 2 * (RADIX_PASSES - 1) + 1];
            const float et = expf((key_value(cut) - M) * inv_t);
            wt = fixed_weight(et);
            ties_pass_min_p = !(min_p > 0.f && !(et >= min_p));
        }
        const int b = threadIdx.x;
        const u64 tb = radix && b < SAMPLE_BLOCKS ? sc[SC_TIES + b] : 0;
        u64 all_ties;
        const u64 ties_before = block_excl_scan_u64(tb, &all_ties);
        const u64 need = radix ? ties_needed(before, wt, all_ties, top_p, sc[SC_TOTAL]) : 0;
        // This slice's surviving ties: the part of [0, need) that falls in it.
        const u64 kt = need <= ties_before ? 0 : (need - ties_before < tb ? need - ties_before : tb);
        const u64 kb = (b < SAMPLE_BLOCKS ? sc[SC_KEPT + b] : 0) + (ties_pass_min_p ? kt * wt : 0);
        u64 kept;
        const u64 kbefore = block_excl_scan_u64(kb, &kept);
        if (kept > 0) {
            const u64 target = draw_target(u24, kept);
            if (kb > 0 && kbefore <= target && target < kbefore + kb) {
                s_slice = b;
                s_target = target - kbefore;
                s_slice_ties = kt;
            }
        }
        __syncthreads();
        if (s_slice >= 0) {
            int lo, hi;
            vocab_slice(V, s_slice, &lo, &hi);
            const u64 target = s_target, keep_ties = s_slice_ties;
            u64 tie_base = 0, w_base = 0;
            for (int c0 = lo; c0 < hi && w_base <= target; c0 += blockDim.x) {
                const int i = c0 + threadIdx.x;
                bool tie = false, in = false;
                float e = 0.f;
                if (i < hi) {
                    const float l = logits[i];
                    if (l == l) {
                        e = wbuf[i];
                        const u32 key = order_key(l);
                        tie = radix && key == cut;
                        in = !radix || key < cut;
                    }
                }
                u64 n_ties;
                const u64 tie_rank = tie_base + block_excl_scan_u64(tie, &n_ties);
                if (tie && tie_rank < keep_ties) in = true;
                const u64 w = in && !(min_p > 0.f && !(e >= min_p)) ? fixed_weight(e) : 0;
                u64 n_w;
                const u64 w_before = w_base + block_excl_scan_u64(w, &n_w);
                if (w > 0 && w_before <= target && target < w_before + w) s_chosen = i;
                tie_base += n_ties;
                w_base += n_w;
            }
        }
    }
    __syncthreads();
    return s_chosen;
}

extern "C" __global__ void __launch_bounds__(FIN_THREADS)
sample_draw(const float* logits, const float* wbuf, int V, float temperature, float top_p, float min_p,
            int radix, u64 seed, const u64* sc, int* tok, int* pos, int* ring, int ring_mask, int* hist,
            int hist_mask) {
    pdl_trigger();
    pdl_wait();
    const int p = pos[0];  // read by every thread before vocab_draw's barriers; thread 0 writes it last
    const int chosen = vocab_draw(logits, wbuf, V, temperature, top_p, min_p, radix, uniform24(seed, (u64)p), sc);
    if (threadIdx.x == 0) {
        hist[p & hist_mask] = tok[0];
        tok[0] = chosen;
        pos[0] = p + 1;
        ring[2 * (p & ring_mask)] = p;
        ring[2 * (p & ring_mask) + 1] = chosen;
    }
}

// ---- Batched rows (cuda/llm/batched/sample.rs) --------------------------------------------------
// The kernels above over the rows of a batched step: row r's logits at logits + r·V, its
// sampler in rows[r], its token into ids[r]; blockIdx.y is the row, blockIdx.x the slice as
// above. A row takes the merge (k > 0: greedy rows k = 1, top-k rows their k) or the vocabulary
// passes (k = 0), as the single-sequence chain picks for its spec; each kernel skips the rows of
// the other chain (and sample_radix_rows the rows without top-p). Per row: the candidates
// cv/ci[r·ROW_CAND ..], the weights wbuf[r·V ..], the scratch sc[r·SC_WORDS ..].

// One row's sampler (cuda/llm/batched/sample.rs packs it; 48 bytes).
struct RowSpec {
    int k;              // candidates to merge; 0: the vocabulary passes
    int top_k;
    float temperature;  // 0 on greedy rows
    float top_p;
    float min_p;
    float repeat;
    float presence;
    float frequency;
    int win_at;         // the penalty window: win[win_at .. win_at + win_len] (0 ids: no penalties)
    int win_len;
    u64 u24;            // the draw's uniform integer (sample.rs: uniform24 of seed and position)
};

#define ROW_CAND (SAMPLE_BLOCKS * TOPK_MAX)

__device__ __forceinline__ long long row_off(long long n) { return (long long)blockIdx.y * n; }

// Grid (1, m) of FIN_THREADS: the penalties of the rows that have a window.
extern "C" __global__ void __launch_bounds__(FIN_THREADS)
penalize_rows(float* logits, int V, const RowSpec* rows, const int* win) {
    pdl_trigger();
    pdl_wait();
    __shared__ int w[FIN_THREADS];
    const RowSpec r = rows[blockIdx.y];
    const int n = min(r.win_len, FIN_THREADS);
    if (n <= 0) return;
    for (int j = threadIdx.x; j < n; j += blockDim.x) w[j] = win[r.win_at + j];
    __syncthreads();
    penalize_window(logits + row_off(V), V, w, n, r.repeat, r.presence, r.frequency);
}

// Grid (SAMPLE_BLOCKS, m) of SAMPLE_THREADS: topk_partial of the merge rows.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
topk_partial_rows(const float* logits, int V, const RowSpec* rows, float* cv, int* ci) {
    pdl_trigger();
    pdl_wait();
    const int k = rows[blockIdx.y].k;
    if (k <= 0) return;
    topk_slice(logits + row_off(V), V, k, cv + row_off(ROW_CAND), ci + row_off(ROW_CAND));
}

// Grid (1, m) of FIN_THREADS: sample_final of the merge rows.
extern "C" __global__ void __launch_bounds__(FIN_THREADS)
sample_final_rows(const float* cv, const int* ci, int V, const RowSpec* rows, int* ids) {
    pdl_trigger();
    pdl_wait();
    const RowSpec r = rows[blockIdx.y];
    if (r.k <= 0) return;
    const int chosen = final_choice(cv + row_off(ROW_CAND), ci + row_off(ROW_CAND), r.k, r.temperature, r.top_k,
                                    r.top_p, r.min_p, r.u24, V);
    if (threadIdx.x == 0) ids[blockIdx.y] = chosen;
}

// Grid (SAMPLE_BLOCKS, m) of VOCAB_THREADS each: the vocabulary passes of the other rows.
extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_max_rows(const float* logits, int V, const RowSpec* rows, u64* sc) {
    pdl_trigger();
    pdl_wait();
    if (rows[blockIdx.y].k != 0) return;
    vocab_max(logits + row_off(V), V, sc + row_off(SC_WORDS));
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_weights_rows(const float* logits, int V, const RowSpec* rows, float* wbuf, u64* sc) {
    pdl_trigger();
    pdl_wait();
    const RowSpec r = rows[blockIdx.y];
    if (r.k != 0) return;
    vocab_weights(logits + row_off(V), V, r.temperature, r.top_p < 1.f, wbuf + row_off(V), sc + row_off(SC_WORDS));
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_radix_rows(const float* logits, const float* wbuf, int V, const RowSpec* rows, int pass, u64* sc) {
    pdl_trigger();
    pdl_wait();
    const RowSpec r = rows[blockIdx.y];
    if (r.k != 0 || !(r.top_p < 1.f)) return;
    vocab_radix(logits + row_off(V), wbuf + row_off(V), V, r.top_p, pass, sc + row_off(SC_WORDS));
}

extern "C" __global__ void __launch_bounds__(VOCAB_THREADS)
sample_kept_rows(const float* logits, const float* wbuf, int V, const RowSpec* rows, u64* sc) {
    pdl_trigger();
    pdl_wait();
    const RowSpec r = rows[blockIdx.y];
    if (r.k != 0) return;
    vocab_kept(logits + row_off(V), wbuf + row_off(V), V, r.top_p, r.min_p, r.top_p < 1.f, sc + row_off(SC_WORDS));
}

// Grid (1, m) of FIN_THREADS: sample_draw of the vocabulary rows.
extern "C" __global__ void __launch_bounds__(FIN_THREADS)
sample_draw_rows(const float* logits, const float* wbuf, int V, const RowSpec* rows, const u64* sc, int* ids) {
    pdl_trigger();
    pdl_wait();
    const RowSpec r = rows[blockIdx.y];
    if (r.k != 0) return;
    const int chosen = vocab_draw(logits + row_off(V), wbuf + row_off(V), V, r.temperature, r.top_p, r.min_p,
                                  r.top_p < 1.f, r.u24, sc + row_off(SC_WORDS));
    if (threadIdx.x == 0) ids[blockIdx.y] = chosen;
}
