/* core/cuda_stub.c — the core/cuda.h API in a build without CUDA: no
 * devices, and every device call is an error saying so. */
#ifndef MS_WITH_CUDA
#include "cuda.h"
#include "internal.h"

#include <string.h>

static int no_cuda(const char *op) {
    return ms_errorf("%s: moonshard was built without CUDA (no nvcc at build time)", op);
}

int ms_cuda_available(void) { return 0; }
int ms_cuda_device_count(void) { return 0; }
int ms_cuda_set_device(int device) { return no_cuda("set_device"); }
int ms_cuda_get_device(void) { return -1; }
int ms_cuda_device_name(int device, char *buf, int n) { return no_cuda("device_name"); }
int ms_cuda_device_capability(int device, int *major, int *minor) { return no_cuda("device_capability"); }
int ms_cuda_synchronize(int device) { return no_cuda("synchronize"); }
int ms_cuda_get_memory_stats(int device, ms_cuda_memory_stats *out) {
    memset(out, 0, sizeof *out);
    return no_cuda("memory_stats");
}
int ms_cuda_reset_peak_stats(int device) { return no_cuda("reset_peak_stats"); }
int ms_cuda_empty_cache(int device) { return no_cuda("empty_cache"); }
int ms_cuda_check_device_flags(int device) { return 0; }
int ms_cuda_stream_new(ms_cuda_stream **out, int device, int priority) { return no_cuda("stream"); }
void ms_cuda_stream_free(ms_cuda_stream *s) {}
ms_cuda_stream *ms_cuda_current_stream(int device) { return NULL; }
int ms_cuda_set_current_stream(ms_cuda_stream *s) { return no_cuda("set_stream"); }
int ms_cuda_stream_synchronize(ms_cuda_stream *s) { return no_cuda("stream_synchronize"); }
int ms_cuda_stream_wait_event(ms_cuda_stream *s, ms_cuda_event *e) { return no_cuda("stream_wait"); }
int ms_cuda_event_new(ms_cuda_event **out, int device, int timing) { return no_cuda("event"); }
void ms_cuda_event_free(ms_cuda_event *e) {}
int ms_cuda_event_record(ms_cuda_event *e, ms_cuda_stream *s) { return no_cuda("event_record"); }
int ms_cuda_event_synchronize(ms_cuda_event *e) { return no_cuda("event_synchronize"); }
int ms_cuda_event_query(ms_cuda_event *e) { return no_cuda("event_query"); }
int ms_cuda_event_elapsed_ms(ms_cuda_event *a, ms_cuda_event *b, float *ms) { return no_cuda("elapsed"); }
int ms_cuda_record_stream(const struct ms_tensor *t, ms_cuda_stream *s) { return no_cuda("record_stream"); }
int ms_cuda_graph_begin(ms_cuda_graph **out, int device) {
    *out = NULL;
    return no_cuda("graph");
}
int ms_cuda_graph_end(ms_cuda_graph *g, int keep) { return no_cuda("graph_end"); }
int ms_cuda_graph_replay(ms_cuda_graph *g) { return no_cuda("graph_replay"); }
void ms_cuda_graph_free(ms_cuda_graph *g) {}
int ms_cuda_capturing(void) { return -1; }
int ms_cuda_capture_fresh(int on) { (void)on; return 0; }
int ms_cuda_host_alloc(void **out, int64_t nbytes) { return no_cuda("host_alloc"); }
void ms_cuda_host_free(void *p) {}
int ms_cuda_copy_async(struct ms_tensor *dst, const struct ms_tensor *src) {
    (void)dst, (void)src;
    return no_cuda("copy_async");
}
int ms_cuda_attention_set_impl(int impl) { return no_cuda("attention_set_impl"); }
int ms_cuda_attention_get_impl(void) { return MS_ATTENTION_AUTO; }
int ms_cuda_attention_set_onepass(int on) { (void)on; return no_cuda("attention_set_onepass"); }
int ms_cuda_attention_set_wg_onepass(int on) { (void)on; return no_cuda("attention_set_wg_onepass"); }
int ms_cuda_attention_set_fused_delta(int on) { (void)on; return no_cuda("attention_set_fused_delta"); }
int ms_cuda_flce_set_row_unroll(int u) { (void)u; return no_cuda("flce_set_row_unroll"); }
int ms_cuda_flce_set_row_prefetch(int on) { (void)on; return no_cuda("flce_set_row_prefetch"); }
int ms_cuda_float8_set_fused(int on) { (void)on; return no_cuda("float8_set_fused"); }
int ms_cuda_gemm_set_epilogue(int mask) { (void)mask; return no_cuda("gemm_set_epilogue"); }
int ms_cuda_gemm_set_sm_margin(int sms) { (void)sms; return no_cuda("gemm_set_sm_margin"); }
int ms_cuda_gemm_set_tune(int on) { (void)on; return no_cuda("gemm_set_tune"); }
void ms_cuda_gemm_tune_stats(int64_t *out) { out[0] = out[1] = out[2] = out[3] = 0; }
int ms_cuda_gemm_set_tune_file(const char *path) { (void)path; return no_cuda("gemm_set_tune_file"); }
int ms_cuda_gemm_clear_plans(void) { return 0; }
int ms_cuda_attention_last_impl(void) { return MS_ATTENTION_AUTO; }
#else
typedef int ms_cuda_stub_unused; /* keeps the translation unit non-empty */
#endif
