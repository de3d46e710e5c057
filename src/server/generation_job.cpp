#include "server/generation_job.h"

#include <cstdio>

#include "util/check.h"

namespace lily {

namespace {
constexpr int kClientCheckMs = 20;  // how often a waiting connection checks that its client is still there

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}
}  // namespace

GenerationJob::GenerationJob(Engine& engine, GenerationRequest request, Metrics& metrics, int timeout_ms)
    : engine_(engine), request_(std::move(request)), metrics_(metrics), timeout_ms_(timeout_ms) {
  request_.cancel = &cancel;
}

void GenerationJob::check_deadline() {
  int64_t started = started_ns_.load();
  if (timeout_ms_ <= 0 || started == 0 || timed_out_.load()) return;
  if (now_ns() - started >= int64_t{timeout_ms_} * 1000000) {
    timed_out_.store(true);
    cancel.store(true);
  }
}

void GenerationJob::start() {
  started_ns_.store(now_ns());
  guarded([&] {
    Result<std::unique_ptr<Generation>> g =
        engine_.begin(request_, [this](const GenerationPiece& piece) { return on_piece(piece); });
    if (g.ok())
      generation_ = std::move(*g);
    else
      failure_ = g.status();
  });
}

bool GenerationJob::prefilling() const {
  return generation_ && generation_->prefilling();
}

void GenerationJob::prefill() {
  guarded([&] { engine_.prefill_step(*generation_); });
}

void GenerationJob::run_alone(const std::function<bool()>& yield) {
  guarded([&] { engine_.run_alone(*generation_, yield); });
}

bool GenerationJob::done() const {
  return !generation_ || generation_->done();
}

void GenerationJob::decode_together(std::span<Job* const> jobs) {
  std::vector<GenerationJob*> mine;
  std::vector<Generation*> generations;
  for (Job* j : jobs) {
    auto* g = dynamic_cast<GenerationJob*>(j);
    CHECK(g != nullptr && g->generation_, "decode_together: a job that is not a decodable generation");
    CHECK(mine.empty() || &g->engine_ == &mine.front()->engine_,
          "decode_together: generations of two engines");
    mine.push_back(g);
    generations.push_back(g->generation_.get());
  }
  if (mine.empty()) return;
  try {
    mine.front()->engine_.decode_step(generations);
  } catch (const std::exception& e) {  // never past the scheduler's thread: each request gets a 500
    for (GenerationJob* g : mine) g->fail(e.what());
  }
}

void GenerationJob::finish() {
  Result<GenerationResult> result = error(ErrorCode::internal, "the generation did not run");
  if (failure_) {
    result = *failure_;
  } else {
    try {
      result = engine_.finish(std::move(generation_));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lily serve: the generation failed: %s\n", e.what());
      result = error(ErrorCode::internal, "the generation failed: %s", e.what());
    }
  }
  generation_.reset();
  if (result.ok() && timed_out_.load() && result->finish_reason == "cancelled")
    result->finish_reason = "length";
  if (result.ok()) metrics_.record_generation(*result);
  {
    std::lock_guard lock(mu_);
    result_.emplace(std::move(result));
  }
  cv_.notify_one();
}

void GenerationJob::guarded(const std::function<void()>& step) {
  try {
    step();
  } catch (const std::exception& e) {  // never past the scheduler's thread: the request gets a 500
    fail(e.what());
  }
}

void GenerationJob::fail(const std::string& what) {
  std::fprintf(stderr, "lily serve: the generation failed: %s\n", what.c_str());
  failure_ = error(ErrorCode::internal, "the generation failed: %s", what.c_str());
  generation_.reset();
}

bool GenerationJob::on_piece(const GenerationPiece& piece) {
  auto now = Clock::now();
  if (!first_piece_)
    metrics_.observe_token_latency(std::chrono::duration<double>(now - last_piece_at_).count());
  first_piece_ = false;
  last_piece_at_ = now;
  {
    std::lock_guard lock(mu_);
    pieces_.push_back(piece);
  }
  cv_.notify_one();
  return !cancel.load();
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
        job->check_deadline();
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
        job->check_deadline();
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
