// jitckpt._copy_hash: copy bytes and hash them (XXH3-64) in one pass, with the GIL released.
//
// Why native: a snapshot copies the whole training state every step on the core the trainer does
// not use. Done from Python (numpy copy, then xxhash over the copy) it reads the bytes twice,
// fills the shared L3 cache with a copy nobody reads again, and takes the GIL once per chunk. Here
// each 64 KiB block is copied and then hashed from the source while it is still in L1/L2, and a
// copy that only lands in another process's memory (the snapshot keeper's) can bypass the cache
// with streaming stores.
#define XXH_INLINE_ALL
#include <pybind11/pybind11.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "finite_check.h"
#if defined(JITCKPT_AVX2_KERNELS)
#include "avx2_kernels.h"
#endif

namespace py = pybind11;

namespace {

constexpr size_t kBlock = 64 << 10;  // copied, then hashed while in L1/L2
constexpr size_t kStreamMin = 256 << 10;  // smaller copies are worth keeping in cache

// memcpy with non-temporal stores (the destination's lines are not brought into the cache).
void stream_copy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  size_t i = 0;
  const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
  if (head != 0) {
    std::memcpy(dst, src, head < n ? head : n);
    i = head < n ? head : n;
  }
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// XXH3-64's update with the widest kernels this CPU runs (AVX2 when built and present: about
// twice SSE2's speed here); the same hash either way.
void hash_update(XXH3_state_t* state, const char* data, size_t len) {
#if defined(JITCKPT_AVX2_KERNELS)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    jitckpt_copy_hash::xxh3_update_avx2(state, data, len);
    return;
  }
#endif
  XXH3_64bits_update(state, data, len);
}

// block_finite with the widest kernel this CPU runs.
bool finite_block(const char* p, size_t n, size_t itemsize, uint64_t mask) {
#if defined(JITCKPT_AVX2_KERNELS)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return jitckpt_copy_hash::block_finite_avx2(p, n, itemsize, mask);
#endif
  return block_finite(p, n, itemsize, mask);
}

void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();  // streaming stores are weakly ordered: visible to readers before we return
#endif
}

// Whether a copy of ``n`` bytes asked to bypass the cache is worth it (small ones stay cached).
bool streams(bool bypass_cache, size_t n) { return bypass_cache && n >= kStreamMin; }

