// vae.cu — the FLUX VAE decoder's kernels between the cuBLAS GEMMs.
//
// Design. Activations are NHWC ([pixels, C], row-major) so a conv's output is simply the GEMM's
// [pixels, C_out] and every per-channel op reads whole pixel rows. f32 activations, bf16 GEMM
// operands, f32 accumulation (cuBLAS), as the issue sets for the device chain.
// - 3×3 conv = vae_im2col3 (bf16 [pixels, 9·C], columns tap-major: (ky, kx, c); the weights are
//   permuted to that order once at load by vae_permute_taps) + one GEMM per tile of pixels.
//   Tap-major columns let each thread move 8 channels (16 bytes) per tap, loads and stores
//   coalesced; the nearest ×2 upsample is folded into the im2col (it reads source pixel
//   (y >> 1, x >> 1)), so the upsampled map never exists.
// - GroupNorm: two passes of per-block partial sums (mean, then Σ(x − mean)², as the CPU kernel
//   group_stats in cmf-kernels/src/ops/norm.rs) finished in f64, then one apply pass fused with
//   SiLU and the bf16 conversion for the next conv. The preceding conv's bias is folded in
//   (x + b), which saves a pass over conv1's output.
// - conv_out (3 output channels) is a direct conv, one warp per pixel, writing NCHW for the
//   readback: a GEMM with N = 3 would only stream its im2col.
// - Mid attention: softmax over rows of a score tile, f32 in, bf16 out (the P·V GEMM operand).
// Row kernels (vae_gn_*, vae_bias_*) run blocks of C·kpp threads: thread t owns channel t % C
// and pixel lane t / C, so per-channel constants sit in registers and a block reads contiguous
// memory. Host side: cuda/vae/mod.rs (launches), cuda/vae/plan.rs (shapes and tilings).
// CPU reference: cmf-zimage/src/vae.rs.

// out[p, c] = bf16(x[c, p]): the latent, NCHW f32 → NHWC bf16.
extern "C" __global__ void vae_nchw_to_nhwc_bf16(const float* x, int C, long long P, u16* out) {
    const long long n = P * C;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / C;
        const int c = (int)(i - p * C);
        out[i] = f32_to_bf16(x[(long long)c * P + p]);
    }
}

// out[r, t·C + c] = w[r, c·9 + t]: a 3×3 kernel [rows, C·9] from PyTorch's (c, ky, kx) column
// order to the im2col's (ky, kx, c).
extern "C" __global__ void vae_permute_taps(const u16* w, long long rows, int C, u16* out) {
    const long long K = 9LL * C, n = rows * K;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / K;
        const int j = (int)(i - r * K), t = j / C, c = j - t * C;
        out[i] = w[r * K + c * 9 + t];
    }
}

// GroupNorm partial sums over x[P, C] (+ bias[c] when given): block b sums pixels
// [b·ppb, (b+1)·ppb) per group into partial[b, g]: Σ v without `mean`, Σ (v − mean[g])² with it.
// Block: C·kpp threads (≤ 1024).
extern "C" __global__ void __launch_bounds__(1024)
vae_gn_partial(const float* x, const float* bias, int C, int G, long long P, int ppb, const float* mean, float* partial) {
    __shared__ float part[1024];
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C, cpg = C / G;
    const float b = bias ? bias[c] : 0.f;
    const float m = mean ? mean[c / cpg] : 0.f;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    float acc = 0.f;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        float v = x[p * C + c] + b;
        if (mean) {
            v -= m;
            acc += v * v;
        } else {
            acc += v;
        }
    }
    part[t] = acc;
    __syncthreads();
    for (int g = t; g < G; g += blockDim.x) {
        float s = 0.f;
        for (int jj = 0; jj < kpp; jj++)
            for (int cc = g * cpg; cc < (g + 1) * cpg; cc++) s += part[jj * C + cc];
        partial[(long long)blockIdx.x * G + g] = s;
    }
}

// Sums the partials of group blockIdx.x over `chunks` blocks in f64; mode 0 writes
// mean[g] = Σ / count, mode 1 inv[g] = 1 / sqrt(Σ / count + eps). 256 threads.
extern "C" __global__ void __launch_bounds__(256)
vae_gn_finalize(const float* partial, int chunks, int G, long long count, float eps, int mode, float* mean, float* inv) {
    __shared__ double red[256];
    const int g = blockIdx.x;
    double s = 0.0;
    for (int i = threadIdx.x; i < chunks; i += blockDim.x) s += (double)partial[(long long)i * G + g];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const double v = red[0] / (double)count;
        if (mode == 0) mean[g] = (float)v;
        else inv[g] = (float)(1.0 / sqrt(v + (double)eps));
    }
}

// out[p, c] = bf16(act(((x[p, c] + bias[c]) − mean[g])·inv[g]·gw[c] + gb[c])), act = SiLU when
// silu_on. Same block shape as vae_gn_partial; ppb pixels per block.
extern "C" __global__ void __launch_bounds__(1024)
vae_gn_apply(const float* x, const float* bias, int C, int G, long long P, int ppb, const float* mean, const float* inv,
             const float* gw, const float* gb, int silu_on, u16* out) {
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C, g = c / (C / G);
    // As the CPU kernel: v·a + s with a = inv·w, s = b − mean·inv·w (the conv bias folded in).
    const float a = inv[g] * gw[c];
    const float s = gb[c] + ((bias ? bias[c] : 0.f) - mean[g]) * a;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        float v = fmaf(x[p * C + c], a, s);
        if (silu_on) v = silu(v);
        out[p * C + c] = f32_to_bf16(v);
    }
}

