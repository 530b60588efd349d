// CUDA kernels of actcore's ops, bit-exact with the pure-PyTorch reference
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

#include "actcore_native.h"

#include <c10/macros/Macros.h>  // before ATen/cuda/detail/IntegerDivider.cuh, which needs it

#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace actcore_native {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr unsigned kFullMask = 0xffffffffu;
// Lanes per group: as many as hold the group in registers (Tile blocks each), at most this.
constexpr int kDefaultMaxLanes = 32;

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

// ---------------------------------------------------------------- quantize
// floor((x - lo) / step + u), 0 for a constant group, clamped to [0, levels], NaN -> 0:
// quantization.quantize_reference, operation for operation.
template <typename acc_t>
__device__ __forceinline__ uint32_t quantize_code(acc_t x, acc_t lo, acc_t step, acc_t u,
                                                  acc_t levels) {
  acc_t v = div_rn(sub_rn(x, lo), step);
  if (step == acc_t(0)) v = acc_t(0);
  v = floor_(add_rn(v, u));
  if (isnan(v)) return 0;
  v = v < acc_t(0) ? acc_t(0) : (v > levels ? levels : v);
  return static_cast<uint32_t>(v);
}

// The same code without a division, for float32 groups whose step lies in
// [kFastStepMin, kFastStepMax] (and scale 1): with r = RN(1/step), q0 = RN(a * r) is within
// one ulp of a / step, the residual a - q0 * step is exact in an FMA, and RN(q0 + residual
// * r) is RN(a / step) (Markstein's theorem), unless the residual or the quotient
// underflows. That needs a < 2**-100, hence a quotient below 2**-40, where both give code
// 0: q + u stays below 1 for every u. Such a group is finite and lo <= x (lo is rounded
// down, and a group whose lo had to be rounded inward to bfloat16's range has a step far
// above kFastStepMax), so a, q and q + u are >= 0 and never NaN: only the upper clamp
// remains, and it comes before the floor (the same for an integer bound). The floor is an
// addition of 2**23 rounded down: the result's bits are 2**23 + code, so the code is the
// low byte, and no float-to-integer conversion (a quarter-rate instruction) is needed.
constexpr float kFastStepMin = 0x1p-60f;
constexpr float kFastStepMax = 0x1p60f;
constexpr float kTwo23 = 8388608.0f;

__device__ __forceinline__ uint32_t quantize_code_fast(float x, float lo, float step, float r,
                                                       float u, float levels) {
  const float a = __fsub_rn(x, lo);
  const float q0 = __fmul_rn(a, r);
  const float q = __fmaf_rn(__fmaf_rn(-q0, step, a), r, q0);
  const float y = fminf(__fadd_rn(q, u), levels);
  return __float_as_uint(__fadd_rd(y, kTwo23));
}

// The low bytes of four words, in order, as one word.
__device__ __forceinline__ uint32_t low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// Writes the kBits bit planes of one block of 8 codes (code t in the low byte of c[t]):
// plane j holds bit j of code t in its bit t (bitpack.py's layout). The bits j of the four
// codes of a word sit at bits 8t; a multiplication by sum 2**(24 - 7t) (0x01020408) moves
// each to bit 24 + t, the other partial products land on distinct lower bits (or past bit
// 31), so nothing carries and byte 3 is the plane's low nibble; 0x10204080 does the same
// for the high nibble at bits 28..31. `wide`: the payload is 8-byte aligned, so the planes
// of 2, 4 and 8 bits go out as one store. kBits 0: `bits` planes (a run-time count).
__device__ __forceinline__ uint32_t plane(uint32_t lo4, uint32_t hi4, int j) {
  return ((lo4 >> j) & 0x01010101u) * 0x01020408u + ((hi4 >> j) & 0x01010101u) * 0x10204080u;
}

