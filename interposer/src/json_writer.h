// Minimal JSON text builder for status(): objects, arrays, strings, numbers, booleans, null.
#pragma once

#include <cstdint>
#include <string>

namespace jitckpt {

class JsonWriter {
 public:
  JsonWriter& begin_object() { sep(); out_ += '{'; first_ = true; return *this; }
  JsonWriter& end_object() { out_ += '}'; first_ = false; return *this; }
  JsonWriter& begin_array() { sep(); out_ += '['; first_ = true; return *this; }
  JsonWriter& end_array() { out_ += ']'; first_ = false; return *this; }
  JsonWriter& key(const char* k) { sep(); str(k); out_ += ':'; first_ = true; return *this; }
  JsonWriter& value(const std::string& s) { sep(); str(s.c_str()); return *this; }
  JsonWriter& value(const char* s) { sep(); str(s); return *this; }
  JsonWriter& value(bool b) { sep(); out_ += b ? "true" : "false"; return *this; }
  JsonWriter& value(int64_t v) { sep(); out_ += std::to_string(v); return *this; }
  JsonWriter& value(uint64_t v) { sep(); out_ += std::to_string(v); return *this; }
  JsonWriter& value(double v);
  JsonWriter& null() { sep(); out_ += "null"; return *this; }
  const std::string& str() const { return out_; }

 private:
  void sep() {
    if (!first_) out_ += ',';
    first_ = false;
  }
  void str(const char* s);

  std::string out_;
  bool first_ = true;
};

}  // namespace jitckpt
