// matvec.cu — y = W·x for one token (decode), W in its storage codec.
//
// Design. Decode at batch 1 is bound by weight bytes, so everything serves the weight stream:
// - each warp owns a "job" of two output rows and streams both with 16-byte non-coherent
//   loads, 4 chunks per row in flight before the first use (8 loads per lane), coalesced
//   across the warp (a warp reads 512 contiguous bytes of a row per chunk);
// - the grid is persistent (about 2 blocks per SM, jobs taken grid-stride), so the per-block
//   prologue below is paid ~264 times, not once per row;
// - the prologue fuses what used to be separate kernels: RMSNorm of the input (optional),
//   the q8_2f column field (x'[i] = x[i]·col[i], so the inner loop is plain int8), and the
//   quantisation of x to int8 in blocks of 32 with an f32 scale (q8/q4 codecs: dp4a does 4
//   multiply-adds per instruction, which keeps the SM far from its int/convert limits at
//   4.3 TB/s); float codecs keep x as f32 in shared memory;
// - up to 3 weight segments share one launch (q, k, v rows concatenated), and the epilogue
//   adds a bias, accumulates into the output (residual), or applies SwiGLU to a (gate, up)
//   row pair, so no separate elementwise kernels run between matvecs.
// Shapes: x[K] f32; W [rows, K]; y[rows] (mode 0/1) or y[rows_gate] (mode 2).
// Reference: cmf_kernels::reference::matvec (parity: tests/cuda_kernels.rs).

#define MV_WARPS 8
#define MV_U 4

struct Seg {
    const u8* w;       // codec payload (q8: int8 rows; q4: nibble plane; float codecs: values)
    const u16* rs;     // q8: f16 row scales [rows]; q4: f16 group scales [rows*K/32]; else null
    const u16* col;    // q8_2f: f16 column field [K]; else null
    const float* bias; // [rows] or null
    int rows;
    int row0;          // first output index of this segment
};

struct MvArgs {
    Seg seg[3];
    int nseg;
    int K;
    const float* x;     // [K]
    const float* norm;  // [K] RMSNorm weight, or null (no norm)
    float eps;
    float* y;
    int mode;           // 0: y = Wx (+bias); 1: y += Wx (+bias); 2: y = silu(W0 x)·(W1 x)
    int jobs;
};

template <int CODEC> struct Traits;
template <> struct Traits<CODEC_Q8> { static const int CH = 16; };   // elements per 16-B chunk
template <> struct Traits<CODEC_Q4> { static const int CH = 32; };
template <> struct Traits<CODEC_BF16> { static const int CH = 8; };
template <> struct Traits<CODEC_F16> { static const int CH = 8; };
template <> struct Traits<CODEC_F32> { static const int CH = 4; };

// Byte offset of element (r, c) in the codec's main plane.
template <int CODEC> __device__ __forceinline__ long long elem_off(long long r, long long c, long long K) {
    long long i = r * K + c;
    if (CODEC == CODEC_Q8) return i;
    if (CODEC == CODEC_Q4) return i >> 1;
    if (CODEC == CODEC_F32) return i * 4;
    return i * 2;
}

// Shared-memory layout of the prologue's output.
//   int8 codecs: per quant copy c < nq: xq[c][K] int8, then xs[c][K/32] f32, then xsum[c][K/32] int
//   float codecs: xf[K] f32
struct XQ {
    const i8* q;
    const float* s;
    const int* sum;
};

