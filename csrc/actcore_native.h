// Interface between the CUDA kernels (kernels.cu) and their torch.library registration
// (ops.cpp). Plain C++ with raw pointers: kernels.cu includes no ATen header, which keeps
// its nvcc compile short; ops.cpp does all tensor work (checks, allocation, streams).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "op_args.h"

namespace actcore_native {

// Bumped whenever this interface or the registered ops change; loader.py checks it.
constexpr int kAbiVersion = 3;

enum class Scalar : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

using actcore_kernels::DequantizeArgs;
using actcore_kernels::MaskedDequantizeArgs;
using actcore_kernels::MaskView;
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

// The masked ops. `counts` (words + 1 int64): 0, then each mask word's set bits; its inclusive
// cumulative sum is the mask's offsets table.
cudaError_t launch_mask_counts(const uint8_t* mask, int64_t numel, int64_t* counts,
                               cudaStream_t stream);
// The set elements of the dense `x` (mask.numel elements), in order, into `values`.
cudaError_t launch_masked_gather(Scalar dtype, const void* x, const MaskView& mask, void* values,
                                 cudaStream_t stream);
// values[*count ...] up to the end of the last partial group (at most `numel`) repeat
// values[*count - 1]; the count is read on the device (nothing waits for it).
cudaError_t launch_pad_group_tail(Scalar dtype, void* values, const int64_t* count,
                                  int64_t numel, int64_t group_size, cudaStream_t stream);
cudaError_t launch_masked_dequantize(Scalar dtype, const MaskedDequantizeArgs& args,
                                     cudaStream_t stream);
// `numel` elements: x where the mask is set, +0 elsewhere.
cudaError_t launch_apply_mask(Scalar dtype, const void* x, void* out, const uint8_t* mask,
                              int64_t numel, cudaStream_t stream);

}  // namespace actcore_native
