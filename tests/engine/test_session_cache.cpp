// SessionCache on the CPU backend of the tiny model: a restored checkpoint continues exactly like a fresh
// sequence; resume points; take-over versus fork; checkpoint pruning; bytes with shared checkpoints counted
// once.
#include "engine/session_cache.h"

#include <gtest/gtest.h>

#include "test_engine_util.h"

namespace lily::test {
namespace {

// A cached entry that has consumed `tokens`, with checkpoints at `marks`.
std::unique_ptr<CachedSequence> consumed(Backend& be, const std::vector<int32_t>& tokens,
                                         const std::vector<int64_t>& marks) {
  auto seq = std::make_unique<CachedSequence>();
  seq->state = be.new_sequence();
  int64_t pos = 0;
  for (int64_t m : marks) {
    forward(be, *seq->state, std::span(tokens).subspan(pos, m - pos));
    seq->checkpoints[m] = seq->state->checkpoint();
    pos = m;
  }
  forward(be, *seq->state, std::span(tokens).subspan(pos));
  seq->tokens = tokens;
  return seq;
}

TEST(SessionCache, RestoredCheckpointContinuesLikeAFreshSequence) {
  auto be = tiny_backend();
  auto a = ids(30, 1), b = ids(30, 2);
  std::copy(a.begin(), a.begin() + 12, b.begin());  // b shares a's first 12 tokens
  auto seq = be->new_sequence();
  forward(*be, *seq, std::span(a).first(12));
  auto cp = seq->checkpoint();
  forward(*be, *seq, std::span(a).subspan(12));
  ASSERT_TRUE(seq->restore(*cp).ok());
  EXPECT_EQ(seq->n_tokens(), 12);
  auto resumed = forward(*be, *seq, std::span(b).subspan(12));
  auto fresh_seq = be->new_sequence();
  forward(*be, *fresh_seq, std::span(b).first(12));
  auto fresh = forward(*be, *fresh_seq, std::span(b).subspan(12));
  ASSERT_EQ(resumed.size(), fresh.size());
  EXPECT_EQ(resumed, fresh);  // same splits, same arithmetic: bit-identical
}

TEST(SessionCache, ResumePointIsTheLatestCheckpointOrTheEnd) {
  auto be = tiny_backend();
  auto seq = consumed(*be, ids(20, 3), {5, 10, 15});
  EXPECT_EQ(seq->resume_point(4), 0);
  EXPECT_EQ(seq->resume_point(5), 5);
  EXPECT_EQ(seq->resume_point(14), 10);
  EXPECT_EQ(seq->resume_point(19), 15);
  EXPECT_EQ(seq->resume_point(20), 20);  // everything consumed is within the limit: the state itself
}

TEST(SessionCache, TakeOverRewindsAndForkKeepsTheOriginal) {
  auto be = tiny_backend();
  SessionCache cache(1ull << 30);
  auto first = ids(20, 4);
  auto lease0 = cache.acquire(*be, first, 19);
  ASSERT_TRUE(lease0.ok());
  EXPECT_EQ(lease0->resume, 0);
  EXPECT_EQ(lease0->seq->state->n_tokens(), 0);
  auto entry = consumed(*be, first, {8, 14});
  entry->anchor = 14;
  cache.release(std::move(entry));

  // Diverges at 16 (>= anchor 14): the entry is taken over and rewound to 14.
  auto second = first;
  second[16] = 9;
  auto lease = cache.acquire(*be, second, 19);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->resume, 14);
  EXPECT_EQ(lease->seq->state->n_tokens(), 14);
  EXPECT_EQ(lease->seq->tokens, std::vector<int32_t>(first.begin(), first.begin() + 14));
  EXPECT_EQ(lease->seq->checkpoints.size(), 2u);
  EXPECT_EQ(cache.stats().entries, 0u);  // checked out
  cache.release(std::move(lease->seq));

  // Diverges at 10 (< anchor 14): a fork at 8; the entry stays as it was.
  auto third = first;
  third[10] = 9;
  auto forked = cache.acquire(*be, third, 19);
  ASSERT_TRUE(forked.ok());
  EXPECT_EQ(forked->resume, 8);
  EXPECT_EQ(forked->seq->state->n_tokens(), 8);
  EXPECT_EQ(forked->seq->checkpoints.size(), 1u);
  SessionCacheStats s = cache.stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 1u);
  // The fork shares the checkpoint at 8 with the original: counted once.
  const size_t shared = forked->seq->checkpoints.at(8)->bytes();
  const size_t fork_state = forked->seq->state->bytes();
  cache.release(std::move(forked->seq));
  EXPECT_EQ(cache.stats().bytes, s.bytes + fork_state);
  EXPECT_GT(shared, 0u);
  cache.clear();
  EXPECT_EQ(cache.stats().bytes, 0u);
}

TEST(SessionCache, PruningKeepsTheGridAndTheRecentMarks) {
  auto be = tiny_backend();
  auto seq = consumed(*be, ids(40, 5), {3, 8, 12, 16, 21, 30, 32});
  for (int64_t m : {3, 12, 21, 30}) seq->mark(m);
  seq->prune_checkpoints(/*interval=*/16, /*keep_marks=*/2);
  std::vector<int64_t> kept;
  for (const auto& [pos, cp] : seq->checkpoints) kept.push_back(pos);
  EXPECT_EQ(kept, (std::vector<int64_t>{16, 21, 30, 32}));
}

}  // namespace
}  // namespace lily::test
