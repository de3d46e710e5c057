#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace lily {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // real headers are < 10 MB

Result<DType> parse_dtype(const std::string& s) {
  static const std::map<std::string, DType> kDtypes = {
      {"F32", DType::f32}, {"F16", DType::f16}, {"BF16", DType::bf16}, {"U32", DType::u32},
      {"I32", DType::i32}, {"I8", DType::i8},   {"U8", DType::u8},     {"I64", DType::i64}};
  auto it = kDtypes.find(s);
  if (it == kDtypes.end()) return format_error("unsupported dtype `%s`", s.c_str());
  return it->second;
}

static Result<TensorInfo> parse_entry(const std::string& name, const json& e, uint64_t data_size,
                                      const std::string& file) {
  auto bad = [&](const std::string& why) {
    return format_error("%s: tensor `%s`: %s", file.c_str(), name.c_str(), why.c_str());
  };
  if (!e.is_object()) return bad("header entry is not an object");
  if (!e.contains("dtype") || !e["dtype"].is_string()) return bad("missing or non-string `dtype`");
  if (!e.contains("shape") || !e["shape"].is_array()) return bad("missing or non-array `shape`");
  if (!e.contains("data_offsets") || !e["data_offsets"].is_array() || e["data_offsets"].size() != 2)
    return bad("`data_offsets` must be [begin, end]");
  TensorInfo t;
  t.name = name;
  t.file = file;
  auto dt = parse_dtype(e["dtype"].get<std::string>());
  if (!dt.ok()) return bad(dt.status().message());
  t.dtype = *dt;
  if (e["shape"].size() > kMaxDims) return bad(format("rank %zu exceeds %d", e["shape"].size(), kMaxDims));
  uint64_t numel = 1;
  for (const json& d : e["shape"]) {
    if (!d.is_number_unsigned()) return bad("shape entries must be non-negative integers");
    uint64_t v = d.get<uint64_t>();
    if (v > (1ull << 40) || (v && numel > (1ull << 50) / v)) return bad("shape is absurdly large");
    numel *= v;
    t.shape.d[t.shape.n++] = static_cast<int64_t>(v);
  }
  const json& off = e["data_offsets"];
  if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) return bad("data_offsets must be non-negative");
  uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  if (end < begin) return bad(format("data_offsets [%llu, %llu] end before begin", (unsigned long long)begin,
                                     (unsigned long long)end));
  if (end > data_size)
    return bad(format("data_offsets end %llu is past the data region (%llu bytes): file truncated?",
                      (unsigned long long)end, (unsigned long long)data_size));
  uint64_t want = numel * dtype_size(t.dtype);
  if (end - begin != want)
    return bad(format("data_offsets span %llu bytes, but shape %s %s needs %llu", (unsigned long long)(end - begin),
                      t.shape.str().c_str(), dtype_name(t.dtype), (unsigned long long)want));
  t.data = reinterpret_cast<const uint8_t*>(begin);  // offset for now; rebased by the caller
  t.nbytes = want;
  return t;
}

Result<std::vector<TensorInfo>> parse_safetensors(const uint8_t* file_data, size_t file_size,
                                                  const std::string& file) {
  if (file_size < 8) return format_error("%s: %zu bytes is too short for a safetensors file", file.c_str(), file_size);
  uint64_t header_size = 0;
  std::memcpy(&header_size, file_data, 8);  // little-endian hosts only (x86-64, arm64)
  if (header_size > kMaxHeaderBytes || header_size > file_size - 8)
    return format_error("%s: header size %llu is absurd for a file of %zu bytes", file.c_str(),
                        (unsigned long long)header_size, file_size);
  const char* hp = reinterpret_cast<const char*>(file_data + 8);
  json header = json::parse(hp, hp + header_size, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return format_error("%s: header is not a valid JSON object", file.c_str());
  const uint8_t* data_region = file_data + 8 + header_size;
  uint64_t data_size = file_size - 8 - header_size;
  std::vector<TensorInfo> out;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto t = parse_entry(name, entry, data_size, file);
    if (!t.ok()) return t.status();
    out.push_back(std::move(*t));
  }
  // Ranges must not overlap (empty tensors take no room).
  std::vector<const TensorInfo*> by_begin;
  for (const auto& t : out)
    if (t.nbytes) by_begin.push_back(&t);
  std::sort(by_begin.begin(), by_begin.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_begin.size(); ++i) {
    auto prev_end = reinterpret_cast<uintptr_t>(by_begin[i - 1]->data) + by_begin[i - 1]->nbytes;
    if (reinterpret_cast<uintptr_t>(by_begin[i]->data) < prev_end)
      return format_error("%s: tensor `%s` overlaps tensor `%s`", file.c_str(), by_begin[i]->name.c_str(),
                          by_begin[i - 1]->name.c_str());
  }
  for (auto& t : out) t.data = data_region + reinterpret_cast<uintptr_t>(t.data);
  return out;
}

Result<std::shared_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open %s: %s", path.c_str(), std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return io_error("%s is not a regular file", path.c_str());
  }
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->size_ = static_cast<size_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return io_error("cannot mmap %s: %s", path.c_str(), std::strerror(errno));
    }
    m->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return m;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
}

