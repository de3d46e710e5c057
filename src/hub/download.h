// One blob of a hub repository onto disk: resumable (the partial file is kept as <blob>.incomplete and continued
// with `Range: bytes=N-`), retried after a transport failure, sha256-checked before it takes its final name.
// HubSession carries the endpoint and the token and turns the hub's error answers into actionable messages.
#pragma once
#include <cstdint>
#include <string>

#include "hub/hf_cache.h"
#include "hub/http_client.h"
#include "util/status.h"

namespace lily {

struct HubSession {
  std::string endpoint, token;
  HttpRequest request(const std::string& method, const std::string& url) const;  // with Authorization
  // A non-success answer about `ref` (and `file`, when about one) as a Status: gated or private (401/403),
  // missing repository, revision or file (404 or the hub's X-Error-Code), anything else with its status.
  Status error_for(const HttpResponse& r, const RepoRef& ref, const std::string& file) const;
};

struct BlobDownload {
  std::string url, display_name, blob_path;
  // Held (flock) while the blob is written: the lock file huggingface_hub takes for the same blob, so two
  // downloads of one blob, by lily or by Python, never write the same .incomplete file at once.
  std::string lock_path;
  int64_t expected_size = -1;   // -1: unknown
  std::string expected_sha256;  // empty: not an LFS file (the hub gives no sha256 for those)
  int retries = 5;
  bool progress = false;
};

std::string human_bytes(int64_t n);  // "12.3 MB", "1.25 GB", "0.4 kB"

// Downloads d.url to d.blob_path (through d.blob_path + ".incomplete") unless another process finished it while
// this one waited for the lock. A size or sha256 mismatch deletes the partial file and leaves nothing under the
// blob's name.
Status download_blob(const BlobDownload& d, const HubSession& hub);

}  // namespace lily
