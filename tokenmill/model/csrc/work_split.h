// Splitting work over the threads as they go: at::parallel_for gives each thread an equal count of items up
// front, so any difference in their speed (uneven items: a causal prefill's last tokens read many times the
// blocks its first ones do, decodes differ in context length; or a thread that starts a region late or is slowed
// by another process on its core) leaves one thread waiting at the region's end barrier: ~15% of a 64-row decode
// step's thread time on 2 cores (perf). Here each thread takes the next chunk of items when it is done with
// its last. Which thread computes an item never changes what it computes, so the split keeps batch invariance.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// Items [0, n), handed out a chunk at a time, in order: `chunk` items each, or with `guided` > 0 a 1/guided share
// of the items left (at least `chunk`), so the first chunks are long runs and the last ones short.
class WorkQueue {
 public:
  WorkQueue(int64_t n, int64_t chunk, int64_t guided = 0)
      : n_(n), chunk_(std::max<int64_t>(chunk, 1)), guided_(guided) {}
  // The next chunk [begin, end); false once every item is taken.
  bool take(int64_t& begin, int64_t& end) {
    if (guided_ > 0) {
      int64_t next = next_.load(std::memory_order_relaxed);
      for (;;) {
        if (next >= n_) return false;
        const int64_t size = std::max(chunk_, (n_ - next) / guided_);
        if (next_.compare_exchange_weak(next, next + size, std::memory_order_relaxed)) {
          begin = next, end = std::min(n_, next + size);
          return true;
        }
      }
    }
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(n_, begin + chunk_);
    return true;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_, chunk_, guided_;
};

// fn(queue) once on each thread (so per-thread scratch is set up once), every thread taking chunks (of `chunk`
// items, or guided: WorkQueue) from one shared queue until none is left.
template <typename F>
void parallel_take(int64_t n, int64_t chunk, const F& fn, int64_t guided = 0) {
  if (n <= 0) return;
  WorkQueue queue(n, chunk, guided);
  const int64_t chunks = (n + std::max<int64_t>(chunk, 1) - 1) / std::max<int64_t>(chunk, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(queue);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { fn(queue); });
}
