// kernels/gemm.cu — matrix products through cuBLASLt.
//
// out (batch, M, N) = alpha * op(a) (batch, M, K) @ op(b) (batch, K, N) + beta * out
// bf16/f16 operands with f32 accumulation, f32 with f32 (no TF32 unless
// ms_cuda_gemm_allow_tf32(1)), f64 with f64; out may also be f32 with
// bf16/f16 operands (a sum kept in f32 across calls: the fused
// cross-entropy's grad_W; ms_cuda_gemm_mixed_ok). Row-major tensors are handed
// to the column-major library as their transposes: out^T = op(b)^T op(a)^T,
// so no operand is copied when its last two dims have a unit stride on
// either side (plain or transposed views). Batch dims must collapse into one
// stride per operand (stride 0 for a broadcast operand); otherwise the
// operand is copied to contiguous first. Cost: 2*batch*M*N*K flops.
#include "common.cuh"

#include <chrono>
#include <errno.h>
#include <mutex>
#include <string.h>
#include <string>
#include <unordered_map>
#include "kernels.h"
#include "ops.h"
#include "vec.cuh"

#include <cublasLt.h>

#define CUBLAS_CHECK(call)                                                                     \
    do {                                                                                       \
        cublasStatus_t st_ = (call);                                                           \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                      \
            return ms_errorf("%s:%d: %s failed: cublas status %d (%s)", __FILE__, __LINE__, #call, \
                             (int)st_, cublasGetStatusString(st_));                            \
    } while (0)

namespace {

const size_t kWorkspace = 32u << 20;

// one workspace per stream that ran a GEMM (two GEMMs on two streams must
// not share one); a device rarely sees more than a few streams
const int kStreams = 8;
struct LtState {
    cublasLtHandle_t handle = nullptr;
    cudaStream_t streams[kStreams] = {};
    void *workspaces[kStreams] = {};
    int n = 0;
};
LtState g_lt[64];
int g_allow_tf32 = 0;

int lt_ready(int device) {
    LtState &s = g_lt[device];
    if (s.handle) return 0;
    CUBLAS_CHECK(cublasLtCreate(&s.handle));
    return 0;
}

// the workspace of `stream` on `device` (allocated on its first GEMM)
int lt_workspace(int device, cudaStream_t stream, void **ws) {
    LtState &s = g_lt[device];
    for (int i = 0; i < s.n; i++)
        if (s.streams[i] == stream) {
            *ws = s.workspaces[i];
            return 0;
        }
    if (s.n == kStreams)
        return ms_errorf("matmul: GEMMs on more than %d streams of cuda:%d (one workspace each)", kStreams, device);
    CUDA_CHECK(ms_cuda_malloc_any(&s.workspaces[s.n], kWorkspace));
    s.streams[s.n] = stream;
    *ws = s.workspaces[s.n++];
    return 0;
}

// One operand as the column-major library sees it.
struct operand {
    const void *ptr;
    int64_t rows, cols, ld;  // stored column-major matrix
    cublasOperation_t op;
    int64_t batch_stride;
};

// Can the batch dims (all but the last two) of t be walked with one stride?
bool batch_stride_of(const ms_tensor *t, int64_t *stride) {
    int nb = t->ndim - 2;
    int64_t st = 0;
    bool have = false;
    int64_t expect = 0;
    for (int i = nb - 1; i >= 0; i--) {
        if (t->sizes[i] == 1) continue;
        if (!have) {
            st = t->strides[i];
            expect = st * t->sizes[i];
            have = true;
        } else {
            if (t->strides[i] != expect) return false;
            expect *= t->sizes[i];
        }
    }
    *stride = st;
    return true;
}

// Describe x (logical (..., p, q) in memory, used as op(x) in the row-major
// product) as the column-major operand op(x)^T. Returns false when the
// layout is not one the library takes.
bool describe(const ms_tensor *x, int trans, operand *o) {
    int nd = x->ndim;
    int64_t p = x->sizes[nd - 2], q = x->sizes[nd - 1];
    int64_t sp = x->strides[nd - 2], sq = x->strides[nd - 1];
    if (!batch_stride_of(x, &o->batch_stride)) return false;
    o->ptr = ms_tensor_data(x);
    bool rowmajor = (q == 1 || sq == 1) && (p == 1 || sp >= q);
    bool colmajor = (p == 1 || sp == 1) && (q == 1 || sq >= p);
    if (rowmajor) {
        // stored column-major matrix S = x^T (q x p), ld = sp
        o->rows = q;
        o->cols = p;
        o->ld = p == 1 ? (q > 1 ? q : 1) : sp;
        // op(x)^T = trans ? S^T : S
        o->op = trans ? CUBLAS_OP_T : CUBLAS_OP_N;
        return true;
    }
    if (colmajor) {
        // stored column-major matrix S = x (p x q), ld = sq
        o->rows = p;
        o->cols = q;
        o->ld = q == 1 ? (p > 1 ? p : 1) : sq;
        o->op = trans ? CUBLAS_OP_N : CUBLAS_OP_T;
        return true;
    }
    return false;
}

cudaDataType_t cuda_type(int dtype) {
    switch (dtype) {
    case MS_F64: return CUDA_R_64F;
    case MS_F32: return CUDA_R_32F;
    case MS_BF16: return CUDA_R_16BF;
    case MS_F8E4M3: return CUDA_R_8F_E4M3;
    case MS_F8E5M2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_16F;
    }
}

// An FP8 product's extras (ms_cuda_scaled_gemm): the operands' dtypes (which
// may differ: e5m2 gradients with e4m3 weights), the device pointers of
// their dequantisation factors, and cuBLASLt's fast accumulation. A and B
// are run_lt's own (A: the row-major product's left operand a).
struct Fp8 {
    int dta, dtb;
    const void *sa, *sb;
    bool fast;
    bool vec;   // sa (M) and sb (N) vectors: CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
    // blockwise: a's and b's cuBLASLt scale modes (VEC128_32F,
    // BLK128x128_32F; 0: none), sa / sb in float8_cast_blockwise's layout
    int amode, bmode;
};

typedef ms_tmp holder;

// Plans: the descriptors, layouts and heuristic's algorithm of a GEMM shape,
// made once and kept (a training step repeats the same few dozen shapes; the
// heuristic query alone costs tens of microseconds of host time per call).
// The key is every value the objects are built from; pointers are not in it
// (the heuristic never saw them).
struct PlanKey {
    int64_t v[22];
};
struct Plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    bool unsupported;   // an epilogue the library has no algorithm for: two passes
};
struct PlanKeyHash {
    size_t operator()(const PlanKey &k) const {
        uint64_t h = 1469598103934665603ull;
        for (int64_t x : k.v) h = (h ^ (uint64_t)x) * 1099511628211ull;
        return (size_t)h;
    }
};
struct PlanKeyEq {
    bool operator()(const PlanKey &a, const PlanKey &b) const { return memcmp(a.v, b.v, sizeof a.v) == 0; }
};
int g_sm_margin = -1;   // ms_cuda_gemm_set_sm_margin (-1: not read from the environment yet)
int sm_margin() {
    if (g_sm_margin < 0) {
        const char *e = getenv("MS_GEMM_SM_MARGIN");
        g_sm_margin = e && e[0] ? atoi(e) : 0;
        if (g_sm_margin < 0) g_sm_margin = 0;
    }
    return g_sm_margin;
}
int g_tune = -1;   // ms_cuda_gemm_set_tune (-1: not read from the environment yet)
int tune_mode() {
    if (g_tune < 0) {
        const char *e = getenv("MS_GEMM_TUNE");
        g_tune = e && e[0] ? (atoi(e) != 0) : 1;
    }
    return g_tune;
}
int64_t g_tune_stats[4];   // plans tuned, of them not on the heuristic's first, host microseconds, plans from the file

