// Inf/nan check over a host buffer, by bit pattern, on the shared worker pool (cpu/parallel.h says why a
// pool rather than OpenMP). Waking a worker costs microseconds, so buffers of a MiB or more are split.
#include "cpu/inf_nan.h"

#include <algorithm>
#include <atomic>

#include "cpu/parallel.h"

namespace bmtwrap::cpu {
namespace {

// Bytes scanned between two looks at the shared `found` flag: large enough for the inner loop to run
// vectorised at memory speed, small enough for an early exit to skip most of a large buffer.
constexpr int64_t kBlockBytes = 64 * 1024;
// Each extra thread must have at least this much to read to pay for waking it.
constexpr int64_t kMinBytesPerThread = 1024 * 1024;

// Branch-free, so the compiler vectorises it with the baseline instruction set (SSE2: pand, pcmpeq, por).
template <typename Bits>
bool block_has_inf_nan(const Bits* data, int64_t n, Bits exponent_mask) {
  Bits any = 0;
  for (int64_t i = 0; i < n; ++i) {
    any |= static_cast<Bits>((data[i] & exponent_mask) == exponent_mask);
  }
  return any != 0;
}

template <typename Bits>
bool range_has_inf_nan(const Bits* data, int64_t n, Bits exponent_mask, const std::atomic<bool>& found) {
  constexpr int64_t kBlock = kBlockBytes / static_cast<int64_t>(sizeof(Bits));
  for (int64_t start = 0; start < n; start += kBlock) {
    if (found.load(std::memory_order_relaxed)) {
      return false;  // another thread has the answer already
    }
    if (block_has_inf_nan(data + start, std::min(kBlock, n - start), exponent_mask)) {
      return true;
    }
  }
  return false;
}

template <typename Bits>
bool has_inf_nan_typed(const Bits* data, int64_t numel, Bits exponent_mask, int num_threads) {
  std::atomic<bool> found{false};
  const int64_t nbytes = numel * static_cast<int64_t>(sizeof(Bits));
  const int threads = threads_for(nbytes, kMinBytesPerThread, num_threads);
  // One contiguous slice per thread.
  const int64_t per_slice = (numel + threads - 1) / threads;
  parallel_for(threads, threads, [&](int slice) {
    const int64_t begin = slice * per_slice;
    const int64_t n = std::min(per_slice, numel - begin);
    if (n > 0 && range_has_inf_nan(data + begin, n, exponent_mask, found)) {
      found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load(std::memory_order_relaxed);  // parallel_for's return orders the tasks' stores before this
}

}  // namespace

bool has_inf_nan(std::uintptr_t ptr, int64_t numel, DType dtype, int num_threads) {
  check_buffer("has_inf_nan", ptr, numel);
  return dispatch_dtype(dtype, [&](auto traits) {
    using Traits = decltype(traits);
    using Bits = typename Traits::Bits;
    return has_inf_nan_typed(reinterpret_cast<const Bits*>(ptr), numel, Traits::kExponentMask, num_threads);
  });
}

}  // namespace bmtwrap::cpu
