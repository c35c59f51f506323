// Fused softmax + NLL over the rows of an (N, V) logits matrix: kernels first, launchers after.
//
// [Note: cross-entropy kernel layout]
// A group of kGroup threads owns one row at a time (grid-stride over rows): a warp (kGroup = 32, eight rows
// per 256-thread block) when rows are short, the whole 512-thread block when they are long. Rows start
// wherever row * V elements puts them, so each row is read as
//   head:    the elements before its first 16-byte boundary,
//   body:    whole 16-byte packs, kUnroll of them loaded per thread before the first is used (3 forward, 2
//            backward: see kForwardUnroll),
//   tail:    the fewer than 16 / sizeof(T) elements after the last whole pack;
// head + tail is under 2 * 16 / sizeof(T) <= 16 elements, one each for the group's first threads.
// Forward: one pass. Each thread keeps a running (max, sum of exp(x - max), sum of x) over its elements
// (the online softmax: the sum is rescaled whenever the max grows); the group merges the threads' triples
// with shuffles (and shared memory across warps); its rank 0 writes loss and lse.
// Backward: a second pass reads each element once more and overwrites it with its gradient.
//
// [Note: exp through exp2]
// exp(x - m) is computed as exp2f((x - m) * log2 e): the hardware's ex2 after one subtraction and one
// product. The subtraction comes first so that the largest terms, x near m, keep their accuracy (x - m is
// exact there), and so that a term whose max does not change is rescaled by exactly exp2(0) = 1 at every
// merge. (The fma(x, log2 e, -m * log2 e) of flash attention saves an instruction but rescales by
// exp2(rounding residual of m * log2 e) instead: about 1e-6 relative for |m| ~ 30, compounded over the ten
// merges of a 512-thread group into a 1e-5 error in lse.) A reference value of 0 replaces m while every value
// seen is -inf, so that -inf logits (masked classes) contribute 0 and a nan anywhere reaches the sum (fmaxf
// alone would drop it).
#include "cuda/cross_entropy.h"

#include <cmath>
#include <limits>

#include "cuda/kernel_utils.h"

namespace bmtwrap::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
// Packs in flight per thread, with at least 1024 resident threads per SM (so at most 64 registers each; ptxas
// fits every instantiation without spilling on sm_90). The forward only reads: three packs, 48 KB of loads in
// flight per SM (four spill bf16's registers). With two (32 KB) it read 3.4 TB/s on an H200 where a row sum
// reads 4.4: HBM3e's latency under load asks for more than 32 KB per SM by Little's law (4.8 TB/s x ~1.5 us /
// 132 SMs). The backward reads and writes each pack, and with two it ran at 4.0 TB/s, 92 % of a copy's pace on
// the same card.
constexpr int kForwardUnroll = 3;
constexpr int kBackwardUnroll = 2;
constexpr int kMinThreadsPerSM = 1024;
constexpr int kWarp = 32;
constexpr int64_t kShortRow = 2048;  // rows up to this many elements take one warp, longer ones a block
constexpr int kShortRowBlock = 256;
constexpr int kLongRowBlock = 512;
constexpr const char* kForwardOp = "cross_entropy_forward_cuda";
constexpr const char* kBackwardOp = "cross_entropy_backward_cuda";

// Running statistics of part of a row: max, the sum of exp(x - reference_point(max)), and the sum of x.
struct RowStats {
  float max;
  float sum;
  float sum_x;
};

BMT_HOST_DEVICE inline RowStats empty_stats() { return {-INFINITY, 0.0f, 0.0f}; }

// See [Note: exp through exp2]: the point that exponents are taken from, for a running max.
BMT_HOST_DEVICE inline float reference_point(float max) { return max == -INFINITY ? 0.0f : max; }

// exp(x - ref).
BMT_HOST_DEVICE inline float exp_shifted(float x, float ref) { return exp2f((x - ref) * kLog2e); }

