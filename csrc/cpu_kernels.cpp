// CPU kernels of actcore's ops, bit-exact with the pure-PyTorch reference
// (packages/actcore/src/actcore/ops/{quantization,bitpack,noise}.py), registered as the
// `CPU` implementation of the actcore::* ops by actcore.native.loader. One translation
// unit, no CUDA: built by torch.utils.cpp_extension with the host C++ compiler.
//
// Exactness rests on doing each float operation of the reference once, in its order, in
// float32 (float64 for float64 input), with IEEE semantics: the build passes
// -ffp-contract=off (no fused multiply-add) and no -ffast-math. Min and max are exact in
// any order. As for the CUDA kernels, NaN bit patterns are not part of the contract (any
// NaN is a NaN), nor is the sign of a zero group minimum (codes and values are the same).
//
// Speed: each group is read once for its min/max and once (from cache) for its codes;
// codes go through a small buffer, 8 at a time into bit planes (one 64-bit multiply per
// plane; back through a 256-entry table), the bit count a template argument. The masked ops
// move a mask byte's float32 values with one AVX2 permute (a left-pack on the way in, its
// inverse on the way out) instead of one bit at a time. Work is split over groups with
// at::parallel_for. On x86-64 the loops are compiled three times, for the baseline ISA, for
// AVX2 and for AVX-512 (float32 16 lanes at a time: min/max, codes, bit planes by mask
// tests, compress and expand for the masked ops), and the variant is picked at run time
// (actcore_cpu_limit_isa caps it), so a cached library runs on any x86-64 CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define ACTCORE_X86 1
#define ACTCORE_AVX2 __attribute__((target("avx2")))
#define ACTCORE_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq")))
#else
#define ACTCORE_X86 0
#endif
#if defined(_MSC_VER)
#define ACTCORE_INLINE __forceinline
#else
#define ACTCORE_INLINE inline __attribute__((always_inline))
#endif

#include "op_checks.h"
#include "op_registration.h"

namespace actcore_cpu {
namespace {

// Bumped whenever the registered ops or the C entry points change; loader.py checks it.
constexpr int kAbiVersion = 7;
constexpr int64_t kChunk = 1024;           // elements per inner pass (a multiple of 8)
constexpr int64_t kGrainElements = 1 << 15;  // least work per parallel task
constexpr uint32_t kMultA = 0x21F0AAADu;
constexpr uint32_t kMultB = 0x735A2D97u;
constexpr uint64_t kLowBits = 0x0101010101010101ull;

// The instruction sets the hot loops have variants for, in order.
enum Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

int supported_isa() {
#if ACTCORE_X86
  static const int best =
      (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
          ? kAvx512
          : (__builtin_cpu_supports("avx2") ? kAvx2 : kBaseline);
  return best;
#else
  return kBaseline;
#endif
}

// The highest variant allowed (actcore_cpu_limit_isa: the tests run each one the CPU has).
std::atomic<int> isa_limit{kAvx512};

// The variant the loops run: the best this CPU has, within the limit.
int isa() { return std::min(supported_isa(), isa_limit.load(std::memory_order_relaxed)); }
bool has_avx2() { return isa() >= kAvx2; }

// ---------------------------------------------------------------- noise (noise.py)
ACTCORE_INLINE uint32_t mix_tail(uint32_t x) {
  x *= kMultA;
  x ^= x >> 15;
  x *= kMultB;
  return x ^ (x >> 15);
}

ACTCORE_INLINE uint32_t mix32(uint32_t x) { return mix_tail(x ^ (x >> 16)); }

// mix32 of a signed 64-bit word as the reference computes it: the first xor-shift is
// arithmetic on 64 bits, and only the low 32 bits of it reach the multiplication.
ACTCORE_INLINE uint32_t mix64(int64_t x) {
  return mix_tail(static_cast<uint32_t>(x ^ (x >> 16)));
}

// Key of the block of 2**32 indices whose upper word is `hi`.
ACTCORE_INLINE uint32_t block_key(int64_t seed, int64_t hi) {
  return mix32(mix64(hi ^ (seed >> 32)) ^ static_cast<uint32_t>(seed));
}

constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;  // (h >> 8) * 2**-24 is exact

// ---------------------------------------------------------------- bfloat16 metadata
// Round toward -inf (quantization.round_to_bf16(up=False)): keep the upper half of the
// bits; a negative inexact value gains one ulp of magnitude. NaN converts as torch does.
ACTCORE_INLINE uint16_t bf16_down(float t) {
  if (std::isnan(t)) return c10::BFloat16(t).x;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof(bits));
  int32_t top = bits >> 16;  // arithmetic: the sign stays
  if ((bits & 0xFFFF) != 0 && bits < 0) top += 1;
  return static_cast<uint16_t>(top);
}

// float64: first the largest float32 <= t (quantization._to_float32_directed).
ACTCORE_INLINE uint16_t bf16_down(double t) {
  float f = static_cast<float>(t);
  if (static_cast<double>(f) > t) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  return bf16_down(f);
}

// Toward +inf: the reference's -round_down(-t).
template <typename T>
ACTCORE_INLINE uint16_t bf16_up(T t) {
  return static_cast<uint16_t>(bf16_down(-t) ^ 0x8000u);
}

template <typename T>
ACTCORE_INLINE T from_bf16(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return static_cast<T>(f);
}

constexpr uint16_t kBf16Max = 0x7F7Fu;        // the largest finite bfloat16
constexpr uint16_t kBf16NegMax = 0xFF7Fu;     // its negative
constexpr uint16_t kBf16NegInf = 0xFF80u;
constexpr uint16_t kBf16PosInf = 0x7F80u;

// Per group (quantization._metadata): lo rounded down and step up to bfloat16, rounded
// inward to +-kBf16Max where a finite group would leave bfloat16's range; where max - lo
// overflows, the step comes from the values times 1/4 and `scale` is 1/4 (else 1).
template <typename acc_t>
ACTCORE_INLINE void group_metadata(acc_t mn, acc_t mx, acc_t levels, uint16_t& lo_bits,
                                   uint16_t& step_bits, acc_t& scale) {
  lo_bits = bf16_down(mn);
  if (lo_bits == kBf16NegInf && std::isfinite(mn)) lo_bits = kBf16NegMax;
  const acc_t lo = from_bf16<acc_t>(lo_bits);
  const bool finite = std::isfinite(mx) && std::isfinite(lo);
  const acc_t span = mx - lo;
  const bool huge = std::isinf(span) && finite;
  acc_t raw;
  if (huge) {
    const acc_t a = mx * acc_t(0.25);
    const acc_t b = lo * acc_t(0.25);
    raw = ((a - b) / levels) * acc_t(4);
  } else {
    raw = span / levels;
  }
  if (raw < acc_t(0)) raw = acc_t(0);
  step_bits = bf16_up(raw);
  if (step_bits == kBf16PosInf && finite) step_bits = kBf16Max;
  scale = huge ? acc_t(0.25) : acc_t(1);
}

// ---------------------------------------------------------------- bit planes (bitpack.py)
// Bit j of each of the 8 bytes of w, as one byte (byte t's bit in bit t).
ACTCORE_INLINE uint8_t gather_plane(uint64_t w, int j) {
  return static_cast<uint8_t>((((w >> j) & kLowBits) * 0x0102040810204080ull) >> 56);
}

// Bit t of byte b at bit 0 of byte t, for every b: unpacking looks a plane up (a load, a
// shift and an or per plane).
struct SpreadTable {
  uint64_t of[256];
  constexpr SpreadTable() : of() {
    for (int b = 0; b < 256; ++b) {
      uint64_t w = 0;
      for (int t = 0; t < 8; ++t) w |= static_cast<uint64_t>((b >> t) & 1) << (8 * t);
      of[b] = w;
    }
  }
};
constexpr SpreadTable kSpread{};

#if ACTCORE_X86
// For each mask byte: the lanes of its set bits in order, then 0s (a left-pack: one
// permute moves a byte's selected floats to the front), and each lane's rank among the set
// bits (the inverse: one permute spreads consecutive values back to their lanes).
struct LaneTables {
  alignas(32) int32_t pack[256][8];
  alignas(32) int32_t spread[256][8];
  constexpr LaneTables() : pack(), spread() {
    for (int b = 0; b < 256; ++b) {
      int k = 0;
      for (int t = 0; t < 8; ++t) {
        spread[b][t] = k;
        if ((b >> t) & 1) pack[b][k++] = t;
      }
    }
  }
};
constexpr LaneTables kLanes{};
#endif

// `blocks` blocks of 8 uint8 values -> `Bits` bytes each (the planes unrolled).
template <int Bits>
ACTCORE_INLINE void pack_blocks_of(const uint8_t* values, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    uint64_t w;
    std::memcpy(&w, values + 8 * b, sizeof(w));
    uint8_t planes[Bits];
    for (int j = 0; j < Bits; ++j) planes[j] = gather_plane(w, j);
    std::memcpy(out + b * Bits, planes, Bits);
  }
}

template <int Bits>
ACTCORE_INLINE void unpack_blocks_of(const uint8_t* in, int64_t blocks, uint8_t* values) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = in + b * Bits;
    uint64_t w = 0;
    for (int j = 0; j < Bits; ++j) w |= kSpread.of[p[j]] << j;
    std::memcpy(values + 8 * b, &w, sizeof(w));
  }
}

