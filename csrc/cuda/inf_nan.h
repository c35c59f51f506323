// Inf/nan check over a device buffer. See [Note: tensors crossing into C++] in common.h.
// Plain C++ on purpose: bind.cpp includes this without the CUDA headers.
#pragma once

#include <cstdint>

#include "common.h"

namespace bmtwrap::cuda {

// Enqueues on `stream` (a cudaStream_t as an integer) a check of the `numel` elements of type `dtype` at
// device address `ptr`, which writes 1 to the uint8 at device address `flag_ptr` if any of them is +inf,
// -inf or nan. It never writes 0: the caller zeroes the flag once and may then accumulate over many
// buffers without synchronising the host. Launches on the current device, which must own `ptr`, `flag_ptr`
// and `stream`. Throws std::runtime_error with the CUDA error string if the launch fails.
void has_inf_nan_cuda(std::uintptr_t ptr, int64_t numel, DType dtype, std::uintptr_t flag_ptr,
                      std::uintptr_t stream);

}  // namespace bmtwrap::cuda
