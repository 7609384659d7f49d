// Minimal JSON reader for the headers of SWIFT log chunks (json.dumps or JsonWriter output):
// objects, arrays, strings (with \uXXXX escapes of the basic plane), integers, numbers, booleans,
// null. Strict: anything else is an error with its offset, never a guess.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace jitckpt {

struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  int64_t integer = 0;     // exact when the number was written without fraction or exponent
  bool is_integer = false;
  std::string string;
  std::vector<JsonValue> array;
  std::vector<std::pair<std::string, JsonValue>> object;

  // The member named `key` of an object, or nullptr.
  const JsonValue* find(const char* key) const;
};

// Parses all of `text`. Returns false with a message naming the offset on malformed input.
bool parse_json(const std::string& text, JsonValue* out, std::string* error);

}  // namespace jitckpt
