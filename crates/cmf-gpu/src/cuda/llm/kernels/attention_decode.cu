// attention_decode.cu — decode attention (one new token) over the device KV cache, with the
// q/k RMSNorm, RoPE and the cache write of the new token fused in.
//
// Design. At short contexts decode attention is latency, not bytes: a few hundred keys cost
// less than a launch. So one launch does what used to take two (rope_qk_kv, then attention),
// a short context is one block per kv head with no merge, and every phase keeps many loads in
// flight per thread.
// - Grid (NKV, P), DEC_WARPS warps. Block (kvh, split) serves the GQA query heads that share kv
//   head kvh, over a contiguous slice [c0, c1) of the visible keys [first, S), S = *pos_ptr + 1
//   (decode_split). The length comes from device memory, so one captured graph serves every
//   position; splits past P_eff exit at once.
// - A block waits for its predecessor (PDL) either first thing or, with DEC_EARLY_WAIT = 0,
//   after asking L2 for its K and V rows: rows before S − 1 were written by earlier tokens'
//   graphs, which have completed, and a prefetch cannot make a later read stale (L2 is where
//   the new row's write lands too).
// - Prologue: warps take the group's raw q heads from the q|k|v matvec output, apply the q norm,
//   RoPE (rope.cuh) and the score scale, into shared memory. The block holding key S − 1 (the
//   last split) also normalises and rotates the new k and writes k and v into cache row S − 1
//   before any of its threads reads keys: __syncthreads makes the block's global writes visible
//   to it, and the cache is read with ld.global.cg, never the read-only path.
// - Scores: each thread takes whole keys (its K row as 16-byte loads, all in flight; q from
//   shared memory as a broadcast) into scores [GQA][chunk] in shared memory; a warp per head
//   takes their max and sum of exp.
// - P·V: HD/VEC lanes cover a V row (VEC = 8 halves or 4 floats per 16 bytes), so one warp load
//   reads 32/(HD/VEC) keys, V_UNROLL loads in flight per lane; lanes that share dims are summed
//   with shuffles, then the warps in a fixed order through shared memory (deterministic).
// - One split: the block writes out = o / l. Several: each writes its unnormalised partial
//   (o, max, sum) to `part`; the last block of the kv head to finish (counted in count[kvh],
//   which it resets) merges them with the log-sum-exp rescale.
// - attn_decode_short: the same arithmetic for contexts of at most DEC_ONE_BLOCK keys, launched
//   with one block per kv head (the host captures a second decode graph for them). It copies
//   the block's K and V rows into shared memory with cp.async before waiting for its
//   predecessor (rows before S − 1 are immutable by then; the prologue puts row S − 1 there
//   itself), and computes its RoPE factors before the wait too, so no load from the cache and
//   no sincos sits on the path after the q|k|v matvec; two threads share a key in the scores.
// Layouts: qkv [NH + 2·NKV, HD] f32 (q heads, k heads, v heads; biases already added by the
// matvec); caches [NKV, S_max, HD]; part [NH, P, HD + 2]; out [NH, HD] f32.
// Reference: llm/reference.rs `layer`; parity: tests/cuda.rs (decode against the CPU model).

// Up to DEC_ONE_BLOCK visible keys one block does the whole head group (no partials, no merge:
// the fastest at short contexts); beyond, splits of at least DEC_MIN_CHUNK keys (more blocks
// in flight against more merging).
#ifndef DEC_ONE_BLOCK
#define DEC_ONE_BLOCK 256
#endif
#ifndef DEC_MIN_CHUNK
#define DEC_MIN_CHUNK 128
#endif
// When a split-K block waits for its predecessor (PDL). 1: first thing. 0: after reading the
// length (idle splits exit at once) and asking L2 for its K/V rows, so that setup overlaps the
// tail of the q|k|v matvec before it. Chosen per model at load (cuda/llm/mod.rs
// `decode_early_wait`). attn_decode_short always waits after starting its copies (measured on
// the H200, Qwen3-0.6B q8 from context 128: 1374 tok/s against 1316 waiting first).
#ifndef DEC_EARLY_WAIT
#define DEC_EARLY_WAIT 0
#endif
#define DEC_WARPS 8
#define DEC_THREADS (DEC_WARPS * 32)

