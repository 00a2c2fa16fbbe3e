// dit.cu — the row operations of the Z-Image DiT between its GEMMs (cuda/dit.rs).
//
// Design. The residual stream X [R, D] stays on the device as f32, or as bf16 with X_BF16 = 1
// (cuda/dit.rs `RESIDUAL_BF16`; diffusers' bf16 pipeline keeps it in bf16 too): the kernels that
// read or update it (rms_mod, residual_norm, bias_pad_rows, final_norm_bf16) work in f32 and round
// once per update, and take `xt` rows. Every GEMM takes bf16 operands
// (cuBLAS, f32 accumulate, bf16 out), so each kernel here that feeds a GEMM writes bf16. Rows of
// several batch items share the weights: the host lays them out [img0 | img1 | cap0 | cap1] and
// describes each row by a map entry (MAPW ints):
//   {item, J, L, p, rope_row}: the row belongs to `item`, whose joint sequence starts at row J
//   of the attention buffers and has L rows; the row is position p of it; its RoPE angles are row
//   `rope_row` of the cos/sin tables.
// Attention runs per item over its own joint sequence (attn_full_fa2 in attention.cu), so Q is
// written in joint order (row J + p) and K/V into the item's [NH, L, HD] f16 slice at offset
// NH·J·HD; the attention kernel writes its bf16 output straight back at the X rows.
// Every block GEMM writes bf16 (half the bytes of f32 for the kernels that read them).
// Modulation (adaLN): `mod` points at one block's [4, D] slice of item 0; item i's slice is
// `mod + i·mod_stride`; slots: 0 scale_msa, 1 gate_msa, 2 scale_mlp, 3 gate_mlp, finished once a
// step by ada_finish (1 + scale, tanh(gate), as diffusers applies them), so the row kernels only
// multiply. mod = 0: unmodulated (the context refiner). A null norm weight (w, next_w): ada_finish
// folded it into the modulation.
// Fusions: sandwich RMSNorm + gate + residual + the next pre-norm (+ its adaLN scale) in one
// pass (`residual_norm`); q/k RMSNorm + interleaved RoPE + the f16 K/V write (`qk_norm_rope`,
// which also folds each head's V amax into v_amax and writes e4m3 Q and K when the FP8
// attention runs; `k_norm_rope` does K and the V maxima alone, faster, where the attention makes
// Q and reads V from the q|k|v rows itself: the Hopper kernels' default).
// Range guard: K and V are stored as f16; values are clamped to ±65504 so an outlier saturates
// instead of becoming inf.
// FP8 GEMM inputs (`--dit-precision`, cuda/dit_rows.rs): the kernels that feed a GEMM (rms_mod,
// residual_norm, swiglu) write either bf16 rows out_b or, when out_q is set because the consuming
// GEMM runs in FP8, e4m3 rows out_q with one f32 scale per row out_s (e4m3.cuh), made from the
// f32 values: what quant_rows_e4m3 would make of the bf16 rows, except that the values skip the
// bf16 rounding (amax and the bytes come from the f32 values), so a byte can differ where that
// rounding would have crossed an e4m3 rounding boundary. Compiled with ROW8_S8=1 (the int8
// path, cuda/int8.rs) the same out_q rows are s8 instead (e4m3.cuh's row8 encoding), as
// quant_rows_s8 makes them. Such a kernel keeps its row's values in
// dynamic shared memory (the stash) until the row's amax is known.
// Row access (rms_mod, residual_norm, swiglu): one block per row, each thread taking groups of 4
// values (16-byte f32, 8-byte bf16, 4-byte e4m3 accesses) when the width is a multiple of 4 and
// the rows are aligned (D = 3840, F = 10240 at full size), else single values (the tiny fixture's
// F = 341): one template body per kernel, V = 4 or 1 (Vf, common.cuh).
// Compile-time: HD (head dim). Reference: cmf-zimage transformer.rs `Block::forward`.

#ifndef HD
#define HD 128
#endif
#define MAPW 5
#define F16_MAX 65504.f
#ifndef X_BF16
#define X_BF16 0
#endif
#if X_BF16
typedef u16 xt;
#else
typedef float xt;
#endif
// Scales a residual row pointer for row_vec4's alignment test (a 4-group of bf16 is 8 bytes).
#define X_ALIGN (X_BF16 ? 2 : 1)


// Group g (V values, common.cuh) of an output row: bf16 to out_b (the row), or (out_q set) into
// the e4m3 stash, folding |v| into amax.
template <int V>
__device__ __forceinline__ void put(const Vf<V>& v, int g, u16* out_b, const u8* out_q, float* stash, float& amax) {
    if (out_q) {
        st_f32<V>(stash + V * g, v);
#pragma unroll
        for (int j = 0; j < V; j++) amax = fmaxf(amax, fabsf(v.v[j]));
    } else {
        st_bf16<V>(out_b + V * g, v);
    }
}

