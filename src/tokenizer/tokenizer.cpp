#include "tokenizer/tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "tokenizer/bpe.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/pretokenize_added.h"
#include "tokenizer/pretokenize_utf8.h"

namespace lily {

using json = nlohmann::json;

struct Tokenizer::Impl {
  BpeModel bpe;
  Normalizer normalizer;
  SplitRegex split;
  AddedTokenMatcher raw_matcher;         // added tokens with normalized=false: cut from the raw text
  AddedTokenMatcher normalized_matcher;  // normalized=true: cut from each normalized segment
  std::unordered_map<int32_t, AddedToken> added_by_id;
  std::unordered_map<std::string, int32_t, StringViewHash, std::equal_to<>> added_by_content;
  std::string token_bytes_blob;            // token_bytes(id) of every id, back to back
  std::vector<uint32_t> token_bytes_start;  // vocab_size + 1 offsets into token_bytes_blob
  int32_t vocab_size = 0;

  void encode_plain(std::string_view text, std::vector<std::string_view>* pieces, std::vector<int32_t>* ids) const;
};

namespace {

Result<AddedToken> parse_added_token(const json& j, size_t index) {
  if (!j.is_object() || !j.contains("id") || !j["id"].is_number_integer() || !j.contains("content") ||
      !j["content"].is_string()) {
    return format_error("added_tokens[%zu]: expected {\"id\": int, \"content\": string, ...}, got %s", index,
                        j.dump().c_str());
  }
  AddedToken t;
  const int64_t id = j["id"].get<int64_t>();
  t.content = j["content"].get<std::string>();
  if (id < 0 || id >= (1 << 24)) return format_error("added_tokens[%zu]: id %lld out of range", index,
                                                     static_cast<long long>(id));
  if (t.content.empty() || !is_valid_utf8(t.content)) {
    return format_error("added_tokens[%zu]: content must be non-empty UTF-8", index);
  }
  t.id = static_cast<int32_t>(id);
  auto flag = [&](const char* key) { return j.value(key, false) == true; };
  t.special = flag("special");
  t.lstrip = flag("lstrip");
  t.rstrip = flag("rstrip");
  t.normalized = flag("normalized");
  t.single_word = flag("single_word");
  return t;
}

Status load_added_tokens(const json& doc, Tokenizer::Impl* impl) {
  if (!doc.contains("added_tokens") || doc["added_tokens"].is_null()) return ok_status();
  const json& list = doc["added_tokens"];
  if (!list.is_array()) return format_error("added_tokens: expected an array");
  std::vector<AddedToken> raw, normalized;
  for (size_t i = 0; i < list.size(); ++i) {
    ASSIGN_OR_RETURN(AddedToken t, parse_added_token(list[i], i));
    if (impl->added_by_id.count(t.id) != 0) return format_error("added_tokens[%zu]: duplicate id %d", i, t.id);
    impl->added_by_content.emplace(t.content, t.id);
    impl->added_by_id.emplace(t.id, t);
    if (t.normalized) {
      std::string storage;  // the pattern is the normalized content, as in `tokenizers`
      t.content = std::string(impl->normalizer.apply(t.content, &storage));
      normalized.push_back(std::move(t));
    } else {
      raw.push_back(std::move(t));
    }
  }
  impl->raw_matcher = AddedTokenMatcher(std::move(raw));
  impl->normalized_matcher = AddedTokenMatcher(std::move(normalized));
  return ok_status();
}

Status check_decoder(const json& doc) {
  const json& decoder = doc.contains("decoder") ? doc["decoder"] : json();
  const std::string type = decoder.is_object() ? decoder.value("type", std::string()) : std::string("null");
  if (type != "ByteLevel") {
    return error(ErrorCode::unsupported, "decoder: type \"%s\" is unsupported (expected ByteLevel)", type.c_str());
  }
  return ok_status();
}

void build_token_bytes(Tokenizer::Impl* impl) {
  int32_t max_added = -1;
  for (const auto& [id, token] : impl->added_by_id) max_added = std::max(max_added, id);
  impl->vocab_size = std::max(impl->bpe.n_ids(), max_added + 1);
  impl->token_bytes_start.reserve(static_cast<size_t>(impl->vocab_size) + 1);
  for (int32_t id = 0; id < impl->vocab_size; ++id) {
    impl->token_bytes_start.push_back(static_cast<uint32_t>(impl->token_bytes_blob.size()));
    auto added = impl->added_by_id.find(id);
    if (added != impl->added_by_id.end()) {
      impl->token_bytes_blob += added->second.content;
    } else if (impl->bpe.has_id(id)) {
      impl->token_bytes_blob += byte_level_decode(impl->bpe.token_string(id));
    }
  }
  impl->token_bytes_start.push_back(static_cast<uint32_t>(impl->token_bytes_blob.size()));
}

Result<Tokenizer::Impl> build_impl(const json& doc) {
  if (!doc.is_object()) return format_error("tokenizer.json: expected a JSON object at the top level");
  Tokenizer::Impl impl;
  const json null_json;
  auto component = [&](const char* key) -> const json& { return doc.contains(key) ? doc[key] : null_json; };
  ASSIGN_OR_RETURN(impl.normalizer, Normalizer::from_json(component("normalizer")));
  ASSIGN_OR_RETURN(impl.split, SplitRegex::from_json(component("pre_tokenizer")));
  ASSIGN_OR_RETURN(impl.bpe, BpeModel::from_json(component("model")));
  RETURN_IF_ERROR(check_decoder(doc));
  // "post_processor" is not read: it only acts with add_special_tokens=True, and lily never adds
  // special tokens in encode() (the chat format writes them as text).
  RETURN_IF_ERROR(load_added_tokens(doc, &impl));
  build_token_bytes(&impl);
  return impl;
}

}  // namespace

Result<Tokenizer> Tokenizer::load(const std::string& tokenizer_json_path) {
  std::ifstream file(tokenizer_json_path, std::ios::binary);
  if (!file) return io_error("cannot open tokenizer file %s", tokenizer_json_path.c_str());
  std::stringstream buffer;
  buffer << file.rdbuf();
  if (file.bad()) return io_error("error reading tokenizer file %s", tokenizer_json_path.c_str());
  Result<Tokenizer> tokenizer = from_json_string(buffer.str());
  if (!tokenizer.ok()) return tokenizer.status().with_context(tokenizer_json_path);
  return tokenizer;
}

Result<Tokenizer> Tokenizer::from_json_string(std::string_view tokenizer_json) {
  try {
    json doc = json::parse(tokenizer_json);
    ASSIGN_OR_RETURN(Impl impl, build_impl(doc));
    return Tokenizer(std::make_shared<const Impl>(std::move(impl)));
  } catch (const json::exception& e) {  // a parse error or a field of the wrong JSON type
    return format_error("tokenizer.json: %s", e.what());
  }
}

void Tokenizer::Impl::encode_plain(std::string_view text, std::vector<std::string_view>* pieces,
                                   std::vector<int32_t>* ids) const {
  pieces->clear();
  split.split(text, pieces);
  for (std::string_view piece : *pieces) bpe.encode_piece(piece, ids);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const Impl& impl = *impl_;
  std::string repaired;
  if (!is_valid_utf8(text)) {
    append_utf8_lossy(repaired, text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  std::vector<TextSegment> segments, inner_segments;
  std::vector<std::string_view> pieces;
  std::string normalized_storage;
  impl.raw_matcher.split(text, &segments);
  for (const TextSegment& segment : segments) {
    if (segment.added_id >= 0) {
      ids.push_back(segment.added_id);
      continue;
    }
    std::string_view normalized = impl.normalizer.apply(segment.text, &normalized_storage);
    inner_segments.clear();
    impl.normalized_matcher.split(normalized, &inner_segments);
    for (const TextSegment& inner : inner_segments) {
      if (inner.added_id >= 0) {
        ids.push_back(inner.added_id);
      } else {
        impl.encode_plain(inner.text, &pieces, &ids);
      }
    }
  }
  return ids;
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  const Impl& impl = *impl_;
  if (id < 0 || id >= impl.vocab_size) return {};
  const uint32_t start = impl.token_bytes_start[id];
  return std::string_view(impl.token_bytes_blob).substr(start, impl.token_bytes_start[id + 1] - start);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string bytes;
  for (int32_t id : ids) bytes += token_bytes(id);
  std::string text;
  append_utf8_lossy(text, bytes);
  return text;
}

int32_t Tokenizer::token_id(std::string_view token_text) const {
  auto it = impl_->added_by_content.find(token_text);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->bpe.token_id(token_text);
}

std::string Tokenizer::token_text(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  if (it != impl_->added_by_id.end()) return it->second.content;
  return impl_->bpe.has_id(id) ? impl_->bpe.token_string(id) : std::string();
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second.special;
}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_.token_bytes(id);
  std::string out;
  pending_.erase(0, append_utf8_complete(out, pending_));
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_utf8_lossy(out, pending_);
  pending_.clear();
  return out;
}

}  // namespace lily