// Tuning: the first GEMM of a new plan times each of the heuristic's
// candidates on the current stream, the device otherwise idle (a warm-up
// each, then kTuneRounds passes over them, kTuneReps runs between two
// events a pass, the best pass kept) and keeps the fastest when it beats
// the first by the margin (ms_gemm_tune_pick). With beta = 0 the trials
// write the real output (the real call overwrites it); otherwise they
// accumulate into a scratch tensor of the output's size, so the output is
// read only by the real call. When the first candidate takes over 5 ms a
// run, one run a pass. Refused during an ms.cuda.graph capture (run_lt: an
// error naming the shape); not done while the stream is captured by
// someone else, nor without the scratch memory (the heuristic's first then).
const int kTuneCandidates = 8;
const int kTuneReps = 2;     // runs between two events
const int kTuneRounds = 2;   // passes over the candidates
// Candidates within a few percent of the first are not told apart by short
// timings: the clocks drift as the GPU heats, and a GEMM that runs beside
// another stream's (the FLCE's grad_x and grad_W) ranks differently than
// alone (bench/flce.lua --tune-ab: with those two tuned, the FLCE with bf16
// accumulation ran 5-6% slower than untuned)
const double kTuneMargin = 0.05;

int tune_pick(int device, cudaStream_t st, cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
              cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, const void *pa, const void *pb,
              const void *Bp, const void *Ap, void *C, int out_dtype, int64_t c_elems, bool beta_zero,
              const cublasLtMatmulHeuristicResult_t *heur, int found) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return 0;
    }
    auto t0 = std::chrono::steady_clock::now();
    ms_tmp scratch;
    void *out = C;
    if (!beta_zero) {
        int64_t shape[1] = {c_elems};
        if (ms_tensor_empty(&scratch.t, 1, shape, out_dtype, device) != 0) {
            ms_set_error("");   // no room for the scratch: the heuristic's first, untimed
            cudaGetLastError();
            return 0;
        }
        out = ms_tensor_data(scratch.t);
    }
    void *ws = nullptr;
    if (lt_workspace(device, st, &ws)) return -1;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    CUDA_CHECK(cudaEventCreate(&e0));
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        return ms_errorf("matmul: cudaEventCreate failed while tuning");
    }
    // the device idle first: work of other streams (the FLCE's side-stream
    // GEMM, say) running beside a candidate would be timed with it. (Only
    // work already issued is waited for; collectives of other ranks are
    // never waited on for more than they themselves have issued.)
    CUDA_CHECK(cudaDeviceSynchronize());
    double ms[kTuneCandidates];
    bool runs[kTuneCandidates];
    int rc = 0, reps = kTuneReps;
    auto launch = [&](int i) {
        return cublasLtMatmul(h, desc, pa, Bp, la, Ap, lb, pb, out, lc, out, lc, &heur[i].algo, ws, kWorkspace, st) ==
               CUBLAS_STATUS_SUCCESS;
    };
    for (int i = 0; i < found; i++) {
        runs[i] = launch(i);   // the warm-up; a candidate the library turns down at launch is not a choice
        ms[i] = -1;
    }
    // rounds over the candidates in turn, each candidate's best round kept:
    // a drift of the clocks falls on all of them
    for (int round = 0; round < kTuneRounds && rc == 0; round++) {
        for (int i = 0; i < found && rc == 0; i++) {
            if (!runs[i]) continue;
            bool ok = cudaEventRecord(e0, st) == cudaSuccess;
            for (int r = 0; r < reps && ok; r++) ok = launch(i);
            float el = 0;
            if (!ok || cudaEventRecord(e1, st) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
                cudaEventElapsedTime(&el, e0, e1) != cudaSuccess) {
                cudaError_t e = cudaGetLastError();
                if (e != cudaSuccess) rc = ms_errorf("matmul: tuning candidate %d: %s", i, cudaGetErrorString(e));
                runs[i] = false;
                ms[i] = -1;
                continue;
            }
            const double t = el / reps;
            if (ms[i] < 0 || t < ms[i]) ms[i] = t;
            if (round == 0 && i == 0 && ms[0] > 5.0) reps = 1;   // a long GEMM (f32 without TF32, say): one run a round
        }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (rc) return rc;
    int pick = ms_gemm_tune_pick(ms, found, kTuneMargin);
    g_tune_stats[0]++;
    if (pick > 0) g_tune_stats[1]++;
    g_tune_stats[2] += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    return pick;
}

