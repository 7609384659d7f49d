// Lazily resolved pointer to the next definition of an interposed symbol (the real libcudart/libnccl
// or simcuda). Resolved on first use, because libcudart is often dlopen()ed after libjit.so is loaded
// (torch), then cached in an atomic: the hot path is one acquire load and a branch, no lock.
#pragma once

#include <atomic>

namespace jitckpt {

// Returns the address of `name` in the first object after libjit.so, falling back to an already
// loaded `soname` (covers libraries dlopen()ed with RTLD_LOCAL). nullptr if neither has it.
// In proxy mode (JITCKPT_MODE=proxy) the "next" definition is proxy mode's forwarder instead, so
// the observe-mode hooks run unchanged on top of the proxy; a name proxy mode does not define
// gives nullptr rather than the real library's code in this process.
void* resolve_next_symbol(const char* name, const char* soname);
// The real library's definition, whatever the mode (pure functions: error strings, versions).
void* resolve_real_symbol(const char* name, const char* soname);

template <typename Fn>
class NextSymbol {
 public:
  constexpr NextSymbol(const char* name, const char* soname) : name_(name), soname_(soname) {}

  Fn get() {
    Fn fn = fn_.load(std::memory_order_acquire);
    if (__builtin_expect(fn != nullptr, 1)) return fn;
    fn = reinterpret_cast<Fn>(resolve_next_symbol(name_, soname_));
    fn_.store(fn, std::memory_order_release);  // racing resolvers store the same value
    return fn;
  }
  const char* name() const { return name_; }

 private:
  const char* name_;
  const char* soname_;
  std::atomic<Fn> fn_{nullptr};
};

}  // namespace jitckpt
