// attention_frag.cuh — register-fragment helpers shared by attention.cu and attention_wg.cu
// (prepended to both). Layouts are those of mma.sync m16n8k16 per warp, which wgmma's register
// operands and accumulators repeat: a thread (g = lane / 4, tg = lane % 4) holds rows g and g + 8.

// Reductions over the four threads (tg = 0..3) that share a fragment row.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// Q rows r0 and r1 (= r0 + 8) of head h, q [T, NH, D] f32, as f16 A fragments of the D / 16
// k-steps (rows at or past T read as zeros).
template <int D>
__device__ __forceinline__ void load_q_frags(const float* q, int r0, int r1, int T, int NH, int h, int tg,
                                             u32 (*qa)[4]) {
    const float* q0 = q + ((size_t)r0 * NH + h) * D;
    const float* q1 = q + ((size_t)r1 * NH + h) * D;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
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

// The X row of an item's attention row r: r < np → img_row0 + r, else cap_row0 + r − np.
__device__ __forceinline__ int o_xrow(int r, int np, int img_row0, int cap_row0) {
    return r < np ? img_row0 + r : cap_row0 + r - np;
}

// The DiT's output, pair by pair: O rows r0 and r1 (accumulator fragments o[D / 8][4]) times i0,
// i1 handed to put(x, d, a, b) — x the row's X row (o_xrow), d the pair's first dim; rows at or
// past T skipped.
template <int D, typename Put>
__device__ __forceinline__ void for_o_xrows(const float (*o)[4], float i0, float i1, int r0, int r1, int T, int np,
                                            int img_row0, int cap_row0, int tg, Put put) {
    const int x0 = o_xrow(r0, np, img_row0, cap_row0), x1 = o_xrow(r1, np, img_row0, cap_row0);
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) {
        const int d = dn * 8 + tg * 2;
        if (r0 < T) put(x0, d, o[dn][0] * i0, o[dn][1] * i0);
        if (r1 < T) put(x1, d, o[dn][2] * i1, o[dn][3] * i1);
    }
}

// The DiT's output as bf16 into out_b [*, NH · D] (for_o_xrows).
template <int D>
__device__ __forceinline__ void store_o_xrows(const float (*o)[4], float i0, float i1, int r0, int r1, int T,
                                              int np, int img_row0, int cap_row0, int NH, int h, int tg,
                                              u16* out_b) {
    for_o_xrows<D>(o, i0, i1, r0, r1, T, np, img_row0, cap_row0, tg, [&](int x, int d, float a, float b) {
        *(u32*)(out_b + ((size_t)x * NH + h) * D + d) = (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
    });
}
