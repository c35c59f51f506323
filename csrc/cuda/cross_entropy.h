// Fused softmax + negative log-likelihood over the rows of a logits matrix. See [Note: tensors crossing into
// C++] in common.h. Plain C++ on purpose: bind.cpp includes this without the CUDA headers.
#pragma once

#include <cstdint>

#include "common.h"

namespace bmtwrap::cuda {

// Enqueues on `stream` the forward pass over `logits`, an (N, V) row-major matrix of `dtype` at device
// address `logits`, with int64 class indices `targets` (N of them). For each row n it writes
//   lse_out[n]  = logsumexp(logits[n, :])                                 (fp32, kept for the backward)
//   loss_out[n] = (1 - eps) * (lse - logits[n, t]) + eps * (lse - mean(logits[n, :]))     (fp32)
// with eps = label_smoothing and t = targets[n], as torch.nn.functional.cross_entropy(reduction="none",
// label_smoothing=eps) computes it in fp32. Rows with t == ignore_index read nothing and get loss 0 and
// lse 0. A row whose target is neither ignore_index nor in [0, V) gets loss nan (the kernel cannot raise);
// so does a row holding nan or +inf. All arithmetic is fp32. Throws std::invalid_argument on bad arguments
// and std::runtime_error with CUDA's error string if the launch fails.
void cross_entropy_forward_cuda(std::uintptr_t logits, DType dtype, std::uintptr_t targets, int64_t N, int64_t V,
                                int64_t ignore_index, double label_smoothing, std::uintptr_t loss_out,
                                std::uintptr_t lse_out, std::uintptr_t stream);

// Enqueues the backward pass: overwrites `logits_inout` (same layout and dtype as the forward's logits) with
//   grad[n, c] = (softmax(logits[n])[c] - (1 - eps) * [c == t] - eps / V) * grad_rows[n]
// computed in fp32 from the forward's `lse` (fp32, N) and the fp32 per-row upstream gradient `grad_rows`
// (N; e.g. 1 / count for a mean over rows), rounded to nearest even into `dtype`. Rows with
// t == ignore_index become 0; rows with a target out of [0, V) become nan.
void cross_entropy_backward_cuda(std::uintptr_t logits_inout, DType dtype, std::uintptr_t targets, int64_t N,
                                 int64_t V, int64_t ignore_index, double label_smoothing, std::uintptr_t lse,
                                 std::uintptr_t grad_rows, std::uintptr_t stream);

}  // namespace bmtwrap::cuda
