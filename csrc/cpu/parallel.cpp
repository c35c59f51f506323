// The worker pool behind parallel_for (see parallel.h for the contract).
//
// [Note: one job at a time]
// A job is (task, num_tasks, next_task). The caller publishes it under `mutex_`, bumps `generation_`, sets
// `wanted_` (workers with a smaller index may take part) and wakes exactly those workers, each through its
// own condition variable, so a job of two threads costs one wake-up however many workers the pool holds.
// Participants, the caller included, claim task indices from the atomic `next_task_` until they run out.
// A woken worker joins only while the job is `open_`, counting itself in `active_`, and leaves it
// decrementing `active_`. Once the caller has run out of tasks it closes the job and waits for `active_` to
// reach zero: then no worker can still be touching the job (or the caller's stack that `task` refers to),
// and the caller never waits for a worker that has not yet been scheduled: on a busy machine that can take
// milliseconds, and by then the caller has done the worker's share. Workers read the job only after taking
// `mutex_` in the wait, which orders them after its publication.
#include "cpu/parallel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace bmtwrap::cpu {
namespace {

// More threads than this is a mistake in the caller's arithmetic, not a request to honour.
constexpr int kMaxThreads = 256;

class ThreadPool {
 public:
  explicit ThreadPool(pid_t owner) : owner_(owner) {}
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  pid_t owner() const { return owner_; }

  // Held by the caller of run() for the duration of one job (see [Note: one job at a time]).
  std::mutex& busy() { return busy_; }

  // Runs the job on the calling thread and up to num_threads - 1 workers. The caller holds busy().
  void run(int num_tasks, int num_threads, TaskRef task) {
    int wanted = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      start_workers(num_threads - 1);
      task_ = &task;
      num_tasks_ = num_tasks;
      next_task_.store(0, std::memory_order_relaxed);
      error_ = nullptr;
      wanted = std::min<int>(num_threads - 1, static_cast<int>(workers_.size()));
      wanted_ = wanted;
      open_ = true;
      ++generation_;
    }
    for (int index = 0; index < wanted; ++index) {
      workers_[index]->wake.notify_one();  // workers_ only grows, and only under busy(), which we hold
    }
    run_tasks();
    std::unique_lock<std::mutex> lock(mutex_);
    open_ = false;
    finished_.wait(lock, [this] { return active_ == 0; });
    task_ = nullptr;
    if (error_) {
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }

 private:
  struct Worker {
    std::condition_variable wake;  // a generation that wants this worker has been published
    std::thread thread;
  };

  // Under mutex_. Fewer workers than asked for is not an error: the caller runs their share.
  void start_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size());
      Worker& worker = *workers_.emplace_back(std::make_unique<Worker>());
      try {
        worker.thread = std::thread([this, index, &worker] { work(index, worker.wake); });
      } catch (const std::system_error&) {
        workers_.pop_back();  // out of threads: go on with the workers we have
        return;
      }
    }
  }

  void work(int index, std::condition_variable& wake) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake.wait(lock, [&] { return generation_ != seen && index < wanted_; });
      seen = generation_;
      if (!open_) {
        continue;  // the caller has run every task already
      }
      ++active_;
      lock.unlock();
      run_tasks();
      lock.lock();
      if (--active_ == 0 && !open_) {
        finished_.notify_one();
      }
    }
  }

  void run_tasks() {
    for (int t = next_task_.fetch_add(1, std::memory_order_relaxed); t < num_tasks_;
         t = next_task_.fetch_add(1, std::memory_order_relaxed)) {
      try {
        (*task_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
        next_task_.store(num_tasks_, std::memory_order_relaxed);  // skip what is left
      }
    }
  }

  const pid_t owner_;
  std::mutex busy_;
  std::mutex mutex_;                              // guards everything below except next_task_
  std::condition_variable finished_;              // active_ has reached zero after the job closed
  std::vector<std::unique_ptr<Worker>> workers_;  // never joined: the pool lives as long as the process
  uint64_t generation_ = 0;
  int wanted_ = 0;     // workers with a smaller index are woken for the current job
  bool open_ = false;  // whether a woken worker may still join the current job
  int active_ = 0;     // workers inside the current job
  const TaskRef* task_ = nullptr;
  int num_tasks_ = 0;
  std::atomic<int> next_task_{0};
  std::exception_ptr error_;
};

// The pool of this process. A pool is never destroyed: its workers sleep until the process exits, and
// joining them from a static destructor could hang at interpreter shutdown. After fork() the child inherits
// the parent's pool object but none of its threads (and perhaps a locked mutex), so a process that finds
// another process's pool leaks it and starts its own.
ThreadPool& pool() {
  static std::atomic<ThreadPool*> current{nullptr};
  const pid_t pid = getpid();
  ThreadPool* existing = current.load(std::memory_order_acquire);
  if (existing != nullptr && existing->owner() == pid) {
    return *existing;
  }
  auto* fresh = new ThreadPool(pid);
  if (current.compare_exchange_strong(existing, fresh, std::memory_order_acq_rel)) {
    return *fresh;
  }
  delete fresh;  // another thread of this process installed its pool first; it has no workers yet
  return *existing;
}

}  // namespace

int threads_for(int64_t work_units, int64_t min_units_per_thread, int num_threads) {
  const int64_t available =
      num_threads > 0 ? num_threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t useful = work_units / std::max<int64_t>(1, min_units_per_thread);
  return static_cast<int>(std::clamp<int64_t>(useful, 1, std::min<int64_t>(available, kMaxThreads)));
}

void parallel_for(int num_tasks, int num_threads, TaskRef task) {
  if (num_tasks <= 1 || num_threads <= 1) {
    for (int t = 0; t < num_tasks; ++t) {
      task(t);
    }
    return;
  }
  ThreadPool& workers = pool();
  std::unique_lock<std::mutex> busy(workers.busy(), std::try_to_lock);
  if (!busy.owns_lock()) {
    for (int t = 0; t < num_tasks; ++t) {
      task(t);
    }
    return;
  }
  workers.run(num_tasks, std::min({num_threads, num_tasks, kMaxThreads}), task);
}

}  // namespace bmtwrap::cpu