// A group of V values of a row, f32 or bf16 (the row kernels read both), and its store.
template <int V>
__device__ __forceinline__ Vf<V> ld_vals(const float* p) { return ld_f32<V>(p); }
template <int V>
__device__ __forceinline__ Vf<V> ld_vals(const u16* p) { return ld_bf16<V>(p); }
template <int V>
__device__ __forceinline__ void st_vals(float* p, const Vf<V>& a) { st_f32<V>(p, a); }
template <int V>
__device__ __forceinline__ void st_vals(u16* p, const Vf<V>& a) { st_bf16<V>(p, a); }
// One residual value as f32, and its store.
__device__ __forceinline__ float ld_x(const float* p) { return *p; }
__device__ __forceinline__ float ld_x(const u16* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ void st_x(float* p, float v) { *p = v; }
__device__ __forceinline__ void st_x(u16* p, float v) { *p = f32_to_bf16(v); }

// Σ x² over a row of n values, f32 or bf16 (all threads get it).
template <int V, typename T>
__device__ __forceinline__ float row_sumsq(const T* x, int n, float* red) {
    float ss = 0.f;
    for (int g = threadIdx.x; g < n / V; g += blockDim.x) {
        const Vf<V> a = ld_vals<V>(x + V * g);
#pragma unroll
        for (int j = 0; j < V; j++) ss += a.v[j] * a.v[j];
    }
    return block_sum(ss, red);
}

// One row of a block GEMM's output as residual_norm and swiglu read it: bf16 values b, or, on
// the int8 path (b null), the GEMM's exact s32 sums acc scaled by the row's activation scale xs
// and each column's weight scale ws (cuda/int8.rs: the scaling pass those kernels then skip, its
// values exactly: (sum · xs) · ws in f32, without the bf16 rounding). The scale is read when the
// row is set up, before any barrier: the kernel may overwrite it with its own output's scale
// (the same row of the same buffer) after one.
struct GemmRow {
    const u16* b;
    const int* acc;
    const float* ws;
    float xs;
};
// Row r of a GEMM's [R, n] output (row stride n): bf16 at b, else sums at acc.
__device__ __forceinline__ GemmRow gemm_row(const u16* b, const int* acc, const float* xs, const float* ws,
                                            long long r, long long n) {
    GemmRow g;
    g.b = b ? b + r * n : nullptr;
    g.acc = b ? nullptr : acc + r * n;
    g.ws = ws;
    g.xs = b ? 1.f : xs[r];
    return g;
}
// V values of the row from column i.
template <int V>
__device__ __forceinline__ Vf<V> ld_gemm(const GemmRow& o, int i) {
    if (o.b) return ld_bf16<V>(o.b + i);
    Vf<V> a;
    if constexpr (V == 4) {
        const int4 q = *(const int4*)(o.acc + i);
        const float4 w = *(const float4*)(o.ws + i);
        a.v[0] = (float)q.x * o.xs * w.x, a.v[1] = (float)q.y * o.xs * w.y;
        a.v[2] = (float)q.z * o.xs * w.z, a.v[3] = (float)q.w * o.xs * w.w;
    } else {
        a.v[0] = (float)o.acc[i] * o.xs * o.ws[i];
    }
    return a;
}
// The alignment bits of a GemmRow for row_vec4 (s32 and f32 groups of 4 are 16 bytes).
__device__ __forceinline__ u64 gemm_bits(const GemmRow& o) { return 2 * (u64)o.b | (u64)o.acc | (u64)o.ws; }

// Group g of a row being normalised: v · inv · w[group] (w null: folded into the modulation,
// v · inv).
template <int V>
__device__ __forceinline__ void norm_scale(Vf<V>& v, float inv, const float* w, int g) {
    if (w) {
        const Vf<V> wv = ld_f32<V>(w + V * g);
#pragma unroll
        for (int j = 0; j < V; j++) v.v[j] *= inv * wv.v[j];
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) v.v[j] *= inv;
    }
}

// One row of rms_mod: xr, sc (null: unmodulated), out_b / out_q / out_s at the row.
template <int V>
__device__ __forceinline__ void rms_mod_row(const xt* xr, const float* w, float eps, int D, const float* sc,
                                            u16* out_b, u8* out_q, float* out_s, float* red, float* stash) {
    const float inv = rsqrtf(row_sumsq<V>(xr, D, red) / (float)D + eps);
    float amax = 0.f;
    for (int g = threadIdx.x; g < D / V; g += blockDim.x) {
        Vf<V> v = ld_vals<V>(xr + V * g);
        norm_scale<V>(v, inv, w, g);
        if (sc) {
            const Vf<V> s = ld_f32<V>(sc + V * g);
#pragma unroll
            for (int j = 0; j < V; j++) v.v[j] *= s.v[j];
        }
        put<V>(v, g, out_b, out_q, stash, amax);
    }
    if (out_q) emit_row8<V>(stash, D, amax, red, out_q, out_s);
}

// out[r] = rmsnorm(x[r]) · w · (1 + scale[item])   (R blocks; scale slot `slot`), bf16 or e4m3.
// Dynamic smem: the e4m3 stash (D floats) when out_q.
extern "C" __global__ void rms_mod(const xt* x, const float* w, float eps, int D, const float* mod,
                                   long long mod_stride, int slot, const int* map, u16* out_b, u8* out_q,
                                   float* out_s) {
    __shared__ float red[32];
    extern __shared__ __align__(16) float rowsm[];
    const long long r = blockIdx.x;
    const xt* xr = x + r * D;
    const float* sc = mod ? mod + map[r * MAPW] * mod_stride + (long long)slot * D : nullptr;
    u16* ob = out_b ? out_b + r * D : nullptr;
    u8* oq = out_q ? out_q + r * D : nullptr;
    float* os = out_q ? out_s + r : nullptr;
    if (row_vec4(D, X_ALIGN * (u64)xr | (u64)w | (u64)sc | 2 * (u64)ob | 4 * (u64)oq))
        rms_mod_row<4>(xr, w, eps, D, sc, ob, oq, os, red, rowsm);
    else
        rms_mod_row<1>(xr, w, eps, D, sc, ob, oq, os, red, rowsm);
}

