// attention_wg.cu — the DiT's non-causal flash attention on Hopper warpgroup MMA (wgmma).
//
// Same contract as attn_full_fa2 in attention.cu (q [T, NH, HD]; k/v [NH, S_max, HD]; output
// bf16 at the item's X rows of out_b [*, NH·HD]), built for sm_90a only.
//
// Why: mma.sync fetches every B fragment from shared memory through the register file, and at
// 16 query rows per warp that traffic caps attn_full_fa2 near 190 TFLOP/s. wgmma reads K and V
// straight from shared memory for a 64-row warpgroup at once. Measured on the H200 (the 30 + 2
// attention calls of a 1024² DiT step, 4128 rows, 30 heads): 45.7 ms with attn_full_fa2; a
// first wgmma kernel (tiles loaded by every thread through cp.async, P through shared memory)
// 37 ms on unswizzled tiles, 26.9 ms (~310 TFLOP/s) with 128-byte swizzle and ex2.approx;
// attn_full_ws below took 5.0 ms against that kernel's 8.3 over 8 layers and the refiners.
//
// Shared layout, 128-byte swizzle (what wgmma reads at full rate): a tile of keys × 128 dims is
// two halves (dims 0–63, 64–127); in a half, key k's 128 bytes sit at (k / 8) · 1024 + (k % 8) ·
// 128, their 16-byte chunk c stored at chunk position c ^ (k % 8). The same bytes serve K as a
// K-major B operand (S = Q·Kᵀ: 8-key groups 1024 B apart, a k16 step is +32 B inside the half)
// and V as an MN-major one (O += P·V: 8-key groups 1024 B apart, the second 64 dims a half on).

#if defined(HD) && HD == 128
#define WG_ROWS 128  // query rows per block

