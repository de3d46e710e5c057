#include "engine/model_loader.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "engine/session_file.h"

namespace lily {

std::vector<int32_t> stop_token_ids(const ModelConfig& config, const SamplingDefaults& defaults,
                                    const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  auto add = [&](int32_t id) {
    if (id >= 0 && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  for (int id : config.eos_token_ids) add(id);
  for (int32_t id : defaults.eos_token_ids) add(id);
  add(tokenizer.token_id("<|im_end|>"));
  add(tokenizer.token_id("<|endoftext|>"));
  return ids;
}

Result<LoadedModel> load_model(const ModelLoadOptions& o, const std::function<void(const std::string&)>& stage) {
  auto tell = [&](const std::string& what) {
    if (stage) stage(what);
  };
  const auto t0 = std::chrono::steady_clock::now();
  const std::filesystem::path dir(o.model_dir);
  tell("mapping weights from " + o.model_dir);
  ASSIGN_OR_RETURN(ModelWeights w, ModelWeights::load(o.model_dir));
  if (!o.mtp_from.empty()) {
    tell("mapping the MTP head from " + o.mtp_from);
    RETURN_IF_ERROR(w.attach_mtp(o.mtp_from));
  }
  if (o.engine.speculative_tokens > 0 && !w.mtp)
    return error(ErrorCode::not_found,
                 "--speculative mtp:%d: %s has no multi-token-prediction head (no mtp.* tensors). mlx-lm drops it "
                 "when converting; `lily quantize` keeps it, or give the Hugging Face checkpoint's directory with "
                 "--mtp-from DIR",
                 o.engine.speculative_tokens, o.model_dir.c_str());
  auto weights = std::make_shared<const ModelWeights>(std::move(w));
  const ModelConfig& config = weights->config;
  if (o.backend.max_context > config.max_position_embeddings)
    return invalid_argument("--ctx-size %lld exceeds the model's max_position_embeddings %d",
                            (long long)o.backend.max_context, config.max_position_embeddings);
  if (o.backend.max_context < 0 && o.backend.max_context != BackendOptions::kContextAuto)
    return invalid_argument("--ctx-size %lld: a positive number of tokens, or auto", (long long)o.backend.max_context);
  tell("creating the backend");
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(weights, o.backend));
  if (o.engine.speculative_tokens > 0) {
    Status st = backend->enable_mtp();
    if (st.code() == ErrorCode::unsupported)
      return error(ErrorCode::unsupported,
                   "--speculative mtp:%d: the %s backend cannot draft with the MTP head here (%s); the CPU "
                   "backend can (--backend cpu), or run without --speculative",
                   o.engine.speculative_tokens, backend->name(), st.message().c_str());
    RETURN_IF_ERROR(st);
  }
  tell("loading the tokenizer");
  const std::string tokenizer_path = (dir / "tokenizer.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(tokenizer_path, ec))
    return error(ErrorCode::not_found, "%s: no tokenizer.json in the model directory", tokenizer_path.c_str());
  ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::load(tokenizer_path));
  tell("reading generation_config.json");
  ASSIGN_OR_RETURN(SamplingDefaults defaults, load_generation_config(o.model_dir));
  // The CPU backend holds the model's maximum; the engine is bounded by an explicit --ctx-size there too.
  int64_t ctx = backend->max_context();
  if (o.backend.max_context > 0) ctx = std::min<int64_t>(ctx, o.backend.max_context);
  const std::string backend_name = backend->name();
  tell("starting the engine on " + backend_name);
  EngineOptions engine = o.engine;
  engine.max_context = ctx;
  engine.model_fingerprint = model_fingerprint(*weights);
  engine.mtp_fingerprint = mtp_fingerprint(*weights);
  LoadedModel out{std::make_unique<Engine>(std::move(backend), tokenizer, engine),
                  tokenizer,
                  defaults,
                  stop_token_ids(config, defaults, tokenizer),
                  ctx,
                  config.vocab_size,
                  backend_name,
                  0.0};
  out.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace lily
