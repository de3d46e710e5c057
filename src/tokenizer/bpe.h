// The BPE model of a byte-level tokenizer.json: vocab, merges ranked by their order in the file,
// and the GPT-2 byte <-> char map that ByteLevel applies before it.
//
// A piece's raw bytes are BPE-merged directly on ids: each byte starts as the id of its byte-level
// char, then the adjacent pair with the lowest merge rank (leftmost first on ties) is merged until no
// pair has a rank - what `tokenizers` computes. Results are cached per piece (thread-safe).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "util/status.h"

namespace lily {

// GPT-2 bytes_to_unicode(): printable bytes map to themselves, the other 68 to U+0100.. in order.
char32_t byte_level_char(uint8_t byte);
// Inverse map over a vocab string: byte-level chars to bytes; other chars pass through as UTF-8.
std::string byte_level_decode(std::string_view vocab_string);

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Piece bytes -> ids, sharded with a reader-writer lock per shard. A full shard is cleared, so a
// long-running server keeps the words it currently sees.
class BpeCache {
 public:
  BpeCache();
  bool lookup(std::string_view piece, std::vector<int32_t>* ids) const;  // appends on a hit
  void insert(std::string_view piece, const int32_t* ids, size_t n_ids);

  static constexpr size_t kMaxPieceBytes = 128;  // longer pieces are rare and not cached

 private:
  static constexpr size_t kShards = 64;
  static constexpr size_t kEntriesPerShard = 2048;
  struct Shard;
  std::shared_ptr<std::array<Shard, kShards>> shards_;  // shared: copies of a model share its cache
};

// (left id, right id) -> merge rule: open addressing with linear probing, sized for a load factor
// <= 1/2. The BPE inner loop does one lookup per candidate pair, so this is the hot table.
class MergeTable {
 public:
  struct Rule {
    int32_t rank;
    int32_t merged_id;
  };
  void reserve(size_t n_rules);
  void set(int32_t left, int32_t right, Rule rule);  // overwrites an existing pair
  const Rule* find(int32_t left, int32_t right) const;

 private:
  struct Slot {
    uint64_t key;  // kEmpty or (left << 32 | right)
    Rule rule;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are < 2^24, so no real key is all ones
  size_t slot_of(uint64_t key) const;
  std::vector<Slot> slots_;
  size_t n_used_ = 0;
  int shift_ = 64;
};

class BpeModel {
 public:
  // tokenizer.json "model": type BPE without dropout, subword prefixes/suffixes or byte fallback.
  static Result<BpeModel> from_json(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized piece, given as raw bytes.
  void encode_piece(std::string_view piece, std::vector<int32_t>* ids) const;

  int32_t token_id(std::string_view vocab_string) const;  // -1 if absent
  bool has_id(int32_t id) const { return id >= 0 && id < n_ids() && !id_to_string_[id].empty(); }
  const std::string& token_string(int32_t id) const { return id_to_string_[id]; }  // needs has_id(id)
  int32_t n_ids() const { return static_cast<int32_t>(id_to_string_.size()); }  // max vocab id + 1

 private:
  Status load_vocab(const nlohmann::json& vocab);
  Status load_merges(const nlohmann::json& merges);
  void merge(std::string_view piece, std::vector<int32_t>* ids) const;

  std::unordered_map<std::string, int32_t, StringViewHash, std::equal_to<>> vocab_;
  std::vector<std::string> id_to_string_;       // "" where no token has that id
  std::array<int32_t, 256> byte_ids_{};         // id of each byte's byte-level char, -1 if not in vocab
  MergeTable merges_;
  bool ignore_merges_ = false;
  mutable BpeCache cache_;  // shared by copies; thread-safe
};

}  // namespace lily