template <int kBits>
__device__ __forceinline__ void store_planes(uint8_t* __restrict__ o, const uint32_t (&c)[8],
                                             bool wide, int bits) {
  const uint32_t lo4 = low_bytes(c[0], c[1], c[2], c[3]);
  const uint32_t hi4 = low_bytes(c[4], c[5], c[6], c[7]);
  if constexpr (kBits == 0) {
    for (int j = 0; j < bits; ++j) o[j] = static_cast<uint8_t>(plane(lo4, hi4, j) >> 24);
    return;
  }
  uint32_t p[kBits > 0 ? kBits : 1];
#pragma unroll
  for (int j = 0; j < kBits; ++j) p[j] = plane(lo4, hi4, j);
  if constexpr (kBits == 2) {
    if (wide) {
      *reinterpret_cast<uint16_t*>(o) = static_cast<uint16_t>(__byte_perm(p[0], p[1], 0x0073));
      return;
    }
  } else if constexpr (kBits == 4) {
    if (wide) {
      *reinterpret_cast<uint32_t*>(o) =
          __byte_perm(__byte_perm(p[0], p[1], 0x0073), __byte_perm(p[2], p[3], 0x0073), 0x5410);
      return;
    }
  } else if constexpr (kBits == 8) {
    if (wide) {
      uint2 w;
      w.x = __byte_perm(__byte_perm(p[0], p[1], 0x0073), __byte_perm(p[2], p[3], 0x0073), 0x5410);
      w.y = __byte_perm(__byte_perm(p[4], p[5], 0x0073), __byte_perm(p[6], p[7], 0x0073), 0x5410);
      *reinterpret_cast<uint2*>(o) = w;
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kBits; ++j) o[j] = static_cast<uint8_t>(p[j] >> 24);
}

// One group's quantization parameters, and the codes of its blocks.
template <typename acc_t, int kBits>
struct GroupCoder {
  acc_t lo;
  acc_t step;
  acc_t scale;  // 1, or 1/4 in a group whose span overflows: codes of the scaled values
  acc_t r;      // RN(1 / step) on the division-free path
  bool fast;
  bool stochastic;
  // index0 % 8 == 0 (every block starts on an 8-element boundary of the flat tensor): the
  // first xor-shift of the 8 hashes of a block is shared (see encode).
  bool aligned;
  int bits;      // kBits, or the run-time count where kBits is 0
  acc_t levels;  // 2**bits - 1

  // The codes of one block of 8 values (`valid` of them real; flat index of the first:
  // index0) written as bit planes to `o`.
  __device__ __forceinline__ void encode(const acc_t (&v)[8], int valid, int64_t index0,
                                         NoiseStream& noise, uint8_t* __restrict__ o,
                                         bool wide) const {
    uint32_t c[8];
    bool done = false;
    if constexpr (std::is_same<acc_t, float>::value) {
      if (fast) {
        // hash(i) = mix_tail(y ^ (y >> 16)), y = uint32(i) ^ key; with index0 % 8 == 0,
        // y = (uint32(index0) ^ key) ^ t, so the first xor-shift is shared by the block
        uint32_t pre[8];
        if (stochastic) {
          if (aligned) {
            const uint32_t y = static_cast<uint32_t>(index0) ^ noise.key_of(index0);
            const uint32_t b = y ^ (y >> 16);
#pragma unroll
            for (int t = 0; t < 8; ++t) pre[t] = b ^ t;
          } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) {
              const uint32_t y = static_cast<uint32_t>(index0 + t) ^ noise.key_of(index0 + t);
              pre[t] = y ^ (y >> 16);
            }
          }
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const float u = stochastic ? uniform_f32(mix_tail(pre[t])) : 0.5f;
          c[t] = quantize_code_fast(v[t], lo, step, r, u, levels);
        }
        if (valid < 8) {  // codes past the row's end stay 0 (one branch, not one per code)
#pragma unroll
          for (int t = 0; t < 8; ++t) c[t] = t < valid ? c[t] : 0u;
        }
        done = true;
      }
    }
    if (!done) {
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        c[t] = 0;  // codes past the row's end stay 0
        if (t < valid) {
          acc_t u = acc_t(0.5);
          if (stochastic) uniform(noise.hash(index0 + t), u);
          c[t] = quantize_code(mul_rn(v[t], scale), lo, step, u, levels);
        }
      }
    }
    store_planes<kBits>(o, c, wide, bits);
  }
};

// Blocks of 8 that one lane keeps in registers between the range and the codes (32 float
// elements: a group of 256 takes 8 lanes and is read once); blocks past lanes * kTile are
// read a second time (from cache). float64 keeps one block.
template <typename acc_t>
struct Tile {
  static constexpr int value = std::is_same<acc_t, double>::value ? 1 : 4;
};

