// safetensors: read (mmap, sharded through model.safetensors.index.json) and write (streaming, for synth and
// quantize). Format: u64 little-endian header size N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// then the data region. Every malformed input is a Status naming the file and tensor, never a crash.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "util/status.h"
#include "util/tensor.h"

namespace lily {

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  const uint8_t* data = nullptr;  // into the mapped file
  size_t nbytes = 0;
  std::string file;               // for error messages
};

// Parses a safetensors header from a buffer holding the whole file (pure function; the fuzz target drives it).
// data pointers in the result point into `file_data`.
Result<std::vector<TensorInfo>> parse_safetensors(const uint8_t* file_data, size_t file_size, const std::string& file);

class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Streaming writer: the header is computed from the specs, then fill(i, dst) writes tensor i's bytes.
struct TensorSpec {
  std::string name;
  DType dtype = DType::bf16;
  Shape shape;
  size_t nbytes() const { return static_cast<size_t>(shape.numel()) * dtype_size(dtype); }
};
// All tensors of a checkpoint directory: model.safetensors.index.json when present, else every *.safetensors file.
class TensorStore {
 public:
  static Result<TensorStore> open_dir(const std::string& dir);
  static Result<TensorStore> open_file(const std::string& path);
  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  size_t total_bytes() const;
  // An in-memory tensor (synthetic weights generated without touching the disk).
  Status add_buffer(const TensorSpec& spec, std::shared_ptr<std::vector<uint8_t>> bytes);

 private:
  Status add_file(const std::string& path, const std::string& display);
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> buffers_;
  std::map<std::string, TensorInfo> tensors_;
};

Result<DType> parse_dtype(const std::string& s);

using TensorFill = std::function<void(size_t index, uint8_t* dst)>;
Status write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs, const TensorFill& fill,
                         const std::map<std::string, std::string>& metadata = {});

// Splits specs into shards of at most shard_bytes, writes model-0000i-of-0000N.safetensors and
// model.safetensors.index.json into dir (one model.safetensors when everything fits one shard).
Status write_sharded(const std::string& dir, const std::vector<TensorSpec>& specs, const TensorFill& fill,
                     size_t shard_bytes, const std::map<std::string, std::string>& metadata = {});

}  // namespace lily