__device__ __forceinline__ u32 wg_smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// Shared-memory matrix descriptor, 128-byte swizzle (mode 1 in bits 62–63): start, leading
// and stride byte offsets, all in 16-byte units (atoms 1024-byte aligned, base offset 0).
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32) |
           (1ull << 62);
}
// Byte offset of 16-byte chunk c (0..15) of row r in a swizzled block of `rows` rows × 128
// halves (two halves of rows × 128 B).
__device__ __forceinline__ u32 sw_chunk(int r, int c, int rows) {
    return (c >> 3) * rows * 128 + (r >> 3) * 1024 + (r & 7) * 128 + (((c & 7) ^ (r & 7)) << 4);
}
// 2^x on the SFU, no range fix-up (x ≤ 0 here; flushing tiny results to 0 is harmless).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving register operands of an in-flight wgmma.
__device__ __forceinline__ void wg_keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// ---------------------------------------------------------------------------------------------
// attn_full_ws: the same contract except for Q, read as f16 (qk_norm_rope writes it so: half the
// bytes of f32), and V, read as bf16 through its tensor map — the DiT's maps point V straight at
// the q|k|v GEMM's rows, so V is never copied; P·V runs in bf16 — warp-specialised and
// ping-ponged (FlashAttention-3's plan,
// written for this layout). Block: 2 consumer warpgroups (64 query rows each) and 1 producer
// warpgroup (384 threads; setmaxnreg moves registers from the producer to the consumers: 9
// warps would leave one SM sub-partition 3 warps of at most 168 registers).
// - K/V tiles of WS_KEYS keys (176 by default, FlashAttention-3's tile for head dim 128; 128
//   still builds): S = Q·Kᵀ is one m64n176k16 wgmma per k16 step of the head dim (88 f32
//   accumulators a thread), O += P·V WS_KEYS / 16 = 11 m64n128k16 steps over the keys. A tile
//   is laid out as described at the top with WS_KEYS keys per half: dims 0–63 of key k at
//   (k / 8) · 1024 + (k % 8) · 128, dims 64–127 WS_KEYS · 128 bytes on.
// - The producer's lane 0 streams K and V with TMA (tensor maps made on the host: boxes of 64
//   dims × WS_KEYS keys, 128-byte swizzle, the layout wgmma reads; keys ≥ T come back as zeros)
//   into WS_SLOTS slots: 2 at 176 keys (Q 32 KiB + 2 × 88 KiB), 3 at 128 keys (Q + 3 × 64 KiB;
//   4 would not fit in 227 KiB). K and V of a slot each have a "full" mbarrier (transaction
//   bytes) and an "empty" one (the 256 consumer threads release it): K_j is free once S_j has
//   run, V_j only once P_j·V_j has, a tile later; so the producer loads K one tile ahead of V
//   (K0, K1, V0, K2, V1, ...), and with two slots each load is still issued about a tile before
//   it is read. No consumer thread issues a load and no __syncthreads couples the warpgroups.
// - Q is converted to f16 once and kept in shared memory (both GEMM operands of S = Q·Kᵀ come
//   from shared memory), so the registers go to O (64 a thread), S (88) and one P (44).
// - FlashAttention-3's order, one P buffer. Per tile j (j > 0) a warpgroup issues S_j = Q·K_jᵀ
//   and O += P_{j−1}·V_{j−1} (P in registers, the A operand) as two commit groups, waits for S_j
//   alone (wait_group 1: P·V stays in flight), releases K_j, runs the softmax of tile j in place
//   on the f32 S registers, then waits for P_{j−1}·V_{j−1}, releases V_{j−1}, and only then
//   packs S_j into the f16 P registers (the P·V that read them is done). O's rows take tile j's
//   correction before P_j·V_j is issued, with S_{j+1}; the last P·V follows the loop. Two named
//   barriers pass a token so the warpgroups issue their GEMMs in turn: one's softmax runs under
//   the other's tensor-core work.
// - Register operands of an in-flight wgmma are pinned (ws_keep after the wait): without that
//   the compiler may reuse P's registers before the tensor core has read them.
// - No wgmma sits under a run-time branch or after a C++ spin loop on an mbarrier (mbar_wait
//   spins inside its asm): ptxas takes either as divergent and then serialises every wgmma
//   (remark C7519, a WARPGROUP.DEPBAR after each HGMMA).
#ifndef WS_KEYS
#define WS_KEYS 176
#endif
#if WS_KEYS != 128 && WS_KEYS != 176
#error "attn_full_ws: WS_KEYS must be 128 or 176 (an S = Q·Kᵀ wgmma wrapper per width)"
#endif
#ifndef WS_SLOTS
#define WS_SLOTS (WS_KEYS <= 128 ? 3 : 2)
#endif
#define WS_TILE (WS_KEYS * HD * 2)  // bytes per K (or V) tile
#define WS_THREADS 384
#ifndef WS_PINGPONG
#define WS_PINGPONG 1
#endif
// Lazy rescaling: a row's running maximum moves only when a tile's maximum exceeds it by more
// than WS_TAU (log2 units), so P ≤ 2^WS_TAU (f16 holds it) and O skips its rescale in every
// warp whose rows all kept theirs. 0: the maximum moves with every increase (eager).
#ifndef WS_TAU
#define WS_TAU 8
#endif
#define WS_Q_BYTES (WG_ROWS * HD * 2)
// 1 KiB to align the swizzle atoms, Q, the slots, 4 mbarriers a slot (kernels.rs: WS_SMEM).
#define WS_SMEM_BYTES (1024 + WS_Q_BYTES + WS_SLOTS * 2 * WS_TILE + 32 * WS_SLOTS)
static_assert(WS_SMEM_BYTES <= 227 * 1024, "attn_full_ws: shared memory over 227 KiB");
static_assert(WS_KEYS % 16 == 0 && WS_KEYS <= 256, "attn_full_ws: TMA box and k16 steps");

template <bool B>
struct FalseTrue {
    static constexpr bool value = B;
};

struct __align__(64) TmaDesc {
    u64 v[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// The spin stays inside the asm: a C++ loop on a per-thread flag is a branch ptxas must treat
// as divergent, and it then serialises every wgmma after it.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// A 3-D TMA tile (coordinates innermost first) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaDesc* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void named_sync(u32 id, u32 n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(u32 id, u32 n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
__device__ __forceinline__ void ws_keep_u(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// d[64] (+)= A (m64k16 at adesc, K-major) · B (k16n128 at bdesc, K-major); scale_d 0 overwrites.
__device__ __forceinline__ void wgmma_ss_k_major(float* d, u64 adesc, u64 bdesc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(adesc), "l"(bdesc), "r"(scale_d));
}
// d[64] += a (m64k16 bf16, registers) · B (k16n128 bf16 at bdesc, MN-major).
__device__ __forceinline__ void wgmma_rs_mn_major_bf16(float* d, const u32* a, u64 bdesc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(1));
}

// d[88] (+)= A (m64k16 at adesc, K-major) · B (k16n176 at bdesc, K-major); scale_d 0 overwrites.
// S = Q·Kᵀ of a 176-key tile: thread t holds rows 16·warp + t/4 and + 8, columns 8i + 2(t % 4)
// + {0, 1} (i < 22), the n128 layout with 6 more column blocks.
__device__ __forceinline__ void wgmma_ss_k_major_n176(float* d, u64 adesc, u64 bdesc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, "
        "%88, %89, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
        : "l"(adesc), "l"(bdesc), "r"(scale_d));
}

