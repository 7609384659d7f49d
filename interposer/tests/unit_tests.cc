// Unit tests of libjit.so's building blocks that need no CUDA runtime: the lock-free stream graph,
// the failure latch, the JSON writer and reader, the SWIFT log chunk reader and next-symbol resolution. Exit code 0 = all passed; each
// failed check prints its line. Run by tests/native/test_interposer_unit.py.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "failure_latch.h"
#include "json_reader.h"
#include "json_writer.h"
#include "log_chunk.h"
#include "next_symbol.h"
#include "stream_graph.h"

namespace {

int g_failures = 0;

#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                  \
    }                                                                \
  } while (0)

cudaStream_t stream(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }
cudaEvent_t event(uintptr_t v) { return reinterpret_cast<cudaEvent_t>(v); }

void stream_set_holds_up_to_capacity() {
  jitckpt::StreamSet set;
  CHECK(!set.contains(stream(0x10)));
  CHECK(set.insert(stream(0x10)));
  CHECK(set.insert(stream(0x10)));  // idempotent
  CHECK(set.snapshot().size() == 1);
  for (uintptr_t i = 1; i < jitckpt::StreamSet::kCapacity; ++i) CHECK(set.insert(stream(0x1000 + i)));
  CHECK(!set.insert(stream(0x99999)));  // full: reported, not stored
  CHECK(set.snapshot().size() == jitckpt::StreamSet::kCapacity);
  CHECK(set.contains(stream(0x10)) && !set.contains(stream(0x99999)));
}

void stream_set_concurrent_inserts_are_all_visible() {
  jitckpt::StreamSet set;
  std::vector<std::thread> threads;
  for (uintptr_t t = 0; t < 4; ++t)
    threads.emplace_back([&set, t] {
      for (uintptr_t i = 0; i < 8; ++i) set.insert(stream(0x100 * (t + 1) + i * 16));
    });
  for (auto& th : threads) th.join();
  CHECK(set.snapshot().size() == 32);
  for (uintptr_t t = 0; t < 4; ++t)
    for (uintptr_t i = 0; i < 8; ++i) CHECK(set.contains(stream(0x100 * (t + 1) + i * 16)));
}

void stream_graph_learns_processgroup_pattern() {
  jitckpt::StreamGraph g;
  cudaStream_t nccl = stream(0xa0), compute = stream(0xb0), other = stream(0xc0);
  cudaEvent_t done = event(0x7000), unrelated = event(0x8000);
  g.note_collective_stream(nccl);
  g.note_event_record(done, nccl);        // end-of-collective event on the NCCL stream
  g.note_event_record(unrelated, compute);
  g.note_stream_wait(other, unrelated);   // not an NCCL dependency
  CHECK(g.dependent_streams().snapshot().empty());
  g.note_stream_wait(compute, done);      // compute waits for the collective
  CHECK(g.dependent_streams().contains(compute));
  g.note_event_record(done, compute);     // event reused on a compute stream: forgotten
  g.note_stream_wait(other, done);
  CHECK(!g.dependent_streams().contains(other));
  g.note_stream_wait(nccl, done);         // the NCCL stream itself is never "dependent"
  CHECK(!g.dependent_streams().contains(nccl));
}

void failure_latch_first_report_wins_and_is_claimed_once() {
  jitckpt::FailureLatch latch;
  CHECK(!latch.triggered());
  CHECK(!latch.wait_for_report(std::chrono::milliseconds(1)).has_value());
  CHECK(latch.report({"hang", "first", 0, 3, "forward"}));
  CHECK(!latch.report({"nccl_error", "second", 0, 4, "backward"}));
  auto claimed = latch.wait_for_report(std::chrono::milliseconds(1));
  CHECK(claimed.has_value() && claimed->detail == "first" && claimed->step == 3);
  CHECK(!latch.wait_for_report(std::chrono::milliseconds(1)).has_value());  // claimed already
  CHECK(latch.triggered() && !latch.handled());
  std::thread waiter([&] { latch.wait_handled(); });
  latch.mark_handled();
  waiter.join();
  CHECK(latch.handled() && latch.last()->kind == "hang");
}

void json_writer_escapes_and_nests() {
  jitckpt::JsonWriter w;
  w.begin_object();
  w.key("s").value("a\"b\\c\n");
  w.key("n").value(static_cast<int64_t>(-3));
  w.key("list").begin_array().value(true).null().value(1.5).end_array();
  w.key("obj").begin_object().key("x").value(static_cast<uint64_t>(7)).end_object();
  w.end_object();
  CHECK(w.str() == R"({"s":"a\"b\\c\u000a","n":-3,"list":[true,null,1.5],"obj":{"x":7}})");
}

void next_symbol_resolution() {
  jitckpt::NextSymbol<int (*)()> missing{"jitckpt_no_such_symbol", "libjitckpt-no-such.so"};
  CHECK(missing.get() == nullptr);
  jitckpt::NextSymbol<int (*)(int)> abs_fn{"abs", "libc.so.6"};
  CHECK(abs_fn.get() != nullptr && abs_fn.get()(-4) == 4);
}

}  // namespace