// The bit count as a template argument: each case's loops are straight-line code.
#define ACTCORE_BY_BITS(bits, call)       \
  switch (bits) {                         \
    case 1: call(1); break;               \
    case 2: call(2); break;               \
    case 3: call(3); break;               \
    case 4: call(4); break;               \
    case 5: call(5); break;               \
    case 6: call(6); break;               \
    case 7: call(7); break;               \
    default: call(8); break;              \
  }

// `blocks` blocks of 8 uint8 values -> `bits` bytes each.
ACTCORE_INLINE void pack_blocks(const uint8_t* values, int64_t blocks, int bits, uint8_t* out) {
#define ACTCORE_PACK(B) pack_blocks_of<B>(values, blocks, out)
  ACTCORE_BY_BITS(bits, ACTCORE_PACK)
#undef ACTCORE_PACK
}

ACTCORE_INLINE void unpack_blocks(const uint8_t* in, int64_t blocks, int bits, uint8_t* values) {
#define ACTCORE_UNPACK(B) unpack_blocks_of<B>(in, blocks, values)
  ACTCORE_BY_BITS(bits, ACTCORE_UNPACK)
#undef ACTCORE_UNPACK
}

// ---------------------------------------------------------------- float helpers
template <typename scalar_t>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

typedef float f32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x4 __attribute__((vector_size(4)));

// A vector of 32 bytes of T, and the uint32, int32 and uint8 vectors of as many lanes (the
// baseline and AVX2 variants; AVX-512 has loops of its own).
template <typename T>
struct Simd;
template <>
struct Simd<float> {
  using V = f32x8;
  using U = u32x8;
  using I = i32x8;
  using B = u8x8;
};
template <>
struct Simd<double> {
  using V = f64x4;
  using U = u32x4;
  using I = i32x4;
  using B = u8x4;
};

// NaN-propagating min/max (a NaN anywhere wins, as torch's amin/amax), of scalars and lane
// by lane.
template <typename T>
ACTCORE_INLINE T min_nan(T a, T b) {
  return (b < a || b != b) ? b : a;
}
template <typename T>
ACTCORE_INLINE T max_nan(T a, T b) {
  return (b > a || b != b) ? b : a;
}
template <bool kMax, typename V>
ACTCORE_INLINE V lanes_min_or_max(V a, V b) {
  if constexpr (kMax) {
    return ((b > a) | (b != b)) ? b : a;
  } else {
    return ((b < a) | (b != b)) ? b : a;
  }
}

// The min (max) of a vector's lanes: its halves against each other until one lane is left,
// a few shuffles and no branch (a scalar pass over the lanes mispredicts its compares).
template <bool kMax>
ACTCORE_INLINE float reduce_lanes(f32x8 v) {
  v = lanes_min_or_max<kMax>(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = lanes_min_or_max<kMax>(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = lanes_min_or_max<kMax>(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}
template <bool kMax>
ACTCORE_INLINE double reduce_lanes(f64x4 v) {
  v = lanes_min_or_max<kMax>(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
  v = lanes_min_or_max<kMax>(v, __builtin_shufflevector(v, v, 1, 0, 3, 2));
  return v[0];
}

#if ACTCORE_X86
// AVX-512, float32: min_max and codes_of 16 lanes at a time. They are written in intrinsics
// (GCC lowers a select of 64-byte generic vectors lane by lane) and called, not inlined (a
// function of another target cannot be inlined into the generic templates that call them).
// vminps/vmaxps return their second operand where either is NaN: min_max tracks NaN in a
// mask of its own, and a group that has one gets a NaN min and max.
ACTCORE_AVX512 void min_max_avx512(const float* p, int64_t n, float& mn, float& mx) {
  __m512 vmn = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 vmx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    vmn = _mm512_min_ps(v, vmn);
    vmx = _mm512_max_ps(v, vmx);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (nan != 0) {
    mn = mx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  mn = min_nan(mn, _mm512_reduce_min_ps(vmn));
  mx = max_nan(mx, _mm512_reduce_max_ps(vmx));
  for (; i < n; ++i) {
    mn = min_nan(mn, p[i]);
    mx = max_nan(mx, p[i]);
  }
}

#endif

// Folds the min and max of p[0, n) into mn and mx, a vector at a time.
template <typename T>
ACTCORE_INLINE void min_max(const T* p, int64_t n, T& mn, T& mx) {
  using V = typename Simd<T>::V;
  constexpr int kWidth = sizeof(V) / sizeof(T);
  const T inf = std::numeric_limits<T>::infinity();
  V vmn = V{} + inf;
  V vmx = V{} - inf;
  V vmn2 = vmn;  // two accumulators each: the compare-and-blend chains run side by side
  V vmx2 = vmx;
  int64_t i = 0;
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    V v;
    V w;
    std::memcpy(&v, p + i, sizeof(V));
    std::memcpy(&w, p + i + kWidth, sizeof(V));
    vmn = lanes_min_or_max<false>(vmn, v);
    vmx = lanes_min_or_max<true>(vmx, v);
    vmn2 = lanes_min_or_max<false>(vmn2, w);
    vmx2 = lanes_min_or_max<true>(vmx2, w);
  }
  for (; i + kWidth <= n; i += kWidth) {
    V v;
    std::memcpy(&v, p + i, sizeof(V));
    vmn = lanes_min_or_max<false>(vmn, v);
    vmx = lanes_min_or_max<true>(vmx, v);
  }
  mn = min_nan(mn, reduce_lanes<false>(lanes_min_or_max<false>(vmn, vmn2)));
  mx = max_nan(mx, reduce_lanes<true>(lanes_min_or_max<true>(vmx, vmx2)));
  for (; i < n; ++i) {
    mn = min_nan(mn, p[i]);
    mx = max_nan(mx, p[i]);
  }
}

// `m` input elements as acc_t: the input itself, or converted (exactly) into `buf`.
template <typename scalar_t, typename acc_t>
ACTCORE_INLINE const acc_t* as_acc(const scalar_t* p, int64_t m, acc_t* buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return p;
  } else {
    for (int64_t k = 0; k < m; ++k) buf[k] = static_cast<acc_t>(p[k]);
    return buf;
  }
}

// floor(t) clamped to [0, levels], NaN -> 0 (the reference's floor_, clamp_, nan_to_num_):
// below 0 or NaN gives 0, at least `levels` gives levels (an integer), and in between
// floor is the truncation of a non-negative value. No rounding happens here.
template <typename acc_t>
ACTCORE_INLINE uint8_t to_code(acc_t t, acc_t levels) {
  const acc_t c = t >= levels ? levels : (t >= acc_t(0) ? t : acc_t(0));
  return static_cast<uint8_t>(static_cast<int32_t>(c));
}

// The low byte of each int32 lane, in lane order: one byte shuffle (a lane-wise conversion
// to uint8 compiles to a scalar extract per lane).
ACTCORE_INLINE u8x8 low_bytes(i32x8 v) {
  const u8x32 b = (u8x32)v;
  return __builtin_shufflevector(b, b, 0, 4, 8, 12, 16, 20, 24, 28);
}
ACTCORE_INLINE u8x4 low_bytes(i32x4 v) {
  const u8x16 b = (u8x16)v;
  return __builtin_shufflevector(b, b, 0, 4, 8, 12);
}
// Codes of m elements: floor((v - lo) / step + u) with u the noise of the element's flat
// index (`stochastic`; the m indices lie in one block of 2**32, `index` the low word of
// the first, `key` the block's key) or 0.5. The same operations as the scalar tail, a
// vector of acc_t at a time.
template <typename acc_t, bool stochastic>
ACTCORE_INLINE void codes_of(const acc_t* v, int64_t m, acc_t lo, acc_t step, acc_t levels,
                             uint32_t index, uint32_t key, uint8_t* codes) {
  using V = typename Simd<acc_t>::V;
  using U = typename Simd<acc_t>::U;
  using I = typename Simd<acc_t>::I;
  using B = typename Simd<acc_t>::B;
  constexpr int kWidth = sizeof(V) / sizeof(acc_t);
  U lane;
  for (int l = 0; l < kWidth; ++l) lane[l] = static_cast<uint32_t>(l);
  const V vlo = V{} + lo;
  const V vstep = V{} + step;
  const V vlevels = V{} + levels;
  const V zero = V{};
  int64_t k = 0;
  for (; k + kWidth <= m; k += kWidth) {
    V x;
    std::memcpy(&x, v + k, sizeof(V));
    V t = (x - vlo) / vstep;
    if constexpr (stochastic) {
      U h = (U{} + (index + static_cast<uint32_t>(k))) + lane;
      h ^= key;
      h ^= h >> 16;
      h *= kMultA;
      h ^= h >> 15;
      h *= kMultB;
      h ^= h >> 15;
      const I top = __builtin_convertvector(h >> 8, I);  // below 2**24: exact
      t = t + __builtin_convertvector(top, V) * acc_t(kTwoPowMinus24);
    } else {
      t = t + acc_t(0.5);
    }
    const V c = t >= vlevels ? vlevels : (t >= zero ? t : zero);
    const B b = low_bytes(__builtin_convertvector(c, I));  // codes are 0..255
    std::memcpy(codes + k, &b, sizeof(B));
  }
  for (; k < m; ++k) {
    acc_t u = acc_t(0.5);
    if constexpr (stochastic) {
      const uint32_t h = mix32((index + static_cast<uint32_t>(k)) ^ key);
      u = static_cast<acc_t>(static_cast<int32_t>(h >> 8)) * acc_t(kTwoPowMinus24);
    }
    codes[k] = to_code((v[k] - lo) / step + u, levels);
  }
}

#if ACTCORE_X86
// codes_of for float32 on AVX-512, 16 lanes at a time with the same operations in the same
// order; vmaxps(t, 0) gives 0 for a NaN t. The last m % 16 go through codes_of.
template <bool stochastic>
ACTCORE_AVX512 void codes_avx512(const float* v, int64_t m, float lo, float step, float levels,
                                 uint32_t index, uint32_t key, uint8_t* codes) {
  const __m512 vlo = _mm512_set1_ps(lo);
  const __m512 vstep = _mm512_set1_ps(step);
  const __m512 vlevels = _mm512_set1_ps(levels);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i vkey = _mm512_set1_epi32(static_cast<int>(key));
  const __m512i mult_a = _mm512_set1_epi32(static_cast<int>(kMultA));
  const __m512i mult_b = _mm512_set1_epi32(static_cast<int>(kMultB));
  int64_t k = 0;
  for (; k + 16 <= m; k += 16) {
    __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(v + k), vlo), vstep);
    if constexpr (stochastic) {
      __m512i h = _mm512_add_epi32(
          _mm512_set1_epi32(static_cast<int>(index + static_cast<uint32_t>(k))), lane);
      h = _mm512_xor_si512(h, vkey);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
      h = _mm512_mullo_epi32(h, mult_a);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
      h = _mm512_mullo_epi32(h, mult_b);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
      const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)),
                                     _mm512_set1_ps(kTwoPowMinus24));
      t = _mm512_add_ps(t, u);
    } else {
      t = _mm512_add_ps(t, _mm512_set1_ps(0.5f));
    }
    const __m512 c = _mm512_min_ps(_mm512_max_ps(t, _mm512_setzero_ps()), vlevels);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k),
                     _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(c)));
  }
  codes_of<float, stochastic>(v + k, m - k, lo, step, levels, index + static_cast<uint32_t>(k),
                              key, codes + k);
}
#endif

