// SWIFT log chunk files, as jitckpt/swift/pipeline/logging_records.py defines them:
// chunk-g<gen>-<number>-it<lo>-<hi>.log = 8-byte little-endian header length, a JSON header
// {"records": [[iteration, micro_batch, payload, src, dst, seq, generation, kind, digest], ...],
//  "tensors": [{"dtype", "shape", "offset", "nbytes"} | null, ...]}, then the tensor bytes.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jitckpt {

// torch's name of an NCCL element type (the reader does getattr(torch, name)); nullptr if unknown.
const char* torch_dtype(ncclDataType_t t, size_t* size);

struct ChunkFile {
  std::string name;
  int generation = 0;
  int64_t number = 0, lo = 0, hi = 0;
};

// The complete chunk files in `dir` (temporary files are hidden names and never listed).
std::vector<ChunkFile> list_chunks(const std::string& dir);

// One row of a chunk header: the message key and what the record holds.
struct RecordMeta {
  int64_t iteration = 0;
  int micro_batch = 0;
  std::string payload;
  int src = -1, dst = -1;
  int64_t seq = 0;
  int generation = 0;
  std::string kind;   // "send" (bytes kept) or "recv" (digest only)
  std::string dtype;  // of the tensor, "" without one
};

struct ChunkRecord {
  RecordMeta meta;
  std::vector<char> bytes;
};

// A record to write: its bytes (a 1-D tensor of `count` elements) stay where they are.
struct ChunkEntry {
  const RecordMeta* meta;
  const void* bytes;
  size_t nbytes;
  size_t count;
};

// Writes entries (all "send" records, no digest) as chunk `number` of `generation` in `dir`:
// a temporary file, then a rename, so a reader never sees a torn chunk. The iteration range in
// the name comes from the entries. False with a message on an I/O error.
bool write_chunk(const std::string& dir, int generation, int64_t number, const std::vector<ChunkEntry>& entries,
                 std::string* error);

// Reads one chunk file; false with a message naming the file on any malformed content.
bool read_chunk(const std::string& path, std::vector<ChunkRecord>* out, std::string* error);

}  // namespace jitckpt
