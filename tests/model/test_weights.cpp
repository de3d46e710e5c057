// ModelWeights binding: a tiny synthetic checkpoint (synth_write, both layouts) loads, and copies of it with one
// tensor dropped, reshaped or retyped (rewritten with write_safetensors) fail with an error that names the tensor
// and says expected vs got. Each TEST synthesises its checkpoint once (ctest runs every TEST in its own process).
#include "model/weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "model/synth.h"
#include "common/temp_dir.h"

#include <unistd.h>

namespace lily {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using testing::TempDir;

// Small shards so that a corrupted copy rewrites a few MB, not the whole checkpoint.
constexpr size_t kShardBytes = 4u << 20;

void synth(const TempDir& dir, CheckpointLayout layout) {
  SynthOptions o;
  o.preset = "tiny";
  o.layout = layout;
  o.out_dir = dir.str();
  o.seed = 3;
  o.shard_bytes = kShardBytes;
  Status st = synth_write(o);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(fs::exists(dir.path() / "model.safetensors.index.json"));
}

struct Edit {
  enum Op { drop, reshape, retype } op;
  std::string name;
  Shape shape;
  DType dtype = DType::bf16;
};

// dst = src with `edit` applied: the shard holding the tensor is rewritten with write_safetensors (the other
// tensors' bytes copied), every other file is symlinked, and the index follows a dropped tensor.
void corrupt_copy(const TempDir& src, const TempDir& dst, const Edit& edit) {
  json index = json::parse(std::ifstream(src.path() / "model.safetensors.index.json"));
  ASSERT_TRUE(index["weight_map"].contains(edit.name)) << edit.name;
  const std::string shard = index["weight_map"][edit.name];
  for (const auto& e : fs::directory_iterator(src.path())) {
    const std::string f = e.path().filename().string();
    if (f != shard && f != "model.safetensors.index.json") fs::create_symlink(e.path(), dst.path() / f);
  }
  auto store = TensorStore::open_file((src.path() / shard).string());
  ASSERT_TRUE(store.ok()) << store.status().message();
  std::vector<const TensorInfo*> infos;
  for (const auto& [name, t] : store->tensors()) infos.push_back(&t);
  std::sort(infos.begin(), infos.end(), [](auto* a, auto* b) { return a->data < b->data; });  // file order
  std::vector<TensorSpec> specs;
  std::vector<const TensorInfo*> sources;
  for (const TensorInfo* t : infos) {
    TensorSpec s{t->name, t->dtype, t->shape};
    if (t->name == edit.name) {
      if (edit.op == Edit::drop) continue;
      if (edit.op == Edit::reshape) s.shape = edit.shape;
      if (edit.op == Edit::retype) s.dtype = edit.dtype;
    }
    specs.push_back(s);
    sources.push_back(t);
  }
  auto fill = [&](size_t i, uint8_t* out) {
    std::memcpy(out, sources[i]->data, std::min(sources[i]->nbytes, specs[i].nbytes()));
  };
  Status st = write_safetensors((dst.path() / shard).string(), specs, fill);
  ASSERT_TRUE(st.ok()) << st.message();
  if (edit.op == Edit::drop) index["weight_map"].erase(edit.name);
  std::ofstream(dst.path() / "model.safetensors.index.json") << index.dump();
}

// Loads a corrupted copy and expects an error containing every needle.
void expect_bind_error(const TempDir& src, const Edit& edit, std::initializer_list<std::string> needles) {
  SCOPED_TRACE(edit.name);
  TempDir dst("bad");
  ASSERT_NO_FATAL_FAILURE(corrupt_copy(src, dst, edit));
  auto r = ModelWeights::load(dst.str());
  ASSERT_FALSE(r.ok()) << "loading with a corrupted " << edit.name << " should fail";
  const std::string& msg = r.status().message();
  std::printf("[weights] %s\n", msg.c_str());
  EXPECT_NE(msg.find("`" + edit.name + "`"), std::string::npos) << msg;
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "`" << msg << "` lacks `" << n << "`";
}

void expect_loads(const TempDir& dir, CheckpointLayout layout, size_t n_tensors) {
  auto w = ModelWeights::load(dir.str());
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->layout, layout);
  EXPECT_EQ(w->store->tensors().size(), n_tensors);
  EXPECT_EQ(w->n_tensors, n_tensors) << "every tensor of the checkpoint is bound exactly once";
  EXPECT_EQ(w->tensor_bytes, w->store->total_bytes());
  ASSERT_EQ(w->layers.size(), 4u);
  EXPECT_EQ(w->layers[3].type, LayerType::full_attention);
  EXPECT_EQ(w->layers[0].moe.expert_gate.size(), 16u);
  ASSERT_TRUE(w->mtp.has_value()) << "synth writes the MTP head";
  EXPECT_EQ(w->mtp->layer.type, LayerType::full_attention);
  EXPECT_EQ(w->mtp->fc.in, 2 * w->config.hidden_size);
  EXPECT_EQ(w->mtp->layer.moe.expert_gate.size(), 16u);
}

