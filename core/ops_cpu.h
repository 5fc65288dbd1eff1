/* core/ops_cpu.h — the CPU reference kernels core/ops.c dispatches to
 * (core/ops_cpu.c; rand/randn in core/rng.c). Arguments are checked and
 * outputs prepared by core/ops.c before these run; each kernel's comment in
 * ops_cpu.c gives its shapes and the PyTorch op it mirrors. */
#ifndef MS_OPS_CPU_H
#define MS_OPS_CPU_H

#include "tensor.h"

int ms_cpu_unary(ms_tensor *out, int op, const ms_tensor *a);
int ms_cpu_binary(ms_tensor *out, int op, const ms_tensor *a, const ms_tensor *b);
int ms_cpu_binary_scalar(ms_tensor *out, int op, const ms_tensor *a, double s, int reverse);
int ms_cpu_clamp(ms_tensor *out, const ms_tensor *a, double lo, double hi);
int ms_cpu_where(ms_tensor *out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b);
int ms_cpu_reduce(ms_tensor *out, int op, const ms_tensor *a, int dim, int keepdim);
int ms_cpu_softmax(ms_tensor *out, const ms_tensor *a, int dim, int log);
int ms_cpu_softmax_backward(ms_tensor *out, const ms_tensor *y, const ms_tensor *g, int dim, int log);
int ms_cpu_matmul(ms_tensor *c, const ms_tensor *a, const ms_tensor *b);
int ms_cpu_gemm_(ms_tensor *c, const ms_tensor *a, const ms_tensor *b, double alpha, double beta);
int ms_cpu_index_select(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx);
int ms_cpu_index_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src);
int ms_cpu_gather(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx);
int ms_cpu_scatter_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src);
int ms_cpu_fill_(ms_tensor *t, double value);
int ms_cpu_arange_(ms_tensor *t, double start, double step);
int ms_cpu_rand_(ms_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi);
int ms_cpu_randn_(ms_tensor *t, uint64_t seed, uint64_t offset, double mean, double std);

#endif
