// Argument checks, shape helpers and the kernels' argument structs filled from tensors,
// shared by the CPU ops (cpu_kernels.cpp) and the CUDA ops (ops.cpp): the same messages and
// the same row/column view as the Python reference.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <utility>

#include "op_args.h"

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

// quantize's outputs for a rows x cols view of `x`: payload (uint8), lo and step (bfloat16).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_outputs(const at::Tensor& x,
                                                                       int64_t rows, int64_t cols,
                                                                       int64_t group_size,
                                                                       int64_t bits) {
  const int64_t groups = (cols + group_size - 1) / group_size;
  return {at::empty({rows, (cols + 7) / 8 * bits}, x.options().dtype(at::kByte)),
          at::empty({rows, groups}, x.options().dtype(at::kBFloat16)),
          at::empty({rows, groups}, x.options().dtype(at::kBFloat16))};
}

// The kernel view of quantize (`xc` contiguous; the outputs from quantize_outputs).
inline actcore_kernels::QuantizeArgs quantize_args(const at::Tensor& xc, at::Tensor& payload,
                                                   at::Tensor& lo, at::Tensor& step, int64_t rows,
                                                   int64_t cols, int64_t group_size, int64_t bits,
                                                   bool stochastic, int64_t seed) {
  actcore_kernels::QuantizeArgs args{};
  args.x = xc.const_data_ptr();
  args.payload = payload.mutable_data_ptr<uint8_t>();
  args.lo = bf16_ptr(lo);
  args.step = bf16_ptr(step);
  args.rows = rows;
  args.cols = cols;
  args.group_size = group_size;
  args.bits = static_cast<int>(bits);
  args.stochastic = stochastic;
  args.seed = seed;
  return args;
}

// dequantize's inputs: dtypes, and (for a non-empty rows x cols view) their shapes.
inline void check_packed_dtypes(const at::Tensor& payload, const at::Tensor& lo,
                                const at::Tensor& step, const char* op) {
  TORCH_CHECK(payload.scalar_type() == at::kByte, op, ": payload must be uint8, got ",
              payload.scalar_type());
  TORCH_CHECK(lo.scalar_type() == at::kBFloat16 && step.scalar_type() == at::kBFloat16, op,
              ": lo and step must be bfloat16, got ", lo.scalar_type(), " and ",
              step.scalar_type());
}

inline void check_packed_shapes(const at::Tensor& payload, const at::Tensor& lo,
                                const at::Tensor& step, int64_t rows, int64_t cols,
                                int64_t group_size, int64_t bits, const char* op) {
  const int64_t groups = (cols + group_size - 1) / group_size;
  check_2d(payload, rows, (cols + 7) / 8 * bits, op, "payload");
  check_2d(lo, rows, groups, op, "lo");
  check_2d(step, rows, groups, op, "step");
}

// One row holding at least `count` values: masked_quantize's exact outputs or the larger
// ones of masked_quantize_padded (the values past `count` are never read).
inline void check_packed_capacity(const at::Tensor& payload, const at::Tensor& lo,
                                  const at::Tensor& step, int64_t count, int64_t group_size,
                                  int64_t bits, const char* op) {
  const int64_t groups = (count + group_size - 1) / group_size;
  const int64_t bytes = (count + 7) / 8 * bits;
  TORCH_CHECK(payload.dim() == 2 && payload.size(0) == 1 && payload.size(1) >= bytes, op,
              ": payload has shape ", payload.sizes(), ", expected [1, >= ", bytes, "]");
  TORCH_CHECK(lo.dim() == 2 && lo.size(0) == 1 && lo.size(1) >= groups, op, ": lo has shape ",
              lo.sizes(), ", expected [1, >= ", groups, "]");
  TORCH_CHECK(step.sizes() == lo.sizes(), op, ": step has shape ", step.sizes(),
              ", expected lo's ", lo.sizes());
}

