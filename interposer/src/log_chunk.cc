#include "log_chunk.h"

#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "json_reader.h"

namespace jitckpt {

const char* torch_dtype(ncclDataType_t t, size_t* size) {
  switch (t) {
    case ncclInt8: *size = 1; return "int8";
    case ncclUint8: *size = 1; return "uint8";
    case ncclInt32: *size = 4; return "int32";
    case ncclUint32: *size = 4; return "uint32";
    case ncclInt64: *size = 8; return "int64";
    case ncclUint64: *size = 8; return "uint64";
    case ncclFloat16: *size = 2; return "float16";
    case ncclFloat32: *size = 4; return "float32";
    case ncclFloat64: *size = 8; return "float64";
    case ncclBfloat16: *size = 2; return "bfloat16";
    case ncclFloat8e4m3: *size = 1; return "float8_e4m3fn";
    case ncclFloat8e5m2: *size = 1; return "float8_e5m2";
    default: *size = 0; return nullptr;
  }
}

std::vector<ChunkFile> list_chunks(const std::string& dir) {
  std::vector<ChunkFile> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    ChunkFile c;
    long long number, lo, hi;
    int consumed = 0;
    if (std::sscanf(e->d_name, "chunk-g%d-%lld-it%lld-%lld.log%n", &c.generation, &number, &lo, &hi, &consumed) != 4 ||
        e->d_name[consumed] != '\0')
      continue;
    c.name = e->d_name;
    c.number = number;
    c.lo = lo;
    c.hi = hi;
    out.push_back(std::move(c));
  }
  closedir(d);
  return out;
}

namespace {

bool int_at(const JsonValue& row, size_t i, int64_t* v) {
  if (i >= row.array.size() || row.array[i].kind != JsonValue::Kind::kNumber || !row.array[i].is_integer) return false;
  *v = row.array[i].integer;
  return true;
}

bool str_at(const JsonValue& row, size_t i, std::string* v) {
  if (i >= row.array.size() || row.array[i].kind != JsonValue::Kind::kString) return false;
  *v = row.array[i].string;
  return true;
}

}  // namespace

bool read_chunk(const std::string& path, std::vector<ChunkRecord>* out, std::string* error) {
  std::ifstream f(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) {
    *error = path + ": " + why;
    return false;
  };
  if (!f.good() && !f.eof()) return bad("cannot read");
  uint64_t len = 0;
  if (data.size() < sizeof len) return bad("shorter than its header length");
  std::memcpy(&len, data.data(), sizeof len);
  if (len > data.size() - sizeof len) return bad("header length beyond the end of the file");
  JsonValue header;
  std::string why;
  if (!parse_json(data.substr(sizeof len, len), &header, &why)) return bad("header: " + why);
  const JsonValue* records = header.find("records");
  const JsonValue* tensors = header.find("tensors");
  if (records == nullptr || tensors == nullptr || records->kind != JsonValue::Kind::kArray ||
      tensors->kind != JsonValue::Kind::kArray || records->array.size() != tensors->array.size())
    return bad("header without matching records and tensors");
  const size_t payload_start = sizeof len + len;
  for (size_t i = 0; i < records->array.size(); ++i) {
    const JsonValue& row = records->array[i];
    ChunkRecord r;
    int64_t mb, src, dst, gen;
    if (row.kind != JsonValue::Kind::kArray || !int_at(row, 0, &r.iteration) || !int_at(row, 1, &mb) ||
        !str_at(row, 2, &r.payload) || !int_at(row, 3, &src) || !int_at(row, 4, &dst) || !int_at(row, 5, &r.seq) ||
        !int_at(row, 6, &gen) || !str_at(row, 7, &r.kind))
      return bad("record " + std::to_string(i) + " is malformed");
    r.micro_batch = static_cast<int>(mb);
    r.src = static_cast<int>(src);
    r.dst = static_cast<int>(dst);
    r.generation = static_cast<int>(gen);
    const JsonValue& t = tensors->array[i];
    if (t.kind == JsonValue::Kind::kObject) {
      const JsonValue* dtype = t.find("dtype");
      const JsonValue* offset = t.find("offset");
      const JsonValue* nbytes = t.find("nbytes");
      if (dtype == nullptr || offset == nullptr || nbytes == nullptr || dtype->kind != JsonValue::Kind::kString ||
          !offset->is_integer || !nbytes->is_integer || offset->integer < 0 || nbytes->integer < 0 ||
          static_cast<uint64_t>(offset->integer) + static_cast<uint64_t>(nbytes->integer) >
              data.size() - payload_start)
        return bad("tensor " + std::to_string(i) + " is malformed or beyond the end of the file");
      r.dtype = dtype->string;
      const char* begin = data.data() + payload_start + offset->integer;
      r.bytes.assign(begin, begin + nbytes->integer);
    } else if (t.kind != JsonValue::Kind::kNull) {
      return bad("tensor " + std::to_string(i) + " is neither an object nor null");
    }
    out->push_back(std::move(r));
  }
  return true;
}

}  // namespace jitckpt
