// The Hugging Face hub cache, laid out exactly as huggingface_hub writes it, so a checkpoint downloaded by
// `huggingface-cli download`, mlx-lm or transformers is used in place and what `lily pull` writes is found by
// them:
//   <cache>/models--ORG--NAME/refs/<revision>            the commit sha a branch or tag points to (text)
//   <cache>/models--ORG--NAME/snapshots/<commit>/<file>  a relative symlink to ../../blobs/<etag>
//   <cache>/models--ORG--NAME/blobs/<etag>               the file (LFS files: etag = sha256 of the content)
#pragma once
#include <string>

#include "util/status.h"

namespace lily {

// "ORG/NAME" or "ORG/NAME@REVISION" (a branch, a tag or a commit sha; default "main").
struct RepoRef {
  std::string repo_id;  // ORG/NAME
  std::string revision = "main";
  std::string folder_name() const;  // models--ORG--NAME
};

// Parses a repo id; the error says what is wrong with it.
Result<RepoRef> parse_repo_ref(const std::string& text);
// True when `text` has the shape of a repo id (one '/', hub-legal characters), whether or not it is cached.
bool looks_like_repo_id(const std::string& text);
bool is_commit_sha(const std::string& revision);  // 40 lowercase hex digits

// From the environment, as huggingface_hub computes them: $HF_HOME, else $XDG_CACHE_HOME/huggingface, else
// ~/.cache/huggingface; the cache is $HF_HUB_CACHE, else <hf_home>/hub.
std::string hf_home_dir();
std::string hf_hub_cache_dir();

// The snapshot directory of `ref` in `cache`: refs/<revision> names the commit (a commit sha is used as is).
// not_found, with "run `lily pull ORG/NAME`", when the model or the revision is not cached.
Result<std::string> resolve_snapshot(const std::string& cache, const RepoRef& ref);

// What every --model option accepts: an existing directory (it wins), else a repo id resolved in the cache.
struct ModelLocation {
  std::string path;     // the directory to load
  std::string repo_id;  // ORG/NAME when resolved in the cache, else empty
};
Result<ModelLocation> resolve_model(const std::string& arg);

}  // namespace lily
