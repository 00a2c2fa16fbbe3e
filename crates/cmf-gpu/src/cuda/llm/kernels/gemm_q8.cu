// gemm_q8.cu — the batched step's linear layers over q8_row weights on tensor cores: int8 (s8
// inputs, below) or bf16 (W8A16, further down).
//
// A q8_row matrix w [N, K] is s8 with one f16 scale per row (ws). The step's input rows are
// quantised as llama.cpp does for its q8 GEMMs: blocks of 32 consecutive values, s8 with one f32
// scale each (amax / 127). Then
//   out[t, n] (+)= ws[n] · Σ_b xd[t, b] · Σ_{k ∈ block b} xq[t, k] · w[n, k]
// with exact s32 sums per block (mma.sync m16n8k32) and f32 sums over blocks. Block-wise input
// scales keep an outlier channel from flattening the rest of its row (a per-row scale would).
// Reference: llm/batch.rs `q8_gemm_reference` (the same arithmetic, summed in the same order).

// quant_blocks_s8: bf16 rows x [T, K] (row stride ldx values) to s8 xq [T, K] and f32 scales
// xd [T, K / 32]. A warp per block of 32: grid ceil(T · K / 32 / 8), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
quant_blocks_s8(const u16* x, int K, long long ldx, int T, signed char* xq, float* xd) {
    const int nb = K >> 5;
    const long long blk = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (blk >= (long long)T * nb) return;
    const long long r = blk / nb, b = blk - r * nb;
    const float v = bf16_to_f32(x[r * ldx + b * 32 + lane]);
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    xq[r * K + b * 32 + lane] = (signed char)__float2int_rn(v * inv);
    if (lane == 0) xd[r * nb + b] = d;
}

// D (16 × 8, s32) += A (16 × 32, s8, rows) · B (32 × 8, s8, columns).
__device__ __forceinline__ void mma_s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Input rows a block takes (8 mma column tiles of 8).
#define MQ_T 64

// gemm_q8: out[t, col0 + n] (row stride ldc; accumulate: +=) for the q8_row matrix (w, ws) and
// the quantised rows (xq, xd) of T rows. Block: WR × WK warps; WR row groups of 16 weight rows,
// WK warps splitting each chunk's 32-blocks (then summed in warp order: deterministic). Grid
// (ceil(N / (16 · WR)), ceil(T / 64)). K is a multiple of 32 (checked on the host).
//
// Fragments: thread (g = lane / 4, q = lane % 4) loads 8 bytes of each of its two weight rows
// (g, g + 8) at byte 8q of a block, and 8 bytes of input row g at the same byte. The first four
// bytes go where m16n8k32 expects k = 4q .. 4q + 3, the next four where it expects 16 + 4q ..:
// a permutation of k inside the block, the same for both operands, so every block's sum is exact.
template <int WR, int WK, int KC>
__device__ __forceinline__ void gemm_q8_body(const signed char* __restrict__ w, const u16* __restrict__ ws, int N,
                                             int K, const signed char* __restrict__ xq,
                                             const float* __restrict__ xd, int T, float* out, long long ldc,
                                             int col0, int accumulate) {
    constexpr int LD = KC + 32;          // smem row stride: conflict-free 8-byte fragment loads
    constexpr int NB = KC / 32;          // blocks per chunk
    constexpr int BPW = NB / WK;         // blocks per warp per chunk
    __shared__ __align__(16) signed char xs[MQ_T * LD];
    __shared__ float ds[MQ_T * NB];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int wr = warp % WR, wk = warp / WR;
    const int n0 = (blockIdx.x * WR + wr) * 16;
    const int t0 = blockIdx.y * MQ_T;
    const int nt = min(MQ_T, T - t0);
    const int tiles = (nt + 7) >> 3;
    const int nb = K >> 5;
    // Rows past N read row N - 1 and are never stored.
    const signed char* wa = w + (size_t)min(n0 + g, N - 1) * K + 8 * q;
    const signed char* wb = w + (size_t)min(n0 + g + 8, N - 1) * K + 8 * q;
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;

    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kb = min(NB, (K - k0) >> 5);  // blocks in this chunk
        // This warp's weight fragments, loaded before the barrier so they fly while the
        // inputs are staged.
        uint2 fa[BPW], fb[BPW];
#pragma unroll
        for (int i = 0; i < BPW; i++) {
            const int b = wk + i * WK;
            if (b < kb) {
                fa[i] = __ldg((const uint2*)(wa + k0 + b * 32));
                fb[i] = __ldg((const uint2*)(wb + k0 + b * 32));
            }
        }
        __syncthreads();  // the previous chunk is consumed
        const int per_row = kb * 2;  // 16-byte pieces
        for (int i = threadIdx.x; i < nt * per_row; i += blockDim.x) {
            const int r = i / per_row, c = (i - r * per_row) * 16;
            *(uint4*)(xs + r * LD + c) = *(const uint4*)(xq + (size_t)(t0 + r) * K + k0 + c);
        }
        for (int i = threadIdx.x; i < nt * kb; i += blockDim.x) {
            const int r = i / kb, b = i - r * kb;
            ds[r * NB + b] = xd[(size_t)(t0 + r) * nb + (k0 >> 5) + b];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < BPW; i++) {
            const int b = wk + i * WK;
            if (b >= kb) break;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (j >= tiles) break;
                const uint2 bv = *(const uint2*)(xs + (j * 8 + g) * LD + b * 32 + 8 * q);
                int c[4] = {0, 0, 0, 0};
                mma_s8(c, fa[i].x, fb[i].x, fa[i].y, fb[i].y, bv.x, bv.y);
                // c: (weight row g, input 2q), (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1).
                const float d0 = ds[(j * 8 + 2 * q) * NB + b], d1 = ds[(j * 8 + 2 * q + 1) * NB + b];
                acc[j][0] += (float)c[0] * d0;
                acc[j][1] += (float)c[1] * d1;
                acc[j][2] += (float)c[2] * d0;
                acc[j][3] += (float)c[3] * d1;
            }
        }
    }
    if (WK > 1) {
        // The k-slices of each row group summed in warp order, through the staging buffer.
        __syncthreads();
        float* red = (float*)xs;  // [WK - 1][WR][32 lanes][32]
        static_assert((WK - 1) * WR * 32 * 32 * 4 <= MQ_T * LD, "reduction fits the staging buffer");
        if (wk > 0) {
            float* mine = red + (((wk - 1) * WR + wr) * 32 + lane) * 32;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) mine[j * 4 + i] = acc[j][i];
        }
        __syncthreads();
        if (wk > 0) return;
