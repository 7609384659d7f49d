#include "runtime.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace simcuda {
namespace {

thread_local int t_current_device = 0;

// Parses an integer env var in [lo, hi]; prints a clear message and returns `fallback` otherwise.
long env_int(const char* name, long fallback, long lo, long hi, const char* meaning, bool* ok) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < lo || n > hi) {
    std::fprintf(stderr, "simcuda: %s='%s' is invalid: expected an integer in %ld..%ld (%s)\n", name, v, lo, hi,
                 meaning);
    *ok = false;
    return fallback;
  }
  return n;
}

// Per-thread default streams, closed when their thread exits.
struct PerThreadStreams {
  std::map<int, std::shared_ptr<Stream>> by_device;
  ~PerThreadStreams() {
    for (auto& [d, s] : by_device) s->close();
  }
};
thread_local PerThreadStreams t_per_thread_streams;

}  // namespace

Runtime& Runtime::get() {
  static Runtime* rt = new Runtime();
  return *rt;
}

Runtime::Runtime() {
  bool ok = true;
  const long n = env_int("SIMCUDA_DEVICES", 1, 1, 16, "the number of simulated GPUs", &ok);
  const long mem_mib =
      env_int("SIMCUDA_DEVICE_MEMORY_MB", 16384, 1, 65536, "simulated memory per device in MiB", &ok);
  const size_t bytes = static_cast<size_t>(mem_mib) << 20;
  // SIMCUDA_ARENA_BASE: device memory at a fixed address (hex), identical in every process that
  // sets it: what a device proxy needs to hand out the same pointers after a restart.
  uintptr_t fixed = 0;
  if (const char* v = std::getenv("SIMCUDA_ARENA_BASE"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const unsigned long long a = std::strtoull(v, &end, 0);
    const unsigned long long top = 1ULL << 47;  // x86-64 user address space
    if (*end != '\0' || a == 0 || a % 4096 != 0 || a + DeviceArena::reserved_bytes(static_cast<int>(n)) > top) {
      std::fprintf(stderr,
                   "simcuda: SIMCUDA_ARENA_BASE='%s' is invalid: expected a page-aligned address such as "
                   "0x200000000000, with %zu GiB free above it below 0x800000000000\n",
                   v, DeviceArena::reserved_bytes(static_cast<int>(n)) >> 30);
      ok = false;
    } else {
      fixed = static_cast<uintptr_t>(a);
    }
  }
  try {
    arena_ = std::make_unique<DeviceArena>(static_cast<int>(n), bytes, fixed);
  } catch (const std::runtime_error& e) {  // the fixed range is taken: every call fails, as documented
    std::fprintf(stderr, "%s\n", e.what());
    ok = false;
    arena_ = std::make_unique<DeviceArena>(static_cast<int>(n), bytes);
  }
  vmm_ = std::make_unique<VirtualMemory>(arena_.get(), static_cast<int>(n));
  if (!ok) errors_.set_sticky(cudaErrorInitializationError);
  for (int d = 0; d < n; ++d) devices_.push_back(std::make_unique<Device>(d, bytes, &errors_));
}

std::optional<DeviceAllocation> Runtime::find_device(const void* ptr) const {
  if (auto a = arena_->find(ptr)) return a;
  return vmm_->find(ptr);
}

bool Runtime::device_range(const void* ptr, size_t len) const {
  auto a = find_device(ptr);
  return a && reinterpret_cast<uintptr_t>(ptr) + len <= a->base + a->size;
}

int Runtime::current_device() const { return t_current_device; }
void Runtime::set_current_device(int d) { t_current_device = d; }

std::shared_ptr<Stream> Runtime::per_thread_stream(int device) {
  auto& slot = t_per_thread_streams.by_device[device];
  if (!slot) slot = this->device(device).create_stream(Stream::Kind::PerThread, cudaStreamDefault, 0);
  return slot;
}

std::shared_ptr<Stream> Runtime::resolve_stream(cudaStream_t handle, bool per_thread_default) {
  if (handle == cudaStreamLegacy || (handle == nullptr && !per_thread_default)) return current().legacy_stream();
  if (handle == cudaStreamPerThread || handle == nullptr) return per_thread_stream(current_device());
  std::lock_guard<std::mutex> lock(handles_mu_);
  auto it = streams_.find(handle);
  return it == streams_.end() ? nullptr : it->second;
}

cudaStream_t Runtime::add_stream(std::shared_ptr<Stream> s) {
  auto handle = reinterpret_cast<cudaStream_t>(s.get());
  std::lock_guard<std::mutex> lock(handles_mu_);
  streams_[handle] = std::move(s);
  return handle;
}

std::shared_ptr<Stream> Runtime::remove_stream(cudaStream_t handle) {
  std::lock_guard<std::mutex> lock(handles_mu_);
  auto it = streams_.find(handle);
  if (it == streams_.end()) return nullptr;
  auto s = std::move(it->second);
  streams_.erase(it);
  return s;
}

cudaEvent_t Runtime::add_event(std::shared_ptr<Event> e) {
  auto handle = reinterpret_cast<cudaEvent_t>(e.get());
  std::lock_guard<std::mutex> lock(handles_mu_);
  events_[handle] = std::move(e);
  return handle;
}

std::shared_ptr<Event> Runtime::find_event(cudaEvent_t handle) {
  std::lock_guard<std::mutex> lock(handles_mu_);
  auto it = events_.find(handle);
  return it == events_.end() ? nullptr : it->second;
}

std::shared_ptr<Event> Runtime::remove_event(cudaEvent_t handle) {
  std::lock_guard<std::mutex> lock(handles_mu_);
  auto it = events_.find(handle);
  if (it == events_.end()) return nullptr;
  auto e = std::move(it->second);
  events_.erase(it);
  return e;
}

}  // namespace simcuda
