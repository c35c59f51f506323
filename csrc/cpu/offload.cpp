// The offload queue (see offload.h).
//
// [Note: offload queue]
// Python submits one update per parameter shard and returns at once. A single C++ worker thread cuts each
// update into chunks of at most `chunk_numel` elements and runs them; it never touches Python, so it keeps
// working at full speed while the training loop's thread holds the GIL (during backward, Python runs the
// checkpointed blocks' recomputation almost without pause; a Python worker got the GIL too rarely there).
//
// With a DeviceLink (parameters on a GPU) each chunk passes three stages, each on its own engine, so that
// they overlap across chunks:
//   fetch  D2H of the gradient chunk into a pinned staging slot, on the link's fetch stream, once the
//          compute stream has reached the point where the update was submitted (its `ready` event);
//   adam   the vectorised, multithreaded CPU kernel updates the fp32 master and moments (plain host memory)
//          and writes the rounded parameter into the slot's output half;
//   put    H2D of the output into the parameter shard, on the link's put stream.
// Fetches run up to `slots - 1` chunks ahead of the Adam kernel, so transfers hide behind CPU work; a slot's
// output is rewritten only after its previous put has left. Pinned memory is bounded by the slots, whatever
// the model's size. Parameters kept in fp32 on the GPU are put straight from the master.
// Without a link (parameters on the host) the kernel updates the master in place and writes the rounded
// parameter, if it has its own master, straight into it. So it does for an update marked `on_host` in a queue
// with a link: parameters offloaded to the host, whose gradients the submitting stream copies there. Such a
// chunk takes no slot; the worker waits for its `ready` event (which follows the gradient's copy) and runs it.
// An update marked `grad_on_host` has its parameter on the device but its gradient already copied to the host
// by the submitting stream (so that the device memory of a gradient waiting for the CPU is freed at once): its
// chunks skip the fetch, wait for `ready` instead, and take a slot for the output and the put as usual.
//
// Order: until prioritise() (the user's step()) the newest task whose gradient the device has already
// computed goes first (the oldest if none has); from then until the queue empties, the lowest priority, which
// the optimizer sets to the order the next forward gathers parameters in. Either way, updates of one buffer
// (one master) run in the order they were submitted. Why the newest first: during backward gradients become
// final from the last block to the first and the CPU falls behind; the next forward needs the first blocks
// first. Updating the newest gradients (the lowest blocks so far) leaves the backlog to blocks the forward
// reaches last, so that once the CPU is done the GPU soon needs the CPU again; oldest-first leaves the
// forward a stretch of already updated blocks to run while the CPU idles. Only gradients already computed
// count: Python submits a block's update when it has queued the block's backward, well before the GPU has
// run it, and a fetch of such a gradient would hold the CPU up. The cost of the order: gradients of deferred
// blocks stay on the GPU a little longer.
// A task is done once its last put is queued; its `written` event follows that put, and a ticket's wait()
// makes a reader's stream wait for it.
//
// Errors: the first exception of the worker marks every unfinished task failed (so that no reader blocks
// forever), is kept for wait_all()/check(), and each failed ticket's wait() throws it. The worker lives on.
#include "cpu/offload.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <utility>

