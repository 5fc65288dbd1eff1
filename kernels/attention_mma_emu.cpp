// kernels/attention_mma_emu.cpp — runs the mma.sync attention kernels of
// kernels/attention_mma.cuh and the wgmma ones of kernels/attention_wgmma.cuh
// on the CPU, thread by thread, and checks out, lse, dq, dk and dv against a
// double-precision reference. The kernels are compiled as they are; only
// their PTX wrappers (ldmatrix(.trans), mma.m16n8k16, wgmma.mma_async with
// its matrix descriptors and 128-byte swizzle, cp.async groups, ex2) are
// replaced (MS_ATTENTION_MMA_EMU) by stand-ins with the semantics of the
// PTX ISA: a block is 128 fibers (fwd_ws_kernel's: 384, three warpgroups)
// (ucontext) switched at every barrier (block, named: bar.sync / bar.arrive
// with a thread count, a named barrier left part-arrived at the block's end
// failing the run) and warp collective; ldmatrix and
// mma exchange the lanes' addresses and fragments through the warp, so a
// wrong fragment index, mask or tile bound shows as a wrong result; cp.async
// lands only when the issuing thread waits, and shared memory starts as
// NaNs, so a read before the wait or of an unwritten row shows too. A
// wgmma runs when the thread waits for its group, reading shared memory
// then, its accumulators NaN until then (a product waited for too early, or
// its registers touched in flight, shows). Blocks
// run one after another: the wgmma one-pass backward's ordered dq sums stop
// the run where a block waits for a count its predecessors did not leave.
// What it cannot see: the hardware's timing (races the barriers do not order
// on the GPU but the fibers' order hides: --eager and --warps below move
// that order to the other extreme; whether the blocks' order could hang
// when they run at once), wgmma.fence's placement, setmaxnreg's budgets (a
// no-op here), and the PTX text itself.
//
// With --gemm it runs the grouped GEMM of kernels/grouped_gemm.cuh instead
// (its three layouts, bf16 and f32 outputs, beta, empty groups, a plan of
// two launches) against a double reference.
//
//   g++ -std=c++17 -O2 -o build/attention_mma_emu kernels/attention_mma_emu.cpp
//   build/attention_mma_emu [--quick] [--reverse] [--eager] [--warps] [--ovl] [--gemm]
//                           (exit status 1 on a mismatch)
// --quick: the launched configurations on 6 shapes (mma at head dims 64,
// 128 and 192, and q/k 192 with v 128, wgmma at 64, 128, q/k 192 with v 128
// and, the forward, 192); else 11 shapes, the
// one-m-tile tilings, (192, 128) with 32-query dk/dv steps and wgmma's
// 128-key forward too; --reverse: the fibers of a block run in reverse order;
// --eager: cp.async lands when issued; --warps: each warp runs on to its
// next block barrier before the next warp starts; --ovl: the overlapped
// wgmma forward's cases only (MS_ATTENTION_WG_FWD=ovl, ovlq) and ws's
// (two consumer warpgroups and a producer, on two longer shapes too; in
// every run).
//
// bf16 only (f16 differs in op<__half>, the PTX type names and the rounding;
// the kernels' f16 instantiations are the same code).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>
#include <ucontext.h>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(x)
using std::max;
using std::min;