template <int K>
BMT_HOST_DEVICE inline void add_values(RowStats& s, const float (&x)[K]) {
  float chunk_max = x[0];
  float chunk_sum_x = x[0];
#pragma unroll
  for (int k = 1; k < K; ++k) {
    chunk_max = fmaxf(chunk_max, x[k]);
    chunk_sum_x += x[k];
  }
  const float new_max = fmaxf(s.max, chunk_max);
  const float ref = reference_point(new_max);
  float sum = s.sum * exp_shifted(s.max, ref);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    sum += exp_shifted(x[k], ref);
  }
  s = {new_max, sum, s.sum_x + chunk_sum_x};
}

BMT_HOST_DEVICE inline RowStats merge(const RowStats& a, const RowStats& b) {
  const float max = fmaxf(a.max, b.max);
  const float ref = reference_point(max);
  return {max, a.sum * exp_shifted(a.max, ref) + b.sum * exp_shifted(b.max, ref), a.sum_x + b.sum_x};
}

// The head/body/tail split of one row (see [Note: cross-entropy kernel layout]).
template <typename T>
struct RowSplit {
  static constexpr int kPer = static_cast<int>(kVectorBytes / sizeof(T));
  int64_t head;
  int64_t n_packs;
  int64_t tail_begin;
  int64_t n_scalars;

  BMT_HOST_DEVICE RowSplit(const T* row, int64_t V) {
    head = elements_to_alignment(reinterpret_cast<std::uintptr_t>(row), sizeof(T));
    head = head < V ? head : V;
    n_packs = (V - head) / kPer;
    tail_begin = head + n_packs * kPer;
    n_scalars = head + (V - tail_begin);
  }
  // Element index of scalar j in [0, n_scalars).
  BMT_HOST_DEVICE int64_t scalar_index(int64_t j) const { return j < head ? j : tail_begin + (j - head); }
};

// The statistics of the elements of `row` that thread `rank` of a kGroup-thread group reads.
template <typename T, int kGroup, int kUnroll = kForwardUnroll>
BMT_HOST_DEVICE RowStats row_stats_part(const T* row, int64_t V, int rank) {
  using Split = RowSplit<T>;
  constexpr int kPer = Split::kPer;
  static_assert(kGroup >= 2 * kPer, "head and tail take one element per thread");
  const Split split(row, V);
  const T* packed = row + split.head;
  RowStats s = empty_stats();
  for (int64_t base = rank; base < split.n_packs; base += kUnroll * kGroup) {
    Pack<T, kPer> packs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kGroup < split.n_packs) {
        packs[u] = load_pack<T, kPer>(packed + (base + u * kGroup) * kPer);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kGroup < split.n_packs) {
        float x[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          x[k] = to_float(packs[u].v[k]);
        }
        add_values(s, x);
      }
    }
  }
  if (rank < split.n_scalars) {
    const float x[1] = {to_float(row[split.scalar_index(rank)])};
    add_values(s, x);
  }
  return s;
}

struct RowResult {
  float loss;
  float lse;
};

// Loss and logsumexp of `row` from its merged statistics (a target out of [0, V) gives loss nan).
template <typename T>
BMT_HOST_DEVICE inline RowResult row_result(const RowStats& s, const T* row, int64_t target, int64_t V,
                                            float smoothing) {
  const float lse = s.max + logf(s.sum);
  const float target_logit = target >= 0 && target < V ? to_float(row[target]) : NAN;
  const float nll = lse - target_logit;
  if (smoothing == 0.0f) {
    return {nll, lse};
  }
  const float smooth = lse - s.sum_x / static_cast<float>(V);  // mean over classes of -log p
  return {(1.0f - smoothing) * nll + smoothing * smooth, lse};
}

