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
// Chunks of 16 bytes per row in flight per lane (two rows per warp, double-buffered).
#ifndef MV_U
#define MV_U 4
#endif
// Resident blocks per SM the register allocation must allow (launch bounds).
#ifndef MV_MINB
#define MV_MINB 2
#endif

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

// Prologue: x → shared memory, RMSNorm fused. One pass per 16 elements per thread, in
// registers: int8 codecs quantise per 32-block (a block is two neighbouring threads' chunks,
// combined with one shuffle), float codecs store f32.
template <int CODEC>
__device__ __forceinline__ void prologue(const MvArgs& a, char* smem, int nq) {
    const int K = a.K, tid = threadIdx.x;
    __shared__ float red[32];
    float inv = 1.f;
    if (a.norm) {
        float ss = 0.f;
        for (int i = tid * 4; i < K; i += blockDim.x * 4) {
            float4 v = *(const float4*)(a.x + i);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = block_sum(ss, red);
        inv = rsqrtf(ss / (float)K + a.eps);
    }
    if (CODEC == CODEC_Q8 || CODEC == CODEC_Q4) {
        const int nb = K >> 5, nch = K >> 4;
        for (int c = 0; c < nq; c++) {
            i8* xq = (i8*)smem + (size_t)c * K;
            float* xs = (float*)(smem + (size_t)nq * K) + (size_t)c * nb;
            int* xsum = (int*)(smem + (size_t)nq * K + (size_t)nq * nb * 4) + (size_t)c * nb;
            const u16* col = a.seg[c].col;
            // Loop bounds are uniform per warp, so the pair shuffles see both partners.
            for (int base = 0; base < nch; base += blockDim.x) {
                const int j = base + tid;
                const bool act = j < nch;
                float v[16];
                float amax = 0.f;
                if (act) {
#pragma unroll
                    for (int q4 = 0; q4 < 4; q4++) {
                        float4 xv = *(const float4*)(a.x + j * 16 + q4 * 4);
                        float4 nv = a.norm ? *(const float4*)(a.norm + j * 16 + q4 * 4) : make_float4(1.f, 1.f, 1.f, 1.f);
                        v[q4 * 4 + 0] = xv.x * inv * nv.x;
                        v[q4 * 4 + 1] = xv.y * inv * nv.y;
                        v[q4 * 4 + 2] = xv.z * inv * nv.z;
                        v[q4 * 4 + 3] = xv.w * inv * nv.w;
                    }
                    if (col) {
                        uint4 c0 = *(const uint4*)(col + j * 16), c1 = *(const uint4*)(col + j * 16 + 8);
                        u32 cw[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            v[2 * e] *= f16_to_f32((u16)(cw[e] & 0xffff));
                            v[2 * e + 1] *= f16_to_f32((u16)(cw[e] >> 16));
                        }
                    }
#pragma unroll
                    for (int e = 0; e < 16; e++) amax = fmaxf(amax, fabsf(v[e]));
                }
                amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 1));
                const float s = amax / 127.f;
                const float rs = amax > 0.f ? 127.f / amax : 0.f;
                int q[16], sum = 0;
#pragma unroll
                for (int e = 0; e < 16; e++) {
                    q[e] = max(-127, min(127, __float2int_rn(v[e] * rs)));
                    sum += q[e];
                }
                sum += __shfl_xor_sync(FULL_MASK, sum, 1);
                if (act) {
                    u32 pk[4];
                    if (CODEC == CODEC_Q4) {
                        // Per 8 elements: the evens, then the odds (matches lo/hi nibbles).
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int* g = q + 8 * h;
                            pk[2 * h] = (u32)(g[0] & 255) | ((u32)(g[2] & 255) << 8) | ((u32)(g[4] & 255) << 16) | ((u32)(g[6] & 255) << 24);
                            pk[2 * h + 1] = (u32)(g[1] & 255) | ((u32)(g[3] & 255) << 8) | ((u32)(g[5] & 255) << 16) | ((u32)(g[7] & 255) << 24);
                        }
                    } else {
#pragma unroll
                        for (int w = 0; w < 4; w++)
                            pk[w] = (u32)(q[4 * w] & 255) | ((u32)(q[4 * w + 1] & 255) << 8) | ((u32)(q[4 * w + 2] & 255) << 16) |
                                    ((u32)(q[4 * w + 3] & 255) << 24);
                    }
                    *(uint4*)(xq + j * 16) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
                    if ((j & 1) == 0) {
                        xs[j >> 1] = s;
                        xsum[j >> 1] = sum;
                    }
                }
            }
        }
    } else {
        float* xf = (float*)smem;
        for (int i = tid * 4; i < K; i += blockDim.x * 4) {
            float4 v = *(const float4*)(a.x + i);
            float4 nv = a.norm ? *(const float4*)(a.norm + i) : make_float4(1.f, 1.f, 1.f, 1.f);
            *(float4*)(xf + i) = make_float4(v.x * inv * nv.x, v.y * inv * nv.y, v.z * inv * nv.z, v.w * inv * nv.w);
        }
    }
    __syncthreads();
}

// A warp's unit of work: two output rows (mode 0/1: rows 2j, 2j+1 of the concatenated
// segments; mode 2: gate row j and up row j). Row scale and bias are fetched when the job is
// resolved (they are immutable), so the epilogue does not wait on them.
struct Job {
    int sidx[2], r[2];
    bool ok[2];
    const u8* base[2];
    const u16* gs[2];
    float scale[2], bias[2];
};

