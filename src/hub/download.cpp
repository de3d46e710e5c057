#include "hub/download.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "util/sha256.h"

namespace lily {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// `\r  name  [=====>      ]  45%  12.3/27.0 MB  5.1 MB/s` on stderr, redrawn at most 10 times a second.
class ProgressBar {
 public:
  ProgressBar(std::string name, int64_t total, bool on) : name_(std::move(name)), total_(total), on_(on) {}
  void update(int64_t done, bool force = false) {
    if (!on_) return;
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double rate = s > 0 ? (done - start_bytes_) / s : 0;
    const double frac = total_ > 0 ? std::min(1.0, double(done) / double(total_)) : 0;
    const int width = 30, filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < width) bar += '>', bar += std::string(static_cast<size_t>(width - filled - 1), ' ');
    std::fprintf(stderr, "\r  %-32.32s [%s] %3d%%  %s / %s  %s/s   ", name_.c_str(), bar.c_str(),
                 static_cast<int>(frac * 100), human_bytes(done).c_str(), human_bytes(total_).c_str(),
                 human_bytes(static_cast<int64_t>(rate)).c_str());
  }
  void set_start(int64_t bytes) { start_bytes_ = bytes; }
  void finish(int64_t done) {
    if (!on_) return;
    update(done, true);
    std::fputc('\n', stderr);
  }

 private:
  std::string name_;
  int64_t total_, start_bytes_ = 0;
  bool on_;
  Clock::time_point start_ = Clock::now(), last_{};
};

// An exclusive flock on `path` for the object's lifetime (fd < 0: could not be taken; the error says why).
class FileLock {
 public:
  explicit FileLock(const std::string& path, const std::string& what) {
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0664);
    if (fd_ < 0) return;
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
    std::fprintf(stderr, "lily pull: %s: waiting for another download of it (%s)\n", what.c_str(), path.c_str());
    if (::flock(fd_, LOCK_EX) != 0) ::close(fd_), fd_ = -1;
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

int64_t file_size_or_zero(const fs::path& p) {
  std::error_code ec;
  const auto n = fs::file_size(p, ec);
  return ec ? 0 : static_cast<int64_t>(n);
}

// One GET of the rest of the file (from the partial file's size on). Ok when the response ended; the caller
// checks size and sha256. A transport failure is an io error and the bytes received so far stay in the file.
Status fetch_rest(const BlobDownload& d, const HubSession& hub, const fs::path& part, ProgressBar& bar) {
  int64_t have = file_size_or_zero(part);
  std::error_code ec;
  if (d.expected_size >= 0 && have > d.expected_size) fs::remove(part, ec), have = 0;
  if (d.expected_size >= 0 && have == d.expected_size) return ok_status();
  HttpRequest req = hub.request("GET", d.url);
  if (have > 0) req.headers.push_back("Range: bytes=" + std::to_string(have) + "-");
  std::ofstream out;
  int64_t written = 0;
  req.on_body = [&](long status, const char* data, size_t n) {
    if (!out.is_open()) {  // 206: the rest, appended; 200: the server ignored the Range, the whole file again
      const bool append = status == 206 && have > 0;
      out.open(part, std::ios::binary | (append ? std::ios::app : std::ios::trunc));
      written = append ? have : 0;
      bar.set_start(written);
    }
    out.write(data, static_cast<std::streamsize>(n));
    written += static_cast<int64_t>(n);
    bar.update(written);
    return static_cast<bool>(out);
  };
  Result<HttpResponse> r = http_request(req);
  out.close();
  if (!r.ok()) return r.status();
  if (r->status == 416 && d.expected_size >= 0 && have == d.expected_size) return ok_status();
  if (r->status / 100 != 2) return hub.error_for(*r, RepoRef{}, d.display_name);
  return ok_status();
}

}  // namespace

std::string human_bytes(int64_t n) {
  if (n >= 1000000000) return format("%.2f GB", n / 1e9);
  if (n >= 1000000) return format("%.1f MB", n / 1e6);
  return format("%.1f kB", n / 1e3);
}