struct emu_dim3 {
    unsigned x, y, z;
};
static emu_dim3 threadIdx, blockIdx, gridDim;
struct uint4 {
    unsigned x, y, z, w;
};
struct float2 {
    float x, y;
};
static float2 make_float2(float x, float y) { return {x, y}; }
struct __nv_bfloat16 {
    uint16_t x;
};
static float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f2bf(float f) {  // round to nearest even, as __float2bfloat16_rn
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// ---- a block: 128 fibers (fwd_ws_kernel: 384, three warpgroups), switched
// only at barriers and collectives
static const int kThreads = 384;  // the most a block has
static int nthreads = 128;        // this launch's
static ucontext_t sched_ctx, fiber_ctx[kThreads];
static bool fiber_done[kThreads];
static int cur;
static long progress;
static bool reverse_order;
// --warps: each warp in turn runs until it blocks on a block barrier (by
// default the fibers take turns at every warp collective too, so the warps
// keep step): a block barrier missing between one warp's write and another's
// read (a buffer refilled while another warp's product in flight reads it)
// shows
static bool warp_major;
static std::function<void()> kernel_body;
static void yield_fiber() { swapcontext(&fiber_ctx[cur], &sched_ctx); }
struct barrier {
    int n, arrived;
    long gen;
    void wait() {
        long g = gen;
        progress++;
        if (++arrived == n) {
            arrived = 0;
            gen++;
        } else {
            while (gen == g) yield_fiber();
        }
    }
};
static barrier block_bar = {128, 0, 0}, warp_bar[kThreads / 32], wgroup_bar[kThreads / 128];
static void __syncthreads() { block_bar.wait(); }
static void __syncwarp() { warp_bar[threadIdx.x / 32].wait(); }
// named barriers (bar.sync / bar.arrive id, n; 0 is __syncthreads'): a
// barrier completes when n threads have arrived, a sync counting as an
// arrival and waiting for the completion, an arrive going on. Every use
// while it is partly arrived must name the same n; a barrier left partly
// arrived when the block ends fails the run (its counts do not match)
static barrier named_bar[16];
static void named_check(int id, int n) {
    if (id < 1 || id > 15 || n <= 0 || n % 32 || n > nthreads || (named_bar[id].arrived && named_bar[id].n != n)) {
        printf("bar %d, %d: a barrier id outside 1-15, a count not a multiple of 32 or above the block's %d "
               "threads, or not the count of its pending arrivals (%d of %d)\n",
               id, n, nthreads, named_bar[id].arrived, named_bar[id].n);
        exit(1);
    }
    named_bar[id].n = n;
}
static void emu_bar_sync(int id, int n) {
    named_check(id, n);
    named_bar[id].wait();
}
static void emu_bar_arrive(int id, int n) {
    named_check(id, n);
    barrier &b = named_bar[id];
    progress++;
    if (++b.arrived == b.n) {
        b.arrived = 0;
        b.gen++;
    }
}
static float shfl_slot[kThreads];
static float __shfl_xor_sync(unsigned, float v, int m) {
    int t = threadIdx.x, w = t / 32, l = t % 32;
    shfl_slot[t] = v;
    __syncwarp();
    float r = shfl_slot[w * 32 + (l ^ m)];
    __syncwarp();
    return r;
}
static int any_slot[kThreads];
static bool __any_sync(unsigned, bool p) {
    int t = threadIdx.x, w = t / 32;
    any_slot[t] = p;
    __syncwarp();
    bool r = false;
    for (int l = 0; l < 32; l++) r = r || any_slot[w * 32 + l];
    __syncwarp();
    return r;
}

// what attention.cu defines before including the kernels
struct qkv_layout {
    long long sb, sh, st;
};
static long long at(const qkv_layout &l, long long b, long long h, long long t) { return b * l.sb + h * l.sh + t * l.st; }
static const float kLog2e = 1.4426950408889634f;

#define MS_ATTENTION_MMA_EMU
namespace mma {
alignas(1024) unsigned char sm[256 * 1024];  // the kernels' extern __shared__ buffer
static unsigned smem_u32(const void *p) { return (unsigned)((const unsigned char *)p - sm); }
static const void *addr_slot[kThreads];
static unsigned a_slot[kThreads][4], b_slot[kThreads][2];

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8i..8i+7 give the
// rows of matrix i; lane (g = lane/4, t = lane%4) gets M_i[g][2t, 2t+1]
// (.trans: M_i[2t, 2t+1][g]) in register i, the lower index in the low half
static void ldsm(unsigned r[4], const void *p, bool trans) {
    int t = threadIdx.x, w = t / 32, lane = t % 32;
    if (((uintptr_t)p & 15) || (const unsigned char *)p < sm || (const unsigned char *)p + 16 > sm + sizeof sm) {
        printf("ldmatrix: row address %p unaligned or outside shared memory\n", p);
        exit(1);
    }
    addr_slot[t] = p;
    __syncwarp();
    int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; i++) {
        auto row = [&](int rr) { return (const uint16_t *)addr_slot[w * 32 + 8 * i + rr]; };
        uint16_t lo = trans ? row(2 * q)[g] : row(g)[2 * q], hi = trans ? row(2 * q + 1)[g] : row(g)[2 * q + 1];
        r[i] = lo | ((unsigned)hi << 16);
    }
    __syncwarp();
}
static void ldsm_x4(unsigned r[4], const void *p) { ldsm(r, p, false); }
static void ldsm_x4_t(unsigned r[4], const void *p) { ldsm(r, p, true); }

// cp.async: queued in the thread's open group, lands when the issuing thread
// waits for that group (cp.async.wait_group N: all but its N most recent
// committed groups; copies not yet committed are not waited for)
struct pending_copy {
    void *dst;
    const void *src;
    bool pred;
    int group;
};
static std::vector<pending_copy> pending[kThreads];
static int committed[kThreads];
// --eager: a copy lands when issued (as early as the hardware may; by default
// as late, at the wait): a buffer refilled while a product in flight or
// another thread still reads it shows
static bool eager_copies;
static void cp_async16(void *dst, const void *src, bool pred) {
    if (((uintptr_t)dst & 15) || ((uintptr_t)src & 15)) {
        printf("cp.async: unaligned address\n");
        exit(1);
    }
    if (eager_copies) {
        if (pred) memcpy(dst, src, 16);
        else memset(dst, 0, 16);
        return;
    }
    pending[threadIdx.x].push_back({dst, src, pred, committed[threadIdx.x]});
}
static void cp_async_commit() { committed[threadIdx.x]++; }
static void cp_async_wait_groups(int n) {
    std::vector<pending_copy> &q = pending[threadIdx.x], left;
    for (auto &c : q) {
        if (c.group >= committed[threadIdx.x] - n) {
            left.push_back(c);
            continue;
        }
        if (c.pred) memcpy(c.dst, c.src, 16);
        else memset(c.dst, 0, 16);
    }
    q.swap(left);
}
static void cp_async_wait_all() { cp_async_wait_groups(0); }
template <int N> static void cp_async_wait_n() { cp_async_wait_groups(N); }
static float fast_exp2(float x) { return exp2f(x); }
// fibers switch only at barriers and warp collectives: a read-modify-write
// is atomic here
static float atomicAdd(float *p, float v) {
    float o = *p;
    *p = o + v;
    return o;
}

template <typename T> struct op;
template <> struct op<__nv_bfloat16> {
    // mma.m16n8k16.row.col: A[r][k] sits in lane (r%8)*4 + (k%8)/2, register
    // (r>=8) + 2(k>=8); B[k][c] in lane c*4 + (k%8)/2, register (k>=8); half k&1.
    // Lane (g, t) owns C[g][2t, 2t+1] (c0, c1) and C[g+8][2t, 2t+1] (c2, c3).
    static void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
        int t = threadIdx.x, w = t / 32, lane = t % 32;
        for (int i = 0; i < 4; i++) a_slot[t][i] = a[i];
        b_slot[t][0] = b0;
        b_slot[t][1] = b1;
        __syncwarp();
        auto half = [](unsigned x, int k) { return bf2f((uint16_t)(k & 1 ? x >> 16 : x & 0xffff)); };
        int g = lane >> 2, q = lane & 3;
        for (int e = 0; e < 4; e++) {
            int row = g + 8 * (e >> 1), col = 2 * q + (e & 1);
            float s = 0;
            for (int k = 0; k < 16; k++)
                s += half(a_slot[w * 32 + (row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k) *
                     half(b_slot[w * 32 + col * 4 + (k % 8) / 2][k >= 8], k);
            c[e] += s;
        }
        __syncwarp();
    }
    static unsigned pack(float x, float y) { return f2bf(x) | ((unsigned)f2bf(y) << 16); }
    static float to_float(__nv_bfloat16 x) { return bf2f(x.x); }
};
}  // namespace mma

#include "attention_mma.cuh"

// wgmma.mma_async and friends (attention_wgmma.cuh): the warpgroup is the
// block's 128 fibers. A descriptor (start address >> 4 in bits 0-13, leading
// byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45, swizzle mode
// in 62-63) is decoded as the PTX ISA's 128-byte-swizzle layouts: element
// (row r, column c) of a K-major tile at start + (r / 8) SBO + (r % 8) 128 +
// 2c (c < 64: a k16 step inside one 128-byte row), of an MN-major one (k, n)
// at start + (n / 64) LBO + (k / 8) SBO + (k % 8) 128 + 2 (n % 64) (N = 128
// at head dim 128: two 64-wide atoms along N, LBO apart), and the byte
// address then swizzled: bits 4-6 XOR bits 7-9.
namespace wg {
// wgmma is asynchronous: a product issued by mma_* is queued in the thread's
// open group (commit closes it) and runs when the thread waits for its group
// (wait<N>: all but the N most recent committed groups), reading shared
// memory then, as late as the hardware may. Its accumulators read NaN from
// issue to completion (the hardware leaves them undefined), and a write to
// them or to its A fragment registers in between fails the run: a product
// waited for too early (wait<1> for the wrong group, a missing commit) or
// a buffer overwritten under a product in flight shows as a wrong result.
// Products queued on the same accumulators chain in issue order.
struct wg_pending {
    int group;
    float *d;
    int n, acc;
    bool chained;            // d's input is the result of an earlier queued product
    std::vector<float> in;   // d at issue (not chained)
    std::function<float(int, int)> A, B;
    const unsigned *areg;    // RS: the A fragment registers, as at issue
    unsigned asnap[4];
};
static std::vector<wg_pending> wg_queue[kThreads];
static int wg_committed[kThreads];
static const uint32_t kInFlight = 0x7fc0dead;  // a NaN: an accumulator of a product in flight
static bool in_flight(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u == kInFlight;
}
static void fence() {}
static void commit() { wg_committed[threadIdx.x]++; }
// run the thread's queued products of groups before `upto`
static void wg_run(int upto) {
    const int t = threadIdx.x, w = t / 32 % 4, lane = t % 32, g = lane >> 2, q = lane & 3;  // w: in the warpgroup
    std::vector<wg_pending> &Q = wg_queue[t];
    size_t i = 0;
    for (; i < Q.size() && Q[i].group < upto; i++) {
        wg_pending &p = Q[i];
        for (int e = 0; e < p.n; e++)
            if (!in_flight(p.d[e])) {
                printf("wgmma: thread %d wrote accumulator %d of a product in flight (block %u, %u)\n", t, e,
                       blockIdx.x, blockIdx.y);
                exit(1);
            }
        if (p.areg && memcmp(p.areg, p.asnap, sizeof p.asnap)) {
            printf("wgmma: thread %d wrote the A fragment registers of a product in flight\n", t);
            exit(1);
        }
        if (p.chained) {
            printf("wgmma: a chained product without its input (emulator)\n");
            exit(1);
        }
        std::vector<float> r(p.n);
        for (int j = 0; j < p.n / 4; j++)
            for (int e = 0; e < 4; e++) {
                const int row = w * 16 + g + 8 * (e >> 1), col = 8 * j + 2 * q + (e & 1);
                float s = 0;
                for (int k = 0; k < 16; k++) s += p.A(row, k) * p.B(k, col);
                r[4 * j + e] = (p.acc ? p.in[4 * j + e] : 0.f) + s;
            }
        // the next product queued on these accumulators takes r as its input
        bool handed = false;
        for (size_t j = i + 1; j < Q.size() && !handed; j++)
            if (Q[j].d == p.d && Q[j].chained) {
                Q[j].in = r;
                Q[j].chained = false;
                handed = true;
            }
        if (!handed) memcpy(p.d, r.data(), sizeof(float) * p.n);
    }
    Q.erase(Q.begin(), Q.begin() + i);
}
template <int N> static void wait() { wg_run(wg_committed[threadIdx.x] - N); }
static void fence_proxy() {}
template <int N> static void pin(float *) {}
template <int N> static void pin_u(unsigned *) {}
template <int N> static void cp_async_wait() { mma::cp_async_wait_groups(N); }
#define WG_SMEM unsigned char *wg_smem = mma::sm
// mn: an MN-major operand (row = k, col = m or n), else K-major (row = m or
// n, col = k)
static float sw_at(uint64_t d, int row, int col, bool mn) {
    const unsigned start = (unsigned)(d & 0x3fff) << 4, lbo = (unsigned)((d >> 16) & 0x3fff) << 4,
                   sbo = (unsigned)((d >> 32) & 0x3fff) << 4, mode = (unsigned)(d >> 62);
    if (mode != 1 || sbo != 1024 || (!mn && (lbo != 16 || col >= 64)) ||
        (mn && col >= 64 && (lbo < 1024 || lbo % 1024 != 0))) {
        printf("wgmma: descriptor %llx (mode %u, LBO %u, SBO %u) or %s column %d outside the 128-byte-swizzle layout\n",
               (unsigned long long)d, mode, lbo, sbo, mn ? "MN-major" : "K-major", col);
        exit(1);
    }
    unsigned a = start + (unsigned)(col / 64) * lbo + (unsigned)(row / 8) * sbo + (unsigned)(row % 8) * 128 +
                 (unsigned)(col % 64) * 2;
    a ^= ((a >> 7) & 7) << 4;
    if (a + 2 > sizeof mma::sm) {
        printf("wgmma: operand address %u outside shared memory\n", a);
        exit(1);
    }
    uint16_t v;
    memcpy(&v, mma::sm + a, 2);
    return bf2f(v);
}
static unsigned ra_slot[kThreads][4];
static void bar_sync(int id, int n) { emu_bar_sync(id, n); }
static void bar_arrive(int id, int n) { emu_bar_arrive(id, n); }
template <int N> static void setmaxnreg_dec() {}
template <int N> static void setmaxnreg_inc() {}
// queue d (64 x N) (+)= A(row, k) . B(k, col) over k16 (the thread's
// accumulators: warp w's rows 16w + g (+8), columns 8j + 2q (+1)); areg: the
// A fragment registers of an RS product
template <int N> static void mma_k16(float *d, int acc, std::function<float(int, int)> A,
                                     std::function<float(int, int)> B, const unsigned *areg = nullptr) {
    const int t = threadIdx.x;
    wg_pending p;
    p.group = wg_committed[t];
    p.d = d;
    p.n = N / 2;
    p.acc = acc;
    p.chained = false;
    for (const wg_pending &o : wg_queue[t]) {
        const bool overlap = o.d < d + p.n && d < o.d + o.n;
        if (overlap && (o.d != d || o.n != p.n)) {
            printf("wgmma: products in flight on overlapping accumulators of different shapes\n");
            exit(1);
        }
        p.chained = p.chained || overlap;
    }
    if (!p.chained) p.in.assign(d, d + p.n);
    p.A = A;
    p.B = B;
    p.areg = areg;
    if (areg) memcpy(p.asnap, areg, sizeof p.asnap);
    for (int e = 0; e < p.n; e++) memcpy(&d[e], &kInFlight, 4);
    wg_queue[t].push_back(p);
}
// d (64 x N) (+)= A . B, k16: A (64 x 16) and B (N x 16) K-major
template <typename T, int N> static void mma_ss(float *d, uint64_t a, uint64_t b, int acc) {
    mma_k16<N>(d, acc, [=](int m, int k) { return sw_at(a, m, k, false); },
               [=](int k, int n) { return sw_at(b, n, k, false); });
}
// the A fragment values of the warpgroup's registers (warp w's m16k16
// fragment of rows 16w..) this thread's accumulator rows need, taken at issue
// (exchanged through the warpgroup: its four warps, threads 128 wg..)
static std::function<float(int, int)> reg_a(const unsigned *a) {
    const int t = threadIdx.x, base = t / 128 * 128;
    for (int i = 0; i < 4; i++) ra_slot[t][i] = a[i];
    wgroup_bar[t / 128].wait();
    const int r0 = (t / 32 % 4) * 16 + (t % 32) / 4;
    std::vector<float> v(32);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 16; k++) {
            const int m = r0 + 8 * h, r = m % 16;
            const unsigned x = ra_slot[base + (m / 16) * 32 + (r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)];
            v[16 * h + k] = bf2f((uint16_t)(k & 1 ? x >> 16 : x & 0xffff));
        }
    wgroup_bar[t / 128].wait();
    return [v, r0](int m, int k) {
        if (m != r0 && m != r0 + 8) {
            printf("wgmma: a row outside the thread's accumulators (emulator)\n");
            exit(1);
        }
        return v[16 * (m != r0) + k];
    };
}
// d (64 x N) (+)= A . B, k16: A from the warpgroup's registers (warp w's
// m16k16 fragment of rows 16w..), B (16 x N) MN-major
template <typename T, int N> static void mma_rs_t(float *d, const unsigned *a, uint64_t b, int acc) {
    mma_k16<N>(d, acc, reg_a(a), [=](int k, int n) { return sw_at(b, k, n, true); }, a);
}
// d (64 x N) (+)= A . B, k16: A from the warpgroup's registers, B (N x 16) K-major
template <typename T, int N> static void mma_rs(float *d, const unsigned *a, uint64_t b, int acc) {
    mma_k16<N>(d, acc, reg_a(a), [=](int k, int n) { return sw_at(b, n, k, false); }, a);
}
// d (64 x N) (+)= A . B, k16: A (16 x 64, k x m) and B (16 x N) MN-major
template <typename T, int N> static void mma_ss_tt(float *d, uint64_t a, uint64_t b, int acc) {
    mma_k16<N>(d, acc, [=](int m, int k) { return sw_at(a, k, m, true); },
               [=](int k, int n) { return sw_at(b, k, n, true); });
}
// d (64 x N) (+)= A . B, k16: A (64 x 16) K-major and B (16 x N) MN-major
template <typename T, int N> static void mma_ss_t(float *d, uint64_t a, uint64_t b, int acc) {
    mma_k16<N>(d, acc, [=](int m, int k) { return sw_at(a, m, k, false); },
               [=](int k, int n) { return sw_at(b, k, n, true); });
}
// the one-pass backward's order between blocks (global memory): the blocks
// run one after another in the order of their tickets, so a block's turn
// has come when it waits, or the order is wrong (on the GPU: a hang)
static int atomicAdd(int *p, int v) {
    const int o = *p;
    *p = o + v;
    return o;
}
static void spin_until(const int *p, int v) {
    if (*p != v) {
        printf("spin_until: block (%u, %u) thread %u waits for count %d, reads %d: a wrong order\n", blockIdx.x,
               blockIdx.y, threadIdx.x, v, *p);
        exit(1);
    }
}
static void __threadfence() {}
static float2 __ldcg(const float2 *p) { return *p; }
static void __stcg(float2 *p, float2 v) { *p = v; }
}  // namespace wg
#include "attention_wgmma.cuh"
#define __grid_constant__
#include "grouped_gemm.cuh"

