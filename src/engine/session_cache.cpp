#include "engine/session_cache.h"

#include <algorithm>
#include <unordered_set>

#include "engine/session_disk.h"
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

SessionCache::SessionCache(size_t budget_bytes, std::unique_ptr<SessionDisk> disk)
    : budget_bytes_(budget_bytes), disk_(std::move(disk)) {}

SessionCache::~SessionCache() = default;

Result<SessionCache::Lease> SessionCache::acquire(Backend& backend, std::span<const int32_t> prompt,
                                                  int64_t max_resume) {
  std::lock_guard lock(mu_);
  auto best = entries_.end();
  int64_t best_resume = 0;
  auto find_best = [&] {
    best = entries_.end(), best_resume = 0;
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {  // most recent first: it wins ties
      int64_t limit = std::min(common_prefix((*it)->tokens, prompt), max_resume);
      int64_t r = (*it)->resume_point(limit);
      if (r > best_resume) best = it, best_resume = r;
    }
  };
  find_best();
  if (disk_) {
    const uint64_t evictions = stats_.evictions;
    ASSIGN_OR_RETURN(Lease loaded, load_from_disk(backend, prompt, max_resume, best_resume));
    if (loaded.seq) return loaded;
    if (stats_.evictions != evictions) find_best();  // made room for a load that then failed
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

// A file that resumes `prompt` further than `than` (the best entry in memory), loaded and cut back to where
// it resumes; an empty lease when there is none or it cannot be loaded (the file was refused, or the backend
// has no memory even with every entry evicted).
Result<SessionCache::Lease> SessionCache::load_from_disk(Backend& backend, std::span<const int32_t> prompt,
                                                         int64_t max_resume, int64_t than) {
  const SessionDisk::Candidate c = disk_->best(prompt, max_resume, backend.max_context());
  if (c.resume <= than) return Lease{};
  Result<std::unique_ptr<CachedSequence>> loaded = disk_->load(c.name, backend);
  while (!loaded.ok() && loaded.status().code() == ErrorCode::out_of_range && evict_lru_locked())
    loaded = disk_->load(c.name, backend);
  if (!loaded.ok()) return Lease{};
  CachedSequence& e = **loaded;
  // Measured again on what was read: the file may have been rewritten since it was indexed.
  const int64_t resume = e.resume_point(std::min(common_prefix(e.tokens, prompt), max_resume));
  if (resume <= than) return Lease{};
  // As take_over versus fork: continuing the file's conversation keeps its file, anything else gets its own.
  if (resume >= e.anchor || resume == static_cast<int64_t>(e.tokens.size())) e.disk_name = c.name;
  RETURN_IF_ERROR(rewind(e, resume));
  ++stats_.hits;
  return Lease{std::move(*loaded), resume};
}

// A snapshot for the writer: the state is copied now (a later request may change it), the immutable
// checkpoints are shared. A backend that cannot save its state keeps its sessions in memory only.
void SessionCache::save_to_disk(CachedSequence& seq) {
  SessionSnapshot snap;
  ByteWriter out(snap.state);
  if (Status st = seq.state->save(out); !st.ok()) {
    disk_->warn_once("session cache: not saving sessions: " + st.message());
    return;
  }
  if (seq.disk_name.empty()) seq.disk_name = disk_->new_name();
  snap.tokens = seq.tokens;
  snap.anchor = seq.anchor;
  snap.recent_marks = seq.recent_marks;
  snap.checkpoints = seq.checkpoints;
  disk_->save(seq.disk_name, std::move(snap));
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
  if (disk_) save_to_disk(*seq);
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
  if (disk_) {
    const SessionDiskStats d = disk_->stats();
    s.disk_hits = d.hits, s.disk_writes = d.writes, s.disk_evictions = d.evictions, s.disk_refused = d.refused;
    s.disk_dropped = d.dropped, s.disk_bytes = d.bytes, s.disk_files = d.files, s.disk_budget_bytes = d.budget_bytes;
  }
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