#if ACTCORE_X86
// pack_blocks on AVX-512, 64 codes (8 blocks) at a time: one test-into-mask per bit plane
// gives that plane of all 8 blocks (byte b of the mask: block b), then the planes are
// interleaved block by block (unpacks for 1, 2 and 4 bits, byte stores otherwise).
template <int Bits>
ACTCORE_AVX512 void pack_blocks_avx512_of(const uint8_t* values, int64_t blocks, uint8_t* out) {
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    const __m512i c = _mm512_loadu_si512(values + 8 * b);
    uint64_t plane[Bits];
    for (int j = 0; j < Bits; ++j) {
      plane[j] = _mm512_test_epi8_mask(c, _mm512_set1_epi8(static_cast<char>(1 << j)));
    }
    uint8_t* o = out + b * Bits;
    if constexpr (Bits == 1) {
      std::memcpy(o, plane, 8);
    } else if constexpr (Bits == 2) {
      const __m128i p0 = _mm_cvtsi64_si128(static_cast<int64_t>(plane[0]));
      const __m128i p1 = _mm_cvtsi64_si128(static_cast<int64_t>(plane[1]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi8(p0, p1));
    } else if constexpr (Bits == 4) {
      __m128i p[4];
      for (int j = 0; j < 4; ++j) p[j] = _mm_cvtsi64_si128(static_cast<int64_t>(plane[j]));
      const __m128i p01 = _mm_unpacklo_epi8(p[0], p[1]);
      const __m128i p23 = _mm_unpacklo_epi8(p[2], p[3]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi16(p01, p23));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm_unpackhi_epi16(p01, p23));
    } else {
      for (int t = 0; t < 8; ++t) {
        for (int j = 0; j < Bits; ++j) o[t * Bits + j] = static_cast<uint8_t>(plane[j] >> (8 * t));
      }
    }
  }
  pack_blocks_of<Bits>(values + 8 * b, blocks - b, out + b * Bits);
}

ACTCORE_AVX512 void pack_blocks_avx512(const uint8_t* values, int64_t blocks, int bits,
                                       uint8_t* out) {
#define ACTCORE_PACK(B) pack_blocks_avx512_of<B>(values, blocks, out)
  ACTCORE_BY_BITS(bits, ACTCORE_PACK)
#undef ACTCORE_PACK
}
#endif

// ---------------------------------------------------------------- quantize
using actcore_kernels::MaskedQuantizeArgs;
using actcore_kernels::MaskView;
using actcore_kernels::QuantizeArgs;
using actcore_kernels::mask_word;

// Where quantize_groups reads its values: the rows of a dense input ...
template <typename scalar_t, typename acc_t>
struct DenseSource {
  const scalar_t* x;
  int64_t cols;

  // `m` values of row `row` from column `col` on, as acc_t (the input itself, or in `buf`).
  ACTCORE_INLINE const acc_t* read(int64_t row, int64_t col, int64_t m, acc_t* buf) {
    return as_acc<scalar_t, acc_t>(x + row * cols + col, m, buf);
  }
};

// The channel multipliers of quantize_scaled / dequantize_scaled: element i of the input
// (row-major over all of it) lies in channel (i / inner) % channels.
struct ChannelScale {
  const float* mult;  // one per channel
  int64_t channels;
  int64_t inner;
};

// x * f in scalar_t, f first converted to scalar_t (as the reference multiplies by the
// multipliers in x's dtype: computed in acc_t and rounded once); 0 where f is 0.
template <typename scalar_t, typename acc_t>
ACTCORE_INLINE acc_t scaled_value(scalar_t x, float f) {
  const auto fs = static_cast<acc_t>(static_cast<scalar_t>(f));
  const auto v = static_cast<acc_t>(static_cast<scalar_t>(static_cast<acc_t>(x) * fs));
  return f == 0.0f ? acc_t(0) : v;
}

// Calls run(k, len, c) over the runs of one channel among the `m` elements from flat index
// `first` on: elements [k, k + len) all lie in channel c (inner > 1), or (inner == 1) in
// channels c, c + 1, ... one each.
template <typename Run>
ACTCORE_INLINE void channel_runs(const ChannelScale& s, int64_t first, int64_t m, Run run) {
  int64_t pos = first % s.inner;
  int64_t c = (first / s.inner) % s.channels;
  for (int64_t k = 0; k < m;) {
    const int64_t len = s.inner == 1 ? std::min(m - k, s.channels - c)
                                     : std::min(m - k, s.inner - pos);
    run(k, len, c);
    k += len;
    if (s.inner == 1) {
      c += len;
    } else if ((pos += len) == s.inner) {
      pos = 0;
      ++c;
    }
    if (c == s.channels) c = 0;
  }
}

// ... or the rows of a dense input times its channel multipliers (quantize_scaled), into buf.
template <typename scalar_t, typename acc_t>
struct ScaledSource {
  const scalar_t* x;
  int64_t cols;
  ChannelScale scale;

  ACTCORE_INLINE const acc_t* read(int64_t row, int64_t col, int64_t m, acc_t* buf) {
    const int64_t first = row * cols + col;
    const scalar_t* p = x + first;
    const float* mult = scale.mult;
    channel_runs(scale, first, m, [&](int64_t k, int64_t len, int64_t c) {
      if (scale.inner == 1) {
        for (int64_t j = 0; j < len; ++j) {
          buf[k + j] = scaled_value<scalar_t, acc_t>(p[k + j], mult[c + j]);
        }
      } else {
        const float f = mult[c];
        for (int64_t j = 0; j < len; ++j) buf[k + j] = scaled_value<scalar_t, acc_t>(p[k + j], f);
      }
    });
    return buf;
  }
};

#if ACTCORE_X86
// `m` set elements of a float32 input from the mask's position (word, rest) on, into `buf`
// (which takes kLanes floats past m): kLanes mask bits at a time where their set bits all
// fit, `move` storing the selected ones of kLanes inputs (a left-pack), else an element at
// a time.
template <int kLanes, typename Move>
ACTCORE_INLINE void read_set(const float* x, const MaskView& mask, int64_t& word,
                             uint64_t& rest, int64_t m, float* buf, Move move) {
  constexpr uint64_t kAll = (uint64_t{1} << kLanes) - 1;
  for (int64_t k = 0; k < m;) {
    while (rest == 0) rest = mask_word(mask.bits, mask.numel, ++word);
    const int shift = __builtin_ctzll(rest) & ~(kLanes - 1);
    const auto lanes = static_cast<unsigned>((rest >> shift) & kAll);
    const int count = __builtin_popcount(lanes);
    const int64_t first = word * 64 + shift;
    if (k + count <= m && first + kLanes <= mask.numel) {
      move(x + first, lanes, buf + k);
      k += count;
      rest &= ~(kAll << shift);
    } else {
      buf[k++] = x[word * 64 + __builtin_ctzll(rest)];
      rest &= rest - 1;
    }
  }
}

