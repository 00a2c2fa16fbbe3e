// attention_paged.cu — the batched step's kernels over the device KV block pool.
//
// A step holds the rows of several sequences (decode tokens and prompt chunks alike). Per row t:
// row_pos[t] (its position in its sequence), row_slot[t] (the pool slot its keys and values go
// to: block · BS + position % BS), row_seq[t] (its sequence). Per sequence s: its block table at
// tables + tab_off[s] (block i holds positions i·BS .. i·BS + BS - 1).
// Layouts: qkv [T, NH·HD + 2·NKV·HD] f32 (q | k | v); q, out [T, NH, HD] f32;
// pools [NKV, S_pool, HD] kv_t with S_pool = blocks · BS.
// Compile-time: HD, GQA, KV_F32 (kv.cuh). Reference: llm/batch.rs `paged_attention_reference`
// (attention) and llm/reference.rs `layer` (norms, RoPE).

// rope_qk_kv (rowops.cu) with a position and a pool slot per row (rope_rows.cuh): bias, q/k
// RMSNorm, RoPE, q to q_out, k and v into the pool. Grid (ceil((NH + 2·NKV) / 4), T), 128 threads: a warp per
// (row, head).
extern "C" __global__ void __launch_bounds__(128)
rope_rows_paged(const float* qkv, int ld, const float* q_bias, const float* k_bias, const float* v_bias,
                const float* q_norm, const float* k_norm, float eps, const float* inv_freq, int R, float attn_factor,
                const int* row_pos, const int* row_slot, int NH, int NKV, float* q_out, kv_t* k_pool, kv_t* v_pool,
                int S_pool) {
    __shared__ float buf[4][HD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hh = blockIdx.x * 4 + warp, t = blockIdx.y;
    if (hh >= NH + 2 * NKV) return;
    rope_row_head(qkv, ld, q_bias, k_bias, v_bias, q_norm, k_norm, eps, inv_freq, R, attn_factor, NH, NKV, hh, t,
                  row_pos[t], row_slot[t], q_out, k_pool, v_pool, S_pool, buf[warp], lane);
}

// Keys per round of attn_paged: each lane scores one key of the round.
#define PA_KEYS 32

// Paged causal attention. Grid (T, NKV), 32·GQA threads (GQA ≤ 32): one warp per query head of
// one kv head's group, so the group reads each key and value row once from global memory (the
// block's warps share it through L1). A warp takes its row's visible positions first..pos in
// rounds of 32: each lane scores one key (the dot product over HD from shared q), then the warp
// folds the round into its online softmax (log-sum-exp state m, l) and accumulates the values,
// each lane owning EPL dims. A row's own chunk is visible up to itself: rope_rows_paged wrote it
// before this launch.
extern "C" __global__ void __launch_bounds__(1024)
attn_paged(const float* q, const kv_t* k_pool, const kv_t* v_pool, int S_pool, const int* row_pos,
           const int* row_seq, const int* tables, const int* tab_off, int BS, int window, float scale, int NH,
           float* out) {
    __shared__ float qs[GQA][HD];
    __shared__ int slots[GQA][PA_KEYS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int t = blockIdx.x, kvh = blockIdx.y, h = kvh * GQA + w;
    const int pos = row_pos[t];
    const int first = window > 0 ? max(0, pos + 1 - window) : 0;
    const int* table = tables + tab_off[row_seq[t]];
    for (int e = lane; e < HD; e += 32) qs[w][e] = q[((size_t)t * NH + h) * HD + e] * scale;
    __syncwarp();
    const kv_t* kbase = k_pool + (size_t)kvh * S_pool * HD;
    const kv_t* vbase = v_pool + (size_t)kvh * S_pool * HD;
    const bool ok = LANE_OK(lane);
    float o[EPL];
#pragma unroll
    for (int j = 0; j < EPL; j++) o[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    for (int s0 = first; s0 <= pos; s0 += PA_KEYS) {
        const int s = s0 + lane;
        const bool live = s <= pos;
        const int slot = live ? table[s / BS] * BS + s % BS : 0;
        slots[w][lane] = slot;
        float d = NEG_INF;
        if (live) {
            const kv_t* kr = kbase + (size_t)slot * HD;
            float acc = 0.f;
#pragma unroll 8
            for (int e = 0; e < HD; e++) acc += qs[w][e] * kv_f(kr[e]);
            d = acc;
        }
        __syncwarp();
        const float mn = fmaxf(m, warp_max(d));
        const float p = live ? expf(d - mn) : 0.f;
        const float corr = expf(m - mn);
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int j = 0; j < EPL; j++) o[j] *= corr;
        const int n = min(PA_KEYS, pos - s0 + 1);
        for (int i = 0; i < n; i++) {
            const float pi = __shfl_sync(0xffffffffu, p, i);
            const kv_t* vr = vbase + (size_t)slots[w][i] * HD + (ok ? lane : 0) * EPL;
#pragma unroll
            for (int j = 0; j < EPL; j++) o[j] += pi * kv_f(vr[j]);
        }
        m = mn;
        __syncwarp();
    }
    if (ok) {
#pragma unroll
        for (int j = 0; j < EPL; j++) out[((size_t)t * NH + h) * HD + lane * EPL + j] = o[j] / l;
    }
}

// Paged causal attention, split over the keys (flash-decoding): grid (T, NKV, splits), 128 threads.
// Block (t, kvh, p) takes the p-th of `splits` equal runs (whole tiles) of row t's visible
// positions first..pos, for the GQA query heads of kv head kvh. Per tile of PS_TK keys it stages
// the keys and values in shared memory (16-byte coalesced loads, each staged row padded by 16
// bytes so that the score loop's 16-byte reads are conflict-free), scores every (head, key) pair
// (a thread each), folds the tile into each head's online softmax (a warp per head) and adds the
// weighted values (a thread per (head, dim) output). With one split it writes out; otherwise its
// unnormalised output and (max, sum) go to part_o [T, NH, splits, HD] / part_ml [T, NH, splits]
// and attn_paged_combine merges them. A row's own chunk is visible up to itself:
// rope_rows_paged wrote it before this launch.
#define PS_THREADS 128
constexpr int PS_ROW = HD * (int)sizeof(kv_t) + 16;  // bytes per staged key or value row
constexpr int ps_smem(int tk) { return 2 * tk * PS_ROW + GQA * HD * 4 + GQA * tk * 4 + 3 * GQA * 4; }
// Keys per tile: as many (up to a warp's 32) as fit static shared memory.
constexpr int PS_TK = ps_smem(32) <= 48 * 1024 ? 32 : ps_smem(16) <= 48 * 1024 ? 16 : 8;
// Outputs (head, dim) per thread.
constexpr int PS_OUT = (GQA * HD + PS_THREADS - 1) / PS_THREADS;
constexpr int PS_VEC = HD * (int)sizeof(kv_t) / 16;  // 16-byte pieces per row
static_assert(HD * sizeof(kv_t) % 16 == 0, "key rows are whole 16-byte pieces");
constexpr int PS_PER = 16 / (int)sizeof(kv_t);      // elements per piece

// The PS_PER elements of one 16-byte piece of a key or value row, as f32.
__device__ __forceinline__ void ps_unpack(uint4 u, float* f) {
#if KV_F32
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
#else
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
    }
#endif
}

extern "C" __global__ void __launch_bounds__(PS_THREADS)
attn_paged_split(const float* q, const kv_t* k_pool, const kv_t* v_pool, int S_pool, const int* row_pos,
                 const int* row_seq, const int* tables, const int* tab_off, int BS, int window, float scale,
                 int NH, float* out, float* part_o, float2* part_ml) {
    __shared__ __align__(16) unsigned char ks[PS_TK * PS_ROW];
    __shared__ __align__(16) unsigned char vs[PS_TK * PS_ROW];
    __shared__ float qs[GQA][HD];
    __shared__ float ps[GQA][PS_TK];
    __shared__ float ms[GQA], ls[GQA], cs[GQA];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int pos = row_pos[t];
    const int first = window > 0 ? max(0, pos + 1 - window) : 0;
    const int n = pos + 1 - first;
    const int run = ((n + splits - 1) / splits + PS_TK - 1) / PS_TK * PS_TK;
    const int lo = first + split * run, hi = min(lo + run, pos + 1);
    const int* table = tables + tab_off[row_seq[t]];
    const size_t head0 = (size_t)t * NH + kvh * GQA;
    for (int i = tid; i < GQA * HD; i += PS_THREADS) qs[i / HD][i % HD] = q[head0 * HD + i] * scale;
    if (tid < GQA) {
        ms[tid] = NEG_INF;
        ls[tid] = 0.f;
    }
    float o[PS_OUT];
#pragma unroll
    for (int k = 0; k < PS_OUT; k++) o[k] = 0.f;
    const unsigned char* kbase = (const unsigned char*)(k_pool + (size_t)kvh * S_pool * HD);
    const unsigned char* vbase = (const unsigned char*)(v_pool + (size_t)kvh * S_pool * HD);
    __syncthreads();
    for (int s0 = lo; s0 < hi; s0 += PS_TK) {
        const int nk = min(PS_TK, hi - s0);
        for (int i = tid; i < nk * PS_VEC; i += PS_THREADS) {
            const int j = i / PS_VEC, c = i - j * PS_VEC, s = s0 + j;
            const size_t at = ((size_t)table[s / BS] * BS + s % BS) * HD * sizeof(kv_t) + 16 * c;
            *(uint4*)(ks + j * PS_ROW + 16 * c) = *(const uint4*)(kbase + at);
            *(uint4*)(vs + j * PS_ROW + 16 * c) = *(const uint4*)(vbase + at);
        }
        __syncthreads();
        for (int i = tid; i < GQA * PS_TK; i += PS_THREADS) {
            const int g = i / PS_TK, j = i - g * PS_TK;
            float acc = NEG_INF;
            if (j < nk) {
                acc = 0.f;
                const uint4* kr = (const uint4*)(ks + j * PS_ROW);
#pragma unroll 4
                for (int c = 0; c < PS_VEC; c++) {
                    float f[PS_PER];
                    ps_unpack(kr[c], f);
#pragma unroll
                    for (int x = 0; x < PS_PER; x++) acc += qs[g][c * PS_PER + x] * f[x];
                }
            }
            ps[g][j] = acc;
        }
        __syncthreads();
        for (int g = warp; g < GQA; g += PS_THREADS / 32) {
            const float sj = lane < PS_TK ? ps[g][lane] : NEG_INF;
            const float mo = ms[g];
            const float mn = fmaxf(mo, warp_max(sj));
            const float p = lane < nk ? expf(sj - mn) : 0.f;
            const float sum = warp_sum(p);
            if (lane < PS_TK) ps[g][lane] = p;
            if (lane == 0) {
                const float c = expf(mo - mn);
                cs[g] = c;
                ls[g] = ls[g] * c + sum;
                ms[g] = mn;
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < PS_OUT; k++) {
            const int i = tid + k * PS_THREADS;
            if (i < GQA * HD) {
                const int g = i / HD, e = i - g * HD;
                float acc = o[k] * cs[g];
                for (int j = 0; j < nk; j++) acc += ps[g][j] * kv_f(((const kv_t*)(vs + j * PS_ROW))[e]);
                o[k] = acc;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < PS_OUT; k++) {
        const int i = tid + k * PS_THREADS;
        if (i >= GQA * HD) break;
        const int g = i / HD, e = i - g * HD;
        if (splits == 1) {
            out[(head0 + g) * HD + e] = o[k] / ls[g];
        } else {
            part_o[((head0 + g) * splits + split) * HD + e] = o[k];
        }
    }
    if (splits > 1 && tid < GQA) part_ml[(head0 + tid) * splits + split] = make_float2(ms[tid], ls[tid]);
}

// Merges attn_paged_split's runs of each (row, head): grid (T · NH), 128 threads. Runs that saw
// no key (max -inf) weigh nothing.
extern "C" __global__ void __launch_bounds__(128)
attn_paged_combine(const float* part_o, const float2* part_ml, int splits, float* out) {
    const size_t th = blockIdx.x;
    const float2* ml = part_ml + th * splits;
    float m = NEG_INF;
    for (int p = 0; p < splits; p++) m = fmaxf(m, ml[p].x);
    float l = 0.f;
    for (int p = 0; p < splits; p++)
        if (ml[p].x > NEG_INF) l += expf(ml[p].x - m) * ml[p].y;
    const float inv = 1.f / l;
    for (int e = threadIdx.x; e < HD; e += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < splits; p++)
            if (ml[p].x > NEG_INF) acc += expf(ml[p].x - m) * part_o[(th * splits + p) * HD + e];
        out[th * HD + e] = acc * inv;
    }
}

// dst[i] = src[idx[i]], rows of H floats. Grid (n), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
gather_rows(const float* src, const int* idx, int H, float* dst) {
    const float* s = src + (size_t)idx[blockIdx.x] * H;
    float* d = dst + (size_t)blockIdx.x * H;
    for (int e = threadIdx.x; e < H; e += blockDim.x) d[e] = s[e];
}

// The arg-max of each row of logits [n, V]: the first of the largest, as reference::argmax (NaNs
// are skipped). Grid (n), 1024 threads.
extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float* logits, int V, int* out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* x = logits + (size_t)blockIdx.x * V;
    float best = NEG_INF;
    int idx = V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = x[i];
        if (v > best || (idx == V && v == best)) { best = v; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, best, o);
        const int oi = __shfl_down_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { bv[w] = best; bi[w] = idx; }
    __syncthreads();
    if (w == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : NEG_INF;
        idx = lane < nw ? bi[lane] : V;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, best, o);
            const int oi = __shfl_down_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
        if (lane == 0) out[blockIdx.x] = idx < V ? idx : 0;
    }
}
