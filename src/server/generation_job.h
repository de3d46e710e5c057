// One generation as a scheduler Job: on the scheduler's thread the job advances through the engine's steps
// (Engine::begin, prefill_step, run_alone or decode_step beside other jobs, finish) and hands each piece over
// to the connection thread through a small channel, so a slow client never stalls the scheduler and pieces of
// different requests never mix. The connection thread drives the job with drive(): it waits for pieces,
// writes them, and checks between them that the client is still connected; when it is not, the job is
// cancelled (the engine stops within one token) or, if still queued, withdrawn without running.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/scheduler.h"

namespace lily {

class GenerationJob : public Job {
 public:
  // engine and metrics must outlive the job. timeout_ms > 0: the generation may run that long once admitted
  // (then it ends with finish_reason "length"; see check_deadline).
  GenerationJob(Engine& engine, GenerationRequest request, Metrics& metrics, int timeout_ms = 0);

  void start() override;
  bool prefilling() const override;
  void prefill() override;
  void run_alone(const std::function<bool()>& yield) override;
  bool done() const override;
  void finish() override;
  void dropped() override;
  // The scheduler's DecodeBatch: one Engine::decode_step over these jobs (GenerationJobs of one engine).
  static void decode_together(std::span<Job* const> jobs);

  enum class Event { piece, finished, dropped, timeout };
  // Waits up to timeout_ms for the next piece (moved into `piece`) or the end.
  Event next(GenerationPiece& piece, int timeout_ms);
  // Valid after Event::finished.
  const Result<GenerationResult>& result() const { return *result_; }
  // Called by the connection thread while it waits: past the timeout since start(), the generation is
  // stopped (prefill or decode, within one token) and reported as finish_reason "length".
  void check_deadline();
  bool timed_out() const { return timed_out_.load(); }

 private:
  bool on_piece(const GenerationPiece& piece);  // on the scheduler's thread
  // Runs an engine step; an exception ends the generation as a 500 (its sequence is dropped).
  void guarded(const std::function<void()>& step);
  void fail(const std::string& what);

  Engine& engine_;
  GenerationRequest request_;
  Metrics& metrics_;
  std::unique_ptr<Generation> generation_;  // between start() and finish()
  std::optional<Status> failure_;           // start() or a step failed: finish() reports it
  std::chrono::steady_clock::time_point last_piece_at_;
  bool first_piece_ = true;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerationPiece> pieces_;
  std::optional<Result<GenerationResult>> result_;
  bool dropped_ = false;
  const int timeout_ms_;
  std::atomic<int64_t> started_ns_{0};  // steady clock at start(); 0: not admitted yet
  std::atomic<bool> timed_out_{false};
};

enum class DriveOutcome {
  finished,     // result() holds the engine's result (which may be an error or "cancelled")
  client_gone,  // the client disconnected: the job was cancelled or withdrawn
  dropped,      // never ran: the server is shutting down
  queue_full,   // refused by the scheduler
  stopped,      // refused: the scheduler no longer takes work
};

// Submits the job, calls on_accepted once it is queued (false: the client is gone), and feeds its pieces to
// on_piece (which returns false when writing to the client failed)
// until it ends, checking between pieces (and every 20 ms while waiting) that the client is still there.
DriveOutcome drive(Scheduler& scheduler, const std::shared_ptr<GenerationJob>& job, HttpExchange& exchange,
                   const std::function<bool()>& on_accepted,
                   const std::function<bool(const GenerationPiece&)>& on_piece);

}  // namespace lily
