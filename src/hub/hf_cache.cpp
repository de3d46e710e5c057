#include "hub/hf_cache.h"

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace lily {

namespace fs = std::filesystem;

namespace {

// The hub's rule for a repo name part: letters, digits, '-', '_', '.'; no "--" or "..", no leading or trailing
// '-' or '.'; at most 96 characters.
bool valid_name_part(const std::string& s) {
  if (s.empty() || s.size() > 96) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') return false;
  if (s.find("--") != std::string::npos || s.find("..") != std::string::npos) return false;
  return s.front() != '-' && s.front() != '.' && s.back() != '-' && s.back() != '.';
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

std::string RepoRef::folder_name() const {
  std::string out = "models--" + repo_id;
  const size_t slash = out.find('/');
  return out.replace(slash, 1, "--");
}

bool looks_like_repo_id(const std::string& text) {
  const std::string id = text.substr(0, text.find('@'));
  const size_t slash = id.find('/');
  return slash != std::string::npos && id.find('/', slash + 1) == std::string::npos &&
         valid_name_part(id.substr(0, slash)) && valid_name_part(id.substr(slash + 1));
}

bool is_commit_sha(const std::string& revision) {
  if (revision.size() != 40) return false;
  for (char c : revision)
    if (!std::isdigit(static_cast<unsigned char>(c)) && (c < 'a' || c > 'f')) return false;
  return true;
}

Result<RepoRef> parse_repo_ref(const std::string& text) {
  RepoRef ref;
  const size_t at = text.find('@');
  ref.repo_id = text.substr(0, at);
  if (at != std::string::npos) ref.revision = text.substr(at + 1);
  if (!looks_like_repo_id(ref.repo_id))
    return invalid_argument("`%s` is not a Hugging Face model id: expected ORG/NAME[@REVISION] (letters, digits, "
                            "'-', '_', '.'), e.g. Qwen/Qwen3.6-35B-A3B",
                            text.c_str());
  if (ref.revision.empty() || ref.revision.find("..") != std::string::npos || ref.revision.front() == '/')
    return invalid_argument("`%s`: the revision after '@' must be a branch, a tag or a commit sha", text.c_str());
  return ref;
}

std::string hf_home_dir() {
  if (std::string v = env("HF_HOME"); !v.empty()) return v;
  if (std::string v = env("XDG_CACHE_HOME"); !v.empty()) return (fs::path(v) / "huggingface").string();
  return (fs::path(env("HOME")) / ".cache" / "huggingface").string();
}

std::string hf_hub_cache_dir() {
  if (std::string v = env("HF_HUB_CACHE"); !v.empty()) return v;
  return (fs::path(hf_home_dir()) / "hub").string();
}

Result<std::string> resolve_snapshot(const std::string& cache, const RepoRef& ref) {
  const fs::path repo = fs::path(cache) / ref.folder_name();
  const std::string pull_hint = "run `lily pull " + ref.repo_id +
                                (ref.revision == "main" ? "" : "@" + ref.revision) + "` to download it";
  std::error_code ec;
  if (!fs::is_directory(repo, ec))
    return error(ErrorCode::not_found, "model %s is not in the Hugging Face cache (%s): %s", ref.repo_id.c_str(),
                 repo.string().c_str(), pull_hint.c_str());
  std::string commit = ref.revision;
  if (!is_commit_sha(ref.revision)) {
    std::ifstream in(repo / "refs" / ref.revision);
    if (!in || !(in >> commit) || !is_commit_sha(commit))
      return error(ErrorCode::not_found, "model %s is cached but not at revision `%s` (no %s): %s",
                   ref.repo_id.c_str(), ref.revision.c_str(), (repo / "refs" / ref.revision).string().c_str(),
                   pull_hint.c_str());
  }
  const fs::path snapshot = repo / "snapshots" / commit;
  if (!fs::is_directory(snapshot, ec))
    return error(ErrorCode::not_found, "model %s: revision `%s` names commit %s, but %s is missing: %s",
                 ref.repo_id.c_str(), ref.revision.c_str(), commit.c_str(), snapshot.string().c_str(),
                 pull_hint.c_str());
  return snapshot.string();
}

Result<ModelLocation> resolve_model(const std::string& arg) {
  std::error_code ec;
  if (fs::is_directory(arg, ec)) return ModelLocation{arg, ""};
  if (!looks_like_repo_id(arg)) {
    if (fs::exists(arg, ec)) return invalid_argument("%s: not a directory", arg.c_str());
    return error(ErrorCode::not_found,
                 "%s: no such directory, and not a Hugging Face model id (ORG/NAME[@REVISION])",
                 arg.c_str());
  }
  ASSIGN_OR_RETURN(RepoRef ref, parse_repo_ref(arg));
  ASSIGN_OR_RETURN(std::string path, resolve_snapshot(hf_hub_cache_dir(), ref));
  return ModelLocation{path, ref.repo_id};
}

}  // namespace lily