// One group per `lanes` lanes of a warp (a power of two <= 32; 32 / lanes groups per
// warp); lane l takes blocks l, l + lanes, ... of its group (so a warp's loads and stores
// are contiguous). Min and max come from the values the lane holds in registers, reduced
// with warp shuffles, and the same registers are quantized and packed.
template <typename scalar_t, int kBits>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const QuantizeArgs a, const int lanes, const bool vec, const bool wide) {
  using acc_t = typename Compute<scalar_t>::type;
  constexpr int kTileBlocks = Tile<acc_t>::value;
  const scalar_t* __restrict__ x = static_cast<const scalar_t*>(a.x);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int slot = lane / lanes;
  const int l = lane % lanes;
  const int groups_per_warp = 32 / lanes;
  const int64_t groups_per_row = (a.cols + a.group_size - 1) / a.group_size;
  const int64_t total = a.rows * groups_per_row;
  const int bits = kBits > 0 ? kBits : a.bits;
  const int64_t row_bytes = (a.cols + 7) / 8 * bits;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock * groups_per_warp;
  NoiseStream noise(a.seed);
  GroupCoder<acc_t, kBits> coder;
  coder.stochastic = a.stochastic;
  coder.aligned = a.cols % 8 == 0 || a.rows == 1;
  coder.bits = bits;
  coder.levels = static_cast<acc_t>((1 << bits) - 1);

  for (int64_t first = warp * groups_per_warp; first < total; first += stride) {
    const int64_t gid = first + slot;
    const bool active = gid < total;
    const int64_t row = active ? gid / groups_per_row : 0;
    const int64_t col0 = active ? (gid - row * groups_per_row) * a.group_size : 0;
    const int64_t ncols = active ? imin(a.group_size, a.cols - col0) : 0;
    const int64_t nblocks = (ncols + 7) / 8;
    const int64_t base = row * a.cols + col0;  // flat index of the group's first element
    const scalar_t* xg = x + base;

    acc_t v[kTileBlocks][8];
    int valid[kTileBlocks];  // real values in each block of the tile (0: past the group)
#pragma unroll
    for (int i = 0; i < kTileBlocks; ++i) {  // every load in flight before the first use
      const int64_t k = l + static_cast<int64_t>(i) * lanes;
      valid[i] = static_cast<int>(imax(0, imin(8, ncols - 8 * k)));
      if (valid[i] > 0) load8(xg + 8 * k, valid[i], vec, v[i]);
    }
    Extrema<acc_t> range;
#pragma unroll
    for (int i = 0; i < kTileBlocks; ++i) {
      if (valid[i] > 0) {
        if (valid[i] == 8) {
#pragma unroll
          for (int t = 0; t < 8; ++t) range.add(v[i][t]);
        } else {
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            if (t < valid[i]) range.add(v[i][t]);
          }
        }
      }
    }
    for (int64_t k = l + kTileBlocks * lanes; k < nblocks; k += lanes) {
      acc_t w[8];
      const int valid = static_cast<int>(imin(8, ncols - 8 * k));
      load8(xg + 8 * k, valid, vec, w);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        if (t < valid) range.add(w[t]);
      }
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) range.merge_lane(offset);
    acc_t mn;
    acc_t mx;
    range.get(mn, mx);
    if (!active) continue;  // no shuffle below: lanes may diverge

    uint16_t lo_bits;
    uint16_t step_bits;
    group_metadata(mn, mx, coder.levels, lo_bits, step_bits, coder.scale);
    from_bf16(lo_bits, coder.lo);
    coder.lo = mul_rn(coder.lo, coder.scale);
    from_bf16(step_bits, coder.step);
    coder.step = mul_rn(coder.step, coder.scale);
    if (l == 0) {
      a.lo[gid] = lo_bits;
      a.step[gid] = step_bits;
    }
    // the division-free path (scale is 1 there: a span that overflows has a larger step)
    coder.fast = false;
    coder.r = acc_t(0);
    if constexpr (std::is_same<acc_t, float>::value) {
      coder.fast = coder.step >= kFastStepMin && coder.step <= kFastStepMax;
      coder.r = __frcp_rn(coder.step);
    }
    uint8_t* out = a.payload + row * row_bytes + col0 / 8 * bits;
