// The one model loader of `lily serve` and the CLI (engine/model_loader.h): the stop ids both get, what it reports
// about the backend, and its errors.
#include "engine/model_loader.h"

#include <algorithm>

#include "test_engine_util.h"

namespace lily::test {
namespace {

ModelLoadOptions cpu_options() {
  ModelLoadOptions o;
  o.model_dir = tiny_model().dir.string();
  o.backend.kind = BackendKind::cpu;
  o.backend.n_threads = 2;
  return o;
}

// The stop ids: config.json's eos ids, generation_config.json's, <|im_end|> and <|endoftext|>, each once, in that
// order. The server (Server::load_model) and the CLI (cli::load_engine) both take them from load_model.
TEST(ModelLoader, StopIdsAreTheEosIdsImEndAndEndOfText) {
  const Tokenizer& tok = tiny_model().tokenizer;
  const int32_t im_end = tok.token_id("<|im_end|>"), eot = tok.token_id("<|endoftext|>");
  ASSERT_GE(im_end, 0);
  ASSERT_GE(eot, 0);
  ModelConfig c;
  c.eos_token_ids = {eot, 5};
  SamplingDefaults d;
  d.eos_token_ids = {5, 7};
  EXPECT_EQ(stop_token_ids(c, d, tok), (std::vector<int32_t>{eot, 5, 7, im_end}));
  c.eos_token_ids.clear(), d.eos_token_ids.clear();
  EXPECT_EQ(stop_token_ids(c, d, tok), (std::vector<int32_t>{im_end, eot}));

  auto m = load_model(cpu_options());
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto want = stop_token_ids(tiny_model().weights->config, m->defaults, tok);
  EXPECT_EQ(m->stop_token_ids, want);
  EXPECT_NE(std::find(want.begin(), want.end(), im_end), want.end());
  EXPECT_NE(std::find(want.begin(), want.end(), eot), want.end());
}

TEST(ModelLoader, ReportsTheBackendAndItsContext) {
  const int model_max = tiny_model().weights->config.max_position_embeddings;
  auto m = load_model(cpu_options());
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->backend_name, "cpu");
  EXPECT_EQ(m->ctx_size, model_max);  // the CPU backend's default: the model's maximum
  EXPECT_EQ(m->vocab_size, tiny_model().weights->config.vocab_size);
  ModelLoadOptions o = cpu_options();
  o.backend.max_context = BackendOptions::kContextAuto;  // CPU: the model's maximum too
  auto a = load_model(o);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->ctx_size, model_max);
  o.backend.max_context = 64;
  auto small = load_model(o);
  ASSERT_TRUE(small.ok()) << small.status().message();
  EXPECT_EQ(small->ctx_size, 64);
  std::vector<std::string> stages;
  auto staged = load_model(cpu_options(), [&](const std::string& s) { stages.push_back(s); });
  ASSERT_TRUE(staged.ok());
  EXPECT_EQ(stages.size(), 5u);
}

TEST(ModelLoader, ErrorsNameTheProblem) {
  ModelLoadOptions o = cpu_options();
  o.backend.max_context = int64_t{1} << 40;
  auto big = load_model(o);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("exceeds the model's max_position_embeddings"), std::string::npos)
      << big.status().message();
  o.backend.max_context = -7;
  auto neg = load_model(o);
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.status().message().find("or auto"), std::string::npos) << neg.status().message();
  o = cpu_options();
  o.model_dir = "/nonexistent/lily-model";
  EXPECT_FALSE(load_model(o).ok());
}

}  // namespace
}  // namespace lily::test