// The split-K partition: P_eff splits of `chunk` keys over the visible keys [first, S).
__device__ __forceinline__ void decode_split(const int* pos_ptr, int window, int P, int& first, int& S, int& peff, int& chunk) {
    S = pos_ptr[0] + 1;
    first = window > 0 ? max(0, S - window) : 0;
    const int n = S - first;
    peff = n <= DEC_ONE_BLOCK ? 1 : min(P, (n + DEC_MIN_CHUNK - 1) / DEC_MIN_CHUNK);
    chunk = (n + peff - 1) / peff;
}

// Loads that bypass L1: partials written by other SMs in this kernel, and cache rows this
// block may have just written.
__device__ __forceinline__ float ldcg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ldcg16(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// cp.async of 16 bytes, global → shared (L2 only: rows written by earlier kernels).
__device__ __forceinline__ void dec_cp16(void* dst, const void* src) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(src));
}
__device__ __forceinline__ void dec_cp_wait_all() {
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}

// Asks L2 for `bytes` from `p` (128-byte lines spread over the block's threads).
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes) {
    const char* c = (const char*)p;
    for (size_t off = (size_t)threadIdx.x * 128; off < bytes; off += (size_t)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}

// 16 bytes of a cache row as f32 (8 halves or 4 floats).
#if KV_F32
#define KV_VEC 4
__device__ __forceinline__ void kv_vec(uint4 u, float* o) {
    o[0] = __uint_as_float(u.x); o[1] = __uint_as_float(u.y); o[2] = __uint_as_float(u.z); o[3] = __uint_as_float(u.w);
}
#else
#define KV_VEC 8
__device__ __forceinline__ void kv_vec(uint4 u, float* o) {
    u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; e++) { o[2 * e] = f16_to_f32((u16)(w[e] & 0xffff)); o[2 * e + 1] = f16_to_f32((u16)(w[e] >> 16)); }
}
#endif

// Scores: loads of one K row in flight per thread (16 bytes each).
#define KV_GRP (HD / KV_VEC < 16 ? HD / KV_VEC : 16)
// P·V: lanes per V row, keys per warp load, 16-byte chunks per lane per key, loads in flight.
#define V_LPR (HD / KV_VEC)
#define V_LANES (V_LPR < 32 ? V_LPR : 32)
#define V_KPW (32 / V_LANES)
#define V_CPL (V_LPR / V_LANES)
#define V_UNROLL 8

// 16-byte chunks per cache row, and the staged copy's layout (attn_decode_short): row i's
// chunk c sits at chunk position c ^ X(i), X(i) = (i % 8) · (chunks / 8), so the lanes of a
// quarter-warp reading the same chunk of 8 consecutive rows (or two halves of 4 rows) hit 8
// different 16-byte bank groups. Needs a power-of-two chunk count of at least 8; otherwise the
// rows are stored plainly (correct, with bank conflicts).
#define KV_CHUNKS (HD / KV_VEC)
#define KV_SWZ (KV_CHUNKS >= 8 && (KV_CHUNKS & (KV_CHUNKS - 1)) == 0)
__device__ __forceinline__ int stage_pos(int i, int c) {
    return i * KV_CHUNKS + (KV_SWZ ? c ^ ((i & 7) * (KV_CHUNKS / 8)) : c);
}
// Shared q: element e of head g at g · QS_STRIDE + q_idx(e). The second half of a head is
// shifted by 16 bytes so the two threads of a key (each reading its half) use different banks.
#define QS_STRIDE (HD + 4)
__device__ __forceinline__ int q_idx(int e) { return e + (e >= HD / 2 ? 4 : 0); }

// 16 bytes of cache row c0 + i, chunk c: from the staged copy or from global memory.
template <bool STAGED>
__device__ __forceinline__ uint4 kv_chunk(const kv_t* rows, const uint4* staged, int i, int c) {
    if (STAGED) return staged[stage_pos(i, c)];
    return ldcg16(rows + (size_t)i * HD + c * KV_VEC);
}