// S (+)= Q·K_jᵀ for one k16 step of the head dim, WS_KEYS columns.
__device__ __forceinline__ void ws_qk(float* s, u64 adesc, u64 bdesc, int scale_d) {
#if WS_KEYS == 176
    wgmma_ss_k_major_n176(s, adesc, bdesc, scale_d);
#else
    wgmma_ss_k_major(s, adesc, bdesc, scale_d);
#endif
}

// The first half of a tile's online softmax, attn_full_ws's and attn_full_ws8's: keys at or past
// T masked (TAIL; kt the tile's first key), the rows' tile maxima over the quad, and each row's
// running maximum moved where the tile's exceeds it by more than tau once scaled by k0 (row g)
// or k1 (row g + 8), the exponent's multipliers (corr: what O and l are multiplied by; 1 where the
// maximum stayed). N: this thread's score accumulators (4 per 8 keys). Every tile holds at least
// one key < T, so the maxima are finite; a first tile moves from −inf (corr 0: O and l are still
// zero).
template <int N, bool TAIL>
__device__ __forceinline__ void ws_move_max(float* s, int kt, int T, int tg, float k0, float k1, float tau,
                                            float& m0, float& m1, float& corr0, float& corr1, bool& moved) {
    if (TAIL) {
#pragma unroll
        for (int nt = 0; nt < N / 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (kt + nt * 8 + tg * 2 + (e & 1) >= T) s[4 * nt + e] = NEG_INF;
    }
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int nt = 0; nt < N / 4; nt++) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * nt + 0], s[4 * nt + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * nt + 2], s[4 * nt + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    const bool u0 = (mx0 - m0) * k0 > tau, u1 = (mx1 - m1) * k1 > tau;
    corr0 = u0 ? fast_exp2((m0 - mx0) * k0) : 1.f;
    corr1 = u1 ? fast_exp2((m1 - mx1) * k1) : 1.f;
    if (u0) m0 = mx0;
    if (u1) m1 = mx1;
    moved = u0 || u1;
}

// The online softmax of attn_full_ws, lean (per element: a max, one FFMA, one ex2, one add), in
// place: s (rows g and g + 8, this thread's WS_KEYS / 4 columns) becomes the probabilities in
// f32, packed into P by ws_pack_p once the previous P·V is done. The running maxima stay in raw
// score units and the scale folds into the exponent's FFMA; keys at or past T are masked only
// in the tile that has them (TAIL). A maximum moves by more than WS_TAU only (corr 1 otherwise);
// moved: whether either row's did.
template <bool TAIL>
__device__ __forceinline__ void ws_softmax(float* s, int kt, int T, int tg, float sl2, float& m0, float& m1,
                                           float& l0, float& l1, float& corr0, float& corr1, bool& moved) {
    ws_move_max<WS_KEYS / 2, TAIL>(s, kt, T, tg, sl2, sl2, (float)WS_TAU, m0, m1, corr0, corr1, moved);
    const float ms0 = m0 * sl2, ms1 = m1 * sl2;
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int c = 0; c < WS_KEYS / 16; c++) {
#pragma unroll
        for (int e = 0; e < 8; e++) s[8 * c + e] = fast_exp2(fmaf(s[8 * c + e], sl2, (e & 2) ? -ms1 : -ms0));
        a0 += (s[8 * c + 0] + s[8 * c + 1]) + (s[8 * c + 4] + s[8 * c + 5]);
        a1 += (s[8 * c + 2] + s[8 * c + 3]) + (s[8 * c + 6] + s[8 * c + 7]);
    }
    l0 = l0 * corr0 + a0;
    l1 = l1 * corr1 + a1;
}
// The probabilities as bf16 A fragments of P·V (V is bf16, as the q|k|v GEMM wrote it; lazy
// rescaling keeps P ≤ 2^WS_TAU): k16 step c takes columns 16c .. 16c + 15, i.e. accumulator
// blocks 2c (a0: row g, a1: row g + 8) and 2c + 1 (a2, a3).
__device__ __forceinline__ void ws_pack_p(const float* s, u32 (*pa)[4]) {
#pragma unroll
    for (int c = 0; c < WS_KEYS / 16; c++) {
        pa[c][0] = pack_bf16x2(s[8 * c + 0], s[8 * c + 1]);
        pa[c][1] = pack_bf16x2(s[8 * c + 2], s[8 * c + 3]);
        pa[c][2] = pack_bf16x2(s[8 * c + 4], s[8 * c + 5]);
        pa[c][3] = pack_bf16x2(s[8 * c + 6], s[8 * c + 7]);
    }
}