// The kernel view of dequantize (`pc`, `lc`, `sc`: contiguous payload, lo, step).
inline actcore_kernels::DequantizeArgs dequantize_args(const at::Tensor& pc, const at::Tensor& lc,
                                                       const at::Tensor& sc, at::Tensor& out,
                                                       int64_t rows, int64_t cols,
                                                       int64_t group_size, int64_t bits) {
  actcore_kernels::DequantizeArgs args{};
  args.payload = pc.const_data_ptr<uint8_t>();
  args.lo = bf16_ptr(lc);
  args.step = bf16_ptr(sc);
  args.out = out.mutable_data_ptr();
  args.rows = rows;
  args.cols = cols;
  args.group_size = group_size;
  args.bits = static_cast<int>(bits);
  return args;
}

// The masked ops' packed 1-bit mask over `numel` elements: uint8, ceil(numel / 8) bytes or more.
inline void check_mask(const at::Tensor& mask, int64_t numel, const char* op) {
  TORCH_CHECK(mask.scalar_type() == at::kByte, op,
              ": mask must be a packed 1-bit mask (uint8, as pack_mask makes), got ",
              mask.scalar_type());
  TORCH_CHECK(mask.numel() >= (numel + 7) / 8, op, ": a mask over ", numel, " elements takes ",
              (numel + 7) / 8, " bytes, got ", mask.numel());
}

// An empty offsets table for a mask over `numel` elements (words + 1 int64 entries).
inline at::Tensor mask_offsets_buffer(const at::Tensor& mask, int64_t numel) {
  return at::empty({actcore_kernels::mask_words(numel) + 1}, mask.options().dtype(at::kLong));
}

// The kernel view of a contiguous mask `mc` and its filled offsets table.
inline actcore_kernels::MaskView mask_view(const at::Tensor& mc, const at::Tensor& offsets,
                                           int64_t numel) {
  actcore_kernels::MaskView view{};
  view.bits = mc.const_data_ptr<uint8_t>();
  view.offsets = offsets.const_data_ptr<int64_t>();
  view.numel = numel;
  view.words = actcore_kernels::mask_words(numel);
  return view;
}

// pack_bits' values and unpack_bits' payload: uint8, and a payload long enough for `numel`.
inline void check_pack_values(const at::Tensor& values, const char* op) {
  TORCH_CHECK(values.scalar_type() == at::kByte, op, " takes uint8 values, got ",
              values.scalar_type());
}

inline void check_unpack_payload(const at::Tensor& packed, int64_t bits, int64_t numel,
                                 const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, op, " takes a uint8 payload, got ",
              packed.scalar_type());
  TORCH_CHECK(packed.numel() % bits == 0, op, ": a payload of ", bits,
              "-bit values holds a multiple of ", bits, " bytes, got ", packed.numel());
  TORCH_CHECK(numel >= 0 && (numel + 7) / 8 <= packed.numel() / bits, op, ": a payload of ",
              packed.numel(), " bytes holds at most ", packed.numel() / bits * 8, " values of ",
              bits, " bits, asked for ", numel);
}

inline void check_hash_index(const at::Tensor& index, const char* op) {
  TORCH_CHECK(index.scalar_type() == at::kLong, op, " takes int64 indices, got ",
              index.scalar_type());
}

// hash_uniform's (output, input in the output's layout) for a non-empty `index`: the output
// has empty_like's layout (what the fake kernel promises); a non-dense input is first copied
// into that layout, so input and output walk the same memory order.
inline std::pair<at::Tensor, at::Tensor> hash_buffers(const at::Tensor& index, const char* op) {
  at::Tensor out = at::empty_like(index, index.options().dtype(at::kFloat));
  at::Tensor src = index;
  if (src.strides() != out.strides()) {
    src = at::empty_like(index);
    src.copy_(index);
  }
  TORCH_CHECK(src.strides() == out.strides() && out.is_non_overlapping_and_dense(), op,
              ": internal error, layouts of index ", src.strides(), " and output ",
              out.strides(), " differ");
  return {out, src};
}

}  // namespace actcore_checks
