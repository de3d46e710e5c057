// libFuzzer target for the safetensors parser (parse_safetensors, the entry point TensorStore uses on every mapped
// file): arbitrary bytes give either a Status naming the file, or tensors that lie inside the buffer, after the
// header, without overlapping, with nbytes = numel x dtype size, which are then read the way TensorStore's users
// read them. Any violation aborts, so libFuzzer reports it like a sanitizer finding.
// Built with LILY_FUZZ_SEED_MAIN it is instead a small program that writes the seed corpus (scripts/fuzz.sh).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "util/bf16.h"

namespace {

[[noreturn]] void violated(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_safetensors: invariant violated: %s (%s)\n", what, detail.c_str());
  std::abort();
}

// Reads every element of a tensor as its consumer would (copying, since file offsets need not be aligned).
float touch(const lily::TensorInfo& t) {
  float acc = 0;
  const size_t elem = lily::dtype_size(t.dtype);
  for (size_t i = 0; i + elem <= t.nbytes; i += elem) {
    uint32_t u32 = 0;
    uint16_t u16 = 0;
    switch (t.dtype) {
      case lily::DType::bf16: std::memcpy(&u16, t.data + i, 2); acc += lily::bf16_to_float(u16); break;
      case lily::DType::f16: std::memcpy(&u16, t.data + i, 2); acc += lily::f16_to_float(u16); break;
      case lily::DType::f32: case lily::DType::u32: case lily::DType::i32:
        std::memcpy(&u32, t.data + i, 4);
        acc += static_cast<float>(u32 & 0xff);
        break;
      default: acc += t.data[i]; break;
    }
  }
  return acc;
}

void check(const uint8_t* data, size_t size) {
  const std::string file = "fuzz.safetensors";
  auto r = lily::parse_safetensors(data, size, file);
  if (!r.ok()) {
    if (r.status().message().find(file) == std::string::npos) violated("error does not name the file", r.status().message());
    return;
  }
  uint64_t header_size = 0;
  std::memcpy(&header_size, data, 8);  // parse succeeded, so there are at least 8 bytes
  const uint8_t* region = data + 8 + header_size;
  const uint8_t* end = data + size;
  std::vector<const lily::TensorInfo*> by_begin;
  for (const lily::TensorInfo& t : *r) {
    if (t.shape.n < 0 || t.shape.n > lily::kMaxDims) violated("rank", t.name);
    for (int i = 0; i < t.shape.n; ++i)
      if (t.shape[i] < 0) violated("negative dim", t.name);
    if (t.nbytes != static_cast<size_t>(t.shape.numel()) * lily::dtype_size(t.dtype)) violated("nbytes", t.name);
    if (t.file != file) violated("file", t.name);
    if (t.data < region || t.data > end || t.nbytes > static_cast<size_t>(end - t.data))
      violated("tensor outside the data region", t.name);
    volatile float sink = touch(t);
    (void)sink;
    if (t.nbytes) by_begin.push_back(&t);
  }
  std::sort(by_begin.begin(), by_begin.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_begin.size(); ++i)
    if (by_begin[i]->data < by_begin[i - 1]->data + by_begin[i - 1]->nbytes) violated("overlap", by_begin[i]->name);
}

}  // namespace

#ifndef LILY_FUZZ_SEED_MAIN

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An exact-size heap copy, so that any read past the end is an ASan report.
  std::vector<uint8_t> buf(data, data + size);
  check(buf.data(), buf.size());
  return 0;
}

#else  // the seed-corpus writer

namespace {

bool write_file(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

// A file from its header text and data size (filled with a pattern), with an optional lying size field.
std::string raw(const std::string& header, size_t data_bytes, uint64_t size_field = ~0ull) {
  uint64_t n = size_field == ~0ull ? header.size() : size_field;
  std::string out(reinterpret_cast<const char*>(&n), 8);
  out += header;
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i * 37));
  return out;
}

std::string slurp(const std::string& path) {
  std::string s;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return s;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) s.append(buf, n);
  std::fclose(f);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  using lily::DType;
  std::vector<lily::TensorSpec> specs = {{"model.embed_tokens.weight", DType::bf16, {4, 8}},
                                         {"layers.0.linear_attn.A_log", DType::f32, {3}},
                                         {"lm_head.weight", DType::u32, {2, 2}},
                                         {"lm_head.scales", DType::bf16, {2, 1}},
                                         {"x.f16", DType::f16, {2, 3}},
                                         {"x.i8", DType::i8, {5}},
                                         {"x.empty", DType::u8, {0}}};
  const std::string valid = dir + "/valid.safetensors";
  lily::Status st = lily::write_safetensors(
      valid, specs,
      [&](size_t i, uint8_t* dst) {
        for (size_t k = 0; k < specs[i].nbytes(); ++k) dst[k] = static_cast<uint8_t>(i * 31 + k);
      },
      {{"format", "mlx"}});
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message().c_str());
    return 1;
  }
  const std::string v = slurp(valid);
  const std::string e = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)";
  bool ok = write_file(dir + "/truncated.safetensors", v.substr(0, v.size() - 7)) &&
            write_file(dir + "/header_past_end.safetensors", raw("{}", 0, 1000)) &&
            write_file(dir + "/absurd_header.safetensors", raw("{}", 0, 1ull << 60)) &&
            write_file(dir + "/not_json.safetensors", raw("{\"a\": [1, 2", 16)) &&
            write_file(dir + "/overlap.safetensors",
                       raw(e + R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 16)) &&
            write_file(dir + "/end_before_begin.safetensors",
                       raw(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", 16)) &&
            write_file(dir + "/span_mismatch.safetensors",
                       raw(R"({"a":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,16]}})", 16)) &&
            write_file(dir + "/bad_dtype.safetensors",
                       raw(R"({"a":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4)) &&
            write_file(dir + "/metadata.safetensors",
                       raw(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8));
  if (!ok) {
    std::fprintf(stderr, "cannot write the corpus into %s\n", dir.c_str());
    return 1;
  }
  // The seeds themselves must pass the checks (the valid file parses, the rest give errors).
  for (const char* name : {"valid", "truncated", "overlap", "metadata"}) {
    std::string bytes = slurp(dir + "/" + name + ".safetensors");
    check(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  if (!lily::parse_safetensors(reinterpret_cast<const uint8_t*>(v.data()), v.size(), "valid").ok()) return 1;
  std::printf("wrote the seed corpus into %s\n", dir.c_str());
  return 0;
}

#endif
