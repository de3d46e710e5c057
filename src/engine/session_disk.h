// SessionDisk: the disk tier of the session cache (`lily serve --cache-dir DIR`, docs/DESIGN.md section 2).
// Each cached sequence the cache hands back is also written to DIR as a session file (engine/session_file.h)
// by a writer thread; at start DIR is indexed (header and token ids of each file), so after a restart a
// request whose prompt shares a prefix with a file loads its state and checkpoints instead of prefilling.
//
// - The request path only hands a snapshot over (save()): the queue is bounded in bytes, a newer snapshot of
//   an entry replaces one still waiting, and one that does not fit behind the others is dropped (the file is
//   just older).
// - Files are written to a temporary name and renamed into place, so a reader (or a restart after SIGKILL)
//   sees a whole old or a whole new file, never a partial one; temporaries of dead processes are removed at
//   start.
// - The files' total size is bounded (budget_bytes): the least recently written or loaded go first. They hold
//   conversations: files are created 0600, a directory created here 0700.
// - A file that fails any check is refused with one warning line naming it and the reason, then deleted when
//   nothing could use it (truncated, corrupt, junk) or left alone (another model, backend or format version),
//   and the request prefills as without it.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>

#include "engine/session_file.h"

namespace lily {

struct SessionDiskOptions {
  std::string dir;
  uint64_t budget_bytes = 0;  // 0: kDefaultDiskBudget, at most half the free space of dir's file system
  size_t max_pending_bytes = 1ull << 30;        // snapshots waiting for the writer
  std::function<void(const std::string&)> log;  // one line (a warning, the startup summary); default: stderr
};

constexpr uint64_t kDefaultDiskBudget = 16ull << 30;

struct SessionDiskStats {
  uint64_t hits = 0, writes = 0, evictions = 0, refused = 0, dropped = 0;
  uint64_t bytes = 0, files = 0, budget_bytes = 0;
};

class SessionDisk {
 public:
  // Creates dir when missing and indexes it. Null (after a warning) when it cannot be created, is not a
  // directory, or cannot be written: the server then runs without a disk tier.
  static std::unique_ptr<SessionDisk> open(SessionDiskOptions options, SessionFileOwner owner);
  ~SessionDisk();  // writes what is still queued, then stops the writer

  // The file that resumes `prompt` furthest (at most at max_resume, a checkpoint or the file's own end), and
  // that position; resume 0 when none. Files of more than max_tokens tokens (the backend's context) are
  // passed over.
  struct Candidate {
    std::string name;
    int64_t resume = 0;
  };
  Candidate best(std::span<const int32_t> prompt, int64_t max_resume, int64_t max_tokens) const;
  // The entry of file `name` loaded into `backend`; a refused file has been warned about and dropped from the
  // index. ErrorCode::out_of_range: the backend had no memory for it (the file stays).
  Result<std::unique_ptr<CachedSequence>> load(const std::string& name, Backend& backend);
  // Queues `snapshot` to be written as file `name` (replacing an earlier version).
  void save(const std::string& name, SessionSnapshot snapshot);
  void flush();            // waits until everything queued so far is written
  std::string new_name();  // a fresh file name: 16 random hex digits
  SessionDiskStats stats() const;
  void warn_once(const std::string& line);  // the first such line only
  const std::string& dir() const { return options_.dir; }

 private:
  SessionDisk(SessionDiskOptions options, SessionFileOwner owner);
  struct Indexed {
    SessionFileInfo info;
    uint64_t last_used = 0;  // larger: more recent
  };
  struct Job {
    std::string name;
    SessionSnapshot snapshot;
  };
  std::string path_of(const std::string& name) const;
  void index();
  void refuse(const std::string& file, const Status& why);
  void write(Job& job);
  std::vector<std::string> evict_locked(const std::string& keep);
  void run_writer();

  SessionDiskOptions options_;
  SessionFileOwner owner_;
  mutable std::mutex mu_;  // the index and the queue
  std::map<std::string, Indexed> index_;
  uint64_t clock_ = 0, index_bytes_ = 0;
  std::deque<Job> queue_;
  size_t queued_bytes_ = 0;
  bool writing_ = false, stop_ = false;
  std::condition_variable wake_, idle_;
  SessionDiskStats stats_;
  uint64_t tmp_counter_ = 0;
  bool warned_ = false;
  std::thread writer_;
};

}  // namespace lily