// The prologue: q heads → shared qs (normed, rotated, scaled); in the last split also the new
// k and v → cache row `pos` (and, when staged, into the staged copy's row `srow`). `scratch`:
// DEC_WARPS × HD floats. cs/sn: this lane's RoPE factors at `pos`. Ends without a barrier.
__device__ __forceinline__ void decode_prologue(const float* qkv, const float* q_norm, const float* k_norm, float eps,
                                                const float (&cs)[RJ], const float (&sn)[RJ], int R, int pos, int NH,
                                                int NKV, float scale, bool last, int S_max, kv_t* kc, kv_t* vc,
                                                float* qs, float* scratch, uint4* ks_stage, uint4* vs_stage, int srow,
                                                int kvh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int u = warp; u < GQA + (last ? 2 : 0); u += DEC_WARPS) {
        const int kind = u < GQA ? 0 : u - GQA + 1;  // 0: q head u, 1: k, 2: v
        const float* src = qkv + (size_t)(kind == 0 ? kvh * GQA + u : NH + (kind - 1) * NKV + kvh) * HD;
        // Plain loads: q|k|v was written by the previous kernel (the matvec), visible after the
        // pdl_wait that precedes decode_end; nothing writes it during this kernel.
        float v[RJ];
#pragma unroll
        for (int j = 0; j < RJ; j++) v[j] = lane + 32 * j < HD ? src[lane + 32 * j] : 0.f;
        if (kind < 2) {
            head_rmsnorm(v, kind == 0 ? q_norm : k_norm, eps, lane);
            head_rope_with(v, scratch + warp * HD, cs, sn, R, lane);
        }
        kv_t* dst = (kind == 1 ? kc : vc) + ((size_t)kvh * S_max + pos) * HD;
        kv_t* sdst = ks_stage ? (kv_t*)(kind == 1 ? ks_stage : vs_stage) : nullptr;
#pragma unroll
        for (int j = 0; j < RJ; j++) {
            const int e = lane + 32 * j;
            if (e >= HD) continue;
            if (kind == 0) {
                qs[u * QS_STRIDE + q_idx(e)] = v[j] * scale;
            } else {
                const kv_t val = to_kv(v[j]);
                dst[e] = val;
                if (sdst) sdst[stage_pos(srow, e / KV_VEC) * KV_VEC + e % KV_VEC] = val;
            }
        }
    }
}

// Dynamic smem: [staged K, staged V: DEC_ONE_BLOCK × HD kv_t each, attn_decode_short only],
// then floats: qs [GQA][QS_STRIDE], scores [GQA][chunk_max], per-warp outputs
// [DEC_WARPS][GQA][HD] (also the prologue's RoPE scratch), merge weights [DEC_WARPS][P].
struct DecodeSmem {
    uint4* ks;
    uint4* vs;
    float* qs;
    float* sc;
    float* ow;
    float* wts;
};
template <bool STAGED>
__device__ __forceinline__ DecodeSmem decode_smem(void* base, int chunk_max) {
    DecodeSmem m;
    m.ks = (uint4*)base;
    m.vs = m.ks + (STAGED ? DEC_ONE_BLOCK * KV_CHUNKS : 0);
    m.qs = (float*)(m.vs + (STAGED ? DEC_ONE_BLOCK * KV_CHUNKS : 0));
    m.sc = m.qs + GQA * QS_STRIDE;
    m.ow = m.sc + GQA * chunk_max;
    m.wts = m.ow + DEC_WARPS * GQA * HD;
    return m;
}

// One block's share of decode attention: its kv head and split, the split's keys [c0, c0 + len)
// of the visible S, and this lane's RoPE factors at position S − 1.
struct DecodeSlice {
    int kvh, split, S, peff, c0, len;
    const kv_t* krow0;
    const kv_t* vrow0;
    float cs[RJ], sn[RJ];
};

