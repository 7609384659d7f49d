// The NaN/Inf check of a block of floats, compiled twice: for the baseline ISA (copy_hash.cc) and
// with -mavx2 (avx2_kernels.cc). Internal linkage (an unnamed namespace), so the linker never puts
// one file's AVX2 copy in place of the other's. C headers only, as in avx2_kernels.cc.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

namespace {

// True if no element of [p, p + n) has every bit of ``mask`` (the exponent) set: no NaN or Inf.
template <typename U>
bool all_finite(const char* p, size_t n, U mask) {
  U bad = 0;
  const size_t count = n / sizeof(U);  // a counted loop: the compiler vectorizes it
  for (size_t k = 0; k < count; ++k) {
    U v;
    memcpy(&v, p + k * sizeof(U), sizeof(U));  // any alignment
    bad |= static_cast<U>((v & mask) == mask);
  }
  return bad == 0;
}

inline bool block_finite(const char* p, size_t n, size_t itemsize, uint64_t mask) {
  switch (itemsize) {
    case 2: return all_finite<uint16_t>(p, n, static_cast<uint16_t>(mask));
    case 4: return all_finite<uint32_t>(p, n, static_cast<uint32_t>(mask));
    case 8: return all_finite<uint64_t>(p, n, mask);
    default: return true;
  }
}

}  // namespace
