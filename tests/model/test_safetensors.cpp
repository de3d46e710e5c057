// safetensors tests: round trip through write_safetensors / write_sharded and TensorStore::open_dir (sharded with
// an index, and a single file), and every kind of malformed input giving an error that names the file and tensor.
#include "model/safetensors.h"
#include "common/temp_dir.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include <unistd.h>

namespace lily {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using testing::TempDir;

// A byte pattern that depends on the tensor and the byte index, so a misplaced tensor is caught.
uint8_t pattern(size_t tensor, size_t i) { return static_cast<uint8_t>(tensor * 131 + i * 7 + (i >> 8)); }
void fill_pattern(size_t index, uint8_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = pattern(index, i);
}

std::vector<TensorSpec> sample_specs() {
  return {{"model.embed_tokens.weight", DType::bf16, {64, 32}},
          {"model.layers.0.linear_attn.A_log", DType::f32, {8}},
          {"model.layers.0.mlp.experts.gate_up_proj", DType::bf16, {4, 16, 32}},
          {"language_model.lm_head.weight", DType::u32, {64, 4}},
          {"language_model.lm_head.scales", DType::bf16, {64, 1}},
          {"some.f16", DType::f16, {3, 5}},
          {"some.i8", DType::i8, {7}},
          {"some.u8", DType::u8, {2, 2}},
          {"some.empty", DType::f32, {0, 4}}};
}

void expect_store_matches(const TensorStore& store, const std::vector<TensorSpec>& specs) {
  ASSERT_EQ(store.tensors().size(), specs.size());
  size_t total = 0;
  for (size_t k = 0; k < specs.size(); ++k) {
    const TensorSpec& s = specs[k];
    SCOPED_TRACE(s.name);
    const TensorInfo* t = store.find(s.name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, s.dtype);
    EXPECT_EQ(t->shape, s.shape);
    EXPECT_EQ(t->nbytes, s.nbytes());
    for (size_t i = 0; i < t->nbytes; ++i) ASSERT_EQ(t->data[i], pattern(k, i)) << "byte " << i;
    total += s.nbytes();
  }
  EXPECT_EQ(store.total_bytes(), total);
  EXPECT_EQ(store.find("not.there"), nullptr);
}

TEST(Safetensors, RoundTripSingleFile) {
  TempDir dir;
  auto specs = sample_specs();
  auto fill = [&](size_t i, uint8_t* dst) { fill_pattern(i, dst, specs[i].nbytes()); };
  ASSERT_TRUE(write_sharded(dir.str(), specs, fill, 1 << 30, {{"format", "pt"}}).ok());
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  auto store = TensorStore::open_dir(dir.str());
  ASSERT_TRUE(store.ok()) << store.status().message();
  expect_store_matches(*store, specs);
  auto file = TensorStore::open_file(dir / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().message();
  expect_store_matches(*file, specs);

  // The layout on disk: u64 header size, JSON header with metadata, data region aligned to 8 bytes.
  std::ifstream f(dir / "model.safetensors", std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  json h = json::parse(header);
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  EXPECT_EQ(h["some.f16"]["dtype"], "F16");
  EXPECT_EQ(h["some.f16"]["shape"], json({3, 5}));
}

TEST(Safetensors, RoundTripShardedWithIndex) {
  TempDir dir;
  auto specs = sample_specs();
  auto fill = [&](size_t i, uint8_t* dst) { fill_pattern(i, dst, specs[i].nbytes()); };
  ASSERT_TRUE(write_sharded(dir.str(), specs, fill, 4096, {{"format", "mlx"}}).ok());
  std::ifstream f(dir / "model.safetensors.index.json");
  json index = json::parse(f);
  std::set<std::string> shards;
  for (auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_GE(shards.size(), 2u);
  EXPECT_TRUE(shards.count("model-00001-of-0000" + std::to_string(shards.size()) + ".safetensors"));
  EXPECT_EQ(index["weight_map"].size(), specs.size());
  size_t total = 0;
  for (auto& s : specs) total += s.nbytes();
  EXPECT_EQ(index["metadata"]["total_size"], total);
  for (auto& s : shards) EXPECT_TRUE(fs::exists(dir / s)) << s;
  auto store = TensorStore::open_dir(dir.str());
  ASSERT_TRUE(store.ok()) << store.status().message();
  expect_store_matches(*store, specs);
}

TEST(Safetensors, DirectoryWithoutIndexReadsEveryFile) {
  TempDir dir;
  auto specs = sample_specs();
  std::vector<TensorSpec> a(specs.begin(), specs.begin() + 4), b(specs.begin() + 4, specs.end());
  ASSERT_TRUE(write_safetensors(dir / "a.safetensors", a, [&](size_t i, uint8_t* d) { fill_pattern(i, d, a[i].nbytes()); }).ok());
  ASSERT_TRUE(write_safetensors(dir / "b.safetensors", b,
                                [&](size_t i, uint8_t* d) { fill_pattern(i + 4, d, b[i].nbytes()); }).ok());
  auto store = TensorStore::open_dir(dir.str());
  ASSERT_TRUE(store.ok()) << store.status().message();
  expect_store_matches(*store, specs);

  // The same tensor in two files is an error naming both.
  ASSERT_TRUE(write_safetensors(dir / "c.safetensors", {b[0]}, [&](size_t, uint8_t* d) { fill_pattern(4, d, b[0].nbytes()); }).ok());
  auto dup = TensorStore::open_dir(dir.str());
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find(b[0].name), std::string::npos) << dup.status().message();
  EXPECT_NE(dup.status().message().find("b.safetensors"), std::string::npos) << dup.status().message();
  EXPECT_NE(dup.status().message().find("c.safetensors"), std::string::npos) << dup.status().message();

  TempDir empty;
  auto none = TensorStore::open_dir(empty.str());
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find(empty.str()), std::string::npos);
}

// ------------------------------------------------------------------------------------------- malformed files

// Writes a file: u64 header size (or `size_field` when set), the header text, then `data_bytes` bytes.
std::string write_raw(const TempDir& dir, const std::string& name, const std::string& header, size_t data_bytes,
                      std::optional<uint64_t> size_field = std::nullopt) {
  std::string path = dir / name;
  std::ofstream f(path, std::ios::binary);
  uint64_t n = size_field.value_or(header.size());
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  std::string data(data_bytes, '\x11');
  f << data;
  return path;
}

json entry(const char* dtype, std::vector<int64_t> shape, uint64_t begin, uint64_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

// Opens `path` and expects an error naming the file and every one of `needles`.
void expect_open_error(const std::string& path, std::initializer_list<std::string> needles) {
  auto r = TensorStore::open_file(path);
  ASSERT_FALSE(r.ok()) << "opening " << path << " should fail";
  const std::string& msg = r.status().message();
  EXPECT_NE(msg.find(path), std::string::npos) << "message `" << msg << "` should name the file";
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message `" << msg << "` lacks `" << n << "`";
}

TEST(SafetensorsErrors, TruncatedFile) {
  TempDir dir;
  json h = {{"a.weight", entry("BF16", {4, 4}, 0, 32)}, {"b.weight", entry("F32", {8}, 32, 64)}};
  // The data region ends inside b.weight.
  expect_open_error(write_raw(dir, "trunc.safetensors", h.dump(), 40), {"b.weight", "truncated"});
  // Shorter than the 8-byte size field, and empty.
  {
    std::ofstream(dir / "tiny.safetensors", std::ios::binary) << "abc";
    std::ofstream(dir / "empty.safetensors", std::ios::binary);
  }
  expect_open_error(dir / "tiny.safetensors", {"too short"});
  expect_open_error(dir / "empty.safetensors", {"too short"});
  // The header itself cut short.
  expect_open_error(write_raw(dir, "cut.safetensors", h.dump().substr(0, 20), 0, h.dump().size()), {"header size"});
}

TEST(SafetensorsErrors, HeaderSizeLargerThanFile) {
  TempDir dir;
  json h = {{"a.weight", entry("BF16", {4}, 0, 8)}};
  std::string text = h.dump();
  expect_open_error(write_raw(dir, "big.safetensors", text, 8, text.size() + 9), {"header size"});
}

TEST(SafetensorsErrors, AbsurdHeaderSize) {
  TempDir dir;
  expect_open_error(write_raw(dir, "absurd.safetensors", "{}", 0, 1ull << 62), {"header size", "absurd"});
  expect_open_error(write_raw(dir, "max.safetensors", "{}", 0, ~0ull), {"header size"});
  // Over the 100 MB cap even though the file would be large enough is still refused without reading it.
  expect_open_error(write_raw(dir, "cap.safetensors", "{}", 0, 200ull << 20), {"header size"});
}

TEST(SafetensorsErrors, HeaderNotJson) {
  TempDir dir;
  expect_open_error(write_raw(dir, "garbage.safetensors", "{\"a\": [1, 2", 0), {"JSON"});
  expect_open_error(write_raw(dir, "array.safetensors", "[1, 2, 3]", 0), {"JSON"});
  expect_open_error(write_raw(dir, "binary.safetensors", std::string("\xff\xfe\x00\x01", 4), 0), {"JSON"});
}

TEST(SafetensorsErrors, OffsetsPastTheEnd) {
  TempDir dir;
  json h = {{"a.weight", entry("BF16", {4}, 0, 8)}, {"layers.1.far", entry("BF16", {4}, 1000, 1008)}};
  expect_open_error(write_raw(dir, "past.safetensors", h.dump(), 16), {"layers.1.far", "1008"});
  json huge = {{"huge", entry("U8", {4}, ~0ull - 2, ~0ull + 2)}};  // wraps to a small end
  expect_open_error(write_raw(dir, "wrap.safetensors", huge.dump(), 16), {"huge"});
}

TEST(SafetensorsErrors, OverlappingTensors) {
  TempDir dir;
  json h = {{"first.weight", entry("F32", {4}, 0, 16)}, {"second.weight", entry("F32", {4}, 8, 24)}};
  expect_open_error(write_raw(dir, "overlap.safetensors", h.dump(), 24), {"first.weight", "second.weight", "overlap"});
  json same = {{"x", entry("U8", {4}, 0, 4)}, {"y", entry("U8", {4}, 0, 4)}};
  expect_open_error(write_raw(dir, "same.safetensors", same.dump(), 4), {"overlap"});
  // Adjacent and empty tensors are fine.
  json ok = {{"x", entry("U8", {4}, 0, 4)}, {"y", entry("U8", {4}, 4, 8)}, {"z", entry("U8", {0}, 4, 4)}};
  auto r = TensorStore::open_file(write_raw(dir, "adjacent.safetensors", ok.dump(), 8));
  EXPECT_TRUE(r.ok()) << r.status().message();
}

TEST(SafetensorsErrors, EndBeforeBegin) {
  TempDir dir;
  json h = {{"backwards.weight", entry("U8", {0}, 8, 4)}};
  expect_open_error(write_raw(dir, "back.safetensors", h.dump(), 16), {"backwards.weight", "end before begin"});
}

TEST(SafetensorsErrors, SpanNotMatchingShape) {
  TempDir dir;
  json h = {{"wrong.span", entry("BF16", {4, 4}, 0, 30)}};
  expect_open_error(write_raw(dir, "span.safetensors", h.dump(), 32), {"wrong.span", "[4, 4]", "BF16", "30", "32"});
  json f32 = {{"f32.span", entry("F32", {3}, 0, 6)}};
  expect_open_error(write_raw(dir, "span2.safetensors", f32.dump(), 16), {"f32.span", "12"});
  json absurd = {{"absurd.shape", entry("U8", {1 << 30, 1 << 30, 1 << 30}, 0, 8)}};
  expect_open_error(write_raw(dir, "absurd_shape.safetensors", absurd.dump(), 8), {"absurd.shape", "absurd"});
}

TEST(SafetensorsErrors, UnsupportedDtype) {
  TempDir dir;
  json h = {{"fp8.weight", entry("F8_E4M3", {4}, 0, 4)}};
  expect_open_error(write_raw(dir, "dtype.safetensors", h.dump(), 4), {"fp8.weight", "F8_E4M3"});
}

TEST(SafetensorsErrors, BadEntries) {
  TempDir dir;
  struct Case { const char* name; json e; const char* needle; };
  std::vector<Case> cases = {
      {"no_dtype", {{"shape", {4}}, {"data_offsets", {0, 4}}}, "dtype"},
      {"no_shape", {{"dtype", "U8"}, {"data_offsets", {0, 4}}}, "shape"},
      {"neg_shape", entry("U8", {-4}, 0, 4), "shape"},
      {"float_shape", {{"dtype", "U8"}, {"shape", {4.5}}, {"data_offsets", {0, 4}}}, "shape"},
      {"one_offset", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {4}}}, "data_offsets"},
      {"neg_offset", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {-4, 0}}}, "data_offsets"},
      {"str_offset", {{"dtype", "U8"}, {"shape", {4}}, {"data_offsets", {"0", "4"}}}, "data_offsets"},
      {"not_object", json::array({1, 2}), "not an object"},
      {"rank7", entry("U8", {1, 1, 1, 1, 1, 1, 4}, 0, 4), "rank"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    json h = {{c.name, c.e}};
    expect_open_error(write_raw(dir, std::string(c.name) + ".safetensors", h.dump(), 16), {c.name, c.needle});
  }
}

