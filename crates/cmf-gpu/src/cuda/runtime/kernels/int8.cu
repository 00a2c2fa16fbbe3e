// int8.cu — the DiT's int8 GEMM path (`--dit-precision int8`, cuda/int8.rs): rows to s8 with
// one f32 scale per row, and cuBLASLt's exact s32 sums of two such operands scaled to bf16.
// (The s8 encoding and block_max_once come from e4m3.cuh, prepended.)

// quant_rows_s8: one block per row of a bf16 matrix [rows, cols] (row stride ld values; cols
// and ld multiples of 4: 8-byte loads) to s8 rows q [rows, cols] and scales [rows] (e4m3.cuh's
// s8 encoding). The second pass reads the row again from L1/L2.
extern "C" __global__ void __launch_bounds__(256)
quant_rows_s8(const u16* x, int cols, long long ld, i8* q, float* scale) {
    __shared__ float red[32];
    const u16* row = x + (size_t)blockIdx.x * ld;
    const int n4 = cols >> 2;
    float amax = 0.f;
    for (int c = threadIdx.x; c < n4; c += blockDim.x) {
        const Vf<4> v = ld_bf16<4>(row + 4 * c);
#pragma unroll
        for (int i = 0; i < 4; i++) amax = fmaxf(amax, fabsf(v.v[i]));
    }
    const float s = s8_scale(block_max_once(amax, red)), inv = 1.f / s;
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
    u32* out = (u32*)(q + (size_t)blockIdx.x * cols);
    for (int c = threadIdx.x; c < n4; c += blockDim.x) {
        const Vf<4> v = ld_bf16<4>(row + 4 * c);
        out[c] = pack_s8x4(v.v[0] * inv, v.v[1] * inv, v.v[2] * inv, v.v[3] * inv);
    }
}

// dequant_s32_bf16: out[r, c] = bf16(acc[r, c] · xs[r] · ws[c]) for the s32 sums acc [rows, n]
// (row stride n) of s8 rows scaled by xs (activations) and s8 weight rows scaled by ws; out has
// row stride ldc. Grid (ceil(n / 1024), rows), 256 threads of 4 columns; n and ldc multiples of 4.
extern "C" __global__ void __launch_bounds__(256)
dequant_s32_bf16(const int* acc, int n, const float* xs, const float* ws, u16* out, long long ldc) {
    const int c = (blockIdx.x * 256 + threadIdx.x) * 4;
    if (c >= n) return;
    const size_t r = blockIdx.y;
    const int4 a = *(const int4*)(acc + r * n + c);
    const float4 w = *(const float4*)(ws + c);
    const float sx = xs[r];
    const u32 lo = (u32)f32_to_bf16((float)a.x * sx * w.x) | ((u32)f32_to_bf16((float)a.y * sx * w.y) << 16);
    const u32 hi = (u32)f32_to_bf16((float)a.z * sx * w.z) | ((u32)f32_to_bf16((float)a.w * sx * w.w) << 16);
    *(uint2*)(out + r * ldc + c) = make_uint2(lo, hi);
}
