// kernels/wgmma_ops.cuh — Hopper's warpgroup MMA (wgmma.mma_async, sm_90a)
// as the kernels use it (attention_wgmma.cuh, grouped_gemm.cuh): matrix
// descriptors of 128-byte-swizzled shared-memory tiles, the fence / commit
// / wait protocol, and the m64nNk16 products with each operand K-major or
// MN-major (attention_wgmma.cuh's header describes the layouts). The PTX
// parts have CPU stand-ins in kernels/attention_mma_emu.cpp
// (MS_ATTENTION_MMA_EMU), defined before the kernels are included.
#pragma once
#include "mma_ops.cuh"

namespace wg {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MS_WG_ENABLED 1
#endif

// ------------------------------------------------------------------ PTX
using mma::smem_u32;

// the descriptor of a 128-byte-swizzled tile at p (1024-byte aligned, or an
// offset of one inside its rows): start address, leading byte offset 16
// (unused by these layouts), stride byte offset 1024, swizzle mode 1 (128 B)
__device__ __forceinline__ uint64_t desc(const void *p) {
    return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
// desc's with leading byte offset lbo: the bytes between the 64-wide atoms
// along N of an MN-major tile wider than 64 (attention_wgmma.cuh at D = 128)
__device__ __forceinline__ uint64_t desc(const void *p, unsigned lbo) {
    return (desc(p) & ~((uint64_t)0x3FFF << 16)) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16);
}

#ifndef MS_ATTENTION_MMA_EMU

__device__ __forceinline__ void fence() {
#ifdef MS_WG_ENABLED
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#ifdef MS_WG_ENABLED
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wait() {
#ifdef MS_WG_ENABLED
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// the generic proxy's writes to shared memory (cp.async) made visible to
// wgmma's reads (the async proxy)
__device__ __forceinline__ void fence_proxy() {
#ifdef MS_WG_ENABLED
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// registers an in-flight wgmma writes: the compiler may not move their
// reads or writes across this point
template <int N>
__device__ __forceinline__ void pin(float *d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin_u(unsigned *d) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(d[i])::"memory");
}

// d (64 x N f32, the warpgroup's accumulators) (+)= A . B over k16, A and B
// from shared memory (both K-major); acc = 0: d = A . B
template <typename T, int N>
__device__ __forceinline__ void mma_ss(float *d, uint64_t a, uint64_t b, int acc);
// d (64 x N) (+)= A . B over k16, A from registers (a[4]: this warp's m16k16
// fragment), B MN-major from shared memory
template <typename T, int N>
__device__ __forceinline__ void mma_rs_t(float *d, const unsigned *a, uint64_t b, int acc);
// d (64 x N) (+)= A . B over k16, A from registers as mma_rs_t's, B K-major
// from shared memory (imm-trans-b = 0): S = Q.K^T with Q held in registers
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float *d, const unsigned *a, uint64_t b, int acc);
// d (64 x N) (+)= A . B over k16, both MN-major from shared memory: A's tile
// is K x M with M (64) along the row (transposed A, imm-trans-a = 1)
template <typename T, int N>
__device__ __forceinline__ void mma_ss_tt(float *d, uint64_t a, uint64_t b, int acc);
// d (64 x N) (+)= A . B over k16, A K-major and B MN-major from shared
// memory (imm-trans-b = 1): a GEMM's A (M x K) times a B stored K x N
template <typename T, int N>
__device__ __forceinline__ void mma_ss_t(float *d, uint64_t a, uint64_t b, int acc);

#ifdef MS_WG_ENABLED
#include "attention_wgmma_ops.inc"
#else
template <typename T, int N>
__device__ __forceinline__ void mma_ss(float *, uint64_t, uint64_t, int) { __trap(); }
template <typename T, int N>
__device__ __forceinline__ void mma_rs_t(float *, const unsigned *, uint64_t, int) { __trap(); }
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float *, const unsigned *, uint64_t, int) { __trap(); }
template <typename T, int N>
__device__ __forceinline__ void mma_ss_tt(float *, uint64_t, uint64_t, int) { __trap(); }
template <typename T, int N>
__device__ __forceinline__ void mma_ss_t(float *, uint64_t, uint64_t, int) { __trap(); }
#endif

// the one-pass backward's order (dkdv_kernel<T, true>): one thread waits
// until the counter at p (global memory, other blocks' increments) reaches
// v, reading it with acquire semantics at gpu scope; the block's barrier
// after it hands the order on to the other threads
__device__ __forceinline__ void spin_until(const int *p, int v) {
#ifdef MS_WG_ENABLED
    int x;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(x) : "l"(p) : "memory");
    } while (x < v);
#else
    while (*(const volatile int *)p < v) {
    }
    __threadfence();
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// named barriers (0 is __syncthreads'): bar_sync waits until n threads (a
// multiple of 32, every warp whole) have arrived at barrier id, counting its
// own; bar_arrive counts the calling warp and goes on (a producer's "full"
// or a consumer's "empty"). The barrier orders the memory accesses before
// an arrival before those after the sync (fwd_ws_kernel's hand-offs)
__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// a warpgroup's register budget moved (every thread of the warpgroup calls
// it with the same N, a multiple of 8 in [24, 256]): dec gives registers
// back to the block's pool, inc waits for them (fwd_ws_kernel's producer
// and consumers)
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifdef MS_WG_ENABLED
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifdef MS_WG_ENABLED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
#define WG_SMEM extern __shared__ unsigned char wg_smem[]
#endif  // MS_ATTENTION_MMA_EMU

// p rounded up to the next 1024-byte boundary of shared memory (the
// 128-byte swizzle's atoms)
__device__ __forceinline__ unsigned char *align1024(unsigned char *p) {
    const unsigned a = smem_u32(p);
    return p + ((1024 - (a & 1023)) & 1023);
}

}  // namespace wg
