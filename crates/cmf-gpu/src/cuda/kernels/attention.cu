// attention.cu — causal GQA attention over the device KV cache.
//
// Design.
// - Decode (one query per head): split-K. Block (kv head, split) takes the G = NH/NKV query
//   heads that share the kv head, so each K/V row is read once for the whole group, over a
//   contiguous slice of the visible keys; it writes an unnormalised partial (o, max, sum) per
//   head, and a combine kernel merges the splits (the log-sum-exp rescale). The current length
//   comes from device memory (pos_ptr), so one captured graph serves every position: splits
//   past the end exit at once. Scores live in shared memory (G × chunk floats).
// - Prefill, f16 cache: flash attention on tensor cores (mma.sync m16n8k16, f16 in, f32
//   accumulate). A block = 4 warps = 64 queries of one head; key tiles of 64 are staged in
//   shared memory (V transposed so B fragments are single 32-bit loads), online softmax in the
//   log2 domain, P re-packed from the S accumulators straight into A fragments.
// - Prefill, f32 cache (f32/f16 models, where parity with the CPU matters more than speed):
//   one warp per (query, head) with an online softmax, all f32.
// Compile-time: HD (head dim), GQA (query heads per kv head), KV_F32.
// Layouts: q [T, NH, HD] f32; caches [NKV, S_max, HD]; out [T, NH, HD] f32.
// Reference: llm/reference.rs `layer` (scores · attn_scale, softmax, weighted V).

#ifndef HD
#define HD 128
#endif
#ifndef GQA
#define GQA 1
#endif
#ifndef KV_F32
#define KV_F32 0
#endif
#define EPL (HD / 32)
#if KV_F32
typedef float kv_t;
__device__ __forceinline__ float kv_f(kv_t v) { return v; }
#else
typedef u16 kv_t;
__device__ __forceinline__ float kv_f(kv_t v) { return f16_to_f32(v); }
#endif

// EPL consecutive elements of a cache row (lane's share) as f32.
__device__ __forceinline__ void load_kv(const kv_t* p, float* out) {
#if !KV_F32
    if (EPL == 4) {
        uint2 u = *(const uint2*)p;
        out[0] = f16_to_f32(u.x & 0xffff); out[1] = f16_to_f32(u.x >> 16);
        out[2] = f16_to_f32(u.y & 0xffff); out[3] = f16_to_f32(u.y >> 16);
        return;
    }
    if (EPL == 2) {
        u32 u = *(const u32*)p;
        out[0] = f16_to_f32(u & 0xffff); out[1] = f16_to_f32(u >> 16);
        return;
    }
#else
    if (EPL == 4) {
        float4 f = *(const float4*)p;
        out[0] = f.x; out[1] = f.y; out[2] = f.z; out[3] = f.w;
        return;
    }
#endif
#pragma unroll
    for (int j = 0; j < EPL; j++) out[j] = kv_f(p[j]);
}

