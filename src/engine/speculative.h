// Speculative decoding with the checkpoint's own multi-token-prediction head (`--speculative mtp:K`,
// docs/MODEL.md eq 26). Each step drafts K tokens with the head (draft i+1 reads draft i and the head's own
// output hidden state, as vLLM's MTP proposer chains them), verifies the last sampled token and the K drafts in
// one forward of 1+K rows (Backend::forward_verify), keeps the longest accepted prefix plus one token sampled
// from the first rejected row (or the bonus row after K acceptances), and cuts the sequence back to what was
// kept (Backend::accept_verified: no recomputation).
//
// Acceptance. Greedy (temperature 0): a draft is kept iff it is the row's argmax, so the output is token for
// token the plain loop's (the CPU backend's rows do not depend on how many are computed together). A greedy
// request with no logit transforms (bias, penalties) and no logprobs needs only argmaxes once min_tokens is
// reached: those rounds call Backend::mtp_draft_argmax / forward_verify_argmax, which need not bring the logits
// to the host. Sampling:
// the rule of Leviathan et al. 2023 / Chen et al. 2023: draft x ~ q (the head's distribution after the request's
// sampling transforms) is kept with probability min(1, p(x) / q(x)), where p is the model's distribution at that
// row; otherwise the token is drawn from norm(max(0, p - q)). The emitted tokens are then distributed exactly as
// without speculation (not the same draws: a seed gives a reproducible, different sequence).
//
// Everything a request can ask for works as in the plain host loop: penalties and logit_bias (each row sees the
// history up to it), min_tokens, logprobs (step 4 of sampler.h at the emitted token), stop tokens and strings,
// max_tokens, cancellation (the caller's emit callback), the context limit (K shrinks near the budget).
// This component is self-contained: Engine::run_alone (a request decoding alone: generate(), or the server's
// scheduler with one request in flight) calls it when the engine was built with EngineOptions::speculative_tokens
// > 0; batched decode steps (several requests at once) decode without speculation.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"
#include "util/status.h"

namespace lily {

inline constexpr int kMaxSpeculativeTokens = 3;

// `--speculative` values: "" or "off" -> 0; "mtp:K" with 1 <= K <= kMaxSpeculativeTokens -> K; anything else is
// an error that says what is accepted.
Result<int> parse_speculative(const std::string& value);

// The acceptance rule for one draft token (above): accept iff u_accept * q(draft) < p(draft); on rejection the
// token is drawn with u_resample from norm(max(0, p - q)) (from p when that is all zero, which only rounding
// can cause). p and q are distributions over the same vocabulary.
struct DraftVerdict {
  bool accepted = false;
  int32_t token = -1;
};
DraftVerdict accept_or_resample(std::span<const float> p, std::span<const float> q, int32_t draft, double u_accept,
                                double u_resample);

// Draws from a distribution with one uniform u in [0, 1): the first id (ascending) whose running sum exceeds
// u * total (sampler.h step 10's walk); zero-probability ids are never drawn.
int32_t draw_from(std::span<const float> probs, double u);

struct SpeculativeCounts {
  int64_t steps = 0;     // verification forwards
  int64_t drafted = 0;   // draft tokens verified
  int64_t accepted = 0;  // draft tokens kept
};

// What the loop needs from its caller. `history` is the prompt and the tokens emitted so far; its last token is
// the one `state` has not consumed yet (the last prompt token before the first decode step), and emit(id,
// logprob, top) appends each new token to it and returns false once generation must end (the loop can be
// called again later with the grown history). On return the state has
// consumed the history but its last token. yield() (optional) is asked after each round whether to hand the
// thread back; the target sampler and the loop's RNG belong to the request, so a generation resumed after a
// yield makes the same rounds and draws as an uninterrupted one (a seed gives the same tokens either way).
struct SpeculativeRequest {
  const std::vector<int32_t>* history = nullptr;
  size_t n_prompt = 0;
  std::span<const int32_t> stop_token_ids;
  int64_t emitted = 0;  // tokens emitted before this call (min_tokens counts them)
  int64_t budget = 0;   // tokens this call may still emit
  int draft_tokens = 1; // K
  std::function<bool()> yield;
};
using EmitFn = std::function<bool(int32_t id, float logprob, std::vector<TokenLogprob> top)>;

// What the costs imply (lily bench --mode verify): speculative decoding with K drafts a round, each accepted with
// probability `accept` independently of the others until the first rejection: a round emits (1 - a^(K+1)) / (1 - a)
// tokens (the accepted drafts and one token sampled by the verification) in K draft steps and one verification of
// 1+K rows.
struct SpeculativeProjection {
  double tokens_per_round = 0;  // at `accept`
  double speedup = 0;           // tokens per unit of time against plain decoding
};
SpeculativeProjection speculative_projection(int k, double accept, double decode_ms, double draft_ms,
                                             double verify_ms);
// The acceptance in [0, 1] at which the speed-up is 1 (1 when even a = 1 does not win).
double break_even_acceptance(int k, double decode_ms, double draft_ms, double verify_ms);

// The seed of the loop's own stream of draws for a request whose sampler has `sampler_seed`.
uint64_t speculative_seed(uint64_t sampler_seed);

Status speculative_decode(Backend& backend, SequenceState& state, Sampler& target, SplitMix64& rng,
                          const SpeculativeRequest& request, const EmitFn& emit, SpeculativeCounts& counts);

}  // namespace lily
