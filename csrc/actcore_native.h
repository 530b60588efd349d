// Interface between the CUDA kernels (kernels.cu) and their torch.library registration
// (ops.cpp). Plain C++ with raw pointers: kernels.cu includes no ATen header, which keeps
// its nvcc compile short; ops.cpp does all tensor work (checks, allocation, streams).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "op_args.h"

namespace actcore_native {

// Bumped whenever this interface or the registered ops change; loader.py checks it.
constexpr int kAbiVersion = 1;

enum class Scalar : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

using actcore_kernels::DequantizeArgs;
using actcore_kernels::QuantizeArgs;

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
