#include "engine/session_disk.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "util/byte_size.h"

namespace lily {

namespace {

namespace fs = std::filesystem;
constexpr const char* kTmpSuffix = ".tmp";

bool ends_with(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  size_t n = std::min(a.size(), b.size()), i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

// Temporaries are named .NAME.PID.N.tmp: one of a process that is gone (or of an earlier process with this
// pid) was cut off mid-write.
bool stale_temporary(const std::string& file) {
  const size_t end = file.size() - std::strlen(kTmpSuffix);
  const size_t n_dot = file.rfind('.', end - 1);
  if (n_dot == std::string::npos || n_dot == 0) return true;
  const size_t pid_dot = file.rfind('.', n_dot - 1);
  if (pid_dot == std::string::npos) return true;
  const long pid = std::strtol(file.c_str() + pid_dot + 1, nullptr, 10);
  if (pid <= 0 || pid == ::getpid()) return true;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

std::unique_ptr<SessionDisk> SessionDisk::open(SessionDiskOptions o, SessionFileOwner owner) {
  if (!o.log) o.log = [](const std::string& line) { std::fprintf(stderr, "lily: %s\n", line.c_str()); };
  auto off = [&](const std::string& why) {
    o.log(format("--cache-dir %s: %s; sessions are kept in memory only", o.dir.c_str(), why.c_str()));
    return nullptr;
  };
  std::error_code ec;
  if (fs::exists(o.dir, ec) && !fs::is_directory(o.dir, ec)) return off("not a directory");
  if (!fs::exists(o.dir, ec)) {
    fs::create_directories(o.dir, ec);
    if (ec) return off("cannot create it: " + ec.message());
    fs::permissions(o.dir, fs::perms::owner_all, ec);  // the files hold conversations
  }
  // Writable: a probe file (access(2) says yes to root on a read-only mount).
  const std::string probe = (fs::path(o.dir) / format(".probe.%d.0%s", (int)::getpid(), kTmpSuffix)).string();
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return off(format("cannot write in it: %s", std::strerror(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
  if (o.budget_bytes == 0) {
    struct statvfs vfs {};
    o.budget_bytes = kDefaultDiskBudget;
    if (::statvfs(o.dir.c_str(), &vfs) == 0)
      o.budget_bytes = std::min<uint64_t>(kDefaultDiskBudget, uint64_t{vfs.f_bavail} * vfs.f_frsize / 2);
  }
  std::unique_ptr<SessionDisk> d(new SessionDisk(std::move(o), std::move(owner)));
  d->index();
  const SessionDiskStats st = d->stats();
  d->options_.log(format("session cache: %s: %llu session files, %s of %s", d->options_.dir.c_str(),
                         (unsigned long long)st.files, format_byte_size(st.bytes).c_str(),
                         format_byte_size(st.budget_bytes).c_str()));
  d->writer_ = std::thread([p = d.get()] { p->run_writer(); });
  return d;
}

SessionDisk::SessionDisk(SessionDiskOptions options, SessionFileOwner owner)
    : options_(std::move(options)), owner_(std::move(owner)) {
  stats_.budget_bytes = options_.budget_bytes;
}

SessionDisk::~SessionDisk() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (writer_.joinable()) writer_.join();
}

std::string SessionDisk::path_of(const std::string& name) const {
  return (fs::path(options_.dir) / (name + kSessionFileSuffix)).string();
}

void SessionDisk::refuse(const std::string& file, const Status& why) {
  if (why.code() == ErrorCode::not_found) return;  // evicted (here or by another server) since it was listed
  const char* action = "ignored";
  if (why.code() == ErrorCode::format) {
    action = ::unlink(file.c_str()) == 0 ? "deleted" : "ignored (cannot delete it)";
  } else if (why.code() == ErrorCode::unsupported) {
    action = "left in place";
  }
  options_.log(format("session cache: refusing %s: %s; %s", file.c_str(), why.message().c_str(), action));
  std::lock_guard lock(mu_);
  ++stats_.refused;
}

void SessionDisk::index() {
  struct Found {
    std::string name;
    SessionFileInfo info;
    fs::file_time_type mtime;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (fs::directory_iterator it(options_.dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string(), path = it->path().string();
    if (file.starts_with(".") && ends_with(file, kTmpSuffix)) {
      if (stale_temporary(file)) ::unlink(path.c_str());
      continue;
    }
    if (!ends_with(file, kSessionFileSuffix)) {
      options_.log(
          format("session cache: ignoring %s: not a session file (*%s)", path.c_str(), kSessionFileSuffix));
      continue;
    }
    Result<SessionFileInfo> info = read_session_info(path, owner_);
    if (!info.ok()) {
      refuse(path, info.status());
      continue;
    }
    std::error_code tec;
    fs::file_time_type mtime = fs::last_write_time(it->path(), tec);
    found.push_back({file.substr(0, file.size() - std::strlen(kSessionFileSuffix)), std::move(*info), mtime});
  }
  if (ec) options_.log(format("session cache: listing %s: %s", options_.dir.c_str(), ec.message().c_str()));
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  std::vector<std::string> victims;
  {
    std::lock_guard lock(mu_);
    for (Found& f : found) {
      index_bytes_ += f.info.file_bytes;
      index_[f.name] = Indexed{std::move(f.info), ++clock_};
    }
    victims = evict_locked("");
  }
  for (const std::string& v : victims) ::unlink(v.c_str());
}

SessionDisk::Candidate SessionDisk::best(std::span<const int32_t> prompt, int64_t max_resume,
                                         int64_t max_tokens) const {
  std::lock_guard lock(mu_);
  Candidate best;
  uint64_t best_used = 0;
  for (const auto& [name, e] : index_) {
    if (static_cast<int64_t>(e.info.tokens.size()) > max_tokens) continue;
    const int64_t limit = std::min(common_prefix(e.info.tokens, prompt), max_resume);
    int64_t r = 0;
    if (static_cast<int64_t>(e.info.tokens.size()) <= limit) {
      r = static_cast<int64_t>(e.info.tokens.size());
    } else {
      auto it = std::upper_bound(e.info.checkpoints.begin(), e.info.checkpoints.end(), limit);
      if (it != e.info.checkpoints.begin()) r = *std::prev(it);
    }
    if (r > best.resume || (r == best.resume && r > 0 && e.last_used > best_used))
      best = {name, r}, best_used = e.last_used;
  }
  return best;
}

Result<std::unique_ptr<CachedSequence>> SessionDisk::load(const std::string& name, Backend& backend) {
  const std::string path = path_of(name);
  Result<std::unique_ptr<CachedSequence>> seq = read_session_file(path, owner_, backend);
  if (!seq.ok() && seq.status().code() == ErrorCode::out_of_range) return seq.status();
  {
    std::lock_guard lock(mu_);
    auto it = index_.find(name);
    if (!seq.ok() && it != index_.end()) index_bytes_ -= it->second.info.file_bytes, index_.erase(it);
    if (seq.ok() && it != index_.end()) it->second.last_used = ++clock_;
    if (seq.ok()) ++stats_.hits;
  }
  if (!seq.ok()) {
    refuse(path, seq.status());
    return seq.status();
  }
  ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);  // the LRU order survives a restart
  return seq;
}

void SessionDisk::save(const std::string& name, SessionSnapshot snapshot) {
  const size_t bytes = snapshot.bytes();
  {
    std::lock_guard lock(mu_);
    auto same = std::find_if(queue_.begin(), queue_.end(), [&](const Job& j) { return j.name == name; });
    if (same != queue_.end()) {
      queued_bytes_ -= same->snapshot.bytes();
      same->snapshot = std::move(snapshot);
    } else if (!queue_.empty() && queued_bytes_ + bytes > options_.max_pending_bytes) {  // one always fits
      ++stats_.dropped;
      return;
    } else {
      queue_.push_back(Job{name, std::move(snapshot)});
    }
    queued_bytes_ += bytes;
  }
  wake_.notify_one();
}

void SessionDisk::flush() {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [&] { return queue_.empty() && !writing_; });
}

std::string SessionDisk::new_name() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return format("%016llx", (unsigned long long)rng());
}

void SessionDisk::warn_once(const std::string& line) {
  {
    std::lock_guard lock(mu_);
    if (std::exchange(warned_, true)) return;
  }
  options_.log(line);
}

SessionDiskStats SessionDisk::stats() const {
  std::lock_guard lock(mu_);
  SessionDiskStats s = stats_;
  s.bytes = index_bytes_;
  s.files = index_.size();
  return s;
}

void SessionDisk::run_writer() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) break;  // stopping, and everything queued is written
    Job job = std::move(queue_.front());
    queue_.pop_front();
    queued_bytes_ -= job.snapshot.bytes();
    writing_ = true;
    lock.unlock();
    write(job);
    job = Job{};  // the checkpoints' memory goes back before the next wait
    lock.lock();
    writing_ = false;
    if (queue_.empty()) idle_.notify_all();
  }
}

void SessionDisk::write(Job& job) {
  const std::string path = path_of(job.name);
  uint64_t n;
  {
    std::lock_guard lock(mu_);
    n = ++tmp_counter_;
  }
  const std::string tmp = (fs::path(options_.dir) / format(".%s.%d.%llu%s", job.name.c_str(), (int)::getpid(),
                                                           (unsigned long long)n, kTmpSuffix))
                              .string();
  Result<uint64_t> bytes = write_session_file(tmp, owner_, job.snapshot);
  if (bytes.ok() && *bytes > options_.budget_bytes) {
    ::unlink(tmp.c_str());  // larger than the whole budget: it would evict everything and then itself
    std::lock_guard lock(mu_);
    ++stats_.dropped;
    return;
  }
  Status st = bytes.status();
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    st = io_error("rename failed: %s", std::strerror(errno));
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    options_.log(format("session cache: cannot write %s: %s", path.c_str(), st.message().c_str()));
    return;
  }
  SessionFileInfo info;
  info.tokens = std::move(job.snapshot.tokens);
  for (const auto& [pos, cp] : job.snapshot.checkpoints) info.checkpoints.push_back(pos);
  info.file_bytes = *bytes;
  std::vector<std::string> victims;
  {
    std::lock_guard lock(mu_);
    Indexed& e = index_[job.name];
    index_bytes_ -= e.info.file_bytes;
    index_bytes_ += info.file_bytes;
    e = Indexed{std::move(info), ++clock_};
    ++stats_.writes;
    victims = evict_locked(job.name);
  }
  for (const std::string& v : victims) ::unlink(v.c_str());
}

// The least recently used files beyond the budget, `keep` (the one just written) last of all; their paths, to
// unlink once the lock is released.
std::vector<std::string> SessionDisk::evict_locked(const std::string& keep) {
  std::vector<std::string> victims;
  while (index_bytes_ > options_.budget_bytes) {
    auto lru = index_.end();
    for (auto it = index_.begin(); it != index_.end(); ++it)
      if (it->first != keep && (lru == index_.end() || it->second.last_used < lru->second.last_used))
        lru = it;
    if (lru == index_.end()) break;
    victims.push_back(path_of(lru->first));
    index_bytes_ -= lru->second.info.file_bytes;
    index_.erase(lru);
    ++stats_.evictions;
  }
  return victims;
}

}  // namespace lily