void json_reader_reads_what_json_dumps_writes() {
  jitckpt::JsonValue v;
  std::string err;
  CHECK(jitckpt::parse_json(R"({"records": [[3, 0, "activation", 0, 1, 5, 2, "send", ""]],
                                 "tensors": [{"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}, null],
                                 "x": -1.5e3, "t": true, "s": "a\"b\u00e9"})", &v, &err));
  const jitckpt::JsonValue* rec = v.find("records");
  CHECK(rec != nullptr && rec->array.size() == 1 && rec->array[0].array.size() == 9);
  CHECK(rec->array[0].array[0].is_integer && rec->array[0].array[0].integer == 3);
  CHECK(rec->array[0].array[2].string == "activation");
  const jitckpt::JsonValue* x = v.find("x");
  CHECK(x != nullptr && !x->is_integer && x->number == -1500.0);
  CHECK(v.find("t")->boolean && v.find("s")->string == "a\"b\xc3\xa9");
  CHECK(v.find("tensors")->array[1].kind == jitckpt::JsonValue::Kind::kNull);
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "[1] x", "\"unterminated", "tru", "{\"a\":01x}",
                          "[\"\\q\"]"}) {
    err.clear();
    CHECK(!jitckpt::parse_json(bad, &v, &err) && err.find("offset") != std::string::npos);
  }
  std::string deep(100, '[');
  CHECK(!jitckpt::parse_json(deep, &v, &err));  // bounded nesting, no stack overflow
}

void log_chunk_reader_rejects_damage() {
  const std::string path = "/tmp/jitckpt_unit_chunk.log";
  auto write = [&](const std::string& header, const std::string& payload, uint64_t len) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(&len), sizeof len);
    f << header << payload;
  };
  const std::string good = R"({"records": [[1, 0, "gradient", 1, 0, 0, 0, "send", ""]],
                               "tensors": [{"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}]})";
  std::vector<jitckpt::ChunkRecord> out;
  std::string err;
  write(good, std::string(8, 'x'), good.size());
  CHECK(jitckpt::read_chunk(path, &out, &err) && out.size() == 1 && out[0].bytes.size() == 8 &&
        out[0].meta.payload == "gradient" && out[0].meta.src == 1 && out[0].meta.dtype == "float32");
  out.clear();
  write(good, std::string(7, 'x'), good.size());  // truncated payload
  CHECK(!jitckpt::read_chunk(path, &out, &err) && err.find("beyond the end") != std::string::npos);
  write(good, "", good.size() + 100);  // header length past the end
  CHECK(!jitckpt::read_chunk(path, &out, &err) && err.find("header length") != std::string::npos);
  const std::string short_row = R"({"records": [[1, 0, "gradient"]], "tensors": [null]})";
  write(short_row, "", short_row.size());
  CHECK(!jitckpt::read_chunk(path, &out, &err) && err.find("record 0") != std::string::npos);
  std::remove(path.c_str());
  // What write_chunk writes, read_chunk reads back (name, header and bytes).
  jitckpt::RecordMeta meta{7, 1, "activation", 0, 1, 3, 2, "send", "int32"};
  const int values[3] = {5, -6, 7};
  std::string dir = "/tmp";
  CHECK(jitckpt::write_chunk(dir, 2, 424242, {{&meta, values, sizeof values, 3}}, &err));
  std::vector<jitckpt::ChunkFile> files;
  for (const jitckpt::ChunkFile& c : jitckpt::list_chunks(dir))
    if (c.number == 424242) files.push_back(c);
  CHECK(files.size() == 1 && files[0].name == "chunk-g2-424242-it7-7.log" && files[0].lo == 7 && files[0].hi == 7);
  out.clear();
  CHECK(jitckpt::read_chunk(dir + "/chunk-g2-424242-it7-7.log", &out, &err) && out.size() == 1 &&
        out[0].meta.iteration == 7 && out[0].meta.seq == 3 && out[0].meta.generation == 2 &&
        out[0].meta.dtype == "int32" && out[0].bytes.size() == sizeof values &&
        std::memcmp(out[0].bytes.data(), values, sizeof values) == 0);
  std::remove((dir + "/chunk-g2-424242-it7-7.log").c_str());
  size_t size = 0;
  CHECK(std::strcmp(jitckpt::torch_dtype(ncclBfloat16, &size), "bfloat16") == 0 && size == 2);
  CHECK(jitckpt::torch_dtype(static_cast<ncclDataType_t>(99), &size) == nullptr);
}

int main() {
  stream_set_holds_up_to_capacity();
  stream_set_concurrent_inserts_are_all_visible();
  stream_graph_learns_processgroup_pattern();
  failure_latch_first_report_wins_and_is_claimed_once();
  json_writer_escapes_and_nests();
  json_reader_reads_what_json_dumps_writes();
  log_chunk_reader_rejects_damage();
  next_symbol_resolution();
  std::printf("%s (%d failed checks)\n", g_failures ? "FAILED" : "OK", g_failures);
  return g_failures ? 1 : 0;
}