namespace bmtwrap::cpu {

struct OffloadTask {
  OffloadUpdate update;
  DeviceLink::Event ready;    // the gradient is final on the submitting stream (null on the host)
  bool ready_seen = false;    // `ready` was found reached (under the mutex)
  DeviceLink::Event written;  // after the last put; set with done
  int64_t next = 0;           // first element not yet taken by the worker (under the mutex)
  int64_t left = 0;           // elements not yet finished (the worker only)
  bool done = false;
  bool failed = false;
  std::string error;
};

struct OffloadCore {
  std::mutex mutex;
  std::condition_variable changed;
  std::unique_ptr<DeviceLink> link;
  std::deque<std::shared_ptr<OffloadTask>> queue;  // tasks with elements not yet taken
  bool prioritised = false;
  bool stopping = false;
  std::vector<std::shared_ptr<OffloadTask>> active;  // submitted, not done
  std::string error;       // the first failure since the last wait_all()/check()
};

struct OffloadQueue::Chunk {
  std::shared_ptr<OffloadTask> task;
  int64_t start = 0;
  int64_t end = 0;
  int slot = 0;
};

namespace {

// Adds the nanoseconds of its lifetime to a counter.
class Timer {
 public:
  explicit Timer(std::atomic<int64_t>& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Timer() {
    const auto elapsed = std::chrono::steady_clock::now() - start_;
    total_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count(), std::memory_order_relaxed);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

 private:
  std::atomic<int64_t>& total_;
  std::chrono::steady_clock::time_point start_;
};

int64_t element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

std::uintptr_t at(std::uintptr_t base, int64_t index, int64_t bytes) {
  return base + static_cast<std::uintptr_t>(index * bytes);
}

// The update's targets from element `start` on (a zero target stays zero: in place).
AdamTargets chunk_targets(const OffloadUpdate& u, int64_t start) {
  auto offset = [start](std::uintptr_t ptr) { return ptr != 0 ? at(ptr, start, 4) : 0; };
  return AdamTargets{offset(u.targets.param), offset(u.targets.exp_avg), offset(u.targets.exp_avg_sq)};
}

void check_update(const OffloadUpdate& u, const DeviceLink* link, int64_t chunk_numel) {
  for (auto [name, ptr] : {std::pair{"param", u.param}, {"grad", u.grad}, {"master", u.master},
                           {"exp_avg", u.exp_avg}, {"exp_avg_sq", u.exp_avg_sq}}) {
    check_buffer((std::string("OffloadQueue.submit(") + name + ")").c_str(), ptr, u.numel);
  }
  const bool host = link == nullptr || u.on_host;
  if (u.grad_on_host && host) {
    throw std::invalid_argument("OffloadQueue.submit: grad_on_host is for a device parameter in a queue for a device; "
                                "a host parameter's gradient is on the host already");
  }
  const bool own_master = u.master == u.param;
  if (own_master && (!host || u.param_dtype != DType::kFloat32)) {
    throw std::invalid_argument("OffloadQueue.submit: a parameter can be its own master only on the host and in "
                                "float32");
  }
  if (!own_master && host && u.param_dtype == DType::kFloat32) {
    throw std::invalid_argument("OffloadQueue.submit: a float32 host parameter must be its own master");
  }
  if (own_master && (u.targets.param != 0 || u.targets.exp_avg != 0 || u.targets.exp_avg_sq != 0)) {
    throw std::invalid_argument("OffloadQueue.submit: a parameter that is its own master is updated in place; "
                                "targets need a separate master");
  }
  for (auto [name, ptr] : {std::pair{"master target", u.targets.param}, {"exp_avg target", u.targets.exp_avg},
                           {"exp_avg_sq target", u.targets.exp_avg_sq}}) {
    if (ptr != 0) {
      check_buffer((std::string("OffloadQueue.submit(") + name + ")").c_str(), ptr, u.numel);
    }
  }
  if (!host) {
    const int64_t numel = std::min(u.numel, chunk_numel);
    if ((!u.grad_on_host && numel * element_bytes(u.grad_dtype) > link->slot_grad_bytes()) ||
        (u.param_dtype != DType::kFloat32 && numel * element_bytes(u.param_dtype) > link->slot_out_bytes())) {
      throw std::invalid_argument("OffloadQueue.submit: a chunk of this update does not fit the staging slots");
    }
  }
}

}  // namespace

bool OffloadTicket::done() const {
  std::lock_guard<std::mutex> lock(core_->mutex);
  return task_->done;
}

void OffloadTicket::wait(std::uintptr_t stream) const {
  DeviceLink::Event written;
  {
    std::unique_lock<std::mutex> lock(core_->mutex);
    core_->changed.wait(lock, [this] { return task_->done; });
    if (task_->failed) {
      throw std::runtime_error("the offloaded optimizer update failed on its worker thread: " + task_->error);
    }
    written = task_->written;
  }
  if (written) {  // null on the host
    core_->link->stream_wait(stream, written);
  }
}

OffloadQueue::OffloadQueue(std::unique_ptr<DeviceLink> link, int64_t chunk_numel, int num_threads)
    : core_(std::make_shared<OffloadCore>()), chunk_numel_(chunk_numel), num_threads_(num_threads) {
  if (chunk_numel < 1 || num_threads < 0) {
    throw std::invalid_argument("OffloadQueue: need chunk_numel >= 1 and num_threads >= 0, got " +
                                std::to_string(chunk_numel) + " and " + std::to_string(num_threads));
  }
  core_->link = std::move(link);
  worker_ = std::thread([this] { run(); });
}

OffloadQueue::~OffloadQueue() {
  {
    std::unique_lock<std::mutex> lock(core_->mutex);
    core_->changed.wait(lock, [this] { return core_->active.empty(); });
    core_->stopping = true;
  }
  core_->changed.notify_all();
  worker_.join();
}

std::vector<OffloadTicket> OffloadQueue::submit(const std::vector<OffloadUpdate>& updates,
                                                std::uintptr_t ready_stream) {
  DeviceLink* link = core_->link.get();
  for (const OffloadUpdate& u : updates) {
    check_update(u, link, chunk_numel_);
  }
  DeviceLink::Event ready = link != nullptr ? link->record(ready_stream) : nullptr;
  std::vector<OffloadTicket> tickets;
  std::vector<std::shared_ptr<OffloadTask>> tasks;
  for (const OffloadUpdate& u : updates) {
    auto task = std::make_shared<OffloadTask>();
    task->update = u;
    task->ready = ready;
    task->left = u.numel;
    task->done = u.numel == 0;
    tickets.emplace_back(core_, task);
    tasks.push_back(std::move(task));
  }
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    for (auto& task : tasks) {
      if (!task->done) {
        core_->queue.push_back(task);
        core_->active.push_back(std::move(task));
      }
    }
  }
  core_->changed.notify_all();
  return tickets;
}

void OffloadQueue::prioritise() {
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->prioritised = true;
}

void OffloadQueue::wait_all() {
  {
    std::unique_lock<std::mutex> lock(core_->mutex);
    core_->changed.wait(lock, [this] { return core_->active.empty(); });
  }
  check();
}

OffloadQueue::Stats OffloadQueue::stats() const {
  return Stats{adam_ns_.load() * 1e-9, stalled_ns_.load() * 1e-9, idle_ns_.load() * 1e-9, elements_.load()};
}

void OffloadQueue::check() {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    error = std::exchange(core_->error, std::string());
  }
  if (!error.empty()) {
    throw std::runtime_error("the offloaded optimizer step failed on its worker thread: " + error);
  }
}

