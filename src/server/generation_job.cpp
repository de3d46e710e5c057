#include "server/generation_job.h"

namespace lily {

namespace {
constexpr int kClientCheckMs = 20;  // how often a waiting connection checks that its client is still there
}

GenerationJob::GenerationJob(Engine& engine, GenerationRequest request, Metrics& metrics)
    : engine_(engine), request_(std::move(request)), metrics_(metrics) {
  request_.cancel = &cancel;
}

void GenerationJob::run() {
  using Clock = std::chrono::steady_clock;
  auto last = Clock::now();
  bool first = true;
  Result<GenerationResult> result = engine_.generate(request_, [&](const GenerationPiece& piece) {
    auto now = Clock::now();
    if (!first) metrics_.observe_token_latency(std::chrono::duration<double>(now - last).count());
    first = false;
    last = now;
    {
      std::lock_guard lock(mu_);
      pieces_.push_back(piece);
    }
    cv_.notify_one();
    return !cancel.load();
  });
  if (result.ok()) metrics_.record_generation(*result);
  {
    std::lock_guard lock(mu_);
    result_.emplace(std::move(result));
  }
  cv_.notify_one();
}

void GenerationJob::dropped() {
  {
    std::lock_guard lock(mu_);
    dropped_ = true;
  }
  cv_.notify_one();
}

GenerationJob::Event GenerationJob::next(GenerationPiece& piece, int timeout_ms) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
               [&] { return !pieces_.empty() || result_.has_value() || dropped_; });
  if (!pieces_.empty()) {  // pieces first: the result comes after the last of them
    piece = std::move(pieces_.front());
    pieces_.pop_front();
    return Event::piece;
  }
  if (result_.has_value()) return Event::finished;
  if (dropped_) return Event::dropped;
  return Event::timeout;
}

DriveOutcome drive(Scheduler& scheduler, const std::shared_ptr<GenerationJob>& job, HttpExchange& exchange,
                   const std::function<bool()>& on_accepted,
                   const std::function<bool(const GenerationPiece&)>& on_piece) {
  switch (scheduler.submit(job)) {
    case Scheduler::Submit::queue_full:
      return DriveOutcome::queue_full;
    case Scheduler::Submit::stopped:
      return DriveOutcome::stopped;
    case Scheduler::Submit::accepted:
      break;
  }
  if (!on_accepted()) {
    job->cancel.store(true);
    scheduler.withdraw(job);
    return DriveOutcome::client_gone;
  }
  GenerationPiece piece;
  for (;;) {
    switch (job->next(piece, kClientCheckMs)) {
      case GenerationJob::Event::piece:
        if (!on_piece(piece) || exchange.client_gone()) {
          job->cancel.store(true);
          return DriveOutcome::client_gone;
        }
        break;
      case GenerationJob::Event::finished:
        return DriveOutcome::finished;
      case GenerationJob::Event::dropped:
        return job->cancel.load() ? DriveOutcome::client_gone : DriveOutcome::dropped;
      case GenerationJob::Event::timeout:
        if (exchange.client_gone()) {
          job->cancel.store(true);
          scheduler.withdraw(job);  // still queued: leaves without running; running: stops within a token
          return DriveOutcome::client_gone;
        }
        break;
    }
  }
}

}  // namespace lily
