// The scheduler: one job at a time in arrival order, a bounded queue, withdrawn and cancelled jobs never run,
// and stop() drops what is queued while the running job finishes or is cancelled.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "server/scheduler.h"

namespace lily {
namespace {

struct Log {
  std::mutex mu;
  std::vector<int> ran, dropped;
  std::atomic<int> running{0}, max_running{0};
};

class TestJob : public Job {
 public:
  TestJob(Log& log, int id, std::atomic<bool>* gate = nullptr) : log_(log), id_(id), gate_(gate) {}
  void run() override {
    int now = ++log_.running;
    int prev = log_.max_running.load();
    while (now > prev && !log_.max_running.compare_exchange_weak(prev, now)) {
    }
    // A "generation": until the gate opens or the job is cancelled, checking between "tokens".
    while (gate_ != nullptr && !gate_->load() && !cancel.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    --log_.running;
    std::lock_guard lock(log_.mu);
    log_.ran.push_back(id_);
  }
  void dropped() override {
    std::lock_guard lock(log_.mu);
    log_.dropped.push_back(id_);
  }

 private:
  Log& log_;
  int id_;
  std::atomic<bool>* gate_;
};

void wait_for(const std::function<bool()>& cond) {
  for (int i = 0; i < 2000 && !cond(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(cond());
}

TEST(Scheduler, OneAtATimeInArrivalOrder) {
  Log log;
  Scheduler s(100);
  for (int i = 0; i < 20; ++i)
    ASSERT_EQ(s.submit(std::make_shared<TestJob>(log, i)), Scheduler::Submit::accepted);
  wait_for([&] {
    std::lock_guard lock(log.mu);
    return log.ran.size() == 20;
  });
  EXPECT_EQ(log.max_running.load(), 1);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(log.ran[i], i);
}

TEST(Scheduler, BoundedQueueWithdrawAndCancel) {
  Log log;
  std::atomic<bool> gate{false};
  Scheduler s(2);
  auto blocker = std::make_shared<TestJob>(log, 0, &gate);
  ASSERT_EQ(s.submit(blocker), Scheduler::Submit::accepted);
  wait_for([&] { return s.running() == 1; });
  auto a = std::make_shared<TestJob>(log, 1), b = std::make_shared<TestJob>(log, 2);
  ASSERT_EQ(s.submit(a), Scheduler::Submit::accepted);
  ASSERT_EQ(s.submit(b), Scheduler::Submit::accepted);
  EXPECT_EQ(s.queue_depth(), 2u);
  EXPECT_EQ(s.submit(std::make_shared<TestJob>(log, 3)), Scheduler::Submit::queue_full);
  EXPECT_TRUE(s.withdraw(a));         // its client left while queued
  EXPECT_FALSE(s.withdraw(a));        // only once
  EXPECT_FALSE(s.withdraw(blocker));  // running: not withdrawable
  b->cancel.store(true);              // cancelled while queued: dropped when reached
  gate.store(true);
  wait_for([&] { return s.dropped_count() == 2 && s.running() == 0 && s.queue_depth() == 0; });
  std::lock_guard lock(log.mu);
  EXPECT_EQ(log.ran, std::vector<int>{0});
  EXPECT_EQ(log.dropped, (std::vector<int>{1, 2}));
}

TEST(Scheduler, StopDropsQueuedAndCancelsRunningAfterGrace) {
  Log log;
  std::atomic<bool> gate{false};  // never opens: only cancellation ends the running job
  Scheduler s(10);
  ASSERT_EQ(s.submit(std::make_shared<TestJob>(log, 0, &gate)), Scheduler::Submit::accepted);
  wait_for([&] { return s.running() == 1; });
  ASSERT_EQ(s.submit(std::make_shared<TestJob>(log, 1)), Scheduler::Submit::accepted);
  auto t0 = std::chrono::steady_clock::now();
  s.stop(/*grace_ms=*/50);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.045);
  EXPECT_LT(took, 1.0);
  EXPECT_EQ(s.submit(std::make_shared<TestJob>(log, 2)), Scheduler::Submit::stopped);
  std::lock_guard lock(log.mu);
  EXPECT_EQ(log.ran, std::vector<int>{0});
  EXPECT_EQ(log.dropped, std::vector<int>{1});
}

TEST(Scheduler, StopLetsTheRunningJobFinishWithinGrace) {
  Log log;
  std::atomic<bool> gate{false};
  Scheduler s(10);
  auto job = std::make_shared<TestJob>(log, 0, &gate);
  ASSERT_EQ(s.submit(job), Scheduler::Submit::accepted);
  wait_for([&] { return s.running() == 1; });
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    gate.store(true);
  });
  s.stop(/*grace_ms=*/5000);
  opener.join();
  EXPECT_FALSE(job->cancel.load());  // finished on its own, not cancelled
  std::lock_guard lock(log.mu);
  EXPECT_EQ(log.ran, std::vector<int>{0});
}

// SIGTERM's shutdown (stop with the grace) and the end of Server::run() (stop(0)) stop the scheduler from two
// threads at once. Before stop() was serialized both joined the worker: undefined, and about one SIGTERM in
// four with a stream in flight never exited (or aborted on EINVAL from the second join).
TEST(Scheduler, ConcurrentStopsBothReturn) {
  for (int round = 0; round < 50; ++round) {
    Log log;
    std::atomic<bool> gate{false};
    auto s = std::make_unique<Scheduler>(10);
    ASSERT_EQ(s->submit(std::make_shared<TestJob>(log, 0, &gate)), Scheduler::Submit::accepted);
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
    std::lock_guard lock(log.mu);
    EXPECT_EQ(log.ran, std::vector<int>{0}) << "round " << round;
  }
}

}  // namespace
}  // namespace lily