// The tuning file (core/gemm_tune.c has the format): the records of each
// device's name and this library version, read on the device's first
// tuning; a plan found there takes the recorded candidate untimed, a plan
// tuned here is appended. The device index is not part of a record (0 in
// its key): ranks on other GPUs of the same kind share the records.
std::mutex g_file_mu;
std::string g_tune_file;
bool g_tune_file_env = false;   // MS_GEMM_TUNE_FILE read
bool g_file_loaded[64];
std::unordered_map<PlanKey, std::pair<int, int>, PlanKeyHash, PlanKeyEq> g_file_recs;   // (pick, found)

const char *tune_file() {
    if (!g_tune_file_env) {
        const char *e = getenv("MS_GEMM_TUNE_FILE");
        if (e && e[0]) g_tune_file = e;
        g_tune_file_env = true;
    }
    return g_tune_file.empty() ? nullptr : g_tune_file.c_str();
}

int device_name(int device, char *name, size_t n) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    snprintf(name, n, "%s", prop.name);
    return 0;
}

// 1: the file holds a choice for this plan (*pick), 0: not, -1: an error
int file_lookup(int device, const PlanKey &key, int found, int *pick) {
    const char *path = tune_file();
    if (!path || device < 0 || device >= 64) return 0;
    std::lock_guard<std::mutex> l(g_file_mu);
    if (!g_file_loaded[device]) {
        char name[256];
        if (device_name(device, name, sizeof name)) return -1;
        ms_gemm_tune_rec *recs = nullptr;
        int n = 0;
        if (ms_gemm_tune_read(path, cublasLtGetVersion(), name, &recs, &n)) return -1;
        for (int i = 0; i < n; i++) {
            PlanKey k;
            memcpy(k.v, recs[i].key, sizeof k.v);
            k.v[0] = device;
            g_file_recs.emplace(k, std::make_pair(recs[i].pick, recs[i].found));   // the first line wins
        }
        ms_gemm_tune_free(recs);
        g_file_loaded[device] = true;
    }
    auto it = g_file_recs.find(key);
    if (it == g_file_recs.end() || it->second.second != found) return 0;
    *pick = it->second.first;
    return 1;
}

int file_record(int device, const PlanKey &key, int pick, int found) {
    const char *path = tune_file();
    if (!path) return 0;
    char name[256], line[1024];
    if (device_name(device, name, sizeof name)) return -1;
    int64_t k[MS_GEMM_TUNE_KEY];
    static_assert(sizeof k == sizeof key.v, "the record's key is the plan's");
    memcpy(k, key.v, sizeof k);
    k[0] = 0;
    if (ms_gemm_tune_format(line, sizeof line, cublasLtGetVersion(), name, k, pick, found)) return -1;
    std::lock_guard<std::mutex> l(g_file_mu);
    if (ms_gemm_tune_append(path, line)) return -1;
    g_file_recs.emplace(key, std::make_pair(pick, found));
    return 0;
}

std::mutex g_plan_mu;
std::unordered_map<PlanKey, Plan, PlanKeyHash, PlanKeyEq> g_plans;
const size_t kMaxPlans = 4096;

// epi: the library's epilogue (CUBLASLT_EPILOGUE_DEFAULT, or BIAS / BGRADA /
// BGRADB with `bias` a vector of out_dtype). Returns 0, -1 on an error, or
// 1 when cuBLASLt has no algorithm for that epilogue (the caller falls back).
int run_lt(int device, int dtype, int out_dtype, const operand &A, const operand &B, void *C, int64_t ldc,
           int64_t c_batch, int64_t m, int64_t n, int64_t k, int64_t batch, double alpha, double beta,
           cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT, void *bias = nullptr, void *aux = nullptr,
           int64_t aux_ld = 0, const Fp8 *f8 = nullptr) {
    LtState &s = g_lt[device];
    PlanKey key;
    {
        const int64_t dkey = f8 ? (int64_t)f8->dta | ((int64_t)f8->dtb << 8) | ((int64_t)f8->fast << 16) | (1LL << 17) |
                                     ((int64_t)f8->vec << 18) | ((int64_t)f8->amode << 20) | ((int64_t)f8->bmode << 24)
                                : (int64_t)dtype;
        int64_t kv[22] = {device, dkey, out_dtype, g_allow_tf32, (int64_t)A.op, (int64_t)B.op, A.rows, A.cols,
                          A.ld, B.rows, B.cols, B.ld, ldc, m, n, k, batch, A.batch_stride, B.batch_stride, c_batch,
                          (int64_t)epi | ((int64_t)sm_margin() << 32) | ((int64_t)tune_mode() << 48) |
                              ((int64_t)(beta != 0) << 49), aux_ld};
        memcpy(key.v, kv, sizeof kv);
    }
    float af0 = (float)alpha, bf0 = (float)beta;
    const void *pa0 = dtype == MS_F64 ? (const void *)&alpha : (const void *)&af0;
    const void *pb0 = dtype == MS_F64 ? (const void *)&beta : (const void *)&bf0;
    {
        Plan plan;
        bool have = false;
        {
            std::lock_guard<std::mutex> l(g_plan_mu);
            auto it = g_plans.find(key);
            if (it != g_plans.end()) {
                plan = it->second;
                have = true;
            }
        }
        if (have && plan.unsupported) return 1;
        if (have) {
            cudaStream_t st = ms_cuda_stream_of(device);
            void *ws = nullptr;
            if (lt_workspace(device, st, &ws)) return -1;
            if (bias)
                CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                            sizeof bias));
            if (aux)
                CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                            sizeof aux));
            if (f8) {   // the library's A is our b (see the top)
                CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &f8->sb,
                                                            sizeof f8->sb));
                CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &f8->sa,
                                                            sizeof f8->sa));
            }
            cublasStatus_t r = cublasLtMatmul(s.handle, plan.desc, pa0, B.ptr, plan.la, A.ptr, plan.lb, pb0, C,
                                              plan.lc, C, plan.lc, &plan.algo, ws, kWorkspace, st);
            if (r == CUBLAS_STATUS_NOT_SUPPORTED && epi != CUBLASLT_EPILOGUE_DEFAULT) return 1;
            if (r != CUBLAS_STATUS_SUCCESS)
                return ms_errorf("matmul: cublasLtMatmul failed: %s (M=%lld N=%lld K=%lld batch=%lld)",
                                 cublasGetStatusString(r), (long long)m, (long long)n, (long long)k, (long long)batch);
            return 0;
        }
    }
    cublasComputeType_t compute = f8 ? CUBLAS_COMPUTE_32F
                                  : dtype == MS_F64 ? CUBLAS_COMPUTE_64F
                                  : (dtype == MS_F32 && !g_allow_tf32) ? CUBLAS_COMPUTE_32F
                                  : dtype == MS_F32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                    : CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = dtype == MS_F64 ? CUDA_R_64F : CUDA_R_32F;
    cudaDataType_t dt = cuda_type(dtype);
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    int rc = -1;
    cublasLtMatmulHeuristicResult_t heurs[kTuneCandidates];
    int found = 0, pick = 0;
    int32_t bc = (int32_t)batch;
    float af = (float)alpha, bf = (float)beta;
    const void *pa = dtype == MS_F64 ? (const void *)&alpha : (const void *)&af;
    const void *pb = dtype == MS_F64 ? (const void *)&beta : (const void *)&bf;
