// Inf/nan check over a host buffer. See [Note: tensors crossing into C++] in common.h.
#pragma once

#include <cstdint>

#include "common.h"

namespace bmtwrap::cpu {

// True if any of the `numel` elements of type `dtype` at `ptr` is +inf, -inf or nan.
// Large buffers are split over up to `num_threads` threads (0: one per hardware thread); every thread
// stops as soon as one of them has found an element, so the answer can come before the whole buffer is read.
bool has_inf_nan(std::uintptr_t ptr, int64_t numel, DType dtype, int num_threads);

}  // namespace bmtwrap::cpu