TEST(WeightsBinding, HfLayout) {
  TempDir dir("hf");
  ASSERT_NO_FATAL_FAILURE(synth(dir, CheckpointLayout::hf));
  // tiny: 3 Gated DeltaNet layers x 18 + 1 attention layer x 15 + 3 globals + 19 MTP (MODEL.md 1.2 counting).
  ASSERT_NO_FATAL_FAILURE(expect_loads(dir, CheckpointLayout::hf, 3 * 18 + 15 + 3 + 19));
  const std::string p = "model.language_model.layers.";
  expect_bind_error(dir, {Edit::drop, p + "1.linear_attn.in_proj_qkv.weight", {}}, {"missing", "[512, 128]"});
  expect_bind_error(dir, {Edit::drop, p + "3.self_attn.q_norm.weight", {}}, {"missing", "[64]"});
  expect_bind_error(dir, {Edit::reshape, p + "3.self_attn.k_proj.weight", {64, 128}},
                    {"expected [128, 128]", "got [64, 128] BF16"});
  expect_bind_error(dir, {Edit::reshape, p + "0.linear_attn.conv1d.weight", {512, 4, 1}},
                    {"expected [512, 1, 4]", "got [512, 4, 1]"});
  expect_bind_error(dir, {Edit::reshape, p + "2.mlp.experts.down_proj", {16, 64, 128}},
                    {"expected [16, 128, 64]", "got [16, 64, 128]"});
  expect_bind_error(dir, {Edit::retype, p + "0.mlp.experts.gate_up_proj", {}, DType::i8},
                    {"expected [16, 128, 128] BF16|F16|F32", "got [16, 128, 128] I8"});
  expect_bind_error(dir, {Edit::retype, p + "2.linear_attn.A_log", {}, DType::i32}, {"expected [4]", "got [4] I32"});
  expect_bind_error(dir, {Edit::reshape, "lm_head.weight", {151936, 64}}, {"expected [151936, 128]"});
  expect_bind_error(dir, {Edit::drop, "model.language_model.norm.weight", {}}, {"missing"});
}

TEST(WeightsBinding, MlxLayout) {
  TempDir dir("mlx");
  ASSERT_NO_FATAL_FAILURE(synth(dir, CheckpointLayout::mlx));
  // tiny: 3 x 45 + 1 x 40 + 7 (MODEL.md 2.3: quantized triples plus the unquantized tensors).
  ASSERT_NO_FATAL_FAILURE(expect_loads(dir, CheckpointLayout::mlx, 3 * 45 + 40 + 7 + 46));
  const std::string p = "language_model.model.layers.";
  expect_bind_error(dir, {Edit::drop, p + "0.mlp.switch_mlp.down_proj.biases", {}}, {"missing", "[16, 128, 1]"});
  expect_bind_error(dir, {Edit::drop, p + "3.self_attn.q_proj.weight", {}}, {"missing"});
  expect_bind_error(dir, {Edit::drop, p + "1.linear_attn.in_proj_z.scales", {}}, {"missing", "[256, 2]"});
  expect_bind_error(dir, {Edit::drop, p + "2.mlp.switch_mlp.gate_proj.scales", {}}, {"missing", "[16, 64, 2]"});
  // The 8-bit router stored with the 4-bit width.
  expect_bind_error(dir, {Edit::reshape, p + "2.mlp.gate.weight", {16, 16}}, {"expected [16, 32] U32", "got [16, 16] U32"});
  expect_bind_error(dir, {Edit::reshape, p + "0.linear_attn.conv1d.weight", {512, 1, 4}},
                    {"expected [512, 4, 1]", "got [512, 1, 4]"});
  expect_bind_error(dir, {Edit::retype, p + "1.linear_attn.in_proj_z.scales", {}, DType::f16},
                    {"expected [256, 2] BF16", "got [256, 2] F16"});
  expect_bind_error(dir, {Edit::retype, p + "0.mlp.switch_mlp.up_proj.weight", {}, DType::i32},
                    {"expected [16, 64, 16] U32", "got [16, 64, 16] I32"});
  expect_bind_error(dir, {Edit::reshape, "language_model.lm_head.scales", {151936, 1}}, {"expected [151936, 2] BF16"});
}