#define LT(call)                                                                                   \
    do {                                                                                           \
        cublasStatus_t st_ = (call);                                                               \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                        \
            ms_errorf("%s:%d: %s failed: %s (M=%lld N=%lld K=%lld batch=%lld)", __FILE__, __LINE__, #call, \
                      cublasGetStatusString(st_), (long long)m, (long long)n, (long long)k, (long long)batch); \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)
    // column-major product: C^T (n x m) = op(b)^T (n x k) * op(a)^T (k x m)
    LT(cublasLtMatmulDescCreate(&desc, compute, scale));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &B.op, sizeof B.op));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &A.op, sizeof A.op));
    if (sm_margin() > 0) {
        int32_t target = ms_sm_count(device) - sm_margin();
        if (target < 1) target = 1;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &target, sizeof target));
    }
    if (epi != CUBLASLT_EPILOGUE_DEFAULT) {
        cudaDataType_t bt = cuda_type(out_dtype);
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        if (bias) {
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
        }
        if (aux) {
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld));
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &bt, sizeof bt));
        }
    }
    if (f8) {
        int8_t fast = f8->fast ? 1 : 0;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &f8->sb, sizeof f8->sb));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &f8->sa, sizeof f8->sa));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
        if (f8->vec) {
            int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
        } else if (f8->amode || f8->bmode) {   // (the library's A is our b)
            int32_t ma = f8->bmode, mb = f8->amode;
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
            LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
        }
    }
    LT(cublasLtMatrixLayoutCreate(&la, f8 ? cuda_type(f8->dtb) : dt, (uint64_t)B.rows, (uint64_t)B.cols, B.ld));
    LT(cublasLtMatrixLayoutCreate(&lb, f8 ? cuda_type(f8->dta) : dt, (uint64_t)A.rows, (uint64_t)A.cols, A.ld));
    LT(cublasLtMatrixLayoutCreate(&lc, cuda_type(out_dtype), (uint64_t)n, (uint64_t)m, ldc));
    if (batch > 1) {
        LT(cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
        LT(cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &B.batch_stride,
                                            sizeof B.batch_stride));
        LT(cublasLtMatrixLayoutSetAttribute(lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
        LT(cublasLtMatrixLayoutSetAttribute(lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &A.batch_stride,
                                            sizeof A.batch_stride));
        LT(cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
        LT(cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &c_batch,
                                            sizeof c_batch));
    }
    LT(cublasLtMatmulPreferenceCreate(&pref));
    {
        uint64_t ws = kWorkspace;
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    }
    {
        cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(s.handle, desc, la, lb, lc, lc, pref,
                                                             tune_mode() ? kTuneCandidates : 1, heurs, &found);
        if (epi != CUBLASLT_EPILOGUE_DEFAULT &&
            (hs == CUBLAS_STATUS_NOT_SUPPORTED || (hs == CUBLAS_STATUS_SUCCESS && found == 0))) {
            rc = 1;   // no algorithm with this epilogue: the caller does it in two passes
            goto done;
        }
        LT(hs);
    }
    if (found == 0) {
        ms_errorf("matmul: cuBLASLt found no algorithm for %s%s%s M=%lld N=%lld K=%lld batch=%lld -> %s",
                  ms_dtype_name(f8 ? f8->dta : dtype), f8 ? " x " : "", f8 ? ms_dtype_name(f8->dtb) : "",
                  (long long)m, (long long)n, (long long)k, (long long)batch, ms_dtype_name(out_dtype));
        goto done;
    }
    if (found > 1) {
        const int had = file_lookup(device, key, found, &pick);
        if (had < 0) goto done;
        if (had) {
            g_tune_stats[3]++;
        } else if (ms_cuda_capturing() >= 0) {
            // tuning times the candidates with events the host waits for
            ms_errorf("matmul during CUDA graph capture on cuda:%d: a GEMM without a tuned plan (%s M=%lld N=%lld "
                      "K=%lld batch=%lld -> %s) would be tuned, which times candidates with host waits; run the "
                      "step eagerly first (ms.cuda.graph's warmup) or turn tuning off (ms.cuda.gemm_tune(false)) "
                      "(the capture is aborted; docs/cuda-graphs.md)",
                      ms_cuda_capturing(), ms_dtype_name(f8 ? f8->dta : dtype), (long long)m, (long long)n,
                      (long long)k, (long long)batch, ms_dtype_name(out_dtype));
            goto done;
        } else {
            int64_t c_elems = (m - 1) * ldc + n + (batch > 1 ? (batch - 1) * c_batch : 0);
            pick = tune_pick(device, ms_cuda_stream_of(device), s.handle, desc, la, lb, lc, pa, pb, B.ptr, A.ptr, C,
                             out_dtype, c_elems, beta == 0, heurs, found);
            if (pick < 0 || file_record(device, key, pick, found)) goto done;
        }
    }
    {
        cudaStream_t st = ms_cuda_stream_of(device);
        void *ws = nullptr;
        if (lt_workspace(device, st, &ws)) goto done;
        cublasStatus_t r = cublasLtMatmul(s.handle, desc, pa, B.ptr, la, A.ptr, lb, pb, C, lc, C, lc,
                                          &heurs[pick].algo, ws, kWorkspace, st);
        if (epi != CUBLASLT_EPILOGUE_DEFAULT && r == CUBLAS_STATUS_NOT_SUPPORTED) {
            rc = 1;   // an epilogue the library turns down at launch (an operand's alignment, say)
            goto done;
        }
        LT(r);
    }
    rc = 0;
    {
        std::lock_guard<std::mutex> l(g_plan_mu);
        if (g_plans.size() < kMaxPlans && g_plans.find(key) == g_plans.end()) {
            g_plans[key] = Plan{desc, la, lb, lc, heurs[pick].algo, false};
            desc = nullptr;   // kept by the plan
            la = lb = lc = nullptr;
        }
    }
done:
#undef LT
    if (rc == 1) {   // remember the refusal: no heuristic query on the next call
        std::lock_guard<std::mutex> l(g_plan_mu);
        if (g_plans.size() < kMaxPlans) g_plans[key] = Plan{nullptr, nullptr, nullptr, nullptr, {}, true};
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return rc;
}

}  // namespace

// which epilogue paths run (MS_GEMM_EPI_* bits): MS_GEMM_EPILOGUE=<mask> in
// the environment (0: none), or ms_cuda_gemm_set_epilogue; the default is
// bias/bias-gradient and the GELU forward, not the DGELU backward (on an H100
// cuBLASLt runs DGELU_BGRAD as a separate pass over the product that takes
// about three times our GELU-backward kernel, see docs/perf-notes.md)
static int g_epilogue = -1;
static int epilogue_mask() {
    if (g_epilogue < 0) {
        const char *e = getenv("MS_GEMM_EPILOGUE");
        g_epilogue = e && e[0] ? (int)strtol(e, NULL, 0) & MS_GEMM_EPI_ALL : MS_GEMM_EPI_DEFAULT;
    }
    return g_epilogue;
}

extern "C" int ms_cuda_gemm_set_epilogue(int mask) {
    int old = epilogue_mask();
    g_epilogue = mask < 0 ? MS_GEMM_EPI_DEFAULT : mask & MS_GEMM_EPI_ALL;
    return old;
}

extern "C" int ms_cuda_gemm_set_tune(int on) {
    int old = tune_mode();
    g_tune = on < 0 ? 1 : (on != 0);
    return old;
}

extern "C" void ms_cuda_gemm_tune_stats(int64_t *out) {
    for (int i = 0; i < 4; i++) out[i] = g_tune_stats[i];
}

extern "C" int ms_cuda_gemm_set_tune_file(const char *path) {
    tune_file();   // the environment's, read once, before this one replaces it
    std::lock_guard<std::mutex> l(g_file_mu);
    if (path && path[0]) {
        FILE *f = fopen(path, "a");   // made now if missing: a path that cannot be written fails here, not in a GEMM
        if (!f) return ms_errorf("gemm tuning file %s: cannot open it for appending: %s", path, strerror(errno));
        fclose(f);
    }
    g_tune_file = path ? path : "";
    g_file_recs.clear();
    memset(g_file_loaded, 0, sizeof g_file_loaded);
    return 0;
}

extern "C" int ms_cuda_gemm_clear_plans(void) {
    std::lock_guard<std::mutex> l(g_plan_mu);
    for (auto &kv : g_plans) {
        Plan &p = kv.second;
        if (p.la) cublasLtMatrixLayoutDestroy(p.la);
        if (p.lb) cublasLtMatrixLayoutDestroy(p.lb);
        if (p.lc) cublasLtMatrixLayoutDestroy(p.lc);
        if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    }
    g_plans.clear();
    return 0;
}

extern "C" int ms_cuda_gemm_set_sm_margin(int sms) {
    int old = sm_margin();
    g_sm_margin = sms < 0 ? 0 : sms;
    return old;
}

// 1: ms_cuda_gemm takes an f32 out with bf16/f16 operands (core/flce.c asks)
extern "C" int ms_cuda_gemm_mixed_ok(void) { return 1; }

extern "C" int ms_cuda_gemm_allow_tf32(int on) {
    int old = g_allow_tf32;
    g_allow_tf32 = on;
    return old;
}

// a, b, out: same ndim >= 2, batch dims already broadcast to out's (stride 0
// where an operand is broadcast); a is (..., M, K) after transa, b (..., K, N)
// after transb, out (..., M, N).
extern "C" int ms_cuda_gemm(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                            double alpha, double beta) {
    int nd = out->ndim;
    int device = out->device_id;
    int64_t m = out->sizes[nd - 2], n = out->sizes[nd - 1];
    int64_t k = transa ? a->sizes[nd - 2] : a->sizes[nd - 1];
    int64_t batch = 1;
    for (int i = 0; i < nd - 2; i++) batch *= out->sizes[i];
    if (a->dtype_id != out->dtype_id &&
        !(out->dtype_id == MS_F32 && (a->dtype_id == MS_BF16 || a->dtype_id == MS_F16) && b->dtype_id == a->dtype_id))
        return ms_errorf("matmul: out %s with operands %s and %s (mixed: only an f32 out of bf16/f16 operands)",
                         ms_dtype_name(out->dtype_id), ms_dtype_name(a->dtype_id), ms_dtype_name(b->dtype_id));
    if (m == 0 || n == 0 || batch == 0) return 0;
    if (ms_cuda_activate(device) || lt_ready(device)) return -1;
    // an empty sum: out = beta out, and with beta = 0 out's old contents
    // (NaN included) are ignored, as BLAS does
    if (k == 0) return beta == 0.0 ? ms_cuda_fill(out, 0.0) : ms_cuda_binary_scalar(out, MS_OP_MUL, out, beta, 0);
    holder ca, cb, co;
    operand A, B;
    if (!describe(a, transa, &A)) {
        if (ms_tensor_clone(&ca.t, a)) return -1;
        describe(ca.t, transa, &A);
    }
    if (!describe(b, transb, &B)) {
        if (ms_tensor_clone(&cb.t, b)) return -1;
        describe(cb.t, transb, &B);
    }
    ms_tensor *dst = out;
    int64_t c_batch = 0;
    bool out_ok = out->strides[nd - 1] == 1 && (m == 1 || out->strides[nd - 2] >= n) &&
                  batch_stride_of(out, &c_batch) && (batch == 1 || c_batch != 0);
    if (!out_ok) {
        if (beta != 0) {
            if (ms_tensor_clone(&co.t, out)) return -1;
        } else if (ms_tensor_empty(&co.t, nd, out->sizes, out->dtype_id, device)) {
            return -1;
        }
        dst = co.t;
        batch_stride_of(dst, &c_batch);
    }
    int64_t ldc = m == 1 ? (n > 1 ? n : 1) : dst->strides[nd - 2];
    if (batch == 1) {
        A.batch_stride = B.batch_stride = c_batch = 0;
    }
    if (run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(dst), ldc, c_batch, m, n, k, batch, alpha,
               beta))
        return -1;
    if (dst != out) return ms_cuda_convert(out, dst);
    return 0;
}