// Per-row constants of the backward.
struct RowGrad {
  int64_t target;    // in [0, V) when valid
  bool valid;        // false: the target is out of range, the row becomes nan
  float lse;         // from the forward
  float on_target;   // 1 - eps
  float off_target;  // eps / V
  float grad_row;
};

BMT_HOST_DEVICE inline RowGrad make_row_grad(int64_t target, int64_t V, float smoothing, float lse, float grad_row) {
  RowGrad r;
  r.target = target;
  r.valid = target >= 0 && target < V;
  r.lse = lse;
  r.on_target = 1.0f - smoothing;
  r.off_target = smoothing / static_cast<float>(V);
  r.grad_row = grad_row;
  return r;
}

BMT_HOST_DEVICE inline float grad_value(float x, int64_t index, const RowGrad& r) {
  float d = exp_shifted(x, r.lse) - r.off_target;
  if (index == r.target) {
    d -= r.on_target;
  }
  return r.valid ? d * r.grad_row : NAN;
}

// Overwrites the elements of `row` that thread `rank` owns with their gradient.
template <typename T, int kGroup, int kUnroll = kBackwardUnroll>
BMT_HOST_DEVICE void row_grad_part(T* row, int64_t V, int rank, const RowGrad& r) {
  using Split = RowSplit<T>;
  constexpr int kPer = Split::kPer;
  static_assert(kGroup >= 2 * kPer, "head and tail take one element per thread");
  const Split split(row, V);
  T* packed = row + split.head;
  for (int64_t base = rank; base < split.n_packs; base += kUnroll * kGroup) {
    Pack<T, kPer> packs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kGroup < split.n_packs) {
        packs[u] = load_pack<T, kPer>(packed + (base + u * kGroup) * kPer);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t pack = base + u * kGroup;
      if (pack < split.n_packs) {
        const int64_t first = split.head + pack * kPer;
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          packs[u].v[k] = from_float<T>(grad_value(to_float(packs[u].v[k]), first + k, r));
        }
        store_pack(packed + pack * kPer, packs[u]);
      }
    }
  }
  if (rank < split.n_scalars) {
    const int64_t i = split.scalar_index(rank);
    row[i] = from_float<T>(grad_value(to_float(row[i]), i, r));
  }
}

// Overwrites the elements of `row` that thread `rank` owns with 0 (an ignored row), reading nothing.
template <typename T, int kGroup>
BMT_HOST_DEVICE void row_zero_part(T* row, int64_t V, int rank) {
  const RowSplit<T> split(row, V);
  uint4* packed = reinterpret_cast<uint4*>(row + split.head);
  for (int64_t pack = rank; pack < split.n_packs; pack += kGroup) {
    packed[pack] = make_uint4(0u, 0u, 0u, 0u);  // all-zero bits are +0 in every float format
  }
  if (rank < split.n_scalars) {
    row[split.scalar_index(rank)] = from_float<T>(0.0f);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Kernels

__device__ inline RowStats warp_merge(RowStats s) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const RowStats other{__shfl_xor_sync(0xffffffffu, s.max, offset), __shfl_xor_sync(0xffffffffu, s.sum, offset),
                         __shfl_xor_sync(0xffffffffu, s.sum_x, offset)};
    s = merge(s, other);
  }
  return s;
}

