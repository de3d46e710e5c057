// The speculative decode loop and its acceptance rule (see speculative.h).
#include "engine/speculative.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "util/check.h"

namespace lily {

Result<int> parse_speculative(const std::string& value) {
  if (value.empty() || value == "off") return 0;
  const std::string prefix = "mtp:";
  if (value.rfind(prefix, 0) == 0 && value.size() > prefix.size()) {
    const std::string k = value.substr(prefix.size());
    char* end = nullptr;
    const long n = std::strtol(k.c_str(), &end, 10);
    if (*end == '\0' && k.find_first_not_of("0123456789") == std::string::npos && n >= 1 &&
        n <= kMaxSpeculativeTokens)
      return static_cast<int>(n);
  }
  return invalid_argument("--speculative `%s`: expected mtp:K, K from 1 to %d (tokens drafted per step by the "
                          "checkpoint's multi-token-prediction head), or off",
                          value.c_str(), kMaxSpeculativeTokens);
}

int32_t draw_from(std::span<const float> probs, double u) {
  double total = 0.0;
  for (float p : probs) total += p;
  const double target = u * total;
  double sum = 0.0;
  int32_t last_positive = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    last_positive = static_cast<int32_t>(i);
    sum += probs[i];
    if (sum > target) return last_positive;
  }
  CHECK(last_positive >= 0, "draw_from: no token has a positive probability");
  return last_positive;
}

DraftVerdict accept_or_resample(std::span<const float> p, std::span<const float> q, int32_t draft, double u_accept,
                                double u_resample) {
  CHECK(p.size() == q.size() && draft >= 0 && static_cast<size_t>(draft) < p.size(), "draft %d over %zu/%zu",
        draft, p.size(), q.size());
  const double px = p[static_cast<size_t>(draft)], qx = q[static_cast<size_t>(draft)];
  if (qx > 0.0 && u_accept * qx < px) return {true, draft};
  std::vector<float> residual(p.size());
  bool any = false;
  for (size_t i = 0; i < p.size(); ++i) {
    residual[i] = std::max(0.0f, p[i] - q[i]);
    any |= residual[i] > 0.0f;
  }
  return {false, draw_from(any ? std::span<const float>(residual) : p, u_resample)};
}

SpeculativeProjection speculative_projection(int k, double accept, double decode_ms, double draft_ms,
                                             double verify_ms) {
  SpeculativeProjection p;
  double term = 1;
  for (int i = 0; i <= k; ++i) p.tokens_per_round += term, term *= accept;
  p.speedup = p.tokens_per_round * decode_ms / (k * draft_ms + verify_ms);
  return p;
}

double break_even_acceptance(int k, double decode_ms, double draft_ms, double verify_ms) {
  if (speculative_projection(k, 1.0, decode_ms, draft_ms, verify_ms).speedup < 1) return 1.0;
  double lo = 0, hi = 1;  // the speed-up grows with the acceptance
  for (int it = 0; it < 60; ++it) {
    const double mid = 0.5 * (lo + hi);
    (speculative_projection(k, mid, decode_ms, draft_ms, verify_ms).speedup < 1 ? lo : hi) = mid;
  }
  return hi;
}

uint64_t speculative_seed(uint64_t sampler_seed) {
  return sampler_seed ^ 0x5be0cd19137e2179ull;  // a stream of its own: the sampler's draws are not disturbed
}

