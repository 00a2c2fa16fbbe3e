// attention_ws8.cu — attn_full_ws8: the DiT attention with both GEMMs in FP8 (e4m3 operands, f32
// accumulation), the FP8 path's attention (cuda/dit.rs `CMF_DIT_ATTN8`). Appended to
// attention_wg.cu (it reuses its mbarrier, TMA and descriptor helpers); sm_90a, head dim 128.
//
// Plan: attn_full_ws's (producer warpgroup streaming K/V tiles with TMA into mbarrier-guarded
// slots, two ping-ponged consumer warpgroups of 64 query rows, FlashAttention-3's order with P in
// registers), with these differences:
// - Scales. Q rows get one scale per row and head, K and V one per head: qk_norm_rope (dit.cu)
//   writes Q as e4m3 rows with their scales and folds the K/V maxima in with atomics. A score is
//   then raw · sq(row) · sk(head): per-row constants, folded into the exponent's multiplier, so the
//   softmax costs what it did. O is raw · sv(head) / l at the end.
// - No ping-pong by default (W8_PINGPONG): the warpgroups issue their GEMMs at will.
// - Tiles of 128 keys. FP8 wgmma reads both operands K-major only, so V comes transposed: Vᵀ
//   [NH, HD, Lp] e4m3, made with K's e4m3 copy by attn8_prep below. A Vᵀ row is 128 keys = 128
//   bytes, one 128-byte swizzle span, so a tile is one TMA box (16 KiB) as a K tile is; 4 slots.
// - P as the register A operand of a k32 step: thread (g, tg) holds bytes 4tg..4tg+3 (rows g and
//   g + 8) and 16 + 4tg..16 + 4tg + 3 of the step's 32 keys, but its S accumulators are columns
//   8i + 2tg + {0, 1}. Rather than shuffling P between threads, Vᵀ stores its keys in the order the
//   registers hold them: within each 32 keys, byte position p holds key
//     σ(p) = 16·(p / 16) + 8·((p % 4) / 2) + 2·((p % 16) / 4) + p % 2,
//   and the sum over keys does not care about their order.
// - P is exp2(...) · 2^8 (the boost added to the exponent, free): probabilities down to 2^-17
//   stay e4m3 normals instead of flushing at 2^-9; l takes the same factor, which cancels.
#if defined(HD) && HD == 128

#define W8_KEYS 128
#define W8_TILE (W8_KEYS * HD)  // bytes per K (or Vᵀ) tile
#ifndef W8_SLOTS
#define W8_SLOTS 4
#endif
// The two consumer warpgroups issue their GEMMs in turn (attn_full_ws's ping-pong) only with
// W8_PINGPONG 1: without it measured 0.2 ms faster per 1024² step (bench/results, session 7).
#ifndef W8_PINGPONG
#define W8_PINGPONG 0
#endif
#define W8_Q_BYTES (WG_ROWS * HD)
#define W8_BOOST 8.f
// 1 KiB to align the swizzle atoms, Q, the slots, 4 mbarriers a slot, the Q row scales
// (kernels.rs: ws8_smem).
#define W8_SMEM_BYTES (1024 + W8_Q_BYTES + W8_SLOTS * 2 * W8_TILE + 32 * W8_SLOTS + WG_ROWS * 4)
static_assert(W8_SMEM_BYTES <= 227 * 1024, "attn_full_ws8: shared memory over 227 KiB");

// d[64] (+)= A (m64k32 e4m3 at adesc, K-major) · B (k32n128 e4m3 at bdesc, K-major).
__device__ __forceinline__ void wgmma_e4m3_ss(float* d, u64 adesc, u64 bdesc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(adesc), "l"(bdesc), "r"(scale_d));
}
// d[64] += a (m64k32 e4m3, registers) · B (k32n128 e4m3 at bdesc, K-major).
__device__ __forceinline__ void wgmma_e4m3_rs(float* d, const u32* a, u64 bdesc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(1));
}

// Four floats → four e4m3 bytes (a in the low byte).
__device__ __forceinline__ u32 pack_e4m3x4(float a, float b, float c, float d) {
    return (u32)pack_e4m3x2(a, b) | ((u32)pack_e4m3x2(c, d) << 16);
}

