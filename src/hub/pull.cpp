#include "hub/pull.h"

#include <fnmatch.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "hub/download.h"
#include "hub/hf_cache.h"
#include "hub/http_client.h"

namespace lily {

namespace fs = std::filesystem;

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Percent-encodes all but unreserved characters (and '/' when `keep_slash`), as urllib.parse.quote does.
std::string url_quote(const std::string& s, bool keep_slash) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%', out += kHex[c >> 4], out += kHex[c & 15];
    }
  }
  return out;
}

// A file path from the server becomes a path under snapshots/<commit>/: relative, no "." or ".." parts.
bool safe_repo_path(const std::string& path) {
  if (path.empty() || path.front() == '/' || path.find('\\') != std::string::npos) return false;
  for (const auto& part : fs::path(path))
    if (part == "." || part == ".." || part.empty()) return false;
  return true;
}

bool selected(const PullOptions& o, const std::string& path) {
  auto any = [&](const std::vector<std::string>& patterns) {
    for (const std::string& p : patterns)
      if (fnmatch(p.c_str(), path.c_str(), 0) == 0) return true;
    return false;
  };
  return (o.include.empty() || any(o.include)) && !any(o.exclude);
}

struct RepoFile {
  std::string path, blob_id, lfs_sha256;
  int64_t size = 0;
};

struct RepoListing {
  std::string commit;
  std::vector<RepoFile> files;
};

Result<RepoListing> fetch_listing(const PullOptions& o, const RepoRef& ref, const HubSession& hub) {
  const std::string url = o.endpoint + "/api/models/" + ref.repo_id + "/revision/" +
                          url_quote(ref.revision, false) + "?blobs=true";
  ASSIGN_OR_RETURN(HttpResponse r, http_request(hub.request("GET", url)));
  if (r.status != 200) return hub.error_for(r, ref, "");
  nlohmann::json info = nlohmann::json::parse(r.body, nullptr, false);
  if (info.is_discarded() || !info.is_object() || !info.contains("sha") || !info["sha"].is_string())
    return format_error("%s: the hub's answer is not model info JSON with a `sha`", url.c_str());
  RepoListing listing;
  listing.commit = info["sha"].get<std::string>();
  if (!is_commit_sha(listing.commit))
    return format_error("%s: `sha` %s is not a commit sha", url.c_str(), listing.commit.c_str());
  for (const nlohmann::json& s : info.value("siblings", nlohmann::json::array())) {
    if (!s.is_object() || !s.contains("rfilename") || !s["rfilename"].is_string()) continue;
    RepoFile f;
    f.path = s["rfilename"].get<std::string>();
    if (!safe_repo_path(f.path))
      return format_error("%s: refusing the file name `%s` (absolute, or with '.'/'..' parts)", url.c_str(),
                          f.path.c_str());
    f.size = s.value("size", int64_t{-1});
    f.blob_id = s.value("blobId", std::string());
    if (s.contains("lfs") && s["lfs"].is_object()) {
      f.lfs_sha256 = s["lfs"].value("sha256", std::string());
      f.size = s["lfs"].value("size", f.size);
    }
    listing.files.push_back(std::move(f));
  }
  return listing;
}

// huggingface_hub's _normalize_etag: drop a weak-validator prefix and the quotes.
std::string normalize_etag(std::string etag) {
  if (etag.rfind("W/", 0) == 0) etag = etag.substr(2);
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') etag = etag.substr(1, etag.size() - 2);
  return etag;
}

// The blob name and size from the resolve URL's headers, as hf_hub_download reads them.
struct BlobMeta {
  std::string etag;
  int64_t size = -1;
};

// scheme://host[:port] of a URL, lowercased ("" when it has none).
std::string url_origin(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos) return "";
  std::string origin = url.substr(0, url.find('/', scheme + 3));
  for (char& c : origin) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return origin;
}

// As huggingface_hub: redirects that stay on the hub's host (a renamed repository) are followed; one to another
// host (the CDN) is not, since the file's metadata is on that redirect and the token must not leave the hub.
Result<BlobMeta> head_blob(const std::string& url, const RepoRef& ref, const RepoFile& f, const HubSession& hub) {
  HttpResponse r;
  std::string at = url;
  for (int hop = 0;; ++hop) {
    HttpRequest req = hub.request("HEAD", at);
    req.follow_redirects = false;
    req.headers.push_back("Accept-Encoding: identity");
    ASSIGN_OR_RETURN(r, http_request(req));
    std::string location = r.header("location");
    if (r.status / 100 != 3 || location.empty()) break;
    if (location.front() == '/') location = url_origin(at) + location;
    if (url_origin(location) != url_origin(at)) break;
    if (hop == 10) return io_error("%s: more than 10 redirects", url.c_str());
    at = location;
  }
  if (r.status / 100 != 2 && r.status / 100 != 3) return hub.error_for(r, ref, f.path);
  BlobMeta m;
  m.etag = normalize_etag(!r.header("x-linked-etag").empty() ? r.header("x-linked-etag") : r.header("etag"));
  const std::string size = !r.header("x-linked-size").empty()   ? r.header("x-linked-size")
                           : r.status / 100 == 2 ? r.header("content-length")
                                                 : "";
  m.size = size.empty() ? f.size : std::strtoll(size.c_str(), nullptr, 10);
  if (m.etag.empty()) m.etag = !f.lfs_sha256.empty() ? f.lfs_sha256 : f.blob_id;
  if (m.etag.empty() || m.etag.find('/') != std::string::npos || m.etag.find("..") != std::string::npos)
    return format_error("%s: no usable ETag for the blob name", url.c_str());
  return m;
}