// out (M, N) = op(a) @ op(b) with an epilogue (2-D, one pass over out):
//   MS_GEMM_BIAS     out += bias (N) on every row
//   MS_GEMM_BGRAD_A  bias (M) = sum over k of op(a) (M, K): the bias
//                    gradient of a layer whose weight gradient is g^T x
//   MS_GEMM_BGRAD_B  bias (N) = sum over k of op(b) (K, N): ... x^T g
// The product is handed to the library transposed (see the top), so its
// D is out^T: our N is its rows (BIAS, BGRADA), our M its columns (BGRADB).
// Off without MS_GEMM_EPI_BIAS in the epilogue mask.
// Returns 1, having done nothing, when the layout or dtypes are not ones the
// epilogue takes (bias not a contiguous vector of out's dtype, an out the
// library cannot write in place, mixed dtypes) or cuBLASLt has no algorithm
// for it: the caller then runs the GEMM and the bias pass apart.
extern "C" int ms_cuda_gemm_epilogue(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                                     ms_tensor *bias, int mode) {
    if (!(epilogue_mask() & MS_GEMM_EPI_BIAS)) return 1;   // off: always the two passes (to compare)
    if (out->ndim != 2 || a->ndim != 2 || b->ndim != 2 || !bias || bias->ndim != 1) return 1;
    int device = out->device_id;
    int64_t m = out->sizes[0], n = out->sizes[1];
    int64_t k = transa ? a->sizes[0] : a->sizes[1];
    int64_t want = mode == MS_GEMM_BGRAD_A ? m : n;
    if (bias->sizes[0] != want || bias->dtype_id != out->dtype_id || bias->device_id != device ||
        (bias->strides[0] != 1 && want > 1) || a->dtype_id != out->dtype_id || b->dtype_id != out->dtype_id ||
        out->dtype_id == MS_F64 || m == 0 || n == 0 || k == 0)
        return 1;
    if (!(out->strides[1] == 1 && (m == 1 || out->strides[0] >= n))) return 1;
    if (((uintptr_t)ms_tensor_data(bias) | (uintptr_t)ms_tensor_data(out)) % 16 != 0) return 1;
    operand A, B;
    if (!describe(a, transa, &A) || !describe(b, transb, &B)) return 1;
    A.batch_stride = B.batch_stride = 0;
    if (ms_cuda_activate(device) || lt_ready(device)) return -1;
    cublasLtEpilogue_t epi = mode == MS_GEMM_BIAS      ? CUBLASLT_EPILOGUE_BIAS
                             : mode == MS_GEMM_BGRAD_A ? CUBLASLT_EPILOGUE_BGRADB
                                                       : CUBLASLT_EPILOGUE_BGRADA;
    int64_t ldc = m == 1 ? (n > 1 ? n : 1) : out->strides[0];
    return run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, 0.0, epi,
                  ms_tensor_data(bias));
}