// One row of residual_norm: xr, orow, the norm weights w and next_w, the gate g and scale sc (each
// null: none), outputs at the row (null: no next pre-norm).
template <int V>
__device__ __forceinline__ void residual_norm_row(xt* xr, const GemmRow& orow, const float* w, float eps, int D,
                                                  const float* g, const float* next_w, const float* sc, u16* out_b,
                                                  u8* out_q, float* out_s, float* red, float* row) {
    float ss = 0.f;
    for (int k = threadIdx.x; k < D / V; k += blockDim.x) {
        const Vf<V> a = ld_gemm<V>(orow, V * k);
#pragma unroll
        for (int j = 0; j < V; j++) ss += a.v[j] * a.v[j];
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)D + eps);
    float ss2 = 0.f;
    for (int k = threadIdx.x; k < D / V; k += blockDim.x) {
        const Vf<V> o = ld_gemm<V>(orow, V * k);
        Vf<V> nx = ld_vals<V>(xr + V * k);
        Vf<V> wv, gv;
        if (w) wv = ld_f32<V>(w + V * k);
        if (g) gv = ld_f32<V>(g + V * k);
#pragma unroll
        for (int j = 0; j < V; j++) {
            float v = o.v[j] * inv;
            if (w) v *= wv.v[j];
            if (g) v *= gv.v[j];
            nx.v[j] += v;
            ss2 += nx.v[j] * nx.v[j];
        }
        st_vals<V>(xr + V * k, nx);
        st_f32<V>(row + V * k, nx);  // the next pre-norm reads the unrounded row
    }
    if (!out_b && !out_q) return;
    const float inv2 = rsqrtf(block_sum(ss2, red) / (float)D + eps);
    float amax = 0.f;
    for (int k = threadIdx.x; k < D / V; k += blockDim.x) {
        Vf<V> v = ld_f32<V>(row + V * k);
        norm_scale<V>(v, inv2, next_w, k);
        if (sc) {
            const Vf<V> s = ld_f32<V>(sc + V * k);
#pragma unroll
            for (int j = 0; j < V; j++) v.v[j] *= s.v[j];
        }
        put<V>(v, k, out_b, out_q, row, amax);
    }
    if (out_q) emit_row8<V>(row, D, amax, red, out_q, out_s);
}

// x[r] += tanh(gate[item]) · rmsnorm(o[r]) · w   (gate = 1 when mod = 0; o is the bf16 output of
// the O or w2 GEMM: half the bytes of f32 to write and read back; or, o null, its s32 sums o_acc
// with scales o_xs, o_ws: GemmRow), then, when out_b or out_q:
// out[r] = rmsnorm(x[r]) · next_w · (1 + next_mod[item][next_slot]), bf16 or e4m3  (R blocks).
// Dynamic smem: D floats (the updated row, then the e4m3 stash in its place).
// The register cap (RN_MAXNREG; 0: none) decides the blocks an SM:
// at 256 threads 36 registers held six, 32 hold eight. Latency-bound (ncu, 2026-12-04: DRAM at
// 39 % of peak, warps stalled on their loads), so more rows in flight pay: 53.5 → 46.4 µs on
// bf16 rows, 67.3 → 61.1 on the int8 sums (warps active 68 → 91 %).
#ifndef RN_MAXNREG
#define RN_MAXNREG 32
#endif
#if RN_MAXNREG
#define RN_BOUNDS __maxnreg__(RN_MAXNREG)
#else
#define RN_BOUNDS
#endif
extern "C" __global__ void RN_BOUNDS residual_norm(xt* x, const u16* o, const int* o_acc, const float* o_xs, const float* o_ws,
                                         const float* w, float eps, int D, const float* mod,
                                         int gate_slot, const float* next_w, const float* next_mod, int next_slot,
                                         long long mod_stride, const int* map, u16* out_b, u8* out_q, float* out_s) {
    __shared__ float red[32];
    extern __shared__ __align__(16) float rowsm[];
    const long long r = blockIdx.x;
    const int item = map[r * MAPW];
    xt* xr = x + r * D;
    const GemmRow orow = gemm_row(o, o_acc, o_xs, o_ws, r, D);
    const float* g = mod ? mod + item * mod_stride + (long long)gate_slot * D : nullptr;
    const float* sc = next_mod ? next_mod + item * mod_stride + (long long)next_slot * D : nullptr;
    u16* ob = out_b ? out_b + r * D : nullptr;
    u8* oq = out_q ? out_q + r * D : nullptr;
    float* os = out_q ? out_s + r : nullptr;
    const u64 bits = X_ALIGN * (u64)xr | gemm_bits(orow) | (u64)w | (u64)g | (u64)next_w | (u64)sc | 2 * (u64)ob | 4 * (u64)oq;
    if (row_vec4(D, bits))
        residual_norm_row<4>(xr, orow, w, eps, D, g, next_w, sc, ob, oq, os, red, rowsm);
    else
        residual_norm_row<1>(xr, orow, w, eps, D, g, next_w, sc, ob, oq, os, red, rowsm);
}

// qkv [R, 3D] (q | k | v per row) → per head: q, k RMSNorm (norm_q/norm_k, eps) and interleaved
// RoPE (pairs (2j, 2j+1) rotated by angle row rope_row, pair j); q to q_out[J + p] (f32, or f16
// with q_half; [*, NH, HD]); k, v to the item's f16 slices kc/vc + NH·J·HD, layout [NH, L, HD].
// Rows per qk_norm_rope block (each warp loops over them): the FP8 attention's V maxima then take
// one atomic per head and QKR_ROWS rows, not one per row (one per row cost 3 ms per 1024² step in
// contention on the NH addresses).
#define QKR_ROWS 16
// Lanes per head: each lane takes 8 consecutive values (16 bytes of bf16, 4 RoPE pairs), so a warp
// covers QKR_HPW heads of a row in one 512-byte load (HD = 128: 2 heads) — four times the bytes in
// flight of a lane per pair, which left the kernel latency-bound at ~2 TB/s.
#define QKR_LPH (HD / 8)
#define QKR_HPW (32 / QKR_LPH)

