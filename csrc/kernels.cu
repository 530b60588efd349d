// CUDA kernels of actcore's bit packing, noise and masked ops, bit-exact with the
// pure-PyTorch reference (packages/actcore/src/actcore/ops/{bitpack,noise,masked}.py);
// quantize and dequantize are in quantize_kernels.cu, the shared helpers in
// kernel_common.cuh.

#include "kernel_common.cuh"

namespace actcore_native {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace): this unit's own helpers

// ---------------------------------------------------------------- bit packing
__global__ void __launch_bounds__(kThreads)
    pack_bits_kernel(const uint8_t* __restrict__ values, uint8_t* __restrict__ packed,
                     const int64_t n, const int bits, const bool vec) {
  const int64_t blocks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    const int valid = static_cast<int>(imin(8, n - 8 * b));
    uint64_t w = 0;  // value t in byte t, zero padding past n
    if (vec && valid == 8) {
      w = *reinterpret_cast<const uint64_t*>(values + 8 * b);
    } else {
      for (int t = 0; t < valid; ++t) w |= static_cast<uint64_t>(values[8 * b + t]) << (8 * t);
    }
    uint8_t* o = packed + b * bits;
    for (int j = 0; j < bits; ++j) o[j] = gather_plane(w, j);  // bits >= `bits` are dropped
  }
}

__global__ void __launch_bounds__(kThreads)
    unpack_bits_kernel(const uint8_t* __restrict__ packed, uint8_t* __restrict__ values,
                       const int64_t n, const int bits, const bool vec) {
  const int64_t blocks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    const uint8_t* in = packed + b * bits;
    uint64_t w = 0;
    for (int j = 0; j < bits; ++j) w |= scatter_plane(in[j]) << j;
    const int valid = static_cast<int>(imin(8, n - 8 * b));
    if (vec && valid == 8) {
      *reinterpret_cast<uint64_t*>(values + 8 * b) = w;
    } else {
      for (int t = 0; t < valid; ++t) values[8 * b + t] = static_cast<uint8_t>(w >> (8 * t));
    }
  }
}

// ---------------------------------------------------------------- hash_uniform
__global__ void __launch_bounds__(kThreads)
    hash_uniform_kernel(const int64_t* __restrict__ index, float* __restrict__ out,
                        const int64_t n, const int64_t seed) {
  NoiseStream noise(seed);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = uniform_f32(noise.hash(index[i]));
  }
}

// ---------------------------------------------------------------- masked ops
// Set bits of each mask word (counts[w + 1]; counts[0] = 0).
__global__ void __launch_bounds__(kThreads)
    mask_counts_kernel(const uint8_t* __restrict__ mask, const int64_t numel,
                       int64_t* __restrict__ counts) {
  const int64_t words = actcore_kernels::mask_words(numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) counts[0] = 0;
  for (int64_t w = first; w < words; w += stride) {
    counts[w + 1] = __popcll(actcore_kernels::mask_word(mask, numel, w));
  }
}

// One thread per mask word: its set elements to values[offsets[w]...], in order.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    masked_gather_kernel(const scalar_t* __restrict__ x, const MaskView m,
                         scalar_t* __restrict__ values) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < m.words;
       w += stride) {
    int64_t r = m.offsets[w];
    for (uint64_t bits = actcore_kernels::mask_word(m.bits, m.numel, w); bits != 0;
         bits &= bits - 1) {
      values[r++] = x[w * 64 + __ffsll(static_cast<long long>(bits)) - 1];
    }
  }
}

// After a gather of `*count` values into a buffer of a larger capacity `numel`: the rest of
// the last partial group repeats the last value, so that group's range, and so every code of
// its real values, is what quantizing the `*count` values alone gives. (Later groups hold
// whatever the buffer held; nothing reads their codes.)
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    pad_group_tail_kernel(scalar_t* __restrict__ values, const int64_t* __restrict__ count,
                          const int64_t numel, const int64_t group_size) {
  const int64_t c = *count;
  if (c == 0) return;
  const int64_t end = min((c + group_size - 1) / group_size * group_size, numel);
  const scalar_t last = values[c - 1];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = c + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += stride) {
    values[i] = last;
  }
}

// One thread per output element: +0 where the mask is clear, else the value of its rank
// among the set elements, computed as dequantize_kernel computes it.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) masked_dequantize_kernel(const MaskedDequantizeArgs a) {
  using acc_t = typename Compute<scalar_t>::type;
  scalar_t* __restrict__ out = static_cast<scalar_t*>(a.d.out);
  const MaskView& m = a.mask;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m.numel;
       i += stride) {
    const int64_t w = i / 64;
    const int j = static_cast<int>(i % 64);
    const uint64_t word = actcore_kernels::mask_word(m.bits, m.numel, w);
    if (((word >> j) & 1) == 0) {
      out[i] = static_cast<scalar_t>(acc_t(0));
      continue;
    }
    const int64_t k = m.offsets[w] + __popcll(word & ((uint64_t{1} << j) - 1));
    const int64_t g = k / a.d.group_size;
    const uint8_t* in = a.d.payload + (k / 8) * a.d.bits;
    const int t = static_cast<int>(k % 8);
    uint32_t code = 0;
    for (int b = 0; b < a.d.bits; ++b) code |= static_cast<uint32_t>((in[b] >> t) & 1) << b;
    acc_t lo;
    acc_t step;
    from_bf16(a.d.lo[g], lo);
    from_bf16(a.d.step[g], step);
    const bool finite = isfinite(lo) && isfinite(step);
    const acc_t lo_q = finite ? mul_rn(lo, acc_t(0.25)) : acc_t(NAN);
    const acc_t step_q = mul_rn(step, acc_t(0.25));
    const acc_t top = OutputMax<scalar_t>::value;
    acc_t value = mul_rn(add_rn(mul_rn(static_cast<acc_t>(code), step_q), lo_q), acc_t(4));
    value = value < -top ? -top : (value > top ? top : value);  // NaN stays
    out[i] = static_cast<scalar_t>(value);
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    apply_mask_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out,
                      const uint8_t* __restrict__ mask, const int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const bool keep = (mask[i / 8] >> (i % 8)) & 1;
    out[i] = keep ? x[i] : static_cast<scalar_t>(0.0f);
  }
}

}  // namespace

