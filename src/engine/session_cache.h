// SessionCache: the sequences kept between requests so that the next turn of a conversation prefills only its
// new tokens (docs/DESIGN.md section 2). Each entry is a backend SequenceState, the exact tokens it has
// consumed and checkpoints of its recurrent state at chosen positions. The KV cache can be cut back to any
// length but the Gated DeltaNet state cannot be rewound, so a request resumes at the latest checkpoint (or
// the state's own end) inside the prefix it shares with an entry. Entries live in an LRU bounded by a byte
// budget (state bytes plus distinct checkpoint bytes; checkpoints are immutable and shared between an entry
// and its forks).
//
// A request checks an entry out (acquire) and hands it back afterwards (release); meanwhile the entry is not
// in the cache, so stats() and clear() are safe from other threads at any time.
//
// With a disk tier (engine/session_disk.h) each released entry is also saved to a file in the background,
// and acquire loads a file instead when it resumes the prompt further than any entry in memory (after a
// restart, or once the entry was evicted from memory).
#pragma once
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "util/status.h"

namespace lily {

struct CachedSequence {
  std::unique_ptr<SequenceState> state;
  std::vector<int32_t>
      tokens;  // exactly the tokens `state` has consumed (tokens.size() == state->n_tokens())
  std::map<int64_t, std::shared_ptr<const Checkpoint>> checkpoints;  // position -> recurrent state there
  // The last request's generation-prompt position (its last <|im_start|>), or the position of the checkpoint
  // taken for it when the backend took that a little earlier (Backend::forward_with_checkpoint). A later
  // request that resumes at or after it continues this conversation and takes the entry over; one that
  // resumes earlier (an edited older message, another conversation with the same system prompt) forks a copy
  // so that this one stays intact.
  int64_t anchor = 0;
  std::vector<int64_t>
      recent_marks;  // anchor/end checkpoint positions of the last requests (pruning keeps them)
  // The disk tier's file of this conversation: kept when the entry is taken over (the next save replaces the
  // file), empty in a fork (which gets a file of its own) and until the first save.
  std::string disk_name;

  // The latest position <= limit at which this entry can resume: a checkpoint, or the state's own end when
  // all of `tokens` is within the limit. 0 when none.
  int64_t resume_point(int64_t limit) const;
  // Records an anchor/end position of the request just run; drops checkpoints that are neither at a multiple
  // of `interval` nor among the last `keep_marks` recorded positions (older turns' anchors are rarely resumed
  // from, and each checkpoint holds a whole recurrent state).
  void mark(int64_t position);
  void prune_checkpoints(int64_t interval, size_t keep_marks = 4);
  size_t checkpoint_bytes() const;
};

struct SessionCacheStats {
  uint64_t hits = 0, misses = 0, evictions = 0;  // hits include disk_hits
  size_t bytes = 0, entries = 0;
  // The disk tier (all 0 without one): hits are requests resumed from a file; refused files failed a check.
  uint64_t disk_hits = 0, disk_writes = 0, disk_evictions = 0, disk_refused = 0, disk_dropped = 0;
  uint64_t disk_bytes = 0, disk_files = 0, disk_budget_bytes = 0;
};

class SessionDisk;

class SessionCache {
 public:
  explicit SessionCache(size_t budget_bytes, std::unique_ptr<SessionDisk> disk = nullptr);
  ~SessionCache();

  // A sequence ready to consume prompt[resume:]: the cached entry that shares the longest usable prefix with
  // `prompt` (resumed at most at `max_resume`), restored to that point (taken over or forked), or a fresh one
  // from the backend when nothing is reusable. resume == 0 counts as a miss.
  struct Lease {
    std::unique_ptr<CachedSequence> seq;
    int64_t resume = 0;
  };
  Result<Lease> acquire(Backend& backend, std::span<const int32_t> prompt, int64_t max_resume);

  // A fresh sequence (no lookup, nothing counted); when the backend cannot allocate one, LRU entries are
  // evicted until it can.
  Result<std::unique_ptr<SequenceState>> new_state(Backend& backend);

  // Puts a sequence back as the most recently used entry, then evicts LRU entries down to the budget (the one
  // just released too, when it alone exceeds it). With a disk tier, first hands a snapshot of it to the
  // writer (a copy of its state in host memory; no disk I/O here).
  void release(std::unique_ptr<CachedSequence> seq);

  void clear();  // the entries in memory (files stay)
  SessionDisk* disk() { return disk_.get(); }
  SessionCacheStats stats() const;
  size_t budget_bytes() const { return budget_bytes_; }

 private:
  using Entry = std::unique_ptr<CachedSequence>;
  Result<Lease> take_over(std::list<Entry>::iterator it, int64_t resume);
  Result<Lease> fork(const CachedSequence& from, int64_t resume);
  Result<Lease> load_from_disk(Backend& backend, std::span<const int32_t> prompt, int64_t max_resume, int64_t than);
  void save_to_disk(CachedSequence& seq);
  size_t bytes_locked() const;
  bool evict_lru_locked();

  const size_t budget_bytes_;
  mutable std::mutex mu_;
  std::list<Entry> entries_;  // front = most recently used
  SessionCacheStats stats_;
  std::unique_ptr<SessionDisk> disk_;  // declared last: its writer stops before the entries go
};

}  // namespace lily
