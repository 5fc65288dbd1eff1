// kernels/grouped_gemm.cu — the launches of the grouped GEMM
// (kernels/grouped_gemm.cuh; core/ops.h ms_gemm_grouped_, which checks the
// groups and falls back to a GEMM a group where this kernel does not apply):
// the wgmma kernel on sm_90 (Hopper), the mma.sync one elsewhere (and when
// asked: mode 2).
#include "common.cuh"
#include "kernels.h"
#include "grouped_gemm.cuh"

#include <vector>

namespace {

int cc_major(int device) {
    static int major[64];
    if (device < 0 || device >= 64) return 0;
    if (!major[device] && cudaDeviceGetAttribute(&major[device], cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
        return 0;
    return major[device];
}

template <typename T, typename OutT, bool AK, bool BK, auto kern>
int run(int smem, ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, double beta) {
    const int dev = c[0]->device_id;  // (every group's: core/gemm_grouped.c checks)
    if (ms_cuda_activate(dev)) return -1;
    static bool raised[64];  // this kernel's shared-memory limit (one flag a kernel), raised once a device
    if (dev >= 64 || !raised[dev]) {
        CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        if (dev < 64) raised[dev] = true;
    }
    std::vector<mma::gg_group> gs((size_t)G);
    long long lda = 0, ldb = 0, ldc = 0;
    int n = 0;
    for (int g = 0; g < G; g++) {
        // op(A) (M x K): A stored [M][K] (AK) or [K][M]
        const int M = (int)c[g]->sizes[0], K = (int)(AK ? a[g]->sizes[1] : a[g]->sizes[0]);
        gs[g] = {ms_tensor_data(a[g]), ms_tensor_data(b[g]), ms_tensor_data(c[g]), M, K};
        lda = a[g]->strides[0];
        ldb = b[g]->strides[0];
        ldc = c[g]->strides[0];
        n = (int)c[g]->sizes[1];
    }
    cudaStream_t st = ms_cuda_stream_of(dev);
    return mma::gg_plan(gs.data(), G, n, lda, ldb, ldc, (float)beta, [&](const mma::gg_args &p, int tx, int ty) {
        kern<<<dim3((unsigned)tx, (unsigned)ty), mma::GG_THREADS, smem, st>>>(p);
        LAUNCH_CHECK("grouped gemm");
        return 0;
    });
}

template <typename T, typename OutT, bool AK, bool BK>
int by_kernel(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, double beta, int mode) {
    // (3 stages, 97 KB of shared memory: two blocks an SM, so that one's
    // prologue and epilogue overlap the other's products; on an H200 the
    // 64-expert products ran 7-20% faster than with 4 stages and one block)
    if (mode == 1 && cc_major(c[0]->device_id) == 9)
        return run<T, OutT, AK, BK, wg::gw_kernel<T, OutT, AK, BK, 3>>(wg::gw_cfg<3>::SMEM, c, a, b, G, beta);
    return run<T, OutT, AK, BK, mma::gg_kernel<T, OutT, AK, BK>>(mma::gg_tiles<AK, BK>::SMEM, c, a, b, G, beta);
}

template <typename T, bool AK, bool BK>
int by_out(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, double beta, int mode) {
    if (c[0]->dtype_id == MS_F32) return by_kernel<T, float, AK, BK>(c, a, b, G, beta, mode);
    return by_kernel<T, T, AK, BK>(c, a, b, G, beta, mode);
}

template <typename T>
int by_layout(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, int transa, int transb, double beta, int mode) {
    if (!transa && transb) return by_out<T, true, true>(c, a, b, G, beta, mode);
    if (!transa && !transb) return by_out<T, true, false>(c, a, b, G, beta, mode);
    if (transa && !transb) return by_out<T, false, false>(c, a, b, G, beta, mode);
    return ms_errorf("grouped gemm: op(A) = A^T with op(B) = B^T has no kernel");
}

}  // namespace

extern "C" int ms_cuda_gemm_grouped(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, int transa, int transb,
                                    double beta, int mode) {
    if (G < 1) return 0;
    if (a[0]->dtype_id == MS_BF16) return by_layout<__nv_bfloat16>(c, a, b, G, transa, transb, beta, mode);
    if (a[0]->dtype_id == MS_F16) return by_layout<__half>(c, a, b, G, transa, transb, beta, mode);
    return ms_errorf("grouped gemm: bf16 or f16 operands, got dtype %d", a[0]->dtype_id);
}