// Phase 1, on what earlier graphs wrote only (the position, cache rows before S − 1): the
// slice, the RoPE factors, and when staged the copies of the slice's K/V rows into shared
// memory (cp.async, waited for in decode_end). False: an idle split, or (staged) a context
// longer than the kernel takes, which writes NaN to the kv head's outputs to be loud about it
// (the host launches the staged kernels for at most DEC_ONE_BLOCK keys only).
template <bool STAGED>
__device__ __forceinline__ bool decode_begin(DecodeSlice& d, const DecodeSmem& m, int kvh, int split,
                                             const int* pos_ptr, int window, int P, int S_max, const kv_t* kc,
                                             const kv_t* vc, const float* inv_freq, int R, float attn_factor,
                                             float* out) {
    int first, chunk;
    decode_split(pos_ptr, window, P, first, d.S, d.peff, chunk);
    if (split >= d.peff) return false;
    d.kvh = kvh;
    d.split = split;
    d.c0 = first + split * chunk;
    d.len = min(d.S, d.c0 + chunk) - d.c0;
    d.krow0 = kc + ((size_t)kvh * S_max + d.c0) * HD;
    d.vrow0 = vc + ((size_t)kvh * S_max + d.c0) * HD;
    if (STAGED && (d.peff != 1 || d.len > DEC_ONE_BLOCK)) {
        for (int i = threadIdx.x; i < GQA * HD; i += DEC_THREADS)
            out[(size_t)kvh * GQA * HD + i] = __int_as_float(0x7fc00000);
        return false;
    }
    head_rope_factors(d.cs, d.sn, d.S - 1, inv_freq, R, attn_factor, threadIdx.x & 31);
    if (STAGED) {
        // Rows c0 .. S − 2 were written by earlier tokens' graphs; the prologue adds row S − 1.
        for (int idx = threadIdx.x; idx < (d.len - 1) * KV_CHUNKS; idx += DEC_THREADS) {
            const int i = idx / KV_CHUNKS, c = idx % KV_CHUNKS;
            dec_cp16(m.ks + stage_pos(i, c), d.krow0 + (size_t)i * HD + c * KV_VEC);
            dec_cp16(m.vs + stage_pos(i, c), d.vrow0 + (size_t)i * HD + c * KV_VEC);
        }
    }
    return true;
}