void copy_range(char* dst, const char* src, size_t n, bool stream) {
  if (stream) {
    stream_copy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void check_same_size(size_t src, size_t dst) {
  if (src != dst) {
    throw py::value_error("copy: src has " + std::to_string(src) + " bytes, dst " + std::to_string(dst));
  }
}

// A contiguous view of a Python buffer (released with the object).
class Buffer {
 public:
  Buffer(const py::handle& obj, bool writable, const char* what) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS
                                                        : PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw py::type_error(std::string(what) + " must be a C-contiguous" +
                           (writable ? " writable" : "") + " buffer (numpy array, memoryview, mmap)");
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  char* data() const { return static_cast<char*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

// Streaming XXH3-64 (seed 0): the same value as xxhash.xxh3_64 over the same bytes.
class Xxh3 {
 public:
  Xxh3() : state_(XXH3_createState(), &XXH3_freeState) {
    if (!state_ || XXH3_64bits_reset(state_.get()) != XXH_OK) throw std::bad_alloc();
  }

  // Hash the bytes of ``data``; with an ``itemsize`` (2, 4 or 8) and the floating type's exponent
  // ``mask``, also check every element for NaN/Inf, each block while it is in cache. Returns false
  // if one is found.
  bool update(const py::buffer& data, size_t itemsize, uint64_t exponent_mask) {
    check_itemsize(itemsize);
    Buffer src(data, false, "data");
    py::gil_scoped_release nogil;
    if (itemsize == 0) {
      hash_update(state_.get(), src.data(), src.size());
      return true;
    }
    bool finite = true;
    for (size_t at = 0; at < src.size(); at += kBlock) {
      const size_t n = src.size() - at < kBlock ? src.size() - at : kBlock;
      hash_update(state_.get(), src.data() + at, n);
      if (finite) finite = finite_block(src.data() + at, n, itemsize, exponent_mask);
    }
    return finite;
  }

  // Copy ``src`` into ``dst`` (same length; None: zero-fill) and hash what was written.
  void copy(const py::buffer& dst_obj, const py::object& src_obj, bool bypass_cache) {
    Buffer dst(dst_obj, true, "dst");
    if (src_obj.is_none()) {
      py::gil_scoped_release nogil;
      zero_and_hash(dst.data(), dst.size());
      return;
    }
    Buffer src(src_obj, false, "src");
    check_same_size(src.size(), dst.size());
    py::gil_scoped_release nogil;
    const bool stream = streams(bypass_cache, dst.size());
    copy_and_hash(dst.data(), src.data(), dst.size(), stream);
    if (stream) store_fence();
  }

  // Copy bytes [start, start + len(dst)) of a flat byte space into ``dst`` and hash them in order.
  // Piece i of the space is ``sizes[i]`` bytes at address ``addrs[i]``, placed at ``offsets[i]``
  // (ascending, not overlapping); bytes between pieces and past the last one are zero. One call
  // for a chunk of a state of many small tensors: a Python loop over them costs more than the copy.
  // The caller keeps the pieces' memory alive and unchanged during the call.
  void copy_gather(const py::buffer& dst_obj, const py::buffer& addrs_obj, const py::buffer& offsets_obj,
                   const py::buffer& sizes_obj, uint64_t start, bool bypass_cache) {
    Buffer dst(dst_obj, true, "dst");
    Buffer addrs(addrs_obj, false, "addrs"), offsets(offsets_obj, false, "offsets"), sizes(sizes_obj, false, "sizes");
    if (addrs.size() % 8 != 0 || offsets.size() != addrs.size() || sizes.size() != addrs.size()) {
      throw py::value_error("copy_gather: addrs, offsets and sizes must be uint64 arrays of one length");
    }
    const auto* addr = reinterpret_cast<const uint64_t*>(addrs.data());
    const auto* off = reinterpret_cast<const uint64_t*>(offsets.data());
    const auto* size = reinterpret_cast<const uint64_t*>(sizes.data());
    const size_t count = addrs.size() / 8;
    char* out = dst.data();
    const size_t n = dst.size();
    py::gil_scoped_release nogil;
    const bool stream = streams(bypass_cache, n);
    // The last piece that starts at or before ``start``.
    size_t i = static_cast<size_t>(std::upper_bound(off, off + count, start) - off);
    i = i > 0 ? i - 1 : 0;
    size_t pos = 0;
    while (pos < n) {
      const uint64_t at = start + pos;
      if (i >= count || at < off[i]) {  // zeros up to piece i (or to the end)
        const uint64_t gap = i < count ? off[i] - at : n - pos;
        const size_t len = static_cast<size_t>(std::min<uint64_t>(gap, n - pos));
        zero_and_hash(out + pos, len);
        pos += len;
        continue;
      }
      const uint64_t in = at - off[i];
      if (in >= size[i]) {
        ++i;
        continue;
      }
      const size_t len = static_cast<size_t>(std::min<uint64_t>(size[i] - in, n - pos));
      copy_and_hash(out + pos, reinterpret_cast<const char*>(static_cast<uintptr_t>(addr[i])) + in, len, stream);
      pos += len;
    }
    if (stream) store_fence();
  }

  uint64_t intdigest() const { return XXH3_64bits_digest(state_.get()); }

 private:
  // Copy ``n`` bytes block by block, each hashed from the source right after it is read (in cache).
  void copy_and_hash(char* dst, const char* src, size_t n, bool stream) {
    for (size_t at = 0; at < n; at += kBlock) {
      const size_t m = n - at < kBlock ? n - at : kBlock;
      copy_range(dst + at, src + at, m, stream);
      hash_update(state_.get(), src + at, m);
    }
  }

  void zero_and_hash(char* dst, size_t n) {
    std::memset(dst, 0, n);
    hash_update(state_.get(), dst, n);
  }

  static void check_itemsize(size_t itemsize) {
    if (itemsize != 0 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
      throw py::value_error("itemsize must be 0 (no check), 2, 4 or 8, got " + std::to_string(itemsize));
    }
  }

  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state_;
};

// Copy ``src`` into ``dst`` (same length) without hashing; ``bypass_cache`` as in Xxh3::copy.
void copy_bytes(const py::buffer& dst_obj, const py::buffer& src_obj, bool bypass_cache) {
  Buffer dst(dst_obj, true, "dst");
  Buffer src(src_obj, false, "src");
  check_same_size(src.size(), dst.size());
  py::gil_scoped_release nogil;
  const bool stream = streams(bypass_cache, dst.size());
  copy_range(dst.data(), src.data(), dst.size(), stream);
  if (stream) store_fence();
}

}  // namespace

PYBIND11_MODULE(_copy_hash, m) {
  m.doc() = "Copy + XXH3-64 in one pass, GIL released (jitckpt.snapshot.checksum uses it).";
  py::class_<Xxh3>(m, "Xxh3", "Streaming XXH3-64 (seed 0), equal to xxhash.xxh3_64.")
      .def(py::init<>())
      .def("update", &Xxh3::update, py::arg("data"), py::kw_only(), py::arg("itemsize") = 0,
           py::arg("exponent_mask") = 0,
           "Hash the bytes of a buffer. itemsize (2, 4, 8) and exponent_mask: check them for NaN/Inf "
           "too, block by block while in cache; returns False if one is found (True without a check).")
      .def("copy", &Xxh3::copy, py::arg("dst"), py::arg("src"), py::kw_only(),
           py::arg("bypass_cache") = false,
           "Copy buffer src into the writable buffer dst of the same length (src None: zero-fill "
           "dst) and hash the bytes. bypass_cache: write large copies with streaming stores that "
           "skip the cache (for memory this process will not read again soon).")
      .def("copy_gather", &Xxh3::copy_gather, py::arg("dst"), py::arg("addrs"), py::arg("offsets"),
           py::arg("sizes"), py::arg("start"), py::kw_only(), py::arg("bypass_cache") = false,
           "Copy bytes [start, start + len(dst)) of a flat space into dst and hash them: piece i is "
           "sizes[i] bytes at address addrs[i], placed at offsets[i] (uint64 arrays, offsets "
           "ascending); the rest of the space reads as zero. The caller keeps the pieces alive.")
      .def("intdigest", &Xxh3::intdigest, "The hash of everything so far.");
  m.def("copy", &copy_bytes, py::arg("dst"), py::arg("src"), py::kw_only(), py::arg("bypass_cache") = false,
        "Copy buffer src into the writable buffer dst of the same length, the GIL released; "
        "bypass_cache: with streaming stores (no read of dst's lines first, none left in cache).");
}