static char stacks[kThreads][128 * 1024];
static void trampoline() {
    kernel_body();
    fiber_done[cur] = true;
    progress++;
}
// run body() as a grid of gx x gy blocks of nt threads (128 or 384)
static void launch(unsigned gx, unsigned gy, std::function<void()> body, int nt = 128) {
    kernel_body = body;
    gridDim = {gx, gy, 1};
    nthreads = nt;
    block_bar = {nt, 0, 0};
    for (barrier &b : warp_bar) b = {32, 0, 0};
    for (barrier &b : wgroup_bar) b = {128, 0, 0};
    for (barrier &b : named_bar) b = {0, 0, 0};
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bx = 0; bx < gx; bx++) {
            blockIdx = {bx, by, 0};
            memset(mma::sm, 0xff, sizeof mma::sm);  // bf16 NaNs: a stale read shows
            for (int t = 0; t < nthreads; t++) {
                getcontext(&fiber_ctx[t]);
                fiber_ctx[t].uc_stack.ss_sp = stacks[t];
                fiber_ctx[t].uc_stack.ss_size = sizeof stacks[t];
                fiber_ctx[t].uc_link = &sched_ctx;
                makecontext(&fiber_ctx[t], trampoline, 0);
                fiber_done[t] = false;
            }
            // one sweep over fibers [t0, t1): each runs to its next barrier or collective
            auto sweep = [&](int t0, int t1, bool &all) {
                for (int i = t0; i < t1; i++) {
                    int t = reverse_order ? nthreads - 1 - i : i;
                    if (fiber_done[t]) continue;
                    all = false;
                    cur = t;
                    threadIdx = {(unsigned)t, 0, 0};
                    swapcontext(&sched_ctx, &fiber_ctx[t]);
                }
            };
            for (;;) {
                long p = progress;
                bool all = true;
                if (warp_major) {
                    // a warp runs as far as it can (to a block barrier) before the next starts
                    for (int w = 0; w < nthreads / 32; w++)
                        for (long q = -1; q != progress;) {
                            q = progress;
                            sweep(32 * w, 32 * w + 32, all);
                        }
                } else {
                    sweep(0, nthreads, all);
                }
                if (all) break;
                if (p == progress) {
                    printf("deadlock: block (%u, %u) stopped at a barrier not every thread reaches\n", bx, by);
                    exit(1);
                }
            }
            for (int t = 0; t < nthreads; t++)
                if (!mma::pending[t].empty() || !wg::wg_queue[t].empty()) {
                    printf("%s never waited for (thread %d)\n", mma::pending[t].empty() ? "wgmma" : "cp.async", t);
                    exit(1);
                }
            for (int id = 1; id < 16; id++)
                if (named_bar[id].arrived) {
                    printf("bar %d: left with %d of %d arrivals when block (%u, %u) ended\n", id,
                           named_bar[id].arrived, named_bar[id].n, bx, by);
                    exit(1);
                }
        }
}

