#include "host_registration.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#include "proxy_forwarding.h"
#include "shared_memfd.h"

namespace jitckpt {
namespace {

using proxy_mode::CallWriter;
using proxy_mode::record_cuda_error;
using proxy_mode::session;

cudaError_t fail(cudaError_t e, const char* fmt, const std::string& detail) {
  log_always(fmt, detail.c_str());
  record_cuda_error(e);
  return e;
}

// Why [base, base + size) cannot be shared with the proxy, or "" if it can: every byte must be in a
// private anonymous mapping (heap, stack, malloc's mmap chunks) with the access the flags ask for.
// A file or a shared mapping would be cut off from its backing by the remap.
std::string unshareable(uintptr_t base, size_t size, bool read_only) {
  FILE* maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return "cannot read /proc/self/maps";
  uintptr_t covered = base;
  const uintptr_t end = base + size;
  char line[512], perms[8] = "", path[256];
  std::string why;
  while (why.empty() && covered < end && std::fgets(line, sizeof line, maps)) {
    uintptr_t lo = 0, hi = 0;
    unsigned long long inode = 0;
    path[0] = '\0';
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %*s %*s %llu %255[^\n]", &lo, &hi, perms, &inode, path) < 4)
      continue;
    if (hi <= covered || lo >= end) continue;
    if (lo > covered) break;  // a hole
    if (inode != 0 || perms[3] != 'p')
      why = std::string("part of it is a ") + (inode != 0 ? "file" : "shared") + " mapping (" + path + ")";
    else if (perms[0] != 'r' || (!read_only && perms[1] != 'w'))
      why = std::string("part of it is mapped ") + perms + " (cudaHostRegisterReadOnly registers read-only memory)";
    covered = hi;
  }
  std::fclose(maps);
  if (why.empty() && covered < end) why = "part of it is not mapped";
  return why;
}

// The same bytes as a private mapping: what the pages are when the proxy no longer shares them.
void make_private(uintptr_t base, size_t size, int prot, int fd) {
  if (mmap(reinterpret_cast<void*>(base), size, prot, MAP_PRIVATE | MAP_FIXED, fd, 0) == MAP_FAILED)
    log_always("proxy mode: cannot turn the registered pages at %#" PRIxPTR " private again (%s)", base,
               std::strerror(errno));
}

}  // namespace

cudaError_t HostRegistrations::add(void* ptr, size_t size, unsigned int flags) {
  if (ptr == nullptr || size == 0) {
    record_cuda_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  if (flags & cudaHostRegisterIoMemory)
    return proxy_mode::refuse<cudaError_t>("cudaHostRegister", "I/O memory (cudaHostRegisterIoMemory) cannot be "
                                                               "shared with the proxy");
  static std::once_flag fork_handlers;
  std::call_once(fork_handlers, [] { pthread_atfork(&lock_for_fork, &unlock_after_fork, &privatize_in_child); });

  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t user = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t base = user / page * page;
  const size_t len = (user + size + page - 1) / page * page - base;
  const bool read_only = flags & cudaHostRegisterReadOnly;
  const int prot = read_only ? PROT_READ : PROT_READ | PROT_WRITE;
  char range[96];
  std::snprintf(range, sizeof range, "[%p, %p)", ptr, static_cast<void*>(static_cast<char*>(ptr) + size));

  std::lock_guard<std::mutex> lock(mu_);
  if (session().overlaps_memory(base, len))
    return fail(cudaErrorHostMemoryAlreadyRegistered,
                "proxy mode: cudaHostRegister%s: already pinned, or shares a page with pinned memory (proxy mode "
                "shares whole pages with the proxy: register page-aligned buffers, or together)",
                range);
  if (std::string why = unshareable(base, len, read_only); !why.empty())
    return fail(cudaErrorInvalidValue, "proxy mode: cudaHostRegister%s", std::string(range) + ": " + why);
  // The pages' bytes in a new memfd: the backing both processes will map.
  const int fd = shared_memfd("jitckpt-registered", len, {{reinterpret_cast<const void*>(base), len}});
  if (fd < 0) return fail(cudaErrorMemoryAllocation, "proxy mode: cudaHostRegister: %s", std::strerror(errno));
  if (mmap(reinterpret_cast<void*>(base), len, prot, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    const std::string err = std::strerror(errno);
    close(fd);  // the original pages are still in place
    return fail(cudaErrorMemoryAllocation, "proxy mode: cudaHostRegister: remapping the pages: %s", err);
  }
  // The proxy maps the memfd at the same address and registers it with the real runtime (the same
  // request as a cudaHostAlloc buffer).
  const uint64_t token = session().next_token();
  CallWriter w(static_cast<uint32_t>(proxy::Call::kHostAlloc), false);
  w.value(proxy::HostAlloc{base, len, token, flags, 0});
  const cudaError_t e = w.send("cudaHostRegister", fd, token).status<cudaError_t>();
  if (e != cudaSuccess) {
    make_private(base, len, prot, fd);
    close(fd);
    return e;
  }
  session().add_memory(base, len, ProxySession::Memory::kRegistered);
  by_ptr_[user] = Entry{base, len, fd, prot};
  return cudaSuccess;
}

cudaError_t HostRegistrations::remove(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_ptr_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == by_ptr_.end()) {
    record_cuda_error(cudaErrorHostMemoryNotRegistered);
    return cudaErrorHostMemoryNotRegistered;
  }
  const Entry r = it->second;
  CallWriter w(static_cast<uint32_t>(proxy::Call::kHostFree), false);
  w.value(proxy::PointerArg{r.base});
  const cudaError_t e = w.send("cudaHostUnregister").status<cudaError_t>();
  // Whatever the proxy answered, this process stops sharing the pages: they keep their bytes.
  session().remove_memory(r.base, ProxySession::Memory::kRegistered);
  make_private(r.base, r.size, r.prot, r.fd);
  close(r.fd);
  by_ptr_.erase(it);
  return e;
}

// fork(): the registrations must not change under the child's copy of the table.
void HostRegistrations::lock_for_fork() { session().registrations().mu_.lock(); }
void HostRegistrations::unlock_after_fork() { session().registrations().mu_.unlock(); }
void HostRegistrations::privatize_in_child() {
  HostRegistrations& self = session().registrations();
  for (const auto& [user, r] : self.by_ptr_) make_private(r.base, r.size, r.prot, r.fd);
  self.mu_.unlock();
}

}  // namespace jitckpt