// The online softmax of one 128-key tile, in place (ws_softmax's, with a multiplier per row:
// k0, k1 = scale · log2 e · sq(row) · sk; maxima in raw units, which a per-row constant allows).
template <bool TAIL>
__device__ __forceinline__ void ws8_softmax(float* s, int kt, int T, int tg, float k0, float k1, float& m0,
                                            float& m1, float& l0, float& l1, float& corr0, float& corr1) {
    if (TAIL) {
#pragma unroll
        for (int nt = 0; nt < W8_KEYS / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (kt + nt * 8 + tg * 2 + (e & 1) >= T) s[4 * nt + e] = NEG_INF;
    }
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int nt = 0; nt < W8_KEYS / 8; nt++) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * nt + 0], s[4 * nt + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * nt + 2], s[4 * nt + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    const float ms0 = mx0 * k0, ms1 = mx1 * k1;
    corr0 = fast_exp2(fmaf(m0, k0, -ms0));
    corr1 = fast_exp2(fmaf(m1, k1, -ms1));
    m0 = mx0;
    m1 = mx1;
    const float b0 = W8_BOOST - ms0, b1 = W8_BOOST - ms1;
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int c = 0; c < W8_KEYS / 16; c++) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            s[8 * c + e] = fast_exp2((e & 2) ? fmaf(s[8 * c + e], k1, b1) : fmaf(s[8 * c + e], k0, b0));
        a0 += (s[8 * c + 0] + s[8 * c + 1]) + (s[8 * c + 4] + s[8 * c + 5]);
        a1 += (s[8 * c + 2] + s[8 * c + 3]) + (s[8 * c + 6] + s[8 * c + 7]);
    }
    l0 = l0 * corr0 + a0;
    l1 = l1 * corr1 + a1;
}

// The probabilities as e4m3 A fragments of P·V: k32 step c holds accumulator blocks 4c .. 4c + 3
// (the key order σ of the header).
__device__ __forceinline__ void ws8_pack_p(const float* s, u32 (*pa)[4]) {
#pragma unroll
    for (int c = 0; c < W8_KEYS / 32; c++) {
        const float* b = s + 16 * c;
        pa[c][0] = pack_e4m3x4(b[0], b[1], b[4], b[5]);
        pa[c][1] = pack_e4m3x4(b[2], b[3], b[6], b[7]);
        pa[c][2] = pack_e4m3x4(b[8], b[9], b[12], b[13]);
        pa[c][3] = pack_e4m3x4(b[10], b[11], b[14], b[15]);
    }
}

// The scale of a head from its amax bits (dit.cu folds |value| in as u32: non-negative floats
// order as their bits do).
__device__ __forceinline__ float amax_scale(const unsigned* amax, int i) { return e4m3_scale(__uint_as_float(amax[i])); }

// K and V of one item for attn_full_ws8. kc, vc [NH, L, HD] f16 → k8 [NH, L, HD] = e4m3(k / sk_h)
// and vt8 [NH, HD, Lp] = e4m3(v / sv_h), keys permuted by σ within each 32 and zero from L to Lp.
// amax: [2, NH] (K, then V) bits. Grid (Lp / 128, NH), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
attn8_prep(const u16* kc, const u16* vc, int L, int Lp, const unsigned* amax, int NH, u8* k8, u8* vt8) {
    __shared__ u16 vs[W8_KEYS][HD + 8];  // + 8: rows 272 B apart, reads of one dim spread over banks
    const int h = blockIdx.y, t0 = blockIdx.x * W8_KEYS, tid = threadIdx.x;
    const float ik = 1.f / amax_scale(amax, h), iv = 1.f / amax_scale(amax, NH + h);
    const size_t head = (size_t)h * L * HD;
    for (int i = tid; i < W8_KEYS * HD / 8; i += 256) {
        const int kr = i / (HD / 8), c = i % (HD / 8), key = t0 + kr;
        uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
        if (key < L) {
            kv = *(const uint4*)(kc + head + (size_t)key * HD + c * 8);
            vv = *(const uint4*)(vc + head + (size_t)key * HD + c * 8);
            const u32 w[4] = {kv.x, kv.y, kv.z, kv.w};
            float f[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                f[2 * j] = f16_to_f32((u16)(w[j] & 0xffff)) * ik;
                f[2 * j + 1] = f16_to_f32((u16)(w[j] >> 16)) * ik;
            }
            *(uint2*)(k8 + head + (size_t)key * HD + c * 8) =
                make_uint2(pack_e4m3x4(f[0], f[1], f[2], f[3]), pack_e4m3x4(f[4], f[5], f[6], f[7]));
        }
        *(uint4*)&vs[kr][c * 8] = vv;
    }
    __syncthreads();
    // Vᵀ: a thread writes 4 consecutive byte positions p of one dim's row.
    for (int i = tid; i < HD * (W8_KEYS / 4); i += 256) {
        const int d = i / (W8_KEYS / 4), p0 = 4 * (i % (W8_KEYS / 4));
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int p = p0 + j, q = p & 31;
            const int key = (p & ~31) + 16 * (q >> 4) + 8 * ((q & 3) >> 1) + 2 * ((q & 15) >> 2) + (q & 1);
            f[j] = f16_to_f32(vs[key][d]) * iv;
        }
        *(u32*)(vt8 + ((size_t)h * HD + d) * Lp + t0 + p0) = pack_e4m3x4(f[0], f[1], f[2], f[3]);
    }
}