typedef __nv_bfloat16 bf;
// a (B, H, T, D) bf16 tensor, contiguous or a (B, T, H, D) layout seen as one
struct tensor4 {
    int B, H, T, D;
    std::vector<bf> v;
    qkv_layout l;
    tensor4(int B_, int H_, int T_, int D_, bool bthd) : B(B_), H(H_), T(T_), D(D_) {
        v.resize((size_t)B * H * T * D + 16);
        l = bthd ? qkv_layout{(long long)T * H * D, D, (long long)H * D}
                 : qkv_layout{(long long)H * T * D, (long long)T * D, D};
    }
    bf *data() { return (bf *)(((uintptr_t)v.data() + 15) & ~(uintptr_t)15); }
    float get(int b, int h, int t, int d) { return bf2f(data()[at(l, b, h, t) + d].x); }
    void set(int b, int h, int t, int d, float x) { data()[at(l, b, h, t) + d].x = f2bf(x); }
};

struct errsum {
    double e = 0, n = 0;
    void add(double got, double want) { e += (got - want) * (got - want), n += want * want; }
    double rel() const { return n > 0 ? sqrt(e / n) : sqrt(e); }
};

// the kernels at q/k head dim D and v head dim DV with m-tiles MT (forward),
// KMT and BQ (dk/dv), QMT (dq); wg: the wgmma kernels instead (D = DV = 64
// or 128, or D = 192 with DV = 128 or 192; MT is the forward's key tile, BQ
// the dk/dv kernel's query step; the one pass at 64 only; at D = DV = 192
// the forward only, the backward on the mma kernels of config<192> as
// attention.cu runs it).
// sharp > 0: q times 1 + sharp and key t times 1 + sharp*t/64, so that the
// rows' maxima climb by far more than the forward's kStale from tile to tile
// (its O rescaling runs, and is skipped, within one row)
// FWD (wgmma): 0 the forward as launched by default (fwd_kernel); 1, 2
// fwd_ovl_kernel (MS_ATTENTION_WG_FWD=ovl, ovlq: Q's fragments in
// registers); 3 fwd_ws_kernel (ws: two consumer warpgroups and a producer);
// the forward only (out and lse; the backward is the same code)
template <int D, int DV, int MT, int BQ, int KMT, int QMT, bool WG = false, int FWD = 0>
static int run_case(int B, int H, int Hkv, int Tq, int Tk, bool causal, bool bthd, unsigned seed,
                    float sharp = 0.f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    // bthd: every tensor a (B, T, H, D) layout, as nnf.qkv_attention hands
    // them over (views of GPT-2's fused projection, its output and gradient)
    tensor4 q(B, H, Tq, D, bthd), k(B, Hkv, Tk, D, bthd), v(B, Hkv, Tk, DV, bthd), g(B, H, Tq, DV, bthd);
    tensor4 o(B, H, Tq, DV, bthd), dq(B, H, Tq, D, bthd), dk(B, Hkv, Tk, D, bthd), dv(B, Hkv, Tk, DV, bthd);
    for (tensor4 *x : {&q, &k, &v, &g})
        for (int b = 0; b < x->B; b++)
            for (int h = 0; h < x->H; h++)
                for (int t = 0; t < x->T; t++) {
                    const float mul = x == &q ? 1.f + sharp : x == &k ? 1.f + sharp * t / 64.f : 1.f;
                    for (int d = 0; d < x->D; d++) x->set(b, h, t, d, nd(rng) * mul);
                }
    for (tensor4 *x : {&o, &dq, &dk, &dv})
        for (auto &e : x->v) e.x = 0x7fc0;  // NaN: an unwritten element shows
    const float scale = 1.f / sqrtf((float)D);
    std::vector<float> lse((size_t)B * H * Tq, NAN), delta((size_t)B * H * Tq);
    // the wgmma backward (WGB), else the mma one (at D = DV = 192 with WG: config<192>'s tiles)
    constexpr bool BWD = FWD == 0;   // the backward too
    constexpr bool WGB = WG && !(D == 192 && DV == 192);
    typedef mma::config<D, DV> CB;
    constexpr bool MB = WG && !WGB;   // the mma backward of a wgmma forward
    constexpr int mBQ = MB ? CB::dkdv_bq : BQ, mKMT = MB ? CB::dkdv_mt : KMT, mQMT = MB ? CB::dq_mt : QMT;
    if constexpr (FWD == 3) {
        static_assert(WG && (D == 128 || D == 192) && DV == 128, "fwd_ws_kernel: q/k 128 or 192, v 128");
        launch((Tq + 127) / 128, B * H, [&] {
            wg::fwd_ws_kernel<bf, D, DV>(o.data(), lse.data(), q.data(), k.data(), v.data(), q.l, k.l, v.l, o.l, H, Hkv,
                                         Tq, Tk, scale, causal);
        }, 384);
    } else if constexpr (FWD > 0) {
        static_assert(WG && (D == 128 || D == 192) && DV == 128, "fwd_ovl_kernel: q/k 128 or 192, v 128");
        launch((Tq + 63) / 64, B * H, [&] {
            wg::fwd_ovl_kernel<bf, D, DV, FWD == 2>(o.data(), lse.data(), q.data(), k.data(), v.data(), q.l, k.l, v.l,
                                                   o.l, H, Hkv, Tq, Tk, scale, causal);
        });
    } else if constexpr (WG) {
        static_assert(((D == 64 || D == 128) && DV == D) || (D == 192 && (DV == 128 || DV == 192)),
                      "wgmma kernels: head dim 64 or 128, or q/k 192 with v 128 or 192");
        launch((Tq + 63) / 64, B * H, [&] {
            wg::fwd_kernel<bf, MT, D, DV>(o.data(), lse.data(), q.data(), k.data(), v.data(), q.l, k.l, v.l, o.l, H, Hkv, Tq,
                                   Tk, scale, causal);
        });
    } else {
        launch((Tq + 64 * MT - 1) / (64 * MT), B * H, [&] {
            mma::fwd_kernel<bf, D, DV, MT>(o.data(), lse.data(), q.data(), k.data(), v.data(), q.l, k.l, v.l, o.l, H, Hkv,
                                       Tq, Tk, scale, causal);
        });
    }
    // the reference (double); the backward's delta from the kernel's out, as attention.cu does
    const int rep = H / Hkv;
    const long long off = Tk - Tq;
    errsum eo, el, edq, edk, edv;
    bool lse_inf_ok = true;
    std::vector<double> rdq((size_t)B * H * Tq * D), rdk((size_t)B * Hkv * Tk * D), rdv((size_t)B * Hkv * Tk * DV);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < Tq; i++) {
                const int gk = h / rep;
                std::vector<double> s(Tk), p(Tk, 0);
                double m = -INFINITY, sum = 0, dl = 0;
                for (int j = 0; j < Tk; j++) {
                    s[j] = -INFINITY;
                    if (causal && j > i + off) continue;
                    double a = 0;
                    for (int d = 0; d < D; d++) a += (double)q.get(b, h, i, d) * k.get(b, gk, j, d);
                    s[j] = a * scale;
                    m = max(m, s[j]);
                }
                for (int j = 0; j < Tk; j++)
                    if (s[j] > -INFINITY) sum += p[j] = exp(s[j] - m);
                const float Lg = lse[((size_t)b * H + h) * Tq + i];
                if (sum > 0) el.add(Lg, m + log(sum));
                else lse_inf_ok = lse_inf_ok && std::isinf(Lg) && Lg < 0;
                for (int d = 0; d < DV; d++) {
                    double od = 0;
                    for (int j = 0; j < Tk; j++)
                        if (p[j] > 0) od += p[j] / sum * v.get(b, gk, j, d);
                    eo.add(o.get(b, h, i, d), od);
                    dl += (double)g.get(b, h, i, d) * o.get(b, h, i, d);
                }
                delta[((size_t)b * H + h) * Tq + i] = (float)dl;
                for (int j = 0; j < Tk; j++) {
                    if (p[j] == 0) continue;
                    double P = p[j] / sum, dp = 0;
                    for (int d = 0; d < DV; d++) dp += (double)g.get(b, h, i, d) * v.get(b, gk, j, d);
                    const double ds = P * (dp - dl);
                    for (int d = 0; d < D; d++) {
                        rdq[(((size_t)b * H + h) * Tq + i) * D + d] += ds * k.get(b, gk, j, d) * scale;
                        rdk[(((size_t)b * Hkv + gk) * Tk + j) * D + d] += ds * q.get(b, h, i, d) * scale;
                    }
                    for (int d = 0; d < DV; d++) rdv[(((size_t)b * Hkv + gk) * Tk + j) * DV + d] += P * g.get(b, h, i, d);
                }
            }
    // a dq as stored against the reference
    auto dq_err = [&](tensor4 &t, errsum &e) {
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < Tq; i++)
                    for (int d = 0; d < D; d++) e.add(t.get(b, h, i, d), rdq[(((size_t)b * H + h) * Tq + i) * D + d]);
    };
    // the wgmma kernels' column sums of dq, dk, dv (the fused qkv bias
    // gradient): a row of partial sums per (batch, tile), NaN-filled
    const long long tq = (Tq + 63) / 64, tk = (Tk + 63) / 64;
    std::vector<float> pq((size_t)(B * tq * H * D), NAN), pkv((size_t)(B * tk * Hkv * (D + DV)), NAN);
    // wgmma: as attention.cu runs it by default, dq_kernel first, computing
    // Delta from the forward's out into dfused (NaN-filled), then dkdv_kernel
    // reading it
    std::vector<float> dfused((size_t)B * H * Tq, NAN);
    errsum edelta, edq0;
    if constexpr (!BWD) {
    } else if constexpr (WGB) {
        launch((Tq + 63) / 64, B * H, [&] {
            wg::dq_kernel<bf, D, DV>(dq.data(), q.data(), k.data(), v.data(), g.data(), lse.data(), nullptr, q.l, k.l, v.l,
                              g.l, dq.l, H, Hkv, Tq, Tk, scale, causal, pq.data(), o.data(), o.l, dfused.data());
        });
        for (size_t i = 0; i < delta.size(); i++) edelta.add(dfused[i], delta[i]);
        // and as it runs with the delta kernel (ms_cuda_attention_set_fused_delta(0)):
        // Delta read, not computed
        tensor4 dq0(B, H, Tq, D, bthd);
        for (auto &e : dq0.v) e.x = 0x7fc0;
        launch((Tq + 63) / 64, B * H, [&] {
            wg::dq_kernel<bf, D, DV>(dq0.data(), q.data(), k.data(), v.data(), g.data(), lse.data(), delta.data(), q.l, k.l,
                              v.l, g.l, dq0.l, H, Hkv, Tq, Tk, scale, causal);
        });
        dq_err(dq0, edq0);
        launch((Tk + 63) / 64, B * Hkv, [&] {
            wg::dkdv_kernel<bf, false, D, DV, BQ>(dk.data(), dv.data(), q.data(), k.data(), v.data(), g.data(), lse.data(), dfused.data(),
                                q.l, k.l, v.l, g.l, dk.l, dv.l, H, Hkv, Tq, Tk, scale, causal, pkv.data());
        });
    } else {
        launch((Tk + 64 * mKMT - 1) / (64 * mKMT), B * Hkv, [&] {
            mma::dkdv_kernel<bf, D, DV, mBQ, mKMT>(dk.data(), dv.data(), q.data(), k.data(), v.data(), g.data(), lse.data(),
                                             delta.data(), q.l, k.l, v.l, g.l, dk.l, dv.l, H, Hkv, Tq, Tk, scale, causal);
        });
        launch((Tq + 64 * mQMT - 1) / (64 * mQMT), B * H, [&] {
            mma::dq_kernel<bf, D, DV, mQMT>(dq.data(), q.data(), k.data(), v.data(), g.data(), lse.data(), delta.data(), q.l,
                                       k.l, v.l, g.l, dq.l, H, Hkv, Tq, Tk, scale, causal);
        });
    }
    // the one-pass backward: dk, dv again and dq (mma: through f32 atomics;
    // wgmma: added in key-block order inside dkdv_kernel<bf, true>)
    tensor4 dk1(B, Hkv, Tk, D, bthd), dv1(B, Hkv, Tk, DV, bthd);
    for (tensor4 *x : {&dk1, &dv1})
        for (auto &e : x->v) e.x = 0x7fc0;
    std::vector<float> dqacc((size_t)B * H * Tq * D, 0.f);
    // wgmma's: dq in dq1 (added in key-block order through dqacc, NaN-filled:
    // key block 0 writes before anyone reads), only where attention.cu runs it
    tensor4 dq1(B, H, Tq, D, bthd);
    for (auto &e : dq1.v) e.x = 0x7fc0;
    const bool wg1 = WG && BWD && D == 64 && causal && Tk >= Tq;   // where attention.cu runs the one pass
    if (wg1) {
        std::fill(dqacc.begin(), dqacc.end(), NAN);
        std::vector<int> sem((size_t)(1 + B * H * tq), 0);
        launch((Tk + 63) / 64, B * Hkv, [&] {
            wg::dkdv_kernel<bf, true>(dk1.data(), dv1.data(), q.data(), k.data(), v.data(), g.data(), lse.data(),
                                      delta.data(), q.l, k.l, v.l, g.l, dk1.l, dv1.l, H, Hkv, Tq, Tk, scale, causal,
                                      nullptr, dq1.data(), dq1.l, dqacc.data(), sem.data());
        });
    }
    if (!WG) launch((Tk + 64 * KMT - 1) / (64 * KMT), B * Hkv, [&] {
        mma::dkdv_kernel<bf, D, DV, BQ, KMT, true>(dk1.data(), dv1.data(), q.data(), k.data(), v.data(), g.data(),
                                               lse.data(), delta.data(), q.l, k.l, v.l, g.l, dk1.l, dv1.l, H, Hkv, Tq,
                                               Tk, scale, causal, dqacc.data());
    });
    errsum edq1, edk1, edv1;
    for (int b = 0; b < B && (!WG || wg1); b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < Tq; i++)
                for (int d = 0; d < D; d++) {
                    // rounded to bf16 as the conversion kernel stores it
                    const float x = WG ? dq1.get(b, h, i, d) : bf2f(f2bf(dqacc[(((size_t)b * H + h) * Tq + i) * D + d]));
                    edq1.add(x, rdq[(((size_t)b * H + h) * Tq + i) * D + d]);
                }
    for (int b = 0; b < B && (!WG || wg1); b++)
        for (int h = 0; h < Hkv; h++)
            for (int j = 0; j < Tk; j++) {
                for (int d = 0; d < D; d++) edk1.add(dk1.get(b, h, j, d), rdk[(((size_t)b * Hkv + h) * Tk + j) * D + d]);
                for (int d = 0; d < DV; d++)
                    edv1.add(dv1.get(b, h, j, d), rdv[(((size_t)b * Hkv + h) * Tk + j) * DV + d]);
            }
    if (BWD) dq_err(dq, edq);
    for (int b = 0; b < B && BWD; b++)
        for (int h = 0; h < Hkv; h++)
            for (int j = 0; j < Tk; j++) {
                for (int d = 0; d < D; d++) edk.add(dk.get(b, h, j, d), rdk[(((size_t)b * Hkv + h) * Tk + j) * D + d]);
                for (int d = 0; d < DV; d++) edv.add(dv.get(b, h, j, d), rdv[(((size_t)b * Hkv + h) * Tk + j) * DV + d]);
            }
    // the partial rows summed (as attention.cu's part_colsum_kernel) against
    // the column sums of the stored dq, dk, dv
    errsum esum;
    if (WGB && BWD) {
        // p's rows from element base on, heads x cols each
        auto check_sums = [&](const std::vector<float> &p, long long base, long long rows, int heads, int cols,
                              tensor4 &t, int Tn) {
            for (int h = 0; h < heads; h++)
                for (int d = 0; d < cols; d++) {
                    float s = 0;
                    for (long long r = 0; r < rows; r++) s += p[(size_t)(base + r * heads * cols + h * cols + d)];
                    double want = 0;
                    for (int b = 0; b < B; b++)
                        for (int i = 0; i < Tn; i++) want += t.get(b, h, i, d);
                    esum.add(s, want);
                }
        };
        check_sums(pq, 0, B * tq, H, D, dq, Tq);
        check_sums(pkv, 0, B * tk, Hkv, D, dk, Tk);
        check_sums(pkv, B * tk * Hkv * D, B * tk, Hkv, DV, dv, Tk);
    }
    // bf16 bounds as spec/gpu_attention_spec.lua; NaN fails every comparison
    const double r[8] = {eo.rel(), el.rel(), edq.rel(), edk.rel(), edv.rel(), edq1.rel(), edk1.rel(), edv1.rel()};
    bool ok = lse_inf_ok && (!WGB || !BWD || (esum.rel() <= 1e-5 && edelta.rel() <= 1e-5 && edq0.rel() <= 1e-2));
    for (int i = 0; i < 8; i++) ok = ok && r[i] <= (i == 1 ? 1e-5 : 1e-2);
    char dims[32];
    if (DV == D) snprintf(dims, sizeof dims, "D=%d", D);
    else snprintf(dims, sizeof dims, "D=%d Dv=%d", D, DV);
    printf("%s %s %s [%d %d/%d %d] B=%d H=%d Hkv=%d Tq=%d Tk=%d %s%s%s: out %.1e lse %.1e",
           ok ? "ok  " : "FAIL", FWD == 1 ? "wgmma ovl" : FWD == 2 ? "wgmma ovlq" : FWD == 3 ? "wgmma ws" : WG ? "wgmma" : "mma  ", dims, MT, mBQ, mKMT, mQMT, B, H, Hkv, Tq, Tk,
           causal ? "causal" : "full", bthd ? " (B,T,H,D) views" : "", sharp > 0 ? " sharp" : "", r[0], r[1]);
    if (!BWD) {
        printf("; the forward only\n");
        return ok ? 0 : 1;
    }
    printf(" dq %.1e dk %.1e dv %.1e", r[2], r[3], r[4]);
    if (WGB) printf("; column sums %.1e; Delta in dq %.1e (Delta read: dq %.1e)", esum.rel(), edelta.rel(), edq0.rel());
    if (!WG || wg1) printf("; one pass dq %.1e dk %.1e dv %.1e\n", r[5], r[6], r[7]);
    else printf("; one pass: not run (not causal, Tk < Tq, or D > 64)%s\n",
                WGB ? "" : "; backward on the mma kernels (config<192>)");
    return ok ? 0 : 1;
}

