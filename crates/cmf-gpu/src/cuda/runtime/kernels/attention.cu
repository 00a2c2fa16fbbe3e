// attention.cu — causal GQA attention over the device KV cache.
//
// Design.
// - Decode (one query per head, the q/k norm and RoPE fused in): attention_decode.cu.
// - Prefill, f16 cache: flash attention on tensor cores (mma.sync m16n8k16, f16 in, f32
//   accumulate). A block = 4 warps = 64 queries of one head; key tiles of 64 are double-buffered
//   in shared memory through cp.async (V read transposed by ldmatrix.trans), online softmax in
//   the log2 domain, P re-packed from the S accumulators straight into A fragments.
// - Prefill, f32 cache (f32/f16 models, where parity with the CPU matters more than speed):
//   one warp per (query, head) with an online softmax, all f32.
// Compile-time: HD (head dim), GQA (query heads per kv head), KV_F32.
// Layouts: q [T, NH, HD] f32; caches [NKV, S_max, HD]; out [T, NH, HD] f32.
// Reference: llm/reference.rs `layer` (scores · attn_scale, softmax, weighted V).
// DIT_FULL 1 (the DiT's non-Hopper attention, cuda/dit.rs) builds only the non-causal
// attn_full_fa2 at the end, 0 (the LLM) only the prefill kernels: each user compiles
// half the instantiations of fa2_body (NVRTC took 3.1 s for all of them, 1.5 s for the LLM's: the
// text encoder's first image on a machine waits for it).
#ifndef DIT_FULL
#define DIT_FULL 0
#endif


// EPL consecutive elements of a cache row (lane's share) as f32: one vector load where EPL fits
// one, else element by element.
__device__ __forceinline__ void load_kv(const kv_t* p, float* out) {
#if !KV_F32
    if constexpr (EPL == 4) {
        uint2 u = *(const uint2*)p;
        out[0] = f16_to_f32(u.x & 0xffff); out[1] = f16_to_f32(u.x >> 16);
        out[2] = f16_to_f32(u.y & 0xffff); out[3] = f16_to_f32(u.y >> 16);
    } else if constexpr (EPL == 2) {
        u32 u = *(const u32*)p;
        out[0] = f16_to_f32(u & 0xffff); out[1] = f16_to_f32(u >> 16);
    } else
#else
    if constexpr (EPL == 4) {
        float4 f = *(const float4*)p;
        out[0] = f.x; out[1] = f.y; out[2] = f.z; out[3] = f.w;
    } else
#endif
    {
#pragma unroll
        for (int j = 0; j < EPL; j++) out[j] = kv_f(p[j]);
    }
}

#if !DIT_FULL
// Grid (T, ceil(NH/4)), 128 threads: one warp per (query, head); any cache type.
extern "C" __global__ void __launch_bounds__(128)
attn_prefill_simple(const float* q, const kv_t* kc, const kv_t* vc, int start, int window, int S_max, float scale,
                    int NH, float* out) {
    const int lane = threadIdx.x & 31, t = blockIdx.x, h = blockIdx.y * 4 + (threadIdx.x >> 5);
    if (h >= NH) return;
    const int kvh = h / GQA, pos = start + t;
    const int first = window > 0 ? max(0, pos + 1 - window) : 0;
    float qr[EPL], o[EPL];
    const bool ok = LANE_OK(lane);
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        qr[j] = ok ? q[((size_t)t * NH + h) * HD + lane * EPL + j] * scale : 0.f;
        o[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int s = first; s <= pos; s++) {
        float k[EPL], v[EPL];
        const int li = ok ? lane : 0;  // idle lanes read lane 0's (valid) elements, weighted 0
        load_kv(kc + ((size_t)kvh * S_max + s) * HD + li * EPL, k);
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; j++) d += qr[j] * k[j];
        d = warp_sum(d);
        float mn = fmaxf(m, d), corr = expf(m - mn), p = expf(d - mn);
        l = l * corr + p;
        load_kv(vc + ((size_t)kvh * S_max + s) * HD + li * EPL, v);
#pragma unroll
        for (int j = 0; j < EPL; j++) o[j] = o[j] * corr + p * v[j];
        m = mn;
    }
#pragma unroll
    for (int j = 0; j < EPL; j++)
        if (ok) out[((size_t)t * NH + h) * HD + lane * EPL + j] = o[j] / l;
}

#endif  // !DIT_FULL