// Test hook's Q: f32 rows of HD (= 128) values → e4m3 rows and scales as qk_norm_rope makes them.
// One warp a row, 4 rows a block.
extern "C" __global__ void __launch_bounds__(128) q_rows_e4m3(const float* q, int rows, u8* q8, float* qsc) {
    const int lane = threadIdx.x & 31, r = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (r >= rows) return;
    float2 v[2];
#pragma unroll
    for (int k = 0; k < 2; k++) v[k] = *(const float2*)(q + (size_t)r * HD + 2 * (lane + 32 * k));
    warp_e4m3_row<2>(v, lane, q8 + (size_t)r * HD, qsc + r);
}

// Same contract as attn_full_ws (output bf16 at the item's X rows), with Q as e4m3 rows q8
// [T, NH, HD] and their scales qsc [T, NH] (qk_norm_rope), and K and V as attn8_prep wrote them:
// tk a map of k8 (boxes of 128 dims × 128 keys), tv of vt8 (128 keys × 128 dims); amax the item's
// [2, NH] scale bits.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
attn_full_ws8(const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, const u8* q8,
              const float* qsc, int T, float scale, int NH, int img_row0, int np, int cap_row0, u16* out_b,
              const unsigned* amax) {
    extern __shared__ __align__(128) u8 wsm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(FULL_MASK, tid >> 5, 0);
    const int h = blockIdx.y;
    const u32 sbase = (wg_smem_u32(wsm) + 1023) & ~1023u;
    const u32 q_sm = sbase;               // 2 warpgroups × 64 rows × 128 B
    const u32 kv_sm = sbase + W8_Q_BYTES;  // slot s: K at + 2s·TILE, Vᵀ one TILE on
    const u32 full_k = kv_sm + W8_SLOTS * 2 * W8_TILE, full_v = full_k + 8 * W8_SLOTS;
    const u32 empty_k = full_v + 8 * W8_SLOTS, empty_v = empty_k + 8 * W8_SLOTS;
    float* qscale = (float*)(wsm + (sbase - wg_smem_u32(wsm)) + W8_Q_BYTES + W8_SLOTS * 2 * W8_TILE + 32 * W8_SLOTS);
    const int ntiles = (T + W8_KEYS - 1) / W8_KEYS;
    if (tid == 0) ws_init_barriers(full_k, W8_SLOTS);
    __syncthreads();

    if (warp >= 8) {
        // Producer: as attn_full_ws's, one box per tile.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        if (warp == 8 && lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tk) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tv) : "memory");
            for (int t = 0; t <= ntiles; t++) {
                if (t < ntiles) {
                    const int s = t % W8_SLOTS;
                    if (t >= W8_SLOTS) mbar_wait(empty_k + 8 * s, (t / W8_SLOTS - 1) & 1);
                    mbar_expect_tx(full_k + 8 * s, W8_TILE);
                    tma_load_3d(kv_sm + s * 2 * W8_TILE, &tk, 0, t * W8_KEYS, h, full_k + 8 * s);
                }
                if (t > 0) {
                    const int u = t - 1, s = u % W8_SLOTS;
                    if (u >= W8_SLOTS) mbar_wait(empty_v + 8 * s, (u / W8_SLOTS - 1) & 1);
                    mbar_expect_tx(full_v + 8 * s, W8_TILE);
                    tma_load_3d(kv_sm + s * 2 * W8_TILE + W8_TILE, &tv, u * W8_KEYS, 0, h, full_v + 8 * s);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int wgi = warp >> 2, g = lane >> 2, tg = lane & 3;
    const int r0 = blockIdx.x * WG_ROWS + warp * 16 + g, r1 = r0 + 8;
    // This warpgroup's 64 Q rows (e4m3, 128 B each), swizzled as a K-major A operand, and their
    // scales (rows at or past T: zeros, scale 1). Eight threads a row, 16 bytes each.
    const u32 qs = q_sm + wgi * (W8_Q_BYTES / 2);
    for (int pass = 0; pass < 4; pass++) {
        const int row = pass * 16 + ((tid & 127) >> 3), c = tid & 7;
        const int r = blockIdx.x * WG_ROWS + wgi * 64 + row;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (r < T) w = *(const uint4*)(q8 + ((size_t)r * NH + h) * HD + c * 16);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(qs + row * 128 + ((c ^ (row & 7)) << 4)),
                     "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                     : "memory");
        if (c == 0) qscale[wgi * 64 + row] = r < T ? qsc[(size_t)r * NH + h] : 1.f;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_sync(3 + wgi, 128);
    const float sk = amax_scale(amax, h), sv = amax_scale(amax, NH + h);
    const float base = scale * 1.4426950408889634f * sk;
    const float k0 = base * qscale[warp * 16 + g], k1 = base * qscale[warp * 16 + g + 8];

    const u32 my_tok = 1 + wgi, other_tok = 2 - wgi;
    if (W8_PINGPONG && wgi == 1) named_arrive(1, 256);

    float o[64], s[W8_KEYS / 2];
    u32 p[W8_KEYS / 32][4];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < W8_KEYS / 2; i++) s[i] = 0.f;
#pragma unroll
    for (int c = 0; c < W8_KEYS / 32; c++)
#pragma unroll
        for (int e = 0; e < 4; e++) p[c][e] = 0u;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f, corr0 = 1.f, corr1 = 1.f;
    auto rescale_o = [&]() { ws_rescale(o, corr0, corr1); };
    // Every operand: rows of 128 bytes, 8-row groups 1024 B apart; a k32 step is + 32 B.
    const u64 q_desc0 = wg_desc(qs, 16, 1024), k_desc0 = wg_desc(kv_sm, 16, 1024);
    const u64 v_desc0 = wg_desc(kv_sm + W8_TILE, 16, 1024);
    auto issue_pv = [&](int tile) {
        const u64 vd = v_desc0 + (u64)((tile % W8_SLOTS) * 2 * W8_TILE >> 4);
#pragma unroll
        for (int c = 0; c < W8_KEYS / 32; c++) wgmma_e4m3_rs(o, p[c], vd + (u64)(c * 32 >> 4));
        wg_commit();
    };
    auto pin = [&]() {
#pragma unroll
        for (int i = 0; i < 64; i++) wg_keep(o[i]);
#pragma unroll
        for (int c = 0; c < W8_KEYS / 32; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) ws_keep_u(p[c][e]);
    };
    auto step = [&](int j, auto first) {
        constexpr bool FIRST = decltype(first)::value;
        const int sj = j % W8_SLOTS, sp = (j + W8_SLOTS - 1) % W8_SLOTS;
        if (!FIRST) rescale_o();
        mbar_wait(full_k + 8 * sj, (j / W8_SLOTS) & 1);
        if (!FIRST) mbar_wait(full_v + 8 * sp, ((j - 1) / W8_SLOTS) & 1);
        if (W8_PINGPONG) named_sync(my_tok, 256);
        pin();
#pragma unroll
        for (int i = 0; i < W8_KEYS / 2; i++) wg_keep(s[i]);
        wg_fence();
        const u64 kd = k_desc0 + (u64)(sj * 2 * W8_TILE >> 4);
#pragma unroll
        for (int kk = 0; kk < HD / 32; kk++)
            wgmma_e4m3_ss(s, q_desc0 + (u64)(kk * 32 >> 4), kd + (u64)(kk * 32 >> 4), kk > 0);
        wg_commit();
        if (!FIRST) issue_pv(j - 1);
        if (W8_PINGPONG) named_arrive(other_tok, 256);
        if (FIRST) wg_wait0();
        else wg_wait1();
#pragma unroll
        for (int i = 0; i < W8_KEYS / 2; i++) wg_keep(s[i]);
        mbar_arrive(empty_k + 8 * sj);
        if (j * W8_KEYS + W8_KEYS > T) ws8_softmax<true>(s, j * W8_KEYS, T, tg, k0, k1, m0, m1, l0, l1, corr0, corr1);
        else ws8_softmax<false>(s, j * W8_KEYS, T, tg, k0, k1, m0, m1, l0, l1, corr0, corr1);
        if (!FIRST) {
            wg_wait0();
            pin();
            mbar_arrive(empty_v + 8 * sp);
        }
        ws8_pack_p(s, p);
    };
    step(0, FalseTrue<true>());
    for (int j = 1; j < ntiles; j++) step(j, FalseTrue<false>());
    {
        const int last = ntiles - 1;
        rescale_o();
        mbar_wait(full_v + 8 * (last % W8_SLOTS), (last / W8_SLOTS) & 1);
        pin();
        wg_fence();
        issue_pv(last);
        wg_wait0();
        pin();
    }
    if (W8_PINGPONG && wgi == 0) named_sync(1, 256);
    ws_store(o, l0, l1, sv, r0, r1, T, np, img_row0, cap_row0, NH, h, tg, out_b);
}

#endif
