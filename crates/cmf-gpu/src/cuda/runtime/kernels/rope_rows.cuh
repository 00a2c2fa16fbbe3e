// rope_rows.cuh — one (row, head) of q|k|v rows, in one warp: bias, the head's RMSNorm (q and k),
// RoPE at `pos` (q and k), then q into q_out [T, NH, HD] and k or v into row `slot` of its cache
// [NKV, S, HD]. The body of rope_qk_kv (rowops.cu: slot = position) and rope_rows_paged
// (attention_paged.cu: slot = the row's pool slot). Needs kv.cuh and rope.cuh before it.
__device__ __forceinline__ void rope_row_head(const float* qkv, int ld, const float* q_bias, const float* k_bias,
                                              const float* v_bias, const float* q_norm, const float* k_norm,
                                              float eps, const float* inv_freq, int R, float attn_factor, int NH,
                                              int NKV, int hh, int t, int pos, long long slot, float* q_out,
                                              kv_t* k_cache, kv_t* v_cache, int S, float* buf, int lane) {
    int kind, h, off;
    const float *bias, *norm;
    if (hh < NH) { kind = 0; h = hh; off = h * HD; bias = q_bias; norm = q_norm; }
    else if (hh < NH + NKV) { kind = 1; h = hh - NH; off = NH * HD + h * HD; bias = k_bias; norm = k_norm; }
    else { kind = 2; h = hh - NH - NKV; off = (NH + NKV) * HD + h * HD; bias = v_bias; norm = 0; }
    const float* src = qkv + (long long)t * ld + off;
    float v[RJ];
#pragma unroll
    for (int j = 0; j < RJ; j++) {
        int e = lane + 32 * j;
        v[j] = e < HD ? src[e] + (bias ? bias[h * HD + e] : 0.f) : 0.f;
    }
    head_rmsnorm(v, norm, eps, lane);
    if (kind < 2) head_rope(v, buf, pos, inv_freq, R, attn_factor, lane);
    if (kind == 0) {
        float* dst = q_out + ((long long)t * NH + h) * HD;
#pragma unroll
        for (int j = 0; j < RJ; j++)
            if (lane + 32 * j < HD) dst[lane + 32 * j] = v[j];
    } else {
        kv_t* dst = (kind == 1 ? k_cache : v_cache) + ((long long)h * S + slot) * HD;
#pragma unroll
        for (int j = 0; j < RJ; j++)
            if (lane + 32 * j < HD) dst[lane + 32 * j] = to_kv(v[j]);
    }
}