// The four mbarriers of each of `slots` K/V slots (K full, V full, K empty, V empty; each kind
// `slots` · 8 bytes on from the one before, starting at full_k): a full one completes on the
// producer's arrival plus the TMA bytes, an empty one on the 256 consumer threads'. Thread 0.
__device__ __forceinline__ void ws_init_barriers(u32 full_k, int slots) {
    for (int s = 0; s < slots; s++) {
        mbar_init(full_k + 8 * s, 1);
        mbar_init(full_k + 8 * (slots + s), 1);
        mbar_init(full_k + 8 * (2 * slots + s), 256);
        mbar_init(full_k + 8 * (3 * slots + s), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// O's N accumulators (4 per 8 columns) times the softmax corrections (row g: corr0, row g + 8:
// corr1), unless no row of the warp moved its maximum (lazy rescaling, WS_TAU / W8_TAU).
template <int N>
__device__ __forceinline__ void ws_rescale(float* o, float corr0, float corr1, bool moved) {
    if (!__any_sync(FULL_MASK, moved)) return;  // warp-uniform; no wgmma under it
#pragma unroll
    for (int dn = 0; dn < N / 4; dn++) {
        o[4 * dn + 0] *= corr0; o[4 * dn + 1] *= corr0;
        o[4 * dn + 2] *= corr1; o[4 * dn + 3] *= corr1;
    }
}
// The end of a consumer warpgroup of attn_full_ws / attn_full_ws8: its 64 rows of O · (i0 | i1)
// (HD values of EB bytes, pack(a, b) making a pair's 2·EB) staged in shared memory, then written to
// the item's X rows of out [*, NH · HD] 16 bytes a lane, consecutive lanes along a row. Storing
// the accumulator fragments directly (2 or 4 bytes a lane, 8 rows an instruction) kept the
// load/store queue full: ncu put 5 % of attn_full_ws8's and 2 % of attn_full_ws's warp samples
// there, stalled on it ('lg'). stage: the warpgroup's half of Q's buffer (64 · HD · EB bytes or
// more), free once all its S are done; row lr at lr · HD · EB, its 16-byte chunk c at chunk
// c ^ (lr & 7): a fragment store's 8 rows hit 8 different chunks, a row's reads the same 8.
// wrow0: the warpgroup's first row in the item; bar: its named barrier; wtid: tid & 127.
template <int EB, typename Pack>
__device__ __forceinline__ void ws_store_staged(const float (*o)[4], float i0, float i1, u32 stage, int wrow0, int T,
                                                int np, int img_row0, int cap_row0, int NH, int h, int wtid,
                                                u32 bar, u8* out, Pack pack) {
    constexpr int RB = HD * EB, CH = RB / 16;
    static_assert(CH % 8 == 0, "ws_store_staged: the swizzle needs rows of 8k chunks");
    const int g = (wtid & 31) >> 2, tg = wtid & 3, lr0 = (wtid >> 5) * 16 + g;
    named_sync(bar, 128);  // every warp of the warpgroup is past its last S (Q is read no more)
#pragma unroll
    for (int dn = 0; dn < HD / 8; dn++) {
        const int byte = (dn * 8 + tg * 2) * EB, c = byte >> 4, in = byte & 15;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int lr = lr0 + 8 * half;
            const float m = half ? i1 : i0;
            const u32 a = stage + lr * RB + ((c ^ (lr & 7)) << 4) + in;
            if constexpr (EB == 2)
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"((u32)pack(o[dn][2 * half] * m, o[dn][2 * half + 1] * m)) : "memory");
            else
                asm volatile("st.shared.u16 [%0], %1;" ::"r"(a), "h"((unsigned short)pack(o[dn][2 * half] * m, o[dn][2 * half + 1] * m)) : "memory");
        }
    }
    named_sync(bar, 128);
#pragma unroll
    for (int i = wtid; i < 64 * CH; i += 128) {
        const int lr = i / CH, c = i % CH, r = wrow0 + lr;
        if (r >= T) continue;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(stage + lr * RB + ((c ^ (lr & 7)) << 4)));
        *(uint4*)(out + ((size_t)o_xrow(r, np, img_row0, cap_row0) * NH + h) * RB + 16 * c) = v;
    }
}

// The tail split of the warp-specialised kernels (attn_full_ws, attn_full_ws8). Their tiles (query
// block qt, head h; tile = h · nq + qt) run in rounds of one block per SM. Where the last round
// would be at most half full (990 tiles at 1024² on 132 SMs: 7 rounds and 66 tiles), the host
// splits its tiles in two halves of the key tiles, so that round takes half as long: the grid is
// 1D, split_from + 2 · (tiles − split_from) blocks, and blocks from split_from on take tile
// split_from + (b − split_from) / 2, half (b − split_from) % 2 (split_from = tiles: no split).
// The halves meet in ws_merge_halves.
struct WsWork {
    int qt, h;       // query block and head
    int t0, t1;      // the key tiles [t0, t1) this block takes
    int pair, half;  // a split tile's index from split_from (−1: whole) and which half
};
__device__ __forceinline__ WsWork ws_work(int nq, int ntiles, int split_from) {
    const int b = blockIdx.x;
    const bool split = b >= split_from;
    const int tile = split ? split_from + ((b - split_from) >> 1) : b;
    WsWork w;
    w.qt = tile % nq;
    w.h = tile / nq;
    w.half = split ? (b - split_from) & 1 : 0;
    w.pair = split ? tile - split_from : -1;
    w.t0 = split && w.half ? ntiles / 2 : 0;
    w.t1 = split && !w.half ? ntiles / 2 : ntiles;
    return w;
}

// Floats a consumer thread keeps of a split half: N accumulators, m0, m1, l0, l1.
#define WS_PART(N) ((N) + 4)

// The halves of a split tile meet. Each of the 256 consumer threads (ctid) stores its state — the
// N accumulators, its rows' running maxima m0, m1 (raw score units; k0, k1 their exponent
// multipliers) and row-sum parts l0, l1 — in part ([pair][half], WS_PART(N) floats a thread,
// thread-minor); the second half to arrive (a counter per pair, which it resets for the next
// launch) folds the other's state into its registers and returns true to store O; the first
// returns false. The same thread of both halves holds the same rows and columns. Named barrier 5
// (the consumers); flag: a shared int.
template <int N>
__device__ __forceinline__ bool ws_merge_halves(float* o, float& m0, float& m1, float& l0, float& l1, float k0,
                                                float k1, const WsWork& w, float* part, unsigned* pairs, int ctid,
                                                int* flag) {
    constexpr int S = WS_PART(N);
    float* mine = part + (size_t)(2 * w.pair + w.half) * S * 256 + ctid;
#pragma unroll
    for (int i = 0; i < N; i++) mine[i * 256] = o[i];
    mine[N * 256] = m0;
    mine[(N + 1) * 256] = m1;
    mine[(N + 2) * 256] = l0;
    mine[(N + 3) * 256] = l1;
    __threadfence();
    named_sync(5, 256);
    if (ctid == 0) *flag = (int)atomicAdd(pairs + w.pair, 1u);
    named_sync(5, 256);
    if (*flag == 0) return false;
    __threadfence();
    const float* other = part + (size_t)(2 * w.pair + (w.half ^ 1)) * S * 256 + ctid;
    const float p0 = __ldcg(other + N * 256), p1 = __ldcg(other + (N + 1) * 256);
    const float n0 = fmaxf(m0, p0), n1 = fmaxf(m1, p1);
    const float a0 = fast_exp2((m0 - n0) * k0), b0 = fast_exp2((p0 - n0) * k0);
    const float a1 = fast_exp2((m1 - n1) * k1), b1 = fast_exp2((p1 - n1) * k1);
    // Half 0's term first whichever half folds (one fused multiply-add of half 0's value onto
    // half 1's product): the sum is then the same bits whichever half finished second, so an
    // image does not depend on the order two blocks finish in (it did: two runs of one binary
    // were 48.9 dB apart).
    const bool h0 = w.half == 0;
    auto fold = [h0](float mine, float ca, float theirs, float cb) {
        return h0 ? fmaf(mine, ca, theirs * cb) : fmaf(theirs, cb, mine * ca);
    };
#pragma unroll
    for (int i = 0; i < N; i++)
        o[i] = fold(o[i], (i & 2) ? a1 : a0, __ldcg(other + i * 256), (i & 2) ? b1 : b0);
    l0 = fold(l0, a0, __ldcg(other + (N + 2) * 256), b0);
    l1 = fold(l1, a1, __ldcg(other + (N + 3) * 256), b1);
    m0 = n0;
    m1 = n1;
    if (ctid == 0) pairs[w.pair] = 0u;
    return true;
}

// Where attn_full_ws finds Q when it makes it itself (norm non-null): the q|k|v GEMM's bf16 rows
// (q at X row xr, head h: q + xr · ld + h · HD), the q norm weight and eps, the RoPE cos/sin
// tables [rows, HD / 2] and each X row's table row (rope_row[xr · rope_stride]). norm null: q is
// the f16 [T, NH, HD] that qk_norm_rope wrote.
struct WsQRows {
    int ld;
    const float* norm;
    float eps;
    const float* cosb;
    const float* sinb;
    const int* rope_row;
    int rope_stride;
};

__device__ __forceinline__ void ws_st_q(u32 at, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// The X rows (−1 past T) and RoPE table rows of joint positions r, r + STEP, … (N of them): where
// a Q-from-rows prologue reads its rows' values and angles.
template <int N, int STEP>
__device__ __forceinline__ void ws_q_rows_at(const WsQRows& qr, int r, int T, int img_row0, int np, int cap_row0,
                                             long long* xr, int* rr) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int ri = r + STEP * i;
        xr[i] = ri >= T ? -1 : ri < np ? img_row0 + ri : cap_row0 + (ri - np);
        rr[i] = xr[i] < 0 ? 0 : qr.rope_row[xr[i] * qr.rope_stride];
    }
}

