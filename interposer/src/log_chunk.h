// SWIFT log chunk files, as jitckpt/swift/pipeline/logging_records.py defines them (its module
// docstring documents the layout in the same words; tests/test_logging_records.py checks that they
// stay the same): chunk-g<gen>-<number>-it<lo>-<hi>.log in this layout, version 1, fixed
// little-endian binary, no padding between fields:
//
//   offset  size  field
//   file header (16 bytes)
//   0       8     magic "JITSWLG" followed by the format version, 0x01
//   8       4     u32 record count
//   12      4     u32 reserved, 0
//   each record: a fixed 72-byte part, then ndim i64 dimensions
//   0       8     i64 iteration
//   8       8     i64 seq (the sender's per-destination sequence number)
//   16      8     u64 offset of the tensor's bytes from the start of the data section
//   24      8     u64 nbytes of the tensor (product of the dimensions x the dtype's size)
//   32      4     i32 micro_batch
//   36      4     i32 src
//   40      4     i32 dst
//   44      4     i32 generation
//   48      1     u8 payload: 1 activation, 2 gradient
//   49      1     u8 kind: 1 send, 2 recv
//   50      1     u8 digest algorithm: 0 none (digest ""), 1 xxh3_128, 2 blake2b
//   51      1     u8 dtype code (table below); 0 no tensor (then ndim, offset, nbytes are 0)
//   52      1     u8 ndim (0 for a 0-d tensor)
//   53      3     reserved, 0
//   56      16    the digest's 16 bytes (the 32 hex digits); zeros with algorithm 0
//   72      8*n   i64 dimensions
//   data section: right after the last record, the tensors' bytes back to back in record order
//
// dtype codes (torch names): 1 float32, 2 float64, 3 float16, 4 bfloat16, 5 int8, 6 uint8,
// 7 int16, 8 uint16, 9 int32, 10 uint32, 11 int64, 12 uint64, 13 bool, 14 float8_e4m3fn,
// 15 float8_e5m2, 16 float8_e4m3fnuz, 17 float8_e5m2fnuz, 18 complex32, 19 complex64,
// 20 complex128. A reader checks everything (magic and version, codes, reserved bytes, sizes,
// offsets, truncation, trailing bytes) and names the file and the problem; a chunk of another
// format version (the JSON-header chunks of earlier jitckpt versions included) cannot be replayed.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jitckpt {

// torch's name of an NCCL element type (a dtype of the chunk format); nullptr if unknown.
const char* torch_dtype(ncclDataType_t t, size_t* size);

struct ChunkFile {
  std::string name;
  int generation = 0;
  int64_t number = 0, lo = 0, hi = 0;
};

// The complete chunk files in `dir` (temporary files are hidden names and never listed).
std::vector<ChunkFile> list_chunks(const std::string& dir);

// One record of a chunk: the message key and what the record holds.
struct RecordMeta {
  int64_t iteration = 0;
  int micro_batch = 0;
  std::string payload;  // "activation" or "gradient"
  int src = -1, dst = -1;
  int64_t seq = 0;
  int generation = 0;
  std::string kind;   // "send" (bytes kept) or "recv" (digest only)
  std::string dtype;  // of the tensor, "" without one
};

// A record read back; the tensor's shape and a receive's digest are checked but not kept.
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

// Writes entries (without digests: sends keep their bytes) as chunk `number` of `generation` in
// `dir`: a temporary file, then a rename, so a reader never sees a torn chunk. The iteration range
// in the name comes from the entries. False with a message on an I/O error or on a record the
// layout cannot hold (unknown payload, kind or dtype, nbytes not count x the dtype's size).
bool write_chunk(const std::string& dir, int generation, int64_t number, const std::vector<ChunkEntry>& entries,
                 std::string* error);

// Reads one chunk file (appending its records to `out`); false with a message naming the file
// and the problem on anything but a complete chunk of this format version (nothing appended).
bool read_chunk(const std::string& path, std::vector<ChunkRecord>* out, std::string* error);

}  // namespace jitckpt
