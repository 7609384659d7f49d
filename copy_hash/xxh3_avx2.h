// XXH3-64's streaming update with AVX2 kernels (xxh3_avx2.cc, built with -mavx2 on x86-64): the
// copy_hash module calls it only when the CPU has AVX2. The state is an XXH3_state_t of
// copy_hash.cc (same layout for every kernel: XXH3's results do not depend on the vector width).
#pragma once

#include <cstddef>

namespace jitckpt_copy_hash {

// Returns XXH_OK (0) or XXH_ERROR.
int xxh3_update_avx2(void* state, const void* data, size_t len);

}  // namespace jitckpt_copy_hash
