#include "engine/session_cache.h"

#include <algorithm>
#include <unordered_set>

#include "util/check.h"

namespace lily {

int64_t CachedSequence::resume_point(int64_t limit) const {
  const auto n = static_cast<int64_t>(tokens.size());
  if (n <= limit) return n;
  auto it = checkpoints.upper_bound(limit);
  if (it == checkpoints.begin()) return 0;
  return std::prev(it)->first;
}

void CachedSequence::mark(int64_t position) {
  std::erase(recent_marks, position);
  recent_marks.push_back(position);
}

void CachedSequence::prune_checkpoints(int64_t interval, size_t keep_marks) {
  if (recent_marks.size() > keep_marks)
    recent_marks.erase(recent_marks.begin(), recent_marks.end() - static_cast<ptrdiff_t>(keep_marks));
  std::erase_if(checkpoints, [&](const auto& kv) {
    const int64_t pos = kv.first;
    bool on_grid = interval > 0 && pos % interval == 0;
    return !on_grid && std::find(recent_marks.begin(), recent_marks.end(), pos) == recent_marks.end();
  });
}

size_t CachedSequence::checkpoint_bytes() const {
  size_t b = 0;
  for (const auto& [pos, cp] : checkpoints) b += cp->bytes();
  return b;
}

namespace {

int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  size_t n = std::min(a.size(), b.size()), i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

// Cuts `seq` back to `resume` (a checkpoint position or its own end): restores the recurrent state, truncates
// the KV cache, and forgets the tokens and checkpoints past that point.
Status rewind(CachedSequence& seq, int64_t resume) {
  if (resume < seq.state->n_tokens()) {
    auto it = seq.checkpoints.find(resume);
    CHECK(it != seq.checkpoints.end(), "no checkpoint at %lld", (long long)resume);
    RETURN_IF_ERROR(seq.state->restore(*it->second));
  }
  CHECK(seq.state->n_tokens() == resume, "state at %lld after rewinding to %lld",
        (long long)seq.state->n_tokens(), (long long)resume);
  seq.tokens.resize(static_cast<size_t>(resume));
  seq.checkpoints.erase(seq.checkpoints.upper_bound(resume), seq.checkpoints.end());
  std::erase_if(seq.recent_marks, [&](int64_t p) { return p > resume; });
  seq.anchor = std::min(seq.anchor, resume);
  return ok_status();
}

}  // namespace

Result<SessionCache::Lease> SessionCache::acquire(Backend& backend, std::span<const int32_t> prompt,
                                                  int64_t max_resume) {
  std::lock_guard lock(mu_);
  auto best = entries_.end();
  int64_t best_resume = 0;
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {  // most recent first: it wins ties
    int64_t limit = std::min(common_prefix((*it)->tokens, prompt), max_resume);
    int64_t r = (*it)->resume_point(limit);
    if (r > best_resume) best = it, best_resume = r;
  }
  if (best_resume > 0) {
    const CachedSequence& e = **best;
    if (best_resume >= e.anchor || best_resume == static_cast<int64_t>(e.tokens.size()))
      return take_over(best, best_resume);
    Result<Lease> forked = fork(e, best_resume);
    if (!forked.ok() || forked->resume > 0) return forked;
  }
  ++stats_.misses;
  Lease lease;
  lease.seq = std::make_unique<CachedSequence>();
  while (!(lease.seq->state = backend.new_sequence())) {
    if (!evict_lru_locked())
      return error(ErrorCode::out_of_range, "the %s backend cannot allocate a sequence", backend.name());
  }
  return lease;
}

Result<SessionCache::Lease> SessionCache::take_over(std::list<Entry>::iterator it, int64_t resume) {
  Lease lease{std::move(*it), resume};
  entries_.erase(it);
  RETURN_IF_ERROR(rewind(*lease.seq, resume));
  ++stats_.hits;
  return lease;
}

// The entry stays as it is; the copy is cut back to `resume`. Checkpoints up to there are shared. A copy the
// backend cannot allocate makes this a miss (resume 0, no sequence) for the caller to handle.
Result<SessionCache::Lease> SessionCache::fork(const CachedSequence& from, int64_t resume) {
  Lease lease;
  lease.seq = std::make_unique<CachedSequence>();
  lease.seq->state = from.state->clone();
  if (!lease.seq->state) return Lease{};
  lease.seq->tokens = from.tokens;
  lease.seq->checkpoints = from.checkpoints;
  lease.seq->recent_marks = from.recent_marks;
  lease.seq->anchor = from.anchor;
  RETURN_IF_ERROR(rewind(*lease.seq, resume));
  lease.resume = resume;
  ++stats_.hits;
  return lease;
}

Result<std::unique_ptr<SequenceState>> SessionCache::new_state(Backend& backend) {
  std::lock_guard lock(mu_);
  std::unique_ptr<SequenceState> state;
  while (!(state = backend.new_sequence())) {
    if (!evict_lru_locked())
      return error(ErrorCode::out_of_range, "the %s backend cannot allocate a sequence", backend.name());
  }
  return state;
}

void SessionCache::release(std::unique_ptr<CachedSequence> seq) {
  CHECK(seq && seq->state, "releasing an empty sequence");
  CHECK(static_cast<int64_t>(seq->tokens.size()) == seq->state->n_tokens(), "cached tokens %zu != state %lld",
        seq->tokens.size(), (long long)seq->state->n_tokens());
  std::lock_guard lock(mu_);
  entries_.push_front(std::move(seq));
  while (!entries_.empty() && bytes_locked() > budget_bytes_) evict_lru_locked();
}

void SessionCache::clear() {
  std::lock_guard lock(mu_);
  entries_.clear();
}

SessionCacheStats SessionCache::stats() const {
  std::lock_guard lock(mu_);
  SessionCacheStats s = stats_;
  s.bytes = bytes_locked();
  s.entries = entries_.size();
  return s;
}

size_t SessionCache::bytes_locked() const {
  std::unordered_set<const Checkpoint*> seen;  // forks share checkpoints: count each once
  size_t b = 0;
  for (const auto& e : entries_) {
    b += e->state->bytes();
    for (const auto& [pos, cp] : e->checkpoints)
      if (seen.insert(cp.get()).second) b += cp->bytes();
  }
  return b;
}

bool SessionCache::evict_lru_locked() {
  if (entries_.empty()) return false;
  entries_.pop_back();
  ++stats_.evictions;
  return true;
}

}  // namespace lily