// A mask byte at a time: one permute with the byte's left-pack lanes, one store.
ACTCORE_AVX2 void avx2_read_set(const float* x, const MaskView& mask, int64_t& word,
                                uint64_t& rest, int64_t m, float* buf) {
  read_set<8>(x, mask, word, rest, m, buf,
              [](const float* from, unsigned lanes, float* to) ACTCORE_AVX2 {
                const __m256i order =
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(kLanes.pack[lanes]));
                _mm256_storeu_ps(to, _mm256_permutevar8x32_ps(_mm256_loadu_ps(from), order));
              });
}

// 16 mask bits at a time: one compress, one store.
ACTCORE_AVX512 void avx512_read_set(const float* x, const MaskView& mask, int64_t& word,
                                    uint64_t& rest, int64_t m, float* buf) {
  read_set<16>(x, mask, word, rest, m, buf,
               [](const float* from, unsigned lanes, float* to) ACTCORE_AVX512 {
                 const auto keep = static_cast<__mmask16>(lanes);
                 _mm512_storeu_ps(to, _mm512_maskz_compress_ps(keep, _mm512_loadu_ps(from)));
               });
}
#endif

// ... or the set elements of a mask over a dense input, in order (one row: the column of a
// value is its rank among them). Reads run on from where the last one stopped; float32
// reads left-pack a mask byte (AVX2) or 16 bits (AVX-512) at a time.
template <typename scalar_t, typename acc_t, int kLevel>
struct MaskedSource {
  const scalar_t* x;
  MaskView mask;
  int64_t word = 0;
  uint64_t rest = 0;  // set bits of `word` not read yet
  int64_t next = -1;  // rank of the next value read without a seek

  ACTCORE_INLINE void seek(int64_t rank) {
    const int64_t* o = mask.offsets;  // the last word with fewer set bits before it than rank
    word = std::upper_bound(o, o + mask.words + 1, rank) - o - 1;
    rest = mask_word(mask.bits, mask.numel, word);
    for (int64_t k = o[word]; k < rank; ++k) rest &= rest - 1;
  }

  ACTCORE_INLINE const acc_t* read(int64_t, int64_t col, int64_t m, acc_t* buf) {
    if (col != next) seek(col);
    next = col + m;
#if ACTCORE_X86
    if constexpr (std::is_same_v<scalar_t, float> && kLevel >= kAvx512) {
      avx512_read_set(x, mask, word, rest, m, buf);
      return buf;
    } else if constexpr (std::is_same_v<scalar_t, float> && kLevel >= kAvx2) {
      avx2_read_set(x, mask, word, rest, m, buf);
      return buf;
    }
#endif
    for (int64_t k = 0; k < m; ++k) {
      while (rest == 0) rest = mask_word(mask.bits, mask.numel, ++word);
      const int64_t i = word * 64 + __builtin_ctzll(rest);
      rest &= rest - 1;
      buf[k] = static_cast<acc_t>(x[i]);
    }
    return buf;
  }
};

// Groups [g0, g1) of quantization.quantize_reference, operation for operation, on the
// values `src` reads.
template <typename scalar_t, int kLevel, typename Source>
ACTCORE_INLINE void quantize_groups(const QuantizeArgs& a, Source& src, int64_t g0, int64_t g1) {
  using acc_t = typename Acc<scalar_t>::type;
  // float32 under AVX-512: min/max and codes in loops of their own (16 lanes)
  constexpr bool k512 = kLevel >= kAvx512 && std::is_same_v<acc_t, float>;
  alignas(64) acc_t buf[kChunk + 16];  // + 16: a masked read's last 16-lane store
  alignas(64) uint8_t codes[kChunk];
  const int64_t groups_per_row = (a.cols + a.group_size - 1) / a.group_size;
  const int64_t row_bytes = (a.cols + 7) / 8 * a.bits;
  const acc_t levels = static_cast<acc_t>((1 << a.bits) - 1);
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  int64_t key_hi = 0;
  uint32_t key = block_key(a.seed, 0);
  for (int64_t gid = g0; gid < g1; ++gid) {
    const int64_t row = gid / groups_per_row;
    const int64_t col0 = (gid - row * groups_per_row) * a.group_size;
    const int64_t n = std::min(a.group_size, a.cols - col0);

    acc_t mn = inf;
    acc_t mx = -inf;
    const acc_t* held = nullptr;  // the converted group, when it fits one chunk
    for (int64_t off = 0; off < n; off += kChunk) {
      const int64_t m = std::min(kChunk, n - off);
      held = src.read(row, col0 + off, m, buf);
#if ACTCORE_X86
      if constexpr (k512) {
        min_max_avx512(held, m, mn, mx);
      } else
#endif
      {
        min_max(held, m, mn, mx);
      }
    }
    uint16_t lo_bits;
    uint16_t step_bits;
    acc_t scale;
    group_metadata(mn, mx, levels, lo_bits, step_bits, scale);
    a.lo[gid] = lo_bits;
    a.step[gid] = step_bits;
    // scale is 1 except in groups whose span overflows: codes from the values times 1/4
    const bool scaled = scale != acc_t(1);
    const acc_t lo = from_bf16<acc_t>(lo_bits) * scale;
    const acc_t step = from_bf16<acc_t>(step_bits) * scale;

    uint8_t* out = a.payload + row * row_bytes + col0 / 8 * a.bits;
    for (int64_t off = 0; off < n; off += kChunk) {
      const int64_t m = std::min(kChunk, n - off);
      const int64_t m8 = (m + 7) / 8 * 8;
      if (step == acc_t(0)) {  // a constant group: every code is 0
        std::memset(codes, 0, static_cast<size_t>(m8));
      } else {
        const acc_t* v = n <= kChunk ? held : src.read(row, col0 + off, m, buf);
        if (scaled) {  // (buf may be v itself: element by element, in place)
          for (int64_t k = 0; k < m; ++k) buf[k] = v[k] * scale;
          v = buf;
        }
        if (a.stochastic) {
          const int64_t first = row * a.cols + col0 + off;
          for (int64_t done = 0; done < m;) {  // split where the noise key changes
            const int64_t index = first + done;
            const int64_t hi = index >> 32;
            const int64_t len = std::min(m - done, ((hi + 1) << 32) - index);
            if (hi != key_hi) {
              key_hi = hi;
              key = block_key(a.seed, hi);
            }
#if ACTCORE_X86
            if constexpr (k512) {
              codes_avx512<true>(v + done, len, lo, step, levels, static_cast<uint32_t>(index),
                                 key, codes + done);
            } else
#endif
            {
              codes_of<acc_t, true>(v + done, len, lo, step, levels,
                                          static_cast<uint32_t>(index), key, codes + done);
            }
            done += len;
          }
        } else {
#if ACTCORE_X86
          if constexpr (k512) {
            codes_avx512<false>(v, m, lo, step, levels, 0, 0, codes);
          } else
#endif
          {
            codes_of<acc_t, false>(v, m, lo, step, levels, 0, 0, codes);
          }
        }
        std::memset(codes + m, 0, static_cast<size_t>(m8 - m));  // past the row's end
      }
#if ACTCORE_X86
      if constexpr (kLevel >= kAvx512) {
        pack_blocks_avx512(codes, m8 / 8, a.bits, out + off / 8 * a.bits);
      } else
#endif
      {
        pack_blocks(codes, m8 / 8, a.bits, out + off / 8 * a.bits);
      }
    }
  }
}

// ---------------------------------------------------------------- dequantize
using actcore_kernels::DequantizeArgs;

// (code * step/4 + lo/4) * 4 in acc_t (code * step/4 is exact: one rounding, no overflow),
// clamped to the output dtype's finite range, then converted (nearest even).
// With `scale` (dequantize_scaled), each value is then multiplied by its channel's multiplier
// in scalar_t (the multiplier converted to scalar_t first, the product rounded once).
template <typename scalar_t>
ACTCORE_INLINE void dequantize_groups(const DequantizeArgs& a, int64_t g0, int64_t g1,
                                      const ChannelScale* scale = nullptr) {
  using acc_t = typename Acc<scalar_t>::type;
  alignas(64) uint8_t codes[kChunk];
  auto* out = static_cast<scalar_t*>(a.out);
  const int64_t groups_per_row = (a.cols + a.group_size - 1) / a.group_size;
  const int64_t row_bytes = (a.cols + 7) / 8 * a.bits;
  // the output dtype's largest finite value, in acc_t (exact)
  const acc_t top = static_cast<acc_t>(std::numeric_limits<scalar_t>::max());
  for (int64_t gid = g0; gid < g1; ++gid) {
    const int64_t row = gid / groups_per_row;
    const int64_t col0 = (gid - row * groups_per_row) * a.group_size;
    const int64_t n = std::min(a.group_size, a.cols - col0);
    const acc_t lo = from_bf16<acc_t>(a.lo[gid]);
    const acc_t step = from_bf16<acc_t>(a.step[gid]);
    const bool finite = std::isfinite(lo) && std::isfinite(step);
    const acc_t lo_q = finite ? lo * acc_t(0.25) : std::numeric_limits<acc_t>::quiet_NaN();
    const acc_t step_q = step * acc_t(0.25);
    const uint8_t* in = a.payload + row * row_bytes + col0 / 8 * a.bits;
    scalar_t* o = out + row * a.cols + col0;
    for (int64_t off = 0; off < n; off += kChunk) {
      const int64_t m = std::min(kChunk, n - off);
      unpack_blocks(in + off / 8 * a.bits, (m + 7) / 8, a.bits, codes);
      for (int64_t k = 0; k < m; ++k) {
        acc_t value = (static_cast<acc_t>(codes[k]) * step_q + lo_q) * acc_t(4);
        value = value < -top ? -top : (value > top ? top : value);  // NaN stays
        o[off + k] = static_cast<scalar_t>(value);
      }
      if (scale != nullptr) {
        scalar_t* os = o + off;
        const float* mult = scale->mult;
        channel_runs(*scale, row * a.cols + col0 + off, m, [&](int64_t k, int64_t len, int64_t c) {
          if (scale->inner == 1) {
            for (int64_t j = 0; j < len; ++j) {
              const auto f = static_cast<acc_t>(static_cast<scalar_t>(mult[c + j]));
              os[k + j] = static_cast<scalar_t>(static_cast<acc_t>(os[k + j]) * f);
            }
          } else {
            const auto f = static_cast<acc_t>(static_cast<scalar_t>(mult[c]));
            for (int64_t j = 0; j < len; ++j) {
              os[k + j] = static_cast<scalar_t>(static_cast<acc_t>(os[k + j]) * f);
            }
          }
        });
      }
    }
  }
}

