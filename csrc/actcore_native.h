// Interface between the CUDA kernels (kernels.cu) and their torch.library registration
// (ops.cpp). Plain C++ with raw pointers: kernels.cu includes no ATen header, which keeps
// its nvcc compile short; ops.cpp does all tensor work (checks, allocation, streams).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace actcore_native {

// Bumped whenever this interface or the registered ops change; loader.py checks it.
constexpr int kAbiVersion = 1;

enum class Scalar : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

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

cudaError_t launch_quantize(Scalar dtype, const QuantizeArgs& args, cudaStream_t stream);
cudaError_t launch_dequantize(Scalar dtype, const DequantizeArgs& args, cudaStream_t stream);
// `n` uint8 values -> ceil(n / 8) * bits bytes, and back (`n` values from the packed bytes).
cudaError_t launch_pack_bits(const uint8_t* values, uint8_t* packed, int64_t n, int bits,
                             cudaStream_t stream);
cudaError_t launch_unpack_bits(const uint8_t* packed, uint8_t* values, int64_t n, int bits,
                               cudaStream_t stream);
// `n` int64 indices -> their float32 noise under `seed` (element-wise, same layout).
cudaError_t launch_hash_uniform(const int64_t* index, float* out, int64_t n, int64_t seed,
                                cudaStream_t stream);

}  // namespace actcore_native