// Grid (NKV, P), 128 threads, dynamic smem GQA·chunk_max floats.
// part: [NH, P, HD + 2] — o (unnormalised), then max, then sum.
extern "C" __global__ void __launch_bounds__(128)
attn_decode_partial(const float* q, const kv_t* kc, const kv_t* vc, const int* pos_ptr, int window, int S_max,
                    float scale, int P, int chunk_max, float* part) {
    extern __shared__ float sc[];
    const int kvh = blockIdx.x, split = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = pos_ptr[0] + 1;
    const int first = window > 0 ? max(0, S - window) : 0;
    const int n = S - first;
    const int chunk = (n + P - 1) / P;
    const int c0 = first + split * chunk, c1 = min(S, c0 + chunk);
    const size_t stride_h = (size_t)P * (HD + 2);
    float* ob = part + (size_t)kvh * GQA * stride_h + (size_t)split * (HD + 2);
    if (c0 >= c1) {
        for (int i = threadIdx.x; i < GQA * (HD + 2); i += blockDim.x) {
            int g = i / (HD + 2), d = i % (HD + 2);
            ob[g * stride_h + d] = d == HD ? NEG_INF : 0.f;
        }
        return;
    }
    const int len = c1 - c0;
    float qr[GQA][EPL];
#pragma unroll
    for (int g = 0; g < GQA; g++)
#pragma unroll
        for (int j = 0; j < EPL; j++) qr[g][j] = q[(size_t)(kvh * GQA + g) * HD + lane * EPL + j] * scale;

    for (int s = c0 + warp; s < c1; s += 4) {
        float k[EPL];
        load_kv(kc + ((size_t)kvh * S_max + s) * HD + lane * EPL, k);
#pragma unroll
        for (int g = 0; g < GQA; g++) {
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < EPL; j++) d += qr[g][j] * k[j];
            d = warp_sum(d);
            if (lane == 0) sc[g * chunk_max + (s - c0)] = d;
        }
    }
    __syncthreads();
    for (int g = warp; g < GQA; g += 4) {
        float m = NEG_INF;
        for (int i = lane; i < len; i += 32) m = fmaxf(m, sc[g * chunk_max + i]);
        m = warp_max(m);
        float l = 0.f;
        for (int i = lane; i < len; i += 32) {
            float p = expf(sc[g * chunk_max + i] - m);
            sc[g * chunk_max + i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ob[g * stride_h + HD] = m;
            ob[g * stride_h + HD + 1] = l;
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float o[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) o[g] = 0.f;
        const kv_t* vp = vc + ((size_t)kvh * S_max + c0) * HD + d;
#pragma unroll 4
        for (int i = 0; i < len; i++) {
            float v = kv_f(vp[(size_t)i * HD]);
#pragma unroll
            for (int g = 0; g < GQA; g++) o[g] += sc[g * chunk_max + i] * v;
        }
#pragma unroll
        for (int g = 0; g < GQA; g++) ob[g * stride_h + d] = o[g];
    }
}

// Grid NH, 128 threads: merges the P partials of each head into out[NH, HD].
extern "C" __global__ void __launch_bounds__(128) attn_decode_combine(const float* part, int P, float* out) {
    const float* b = part + (size_t)blockIdx.x * P * (HD + 2);
    float M = NEG_INF;
    for (int p = 0; p < P; p++) M = fmaxf(M, b[p * (HD + 2) + HD]);
    float L = 0.f;
    for (int p = 0; p < P; p++) {
        float m = b[p * (HD + 2) + HD];
        if (m > NEG_INF) L += expf(m - M) * b[p * (HD + 2) + HD + 1];
    }
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float o = 0.f;
        for (int p = 0; p < P; p++) {
            float m = b[p * (HD + 2) + HD];
            if (m > NEG_INF) o += expf(m - M) * b[p * (HD + 2) + d];
        }
        out[(size_t)blockIdx.x * HD + d] = o / L;
    }
}

// Grid (T, ceil(NH/4)), 128 threads: one warp per (query, head); any cache type.
extern "C" __global__ void __launch_bounds__(128)
attn_prefill_simple(const float* q, const kv_t* kc, const kv_t* vc, int start, int window, int S_max, float scale,
                    int NH, float* out) {
    const int lane = threadIdx.x & 31, t = blockIdx.x, h = blockIdx.y * 4 + (threadIdx.x >> 5);
    if (h >= NH) return;
    const int kvh = h / GQA, pos = start + t;
    const int first = window > 0 ? max(0, pos + 1 - window) : 0;
    float qr[EPL], o[EPL];
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        qr[j] = q[((size_t)t * NH + h) * HD + lane * EPL + j] * scale;
        o[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int s = first; s <= pos; s++) {
        float k[EPL], v[EPL];
        load_kv(kc + ((size_t)kvh * S_max + s) * HD + lane * EPL, k);
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; j++) d += qr[j] * k[j];
        d = warp_sum(d);
        float mn = fmaxf(m, d), corr = expf(m - mn), p = expf(d - mn);
        l = l * corr + p;
        load_kv(vc + ((size_t)kvh * S_max + s) * HD + lane * EPL, v);
#pragma unroll
        for (int j = 0; j < EPL; j++) o[j] = o[j] * corr + p * v[j];
        m = mn;
    }
#pragma unroll
    for (int j = 0; j < EPL; j++) out[((size_t)t * NH + h) * HD + lane * EPL + j] = o[j] / l;
}