TEST(SafetensorsErrors, MetadataIsIgnored) {
  TempDir dir;
  json h = {{"__metadata__", {{"format", "pt"}}}, {"x", entry("U8", {4}, 0, 4)}};
  auto r = TensorStore::open_file(write_raw(dir, "meta.safetensors", h.dump(), 4));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->tensors().size(), 1u);
}

// A two-shard checkpoint whose index we then edit.
void write_two_shards(const TempDir& dir) {
  std::vector<TensorSpec> specs = {{"a.weight", DType::bf16, {64, 64}}, {"b.weight", DType::bf16, {64, 64}}};
  ASSERT_TRUE(write_sharded(dir.str(), specs, [&](size_t i, uint8_t* d) { fill_pattern(i, d, specs[i].nbytes()); },
                            10000).ok());
  ASSERT_TRUE(fs::exists(dir / "model-00002-of-00002.safetensors"));
}

json read_index(const TempDir& dir) {
  std::ifstream f(dir / "model.safetensors.index.json");
  return json::parse(f);
}
void write_index(const TempDir& dir, const json& j) { std::ofstream(dir / "model.safetensors.index.json") << j.dump(); }

TEST(SafetensorsErrors, IndexNamesMissingShard) {
  TempDir dir;
  write_two_shards(dir);
  fs::remove(dir / "model-00002-of-00002.safetensors");
  auto r = TensorStore::open_dir(dir.str());
  ASSERT_FALSE(r.ok());
  const std::string& msg = r.status().message();
  EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model-00002-of-00002.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("b.weight"), std::string::npos) << msg;

  TempDir other;
  write_two_shards(other);
  json j = read_index(other);
  j["weight_map"]["b.weight"] = "model-00009-of-00009.safetensors";
  write_index(other, j);
  auto r2 = TensorStore::open_dir(other.str());
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("model-00009-of-00009.safetensors"), std::string::npos) << r2.status().message();
  EXPECT_NE(r2.status().message().find("b.weight"), std::string::npos) << r2.status().message();
}

