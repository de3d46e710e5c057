// The step scheduler: admission in arrival order into at most `parallel` slots, a bounded queue, prefill
// pieces handed out round-robin between batched decode steps, a lone job on the single-request path that
// makes way when another arrives, withdrawn and cancelled jobs that never run, and stop() dropping what is
// queued while the active jobs finish or are cancelled.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "server/scheduler.h"

namespace lily {
namespace {

struct Log {
  std::mutex mu;
  std::vector<std::string> events;
  std::atomic<int> active{0}, max_active{0};
  void add(const std::string& e) {
    std::lock_guard lock(mu);
    events.push_back(e);
  }
  std::vector<std::string> snapshot() {
    std::lock_guard lock(mu);
    return events;
  }
  bool has(const std::string& e) {
    std::lock_guard lock(mu);
    return std::find(events.begin(), events.end(), e) != events.end();
  }
};

// A request of `pieces` prefill pieces and `tokens` decode tokens. Each token waits for `gate` (when given)
// or cancellation, then takes `token_ms`.
class StepJob : public Job {
 public:
  StepJob(Log& log, std::string name, int pieces, int tokens, std::atomic<bool>* gate = nullptr,
          int token_ms = 0)
      : log_(log),
        name_(std::move(name)),
        pieces_(pieces),
        tokens_(tokens),
        gate_(gate),
        token_ms_(token_ms) {}
  void start() override {
    log_.add(name_ + " start");
    const int now = ++log_.active;
    int prev = log_.max_active.load();
    while (now > prev && !log_.max_active.compare_exchange_weak(prev, now)) {
    }
    if (tokens_ == 0) ended_ = true;  // a request that fails at once (a validation error, say)
  }
  bool prefilling() const override { return pieces_ > 0 && !ended_; }
  void prefill() override {
    log_.add(name_ + " prefill");
    if (cancel.load())
      ended_ = true;
    else
      --pieces_;
  }
  void run_alone(const std::function<bool()>& yield) override {
    log_.add(name_ + " alone");
    while (!ended_) {
      token();
      if (yield()) return;
    }
  }
  bool done() const override { return ended_; }
  void finish() override {
    --log_.active;
    log_.add(name_ + " finish");
  }
  void dropped() override { log_.add(name_ + " dropped"); }

  void token() {
    while (gate_ != nullptr && !gate_->load() && !cancel.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (cancel.load()) {
      ended_ = true;
      return;
    }
    if (token_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(token_ms_));
    if (--tokens_ == 0) ended_ = true;
  }
  const std::string& name() const { return name_; }

 private:
  Log& log_;
  std::string name_;
  int pieces_, tokens_;
  std::atomic<bool>* gate_;
  int token_ms_;
  std::atomic<bool> ended_{false};
};

DecodeBatch batch_of(Log& log) {
  return [&log](std::span<Job* const> jobs) {
    std::string e = "batch";
    for (Job* j : jobs) e += " " + static_cast<StepJob*>(j)->name();
    log.add(e);
    for (Job* j : jobs) static_cast<StepJob*>(j)->token();
  };
}

void wait_for(const std::function<bool()>& cond) {
  for (int i = 0; i < 5000 && !cond(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(cond());
}

std::vector<std::string> finishes(const std::vector<std::string>& events) {
  std::vector<std::string> out;
  for (const auto& e : events)
    if (e.ends_with(" finish")) out.push_back(e.substr(0, e.size() - 7));
  return out;
}

TEST(Scheduler, OneSlotRunsOneJobAtATimeInArrivalOrder) {
  Log log;
  Scheduler s(100, 1, batch_of(log));
  for (int i = 0; i < 20; ++i)
    ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, std::to_string(i), 2, 3)), Scheduler::Submit::accepted);
  wait_for([&] { return finishes(log.snapshot()).size() == 20; });
  EXPECT_EQ(log.max_active.load(), 1);
  std::vector<std::string> events = log.snapshot(), expected;
  for (int i = 0; i < 20; ++i) {
    const std::string n = std::to_string(i);
    expected.insert(expected.end(),
                    {n + " start", n + " prefill", n + " prefill", n + " alone", n + " finish"});
  }
  EXPECT_EQ(events, expected);  // with one slot, never a batch: the single-request path only
}

TEST(Scheduler, AtMostParallelJobsAreActiveAndAdmittedInArrivalOrder) {
  Log log;
  Scheduler s(100, 3, batch_of(log));
  for (int i = 0; i < 10; ++i)
    ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, std::to_string(i), 1, 4, nullptr, 1)),
              Scheduler::Submit::accepted);
  wait_for([&] { return finishes(log.snapshot()).size() == 10; });
  EXPECT_EQ(log.max_active.load(), 3);
  std::vector<std::string> starts;
  for (const auto& e : log.snapshot())
    if (e.ends_with(" start")) starts.push_back(e.substr(0, e.size() - 6));
  EXPECT_EQ(starts, (std::vector<std::string>{"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"}));
}

