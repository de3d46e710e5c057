// lily pull ORG/NAME[@REVISION]: download a model from the Hugging Face hub into its cache (src/hub/pull.h), so
// that `--model ORG/NAME` finds it, and so do huggingface_hub, transformers and mlx-lm.
#include <cstdio>

#include "cli/commands.h"
#include "hub/hf_cache.h"
#ifdef LILY_HAVE_PULL
#include "hub/pull.h"
#endif

namespace lily::cli {

namespace {

struct PullArgs {
  std::string model, cache_dir;
  std::vector<std::string> include, exclude;
  int retries = 5;
  bool quiet = false, no_progress = false;
};

constexpr const char* kPullHelp = R"(Files land where huggingface_hub puts them (blobs/, snapshots/<commit>/ as symlinks, refs/<revision>), so a model
pulled here is found by transformers, mlx-lm and `huggingface-cli`, and a model they downloaded is found by
`lily serve --model ORG/NAME` without pulling it again. Blobs already in the cache are not downloaded again; a cut
download resumes where it stopped (blobs/<etag>.incomplete); every LFS file is checked against the hub's sha256
before it enters the snapshot.

Environment:
  HF_HUB_CACHE   the cache (default $HF_HOME/hub; HF_HOME defaults to ~/.cache/huggingface)
  HF_ENDPOINT    the hub (default https://huggingface.co), e.g. a mirror
  HF_TOKEN       access token for gated or private models (default: the file `huggingface-cli login` writes)

Examples:
  lily pull mlx-community/Qwen3.6-35B-A3B-4bit
  lily pull Qwen/Qwen3.6-35B-A3B@main --include '*.json' --include '*.safetensors'
  lily serve --model mlx-community/Qwen3.6-35B-A3B-4bit)";

int run_pull(const PullArgs& a) {
#ifdef LILY_HAVE_PULL
  PullOptions o = pull_options_from_env();
  o.model = a.model, o.include = a.include, o.exclude = a.exclude, o.retries = a.retries;
  if (!a.cache_dir.empty()) o.cache_dir = a.cache_dir;
  o.quiet = a.quiet;
  o.progress = o.progress && !a.quiet && !a.no_progress;
  Result<std::string> snapshot = pull_model(o);
  if (!snapshot.ok()) {
    std::fprintf(stderr, "lily pull: %s\n", snapshot.status().message().c_str());
    return snapshot.status().code() == ErrorCode::invalid_argument ? 2 : 1;
  }
  std::printf("%s\n", snapshot->c_str());
  return 0;
#else
  std::fprintf(stderr,
               "lily pull: this lily was built without libcurl (a static build, or -DLILY_PULL=OFF), so it cannot "
               "download %s. Download it with a lily built with libcurl (Debian: libcurl4-openssl-dev) or with "
               "`huggingface-cli download %s`; then `--model %s` finds it in the cache (%s).\n",
               a.model.c_str(), a.model.c_str(), a.model.c_str(), hf_hub_cache_dir().c_str());
  return 1;
#endif
}

void setup(CLI::App& app) {
  auto* cmd = app.add_subcommand("pull", "Download a model from the Hugging Face hub into its cache");
  cmd->footer(kPullHelp);
  auto a = std::make_shared<PullArgs>();
  cmd->add_option("model", a->model, "ORG/NAME[@REVISION] (revision: a branch, a tag or a commit; default main)")
      ->required();
  cmd->add_option("--include", a->include, "only files matching this glob (repeatable), e.g. '*.safetensors'")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--exclude", a->exclude, "skip files matching this glob (repeatable), e.g. '*.bin'")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--cache-dir", a->cache_dir, "hub cache to write (default: $HF_HUB_CACHE or $HF_HOME/hub)");
  cmd->add_option("--retries", a->retries, "resumed attempts per file after a dropped connection")
      ->check(CLI::Range(0, 100));
  cmd->add_flag("--no-progress", a->no_progress, "no progress bar (one line per file instead)");
  cmd->add_flag("--quiet", a->quiet, "print only the snapshot directory");
  cmd->callback([a] { set_exit_code(run_pull(*a)); });
}

}  // namespace

LILY_COMMAND(setup);

}  // namespace lily::cli