#if ACTCORE_X86
// Words [w, we) of a float32 masked_dequantize output, all of it: `values` (the set
// elements' values in order, kLanes floats readable past the last) spread to their lanes
// kLanes mask bits at a time by `move` (the inverse of read_set's left-pack), +0 in the
// other lanes.
template <int kLanes, typename Move>
ACTCORE_INLINE void spread_words(const float* values, float* out, const MaskView& m, int64_t w,
                                 int64_t we, Move move) {
  constexpr uint64_t kAll = (uint64_t{1} << kLanes) - 1;
  int64_t k = 0;
  for (int64_t v = w; v < we; ++v) {
    const uint64_t bits = mask_word(m.bits, m.numel, v);
    const int64_t n = std::min<int64_t>(64, m.numel - v * 64);
    float* o = out + v * 64;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const auto lanes = static_cast<unsigned>((bits >> j) & kAll);
      move(values + k, lanes, o + j);
      k += __builtin_popcount(lanes);
    }
    for (; j < n; ++j) o[j] = ((bits >> j) & 1) ? values[k++] : 0.0f;
  }
}

// A mask byte at a time: one permute, one and, one store.
ACTCORE_AVX2 void avx2_spread_words(const float* values, float* out, const MaskView& m,
                                    int64_t w, int64_t we) {
  spread_words<8>(values, out, m, w, we, [](const float* from, unsigned lanes, float* to)
                                             ACTCORE_AVX2 {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i ranks = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLanes.spread[lanes]));
    const __m256 spread = _mm256_permutevar8x32_ps(_mm256_loadu_ps(from), ranks);
    const __m256i set = _mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(lanes)), lane_bit), lane_bit);
    _mm256_storeu_ps(to, _mm256_and_ps(spread, _mm256_castsi256_ps(set)));
  });
}

// 16 mask bits at a time: one zero-masking expand, one store.
ACTCORE_AVX512 void avx512_spread_words(const float* values, float* out, const MaskView& m,
                                        int64_t w, int64_t we) {
  spread_words<16>(values, out, m, w, we, [](const float* from, unsigned lanes, float* to)
                                              ACTCORE_AVX512 {
    const auto keep = static_cast<__mmask16>(lanes);
    _mm512_storeu_ps(to, _mm512_maskz_expand_ps(keep, _mm512_loadu_ps(from)));
  });
}
#endif

// The dense output of masked_dequantize over words [w0, w1) of the mask: +0 everywhere, then
// the values of the set elements (ranks offsets[w0] on), each computed as dequantize_groups
// computes it. Works in spans of kChunk outputs (their codes fit the buffers).
template <typename scalar_t, int kLevel>
ACTCORE_INLINE void masked_dequantize_words(const actcore_kernels::MaskedDequantizeArgs& ma,
                                            int64_t w0, int64_t w1) {
  using acc_t = typename Acc<scalar_t>::type;
  constexpr int64_t kSpanWords = kChunk / 64;
  alignas(64) uint8_t codes[kChunk + 16];
  alignas(64) acc_t values[kChunk + 16];  // + 16: the spreading write's last 16-lane load
  const DequantizeArgs& a = ma.d;
  const MaskView& m = ma.mask;
  auto* out = static_cast<scalar_t*>(a.out);
  const acc_t top = static_cast<acc_t>(std::numeric_limits<scalar_t>::max());
  for (int64_t w = w0; w < w1; w += kSpanWords) {
    const int64_t we = std::min(w1, w + kSpanWords);
    const int64_t r0 = m.offsets[w];
    const int64_t r1 = m.offsets[we];
    constexpr bool spread = kLevel >= kAvx2 && std::is_same_v<scalar_t, float>;
    if (!spread || r1 == r0) std::fill(out + w * 64, out + std::min(m.numel, we * 64), scalar_t(0));
    if (r1 == r0) continue;
    const int64_t b0 = r0 / 8;
    unpack_blocks(a.payload + b0 * a.bits, (r1 + 7) / 8 - b0, a.bits, codes);
    const uint8_t* c = codes + (r0 - b0 * 8);
    for (int64_t r = r0; r < r1;) {  // one group's run at a time
      const int64_t g = r / a.group_size;
      const int64_t end = std::min(r1, (g + 1) * a.group_size);
      const acc_t lo = from_bf16<acc_t>(a.lo[g]);
      const acc_t step = from_bf16<acc_t>(a.step[g]);
      const bool finite = std::isfinite(lo) && std::isfinite(step);
      const acc_t lo_q = finite ? lo * acc_t(0.25) : std::numeric_limits<acc_t>::quiet_NaN();
      const acc_t step_q = step * acc_t(0.25);
      for (int64_t k = r - r0; k < end - r0; ++k) {
        acc_t value = (static_cast<acc_t>(c[k]) * step_q + lo_q) * acc_t(4);
        values[k] = value < -top ? -top : (value > top ? top : value);  // NaN stays
      }
      r = end;
    }
#if ACTCORE_X86
    if constexpr (spread && kLevel >= kAvx512) {
      avx512_spread_words(values, out, m, w, we);
      continue;
    } else if constexpr (spread) {
      avx2_spread_words(values, out, m, w, we);
      continue;
    }
#endif
    int64_t k = 0;
    for (int64_t v = w; v < we; ++v) {
      scalar_t* o = out + v * 64;
      for (uint64_t bits = mask_word(m.bits, m.numel, v); bits != 0; bits &= bits - 1) {
        o[__builtin_ctzll(bits)] = static_cast<scalar_t>(values[k++]);
      }
    }
  }
}

// apply_mask over words [w0, w1): x where the mask is set, +0 elsewhere.
template <typename scalar_t>
ACTCORE_INLINE void apply_mask_words(const scalar_t* x, scalar_t* out, const MaskView& m,
                                     int64_t w0, int64_t w1) {
  for (int64_t w = w0; w < w1; ++w) {
    const uint64_t bits = mask_word(m.bits, m.numel, w);
    const int64_t n = std::min<int64_t>(64, m.numel - w * 64);
    const scalar_t* xs = x + w * 64;
    scalar_t* o = out + w * 64;
    if (n == 64 && bits == ~uint64_t{0}) {
      std::memcpy(o, xs, sizeof(scalar_t) * 64);
      continue;
    }
    for (int64_t j = 0; j < n; ++j) o[j] = ((bits >> j) & 1) ? xs[j] : scalar_t(0);
  }
}

// ---------------------------------------------------------------- element-wise ops
void pack_range(const uint8_t* values, uint8_t* packed, int64_t n, int bits, int64_t b0,
                int64_t b1) {
  int64_t full_end = std::min(b1, n / 8);
  if (b0 < full_end) pack_blocks(values + 8 * b0, full_end - b0, bits, packed + b0 * bits);
  if (full_end < b1 && b1 * 8 > n) {  // the last, partial block: zero padding
    uint8_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t b = std::max(full_end, b0);
    std::memcpy(tail, values + 8 * b, static_cast<size_t>(n - 8 * b));
    pack_blocks(tail, 1, bits, packed + b * bits);
  }
}

void unpack_range(const uint8_t* packed, uint8_t* values, int64_t n, int bits, int64_t b0,
                  int64_t b1) {
  int64_t full_end = std::min(b1, n / 8);
  if (b0 < full_end) unpack_blocks(packed + b0 * bits, full_end - b0, bits, values + 8 * b0);
  if (full_end < b1 && b1 * 8 > n) {
    uint8_t tail[8];
    const int64_t b = std::max(full_end, b0);
    unpack_blocks(packed + b * bits, 1, bits, tail);
    std::memcpy(values + 8 * b, tail, static_cast<size_t>(n - 8 * b));
  }
}

void hash_range(const int64_t* index, float* out, int64_t seed, int64_t i0, int64_t i1) {
  int64_t key_hi = 0;
  uint32_t key = block_key(seed, 0);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t hi = index[i] >> 32;
    if (hi != key_hi) {
      key_hi = hi;
      key = block_key(seed, hi);
    }
    const uint32_t h = mix32(static_cast<uint32_t>(index[i]) ^ key);
    out[i] = static_cast<float>(static_cast<int32_t>(h >> 8)) * kTwoPowMinus24;
  }
}

