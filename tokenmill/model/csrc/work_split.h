// Splitting uneven work over the threads: at::parallel_for gives each thread an equal count of items, which for
// attention is an unequal share of the work (a causal prefill's last tokens read many times the blocks its first
// ones do; decodes differ in context length), so one thread finishes early and waits at the barrier.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// fn(begin, end) over [0, costs.size()) in one contiguous range per thread, the ranges of about equal total cost:
// an item goes to the thread whose share holds the middle of its cost. Which thread computes an item never
// changes what it computes, so the split keeps batch invariance.
template <typename F>
void parallel_for_balanced(const std::vector<int64_t>& costs, const F& fn) {
  const int64_t n = static_cast<int64_t>(costs.size());
  if (n == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  std::vector<int64_t> bounds(threads + 1, n);
  bounds[0] = 0;
  int64_t before = 0, t = 1;
  for (int64_t i = 0; i < n && t < threads; ++i) {
    // 2 * (cost before i + half of i's) * threads >= 2 * total * t: i's middle lies past thread t's start
    while (t < threads && (2 * before + costs[i]) * threads >= 2 * total * t) bounds[t++] = i;
    before += costs[i];
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      if (bounds[k] < bounds[k + 1]) fn(bounds[k], bounds[k + 1]);
  });
}
