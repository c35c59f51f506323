// The offload queue: Adam updates of parameter shards run on the CPU by a C++ worker thread that never
// needs Python's GIL. See [Note: offload queue] in offload.cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "cpu/adam.h"

namespace bmtwrap::cpu {

// One parameter shard's update. Pointers as in [Note: tensors crossing into C++]; the caller keeps every
// buffer alive until the update's ticket is done.
struct OffloadUpdate {
  std::uintptr_t param;       // the shard: device memory when the queue has a DeviceLink, host memory otherwise
  DType param_dtype;
  std::uintptr_t grad;        // its gradient, where param is (or host memory: grad_on_host)
  DType grad_dtype;
  std::uintptr_t master;      // fp32 host master; equal to param for an fp32 host shard that is its own master
  std::uintptr_t exp_avg;     // fp32 host
  std::uintptr_t exp_avg_sq;  // fp32 host
  int64_t numel;
  AdamHyper hyper;
  int64_t priority;           // lower first, once the queue is prioritised
  // param and grad are host memory although the queue has a DeviceLink (parameters offloaded to the host, their
  // gradients copied there on the submitting stream): updated in place, without staging, once `ready` is reached.
  bool on_host = false;
  // Only grad is host memory: the submitting stream copied it there from the device, so the worker reads it once
  // `ready` is reached instead of fetching it; the new parameter goes back through a staging slot as usual.
  bool grad_on_host = false;
  // Where the new master and moments go: in place by default; elsewhere when the update may have to be redone
  // from the same state (fp32 host memory of numel elements each, disjoint from the inputs).
  AdamTargets targets;
  // Updates with the same key run in the order they were submitted (0: the master's address). Updates that
  // alternate between two sets of state buffers share one key.
  std::uintptr_t order = 0;

  std::uintptr_t order_key() const { return order != 0 ? order : master; }
  // The address the new master is written to.
  std::uintptr_t master_out() const { return targets.param != 0 ? targets.param : master; }
};

// The copies between one GPU and pinned host staging; implemented with CUDA in cuda/offload_link.cu. The
// queue calls the worker-side methods from its worker thread only.
class DeviceLink {
 public:
  using Event = std::shared_ptr<void>;  // an opaque device event, destroyed with its last owner

  virtual ~DeviceLink() = default;
  virtual int num_slots() const = 0;
  virtual int64_t slot_grad_bytes() const = 0;
  virtual int64_t slot_out_bytes() const = 0;
  virtual std::uintptr_t slot_grad(int slot) const = 0;  // pinned host, slot_grad_bytes() each
  virtual std::uintptr_t slot_out(int slot) const = 0;   // pinned host, slot_out_bytes() each

  // Any thread. Streams are cudaStream_t handles of the link's device; 0 is its default stream.
  virtual Event record(std::uintptr_t stream) = 0;  // an event recorded on a caller's stream now
  virtual void stream_wait(std::uintptr_t stream, const Event& event) = 0;
  virtual bool reached(const Event& event) = 0;
  virtual void synchronize(const Event& event) = 0;  // the calling thread waits until the event is reached

  // The worker thread.
  virtual void bind_thread() = 0;  // make the link's device current
  // D2H of `bytes` at device address `src` into the slot's grad, on the fetch stream, once `after` (may be
  // null) is reached; returns without waiting for the copy.
  virtual void fetch(int slot, std::uintptr_t src, int64_t bytes, const Event& after) = 0;
  // The host waits for the slot's fetch, and for its previous put to have left (its output is rewritten next).
  virtual void wait_fetched(int slot) = 0;
  // H2D of `bytes` from host address `src` (the slot's output, or any host memory) to device address `dst`, on
  // the put stream; the slot is free again once it has left.
  virtual void put(int slot, std::uintptr_t src, std::uintptr_t dst, int64_t bytes) = 0;
  virtual Event mark_puts() = 0;  // an event after every put queued so far
  virtual void drain() noexcept = 0;  // wait for both streams, ignoring errors
};

// Shared by the queue, its worker and the tickets (which may outlive the queue).
struct OffloadCore;
struct OffloadTask;

// One update's progress, handed to Python.
class OffloadTicket {
 public:
  OffloadTicket(std::shared_ptr<OffloadCore> core, std::shared_ptr<OffloadTask> task)
      : core_(std::move(core)), task_(std::move(task)) {}
  // Whether the update has finished on the host and its copy back is queued (or it failed).
  bool done() const;
  // Blocks until done(); then, on a device, makes `stream` (a cudaStream_t; 0 is the default stream) wait for
  // the copy back. Throws std::runtime_error naming the worker's error if the update failed.
  void wait(std::uintptr_t stream) const;

 private:
  std::shared_ptr<OffloadCore> core_;
  std::shared_ptr<OffloadTask> task_;
};

class OffloadQueue {
 public:
  // link: nullptr for host parameters (updated in place, no staging). chunk_numel: elements per chunk (the
  // link's slots must hold that many gradient and output elements). num_threads: of the Adam kernel, 0 = all.
  OffloadQueue(std::unique_ptr<DeviceLink> link, int64_t chunk_numel, int num_threads);
  ~OffloadQueue();  // finishes every queued update, then stops the worker
  OffloadQueue(const OffloadQueue&) = delete;
  OffloadQueue& operator=(const OffloadQueue&) = delete;

  // Queues the updates in order; on a device, each gradient is read once `ready_stream` (a cudaStream_t; 0 is
  // the default stream) reaches this point.
  std::vector<OffloadTicket> submit(const std::vector<OffloadUpdate>& updates, std::uintptr_t ready_stream);
  // From now until the queue is next empty after a take, take work by priority rather than newest first
  // (updates queued right after this call are included).
  void prioritise();
  // Blocks until nothing is queued or in flight; then throws the first error since the last call, if any.
  void wait_all();
  // Throws the first error since the last call, if any, without waiting.
  void check();

  // Where the worker's time went since the queue was made, in seconds, and the elements it updated.
  struct Stats {
    double adam_s = 0;     // in the Adam kernel
    double stalled_s = 0;  // waiting for a gradient fetch (which waits for the gradient to be final)
    double idle_s = 0;     // with nothing to do
    int64_t elements = 0;
  };
  Stats stats() const;

 private:
  void run();
  void run_host();
  void run_device();
  struct Chunk;
  void adam_in_place(const Chunk& chunk);  // a chunk of a host parameter, master and gradient
  bool take(bool block, Chunk* chunk);
  std::deque<std::shared_ptr<OffloadTask>>::iterator newest_ready();  // under the mutex
  void finish(OffloadTask& task);
  void fail(const std::string& message);

  std::shared_ptr<OffloadCore> core_;
  std::atomic<int64_t> adam_ns_{0};
  std::atomic<int64_t> stalled_ns_{0};
  std::atomic<int64_t> idle_ns_{0};
  std::atomic<int64_t> elements_{0};
  int64_t chunk_numel_;
  int num_threads_;
  std::thread worker_;
};

}  // namespace bmtwrap::cpu