// im2col of a 3×3 "same" conv over src [Hs, Ws, C] bf16 (nearest-upsampled ×2 first when
// up = 1: the conv runs at H = Hs << up, W = Ws << up). Output pixels [p0, p0 + np) of the
// H×W grid become rows of cols [np, 9·C]: cols[r, t·C + c] = src(y + ky − 1, x + kx − 1, c),
// t = 3·ky + kx, zero outside the image. One thread per (pixel, 8 channels); C % 8 == 0 and
// np·C/8 < 2³¹ (plan.rs).
extern "C" __global__ void vae_im2col3(const u16* src, int C, int Hs, int Ws, int up, int p0, int np, u16* cols) {
    const int C8 = C >> 3, H = Hs << up, W = Ws << up;
    const int n = np * C8;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int r = e / C8, c8 = e - r * C8;
        const int p = p0 + r, oy = p / W, ox = p - oy * W;
        uint4* dst = (uint4*)(cols + (long long)r * 9 * C) + c8;
#pragma unroll
        for (int t = 0; t < 9; t++) {
            const int iy = oy + t / 3 - 1, ix = ox + t % 3 - 1;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (iy >= 0 && iy < H && ix >= 0 && ix < W)
                v = *((const uint4*)(src + ((long long)(iy >> up) * Ws + (ix >> up)) * C) + c8);
            dst[t * C8] = v;
        }
    }
}

// out[p, c] = y[p, c] + bias[c] (+ skip[p, c]); out may alias y or skip. Row-kernel block shape.
extern "C" __global__ void __launch_bounds__(1024)
vae_bias_res(const float* y, const float* bias, const float* skip, int C, long long P, int ppb, float* out) {
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C;
    const float b = bias ? bias[c] : 0.f;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        const long long i = p * C + c;
        float v = y[i] + b;
        if (skip) v += skip[i];
        out[i] = v;
    }
}

// out = bf16(y[p, c] + bias[c]) at [p, c], or at [c, p] when transpose (Vᵀ for the P·V GEMM).
extern "C" __global__ void __launch_bounds__(1024)
vae_bias_bf16(const float* y, const float* bias, int C, long long P, int ppb, int transpose, u16* out) {
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C;
    const float b = bias ? bias[c] : 0.f;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        const float v = y[p * C + c] + b;
        out[transpose ? (long long)c * P + p : p * C + c] = f32_to_bf16(v);
    }
}

// Online-softmax merge of (max, Σ exp(v − max)) pairs; an empty side has m = −inf.
__device__ __forceinline__ void vae_sm_merge(float& m, float& l, float m2, float l2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) {
        m = m2;
        l = l2;
        return;
    }
    const float mn = fmaxf(m, m2);
    l = l * expf(m - mn) + l2 * expf(m2 - mn);
    m = mn;
}

// p[row, :] = bf16(softmax(scale · s[row, :])) over rows of n; one block of 256 threads a row.
extern "C" __global__ void __launch_bounds__(256) vae_softmax_rows(const float* s, int n, float scale, u16* p) {
    __shared__ float sm[32], sl[32];
    const float* row = s + (long long)blockIdx.x * n;
    u16* prow = p + (long long)blockIdx.x * n;
    float m = NEG_INF, l = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = row[i] * scale;
        if (v > m) {
            l = l * expf(m - v) + 1.f;
            m = v;
        } else {
            l += expf(v - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(FULL_MASK, m, o), l2 = __shfl_xor_sync(FULL_MASK, l, o);
        vae_sm_merge(m, l, m2, l2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    __syncthreads();
    m = NEG_INF;
    l = 0.f;
    for (int k = 0; k < nw; k++) vae_sm_merge(m, l, sm[k], sl[k]);
    const float inv = 1.f / l;
    for (int i = threadIdx.x; i < n; i += blockDim.x) prow[i] = f32_to_bf16(expf(row[i] * scale - m) * inv);
}

// Direct 3×3 "same" conv for a few output channels (conv_out): a [H·W, C] bf16 NHWC, w
// [Cout, 9·C] bf16 tap-major, out [Cout, H, W] f32 NCHW (+ bias). One warp per pixel, lanes
// over channels; Cout ≤ 4.
extern "C" __global__ void __launch_bounds__(256)
vae_conv3_small(const u16* a, int C, int H, int W, const u16* w, const float* bias, int Cout, float* out) {
    const int lane = threadIdx.x & 31;
    const int p = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    const int P = H * W;
    if (p >= P) return;  // whole warps leave together
    const int oy = p / W, ox = p - oy * W, K = 9 * C;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int t = 0; t < 9; t++) {
        const int iy = oy + t / 3 - 1, ix = ox + t % 3 - 1;
        if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
        const u16* ap = a + ((long long)iy * W + ix) * C;
        const u16* wp = w + t * C;
        for (int c = lane; c < C; c += 32) {
            const float v = bf16_to_f32(ap[c]);
#pragma unroll
            for (int co = 0; co < 4; co++)
                if (co < Cout) acc[co] += v * bf16_to_f32(wp[co * K + c]);
        }
    }
#pragma unroll
    for (int co = 0; co < 4; co++) {
        const float v = warp_sum(acc[co]);
        if (lane == 0 && co < Cout) out[(long long)co * P + p] = v + (bias ? bias[co] : 0.f);
    }
}
