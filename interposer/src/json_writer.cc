#include "json_writer.h"

#include <cmath>
#include <cstdio>

namespace jitckpt {

JsonWriter& JsonWriter::value(double v) {
  sep();
  if (!std::isfinite(v)) {
    out_ += "null";
    return *this;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);  // Unix times to the microsecond
  out_ += buf;
  return *this;
}

void JsonWriter::str(const char* s) {
  out_ += '"';
  for (; *s; ++s) {
    unsigned char c = static_cast<unsigned char>(*s);
    if (c == '"' || c == '\\') {
      out_ += '\\';
      out_ += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out_ += buf;
    } else {
      out_ += static_cast<char>(c);
    }
  }
  out_ += '"';
}

}  // namespace jitckpt
