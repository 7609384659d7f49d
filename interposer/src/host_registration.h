// Proxy mode's cudaHostRegister: host memory the application allocated, made visible to the proxy
// at the same address. Its pages are copied into a memfd that then replaces them in place
// (MAP_SHARED|MAP_FIXED), and the proxy maps the same memfd at the same address, so an async copy
// reads the bytes when it runs, as on a GPU. Whole pages are shared: two registrations may not share
// a page, and a write by another thread to those pages during the cudaHostRegister call itself can
// be lost (the copy and the remap are not one step). After cudaHostUnregister, and in a forked
// child, the pages become a private mapping of the same memfd again: same bytes, ordinary
// copy-on-write, so a child's malloc never writes into its parent's heap.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace jitckpt {

class HostRegistrations {
 public:
  HostRegistrations() = default;
  HostRegistrations(const HostRegistrations&) = delete;
  HostRegistrations& operator=(const HostRegistrations&) = delete;

  cudaError_t add(void* ptr, size_t size, unsigned int flags);
  cudaError_t remove(void* ptr);

 private:
  struct Entry {
    uintptr_t base;  // the whole pages of the registration
    size_t size;
    int fd;          // the memfd behind them (kept for unregister and fork)
    int prot;
  };
  static void lock_for_fork();
  static void unlock_after_fork();
  static void privatize_in_child();

  std::mutex mu_;
  std::map<uintptr_t, Entry> by_ptr_;  // key: the pointer the application registered
};

}  // namespace jitckpt
