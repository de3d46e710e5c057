// API-key check for `--api-key`: the `Authorization` header must be `Bearer KEY` (scheme case-insensitive).
#pragma once
#include <string_view>

namespace lily {

// Compares every byte of the key whatever the input, so the time taken depends only on the key's length, not
// on how much of a guess was right.
bool bearer_token_matches(std::string_view authorization, std::string_view key);

}  // namespace lily