#pragma unroll
    for (int i = 0; i < kTileBlocks; ++i) {
      const int64_t k = l + static_cast<int64_t>(i) * lanes;
      if (valid[i] > 0) coder.encode(v[i], valid[i], base + 8 * k, noise, out + k * bits, wide);
    }
    for (int64_t k = l + kTileBlocks * lanes; k < nblocks; k += lanes) {
      acc_t w[8];
      const int valid = static_cast<int>(imin(8, ncols - 8 * k));
      load8(xg + 8 * k, valid, vec, w);
      coder.encode(w, valid, base + 8 * k, noise, out + k * bits, wide);
    }
  }
}

// ---------------------------------------------------------------- dequantize
// The codes of one block of 8 from its kBits bit planes: code t in byte t of the two words
// (codes 0-3 in lo, 4-7 in hi). A nibble times 0x00204081 (sum 2**(7s)) puts its bit t at
// bit 8t and every other partial product on a bit that is no multiple of 8, so nothing
// carries into the masked bits.
__device__ __forceinline__ void add_plane(uint32_t p, int j, uint32_t& lo, uint32_t& hi) {
  lo |= ((p & 0xFu) * (0x00204081u << j)) & (0x01010101u << j);
  hi |= (((p >> 4) & 0xFu) * (0x00204081u << j)) & (0x01010101u << j);
}

template <int kBits>
__device__ __forceinline__ void load_codes(const uint8_t* __restrict__ in, bool wide, int bits,
                                           uint32_t& lo, uint32_t& hi) {
  lo = 0;
  hi = 0;
  if constexpr (kBits == 0) {
    for (int j = 0; j < bits; ++j) add_plane(in[j], j, lo, hi);
    return;
  }
  uint32_t p[kBits > 0 ? kBits : 1];
  if constexpr (kBits == 2 || kBits == 4 || kBits == 8) {
    if (wide) {
      uint32_t w[(kBits + 3) / 4];
      if constexpr (kBits == 2) {
        w[0] = *reinterpret_cast<const uint16_t*>(in);
      } else if constexpr (kBits == 4) {
        w[0] = *reinterpret_cast<const uint32_t*>(in);
      } else {
        const uint2 d = *reinterpret_cast<const uint2*>(in);
        w[0] = d.x;
        w[1] = d.y;
      }
#pragma unroll
      for (int j = 0; j < kBits; ++j) p[j] = (w[j / 4] >> (8 * (j % 4))) & 0xFFu;
    } else {
#pragma unroll
      for (int j = 0; j < kBits; ++j) p[j] = in[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kBits; ++j) p[j] = in[j];
  }
#pragma unroll
  for (int j = 0; j < kBits; ++j) add_plane(p[j], j, lo, hi);
}

// The blocks of a row, the groups of a row in blocks: 32-bit division by multiplication
// (ATen's IntDivider) while every block index fits in 31 bits, else 64-bit.
template <typename index_t>
struct DequantizeShape {
  at::cuda::detail::IntDivider<index_t> blocks_per_row;
  at::cuda::detail::IntDivider<index_t> blocks_per_group;
};

// One thread per block of 8 codes: (code * step/4 + lo/4) * 4 (code * step/4 is exact, so
// one rounding, which one FMA does; no overflow), clamped to the output dtype's finite range
// where the group's largest value could leave it, then converted to it (round to nearest
// even).
template <typename scalar_t, int kBits, typename index_t>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const DequantizeArgs a, const DequantizeShape<index_t> shape,
                      const bool vec, const bool wide) {
  using acc_t = typename Compute<scalar_t>::type;
  scalar_t* __restrict__ out = static_cast<scalar_t*>(a.out);
  const int64_t groups_per_row = (a.cols + a.group_size - 1) / a.group_size;
  const index_t total = static_cast<index_t>(a.rows) * shape.blocks_per_row.divisor;
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  const acc_t top = OutputMax<scalar_t>::value;
  const int bits = kBits > 0 ? kBits : a.bits;
  const acc_t levels = static_cast<acc_t>((1 << bits) - 1);
  for (index_t b = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < total;
       b += stride) {
    const auto rc = shape.blocks_per_row.divmod(b);
    const int64_t row = static_cast<int64_t>(rc.div);
    const int64_t col = static_cast<int64_t>(rc.mod) * 8;
    const int64_t gi = row * groups_per_row + shape.blocks_per_group.div(rc.mod);
    acc_t lo;
    acc_t step;
    from_bf16(a.lo[gi], lo);
    from_bf16(a.step[gi], step);
    const bool finite = isfinite(lo) && isfinite(step);
    const acc_t lo_q = finite ? mul_rn(lo, acc_t(0.25)) : acc_t(NAN);
    const acc_t step_q = mul_rn(step, acc_t(0.25));
    // values are monotone in the code: those of codes 0 and `levels` decide whether any
    // needs the clamp (either order, so a negative step in a hand-made payload is fine)
    const acc_t first = mul_rn(lo_q, acc_t(4));
    const acc_t last = mul_rn(add_rn(mul_rn(levels, step_q), lo_q), acc_t(4));
    const bool in_range = first >= -top && first <= top && last >= -top && last <= top;
    uint32_t lo4;
    uint32_t hi4;
    const int64_t row_bytes = static_cast<int64_t>(shape.blocks_per_row.divisor) * bits;
    load_codes<kBits>(a.payload + row * row_bytes + (col / 8) * bits, wide, bits, lo4, hi4);
    acc_t value[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const uint32_t word = t < 4 ? lo4 : hi4;
      if constexpr (std::is_same<acc_t, float>::value) {
        // 2**23 + code as a float's bits, minus 2**23: the code, without a conversion
        const float q = __fsub_rn(__uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540 + t % 4)),
                                  kTwo23);
        value[t] = __fmul_rn(__fmaf_rn(q, step_q, lo_q), 4.0f);
      } else {
        const acc_t q = static_cast<acc_t>((word >> (8 * (t % 4))) & 0xFFu);
        value[t] = mul_rn(add_rn(mul_rn(q, step_q), lo_q), acc_t(4));
      }
      if (!in_range) value[t] = value[t] < -top ? -top : (value[t] > top ? top : value[t]);
    }
    scalar_t r[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) r[t] = static_cast<scalar_t>(value[t]);
    store8(out + row * a.cols + col, static_cast<int>(imin(8, a.cols - col)), vec, r);
  }
}

