// The Python module bmtwrap._C: bindings only, no logic. Its one importer is bmtwrap/ops/_ext.py; the
// bmtwrap.ops package checks every tensor before its pointer arrives here (see [Note: tensors crossing
// into C++] in common.h).
// Kernels release the GIL: they only touch memory the caller keeps alive for the duration of the call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "cpu/adam.h"
#include "cpu/inf_nan.h"
#include "cpu/offload.h"
#ifdef BMTWRAP_WITH_CUDA
#include "cuda/inf_nan.h"
#include "cuda/offload_link.h"
#endif
// CUDA fused Adam, cross-entropy and the scaled copy (cuda/adam.h, cuda/cross_entropy.h, cuda/scale.h)
#ifdef BMTWRAP_WITH_CUDA
#include "cuda/adam.h"
#include "cuda/cross_entropy.h"
#include "cuda/scale.h"
#endif

namespace py = pybind11;
using namespace pybind11::literals;

PYBIND11_MODULE(_C, m) {
  m.doc() = "bmtwrap's compiled kernels. Use bmtwrap.ops, which validates tensors, instead of this module.";

  m.def(
      "has_cuda",
      []() {
#ifdef BMTWRAP_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether the CUDA kernels were compiled in (says nothing about a GPU being present).");
  m.def(
      "cuda_archs",
      []() {
#ifdef BMTWRAP_CUDA_ARCHS
        return std::string(BMTWRAP_CUDA_ARCHS);  // set by setup.py: what nvcc compiled the kernels for
#else
        return std::string();
#endif
      },
      "The compute capabilities the CUDA kernels were compiled for, ';'-separated (\"80;90\"); empty without them.");

  py::enum_<bmtwrap::DType>(m, "DType", "Element type codes; the names match torch's dtype names.")
      .value("float32", bmtwrap::DType::kFloat32)
      .value("float16", bmtwrap::DType::kFloat16)
      .value("bfloat16", bmtwrap::DType::kBFloat16);

  m.def("has_inf_nan", &bmtwrap::cpu::has_inf_nan, "ptr"_a, "numel"_a, "dtype"_a, "num_threads"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "True if any of the numel elements at host address ptr is +-inf or nan. num_threads=0: all cores.");

  // ---------------------------------------------------------------------------- CPU Adam (cpu/adam.h)
  using bmtwrap::cpu::CpuIsa;
  py::enum_<CpuIsa>(m, "CpuIsa", "Instruction sets of the CPU kernels; `best` is the widest this CPU supports.")
      .value("best", CpuIsa::kBest)
      .value("scalar", CpuIsa::kScalar)
      .value("avx2", CpuIsa::kAvx2)
      .value("avx512", CpuIsa::kAvx512);
  m.def("cpu_best_isa", &bmtwrap::cpu::cpu_best_isa, "What CpuIsa.best stands for on this CPU.");
  m.def("cpu_supported_isas", &bmtwrap::cpu::cpu_supported_isas,
        "The instruction sets this CPU supports, scalar first (best excluded).");
  m.def(
      "adam_cpu",
      [](std::uintptr_t param_ptr, std::uintptr_t grad_ptr, bmtwrap::DType grad_dtype, std::uintptr_t exp_avg_ptr,
         std::uintptr_t exp_avg_sq_ptr, int64_t numel, double lr, double beta1, double beta2, double eps,
         double weight_decay, int64_t step, double grad_scale, bool decoupled, std::uintptr_t out_ptr,
         bmtwrap::DType out_dtype, int num_threads, CpuIsa isa, std::uintptr_t param_target,
         std::uintptr_t exp_avg_target, std::uintptr_t exp_avg_sq_target) {
        const bmtwrap::cpu::AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled};
        bmtwrap::cpu::adam_cpu(param_ptr, grad_ptr, grad_dtype, exp_avg_ptr, exp_avg_sq_ptr, numel, hyper, out_ptr,
                               out_dtype, num_threads, isa, {param_target, exp_avg_target, exp_avg_sq_target});
      },
      "param_ptr"_a, "grad_ptr"_a, "grad_dtype"_a, "exp_avg_ptr"_a, "exp_avg_sq_ptr"_a, "numel"_a, "lr"_a,
      "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "grad_scale"_a, "decoupled"_a, "out_ptr"_a,
      "out_dtype"_a, "num_threads"_a = 0, "isa"_a = CpuIsa::kBest, "param_target"_a = 0, "exp_avg_target"_a = 0,
      "exp_avg_sq_target"_a = 0, py::call_guard<py::gil_scoped_release>(),
      "One Adam (decoupled=False) or AdamW step over numel host elements: param, exp_avg, exp_avg_sq fp32, "
      "updated in place, or written to the *_target addresses where those are nonzero (the inputs then only "
      "read); grad of grad_dtype, multiplied by grad_scale on load; when out_ptr != 0, the new param rounded "
      "to out_dtype (float16 or bfloat16) at out_ptr. Matches torch.optim.AdamW to fp32 rounding. "
      "num_threads=0: all cores; isa: which compiled kernels (CpuIsa.best: the widest this CPU has).");

  // ------------------------------------------------------------- split fp32 masters (common.h, [Note: split master])
  m.def(
      "split_master_cpu",
      [](std::uintptr_t master_ptr, std::uintptr_t weight_ptr, std::uintptr_t low_ptr, int64_t numel) {
        bmtwrap::check_buffer("split_master_cpu", master_ptr, numel);
        const auto* master = reinterpret_cast<const uint32_t*>(master_ptr);
        auto* weight = reinterpret_cast<uint16_t*>(weight_ptr);
        auto* low = reinterpret_cast<uint16_t*>(low_ptr);
        for (int64_t i = 0; i < numel; ++i) {
          const bmtwrap::SplitBits halves = bmtwrap::split_master_bits(master[i]);
          weight[i] = halves.weight;
          low[i] = halves.low;
        }
      },
      "master_ptr"_a, "weight_ptr"_a, "low_ptr"_a, "numel"_a, py::call_guard<py::gil_scoped_release>(),
      "Split numel fp32 masters at host address master_ptr into their bf16 weights (rounded to nearest even) "
      "and 16-bit low halves.");
  m.def(
      "join_master_cpu",
      [](std::uintptr_t weight_ptr, std::uintptr_t low_ptr, std::uintptr_t master_ptr, int64_t numel) {
        bmtwrap::check_buffer("join_master_cpu", master_ptr, numel);
        const auto* weight = reinterpret_cast<const uint16_t*>(weight_ptr);
        const auto* low = reinterpret_cast<const uint16_t*>(low_ptr);
        auto* master = reinterpret_cast<uint32_t*>(master_ptr);
        for (int64_t i = 0; i < numel; ++i) {
          master[i] = bmtwrap::join_master_bits(weight[i], low[i]);
        }
      },
      "weight_ptr"_a, "low_ptr"_a, "master_ptr"_a, "numel"_a, py::call_guard<py::gil_scoped_release>(),
      "Join numel bf16 weights and 16-bit low halves at host addresses into fp32 masters at master_ptr.");

  // ---------------------------------------------------------------- offload queue (cpu/offload.h, cuda/offload_link.h)
  using bmtwrap::cpu::OffloadQueue;
  using bmtwrap::cpu::OffloadTicket;
  py::class_<OffloadTicket>(m, "OffloadTicket", "One submitted update of an OffloadQueue.")
      .def("done", &OffloadTicket::done, "Whether the update is finished on the host and its copy back queued.")
      .def("wait", &OffloadTicket::wait, "stream"_a = 0, py::call_guard<py::gil_scoped_release>(),
           "Block until done(); then, on a GPU, make stream (a cudaStream_t as an integer; 0 is the default stream) "
           "wait for the copy back. "
           "Raises RuntimeError if the update failed.");
  // param, param_dtype, grad, grad_dtype, master, exp_avg, exp_avg_sq, numel, lr, beta1, beta2, eps,
  // weight_decay, step, grad_scale, decoupled, priority, on_host, grad_on_host, master_target, exp_avg_target,
  // exp_avg_sq_target, order
  using UpdateTuple = std::tuple<std::uintptr_t, bmtwrap::DType, std::uintptr_t, bmtwrap::DType, std::uintptr_t,
                                 std::uintptr_t, std::uintptr_t, int64_t, double, double, double, double, double,
                                 int64_t, double, bool, int64_t, bool, bool, std::uintptr_t, std::uintptr_t,
                                 std::uintptr_t, std::uintptr_t>;
  py::class_<OffloadQueue>(m, "OffloadQueue",
                           "Adam updates run chunk by chunk on a C++ worker thread; see csrc/cpu/offload.cpp.")
      .def(py::init([](int device, int64_t chunk_numel, int slots, int64_t grad_bytes, int64_t out_bytes,
                       int num_threads) {
             std::unique_ptr<bmtwrap::cpu::DeviceLink> link;
             if (device >= 0) {
#ifdef BMTWRAP_WITH_CUDA
               link = bmtwrap::cuda::make_cuda_link(device, slots, grad_bytes, out_bytes);
#else
               throw std::invalid_argument("OffloadQueue: bmtwrap._C was built without CUDA");
#endif
             }
             return std::make_unique<OffloadQueue>(std::move(link), chunk_numel, num_threads);
           }),
           "device"_a, "chunk_numel"_a, "slots"_a, "grad_bytes"_a, "out_bytes"_a, "num_threads"_a = 0,
           "device: a CUDA device index, or -1 for host parameters (then slots and the byte sizes are unused). "
           "grad_bytes, out_bytes: of each pinned staging slot's gradient and output halves.")
      .def(
          "submit",
          [](OffloadQueue& queue, const std::vector<UpdateTuple>& updates, std::uintptr_t ready_stream) {
            std::vector<bmtwrap::cpu::OffloadUpdate> specs;
            specs.reserve(updates.size());
            for (const auto& u : updates) {
              const auto& [param, param_dtype, grad, grad_dtype, master, exp_avg, exp_avg_sq, numel, lr, beta1,
                           beta2, eps, weight_decay, step, grad_scale, decoupled, priority, on_host, grad_on_host,
                           master_target, exp_avg_target, exp_avg_sq_target, order] = u;
              specs.push_back({param, param_dtype, grad, grad_dtype, master, exp_avg, exp_avg_sq, numel,
                               {lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled}, priority,
                               on_host, grad_on_host, {master_target, exp_avg_target, exp_avg_sq_target}, order});
            }
            return queue.submit(specs, ready_stream);
          },
          "updates"_a, "ready_stream"_a, py::call_guard<py::gil_scoped_release>(),
          "Queue updates, each a tuple (param, param_dtype, grad, grad_dtype, master, exp_avg, exp_avg_sq, numel, "
          "lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled, priority, on_host, grad_on_host, "
          "master_target, exp_avg_target, exp_avg_sq_target, order); on a "
          "device, gradients are read once ready_stream reaches this point. *_target: where the new master and "
          "moments go (0: in place); order: updates with the same nonzero order run in submission order (0: the "
          "master's address). on_host: param and grad are host memory "
          "in a queue for a device (updated in place, no staging). grad_on_host: only grad is host memory, copied "
          "there before ready_stream's point. Returns one OffloadTicket per update.")
      .def("prioritise", &OffloadQueue::prioritise, "Until the queue is next empty, take the lowest priority first instead of the newest.")
      .def("wait_all", &OffloadQueue::wait_all, py::call_guard<py::gil_scoped_release>(),
           "Block until nothing is in flight; raise the first failure since the last call.")
      .def("check", &OffloadQueue::check, "Raise the first failure since the last call, without waiting.")
      .def(
          "stats",
          [](const OffloadQueue& queue) {
            const OffloadQueue::Stats s = queue.stats();
            return py::dict("adam_s"_a = s.adam_s, "stalled_s"_a = s.stalled_s, "idle_s"_a = s.idle_s,
                            "elements"_a = s.elements);
          },
          "Where the worker's time went since the queue was made (seconds in the Adam kernel, waiting for a "
          "gradient fetch, idle) and the elements it updated.");

#ifdef BMTWRAP_WITH_CUDA
  m.def("has_inf_nan_cuda", &bmtwrap::cuda::has_inf_nan_cuda, "ptr"_a, "numel"_a, "dtype"_a, "flag_ptr"_a,
        "stream"_a, py::call_guard<py::gil_scoped_release>(),
        "Enqueue on stream a kernel that writes 1 to the uint8 at flag_ptr if any of the numel elements at "
        "device address ptr is +-inf or nan. Never writes 0. Runs on the current CUDA device.");
#endif

  // ------------------------------------------ CUDA fused Adam and cross-entropy (cuda/adam.h, cross_entropy.h)
#ifdef BMTWRAP_WITH_CUDA
  m.def("adam_cuda", &bmtwrap::cuda::adam_cuda, "param"_a, "grad"_a, "grad_dtype"_a, "exp_avg"_a, "exp_avg_sq"_a,
        "numel"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "grad_scale"_a, "decoupled"_a,
        "out"_a, "out_dtype"_a, "skip_flag_ptr"_a, "stream"_a, py::call_guard<py::gil_scoped_release>(),
        "Enqueue on stream one Adam (decoupled=False) or AdamW step over numel device elements, in place: param, "
        "exp_avg, exp_avg_sq fp32; grad of grad_dtype, multiplied by grad_scale on load; when out != 0, the new "
        "param rounded to out_dtype at out. When skip_flag_ptr != 0 and the uint8 there is nonzero, nothing is "
        "written. Runs on the current CUDA device.");
  m.def("adam_split_cuda", &bmtwrap::cuda::adam_split_cuda, "weight"_a, "low"_a, "grad"_a, "grad_dtype"_a,
        "exp_avg"_a, "exp_avg_sq"_a, "numel"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a,
        "grad_scale"_a, "decoupled"_a, "skip_flag_ptr"_a, "stream"_a, py::call_guard<py::gil_scoped_release>(),
        "adam_cuda for bf16 weights whose fp32 master is split: joined from weight and low (uint16), updated, "
        "and written back split.");
  m.def("cross_entropy_forward_cuda", &bmtwrap::cuda::cross_entropy_forward_cuda, "logits"_a, "dtype"_a,
        "targets"_a, "N"_a, "V"_a, "ignore_index"_a, "label_smoothing"_a, "loss_out"_a, "lse_out"_a, "stream"_a,
        py::call_guard<py::gil_scoped_release>(),
        "Enqueue on stream the fused softmax + NLL of the (N, V) logits of dtype with int64 targets: fp32 "
        "per-row loss (0 where target == ignore_index) into loss_out and logsumexp into lse_out.");
  m.def("cross_entropy_backward_cuda", &bmtwrap::cuda::cross_entropy_backward_cuda, "logits_inout"_a, "dtype"_a,
        "targets"_a, "N"_a, "V"_a, "ignore_index"_a, "label_smoothing"_a, "lse"_a, "grad_rows"_a, "stream"_a,
        py::call_guard<py::gil_scoped_release>(),
        "Enqueue on stream the cross-entropy backward: overwrite the (N, V) logits with "
        "(softmax - (1 - eps) * onehot - eps / V) * grad_rows[:, None], computed in fp32 from the forward's lse.");
  m.def("scaled_copy_cuda", &bmtwrap::cuda::scaled_copy_cuda, "in"_a, "in_dtype"_a, "out"_a, "out_dtype"_a,
        "numel"_a, "scale_ptr"_a, "stream"_a, py::call_guard<py::gil_scoped_release>(),
        "Enqueue on stream out[i] = in[i] * scale rounded to out_dtype, scale being the fp32 at device address "
        "scale_ptr. Runs on the current CUDA device.");
#endif
}