template <int CODEC>
__device__ __forceinline__ float chunk_dot(uint4 w, int c, const XQ& xq, const float* xf, const u16* gs, long long grp) {
    if (CODEC == CODEC_Q8) {
        int4 x = *(const int4*)(xq.q + c);
        int acc = __dp4a((int)w.x, x.x, 0);
        acc = __dp4a((int)w.y, x.y, acc);
        acc = __dp4a((int)w.z, x.z, acc);
        acc = __dp4a((int)w.w, x.w, acc);
        return (float)acc * xq.s[c >> 5];
    } else if (CODEC == CODEC_Q4) {
        // 32 elements; x is stored permuted per 8 (evens then odds) to match lo/hi nibbles.
        const int* x = (const int*)(xq.q + c);
        u32 ws[4] = {w.x, w.y, w.z, w.w};
        int acc = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int lo = (int)(ws[j] & 0x0F0F0F0Fu), hi = (int)((ws[j] >> 4) & 0x0F0F0F0Fu);
            acc = __dp4a(lo, x[2 * j], acc);
            acc = __dp4a(hi, x[2 * j + 1], acc);
        }
        int b = c >> 5;
        return f16_to_f32(gs[grp]) * xq.s[b] * (float)(acc - 8 * xq.sum[b]);
    } else if (CODEC == CODEC_F32) {
        float4 x = *(const float4*)(xf + c);
        return __uint_as_float(w.x) * x.x + __uint_as_float(w.y) * x.y + __uint_as_float(w.z) * x.z +
               __uint_as_float(w.w) * x.w;
    } else {
        float4 xa = *(const float4*)(xf + c), xb = *(const float4*)(xf + c + 4);
        u32 ws[4] = {w.x, w.y, w.z, w.w};
        float v[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (CODEC == CODEC_BF16) {
                v[2 * j] = __uint_as_float(ws[j] << 16);
                v[2 * j + 1] = __uint_as_float(ws[j] & 0xffff0000u);
            } else {
                v[2 * j] = f16_to_f32((u16)(ws[j] & 0xffff));
                v[2 * j + 1] = f16_to_f32((u16)(ws[j] >> 16));
            }
        }
        return v[0] * xa.x + v[1] * xa.y + v[2] * xa.z + v[3] * xa.w + v[4] * xb.x + v[5] * xb.y + v[6] * xb.z +
               v[7] * xb.w;
    }
}

template <int CODEC>
__device__ __forceinline__ void prologue(const MvArgs& a, char* smem, int nq) {
    const int K = a.K, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    __shared__ float red[32];
    float inv = 1.f;
    if (a.norm) {
        float ss = 0.f;
        for (int i = tid; i < K; i += blockDim.x) {
            float v = a.x[i];
            ss += v * v;
        }
        ss = block_sum(ss, red);
        inv = rsqrtf(ss / (float)K + a.eps);
    }
    if (CODEC == CODEC_Q8 || CODEC == CODEC_Q4) {
        const int nb = K >> 5;
        for (int c = 0; c < nq; c++) {
            i8* xq = (i8*)smem + (size_t)c * K;
            float* xs = (float*)(smem + (size_t)nq * K) + (size_t)c * nb;
            int* xsum = (int*)(smem + (size_t)nq * K + (size_t)nq * nb * 4) + (size_t)c * nb;
            const u16* col = a.seg[c].col;
            for (int b = warp; b < nb; b += blockDim.x >> 5) {
                int i = (b << 5) + lane;
                float v = a.x[i] * inv;
                if (a.norm) v *= a.norm[i];
                if (col) v *= f16_to_f32(col[i]);
                float amax = warp_max(fabsf(v));
                float s = amax / 127.f;
                int q = s > 0.f ? __float2int_rn(v / s) : 0;
                q = max(-127, min(127, q));
                int pos = lane;
                if (CODEC == CODEC_Q4) {
                    int e = lane & 7;
                    pos = (lane & ~7) + ((e & 1) ? 4 + (e >> 1) : (e >> 1));
                }
                xq[(b << 5) + pos] = (i8)q;
                int sum = warp_sum_i(q);
                if (lane == 0) {
                    xs[b] = s;
                    xsum[b] = sum;
                }
            }
        }
    } else {
        float* xf = (float*)smem;
        for (int i = tid; i < K; i += blockDim.x) {
            float v = a.x[i] * inv;
            if (a.norm) v *= a.norm[i];
            xf[i] = v;
        }
    }
    __syncthreads();
}