HttpRequest HubSession::request(const std::string& method, const std::string& url) const {
  HttpRequest r;
  r.method = method, r.url = url;
  if (!token.empty()) r.headers.push_back("Authorization: Bearer " + token);
  return r;
}

Status HubSession::error_for(const HttpResponse& r, const RepoRef& ref, const std::string& file) const {
  const std::string code = r.header("x-error-code");
  const std::string what = ref.repo_id.empty() ? file : ref.repo_id;
  if (code == "GatedRepo" || ((r.status == 401 || r.status == 403) && code != "RepoNotFound"))
    return error(ErrorCode::unsupported,
                 "%s is gated or private (HTTP %ld at %s): accept its terms on %s/%s and set HF_TOKEN to a token "
                 "with access%s",
                 what.c_str(), r.status, endpoint.c_str(), endpoint.c_str(), what.c_str(),
                 token.empty() ? " (no token was sent)" : " (the token sent was refused)");
  if (code == "RevisionNotFound")
    return error(ErrorCode::not_found, "%s has no revision `%s` (HTTP %ld at %s)", what.c_str(),
                 ref.revision.c_str(), r.status, endpoint.c_str());
  if (code == "EntryNotFound" || (r.status == 404 && !file.empty()))
    return error(ErrorCode::not_found, "%s: file `%s` not found (HTTP %ld)", what.c_str(), file.c_str(), r.status);
  if (code == "RepoNotFound" || r.status == 404)
    return error(ErrorCode::not_found, "model %s not found at %s (HTTP %ld): check the id, or set HF_TOKEN if it "
                 "is private", what.c_str(), endpoint.c_str(), r.status);
  return error(ErrorCode::io, "%s: HTTP %ld from %s%s%s", what.c_str(), r.status, r.effective_url.c_str(),
               r.body.empty() ? "" : ": ", r.body.substr(0, 200).c_str());
}

Status download_blob(const BlobDownload& d, const HubSession& hub) {
  const fs::path part = d.blob_path + ".incomplete";
  FileLock lock(d.lock_path, d.display_name);
  if (!lock.held()) return io_error("%s: cannot lock: %s", d.lock_path.c_str(), std::strerror(errno));
  std::error_code exists_ec;
  if (fs::exists(d.blob_path, exists_ec)) return ok_status();  // another process finished it meanwhile
  ProgressBar bar(d.display_name, d.expected_size, d.progress);
  Status last;
  for (int attempt = 0; attempt <= d.retries; ++attempt) {
    if (attempt > 0) {
      if (d.progress) std::fputc('\n', stderr);
      std::fprintf(stderr, "lily pull: %s: %s; resuming at byte %lld (attempt %d of %d)\n", d.display_name.c_str(),
                   last.message().c_str(), static_cast<long long>(file_size_or_zero(part)), attempt, d.retries);
      std::this_thread::sleep_for(std::chrono::milliseconds(200 * attempt));
    }
    last = fetch_rest(d, hub, part, bar);
    if (last.ok()) break;
    if (last.code() != ErrorCode::io) return last;  // the hub said no: retrying will not help
  }
  if (!last.ok()) return last.with_context(format("gave up after %d attempts (the partial file %s is kept; run "
                                                  "`lily pull` again to resume)", d.retries + 1,
                                                  part.string().c_str()));
  const int64_t got = file_size_or_zero(part);
  bar.finish(got);
  std::error_code ec;
  if (d.expected_size >= 0 && got != d.expected_size) {
    fs::remove(part, ec);
    return format_error("got %lld bytes, the hub announced %lld; the partial file was deleted",
                        static_cast<long long>(got), static_cast<long long>(d.expected_size));
  }
  if (!d.expected_sha256.empty()) {
    const std::string sha = sha256_file(part.string());
    if (sha != d.expected_sha256) {
      fs::remove(part, ec);
      return format_error("sha256 mismatch: the hub lists %s, the download is %s; refusing it (deleted, nothing "
                          "added to the cache)", d.expected_sha256.c_str(), sha.c_str());
    }
  }
  fs::rename(part, d.blob_path, ec);
  if (ec) return io_error("%s: %s", d.blob_path.c_str(), ec.message().c_str());
  return ok_status();
}

}  // namespace lily