// The GELU epilogues (the tanh form, as GPT-2's gelu_new), 2-D, bf16/f16/f32:
//   backward = 0: out = gelu(op(a) @ op(b) + bias), aux = the pre-activation
//                 (GELU_AUX_BIAS; GELU_AUX without a bias)
//   backward = 1: out = (op(a) @ op(b)) * gelu'(aux), and with bias (N) given
//                 bias = the column sums of out (DGELU_BGRAD; DGELU without)
// aux is (M, N) row-major with a row stride that is a multiple of 8 (the
// library's). Returns 1, having done nothing, where the epilogue does not
// apply (then the caller runs the passes apart), as ms_cuda_gemm_epilogue.
extern "C" int ms_cuda_gemm_gelu(ms_tensor *out, ms_tensor *aux, const ms_tensor *a, const ms_tensor *b, int transa,
                                 int transb, ms_tensor *bias, int backward) {
    if (!(epilogue_mask() & (backward ? MS_GEMM_EPI_DGELU : MS_GEMM_EPI_GELU))) return 1;
    if (out->ndim != 2 || a->ndim != 2 || b->ndim != 2 || aux->ndim != 2) return 1;
    int device = out->device_id;
    int64_t m = out->sizes[0], n = out->sizes[1];
    int64_t k = transa ? a->sizes[0] : a->sizes[1];
    int dt = out->dtype_id;
    if (a->dtype_id != dt || b->dtype_id != dt || aux->dtype_id != dt || dt == MS_F64 || m == 0 || n == 0 || k == 0)
        return 1;
    if (aux->sizes[0] != m || aux->sizes[1] != n || aux->device_id != device || aux->strides[1] != 1 ||
        (m > 1 && aux->strides[0] < n) || (m > 1 ? aux->strides[0] : n) % 8 != 0)
        return 1;
    if (bias && (bias->ndim != 1 || bias->sizes[0] != n || bias->dtype_id != dt || bias->device_id != device ||
                 (bias->strides[0] != 1 && n > 1)))
        return 1;
    if (!(out->strides[1] == 1 && (m == 1 || out->strides[0] >= n))) return 1;
    uintptr_t al = (uintptr_t)ms_tensor_data(out) | (uintptr_t)ms_tensor_data(aux) |
                   (bias ? (uintptr_t)ms_tensor_data(bias) : 0);
    if (al % 16 != 0) return 1;
    operand A, B;
    if (!describe(a, transa, &A) || !describe(b, transb, &B)) return 1;
    A.batch_stride = B.batch_stride = 0;
    if (ms_cuda_activate(device) || lt_ready(device)) return -1;
    cublasLtEpilogue_t epi = backward ? (bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU)
                                      : (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX);
    int64_t ldc = m == 1 ? (n > 1 ? n : 1) : out->strides[0];
    int64_t ald = m == 1 ? n : aux->strides[0];
    return run_lt(device, dt, dt, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, 0.0, epi,
                  bias ? ms_tensor_data(bias) : nullptr, ms_tensor_data(aux), ald);
}