// Prompts are read one piece a step, the job that waited longest first, and every step also decodes the
// jobs that are past their prompts, so a running stream keeps streaming while new prompts are read.
TEST(Scheduler, PrefillPiecesTakeTurnsBetweenDecodeSteps) {
  Log log;
  Scheduler s(100, 4, batch_of(log));
  std::atomic<bool> gate{false};
  auto blocker = std::make_shared<StepJob>(log, "G", 0, 1, &gate);  // holds the thread while A, B, C queue
  ASSERT_EQ(s.submit(blocker), Scheduler::Submit::accepted);
  wait_for([&] { return log.has("G alone"); });
  for (auto [name, pieces, tokens] : {std::tuple{"A", 0, 20}, {"B", 3, 2}, {"C", 3, 2}})
    ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, name, pieces, tokens)), Scheduler::Submit::accepted);
  gate.store(true);
  wait_for([&] { return finishes(log.snapshot()).size() == 4; });
  const std::vector<std::string> expected = {
      "G start",   "G alone",   "G finish",    "A start",  "B start",   "C start",  "B prefill", "batch A",
      "C prefill", "batch A",   "B prefill",   "batch A",  "C prefill", "batch A",  "B prefill", "batch A",
      "C prefill", "batch A B", "batch A B C", "B finish", "batch A C", "C finish", "A alone",   "A finish"};
  EXPECT_EQ(log.snapshot(), expected);
}

// A job alone decodes on the single-request path; one that arrives behind it is admitted at the next token
// and a short request finishes long before the long one.
TEST(Scheduler, LoneJobMakesWayForANewcomer) {
  Log log;
  Scheduler s(100, 2, batch_of(log));
  auto longer = std::make_shared<StepJob>(log, "long", 1, 2000, nullptr, 1);
  ASSERT_EQ(s.submit(longer), Scheduler::Submit::accepted);
  wait_for([&] { return log.has("long alone"); });
  ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, "short", 1, 1)), Scheduler::Submit::accepted);
  wait_for([&] { return log.has("short finish"); });
  EXPECT_FALSE(longer->done());
  EXPECT_EQ(log.max_active.load(), 2);
  std::vector<std::string> events = log.snapshot();
  auto at = [&](const std::string& e) { return std::find(events.begin(), events.end(), e) - events.begin(); };
  EXPECT_LT(at("long alone"), at("short start"));
  EXPECT_LT(at("short prefill"), at("batch long"));  // the long one decodes beside the short one's prompt
  EXPECT_LT(at("batch long short"), at("short finish"));
  longer->cancel.store(true);
  wait_for([&] { return log.has("long finish"); });
}

// The queue bound counts jobs waiting for a slot: with 2 slots and a queue of 1, three requests that arrive together
// are all taken, whether or not the step thread has admitted the first ones yet, and the fourth is refused.
TEST(Scheduler, RequestsArrivingTogetherFillTheFreeSlotsBeforeTheQueue) {
  Log log;
  std::atomic<bool> gate{false};
  Scheduler s(1, 2, batch_of(log));
  std::vector<std::shared_ptr<StepJob>> jobs;
  for (int i = 0; i < 3; ++i) {
    jobs.push_back(std::make_shared<StepJob>(log, std::to_string(i), 0, 1, &gate));
    ASSERT_EQ(s.submit(jobs.back()), Scheduler::Submit::accepted) << i;
  }
  EXPECT_EQ(s.submit(std::make_shared<StepJob>(log, "3", 0, 1)), Scheduler::Submit::queue_full);
  gate.store(true);
  wait_for([&] { return s.running() == 0 && s.queue_depth() == 0; });
}

TEST(Scheduler, BoundedQueueWithdrawAndCancel) {
  Log log;
  std::atomic<bool> gate{false};
  Scheduler s(2, 1, batch_of(log));
  auto blocker = std::make_shared<StepJob>(log, "0", 0, 1, &gate);
  ASSERT_EQ(s.submit(blocker), Scheduler::Submit::accepted);
  wait_for([&] { return log.has("0 alone"); });
  auto a = std::make_shared<StepJob>(log, "1", 0, 1), b = std::make_shared<StepJob>(log, "2", 0, 1);
  ASSERT_EQ(s.submit(a), Scheduler::Submit::accepted);
  ASSERT_EQ(s.submit(b), Scheduler::Submit::accepted);
  EXPECT_EQ(s.queue_depth(), 2u);
  EXPECT_EQ(s.submit(std::make_shared<StepJob>(log, "3", 0, 1)), Scheduler::Submit::queue_full);
  EXPECT_TRUE(s.withdraw(a));         // its client left while queued
  EXPECT_FALSE(s.withdraw(a));        // only once
  EXPECT_FALSE(s.withdraw(blocker));  // admitted: not withdrawable
  b->cancel.store(true);              // cancelled while queued: dropped when reached
  gate.store(true);
  wait_for([&] { return s.dropped_count() == 2 && s.running() == 0 && s.queue_depth() == 0; });
  EXPECT_EQ(log.snapshot(),
            (std::vector<std::string>{"0 start", "0 alone", "1 dropped", "0 finish", "2 dropped"}));
}

