#include "server/metrics.h"

#include <algorithm>
#include <cinttypes>

#include "util/status.h"

namespace lily {

namespace {

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += format("# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

std::string number(double v) {
  if (v == static_cast<double>(static_cast<int64_t>(v)) && v < 9e15 && v > -9e15) return format("%.0f", v);
  return format("%.9g", v);
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += format("%s_bucket{le=\"%s\"} %" PRIu64 "\n", name.c_str(), number(bounds_[i]).c_str(), cumulative);
  }
  out += format("%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name.c_str(), count_);
  out +=
      format("%s_sum %s\n%s_count %" PRIu64 "\n", name.c_str(), number(sum_).c_str(), name.c_str(), count_);
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      token_latency_({0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5}) {}

void Metrics::record_request(const std::string& endpoint, int status) {
  std::lock_guard lock(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::record_generation(const GenerationResult& r) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(r.prompt_tokens);
  completion_tokens_ += static_cast<uint64_t>(r.completion_tokens);
  cached_tokens_ += static_cast<uint64_t>(r.cached_tokens);
  int prefilled = r.prompt_tokens - r.cached_tokens;
  prefill_tokens_ += static_cast<uint64_t>(prefilled);
  prefill_seconds_ += r.prefill_ms / 1e3;
  if (r.prefill_ms > 0) last_prefill_tps_ = prefilled / (r.prefill_ms / 1e3);
  // The first token comes out of prefill; decode produced the rest.
  int decoded = r.completion_tokens > 1 ? r.completion_tokens - 1 : 0;
  decode_tokens_ += static_cast<uint64_t>(decoded);
  decode_seconds_ += r.decode_ms / 1e3;
  if (r.decode_ms > 0 && decoded > 0) last_decode_tps_ = decoded / (r.decode_ms / 1e3);
}

void Metrics::observe_ttft(double seconds) {
  std::lock_guard lock(mu_);
  ttft_.observe(seconds);
}

void Metrics::observe_token_latency(double seconds) {
  std::lock_guard lock(mu_);
  token_latency_.observe(seconds);
}

std::string Metrics::render(const LiveGauges& live) const {
  std::lock_guard lock(mu_);
  std::string out;
  header(out, "lily_requests_total", "counter", "HTTP requests by endpoint and status code.");
  for (const auto& [key, n] : requests_) {
    out += format("lily_requests_total{endpoint=\"%s\",status=\"%d\"} %" PRIu64 "\n", key.first.c_str(),
                  key.second, n);
  }
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    out += format("%s %s\n", name, number(v).c_str());
  };
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    out += format("%s %s\n", name, number(v).c_str());
  };
  counter("lily_prompt_tokens_total", "Prompt tokens of finished generations.",
          static_cast<double>(prompt_tokens_));
  counter("lily_completion_tokens_total", "Generated tokens.", static_cast<double>(completion_tokens_));
  counter("lily_cached_prompt_tokens_total", "Prompt tokens served from the session cache.",
          static_cast<double>(cached_tokens_));
  counter("lily_prefill_tokens_total", "Prompt tokens prefilled (not cached).",
          static_cast<double>(prefill_tokens_));
  counter("lily_prefill_seconds_total", "Time spent in prefill.", prefill_seconds_);
  counter("lily_decode_tokens_total", "Tokens produced by decode steps.",
          static_cast<double>(decode_tokens_));
  counter("lily_decode_seconds_total", "Time spent decoding.", decode_seconds_);
  counter("lily_dropped_requests_total", "Queued requests dropped because their client left.",
          static_cast<double>(live.dropped));
  gauge("lily_prefill_tokens_per_second", "Prefill throughput of the last request.", last_prefill_tps_);
  gauge("lily_decode_tokens_per_second", "Decode throughput of the last request.", last_decode_tps_);
  header(out, "lily_time_to_first_token_seconds", "histogram",
         "Time from a request's arrival (queue wait "
         "included) to its first token.");
  ttft_.render(out, "lily_time_to_first_token_seconds");
  header(out, "lily_time_per_output_token_seconds", "histogram", "Gap between consecutive generated tokens.");
  token_latency_.render(out, "lily_time_per_output_token_seconds");
  gauge("lily_queue_depth", "Requests waiting for a slot.", static_cast<double>(live.queue_depth));
  gauge("lily_requests_running", "Requests in a slot (at most --parallel).",
        static_cast<double>(live.running));
  header(out, "lily_slots", "gauge", "Request slots (--parallel) by state.");
  const size_t busy = std::min(live.parallel, live.slots_prefilling + live.slots_decoding);
  out += format("lily_slots{state=\"prefilling\"} %zu\n", live.slots_prefilling);
  out += format("lily_slots{state=\"decoding\"} %zu\n", live.slots_decoding);
  out += format("lily_slots{state=\"idle\"} %zu\n", live.parallel - busy);
  gauge("lily_model_ready", "1 once the model is loaded.", live.model_ready ? 1 : 0);
  counter("lily_session_cache_hits_total", "Requests that reused a cached prefix.",
          static_cast<double>(live.cache.cache_hits));
  counter("lily_session_cache_misses_total", "Requests that found no cached prefix.",
          static_cast<double>(live.cache.cache_misses));
  counter("lily_session_cache_evictions_total", "Cached sessions evicted to stay within the budget.",
          static_cast<double>(live.cache.cache_evictions));
  gauge("lily_session_cache_bytes", "Memory held by cached sessions and checkpoints.",
        static_cast<double>(live.cache.cache_bytes));
  gauge("lily_session_cache_budget_bytes", "The session cache's memory budget.",
        static_cast<double>(live.cache.cache_budget_bytes));
  gauge("lily_session_cache_entries", "Cached sessions.", static_cast<double>(live.cache.cache_entries));
  counter("lily_speculative_steps_total", "Speculative verification forwards (--speculative mtp:K).",
          static_cast<double>(live.cache.speculative_steps));
  counter("lily_speculative_drafted_tokens_total", "Tokens drafted by the MTP head and verified.",
          static_cast<double>(live.cache.drafted_tokens));
  counter("lily_speculative_accepted_tokens_total", "Drafted tokens the model accepted.",
          static_cast<double>(live.cache.accepted_tokens));
  gauge("lily_speculative_acceptance_rate", "Accepted / drafted tokens since start (0 before any draft).",
        live.cache.drafted_tokens ? static_cast<double>(live.cache.accepted_tokens) /
                                        static_cast<double>(live.cache.drafted_tokens)
                                  : 0.0);
  counter("lily_session_disk_hits_total", "Requests resumed from a --cache-dir file.",
          static_cast<double>(live.cache.disk_hits));
  counter("lily_session_disk_writes_total", "Session files written.", static_cast<double>(live.cache.disk_writes));
  counter("lily_session_disk_evictions_total", "Session files deleted to stay within --cache-disk-budget.",
          static_cast<double>(live.cache.disk_evictions));
  counter("lily_session_disk_refused_total", "Session files refused (corrupt, truncated, foreign, unreadable).",
          static_cast<double>(live.cache.disk_refused));
  gauge("lily_session_disk_bytes", "Bytes of the session files.", static_cast<double>(live.cache.disk_bytes));
  gauge("lily_session_disk_files", "Session files.", static_cast<double>(live.cache.disk_files));
  return out;
}

}  // namespace lily