cudaError_t launch_pack_bits(const uint8_t* values, uint8_t* packed, int64_t n, int bits,
                             cudaStream_t stream) {
  const bool vec = reinterpret_cast<uintptr_t>(values) % 8 == 0;
  pack_bits_kernel<<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(values, packed, n, bits, vec);
  return cudaGetLastError();
}

cudaError_t launch_unpack_bits(const uint8_t* packed, uint8_t* values, int64_t n, int bits,
                               cudaStream_t stream) {
  const bool vec = reinterpret_cast<uintptr_t>(values) % 8 == 0;
  unpack_bits_kernel<<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(packed, values, n, bits,
                                                                      vec);
  return cudaGetLastError();
}

cudaError_t launch_mask_counts(const uint8_t* mask, int64_t numel, int64_t* counts,
                               cudaStream_t stream) {
  const int64_t words = actcore_kernels::mask_words(numel);
  mask_counts_kernel<<<grid_for(words), kThreads, 0, stream>>>(mask, numel, counts);
  return cudaGetLastError();
}

namespace {

template <typename scalar_t>
cudaError_t masked_gather_typed(const void* x, const MaskView& m, void* values,
                                cudaStream_t stream) {
  masked_gather_kernel<scalar_t><<<grid_for(m.words), kThreads, 0, stream>>>(
      static_cast<const scalar_t*>(x), m, static_cast<scalar_t*>(values));
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t pad_group_tail_typed(void* values, const int64_t* count, int64_t numel,
                                 int64_t group_size, cudaStream_t stream) {
  pad_group_tail_kernel<scalar_t><<<grid_for(group_size), kThreads, 0, stream>>>(
      static_cast<scalar_t*>(values), count, numel, group_size);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t masked_dequantize_typed(const MaskedDequantizeArgs& a, cudaStream_t stream) {
  masked_dequantize_kernel<scalar_t><<<grid_for(a.mask.numel), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t apply_mask_typed(const void* x, void* out, const uint8_t* mask, int64_t numel,
                             cudaStream_t stream) {
  apply_mask_kernel<scalar_t><<<grid_for(numel), kThreads, 0, stream>>>(
      static_cast<const scalar_t*>(x), static_cast<scalar_t*>(out), mask, numel);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_masked_gather(Scalar dtype, const void* x, const MaskView& mask, void* values,
                                 cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return masked_gather_typed<float>(x, mask, values, stream);
    case Scalar::kFloat16:
      return masked_gather_typed<c10::Half>(x, mask, values, stream);
    case Scalar::kBFloat16:
      return masked_gather_typed<c10::BFloat16>(x, mask, values, stream);
    case Scalar::kFloat64:
      return masked_gather_typed<double>(x, mask, values, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_pad_group_tail(Scalar dtype, void* values, const int64_t* count,
                                  int64_t numel, int64_t group_size, cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return pad_group_tail_typed<float>(values, count, numel, group_size, stream);
    case Scalar::kFloat16:
      return pad_group_tail_typed<c10::Half>(values, count, numel, group_size, stream);
    case Scalar::kBFloat16:
      return pad_group_tail_typed<c10::BFloat16>(values, count, numel, group_size, stream);
    case Scalar::kFloat64:
      return pad_group_tail_typed<double>(values, count, numel, group_size, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_masked_dequantize(Scalar dtype, const MaskedDequantizeArgs& args,
                                     cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return masked_dequantize_typed<float>(args, stream);
    case Scalar::kFloat16:
      return masked_dequantize_typed<c10::Half>(args, stream);
    case Scalar::kBFloat16:
      return masked_dequantize_typed<c10::BFloat16>(args, stream);
    case Scalar::kFloat64:
      return masked_dequantize_typed<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_apply_mask(Scalar dtype, const void* x, void* out, const uint8_t* mask,
                              int64_t numel, cudaStream_t stream) {
  switch (dtype) {
    case Scalar::kFloat32:
      return apply_mask_typed<float>(x, out, mask, numel, stream);
    case Scalar::kFloat16:
      return apply_mask_typed<c10::Half>(x, out, mask, numel, stream);
    case Scalar::kBFloat16:
      return apply_mask_typed<c10::BFloat16>(x, out, mask, numel, stream);
    case Scalar::kFloat64:
      return apply_mask_typed<double>(x, out, mask, numel, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_hash_uniform(const int64_t* index, float* out, int64_t n, int64_t seed,
                                cudaStream_t stream) {
  hash_uniform_kernel<<<grid_for(n), kThreads, 0, stream>>>(index, out, n, seed);
  return cudaGetLastError();
}

}  // namespace actcore_native