// Merges the statistics of a kGroup-thread group; the result is valid in the group's rank 0. A group wider
// than a warp is the whole block, and every thread of the block must call this.
template <int kGroup>
__device__ inline RowStats group_merge(RowStats s) {
  s = warp_merge(s);
  if constexpr (kGroup > kWarp) {
    constexpr int kWarps = kGroup / kWarp;
    __shared__ RowStats partial[kWarps];
    const int warp = static_cast<int>(threadIdx.x) / kWarp;
    const int lane = static_cast<int>(threadIdx.x) % kWarp;
    if (lane == 0) {
      partial[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
      s = warp_merge(lane < kWarps ? partial[lane] : empty_stats());
    }
    __syncthreads();  // the next row writes `partial` again
  }
  return s;
}

// Which rows a thread's group owns: first, first + stride, ... below N. With kGroup == kBlock every thread of
// a block visits the same rows, so the loop body may synchronise the block.
template <int kGroup, int kBlock>
struct RowLoop {
  static_assert(kBlock % kGroup == 0 && (kGroup == kWarp || kGroup == kBlock), "a group is a warp or the block");
  static constexpr int kGroupsPerBlock = kBlock / kGroup;
  int rank;
  int64_t first;
  int64_t stride;

  __device__ RowLoop()
      : rank(static_cast<int>(threadIdx.x) % kGroup),
        first(static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + threadIdx.x / kGroup),
        stride(static_cast<int64_t>(gridDim.x) * kGroupsPerBlock) {}
};

template <typename T, int kGroup, int kBlock>
__global__ void __launch_bounds__(kBlock, kMinThreadsPerSM / kBlock)
    cross_entropy_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t N,
                                 int64_t V, int64_t ignore_index, float smoothing, float* __restrict__ loss_out,
                                 float* __restrict__ lse_out) {
  const RowLoop<kGroup, kBlock> rows;
  for (int64_t row = rows.first; row < N; row += rows.stride) {
    const int64_t target = targets[row];
    if (target == ignore_index) {  // the same for the whole group: no thread reaches group_merge
      if (rows.rank == 0) {
        loss_out[row] = 0.0f;
        lse_out[row] = 0.0f;
      }
      continue;
    }
    const T* x = logits + row * V;
    const RowStats s = group_merge<kGroup>(row_stats_part<T, kGroup>(x, V, rows.rank));
    if (rows.rank == 0) {
      const RowResult result = row_result(s, x, target, V, smoothing);
      loss_out[row] = result.loss;
      lse_out[row] = result.lse;
    }
  }
}

