// CUDA kernels of quantize and dequantize (ops/quantization.py), bit-exact with the
// pure-PyTorch reference; what makes them exact is described in kernel_common.cuh.
// A translation unit of its own: its templates (per dtype, bit count and index type) are
// most of the build's compile time, which ninja now spends beside kernels.cu's.

#include "kernel_common.cuh"

#include <c10/macros/Macros.h>  // before ATen/cuda/detail/IntegerDivider.cuh, which needs it

#include <ATen/cuda/detail/IntegerDivider.cuh>

namespace actcore_native {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace): this unit's own helpers

constexpr int kWarpsPerBlock = kThreads / 32;
// Lanes per group: as many as hold the group in registers (Tile blocks each), at most this.
constexpr int kDefaultMaxLanes = 32;

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
  } else {
    uint32_t p[kBits];
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
  } else {
    uint32_t p[kBits];
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

// ---------------------------------------------------------------- launchers
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

}  // namespace actcore_native
