#include "kernel_launch.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "api_support.h"

namespace simcuda {
namespace {

bool skip_missing_kernels() {
  static const bool skip = [] {
    const char* v = std::getenv("SIMCUDA_MISSING_KERNEL");
    return v && std::strcmp(v, "skip") == 0;
  }();
  return skip;
}

bool valid_dims(dim3 grid, dim3 block) {
  if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z) return false;
  if (static_cast<unsigned long long>(block.x) * block.y * block.z > 1024) return false;
  return block.z <= 64 && grid.y <= 65535 && grid.z <= 65535;
}

// Owns a copy of the launch arguments: the caller's argument slots die when the stub returns.
struct ArgumentCopy {
  static constexpr size_t kAlign = 64;  // at least the alignment of any kernel parameter type
  std::vector<char> bytes;
  std::vector<void*> slots;
  ArgumentCopy(const simcuda_host_kernel& impl, void** args) {
    std::vector<size_t> offsets;
    size_t total = 0;
    for (unsigned i = 0; i < impl.num_params; ++i) {
      total = (total + kAlign - 1) / kAlign * kAlign;
      offsets.push_back(total);
      total += impl.param_sizes[i];
    }
    bytes.resize(total + kAlign);
    char* base = bytes.data();
    base += (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
    for (unsigned i = 0; i < impl.num_params; ++i) {
      std::memcpy(base + offsets[i], args[i], impl.param_sizes[i]);
      slots.push_back(base + offsets[i]);
    }
  }
};

}  // namespace

cudaError_t launch_kernel(const KernelEntry* kernel, dim3 grid, dim3 block, void** args, size_t,
                          cudaStream_t handle, bool per_thread_default) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  if (!kernel) return api_result(cudaErrorInvalidDeviceFunction);
  if (!valid_dims(grid, block)) return api_result(cudaErrorInvalidConfiguration);
  auto stream = rt.resolve_stream(handle, per_thread_default);
  if (!stream) return api_result(cudaErrorInvalidResourceHandle);
  const simcuda_host_kernel* impl = rt.kernels().implementation(*kernel);
  if (!impl) {
    if (skip_missing_kernels()) {
      rt.device(stream->device()).submit(stream, [] {});
      return cudaSuccess;
    }
    return api_result(cudaErrorNoKernelImageForDevice);
  }
  auto copy = std::make_shared<ArgumentCopy>(*impl, args);
  rt.device(stream->device()).submit(stream, [impl, copy, grid, block] {
    // A faulting kernel breaks the context for good, like an illegal address on a GPU.
    if (int rc = impl->launch(impl->host_fn, grid, block, copy->slots.data()); rc != 0)
      Runtime::get().errors().set_sticky(static_cast<cudaError_t>(rc));
  });
  return cudaSuccess;
}

}  // namespace simcuda
