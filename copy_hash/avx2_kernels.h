// The copy_hash module's AVX2 kernels (avx2_kernels.cc, built with -mavx2 on x86-64), called only
// when the CPU has AVX2: XXH3-64's streaming update (about twice SSE2's speed here) and the NaN/Inf
// check (measured 2-6x the SSE2 loop's speed). The hash state is an XXH3_state_t of copy_hash.cc
// (the same layout for every kernel: XXH3's results do not depend on the vector width).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace jitckpt_copy_hash {

// Returns XXH_OK (0) or XXH_ERROR.
int xxh3_update_avx2(void* state, const void* data, size_t len);

// block_finite (finite_check.h) built for AVX2.
bool block_finite_avx2(const char* p, size_t n, size_t itemsize, uint64_t mask);

}  // namespace jitckpt_copy_hash
