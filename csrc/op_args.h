// The kernels' views of quantize / dequantize and of the masked ops, shared by the CPU
// kernels (cpu_kernels.cpp) and the CUDA ones (kernels.cu via actcore_native.h). Plain C++
// with raw pointers: no ATen, no CUDA header (the mask helpers are host and device code).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ACTCORE_HD __host__ __device__ __forceinline__
#else
#define ACTCORE_HD inline
#endif

namespace actcore_kernels {

// Input viewed as `rows` x `cols` (row-major, contiguous). Outputs are contiguous:
// payload rows x ceil(cols / 8) * bits bytes, lo and step rows x ceil(cols / group_size)
// bfloat16 values (passed as their 16-bit patterns).
struct QuantizeArgs {
  const void* x;
  uint8_t* payload;
  uint16_t* lo;
  uint16_t* step;
  int64_t rows;
  int64_t cols;
  int64_t group_size;  // a positive multiple of 8
  int bits;            // 1..8
  bool stochastic;
  int64_t seed;
};

struct DequantizeArgs {
  const uint8_t* payload;
  const uint16_t* lo;
  const uint16_t* step;
  void* out;
  int64_t rows;
  int64_t cols;
  int64_t group_size;
  int bits;
};

// A 1-bit mask over `numel` elements in pack_mask's layout (element i in bit i % 8 of byte
// i / 8, ceil(numel / 8) bytes), read as little-endian 64-bit words: element i is bit i % 64
// of word i / 64. `offsets` (words + 1 entries) counts the set bits before each word, so
// offsets[words] is the number of set elements; bits past `numel` are never set.
struct MaskView {
  const uint8_t* bits;
  const int64_t* offsets;  // filled by the op before its kernel runs
  int64_t numel;
  int64_t words;  // ceil(numel / 64)
};

ACTCORE_HD int64_t mask_words(int64_t numel) { return (numel + 63) / 64; }

// Word w of the mask, bits past `numel` cleared (the last byte may be padded with anything).
ACTCORE_HD uint64_t mask_word(const uint8_t* bits, int64_t numel, int64_t w) {
  const int64_t first = w * 8;
  const int64_t bytes = (numel + 7) / 8;
  uint64_t word = 0;
  if (bytes - first >= 8) {
    memcpy(&word, bits + first, sizeof(word));  // little-endian, as every supported target
  } else {
    for (int64_t b = 0; first + b < bytes; ++b) {
      word |= static_cast<uint64_t>(bits[first + b]) << (8 * b);
    }
  }
  const int64_t valid = numel - w * 64;
  if (valid < 64) word &= (uint64_t{1} << valid) - 1;
  return word;
}

// masked_quantize: the set elements of the dense input `q.x` (numel elements, row-major), in
// order, quantized as one row of `q.cols` (= the number of set elements) values.
struct MaskedQuantizeArgs {
  QuantizeArgs q;  // q.x: the dense input; q.rows == 1, q.cols == offsets[words]
  MaskView mask;
};

// masked_dequantize: the dense output `d.out` (numel elements): the dequantized values in
// order at the set elements, +0 elsewhere.
struct MaskedDequantizeArgs {
  DequantizeArgs d;  // d.out: the dense output; d.rows == 1, d.cols == offsets[words]
  MaskView mask;
};

}  // namespace actcore_kernels
