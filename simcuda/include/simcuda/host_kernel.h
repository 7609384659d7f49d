// Host implementations of CUDA kernels for simcuda.
//
// A .cu test program is compiled twice from the same source:
//   nvcc -cudart shared prog.cu -o prog                      (the real program, unmodified CUDA)
//   g++ -x c++ -shared -fPIC -DSIMCUDA_HOST_KERNELS -include simcuda/host_kernel.h
//       -I<simcuda>/include -I/usr/local/cuda/include prog.cu -o prog_kernels.so
// In the second build this header turns __global__/__device__ into plain host code and threadIdx,
// blockIdx, blockDim, gridDim into per-launch thread-locals; the program hides its host-only part
// (main, <<<>>> launches) behind #ifndef SIMCUDA_HOST_KERNELS and lists its kernels with
// SIMCUDA_EXPORT_KERNEL(name). Because a host function with the kernel's exact signature mangles
// exactly like the device kernel, simcuda matches them by mangled name (found with dladdr).
// Run the program with SIMCUDA_KERNEL_LIB=prog_kernels.so.
//
// Kernels run once per (block, thread), blocks and threads in order, on the stream's worker thread.
// __syncthreads() and shared memory are NOT supported (a kernel needing them must be written as a
// block-level loop by hand). simcuda_fault(code) aborts the launch with a sticky CUDA error, the way
// a device-side fault (e.g. illegal address) does on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simcuda/host_kernel_abi.h"

// Pull in the whole runtime header now (the program includes it again later; its include guard
// makes that a no-op), so the macros below never rewrite CUDA's own declarations.
#include <cuda_runtime.h>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#define __shared__ static_assert(false, "simcuda host kernels do not support __shared__");
// Constant memory would live in the kernel library, apart from the program's cudaMemcpyToSymbol.
#define __constant__ static_assert(false, "simcuda host kernels do not support __constant__ variables");


namespace simcuda {

struct ThreadCoords {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim{1, 1, 1};
  dim3 grid_dim{1, 1, 1};
};

inline ThreadCoords& coords() {
  static thread_local ThreadCoords c;
  return c;
}

// Thrown by simcuda_fault(); caught by the launcher and reported as a sticky launch error.
struct DeviceFault {
  int code;
};

inline std::vector<simcuda_host_kernel>& kernel_table() {
  static std::vector<simcuda_host_kernel> table;
  return table;
}

template <typename... A, size_t... I>
void call_kernel(const void* fn, void** args, std::index_sequence<I...>) {
  using Fn = void (*)(A...);
  reinterpret_cast<Fn>(const_cast<void*>(fn))(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
int launch_grid(const void* fn, dim3 grid, dim3 block, void** args) {
  ThreadCoords& c = coords();
  c.grid_dim = grid;
  c.block_dim = block;
  try {
    for (unsigned bz = 0; bz < grid.z; ++bz)
      for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx)
          for (unsigned tz = 0; tz < block.z; ++tz)
            for (unsigned ty = 0; ty < block.y; ++ty)
              for (unsigned tx = 0; tx < block.x; ++tx) {
                c.block_idx = uint3{bx, by, bz};
                c.thread_idx = uint3{tx, ty, tz};
                call_kernel<A...>(fn, args, std::index_sequence_for<A...>{});
              }
  } catch (const DeviceFault& f) {
    return f.code;
  }
  return 0;
}

template <typename... A>
struct KernelExport {
  explicit KernelExport(void (*fn)(A...)) {
    static const size_t sizes[sizeof...(A) + 1] = {sizeof(std::decay_t<A>)..., 0};
    kernel_table().push_back(simcuda_host_kernel{SIMCUDA_HOST_KERNEL_ABI, reinterpret_cast<const void*>(fn),
                                                 static_cast<unsigned>(sizeof...(A)), sizes,
                                                 &launch_grid<A...>});
  }
};

}  // namespace simcuda

extern "C" __attribute__((weak, visibility("default"))) const simcuda_host_kernel* simcuda_host_kernels(
    size_t* count) {
  *count = simcuda::kernel_table().size();
  return simcuda::kernel_table().data();
}

// Device atomics on host memory. Threads of one launch run one at a time, but launches on different
// streams run concurrently, so these are real atomic read-modify-writes.
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <typename F>
inline F simcuda_atomic_update(F* p, F v, F (*combine)(F, F)) {
  F old;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  for (;;) {
    F desired = combine(old, v);
    if (__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
  }
}
inline float atomicAdd(float* p, float v) {
  return simcuda_atomic_update<float>(p, v, [](float a, float b) { return a + b; });
}
inline double atomicAdd(double* p, double v) {
  return simcuda_atomic_update<double>(p, v, [](double a, double b) { return a + b; });
}
inline int atomicMax(int* p, int v) { return simcuda_atomic_update<int>(p, v, [](int a, int b) { return a > b ? a : b; }); }
inline int atomicMin(int* p, int v) { return simcuda_atomic_update<int>(p, v, [](int a, int b) { return a < b ? a : b; }); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline int atomicCAS(int* p, int expected, int desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}

// Aborts the current launch with `code` (a cudaError_t value, e.g. 700 = cudaErrorIllegalAddress).
inline void simcuda_fault(int code) { throw simcuda::DeviceFault{code}; }

#define threadIdx (simcuda::coords().thread_idx)
#define blockIdx (simcuda::coords().block_idx)
#define blockDim (simcuda::coords().block_dim)
#define gridDim (simcuda::coords().grid_dim)

#define SIMCUDA_CONCAT_INNER(a, b) a##b
#define SIMCUDA_CONCAT(a, b) SIMCUDA_CONCAT_INNER(a, b)
// Registers a kernel (a plain function name; for templates pass one instantiation, e.g. fill<float>).
#define SIMCUDA_EXPORT_KERNEL(...) \
  static simcuda::KernelExport SIMCUDA_CONCAT(simcuda_kernel_export_, __LINE__)(&__VA_ARGS__);
