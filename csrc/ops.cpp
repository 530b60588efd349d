// The CUDA implementations of the actcore::* ops (declared in Python by
// actcore/ops/library.py): argument checks, output allocation, a contiguous copy of
// strided inputs, and the kernel launches of kernels.cu on the current stream.
//
// Registration is explicit, not a static initializer: actcore.native.loader calls
// actcore_native_register() after the ops are defined, so a schema mismatch (a stale
// library against newer op declarations) comes back as an error message, not as an
// exception thrown while the library is being loaded (which would abort the process).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

#include "actcore_native.h"
#include "op_checks.h"
#include "op_registration.h"

namespace actcore_native {
namespace {

Scalar scalar_of(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kFloat:
      return Scalar::kFloat32;
    case at::kHalf:
      return Scalar::kFloat16;
    case at::kBFloat16:
      return Scalar::kBFloat16;
    case at::kDouble:
      return Scalar::kFloat64;
    default:
      break;
  }
  TORCH_CHECK(false, op, " takes float32, float16, bfloat16 or float64, got ", type);
  return Scalar::kFloat32;  // not reached
}

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
}

using actcore_checks::check_bits;
using actcore_checks::check_group_size;
using actcore_checks::check_hash_index;
using actcore_checks::check_mask;
using actcore_checks::check_pack_values;
using actcore_checks::check_packed_dtypes;
using actcore_checks::check_packed_shapes;
using actcore_checks::check_unpack_payload;
using actcore_checks::dequantize_args;
using actcore_checks::hash_buffers;
using actcore_checks::mask_offsets_buffer;
using actcore_checks::mask_view;
using actcore_checks::quantize_args;
using actcore_checks::quantize_outputs;
using actcore_checks::rows_and_cols;

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits,
                                                             int64_t group_size,
                                                             bool stochastic, int64_t seed,
                                                             bool per_sample) {
  constexpr const char* op = "actcore::quantize";
  check_cuda(x, op, "x");
  const Scalar dtype = scalar_of(x.scalar_type(), op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [rows, cols] = rows_and_cols(x.sizes(), per_sample);
  auto [payload, lo, step] = quantize_outputs(x, rows, cols, group_size, bits);
  if (rows * cols == 0) return {payload, lo, step};
  const at::Tensor xc = x.contiguous();  // strided inputs: one contiguous copy
  const QuantizeArgs args =
      quantize_args(xc, payload, lo, step, rows, cols, group_size, bits, stochastic, seed);
  C10_CUDA_CHECK(launch_quantize(dtype, args, c10::cuda::getCurrentCUDAStream(x.get_device())));
  return {payload, lo, step};
}

at::Tensor dequantize_cuda(const at::Tensor& payload, const at::Tensor& lo,
                           const at::Tensor& step, int64_t bits, int64_t group_size,
                           at::IntArrayRef shape, at::ScalarType dtype, bool per_sample) {
  constexpr const char* op = "actcore::dequantize";
  check_cuda(payload, op, "payload");
  check_cuda(lo, op, "lo");
  check_cuda(step, op, "step");
  TORCH_CHECK(lo.device() == payload.device() && step.device() == payload.device(), op,
              ": payload, lo and step must be on one device, got ", payload.device(), ", ",
              lo.device(), ", ", step.device());
  const Scalar out_dtype = scalar_of(dtype, op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  check_packed_dtypes(payload, lo, step, op);
  const c10::cuda::CUDAGuard guard(payload.device());
  at::Tensor out = at::empty(shape, payload.options().dtype(dtype));
  const auto [rows, cols] = rows_and_cols(shape, per_sample);
  if (rows * cols == 0) return out;
  check_packed_shapes(payload, lo, step, rows, cols, group_size, bits, op);
  const at::Tensor pc = payload.contiguous();
  const at::Tensor lc = lo.contiguous();
  const at::Tensor sc = step.contiguous();
  const DequantizeArgs args = dequantize_args(pc, lc, sc, out, rows, cols, group_size, bits);
  C10_CUDA_CHECK(
      launch_dequantize(out_dtype, args, c10::cuda::getCurrentCUDAStream(out.get_device())));
  return out;
}

at::Tensor pack_bits_cuda(const at::Tensor& values, int64_t bits) {
  constexpr const char* op = "actcore::pack_bits";
  check_cuda(values, op, "values");
  check_bits(bits, op);
  check_pack_values(values, op);
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t n = values.numel();
  at::Tensor packed = at::empty({(n + 7) / 8 * bits}, values.options());
  if (n == 0) return packed;
  const at::Tensor vc = values.contiguous();  // row-major order, as reshape(-1)
  C10_CUDA_CHECK(launch_pack_bits(vc.const_data_ptr<uint8_t>(), packed.mutable_data_ptr<uint8_t>(),
                                  n, static_cast<int>(bits),
                                  c10::cuda::getCurrentCUDAStream(values.get_device())));
  return packed;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, int64_t bits, int64_t numel) {
  constexpr const char* op = "actcore::unpack_bits";
  check_cuda(packed, op, "packed");
  check_bits(bits, op);
  check_unpack_payload(packed, bits, numel, op);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor values = at::empty({numel}, packed.options());
  if (numel == 0) return values;
  const at::Tensor pc = packed.contiguous();
  C10_CUDA_CHECK(launch_unpack_bits(pc.const_data_ptr<uint8_t>(), values.mutable_data_ptr<uint8_t>(),
                                    numel, static_cast<int>(bits),
                                    c10::cuda::getCurrentCUDAStream(packed.get_device())));
  return values;
}

at::Tensor hash_uniform_cuda(const at::Tensor& index, int64_t seed) {
  constexpr const char* op = "actcore::hash_uniform";
  check_cuda(index, op, "index");
  check_hash_index(index, op);
  const c10::cuda::CUDAGuard guard(index.device());
  if (index.numel() == 0) return at::empty(index.sizes(), index.options().dtype(at::kFloat));
  const auto [out, src] = hash_buffers(index, op);
  C10_CUDA_CHECK(launch_hash_uniform(src.const_data_ptr<int64_t>(), out.mutable_data_ptr<float>(),
                                     index.numel(), seed,
                                     c10::cuda::getCurrentCUDAStream(index.get_device())));
  return out;
}

// The offsets table of a contiguous mask over `numel` elements: per-word counts, then their
// cumulative sum (its last entry is the number of set elements).
at::Tensor mask_offsets(const at::Tensor& mc, int64_t numel, cudaStream_t stream) {
  at::Tensor counts = mask_offsets_buffer(mc, numel);
  C10_CUDA_CHECK(launch_mask_counts(mc.const_data_ptr<uint8_t>(), numel,
                                    counts.mutable_data_ptr<int64_t>(), stream));
  return at::cumsum(counts, 0);
}

// The arguments of masked_quantize(_padded) checked; x's dtype as the kernels name it.
Scalar check_masked_quantize(const at::Tensor& x, const at::Tensor& mask, int64_t bits,
                             int64_t group_size, const char* op) {
  check_cuda(x, op, "x");
  check_cuda(mask, op, "mask");
  TORCH_CHECK(mask.device() == x.device(), op, ": x and mask must be on one device, got ",
              x.device(), " and ", mask.device());
  const Scalar dtype = scalar_of(x.scalar_type(), op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  check_mask(mask, x.numel(), op);
  return dtype;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_quantize_cuda(const at::Tensor& x,
                                                                    const at::Tensor& mask,
                                                                    int64_t bits,
                                                                    int64_t group_size,
                                                                    bool stochastic,
                                                                    int64_t seed) {
  const Scalar dtype =
      check_masked_quantize(x, mask, bits, group_size, "actcore::masked_quantize");
  const int64_t numel = x.numel();
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  const at::Tensor mc = mask.contiguous();
  const at::Tensor offsets = mask_offsets(mc, numel, stream);
  // the outputs' sizes depend on the count: one read back (as torch's nonzero does)
  const int64_t count = offsets.select(0, offsets.size(0) - 1).item<int64_t>();
  auto [payload, lo, step] = quantize_outputs(x, 1, count, group_size, bits);
  if (count == 0) return {payload, lo, step};
  const at::Tensor xc = x.contiguous();
  at::Tensor values = at::empty({count}, x.options());
  C10_CUDA_CHECK(launch_masked_gather(dtype, xc.const_data_ptr(), mask_view(mc, offsets, numel),
                                      values.mutable_data_ptr(), stream));
  const QuantizeArgs args =
      quantize_args(values, payload, lo, step, 1, count, group_size, bits, stochastic, seed);
  C10_CUDA_CHECK(launch_quantize(dtype, args, stream));
  return {payload, lo, step};
}

// masked_quantize without the read back: the outputs are sized for every element of x (a
// capacity), the count of set elements comes back as a 0-d int64 tensor on the device, and
// the first values' codes are those masked_quantize makes. Nothing waits for the device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_quantize_padded_cuda(
    const at::Tensor& x, const at::Tensor& mask, int64_t bits, int64_t group_size,
    bool stochastic, int64_t seed) {
  const Scalar dtype =
      check_masked_quantize(x, mask, bits, group_size, "actcore::masked_quantize_padded");
  const int64_t numel = x.numel();
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  auto [payload, lo, step] = quantize_outputs(x, 1, numel, group_size, bits);
  if (numel == 0) return {payload, lo, step, at::empty({}, x.options().dtype(at::kLong)).zero_()};
  const at::Tensor mc = mask.contiguous();
  const at::Tensor offsets = mask_offsets(mc, numel, stream);
  // a copy, not a view of the table's last entry: an op's output may not alias a temporary
  // (opcheck on CUDA refused the view)
  at::Tensor count = offsets.select(0, offsets.size(0) - 1).clone();
  const at::Tensor xc = x.contiguous();
  at::Tensor values = at::empty({numel}, x.options());
  C10_CUDA_CHECK(launch_masked_gather(dtype, xc.const_data_ptr(), mask_view(mc, offsets, numel),
                                      values.mutable_data_ptr(), stream));
  C10_CUDA_CHECK(launch_pad_group_tail(dtype, values.mutable_data_ptr(),
                                       count.const_data_ptr<int64_t>(), numel, group_size,
                                       stream));
  const QuantizeArgs args =
      quantize_args(values, payload, lo, step, 1, numel, group_size, bits, stochastic, seed);
  C10_CUDA_CHECK(launch_quantize(dtype, args, stream));
  return {payload, lo, step, count};
}

at::Tensor masked_dequantize_cuda(const at::Tensor& payload, const at::Tensor& lo,
                                  const at::Tensor& step, const at::Tensor& mask, int64_t bits,
                                  int64_t group_size, at::IntArrayRef shape,
                                  at::ScalarType dtype) {
  constexpr const char* op = "actcore::masked_dequantize";
  check_cuda(payload, op, "payload");
  check_cuda(lo, op, "lo");
  check_cuda(step, op, "step");
  check_cuda(mask, op, "mask");
  TORCH_CHECK(lo.device() == payload.device() && step.device() == payload.device() &&
                  mask.device() == payload.device(),
              op, ": payload, lo, step and mask must be on one device");
  const Scalar out_dtype = scalar_of(dtype, op);
  check_bits(bits, op);
  check_group_size(group_size, op);
  check_packed_dtypes(payload, lo, step, op);
  const c10::cuda::CUDAGuard guard(payload.device());
  at::Tensor out = at::empty(shape, payload.options().dtype(dtype));
  const int64_t numel = out.numel();
  check_mask(mask, numel, op);
  if (numel == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.get_device());
  const at::Tensor mc = mask.contiguous();
  const at::Tensor offsets = mask_offsets(mc, numel, stream);
  const at::Tensor pc = payload.contiguous();
  const at::Tensor lc = lo.contiguous();
  const at::Tensor sc = step.contiguous();
  // (no read back: the kernel takes each value's rank from the offsets table; the packed
  // shapes were checked against the count when they were made)
  const MaskedDequantizeArgs args{dequantize_args(pc, lc, sc, out, 1, 0, group_size, bits),
                                  mask_view(mc, offsets, numel)};
  C10_CUDA_CHECK(launch_masked_dequantize(out_dtype, args, stream));
  return out;
}

at::Tensor apply_mask_cuda(const at::Tensor& x, const at::Tensor& mask) {
  constexpr const char* op = "actcore::apply_mask";
  check_cuda(x, op, "x");
  check_cuda(mask, op, "mask");
  TORCH_CHECK(mask.device() == x.device(), op, ": x and mask must be on one device, got ",
              x.device(), " and ", mask.device());
  const Scalar dtype = scalar_of(x.scalar_type(), op);
  const int64_t numel = x.numel();
  check_mask(mask, numel, op);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (numel == 0) return out;
  const at::Tensor xc = x.contiguous();
  const at::Tensor mc = mask.contiguous();
  C10_CUDA_CHECK(launch_apply_mask(dtype, xc.const_data_ptr(), out.mutable_data_ptr(),
                                   mc.const_data_ptr<uint8_t>(), numel,
                                   c10::cuda::getCurrentCUDAStream(x.get_device())));
  return out;
}

actcore_registration::Registration<quantize_cuda, dequantize_cuda, pack_bits_cuda,
                                   unpack_bits_cuda, hash_uniform_cuda, masked_quantize_cuda,
                                   masked_dequantize_cuda, apply_mask_cuda,
                                   masked_quantize_padded_cuda>
    registration{c10::DispatchKey::CUDA};

}  // namespace
}  // namespace actcore_native

extern "C" {

__attribute__((visibility("default"))) int actcore_native_abi_version() {
  return actcore_native::kAbiVersion;
}

// Registers the CUDA kernels of the actcore::* ops (once; later calls do nothing).
// Returns 0, or 1 with the reason in `message` (NUL-terminated, at most `size` bytes).
__attribute__((visibility("default"))) int actcore_native_register(char* message,
                                                                   size_t size) {
  return actcore_native::registration.ensure(message, size);
}

}  // extern "C"
