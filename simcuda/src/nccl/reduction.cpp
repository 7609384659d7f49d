#include "reduction.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace simcuda::nccl {
namespace {

// Half-precision formats are reduced in float and rounded back (round-to-nearest-even).
float bf16_to_float(uint16_t v) {
  uint32_t b = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  b += 0x7fff + ((b >> 16) & 1);
  return static_cast<uint16_t>(b >> 16);
}
float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (exp >= 31) return sign | 0x7c00;  // overflow -> inf
  if (exp <= 0) {                       // subnormal or zero
    if (exp < -10) return sign;
    mant |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;
  return sign | static_cast<uint16_t>(half);
}

struct SumOp { template <typename T> T operator()(T a, T b) const { return static_cast<T>(a + b); } };
struct ProdOp { template <typename T> T operator()(T a, T b) const { return static_cast<T>(a * b); } };
struct MaxOp { template <typename T> T operator()(T a, T b) const { return std::max(a, b); } };
struct MinOp { template <typename T> T operator()(T a, T b) const { return std::min(a, b); } };

// Dispatches on the op once per call so the element loops stay branch-free (and vectorize).
template <template <typename> class Kernel, typename... Args>
void with_op(ncclRedOp_t op, Args&&... args) {
  switch (op) {
    case ncclProd: Kernel<ProdOp>::run(std::forward<Args>(args)...); break;
    case ncclMax: Kernel<MaxOp>::run(std::forward<Args>(args)...); break;
    case ncclMin: Kernel<MinOp>::run(std::forward<Args>(args)...); break;
    default: Kernel<SumOp>::run(std::forward<Args>(args)...); break;  // ncclSum and ncclAvg
  }
}

template <typename T>
struct TypedReduce {
  template <typename Op>
  struct With {
    static void run(void* acc, const void* in, size_t n) {
      T* a = static_cast<T*>(acc);
      const T* b = static_cast<const T*>(in);
      const Op op;
      for (size_t i = 0; i < n; ++i) a[i] = op(a[i], b[i]);
    }
  };
};

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
struct HalfReduce {
  template <typename Op>
  struct With {
    static void run(void* acc, const void* in, size_t n) {
      uint16_t* a = static_cast<uint16_t*>(acc);
      const uint16_t* b = static_cast<const uint16_t*>(in);
      const Op op;
      for (size_t i = 0; i < n; ++i) a[i] = FromF(op(ToF(a[i]), ToF(b[i])));
    }
  };
};

template <typename T>
void reduce_typed(void* acc, const void* in, size_t n, ncclRedOp_t op) {
  with_op<TypedReduce<T>::template With>(op, acc, in, n);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce_half(void* acc, const void* in, size_t n, ncclRedOp_t op) {
  with_op<HalfReduce<ToF, FromF>::template With>(op, acc, in, n);
}

template <typename T>
void divide_typed(void* acc, size_t n, int d) {
  T* a = static_cast<T*>(acc);
  for (size_t i = 0; i < n; ++i) a[i] = static_cast<T>(a[i] / static_cast<T>(d));
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void divide_half(void* acc, size_t n, int d) {
  uint16_t* a = static_cast<uint16_t*>(acc);
  for (size_t i = 0; i < n; ++i) a[i] = FromF(ToF(a[i]) / static_cast<float>(d));
}

}  // namespace

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

bool valid_op(ncclRedOp_t op) { return op >= ncclSum && op <= ncclAvg; }

void reduce_into(void* acc, const void* in, size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: reduce_typed<int8_t>(acc, in, n, op); break;
    case ncclUint8: reduce_typed<uint8_t>(acc, in, n, op); break;
    case ncclInt32: reduce_typed<int32_t>(acc, in, n, op); break;
    case ncclUint32: reduce_typed<uint32_t>(acc, in, n, op); break;
    case ncclInt64: reduce_typed<int64_t>(acc, in, n, op); break;
    case ncclUint64: reduce_typed<uint64_t>(acc, in, n, op); break;
    case ncclFloat32: reduce_typed<float>(acc, in, n, op); break;
    case ncclFloat64: reduce_typed<double>(acc, in, n, op); break;
    case ncclFloat16: reduce_half<fp16_to_float, float_to_fp16>(acc, in, n, op); break;
    case ncclBfloat16: reduce_half<bf16_to_float, float_to_bf16>(acc, in, n, op); break;
    default: break;  // fp8 reductions are not simulated (rejected by the API layer)
  }
}

void finish_average(void* acc, size_t n, ncclDataType_t t, int nranks) {
  switch (t) {
    case ncclInt8: divide_typed<int8_t>(acc, n, nranks); break;
    case ncclUint8: divide_typed<uint8_t>(acc, n, nranks); break;
    case ncclInt32: divide_typed<int32_t>(acc, n, nranks); break;
    case ncclUint32: divide_typed<uint32_t>(acc, n, nranks); break;
    case ncclInt64: divide_typed<int64_t>(acc, n, nranks); break;
    case ncclUint64: divide_typed<uint64_t>(acc, n, nranks); break;
    case ncclFloat32: divide_typed<float>(acc, n, nranks); break;
    case ncclFloat64: divide_typed<double>(acc, n, nranks); break;
    case ncclFloat16: divide_half<fp16_to_float, float_to_fp16>(acc, n, nranks); break;
    case ncclBfloat16: divide_half<bf16_to_float, float_to_bf16>(acc, n, nranks); break;
    default: break;
  }
}

}  // namespace simcuda::nccl
