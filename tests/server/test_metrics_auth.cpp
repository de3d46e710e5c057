// Prometheus text of the metrics, and the API-key check.
#include <gtest/gtest.h>

#include "server/auth.h"
#include "server/metrics.h"

namespace lily {
namespace {

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.starts_with(line + "\n");
}

TEST(Metrics, HistogramIsCumulative) {
  Histogram h({0.1, 1});
  h.observe(0.05);
  h.observe(0.1);  // on the bound: in that bucket (le)
  h.observe(0.5);
  h.observe(7);
  std::string out;
  h.render(out, "x");
  EXPECT_EQ(out,
            "x_bucket{le=\"0.1\"} 2\nx_bucket{le=\"1\"} 3\nx_bucket{le=\"+Inf\"} 4\nx_sum 7.65\nx_count 4\n");
}

TEST(Metrics, RendersEveryFamily) {
  Metrics m;
  m.record_request("/v1/chat/completions", 200);
  m.record_request("/v1/chat/completions", 200);
  m.record_request("/v1/chat/completions", 400);
  GenerationResult r;
  r.prompt_tokens = 100;
  r.cached_tokens = 60;
  r.completion_tokens = 11;
  r.prefill_ms = 20;  // 40 tokens prefilled -> 2000 tok/s
  r.decode_ms = 100;  // 10 decoded tokens -> 100 tok/s
  m.record_generation(r);
  m.observe_ttft(0.03);
  m.observe_token_latency(0.004);
  LiveGauges g;
  g.queue_depth = 3;
  g.running = 1;
  g.model_ready = true;
  g.cache.cache_hits = 5;
  g.cache.cache_bytes = 1234;
  g.cache.speculative_steps = 10, g.cache.drafted_tokens = 20, g.cache.accepted_tokens = 5;
  std::string text = m.render(g);
  EXPECT_TRUE(has_line(text, "lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"))
      << text;
  EXPECT_TRUE(has_line(text, "lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1"));
  EXPECT_TRUE(has_line(text, "lily_prompt_tokens_total 100"));
  EXPECT_TRUE(has_line(text, "lily_completion_tokens_total 11"));
  EXPECT_TRUE(has_line(text, "lily_cached_prompt_tokens_total 60"));
  EXPECT_TRUE(has_line(text, "lily_prefill_tokens_per_second 2000"));
  EXPECT_TRUE(has_line(text, "lily_decode_tokens_per_second 100"));
  EXPECT_TRUE(has_line(text, "lily_time_to_first_token_seconds_bucket{le=\"0.05\"} 1"));
  EXPECT_TRUE(has_line(text, "lily_time_per_output_token_seconds_count 1"));
  EXPECT_TRUE(has_line(text, "lily_queue_depth 3"));
  EXPECT_TRUE(has_line(text, "lily_requests_running 1"));
  EXPECT_TRUE(has_line(text, "lily_session_cache_hits_total 5"));
  EXPECT_TRUE(has_line(text, "lily_session_cache_bytes 1234"));
  EXPECT_TRUE(has_line(text, "lily_speculative_steps_total 10"));
  EXPECT_TRUE(has_line(text, "lily_speculative_drafted_tokens_total 20"));
  EXPECT_TRUE(has_line(text, "lily_speculative_accepted_tokens_total 5"));
  EXPECT_TRUE(has_line(text, "lily_speculative_acceptance_rate 0.25"));
  EXPECT_TRUE(has_line(text, "# TYPE lily_time_to_first_token_seconds histogram"));
  // Every sample line belongs to a family declared with # TYPE.
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.starts_with("#")) continue;
    std::string family = line.substr(0, line.find_first_of("{ "));
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (family.ends_with(suffix) && text.find("# TYPE " + family + " ") == std::string::npos) {
        family = family.substr(0, family.size() - std::string(suffix).size());
      }
    }
    EXPECT_NE(text.find("# TYPE " + family + " "), std::string::npos) << line;
  }
}

TEST(Auth, BearerToken) {
  EXPECT_TRUE(bearer_token_matches("Bearer sk-123", "sk-123"));
  EXPECT_TRUE(bearer_token_matches("bearer sk-123", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("Bearer sk-124", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("Bearer sk-12", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("Bearer sk-1234", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("sk-123", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("Basic sk-123", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("", "sk-123"));
  EXPECT_FALSE(bearer_token_matches("Bearer ", ""));
}

}  // namespace
}  // namespace lily
