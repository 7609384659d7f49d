#include "log_chunk.h"

#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

namespace jitckpt {

namespace {

constexpr char kMagic[8] = {'J', 'I', 'T', 'S', 'W', 'L', 'G', '\x01'};  // the last byte is the version
constexpr size_t kFileHeader = 16;
constexpr size_t kRecordFixed = 72;
constexpr const char* kOtherVersion = "written by another jitckpt version; replay from the global checkpoint instead";

struct Dtype {
  uint8_t code;
  const char* name;
  size_t size;
  ncclDataType_t nccl;  // ncclNumTypes: NCCL has no such type
};

// The format's dtype table (logging_records.DTYPE_NAMES): codes never change within a version.
constexpr ncclDataType_t kNoNccl = ncclNumTypes;
constexpr Dtype kDtypes[] = {
    {1, "float32", 4, ncclFloat32},          {2, "float64", 8, ncclFloat64},
    {3, "float16", 2, ncclFloat16},          {4, "bfloat16", 2, ncclBfloat16},
    {5, "int8", 1, ncclInt8},                {6, "uint8", 1, ncclUint8},
    {7, "int16", 2, kNoNccl},                {8, "uint16", 2, kNoNccl},
    {9, "int32", 4, ncclInt32},              {10, "uint32", 4, ncclUint32},
    {11, "int64", 8, ncclInt64},             {12, "uint64", 8, ncclUint64},
    {13, "bool", 1, kNoNccl},                {14, "float8_e4m3fn", 1, ncclFloat8e4m3},
    {15, "float8_e5m2", 1, ncclFloat8e5m2},  {16, "float8_e4m3fnuz", 1, kNoNccl},
    {17, "float8_e5m2fnuz", 1, kNoNccl},     {18, "complex32", 4, kNoNccl},
    {19, "complex64", 8, kNoNccl},           {20, "complex128", 16, kNoNccl},
};
constexpr const char* kPayloads[] = {"activation", "gradient"};  // code = index + 1
constexpr const char* kKinds[] = {"send", "recv"};              // code = index + 1
constexpr unsigned kDigestAlgorithms = 2;                       // 1 xxh3_128, 2 blake2b

const Dtype* find_dtype(const std::string& name) {
  for (const Dtype& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

template <size_t N>
uint8_t code_of(const char* const (&table)[N], const std::string& value) {
  for (size_t i = 0; i < N; ++i)
    if (value == table[i]) return static_cast<uint8_t>(i + 1);
  return 0;
}

void put(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t get(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

bool all_zero(const char* p, size_t n) {
  return std::all_of(p, p + n, [](char c) { return c == 0; });
}

// A record's fixed part and dimensions as read, before its tensor is located.
struct Parsed {
  RecordMeta meta;
  uint64_t offset = 0, nbytes = 0;
};

bool check_magic(const std::string& data, std::string* why) {
  const size_t n = data.size();
  if (n >= sizeof kMagic && std::memcmp(data.data(), kMagic, sizeof kMagic) == 0) {
    if (n >= kFileHeader) return true;
  } else if (n >= sizeof kMagic && std::memcmp(data.data(), kMagic, sizeof kMagic - 1) == 0) {
    *why = "chunk format version " + std::to_string(static_cast<uint8_t>(data[sizeof kMagic - 1])) +
           ", this jitckpt reads version " + std::to_string(static_cast<int>(kMagic[sizeof kMagic - 1])) + ": " + kOtherVersion;
    return false;
  } else if (n > 8 && data[8] == '{') {  // an 8-byte length, then a JSON header: the format before version 1
    *why = std::string("a chunk with a JSON header: ") + kOtherVersion;
    return false;
  } else if (std::memcmp(data.data(), kMagic, std::min(n, sizeof kMagic)) != 0) {
    *why = "not a SWIFT log chunk: it does not start with the magic JITSWLG\\x01";
    return false;
  }
  *why = "truncated: " + std::to_string(n) + " bytes, shorter than the " + std::to_string(kFileHeader) +
         "-byte file header";
  return false;
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Record `i` at *pos (advanced past it); false with the problem in *why.
bool decode_record(const std::string& data, size_t* pos, size_t i, Parsed* r, std::string* why) {
  const std::string rec = "record " + std::to_string(i) + ": ";
  if (data.size() - *pos < kRecordFixed) {
    *why = rec + "truncated (the file ends inside it)";
    return false;
  }
  const char* p = data.data() + *pos;
  RecordMeta& m = r->meta;
  m.iteration = static_cast<int64_t>(get(p, 8));
  m.seq = static_cast<int64_t>(get(p + 8, 8));
  r->offset = get(p + 16, 8);
  r->nbytes = get(p + 24, 8);
  m.micro_batch = static_cast<int32_t>(get(p + 32, 4));
  m.src = static_cast<int32_t>(get(p + 36, 4));
  m.dst = static_cast<int32_t>(get(p + 40, 4));
  m.generation = static_cast<int32_t>(get(p + 44, 4));
  const unsigned payload = static_cast<uint8_t>(p[48]), kind = static_cast<uint8_t>(p[49]),
                 algorithm = static_cast<uint8_t>(p[50]), dtype = static_cast<uint8_t>(p[51]),
                 ndim = static_cast<uint8_t>(p[52]);
  const struct {
    const char* what;
    unsigned code, lowest, highest;
  } codes[] = {{"payload", payload, 1, std::size(kPayloads)},
               {"kind", kind, 1, std::size(kKinds)},
               {"digest algorithm", algorithm, 0, kDigestAlgorithms},
               {"dtype", dtype, 0, std::size(kDtypes)}};
  for (const auto& c : codes)
    if (c.code < c.lowest || c.code > c.highest) {
      *why = rec + "unknown " + c.what + " code " + std::to_string(c.code);
      return false;
    }
  if (!all_zero(p + 53, 3)) {
    *why = rec + "reserved bytes are not 0";
    return false;
  }
  if (algorithm == 0 && !all_zero(p + 56, 16)) {
    *why = rec + "digest bytes without a digest algorithm";
    return false;
  }
  *pos += kRecordFixed;
  if (data.size() - *pos < 8u * ndim) {
    *why = rec + "truncated (the file ends inside its dimensions)";
    return false;
  }
  std::vector<int64_t> dims;
  for (unsigned d = 0; d < ndim; ++d) dims.push_back(static_cast<int64_t>(get(data.data() + *pos + 8 * d, 8)));
  *pos += 8u * ndim;
  m.payload = kPayloads[payload - 1];
  m.kind = kKinds[kind - 1];
  if (dtype == 0) {
    if (ndim != 0 || r->offset != 0 || r->nbytes != 0) {
      *why = rec + "no tensor, yet ndim " + std::to_string(ndim) + ", offset " + std::to_string(r->offset) +
             ", nbytes " + std::to_string(r->nbytes);
      return false;
    }
    return true;
  }
  const Dtype& dt = kDtypes[dtype - 1];
  m.dtype = dt.name;
  uint64_t want = dt.size;
  bool overflow = false;
  for (int64_t d : dims) {
    if (d < 0) {
      *why = rec + "negative dimension in shape " + shape_text(dims);
      return false;
    }
    overflow = overflow || __builtin_mul_overflow(want, static_cast<uint64_t>(d), &want);
  }
  if (overflow || want != r->nbytes) {
    *why = rec + "nbytes " + std::to_string(r->nbytes) + ", but shape " + shape_text(dims) + " of " + dt.name +
           " is " + (overflow ? std::string("more than 2^64") : std::to_string(want)) + " bytes";
    return false;
  }
  return true;
}

}  // namespace

const char* torch_dtype(ncclDataType_t t, size_t* size) {
  for (const Dtype& d : kDtypes)
    if (d.nccl == t && t != kNoNccl) {
      *size = d.size;
      return d.name;
    }
  *size = 0;
  return nullptr;
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

bool read_chunk(const std::string& path, std::vector<ChunkRecord>* out, std::string* error) {
  std::ifstream f(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) {
    *error = path + ": " + why;
    return false;
  };
  if (!f.is_open() || (!f.good() && !f.eof())) return bad("cannot read");
  std::string why;
  if (!check_magic(data, &why)) return bad(why);
  const uint64_t count = get(data.data() + 8, 4), reserved = get(data.data() + 12, 4);
  if (reserved != 0) return bad("reserved header field is " + std::to_string(reserved) + ", not 0");
  if (count * kRecordFixed > data.size() - kFileHeader)
    return bad("truncated: " + std::to_string(count) + " records need more than the file's " +
               std::to_string(data.size()) + " bytes");
  std::vector<Parsed> parsed(count);
  size_t pos = kFileHeader;
  for (size_t i = 0; i < count; ++i)
    if (!decode_record(data, &pos, i, &parsed[i], &why)) return bad(why);
  const uint64_t available = data.size() - pos;
  uint64_t end = 0;
  std::vector<ChunkRecord> records(count);
  for (size_t i = 0; i < count; ++i) {
    const Parsed& r = parsed[i];
    records[i].meta = r.meta;
    if (r.meta.dtype.empty()) continue;
    const std::string rec = "record " + std::to_string(i) + ": ";
    if (r.offset > available || r.nbytes > available - r.offset)
      return bad(rec + "tensor bytes [" + std::to_string(r.offset) + ", " + std::to_string(r.offset + r.nbytes) +
                 ") of the data section lie beyond the end of the file (" + std::to_string(available) +
                 " bytes of data): truncated");
    if (r.offset != end)
      return bad(rec + "tensor at offset " + std::to_string(r.offset) + " of the data section, expected " +
                 std::to_string(end) + " (tensors are back to back)");
    end += r.nbytes;
    const char* begin = data.data() + pos + r.offset;
    records[i].bytes.assign(begin, begin + r.nbytes);
  }
  if (end != available) return bad(std::to_string(available - end) + " bytes after the last tensor");
  std::move(records.begin(), records.end(), std::back_inserter(*out));
  return true;
}

bool write_chunk(const std::string& dir, int generation, int64_t number, const std::vector<ChunkEntry>& entries,
                 std::string* error) {
  if (entries.empty() || entries.size() > UINT32_MAX) {
    *error = "cannot write a chunk of " + std::to_string(entries.size()) + " records in " + dir;
    return false;
  }
  int64_t lo = entries.front().meta->iteration, hi = lo;
  std::string head(kMagic, sizeof kMagic);
  put(&head, entries.size(), 4);
  put(&head, 0, 4);
  uint64_t offset = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const ChunkEntry& e = entries[i];
    const RecordMeta& m = *e.meta;
    const uint8_t payload = code_of(kPayloads, m.payload), kind = code_of(kKinds, m.kind);
    const Dtype* dt = m.dtype.empty() ? nullptr : find_dtype(m.dtype);
    std::string why;
    if (payload == 0) why = "payload '" + m.payload + "' is none of activation, gradient";
    else if (kind == 0) why = "kind '" + m.kind + "' is none of send, recv";
    else if (!m.dtype.empty() && dt == nullptr) why = "dtype " + m.dtype + " has no code in the chunk format";
    else if (dt != nullptr ? e.nbytes != e.count * dt->size : e.nbytes != 0)
      why = std::to_string(e.nbytes) + " bytes for " + std::to_string(e.count) + " elements of " +
            (dt != nullptr ? m.dtype : "no tensor");
    if (!why.empty()) {
      *error = "cannot write a chunk in " + dir + ": record " + std::to_string(i) + ": " + why;
      return false;
    }
    lo = std::min(lo, m.iteration);
    hi = std::max(hi, m.iteration);
    put(&head, static_cast<uint64_t>(m.iteration), 8);
    put(&head, static_cast<uint64_t>(m.seq), 8);
    put(&head, dt != nullptr ? offset : 0, 8);
    put(&head, e.nbytes, 8);
    for (int v : {m.micro_batch, m.src, m.dst, m.generation}) put(&head, static_cast<uint32_t>(v), 4);
    // No digest (algorithm 0, zero bytes): sends keep their bytes; only receive digests are checked.
    for (uint8_t b : {payload, kind, uint8_t{0}, dt != nullptr ? dt->code : uint8_t{0}, uint8_t{dt != nullptr}})
      head.push_back(static_cast<char>(b));
    head.append(3 + 16, '\0');
    // One dimension: NCCL knows element counts, not shapes; the reader reshapes if it must.
    if (dt != nullptr) put(&head, e.count, 8);
    offset += e.nbytes;
  }

  char name[128];
  std::snprintf(name, sizeof name, "chunk-g%d-%06lld-it%lld-%lld.log", generation, static_cast<long long>(number),
                static_cast<long long>(lo), static_cast<long long>(hi));
  std::string path = dir + "/" + name, tmp = dir + "/." + name + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    *error = "cannot create " + tmp + ": " + std::strerror(errno);
    return false;
  }
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size();
  for (const ChunkEntry& e : entries)  // an empty tensor may have no buffer: fwrite must not see it
    ok = ok && (e.nbytes == 0 || std::fwrite(e.bytes, 1, e.nbytes, f) == e.nbytes);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    *error = "cannot write " + path + ": " + std::strerror(errno);
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace jitckpt
