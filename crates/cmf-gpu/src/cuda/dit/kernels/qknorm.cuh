// qknorm.cuh — the per-head RMSNorm + interleaved RoPE of Q and K, for one lane's 8 consecutive
// values of a head (HD / 8 lanes a head, aligned groups of the warp). One body for the two
// kernels that apply it: qk_norm_rope (dit.cu: K, and Q where the attention does not) and
// attn_full_ws's Q load (attention_wg.cu: Q straight from the q|k|v GEMM's rows), so both make
// the same bits. Reference: cmf-zimage transformer.rs (norm_q / norm_k, then RoPE).

#define QKN_LPH (HD / 8)
#define QKN_F16_MAX 65504.f

// Sum over a head's QKN_LPH lanes (every lane of the warp calls it).
__device__ __forceinline__ float qkn_head_sum(float v) {
#pragma unroll
    for (int o = QKN_LPH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The 8 bf16 values of w as f32.
__device__ __forceinline__ void qkn_unpack_bf16x8(uint4 w, float* v) {
    const u32 u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = bf16_to_f32((u16)(u[k] & 0xffff));
        v[2 * k + 1] = bf16_to_f32((u16)(u[k] >> 16));
    }
}

// Σ v² of a lane's 8 values, in the order every caller sums them.
__device__ __forceinline__ float qkn_sumsq8(const float* v) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) ss += v[2 * k] * v[2 * k] + v[2 * k + 1] * v[2 * k + 1];
    return ss;
}

// v ← RoPE(v · inv · nw) for a lane's 8 values (4 pairs: cos cs, sin sn).
__device__ __forceinline__ void qkn_apply8(float* v, float inv, const float* nw, const float* cs, const float* sn) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float a = v[2 * k] * inv * nw[2 * k], b = v[2 * k + 1] * inv * nw[2 * k + 1];
        v[2 * k] = a * cs[k] - b * sn[k];
        v[2 * k + 1] = a * sn[k] + b * cs[k];
    }
}

// v (this lane's 8 values of a head) ← RoPE(rmsnorm(v) · nw) with the cos cs and sin sn of its 4
// pairs, where apply; every lane takes part in the head's sum either way (warps may mix heads
// that are normed and heads that are not).
__device__ __forceinline__ void qkn_norm_rope8(float* v, const float* nw, float eps, const float* cs, const float* sn,
                                               bool apply) {
    const float inv = rsqrtf(qkn_head_sum(qkn_sumsq8(v)) / (float)HD + eps);
    if (apply) qkn_apply8(v, inv, nw, cs, sn);
}

// f16, saturating at ±65504 (an outlier saturates instead of becoming inf).
__device__ __forceinline__ u16 qkn_f16_sat(float v) { return f32_to_f16(fminf(fmaxf(v, -QKN_F16_MAX), QKN_F16_MAX)); }
__device__ __forceinline__ uint4 qkn_pack_f16x8(const float* v) {
    return make_uint4((u32)qkn_f16_sat(v[0]) | ((u32)qkn_f16_sat(v[1]) << 16),
                      (u32)qkn_f16_sat(v[2]) | ((u32)qkn_f16_sat(v[3]) << 16),
                      (u32)qkn_f16_sat(v[4]) | ((u32)qkn_f16_sat(v[5]) << 16),
                      (u32)qkn_f16_sat(v[6]) | ((u32)qkn_f16_sat(v[7]) << 16));
}
