// vae.cu — the FLUX VAE decoder's kernels between the cuBLAS GEMMs.
//
// Design. Activations are NHWC ([pixels, C], row-major) so a conv's output is simply the GEMM's
// [pixels, C_out] and every per-channel op reads whole pixel rows. f32 activations, bf16 GEMM
// operands, f32 accumulation (cuBLAS), as the rest of the device chain.
// - 3×3 conv = vae_im2col3 (bf16 [pixels, 9·C], columns tap-major: (ky, kx, c); the weights are
//   permuted to that order once at load by vae_permute_taps) + one GEMM per tile of pixels.
//   Tap-major columns let each thread move 8 channels (16 bytes) per tap, loads and stores
//   coalesced; the nearest ×2 upsample is folded into the im2col (it reads source pixel
//   (y >> 1, x >> 1)), so the upsampled map never exists. Where cuDNN loads (cuda/cudnn.rs), its
//   implicit-GEMM convs replace im2col + GEMM, with vae_upsample2_bf16 before them and bf16
//   outputs read by the _bf16 variants of the row kernels.
// - GroupNorm: one pass of per-block (mean, M2) summaries (Welford, then Chan's merge; the CPU
//   kernel group_stats in cmf-kernels/src/ops/norm.rs takes two passes, mean then Σ(x − mean)²,
//   for the same freedom from cancellation) merged in f64, then one apply pass fused with SiLU and
//   the bf16 conversion for the next conv. The preceding conv's bias is folded in
//   (x + b), which saves a pass over conv1's output.
// - conv_out (3 output channels) is a direct conv (a GEMM with N = 3 would only stream its
//   im2col), writing f32 NCHW or, for the pipeline, the 8-bit RGB image itself: a quarter of the
//   readback and no host conversion.
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

// An activation value as f32: the decoder's f32 buffers, or the bf16 output of a cuDNN conv.
__device__ __forceinline__ float act_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float act_f32(const u16* p, long long i) { return bf16_to_f32(p[i]); }

// Chan et al.'s merge of two (count, mean, M2 = Σ (v − mean)²) summaries into (n, mean, m2).
template <typename T>
__device__ __forceinline__ void gn_merge(T& n, T& mean, T& m2, T nb, T mb, T m2b) {
    if (nb == (T)0) return;
    const T nn = n + nb, d = mb - mean;
    mean += d * (nb / nn);
    m2 += m2b + d * d * (n * nb / nn);
    n = nn;
}

// GroupNorm statistics over x[P, C] (+ bias[c] when given), one pass: block b summarises pixels
// [b·ppb, (b+1)·ppb) of each group as (mean, M2) in partial[b, g, 0..2] — Welford per thread,
// Chan's merge across the block's threads — so no second read of x for the variance and no
// cancellation (vae_gn_finalize merges the blocks in f64; an f32 emulation of the scheme on 1M
// values gave relative variance errors of 1e-8 at mean/σ ≤ 17, 3e-7 at 1700, 2e-5 at 17000).
// Block: C·kpp threads (≤ 1024). x f32 or bf16 (vae_gn_stats_bf16).
template <typename T>
__device__ __forceinline__ void gn_stats_body(const T* x, const float* bias, int C, int G, long long P, int ppb,
                                              float* partial) {
    __shared__ float s_mean[1024], s_m2[1024];
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C, cpg = C / G;
    const float b = bias ? bias[c] : 0.f;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    float n = 0.f, mean = 0.f, m2 = 0.f;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        const float v = act_f32(x, p * C + c) + b;
        n += 1.f;
        const float d = v - mean;
        mean += d / n;
        m2 = fmaf(d, v - mean, m2);
    }
    s_mean[t] = mean;
    s_m2[t] = m2;
    __syncthreads();
    // Thread (j, c) saw the pixels p_begin + j + i·kpp < p_end.
    const long long rows = p_end - p_begin;
    for (int g = t; g < G; g += blockDim.x) {
        float gn = 0.f, gm = 0.f, g2 = 0.f;
        for (int jj = 0; jj < kpp; jj++) {
            const float nj = jj < rows ? (float)((rows - jj + kpp - 1) / kpp) : 0.f;
            for (int cc = g * cpg; cc < (g + 1) * cpg; cc++) gn_merge(gn, gm, g2, nj, s_mean[jj * C + cc], s_m2[jj * C + cc]);
        }
        partial[((long long)blockIdx.x * G + g) * 2] = gm;
        partial[((long long)blockIdx.x * G + g) * 2 + 1] = g2;
    }
}
extern "C" __global__ void __launch_bounds__(1024)
vae_gn_stats(const float* x, const float* bias, int C, int G, long long P, int ppb, float* partial) {
    gn_stats_body(x, bias, C, G, P, ppb, partial);
}
extern "C" __global__ void __launch_bounds__(1024)
vae_gn_stats_bf16(const u16* x, const float* bias, int C, int G, long long P, int ppb, float* partial) {
    gn_stats_body(x, bias, C, G, P, ppb, partial);
}

