#include "fixed_arena.h"

#include <algorithm>
#include <cstdio>
#include <iterator>

namespace jitckpt::proxy {

// The driver's entry points, as cuda.h declares them (their ABI is CUDA 10.2's, unchanged since).
struct FixedArena::Driver {
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*free_range)(CUdeviceptr, size_t) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
};

namespace {

constexpr unsigned kDriverVersion = 12000;  // the oldest CUDA 13's driver API answers for these

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

std::string failed(const char* call, CUresult r) { return std::string(call) + " failed (CUresult " + std::to_string(r) + ")"; }

template <typename Fn>
bool resolve(const char* name, Fn* fn, std::string* why) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, kDriverVersion, cudaEnableDefault, &status);
  if (e != cudaSuccess || p == nullptr || status != cudaDriverEntryPointSuccess) {
    *why = std::string("the driver has no ") + name + " (cudaGetDriverEntryPointByVersion: error " +
           std::to_string(e) + ", status " + std::to_string(status) + ")";
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

CUmemAllocationProp device_memory(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace

FixedArena::FixedArena() = default;

const FixedArena::Driver* FixedArena::driver() {
  // Resolved at the first allocation, not at the proxy's start: it is the runtime's first call.
  static const Driver* const resolved = [] () -> const Driver* {
    static Driver d;
    std::string why;
    if (resolve("cuMemAddressReserve", &d.reserve, &why) && resolve("cuMemAddressFree", &d.free_range, &why) &&
        resolve("cuMemCreate", &d.create, &why) && resolve("cuMemRelease", &d.release, &why) &&
        resolve("cuMemMap", &d.map, &why) && resolve("cuMemUnmap", &d.unmap, &why) &&
        resolve("cuMemSetAccess", &d.set_access, &why) &&
        resolve("cuMemGetAllocationGranularity", &d.granularity, &why))
      return &d;
    std::fprintf(stderr, "jitckpt-proxy: %s\n", why.c_str());
    return nullptr;
  }();
  return resolved;
}

FixedArena::~FixedArena() = default;  // the proxy's exit releases the device

bool FixedArena::usable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_.empty();
}

std::string FixedArena::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

void FixedArena::disable(std::string why) {
  why_ = std::move(why);
  std::fprintf(stderr,
               "jitckpt-proxy: device memory comes from cudaMalloc, not a fixed arena: %s. A new proxy would "
               "hand out other pointers, so a replay after a proxy restart fails (and says so)\n",
               why_.c_str());
}

FixedArena::Region* FixedArena::region(int device, std::string* why) {
  if (!why_.empty()) {
    *why = why_;
    return nullptr;
  }
  if (auto it = regions_.find(device); it != regions_.end()) return &it->second;
  if (driver_ == nullptr && (driver_ = driver()) == nullptr) {
    disable("the driver's virtual memory entry points are missing");
    *why = why_;
    return nullptr;
  }
  Region r;
  const CUmemAllocationProp prop = device_memory(device);
  if (CUresult e = driver_->granularity(&r.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM); e != CUDA_SUCCESS) {
    disable(failed("cuMemGetAllocationGranularity", e));
    *why = why_;
    return nullptr;
  }
  size_t free_bytes = 0, total = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_bytes, &total); e != cudaSuccess) {
    *why = "cudaMemGetInfo failed (error " + std::to_string(e) + ")";  // the device's state, not the arena's
    return nullptr;
  }
  // Twice the device's memory in addresses, so that first fit never runs out of addresses first.
  r.size = std::min<uint64_t>(round_up(2 * static_cast<uint64_t>(total), r.granularity), kDeviceStride);
  const uint64_t want = kBase + static_cast<uint64_t>(device) * kDeviceStride;
  CUdeviceptr got = 0;
  if (CUresult e = driver_->reserve(&got, r.size, r.granularity, want, 0); e != CUDA_SUCCESS) {
    disable(failed("cuMemAddressReserve", e));
    *why = why_;
    return nullptr;
  }
  if (got != want) {  // the address is a hint: the range is taken
    driver_->free_range(got, r.size);
    disable("cuMemAddressReserve placed device " + std::to_string(device) + "'s range at " + hex(got) + ", not at " +
            hex(want));
    *why = why_;
    return nullptr;
  }
  r.base = want;
  r.holes[r.base] = r.size;
  return &regions_.emplace(device, std::move(r)).first->second;
}

cudaError_t FixedArena::allocate(size_t size, void** ptr, std::string* why) {
  *ptr = nullptr;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu_);
  Region* r = region(device, why);
  if (r == nullptr) return cudaErrorNotSupported;
  const uint64_t len = round_up(size == 0 ? 1 : size, r->granularity);
  auto hole = r->holes.begin();
  while (hole != r->holes.end() && hole->second < len) ++hole;
  if (hole == r->holes.end()) return cudaErrorMemoryAllocation;
  const uint64_t addr = hole->first;
  const CUmemAllocationProp prop = device_memory(device);
  CUmemGenericAllocationHandle h = 0;
  if (CUresult e = driver_->create(&h, len, &prop, 0); e != CUDA_SUCCESS) {
    if (e == CUDA_ERROR_OUT_OF_MEMORY) return cudaErrorMemoryAllocation;
    *why = failed("cuMemCreate", e);
    return static_cast<cudaError_t>(e);  // the runtime's and driver's codes agree
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult e = driver_->map(addr, len, 0, h, 0);
  if (e == CUDA_SUCCESS && (e = driver_->set_access(addr, len, &access, 1)) != CUDA_SUCCESS) driver_->unmap(addr, len);
  driver_->release(h);  // the mapping holds the memory from here on: unmapping frees it
  if (e != CUDA_SUCCESS) {
    *why = failed("cuMemMap/cuMemSetAccess", e);
    return static_cast<cudaError_t>(e);
  }
  const uint64_t rest = hole->second - len;
  r->holes.erase(hole);
  if (rest != 0) r->holes[addr + len] = rest;
  live_[addr] = {len, device};
  *ptr = reinterpret_cast<void*>(addr);
  return cudaSuccess;
}

bool FixedArena::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.count(reinterpret_cast<uint64_t>(ptr)) != 0;
}

cudaError_t FixedArena::release(void* ptr, std::string* why) {
  // cudaFree waits for the device's work; unmapping does not, so wait first (a sticky error is
  // reported by the next call, as cudaFree's would be).
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(reinterpret_cast<uint64_t>(ptr));
  if (it == live_.end()) return cudaErrorInvalidValue;
  const auto [len, device] = it->second;
  if (CUresult e = driver_->unmap(it->first, len); e != CUDA_SUCCESS) {
    *why = failed("cuMemUnmap", e);
    return static_cast<cudaError_t>(e);
  }
  auto& holes = regions_.at(device).holes;
  auto [pos, inserted] = holes.emplace(it->first, len);
  (void)inserted;
  live_.erase(it);
  if (auto next = std::next(pos); next != holes.end() && pos->first + pos->second == next->first) {
    pos->second += next->second;  // coalesce with the following hole
    holes.erase(next);
  }
  if (pos != holes.begin()) {  // and with the preceding one
    if (auto prev = std::prev(pos); prev->first + prev->second == pos->first) {
      prev->second += pos->second;
      holes.erase(pos);
    }
  }
  return cudaSuccess;
}

}  // namespace jitckpt::proxy