// What one lane needs of one row: its 8 values of qkv and, for q and k, the RoPE cos and sin of
// their 4 pairs.
struct QkRow {
    uint4 pr;
    float4 cs, sn;
};

// Loads unit u's (= kind·NH + head: the row's heads are contiguous) 8 values at li of row r of
// qkv, and for q and k RoPE table row rr; zeros where the unit is past the row.
__device__ __forceinline__ void qk_load_row(const u16* qkv, long long r, int NH, int u, int li, const float* cosb,
                                            const float* sinb, long long rr, QkRow& o) {
    const bool in = u < 3 * NH, rope = in && u < 2 * NH;
    o.pr = in ? *(const uint4*)(qkv + r * 3 * NH * HD + (long long)u * HD + 8 * li) : make_uint4(0u, 0u, 0u, 0u);
    o.cs = rope ? *(const float4*)(cosb + rr * (HD / 2) + 4 * li) : make_float4(0.f, 0.f, 0.f, 0.f);
    o.sn = rope ? *(const float4*)(sinb + rr * (HD / 2) + 4 * li) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// Max over a head's QKR_LPH lanes (aligned groups of the warp; every lane calls it).
__device__ __forceinline__ float head_max(float v) {
#pragma unroll
    for (int o = QKR_LPH / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Eight floats as f16 (saturating) / bf16 / e4m3 (times inv) at p.
__device__ __forceinline__ void st_f16x8(u16* p, const float* v) { *(uint4*)p = qkn_pack_f16x8(v); }
__device__ __forceinline__ void st_bf16x8(u16* p, const float* v) {
    *(uint4*)p = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                            pack_bf16x2(v[6], v[7]));
}
__device__ __forceinline__ void st_e4m3x8(u8* p, const float* v, float inv) {
    *(uint2*)p = make_uint2(pack_e4m3x4(v, inv), pack_e4m3x4(v + 4, inv));
}

// One lane's 8 values of one row's unit (kind, head h; the item's rows start at J, L of them, this
// one at p), with nw its 8 values of the q or k norm weight; returns their |value| max for V (0
// otherwise). Every lane runs the reductions (warps may mix kinds where 3·NH is not a multiple of
// QKR_HPW); the stores diverge.
__device__ __forceinline__ float qk_norm_rope_row(const QkRow& in, const float* nw, float eps, long long J,
                                                  long long L, long long p, int NH, int kind, int h, int li,
                                                  float* q_out, u16* kc, u16* vc, u8* q8, float* q8_scale, u8* k8,
                                                  float k8_inv, int q_half, int v_bf16) {
    const float cs[4] = {in.cs.x, in.cs.y, in.cs.z, in.cs.w}, sn[4] = {in.sn.x, in.sn.y, in.sn.z, in.sn.w};
    float v[8];
    qkn_unpack_bf16x8(in.pr, v);
    qkn_norm_rope8(v, nw, eps, cs, sn, kind < 2);
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) amax = fmaxf(amax, fabsf(v[k]));
    // The FP8 attention's Q rows: e4m3 with a scale per row and head (e4m3.cuh's row encoding).
    const float qs = e4m3_scale(head_max(amax));
    const long long qrow = (J + p) * NH + h, kvrow = (long long)NH * J + (long long)h * L + p;
    if (kind == 0 && q8) {
        st_e4m3x8(q8 + qrow * HD + 8 * li, v, 1.f / qs);
        if (li == 0) q8_scale[qrow] = qs;
    } else if (kind == 0 && q_half) {
        st_f16x8((u16*)q_out + qrow * HD + 8 * li, v);
    } else if (kind == 0) {
        *(float4*)(q_out + qrow * HD + 8 * li) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4*)(q_out + qrow * HD + 8 * li + 4) = make_float4(v[4], v[5], v[6], v[7]);
    } else if (kind == 1 && k8) {
        // The FP8 attention's K: e4m3 with the layer's static scale (1 / k8_inv), laid out as kc.
        st_e4m3x8(k8 + kvrow * HD + 8 * li, v, k8_inv);
    } else if (kind == 1) {
        st_f16x8(kc + kvrow * HD + 8 * li, v);
    } else if (kind == 2 && vc) {
        // attn_full_ws's V keeps the GEMM's bf16 values (they came from bf16: the round trip is
        // exact); the older kernels read f16.
        if (v_bf16) st_bf16x8(vc + kvrow * HD + 8 * li, v);
        else st_f16x8(vc + kvrow * HD + 8 * li, v);
    }
    return kind == 2 ? amax : 0.f;
}

// Folds a head's |value| max of item `item` into the item's [NH] V maxima (u32 bits:
// non-negative floats order as their bits do). Every lane calls it (the head maximum shuffles);
// the head's first lane folds where `on` (a V head of a row in range).
__device__ __forceinline__ void fold_amax(unsigned* v_amax, int item, int NH, bool on, int h, float amax, int li) {
    amax = head_max(fminf(amax, F16_MAX));
    if (on && li == 0) atomicMax(v_amax + item * NH + h, __float_as_uint(amax));
}

