#include "tokenizer/bpe.h"

#include <algorithm>
#include <mutex>
#include <shared_mutex>

#include "tokenizer/pretokenize_utf8.h"
#include "util/check.h"

namespace lily {
namespace {

using json = nlohmann::json;

// Ids beyond this are taken for a corrupt file (Qwen's largest is ~248k); it bounds the id table.
constexpr int64_t kMaxTokenId = 1 << 24;

struct ByteLevelMap {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, uint8_t> to_byte;
  ByteLevelMap() {
    char32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? static_cast<char32_t>(b) : next_extra++;
      to_byte[to_char[b]] = static_cast<uint8_t>(b);
    }
  }
};

const ByteLevelMap& byte_level_map() {
  static const ByteLevelMap map;
  return map;
}

// "a b" (split at the one space) or ["a", "b"].
bool merge_parts(const json& merge, std::string* left, std::string* right) {
  if (merge.is_string()) {
    const std::string& s = merge.get_ref<const std::string&>();
    size_t space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) return false;
    *left = s.substr(0, space);
    *right = s.substr(space + 1);
    return true;
  }
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    *left = merge[0].get<std::string>();
    *right = merge[1].get<std::string>();
    return true;
  }
  return false;
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

char32_t byte_level_char(uint8_t byte) { return byte_level_map().to_char[byte]; }

std::string byte_level_decode(std::string_view vocab_string) {
  const auto& to_byte = byte_level_map().to_byte;
  std::string out;
  size_t pos = 0;
  while (pos < vocab_string.size()) {
    size_t start = pos;
    char32_t c = next_code_point(vocab_string, &pos);
    auto it = to_byte.find(c);
    if (it != to_byte.end()) {
      out += static_cast<char>(it->second);
    } else {
      out.append(vocab_string.substr(start, pos - start));
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// MergeTable
// ------------------------------------------------------------------------------------------------

void MergeTable::reserve(size_t n_rules) {
  size_t capacity = 16;
  shift_ = 60;
  while (capacity < 2 * n_rules) {
    capacity *= 2;
    --shift_;
  }
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(capacity, Slot{kEmpty, {0, 0}});
  n_used_ = 0;
  for (const Slot& slot : old) {
    if (slot.key != kEmpty) set(static_cast<int32_t>(slot.key >> 32), static_cast<int32_t>(slot.key), slot.rule);
  }
}

size_t MergeTable::slot_of(uint64_t key) const {
  return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);  // Fibonacci hashing
}

void MergeTable::set(int32_t left, int32_t right, Rule rule) {
  if (2 * (n_used_ + 1) > slots_.size()) reserve(n_used_ + 1 > 8 ? 2 * (n_used_ + 1) : 8);
  const uint64_t key = pair_key(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = slot_of(key);; i = (i + 1) & mask) {
    if (slots_[i].key == key) {
      slots_[i].rule = rule;
      return;
    }
    if (slots_[i].key == kEmpty) {
      slots_[i] = {key, rule};
      ++n_used_;
      return;
    }
  }
}

const MergeTable::Rule* MergeTable::find(int32_t left, int32_t right) const {
  if (slots_.empty()) return nullptr;
  const uint64_t key = pair_key(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = slot_of(key);; i = (i + 1) & mask) {
    if (slots_[i].key == key) return &slots_[i].rule;
    if (slots_[i].key == kEmpty) return nullptr;
  }
}

// ------------------------------------------------------------------------------------------------
// BpeCache
// ------------------------------------------------------------------------------------------------

struct BpeCache::Shard {
  mutable std::shared_mutex mu;
  std::unordered_map<std::string, std::vector<int32_t>, StringViewHash, std::equal_to<>> words;
};

BpeCache::BpeCache() : shards_(std::make_shared<std::array<Shard, kShards>>()) {}

bool BpeCache::lookup(std::string_view piece, std::vector<int32_t>* ids) const {
  const Shard& shard = (*shards_)[StringViewHash{}(piece) % kShards];
  std::shared_lock lock(shard.mu);
  auto it = shard.words.find(piece);
  if (it == shard.words.end()) return false;
  ids->insert(ids->end(), it->second.begin(), it->second.end());
  return true;
}

void BpeCache::insert(std::string_view piece, const int32_t* ids, size_t n_ids) {
  Shard& shard = (*shards_)[StringViewHash{}(piece) % kShards];
  std::unique_lock lock(shard.mu);
  if (shard.words.size() >= kEntriesPerShard) shard.words.clear();
  shard.words.emplace(std::string(piece), std::vector<int32_t>(ids, ids + n_ids));
}

// ------------------------------------------------------------------------------------------------
// BpeModel
// ------------------------------------------------------------------------------------------------

Result<BpeModel> BpeModel::from_json(const json& model) {
  if (!model.is_object()) return format_error("model: expected an object");
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE") {
    return error(ErrorCode::unsupported, "model: type \"%s\" is unsupported (expected BPE)", type.c_str());
  }
  auto non_empty = [&](const char* key) {
    auto it = model.find(key);
    return it != model.end() && !it->is_null() && !(it->is_string() && it->get_ref<const std::string&>().empty());
  };
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (non_empty(key)) return error(ErrorCode::unsupported, "model: BPE with %s set is unsupported", key);
  }
  if (model.value("byte_fallback", false) == true) {
    return error(ErrorCode::unsupported, "model: BPE byte_fallback=true is unsupported");
  }
  if (!model.contains("vocab") || !model["vocab"].is_object()) return format_error("model.vocab: expected an object");
  if (!model.contains("merges") || !model["merges"].is_array()) return format_error("model.merges: expected an array");

  BpeModel bpe;
  bpe.ignore_merges_ = model.value("ignore_merges", false) == true;
  RETURN_IF_ERROR(bpe.load_vocab(model["vocab"]));
  RETURN_IF_ERROR(bpe.load_merges(model["merges"]));
  std::string scratch;
  for (int b = 0; b < 256; ++b) {
    scratch.clear();
    append_code_point(scratch, byte_level_char(static_cast<uint8_t>(b)));
    bpe.byte_ids_[b] = bpe.token_id(scratch);
  }
  return bpe;
}