TEST(SafetensorsErrors, IndexNamesTensorTheShardLacks) {
  TempDir dir;
  write_two_shards(dir);
  json j = read_index(dir);
  j["weight_map"]["c.weight"] = "model-00001-of-00002.safetensors";
  write_index(dir, j);
  auto r = TensorStore::open_dir(dir.str());
  ASSERT_FALSE(r.ok());
  const std::string& msg = r.status().message();
  EXPECT_NE(msg.find("c.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model-00001-of-00002.safetensors"), std::string::npos) << msg;
}

TEST(SafetensorsErrors, BadIndex) {
  TempDir dir;
  write_two_shards(dir);
  json j = read_index(dir);
  j["weight_map"]["a.weight"] = "../escape.safetensors";
  write_index(dir, j);
  auto r = TensorStore::open_dir(dir.str());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("../escape.safetensors"), std::string::npos) << r.status().message();
  j["weight_map"]["a.weight"] = 7;
  write_index(dir, j);
  auto r2 = TensorStore::open_dir(dir.str());
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("a.weight"), std::string::npos) << r2.status().message();
  write_index(dir, json::array({1}));
  EXPECT_FALSE(TensorStore::open_dir(dir.str()).ok());
  std::ofstream(dir / "model.safetensors.index.json") << "{not json";
  auto r3 = TensorStore::open_dir(dir.str());
  ASSERT_FALSE(r3.ok());
  EXPECT_NE(r3.status().message().find("model.safetensors.index.json"), std::string::npos) << r3.status().message();
}

TEST(SafetensorsErrors, ParseFromMemory) {
  // parse_safetensors is the pure entry point the fuzz target drives: same checks without a file.
  std::string header = json({{"x", entry("F32", {2}, 0, 8)}}).dump();
  std::vector<uint8_t> buf(8 + header.size() + 8, 0);
  uint64_t n = header.size();
  std::memcpy(buf.data(), &n, 8);
  std::memcpy(buf.data() + 8, header.data(), header.size());
  auto ok = parse_safetensors(buf.data(), buf.size(), "mem");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  ASSERT_EQ(ok->size(), 1u);
  EXPECT_EQ((*ok)[0].data, buf.data() + 8 + header.size());
  EXPECT_EQ((*ok)[0].file, "mem");
  for (size_t cut = 0; cut < buf.size(); ++cut) {
    auto r = parse_safetensors(buf.data(), cut, "mem");
    EXPECT_FALSE(r.ok()) << "prefix of " << cut << " bytes";
  }
}

}  // namespace
}  // namespace lily
