// e4m3.cuh — the 8-bit row encodings of the FP8 and int8 GEMM paths: one source for every kernel
// that writes such GEMM operands (fp8.cu's quant_rows_e4m3, int8.cu's quant_rows_s8, dit.cu's
// fused row producers).
//
// A row of values v gets one f32 scale s = amax / 448 (448: the largest finite e4m3; an all-zero
// row gets s = 1) and bytes q = e4m3(v · (1 / s)), rounded to nearest even and saturating. The
// reciprocal is taken once per row and multiplied in, not divided per value: every producer
// rounds exactly this way, so a fused producer's rows equal quant_rows_e4m3's of the same values.
// The conversion (cvt ... e4m3x2) needs sm_89; the FP8 path never runs below it (Fp8Gemm::new
// refuses such devices), but these sources are compiled for older targets too: there it traps.

#define E4M3_MAX 448.f

// Block-wide max for blockDim.x <= 1024; `red` is 32 floats of shared memory. All threads get it.
// For a kernel that takes it once: `red` is written once, so one barrier does.
__device__ __forceinline__ float block_max_once(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    return warp_max(v);
}
// The same where `red` may have been read before (the barrier lets those reads finish first).
__device__ __forceinline__ float block_max(float v, float* red) {
    __syncthreads();
    return block_max_once(v, red);
}

// The scale of a row whose absolute maximum is `amax`.
__device__ __forceinline__ float e4m3_scale(float amax) { return amax > 0.f ? amax / E4M3_MAX : 1.f; }

// Two floats -> two e4m3 bytes (lo in the low byte), round to nearest, saturating.
__device__ __forceinline__ unsigned short pack_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Four floats → four e4m3 bytes (a in the low byte).
__device__ __forceinline__ u32 pack_e4m3x4(float a, float b, float c, float d) {
    return (u32)pack_e4m3x2(a, b) | ((u32)pack_e4m3x2(c, d) << 16);
}
// Four floats v[0..3] · inv → four e4m3 bytes (v[0] in the low byte).
__device__ __forceinline__ u32 pack_e4m3x4(const float* v, float inv) {
    return pack_e4m3x4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv);
}

// s8 rows, the int8 path's encoding (int8.cu's quant_rows_s8, and the fused producers of a dit
// module compiled with ROW8_S8=1): scale s = amax / 127 (1 for a row of zeros) and bytes
// q = round-to-nearest-even(v · (1 / s)), which |v| ≤ amax keeps within ±127 (the clamp only
// absorbs the reciprocal's rounding). Taken the same way everywhere, as e4m3's above.
__device__ __forceinline__ float s8_scale(float amax) { return amax > 0.f ? amax / 127.f : 1.f; }
__device__ __forceinline__ u32 s8_byte(float v) { return (u32)max(-127, min(127, __float2int_rn(v))) & 0xffu; }
__device__ __forceinline__ u32 pack_s8x4(float a, float b, float c, float d) {
    return s8_byte(a) | (s8_byte(b) << 8) | (s8_byte(c) << 16) | (s8_byte(d) << 24);
}

// The 8-bit GEMM operand rows the fused row producers write (dit.cu's rms_mod, residual_norm,
// swiglu): e4m3, or s8 where the module is compiled with ROW8_S8=1 (the int8 path's dit module).
// The FP8 attention's Q and K rows are e4m3 either way.
#ifndef ROW8_S8
#define ROW8_S8 0
#endif
__device__ __forceinline__ float row8_scale(float amax) { return ROW8_S8 ? s8_scale(amax) : e4m3_scale(amax); }
// Four floats v[0..3] · inv → four bytes of the row encoding (v[0] in the low byte).
__device__ __forceinline__ u32 pack_row8x4(const float* v, float inv) {
    return ROW8_S8 ? pack_s8x4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv) : pack_e4m3x4(v, inv);
}
__device__ __forceinline__ u8 pack_row8x1(float v) { return (u8)(ROW8_S8 ? s8_byte(v) : pack_e4m3x2(v, 0.f)); }

// A group of V values (common.cuh) as row-encoded bytes of v · inv at p.
template <int V>
__device__ __forceinline__ void st_row8(u8* p, const Vf<V>& a, float inv) {
    if constexpr (V == 4)
        *(u32*)p = pack_row8x4(a.v, inv);
    else
        *p = pack_row8x1(a.v[0] * inv);
}

// The second half of a fused row producer, whose row of n values is in shared memory: each
// thread stored groups g = threadIdx.x + k·blockDim.x of V values at stash[V·g] (the same threads
// read them back here, so no barrier is needed beyond block_max's) and folded their |v| into
// `amax`. Writes the row's scale to *scale and its bytes (the row encoding) to q[0, n).
template <int V>
__device__ __forceinline__ void emit_row8(const float* stash, int n, float amax, float* red, u8* q, float* scale) {
    const float s = row8_scale(block_max(amax, red)), inv = 1.f / s;
    if (threadIdx.x == 0) *scale = s;
    for (int g = threadIdx.x; g < n / V; g += blockDim.x) st_row8<V>(q + V * g, ld_f32<V>(stash + V * g), inv);
}

// A row of 64·NP values held by one warp as pairs v[k] = values 2(lane + 32k), +1: its e4m3
// bytes at q and its scale at *scale (the row encoding above). The FP8 attention's Q rows as the
// test hook makes them (attention_ws8.cu); qk_norm_rope (dit.cu) writes the same encoding with
// 16 lanes a head.
template <int NP>
__device__ __forceinline__ void warp_e4m3_row(const float2* v, int lane, u8* q, float* scale) {
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < NP; k++) amax = fmaxf(amax, fmaxf(fabsf(v[k].x), fabsf(v[k].y)));
    amax = warp_max(amax);
    const float s = e4m3_scale(amax), inv = 1.f / s;
    if (lane == 0) *scale = s;
#pragma unroll
    for (int k = 0; k < NP; k++) *(unsigned short*)(q + 2 * (lane + 32 * k)) = pack_e4m3x2(v[k].x * inv, v[k].y * inv);
}
