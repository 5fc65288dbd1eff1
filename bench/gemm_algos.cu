// Every algorithm cuBLASLt's heuristic offers for a GEMM, timed: is the
// first choice (what kernels/gemm.cu runs) the fastest for our shapes?
//
//   nvcc -O2 -arch=sm_90a bench/gemm_algos.cu -lcublasLt -o build/gemm_algos
//   build/gemm_algos [reps]            # the FLCE and GPT-2 shapes below
//   build/gemm_algos reps M N K ta tb beta out(bf16|f32)
//   SUSTAIN_MS=500 build/gemm_algos ...  # also each candidate under load
//   SM_TARGET=116 build/gemm_algos ...    # for 116 multiprocessors
//
// Row-major C (M, N) = op(A) (M, K) · op(B) (K, N) + beta·C, bf16 operands,
// f32 accumulation; ta/tb: the operand is stored transposed. Operands are
// random, C is random when beta is 1. Prints, per shape, the heuristic's
// order with each algorithm's median time (CUDA events), its TFLOP/s and
// its tile / stages / split-K / cluster attributes.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)
#define LK(x)                                                                                     \
    do {                                                                                          \
        cublasStatus_t s_ = (x);                                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                        \
            fprintf(stderr, "%s:%d: %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_);\
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

__global__ void fill(__nv_bfloat16 *p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        p[i] = __float2bfloat16(scale * ((h & 0xffff) / 32768.0f - 1.0f));
    }
}

struct Shape {
    const char *name;
    long m, n, k;
    int ta, tb;
    float beta;
    int out_f32;
};

static int cfg(const cublasLtMatmulAlgo_t &a, cublasLtMatmulAlgoConfigAttributes_t at) {
    int v = -1;
    size_t w = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, at, &v, sizeof v, &w) != CUBLAS_STATUS_SUCCESS) return -1;
    return v;
}

