// rowops.cu — the per-row operations between the matrix products.
//
// Design. These kernels move O(T·H) bytes against the matrix products' O(H²), so they are
// written for clarity and fusion, not peak bandwidth: one block (or warp) per row, f32
// arithmetic throughout. Fusions that remove a pass or a launch: q/k RMSNorm + RoPE + the KV
// cache write in one kernel (with the Qwen2 biases when the GEMM path did not add them);
// SwiGLU with the bf16 conversion of the next GEMM's input.
// Compile-time: HD (head dim: 16 or a multiple of 32, ≤ 256), KV_F32 (1: f32 KV cache, else f16).
// References: llm/reference.rs (rms_norm, rope, layer), HF modeling_qwen3.py.

#ifndef HD
#define HD 128
#endif

// out[t, :] = row tokens[t] of W (any codec), as f32. tokens are validated by the host (or
// produced by the sampler), so no range check here beyond the clamp that keeps a bad id from
// reading outside the matrix.
extern "C" __global__ void embed_rows(int codec, const u8* w, const u16* rs, const u16* col, int K, int V,
                                      const int* tokens, float* out) {
    pdl_trigger();
    pdl_wait();
    int t = blockIdx.x;
    long long r = min(max(tokens[t], 0), V - 1);
    for (int c = threadIdx.x; c < K; c += blockDim.x) out[(long long)t * K + c] = decode_elem(codec, w, rs, col, r, c, K);
}

// out[t, :] = x[t, :] · rsqrt(mean(x²) + eps) · w   (T blocks)
extern "C" __global__ void rmsnorm_rows(const float* x, const float* w, float eps, int K, float* out) {
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * K;
    float ss = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)K + eps);
    for (int i = threadIdx.x; i < K; i += blockDim.x) out[(long long)blockIdx.x * K + i] = xr[i] * inv * w[i];
}

// out[i] = bf16(x[i])
extern "C" __global__ void to_bf16(const float* x, long long n, u16* out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// gu: [T, 2I] (gate then up); out[t, i] = silu(gate)·up as f32 (out_f) and/or bf16 (out_b).
extern "C" __global__ void swiglu_rows(const float* gu, int I, long long T, float* out_f, u16* out_b) {
    long long n = T * I;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x) {
        long long t = k / I, i = k - t * I;
        float v = silu(gu[t * 2 * I + i]) * gu[t * 2 * I + I + i];
        if (out_f) out_f[k] = v;
        if (out_b) out_b[k] = f32_to_bf16(v);
    }
}

// Dequantises rows [r0, r0+rows) of W [*, K] to bf16 (out_b) or f32 (out_f), row-major, 8
// elements per thread (K is a multiple of 32). Values match decode_elem / the CPU reference.
extern "C" __global__ void dequant_rows(int codec, const u8* w, const u16* rs, const u16* col, long long K,
                                        long long r0, long long rows, u16* out_b, float* out_f) {
    const long long n8 = rows * K / 8;
    for (long long k8 = blockIdx.x * (long long)blockDim.x + threadIdx.x; k8 < n8; k8 += (long long)gridDim.x * blockDim.x) {
        const long long e = k8 * 8, r = e / K, c = e - r * K, R = r0 + r, i = R * K + c;
        float v[8];
        if (codec == CODEC_Q8) {
            uint2 q = *(const uint2*)(w + i);
            float sc = f16_to_f32(rs[R]);
            u32 qw[2] = {q.x, q.y};
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = (float)(i8)((qw[j >> 2] >> (8 * (j & 3))) & 255) * sc;
            if (col) {
                uint4 cv = *(const uint4*)(col + c);
                u32 cw[4] = {cv.x, cv.y, cv.z, cv.w};
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] *= f16_to_f32((u16)((cw[j >> 1] >> (16 * (j & 1))) & 0xffff));
            }
        } else if (codec == CODEC_Q4) {
            u32 nib = *(const u32*)(w + (i >> 1));
            float sc = f16_to_f32(rs[i >> 5]);
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = (float)((int)((nib >> (4 * j)) & 15) - 8) * sc;
        } else if (codec == CODEC_F32) {
            float4 a = *(const float4*)((const float*)w + i), b = *(const float4*)((const float*)w + i + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
            uint4 h = *(const uint4*)((const u16*)w + i);
            u32 hw[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                u16 b = (u16)((hw[j >> 1] >> (16 * (j & 1))) & 0xffff);
                v[j] = codec == CODEC_BF16 ? bf16_to_f32(b) : f16_to_f32(b);
            }
        }
        if (out_b) {
            u32 p[4];
#pragma unroll
            for (int j = 0; j < 4; j++) p[j] = (u32)f32_to_bf16(v[2 * j]) | ((u32)f32_to_bf16(v[2 * j + 1]) << 16);
            *(uint4*)(out_b + k8 * 8) = make_uint4(p[0], p[1], p[2], p[3]);
        } else {
            *(float4*)(out_f + k8 * 8) = make_float4(v[0], v[1], v[2], v[3]);
            *(float4*)(out_f + k8 * 8 + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
}

// q/k/v of T tokens → RMSNorm per head (Qwen3, optional), rotate-half RoPE on q and k, q to
// q_out[T, NH, HD], k and v into the layer's cache [NKV, S_max, HD] at positions pos0 + t.
// Grid (ceil((NH + 2·NKV)/4), T), 128 threads: one warp per head.
extern "C" __global__ void __launch_bounds__(128)
rope_qk_kv(const float* qkv, int ld, const float* q_bias, const float* k_bias, const float* v_bias,
           const float* q_norm, const float* k_norm, float eps, const float* inv_freq, int R, float attn_factor,
           const int* pos_ptr, int NH, int NKV, float* q_out, kv_t* k_cache, kv_t* v_cache, int S_max) {
    pdl_trigger();
    pdl_wait();
    __shared__ float buf[4][HD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hh = blockIdx.x * 4 + warp, t = blockIdx.y;
    if (hh >= NH + 2 * NKV) return;
    rope_row_head(qkv, ld, q_bias, k_bias, v_bias, q_norm, k_norm, eps, inv_freq, R, attn_factor, NH, NKV, hh, t,
                  pos_ptr[0] + t, pos_ptr[0] + t, q_out, k_cache, v_cache, S_max, buf[warp], lane);
}
