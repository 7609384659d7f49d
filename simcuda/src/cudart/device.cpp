#include "device.h"

#include <cstdio>
#include <cstring>

namespace simcuda {

Device::Device(int id, size_t memory_bytes, const ErrorState* errors) : id_(id), errors_(errors) {
  std::snprintf(props_.name, sizeof(props_.name), "simcuda CPU device %d", id);
  for (int i = 0; i < 16; ++i) props_.uuid.bytes[i] = static_cast<char>(0x5c + id * 16 + i);
  props_.totalGlobalMem = memory_bytes;
  props_.sharedMemPerBlock = 48 * 1024;
  props_.sharedMemPerBlockOptin = 227 * 1024;
  props_.sharedMemPerMultiprocessor = 228 * 1024;
  props_.regsPerBlock = 65536;
  props_.regsPerMultiprocessor = 65536;
  props_.warpSize = 32;
  props_.memPitch = SIZE_MAX / 2;
  props_.maxThreadsPerBlock = 1024;
  props_.maxThreadsDim[0] = 1024;
  props_.maxThreadsDim[1] = 1024;
  props_.maxThreadsDim[2] = 64;
  props_.maxGridSize[0] = 2147483647;
  props_.maxGridSize[1] = 65535;
  props_.maxGridSize[2] = 65535;
  props_.totalConstMem = 64 * 1024;
  props_.major = 9;  // reports compute capability 9.0 so callers take their modern code paths
  props_.minor = 0;
  props_.textureAlignment = 512;
  props_.texturePitchAlignment = 32;
  props_.multiProcessorCount = 8;
  props_.canMapHostMemory = 1;
  props_.concurrentKernels = 1;
  props_.pciBusID = id;
  props_.pciDeviceID = 0;
  props_.pciDomainID = 0;
  props_.asyncEngineCount = 2;
  props_.unifiedAddressing = 1;
  props_.memoryBusWidth = 5120;
  props_.l2CacheSize = 50 * 1024 * 1024;
  props_.maxThreadsPerMultiProcessor = 2048;
  props_.streamPrioritiesSupported = 1;
  props_.globalL1CacheSupported = 1;
  props_.localL1CacheSupported = 1;
  props_.managedMemory = 1;
  props_.concurrentManagedAccess = 0;
  props_.computePreemptionSupported = 1;
  props_.cooperativeLaunch = 1;
  props_.maxBlocksPerMultiProcessor = 32;
  props_.hostRegisterSupported = 1;
  props_.memoryPoolsSupported = 1;
  props_.ipcEventSupported = 0;
  props_.clusterLaunch = 0;
  props_.deviceNumaId = -1;
  props_.hostNumaId = -1;
  legacy_ = Stream::create(id, Stream::Kind::Legacy, cudaStreamDefault, 0, errors_);
}

bool Device::attribute(cudaDeviceAttr attr, int* v) const {
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *v = props_.maxThreadsPerBlock; return true;
    case cudaDevAttrMaxBlockDimX: *v = props_.maxThreadsDim[0]; return true;
    case cudaDevAttrMaxBlockDimY: *v = props_.maxThreadsDim[1]; return true;
    case cudaDevAttrMaxBlockDimZ: *v = props_.maxThreadsDim[2]; return true;
    case cudaDevAttrMaxGridDimX: *v = props_.maxGridSize[0]; return true;
    case cudaDevAttrMaxGridDimY: *v = props_.maxGridSize[1]; return true;
    case cudaDevAttrMaxGridDimZ: *v = props_.maxGridSize[2]; return true;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = static_cast<int>(props_.sharedMemPerBlock); return true;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = static_cast<int>(props_.sharedMemPerBlockOptin); return true;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *v = static_cast<int>(props_.sharedMemPerMultiprocessor);
      return true;
    case cudaDevAttrTotalConstantMemory: *v = static_cast<int>(props_.totalConstMem); return true;
    case cudaDevAttrWarpSize: *v = props_.warpSize; return true;
    case cudaDevAttrMaxRegistersPerBlock: *v = props_.regsPerBlock; return true;
    case cudaDevAttrMultiProcessorCount: *v = props_.multiProcessorCount; return true;
    case cudaDevAttrComputeCapabilityMajor: *v = props_.major; return true;
    case cudaDevAttrComputeCapabilityMinor: *v = props_.minor; return true;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *v = props_.maxThreadsPerMultiProcessor; return true;
    case cudaDevAttrL2CacheSize: *v = props_.l2CacheSize; return true;
    case cudaDevAttrPciBusId: *v = props_.pciBusID; return true;
    case cudaDevAttrPciDeviceId: *v = props_.pciDeviceID; return true;
    case cudaDevAttrPciDomainId: *v = props_.pciDomainID; return true;
    case cudaDevAttrUnifiedAddressing: *v = 1; return true;
    case cudaDevAttrConcurrentKernels: *v = 1; return true;
    case cudaDevAttrAsyncEngineCount: *v = props_.asyncEngineCount; return true;
    case cudaDevAttrCanMapHostMemory: *v = 1; return true;
    case cudaDevAttrManagedMemory: *v = 1; return true;
    case cudaDevAttrMemoryPoolsSupported: *v = 1; return true;
    case cudaDevAttrCooperativeLaunch: *v = 1; return true;
    case cudaDevAttrGlobalMemoryBusWidth: *v = props_.memoryBusWidth; return true;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *v = props_.maxBlocksPerMultiProcessor; return true;
    case cudaDevAttrIntegrated: *v = 0; return true;
    case cudaDevAttrEccEnabled: *v = 0; return true;
    case cudaDevAttrComputePreemptionSupported: *v = 1; return true;
    case cudaDevAttrConcurrentManagedAccess: *v = 0; return true;
    case cudaDevAttrPageableMemoryAccess: *v = 0; return true;
    case cudaDevAttrHostRegisterSupported: *v = 1; return true;
    case cudaDevAttrIpcEventSupport: *v = 0; return true;
    case cudaDevAttrStreamPrioritiesSupported: *v = 1; return true;
    default: return false;
  }
}