template <int CODEC>
__device__ __forceinline__ void matvec_body(const MvArgs& a) {
    extern __shared__ __align__(16) char smem[];
    const int K = a.K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int CH = Traits<CODEC>::CH;
    // One quantised copy of x per segment when any segment has a column field (q8_2f).
    int nq = 1;
    if (CODEC == CODEC_Q8)
        for (int s = 0; s < a.nseg; s++)
            if (a.seg[s].col) nq = a.nseg;
    prologue<CODEC>(a, smem, nq);
    const int nb = K >> 5;
    const float* xf = (const float*)smem;

    for (int job = blockIdx.x * MV_WARPS + warp; job < a.jobs; job += gridDim.x * MV_WARPS) {
        int sidx[2], r[2];
        bool ok[2];
        if (a.mode == 2) {
            sidx[0] = 0; sidx[1] = 1; r[0] = r[1] = job;
            ok[0] = ok[1] = job < a.seg[0].rows;
        } else {
#pragma unroll
            for (int t = 0; t < 2; t++) {
                int g = 2 * job + t, s = 0;
                while (s < a.nseg - 1 && g >= a.seg[s].row0 + a.seg[s].rows) s++;
                sidx[t] = s;
                r[t] = g - a.seg[s].row0;
                ok[t] = r[t] < a.seg[s].rows;
            }
        }
        XQ xq[2];
        const u8* base[2];
        const u16* gs[2];
#pragma unroll
        for (int t = 0; t < 2; t++) {
            int c = (nq > 1) ? sidx[t] : 0;
            xq[t].q = (const i8*)smem + (size_t)c * K;
            xq[t].s = (const float*)(smem + (size_t)nq * K) + (size_t)c * nb;
            xq[t].sum = (const int*)(smem + (size_t)nq * K + (size_t)nq * nb * 4) + (size_t)c * nb;
            base[t] = a.seg[sidx[t]].w + elem_off<CODEC>(r[t], 0, K);
            gs[t] = a.seg[sidx[t]].rs;
        }
        float acc[2] = {0.f, 0.f};
        for (int c0 = lane * CH; c0 < K; c0 += 32 * CH * MV_U) {
            uint4 w[2][MV_U];
#pragma unroll
            for (int t = 0; t < 2; t++)
#pragma unroll
                for (int u = 0; u < MV_U; u++) {
                    int c = c0 + u * 32 * CH;
                    w[t][u] = (ok[t] && c < K) ? ld_stream16(base[t] + elem_off<CODEC>(0, c, K)) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int t = 0; t < 2; t++)
#pragma unroll
                for (int u = 0; u < MV_U; u++) {
                    int c = c0 + u * 32 * CH;
                    if (ok[t] && c < K) {
                        long long grp = ((long long)r[t] * K + c) >> 5;
                        acc[t] += chunk_dot<CODEC>(w[t][u], c, xq[t], xf, gs[t], grp);
                    }
                }
        }
        float v[2];
#pragma unroll
        for (int t = 0; t < 2; t++) {
            v[t] = warp_sum(acc[t]);
            if (ok[t]) {
                const Seg& s = a.seg[sidx[t]];
                if (CODEC == CODEC_Q8) v[t] *= f16_to_f32(s.rs[r[t]]);
                if (s.bias) v[t] += s.bias[r[t]];
            }
        }
        if (lane == 0) {
            if (a.mode == 2) {
                if (ok[0]) a.y[job] = silu(v[0]) * v[1];
            } else {
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    if (!ok[t]) continue;
                    float* dst = a.y + a.seg[sidx[t]].row0 + r[t];
                    *dst = a.mode == 1 ? *dst + v[t] : v[t];
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) mv_q8(const MvArgs a) { matvec_body<CODEC_Q8>(a); }
extern "C" __global__ void __launch_bounds__(256) mv_q4(const MvArgs a) { matvec_body<CODEC_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256) mv_bf16(const MvArgs a) { matvec_body<CODEC_BF16>(a); }
extern "C" __global__ void __launch_bounds__(256) mv_f16(const MvArgs a) { matvec_body<CODEC_F16>(a); }
extern "C" __global__ void __launch_bounds__(256) mv_f32(const MvArgs a) { matvec_body<CODEC_F32>(a); }
