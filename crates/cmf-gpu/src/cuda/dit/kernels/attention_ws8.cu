// attention_ws8.cu — attn_full_ws8: the DiT attention with both GEMMs in FP8 (e4m3 operands, f32
// accumulation), the FP8 path's attention (cuda/dit.rs `attn8_request`). Appended to
// attention_wg.cu (it reuses its mbarrier, TMA and descriptor helpers); sm_90a, head dim 128.
//
// Plan: attn_full_ws's (producer warpgroup streaming K/V tiles with TMA into mbarrier-guarded
// slots, two ping-ponged consumer warpgroups of 64 query rows, FlashAttention-3's order with P in
// registers), with these differences:
// - Scales. Q rows get one scale per row and head, K one per layer, V one per head: qk_norm_rope
//   (dit.cu) writes Q as e4m3 rows with their scales and K as e4m3 with the layer's static scale
//   (RMSNorm bounds |k|), and folds the V maxima in with atomics. A score is then
//   raw · sq(row) · sk: per-row constants, folded into the exponent's multiplier, so the softmax
//   costs what it did. O is raw · sv(head) / l at the end.
// - Output. bf16 rows, or (out_q set: the O projection runs in FP8) e4m3 rows with one scale per
//   item, so = max over heads of V's maximum / 448: a row of O is a convex combination of V rows,
//   so |O| ≤ that maximum, and e4m3 keeps 3 significant bits down to 2⁻⁶ · 448 below it — no
//   pass over the rows for their maxima.
// - No ping-pong by default (W8_PINGPONG): the warpgroups issue their GEMMs at will.
// - Tiles of 128 keys. FP8 wgmma reads both operands K-major only, so V comes transposed: Vᵀ
//   [NH, HD, Lp] e4m3, made by attn8_prep below. A Vᵀ row is 128 keys = 128 bytes, one 128-byte
//   swizzle span, so a tile is one TMA box (16 KiB) as a K tile is; 4 slots.
// - P as the register A operand of a k32 step: thread (g, tg) holds bytes 4tg..4tg+3 (rows g and
//   g + 8) and 16 + 4tg..16 + 4tg + 3 of the step's 32 keys, but its S accumulators are columns
//   8i + 2tg + {0, 1}. Rather than shuffling P between threads, Vᵀ stores its keys in the order the
//   registers hold them: within each 32 keys, byte position p holds key
//     σ(p) = 16·(p / 16) + 8·((p % 4) / 2) + 2·((p % 16) / 4) + p % 2,
//   and the sum over keys does not care about their order.
// - P is exp2(...) · 2^B (the boost B = 8 − W8_TAU added to the exponent, free): probabilities
//   down to 2^-(9+B) stay representable instead of flushing at 2^-9; l takes the same factor,
//   which cancels.
// - Lazy rescaling (W8_TAU): a row's running maximum moves only when a tile's maximum exceeds it
//   by more than W8_TAU (log2 units); otherwise the exponents use the stale one, so P ≤ 2^(B+τ)
//   = 2^8 < 448 still, and O and l skip their rescale when no row of the warp moved (most tiles
//   once the maxima settle).
// - l from the tensor cores (W8_ONES): each slot holds 8 rows of e4m3 ones after its Vᵀ tile, and
//   P·V runs as m64n136 — columns 128..135 of the accumulator are the row sums of exactly the P
//   bytes that went into O, with no adds on the FP32 pipe (the softmax's other limit, with the
//   exponentials, at 128 keys a tile).
#if defined(HD) && HD == 128

