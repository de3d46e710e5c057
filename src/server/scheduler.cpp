#include "server/scheduler.h"

#include <algorithm>
#include <chrono>

#include "util/check.h"

namespace lily {

Scheduler::Scheduler(size_t max_queue, int parallel, DecodeBatch decode_batch)
    : max_queue_(max_queue), parallel_(parallel), decode_batch_(std::move(decode_batch)) {
  CHECK(parallel_ >= 1 && parallel_ <= kMaxParallel, "parallel %d outside [1, %d]", parallel_, kMaxParallel);
  worker_ = std::thread([this] { worker_loop(); });
}

Scheduler::~Scheduler() {
  stop(0);
}

Scheduler::Submit Scheduler::submit(std::shared_ptr<Job> job) {
  std::lock_guard lock(mu_);
  if (stopping_) return Submit::stopped;
  // The limit is on jobs waiting for a slot: those that free slots will take on the next step do not count, so
  // requests that arrive together while slots are free are not refused before the step thread admits them.
  const size_t free_slots = static_cast<size_t>(parallel_) - std::min(active_.size(), static_cast<size_t>(parallel_));
  if (queue_.size() >= max_queue_ + free_slots) return Submit::queue_full;
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

SlotCounts Scheduler::slots() const {
  return SlotCounts{prefilling_.load(), decoding_.load()};
}

bool Scheduler::slot_wanted() const {
  std::lock_guard lock(mu_);
  return !queue_.empty() && active_.size() < static_cast<size_t>(parallel_);
}

void Scheduler::worker_loop() {
  for (;;) {
    std::vector<std::shared_ptr<Job>> admitted, left;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !active_.empty(); });
      if (queue_.empty() && active_.empty()) return;  // stopping, and nothing left
      while (active_.size() < static_cast<size_t>(parallel_) && !queue_.empty()) {
        std::shared_ptr<Job> job = std::move(queue_.front());
        queue_.pop_front();
        if (job->cancel.load()) {
          left.push_back(std::move(job));
          continue;
        }
        active_.push_back(Slot{job});
        admitted.push_back(std::move(job));
        ++running_;
      }
    }
    for (auto& job : left) {
      ++dropped_;
      job->dropped();
    }
    for (auto& job : admitted) job->start();
    step();
    // Finished jobs leave their slots before finish() hands their results to the clients, so a client that
    // has its answer sees the slot free; finish() runs outside the lock.
    std::vector<std::shared_ptr<Job>> finished;
    {
      std::lock_guard lock(mu_);
      size_t n_prefilling = 0;
      for (auto it = active_.begin(); it != active_.end();) {
        if (it->job->done()) {
          finished.push_back(std::move(it->job));
          it = active_.erase(it);
          --running_;
        } else {
          n_prefilling += it->job->prefilling() ? 1 : 0;
          ++it;
        }
      }
      prefilling_.store(n_prefilling);
      decoding_.store(active_.size() - n_prefilling);
    }
    for (auto& job : finished) job->finish();
  }
}

// Only the worker changes active_, so it reads it here without the lock.
void Scheduler::step() {
  ++steps_;
  std::vector<Job*> decoding;
  Slot* piece = nullptr;  // the prefilling job that waited longest for a piece
  size_t n_prefilling = 0;
  for (Slot& s : active_) {
    if (s.job->done()) continue;
    if (s.job->prefilling()) {
      ++n_prefilling;
      if (piece == nullptr || s.last_piece < piece->last_piece) piece = &s;
    } else {
      decoding.push_back(s.job.get());
    }
  }
  prefilling_.store(n_prefilling);
  decoding_.store(decoding.size());
  if (piece == nullptr && decoding.size() == 1)
    return decoding[0]->run_alone([this] { return slot_wanted(); });
  if (piece != nullptr) {
    piece->last_piece = steps_;
    piece->job->prefill();
  }
  if (!decoding.empty()) decode_batch_(decoding);
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
  for (Slot& s : active_) s.job->cancel.store(true);
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