// ---- the grouped GEMM (kernels/grouped_gemm.cuh): groups of C_g = op(A_g)
// op(B_g) + beta C_g planned by gg_plan (launches of up to GG_MAXG groups)
// and run block by block, against a double reference from the same bf16
// inputs. Each operand lives in its own buffer with a row stride 8 past its
// widest row, C's padding columns and rows past M_g hold a sentinel that
// must survive; with beta = 0, C starts as NaNs (read, they would show).
struct buf16 {
    std::vector<uint16_t> v;
    explicit buf16(size_t n) : v(n + 16) {}
    uint16_t *data() { return (uint16_t *)(((uintptr_t)v.data() + 15) & ~(uintptr_t)15); }
};
// KIND 0: gg_kernel (mma.sync); 3 or 4: gw_kernel (wgmma) with that many stages
template <typename OutT, bool AK, bool BK, int KIND = 0>
static int run_gg_case(const std::vector<int> &ms, const std::vector<int> &ks, int N, float beta, unsigned seed) {
    const int G = (int)ms.size();
    const bool f32 = sizeof(OutT) == 4;
    int mmax = 0, kmax = 0;
    for (int g = 0; g < G; g++) mmax = max(mmax, ms[g]), kmax = max(kmax, ks[g]);
    // row strides: A [m][k] or [k][m], B [n][k] or [k][n], C [m][n]
    const long long lda = (AK ? kmax : mmax) + 8, ldb = (BK ? kmax : N) + 8, ldc = N + 8;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<buf16> A, B;
    std::vector<std::vector<float>> Cf;
    std::vector<buf16> Cb;
    std::vector<mma::gg_group> gs(G);
    std::vector<std::vector<double>> want(G);
    const float sentinel = 12345.f;
    for (int g = 0; g < G; g++) {
        const int M = ms[g], K = ks[g];
        A.emplace_back((size_t)(AK ? max(M, 1) : max(K, 1)) * lda);
        B.emplace_back((size_t)(BK ? N : max(K, 1)) * ldb);
        for (auto &x : A.back().v) x = f2bf(nd(rng));
        for (auto &x : B.back().v) x = f2bf(nd(rng));
        const size_t csz = (size_t)(M + 2) * ldc;
        if (f32) Cf.emplace_back(csz, sentinel);
        else {
            Cb.emplace_back(csz);
            for (auto &x : Cb.back().v) x = f2bf(sentinel);
        }
        auto cget = [&](long long i) { return f32 ? (double)Cf[g][i] : (double)bf2f(Cb[g].data()[i]); };
        auto cset = [&](long long i, float x) {
            if (f32) Cf[g][i] = x;
            else Cb[g].data()[i] = f2bf(x);
        };
        const uint16_t *a = A[g].data(), *b = B[g].data();
        want[g].assign((size_t)M * N, 0);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                const long long ci = (long long)i * ldc + j;
                cset(ci, beta != 0.f ? nd(rng) : NAN);
                double s = beta != 0.f ? beta * cget(ci) : 0;
                for (int k = 0; k < K; k++)
                    s += (double)bf2f(AK ? a[i * lda + k] : a[k * lda + i]) * bf2f(BK ? b[j * ldb + k] : b[k * ldb + j]);
                want[g][(size_t)i * N + j] = s;
            }
        gs[g] = {a, b, f32 ? (void *)Cf[g].data() : (void *)Cb[g].data(), M, K};
    }
    int launches = 0;
    mma::gg_plan(gs.data(), G, N, lda, ldb, ldc, beta, [&](const mma::gg_args &p, int tx, int ty) {
        launches++;
        if constexpr (KIND == 0) launch(tx, ty, [&] { mma::gg_kernel<bf, OutT, AK, BK>(p); });
        else launch(tx, ty, [&] { wg::gw_kernel<bf, OutT, AK, BK, KIND>(p); });
        return 0;
    });
    errsum e;
    bool kept = true;
    for (int g = 0; g < G; g++) {
        const double *w = want[g].data();
        for (int i = 0; i < ms[g] + 2; i++)
            for (int j = 0; j < ldc; j++) {
                const long long ci = (long long)i * ldc + j;
                const double got = f32 ? (double)Cf[g][ci] : (double)bf2f(Cb[g].data()[ci]);
                if (i < ms[g] && j < N) e.add(got, w[(size_t)i * N + j]);
                else kept = kept && got == (f32 ? sentinel : bf2f(f2bf(sentinel)));
            }
    }
    const bool ok = kept && e.rel() <= (f32 ? 1e-5 : 1e-2);
    printf("%s grouped gemm %s %s%s %s out, beta %g, N=%d, %d groups (%d launches): rel %.1e%s\n", ok ? "ok  " : "FAIL",
           KIND == 0 ? "mma  " : KIND == 3 ? "wgmma3" : "wgmma4", AK ? "A[m][k]" : "A[k][m]", BK ? " B[n][k]" : " B[k][n]", f32 ? "f32" : "bf16", beta, N, G, launches,
           e.rel(), kept ? "" : "; wrote outside C");
    return ok ? 0 : 1;
}
template <int KIND> static int run_gg_cases(unsigned seed) {
    int bad = 0;
    // the forward (rows x weight^T): M straddling tiles, an empty group, K not a multiple of 32
    bad += run_gg_case<bf, true, true, KIND>({130, 0, 1, 64}, {40, 40, 40, 40}, 136, 0.f, seed++);
    bad += run_gg_case<float, true, true, KIND>({130, 7}, {200, 24}, 8, 1.f, seed++);
    // the input gradient (rows x weight), accumulating
    bad += run_gg_case<bf, true, false, KIND>({3, 129}, {48, 136}, 24, 1.f, seed++);
    bad += run_gg_case<float, true, false, KIND>({200}, {16}, 144, 0.f, seed++);
    // the weight gradients (rows^T x rows): K the rows (none, a few, past a slice), f32 out
    bad += run_gg_case<float, false, false, KIND>({136, 136, 136}, {0, 3, 130}, 16, 0.f, seed++);
    bad += run_gg_case<bf, false, false, KIND>({8, 8}, {33, 1}, 136, 1.f, seed++);
    // more groups than one launch takes
    std::vector<int> m(mma::GG_MAXG + 20), k(mma::GG_MAXG + 20, 8);
    for (size_t i = 0; i < m.size(); i++) m[i] = i % 10 == 0 ? 0 : 1 + (int)(i % 3) * 5;
    bad += run_gg_case<bf, true, true, KIND>(m, k, 8, 0.f, seed++);
    return bad;
}
static int run_gg_cases() { return run_gg_cases<0>(100) + run_gg_cases<3>(200) + run_gg_cases<4>(300); }  // (3 stages: kept working for tuning)