namespace {

int32_t argmax_of(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

class Loop {
 public:
  Loop(Backend& backend, SequenceState& state, Sampler& target, SplitMix64& rng, const SpeculativeRequest& r,
       const EmitFn& emit, SpeculativeCounts& counts)
      : backend_(backend),
        state_(state),
        r_(r),
        emit_(emit),
        counts_(counts),
        target_(target),
        draft_(target.params()),
        rng_(rng),
        greedy_(target.params().temperature == 0.0f),
        argmax_only_(greedy_ && plain_greedy(target.params())),
        history_(*r.history),
        V_(backend.config().vocab_size) {}

  // Rounds of draft + verify; a plain step only where no draft is possible: nothing consumed yet (the head has
  // no hidden state to draft from) or the budget leaves room for one token. The caller's yield is looked at
  // between rounds only, so the rounds (and their draws) are the same however often the loop is resumed.
  Status run() {
    bool go_on = true;
    while (go_on) {
      const int k = state_.n_tokens() == 0
                        ? 0
                        : static_cast<int>(std::min<int64_t>(r_.draft_tokens, r_.budget - emitted_ - 1));
      RETURN_IF_ERROR(k > 0 ? step(k, go_on) : plain_step(go_on));
      if (go_on && r_.yield && r_.yield()) break;
    }
    return ok_status();
  }

 private:
  // Stop tokens are banned until min_tokens tokens were emitted (the plain loop's rule), `ahead` rows later.
  void ban_stops_if_early(std::span<float> row, int64_t ahead) {
    if (r_.emitted + emitted_ + ahead < target_.params().min_tokens)
      for (int32_t id : r_.stop_token_ids) row[static_cast<size_t>(id)] = -INFINITY;
  }

  // emit_ appends the token to history_.
  bool push(int32_t id, float logprob, std::vector<TokenLogprob> top) {
    ++emitted_;
    const size_t before = history_.size();
    const bool go_on = emit_(id, logprob, std::move(top));
    CHECK(history_.size() == before + 1 && history_.back() == id, "emit must append the token to the history");
    return go_on;
  }

  // One token the plain way.
  Status plain_step(bool& go_on) {
    std::vector<float> logits;
    const int32_t t = history_.back();
    RETURN_IF_ERROR(backend_.forward(state_, std::span<const int32_t>(&t, 1), LogitsRows::last, &logits));
    ban_stops_if_early(logits, 0);
    ASSIGN_OR_RETURN(SampleResult s, target_.sample(logits, history_, r_.n_prompt));
    go_on = push(s.id, s.logprob, std::move(s.top));
    return ok_status();
  }

  // Greedy with nothing to the logits but the stop-token ban of min_tokens: a round needs only argmaxes.
  static bool plain_greedy(const SamplingParams& p) {
    return p.logit_bias.empty() && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
           p.frequency_penalty == 0.0f && !p.logprobs && p.top_logprobs == 0;
  }

  // step() where every row of the round is a plain argmax (no ban left: min_tokens reached): the backend's
  // argmax calls, which need not bring the logits to the host. The same tokens as step()'s greedy branch.
  Status argmax_step(int k, bool& go_on) {
    std::vector<int32_t> rows{history_.back()};
    for (int i = 0; i < k; ++i) {
      int32_t id = -1;
      RETURN_IF_ERROR(backend_.mtp_draft_argmax(state_, rows.back(), &id));
      rows.push_back(id);
    }
    std::vector<int32_t> best;
    RETURN_IF_ERROR(backend_.forward_verify_argmax(state_, rows, &best));
    if (best.size() != rows.size())
      return error(ErrorCode::internal, "forward_verify_argmax: %zu ids for %zu rows", best.size(), rows.size());
    return keep_verified(k, go_on, [&](int i) {
      const int32_t token = best[static_cast<size_t>(i)];
      return Result<RowVerdict>(RowVerdict{token, i < k && token == rows[static_cast<size_t>(i) + 1], {}});
    });
  }

  Status step(int k, bool& go_on) {
    if (argmax_only_ && r_.emitted + emitted_ >= target_.params().min_tokens) return argmax_step(k, go_on);
    // Draft k tokens, each from the head's logits after the previous one.
    std::vector<int32_t> rows{history_.back()};
    // The drafts see the request's transforms too (bias, penalties, min_tokens; greedy: the argmax after them).
    std::vector<std::vector<float>> q(static_cast<size_t>(k));
    std::vector<float> dl;
    for (int i = 0; i < k; ++i) {
      RETURN_IF_ERROR(backend_.mtp_draft(state_, rows.back(), &dl));
      std::vector<int32_t> h = history_;
      h.insert(h.end(), rows.begin() + 1, rows.end());
      ban_stops_if_early(dl, i + 1);
      auto& qi = q[static_cast<size_t>(i)];
      RETURN_IF_ERROR(draft_.distribution(dl, h, r_.n_prompt, qi));
      rows.push_back(greedy_ ? argmax_of(qi) : draw_from(qi, rng_.next_uniform()));
    }
    // Verify them in one forward, then keep rows while the drafts are accepted.
    std::vector<float> all;
    RETURN_IF_ERROR(backend_.forward_verify(state_, rows, &all));
    std::vector<float> p;
    return keep_verified(k, go_on, [&](int i) -> Result<RowVerdict> {
      std::span<float> row(all.data() + static_cast<size_t>(i) * V_, static_cast<size_t>(V_));
      ban_stops_if_early(row, 0);
      RowVerdict v{-1, false, {-1, 0.0f, {}}};
      if (greedy_) {
        ASSIGN_OR_RETURN(v.lp, target_.sample(row, history_, r_.n_prompt));
        v.token = v.lp.id;
        v.accepted = i < k && v.token == rows[static_cast<size_t>(i) + 1];
      } else {
        RETURN_IF_ERROR(target_.distribution(row, history_, r_.n_prompt, p));
        const double u_accept = rng_.next_uniform(), u_resample = rng_.next_uniform();
        if (i < k) {
          DraftVerdict d = accept_or_resample(p, q[static_cast<size_t>(i)], rows[static_cast<size_t>(i) + 1],
                                              u_accept, u_resample);
          v.token = d.token, v.accepted = d.accepted;
        } else {
          v.token = draw_from(p, u_accept);  // the bonus row
        }
        if (target_.params().logprobs) {
          ASSIGN_OR_RETURN(v.lp, target_.logprobs(row, v.token));
        }
      }
      return v;
    });
  }

  // A verified row's outcome: its token, whether that is the draft it verified, the token's logprobs.
  struct RowVerdict {
    int32_t token;
    bool accepted;
    SampleResult lp;
  };

  // Emits rows 0 .. k of a verification in order (verdict(i), asked only once the rows before were emitted, as a
  // row's penalties read them) while the drafts are accepted, then cuts the sequence back to them: the state keeps
  // the row before each emitted token (the sampled token and the emitted drafts but the last).
  template <class Verdict>
  Status keep_verified(int k, bool& go_on, Verdict&& verdict) {
    counts_.steps++;
    counts_.drafted += k;
    int64_t kept_rows = 0;
    go_on = true;
    for (int i = 0; i <= k && go_on; ++i) {
      // An error (logits the sampler cannot take) fails the request, whose sequence is then dropped.
      ASSIGN_OR_RETURN(RowVerdict v, verdict(i));
      counts_.accepted += v.accepted;
      ++kept_rows;
      go_on = push(v.token, v.lp.logprob, std::move(v.lp.top));
      if (!v.accepted) break;
    }
    return backend_.accept_verified(state_, kept_rows);
  }

  Backend& backend_;
  SequenceState& state_;
  const SpeculativeRequest& r_;
  const EmitFn& emit_;
  SpeculativeCounts& counts_;
  Sampler& target_;
  Sampler draft_;
  SplitMix64& rng_;
  const bool greedy_;
  const bool argmax_only_;  // greedy without bias, penalties or logprobs (plain_greedy)
  const std::vector<int32_t>& history_;
  const int64_t V_;
  int64_t emitted_ = 0;
};

}  // namespace

Status speculative_decode(Backend& backend, SequenceState& state, Sampler& target, SplitMix64& rng,
                          const SpeculativeRequest& request, const EmitFn& emit, SpeculativeCounts& counts) {
  if (request.draft_tokens < 1 || request.draft_tokens > kMaxSpeculativeTokens)
    return invalid_argument("speculative decoding: %d draft tokens (1..%d)", request.draft_tokens,
                            kMaxSpeculativeTokens);
  if (!request.history || request.n_prompt == 0 || request.history->size() < request.n_prompt || request.budget < 1)
    return invalid_argument("speculative decoding: nothing to do");
  return Loop(backend, state, target, rng, request, emit, counts).run();
}

}  // namespace lily