#define W8_KEYS 128
#define W8_TILE (W8_KEYS * HD)  // bytes per K (or Vᵀ) tile
#ifndef W8_SLOTS
#define W8_SLOTS 4
#endif
// The two consumer warpgroups issue their GEMMs in turn (attn_full_ws's ping-pong) only with
// W8_PINGPONG 1: without it measured 0.2 ms faster per 1024² step (H200, 2026-12-01).
#ifndef W8_PINGPONG
#define W8_PINGPONG 0
#endif
#ifndef W8_TAU
#define W8_TAU 2
#endif
#ifndef W8_ONES
#define W8_ONES 1
#endif
#define W8_Q_BYTES (WG_ROWS * HD)
#define W8_BOOST (8.f - (float)W8_TAU)
// A slot: K tile, Vᵀ tile, then 1 KiB: the 8 rows of ones P·V's n136 reads after Vᵀ.
#define W8_SLOT (2 * W8_TILE + 1024)
// O accumulators a thread: 64, and the ones columns' 4 with W8_ONES.
#define W8_NO (W8_ONES ? 68 : 64)
// 1 KiB to align the swizzle atoms, Q, the slots, 4 mbarriers a slot, the Q row scales
// (kernels.rs: ws8_smem).
#define W8_SMEM_BYTES (1024 + W8_Q_BYTES + W8_SLOTS * W8_SLOT + 32 * W8_SLOTS + WG_ROWS * 4)
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

// d[68] += a (m64k32 e4m3, registers) · B (k32n136 e4m3 at bdesc, K-major): P·V with the ones rows.
__device__ __forceinline__ void wgmma_e4m3_rs_n136(float* d, const u32* a, u64 bdesc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %73, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}, "
        "{%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(1));
}

// The online softmax of one 128-key tile, in place (ws_softmax's, with a multiplier per row:
// k0, k1 = scale · log2 e · sq(row) · sk; maxima in raw units, which a per-row constant allows).
// A row's maximum moves only by more than W8_TAU (corr 1 otherwise); moved: whether either did.
// Without W8_ONES the row sums l0, l1 (this thread's columns) accumulate here.
template <bool TAIL>
__device__ __forceinline__ void ws8_softmax(float* s, int kt, int T, int tg, float k0, float k1, float& m0,
                                            float& m1, float& l0, float& l1, float& corr0, float& corr1,
                                            bool& moved) {
    ws_move_max<W8_KEYS / 2, TAIL>(s, kt, T, tg, k0, k1, (float)W8_TAU, m0, m1, corr0, corr1, moved);
    const float b0 = W8_BOOST - m0 * k0, b1 = W8_BOOST - m1 * k1;
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int c = 0; c < W8_KEYS / 16; c++) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            s[8 * c + e] = fast_exp2((e & 2) ? fmaf(s[8 * c + e], k1, b1) : fmaf(s[8 * c + e], k0, b0));
        if (!W8_ONES) {
            a0 += (s[8 * c + 0] + s[8 * c + 1]) + (s[8 * c + 4] + s[8 * c + 5]);
            a1 += (s[8 * c + 2] + s[8 * c + 3]) + (s[8 * c + 6] + s[8 * c + 7]);
        }
    }
    if (!W8_ONES) {
        l0 = l0 * corr0 + a0;
        l1 = l1 * corr1 + a1;
    }
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

// V (and, with kc set, K) of one item for attn_full_ws8: → vt8 [NH, HD, Lp] = e4m3(v / sv_h), keys
// permuted by σ within each 32 and zero from L to Lp; v_amax: [NH] bits. V comes from either
// - vrows (the DiT): the item's bf16 rows as the q|k|v GEMM wrote them, V's columns (vrows points
//   at the first) vld values apart; key p is X row p < np ? img_row0 + p : cap_row0 + (p − np)
//   (the image rows, then the caption's). No copy of V is made before this kernel; or
// - vc (the test hook's; vrows null): [NH, L, HD] f16.
// kc (the test hook's; the DiT's qk_norm_rope writes k8 itself): [NH, L, HD] f16 → k8 = e4m3(k ·
// k_inv). Grid (Lp / 128, NH), 256 threads.
// The tile goes through shared memory already in e4m3, 18 KiB a block, so eight blocks fit an
// SM and the 990 blocks of a 1024² layer run in one round (staged as 16-bit values, 34 KiB, they
// took 1.25 rounds: 28.2–28.8 against 26.9–27.9 µs under ncu, 2026-12-02; the same bytes).
// Eight 16-bit values (bf16 where `bf16`, else f16) times `scale` as eight e4m3 bytes.
__device__ __forceinline__ uint2 e4m3x8_of(uint4 v, bool bf16, float scale) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float f[8];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u16 lo = (u16)(w[j] & 0xffff), hi = (u16)(w[j] >> 16);
        f[2 * j] = (bf16 ? bf16_to_f32(lo) : f16_to_f32(lo)) * scale;
        f[2 * j + 1] = (bf16 ? bf16_to_f32(hi) : f16_to_f32(hi)) * scale;
    }
    return make_uint2(pack_e4m3x4(f[0], f[1], f[2], f[3]), pack_e4m3x4(f[4], f[5], f[6], f[7]));
}

