// moe.cu — the mixture-of-experts pieces of the LLM graph. Compiled after matvec.cu in one
// module: the indexed expert matvec is matvec.cu's `matvec_body` on segments it looks up at run
// time, so decode runs the routed experts inside the captured graph with no host round trip.
//
// Decode, per MoE layer (x = the residual stream h, normed by the matvec prologues):
//   matvec(router, RMSNorm fused) → logits[E] (+ the shared-expert gate's logit at [E])
//   moe_route                      → ids[k], w[k] (softmax, top-k, renormalisation)
//   moe_mv_* (gate|up, SwiGLU)     → act[slot·F ..], one launch over the k slots (blockIdx.y)
//   moe_mv_* (down)                → y[slot·H ..]
//   (shared expert: the plain matvecs into act[k·F ..] and y[k·H ..])
//   moe_combine                    → h += Σ w[slot]·y[slot] (+ sigmoid(gate)·y_shared)
// Prefill: moe_route over the chunk's router logits, a readback of the ids, then per expert
// moe_gather (its rows), GEMMs, moe_scatter_add (weighted, back into h).
// Reference: cmf_gpu::llm::reference::{route, moe} (parity: tests/cuda/moe.rs).

#define MOE_MAX_K 32
#define MOE_ROUTE_THREADS 256

// One expert's planes as the host packs them (u64 each): w[gate, up, down], then the scales,
// then the column fields (q8_2f; else null).
struct MoeExpert {
    const u8* w[3];
    const u16* rs[3];
    const u16* col[3];
};

// (v, i) becomes the better of itself and (v2, i2): larger value, ties to the lower index.
__device__ __forceinline__ void moe_better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// Routing of `rows` router outputs (one block per row): logits [rows, ld], the first E of
// each row. p = softmax(logits); the k largest p (ties: the lower id) and their weights, best
// first, renormalised to sum 1 when norm_topk. ids [rows, k] i32, w [rows, k] f32.
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route(const float* logits, int ld, int E, int k,
                                                                         int norm_topk, int* ids, float* wts) {
    pdl_wait();
    pdl_trigger();
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nw = blockDim.x >> 5;
    const float* x = logits + (size_t)row * ld;
    __shared__ float red[32];
    __shared__ int redi[32];
    __shared__ int chosen[MOE_MAX_K];
    __shared__ float chosen_p[MOE_MAX_K];
    __shared__ float bc[2];

    float m = NEG_INF;
    for (int i = tid; i < E; i += blockDim.x) m = fmaxf(m, x[i]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (tid == 0) {
        float v = red[0];
        for (int w = 1; w < nw; w++) v = fmaxf(v, red[w]);
        bc[0] = v;
    }
    __syncthreads();
    m = bc[0];
    float s = 0.f;
    for (int i = tid; i < E; i += blockDim.x) s += expf(x[i] - m);
    s = block_sum(s, red);
    const float inv = 1.f / s;
    __syncthreads();  // every warp has read `red` before the rounds reuse it

    for (int r = 0; r < k; r++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = tid; i < E; i += blockDim.x) {
            bool taken = false;
            for (int j = 0; j < r; j++) taken |= chosen[j] == i;
            if (!taken) moe_better(bv, bi, expf(x[i] - m) * inv, i);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(FULL_MASK, bv, o);
            int i2 = __shfl_xor_sync(FULL_MASK, bi, o);
            moe_better(bv, bi, v2, i2);
        }
        if (lane == 0) {
            red[warp] = bv;
            redi[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < nw; w++) moe_better(bv, bi, red[w], redi[w]);
            // NaN scores choose nothing: take the first untaken id (any valid id keeps the
            // expert matvecs in bounds; the output is NaN either way).
            if (bi >= E) {
                for (bi = 0; bi < E; bi++) {
                    bool t = false;
                    for (int j = 0; j < r; j++) t |= chosen[j] == bi;
                    if (!t) break;
                }
            }
            chosen[r] = bi;
            chosen_p[r] = bv;
        }
        __syncthreads();
    }
    if (tid == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; j++) sum += chosen_p[j];
        const float scale = norm_topk ? 1.f / sum : 1.f;
        for (int j = 0; j < k; j++) {
            ids[(size_t)row * k + j] = chosen[j];
            wts[(size_t)row * k + j] = chosen_p[j] * scale;
        }
    }
}