// ---------------------------------------------------------------- bit packing
__global__ void __launch_bounds__(kThreads)
    pack_bits_kernel(const uint8_t* __restrict__ values, uint8_t* __restrict__ packed,
                     const int64_t n, const int bits, const bool vec) {
  const int64_t blocks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    const int valid = static_cast<int>(imin(8, n - 8 * b));
    uint64_t w = 0;  // value t in byte t, zero padding past n
    if (vec && valid == 8) {
      w = *reinterpret_cast<const uint64_t*>(values + 8 * b);
    } else {
      for (int t = 0; t < valid; ++t) w |= static_cast<uint64_t>(values[8 * b + t]) << (8 * t);
    }
    uint8_t* o = packed + b * bits;
    for (int j = 0; j < bits; ++j) o[j] = gather_plane(w, j);  // bits >= `bits` are dropped
  }
}

__global__ void __launch_bounds__(kThreads)
    unpack_bits_kernel(const uint8_t* __restrict__ packed, uint8_t* __restrict__ values,
                       const int64_t n, const int bits, const bool vec) {
  const int64_t blocks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    const uint8_t* in = packed + b * bits;
    uint64_t w = 0;
    for (int j = 0; j < bits; ++j) w |= scatter_plane(in[j]) << j;
    const int valid = static_cast<int>(imin(8, n - 8 * b));
    if (vec && valid == 8) {
      *reinterpret_cast<uint64_t*>(values + 8 * b) = w;
    } else {
      for (int t = 0; t < valid; ++t) values[8 * b + t] = static_cast<uint8_t>(w >> (8 * t));
    }
  }
}

// ---------------------------------------------------------------- hash_uniform
__global__ void __launch_bounds__(kThreads)
    hash_uniform_kernel(const int64_t* __restrict__ index, float* __restrict__ out,
                        const int64_t n, const int64_t seed) {
  NoiseStream noise(seed);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = uniform_f32(noise.hash(index[i]));
  }
}

// ---------------------------------------------------------------- masked ops
// Set bits of each mask word (counts[w + 1]; counts[0] = 0).
__global__ void __launch_bounds__(kThreads)
    mask_counts_kernel(const uint8_t* __restrict__ mask, const int64_t numel,
                       int64_t* __restrict__ counts) {
  const int64_t words = actcore_kernels::mask_words(numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) counts[0] = 0;
  for (int64_t w = first; w < words; w += stride) {
    counts[w + 1] = __popcll(actcore_kernels::mask_word(mask, numel, w));
  }
}