// MLX's own writer (mlx/io/safetensors.cpp save_safetensors) does not pad the header, so in real mlx-community
// files the data region, and every tensor in it, can start at any byte. Such a copy of the checkpoint (header
// padding removed, then 1-3 spaces so the data region is odd-aligned) must bind to the same values.
TEST(WeightsBinding, UnpaddedHeaderAsMlxWritesIt) {
  TempDir dir("mlxpad"), odd("mlxodd");
  ASSERT_NO_FATAL_FAILURE(synth(dir, CheckpointLayout::mlx));
  for (const auto& e : fs::directory_iterator(dir.path())) {
    const std::string f = e.path().filename().string();
    if (e.path().extension() != ".safetensors") {
      fs::copy_file(e.path(), odd.path() / f);
      continue;
    }
    std::ifstream in(e.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    std::string header = bytes.substr(8, n);
    while (!header.empty() && header.back() == ' ') header.pop_back();
    while ((8 + header.size()) % 4 != 1) header.push_back(' ');
    const uint64_t m = header.size();
    std::ofstream out(odd.path() / f, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&m), 8);
    out << header;
    out.write(bytes.data() + 8 + n, static_cast<std::streamsize>(bytes.size() - 8 - n));
  }
  auto a = ModelWeights::load(dir.str());
  auto b = ModelWeights::load(odd.str());
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->embed_tokens.w) % 2, 1u) << "the copy should really be misaligned";
  EXPECT_EQ(b->n_tensors, a->n_tensors);
  EXPECT_EQ(b->final_norm, a->final_norm);
  EXPECT_EQ(b->layers[0].gdn.conv1d, a->layers[0].gdn.conv1d);
  EXPECT_EQ(b->layers[0].gdn.A_log, a->layers[0].gdn.A_log);
  EXPECT_EQ(b->layers[3].attn.q_norm, a->layers[3].attn.q_norm);
  std::vector<float> ra(128), rb(128), x(128, 0.5f);
  for (const auto& [la, lb] : {std::pair{&a->embed_tokens, &b->embed_tokens}, std::pair{&a->lm_head, &b->lm_head},
                               std::pair{&a->layers[1].moe.router, &b->layers[1].moe.router},
                               std::pair{&a->layers[2].moe.expert_up[7], &b->layers[2].moe.expert_up[7]}}) {
    for (int64_t r : {int64_t{0}, la->out / 2, la->out - 1}) {
      la->dequant_row(r, ra.data());
      lb->dequant_row(r, rb.data());
      EXPECT_EQ(ra, rb) << "row " << r;
      EXPECT_EQ(la->dot_row(r, x.data()), lb->dot_row(r, x.data())) << "row " << r;
    }
  }
}

TEST(WeightsBinding, NoEmbedding) {
  TempDir dir("noemb");
  std::vector<TensorSpec> specs = {{"foo.weight", DType::bf16, {4, 4}}};
  ASSERT_TRUE(write_sharded(dir.str(), specs, [](size_t, uint8_t*) {}, 1 << 20).ok());
  auto c = synth_config("tiny", CheckpointLayout::hf);
  ASSERT_TRUE(c.ok());
  std::ofstream(dir.path() / "config.json") << c->to_json_text(true);
  auto r = ModelWeights::load(dir.str());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("embed_tokens"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace lily