static void run(cublasLtHandle_t h, const Shape &s, int reps, void *ws, size_t wsz) {
    size_t na = (size_t)s.m * s.k, nb = (size_t)s.k * s.n, nc = (size_t)s.m * s.n;
    __nv_bfloat16 *A, *B;
    void *C;
    CK(cudaMalloc(&A, na * 2));
    CK(cudaMalloc(&B, nb * 2));
    CK(cudaMalloc(&C, nc * (s.out_f32 ? 4 : 2)));
    fill<<<1024, 256>>>(A, na, 1, 1.0f);
    fill<<<1024, 256>>>(B, nb, 2, 1.0f);
    CK(cudaGetLastError());
    CK(cudaMemset(C, 0, nc * (s.out_f32 ? 4 : 2)));
    cublasLtMatmulDesc_t d;
    LK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // column-major: C^T (n x m) = op(B)^T (n x k) · op(A)^T (k x m)
    cublasOperation_t oa = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N, ob = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa));
    LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob));
    // SM_TARGET=n: the heuristic and the kernels for n multiprocessors (the
    // rest left to a concurrent kernel)
    if (const char *sm = getenv("SM_TARGET")) {
        int32_t n = atoi(sm);
        LK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &n, sizeof n));
    }
    cublasLtMatrixLayout_t la, lb, lc;
    // B row-major (k, n) is column-major (n, k); stored transposed it is (k, n)
    if (s.tb) LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k));
    else LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.n, s.k, s.n));
    if (s.ta) LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.m, s.k, s.m));
    else LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, s.m, s.k));
    LK(cublasLtMatrixLayoutCreate(&lc, s.out_f32 ? CUDA_R_32F : CUDA_R_16BF, s.n, s.m, s.n));
    cublasLtMatmulPreference_t p;
    LK(cublasLtMatmulPreferenceCreate(&p));
    LK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
    const int want = 32;
    cublasLtMatmulHeuristicResult_t hr[want];
    int found = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, lc, p, want, hr, &found));
    double flop = 2.0 * s.m * s.n * s.k;
    printf("\n%s  M=%ld N=%ld K=%ld ta=%d tb=%d beta=%g out=%s: %d algorithms\n", s.name, s.m, s.n, s.k, s.ta, s.tb,
           s.beta, s.out_f32 ? "f32" : "bf16", found);
    printf("  %3s %9s %8s %6s %5s %6s %6s %6s %7s\n", "#", "ms", "TFLOP/s", "tile", "stage", "splitK", "swz", "cust",
           "cluster");
    float one = 1.0f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double best = 1e30, first = 0;
    for (int i = 0; i < found; i++) {
        std::vector<float> t;
        bool ok = true;
        for (int r = 0; r < reps + 1 && ok; r++) {
            CK(cudaEventRecord(e0));
            cublasStatus_t st = cublasLtMatmul(h, d, &one, B, la, A, lb, &s.beta, C, lc, C, lc, &hr[i].algo, ws, wsz, 0);
            if (st != CUBLAS_STATUS_SUCCESS) {
                ok = false;
                break;
            }
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r) t.push_back(ms);
        }
        if (!ok) {
            printf("  %3d  (launch refused)\n", i);
            continue;
        }
        std::sort(t.begin(), t.end());
        double ms = t[t.size() / 2];
        if (i == 0) first = ms;
        best = std::min(best, ms);
        printf("  %3d %9.4f %8.1f %6d %5d %6d %6d %6d %7d\n", i, ms, flop / ms / 1e9, cfg(hr[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
               cfg(hr[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), cfg(hr[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
               cfg(hr[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), cfg(hr[i].algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
               cfg(hr[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
    }
    printf("  first %.4f ms, best %.4f ms: first/best %.3f\n", first, best, first / best);
    // SUSTAIN_MS=t: each candidate again under load, the GPU at its power
    // limit: t ms of the first candidate back to back, then the candidate
    // back to back for t/2 ms, timed as one batch (mean per run)
    const char *se = getenv("SUSTAIN_MS");
    double sustain = se ? atof(se) : 0;
    if (sustain > 0 && first > 0) {
        auto launch = [&](int i) {
            return cublasLtMatmul(h, d, &one, B, la, A, lb, &s.beta, C, lc, C, lc, &hr[i].algo, ws, wsz, 0);
        };
        double lbest = 1e30, lfirst = 0;
        for (int i = 0; i < found; i++) {
            int nheat = (int)(sustain / first) + 1;
            for (int r = 0; r < nheat; r++) LK(launch(0));
            if (launch(i) != CUBLAS_STATUS_SUCCESS) continue;
            // the candidate's own count from its idle time: ~t/2 ms of it
            int n = std::max(3, (int)(sustain / 2 / first));
            CK(cudaEventRecord(e0));
            for (int r = 0; r < n; r++) LK(launch(i));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            double per = ms / n;
            if (i == 0) lfirst = per;
            lbest = std::min(lbest, per);
            printf("  loaded %3d %9.4f %8.1f\n", i, per, flop / per / 1e9);
        }
        printf("  loaded: first %.4f ms, best %.4f ms: first/best %.3f\n", lfirst, lbest, lfirst / lbest);
    }
    cublasLtMatmulPreferenceDestroy(p);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(d);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(C));
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    std::vector<Shape> shapes;
    if (argc >= 9) {
        shapes.push_back({"custom", atol(argv[2]), atol(argv[3]), atol(argv[4]), atoi(argv[5]), atoi(argv[6]),
                          (float)atof(argv[7]), argv[8][0] == 'f'});
    } else {
        shapes = {
            // FLCE, BT = 8192: H = 4096, V = 128256, 2048-row chunks; H = 2560, V = 151936, 1664 rows
            {"flce4096 logits", 2048, 128256, 4096, 0, 1, 0, 0},
            {"flce4096 grad_x", 2048, 4096, 128256, 0, 0, 0, 0},
            {"flce4096 grad_W bf16 acc", 128256, 4096, 2048, 1, 0, 1, 0},
            {"flce4096 grad_W f32 acc", 128256, 4096, 2048, 1, 0, 1, 1},
            {"flce2560 logits", 1664, 151936, 2560, 0, 1, 0, 0},
            {"flce2560 grad_x", 1664, 2560, 151936, 0, 0, 0, 0},
            {"flce2560 grad_W bf16 acc", 151936, 2560, 1664, 1, 0, 1, 0},
            // GPT-2 124M, B=32, T=1024 (BT = 32768, C = 768): forward, grad of the input, grad of the weight
            {"gpt2 qkv fwd", 32768, 2304, 768, 0, 1, 0, 0},
            {"gpt2 qkv dx", 32768, 768, 2304, 0, 0, 0, 0},
            {"gpt2 qkv dW", 2304, 768, 32768, 1, 0, 0, 0},
            {"gpt2 attn-proj fwd", 32768, 768, 768, 0, 1, 0, 0},
            {"gpt2 attn-proj dW", 768, 768, 32768, 1, 0, 0, 0},
            {"gpt2 fc fwd", 32768, 3072, 768, 0, 1, 0, 0},
            {"gpt2 fc dx", 32768, 768, 3072, 0, 0, 0, 0},
            {"gpt2 fc dW", 3072, 768, 32768, 1, 0, 0, 0},
            {"gpt2 mlp-proj fwd", 32768, 768, 3072, 0, 1, 0, 0},
            {"gpt2 mlp-proj dx", 32768, 3072, 768, 0, 0, 0, 0},
            {"gpt2 mlp-proj dW", 768, 3072, 32768, 1, 0, 0, 0},
            {"gpt2 head logits (8192 rows)", 8192, 50304, 768, 0, 1, 0, 0},
            {"gpt2 head grad_x", 8192, 768, 50304, 0, 0, 0, 0},
            {"gpt2 head grad_W f32 acc", 50304, 768, 8192, 1, 0, 1, 1},
        };
    }
    cublasLtHandle_t h;
    LK(cublasLtCreate(&h));
    size_t wsz = 32u << 20;
    void *ws;
    CK(cudaMalloc(&ws, wsz));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, cuBLASLt %zu, %d reps (median)\n", prop.name, cublasLtGetVersion(), reps);
    for (auto &s : shapes) run(h, s, reps, ws, wsz);
    CK(cudaFree(ws));
    cublasLtDestroy(h);
    return 0;
}
