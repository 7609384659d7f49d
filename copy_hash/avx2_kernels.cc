// Built with -mavx2 (see CMakeLists.txt). Only C headers are included here: an inline C++ library
// function emitted in this file could be picked by the linker for the whole module and run AVX2
// instructions on a CPU without them.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include "avx2_kernels.h"
#include "finite_check.h"

namespace jitckpt_copy_hash {

int xxh3_update_avx2(void* state, const void* data, size_t len) {
  return XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, len) == XXH_OK ? 0 : 1;
}

bool block_finite_avx2(const char* p, size_t n, size_t itemsize, uint64_t mask) {
  return block_finite(p, n, itemsize, mask);
}

}  // namespace jitckpt_copy_hash
