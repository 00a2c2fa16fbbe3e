// kv.cuh — the KV cache element type, shared by the kernels that write the cache (rowops.cu,
// attention_decode.cu) and read it (attention*.cu): f16 (KV_F32 = 0, the default) or f32
// (f32/f16 models, where parity with the CPU matters more than bytes); and the head geometry
// (HD, GQA, a lane's share of a head) that attention.cu and attention_decode.cu, compiled as
// modules of their own, both use.

#ifndef HD
#define HD 128
#endif
#ifndef GQA
#define GQA 1
#endif
// Dims per lane; lanes with lane·EPL ≥ HD idle (HD = 16 uses half a warp).
#define EPL ((HD + 31) / 32)
#define LANE_OK(lane) ((lane) * EPL < HD)

#ifndef KV_F32
#define KV_F32 0
#endif
#if KV_F32
typedef float kv_t;
__device__ __forceinline__ kv_t to_kv(float v) { return v; }
__device__ __forceinline__ float kv_f(kv_t v) { return v; }
#else
typedef u16 kv_t;
__device__ __forceinline__ kv_t to_kv(float v) { return f32_to_f16(v); }
__device__ __forceinline__ float kv_f(kv_t v) { return f16_to_f32(v); }
#endif