// ---------------------------------------------------------------- ISA variants
#define ACTCORE_VARIANTS(prefix, attr, level)                                                 \
  template <typename scalar_t>                                                                \
  attr void prefix##quantize(const QuantizeArgs& a, int64_t g0, int64_t g1) {                 \
    DenseSource<scalar_t, typename Acc<scalar_t>::type> src{                                  \
        static_cast<const scalar_t*>(a.x), a.cols};                                           \
    quantize_groups<scalar_t, level>(a, src, g0, g1);                                         \
  }                                                                                           \
  template <typename scalar_t>                                                                \
  attr void prefix##quantize_scaled(const QuantizeArgs& a, const ChannelScale& s, int64_t g0, \
                                    int64_t g1) {                                             \
    ScaledSource<scalar_t, typename Acc<scalar_t>::type> src{                                 \
        static_cast<const scalar_t*>(a.x), a.cols, s};                                        \
    quantize_groups<scalar_t, level>(a, src, g0, g1);                                         \
  }                                                                                           \
  template <typename scalar_t>                                                                \
  attr void prefix##dequantize_scaled(const DequantizeArgs& a, const ChannelScale& s,         \
                                      int64_t g0, int64_t g1) {                               \
    dequantize_groups<scalar_t>(a, g0, g1, &s);                                               \
  }                                                                                           \
  template <typename scalar_t>                                                                \
  attr void prefix##masked_quantize(const MaskedQuantizeArgs& a, int64_t g0, int64_t g1) {    \
    MaskedSource<scalar_t, typename Acc<scalar_t>::type, level> src{                          \
        static_cast<const scalar_t*>(a.q.x), a.mask};                                         \
    quantize_groups<scalar_t, level>(a.q, src, g0, g1);                                       \
  }                                                                                           \
  template <typename scalar_t>                                                                \
  attr void prefix##dequantize(const DequantizeArgs& a, int64_t g0, int64_t g1) {             \
    dequantize_groups<scalar_t>(a, g0, g1);                                                   \
  }                                                                                           \
  template <typename scalar_t>                                                                \
  attr void prefix##masked_dequantize(const actcore_kernels::MaskedDequantizeArgs& a,         \
                                      int64_t w0, int64_t w1) {                               \
    masked_dequantize_words<scalar_t, level>(a, w0, w1);                                      \
  }                                                                                           \
  template <typename scalar_t>                                                                \
  attr void prefix##apply_mask(const scalar_t* x, scalar_t* out, const MaskView& m,           \
                               int64_t w0, int64_t w1) {                                      \
    apply_mask_words<scalar_t>(x, out, m, w0, w1);                                            \
  }

ACTCORE_VARIANTS(base_, , kBaseline)
#if ACTCORE_X86
ACTCORE_VARIANTS(avx2_, ACTCORE_AVX2, kAvx2)
ACTCORE_VARIANTS(avx512_, ACTCORE_AVX512, kAvx512)
#endif

// `scale`: quantize_scaled's channel multipliers, else nullptr.
template <typename scalar_t>
void quantize_parallel(const QuantizeArgs& a, const ChannelScale* scale = nullptr) {
  const int64_t groups = a.rows * ((a.cols + a.group_size - 1) / a.group_size);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / a.group_size);
  const int level = isa();
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    if (scale != nullptr) {
#if ACTCORE_X86
      if (level >= kAvx512) return avx512_quantize_scaled<scalar_t>(a, *scale, g0, g1);
      if (level >= kAvx2) return avx2_quantize_scaled<scalar_t>(a, *scale, g0, g1);
#endif
      return base_quantize_scaled<scalar_t>(a, *scale, g0, g1);
    }
#if ACTCORE_X86
    if (level >= kAvx512) return avx512_quantize<scalar_t>(a, g0, g1);
    if (level >= kAvx2) return avx2_quantize<scalar_t>(a, g0, g1);
#endif
    base_quantize<scalar_t>(a, g0, g1);
  });
}

template <typename scalar_t>
void masked_quantize_parallel(const MaskedQuantizeArgs& a) {
  const int64_t groups = (a.q.cols + a.q.group_size - 1) / a.q.group_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / a.q.group_size);
  const int level = isa();
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
#if ACTCORE_X86
    if (level >= kAvx512) return avx512_masked_quantize<scalar_t>(a, g0, g1);
    if (level >= kAvx2) return avx2_masked_quantize<scalar_t>(a, g0, g1);
#endif
    base_masked_quantize<scalar_t>(a, g0, g1);
  });
}

template <typename scalar_t>
void masked_dequantize_parallel(const actcore_kernels::MaskedDequantizeArgs& a) {
  const int level = isa();
  at::parallel_for(0, a.mask.words, kGrainElements / 64, [&](int64_t w0, int64_t w1) {
#if ACTCORE_X86
    if (level >= kAvx512) return avx512_masked_dequantize<scalar_t>(a, w0, w1);
    if (level >= kAvx2) return avx2_masked_dequantize<scalar_t>(a, w0, w1);
#endif
    base_masked_dequantize<scalar_t>(a, w0, w1);
  });
}

template <typename scalar_t>
void apply_mask_parallel(const at::Tensor& xc, at::Tensor& out, const MaskView& m) {
  const auto* x = static_cast<const scalar_t*>(xc.const_data_ptr());
  auto* o = static_cast<scalar_t*>(out.mutable_data_ptr());
  const int level = isa();
  at::parallel_for(0, m.words, kGrainElements / 64, [&](int64_t w0, int64_t w1) {
#if ACTCORE_X86
    if (level >= kAvx512) return avx512_apply_mask<scalar_t>(x, o, m, w0, w1);
    if (level >= kAvx2) return avx2_apply_mask<scalar_t>(x, o, m, w0, w1);
#endif
    base_apply_mask<scalar_t>(x, o, m, w0, w1);
  });
}

// `scale`: dequantize_scaled's channel multipliers, else nullptr.
template <typename scalar_t>
void dequantize_parallel(const DequantizeArgs& a, const ChannelScale* scale = nullptr) {
  const int64_t groups = a.rows * ((a.cols + a.group_size - 1) / a.group_size);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / a.group_size);
  const int level = isa();
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    if (scale != nullptr) {
#if ACTCORE_X86
      if (level >= kAvx512) return avx512_dequantize_scaled<scalar_t>(a, *scale, g0, g1);
      if (level >= kAvx2) return avx2_dequantize_scaled<scalar_t>(a, *scale, g0, g1);
#endif
      return base_dequantize_scaled<scalar_t>(a, *scale, g0, g1);
    }
#if ACTCORE_X86
    if (level >= kAvx512) return avx512_dequantize<scalar_t>(a, g0, g1);
    if (level >= kAvx2) return avx2_dequantize<scalar_t>(a, g0, g1);
#endif
    base_dequantize<scalar_t>(a, g0, g1);
  });
}

// ---------------------------------------------------------------- argument checks
void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got one on ",
              t.device());
}

void check_float(at::ScalarType type, const char* op) {
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16 ||
                  type == at::kDouble,
              op, " takes float32, float16, bfloat16 or float64, got ", type);
}

using actcore_checks::check_bits;
using actcore_checks::check_group_size;
using actcore_checks::check_hash_index;
using actcore_checks::check_mask;
using actcore_checks::check_pack_values;
using actcore_checks::check_packed_dtypes;
using actcore_checks::check_packed_capacity;
using actcore_checks::check_packed_shapes;
using actcore_checks::check_unpack_payload;
using actcore_checks::dequantize_args;
using actcore_checks::hash_buffers;
using actcore_checks::mask_offsets_buffer;
using actcore_checks::mask_view;
using actcore_checks::quantize_args;
using actcore_checks::quantize_outputs;
using actcore_checks::rows_and_cols;

// The offsets table of a contiguous mask `mc` over `numel` elements (set bits before each
// word; the last entry is their count).
at::Tensor mask_offsets(const at::Tensor& mc, int64_t numel) {
  at::Tensor offsets = mask_offsets_buffer(mc, numel);
  int64_t* o = offsets.mutable_data_ptr<int64_t>();
  const uint8_t* bits = mc.const_data_ptr<uint8_t>();
  const int64_t words = actcore_kernels::mask_words(numel);
  o[0] = 0;
  for (int64_t w = 0; w < words; ++w) {
    o[w + 1] = o[w] + __builtin_popcountll(mask_word(bits, numel, w));
  }
  return offsets;
}

