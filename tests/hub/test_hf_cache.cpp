// The Hugging Face cache: repo id parsing, the cache directory from the environment (huggingface_hub's order),
// and resolving ORG/NAME[@REV] through refs/ and snapshots/ with errors that say what to run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "common/temp_dir.h"
#include "hub/hf_cache.h"

namespace lily {
namespace {

namespace fs = std::filesystem;
const std::string kCommit = "0123456789abcdef0123456789abcdef01234567";

// Sets environment variables for one test and restores them after.
class ScopedEnv {
 public:
  void set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it)
      it->second ? setenv(it->first.c_str(), it->second->c_str(), 1) : unsetenv(it->first.c_str());
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// models--org--name with refs/main -> kCommit and a snapshot holding config.json.
void make_cached_repo(const fs::path& cache, const std::string& folder) {
  const fs::path repo = cache / folder;
  fs::create_directories(repo / "refs");
  fs::create_directories(repo / "snapshots" / kCommit);
  fs::create_directories(repo / "blobs");
  std::ofstream(repo / "refs" / "main") << kCommit;  // no newline, as huggingface_hub writes it
  std::ofstream(repo / "blobs" / "abc") << "{}";
  fs::create_symlink("../../blobs/abc", repo / "snapshots" / kCommit / "config.json");
}

TEST(HfCache, ParsesRepoIds) {
  Result<RepoRef> r = parse_repo_ref("Qwen/Qwen3.6-35B-A3B");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->repo_id, "Qwen/Qwen3.6-35B-A3B");
  EXPECT_EQ(r->revision, "main");
  EXPECT_EQ(r->folder_name(), "models--Qwen--Qwen3.6-35B-A3B");
  r = parse_repo_ref("mlx-community/Qwen3.6-35B-A3B-4bit@v1.0");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->revision, "v1.0");
  for (const char* bad : {"noslash", "a/b/c", "a/", "/b", "a--b/c", "a/b..c", "a/-b", "a b/c", "a/b@", "a/b@../x"}) {
    Result<RepoRef> e = parse_repo_ref(bad);
    EXPECT_FALSE(e.ok()) << bad;
    if (!e.ok()) {
      EXPECT_NE(e.status().message().find(std::string("`") + bad + "`"), std::string::npos) << e.status().message();
    }
  }
  EXPECT_TRUE(is_commit_sha(kCommit));
  EXPECT_FALSE(is_commit_sha("main"));
  EXPECT_FALSE(is_commit_sha("0123456789ABCDEF0123456789abcdef01234567"));
}

TEST(HfCache, CacheDirFollowsTheEnvironment) {
  ScopedEnv env;
  env.set("HF_HUB_CACHE", nullptr);
  env.set("HF_HOME", nullptr);
  env.set("XDG_CACHE_HOME", nullptr);
  env.set("HOME", "/home/u");
  EXPECT_EQ(hf_hub_cache_dir(), "/home/u/.cache/huggingface/hub");
  env.set("XDG_CACHE_HOME", "/xdg");
  EXPECT_EQ(hf_hub_cache_dir(), "/xdg/huggingface/hub");
  env.set("HF_HOME", "/hfhome");
  EXPECT_EQ(hf_hub_cache_dir(), "/hfhome/hub");
  EXPECT_EQ(hf_home_dir(), "/hfhome");
  env.set("HF_HUB_CACHE", "/explicit");
  EXPECT_EQ(hf_hub_cache_dir(), "/explicit");
}

TEST(HfCache, ResolvesThroughRefsAndSnapshots) {
  testing::TempDir cache("hfcache");
  make_cached_repo(cache.path(), "models--org--name");
  const std::string snapshot = (cache.path() / "models--org--name" / "snapshots" / kCommit).string();
  Result<std::string> r = resolve_snapshot(cache.str(), *parse_repo_ref("org/name"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, snapshot);
  r = resolve_snapshot(cache.str(), *parse_repo_ref("org/name@" + kCommit));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, snapshot);
}

TEST(HfCache, MissingModelRevisionOrSnapshotSaysWhatToRun) {
  testing::TempDir cache("hfcache_missing");
  make_cached_repo(cache.path(), "models--org--name");
  auto message = [&](const std::string& id) {
    Result<std::string> r = resolve_snapshot(cache.str(), *parse_repo_ref(id));
    EXPECT_FALSE(r.ok()) << id;
    EXPECT_EQ(r.status().code(), ErrorCode::not_found) << id;
    return r.status().message();
  };
  EXPECT_NE(message("org/other").find("run `lily pull org/other`"), std::string::npos) << message("org/other");
  EXPECT_NE(message("org/name@dev").find("not at revision `dev`"), std::string::npos);
  EXPECT_NE(message("org/name@dev").find("lily pull org/name@dev"), std::string::npos);
  fs::remove_all(cache.path() / "models--org--name" / "snapshots" / kCommit);
  EXPECT_NE(message("org/name").find("is missing"), std::string::npos) << message("org/name");
}

TEST(HfCache, ResolveModelPrefersAnExistingDirectory) {
  testing::TempDir work("hfcache_model");
  make_cached_repo(work.path() / "cache", "models--org--name");
  ScopedEnv env;
  env.set("HF_HUB_CACHE", (work.path() / "cache").c_str());
  Result<ModelLocation> m = resolve_model("org/name");
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->repo_id, "org/name");
  EXPECT_EQ(fs::path(m->path).filename(), kCommit);

  const fs::path old_cwd = fs::current_path();
  fs::create_directories(work.path() / "org" / "name");
  fs::current_path(work.path());
  m = resolve_model("org/name");  // a directory of that name wins over the cache
  fs::current_path(old_cwd);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->path, "org/name");
  EXPECT_EQ(m->repo_id, "");

  m = resolve_model((work.path() / "nope").string());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("no such directory"), std::string::npos) << m.status().message();
  std::ofstream(work / "file") << "x";
  m = resolve_model(work / "file");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("not a directory"), std::string::npos) << m.status().message();
}

}  // namespace
}  // namespace lily
