// A scaled, cast copy of a device buffer. See [Note: tensors crossing into C++] in common.h. Plain C++ on
// purpose: bind.cpp includes this without the CUDA headers.
#pragma once

#include <cstdint>

#include "common.h"

namespace bmtwrap::cuda {

// Enqueues on `stream` out[i] = (float(in[i]) * scale) rounded to nearest even into `out_dtype`, for the `numel`
// elements at device addresses `in` (of `in_dtype`) and `out`; `scale` is the fp32 at device address `scale_ptr`,
// read by the kernel, so a scale that is still being computed costs the host no wait. `in` and `out` may be the
// same buffer (same dtype), but may not otherwise overlap. Launches on the current device. Throws
// std::invalid_argument on bad arguments and std::runtime_error with CUDA's error string if the launch fails.
void scaled_copy_cuda(std::uintptr_t in, DType in_dtype, std::uintptr_t out, DType out_dtype, int64_t numel,
                      std::uintptr_t scale_ptr, std::uintptr_t stream);

}  // namespace bmtwrap::cuda
