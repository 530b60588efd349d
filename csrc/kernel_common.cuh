// What the CUDA kernels of actcore's ops share (kernels.cu, quantize_kernels.cu). The
// kernels are bit-exact with the pure-PyTorch reference
// (packages/actcore/src/actcore/ops/{quantization,bitpack,noise}.py).
//
// Exactness rests on IEEE-754 behaviour and on doing the reference's float operations in
// the reference's order:
// * every rounding step is an explicit round-to-nearest intrinsic (__fsub_rn, __fdiv_rn,
//   __dmul_rn, ...), which nvcc never contracts into a fused multiply-add; the build also
//   passes --fmad=false, --ftz=false (denormals kept, as on the CPU), --prec-div=true;
// * the per-group step is divided by (2**bits - 1) with a true IEEE division, as the CPU
//   reference does (PyTorch's CUDA `tensor / python_scalar` multiplies by the reciprocal
//   instead, so the reference run *on a GPU* can differ from this kernel in the last bit
//   of a step before its rounding to bfloat16: compare against the reference on CPU);
// * min/max are exact in any order; signed zeros are ordered (-0 < +0) so the result does
//   not depend on the reduction order; a NaN anywhere in a group propagates, as in torch;
// * NaN bit patterns (sign, payload) are not part of the contract: any NaN is a NaN.
// fp16 and bf16 inputs are computed in float32, fp64 in float64, as in the reference.
// Indexing is 64-bit throughout (grid-stride loops over int64 counters).

#pragma once

#include "actcore_native.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// Inline device helpers in a named namespace (each translation unit uses what it needs,
// unused ones draw no warning); the kernels themselves live in each unit's anonymous
// namespace.
namespace actcore_native {
namespace detail {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// ---------------------------------------------------------------- noise (noise.py)
constexpr uint32_t kMultA = 0x21F0AAADu;
constexpr uint32_t kMultB = 0x735A2D97u;

// mix32 after its first xor-shift.
__device__ __forceinline__ uint32_t mix_tail(uint32_t x) {
  x *= kMultA;
  x ^= x >> 15;
  x *= kMultB;
  return x ^ (x >> 15);
}

__device__ __forceinline__ uint32_t mix32(uint32_t x) { return mix_tail(x ^ (x >> 16)); }

// The reference's mix32 of a signed 64-bit word (the block number of a negative index):
// its first xor-shift is arithmetic on 64 bits, and only the low 32 bits of that reach the
// multiplication. Equal to mix32 for words in [0, 2**32).
__device__ __forceinline__ uint32_t mix64(int64_t x) {
  return mix_tail(static_cast<uint32_t>(x ^ (x >> 16)));
}

__device__ __forceinline__ uint32_t block_key(int64_t seed, int64_t hi) {
  return mix32(mix64(hi ^ (seed >> 32)) ^ static_cast<uint32_t>(seed));
}

// Hashes element indices under one seed, caching the key of the current block of 2**32.
struct NoiseStream {
  int64_t seed;
  int64_t hi;
  uint32_t key;

  __device__ explicit NoiseStream(int64_t s) : seed(s), hi(0), key(block_key(s, 0)) {}

  // The key of the block of 2**32 holding `index`: hash(index + t) is then
  // mix32((uint32_t(index) + t) ^ key) while index + t stays in that block.
  __device__ __forceinline__ uint32_t key_of(int64_t index) {
    const int64_t h = index >> 32;
    if (h != hi) {
      hi = h;
      key = block_key(seed, h);
    }
    return key;
  }

