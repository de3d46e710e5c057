#include "server/scheduler.h"

#include <algorithm>
#include <chrono>

namespace lily {

Scheduler::Scheduler(size_t max_queue) : max_queue_(max_queue) {
  worker_ = std::thread([this] { worker_loop(); });
}

Scheduler::~Scheduler() {
  stop(0);
}

Scheduler::Submit Scheduler::submit(std::shared_ptr<Job> job) {
  std::lock_guard lock(mu_);
  if (stopping_) return Submit::stopped;
  if (queue_.size() >= max_queue_) return Submit::queue_full;
  queue_.push_back(std::move(job));
  cv_.notify_one();
  return Submit::accepted;
}

bool Scheduler::withdraw(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard lock(mu_);
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it == queue_.end()) return false;
    queue_.erase(it);
  }
  ++dropped_;
  job->dropped();
  return true;
}

size_t Scheduler::queue_depth() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void Scheduler::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      if (!job->cancel.load()) {
        current_ = job;
        ++running_;
      }
    }
    if (job->cancel.load()) {
      ++dropped_;
      job->dropped();
      continue;
    }
    job->run();
    std::lock_guard lock(mu_);
    current_.reset();
    --running_;
  }
}

void Scheduler::close() {
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    left.swap(queue_);
    cv_.notify_all();
  }
  for (auto& job : left) {
    ++dropped_;
    job->dropped();
  }
}

void Scheduler::cancel_running() {
  std::lock_guard lock(mu_);
  if (current_) current_->cancel.store(true);
}

void Scheduler::stop(int grace_ms) {
  // Serialized: the signal's shutdown and the end of Server::run() both stop the scheduler, and two threads
  // joining one std::thread at once is undefined (it hung about one SIGTERM in four with a stream in flight).
  std::lock_guard stop_lock(stop_mu_);
  close();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  while (running_.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  cancel_running();
  if (worker_.joinable()) worker_.join();
}

}  // namespace lily
