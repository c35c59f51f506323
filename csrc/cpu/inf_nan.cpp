// Inf/nan check over a host buffer, by bit pattern, on std::threads.
//
// Threads rather than OpenMP: a second OpenMP runtime next to the one torch bundles oversubscribes cores,
// and GNU libgomp is not fork-safe (DataLoader workers fork). A fresh thread costs tens of microseconds,
// which is why only buffers of a few MiB or more are split.
// TODO(cpu Adam): move the thread splitting into a shared csrc/cpu/ header (or a persistent pool) when the
// second multithreaded CPU kernel arrives.
#include "cpu/inf_nan.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace bmtwrap::cpu {
namespace {

// Bytes scanned between two looks at the shared `found` flag: large enough for the inner loop to run
// vectorised at memory speed, small enough for an early exit to skip most of a large buffer.
constexpr int64_t kBlockBytes = 64 * 1024;
// Each extra thread must have at least this much to read to pay for its start.
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

int choose_threads(int64_t nbytes, int num_threads) {
  const int64_t available =
      num_threads > 0 ? num_threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<int64_t>(nbytes / kMinBytesPerThread, 1, available));
}

template <typename Bits>
bool has_inf_nan_typed(const Bits* data, int64_t numel, Bits exponent_mask, int num_threads) {
  std::atomic<bool> found{false};
  const int threads = choose_threads(numel * static_cast<int64_t>(sizeof(Bits)), num_threads);
  if (threads == 1) {
    return range_has_inf_nan(data, numel, exponent_mask, found);
  }

  // One contiguous slice per thread. The calling thread takes every slice no worker could be started for,
  // so a failure to create threads costs speed, never the answer.
  const int64_t per_slice = (numel + threads - 1) / threads;
  auto scan_slice = [&](int slice) {
    const int64_t begin = slice * per_slice;
    const int64_t n = std::min(per_slice, numel - begin);
    if (n > 0 && range_has_inf_nan(data + begin, n, exponent_mask, found)) {
      found.store(true, std::memory_order_relaxed);
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  try {
    while (static_cast<int>(workers.size()) < threads - 1) {
      workers.emplace_back(scan_slice, static_cast<int>(workers.size()));
    }
  } catch (const std::system_error&) {
    // Out of threads: fall through with the workers we have.
  }
  for (int slice = static_cast<int>(workers.size()); slice < threads; ++slice) {
    scan_slice(slice);
  }
  for (std::thread& worker : workers) {
    worker.join();  // join() orders the workers' stores before the load below
  }
  return found.load(std::memory_order_relaxed);
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