std::deque<std::shared_ptr<OffloadTask>>::iterator OffloadQueue::newest_ready() {
  // Events of one stream complete in order, so the walk from the newest stops at the first reached one; tasks
  // of one submission share their event, which is asked once.
  auto& queue = core_->queue;
  const void* unreached = nullptr;
  for (auto it = queue.end(); it != queue.begin();) {
    OffloadTask& task = **--it;
    if (!task.ready || task.ready_seen) {
      return it;
    }
    if (task.ready.get() == unreached) {
      continue;
    }
    try {
      task.ready_seen = core_->link->reached(task.ready);
    } catch (const std::exception&) {
      task.ready_seen = true;  // its fetch will meet the error and report it
    }
    if (task.ready_seen) {
      return it;
    }
    unreached = task.ready.get();
  }
  return queue.begin();  // no gradient computed yet: the oldest comes first
}

bool OffloadQueue::take(bool block, Chunk* chunk) {
  std::unique_lock<std::mutex> lock(core_->mutex);
  if (block && core_->queue.empty() && !core_->stopping) {
    Timer idle(idle_ns_);
    core_->changed.wait(lock, [this] { return !core_->queue.empty() || core_->stopping; });
  }
  auto& queue = core_->queue;
  if (queue.empty()) {
    return false;
  }
  auto it = core_->prioritised ? std::min_element(queue.begin(), queue.end(), [](const auto& a, const auto& b) {
    return a->update.priority < b->update.priority;  // the first of the lowest priority
  })
                                : newest_ready();
  // Updates of one buffer run in the order they were submitted: the oldest queued one goes first.
  const std::uintptr_t key = (*it)->update.order_key();
  it = std::find_if(queue.begin(), it, [key](const auto& t) { return t->update.order_key() == key; });
  OffloadTask& task = **it;
  chunk->task = *it;
  chunk->start = task.next;
  chunk->end = std::min(task.update.numel, task.next + chunk_numel_);
  task.next = chunk->end;
  if (task.next == task.update.numel) {
    queue.erase(it);
    core_->prioritised = core_->prioritised && !queue.empty();
  }
  return true;
}

void OffloadQueue::finish(OffloadTask& task) {
  DeviceLink::Event written = core_->link && !task.update.on_host ? core_->link->mark_puts() : nullptr;
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    task.written = std::move(written);
    task.done = true;
    auto& active = core_->active;
    active.erase(std::find_if(active.begin(), active.end(), [&](const auto& t) { return t.get() == &task; }));
  }
  core_->changed.notify_all();
}

void OffloadQueue::run() {
  if (core_->link) {
    try {
      core_->link->bind_thread();
    } catch (const std::exception& error) {
      fail(error.what());  // and every later update fails too, in the loop below
    }
    run_device();
  } else {
    run_host();
  }
}