template <int CODEC>
__device__ __forceinline__ void resolve(const MvArgs& a, int job, Job& j) {
#pragma unroll
    for (int t = 0; t < 2; t++) {
        int s = 0, r = job;
        if (a.mode == 2) {
            s = t;
        } else {
            int g = 2 * job + t;
            while (s < a.nseg - 1 && g >= a.seg[s].row0 + a.seg[s].rows) s++;
            r = g - a.seg[s].row0;
        }
        const bool ok = job < a.jobs && r < a.seg[s].rows;
        j.sidx[t] = s;
        j.r[t] = ok ? r : 0;
        j.ok[t] = ok;
        j.base[t] = a.seg[s].w + elem_off<CODEC>(j.r[t], 0, a.K);
        j.gs[t] = a.seg[s].rs;
        j.scale[t] = (CODEC == CODEC_Q8 && ok) ? f16_to_f32(a.seg[s].rs[j.r[t]]) : 1.f;
        j.bias[t] = (ok && a.seg[s].bias) ? a.seg[s].bias[j.r[t]] : 0.f;
    }
}

template <int CODEC>
__device__ __forceinline__ void load_batch(const Job& j, int c0, int K, uint4 (&w)[2][MV_U]) {
    const int CH = Traits<CODEC>::CH;
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
        for (int u = 0; u < MV_U; u++) {
            int c = c0 + u * 32 * CH;
            w[t][u] = (j.ok[t] && c < K) ? ld_stream16(j.base[t] + elem_off<CODEC>(0, c, K)) : make_uint4(0, 0, 0, 0);
        }
}

template <int CODEC>
__device__ __forceinline__ void matvec_body(const MvArgs& a) {
    extern __shared__ __align__(16) char smem[];
    pdl_trigger();
    const int K = a.K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int CH = Traits<CODEC>::CH, STEP = 32 * CH * MV_U;
    // One quantised copy of x per segment when any segment has a column field (q8_2f).
    int nq = 1;
    if (CODEC == CODEC_Q8)
        for (int s = 0; s < a.nseg; s++)
            if (a.seg[s].col) nq = a.nseg;
    const int nb = K >> 5;
    const int stride = gridDim.x * MV_WARPS;

    // The first weights are immutable: start streaming them before waiting for the
    // predecessor kernel (PDL), so the wait and the prologue hide behind the loads.
    int job = blockIdx.x * MV_WARPS + warp;
    Job cur;
    resolve<CODEC>(a, job, cur);
    uint4 w[2][MV_U];
    load_batch<CODEC>(cur, lane * CH, K, w);
    pdl_wait();
    prologue<CODEC>(a, smem, nq);
    const float* xf = (const float*)smem;

    while (job < a.jobs) {
        // Lanes 0 and 1 own the job's two output rows (selects, not indexing: a run-time
        // index into these arrays would put them in local memory).
        const bool my_ok = lane == 0 ? cur.ok[0] : cur.ok[1];
        const int my_out = (lane == 0 ? a.seg[cur.sidx[0]].row0 + cur.r[0] : a.seg[cur.sidx[1]].row0 + cur.r[1]);
        float old = 0.f;
        if (a.mode == 1 && lane < 2 && my_ok) old = a.y[my_out];
        XQ xq[2];
#pragma unroll
        for (int t = 0; t < 2; t++) {
            int c = (nq > 1) ? cur.sidx[t] : 0;
            xq[t].q = (const i8*)smem + (size_t)c * K;
            xq[t].s = (const float*)(smem + (size_t)nq * K) + (size_t)c * nb;
            xq[t].sum = (const int*)(smem + (size_t)nq * K + (size_t)nq * nb * 4) + (size_t)c * nb;
        }
        float acc[2] = {0.f, 0.f};
        int next = job;
        Job nxt = cur;
        for (int base = 0;; base += STEP) {
            const bool more = base + STEP < K;  // warp-uniform
            uint4 wn[2][MV_U];
            if (more) {
                load_batch<CODEC>(cur, base + STEP + lane * CH, K, wn);
            } else {
                // Software pipeline across jobs: the next job's first loads go out now.
                next = job + stride;
                resolve<CODEC>(a, next, nxt);
                load_batch<CODEC>(nxt, lane * CH, K, wn);
            }
#pragma unroll
            for (int t = 0; t < 2; t++)
#pragma unroll
                for (int u = 0; u < MV_U; u++) {
                    int c = base + lane * CH + u * 32 * CH;
                    if (cur.ok[t] && c < K) {
                        long long grp = ((long long)cur.r[t] * K + c) >> 5;
                        acc[t] += chunk_dot<CODEC>(w[t][u], c, xq[t], xf, cur.gs[t], grp);
                    }
                }
#pragma unroll
            for (int t = 0; t < 2; t++)
#pragma unroll
                for (int u = 0; u < MV_U; u++) w[t][u] = wn[t][u];
            if (!more) break;
        }
        float v[2];
#pragma unroll
        for (int t = 0; t < 2; t++) v[t] = warp_sum(acc[t]) * cur.scale[t] + cur.bias[t];
        if (a.mode == 2) {
            if (lane == 0 && cur.ok[0]) a.y[job] = silu(v[0]) * v[1];
        } else if (lane < 2 && my_ok) {
            float val = lane == 0 ? v[0] : v[1];
            a.y[my_out] = a.mode == 1 ? old + val : val;
        }
        job = next;
        cur = nxt;
    }
}

extern "C" __global__ void __launch_bounds__(256, MV_MINB) mv_q8(const MvArgs a) { matvec_body<CODEC_Q8>(a); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) mv_q4(const MvArgs a) { matvec_body<CODEC_Q4>(a); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) mv_bf16(const MvArgs a) { matvec_body<CODEC_BF16>(a); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) mv_f16(const MvArgs a) { matvec_body<CODEC_F16>(a); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) mv_f32(const MvArgs a) { matvec_body<CODEC_F32>(a); }