// q/k RMSNorm + RoPE, f16 K/V. Grid (units / QKR_HPW / 4 rounded up — 3·NH units, 2·NH where V is
// neither copied nor needed for its maxima, NH fewer with q_skip — R / QKR_ROWS rounded up),
// 4 warps: warp w of the grid's x takes units QKR_HPW·w .. + QKR_HPW (unit u: kind u / NH — q, k,
// v — and head u % NH; with q_skip they start at NH: attn_full_ws normalises and rotates Q itself
// as it loads it from the q|k|v rows), QKR_LPH lanes a unit, for QKR_ROWS rows. For the FP8 attention
// (attention_ws8.cu; else null): v_amax, the per-item, per-head V maxima; q8 and q8_scale, Q as
// e4m3 rows [R, NH, HD] with a scale per row and head, in place of q_out; k8, K as e4m3 times
// k8_inv, in place of kc. K needs no maximum: RMSNorm bounds a head's |k| by √HD · max |norm_k|
// (RoPE rotates pairs, keeping that bound), so the host passes the scale. q_half: q_out gets f16
// (saturating, as K) instead of f32 (attn_full_ws reads f16 Q). v_bf16: vc gets V's bf16 values
// as they are (attn_full_ws's V) instead of f16. vc null: no copy of V (the attention kernels
// read it from the q|k|v rows); V is read only for the FP8 attention's maxima then.
// Latency: a warp's rows are serial, so nothing a row needs waits on another load: the rows' map
// entries come in one load (lane i holds row r0 + i's), the norm weight once, and row i + 1's
// qkv values and RoPE values are loaded while row i is worked on.
extern "C" __global__ void __launch_bounds__(128)
qk_norm_rope(const u16* qkv, const float* norm_q, const float* norm_k, float eps, const float* cosb,
             const float* sinb, const int* map, int NH, int R, float* q_out, u16* kc, u16* vc, unsigned* v_amax,
             u8* q8, float* q8_scale, u8* k8, float k8_inv, int q_half, int v_bf16, int q_skip) {
    static_assert(QKR_ROWS <= 32, "qk_norm_rope: a lane holds a row's map entry");
    static_assert(HD % 8 == 0 && QKR_LPH <= 32 && (QKR_LPH & (QKR_LPH - 1)) == 0,
                  "qk_norm_rope: 8 values a lane, a power-of-two group of lanes a head");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Units: q heads (unless the attention makes Q from the rows itself: q_skip), k heads, and V's
    // only where they are copied or their maxima are needed.
    const int units = (vc || v_amax) ? 3 * NH : 2 * NH;
    const int w0 = (q_skip ? NH : 0) + (blockIdx.x * 4 + warp) * QKR_HPW;
    if (w0 >= units) return;  // whole warps only: the reductions need every lane
    const int li = lane % QKR_LPH, u = w0 + lane / QKR_LPH;
    const int kind = u < units ? u / NH : 3, h = u - min(kind, 2) * NH;
    const long long r0 = (long long)blockIdx.y * QKR_ROWS;
    const int n = (int)min((long long)QKR_ROWS, R - r0);
    int mi[MAPW];
#pragma unroll
    for (int e = 0; e < MAPW; e++) mi[e] = lane < n ? map[(r0 + lane) * MAPW + e] : 0;
    float nw[8];
    {
        const float* src = (kind == 0 ? norm_q : norm_k) + 8 * li;
        const float4 a = kind < 2 ? *(const float4*)src : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 b = kind < 2 ? *(const float4*)(src + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        nw[0] = a.x, nw[1] = a.y, nw[2] = a.z, nw[3] = a.w, nw[4] = b.x, nw[5] = b.y, nw[6] = b.z, nw[7] = b.w;
    }
    QkRow cur, next;
    qk_load_row(qkv, r0, NH, u, li, cosb, sinb, __shfl_sync(FULL_MASK, mi[4], 0), cur);
    int item = -1;
    float amax = 0.f;
    for (int i = 0; i < n; i++) {
        if (i + 1 < n) qk_load_row(qkv, r0 + i + 1, NH, u, li, cosb, sinb, __shfl_sync(FULL_MASK, mi[4], i + 1), next);
        const int it = __shfl_sync(FULL_MASK, mi[0], i);
        if (v_amax && it != item) {
            if (item >= 0) fold_amax(v_amax, item, NH, kind == 2, h, amax, li);
            item = it;
            amax = 0.f;
        }
        const float a =
            qk_norm_rope_row(cur, nw, eps, __shfl_sync(FULL_MASK, mi[1], i), __shfl_sync(FULL_MASK, mi[2], i),
                             __shfl_sync(FULL_MASK, mi[3], i), NH, kind, h, li, q_out, kc, vc, q8, q8_scale, k8,
                             k8_inv, q_half, v_bf16);
        amax = fmaxf(amax, a);
        cur = next;
    }
    if (v_amax && item >= 0) fold_amax(v_amax, item, NH, kind == 2, h, amax, li);
}

// ---- k_norm_rope: K, and V's maxima, for the attentions that make Q from the rows ----
// What qk_norm_rope does with q_skip set and vc null, the modes of attn_full_ws (K to kc as f16)
// and attn_full_ws8 (K to k8 as e4m3 · k8_inv; V's per-item, per-head maxima into v_amax), with
// the same bits (qknorm.cuh; gpu_dit's q_from_rows test compares whole steps bit for bit). Why a
// kernel of its own: qk_norm_rope gives a warp one head pair of 16 rows in series, each row
// waiting on its own load, and reloads a row's RoPE tables for every head pair (as many table
// bytes from L2 as K bytes from DRAM; 38 µs a layer at 1024² for 64 MB moved). Here a warp takes
// KR_G head pairs (QKR_HPW heads each) of KR_RPW rows, issues every load before it uses a value,
// and loads a row's table values once for all its pairs.
// Grid (chunks, ceil(R / KR_ROWS)): chunk c < kchunks takes K's pairs KR_G·c .. KR_G·c + KR_G − 1,
// the others V's (v_amax set); a kind has ceil(NH / QKR_HPW) pairs. Block KR_WARPS warps; warp w
// takes rows y·KR_ROWS + w·KR_RPW + i (i < KR_RPW). V's maxima: a lane's |v| maximum over its
// rows, then over the head's lanes, the block's warps (shared atomics) and one global atomic per
// head and block, where the block's rows are of one item; a block on an item boundary folds each
// row's maxima into v_amax instead. One row a warp (KR_RPW): 64 registers, four blocks an SM;
// two rows a warp took 96 registers, two blocks an SM, and measured slower (23 against 20 µs
// bf16, 30 against 26 with the FP8 attention; qk_norm_rope: 39 and 54).
#define KR_G 5
#define KR_RPW 1
#define KR_WARPS 8
#define KR_ROWS (KR_WARPS * KR_RPW)

// Capping it to 40 or 32 registers (six or eight blocks an SM) measured slower: 48 and 58 against
// 21 µs (ncu, 2026-12-04).
extern "C" __global__ void __launch_bounds__(32 * KR_WARPS)
k_norm_rope(const u16* qkv, const float* norm_k, float eps, const float* cosb, const float* sinb, const int* map,
            int NH, int R, int kchunks, u16* kc, u8* k8, float k8_inv, unsigned* v_amax) {
    __shared__ unsigned vmax[KR_G * QKR_HPW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % QKR_LPH, hs = lane / QKR_LPH;
    const bool is_k = (int)blockIdx.x < kchunks;  // uniform over the block
    const int h0 = ((is_k ? (int)blockIdx.x : (int)blockIdx.x - kchunks) * KR_G) * QKR_HPW + hs;
    const long long rb = (long long)blockIdx.y * KR_ROWS, r0 = rb + warp * KR_RPW;
    const long long ld = 3LL * NH * HD;
    const u16* src = qkv + (is_k ? 1 : 2) * NH * HD + 8 * li;
    // Every load first: the rows' map entries, values and (K) table values, and the norm weight.
    int mp[KR_RPW][MAPW];
    uint4 raw[KR_RPW][KR_G];
    float4 cs[KR_RPW], sn[KR_RPW];
#pragma unroll
    for (int i = 0; i < KR_RPW; i++) {
        const long long r = r0 + i;
        const bool in = r < R;
#pragma unroll
        for (int e = 0; e < MAPW; e++) mp[i][e] = in ? map[r * MAPW + e] : 0;
#pragma unroll
        for (int g = 0; g < KR_G; g++) {
            const int h = h0 + g * QKR_HPW;
            raw[i][g] = in && h < NH ? *(const uint4*)(src + r * ld + (long long)h * HD) : make_uint4(0u, 0u, 0u, 0u);
        }
        const long long rr = (long long)mp[i][4] * (HD / 2) + 4 * li;
        cs[i] = is_k && in ? *(const float4*)(cosb + rr) : make_float4(0.f, 0.f, 0.f, 0.f);
        sn[i] = is_k && in ? *(const float4*)(sinb + rr) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (is_k) {
        float nw[8];
        *(float4*)nw = *(const float4*)(norm_k + 8 * li);
        *(float4*)(nw + 4) = *(const float4*)(norm_k + 8 * li + 4);
#pragma unroll
        for (int i = 0; i < KR_RPW; i++) {
            const float c[4] = {cs[i].x, cs[i].y, cs[i].z, cs[i].w}, s[4] = {sn[i].x, sn[i].y, sn[i].z, sn[i].w};
#pragma unroll
            for (int g = 0; g < KR_G; g++) {
                float v[8];
                qkn_unpack_bf16x8(raw[i][g], v);
                qkn_norm_rope8(v, nw, eps, c, s, true);  // every lane: the head sums shuffle
                const int h = h0 + g * QKR_HPW;
                if (r0 + i >= R || h >= NH) continue;
                const long long kvrow = (long long)NH * mp[i][1] + (long long)h * mp[i][2] + mp[i][3];
                if (k8) st_e4m3x8(k8 + kvrow * HD + 8 * li, v, k8_inv);
                else st_f16x8(kc + kvrow * HD + 8 * li, v);
            }
        }
        return;
    }
    // V's maxima.
    for (int i = threadIdx.x; i < KR_G * QKR_HPW; i += blockDim.x) vmax[i] = 0u;
    const int item = map[rb * MAPW];
    bool mine = true;
#pragma unroll
    for (int i = 0; i < KR_RPW; i++) mine = mine && (r0 + i >= R || mp[i][0] == item);
    const bool one_item = __syncthreads_and(mine);  // (also vmax's barrier)
    float acc[KR_G];
#pragma unroll
    for (int g = 0; g < KR_G; g++) acc[g] = 0.f;
#pragma unroll
    for (int i = 0; i < KR_RPW; i++)
#pragma unroll
        for (int g = 0; g < KR_G; g++) {
            float v[8];
            qkn_unpack_bf16x8(raw[i][g], v);
            float a = 0.f;
#pragma unroll
            for (int k = 0; k < 8; k++) a = fmaxf(a, fabsf(v[k]));
            const int h = h0 + g * QKR_HPW;
            if (one_item) acc[g] = fmaxf(acc[g], a);
            else fold_amax(v_amax, mp[i][0], NH, r0 + i < R && h < NH, h, a, li);
        }
    if (!one_item) return;  // uniform over the block
#pragma unroll
    for (int g = 0; g < KR_G; g++) {
        const float a = head_max(fminf(acc[g], F16_MAX));
        if (li == 0) atomicMax(vmax + g * QKR_HPW + hs, __float_as_uint(a));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < KR_G * QKR_HPW; i += blockDim.x) {
        const int h = h0 - hs + (i / QKR_HPW) * QKR_HPW + i % QKR_HPW;
        if (h < NH) atomicMax(v_amax + item * NH + h, vmax[i]);
    }
}

// silu with the fast exponential and division (a few ulps of f32: far below the bf16 or e4m3
// output's rounding; the IEEE pair cost ~20 instructions a value, 1.4e9 values a 1024² step).
// exp(-x) overflowing to inf gives -0 for very negative x, as silu does.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// One row of swiglu: gr the row of gu, outputs at the row.
template <int V>
__device__ __forceinline__ void swiglu_row(const GemmRow& gr, int F, u16* out_b, u8* out_q, float* out_s, float* red,
                                           float* stash) {
    float amax = 0.f;
    for (int k = threadIdx.x; k < F / V; k += blockDim.x) {
        const Vf<V> a = ld_gemm<V>(gr, V * k), b = ld_gemm<V>(gr, F + V * k);
        Vf<V> y;
#pragma unroll
        for (int j = 0; j < V; j++) y.v[j] = silu_fast(a.v[j]) * b.v[j];
        put<V>(y, k, out_b, out_q, stash, amax);
    }
    if (out_q) emit_row8<V>(stash, F, amax, red, out_q, out_s);
}

// gu [R, 2F] bf16 (w1 | w3 per row; or, gu null, its s32 sums acc with scales xs, ws: GemmRow)
// → out[r, i] = silu(gu[r, i]) · gu[r, F + i], bf16 or 8-bit. R blocks (one per row: an 8-bit
// row needs its amax). Dynamic smem: the 8-bit stash (F floats) when out_q.
extern "C" __global__ void swiglu(const u16* gu, const int* acc, const float* xs, const float* ws, int F, u16* out_b,
                                  u8* out_q, float* out_s) {
    __shared__ float red[32];
    extern __shared__ __align__(16) float rowsm[];
    const long long r = blockIdx.x;
    const GemmRow gr = gemm_row(gu, acc, xs, ws, r, 2 * F);
    u16* ob = out_b ? out_b + r * F : nullptr;
    u8* oq = out_q ? out_q + r * F : nullptr;
    float* os = out_q ? out_s + r : nullptr;
    if (row_vec4(F, gemm_bits(gr) | 2 * (u64)ob | 4 * (u64)oq))
        swiglu_row<4>(gr, F, ob, oq, os, red, rowsm);
    else
        swiglu_row<1>(gr, F, ob, oq, os, red, rowsm);
}

// ---- swiglu_r8 / swiglu_r16: swiglu with the row in registers ----
// swiglu's contract for rows whose width F is a multiple of P (8 or 16) with F / P ≤ 1024 and
// 16-byte aligned pointers (cuda/dit_rows.rs picks them then; the full-size F = 10240 takes 640
// threads of 16): one block per row of F / P threads rounded up to whole warps, each thread holding
// its P values (groups strided across the warp: swiglu_rr_groups) from its loads to its stores; an
// 8-bit row needs no stash and one reduction of one barrier. The values and bytes are swiglu's.
// Measured (H200, 2026-12-02, ncu at 4128 rows): 63 → 50 µs with e4m3 output, 60–61 → 59 with
// bf16; on 2026-12-04 (the strided groups and the register cap below): 106 → 58 and 90 → 59. The same treatment of
// rms_mod and residual_norm measured no faster (45 against 44 µs bf16, 52 against 48 e4m3: they
// move as many bytes written as read, and at ~3 TB/s that mix is their bound), so they keep their
// shared-memory form (BENCH.md, 2026-12-02).

// P bf16 values at p (16-byte aligned) as f32, and P values as bf16 / row8 bytes (· inv) at p.
template <int P>
__device__ __forceinline__ void ld_row(const u16* p, float* v) {
#pragma unroll
    for (int i = 0; i < P / 8; i++) qkn_unpack_bf16x8(*(const uint4*)(p + 8 * i), v + 8 * i);
}
template <int P>
__device__ __forceinline__ void st_row(u16* p, const float* v) {
#pragma unroll
    for (int i = 0; i < P / 8; i++) st_bf16x8(p + 8 * i, v + 8 * i);
}
template <int P>
__device__ __forceinline__ void st_row_row8(u8* p, const float* v, float inv) {
#pragma unroll
    for (int i = 0; i < P / 8; i++) *(uint2*)(p + 8 * i) = make_uint2(pack_row8x4(v + 8 * i, inv), pack_row8x4(v + 8 * i + 4, inv));
}

// G values of a GemmRow from column c (one 16-byte load: G = 8 bf16, or 4 s32 sums with their
// 4 column scales) as f32.
template <int G>
__device__ __forceinline__ void ld_gemm_group(const GemmRow& g, int c, float* v) {
    if constexpr (G == 8) {
        ld_row<8>(g.b + c, v);
    } else {
        const Vf<4> a = ld_gemm<4>(g, c);
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = a.v[j];
    }
}
// G values (8 or 4) as bf16 or row8 bytes (· inv) at p.
template <int G>
__device__ __forceinline__ void st_group(u16* p, const float* v) {
    if constexpr (G == 8) {
        st_row<8>(p, v);
    } else {
        Vf<4> a;
#pragma unroll
        for (int j = 0; j < 4; j++) a.v[j] = v[j];
        st_bf16<4>(p, a);
    }
}
template <int G>
__device__ __forceinline__ void st_group_row8(u8* p, const float* v, float inv) {
    if constexpr (G == 8) st_row_row8<8>(p, v, inv);
    else *(u32*)p = pack_row8x4(v, inv);
}

// swiglu_rr's body for groups of G values: thread t's group i at column G·(t + i·blockDim.x),
// so that each load instruction of a warp reads one contiguous span.
template <int P, int G>
__device__ __forceinline__ void swiglu_rr_groups(const GemmRow& gr, long long r, int F, u16* out_b, u8* out_q,
                                                 float* out_s, float* red) {
    float y[P], amax = 0.f;
#pragma unroll
    for (int i = 0; i < P / G; i++) {
        const int c = G * (threadIdx.x + i * blockDim.x);
        if (c < F) {
            float a[G], b[G];
            ld_gemm_group<G>(gr, c, a);
            ld_gemm_group<G>(gr, F + c, b);
#pragma unroll
            for (int j = 0; j < G; j++) {
                y[G * i + j] = silu_fast(a[j]) * b[j];
                amax = fmaxf(amax, fabsf(y[G * i + j]));
            }
        }
    }
    float inv = 0.f;
    if (out_q) {
        const float s = row8_scale(block_max_once(amax, red));
        inv = 1.f / s;
        if (threadIdx.x == 0) out_s[r] = s;
    }
#pragma unroll
    for (int i = 0; i < P / G; i++) {
        const int c = G * (threadIdx.x + i * blockDim.x);
        if (c >= F) continue;
        if (out_q) st_group_row8<G>(out_q + r * F + c, y + G * i, inv);
        else st_group<G>(out_b + r * F + c, y + G * i);
    }
}

template <int P>
__device__ __forceinline__ void swiglu_rr(const u16* gu, const int* acc, const float* xs, const float* ws, int F,
                                          u16* out_b, u8* out_q, float* out_s) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const GemmRow gr = gemm_row(gu, acc, xs, ws, r, 2 * F);
    if (gr.b)
        swiglu_rr_groups<P, 8>(gr, r, F, out_b, out_q, out_s, red);
    else
        swiglu_rr_groups<P, 4>(gr, r, F, out_b, out_q, out_s, red);
}

extern "C" __global__ void __launch_bounds__(1024)
swiglu_r8(const u16* gu, const int* acc, const float* xs, const float* ws, int F, u16* out_b, u8* out_q,
          float* out_s) {
    swiglu_rr<8>(gu, acc, xs, ws, F, out_b, out_q, out_s);
}
// The register cap decides the blocks an SM at F = 10240 (640 threads): 56 registers held one, 48
// two, 32 three. Three run fastest on bf16 rows (ncu, 2026-12-04: bf16 out 90 → 64 → 59 µs, e4m3
// out 106 → 66 → 58), two on the int8 module's s32 sums (190 → 110 → 117: at 32 the eight 16-byte
// loads of a group spill).
#if ROW8_S8
#define SWIGLU_R16_BOUNDS __launch_bounds__(1024)
#else
#define SWIGLU_R16_BOUNDS __maxnreg__(32)
#endif
extern "C" __global__ void SWIGLU_R16_BOUNDS
swiglu_r16(const u16* gu, const int* acc, const float* xs, const float* ws, int F, u16* out_b, u8* out_q,
           float* out_s) {
    swiglu_rr<16>(gu, acc, xs, ws, F, out_b, out_q, out_s);
}

// x [R, D]: row r = b·per + q (b-th group of `per` rows): q < real → x = src + bias; else x = pad.
// (Embedding epilogue: the GEMM wrote the real rows of src, f32 [R, D]; pad rows take the pad
// token.) Blocks take rows (grid-stride), threads columns: no 64-bit division per element.
extern "C" __global__ void bias_pad_rows(const float* src, xt* x, int D, long long R, int per, int real,
                                         const float* bias, const float* pad) {
    for (long long r = blockIdx.x; r < R; r += gridDim.x) {
        xt* xr = x + r * D;
        const float* sr = src + r * D;
        const bool is_real = (int)(r % per) < real;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            st_x(xr + i, is_real ? sr[i] + bias[i] : pad[i]);
        }
    }
}

// The adaLN modulation rows y [R, N] (N = blocks · 4 · D, each block's slots scale_msa, gate_msa,
// scale_mlp, gate_mlp of D values) plus the bias, finished as the row kernels use them: 1 + scale,
// tanh(gate), each times the block's norm weight of that slot (norm_w, same layout: attention_norm1,
// attention_norm2, ffn_norm1, ffn_norm2) when norm_w is set — the row kernels then take a null norm
// weight and read one vector a value instead of two. Grid as add_bias's.
extern "C" __global__ void ada_finish(float* y, int N, long long R, int D, const float* bias, const float* norm_w) {
    for (long long r = blockIdx.y; r < R; r += gridDim.y)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) {
            const float v = y[r * N + i] + bias[i];
            const float f = (i / D) & 1 ? tanhf(v) : 1.f + v;
            y[r * N + i] = norm_w ? norm_w[i] * f : f;
        }
}

