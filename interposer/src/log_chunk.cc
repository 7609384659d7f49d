#include "log_chunk.h"

#include <dirent.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <iterator>

#include "json_reader.h"
#include "json_writer.h"

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
    RecordMeta& m = r.meta;
    int64_t mb, src, dst, gen;
    if (row.kind != JsonValue::Kind::kArray || !int_at(row, 0, &m.iteration) || !int_at(row, 1, &mb) ||
        !str_at(row, 2, &m.payload) || !int_at(row, 3, &src) || !int_at(row, 4, &dst) || !int_at(row, 5, &m.seq) ||
        !int_at(row, 6, &gen) || !str_at(row, 7, &m.kind))
      return bad("record " + std::to_string(i) + " is malformed");
    m.micro_batch = static_cast<int>(mb);
    m.src = static_cast<int>(src);
    m.dst = static_cast<int>(dst);
    m.generation = static_cast<int>(gen);
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
      m.dtype = dtype->string;
      const char* begin = data.data() + payload_start + offset->integer;
      r.bytes.assign(begin, begin + nbytes->integer);
    } else if (t.kind != JsonValue::Kind::kNull) {
      return bad("tensor " + std::to_string(i) + " is neither an object nor null");
    }
    out->push_back(std::move(r));
  }
  return true;
}

bool write_chunk(const std::string& dir, int generation, int64_t number, const std::vector<ChunkEntry>& entries,
                 std::string* error) {
  int64_t lo = entries.front().meta->iteration, hi = lo;
  JsonWriter j;
  j.begin_object().key("records").begin_array();
  for (const ChunkEntry& e : entries) {
    const RecordMeta& m = *e.meta;
    lo = std::min(lo, m.iteration);
    hi = std::max(hi, m.iteration);
    j.begin_array()
        .value(m.iteration)
        .value(static_cast<int64_t>(m.micro_batch))
        .value(m.payload)
        .value(static_cast<int64_t>(m.src))
        .value(static_cast<int64_t>(m.dst))
        .value(m.seq)
        .value(static_cast<int64_t>(m.generation))
        .value(m.kind)
        .value("")  // sends keep their bytes; only receive digests are ever checked
        .end_array();
  }
  j.end_array().key("tensors").begin_array();
  uint64_t offset = 0;
  for (const ChunkEntry& e : entries) {
    // One dimension: NCCL knows element counts, not shapes; the reader reshapes if it must.
    j.begin_object().key("dtype").value(e.meta->dtype).key("shape").begin_array();
    j.value(static_cast<uint64_t>(e.count)).end_array();
    j.key("offset").value(offset).key("nbytes").value(static_cast<uint64_t>(e.nbytes)).end_object();
    offset += e.nbytes;
  }
  j.end_array().end_object();
  const std::string& header = j.str();

  char name[128];
  std::snprintf(name, sizeof name, "chunk-g%d-%06lld-it%lld-%lld.log", generation, static_cast<long long>(number),
                static_cast<long long>(lo), static_cast<long long>(hi));
  std::string path = dir + "/" + name, tmp = dir + "/." + name + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    *error = "cannot create " + tmp + ": " + std::strerror(errno);
    return false;
  }
  uint64_t len = header.size();  // little-endian on every platform CUDA runs on
  bool ok = std::fwrite(&len, sizeof len, 1, f) == 1 && std::fwrite(header.data(), 1, header.size(), f) == header.size();
  for (const ChunkEntry& e : entries) ok = ok && std::fwrite(e.bytes, 1, e.nbytes, f) == e.nbytes;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    *error = "cannot write " + path + ": " + std::strerror(errno);
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace jitckpt
