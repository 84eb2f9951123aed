// Work sharing over a task pool (XLA's CPU intra-op thread pool, which the
// FFI handlers hand in as a TaskPool) for the CPU kernels with enough work
// to split.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

namespace jax_moe {

// A pool of worker threads, type-erased so that kernels need no XLA header
// (ffi/ffi_common.h makes one from ffi::ThreadPool). The default runs
// everything on the calling thread.
struct TaskPool {
  int64_t threads = 1;
  void* impl = nullptr;
  void (*schedule)(void* impl, std::function<void()> task) = nullptr;

  int64_t num_threads() const { return schedule ? threads : 1; }
  void Schedule(std::function<void()> task) const { schedule(impl, std::move(task)); }
};

// Runs body(i) once for every i in [0, n), on the calling thread and on up to
// num_threads - 1 pool tasks, and returns when all n are done. The caller
// works through the indices itself and then waits only for indices that a
// running task has claimed, so a busy pool (or one whose task never starts)
// cannot deadlock it. A task that starts after the caller returned finds no
// index left and touches only the shared counters, which it co-owns.
template <typename Body>
void ParallelFor(const TaskPool& pool, int64_t n, const Body& body) {
  if (n <= 0) return;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &body] {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      body(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace jax_moe