void OffloadQueue::adam_in_place(const Chunk& chunk) {
  const OffloadUpdate& u = chunk.task->update;
  const bool own_master = u.master == u.param;
  Timer timer(adam_ns_);
  adam_cpu(at(u.master, chunk.start, 4), at(u.grad, chunk.start, element_bytes(u.grad_dtype)), u.grad_dtype,
           at(u.exp_avg, chunk.start, 4), at(u.exp_avg_sq, chunk.start, 4), chunk.end - chunk.start, u.hyper,
           own_master ? 0 : at(u.param, chunk.start, element_bytes(u.param_dtype)), u.param_dtype, num_threads_,
           CpuIsa::kBest, chunk_targets(u, chunk.start));
}

void OffloadQueue::run_host() {
  Chunk chunk;
  while (take(true, &chunk)) {
    const int64_t n = chunk.end - chunk.start;
    try {
      adam_in_place(chunk);
    } catch (const std::exception& error) {
      fail(error.what());
      continue;
    }
    elements_ += n;
    if ((chunk.task->left -= n) == 0) {
      finish(*chunk.task);
    }
  }
}

void OffloadQueue::run_device() {
  DeviceLink& link = *core_->link;
  std::deque<Chunk> staged;  // fetched or fetching, in order
  int turn = 0;
  for (;;) {
    try {
      while (static_cast<int>(staged.size()) < link.num_slots()) {
        Chunk chunk;
        if (!take(staged.empty(), &chunk)) {
          if (staged.empty()) {
            return;  // stopping
          }
          break;
        }
        const OffloadUpdate& u = chunk.task->update;
        chunk.slot = u.on_host ? -1 : turn++ % link.num_slots();
        staged.push_back(chunk);
        if (!u.on_host && !u.grad_on_host) {
          const int64_t bytes = element_bytes(u.grad_dtype);
          link.fetch(chunk.slot, at(u.grad, chunk.start, bytes), (chunk.end - chunk.start) * bytes, chunk.task->ready);
        }
      }
      const Chunk chunk = staged.front();
      const OffloadUpdate& u = chunk.task->update;
      const int64_t n = chunk.end - chunk.start;
      if (u.on_host) {
        {
          Timer timer(stalled_ns_);
          link.synchronize(chunk.task->ready);  // its gradient's copy to the host was queued before `ready`
        }
        adam_in_place(chunk);
        elements_ += n;
        staged.pop_front();
        if ((chunk.task->left -= n) == 0) {
          finish(*chunk.task);
        }
        continue;
      }
      const bool rounded = u.param_dtype != DType::kFloat32;
      {
        Timer timer(stalled_ns_);
        if (u.grad_on_host) {
          link.synchronize(chunk.task->ready);  // the gradient's copy to the host was queued before `ready`
        }
        link.wait_fetched(chunk.slot);  // with a host gradient: the slot's previous put has left
      }
      const std::uintptr_t grad = u.grad_on_host ? at(u.grad, chunk.start, element_bytes(u.grad_dtype))
                                                 : link.slot_grad(chunk.slot);
      {
        Timer timer(adam_ns_);
        adam_cpu(at(u.master, chunk.start, 4), grad, u.grad_dtype, at(u.exp_avg, chunk.start, 4),
                 at(u.exp_avg_sq, chunk.start, 4), n, u.hyper, rounded ? link.slot_out(chunk.slot) : 0,
                 u.param_dtype, num_threads_, CpuIsa::kBest, chunk_targets(u, chunk.start));
      }
      elements_ += n;
      const int64_t bytes = element_bytes(u.param_dtype);
      link.put(chunk.slot, rounded ? link.slot_out(chunk.slot) : at(u.master_out(), chunk.start, 4),
               at(u.param, chunk.start, bytes), n * bytes);
      staged.pop_front();
      if ((chunk.task->left -= n) == 0) {
        finish(*chunk.task);
      }
    } catch (const std::exception& error) {
      link.drain();
      fail(error.what());
      staged.clear();
    }
  }
}

void OffloadQueue::fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    if (core_->error.empty()) {
      core_->error = message;
    }
    for (const auto& task : core_->active) {
      task->done = true;
      task->failed = true;
      task->error = message;
    }
    core_->active.clear();
    core_->queue.clear();
    core_->prioritised = false;
  }
  core_->changed.notify_all();
}

}  // namespace bmtwrap::cpu
