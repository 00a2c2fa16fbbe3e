// fp8.cu — e4m3 quantisation for the FP8 GEMM path (sm_89+: cvt ... e4m3x2).
//
// quant_rows_e4m3: one block per row of a bf16 matrix [rows, cols] (row stride ld): the row's
// absolute maximum sets its f32 scale and every value is stored as e4m3 (the encoding of
// e4m3.cuh). Output q [rows, cols] row-major, scale [rows]. cols must be even. The weight planes
// at load and the attention output before the O GEMM go through here; the other GEMM inputs are
// written as e4m3 by their producers (dit.cu).

extern "C" __global__ void __launch_bounds__(256)
quant_rows_e4m3(const u16* x, int cols, long long ld, u8* q, float* scale) {
    __shared__ float red[32];
    const u16* row = x + (size_t)blockIdx.x * ld;
    float amax = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(bf16_to_f32(row[c])));
    amax = block_max(amax, red);
    const float s = e4m3_scale(amax), inv = 1.f / s;
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
    unsigned short* out = (unsigned short*)(q + (size_t)blockIdx.x * cols);
    for (int c = 2 * threadIdx.x; c < cols; c += 2 * blockDim.x)
        out[c >> 1] = pack_e4m3x2(bf16_to_f32(row[c]) * inv, bf16_to_f32(row[c + 1]) * inv);
}