  __device__ __forceinline__ uint32_t hash(int64_t index) {
    return mix32(static_cast<uint32_t>(index) ^ key_of(index));
  }
};

// (h >> 8) * 2**-24: exact in float32 and float64.
__device__ __forceinline__ float uniform_f32(uint32_t h) {
  return __fmul_rn(static_cast<float>(h >> 8), 5.9604644775390625e-08f);
}
__device__ __forceinline__ void uniform(uint32_t h, float& u) { u = uniform_f32(h); }
__device__ __forceinline__ void uniform(uint32_t h, double& u) {
  u = __dmul_rn(static_cast<double>(h >> 8), 5.9604644775390625e-08);
}

// ---------------------------------------------------------------- float helpers
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float floor_(float a) { return floorf(a); }
__device__ __forceinline__ double floor_(double a) { return ::floor(a); }

// NaN-propagating min/max that order -0 below +0: associative and commutative, so any
// reduction order gives the same value.
template <typename T>
__device__ __forceinline__ T min_nan(T a, T b) {
  if (isnan(a)) return a;
  if (isnan(b)) return b;
  return (b < a || (b == a && signbit(b))) ? b : a;
}
template <typename T>
__device__ __forceinline__ T max_nan(T a, T b) {
  if (isnan(a)) return a;
  if (isnan(b)) return b;
  return (b > a || (b == a && !signbit(b))) ? b : a;
}

// Signed-integer keys of float32 in float order: -0 below +0, positive NaNs above +inf and
// negative NaNs below -inf (integer min/max are one instruction each; min_nan/max_nan take
// several). The map is its own inverse.
__device__ __forceinline__ int32_t order_key(float f) {
  const int32_t b = __float_as_int(f);
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}
__device__ __forceinline__ float from_order_key(int32_t k) {
  return __int_as_float(k ^ ((k >> 31) & 0x7FFFFFFF));
}

// A group's minimum and maximum (NaN-propagating, -0 below +0), over the values one lane
// adds, then over the lanes of its group (merge_lane with xor offsets).
template <typename T>
struct Extrema {
  T mn = T(INFINITY);
  T mx = T(-INFINITY);
  __device__ __forceinline__ void add(T v) {
    mn = min_nan(mn, v);
    mx = max_nan(mx, v);
  }
  __device__ __forceinline__ void merge_lane(int offset) {
    const T other_mn = __shfl_xor_sync(kFullMask, mn, offset);
    const T other_mx = __shfl_xor_sync(kFullMask, mx, offset);
    mn = min_nan(mn, other_mn);
    mx = max_nan(mx, other_mx);
  }
  __device__ __forceinline__ void get(T& lo, T& hi) const {
    lo = mn;
    hi = mx;
  }
};

// float32 through order_key: integer min and max
template <>
struct Extrema<float> {
  int32_t kmn = INT32_MAX;  // the keys of a positive and a negative NaN: identities here
  int32_t kmx = INT32_MIN;
  __device__ __forceinline__ void add(float v) {
    const int32_t key = order_key(v);
    kmn = min(kmn, key);
    kmx = max(kmx, key);
  }
  __device__ __forceinline__ void merge_lane(int offset) {
    kmn = min(kmn, __shfl_xor_sync(kFullMask, kmn, offset));
    kmx = max(kmx, __shfl_xor_sync(kFullMask, kmx, offset));
  }
  __device__ __forceinline__ void get(float& lo, float& hi) const {
    lo = from_order_key(kmn);
    hi = from_order_key(kmx);
    if (isnan(lo) || isnan(hi)) lo = hi = NAN;  // a NaN anywhere: both, as torch
  }
};

// bfloat16 rounding toward -inf of a float32 (quantization.round_to_bf16(up=False)):
// keep the upper half of the bits; a negative inexact value gains one ulp of magnitude.
// NaN converts as torch's .to(bfloat16) does on this device.
__device__ __forceinline__ uint16_t bf16_down(float t) {
  if (isnan(t)) return c10::BFloat16(t).x;
  const int32_t bits = __float_as_int(t);
  int32_t top = bits >> 16;  // arithmetic shift
  if ((bits & 0xFFFF) != 0 && bits < 0) top += 1;
  return static_cast<uint16_t>(top);
}

// float64: first the largest float32 <= t (quantization._to_float32_directed), then as above.
__device__ __forceinline__ uint16_t bf16_down(double t) {
  float f = __double2float_rn(t);
  if (static_cast<double>(f) > t) f = nextafterf(f, -INFINITY);
  return bf16_down(f);
}

// Toward +inf: -round_down(-t), the reference's definition.
template <typename T>
__device__ __forceinline__ uint16_t bf16_up(T t) {
  return static_cast<uint16_t>(bf16_down(-t) ^ 0x8000u);
}

__device__ __forceinline__ void from_bf16(uint16_t bits, float& v) {
  v = __int_as_float(static_cast<int32_t>(static_cast<uint32_t>(bits) << 16));
}
__device__ __forceinline__ void from_bf16(uint16_t bits, double& v) {
  float f;
  from_bf16(bits, f);
  v = static_cast<double>(f);
}

template <typename scalar_t>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

// The largest finite value of each output dtype, in its compute type (exact).
template <typename scalar_t>
struct OutputMax;
template <>
struct OutputMax<float> {
  static constexpr float value = 3.4028234663852886e38f;
};
template <>
struct OutputMax<double> {
  static constexpr double value = 1.7976931348623157e308;
};
template <>
struct OutputMax<c10::Half> {
  static constexpr float value = 65504.0f;
};
template <>
struct OutputMax<c10::BFloat16> {
  static constexpr float value = 3.3895313892515355e38f;
};

constexpr uint16_t kBf16Max = 0x7F7Fu;     // the largest finite bfloat16
constexpr uint16_t kBf16NegMax = 0xFF7Fu;  // its negative
constexpr uint16_t kBf16NegInf = 0xFF80u;
constexpr uint16_t kBf16PosInf = 0x7F80u;

// Per group (quantization._metadata): lo rounded down and step up to bfloat16, rounded
// inward to +-kBf16Max where a finite group would leave bfloat16's range; where max - lo
// overflows, the step comes from the values times 1/4 and `scale` is 1/4 (else 1).
template <typename acc_t>
__device__ __forceinline__ void group_metadata(acc_t mn, acc_t mx, acc_t levels,
                                               uint16_t& lo_bits, uint16_t& step_bits,
                                               acc_t& scale) {
  lo_bits = bf16_down(mn);
  if (lo_bits == kBf16NegInf && isfinite(mn)) lo_bits = kBf16NegMax;
  acc_t lo;
  from_bf16(lo_bits, lo);
  const bool finite = isfinite(mx) && isfinite(lo);
  const acc_t span = sub_rn(mx, lo);
  const bool huge = isinf(span) && finite;
  acc_t raw;
  if (huge) {
    const acc_t a = mul_rn(mx, acc_t(0.25));
    const acc_t b = mul_rn(lo, acc_t(0.25));
    raw = mul_rn(div_rn(sub_rn(a, b), levels), acc_t(4));
  } else {
    raw = div_rn(span, levels);
  }
  if (raw < acc_t(0)) raw = acc_t(0);
  step_bits = bf16_up(raw);
  if (step_bits == kBf16PosInf && finite) step_bits = kBf16Max;
  scale = huge ? acc_t(0.25) : acc_t(1);
}

// ---------------------------------------------------------------- bit planes (bitpack.py)
constexpr uint64_t kLowBits = 0x0101010101010101ull;

// Bit j of each of the 8 bytes of w, as one byte (value t of the block in bit t).
__device__ __forceinline__ uint8_t gather_plane(uint64_t w, int j) {
  uint64_t x = (w >> j) & kLowBits;
  x = (x | (x >> 7)) & 0x0303030303030303ull;
  x = (x | (x >> 14)) & 0x0000000F0000000Full;
  x = (x | (x >> 28)) & 0xFFull;
  return static_cast<uint8_t>(x);
}

// Inverse: bit t of b to bit 0 of byte t.
__device__ __forceinline__ uint64_t scatter_plane(uint8_t b) {
  uint64_t x = b;
  x = (x | (x << 28)) & 0x0000000F0000000Full;
  x = (x | (x << 14)) & 0x0003000300030003ull;
  x = (x | (x << 7)) & kLowBits;
  return x;
}

// ---------------------------------------------------------------- loads and stores
// 8 consecutive elements, `valid` of them real. `vec`: the 8 elements start on a
// 16-byte boundary, so full blocks load as 16-byte words.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load8(const scalar_t* __restrict__ p, int valid, bool vec,
                                      acc_t (&v)[8]) {
  if (vec && valid == 8) {
    constexpr int kWords = static_cast<int>(sizeof(scalar_t)) * 8 / 16;
    uint4 words[kWords];
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = q[i];
    scalar_t s[8];
    memcpy(s, words, sizeof(s));
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = static_cast<acc_t>(s[t]);
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = t < valid ? static_cast<acc_t>(p[t]) : acc_t(0);
  }
}

template <typename scalar_t>
__device__ __forceinline__ void store8(scalar_t* __restrict__ p, int valid, bool vec,
                                       const scalar_t (&s)[8]) {
  if (vec && valid == 8) {
    constexpr int kWords = static_cast<int>(sizeof(scalar_t)) * 8 / 16;
    uint4 words[kWords];
    memcpy(words, s, sizeof(words));
    uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) q[i] = words[i];
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      if (t < valid) p[t] = s[t];
    }
  }
}

// ---------------------------------------------------------------- launch shapes
inline int64_t grid_for(int64_t threads_needed) {
  const int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min(blocks, kMaxBlocks));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace detail
}  // namespace actcore_native
