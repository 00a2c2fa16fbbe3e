// sample.cu — choosing the next token on the device, so a decode step ends with a 4-byte
// readback instead of the V logits. The algorithm is cmf_gpu::llm::sample (the host sampler
// runs that code; its module notes define every step and the rounding); this file computes the
// same thing in parallel.
//
// Launches: `penalize` (one block, only for specs with penalties) edits the logits of the
// window's ids in place; `topk_partial` (SAMPLE_BLOCKS blocks) reduces a contiguous slice each
// to its k best; `sample_final` (one block of 1024) merges the candidates, finds the top-k /
// top-p / min-p survivors, draws, writes the token where the next step's embedding reads it and
// into the token ring, records the input token in the penalty ring, and advances the position.
// Ties rank the lower id first (torch.argmax); NaN logits never win.
//
// Weights are 40-bit fixed point in u64, so every sum is an integer sum: the block's parallel
// reductions equal the host's sequential loops. sample_final's passes over the vocabulary give
// each warp a contiguous range and walk it in rows of 32 (coalesced loads; a thread-contiguous
// slice made every warp load touch 32 lines and cost ~1 ms a token on a 152k vocabulary). The
// draw walks the survivors in vocabulary order: the warps' sums find the warp holding the
// target, and that warp scans its rows. A top-p cut beyond the 64 merged
// candidates (flat distributions) is found by a three-pass radix select over the logits' order
// keys, with per-bin weights summed by 64-bit shared-memory atomics (integers: order-free).

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
__device__ __forceinline__ u32 order_key(float l) {
    u32 u = __float_as_uint(l);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}
__device__ __forceinline__ float key_value(u32 key) {
    u32 u = ~key;
    u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
    return __uint_as_float(u);
}

// Exclusive prefix sum of one u64 per thread in thread order (FIN_THREADS threads); `total`
// gets the block's sum. Integer adds: the result does not depend on the reduction's shape.
__device__ u64 block_scan_u64(u64 x, u64* total) {
    __shared__ u64 warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        u64 w = warp_sums[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u64 y = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    *total = warp_sums[31];
    const u64 before_warp = warp == 0 ? 0 : warp_sums[warp - 1];
    return before_warp + incl - x;
}

// One block of 1024 with one entry per thread; edits the logits of the ids in the penalty window
// (positions pos-n+1 ..= pos, n = min(last_n, pos + 1)): divide a positive logit by `repeat`,
// multiply a negative one, subtract presence + frequency · count; each id once. The window's
// older ids come from the ring `hist` (the prefill and earlier steps wrote them); the token at
// `pos` is this step's input, recorded in the ring here.
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
    if (threadIdx.x == 0) hist[p & hist_mask] = tok[0];
}

