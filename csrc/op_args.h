// The kernels' views of quantize / dequantize, shared by the CPU kernels (cpu_kernels.cpp)
// and the CUDA ones (kernels.cu via actcore_native.h). Plain C++ with raw pointers: no ATen,
// no CUDA header.
#pragma once

#include <cstdint>

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

}  // namespace actcore_kernels