Status BpeModel::load_vocab(const json& vocab) {
  vocab_.reserve(vocab.size());
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() >= kMaxTokenId) {
      return format_error("model.vocab[\"%s\"]: expected an id in [0, %lld), got %s", token.c_str(),
                          static_cast<long long>(kMaxTokenId), id_json.dump().c_str());
    }
    if (token.empty()) return format_error("model.vocab: empty token string");
    const auto id = static_cast<int32_t>(id_json.get<int64_t>());
    if (id >= n_ids()) id_to_string_.resize(static_cast<size_t>(id) + 1);
    if (!id_to_string_[id].empty()) {
      return format_error("model.vocab: id %d is used by both \"%s\" and \"%s\"", id, id_to_string_[id].c_str(),
                          token.c_str());
    }
    id_to_string_[id] = token;
    vocab_.emplace(token, id);
  }
  return ok_status();
}

Status BpeModel::load_merges(const json& merges) {
  merges_.reserve(merges.size());
  std::string left, right;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    if (!merge_parts(merges[rank], &left, &right)) {
      return format_error("model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"], got %s", rank,
                          merges[rank].dump().c_str());
    }
    const int32_t left_id = token_id(left), right_id = token_id(right), merged_id = token_id(left + right);
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      const std::string& missing = left_id < 0 ? left : right_id < 0 ? right : left + right;
      return format_error("model.merges[%zu]: token \"%s\" is not in model.vocab", rank, missing.c_str());
    }
    // A repeated pair keeps its last rank, as the HashMap that `tokenizers` collects them into does.
    merges_.set(left_id, right_id, {static_cast<int32_t>(rank), merged_id});
  }
  return ok_status();
}

int32_t BpeModel::token_id(std::string_view vocab_string) const {
  auto it = vocab_.find(vocab_string);
  return it == vocab_.end() ? -1 : it->second;
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.size() == 1) {
    int32_t id = byte_ids_[static_cast<unsigned char>(piece[0])];
    if (id >= 0) ids->push_back(id);
    return;
  }
  const bool cacheable = piece.size() > 4 && piece.size() <= BpeCache::kMaxPieceBytes;
  if (cacheable && cache_.lookup(piece, ids)) return;
  const size_t first = ids->size();
  if (ignore_merges_) {
    std::string chars;
    for (char b : piece) append_code_point(chars, byte_level_char(static_cast<uint8_t>(b)));
    int32_t id = token_id(chars);
    if (id >= 0) {
      ids->push_back(id);
    } else {
      merge(piece, ids);
    }
  } else {
    merge(piece, ids);
  }
  if (cacheable) cache_.insert(piece, ids->data() + first, ids->size() - first);
}

// The merge loop of `tokenizers`' Word::merge_all: a min-heap of candidate pairs ordered by (rank,
// position); a popped candidate is stale if either symbol changed since it was pushed.
void BpeModel::merge(std::string_view piece, std::vector<int32_t>* ids) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
  };
  struct Candidate {
    int32_t rank, pos, left_id, right_id, merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  symbols.clear();
  for (char b : piece) {  // bytes without a vocab entry are dropped, as `tokenizers` does without unk
    int32_t id = byte_ids_[static_cast<unsigned char>(b)];
    if (id < 0) continue;
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  heap.clear();  // a min-heap through std::greater
  auto push_pair = [&](int32_t pos) {
    if (pos < 0 || symbols[pos].next < 0) return;
    const int32_t left = symbols[pos].id, right = symbols[symbols[pos].next].id;
    if (const MergeTable::Rule* rule = merges_.find(left, right)) {
      heap.push_back({rule->rank, pos, left, right, rule->merged_id});
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    }
  };
  for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(symbols.size()); ++pos) push_pair(pos);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = symbols[c.pos];
    if (left.id != c.left_id || left.next < 0 || symbols[left.next].id != c.right_id) continue;  // stale
    Symbol& right = symbols[left.next];
    left.id = c.merged_id;
    right.id = -1;  // dead: no live symbol has id -1
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = c.pos;
    push_pair(left.prev);
    push_pair(c.pos);
  }
  for (int32_t pos = 0; pos >= 0; pos = symbols[pos].next) ids->push_back(symbols[pos].id);
}

}  // namespace lily