// Merges group blockIdx.x's `chunks` block summaries (vae_gn_stats; block i counted
// min(ppb, P − i·ppb)·cpg values) in f64: mean[g], inv[g] = 1 / sqrt(M2 / count + eps). 256 threads.
extern "C" __global__ void __launch_bounds__(256)
vae_gn_finalize(const float* partial, int chunks, int G, long long P, int ppb, int cpg, float eps, float* mean, float* inv) {
    __shared__ double rn[256], rm[256], r2[256];
    const int g = blockIdx.x, t = threadIdx.x;
    double n = 0.0, m = 0.0, m2 = 0.0;
    for (int i = t; i < chunks; i += blockDim.x) {
        const long long left = P - (long long)i * ppb;
        const double ni = (double)((left < ppb ? left : ppb) * cpg);
        gn_merge(n, m, m2, ni, (double)partial[((long long)i * G + g) * 2], (double)partial[((long long)i * G + g) * 2 + 1]);
    }
    rn[t] = n;
    rm[t] = m;
    r2[t] = m2;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (t < o) {
            double a = rn[t], am = rm[t], a2 = r2[t];
            gn_merge(a, am, a2, rn[t + o], rm[t + o], r2[t + o]);
            rn[t] = a;
            rm[t] = am;
            r2[t] = a2;
        }
        __syncthreads();
    }
    if (t == 0) {
        mean[g] = (float)rm[0];
        inv[g] = (float)(1.0 / sqrt(r2[0] / rn[0] + (double)eps));
    }
}

// out[p, c] = bf16(act(((x[p, c] + bias[c]) − mean[g])·inv[g]·gw[c] + gb[c])), act = SiLU when
// silu_on. Same block shape as vae_gn_stats; ppb pixels per block. x f32 or bf16 (_bf16).
template <typename T>
__device__ __forceinline__ void gn_apply_body(const T* x, const float* bias, int C, int G, long long P, int ppb,
                                              const float* mean, const float* inv, const float* gw, const float* gb,
                                              int silu_on, u16* out) {
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C, g = c / (C / G);
    // As the CPU kernel: v·a + s with a = inv·w, s = b − mean·inv·w (the conv bias folded in).
    const float a = inv[g] * gw[c];
    const float s = gb[c] + ((bias ? bias[c] : 0.f) - mean[g]) * a;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        float v = fmaf(act_f32(x, p * C + c), a, s);
        if (silu_on) v = silu(v);
        out[p * C + c] = f32_to_bf16(v);
    }
}

extern "C" __global__ void __launch_bounds__(1024)
vae_gn_apply(const float* x, const float* bias, int C, int G, long long P, int ppb, const float* mean, const float* inv,
             const float* gw, const float* gb, int silu_on, u16* out) {
    gn_apply_body(x, bias, C, G, P, ppb, mean, inv, gw, gb, silu_on, out);
}
extern "C" __global__ void __launch_bounds__(1024)
vae_gn_apply_bf16(const u16* x, const float* bias, int C, int G, long long P, int ppb, const float* mean,
                  const float* inv, const float* gw, const float* gb, int silu_on, u16* out) {
    gn_apply_body(x, bias, C, G, P, ppb, mean, inv, gw, gb, silu_on, out);
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

// The cuDNN conv path's glue (cuda/cudnn.rs): nearest ×2 upsampling of a bf16 NHWC map [Hs, Ws,
// C] into [2Hs, 2Ws, C] (cuDNN cannot fold it into its input reads as vae_im2col3 does), 8
// channels (16 bytes) a thread. The conv's bf16 output goes straight to the _bf16 variants of the
// kernels that read it (GroupNorm, bias + residual).
extern "C" __global__ void vae_upsample2_bf16(const u16* src, int C, int Hs, int Ws, u16* dst) {
    const int C8 = C >> 3, W = Ws << 1;
    const long long n = (long long)(Hs << 1) * W * C8;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long p = e / C8;
        const int c8 = (int)(e - p * C8), y = (int)(p / W), x = (int)(p - (long long)y * W);
        ((uint4*)dst)[e] = ((const uint4*)(src + ((long long)(y >> 1) * Ws + (x >> 1)) * C))[c8];
    }
}

