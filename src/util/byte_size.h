// Sizes given on the command line ("20G", "512MiB", "1.5T", "4096"): binary multiples (K = 1024); an
// optional "i" and "B" after the unit; case does not matter.
#pragma once
#include <cstdint>
#include <string>

#include "util/status.h"

namespace lily {

Result<uint64_t> parse_byte_size(const std::string& text);
std::string format_byte_size(uint64_t bytes);  // "16.0 GiB"

}  // namespace lily