// One thread per mask word: its set elements to values[offsets[w]...], in order.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    masked_gather_kernel(const scalar_t* __restrict__ x, const MaskView m,
                         scalar_t* __restrict__ values) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < m.words;
       w += stride) {
    int64_t r = m.offsets[w];
    for (uint64_t bits = actcore_kernels::mask_word(m.bits, m.numel, w); bits != 0;
         bits &= bits - 1) {
      values[r++] = x[w * 64 + __ffsll(static_cast<long long>(bits)) - 1];
    }
  }
}

// After a gather of `*count` values into a buffer of a larger capacity `numel`: the rest of
// the last partial group repeats the last value, so that group's range, and so every code of
// its real values, is what quantizing the `*count` values alone gives. (Later groups hold
// whatever the buffer held; nothing reads their codes.)
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    pad_group_tail_kernel(scalar_t* __restrict__ values, const int64_t* __restrict__ count,
                          const int64_t numel, const int64_t group_size) {
  const int64_t c = *count;
  if (c == 0) return;
  const int64_t end = min((c + group_size - 1) / group_size * group_size, numel);
  const scalar_t last = values[c - 1];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = c + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += stride) {
    values[i] = last;
  }
}

// One thread per output element: +0 where the mask is clear, else the value of its rank
// among the set elements, computed as dequantize_kernel computes it.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) masked_dequantize_kernel(const MaskedDequantizeArgs a) {
  using acc_t = typename Compute<scalar_t>::type;
  scalar_t* __restrict__ out = static_cast<scalar_t*>(a.d.out);
  const MaskView& m = a.mask;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m.numel;
       i += stride) {
    const int64_t w = i / 64;
    const int j = static_cast<int>(i % 64);
    const uint64_t word = actcore_kernels::mask_word(m.bits, m.numel, w);
    if (((word >> j) & 1) == 0) {
      out[i] = static_cast<scalar_t>(acc_t(0));
      continue;
    }
    const int64_t k = m.offsets[w] + __popcll(word & ((uint64_t{1} << j) - 1));
    const int64_t g = k / a.d.group_size;
    const uint8_t* in = a.d.payload + (k / 8) * a.d.bits;
    const int t = static_cast<int>(k % 8);
    uint32_t code = 0;
    for (int b = 0; b < a.d.bits; ++b) code |= static_cast<uint32_t>((in[b] >> t) & 1) << b;
    acc_t lo;
    acc_t step;
    from_bf16(a.d.lo[g], lo);
    from_bf16(a.d.step[g], step);
    const bool finite = isfinite(lo) && isfinite(step);
    const acc_t lo_q = finite ? mul_rn(lo, acc_t(0.25)) : acc_t(NAN);
    const acc_t step_q = mul_rn(step, acc_t(0.25));
    const acc_t top = OutputMax<scalar_t>::value;
    acc_t value = mul_rn(add_rn(mul_rn(static_cast<acc_t>(code), step_q), lo_q), acc_t(4));
    value = value < -top ? -top : (value > top ? top : value);  // NaN stays
    out[i] = static_cast<scalar_t>(value);
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    apply_mask_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out,
                      const uint8_t* __restrict__ mask, const int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const bool keep = (mask[i / 8] >> (i % 8)) & 1;
    out[i] = keep ? x[i] : static_cast<scalar_t>(0.0f);
  }
}

// ---------------------------------------------------------------- launchers
int64_t grid_for(int64_t threads_needed) {
  const int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min(blocks, kMaxBlocks));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The most lanes of a warp that share one group: fewer lanes share the per-group work
// (reduction, metadata, reciprocal) among more groups per warp instruction, at the cost of
// a second read (from cache) of the blocks past each lane's registers.
// ACTCORE_QUANTIZE_MAX_LANES (a power of two, 1 to 32) overrides it, for tuning on a new
// device.
int max_lanes() {
  static const int value = [] {
    const char* env = std::getenv("ACTCORE_QUANTIZE_MAX_LANES");
    const int v = env ? std::atoi(env) : 0;
    return (v >= 1 && v <= 32 && (v & (v - 1)) == 0) ? v : kDefaultMaxLanes;
  }();
  return value;
}

