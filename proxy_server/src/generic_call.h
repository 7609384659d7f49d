// Decoding and answering the calls the generated layer forwards (proxy_generic_calls.cc, generated
// by jitckpt/proxy_api/forwarding.py, documents the wire format). The reader copies every argument
// out of the ring (the writer is another process) and checks sizes; the first problem becomes the
// call's error, naming the function and the parameter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "address_book.h"
#include "handle_table.h"
#include "proxy_functions.h"

namespace jitckpt::proxy {

// What the generated code writes its answer into; the dispatcher turns it into the reply.
struct GenericReply {
  int32_t status = 0;
  std::string error;  // a protocol error (the status is then cudaErrorInvalidValue or similar)
  std::vector<uint8_t> results;

  template <typename T>
  void result(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    results.insert(results.end(), p, p + sizeof v);
  }
  void result_handle(uint64_t v) { result(v); }
};

class ArgReader {
 public:
  ArgReader(const char* function, bool nccl, const uint8_t* data, size_t len, GenericReply* reply)
      : function_(function), nccl_(nccl), p_(data), end_(data + len), reply_(reply) {}

  template <typename T>
  bool value(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (!take(v, sizeof *v)) return fail("truncated arguments");
    return true;
  }
  template <typename T>
  bool handle(T* physical, uint64_t* virt, const HandleTable& handles, const char* param) {
    if (!value(virt)) return false;
    if (!handles.resolve(*virt, physical))
      return fail(std::string("unknown handle 0x") + hex(*virt) + " for '" + param + "'", kBadHandle);
    return true;
  }
  template <typename T>
  bool address(T** ptr, const AddressBook& memory, const char* param) {
    uint64_t a = 0;
    if (!value(&a)) return false;
    if (a != 0 && memory.kind_of(a, 1) == AddressBook::Kind::kNone)
      return fail(std::string("'") + param + "' = 0x" + hex(a) +
                  " is not in device memory or pinned memory of this proxy");
    *ptr = reinterpret_cast<T*>(a);
    return true;
  }
  // A result pointer: presence, then the pointee (in-out).
  template <typename T>
  bool result(T* v, bool* present) {
    uint8_t p = 0;
    if (!value(&p)) return false;
    *present = p != 0;
    return !*present || value(v);
  }
  // A struct with C strings at `strings` (forwarding.py's wire format): its bytes, then each string,
  // kept in `storage` for the call, its member pointed at it.
  template <typename T, size_t N>
  bool with_strings(T* v, bool* present, const size_t (&strings)[N], std::string (&storage)[N], const char* param) {
    uint8_t p = 0;
    if (!value(&p)) return false;
    *present = p != 0;
    if (!*present) return true;
    if (!value(v)) return false;
    for (size_t i = 0; i < N; ++i) {
      uint8_t has = 0;
      if (!value(&has)) return false;
      const char* text = nullptr;
      if (has != 0) {
        uint32_t n = 0;
        if (!value(&n)) return false;
        if (n > kMaxString) return fail(std::string("a string of '") + param + "' longer than 4096 bytes");
        storage[i].resize(n);
        if (!take(storage[i].data(), n)) return fail("truncated arguments");
        text = storage[i].c_str();
      }
      std::memcpy(reinterpret_cast<char*>(v) + strings[i], &text, sizeof text);
    }
    return true;
  }
  bool result_handle(bool* present) {
    uint8_t p = 0;
    if (!value(&p)) return false;
    *present = p != 0;
    return true;
  }
  // An enum argument that is none of its type's enumerators.
  void invalid(const char* param, long long v) { fail(std::string("invalid value ") + std::to_string(v) + " for '" + param + "'"); }
  bool finished() { return p_ == end_ || fail("unexpected trailing argument bytes"); }
  void fail_if_ok(const char* why) {
    if (reply_->error.empty()) fail(why);
  }

 private:
  static constexpr int32_t kCudaInvalidValue = 1, kCudaInvalidHandle = 400;
  static constexpr int32_t kNcclInvalidArgument = 4;
  static constexpr int kBadHandle = 1;
  static constexpr uint32_t kMaxString = 4096;
  static std::string hex(uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(v));
    return b;
  }
  bool take(void* out, size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) return false;
    std::memcpy(out, p_, n);
    p_ += n;
    return true;
  }
  bool fail(const std::string& why, int what = 0) {
    reply_->status = nccl_ ? kNcclInvalidArgument : (what == kBadHandle ? kCudaInvalidHandle : kCudaInvalidValue);
    reply_->error = std::string(function_) + ": " + why;
    return false;
  }

  const char* function_;
  bool nccl_;
  const uint8_t* p_;
  const uint8_t* end_;
  GenericReply* reply_;
};

// Generated (proxy_generic_calls.cc): runs generic call `id`.
void run_generic(uint32_t id, ArgReader& a, GenericReply& r, HandleTable& handles, const AddressBook& memory);

}  // namespace jitckpt::proxy