// Phase 2, once the q|k|v values of the new token are in `qkv`: the prologue (q/k norm, RoPE,
// the new row into the cache), scores, softmax, P·V, and the output (one split) or the
// partial and, in the last block of the kv head to finish, the merge.
template <bool STAGED>
__device__ __forceinline__ void decode_end(const DecodeSlice& d, const DecodeSmem& m, const float* qkv,
                                           const float* q_norm, const float* k_norm, float eps, int R, int NH,
                                           int NKV, float scale, int S_max, int P, int chunk_max, kv_t* kc, kv_t* vc,
                                           float* part, int* count, float* out) {
    __shared__ float lsh[GQA];  // softmax sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = d.kvh, split = d.split, peff = d.peff, len = d.len;
    const kv_t* krow0 = d.krow0;
    const kv_t* vrow0 = d.vrow0;
    float *qs = m.qs, *sc = m.sc, *ow = m.ow;
    decode_prologue(qkv, q_norm, k_norm, eps, d.cs, d.sn, R, d.S - 1, NH, NKV, scale, split == peff - 1, S_max, kc, vc,
                    qs, ow, STAGED ? m.ks : nullptr, STAGED ? m.vs : nullptr, len - 1, kvh);
    if (STAGED) dec_cp_wait_all();
    __syncthreads();

    // Scores: TPK threads per key (two when staged: more keys in flight at short contexts),
    // each taking a contiguous share of the row's chunks; the pair sums with one shuffle.
    constexpr int TPK = STAGED && KV_CHUNKS % 2 == 0 ? 2 : 1;
    constexpr int CPT = KV_CHUNKS / TPK;
    constexpr int GRP = KV_GRP < CPT ? KV_GRP : CPT;
    const int part_c = (threadIdx.x % TPK) * CPT;
    for (int base = 0; base < len; base += DEC_THREADS / TPK) {
        const int i = base + threadIdx.x / TPK;
        float acc[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) acc[g] = 0.f;
        if (i < len) {
#pragma unroll
            for (int cb = 0; cb < CPT; cb += GRP) {
                uint4 raw[GRP];
#pragma unroll
                for (int c = 0; c < GRP; c++) raw[c] = kv_chunk<STAGED>(krow0, m.ks, i, part_c + cb + c);
#pragma unroll
                for (int c = 0; c < GRP; c++) {
                    float kf[KV_VEC];
                    kv_vec(raw[c], kf);
                    const int e0 = (part_c + cb + c) * KV_VEC;
#pragma unroll
                    for (int g = 0; g < GQA; g++)
#pragma unroll
                        for (int e = 0; e < KV_VEC; e++) acc[g] += qs[g * QS_STRIDE + q_idx(e0 + e)] * kf[e];
                }
            }
        }
        if (TPK == 2)
#pragma unroll
            for (int g = 0; g < GQA; g++) acc[g] += __shfl_xor_sync(FULL_MASK, acc[g], 1);
        if (i < len && threadIdx.x % TPK == 0)
#pragma unroll
            for (int g = 0; g < GQA; g++) sc[g * chunk_max + i] = acc[g];
    }
    __syncthreads();

    // Softmax numerators in place; max and sum per head.
    const size_t stride_h = (size_t)P * (HD + 2);
    float* ob = part + (size_t)kvh * GQA * stride_h + (size_t)split * (HD + 2);
    for (int g = warp; g < GQA; g += DEC_WARPS) {
        float mx = NEG_INF;
        for (int i = lane; i < len; i += 32) mx = fmaxf(mx, sc[g * chunk_max + i]);
        mx = warp_max(mx);
        float l = 0.f;
        for (int i = lane; i < len; i += 32) {
            float p = expf(sc[g * chunk_max + i] - mx);
            sc[g * chunk_max + i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ob[g * stride_h + HD] = mx;
            ob[g * stride_h + HD + 1] = l;
            lsh[g] = l;
        }
    }
    __syncthreads();

    // P·V: lane (ko, sl) takes key ko of each warp load and chunks sl + 32·c of its row.
    const int sl = lane % V_LANES, ko = lane / V_LANES;
    float o[GQA][V_CPL * KV_VEC];
#pragma unroll
    for (int g = 0; g < GQA; g++)
#pragma unroll
        for (int e = 0; e < V_CPL * KV_VEC; e++) o[g][e] = 0.f;
    const int kstep = DEC_WARPS * V_KPW;
    for (int i0 = warp * V_KPW + ko; i0 - ko < len; i0 += kstep * V_UNROLL) {
        uint4 raw[V_UNROLL][V_CPL];
#pragma unroll
        for (int u = 0; u < V_UNROLL; u++) {
            const int i = i0 + u * kstep;
#pragma unroll
            for (int c = 0; c < V_CPL; c++)
                raw[u][c] = i < len ? kv_chunk<STAGED>(vrow0, m.vs, i, sl + 32 * c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < V_UNROLL; u++) {
            const int i = i0 + u * kstep;
            if (i >= len) continue;
            float p[GQA];
#pragma unroll
            for (int g = 0; g < GQA; g++) p[g] = sc[g * chunk_max + i];
#pragma unroll
            for (int c = 0; c < V_CPL; c++) {
                float vf[KV_VEC];
                kv_vec(raw[u][c], vf);
#pragma unroll
                for (int g = 0; g < GQA; g++)
#pragma unroll
                    for (int e = 0; e < KV_VEC; e++) o[g][c * KV_VEC + e] += p[g] * vf[e];
            }
        }
    }
    // Lanes that hold the same dims (different keys of a load) → lanes with ko = 0.
#pragma unroll
    for (int off = V_LANES; off < 32; off <<= 1)
#pragma unroll
        for (int g = 0; g < GQA; g++)
#pragma unroll
            for (int e = 0; e < V_CPL * KV_VEC; e++) o[g][e] += __shfl_xor_sync(FULL_MASK, o[g][e], off);
    if (ko == 0)
#pragma unroll
        for (int g = 0; g < GQA; g++)
#pragma unroll
            for (int c = 0; c < V_CPL; c++)
#pragma unroll
                for (int e = 0; e < KV_VEC; e++) ow[(warp * GQA + g) * HD + (sl + 32 * c) * KV_VEC + e] = o[g][c * KV_VEC + e];
    __syncthreads();
    for (int i = threadIdx.x; i < GQA * HD; i += DEC_THREADS) {
        const int g = i / HD, dd = i % HD;
        float r = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) r += ow[(w * GQA + g) * HD + dd];
        if (peff == 1)
            out[(size_t)(kvh * GQA + g) * HD + dd] = r / lsh[g];  // one split: already final
        else
            ob[g * stride_h + dd] = r;
    }
    if (peff == 1) return;

    // Last block of this kv head: merge the partials (log-sum-exp rescale), one warp per head.
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(count + kvh, 1) == peff - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (threadIdx.x == 0) count[kvh] = 0;
    float* wt = m.wts + warp * P;
    for (int g = warp; g < GQA; g += DEC_WARPS) {
        const float* hb = part + (size_t)(kvh * GQA + g) * stride_h;
        float M = NEG_INF;
        for (int p = lane; p < peff; p += 32) M = fmaxf(M, ldcg(hb + (size_t)p * (HD + 2) + HD));
        M = warp_max(M);
        float L = 0.f;
        for (int p = lane; p < peff; p += 32) {
            const float* pb = hb + (size_t)p * (HD + 2);
            float w = expf(ldcg(pb + HD) - M);
            wt[p] = w;
            L += w * ldcg(pb + HD + 1);
        }
        L = warp_sum(L);
        __syncwarp();
        if (LANE_OK(lane)) {
            float acc[EPL];
#pragma unroll
            for (int e = 0; e < EPL; e++) acc[e] = 0.f;
#pragma unroll 4
            for (int p = 0; p < peff; p++) {
                const float w = wt[p];
                const float* pb = hb + (size_t)p * (HD + 2) + lane * EPL;
#pragma unroll
                for (int e = 0; e < EPL; e++) acc[e] += w * ldcg(pb + e);
            }
#pragma unroll
            for (int e = 0; e < EPL; e++) out[(size_t)(kvh * GQA + g) * HD + lane * EPL + e] = acc[e] / L;
        }
        __syncwarp();
    }
}

#define DECODE_ARGS                                                                                                  \
    const float *qkv, const float *q_norm, const float *k_norm, float eps, const float *inv_freq, int R,              \
        float attn_factor, const int *pos_ptr, int NH, int NKV, int window, int S_max, float scale, int P,            \
        int chunk_max, kv_t *kc, kv_t *vc, float *part, int *count, float *out

// Split-K decode attention, grid (NKV, P). DEC_EARLY_WAIT: wait for the predecessor first, or
// after the slice is known (idle splits exit at once) and its K/V rows were asked of L2.
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode(DECODE_ARGS) {
    extern __shared__ __align__(16) float dsm[];
    pdl_trigger();
    if (DEC_EARLY_WAIT) pdl_wait();
    const DecodeSmem m = decode_smem<false>(dsm, chunk_max);
    DecodeSlice d;
    if (!decode_begin<false>(d, m, blockIdx.x, blockIdx.y, pos_ptr, window, P, S_max, kc, vc, inv_freq, R,
                             attn_factor, out))
        return;
    if (!DEC_EARLY_WAIT) {
        prefetch_l2(d.krow0, (size_t)d.len * HD * sizeof(kv_t));
        prefetch_l2(d.vrow0, (size_t)d.len * HD * sizeof(kv_t));
        pdl_wait();
    }
    decode_end<false>(d, m, qkv, q_norm, k_norm, eps, R, NH, NKV, scale, S_max, P, chunk_max, kc, vc, part, count,
                      out);
}

// Contexts of at most DEC_ONE_BLOCK keys, grid (NKV, 1): K/V staged in shared memory before the
// wait for the q|k|v matvec.
extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode_short(DECODE_ARGS) {
    extern __shared__ __align__(16) float dsm[];
    pdl_trigger();
    const DecodeSmem m = decode_smem<true>(dsm, chunk_max);
    DecodeSlice d;
    if (!decode_begin<true>(d, m, blockIdx.x, 0, pos_ptr, window, P, S_max, kc, vc, inv_freq, R, attn_factor, out))
        return;
    pdl_wait();
    decode_end<true>(d, m, qkv, q_norm, k_norm, eps, R, NH, NKV, scale, S_max, P, chunk_max, kc, vc, part, count,
                     out);
}
