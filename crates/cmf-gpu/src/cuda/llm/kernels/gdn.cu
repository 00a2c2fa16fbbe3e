// gdn.cu — Qwen3-Next's hybrid layers: the GatedDeltaNet mixer and the output gate of its
// attention layers. T rows per launch: 1 in the decode graph, a prompt chunk in prefill; the
// recurrent state (conv ring, delta state) lives in device memory and is carried from launch to
// launch, so a prefill of T tokens leaves exactly the state of T decode steps.
// Reference: llm/reference.rs (gdn_inputs, gdn_conv, gdn_l2norm, gdn_recurrence,
// gdn_gated_norm); each kernel keeps its order of operations.

// Most conv taps (`GDN_MAX_W` in gdn.rs); the ring of W − 1 inputs lives in registers.
#define GDN_MAX_W 8

__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Splits the fused projections (rows grouped per key head: [q | k | v (R heads) | z (R heads)]
// and [b (R) | a (R)]) and runs the causal depthwise conv + SiLU over T rows, one thread per
// index c < max(C, VD, NV), C = 2·KD + VD channels:
//   c < C:  channel c's conv over the T rows from its ring (W − 1 older inputs, oldest first),
//           which then holds the newest W − 1 inputs; mixed[t, c] = silu(conv);
//   c < VD: z[t, c];
//   c < NV: beta[t, c] = sigmoid(b), decay[t, c] = −exp(A_log)·softplus(a + dt_bias).
// qkvz rows have stride ld_qkvz, ba rows stride ld_ba.
extern "C" __global__ void gdn_prep(const float* __restrict__ qkvz, int ld_qkvz, const float* __restrict__ ba,
                                    int ld_ba, int T, const float* __restrict__ conv_w, float* __restrict__ ring,
                                    const float* __restrict__ a_log, const float* __restrict__ dt_bias, int NK,
                                    int NV, int DK, int DV, int W, float* __restrict__ mixed, float* __restrict__ z,
                                    float* __restrict__ beta, float* __restrict__ decay) {
    pdl_wait();
    const int KD = NK * DK, VD = NV * DV, C = 2 * KD + VD, R = NV / NK, G = 2 * DK + 2 * R * DV;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < C) {
        int src;
        if (c < KD) src = (c / DK) * G + c % DK;
        else if (c < 2 * KD) src = ((c - KD) / DK) * G + DK + (c - KD) % DK;
        else src = ((c - 2 * KD) / (R * DV)) * G + 2 * DK + (c - 2 * KD) % (R * DV);
        const float* w = conv_w + (size_t)c * W;
        float* h = ring + (size_t)c * (W - 1);
        float hist[GDN_MAX_W - 1];
#pragma unroll
        for (int j = 0; j < GDN_MAX_W - 1; j++) hist[j] = j < W - 1 ? h[j] : 0.f;
        for (int t = 0; t < T; t++) {
            const float x = qkvz[(size_t)t * ld_qkvz + src];
            float acc = w[W - 1] * x;
#pragma unroll
            for (int j = 0; j < GDN_MAX_W - 1; j++)
                if (j < W - 1) acc += w[j] * hist[j];
#pragma unroll
            for (int j = 0; j < GDN_MAX_W - 2; j++)
                if (j < W - 2) hist[j] = hist[j + 1];
#pragma unroll
            for (int j = 0; j < GDN_MAX_W - 1; j++)
                if (j == W - 2) hist[j] = x;
            mixed[(size_t)t * C + c] = silu(acc);
        }
#pragma unroll
        for (int j = 0; j < GDN_MAX_W - 1; j++)
            if (j < W - 1) h[j] = hist[j];
    }
    if (c < VD) {
        const int src = (c / (R * DV)) * G + 2 * DK + R * DV + c % (R * DV);
        for (int t = 0; t < T; t++) z[(size_t)t * VD + c] = qkvz[(size_t)t * ld_qkvz + src];
    }
    if (c < NV) {
        const int hk = c / R, j = c % R;
        const float al = expf(a_log[c]), dt = dt_bias[c];
        for (int t = 0; t < T; t++) {
            const float* row = ba + (size_t)t * ld_ba + hk * 2 * R;
            beta[(size_t)t * NV + c] = 1.f / (1.f + expf(-row[j]));
            decay[(size_t)t * NV + c] = -al * gdn_softplus(row[R + j] + dt);
        }
    }
}

// Rows of the state one thread keeps in registers (`GDN_ROWS` in gdn.rs).
#define GDN_ROWS 32

