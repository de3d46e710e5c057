#include "util/thread_pool.h"

#include <algorithm>

namespace lily {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t max_chunks = std::max<int64_t>(1, n / grain);
  int64_t chunks = std::min<int64_t>(max_chunks, static_cast<int64_t>(size()) * 4);
  if (chunks <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = (n + chunks - 1) / chunks;
  n_chunks_ = (n + job_chunk_ - 1) / job_chunk_;
  next_chunk_ = 0;
  chunks_done_ = 0;
  ++generation_;
  cv_work_.notify_all();
  // The calling thread works too.
  while (next_chunk_ < n_chunks_) {
    int64_t c = next_chunk_++;
    lock.unlock();
    fn(c * job_chunk_, std::min(n, (c + 1) * job_chunk_));
    lock.lock();
    ++chunks_done_;
  }
  cv_done_.wait(lock, [&] { return chunks_done_ == n_chunks_; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stop_ || (generation_ != seen && job_ && next_chunk_ < n_chunks_); });
    if (stop_) return;
    seen = generation_;
    while (job_ && next_chunk_ < n_chunks_) {
      int64_t c = next_chunk_++;
      const auto* fn = job_;
      int64_t n = job_n_, chunk = job_chunk_;
      lock.unlock();
      (*fn)(c * chunk, std::min(n, (c + 1) * chunk));
      lock.lock();
      if (++chunks_done_ == n_chunks_) cv_done_.notify_all();
    }
  }
}

}  // namespace lily
