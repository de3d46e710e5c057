// Prometheus metrics (text exposition format 0.0.4) for GET /metrics: requests by endpoint and status, tokens
// in and out, time-to-first-token and per-token latency histograms, prefill and decode throughput, queue
// depth, and the engine's session-cache counters. Thread-safe: handlers and the worker record, /metrics
// renders.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"

namespace lily {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);
  // `name_bucket{le="..."} n` lines (cumulative), then _sum and _count.
  void render(std::string& out, const std::string& name) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct LiveGauges {  // read at scrape time
  size_t queue_depth = 0;
  size_t running = 0;
  size_t parallel = 0;                              // slots (--parallel)
  size_t slots_prefilling = 0, slots_decoding = 0;  // the rest are idle
  size_t dropped = 0;  // queued requests whose client left (the scheduler's count)
  bool model_ready = false;
  EngineStats cache;
};

class Metrics {
 public:
  Metrics();
  void record_request(const std::string& endpoint, int status);
  void record_generation(const GenerationResult& result);
  void observe_ttft(double seconds);           // request arrival -> first token (queue wait included)
  void observe_token_latency(double seconds);  // one inter-token gap while decoding
  std::string render(const LiveGauges& live) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0;
  uint64_t prefill_tokens_ = 0, decode_tokens_ = 0;
  double prefill_seconds_ = 0, decode_seconds_ = 0;
  double last_prefill_tps_ = 0, last_decode_tps_ = 0;
  Histogram ttft_, token_latency_;
};

}  // namespace lily