// block_sum (common.cuh) over a 2-D block, `tid` the flat thread index; blockDim.x is a multiple
// of 32, so every warp is full.
__device__ __forceinline__ float gdn_block_sum(float v, float* red, int tid, int nthreads) {
    const int lane = tid & 31, warp = tid >> 5, nw = (nthreads + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}

// The gated delta rule over T rows for value head blockIdx.x (reading key head
// h / (NV / NK)), then the gated RMSNorm with z. The head's state S [DK, DV] (row-major in
// `state`) lives in registers for the whole launch: thread (j, p) holds column j's rows
// p, p + P, … (P = blockDim.y = ⌈DK / GDN_ROWS⌉ row groups), loaded before pdl_wait (only this
// kernel writes S, and the previous token's launch of it is long done) and stored at the end.
// Per row: q, k l2-normalised (eps 1e-6 in the root; q also by 1/√DK), then S ← e^g·S;
// d = β(v − Sᵀk); S ← S + k ⊗ d; o = Sᵀq (the row groups' partial sums meet in shared memory);
// core[t, h·DV + j] = o / rms(o) · w[j] · silu(z[t, h·DV + j]).
// Block: (DV rounded up to a warp multiple, P), at most 512 threads. Dynamic smem:
// (2·DK + 32 + P·blockDim.x) floats.
extern "C" __global__ void __launch_bounds__(512)
    gdn_delta(const float* __restrict__ mixed, const float* __restrict__ beta, const float* __restrict__ decay,
              const float* __restrict__ z, float* __restrict__ state, const float* __restrict__ norm_w, float eps,
              int T, int NK, int NV, int DK, int DV, float* __restrict__ core) {
    extern __shared__ float gdn_sm[];
    const int P = blockDim.y, DVB = blockDim.x;
    float* qs = gdn_sm;
    float* ks = qs + DK;
    float* red = ks + DK;
    float* part = red + 32;  // [P, DVB]
    const int hv = blockIdx.x, hk = hv / (NV / NK), j = threadIdx.x, p = threadIdx.y;
    const int tid = p * DVB + j, nthreads = DVB * P;
    const int KD = NK * DK, VD = NV * DV, C = 2 * KD + VD;
    const bool col = j < DV;
    float* S = state + (size_t)hv * DK * DV;
    float sv[GDN_ROWS];
#pragma unroll
    for (int r = 0; r < GDN_ROWS; r++) {
        const int i = p + r * P;
        sv[r] = col && i < DK ? S[(size_t)i * DV + j] : 0.f;
    }
    pdl_wait();
    const float qscale = 1.f / sqrtf((float)DK);
    for (int t = 0; t < T; t++) {
        const float* row = mixed + (size_t)t * C;
        __syncthreads();  // the previous row's readers of qs/ks/part are done
        float sq = 0.f, sk = 0.f;
        for (int i = tid; i < DK; i += nthreads) {
            const float a = row[hk * DK + i], b = row[KD + hk * DK + i];
            qs[i] = a;
            ks[i] = b;
            sq += a * a;
            sk += b * b;
        }
        sq = gdn_block_sum(sq, red, tid, nthreads);
        sk = gdn_block_sum(sk, red, tid, nthreads);
        const float iq = 1.f / sqrtf(sq + 1e-6f) * qscale, ik = 1.f / sqrtf(sk + 1e-6f);
        const float e = expf(decay[(size_t)t * NV + hv]), b = beta[(size_t)t * NV + hv];
        float kv = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_ROWS; r++) {
            const int i = p + r * P;
            if (i < DK) {
                sv[r] *= e;
                kv += sv[r] * (ks[i] * ik);
            }
        }
        part[p * DVB + j] = kv;
        __syncthreads();
        float d = 0.f;
        if (col) {
            d = row[2 * KD + hv * DV + j];
            for (int g = 0; g < P; g++) d -= part[g * DVB + j];
            d *= b;
        }
        __syncthreads();  // every partial of kv read before the partials of o overwrite them
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_ROWS; r++) {
            const int i = p + r * P;
            if (i < DK) {
                sv[r] += (ks[i] * ik) * d;
                o += sv[r] * (qs[i] * iq);
            }
        }
        part[p * DVB + j] = o;
        __syncthreads();
        const bool out = col && p == 0;
        o = 0.f;
        if (out)
            for (int g = 0; g < P; g++) o += part[g * DVB + j];
        const float ss = gdn_block_sum(out ? o * o : 0.f, red, tid, nthreads);
        if (out) {
            const float inv = 1.f / sqrtf(ss / (float)DV + eps);
            const float zv = z[(size_t)t * VD + hv * DV + j];
            core[(size_t)t * VD + hv * DV + j] = o * inv * norm_w[j] * silu(zv);
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_ROWS; r++) {
        const int i = p + r * P;
        if (col && i < DK) S[(size_t)i * DV + j] = sv[r];
    }
}

// Output-gated attention: the q projection's rows [T, 2·NH·D] hold per head D query values
// then D gate values; the query values go to q_out (row stride ld), the gates to gate [T, NH·D].
extern "C" __global__ void gate_split(const float* __restrict__ qg, int T, int NH, int D, float* __restrict__ q_out,
                                      int ld, float* __restrict__ gate) {
    pdl_wait();
    const size_t n = (size_t)T * NH * D;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / (NH * D);
        const int e = (int)(i % (NH * D)), h = e / D, d = e % D;
        const float* src = qg + t * 2 * NH * D + (size_t)h * 2 * D;
        q_out[t * ld + e] = src[d];
        gate[i] = src[D + d];
    }
}

// attn[i] *= sigmoid(gate[i]) over n values.
extern "C" __global__ void gate_mul(float* __restrict__ attn, const float* __restrict__ gate, u64 n) {
    pdl_wait();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        attn[i] *= 1.f / (1.f + expf(-gate[i]));
}