#if !KV_F32 && HD <= 128 && (HD % 16 == 0)
#define FA_BQ 64
#define FA_BK 64
#define KS (HD + 8)
#define VS (FA_BK + 8)

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid (ceil(T/64), NH), 128 threads. Queries are tokens start..start+T of the cache.
extern "C" __global__ void __launch_bounds__(128)
attn_prefill_mma(const float* q, const u16* kc, const u16* vc, int T, int start, int window, int S_max, float scale,
                 int NH, float* out) {
    __shared__ __align__(16) u16 Ks[FA_BK * KS];
    __shared__ __align__(16) u16 Vt[HD * VS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, kvh = h / GQA;
    const int qb = blockIdx.x * FA_BQ, qw = qb + warp * 16;
    const float sl2 = scale * 1.4426950408889634f;

    u32 qa[HD / 16][4];
    {
        const int r0 = qw + g, r1 = r0 + 8;
        const float* q0 = q + ((size_t)r0 * NH + h) * HD;
        const float* q1 = q + ((size_t)r1 * NH + h) * HD;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            int c = kk * 16 + tg * 2;
            float a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
            if (r0 < T) { a0 = q0[c]; a1 = q0[c + 1]; a2 = q0[c + 8]; a3 = q0[c + 9]; }
            if (r1 < T) { b0 = q1[c]; b1 = q1[c + 1]; b2 = q1[c + 8]; b3 = q1[c + 9]; }
            qa[kk][0] = pack_f16x2(a0, a1);
            qa[kk][1] = pack_f16x2(b0, b1);
            qa[kk][2] = pack_f16x2(a2, a3);
            qa[kk][3] = pack_f16x2(b2, b3);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int p0 = start + qw + g, p1 = p0 + 8;
    const int blk_first = start + qb;
    const int k_end = start + min(T, qb + FA_BQ);  // exclusive
    int k_lo = window > 0 ? max(0, blk_first - window + 1) : 0;
    k_lo &= ~(FA_BK - 1);

    for (int kt = k_lo; kt < k_end; kt += FA_BK) {
        __syncthreads();
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
            int r = i / (HD / 8), c8 = (i % (HD / 8)) * 8, key = kt + r;
            uint4 kv = make_uint4(0, 0, 0, 0);
            if (key < k_end) kv = *(const uint4*)(kc + ((size_t)kvh * S_max + key) * HD + c8);
            *(uint4*)(Ks + r * KS + c8) = kv;
        }
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
            int r = i % FA_BK, c8 = (i / FA_BK) * 8, key = kt + r;
            uint4 vv = make_uint4(0, 0, 0, 0);
            if (key < k_end) vv = *(const uint4*)(vc + ((size_t)kvh * S_max + key) * HD + c8);
            u32 w4[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                Vt[(c8 + 2 * e) * VS + r] = (u16)(w4[e] & 0xffff);
                Vt[(c8 + 2 * e + 1) * VS + r] = (u16)(w4[e] >> 16);
            }
        }
        __syncthreads();

        float s[FA_BK / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_BK / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            const u16* kr = Ks + (nt * 8 + g) * KS + tg * 2;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 b0 = *(const u32*)(kr + kk * 16), b1 = *(const u32*)(kr + kk * 16 + 8);
                mma16816(s[nt], qa[kk], b0, b1);
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < FA_BK / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = kt + nt * 8 + tg * 2 + (e & 1);
                int pos = e < 2 ? p0 : p1;
                bool ok = key <= pos && (window <= 0 || key > pos - window);
                float v = ok ? s[nt][e] * sl2 : NEG_INF;
                s[nt][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float base0 = mn0 == NEG_INF ? 0.f : mn0, base1 = mn1 == NEG_INF ? 0.f : mn1;
        const float corr0 = exp2f(m0 - base0), corr1 = exp2f(m1 - base1);
        m0 = mn0;
        m1 = mn1;
        l0 *= corr0;
        l1 *= corr1;
#pragma unroll
        for (int dn = 0; dn < HD / 8; dn++) {
            o[dn][0] *= corr0; o[dn][1] *= corr0;
            o[dn][2] *= corr1; o[dn][3] *= corr1;
        }
#pragma unroll
        for (int nt = 0; nt < FA_BK / 8; nt++) {
            s[nt][0] = exp2f(s[nt][0] - base0);
            s[nt][1] = exp2f(s[nt][1] - base0);
            s[nt][2] = exp2f(s[nt][2] - base1);
            s[nt][3] = exp2f(s[nt][3] - base1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
#pragma unroll
        for (int c = 0; c < FA_BK / 16; c++) {
            u32 a[4];
            a[0] = pack_f16x2(s[2 * c][0], s[2 * c][1]);
            a[1] = pack_f16x2(s[2 * c][2], s[2 * c][3]);
            a[2] = pack_f16x2(s[2 * c + 1][0], s[2 * c + 1][1]);
            a[3] = pack_f16x2(s[2 * c + 1][2], s[2 * c + 1][3]);
#pragma unroll
            for (int dn = 0; dn < HD / 8; dn++) {
                const u16* vr = Vt + (dn * 8 + g) * VS + c * 16 + tg * 2;
                mma16816(o[dn], a, *(const u32*)vr, *(const u32*)(vr + 8));
            }
        }
    }
    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    const int r0 = qw + g, r1 = r0 + 8;
#pragma unroll
    for (int dn = 0; dn < HD / 8; dn++) {
        int d = dn * 8 + tg * 2;
        if (r0 < T) {
            float* dst = out + ((size_t)r0 * NH + h) * HD + d;
            dst[0] = o[dn][0] / l0;
            dst[1] = o[dn][1] / l0;
        }
        if (r1 < T) {
            float* dst = out + ((size_t)r1 * NH + h) * HD + d;
            dst[0] = o[dn][2] / l1;
            dst[1] = o[dn][3] / l1;
        }
    }
}
#endif