// out (M, N) = ainv * binv * a (M, K) @ b (N, K)^T [+ bias] [+ beta out] with
// FP8 operands (vec: ainv[i] * binv[j] for element (i, j)) (core/ops.h ms_scaled_matmul; core/float8.c checked the
// dtypes, shapes, devices and row layouts). cuBLASLt's FP8 kernels take
// K-major operands only ("TN"), which a and b with contiguous rows are, on
// devices of compute capability 8.9 and newer, with M, N, K multiples of 16
// and 16-byte aligned data.
extern "C" int ms_cuda_scaled_gemm(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                                   const ms_tensor *binv, int vec, const ms_tensor *bias, double beta,
                                   int fast_accum) {
    const int device = out->device_id;
    const int64_t m = a->sizes[0], n = b->sizes[0], k = a->sizes[1];
    static int cc[64];   // compute capability x 10 by device (0: not asked yet)
    if (device < 0 || device >= 64) return ms_errorf("scaled_matmul: cuda:%d is beyond the 64 devices taken", device);
    if (cc[device] == 0) {
        int major = 0, minor = 0;
        if (ms_cuda_device_capability(device, &major, &minor)) return -1;
        cc[device] = major * 10 + minor;
    }
    if (cc[device] < 89)
        return ms_errorf("scaled_matmul: FP8 products need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         "cuda:%d is %d.%d", device, cc[device] / 10, cc[device] % 10);
    if (m % 16 || n % 16 || k % 16)
        return ms_errorf("scaled_matmul: cuBLASLt's FP8 products need M, N and K multiples of 16, got a (%lld, %lld) "
                         "and b (%lld, %lld)", (long long)m, (long long)k, (long long)n, (long long)k);
    const int64_t lda = m > 1 ? a->strides[0] : k, ldb = n > 1 ? b->strides[0] : k;
    uintptr_t al = (uintptr_t)ms_tensor_data(a) | (uintptr_t)ms_tensor_data(b) | (uintptr_t)ms_tensor_data(out) |
                   (bias ? (uintptr_t)ms_tensor_data(bias) : 0);
    if (al % 16 || lda % 16 || ldb % 16)
        return ms_errorf("scaled_matmul: FP8 operands need 16-byte aligned data and row strides that are multiples "
                         "of 16 (a row stride %lld, b %lld)", (long long)lda, (long long)ldb);
    if (ms_cuda_activate(device) || lt_ready(device)) return -1;
    operand A, B;
    describe(a, 0, &A);   // (M, K) row-major: the library's B, K x M, not transposed
    describe(b, 1, &B);   // (N, K) row-major used as (K, N): the library's A, transposed
    A.batch_stride = B.batch_stride = 0;
    if (vec && cc[device] < 90)
        return ms_errorf("scaled_matmul: vector (axiswise) scales need cuBLASLt's outer-vector scaling, which takes "
                         "compute capability 9.0 or newer; cuda:%d is %d.%d", device, cc[device] / 10, cc[device] % 10);
    Fp8 f8{a->dtype_id, b->dtype_id, ms_tensor_data(ainv), ms_tensor_data(binv), fast_accum != 0, vec != 0, 0, 0};
    const int64_t ldc = m == 1 ? n : out->strides[0];
    if (bias) {
        int rc = run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, beta,
                        CUBLASLT_EPILOGUE_BIAS, (void *)ms_tensor_data(bias), nullptr, 0, &f8);
        if (rc <= 0) return rc;
        // no FP8 kernel with the bias epilogue for these dtypes: the product, then the bias
        if (run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, beta,
                   CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, &f8))
            return -1;
        return ms_binary(&out, MS_OP_ADD, out, bias);
    }
    return run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, beta,
                  CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, &f8);
}

