// rope.cuh — one attention head in one warp's registers: the per-head RMSNorm (Qwen3's q/k
// norm) and rotate-half RoPE. Shared by rope_qk_kv (rowops.cu: prefill and tests) and the fused
// decode attention (attention_decode.cu), so both apply exactly the same arithmetic.
// Layout: v[j] holds element lane + 32·j of the head (HD = 16 leaves half the lanes idle).
// Reference: llm/reference.rs (rms_norm, rope).

#ifndef HD
#define HD 128
#endif
// Elements of a head per lane.
#define RJ ((HD + 31) / 32)

// v ← v / rms(v) · norm (eps inside the root); norm = null leaves v as it is.
__device__ __forceinline__ void head_rmsnorm(float (&v)[RJ], const float* norm, float eps, int lane) {
    if (!norm) return;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RJ; j++) ss += v[j] * v[j];
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)HD + eps);
#pragma unroll
    for (int j = 0; j < RJ; j++)
        if (lane + 32 * j < HD) v[j] = v[j] * inv * norm[lane + 32 * j];
}

// The RoPE factors of this lane's elements at position `pos`: angles pos · inv_freq[i], both
// scaled by attn_factor (YaRN). They depend on the position only, so the fused decode attention
// computes them before it waits for the q|k|v matvec.
__device__ __forceinline__ void head_rope_factors(float (&cs)[RJ], float (&sn)[RJ], int pos, const float* inv_freq,
                                                  int R, float attn_factor, int lane) {
#pragma unroll
    for (int j = 0; j < RJ; j++) {
        const int e = lane + 32 * j;
        cs[j] = sn[j] = 0.f;
        if (e < 2 * R && e < HD) {
            const int i = e < R ? e : e - R;
            sincosf((float)pos * inv_freq[i], &sn[j], &cs[j]);
            sn[j] *= attn_factor;
            cs[j] *= attn_factor;
        }
    }
}

// Rotate-half RoPE over the first 2R dims (partial rotary leaves the rest) with the factors of
// head_rope_factors. `buf`: this warp's HD floats of shared scratch (a lane needs its partner
// element, 32·j lanes away or more).
__device__ __forceinline__ void head_rope_with(float (&v)[RJ], float* buf, const float (&cs)[RJ], const float (&sn)[RJ],
                                               int R, int lane) {
#pragma unroll
    for (int j = 0; j < RJ; j++)
        if (lane + 32 * j < HD) buf[lane + 32 * j] = v[j];
    __syncwarp();
#pragma unroll
    for (int j = 0; j < RJ; j++) {
        const int e = lane + 32 * j;
        if (e < 2 * R && e < HD) v[j] = e < R ? v[j] * cs[j] - buf[e + R] * sn[j] : v[j] * cs[j] + buf[e - R] * sn[j];
    }
    __syncwarp();
}

// Rotate-half RoPE at position `pos` (head_rope_factors, then head_rope_with).
__device__ __forceinline__ void head_rope(float (&v)[RJ], float* buf, int pos, const float* inv_freq, int R,
                                          float attn_factor, int lane) {
    float cs[RJ], sn[RJ];
    head_rope_factors(cs, sn, pos, inv_freq, R, attn_factor, lane);
    head_rope_with(v, buf, cs, sn, R, lane);
}
