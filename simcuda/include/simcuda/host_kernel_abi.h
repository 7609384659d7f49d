// The C ABI between simcuda's libcudart and a kernel library (see host_kernel.h for how to build one).
#pragma once

#include <stddef.h>

#include <vector_types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SIMCUDA_HOST_KERNEL_ABI 1u

typedef struct simcuda_host_kernel {
  unsigned abi_version;       /* SIMCUDA_HOST_KERNEL_ABI */
  const void* host_fn;        /* the host function; its dynamic symbol name is the mangled kernel name */
  unsigned num_params;
  const size_t* param_sizes;  /* sizeof each parameter, used to copy arguments at launch time */
  /* Runs the whole grid. Returns 0 (cudaSuccess) or the cudaError_t passed to simcuda_fault(). */
  int (*launch)(const void* host_fn, dim3 grid, dim3 block, void** args);
} simcuda_host_kernel;

/* Exported by every kernel library: its table of kernels. */
const simcuda_host_kernel* simcuda_host_kernels(size_t* count);

#ifdef __cplusplus
}
#endif
