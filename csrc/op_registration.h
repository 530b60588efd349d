// Registration of one device's kernels for the nine actcore::* ops (and the CPU library's
// own further ones), shared by the CPU (cpu_kernels.cpp) and CUDA (ops.cpp) libraries: one
// torch::Library for the dispatch key, made once under a lock, undone if any impl fails;
// errors come back as a message for the loader's warning instead of an abort.
#pragma once

#include <c10/core/DispatchKey.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

namespace actcore_registration {

template <auto Quantize, auto Dequantize, auto PackBits, auto UnpackBits, auto HashUniform,
          auto MaskedQuantize, auto MaskedDequantize, auto ApplyMask, auto MaskedQuantizePadded>
class Registration {
 public:
  // `extra`: registers this device's kernels of further ops (the CPU library's own ones).
  explicit Registration(c10::DispatchKey key, void (*extra)(torch::Library&) = nullptr)
      : key_(key), extra_(extra) {}

  // Registers the kernels (later calls do nothing while they are). Returns 0, or 1 with the
  // reason in `message` (NUL-terminated, at most `size` bytes).
  int ensure(char* message, std::size_t size) noexcept {
    try {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!library_) {
        auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "actcore", key_,
                                                    __FILE__, __LINE__);
        lib->impl("quantize", TORCH_FN(Quantize));
        lib->impl("dequantize", TORCH_FN(Dequantize));
        lib->impl("pack_bits", TORCH_FN(PackBits));
        lib->impl("unpack_bits", TORCH_FN(UnpackBits));
        lib->impl("hash_uniform", TORCH_FN(HashUniform));
        lib->impl("masked_quantize", TORCH_FN(MaskedQuantize));
        lib->impl("masked_dequantize", TORCH_FN(MaskedDequantize));
        lib->impl("apply_mask", TORCH_FN(ApplyMask));
        lib->impl("masked_quantize_padded", TORCH_FN(MaskedQuantizePadded));
        if (extra_ != nullptr) extra_(*lib);
        library_ = std::move(lib);  // on an exception, `lib` undoes what it registered
      }
      return 0;
    } catch (const std::exception& e) {
      if (message != nullptr && size > 0) std::snprintf(message, size, "%s", e.what());
      return 1;
    }
  }

  // Removes the registration (the ops fall back to their other kernels).
  void reset() {
    const std::lock_guard<std::mutex> lock(mutex_);
    library_.reset();
  }

 private:
  c10::DispatchKey key_;
  void (*extra_)(torch::Library&);
  std::mutex mutex_;
  std::unique_ptr<torch::Library> library_;
};

}  // namespace actcore_registration
