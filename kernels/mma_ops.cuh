// kernels/mma_ops.cuh — the warp-level tensor-core primitives shared by the
// mma.sync kernels (attention_mma.cuh, grouped_gemm.cuh): ldmatrix loads of
// A and B fragments from shared-memory tiles in either layout, cp.async
// copies, and mma.sync.m16n8k16 for bf16 and f16 with f32 accumulation.
// kernels/attention_mma_emu.cpp defines MS_ATTENTION_MMA_EMU and its own
// stand-ins for the PTX parts before including the kernels, so the kernels
// built on these run on the CPU too.
#pragma once
namespace mma {

// ------------------------------------------------------------ fragments
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, per warp:
// D (16x8) = A (16x16) . B (16x8) + C. Lane = 4*g + t (g = lane >> 2 is PTX's
// groupID, t = lane & 3 its threadID_in_group). A 32-bit register holds two
// 16-bit elements, the one with the lower column (A) or row (B) index in the
// low half.
//   A (M x K = 16 x 16, row-major), a0..a3:
//     a0 = A[g][2t, 2t+1]       a1 = A[g+8][2t, 2t+1]
//     a2 = A[g][2t+8, 2t+9]     a3 = A[g+8][2t+8, 2t+9]
//   B (K x N = 16 x 8, "col"), b0, b1:
//     b0 = B[2t, 2t+1][g]       b1 = B[2t+8, 2t+9][g]
//   C, D (16 x 8, f32), c0..c3:
//     c0, c1 = C[g][2t, 2t+1]   c2, c3 = C[g+8][2t, 2t+1]
// FA2's identity: the C fragments of two adjacent n-tiles (columns 0-7 and
// 8-15 of a 16 x 16 block), packed in pairs, are the A fragment of that block:
//     a0 = (c0, c1) of tile 0   a1 = (c2, c3) of tile 0
//     a2 = (c0, c1) of tile 1   a3 = (c2, c3) of tile 1
// ldmatrix.sync.aligned.m8n8.x4.b16: lanes 8i..8i+7 give the row addresses of
// 8x8 matrix i; each lane receives r_i = M_i[g][2t, 2t+1], or with .trans
// r_i = M_i[2t, 2t+1][g]. Hence the three loads used below (tiles in shared
// memory with row stride LD elements):
//   lda   A fragment of rows R..R+15, cols C..C+15 of a row-major tile:
//         lane -> row R + (lane & 15), col C + (lane >> 4) * 8; r0..r3 = a0..a3
//         (M_0 rows 0-7/cols 0-7, M_1 rows 8-15, M_2 cols 8-15, M_3 both).
//   ldb   B fragments of n-tiles N..N+7 and N+8..N+15 for k = C..C+15 from a
//         tile stored [n][k] (K in Q.K^T, Q in K.Q^T): lane -> row
//         N + (lane & 7) + (lane >> 4) * 8, col C + ((lane >> 3) & 1) * 8;
//         {r0, r1} = (b0, b1) of the first n-tile, {r2, r3} of the second
//         (plain: M[n = g][k = 2t, 2t+1] is exactly b0's B[2t, 2t+1][g]).
//   ldbt  the same from a tile stored [k][n] (V in P.V, dO in P^T.dO, K in
//         dS.K), with .trans: lane -> row C + (lane & 7) + ((lane >> 3) & 1) * 8,
//         col N + (lane >> 4) * 8; {r0, r1} first n-tile, {r2, r3} second
//         (.trans: M[k = 2t, 2t+1][n = g] = b0).

// The PTX below has a CPU stand-in with the same semantics in
// kernels/attention_mma_emu.cpp (MS_ATTENTION_MMA_EMU), which runs these
// kernels thread by thread against a reference (spec/attention_mma_emu_spec.lua).
#ifndef MS_ATTENTION_MMA_EMU
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(unsigned r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

#endif

// A fragment of rows R..R+15, cols C..C+15 (see lda above)
template <typename T, int LD>
__device__ __forceinline__ void lda(unsigned r[4], const T *s, int R, int C, int lane) {
    ldsm_x4(r, s + (R + (lane & 15)) * LD + C + (lane >> 4) * 8);
}
// B fragments of n-tiles N, N+8 and k-chunk C from a tile stored [n][k]
template <typename T, int LD>
__device__ __forceinline__ void ldb(unsigned r[4], const T *s, int N, int C, int lane) {
    ldsm_x4(r, s + (N + (lane & 7) + (lane >> 4) * 8) * LD + C + ((lane >> 3) & 1) * 8);
}
// B fragments of n-tiles N, N+8 and k-chunk C from a tile stored [k][n]
template <typename T, int LD>
__device__ __forceinline__ void ldbt(unsigned r[4], const T *s, int N, int C, int lane) {
    ldsm_x4_t(r, s + (C + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + N + (lane >> 4) * 8);
}

// A fragment of rows R..R+15 (m), cols C..C+15 (k) from a tile stored
// [k][m] (dS^T in the one-pass backward), with .trans: matrix i = lane >> 3
// covers m half i & 1 and k half i >> 1; lane -> row C + (lane & 7) +
// (lane >> 4) * 8, col R + ((lane >> 3) & 1) * 8 (.trans: M[k = 2t, 2t+1][m = g] = a0)
template <typename T, int LD>
__device__ __forceinline__ void ldat(unsigned r[4], const T *s, int R, int C, int lane) {
    ldsm_x4_t(r, s + (C + (lane & 7) + (lane >> 4) * 8) * LD + R + ((lane >> 3) & 1) * 8);
}

#ifndef MS_ATTENTION_MMA_EMU
// 16 bytes global -> shared, asynchronous; zero-filled when !pred (src must
// still be a valid address: callers pass the tensor's base)
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(pred ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// all but the N most recently committed groups of this thread have landed
template <int N> __device__ __forceinline__ void cp_async_wait_n() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
    return y;
}

template <typename T> struct op;
template <> struct op<__nv_bfloat16> {
    // c += a . b (16x8x16)
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // (x, y) rounded to bf16, x in the low half
    static __device__ __forceinline__ unsigned pack(float x, float y) {
        __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
        return *reinterpret_cast<unsigned *>(&v);
    }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <> struct op<__half> {
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float x, float y) {
        __half2 v = __floats2half2_rn(x, y);
        return *reinterpret_cast<unsigned *>(&v);
    }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
};

#endif
}  // namespace mma