// f(std::integral_constant<int, B>{}): B is the bit count where it has a kernel of its own
// (1, 2, 4, 8), else 0, the kernel that reads the count at run time (float64: always 0).
template <typename scalar_t, typename F>
cudaError_t with_bits(int bits, F&& f) {
  if constexpr (std::is_same<scalar_t, double>::value) {
    return f(std::integral_constant<int, 0>{});
  } else {
    switch (bits) {
      case 1:
        return f(std::integral_constant<int, 1>{});
      case 2:
        return f(std::integral_constant<int, 2>{});
      case 4:
        return f(std::integral_constant<int, 4>{});
      case 8:
        return f(std::integral_constant<int, 8>{});
      default:
        return f(std::integral_constant<int, 0>{});
    }
  }
}

template <typename scalar_t, int kBits>
cudaError_t quantize_bits(const QuantizeArgs& a, cudaStream_t stream) {
  const int64_t blocks_per_group = a.group_size / 8;
  const int tile = Tile<typename Compute<scalar_t>::type>::value;
  const int cap = max_lanes();
  int lanes = 1;
  while (lanes * tile < blocks_per_group && lanes < cap) lanes *= 2;
  const int64_t groups = a.rows * ((a.cols + a.group_size - 1) / a.group_size);
  const int64_t warps = (groups + 32 / lanes - 1) / (32 / lanes);
  // Blocks of 8 elements start on 8-element boundaries of the flat tensor.
  const bool vec = (a.cols % 8 == 0 || a.rows == 1) && aligned16(a.x);
  const bool wide = reinterpret_cast<uintptr_t>(a.payload) % 8 == 0;
  quantize_kernel<scalar_t, kBits>
      <<<grid_for(warps * 32), kThreads, 0, stream>>>(a, lanes, vec, wide);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t quantize_typed(const QuantizeArgs& a, cudaStream_t stream) {
  return with_bits<scalar_t>(a.bits, [&](auto b) {
    return quantize_bits<scalar_t, decltype(b)::value>(a, stream);
  });
}

template <typename scalar_t, int kBits>
cudaError_t dequantize_bits(const DequantizeArgs& a, cudaStream_t stream) {
  const int64_t blocks_per_row = (a.cols + 7) / 8;
  const int64_t blocks = a.rows * blocks_per_row;
  const bool vec = (a.cols % 8 == 0 || a.rows == 1) && aligned16(a.out);
  const bool wide = reinterpret_cast<uintptr_t>(a.payload) % 8 == 0;
  if (blocks <= INT32_MAX) {
    const DequantizeShape<unsigned int> shape{
        at::cuda::detail::IntDivider<unsigned int>(static_cast<unsigned int>(blocks_per_row)),
        at::cuda::detail::IntDivider<unsigned int>(static_cast<unsigned int>(a.group_size / 8))};
    dequantize_kernel<scalar_t, kBits, unsigned int>
        <<<grid_for(blocks), kThreads, 0, stream>>>(a, shape, vec, wide);
  } else {
    const DequantizeShape<int64_t> shape{at::cuda::detail::IntDivider<int64_t>(blocks_per_row),
                                         at::cuda::detail::IntDivider<int64_t>(a.group_size / 8)};
    dequantize_kernel<scalar_t, kBits, int64_t>
        <<<grid_for(blocks), kThreads, 0, stream>>>(a, shape, vec, wide);
  }
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t dequantize_typed(const DequantizeArgs& a, cudaStream_t stream) {
  return with_bits<scalar_t>(a.bits, [&](auto b) {
    return dequantize_bits<scalar_t, decltype(b)::value>(a, stream);
  });
}

}  // namespace

cudaError_t launch_quantize(Scalar dtype, const QuantizeArgs& args, cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return quantize_typed<float>(args, stream);
    case Scalar::kFloat16:
      return quantize_typed<c10::Half>(args, stream);
    case Scalar::kBFloat16:
      return quantize_typed<c10::BFloat16>(args, stream);
    case Scalar::kFloat64:
      return quantize_typed<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_dequantize(Scalar dtype, const DequantizeArgs& args, cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return dequantize_typed<float>(args, stream);
    case Scalar::kFloat16:
      return dequantize_typed<c10::Half>(args, stream);
    case Scalar::kBFloat16:
      return dequantize_typed<c10::BFloat16>(args, stream);
    case Scalar::kFloat64:
      return dequantize_typed<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_pack_bits(const uint8_t* values, uint8_t* packed, int64_t n, int bits,
                             cudaStream_t stream) {
  const bool vec = reinterpret_cast<uintptr_t>(values) % 8 == 0;
  pack_bits_kernel<<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(values, packed, n, bits, vec);
  return cudaGetLastError();
}

cudaError_t launch_unpack_bits(const uint8_t* packed, uint8_t* values, int64_t n, int bits,
                               cudaStream_t stream) {
  const bool vec = reinterpret_cast<uintptr_t>(values) % 8 == 0;
  unpack_bits_kernel<<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(packed, values, n, bits,
                                                                      vec);
  return cudaGetLastError();
}

cudaError_t launch_mask_counts(const uint8_t* mask, int64_t numel, int64_t* counts,
                               cudaStream_t stream) {
  const int64_t words = actcore_kernels::mask_words(numel);
  mask_counts_kernel<<<grid_for(words), kThreads, 0, stream>>>(mask, numel, counts);
  return cudaGetLastError();
}

namespace {

template <typename scalar_t>
cudaError_t masked_gather_typed(const void* x, const MaskView& m, void* values,
                                cudaStream_t stream) {
  masked_gather_kernel<scalar_t><<<grid_for(m.words), kThreads, 0, stream>>>(
      static_cast<const scalar_t*>(x), m, static_cast<scalar_t*>(values));
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t pad_group_tail_typed(void* values, const int64_t* count, int64_t numel,
                                 int64_t group_size, cudaStream_t stream) {
  pad_group_tail_kernel<scalar_t><<<grid_for(group_size), kThreads, 0, stream>>>(
      static_cast<scalar_t*>(values), count, numel, group_size);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t masked_dequantize_typed(const MaskedDequantizeArgs& a, cudaStream_t stream) {
  masked_dequantize_kernel<scalar_t><<<grid_for(a.mask.numel), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t apply_mask_typed(const void* x, void* out, const uint8_t* mask, int64_t numel,
                             cudaStream_t stream) {
  apply_mask_kernel<scalar_t><<<grid_for(numel), kThreads, 0, stream>>>(
      static_cast<const scalar_t*>(x), static_cast<scalar_t*>(out), mask, numel);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_masked_gather(Scalar dtype, const void* x, const MaskView& mask, void* values,
                                 cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return masked_gather_typed<float>(x, mask, values, stream);
    case Scalar::kFloat16:
      return masked_gather_typed<c10::Half>(x, mask, values, stream);
    case Scalar::kBFloat16:
      return masked_gather_typed<c10::BFloat16>(x, mask, values, stream);
    case Scalar::kFloat64:
      return masked_gather_typed<double>(x, mask, values, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_pad_group_tail(Scalar dtype, void* values, const int64_t* count,
                                  int64_t numel, int64_t group_size, cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return pad_group_tail_typed<float>(values, count, numel, group_size, stream);
    case Scalar::kFloat16:
      return pad_group_tail_typed<c10::Half>(values, count, numel, group_size, stream);
    case Scalar::kBFloat16:
      return pad_group_tail_typed<c10::BFloat16>(values, count, numel, group_size, stream);
    case Scalar::kFloat64:
      return pad_group_tail_typed<double>(values, count, numel, group_size, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_masked_dequantize(Scalar dtype, const MaskedDequantizeArgs& args,
                                     cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return masked_dequantize_typed<float>(args, stream);
    case Scalar::kFloat16:
      return masked_dequantize_typed<c10::Half>(args, stream);
    case Scalar::kBFloat16:
      return masked_dequantize_typed<c10::BFloat16>(args, stream);
    case Scalar::kFloat64:
      return masked_dequantize_typed<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_apply_mask(Scalar dtype, const void* x, void* out, const uint8_t* mask,
                              int64_t numel, cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return apply_mask_typed<float>(x, out, mask, numel, stream);
    case Scalar::kFloat16:
      return apply_mask_typed<c10::Half>(x, out, mask, numel, stream);
    case Scalar::kBFloat16:
      return apply_mask_typed<c10::BFloat16>(x, out, mask, numel, stream);
    case Scalar::kFloat64:
      return apply_mask_typed<double>(x, out, mask, numel, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_hash_uniform(const int64_t* index, float* out, int64_t n, int64_t seed,
                                cudaStream_t stream) {
  hash_uniform_kernel<<<grid_for(n), kThreads, 0, stream>>>(index, out, n, seed);
  return cudaGetLastError();
}

}  // namespace actcore_native
