// parse_json_body (declared in request_fields.h): the raw body of a POST -> a JSON object, in time linear in
// the body's size, with a specific 400 for each way it can be wrong.
//
// Why not json::parse: nlohmann's DOM parser inserts each key with ordered_map::operator[], a linear search
// of the object's keys, so an object of n keys costs O(n^2) (a 1.8 MB body of 150,000 keys: ~29 s of CPU,
// found by profiling `lily serve`). The builder below appends keys to the object's vector and finds
// duplicates through a hash index once an object is larger than a few keys; the last of duplicate keys wins,
// as with json::parse. It also refuses nesting past the limit while parsing (not after), turns a number that
// overflows a double
// (`1e400`, which json::parse reports by throwing out_of_range) into a 400, and stops when the client has
// gone.
#include <string>
#include <unordered_map>
#include <vector>

#include "server/request_fields.h"
#include "tokenizer/pretokenize_utf8.h"

namespace lily {

namespace {

constexpr size_t kMaxJsonDepth = 64;
constexpr size_t kIndexFrom = 16;  // objects with more keys get a hash index of their keys
constexpr size_t kEventsPerClientCheck =
    1u << 14;  // how often the parser asks whether the client is still there

class LinearDomBuilder {
 public:
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;

  LinearDomBuilder(json& root, const std::function<bool()>& client_gone) : root_(root), gone_(client_gone) {}

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(number_integer_t v) { return put(v); }
  bool number_unsigned(number_unsigned_t v) { return put(v); }
  bool number_float(number_float_t v, const string_t&) { return put(v); }
  bool string(string_t& v) { return put(std::move(v)); }
  bool binary(binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(size_t) { return open(json::object()); }
  bool start_array(size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(string_t& k) {
    Frame& f = stack_.back();
    auto& entries = static_cast<json::object_t::Container&>(f.value->get_ref<json::object_t&>());
    if (size_t at = find_key(f, entries, k); at != kNone) {
      entries[at].second = nullptr;  // a duplicate: the last value wins
      slot_ = &entries[at].second;
      return true;
    }
    if (!f.index.empty() || entries.size() + 1 == kIndexFrom) {
      if (f.index.empty()) {
        for (size_t i = 0; i < entries.size(); ++i) f.index.emplace(entries[i].first, i);
      }
      f.index.emplace(k, entries.size());
    }
    entries.emplace_back(std::move(k), nullptr);
    slot_ = &entries.back().second;
    return true;
  }

  bool parse_error(size_t position, const std::string& last_token, const nlohmann::detail::exception& ex) {
    if (error_) return false;  // ours (depth, client gone), reported to the parser as a failure
    if (ex.id == 406) {        // out_of_range.406: a number literal beyond the range of a double
      error_ = bad_request(format("The JSON body holds a number that overflows a double: `%s` at byte %zu. "
                                  "Numbers must be finite (at most about 1.8e308 in magnitude).",
                                  last_token.c_str(), position),
                           "", "invalid_json");
    } else {
      error_ = bad_request(std::string("We could not parse the JSON body of your request: ") + ex.what(), "",
                           "invalid_json");
    }
    return false;
  }

  MaybeError error() const { return error_; }

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  struct Frame {
    json* value;
    std::unordered_map<std::string, size_t> index;  // key -> position, once the object is large
  };

  static size_t find_key(const Frame& f, const json::object_t::Container& entries, const std::string& k) {
    if (!f.index.empty()) {
      auto it = f.index.find(k);
      return it == f.index.end() ? kNone : it->second;
    }
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].first == k) return i;
    }
    return kNone;
  }

  bool tick() {
    if (++events_ % kEventsPerClientCheck == 0 && gone_ && gone_()) {
      error_ = client_gone_error();
      return false;
    }
    return true;
  }

  // Where the next value goes: the root, the slot of the last key, or the end of the open array.
  json* place(json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json* parent = stack_.back().value;
    if (parent->is_array()) {
      auto& items = parent->get_ref<json::array_t&>();
      items.push_back(std::move(v));
      return &items.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }

  bool put(json&& v) {
    place(std::move(v));
    return tick();
  }

  bool open(json&& container) {
    if (stack_.size() >= kMaxJsonDepth) {
      error_ = bad_request(format("The request body nests deeper than %zu levels", kMaxJsonDepth), "",
                           "invalid_json");
      return false;
    }
    stack_.push_back(Frame{place(std::move(container)), {}});
    return tick();
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  json& root_;
  const std::function<bool()>& gone_;
  std::vector<Frame> stack_;
  json* slot_ = nullptr;
  size_t events_ = 0;
  MaybeError error_;
};

}  // namespace

ApiError client_gone_error() {
  return ApiError{499, "invalid_request_error", "The client closed the connection.", "", "client_gone"};
}

MaybeError parse_json_body(std::string_view body, json& out, const std::function<bool()>& client_gone) {
  if (!is_valid_utf8(body)) return bad_request("The request body is not valid UTF-8.", "", "invalid_utf8");
  LinearDomBuilder builder(out, client_gone);
  bool ok = json::sax_parse(body, &builder, json::input_format_t::json, /*strict=*/true);
  if (!ok) {
    out = nullptr;
    MaybeError e = builder.error();
    return e ? e : bad_request("We could not parse the JSON body of your request.", "", "invalid_json");
  }
  if (!out.is_object()) {
    return bad_request(format("The request body must be a JSON object, got %s", json_type_name(out)), "",
                       "invalid_json");
  }
  return std::nullopt;
}

}  // namespace lily
