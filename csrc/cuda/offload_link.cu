// The CUDA DeviceLink of the offload queue: pinned staging slots, a fetch stream and a put stream. See
// [Note: offload queue] in cpu/offload.cpp for how the queue drives it.
#include "cuda/offload_link.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace bmtwrap::cuda {
namespace {

using Event = cpu::DeviceLink::Event;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("offload: ") + what + " failed: " + cudaGetErrorString(status));
  }
}

// Makes `device` current for the scope; events and records must be made on the device they belong to.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice");
    }
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

cudaEvent_t raw(const Event& event) { return static_cast<cudaEvent_t>(event.get()); }

// Blocking-sync events: a host that waits on one sleeps instead of spinning a core the CPU Adam needs.
Event new_event() {
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreate");
  return Event(event, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
}

std::shared_ptr<void> new_pinned(int64_t bytes) {
  void* ptr = nullptr;
  if (bytes > 0) {
    check(cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocDefault), "cudaHostAlloc (pinned staging)");
  }
  return std::shared_ptr<void>(ptr, [](void* p) {
    if (p != nullptr) {
      cudaFreeHost(p);
    }
  });
}

std::shared_ptr<void> new_stream() {
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return std::shared_ptr<void>(stream, [](void* s) { cudaStreamDestroy(static_cast<cudaStream_t>(s)); });
}

class CudaLink final : public cpu::DeviceLink {
 public:
  CudaLink(int device, int slots, int64_t grad_bytes, int64_t out_bytes)
      : device_(device), grad_bytes_(grad_bytes), out_bytes_(out_bytes) {
    if (slots < 2 || grad_bytes < 1 || out_bytes < 0) {
      throw std::invalid_argument("offload: need slots >= 2, grad_bytes >= 1 and out_bytes >= 0");
    }
    DeviceGuard guard(device);
    fetch_stream_ = new_stream();
    put_stream_ = new_stream();
    for (int s = 0; s < slots; ++s) {
      slots_.push_back(Slot{new_pinned(grad_bytes), new_pinned(out_bytes), new_event(), new_event()});
    }
  }

  ~CudaLink() override { drain(); }  // then the members free the staging and streams

  int num_slots() const override { return static_cast<int>(slots_.size()); }
  int64_t slot_grad_bytes() const override { return grad_bytes_; }
  int64_t slot_out_bytes() const override { return out_bytes_; }
  std::uintptr_t slot_grad(int slot) const override {
    return reinterpret_cast<std::uintptr_t>(slots_.at(slot).grad.get());
  }
  std::uintptr_t slot_out(int slot) const override {
    return reinterpret_cast<std::uintptr_t>(slots_.at(slot).out.get());
  }

  Event record(std::uintptr_t stream) override {
    DeviceGuard guard(device_);
    Event event = new_event();
    check(cudaEventRecord(raw(event), reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
    return event;
  }

  void stream_wait(std::uintptr_t stream, const Event& event) override {
    DeviceGuard guard(device_);  // stream 0 means the current device's default stream
    check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), raw(event), 0), "cudaStreamWaitEvent");
  }

  bool reached(const Event& event) override {
    const cudaError_t status = cudaEventQuery(raw(event));
    if (status == cudaErrorNotReady) {
      return false;
    }
    check(status, "cudaEventQuery");
    return true;
  }

  void synchronize(const Event& event) override {
    check(cudaEventSynchronize(raw(event)), "cudaEventSynchronize (gradient copied to the host)");
  }

  void bind_thread() override { check(cudaSetDevice(device_), "cudaSetDevice"); }

  void fetch(int slot, std::uintptr_t src, int64_t bytes, const Event& after) override {
    Slot& s = slots_.at(slot);
    if (after) {
      check(cudaStreamWaitEvent(fetch_stream(), raw(after), 0), "cudaStreamWaitEvent");
    }
    check(cudaMemcpyAsync(s.grad.get(), reinterpret_cast<const void*>(src), static_cast<size_t>(bytes),
                          cudaMemcpyDeviceToHost, fetch_stream()),
          "cudaMemcpyAsync (gradient to host)");
    check(cudaEventRecord(raw(s.fetched), fetch_stream()), "cudaEventRecord");
  }

  void wait_fetched(int slot) override {
    Slot& s = slots_.at(slot);
    check(cudaEventSynchronize(raw(s.fetched)), "cudaEventSynchronize (gradient fetch)");
    check(cudaEventSynchronize(raw(s.left)), "cudaEventSynchronize (parameter put)");  // never recorded: returns
  }

  void put(int slot, std::uintptr_t src, std::uintptr_t dst, int64_t bytes) override {
    Slot& s = slots_.at(slot);
    check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), static_cast<size_t>(bytes),
                          cudaMemcpyHostToDevice, put_stream()),
          "cudaMemcpyAsync (parameter to device)");
    check(cudaEventRecord(raw(s.left), put_stream()), "cudaEventRecord");
  }

  Event mark_puts() override {
    Event event = new_event();
    check(cudaEventRecord(raw(event), put_stream()), "cudaEventRecord");
    return event;
  }

  void drain() noexcept override {
    cudaStreamSynchronize(fetch_stream());
    cudaStreamSynchronize(put_stream());
  }

 private:
  struct Slot {
    std::shared_ptr<void> grad;  // pinned
    std::shared_ptr<void> out;   // pinned
    Event fetched;               // after the slot's last fetch
    Event left;                  // after the slot's last put
  };

  cudaStream_t fetch_stream() const { return static_cast<cudaStream_t>(fetch_stream_.get()); }
  cudaStream_t put_stream() const { return static_cast<cudaStream_t>(put_stream_.get()); }

  int device_;
  int64_t grad_bytes_;
  int64_t out_bytes_;
  std::shared_ptr<void> fetch_stream_;
  std::shared_ptr<void> put_stream_;
  std::vector<Slot> slots_;
};

}  // namespace

std::unique_ptr<cpu::DeviceLink> make_cuda_link(int device, int slots, int64_t grad_bytes, int64_t out_bytes) {
  return std::make_unique<CudaLink>(device, slots, grad_bytes, out_bytes);
}

}  // namespace bmtwrap::cuda
