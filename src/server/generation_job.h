// One generation as a scheduler Job: the worker runs Engine::generate and hands each piece over to the
// connection thread through a small channel, so a slow client never stalls the worker and pieces of different
// requests can never interleave. The connection thread drives the job with drive(): it waits for pieces,
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

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/scheduler.h"

namespace lily {

class GenerationJob : public Job {
 public:
  // engine and metrics must outlive the job's run. timeout_ms > 0: the generation may run that long on the
  // worker (then it ends with finish_reason "length"; see check_deadline).
  GenerationJob(Engine& engine, GenerationRequest request, Metrics& metrics, int timeout_ms = 0);

  void run() override;
  void dropped() override;

  enum class Event { piece, finished, dropped, timeout };
  // Waits up to timeout_ms for the next piece (moved into `piece`) or the end.
  Event next(GenerationPiece& piece, int timeout_ms);
  // Valid after Event::finished.
  const Result<GenerationResult>& result() const { return *result_; }
  // Called by the connection thread while it waits: past the timeout since run() began, the generation is
  // stopped (prefill or decode, within one token) and reported as finish_reason "length".
  void check_deadline();
  bool timed_out() const { return timed_out_.load(); }

 private:
  Result<GenerationResult> generate(std::chrono::steady_clock::time_point& last, bool& first);

  Engine& engine_;
  GenerationRequest request_;
  Metrics& metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerationPiece> pieces_;
  std::optional<Result<GenerationResult>> result_;
  bool dropped_ = false;
  const int timeout_ms_;
  std::atomic<int64_t> started_ns_{0};  // steady clock at run(); 0: not running yet
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