extern "C" __global__ void __launch_bounds__(256)
attn8_prep(const u16* kc, const u16* vc, const u16* vrows, long long vld, int img_row0, int np, int cap_row0,
           int L, int Lp, const unsigned* v_amax, float k_inv, u8* k8, u8* vt8) {
    __shared__ __align__(16) u8 vs[W8_KEYS][HD + 16];  // + 16: rows 144 B apart
    const int h = blockIdx.y, t0 = blockIdx.x * W8_KEYS, tid = threadIdx.x;
    const float iv = 1.f / amax_scale(v_amax, h);
    const size_t head = (size_t)h * L * HD;
    const bool v_bf16 = vrows != nullptr;
#pragma unroll
    for (int i = tid; i < W8_KEYS * HD / 8; i += 256) {
        const int kr = i / (HD / 8), c = i % (HD / 8), key = t0 + kr;
        uint4 vv = make_uint4(0u, 0u, 0u, 0u);
        if (key < L) {
            if (v_bf16) {
                const long long row = key < np ? img_row0 + key : cap_row0 + (key - np);
                vv = *(const uint4*)(vrows + row * vld + h * HD + c * 8);
            } else {
                vv = *(const uint4*)(vc + head + (size_t)key * HD + c * 8);
            }
            if (kc) {
                const uint4 kv = *(const uint4*)(kc + head + (size_t)key * HD + c * 8);
                *(uint2*)(k8 + head + (size_t)key * HD + c * 8) = e4m3x8_of(kv, false, k_inv);
            }
        }
        *(uint2*)&vs[kr][c * 8] = e4m3x8_of(vv, v_bf16, iv);
    }
    __syncthreads();
    // Vᵀ: a thread writes the 32 byte positions p of one 32-key group of one dim's row (one
    // 32-byte sector); a warp's lanes take consecutive dims, so each read of a key's row is
    // conflict-free.
#pragma unroll
    for (int it = 0; it < HD * (W8_KEYS / 32) / 256; it++) {
        const int i = tid + 256 * it, d = i % HD, p0 = 32 * (i / HD);
        u32 w[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int key[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int q = 4 * j + e;  // σ within the group (the header's key order)
                key[e] = p0 + 16 * (q >> 4) + 8 * ((q & 3) >> 1) + 2 * ((q & 15) >> 2) + (q & 1);
            }
            w[j] = (u32)vs[key[0]][d] | ((u32)vs[key[1]][d] << 8) | ((u32)vs[key[2]][d] << 16) |
                   ((u32)vs[key[3]][d] << 24);
        }
        uint4* dst = (uint4*)(vt8 + ((size_t)h * HD + d) * Lp + t0 + p0);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
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

// The end of a consumer with e4m3 output: O rows r0, r1 times i0, i1 as e4m3 bytes into out_q
// [*, NH · HD] at the item's X rows (ws_store_staged, through this warpgroup's Q buffer), and, from
// head 0, the item's scale so at out_s of those rows.
__device__ __forceinline__ void ws8_store_e4m3(const float* o, float i0, float i1, float so, int r0, int r1, int T,
                                               int np, int img_row0, int cap_row0, int NH, int h, int tg, u8* out_q,
                                               float* out_s, u32 stage, int wrow0, int wtid, u32 bar) {
    ws_store_staged<1>((const float(*)[4])o, i0, i1, stage, wrow0, T, np, img_row0, cap_row0, NH, h, wtid, bar, out_q,
                       [](float a, float b) { return pack_e4m3x2(a, b); });
    if (h == 0 && tg == 0) {
        if (r0 < T) out_s[o_xrow(r0, np, img_row0, cap_row0)] = so;
        if (r1 < T) out_s[o_xrow(r1, np, img_row0, cap_row0)] = so;
    }
}

// Same contract as attn_full_ws (output bf16 at the item's X rows), with Q as e4m3 rows q8
// [T, NH, HD] and their scales qsc [T, NH] (qk_norm_rope; or, q_norm set, made here from the
// q|k|v rows q_rows: ws8_q_from_rows), and K and V as e4m3 (qk_norm_rope,
// attn8_prep): tk a map of k8 (boxes of 128 dims × 128 keys) with the scale k_scale, tv of vt8
// (128 keys × 128 dims) with the item's [NH] V maxima v_amax. out_q set: the output as e4m3 rows
// (with out_s, see ws8_store_e4m3) instead of bf16 out_b.
// attn_full_ws8's Q made from the q|k|v rows (WsQRows, attention_wg.cu): RMSNorm + RoPE as
// qknorm.cuh does them, then e4m3 with a scale per row as qk_norm_rope encodes it, so the bytes
// and scales are the ones qk_norm_rope would write. Eight threads a row (16 values each, the
// load below's layout): a lane's two 8-value halves are chunks 2c and 2c + 1 of qknorm.cuh's
// 16, and the head's sum follows qkn_head_sum's tree (chunks xor 8, 4, 2 are lanes xor 4, 2, 1;
// xor 1 adds the lane's two halves).
__device__ __forceinline__ void ws8_q_from_rows(const u16* q, const WsQRows& qr, u32 qs, float* qscale, int r0, int T,
                                                int h, int img_row0, int np, int cap_row0, int tid) {
    const int c = tid & 7, row0 = (tid & 127) >> 3;
    float nw[16];
#pragma unroll
    for (int k = 0; k < 4; k++) *(float4*)(nw + 4 * k) = *(const float4*)(qr.norm + 16 * c + 4 * k);
    long long xr[4];
    int rr[4];
    ws_q_rows_at<4, 16>(qr, r0 + row0, T, img_row0, np, cap_row0, xr, rr);
    uint4 raw[4][2];
    float4 cs[4][2], sn[4][2];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const bool in = xr[i] >= 0;
            const long long t = (long long)rr[i] * (HD / 2) + 8 * c + 4 * e;
            raw[i][e] = in ? *(const uint4*)(q + xr[i] * qr.ld + h * HD + 16 * c + 8 * e) : make_uint4(0u, 0u, 0u, 0u);
            cs[i][e] = in ? *(const float4*)(qr.cosb + t) : make_float4(0.f, 0.f, 0.f, 0.f);
            sn[i][e] = in ? *(const float4*)(qr.sinb + t) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float v[16];
        qkn_unpack_bf16x8(raw[i][0], v);
        qkn_unpack_bf16x8(raw[i][1], v + 8);
        float a = qkn_sumsq8(v), b = qkn_sumsq8(v + 8);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) {
            a += __shfl_xor_sync(FULL_MASK, a, o);
            b += __shfl_xor_sync(FULL_MASK, b, o);
        }
        const float inv = rsqrtf((a + b) / (float)HD + qr.eps);
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float c4[4] = {cs[i][e].x, cs[i][e].y, cs[i][e].z, cs[i][e].w};
            const float s4[4] = {sn[i][e].x, sn[i][e].y, sn[i][e].z, sn[i][e].w};
            qkn_apply8(v + 8 * e, inv, nw + 8 * e, c4, s4);
        }
        float amax = 0.f;
#pragma unroll
        for (int k = 0; k < 16; k++) amax = fmaxf(amax, fabsf(v[k]));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
        const float sc = e4m3_scale(amax), is = 1.f / sc;
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = pack_e4m3x4(v + 4 * k, is);
        const int row = row0 + 16 * i;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(qs + row * 128 + ((c ^ (row & 7)) << 4)),
                     "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                     : "memory");
        if (c == 0) qscale[row] = sc;
    }
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
attn_full_ws8(const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, const u8* q8,
              const float* qsc, int T, float scale, int NH, int img_row0, int np, int cap_row0, u16* out_b,
              const unsigned* v_amax, float k_scale, u8* out_q, float* out_s, int split_from, float* part,
              unsigned* pairs, const u16* q_rows, int q_ld, const float* q_norm, float q_eps, const float* q_cos,
              const float* q_sin, const int* q_rope_row, int q_rope_stride) {
    const WsQRows qr = {q_ld, q_norm, q_eps, q_cos, q_sin, q_rope_row, q_rope_stride};
    extern __shared__ __align__(128) u8 wsm[];
    __shared__ int merge_flag;
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(FULL_MASK, tid >> 5, 0);
    const u32 sbase = (wg_smem_u32(wsm) + 1023) & ~1023u;
    const u32 q_sm = sbase;               // 2 warpgroups × 64 rows × 128 B
    const u32 kv_sm = sbase + W8_Q_BYTES;  // slot s at + s·W8_SLOT: K, Vᵀ one TILE on, ones one more
    const u32 full_k = kv_sm + W8_SLOTS * W8_SLOT, full_v = full_k + 8 * W8_SLOTS;
    const u32 empty_k = full_v + 8 * W8_SLOTS, empty_v = empty_k + 8 * W8_SLOTS;
    float* qscale = (float*)(wsm + (sbase - wg_smem_u32(wsm)) + W8_Q_BYTES + W8_SLOTS * W8_SLOT + 32 * W8_SLOTS);
    const WsWork work = ws_work((T + WG_ROWS - 1) / WG_ROWS, (T + W8_KEYS - 1) / W8_KEYS, split_from);
    const int h = work.h, t0 = work.t0, ntiles = work.t1 - work.t0;  // tiles local from here: key tile t0 + j
    if (tid == 0) ws_init_barriers(full_k, W8_SLOTS);
    // The ones rows (e4m3 1.0 = 0x38), written once; TMA never touches them.
    for (int i = tid; i < W8_SLOTS * 256; i += WS_THREADS)
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(kv_sm + (i >> 8) * W8_SLOT + 2 * W8_TILE + (i & 255) * 4),
                     "r"(0x38383838u)
                     : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
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
                    tma_load_3d(kv_sm + s * W8_SLOT, &tk, 0, (t0 + t) * W8_KEYS, h, full_k + 8 * s);
                }
                if (t > 0) {
                    const int u = t - 1, s = u % W8_SLOTS;
                    if (u >= W8_SLOTS) mbar_wait(empty_v + 8 * s, (u / W8_SLOTS - 1) & 1);
                    mbar_expect_tx(full_v + 8 * s, W8_TILE);
                    tma_load_3d(kv_sm + s * W8_SLOT + W8_TILE, &tv, (t0 + u) * W8_KEYS, 0, h, full_v + 8 * s);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int wgi = warp >> 2, g = lane >> 2, tg = lane & 3;
    const int r0 = work.qt * WG_ROWS + warp * 16 + g, r1 = r0 + 8;
    // This warpgroup's 64 Q rows (e4m3, 128 B each), swizzled as a K-major A operand, and their
    // scales (rows at or past T: zeros, scale 1). Eight threads a row, 16 bytes each.
    const u32 qs = q_sm + wgi * (W8_Q_BYTES / 2);
    if (qr.norm)
        ws8_q_from_rows(q_rows, qr, qs, qscale + wgi * 64, work.qt * WG_ROWS + wgi * 64, T, h, img_row0, np, cap_row0,
                        tid);
    else for (int pass = 0; pass < 4; pass++) {
        const int row = pass * 16 + ((tid & 127) >> 3), c = tid & 7;
        const int r = work.qt * WG_ROWS + wgi * 64 + row;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (r < T) w = *(const uint4*)(q8 + ((size_t)r * NH + h) * HD + c * 16);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(qs + row * 128 + ((c ^ (row & 7)) << 4)),
                     "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                     : "memory");
        if (c == 0) qscale[wgi * 64 + row] = r < T ? qsc[(size_t)r * NH + h] : 1.f;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_sync(3 + wgi, 128);
    const float sv = amax_scale(v_amax, h);
    const float base = scale * 1.4426950408889634f * k_scale;
    const float k0 = base * qscale[warp * 16 + g], k1 = base * qscale[warp * 16 + g + 8];

    const u32 my_tok = 1 + wgi, other_tok = 2 - wgi;
    if (W8_PINGPONG && wgi == 1) named_arrive(1, 256);

    float o[W8_NO], s[W8_KEYS / 2];
    u32 p[W8_KEYS / 32][4];
#pragma unroll
    for (int i = 0; i < W8_NO; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < W8_KEYS / 2; i++) s[i] = 0.f;
#pragma unroll
    for (int c = 0; c < W8_KEYS / 32; c++)
#pragma unroll
        for (int e = 0; e < 4; e++) p[c][e] = 0u;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f, corr0 = 1.f, corr1 = 1.f;
    bool moved = true;
    // O (and the ones columns' l) take the last softmax's corrections where a row moved.
    auto rescale_o = [&]() { ws_rescale<W8_NO>(o, corr0, corr1, moved); };
    // Every operand: rows of 128 bytes, 8-row groups 1024 B apart; a k32 step is + 32 B.
    const u64 q_desc0 = wg_desc(qs, 16, 1024), k_desc0 = wg_desc(kv_sm, 16, 1024);
    const u64 v_desc0 = wg_desc(kv_sm + W8_TILE, 16, 1024);
    auto issue_pv = [&](int tile) {
        const u64 vd = v_desc0 + (u64)((tile % W8_SLOTS) * W8_SLOT >> 4);
#pragma unroll
        for (int c = 0; c < W8_KEYS / 32; c++) {
            if (W8_ONES) wgmma_e4m3_rs_n136(o, p[c], vd + (u64)(c * 32 >> 4));
            else wgmma_e4m3_rs(o, p[c], vd + (u64)(c * 32 >> 4));
        }
        wg_commit();
    };
    auto pin = [&]() {
#pragma unroll
        for (int i = 0; i < W8_NO; i++) wg_keep(o[i]);
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
        const u64 kd = k_desc0 + (u64)(sj * W8_SLOT >> 4);
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
        const int kt = (t0 + j) * W8_KEYS;
        if (kt + W8_KEYS > T) ws8_softmax<true>(s, kt, T, tg, k0, k1, m0, m1, l0, l1, corr0, corr1, moved);
        else ws8_softmax<false>(s, kt, T, tg, k0, k1, m0, m1, l0, l1, corr0, corr1, moved);
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
    if (work.pair >= 0 && !ws_merge_halves<W8_NO>(o, m0, m1, l0, l1, k0, k1, work, part, pairs, tid, &merge_flag)) return;
    // The row sums: a ones column (every one holds the full sum), or this thread's columns' summed
    // over the quad.
    const float lr0 = W8_ONES ? o[W8_NO - 4] : quad_sum(l0), lr1 = W8_ONES ? o[W8_NO - 2] : quad_sum(l1);
    if (out_q) {
        // The item's output scale: the largest V maximum over the heads (lane i takes heads i + 32k).
        float vmax = 0.f;
        for (int i = lane; i < NH; i += 32) vmax = fmaxf(vmax, __uint_as_float(v_amax[i]));
        const float so = e4m3_scale(warp_max(vmax)), mul = sv / so;
        ws8_store_e4m3(o, mul / lr0, mul / lr1, so, r0, r1, T, np, img_row0, cap_row0, NH, h, tg, out_q, out_s, qs,
                       work.qt * WG_ROWS + wgi * 64, tid & 127, 3 + wgi);
    } else {
        store_o_xrows<HD>((const float(*)[4])o, sv / lr0, sv / lr1, r0, r1, T, np, img_row0, cap_row0, NH, h, tg,
                          out_b);
    }
}

#endif