// y [R, N] += bias: blocks take rows along y and column chunks along x (the adaLN GEMM's one row
// of ~460k values as much as the final layer's 4096 rows of 64), grid-stride in both.
extern "C" __global__ void add_bias(float* y, int N, long long R, const float* bias) {
    for (long long r = blockIdx.y; r < R; r += gridDim.y)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) y[r * N + i] += bias[i];
}

// out_b[r] = bf16(rmsnorm(x[r]) · w)   (R blocks; the caption's cap_embedder.0 norm).
extern "C" __global__ void rms_bf16(const float* x, const float* w, float eps, int D, u16* out_b) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * D;
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) out_b[r * D + i] = f32_to_bf16(xr[i] * inv * w[i]);
}

// Final layer prologue: out_b[r] = bf16(layernorm(x[src_row(r)]) · (1 + scale[item])), no affine.
// Rows r = b·real + q read x row b·per + q (the real image rows of item b). R blocks.
extern "C" __global__ void final_norm_bf16(const xt* x, int D, float eps, int per, int real, const float* scale,
                                           u16* out_b) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const long long b = r / real, q = r - b * real;
    const xt* xr = x + (b * per + q) * D;
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s += ld_x(xr + i);
    const float mean = block_sum(s, red) / (float)D;
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float d = ld_x(xr + i) - mean;
        ss += d * d;
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)D + eps);
    const float* sc = scale + b * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) out_b[r * D + i] = f32_to_bf16((ld_x(xr + i) - mean) * inv * (1.f + sc[i]));
}
