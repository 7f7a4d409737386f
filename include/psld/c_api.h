/* psld/c_api.h — the worker API for C and other languages (ctypes, cffi,
 * Rust FFI). Mirrors psld/worker.h.
 *
 * Every function returns 0 on success or a psld_status code (> 0); the
 * message of the last error on this thread is psld_last_error(). Handles are
 * opaque; free them with the matching *_free / shutdown call. */
#ifndef PSLD_C_API_H_
#define PSLD_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "psld/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Same values as psld::StatusCode. */
enum psld_status {
  PSLD_OK = 0,
  PSLD_INVALID_ARGUMENT = 1,
  PSLD_NOT_FOUND = 2,
  PSLD_ALREADY_EXISTS = 3,
  PSLD_OUT_OF_RANGE = 4,
  PSLD_FAILED_PRECONDITION = 5,
  PSLD_RESOURCE_EXHAUSTED = 6,
  PSLD_UNAVAILABLE = 7,
  PSLD_TIMEOUT = 8,
  PSLD_ABORTED = 9,
  PSLD_DATA_LOSS = 10,
  PSLD_MOVED = 11,
  PSLD_UNIMPLEMENTED = 12,
  PSLD_INTERNAL = 13,
};

enum psld_dtype { PSLD_FLOAT32 = 1, PSLD_FLOAT16 = 2, PSLD_BFLOAT16 = 3 };

typedef struct psld_worker psld_worker;
typedef struct psld_request psld_request;

/* The linked library's version, "MAJOR.MINOR.PATCH"; PSLD_VERSION_STRING
 * (psld/version.h) is that of the headers compiled against. */
const char* psld_version(void);

/* The message of the last failed call on this thread ("" if none). */
const char* psld_last_error(void);

/* Joins the job configured by the environment (PSLD_*, launchers) and
 * `argc`/`argv` flags (--key=value; may be 0/NULL). */
int psld_worker_join(int argc, const char* const* argv, psld_worker** out);
int psld_worker_rank(const psld_worker* w, uint32_t* rank, uint32_t* num_workers);
/* How tensors in CUDA memory travel here (Worker::gpu_path()); valid until
 * psld_worker_shutdown. NULL (and psld_last_error) for a NULL worker. */
const char* psld_worker_gpu_path(const psld_worker* w);
/* Worker::allocate: zero-filled memory for tensors that servers on this host
 * reach directly; valid until psld_worker_shutdown. */
int psld_allocate(psld_worker* w, size_t bytes, void** out);
/* Registers `bytes` at `data` (host or CUDA memory) as tensor `name`; `init`
 * (host or CUDA memory) may be NULL. */
int psld_register_tensor(psld_worker* w, const char* name, int dtype, size_t bytes, void* data,
                         const void* init, uint32_t* tensor);
int psld_push(psld_worker* w, uint32_t tensor, psld_request** out);
int psld_pull(psld_worker* w, uint32_t tensor, psld_request** out);
int psld_push_pull(psld_worker* w, uint32_t tensor, psld_request** out);
/* The same for `n` tensors at once: out[i] is the request of tensors[i].
 * Submitted together, the small chunks among them that go to one server
 * leave as one batch (what a model of many small tensors should use each
 * round). On an error nothing was submitted and out is untouched. */
int psld_push_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out);
int psld_pull_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out);
int psld_push_pull_many(psld_worker* w, const uint32_t* tensors, size_t n, psld_request** out);
/* Waits up to timeout_ms (< 0: forever) for the request; PSLD_TIMEOUT leaves
 * it in flight. */
int psld_request_wait(psld_request* r, int64_t timeout_ms);
/* 1 when complete, 0 otherwise. */
int psld_request_test(const psld_request* r);
void psld_request_free(psld_request* r);
int psld_barrier(psld_worker* w, int64_t timeout_ms);
/* Worker::set_learning_rate: the rate the next pushes' updates use
 * (server.mode=optimizer); 0 goes back to the servers' optimizer.lr. */
int psld_set_learning_rate(psld_worker* w, double lr);
/* Worker::round: rounds of the tensor pushed so far (a job resumed from a
 * checkpoint starts at the checkpoint's round). */
int psld_tensor_round(const psld_worker* w, uint32_t tensor, uint64_t* round);
/* Says goodbye, disconnects and frees the worker. */
int psld_worker_shutdown(psld_worker* w);

#ifdef __cplusplus
}
#endif

#endif /* PSLD_C_API_H_ */