std::shared_ptr<Stream> Device::create_stream(Stream::Kind kind, unsigned flags, int priority) {
  auto s = Stream::create(id_, kind, flags, priority, errors_);
  std::lock_guard<std::mutex> lock(mu_);
  // Drop entries of destroyed streams so the list does not grow without bound.
  std::vector<std::weak_ptr<Stream>> kept;
  for (auto& w : streams_)
    if (!w.expired()) kept.push_back(std::move(w));
  kept.push_back(s);
  streams_ = std::move(kept);
  return s;
}

std::vector<std::shared_ptr<Stream>> Device::live_streams() {
  std::vector<std::shared_ptr<Stream>> out;
  for (auto& w : streams_)
    if (auto s = w.lock()) out.push_back(std::move(s));
  return out;
}

uint64_t Device::submit(const std::shared_ptr<Stream>& stream, Stream::Op op, bool always_run) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stream->kind() == Stream::Kind::Legacy) {
    for (auto& other : live_streams()) {
      if (!other->blocking()) continue;
      const uint64_t upto = other->last_enqueued();
      if (other->reached(upto)) continue;
      stream->enqueue([other, upto] { other->wait_until(upto); });
    }
  } else if (stream->blocking()) {
    const uint64_t upto = legacy_->last_enqueued();
    if (!legacy_->reached(upto)) {
      auto legacy = legacy_;
      stream->enqueue([legacy, upto] { legacy->wait_until(upto); });
    }
  }
  return stream->enqueue(std::move(op), always_run);
}

void Device::synchronize() {
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    targets.emplace_back(legacy_, legacy_->last_enqueued());
    for (auto& s : live_streams()) targets.emplace_back(s, s->last_enqueued());
  }
  for (auto& [s, seq] : targets) s->wait_until(seq);
}

}  // namespace simcuda