// ---------------------------------------------------------------- the ops
// The channel multipliers of a scaled op over a tensor of `shape`: `multipliers` (float32,
// one per channel) and `inner` (elements per channel run) into `scale`; returns the
// contiguous multipliers the kernels read.
at::Tensor channel_scale(const char* op, const at::Tensor& multipliers, int64_t inner,
                         at::IntArrayRef shape, ChannelScale& scale) {
  check_cpu(multipliers, op, "multipliers");
  TORCH_CHECK(multipliers.scalar_type() == at::kFloat && multipliers.dim() == 1 &&
                  multipliers.numel() > 0,
              op, ": multipliers must be a non-empty 1-D float32 tensor, got ",
              multipliers.scalar_type(), " of shape ", multipliers.sizes());
  TORCH_CHECK(inner > 0, op, ": inner must be positive, got ", inner);
  int64_t numel = 1;
  for (const int64_t size : shape) numel *= size;
  const int64_t channels = multipliers.numel();
  TORCH_CHECK(numel % channels == 0 && numel / channels % inner == 0, op, ": ", channels,
              " channels of ", inner, " elements each do not tile a tensor of shape ", shape);
  at::Tensor mc = multipliers.contiguous();
  scale = ChannelScale{mc.const_data_ptr<float>(), channels, inner};
  return mc;
}

// quantize, and with `multipliers` quantize_scaled (see channel_scale).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_impl(
    const char* op, const at::Tensor& x, const at::Tensor* multipliers, int64_t inner,
    int64_t bits, int64_t group_size, bool stochastic, int64_t seed, bool per_sample) {
  check_cpu(x, op, "x");
  check_float(x.scalar_type(), op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  ChannelScale scale{};
  at::Tensor mc;
  if (multipliers != nullptr) mc = channel_scale(op, *multipliers, inner, x.sizes(), scale);
  const ChannelScale* scaled = multipliers != nullptr ? &scale : nullptr;
  const auto [rows, cols] = rows_and_cols(x.sizes(), per_sample);
  auto [payload, lo, step] = quantize_outputs(x, rows, cols, group_size, bits);
  if (rows * cols == 0) return {payload, lo, step};
  const at::Tensor xc = x.contiguous();  // strided inputs: one contiguous copy
  const QuantizeArgs args =
      quantize_args(xc, payload, lo, step, rows, cols, group_size, bits, stochastic, seed);
  switch (x.scalar_type()) {
    case at::kFloat:
      quantize_parallel<float>(args, scaled);
      break;
    case at::kHalf:
      quantize_parallel<c10::Half>(args, scaled);
      break;
    case at::kBFloat16:
      quantize_parallel<c10::BFloat16>(args, scaled);
      break;
    default:
      quantize_parallel<double>(args, scaled);
      break;
  }
  return {payload, lo, step};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, int64_t bits,
                                                            int64_t group_size, bool stochastic,
                                                            int64_t seed, bool per_sample) {
  return quantize_impl("actcore::quantize", x, nullptr, 1, bits, group_size, stochastic, seed,
                       per_sample);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_scaled_cpu(
    const at::Tensor& x, const at::Tensor& multipliers, int64_t inner, int64_t bits,
    int64_t group_size, bool stochastic, int64_t seed, bool per_sample) {
  return quantize_impl("actcore::quantize_scaled", x, &multipliers, inner, bits, group_size,
                       stochastic, seed, per_sample);
}

// dequantize, and with `multipliers` dequantize_scaled (see channel_scale).
at::Tensor dequantize_impl(const char* op, const at::Tensor& payload, const at::Tensor& lo,
                           const at::Tensor& step, const at::Tensor* multipliers, int64_t inner,
                           int64_t bits, int64_t group_size, at::IntArrayRef shape,
                           at::ScalarType dtype, bool per_sample) {
  check_cpu(payload, op, "payload");
  check_cpu(lo, op, "lo");
  check_cpu(step, op, "step");
  check_float(dtype, op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  check_packed_dtypes(payload, lo, step, op);
  ChannelScale scale{};
  at::Tensor mc;
  if (multipliers != nullptr) mc = channel_scale(op, *multipliers, inner, shape, scale);
  const ChannelScale* scaled = multipliers != nullptr ? &scale : nullptr;
  at::Tensor out = at::empty(shape, payload.options().dtype(dtype));
  const auto [rows, cols] = rows_and_cols(shape, per_sample);
  if (rows * cols == 0) return out;
  check_packed_shapes(payload, lo, step, rows, cols, group_size, bits, op);
  const at::Tensor pc = payload.contiguous();
  const at::Tensor lc = lo.contiguous();
  const at::Tensor sc = step.contiguous();
  const DequantizeArgs args = dequantize_args(pc, lc, sc, out, rows, cols, group_size, bits);
  switch (dtype) {
    case at::kFloat:
      dequantize_parallel<float>(args, scaled);
      break;
    case at::kHalf:
      dequantize_parallel<c10::Half>(args, scaled);
      break;
    case at::kBFloat16:
      dequantize_parallel<c10::BFloat16>(args, scaled);
      break;
    default:
      dequantize_parallel<double>(args, scaled);
      break;
  }
  return out;
}

at::Tensor dequantize_cpu(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& step,
                          int64_t bits, int64_t group_size, at::IntArrayRef shape,
                          at::ScalarType dtype, bool per_sample) {
  return dequantize_impl("actcore::dequantize", payload, lo, step, nullptr, 1, bits, group_size,
                         shape, dtype, per_sample);
}

at::Tensor dequantize_scaled_cpu(const at::Tensor& payload, const at::Tensor& lo,
                                 const at::Tensor& step, const at::Tensor& multipliers,
                                 int64_t inner, int64_t bits, int64_t group_size,
                                 at::IntArrayRef shape, at::ScalarType dtype, bool per_sample) {
  return dequantize_impl("actcore::dequantize_scaled", payload, lo, step, &multipliers, inner,
                         bits, group_size, shape, dtype, per_sample);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_quantize_cpu(const at::Tensor& x,
                                                                   const at::Tensor& mask,
                                                                   int64_t bits,
                                                                   int64_t group_size,
                                                                   bool stochastic, int64_t seed) {
  constexpr const char* op = "actcore::masked_quantize";
  check_cpu(x, op, "x");
  check_cpu(mask, op, "mask");
  check_float(x.scalar_type(), op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  const int64_t numel = x.numel();
  check_mask(mask, numel, op);
  const at::Tensor mc = mask.contiguous();
  const at::Tensor offsets = mask_offsets(mc, numel);
  const int64_t count = offsets.const_data_ptr<int64_t>()[actcore_kernels::mask_words(numel)];
  auto [payload, lo, step] = quantize_outputs(x, 1, count, group_size, bits);
  if (count == 0) return {payload, lo, step};
  const at::Tensor xc = x.contiguous();
  const MaskedQuantizeArgs args{
      quantize_args(xc, payload, lo, step, 1, count, group_size, bits, stochastic, seed),
      mask_view(mc, offsets, numel)};
  switch (x.scalar_type()) {
    case at::kFloat:
      masked_quantize_parallel<float>(args);
      break;
    case at::kHalf:
      masked_quantize_parallel<c10::Half>(args);
      break;
    case at::kBFloat16:
      masked_quantize_parallel<c10::BFloat16>(args);
      break;
    default:
      masked_quantize_parallel<double>(args);
      break;
  }
  return {payload, lo, step};
}

// masked_quantize's outputs in buffers sized for every element of x, zero past them, and
// the count of set elements as a 0-d int64 tensor (the CUDA kernel's contract; on a CPU
// nothing waits, so this is the exact op plus the padding).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_quantize_padded_cpu(
    const at::Tensor& x, const at::Tensor& mask, int64_t bits, int64_t group_size,
    bool stochastic, int64_t seed) {
  const auto [exact_payload, exact_lo, exact_step] =
      masked_quantize_cpu(x, mask, bits, group_size, stochastic, seed);
  const int64_t numel = x.numel();
  auto [payload, lo, step] = quantize_outputs(x, 1, numel, group_size, bits);
  payload.zero_();
  lo.zero_();
  step.zero_();
  payload.narrow(1, 0, exact_payload.size(1)).copy_(exact_payload);
  lo.narrow(1, 0, exact_lo.size(1)).copy_(exact_lo);
  step.narrow(1, 0, exact_step.size(1)).copy_(exact_step);
  int64_t count = 0;
  if (numel > 0) {
    const at::Tensor offsets = mask_offsets(mask.contiguous(), numel);
    count = offsets.const_data_ptr<int64_t>()[actcore_kernels::mask_words(numel)];
  }
  at::Tensor count_tensor = at::empty({}, x.options().dtype(at::kLong));
  count_tensor.mutable_data_ptr<int64_t>()[0] = count;
  return {payload, lo, step, count_tensor};
}

at::Tensor masked_dequantize_cpu(const at::Tensor& payload, const at::Tensor& lo,
                                 const at::Tensor& step, const at::Tensor& mask, int64_t bits,
                                 int64_t group_size, at::IntArrayRef shape, at::ScalarType dtype) {
  constexpr const char* op = "actcore::masked_dequantize";
  check_cpu(payload, op, "payload");
  check_cpu(lo, op, "lo");
  check_cpu(step, op, "step");
  check_cpu(mask, op, "mask");
  check_float(dtype, op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  check_packed_dtypes(payload, lo, step, op);
  at::Tensor out = at::empty(shape, payload.options().dtype(dtype));
  const int64_t numel = out.numel();
  check_mask(mask, numel, op);
  if (numel == 0) return out;
  const at::Tensor mc = mask.contiguous();
  const at::Tensor offsets = mask_offsets(mc, numel);
  const int64_t count = offsets.const_data_ptr<int64_t>()[actcore_kernels::mask_words(numel)];
  if (count > 0) check_packed_capacity(payload, lo, step, count, group_size, bits, op);
  const at::Tensor pc = payload.contiguous();
  const at::Tensor lc = lo.contiguous();
  const at::Tensor sc = step.contiguous();
  const actcore_kernels::MaskedDequantizeArgs args{
      dequantize_args(pc, lc, sc, out, 1, count, group_size, bits), mask_view(mc, offsets, numel)};
  switch (dtype) {
    case at::kFloat:
      masked_dequantize_parallel<float>(args);
      break;
    case at::kHalf:
      masked_dequantize_parallel<c10::Half>(args);
      break;
    case at::kBFloat16:
      masked_dequantize_parallel<c10::BFloat16>(args);
      break;
    default:
      masked_dequantize_parallel<double>(args);
      break;
  }
  return out;
}

at::Tensor apply_mask_cpu(const at::Tensor& x, const at::Tensor& mask) {
  constexpr const char* op = "actcore::apply_mask";
  check_cpu(x, op, "x");
  check_cpu(mask, op, "mask");
  check_float(x.scalar_type(), op);
  const int64_t numel = x.numel();
  check_mask(mask, numel, op);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (numel == 0) return out;
  const at::Tensor xc = x.contiguous();
  const at::Tensor mc = mask.contiguous();
  actcore_kernels::MaskView view{};  // no offsets: each word stands alone
  view.bits = mc.const_data_ptr<uint8_t>();
  view.numel = numel;
  view.words = actcore_kernels::mask_words(numel);
  switch (x.scalar_type()) {
    case at::kFloat:
      apply_mask_parallel<float>(xc, out, view);
      break;
    case at::kHalf:
      apply_mask_parallel<c10::Half>(xc, out, view);
      break;
    case at::kBFloat16:
      apply_mask_parallel<c10::BFloat16>(xc, out, view);
      break;
    default:
      apply_mask_parallel<double>(xc, out, view);
      break;
  }
  return out;
}

at::Tensor pack_bits_cpu(const at::Tensor& values, int64_t bits) {
  constexpr const char* op = "actcore::pack_bits";
  check_cpu(values, op, "values");
  check_bits(bits, op);
  check_pack_values(values, op);
  const int64_t n = values.numel();
  at::Tensor packed = at::empty({(n + 7) / 8 * bits}, values.options());
  if (n == 0) return packed;
  const at::Tensor vc = values.contiguous();  // row-major order, as reshape(-1)
  const uint8_t* in = vc.const_data_ptr<uint8_t>();
  uint8_t* out = packed.mutable_data_ptr<uint8_t>();
  const int b = static_cast<int>(bits);
  at::parallel_for(0, (n + 7) / 8, kGrainElements / 8,
                   [&](int64_t b0, int64_t b1) { pack_range(in, out, n, b, b0, b1); });
  return packed;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, int64_t bits, int64_t numel) {
  constexpr const char* op = "actcore::unpack_bits";
  check_cpu(packed, op, "packed");
  check_bits(bits, op);
  check_unpack_payload(packed, bits, numel, op);
  at::Tensor values = at::empty({numel}, packed.options());
  if (numel == 0) return values;
  const at::Tensor pc = packed.contiguous();
  const uint8_t* in = pc.const_data_ptr<uint8_t>();
  uint8_t* out = values.mutable_data_ptr<uint8_t>();
  const int b = static_cast<int>(bits);
  at::parallel_for(0, (numel + 7) / 8, kGrainElements / 8,
                   [&](int64_t b0, int64_t b1) { unpack_range(in, out, numel, b, b0, b1); });
  return values;
}

at::Tensor hash_uniform_cpu(const at::Tensor& index, int64_t seed) {
  constexpr const char* op = "actcore::hash_uniform";
  check_cpu(index, op, "index");
  check_hash_index(index, op);
  if (index.numel() == 0) return at::empty(index.sizes(), index.options().dtype(at::kFloat));
  const auto [out, src] = hash_buffers(index, op);
  const int64_t* in = src.const_data_ptr<int64_t>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, index.numel(), kGrainElements,
                   [&](int64_t i0, int64_t i1) { hash_range(in, o, seed, i0, i1); });
  return out;
}

// Bytes [b0, b1) of pack_mask(!(x <= 0)): bit t of byte b is set where element 8b + t is
// above zero or NaN (torch's relu backward passes the gradient there).
template <typename scalar_t>
ACTCORE_INLINE void relu_mask_bytes(const scalar_t* x, int64_t n, uint8_t* out, int64_t b0,
                                    int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = 8 * b;
    const int64_t m = std::min<int64_t>(8, n - i0);
    unsigned byte = 0;
    for (int64_t t = 0; t < m; ++t) {
      const auto v = static_cast<typename Acc<scalar_t>::type>(x[i0 + t]);
      byte |= static_cast<unsigned>(!(v <= 0)) << t;
    }
    out[b] = static_cast<uint8_t>(byte);
  }
}

#if ACTCORE_X86
// The float32 case, 8 elements (one output byte) per compare: an ordered "<= 0" is false
// for NaN, so its inverted sign mask sets NaN's bit too.
ACTCORE_AVX2 void avx2_relu_mask_float(const float* x, int64_t n, uint8_t* out, int64_t b0,
                                       int64_t b1) {
  const int64_t full = std::min(b1, n / 8);
  const __m256 zero = _mm256_setzero_ps();
  int64_t b = b0;
  for (; b < full; ++b) {
    const __m256 v = _mm256_loadu_ps(x + 8 * b);
    const int le = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_LE_OQ));
    out[b] = static_cast<uint8_t>(~le);
  }
  if (b < b1) relu_mask_bytes<float>(x, n, out, b, b1);
}
#endif

template <typename scalar_t>
void relu_mask_parallel(const at::Tensor& xc, at::Tensor& out) {
  const auto* x = static_cast<const scalar_t*>(xc.const_data_ptr());
  uint8_t* o = out.mutable_data_ptr<uint8_t>();
  const int64_t n = xc.numel();
  at::parallel_for(0, (n + 7) / 8, kGrainElements / 8, [&](int64_t b0, int64_t b1) {
#if ACTCORE_X86
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (has_avx2()) return avx2_relu_mask_float(x, n, o, b0, b1);
    }
#endif
    relu_mask_bytes<scalar_t>(x, n, o, b0, b1);
  });
}

