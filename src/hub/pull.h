// `lily pull ORG/NAME[@REVISION]`: downloads a model repository from the Hugging Face hub into the hub cache
// (hub/hf_cache.h), the way huggingface_hub does, so both find each other's downloads:
//   1. GET  {endpoint}/api/models/{repo}/revision/{rev}?blobs=true: the commit sha and every file with its size,
//      git blob id and, for LFS files, the sha256;
//   2. per file, HEAD {endpoint}/{repo}/resolve/{commit}/{file} (redirects not followed): X-Linked-Etag or ETag
//      names the blob, X-Linked-Size or Content-Length its size;
//   3. GET the same URL (redirects followed) into blobs/<etag>.incomplete, resumed with Range after a cut;
//      an LFS file's sha256 is checked before it is renamed to blobs/<etag>;
//   4. snapshots/<commit>/<file> -> ../../blobs/<etag> (relative symlinks), then refs/<rev> = commit.
// A blob already in the cache is not downloaded again.
#pragma once
#include <string>
#include <vector>

#include "util/status.h"

namespace lily {

struct PullOptions {
  std::string model;     // ORG/NAME[@REVISION]
  std::string endpoint;  // e.g. https://huggingface.co (no trailing slash)
  std::string token;     // sent as `Authorization: Bearer` when set
  std::string cache_dir;
  std::vector<std::string> include, exclude;  // glob patterns on the file path (fnmatch); empty include: all
  int retries = 5;        // resumed attempts per file after a transport failure
  bool progress = false;  // a progress bar on stderr (a terminal)
  bool quiet = false;     // no per-file lines
};

// The defaults from the environment: HF_ENDPOINT (else https://huggingface.co), HF_TOKEN (else the token file
// `huggingface-cli login` writes: $HF_TOKEN_PATH, else $HF_HOME/token), the hub cache directory.
PullOptions pull_options_from_env();

// Downloads and returns the snapshot directory.
Result<std::string> pull_model(const PullOptions& options);

}  // namespace lily