Status TensorStore::add_file(const std::string& path, const std::string& display) {
  ASSIGN_OR_RETURN(auto file, MappedFile::open(path));
  ASSIGN_OR_RETURN(auto infos, parse_safetensors(file->data(), file->size(), display));
  for (auto& t : infos) {
    if (tensors_.count(t.name))
      return format_error("%s: tensor `%s` is also in %s", display.c_str(), t.name.c_str(),
                          tensors_[t.name].file.c_str());
    std::string name = t.name;
    tensors_.emplace(name, std::move(t));
  }
  files_.push_back(std::move(file));
  return ok_status();
}

Result<TensorStore> TensorStore::open_file(const std::string& path) {
  TensorStore s;
  RETURN_IF_ERROR(s.add_file(path, path));
  return s;
}

Result<TensorStore> TensorStore::open_dir(const std::string& dir) {
  TensorStore s;
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    std::ifstream f(index);
    std::stringstream ss;
    ss << f.rdbuf();
    json j = json::parse(ss.str(), nullptr, false);
    if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object())
      return format_error("%s: not a valid index (needs a `weight_map` object)", index.c_str());
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) return format_error("%s: weight_map[`%s`] is not a file name", index.c_str(), name.c_str());
      std::string fname = file.get<std::string>();
      if (fname.find('/') != std::string::npos || fname.find("..") != std::string::npos)
        return format_error("%s: shard name `%s` must be a plain file name", index.c_str(), fname.c_str());
      by_file[fname].push_back(name);
    }
    for (auto& [fname, names] : by_file) {
      fs::path p = fs::path(dir) / fname;
      if (!fs::exists(p, ec))
        return io_error("%s: shard `%s` (holding `%s`) is missing", index.c_str(), fname.c_str(), names[0].c_str());
      RETURN_IF_ERROR(s.add_file(p.string(), p.string()));
      for (auto& n : names)
        if (!s.tensors_.count(n))
          return format_error("%s: index maps tensor `%s` to it, but the file does not hold it", p.c_str(), n.c_str());
    }
    return s;
  }
  std::vector<fs::path> files;
  for (auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors") files.push_back(e.path());
  if (ec) return io_error("cannot read directory %s: %s", dir.c_str(), ec.message().c_str());
  if (files.empty()) return io_error("%s: no model.safetensors.index.json and no *.safetensors file", dir.c_str());
  std::sort(files.begin(), files.end());
  for (auto& p : files) RETURN_IF_ERROR(s.add_file(p.string(), p.string()));
  return s;
}

const TensorInfo* TensorStore::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Status TensorStore::add_buffer(const TensorSpec& spec, std::shared_ptr<std::vector<uint8_t>> bytes) {
  if (bytes->size() != spec.nbytes())
    return invalid_argument("tensor `%s`: buffer of %zu bytes, shape needs %zu", spec.name.c_str(), bytes->size(),
                            spec.nbytes());
  if (tensors_.count(spec.name)) return invalid_argument("tensor `%s` added twice", spec.name.c_str());
  tensors_[spec.name] = TensorInfo{spec.name, spec.dtype, spec.shape, bytes->data(), bytes->size(), "<memory>"};
  buffers_.push_back(std::move(bytes));
  return ok_status();
}

size_t TensorStore::total_bytes() const {
  size_t n = 0;
  for (auto& [_, t] : tensors_) n += t.nbytes;
  return n;
}

Status write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs, const TensorFill& fill,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& s : specs) {
    json shape = json::array();
    for (int i = 0; i < s.shape.n; ++i) shape.push_back(s.shape[i]);
    header[s.name] = {{"dtype", dtype_name(s.dtype)}, {"shape", shape}, {"data_offsets", {offset, offset + s.nbytes()}}};
    offset += s.nbytes();
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8) text.push_back(' ');  // align the data region to 8 bytes
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return io_error("cannot create %s: %s", path.c_str(), std::strerror(errno));
  uint64_t n = text.size();
  bool ok = std::fwrite(&n, 8, 1, f) == 1 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  std::vector<uint8_t> buf;
  for (size_t i = 0; ok && i < specs.size(); ++i) {
    buf.assign(specs[i].nbytes(), 0);
    fill(i, buf.data());
    ok = buf.empty() || std::fwrite(buf.data(), 1, buf.size(), f) == buf.size();
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return io_error("writing %s failed (disk full?)", path.c_str());
  return ok_status();
}

Status write_sharded(const std::string& dir, const std::vector<TensorSpec>& specs, const TensorFill& fill,
                     size_t shard_bytes, const std::map<std::string, std::string>& metadata) {
  std::vector<std::vector<size_t>> shards(1);
  size_t cur = 0, total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (cur > 0 && cur + specs[i].nbytes() > shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += specs[i].nbytes();
    total += specs[i].nbytes();
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot create directory %s: %s", dir.c_str(), ec.message().c_str());
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string name = shards.size() == 1 ? std::string("model.safetensors")
                                          : format("model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<TensorSpec> sub;
    for (size_t i : shards[s]) {
      sub.push_back(specs[i]);
      weight_map[specs[i].name] = name;
    }
    const auto& idx = shards[s];
    RETURN_IF_ERROR(write_safetensors((fs::path(dir) / name).string(), sub,
                                      [&](size_t j, uint8_t* dst) { fill(idx[j], dst); }, metadata));
  }
  if (shards.size() > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream f(fs::path(dir) / "model.safetensors.index.json");
    f << index.dump(2);
    if (!f) return io_error("cannot write %s/model.safetensors.index.json", dir.c_str());
  }
  return ok_status();
}

}  // namespace lily
