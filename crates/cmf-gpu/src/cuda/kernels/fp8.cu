// fp8.cu — e4m3 quantisation for the FP8 GEMM path (sm_89+: cvt ... e4m3x2).
//
// quant_rows_e4m3: one block per row of a bf16 matrix [rows, cols] (row stride ld): the row's
// absolute maximum sets its f32 scale (amax / 448, the largest finite e4m3), and every value is
// stored as round-to-nearest, saturating e4m3 of x / scale. A zero row gets scale 1 (all zeros).
// Output q [rows, cols] row-major, scale [rows]. cols must be even.

__device__ __forceinline__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    return warp_max(v);
}

// Two floats -> two e4m3 bytes (lo in the low byte), round to nearest, saturating.
__device__ __forceinline__ unsigned short pack_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

extern "C" __global__ void __launch_bounds__(256)
quant_rows_e4m3(const u16* x, int cols, long long ld, u8* q, float* scale) {
    __shared__ float red[32];
    const u16* row = x + (size_t)blockIdx.x * ld;
    float amax = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(bf16_to_f32(row[c])));
    amax = block_max(amax, red);
    const float s = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / s;
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
    unsigned short* out = (unsigned short*)(q + (size_t)blockIdx.x * cols);
    for (int c = 2 * threadIdx.x; c < cols; c += 2 * blockDim.x)
        out[c >> 1] = pack_e4m3x2(bf16_to_f32(row[c]) * inv, bf16_to_f32(row[c + 1]) * inv);
}