// The range of the vocabulary this thread's warp owns in sample_final's passes: contiguous,
// a multiple of 32 long, walked as rows of 32 (lane l takes lo + 32·r + l).
struct Span {
    int lo, hi;
};
__device__ __forceinline__ Span warp_span(int V) {
    const int span = ((V + 31) / 32 + 31) & ~31;
    const int lo = min(V, (int)(threadIdx.x >> 5) * span);
    return {lo, min(V, lo + span)};
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

// Every thread passes its warp's sum (the same value across the warp); returns the sum of the
// warps before this one, and the block's total in *total.
__device__ u64 warps_before_u64(u64 warp_total, u64* total) {
    __shared__ u64 sums[32];
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = warp_total;
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    u64 before = 0, all = 0;
    for (int w = 0; w < 32; w++) {
        if (w < warp) before += sums[w];
        all += sums[w];
    }
    *total = all;
    return before;
}

// The survivors' rank cut for top-p over the whole vocabulary, when the 64 best did not reach
// it: a radix select over order keys (11, 11, 10 bits) finds the key of the token whose
// cumulative weight first reaches top_p · total, then the ties of that key are counted in id
// order. Writes (value, id) of the last survivor to *cut_v, *cut_i. All threads call it.
__device__ void radix_top_p(const float* logits, const float* wbuf, int V, float top_p, u64 total,
                            float* cut_v, int* cut_i) {
    __shared__ u64 bins[RADIX_BINS];
    __shared__ u64 s_before;
    __shared__ u32 s_bin;
    __shared__ int s_cut;
    const int lane = threadIdx.x & 31;
    const Span sp = warp_span(V);
    u64 before = 0;
    u32 prefix = 0, pmask = 0;
    const int shifts[3] = {21, 10, 0};
    for (int pass = 0; pass < 3; pass++) {
        const int shift = shifts[pass];
        const u32 nb = pass == 2 ? 1024u : 2048u;
        for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x) bins[b] = 0;
        if (threadIdx.x == 0) {
            s_bin = nb - 1;  // overwritten by the one thread whose bins cross the target
            s_before = before;
        }
        __syncthreads();
        for (int i = sp.lo + lane; i < sp.hi; i += 32) {
            const float l = logits[i];
            if (l != l) continue;
            const u32 key = order_key(l);
            if ((key & pmask) != prefix) continue;
            const u64 w = fixed_weight(wbuf[i]);
            if (w) atomicAdd(&bins[(key >> shift) & (nb - 1)], w);
        }
        __syncthreads();
        const int b0 = 2 * threadIdx.x;  // each thread owns two bins, in key order
        const u64 a = b0 < (int)nb ? bins[b0] : 0, c = b0 + 1 < (int)nb ? bins[b0 + 1] : 0;
        u64 all;
        const u64 excl = before + block_scan_u64(a + c, &all);
        if (b0 < (int)nb) {
            if (!reaches(excl, top_p, total) && reaches(excl + a, top_p, total)) {
                s_bin = b0;
                s_before = excl;
            } else if (!reaches(excl + a, top_p, total) && reaches(excl + a + c, top_p, total)) {
                s_bin = b0 + 1;
                s_before = excl + a;
            }
        }
        __syncthreads();
        prefix |= s_bin << shift;
        pmask |= (nb - 1) << shift;
        before = s_before;
        __syncthreads();
    }
    // Ties of the cut key (all of the same weight), in id order: the smallest count c with
    // before + c·w reaching top_p; the c-th of them is the last survivor.
    const float cv = key_value(prefix);
    u32 ties = 0;
    for (int i = sp.lo + lane; i < sp.hi; i += 32) {
        const float l = logits[i];
        ties += (l == l && order_key(l) == prefix);
    }
    const u64 warp_ties = warp_sum_u64(ties);
    u64 all_ties;
    const u64 ties_before = warps_before_u64(warp_ties, &all_ties);
    __shared__ u64 s_wtie;
    __shared__ int s_need;
    if (threadIdx.x == 0) s_wtie = 0;
    __syncthreads();
    if (warp_ties > 0 && ties_before == 0) {
        // The first warp holding ties: the weight of its first one.
        for (int r0 = sp.lo; r0 < sp.hi; r0 += 32) {
            const int i = r0 + lane;
            const float l = i < sp.hi ? logits[i] : NEG_INF;
            const unsigned m = __ballot_sync(FULL_MASK, l == l && i < sp.hi && order_key(l) == prefix);
            if (m) {
                if (lane == __ffs(m) - 1) s_wtie = fixed_weight(wbuf[i]);
                break;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 wt = s_wtie;
        u64 c = 1;
        if (wt > 0) {
            const double need = (double)top_p * (double)total - (double)before;
            c = need > 0 ? (u64)ceil(need / (double)wt) : 1;
            if (c < 1) c = 1;
            while (c > 1 && reaches(before + (c - 1) * wt, top_p, total)) c--;
            while (c < all_ties && !reaches(before + c * wt, top_p, total)) c++;
        }
        if (c > all_ties) c = all_ties;
        s_need = (int)c;
        s_cut = -1;
    }
    __syncthreads();
    const u64 need = (u64)s_need;
    if (warp_ties > 0 && ties_before < need && need <= ties_before + warp_ties) {
        u64 seen = ties_before;
        for (int r0 = sp.lo; r0 < sp.hi; r0 += 32) {
            const int i = r0 + lane;
            const float l = i < sp.hi ? logits[i] : NEG_INF;
            const bool tie = l == l && i < sp.hi && order_key(l) == prefix;
            const unsigned m = __ballot_sync(FULL_MASK, tie);
            const u64 n = __popc(m);
            if (seen + n >= need) {
                const int rank = (int)(need - seen - 1);  // among this row's ties
                if (tie && __popc(m & ((1u << lane) - 1)) == rank) s_cut = i;
                break;
            }
            seen += n;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && s_cut >= 0) {
        *cut_v = cv;
        *cut_i = s_cut;
    }
    __syncthreads();
}

// One block of 1024. Merges SAMPLE_BLOCKS·k candidates (the k best in rank order; k = 1 for
// greedy specs), then, unless greedy, the draw of sample.rs over the survivors. Writes the
// token to tok[0] (the next step's input), the pair (position, token) to slot
// position & ring_mask of `ring` (pinned host memory the host reads after the graph:
// llm/ahead.rs), this step's input token to the penalty ring `hist`, and advances pos[0].
// `wbuf` is V floats of scratch (the weights).
extern "C" __global__ void __launch_bounds__(FIN_THREADS)
sample_final(const float* cv, const int* ci, int k, float temperature, int top_k, float top_p, float min_p,
             u64 seed, const float* logits, int V, float* wbuf, int* tok, int* pos, int* ring, int ring_mask,
             int* hist, int hist_mask) {
    pdl_trigger();
    pdl_wait();
    __shared__ float best_v[TOPK_MAX];
    __shared__ int best_i[TOPK_MAX];
    __shared__ float s_cut_v;
    __shared__ int s_cut_i, s_has_cut, s_chosen, s_last;
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
    const int p = pos[0];
    int chosen = best_i[0];
    const float M = best_v[0];
    const bool greedy = temperature <= 0.f || top_k == 1 || !(M > NEG_INF && M < -NEG_INF);
    if (!greedy) {
        const float inv_t = 1.f / temperature;
        const bool topk_on = top_k > 0 && top_k < V;
        const Span sp = warp_span(V);
        const int lane = threadIdx.x & 31;
        // Without top-k, top-p needs the whole vocabulary's weight: one pass (kept in wbuf).
        u64 total_all = 0;
        if (!topk_on) {
            u64 mine = 0;
            for (int i = sp.lo + lane; i < sp.hi; i += 32) {
                const float l = logits[i];
                const float e = l == l ? expf((l - M) * inv_t) : 0.f;
                wbuf[i] = e;
                mine += fixed_weight(e);
            }
            block_scan_u64(mine, &total_all);
        }
        // Where the survivors end: 1 = at merged candidate s_last (the draw needs only the
        // candidates), 2 = past them (radix select), 0 = no rank cut (the whole vocabulary).
        if (threadIdx.x == 0) {
            s_has_cut = 0;
            if (topk_on || top_p < 1.f) {
                const int kk = topk_on ? top_k : k;  // survivors of top-k, or the merged best
                u64 total = total_all;
                if (topk_on) {
                    total = 0;
                    for (int r = 0; r < kk; r++) total += fixed_weight(expf((best_v[r] - M) * inv_t));
                }
                int last = topk_on ? kk - 1 : -1;
                if (top_p < 1.f) {
                    u64 cum = 0;
                    for (int r = 0; r < kk; r++) {
                        cum += fixed_weight(expf((best_v[r] - M) * inv_t));
                        if (reaches(cum, top_p, total)) { last = r; break; }
                    }
                }
                s_has_cut = last >= 0 ? 1 : 2;
                s_last = last;
            } else if (min_p > 0.f && !(expf((best_v[k - 1] - M) * inv_t) >= min_p)) {
                // Min-p cuts inside the merged candidates: nothing past them survives.
                s_has_cut = 1;
                s_last = k - 1;
            }
            s_chosen = chosen;
        }
        __syncthreads();
        if (s_has_cut == 1) {
            // The survivors are candidates 0..=s_last passing min-p: draw among them in id order.
            if (threadIdx.x == 0) {
                int ids[TOPK_MAX];
                u64 ws[TOPK_MAX];
                int n = 0;
                u64 sum = 0;
                for (int r = 0; r <= s_last; r++) {
                    const float e = expf((best_v[r] - M) * inv_t);
                    const u64 w = fixed_weight(e);
                    if ((min_p > 0.f && !(e >= min_p)) || w == 0) continue;
                    int j = n++;
                    for (; j > 0 && ids[j - 1] > best_i[r]; j--) {
                        ids[j] = ids[j - 1];
                        ws[j] = ws[j - 1];
                    }
                    ids[j] = best_i[r];
                    ws[j] = w;
                    sum += w;
                }
                if (sum > 0) {
                    const u64 target = draw_target(uniform24(seed, (u64)p), sum);
                    u64 acc = 0;
                    for (int j = 0; j < n; j++) {
                        acc += ws[j];
                        if (target < acc) { s_chosen = ids[j]; break; }
                    }
                }
            }
        } else {
            if (s_has_cut == 2) {
                radix_top_p(logits, wbuf, V, top_p, total_all, &s_cut_v, &s_cut_i);
                if (threadIdx.x == 0) s_has_cut = 3;
                __syncthreads();
            }
            const bool has_cut = s_has_cut == 3;
            const float cut_v = s_cut_v;
            const int cut_i = s_cut_i;
            // The survivors' weights of this warp's range, then the warp holding the target
            // walks its rows.
            u64 mine = 0;
            for (int i = sp.lo + lane; i < sp.hi; i += 32) {
                const float l = logits[i];
                if (l != l || (min_p > 0.f && !(wbuf[i] >= min_p)) || (has_cut && better(cut_v, cut_i, l, i)))
                    continue;
                mine += fixed_weight(wbuf[i]);
            }
            const u64 wsum = warp_sum_u64(mine);
            u64 kept;
            const u64 wbefore = warps_before_u64(wsum, &kept);
            if (kept > 0) {
                const u64 target = draw_target(uniform24(seed, (u64)p), kept);
                if (wbefore <= target && target < wbefore + wsum) {
                    u64 base = wbefore;
                    for (int r0 = sp.lo; r0 < sp.hi; r0 += 32) {
                        const int i = r0 + lane;
                        u64 w = 0;
                        if (i < sp.hi) {
                            const float l = logits[i];
                            if (l == l && !(min_p > 0.f && !(wbuf[i] >= min_p)) && !(has_cut && better(cut_v, cut_i, l, i)))
                                w = fixed_weight(wbuf[i]);
                        }
                        const u64 incl = warp_incl_scan_u64(w);
                        const u64 row = __shfl_sync(FULL_MASK, incl, 31);
                        if (target < base + row) {
                            if (w > 0 && target < base + incl && target >= base + incl - w) s_chosen = i;
                            break;
                        }
                        base += row;
                    }
                }
            }
        }
        __syncthreads();
        chosen = s_chosen;
    }
    if (threadIdx.x == 0) {
        hist[p & hist_mask] = tok[0];
        tok[0] = chosen;
        pos[0] = p + 1;
        ring[2 * (p & ring_mask)] = p;
        ring[2 * (p & ring_mask) + 1] = chosen;
    }
}