int main(int argc, char **argv) {
    bool quick = false, gemm = false, ovl_only = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--reverse")) reverse_order = true;
        else if (!strcmp(argv[i], "--gemm")) gemm = true;
        else if (!strcmp(argv[i], "--eager")) mma::eager_copies = true;
        else if (!strcmp(argv[i], "--ovl")) ovl_only = true;
        else if (!strcmp(argv[i], "--warps")) warp_major = true;
        else {
            fprintf(stderr, "usage: %s [--quick] [--reverse] [--eager] [--warps] [--ovl] [--gemm]\n", argv[0]);
            return 2;
        }
    }
    if (gemm) {
        const int bad = run_gg_cases();
        printf("%d failed\n", bad);
        return bad != 0;
    }
    struct shape {
        int B, H, Hkv, Tq, Tk;
        bool causal, bthd, in_quick;
    } cases[] = {
        {1, 2, 1, 1, 1, true, false, true},      {1, 2, 2, 17, 17, false, true, true},
        {1, 2, 1, 130, 130, true, false, true},  {1, 2, 2, 130, 130, false, false, false},
        {1, 4, 2, 20, 150, true, true, true},    {2, 1, 1, 37, 91, false, false, true},
        {1, 2, 1, 150, 70, true, false, true},   {1, 1, 1, 1, 130, true, false, false},
        {1, 2, 2, 200, 70, false, false, false}, {1, 2, 1, 200, 130, true, true, false},
        {1, 1, 1, 256, 256, true, false, false},
    };
    int bad = 0;
    unsigned seed = 1, oseed = 5000, wseed = 7000;   // (oseed: the cases added later; the others keep their data)
    for (auto &c : cases) {
        if (quick && !c.in_quick) continue;
        constexpr int BQ192 = wg::dkdv_bq<192>();
        if (!ovl_only) {
            // the configurations attention.cu launches ...
            typedef mma::config<64> C64;
            typedef mma::config<128> C128;
            bad += run_case<64, 64, C64::fwd_mt, C64::dkdv_bq, C64::dkdv_mt, C64::dq_mt>(c.B, c.H, c.Hkv, c.Tq, c.Tk,
                                                                                         c.causal, c.bthd, seed++);
            bad += run_case<128, 128, C128::fwd_mt, C128::dkdv_bq, C128::dkdv_mt, C128::dq_mt>(c.B, c.H, c.Hkv, c.Tq,
                                                                                                c.Tk, c.causal, c.bthd,
                                                                                                seed++);
            typedef mma::config<192> C192;   // (DeepSeek-V3's q/k heads)
            bad += run_case<192, 192, C192::fwd_mt, C192::dkdv_bq, C192::dkdv_mt, C192::dq_mt>(c.B, c.H, c.Hkv, c.Tq,
                                                                                                c.Tk, c.causal, c.bthd,
                                                                                                seed++);
            typedef mma::config<192, 128> CMla;   // (DeepSeek-V3's MLA: q/k 192, v 128)
            bad += run_case<192, 128, CMla::fwd_mt, CMla::dkdv_bq, CMla::dkdv_mt, CMla::dq_mt>(c.B, c.H, c.Hkv, c.Tq,
                                                                                                c.Tk, c.causal, c.bthd,
                                                                                                seed++);
            // ... and the other tilings (one m-tile a warp, 64-query dk/dv steps; MLA's with
            // 32-query steps), kept working for tuning
            if (!quick) bad += run_case<64, 64, 1, 64, 1, 1>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            if (!quick) bad += run_case<192, 128, 1, 32, 1, 1>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            // the wgmma kernels (64-key forward tiles as launched; 128 kept for tuning)
            bad += run_case<64, 64, 64, 64, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            bad += run_case<64, 64, 64, 64, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++, 3.f);
            if (!quick) bad += run_case<64, 64, 128, 64, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            // ... and at head dim 128 (64-key forward tiles, as launched)
            bad += run_case<128, 128, 64, 64, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            bad += run_case<128, 128, 64, 64, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++, 3.f);
            // ... and at q/k 192 with v 128 (DeepSeek's MLA; 32-query dk/dv steps) and
            // v 192 (the forward; its backward on the mma kernels), as launched
            bad += run_case<192, 128, 64, BQ192, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            bad += run_case<192, 128, 64, BQ192, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++, 3.f);
            bad += run_case<192, 192, 64, BQ192, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++);
            bad += run_case<192, 192, 64, BQ192, 1, 1, true>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, seed++, 3.f);
        }
        // ... and the overlapped forward (MS_ATTENTION_WG_FWD=ovl, ovlq) at 128 and (192, 128)
        bad += run_case<128, 128, 64, 64, 1, 1, true, 1>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++);
        bad += run_case<128, 128, 64, 64, 1, 1, true, 1>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++, 3.f);
        bad += run_case<128, 128, 64, 64, 1, 1, true, 2>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++);
        bad += run_case<128, 128, 64, 64, 1, 1, true, 2>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++, 3.f);
        bad += run_case<192, 128, 64, BQ192, 1, 1, true, 1>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++);
        bad += run_case<192, 128, 64, BQ192, 1, 1, true, 1>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++, 3.f);
        bad += run_case<192, 128, 64, BQ192, 1, 1, true, 2>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++);
        bad += run_case<192, 128, 64, BQ192, 1, 1, true, 2>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, oseed++, 3.f);
        // ... and the forward of two consumer warpgroups and a producer (MS_ATTENTION_WG_FWD=ws)
        bad += run_case<128, 128, 64, 64, 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, wseed++);
        bad += run_case<128, 128, 64, 64, 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, wseed++, 3.f);
        bad += run_case<192, 128, 64, BQ192, 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, wseed++);
        bad += run_case<192, 128, 64, BQ192, 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, wseed++,
                                                              3.f);
    }
    // ws's three stages come round only from the fourth key tile on (its
    // producer then waits for the consumers' releases): longer rows too; and
    // causal blocks of 128 queries that see no key at all (Tq - Tk >= 128)
    const shape long_cases[] = {{1, 2, 1, 450, 450, true, false, true}, {1, 2, 2, 70, 520, false, true, true},
                                {1, 2, 1, 300, 40, true, false, true}};
    for (auto &c : long_cases) {
        bad += run_case<128, 128, 64, 64, 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, wseed++);
        bad += run_case<128, 128, 64, 64, 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal, c.bthd, wseed++, 3.f);
        bad += run_case<192, 128, 64, wg::dkdv_bq<192>(), 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal,
                                                                        c.bthd, wseed++);
        bad += run_case<192, 128, 64, wg::dkdv_bq<192>(), 1, 1, true, 3>(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.causal,
                                                                        c.bthd, wseed++, 3.f);
    }
    printf("%d failed\n", bad);
    return bad != 0;
}
