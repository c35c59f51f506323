// A persistent pool of worker threads shared by the multithreaded CPU kernels (Adam, inf/nan check).
//
// Why a pool: the optimizer calls the kernels once per parameter group per step, often on buffers of a few
// MiB, where starting std::threads (tens of microseconds each) would cost as much as the work. Waking a
// parked worker costs a few microseconds.
//
// Why not OpenMP: a second OpenMP runtime next to the one torch bundles oversubscribes cores, and GNU
// libgomp is not fork-safe (DataLoader workers fork). This pool is: a child process notices that it is not
// the process that started the workers and starts its own (see pool() in parallel.cpp).
//
// Invariants:
//   - parallel_for returns only after every task has finished, so tasks may reference the caller's stack.
//   - Every task runs exactly once, on the calling thread or on a worker; which one is unspecified, so a
//     task's result must not depend on the thread that runs it.
//   - One job at a time. A caller that finds the pool busy (another Python thread that released the GIL, or
//     a task that itself calls parallel_for) runs all its tasks on its own thread: slower, never a deadlock.
//   - If workers cannot be started (std::system_error), the calling thread runs the tasks they would have run.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace bmtwrap::cpu {

// A non-owning reference to a callable `void(int task)`: parallel_for's callee is never copied or stored
// beyond the call, so no std::function (and no allocation) is needed.
class TaskRef {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, TaskRef>>>
  TaskRef(F&& f)  // NOLINT(google-explicit-constructor): built implicitly from a lambda at the call site
      : object_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* object, int task) { (*static_cast<std::remove_reference_t<F>*>(object))(task); }) {}

  void operator()(int task) const { call_(object_, task); }

 private:
  void* object_;
  void (*call_)(void*, int);
};

// The number of threads a kernel should use for `work_units` units of work of which each thread needs at
// least `min_units_per_thread` to pay for its wake-up: between 1 and `num_threads` (0 = one per hardware
// thread).
int threads_for(int64_t work_units, int64_t min_units_per_thread, int num_threads);

// Runs task(0) ... task(num_tasks - 1), each once, spread over the calling thread and up to num_threads - 1
// pool workers (never more threads than tasks), and returns when all have finished. Tasks are handed out in
// increasing order as threads become free, so more tasks than threads balance the load when some threads
// run slower (a core shared with another process, say). The first exception a task throws is rethrown here
// after every task has finished or been skipped.
void parallel_for(int num_tasks, int num_threads, TaskRef task);

}  // namespace bmtwrap::cpu
