// The CUDA side of the offload queue (cpu/offload.h). Plain C++ on purpose: bind.cpp includes this without
// the CUDA headers.
#pragma once

#include <cstdint>
#include <memory>

#include "cpu/offload.h"

namespace bmtwrap::cuda {

// A DeviceLink for CUDA device `device`: `slots` staging slots of pinned host memory, each `grad_bytes` for
// a gradient chunk and `out_bytes` for a rounded parameter chunk, and two non-blocking streams of its own (one
// for device-to-host fetches, one for host-to-device puts). Throws std::runtime_error with CUDA's error
// string if any of it cannot be created.
std::unique_ptr<cpu::DeviceLink> make_cuda_link(int device, int slots, int64_t grad_bytes, int64_t out_bytes);

}  // namespace bmtwrap::cuda
