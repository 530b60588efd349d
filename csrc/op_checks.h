// Argument checks and shape helpers shared by the CPU ops (cpu_kernels.cpp) and the CUDA
// ops (ops.cpp): the same messages and the same row/column view as the Python reference.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

namespace actcore_checks {

inline void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK(bits >= 1 && bits <= 8, op, ": bits must be in 1..8, got ", bits);
}

inline void check_group_size(int64_t group_size, const char* op) {
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, op,
              ": group_size must be a positive multiple of 8, got ", group_size);
}

// quantization.rows_and_cols: rows = samples (dim 0) when per_sample, else one row.
inline std::pair<int64_t, int64_t> rows_and_cols(at::IntArrayRef shape, bool per_sample) {
  if (shape.empty()) return {1, 1};
  int64_t rest = 1;
  for (size_t i = 1; i < shape.size(); ++i) rest *= shape[i];
  if (per_sample) return {shape[0], rest};
  return {1, shape[0] * rest};
}

inline void check_2d(const at::Tensor& t, int64_t rows, int64_t cols, const char* op,
                     const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
              " has shape ", t.sizes(), ", expected [", rows, ", ", cols, "]");
}

inline uint16_t* bf16_ptr(at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.mutable_data_ptr());
}
inline const uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.const_data_ptr());
}

}  // namespace actcore_checks