// A consumer warpgroup's 64 Q rows (joint positions r0 ..) made from the q|k|v rows: RMSNorm +
// RoPE exactly as qk_norm_rope does them (qknorm.cuh), so it need not write Q and this kernel
// need not read it back (64 MB a layer at 1024²). Thread t of the warpgroup takes chunk t % 16 of
// rows t / 16 + 8i: a row's 16 chunks are 16 consecutive lanes, the head's lane group of qknorm.cuh.
__device__ __forceinline__ void ws_q_from_rows(const u16* q, const WsQRows& qr, u32 qs, int r0, int T, int h,
                                               int img_row0, int np, int cap_row0, int tid) {
    const int c8 = tid & 15, row0 = (tid & 127) >> 4;
    float nw[8];
    *(float4*)nw = *(const float4*)(qr.norm + 8 * c8);
    *(float4*)(nw + 4) = *(const float4*)(qr.norm + 8 * c8 + 4);
    // Every load is issued before any value is used (the rows' X rows and table rows first,
    // then their values and angles): one round trip of latency instead of a chain per row.
    long long xr[8];
    int rr[8];
    ws_q_rows_at<8, 8>(qr, r0 + row0, T, img_row0, np, cap_row0, xr, rr);
    uint4 raw[8];
    float4 cs[8], sn[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const bool in = xr[i] >= 0;
        raw[i] = in ? *(const uint4*)(q + xr[i] * qr.ld + h * HD + 8 * c8) : make_uint4(0u, 0u, 0u, 0u);
        cs[i] = in ? *(const float4*)(qr.cosb + (long long)rr[i] * (HD / 2) + 4 * c8) : make_float4(0.f, 0.f, 0.f, 0.f);
        sn[i] = in ? *(const float4*)(qr.sinb + (long long)rr[i] * (HD / 2) + 4 * c8) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float v[8];
        const float c[4] = {cs[i].x, cs[i].y, cs[i].z, cs[i].w}, sv[4] = {sn[i].x, sn[i].y, sn[i].z, sn[i].w};
        qkn_unpack_bf16x8(raw[i], v);
        qkn_norm_rope8(v, nw, qr.eps, c, sv, true);
        ws_st_q(qs + sw_chunk(row0 + 8 * i, c8, 64), qkn_pack_f16x8(v));
    }
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
attn_full_ws(const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, const u16* q, int T,
             float scale, int NH, int img_row0, int np, int cap_row0, u16* out_b, int split_from, float* part,
             unsigned* pairs, int q_ld, const float* q_norm, float q_eps, const float* q_cos, const float* q_sin,
             const int* q_rope_row, int q_rope_stride) {
    const WsQRows qr = {q_ld, q_norm, q_eps, q_cos, q_sin, q_rope_row, q_rope_stride};
    extern __shared__ __align__(128) u8 wsm[];
    __shared__ int merge_flag;
    // The warp index through a shuffle: ptxas then knows the role branches below are uniform per
    // warp (a branch it must treat as divergent makes it serialise every wgmma after it).
    const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(FULL_MASK, tid >> 5, 0);
    const u32 sbase = (wg_smem_u32(wsm) + 1023) & ~1023u;  // swizzle atoms are 1024-byte aligned
    const u32 q_sm = sbase;                                  // 2 warpgroups × 64 rows × HD, f16
    const u32 kv_sm = sbase + WS_Q_BYTES;                    // slot s: K at + 2s·TILE, V one TILE on
    // mbarriers of slot s: K full, V full, K empty, V empty, WS_SLOTS · 8 bytes apart.
    const u32 full_k = kv_sm + WS_SLOTS * 2 * WS_TILE, full_v = full_k + 8 * WS_SLOTS;
    const u32 empty_k = full_v + 8 * WS_SLOTS, empty_v = empty_k + 8 * WS_SLOTS;
    const WsWork work = ws_work((T + WG_ROWS - 1) / WG_ROWS, (T + WS_KEYS - 1) / WS_KEYS, split_from);
    const int h = work.h, t0 = work.t0, ntiles = work.t1 - work.t0;  // tiles local from here: key tile t0 + j
    if (tid == 0) ws_init_barriers(full_k, WS_SLOTS);
    __syncthreads();

    if (warp >= 8) {
        // Producer warpgroup: it gives its registers to the consumers; one thread puts K_t and
        // V_t in slot t % SLOTS once the consumers released K (V) of tile t − SLOTS. K runs a
        // tile ahead of V (K_t is read by S_t, V_t by P_t·V_t in the next tile's step).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
        if (warp == 8 && lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tk) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tv) : "memory");
            auto load = [&](const TmaDesc* map, u32 full, u32 empty, u32 dst, int t) {
                if (t >= WS_SLOTS) mbar_wait(empty, (t / WS_SLOTS - 1) & 1);
                mbar_expect_tx(full, WS_TILE);
                tma_load_3d(dst, map, 0, (t0 + t) * WS_KEYS, h, full);
                tma_load_3d(dst + WS_TILE / 2, map, 64, (t0 + t) * WS_KEYS, h, full);
            };
            for (int t = 0; t <= ntiles; t++) {
                if (t < ntiles) {
                    const int s = t % WS_SLOTS;
                    load(&tk, full_k + 8 * s, empty_k + 8 * s, kv_sm + s * 2 * WS_TILE, t);
                }
                if (t > 0) {
                    const int s = (t - 1) % WS_SLOTS;
                    load(&tv, full_v + 8 * s, empty_v + 8 * s, kv_sm + s * 2 * WS_TILE + WS_TILE, t - 1);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    const int wgi = warp >> 2, tg = lane & 3;
    const float sl2 = scale * 1.4426950408889634f;
    // This warpgroup's 64 Q rows as f16, swizzled as a K-major A operand (rows at or past T: 0).
    const u32 qs = q_sm + wgi * (WS_Q_BYTES / 2);
    if (qr.norm) ws_q_from_rows(q, qr, qs, work.qt * WG_ROWS + wgi * 64, T, h, img_row0, np, cap_row0, tid);
    else
        for (int i = tid & 127; i < 64 * (HD / 8); i += 128) {
            const int row = i >> 4, c8 = i & 15;
            const int r = work.qt * WG_ROWS + wgi * 64 + row;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (r < T) v = *(const uint4*)(q + ((size_t)r * NH + h) * HD + c8 * 8);
            ws_st_q(qs + sw_chunk(row, c8, 64), v);
        }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic stores → wgmma reads
    named_sync(3 + wgi, 128);

    // Tokens: barrier 1 lets warpgroup 0 issue, barrier 2 warpgroup 1; warpgroup 0 goes first.
    const u32 my_tok = 1 + wgi, other_tok = 2 - wgi;
    if (WS_PINGPONG && wgi == 1) named_arrive(1, 256);

    // S of the current tile (f32 scores, then probabilities in place) and the one P (f16 A
    // fragments of P·V, written only after the P·V that read the previous tile's is done).
    float o[64], s[WS_KEYS / 2];
    u32 p[WS_KEYS / 16][4];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < WS_KEYS / 2; i++) s[i] = 0.f;
#pragma unroll
    for (int c = 0; c < WS_KEYS / 16; c++)
#pragma unroll
        for (int e = 0; e < 4; e++) p[c][e] = 0u;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f, corr0 = 1.f, corr1 = 1.f;
    bool moved = true;
    auto rescale_o = [&]() { ws_rescale<64>(o, corr0, corr1, moved); };
    const u64 q_desc0 = wg_desc(qs, 16, 1024), k_desc0 = wg_desc(kv_sm, 16, 1024);
    // V as an MN-major B operand: 8-key groups 1024 B apart, dims 64–127 one half (WS_KEYS·128 B) on.
    const u64 v_desc0 = wg_desc(kv_sm + WS_TILE, WS_KEYS * 128, 1024);
    // O += P·V_tile, WS_KEYS / 16 k16 steps of 16 keys (two 8-key groups, 2048 B) each.
    auto issue_pv = [&](int tile) {
        const u64 vd = v_desc0 + (u64)((tile % WS_SLOTS) * 2 * WS_TILE >> 4);
#pragma unroll
        for (int c = 0; c < WS_KEYS / 16; c++) wgmma_rs_mn_major_bf16(o, p[c], vd + (u64)(c * 2048 >> 4));
        wg_commit();
    };
    auto pin = [&]() {
#pragma unroll
        for (int i = 0; i < 64; i++) wg_keep(o[i]);
#pragma unroll
        for (int c = 0; c < WS_KEYS / 16; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) ws_keep_u(p[c][e]);
    };
    // Tile j: S_j, and with FIRST false P_{j−1}·V_{j−1} (P_{j−1} in p) issued with it; then the
    // softmax of tile j in s, and P_j into p once P_{j−1}·V_{j−1} is done. No wgmma sits under a
    // run-time condition: ptxas would take that branch as divergent and serialise every wgmma.
    auto step = [&](int j, auto first) {
        constexpr bool FIRST = decltype(first)::value;
        const int sj = j % WS_SLOTS, sp = (j + WS_SLOTS - 1) % WS_SLOTS;
        // O's rows take tile j − 1's correction before P_{j−1}·V_{j−1} lands in them.
        if (!FIRST) rescale_o();
        mbar_wait(full_k + 8 * sj, (j / WS_SLOTS) & 1);
        if (!FIRST) mbar_wait(full_v + 8 * sp, ((j - 1) / WS_SLOTS) & 1);
        if (WS_PINGPONG) named_sync(my_tok, 256);
        pin();
#pragma unroll
        for (int i = 0; i < WS_KEYS / 2; i++) wg_keep(s[i]);
        wg_fence();
        // Descriptors: a base per operand, the k-step's byte offset added in 16-byte units.
        const u64 kd = k_desc0 + (u64)(sj * 2 * WS_TILE >> 4);
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++)  // the first k-step overwrites S (scale-d 0)
            ws_qk(s, q_desc0 + (u64)(((kk >> 2) * 8192 + (kk & 3) * 32) >> 4),
                  kd + (u64)(((kk >> 2) * WS_KEYS * 128 + (kk & 3) * 32) >> 4), kk > 0);
        wg_commit();
        if (!FIRST) issue_pv(j - 1);
        if (WS_PINGPONG) named_arrive(other_tok, 256);
        if (FIRST) wg_wait0();
        else wg_wait1();  // S_j is done (P_{j−1}·V_{j−1}, committed after it, may still run)
#pragma unroll
        for (int i = 0; i < WS_KEYS / 2; i++) wg_keep(s[i]);
        mbar_arrive(empty_k + 8 * sj);  // K_j is read
        const int kt = (t0 + j) * WS_KEYS;
        if (kt + WS_KEYS > T) ws_softmax<true>(s, kt, T, tg, sl2, m0, m1, l0, l1, corr0, corr1, moved);
        else ws_softmax<false>(s, kt, T, tg, sl2, m0, m1, l0, l1, corr0, corr1, moved);
        if (!FIRST) {
            wg_wait0();
            pin();
            mbar_arrive(empty_v + 8 * sp);  // V_{j−1} is read
        }
        ws_pack_p(s, p);  // P_{j−1} is no longer read: P_j takes its registers
    };
    step(0, FalseTrue<true>());
    for (int j = 1; j < ntiles; j++) step(j, FalseTrue<false>());
    // The last tile's P·V.
    {
        const int last = ntiles - 1;
        rescale_o();
        mbar_wait(full_v + 8 * (last % WS_SLOTS), (last / WS_SLOTS) & 1);
        pin();
        wg_fence();
        issue_pv(last);
        wg_wait0();
        pin();
    }
    if (WS_PINGPONG && wgi == 0) named_sync(1, 256);  // takes warpgroup 1's last token
    if (work.pair >= 0 && !ws_merge_halves<64>(o, m0, m1, l0, l1, sl2, sl2, work, part, pairs, tid, &merge_flag)) return;
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    ws_store_staged<2>((const float(*)[4])o, 1.f / l0, 1.f / l1, qs, work.qt * WG_ROWS + wgi * 64, T, np, img_row0,
                       cap_row0, NH, h, tid & 127, 3 + wgi, (u8*)out_b,
                       [](float a, float b) { return (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16); });
}

#endif