// out[p, c] = y[p, c] + bias[c] (+ skip[p, c]); out may alias y (f32) or skip. Row-kernel block
// shape. y f32 or bf16 (vae_bias_res_bf16: a cuDNN conv's output, widened here).
template <typename T>
__device__ __forceinline__ void bias_res_body(const T* y, const float* bias, const float* skip, int C, long long P,
                                              int ppb, float* out) {
    const int t = threadIdx.x, kpp = blockDim.x / C, c = t % C, j = t / C;
    const float b = bias ? bias[c] : 0.f;
    const long long p_begin = (long long)blockIdx.x * ppb;
    const long long p_end = p_begin + ppb < P ? p_begin + ppb : P;
    for (long long p = p_begin + j; p < p_end; p += kpp) {
        const long long i = p * C + c;
        float v = act_f32(y, i) + b;
        if (skip) v += skip[i];
        out[i] = v;
    }
}
extern "C" __global__ void __launch_bounds__(1024)
vae_bias_res(const float* y, const float* bias, const float* skip, int C, long long P, int ppb, float* out) {
    bias_res_body(y, bias, skip, C, P, ppb, out);
}
extern "C" __global__ void __launch_bounds__(1024)
vae_bias_res_bf16(const u16* y, const float* bias, const float* skip, int C, long long P, int ppb, float* out) {
    bias_res_body(y, bias, skip, C, P, ppb, out);
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
// [Cout, 9·C] bf16 tap-major, bias f32; Cout ≤ 4, C % 8 == 0. `lpp` lanes a pixel (a power of
// two ≤ 32, ≤ C / 8), each taking 8 channels (16 bytes) at a time, so a warp reads whole pixel
// rows in 16-byte loads; the weights (≤ 4 · 9 · C values) stay in L1. Writes f32 NCHW [Cout, H,
// W] to `out`, or, with `rgb` set, the image as interleaved 8-bit RGB [H, W, Cout]
// (diffusers' postprocess: round-half-even of clamp(v / 2 + 0.5, 0, 1) · 255, as to_rgb8 in
// cmf-zimage) and sets *bad when a value is not finite.
extern "C" __global__ void __launch_bounds__(256)
vae_conv3_small(const u16* a, int C, int H, int W, const u16* w, const float* bias, int Cout, int lpp, float* out,
                u8* rgb, int* bad) {
    const int lane = threadIdx.x & 31, sub = lane & (lpp - 1);
    const long long p = ((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5) * (32 / lpp) + lane / lpp;
    const long long P = (long long)H * W;
    const bool live = p < P;
    const int oy = live ? (int)(p / W) : 0, ox = live ? (int)(p - (long long)oy * W) : 0, K = 9 * C;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int tap = 0; tap < 9; tap++) {
        const int iy = oy + tap / 3 - 1, ix = ox + tap % 3 - 1;
        if (!live || iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
        const u16* ap = a + ((long long)iy * W + ix) * C;
        for (int c = sub * 8; c < C; c += lpp * 8) {
            const uint4 av = *(const uint4*)(ap + c);
            const u32 aw[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
            for (int co = 0; co < 4; co++) {
                if (co >= Cout) break;
                const uint4 wv = *(const uint4*)(w + (long long)co * K + tap * C + c);
                const u32 ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[co] = fmaf(bf16_to_f32((u16)(aw[e] & 0xffff)), bf16_to_f32((u16)(ww[e] & 0xffff)), acc[co]);
                    acc[co] = fmaf(bf16_to_f32((u16)(aw[e] >> 16)), bf16_to_f32((u16)(ww[e] >> 16)), acc[co]);
                }
            }
        }
    }
    // Sum over the pixel's lpp lanes (aligned groups of a power of two).
#pragma unroll
    for (int co = 0; co < 4; co++)
        for (int o = lpp >> 1; o > 0; o >>= 1) acc[co] += __shfl_xor_sync(FULL_MASK, acc[co], o);
    if (!live || sub != 0) return;
    for (int co = 0; co < Cout; co++) {
        const float v = acc[co] + (bias ? bias[co] : 0.f);
        if (rgb) {
            if (!isfinite(v)) atomicOr(bad, 1);
            const float u = fminf(fmaxf(v / 2.f + 0.5f, 0.f), 1.f);
            rgb[p * Cout + co] = (u8)rintf(u * 255.f);
        } else {
            out[(long long)co * P + p] = v;
        }
    }
}