#if !KV_F32 && HD <= 128 && (HD % 16 == 0)
#define FA_BK 64
#define KS (HD + 8)

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The end of an mma.sync prefill warp: its O rows r0 and r0 + 8 (accumulator fragments o[HD / 8]
// [4]) divided by their row sums l0, l1, as f32 into out [T, NH, HD] (rows at or past T skipped).
__device__ __forceinline__ void store_o_rows_f32(const float (*o)[4], float l0, float l1, int r0, int T, int NH,
                                                 int h, int tg, float* out) {
    const int r1 = r0 + 8;
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

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// The tensor-core prefill attention: K and V tiles double-buffered through cp.async (the next
// tile streams in while this one is multiplied), V kept row-major, its B fragments read
// transposed by ldmatrix.trans. (Synchronous tile loads with V transposed on the way in took
// 1.58 ms against 0.73 ms in a Qwen3-8B q8 prefill layer at 4096 tokens, H200.)
// Grid (ceil(T/64), NH), 128 threads, dynamic smem 2 × 2 × 64 × (HD + 8) halves.
// CAUSAL = false (attn_full_fa2, the DiT): every query sees keys 0..T of its cache; start and
// window are ignored.
// XOUT (the DiT): the output goes to out_b as bf16 at X row `xrow(r)` = r < np ? img_row0 + r :
// cap_row0 + r − np (the item's image rows, then its caption rows, where the DiT keeps them).
// NW: warps per block (16 query rows each).
template <bool CAUSAL, bool XOUT, int NW>
__device__ __forceinline__ void fa2_body(const float* q, const u16* kc, const u16* vc, int T, int start, int window,
                                         int S_max, float scale, int NH, float* out, int img_row0, int np,
                                         int cap_row0, u16* out_b) {
    extern __shared__ __align__(16) u16 fsm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.y, kvh = h / GQA;
    const int qb = blockIdx.x * (16 * NW), qw = qb + warp * 16;
    const float sl2 = scale * 1.4426950408889634f;
    const int TILE = FA_BK * KS;  // halves per K (or V) tile

    u32 qa[HD / 16][4];
    load_q_frags<HD>(q, qw + g, qw + g + 8, T, NH, h, tg, qa);
    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int p0 = start + qw + g, p1 = p0 + 8;
    const int k_end = CAUSAL ? start + min(T, qb + 16 * NW) : T;
    int k_lo = CAUSAL && window > 0 ? max(0, start + qb - window + 1) : 0;
    k_lo &= ~(FA_BK - 1);

    auto load_tile = [&](int stage, int kt) {
        u16* Kd = fsm + stage * 2 * TILE;
        u16* Vd = Kd + TILE;
#pragma unroll
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 32 * NW) {
            int r = i / (HD / 8), c8 = (i % (HD / 8)) * 8, key = kt + r;
            bool ok = key < k_end;
            size_t off = ((size_t)kvh * S_max + (ok ? key : 0)) * HD + c8;
            cp_async16(Kd + r * KS + c8, kc + off, ok);
            cp_async16(Vd + r * KS + c8, vc + off, ok);
        }
    };

    if (k_lo < k_end) load_tile(0, k_lo);
    cp_async_commit();
    for (int it = 0, kt = k_lo; kt < k_end; it++, kt += FA_BK) {
        if (kt + FA_BK < k_end) load_tile((it + 1) & 1, kt + FA_BK);
        cp_async_commit();
        cp_async_wait1();
        __syncthreads();
        const u16* Ks = fsm + (it & 1) * 2 * TILE;
        const u16* Vs = Ks + TILE;

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
                bool ok = CAUSAL ? key <= pos && (window <= 0 || key > pos - window) : key < k_end;
                float v = ok ? s[nt][e] * sl2 : NEG_INF;
                s[nt][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
            }
        mx0 = quad_max(mx0);
        mx1 = quad_max(mx1);
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
        const int lm = lane >> 3, lr = lane & 7;
#pragma unroll
        for (int c = 0; c < FA_BK / 16; c++) {
            u32 a[4];
            a[0] = pack_f16x2(s[2 * c][0], s[2 * c][1]);
            a[1] = pack_f16x2(s[2 * c][2], s[2 * c][3]);
            a[2] = pack_f16x2(s[2 * c + 1][0], s[2 * c + 1][1]);
            a[3] = pack_f16x2(s[2 * c + 1][2], s[2 * c + 1][3]);
#pragma unroll
            for (int dn = 0; dn < HD / 8; dn += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, Vs + (c * 16 + (lm & 1) * 8 + lr) * KS + dn * 8 + (lm >> 1) * 8);
                mma16816(o[dn], a, b[0], b[1]);
                mma16816(o[dn + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();
    }
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const int r0 = qw + g, r1 = r0 + 8;
    if constexpr (XOUT) store_o_xrows<HD>(o, 1.f / l0, 1.f / l1, r0, r1, T, np, img_row0, cap_row0, NH, h, tg, out_b);
    else store_o_rows_f32(o, l0, l1, r0, T, NH, h, tg, out);
}

#if !DIT_FULL
extern "C" __global__ void __launch_bounds__(128)
attn_prefill_fa2(const float* q, const u16* kc, const u16* vc, int T, int start, int window, int S_max, float scale,
                 int NH, float* out) {
    fa2_body<true, false, 4>(q, kc, vc, T, start, window, S_max, scale, NH, out, 0, 0, 0, nullptr);
}

#endif  // !DIT_FULL

// Non-causal attention of T queries over the T keys of their own cache slice (the Z-Image
// DiT: q [T, NH, HD] f32, k/v [NH, S_max, HD] f16), written as bf16 rows of the next GEMM's
// input out_b [*, NH·HD] at the X rows of the item (see fa2_body). Same grid and smem. K
// fragments through ldmatrix.x4 measured slower than these 32-bit shared loads (1024² DiT step
// on the H200: 126.3 ms, 124.6 with 8 warps a block, against 121.8).
#if DIT_FULL
extern "C" __global__ void __launch_bounds__(128)
attn_full_fa2(const float* q, const u16* kc, const u16* vc, int T, int S_max, float scale, int NH, int img_row0,
              int np, int cap_row0, u16* out_b) {
    fa2_body<false, true, 4>(q, kc, vc, T, 0, 0, S_max, scale, NH, nullptr, img_row0, np, cap_row0, out_b);
}
#endif  // DIT_FULL
#endif
