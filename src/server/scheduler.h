// Request scheduling with continuous batching (docs/DESIGN.md section 4, "Several streams"). Up to `parallel`
// requests are active at once, each in a slot, admitted in arrival order from a bounded queue; a full queue
// refuses new work (the server answers 429). One thread runs steps: it admits queued jobs into free slots,
// gives one prefilling job one bounded piece of its prompt (round-robin: the job that waited longest for a
// piece), then makes one token for every decoding job in one batched call, so running streams keep
// streaming while a new prompt is read. A job that is the only one active, with no queued job that a free
// slot could take, runs on the single-request path (Job::run_alone: on the CUDA backend the device-side loop)
// and is asked between tokens to make way as soon as such a job arrives; with --parallel 1 that is every job,
// as before batching. A queued job whose client left is withdrawn (or dropped when reached) without running;
// an active job watches its own cancel flag between tokens.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace lily {

// One request as the scheduler drives it, on its thread: start() once when admitted, then prefill() while
// prefilling(), then decode steps (run_alone, or the scheduler's DecodeBatch) until done(), then finish()
// once, which frees the slot. Any of them may end the job (done() then true). None may throw.
class Job {
 public:
  virtual ~Job() = default;
  virtual void start() = 0;
  virtual bool prefilling() const = 0;
  virtual void prefill() = 0;  // one bounded piece of the prompt
  // Decodes until the job ends or yield(), asked between tokens, returns true.
  virtual void run_alone(const std::function<bool()>& yield) = 0;
  virtual bool done() const = 0;
  virtual void finish() = 0;
  virtual void dropped() = 0;  // never admitted: cancelled while queued, withdrawn, or the scheduler stopped
  std::atomic<bool> cancel{false};
};

// One token for each of these jobs (admitted, prefilled, not done) in one call.
using DecodeBatch = std::function<void(std::span<Job* const>)>;

struct SlotCounts {
  size_t prefilling = 0, decoding = 0;  // the rest of the `parallel` slots are idle
};

class Scheduler {
 public:
  static constexpr int kMaxParallel = 16;
  // parallel in [1, kMaxParallel] (the caller validates it).
  Scheduler(size_t max_queue, int parallel, DecodeBatch decode_batch);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  enum class Submit { accepted, queue_full, stopped };
  Submit submit(std::shared_ptr<Job> job);
  // Removes a job that is still queued and calls its dropped(); false when it was admitted already.
  bool withdraw(const std::shared_ptr<Job>& job);

  int parallel() const { return parallel_; }
  size_t queue_depth() const;
  size_t running() const { return running_.load(); }  // admitted and not finished
  SlotCounts slots() const;                           // as of the last step
  size_t dropped_count() const { return dropped_.load(); }

  // Stops taking jobs and drops the queued ones; the active jobs go on.
  void close();
  void cancel_running();
  // close(); waits up to `grace_ms` for the active jobs, then cancels them; joins the thread. Idempotent and
  // thread-safe: a second caller waits for the first to finish.
  void stop(int grace_ms);

 private:
  struct Slot {
    std::shared_ptr<Job> job;
    uint64_t last_piece = 0;  // the step of its last prefill piece (0: none yet)
  };
  void worker_loop();
  void step();
  bool slot_wanted() const;  // a queued job could take a free slot

  const size_t max_queue_;
  const int parallel_;
  const DecodeBatch decode_batch_;
  mutable std::mutex mu_;
  std::mutex stop_mu_;  // one stop() at a time
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<Slot> active_;  // admission order; changed by the worker under mu_
  uint64_t steps_ = 0;        // the worker's
  bool stopping_ = false;
  std::atomic<size_t> running_{0}, dropped_{0}, prefilling_{0}, decoding_{0};
  std::thread worker_;
};

}  // namespace lily