TEST(Scheduler, SlotCountsFollowTheJobs) {
  Log log;
  Scheduler s(10, 4, batch_of(log));
  EXPECT_EQ(s.parallel(), 4);
  auto a = std::make_shared<StepJob>(log, "A", 0, 100000, nullptr, 1);
  auto b = std::make_shared<StepJob>(log, "B", 0, 100000, nullptr, 1);
  ASSERT_EQ(s.submit(a), Scheduler::Submit::accepted);
  ASSERT_EQ(s.submit(b), Scheduler::Submit::accepted);
  wait_for([&] { return s.running() == 2 && s.slots().decoding == 2; });
  EXPECT_EQ(s.slots().prefilling, 0u);
  a->cancel.store(true);
  b->cancel.store(true);
  wait_for([&] { return s.running() == 0 && s.slots().decoding == 0; });
}

TEST(Scheduler, StopDropsQueuedAndCancelsActiveAfterGrace) {
  Log log;
  std::atomic<bool> open{false}, never{false};  // only cancellation ends jobs 0 and 1
  Scheduler s(10, 2, batch_of(log));
  ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, "G", 0, 1, &open)), Scheduler::Submit::accepted);
  wait_for([&] { return log.has("G alone"); });
  for (const char* name : {"0", "1"})
    ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, name, 0, 1, &never)), Scheduler::Submit::accepted);
  ASSERT_EQ(s.submit(std::make_shared<StepJob>(log, "2", 0, 1)), Scheduler::Submit::accepted);
  open.store(true);
  wait_for([&] { return log.has("batch 0 1"); });  // both active, decoding together; 2 waits for a slot
  auto t0 = std::chrono::steady_clock::now();
  s.stop(/*grace_ms=*/50);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.045);
  EXPECT_LT(took, 1.0);
  EXPECT_EQ(s.submit(std::make_shared<StepJob>(log, "3", 0, 1)), Scheduler::Submit::stopped);
  EXPECT_EQ(finishes(log.snapshot()), (std::vector<std::string>{"G", "0", "1"}));
  EXPECT_TRUE(log.has("2 dropped"));
}

TEST(Scheduler, StopLetsTheActiveJobFinishWithinGrace) {
  Log log;
  std::atomic<bool> gate{false};
  Scheduler s(10, 4, batch_of(log));
  auto job = std::make_shared<StepJob>(log, "0", 0, 1, &gate);
  ASSERT_EQ(s.submit(job), Scheduler::Submit::accepted);
  wait_for([&] { return s.running() == 1; });
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    gate.store(true);
  });
  s.stop(/*grace_ms=*/5000);
  opener.join();
  EXPECT_FALSE(job->cancel.load());  // finished on its own, not cancelled
  EXPECT_EQ(finishes(log.snapshot()), std::vector<std::string>{"0"});
}

// SIGTERM's shutdown (stop with the grace) and the end of Server::run() (stop(0)) stop the scheduler from two
// threads at once. Before stop() was serialized both joined the worker: undefined, and about one SIGTERM in
// four with a stream in flight never exited (or aborted on EINVAL from the second join).
TEST(Scheduler, ConcurrentStopsBothReturn) {
  for (int round = 0; round < 50; ++round) {
    Log log;
    std::atomic<bool> gate{false};
    auto s = std::make_unique<Scheduler>(10, 1 + round % 4, batch_of(log));
    ASSERT_EQ(s->submit(std::make_shared<StepJob>(log, "0", 0, 1, &gate)), Scheduler::Submit::accepted);
    wait_for([&] { return s->running() == 1; });
    std::atomic<int> returned{0};
    std::thread graceful([&] {
      s->stop(/*grace_ms=*/round % 5);
      ++returned;
    });
    std::thread immediate([&] {
      s->stop(0);
      ++returned;
    });
    graceful.join();
    immediate.join();
    EXPECT_EQ(returned.load(), 2);
    EXPECT_EQ(finishes(log.snapshot()), std::vector<std::string>{"0"}) << "round " << round;
  }
}

}  // namespace
}  // namespace lily