at::Tensor relu_mask_cpu(const at::Tensor& x) {
  constexpr const char* op = "actcore::relu_mask";
  check_cpu(x, op, "x");
  check_float(x.scalar_type(), op);
  const int64_t n = x.numel();
  at::Tensor out = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  if (n == 0) return out;
  const at::Tensor xc = x.contiguous();  // row-major order, as reshape(-1)
  switch (x.scalar_type()) {
    case at::kFloat:
      relu_mask_parallel<float>(xc, out);
      break;
    case at::kHalf:
      relu_mask_parallel<c10::Half>(xc, out);
      break;
    case at::kBFloat16:
      relu_mask_parallel<c10::BFloat16>(xc, out);
      break;
    default:
      relu_mask_parallel<double>(xc, out);
      break;
  }
  return out;
}

// The CPU-only ops (CUDA runs their references, made of the other ops).
void register_cpu_only(torch::Library& lib) {
  lib.impl("relu_mask", TORCH_FN(relu_mask_cpu));
  lib.impl("quantize_scaled", TORCH_FN(quantize_scaled_cpu));
  lib.impl("dequantize_scaled", TORCH_FN(dequantize_scaled_cpu));
}

actcore_registration::Registration<quantize_cpu, dequantize_cpu, pack_bits_cpu, unpack_bits_cpu,
                                   hash_uniform_cpu, masked_quantize_cpu, masked_dequantize_cpu,
                                   apply_mask_cpu, masked_quantize_padded_cpu>
    registration{c10::DispatchKey::CPU, register_cpu_only};

}  // namespace
}  // namespace actcore_cpu

extern "C" {

__attribute__((visibility("default"))) int actcore_cpu_abi_version() {
  return actcore_cpu::kAbiVersion;
}

// Registers the CPU kernels of the actcore::* ops (later calls do nothing while they are).
// Returns 0, or 1 with the reason in `message` (NUL-terminated, at most `size` bytes).
__attribute__((visibility("default"))) int actcore_cpu_register(char* message, size_t size) {
  return actcore_cpu::registration.ensure(message, size);
}

// Removes the registration (the ops fall back to their reference bodies on CPU).
__attribute__((visibility("default"))) void actcore_cpu_unregister() {
  actcore_cpu::registration.reset();
}

// The variant the hot loops run (0 baseline, 1 AVX2, 2 AVX-512) after capping it at `limit`
// (a negative limit leaves the cap as it is): the best this CPU has, within the cap.
__attribute__((visibility("default"))) int actcore_cpu_limit_isa(int limit) {
  if (limit >= 0) actcore_cpu::isa_limit.store(limit, std::memory_order_relaxed);
  return actcore_cpu::isa();
}

// How many threads the kernels' at::parallel_for runs on now: 1 when the library was built
// without the OpenMP that ATen's parallel backend needs in the caller (or torch runs one).
__attribute__((visibility("default"))) int actcore_cpu_parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    seen.fetch_or(uint64_t(1) << (t < 63 ? t : 63));
  });
  return __builtin_popcountll(seen.load());
}

}  // extern "C"