#pragma unroll
        for (int s = 0; s < WK - 1; s++) {
            const float* other = red + ((s * WR + wr) * 32 + lane) * 32;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[j][i] += other[j * 4 + i];
        }
    }
    const int na = n0 + g, nb8 = n0 + g + 8;
    const float sa = na < N ? f16_to_f32(ws[na]) : 0.f, sb = nb8 < N ? f16_to_f32(ws[nb8]) : 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (j >= tiles) break;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = t0 + j * 8 + 2 * q + (i & 1);
            const int n = i < 2 ? na : nb8;
            if (t >= T || n >= N) continue;
            float* o = out + (size_t)t * ldc + col0 + n;
            const float v = acc[j][i] * (i < 2 ? sa : sb);
            *o = accumulate ? *o + v : v;
        }
    }
}

// 16 weight rows a block, the chunk's blocks split over 4 warps, so that a layer's matrices spread
// over many blocks (the batched step takes it up to 16 input rows; see batched/q8.rs).
extern "C" __global__ void __launch_bounds__(128)
gemm_q8_narrow(const signed char* w, const u16* ws, int N, int K, const signed char* xq, const float* xd, int T,
               float* out, long long ldc, int col0, int accumulate) {
    gemm_q8_body<1, 4, 512>(w, ws, N, K, xq, xd, T, out, ldc, col0, accumulate);
}

// ---- bf16 inputs times s8 weights (W8A16) ----------------------------------------------------
// out[t, col0 + n] (+)= ws[n] · Σ_k bf16(x[t, k]) · w[n, k]: the weights widen to bf16 in
// registers (exact: |w| ≤ 128 needs 8 significant bits) and the products run on bf16 tensor cores
// (mma.sync m16n8k16, f32 sums), so the inputs keep the precision of the bf16 GEMM and no
// per-block scale has to be applied after each mma.

