// The Python module bmtwrap._C: bindings only, no logic. Its one importer is bmtwrap/ops.py, which checks
// every tensor before its pointer arrives here (see [Note: tensors crossing into C++] in common.h).
// Kernels release the GIL: they only touch memory the caller keeps alive for the duration of the call.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common.h"
#include "cpu/inf_nan.h"
#ifdef BMTWRAP_WITH_CUDA
#include "cuda/inf_nan.h"
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

  py::enum_<bmtwrap::DType>(m, "DType", "Element type codes; the names match torch's dtype names.")
      .value("float32", bmtwrap::DType::kFloat32)
      .value("float16", bmtwrap::DType::kFloat16)
      .value("bfloat16", bmtwrap::DType::kBFloat16);

  m.def("has_inf_nan", &bmtwrap::cpu::has_inf_nan, "ptr"_a, "numel"_a, "dtype"_a, "num_threads"_a = 0,
        py::call_guard<py::gil_scoped_release>(),
        "True if any of the numel elements at host address ptr is +-inf or nan. num_threads=0: all cores.");

#ifdef BMTWRAP_WITH_CUDA
  m.def("has_inf_nan_cuda", &bmtwrap::cuda::has_inf_nan_cuda, "ptr"_a, "numel"_a, "dtype"_a, "flag_ptr"_a,
        "stream"_a, py::call_guard<py::gil_scoped_release>(),
        "Enqueue on stream a kernel that writes 1 to the uint8 at flag_ptr if any of the numel elements at "
        "device address ptr is +-inf or nan. Never writes 0. Runs on the current CUDA device.");
#endif
}
