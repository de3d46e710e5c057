// Request scheduling. Requests run one at a time (batch 1, the design point: docs/DESIGN.md section 5) on
// one worker thread, in arrival order, from a bounded queue. A full queue refuses new work (the server
// answers 429). A queued job whose client left is withdrawn (or dropped when the worker reaches it) without
// running; a running job watches its own cancel flag between tokens.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace lily {

class Job {
 public:
  virtual ~Job() = default;
  virtual void run() = 0;      // on the worker thread
  virtual void dropped() = 0;  // never run: cancelled while queued, withdrawn, or the scheduler stopped
  std::atomic<bool> cancel{false};
};

class Scheduler {
 public:
  explicit Scheduler(size_t max_queue);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  enum class Submit { accepted, queue_full, stopped };
  Submit submit(std::shared_ptr<Job> job);
  // Removes a job that is still queued and calls its dropped(); false when it already ran or is running.
  bool withdraw(const std::shared_ptr<Job>& job);

  size_t queue_depth() const;
  size_t running() const { return running_.load(); }
  size_t dropped_count() const { return dropped_.load(); }

  // Stops taking jobs and drops the queued ones; the running job goes on.
  void close();
  void cancel_running();
  // close(); waits up to `grace_ms` for the running job, then cancels it; joins the worker. Idempotent and
  // thread-safe: a second caller waits for the first to finish.
  void stop(int grace_ms);

 private:
  void worker_loop();

  const size_t max_queue_;
  mutable std::mutex mu_;
  std::mutex stop_mu_;  // one stop() at a time
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::shared_ptr<Job> current_;
  bool stopping_ = false;
  std::atomic<size_t> running_{0}, dropped_{0};
  std::thread worker_;
};

}  // namespace lily