// D (16 × 8, f32) += A (16 × 16, bf16, rows) · B (16 × 8, bf16, columns).
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Bytes i and i + 1 of a word of s8 values whose sign bits were flipped (v + 128 as u8), as a
// bf16 pair (byte i in the low half): 0x4B0000uu is 2^23 + u as an f32, exact.
__device__ __forceinline__ u32 s8x2_bf16(u32 flipped, int i) {
    const float lo = __int_as_float(__byte_perm(flipped, 0x4B000000u, 0x7540 + i)) - 8388736.f;
    const float hi = __int_as_float(__byte_perm(flipped, 0x4B000000u, 0x7541 + i)) - 8388736.f;
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#define W8_MT 64               // input rows a block takes (8 mma column tiles)
#define W8_KC 256              // values of K a chunk stages
#define W8_LD (2 * W8_KC + 64) // bytes per staged input row: +64 keeps the 16-byte fragment loads conflict-free

// gemm_w8_bf16: grid (ceil(T / 64), ceil(N / 64), splits), 128 threads. Each warp owns 16 weight
// rows of the block's 64 and all of its input rows; block (·, ·, z) sums K values
// [z · kpb, (z + 1) · kpb) with kpb = chunks_per_split · 256. One split: it writes out (scaled
// by ws, stored or added); several: its raw sums go to part [splits, T, N] and gemm_w8_reduce
// adds them in split order (deterministic). The input's row stride ldx and K are multiples of
// 32 (checked on the host).
//
// Fragments: thread (g = lane / 4, q = lane % 4) holds bytes 8q .. 8q + 7 of a 32-block of weight
// rows g and g + 8, and the same 8 values of input row g: the first four feed one m16n8k16 where
// it expects k = 2q, 2q + 1, 2q + 8, 2q + 9, the next four a second one. A permutation of k inside
// the block, the same for both operands.
extern "C" __global__ void __launch_bounds__(128)
gemm_w8_bf16(const signed char* __restrict__ w, const u16* __restrict__ ws, int N, int K,
             const u16* __restrict__ x, long long ldx, int T, float* out, long long ldc, int col0,
             int accumulate, float* part, int chunks_per_split) {
    __shared__ __align__(16) unsigned char xs[W8_MT * W8_LD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * W8_MT, n0 = blockIdx.y * 64 + warp * 16;
    const int split = blockIdx.z, splits = gridDim.z;
    const int nt = min(W8_MT, T - t0), tiles = (nt + 7) >> 3;
    const int kbeg = split * chunks_per_split * W8_KC, kend = min(K, kbeg + chunks_per_split * W8_KC);
    // Rows past N read row N - 1 and are never stored.
    const signed char* wa = w + (size_t)min(n0 + g, N - 1) * K + 8 * q;
    const signed char* wb = w + (size_t)min(n0 + g + 8, N - 1) * K + 8 * q;
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;

    for (int k0 = kbeg; k0 < kend; k0 += W8_KC) {
        const int kb = min(W8_KC, kend - k0) >> 5;  // 32-blocks in this chunk
        // The chunk's weight fragments, loaded before the barrier so they fly while the inputs
        // are staged.
        uint2 fa[W8_KC / 32], fb[W8_KC / 32];
#pragma unroll
        for (int b = 0; b < W8_KC / 32; b++) {
            if (b < kb) {
                fa[b] = __ldg((const uint2*)(wa + k0 + b * 32));
                fb[b] = __ldg((const uint2*)(wb + k0 + b * 32));
            }
        }
        __syncthreads();  // the previous chunk is consumed
        const int per_row = kb * 4;  // 16-byte pieces
        for (int i = threadIdx.x; i < nt * per_row; i += blockDim.x) {
            const int r = i / per_row, c = i - r * per_row;
            *(uint4*)(xs + r * W8_LD + 16 * c) = *(const uint4*)(x + (size_t)(t0 + r) * ldx + k0 + 8 * c);
        }
        __syncthreads();
#pragma unroll
        for (int b = 0; b < W8_KC / 32; b++) {
            if (b >= kb) break;
            const u32 ax = fa[b].x ^ 0x80808080u, ay = fa[b].y ^ 0x80808080u;
            const u32 bx = fb[b].x ^ 0x80808080u, by = fb[b].y ^ 0x80808080u;
            const u32 a0 = s8x2_bf16(ax, 0), a2 = s8x2_bf16(ax, 2), a1 = s8x2_bf16(bx, 0), a3 = s8x2_bf16(bx, 2);
            const u32 c0 = s8x2_bf16(ay, 0), c2 = s8x2_bf16(ay, 2), c1 = s8x2_bf16(by, 0), c3 = s8x2_bf16(by, 2);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (j >= tiles) break;
                const uint4 xv = *(const uint4*)(xs + (j * 8 + g) * W8_LD + 64 * b + 16 * q);
                mma_bf16(acc[j], a0, a1, a2, a3, xv.x, xv.y);
                mma_bf16(acc[j], c0, c1, c2, c3, xv.z, xv.w);
            }
        }
    }
    const int na = n0 + g, nb8 = n0 + g + 8;
    const float sa = na < N ? f16_to_f32(ws[na]) : 0.f, sb = nb8 < N ? f16_to_f32(ws[nb8]) : 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (j >= tiles) break;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // c: (weight row g, input 2q), (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1).
            const int t = t0 + j * 8 + 2 * q + (i & 1);
            const int n = i < 2 ? na : nb8;
            if (t >= T || n >= N) continue;
            if (splits > 1) {
                part[((size_t)split * T + t) * N + n] = acc[j][i];
            } else {
                float* o = out + (size_t)t * ldc + col0 + n;
                const float v = acc[j][i] * (i < 2 ? sa : sb);
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

// out[t, col0 + n] (+)= ws[n] · Σ_z part[z, t, n], the splits summed in order. Grid
// ceil(T · N / 256), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
gemm_w8_reduce(const float* part, int splits, const u16* ws, int N, int T, float* out, long long ldc, int col0,
               int accumulate) {
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i >= (long long)T * N) return;
    const int t = (int)(i / N), n = (int)(i - (long long)t * N);
    float s = 0.f;
    for (int z = 0; z < splits; z++) s += part[(size_t)z * T * N + i];
    const float v = s * f16_to_f32(ws[n]);
    float* o = out + (size_t)t * ldc + col0 + n;
    *o = accumulate ? *o + v : v;
}