template <typename T, int kGroup, int kBlock>
__global__ void __launch_bounds__(kBlock, kMinThreadsPerSM / kBlock)
    cross_entropy_backward_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t N, int64_t V,
                                  int64_t ignore_index, float smoothing, const float* __restrict__ lse,
                                  const float* __restrict__ grad_rows) {
  const RowLoop<kGroup, kBlock> rows;
  for (int64_t row = rows.first; row < N; row += rows.stride) {
    T* x = logits + row * V;
    const int64_t target = targets[row];
    if (target == ignore_index) {
      row_zero_part<T, kGroup>(x, V, rows.rank);
      continue;
    }
    const RowGrad r = make_row_grad(target, V, smoothing, lse[row], grad_rows[row]);
    row_grad_part<T, kGroup>(x, V, rows.rank, r);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launchers

struct RowsShape {
  int64_t N;
  int64_t V;
};

void check_rows(const char* op, std::uintptr_t logits, std::uintptr_t targets, RowsShape shape, double smoothing) {
  const std::string prefix = std::string("bmtwrap._C.") + op + ": ";
  if (shape.N < 0 || shape.V < 1) {
    throw std::invalid_argument(prefix + "expected N >= 0 rows of V >= 1 classes, got N=" + std::to_string(shape.N) +
                                ", V=" + std::to_string(shape.V));
  }
  if (shape.N > std::numeric_limits<int64_t>::max() / shape.V) {
    throw std::invalid_argument(prefix + "N * V overflows int64");
  }
  if (!(smoothing >= 0.0 && smoothing <= 1.0)) {
    throw std::invalid_argument(prefix + "label_smoothing must be in [0, 1], got " + std::to_string(smoothing));
  }
  check_buffer(op, logits, shape.N * shape.V);
  check_buffer(op, targets, shape.N);
  check_aligned(op, "targets", targets, sizeof(int64_t));
}

void check_row_vector(const char* op, const char* name, std::uintptr_t ptr, int64_t N) {
  check_buffer(op, ptr, N);
  check_aligned(op, name, ptr, sizeof(float));
}

// A launch configuration (see [Note: cross-entropy kernel layout]): kGroup threads per row, kBlock per block;
// blocks(N) is the grid for N rows (the row loop covers any rows beyond it).
template <int kGroup, int kBlock>
struct GroupShape {
  static constexpr int group = kGroup;
  static constexpr int block = kBlock;
  static int blocks(int64_t N) {
    constexpr int64_t rows_per_block = kBlock / kGroup;
    const int64_t wanted = (N + rows_per_block - 1) / rows_per_block;
    return static_cast<int>(std::min<int64_t>(wanted, std::numeric_limits<int>::max()));
  }
};

// Calls f(GroupShape<...>{}) with the configuration for rows of V elements.
template <typename F>
void dispatch_group_shape(int64_t V, F&& f) {
  if (V <= kShortRow) {
    f(GroupShape<kWarp, kShortRowBlock>{});
  } else {
    f(GroupShape<kLongRowBlock, kLongRowBlock>{});
  }
}

}  // namespace

void cross_entropy_forward_cuda(std::uintptr_t logits, DType dtype, std::uintptr_t targets, int64_t N, int64_t V,
                                int64_t ignore_index, double label_smoothing, std::uintptr_t loss_out,
                                std::uintptr_t lse_out, std::uintptr_t stream) {
  check_rows(kForwardOp, logits, targets, {N, V}, label_smoothing);
  check_row_vector(kForwardOp, "loss_out", loss_out, N);
  check_row_vector(kForwardOp, "lse_out", lse_out, N);
  if (N == 0) {
    return;
  }
  cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto traits) {
    using T = DeviceScalarT<decltype(traits)>;
    check_aligned(kForwardOp, "logits", logits, sizeof(T));
    dispatch_group_shape(V, [&](auto shape) {
      using Shape = decltype(shape);
      const auto kernel = cross_entropy_forward_kernel<T, Shape::group, Shape::block>;
      kernel<<<Shape::blocks(N), Shape::block, 0, cuda_stream>>>(
          reinterpret_cast<const T*>(logits), reinterpret_cast<const int64_t*>(targets), N, V, ignore_index,
          static_cast<float>(label_smoothing), reinterpret_cast<float*>(loss_out), reinterpret_cast<float*>(lse_out));
      check_cuda(cudaGetLastError(), kForwardOp, "kernel launch");
    });
  });
}

void cross_entropy_backward_cuda(std::uintptr_t logits_inout, DType dtype, std::uintptr_t targets, int64_t N,
                                 int64_t V, int64_t ignore_index, double label_smoothing, std::uintptr_t lse,
                                 std::uintptr_t grad_rows, std::uintptr_t stream) {
  check_rows(kBackwardOp, logits_inout, targets, {N, V}, label_smoothing);
  check_row_vector(kBackwardOp, "lse", lse, N);
  check_row_vector(kBackwardOp, "grad_rows", grad_rows, N);
  if (N == 0) {
    return;
  }
  cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto traits) {
    using T = DeviceScalarT<decltype(traits)>;
    check_aligned(kBackwardOp, "logits", logits_inout, sizeof(T));
    dispatch_group_shape(V, [&](auto shape) {
      using Shape = decltype(shape);
      const auto kernel = cross_entropy_backward_kernel<T, Shape::group, Shape::block>;
      kernel<<<Shape::blocks(N), Shape::block, 0, cuda_stream>>>(
          reinterpret_cast<T*>(logits_inout), reinterpret_cast<const int64_t*>(targets), N, V, ignore_index,
          static_cast<float>(label_smoothing), reinterpret_cast<const float*>(lse),
          reinterpret_cast<const float*>(grad_rows));
      check_cuda(cudaGetLastError(), kBackwardOp, "kernel launch");
    });
  });
}

}  // namespace bmtwrap::cuda
