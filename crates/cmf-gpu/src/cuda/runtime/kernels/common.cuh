// common.cuh — helpers prepended to every kernel source.
//
// NVRTC compiles without system headers, so the few conversions we need are written in PTX:
// f16 <-> f32 (cvt), bf16 -> f32 (a shift), f32 -> bf16 (cvt.rn). Weight streams are read with
// 16-byte non-coherent loads that do not allocate in L1 (each weight byte is read once per
// token; keeping it out of L1 leaves room for the activations).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
}
// Two floats -> packed f16x2 (lo in the low half), as mma.sync operands want.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The same as bf16x2 (attn_full_ws's P, a wgmma A operand beside bf16 V).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Row access in groups of V consecutive values: V = 4 reads or writes a group with one 16-byte
// (f32), 8-byte (bf16) or 4-byte (e4m3) access and needs the row width a multiple of 4 and
// 16-byte aligned f32 rows (see row_vec4); V = 1 is the scalar path for any width.
template <int V>
struct Vf {
    float v[V];
};
template <int V>
__device__ __forceinline__ Vf<V> ld_f32(const float* p) {
    Vf<V> a;
    if constexpr (V == 4) {
        const float4 q = *(const float4*)p;
        a.v[0] = q.x, a.v[1] = q.y, a.v[2] = q.z, a.v[3] = q.w;
    } else {
        a.v[0] = *p;
    }
    return a;
}
template <int V>
__device__ __forceinline__ void st_f32(float* p, const Vf<V>& a) {
    if constexpr (V == 4) *(float4*)p = make_float4(a.v[0], a.v[1], a.v[2], a.v[3]);
    else *p = a.v[0];
}
template <int V>
__device__ __forceinline__ Vf<V> ld_bf16(const u16* p) {
    Vf<V> a;
    if constexpr (V == 4) {
        const uint2 q = *(const uint2*)p;
        a.v[0] = __uint_as_float(q.x << 16), a.v[1] = __uint_as_float(q.x & 0xffff0000u);
        a.v[2] = __uint_as_float(q.y << 16), a.v[3] = __uint_as_float(q.y & 0xffff0000u);
    } else {
        a.v[0] = bf16_to_f32(*p);
    }
    return a;
}
template <int V>
__device__ __forceinline__ void st_bf16(u16* p, const Vf<V>& a) {
    if constexpr (V == 4) {
        *(uint2*)p = make_uint2((u32)f32_to_bf16(a.v[0]) | ((u32)f32_to_bf16(a.v[1]) << 16),
                                (u32)f32_to_bf16(a.v[2]) | ((u32)f32_to_bf16(a.v[3]) << 16));
    } else {
        *p = f32_to_bf16(a.v[0]);
    }
}
// Whether rows of width n at these pointers can take the V = 4 path: n a multiple of 4 and every
// pointer aligned for its group access. Pointers are OR-ed into `bits`, each scaled so that its
// alignment shows as 16 bytes: f32 (16-byte groups) as is, bf16 (8-byte groups) times 2, e4m3
// (4-byte groups) times 4; null pointers do not count.
__device__ __forceinline__ bool row_vec4(int n, unsigned long long bits) { return (n & 3) == 0 && (bits & 15) == 0; }

// Programmatic dependent launch (sm_90): a kernel launched with the PDL attribute may start
// while its predecessor runs; it must call pdl_wait() before reading anything a predecessor
// wrote (immutable weights may be read before). pdl_trigger() lets the successor launch early.
// Both are no-ops for kernels launched without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Block-wide sum for blockDim.x <= 1024; `red` is 32 floats of shared memory. All threads
// get the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// Weight codecs as the kernels see them (host: cuda/weights.rs, DevCodec).
#define CODEC_Q8 0    // int8 rows, f16 row scale, optional f16 column field (q8_2f)
#define CODEC_Q4 1    // nibble plane [rows*K/2] + f16 group scales [rows*K/32] (q4_block layout)
#define CODEC_BF16 2
#define CODEC_F16 3
#define CODEC_F32 4

// Decodes element (r, c) of a weight matrix with K columns to f32 (slow path: embeddings,
// dequantisation for GEMMs). Matches cmf_kernels::reference::decode_row.
__device__ __forceinline__ float decode_elem(int codec, const u8* w, const u16* rs, const u16* col, long long r,
                                             long long c, long long K) {
    long long i = r * K + c;
    switch (codec) {
        case CODEC_Q8: {
            float v = (float)((const i8*)w)[i] * f16_to_f32(rs[r]);
            return col ? v * f16_to_f32(col[c]) : v;
        }
        case CODEC_Q4: {
            u8 b = w[i >> 1];
            int q = (i & 1) ? (b >> 4) : (b & 15);
            return (float)(q - 8) * f16_to_f32(rs[i >> 5]);
        }
        case CODEC_BF16: return bf16_to_f32(((const u16*)w)[i]);
        case CODEC_F16: return f16_to_f32(((const u16*)w)[i]);
        default: return ((const float*)w)[i];
    }
}
