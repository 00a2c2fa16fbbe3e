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
