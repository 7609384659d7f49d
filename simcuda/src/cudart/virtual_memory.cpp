#include "virtual_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>

namespace simcuda {
namespace {

bool aligned(uint64_t v, size_t to) { return v % to == 0; }

// An anonymous PROT_NONE range: what a reservation holds where nothing is mapped.
bool hold(uintptr_t at, size_t size) {
  return mmap(reinterpret_cast<void*>(at), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
              -1, 0) != MAP_FAILED;
}

}  // namespace

VirtualMemory::Physical::~Physical() {
  close(fd);
  arena->refund(device, size);
}

bool VirtualMemory::valid_prop(const CUmemAllocationProp* prop) const {
  return prop != nullptr && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id >= 0 &&
         prop->location.id < num_devices_;
}

bool VirtualMemory::reserved(uintptr_t ptr, size_t size) const {
  auto it = reservations_.upper_bound(ptr);
  if (it == reservations_.begin()) return false;
  --it;
  return ptr >= it->first && ptr - it->first <= it->second && size <= it->second - (ptr - it->first);
}

bool VirtualMemory::whole_mappings(uintptr_t ptr, size_t size) const {
  if (size == 0) return false;
  uintptr_t at = ptr;
  for (auto it = mappings_.find(ptr); at < ptr + size; ++it) {
    if (it == mappings_.end() || it->first != at) return false;
    at += it->second.size;
  }
  return at == ptr + size;
}

CUresult VirtualMemory::reserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                unsigned long long flags) {
  if (ptr == nullptr || size == 0 || flags != 0 || !aligned(size, kGranularity)) return CUDA_ERROR_INVALID_VALUE;
  if (alignment == 0) alignment = kGranularity;
  if (!aligned(alignment, kGranularity) || (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
  void* p = MAP_FAILED;
  if (addr != 0 && aligned(addr, alignment))
    p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) {  // the hint could not be honoured: anywhere, aligned (over-reserve, trim)
    void* any = mmap(nullptr, size + alignment, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (any == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(any);
    const uintptr_t base = (lo + alignment - 1) / alignment * alignment;
    if (base > lo) munmap(any, base - lo);
    if (base + size < lo + size + alignment) munmap(reinterpret_cast<void*>(base + size), lo + alignment - base);
    p = reinterpret_cast<void*>(base);
  }
  std::lock_guard<std::mutex> lock(mu_);
  reservations_[reinterpret_cast<uintptr_t>(p)] = size;
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult VirtualMemory::free_range(CUdeviceptr ptr, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = reservations_.find(ptr);
  if (it == reservations_.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = mappings_.lower_bound(ptr);
  if (m != mappings_.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  munmap(reinterpret_cast<void*>(ptr), size);
  reservations_.erase(it);
  return CUDA_SUCCESS;
}

CUresult VirtualMemory::create(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                               unsigned long long flags) {
  if (handle == nullptr || size == 0 || flags != 0 || !valid_prop(prop) || !aligned(size, kGranularity))
    return CUDA_ERROR_INVALID_VALUE;
  const int device = prop->location.id;
  if (!arena_->charge(device, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("simcuda-vmm", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    arena_->refund(device, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  auto memory = std::make_shared<Physical>(fd, size, device, arena_);
  std::lock_guard<std::mutex> lock(mu_);
  *handle = ++next_handle_;
  handles_[*handle] = std::move(memory);
  return CUDA_SUCCESS;
}

CUresult VirtualMemory::release(CUmemGenericAllocationHandle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  return handles_.erase(handle) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;  // mappings keep the memory
}

CUresult VirtualMemory::map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags) {
  if (size == 0 || flags != 0 || !aligned(ptr, kGranularity) || !aligned(size, kGranularity) ||
      !aligned(offset, kGranularity))
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(mu_);
  auto h = handles_.find(handle);
  if (h == handles_.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (offset > h->second->size || size > h->second->size - offset || !reserved(ptr, size))
    return CUDA_ERROR_INVALID_VALUE;
  auto next = mappings_.lower_bound(ptr);  // no overlap with a mapping on either side
  if (next != mappings_.end() && next->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second.size > ptr)
    return CUDA_ERROR_INVALID_VALUE;
  if (mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second->fd,
           static_cast<off_t>(offset)) == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  mappings_[ptr] = Mapping{size, h->second, false};
  return CUDA_SUCCESS;
}

CUresult VirtualMemory::unmap(CUdeviceptr ptr, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!whole_mappings(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  if (!hold(ptr, size)) return CUDA_ERROR_UNKNOWN;
  mappings_.erase(mappings_.find(ptr), mappings_.lower_bound(ptr + size));  // the last mapping frees released memory
  return CUDA_SUCCESS;
}

CUresult VirtualMemory::set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  int prot = -1;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= num_devices_)
      return CUDA_ERROR_INVALID_DEVICE;
    // One CPU address space stands for every device: the widest access granted wins.
    const int p = desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
                  : desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ    ? PROT_READ
                  : desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE    ? PROT_NONE
                                                                      : -2;
    if (p == -2) return CUDA_ERROR_INVALID_VALUE;
    prot = std::max(prot, p);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!whole_mappings(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  if (mprotect(reinterpret_cast<void*>(ptr), size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
  for (auto m = mappings_.lower_bound(ptr); m != mappings_.end() && m->first < ptr + size; ++m)
    m->second.accessible = prot != PROT_NONE;
  return CUDA_SUCCESS;
}

CUresult VirtualMemory::granularity(size_t* granularity, const CUmemAllocationProp* prop) const {
  if (granularity == nullptr || !valid_prop(prop)) return CUDA_ERROR_INVALID_VALUE;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

std::optional<DeviceAllocation> VirtualMemory::find(const void* ptr) const {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mappings_.upper_bound(addr);
  if (it == mappings_.begin()) return std::nullopt;
  --it;
  if (addr >= it->first + it->second.size || !it->second.accessible) return std::nullopt;
  return DeviceAllocation{it->first, it->second.size, it->second.memory->device, false};
}

}  // namespace simcuda