// The blockwise-scaled product (DeepSeek-V3's recipe; core/ops.h
// ms_scaled_matmul_blockwise, core/float8.c checked the operands and the
// scales' shapes): cuBLASLt's 1-D (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
// one f32 a 128 elements of a row along K) and 2-D
// (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, one a 128 x 128 block)
// scaling, cuBLASLt 12.9+ on compute capability 9.x (PyTorch's _scaled_mm
// takes the same three pairs there: 1x128 x 1x128, 1x128 x 128x128, 128x128 x
// 1x128). The scales' layouts (float8_cast_blockwise's): 1x128 of an (R, K)
// operand (ceil(K/128), R), the R scales of a K block contiguous; 128x128
// (ceil(R/128), ld), ld = ceil(K/128) rounded up to 4 (16 bytes). The
// library promotes each K block's partial sums into f32 with the block's
// scales; no fast accumulation. A refusal (no algorithm, or the launch)
// comes back as an error naming the shapes and the modes.
extern "C" int ms_cuda_scaled_gemm_blockwise(ms_tensor *out, const ms_tensor *a, const ms_tensor *b,
                                             const ms_tensor *ainv, int a_blocks, const ms_tensor *binv, int b_blocks,
                                             const ms_tensor *bias, double beta) {
    const int device = out->device_id;
    const int64_t m = a->sizes[0], n = b->sizes[0], k = a->sizes[1];
    const char *an = a_blocks == MS_FLOAT8_1X128 ? "1x128" : "128x128";
    const char *bn = b_blocks == MS_FLOAT8_1X128 ? "1x128" : "128x128";
    static int cc[64];   // compute capability x 10 by device (0: not asked yet)
    if (device < 0 || device >= 64)
        return ms_errorf("scaled_matmul_blockwise: cuda:%d is beyond the 64 devices taken", device);
    if (cc[device] == 0) {
        int major = 0, minor = 0;
        if (ms_cuda_device_capability(device, &major, &minor)) return -1;
        cc[device] = major * 10 + minor;
    }
    if (cc[device] / 10 != 9)
        return ms_errorf("scaled_matmul_blockwise: cuBLASLt's 1x128 / 128x128 block scaling runs on compute capability "
                         "9.x (Hopper); cuda:%d is %d.%d", device, cc[device] / 10, cc[device] % 10);
    if (m % 16 || n % 16 || k % 128)
        return ms_errorf("scaled_matmul_blockwise: cuBLASLt's block-scaled FP8 products need M and N multiples of 16 and "
                         "K of 128, got a (%lld, %lld) %s and b (%lld, %lld) %s", (long long)m, (long long)k, an,
                         (long long)n, (long long)k, bn);
    const int64_t lda = m > 1 ? a->strides[0] : k, ldb = n > 1 ? b->strides[0] : k;
    uintptr_t al = (uintptr_t)ms_tensor_data(a) | (uintptr_t)ms_tensor_data(b) | (uintptr_t)ms_tensor_data(out) |
                   (uintptr_t)ms_tensor_data(ainv) | (uintptr_t)ms_tensor_data(binv) |
                   (bias ? (uintptr_t)ms_tensor_data(bias) : 0);
    if (al % 16 || lda % 16 || ldb % 16)
        return ms_errorf("scaled_matmul_blockwise: FP8 operands and scales need 16-byte aligned data and row strides "
                         "that are multiples of 16 (a row stride %lld, b %lld)", (long long)lda, (long long)ldb);
    if (ms_cuda_activate(device) || lt_ready(device)) return -1;
    operand A, B;
    describe(a, 0, &A);
    describe(b, 1, &B);
    A.batch_stride = B.batch_stride = 0;
    const int ma = a_blocks == MS_FLOAT8_1X128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                               : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int mb = b_blocks == MS_FLOAT8_1X128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                               : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    Fp8 f8{a->dtype_id, b->dtype_id, ms_tensor_data(ainv), ms_tensor_data(binv), false, false, ma, mb};
    const int64_t ldc = m == 1 ? n : out->strides[0];
    int rc;
    if (bias) {
        rc = run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, beta,
                    CUBLASLT_EPILOGUE_BIAS, (void *)ms_tensor_data(bias), nullptr, 0, &f8);
        if (rc == 1) {   // no kernel with the bias epilogue: the product, then the bias
            rc = run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, beta,
                        CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, &f8);
            if (rc == 0) return ms_binary(&out, MS_OP_ADD, out, bias);
        }
    } else {
        rc = run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(out), ldc, 0, m, n, k, 1, 1.0, beta,
                    CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, &f8);
    }
    if (rc != 0 && beta == 1.0 && !bias) {
        // (no kernel reading C with block scales: the product into a
        // scratch of out's dtype, then added; one more rounding in f32)
        char first[512];
        snprintf(first, sizeof first, "%s", ms_last_error());
        ms_tmp t;
        const int64_t shape[2] = {m, n};
        rc = ms_tensor_empty(&t.t, 2, shape, out->dtype_id, device);
        if (!rc)
            rc = run_lt(device, a->dtype_id, out->dtype_id, A, B, ms_tensor_data(t.t), n, 0, m, n, k, 1, 1.0, 0.0,
                        CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0, &f8);
        if (!rc) return ms_binary(&out, MS_OP_ADD, out, t.t);
        ms_set_error(first);
        rc = -1;
    }
    if (rc != 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", ms_last_error());
        return ms_errorf("scaled_matmul_blockwise: cuBLASLt refused a (%lld, %lld) f8e4m3 %s x b (%lld, %lld) f8e4m3 "
                         "%s -> %s (M=%lld N=%lld K=%lld, VEC128_32F / BLK128x128_32F on cuda:%d, %d.%d): %s",
                         (long long)m, (long long)k, an, (long long)n, (long long)k, bn,
                         ms_dtype_name(out->dtype_id), (long long)m, (long long)n, (long long)k, device,
                         cc[device] / 10, cc[device] % 10, why);
    }
    return 0;
}