// snapshots/<commit>/<path> -> ../../blobs/<etag> (one more ../ per folder in path), replacing what was there.
Status link_into_snapshot(const fs::path& repo_dir, const std::string& commit, const std::string& path,
                          const std::string& etag) {
  const fs::path link = repo_dir / "snapshots" / commit / path;
  std::error_code ec;
  fs::create_directories(link.parent_path(), ec);
  if (ec) return io_error("%s: %s", link.parent_path().string().c_str(), ec.message().c_str());
  const fs::path target = fs::relative(repo_dir / "blobs" / etag, link.parent_path(), ec);
  if (ec) return io_error("%s: %s", link.string().c_str(), ec.message().c_str());
  fs::remove(link, ec);
  fs::create_symlink(target, link, ec);
  if (ec) return io_error("symlink %s -> %s: %s", link.string().c_str(), target.string().c_str(),
                          ec.message().c_str());
  return ok_status();
}

Status write_ref(const fs::path& repo_dir, const RepoRef& ref, const std::string& commit) {
  if (ref.revision == commit) return ok_status();
  const fs::path file = repo_dir / "refs" / ref.revision;
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << commit;  // no newline, as huggingface_hub writes it
    if (!out) return io_error("%s: cannot write", tmp.string().c_str());
  }
  fs::rename(tmp, file, ec);
  if (ec) return io_error("%s: %s", file.string().c_str(), ec.message().c_str());
  return ok_status();
}

}  // namespace

PullOptions pull_options_from_env() {
  PullOptions o;
  o.endpoint = env("HF_ENDPOINT").empty() ? "https://huggingface.co" : env("HF_ENDPOINT");
  while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  o.token = env("HF_TOKEN");
  if (o.token.empty()) o.token = env("HUGGING_FACE_HUB_TOKEN");
  if (o.token.empty()) {
    const std::string path = !env("HF_TOKEN_PATH").empty() ? env("HF_TOKEN_PATH") : hf_home_dir() + "/token";
    std::ifstream in(path);
    if (in) in >> o.token;
  }
  o.cache_dir = hf_hub_cache_dir();
  o.progress = isatty(STDERR_FILENO) != 0;
  return o;
}

Result<std::string> pull_model(const PullOptions& o) {
  ASSIGN_OR_RETURN(RepoRef ref, parse_repo_ref(o.model));
  HubSession hub{o.endpoint, o.token};
  ASSIGN_OR_RETURN(RepoListing listing, fetch_listing(o, ref, hub));
  const fs::path repo_dir = fs::path(o.cache_dir) / ref.folder_name();
  std::error_code ec;
  fs::create_directories(repo_dir / "blobs", ec);
  if (ec) return io_error("%s: %s", (repo_dir / "blobs").string().c_str(), ec.message().c_str());
  int n_files = 0;
  int64_t n_bytes = 0;
  for (const RepoFile& f : listing.files) {
    if (!selected(o, f.path)) continue;
    const std::string url =
        o.endpoint + "/" + ref.repo_id + "/resolve/" + listing.commit + "/" + url_quote(f.path, true);
    ASSIGN_OR_RETURN(BlobMeta meta, head_blob(url, ref, f, hub));
    const fs::path blob = repo_dir / "blobs" / meta.etag;
    if (!fs::exists(blob, ec)) {
      BlobDownload d;
      d.url = url, d.display_name = f.path, d.blob_path = blob.string();
      d.lock_path = (fs::path(o.cache_dir) / ".locks" / ref.folder_name() / (meta.etag + ".lock")).string();
      d.expected_size = meta.size, d.expected_sha256 = f.lfs_sha256;
      d.retries = o.retries, d.progress = o.progress;
      RETURN_IF_ERROR(download_blob(d, hub).with_context(ref.repo_id + "/" + f.path));
      n_bytes += meta.size > 0 ? meta.size : 0;
      if (!o.quiet && !o.progress) std::fprintf(stderr, "lily pull: %s (%s)\n", f.path.c_str(),
                                                human_bytes(meta.size).c_str());
    }
    RETURN_IF_ERROR(link_into_snapshot(repo_dir, listing.commit, f.path, meta.etag));
    ++n_files;
  }
  if (n_files == 0)
    return error(ErrorCode::not_found, "%s@%s: no file matches the --include/--exclude patterns",
                 ref.repo_id.c_str(), ref.revision.c_str());
  RETURN_IF_ERROR(write_ref(repo_dir, ref, listing.commit));
  if (!o.quiet)
    std::fprintf(stderr, "lily pull: %s@%s is commit %s: %d files, %s downloaded\n", ref.repo_id.c_str(),
                 ref.revision.c_str(), listing.commit.c_str(), n_files, human_bytes(n_bytes).c_str());
  return (repo_dir / "snapshots" / listing.commit).string();
}

}  // namespace lily