// The matvec of the expert chosen for slot blockIdx.y, from the expert table:
//   first = 0: y[slot·y_stride + j] = silu(gate_j · x̂) · (up_j · x̂)  (x̂ = x, RMSNorm'd by `norm`)
//   first = 2: y[slot·y_stride + j] = down_j · x[slot·x_stride ..]
struct MoeMvArgs {
    const MoeExpert* table;
    const int* ids;  // [k] chosen experts
    int E;
    int first;
    int rows;  // rows of each matrix
    int K;
    const float* x;
    long long x_stride;
    const float* norm;
    float eps;
    int _pad;
    float* y;
    long long y_stride;
};

template <int CODEC>
__device__ __forceinline__ void moe_mv(const MoeMvArgs& m) {
    // The expert id comes from the predecessor (moe_route): wait before resolving any weight.
    pdl_wait();
    const int slot = blockIdx.y;
    const int id = min(max(m.ids[slot], 0), m.E - 1);
    const MoeExpert& e = m.table[id];
    MvArgs a;
    const int nseg = m.first == 0 ? 2 : 1;
#pragma unroll
    for (int s = 0; s < 3; s++) {
        const bool on = s < nseg;
        a.seg[s].w = on ? e.w[m.first + s] : nullptr;
        a.seg[s].rs = on ? e.rs[m.first + s] : nullptr;
        a.seg[s].col = on ? e.col[m.first + s] : nullptr;
        a.seg[s].bias = nullptr;
        a.seg[s].rows = on ? m.rows : 0;
        a.seg[s].row0 = s * m.rows;
    }
    a.nseg = nseg;
    a.K = m.K;
    a.x = m.x + (size_t)slot * m.x_stride;
    a.norm = m.norm;
    a.eps = m.eps;
    a.y = m.y + (size_t)slot * m.y_stride;
    a.mode = m.first == 0 ? 2 : 0;
    a.jobs = m.first == 0 ? m.rows : (m.rows + 1) / 2;
    matvec_body<CODEC>(a);
}

extern "C" __global__ void __launch_bounds__(256, MV_MINB) moe_mv_q8(const MoeMvArgs m) { moe_mv<CODEC_Q8>(m); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) moe_mv_q4(const MoeMvArgs m) { moe_mv<CODEC_Q4>(m); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) moe_mv_bf16(const MoeMvArgs m) { moe_mv<CODEC_BF16>(m); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) moe_mv_f16(const MoeMvArgs m) { moe_mv<CODEC_F16>(m); }
extern "C" __global__ void __launch_bounds__(256, MV_MINB) moe_mv_f32(const MoeMvArgs m) { moe_mv<CODEC_F32>(m); }

// h[i] += Σ_slot w[slot]·y[slot·H + i] (+ g·y_shared[i], g = sigmoid(*shared_logit), or 1
// without a gate), slots in order as the CPU model adds them.
extern "C" __global__ void moe_combine(float* h, const float* y, const float* w, int k, const float* y_shared,
                                       const float* shared_logit, int H) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= H) return;
    float acc = 0.f;
    for (int s = 0; s < k; s++) acc += w[s] * y[(size_t)s * H + i];
    if (y_shared) {
        const float g = shared_logit ? 1.f / (1.f + expf(-shared_logit[0])) : 1.f;
        acc += g * y_shared[i];
    }
    h[i] += acc;
}

// out_f[j] = x[rows[j]], out_b[j] = bf16 of it (one block per row j).
extern "C" __global__ void moe_gather(const float* x, const int* rows, int H, float* out_f, u16* out_b) {
    const int j = blockIdx.x;
    const float* src = x + (size_t)rows[j] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = src[i];
        out_f[(size_t)j * H + i] = v;
        out_b[(size_t)j * H + i] = f32_to_bf16(v);
    }
}

// h[r] += c_j · y[j] for each row j (one block per row), r = rows ? rows[j] : j,
// c_j = (w ? w[j] : 1) · (gate_logit ? sigmoid(gate_logit[r]) : 1). Rows are distinct within
// a launch, so no two blocks write the same row.
extern "C" __global__ void moe_scatter_add(float* h, const float* y, const int* rows, const float* w,
                                           const float* gate_logit, int H) {
    const int j = blockIdx.x;
    const int r = rows ? rows[j] : j;
    float c = w ? w[j] : 1.f;
    if (gate_logit) c *= 1.f / (1.f + expf(-gate_logit[r]));
    for (int i = threadIdx.x; i < H; i += blockDim.x) h[(size_t)r * H + i] += c * y[(size_t)j * H + i];
}
