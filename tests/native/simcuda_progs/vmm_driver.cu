// The driver's virtual memory management, reached as a device proxy reaches it: entry points from
// cudaGetDriverEntryPointByVersion, a range reserved at a chosen address, physical memory created,
// mapped and made accessible, then used by the runtime (memset, copies, pointer attributes) and
// freed. Prints "key=value" lines (tests/native/test_simcuda_runtime.py).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

template <typename Fn>
Fn entry(const char* name, unsigned version, cudaDriverEntryPointQueryResult* status) {
  void* p = nullptr;
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, status);
  return e == cudaSuccess ? reinterpret_cast<Fn>(p) : nullptr;
}

}  // namespace

int main() {
  using Reserve = CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  using Free = CUresult (*)(CUdeviceptr, size_t);
  using Create = CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  using Release = CUresult (*)(CUmemGenericAllocationHandle);
  using Map = CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  using Unmap = CUresult (*)(CUdeviceptr, size_t);
  using Access = CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  using Granularity = CUresult (*)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);

  cudaDriverEntryPointQueryResult st = cudaDriverEntryPointSuccess;
  void* unknown = reinterpret_cast<void*>(1);
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuNoSuchCall", &unknown, 12000, cudaEnableDefault, &st);
  std::printf("unknown_status=%d\nunknown_null=%d\nunknown_error=%s\n", st, unknown == nullptr, cudaGetErrorName(e));
  entry<Create>("cuMemCreate", 10000, &st);  // before CUDA 10.2
  std::printf("old_version_status=%d\n", st);

  auto reserve = entry<Reserve>("cuMemAddressReserve", 12000, &st);
  auto free_range = entry<Free>("cuMemAddressFree", 12000, &st);
  auto create = entry<Create>("cuMemCreate", 12000, &st);
  auto release = entry<Release>("cuMemRelease", 12000, &st);
  auto map = entry<Map>("cuMemMap", 12000, &st);
  auto unmap = entry<Unmap>("cuMemUnmap", 12000, &st);
  auto access = entry<Access>("cuMemSetAccess", 12000, &st);
  auto granularity = entry<Granularity>("cuMemGetAllocationGranularity", 12000, &st);
  const bool found = reserve && free_range && create && release && map && unmap && access && granularity;
  std::printf("found=%d\n", found);
  if (!found) return 1;

  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t g = 0;
  const CUresult gr = granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  std::printf("granularity_result=%d\ngranularity=%zu\n", gr, g);
  if (g == 0) return 2;

  const CUdeviceptr want = 0x310000000000ULL;
  const size_t range = 8 * g;
  CUdeviceptr at = 0, again = 0;
  const CUresult r1 = reserve(&at, range, g, want, 0);
  const CUresult r2 = reserve(&again, range, g, want, 0);  // taken: elsewhere
  std::printf("reserve_result=%d\nreserve_at_hint=%d\n", r1, at == want);
  std::printf("second_reserve_result=%d\nsecond_elsewhere=%d\n", r2, again != 0 && again != want);
  std::printf("unaligned_reserve_result=%d\n", reserve(&again, g + 1, g, 0, 0));

  size_t free0 = 0, free1 = 0, free2 = 0, total = 0;
  cudaMemGetInfo(&free0, &total);
  CUmemGenericAllocationHandle h = 0;
  std::printf("create_result=%d\n", create(&h, 2 * g, &prop, 0));
  cudaMemGetInfo(&free1, &total);
  std::printf("create_charged=%d\n", free0 - free1 == 2 * g);
  std::printf("map_outside_result=%d\n", map(want + range, g, 0, h, 0));  // beyond the reservation
  std::printf("map_result=%d\n", map(want + g, 2 * g, 0, h, 0));
  std::printf("map_overlap_result=%d\n", map(want + 2 * g, g, 0, h, 0));
  cudaPointerAttributes attr{};
  cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(want + g));
  std::printf("type_before_access=%d\n", attr.type);
  CUmemAccessDesc desc{};
  desc.location = prop.location;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::printf("access_result=%d\n", access(want + g, 2 * g, &desc, 1));
  std::printf("release_result=%d\n", release(h));  // the mapping keeps the memory
  cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(want + g + 100));
  std::printf("type=%d\ndevice=%d\n", attr.type, attr.device);

  char* dev = reinterpret_cast<char*>(want + g);
  std::vector<char> in(2 * g), out(2 * g, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<char>(i * 31 + 7);
  const bool copies = cudaMemcpy(dev, in.data(), in.size(), cudaMemcpyHostToDevice) == cudaSuccess &&
                      cudaMemset(dev + 10, 0x5a, 3) == cudaSuccess &&
                      cudaMemcpy(out.data(), dev, out.size(), cudaMemcpyDeviceToHost) == cudaSuccess;
  std::memset(in.data() + 10, 0x5a, 3);
  std::printf("roundtrip=%d\n", copies && in == out);
  std::printf("cudafree_mapped=%s\n", cudaGetErrorName(cudaFree(dev)));
  cudaGetLastError();
  std::printf("free_range_mapped_result=%d\n", free_range(want, range));  // still mapped: refused
  std::printf("unmap_part_result=%d\n", unmap(want + g, g));              // not a whole mapping
  std::printf("unmap_result=%d\n", unmap(want + g, 2 * g));
  cudaMemGetInfo(&free2, &total);
  std::printf("refunded=%d\n", free2 == free0);
  cudaPointerGetAttributes(&attr, dev);
  std::printf("type_after_unmap=%d\n", attr.type);
  std::printf("free_range_result=%d\n", free_range(want, range));
  CUdeviceptr reused = 0;
  std::printf("reserve_again_at_hint=%d\n", reserve(&reused, range, g, want, 0) == CUDA_SUCCESS && reused == want);
  return 0;
}
