// Unit tests (GoogleTest, run by CTest from `make test`) of libjit.so's building blocks that need no
// CUDA runtime: the lock-free stream graph, the failure latch, the hang timeout policy, the JSON
// writer and reader, the SWIFT log chunk reader and next-symbol resolution.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "failure_latch.h"
#include "hang_timeout.h"
#include "json_reader.h"
#include "json_writer.h"
#include "log_chunk.h"
#include "next_symbol.h"
#include "stream_graph.h"

namespace {

cudaStream_t stream(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }
cudaEvent_t event(uintptr_t v) { return reinterpret_cast<cudaEvent_t>(v); }

TEST(StreamSet, HoldsUpToCapacity) {
  jitckpt::StreamSet set;
  EXPECT_TRUE(!set.contains(stream(0x10)));
  EXPECT_TRUE(set.insert(stream(0x10)));
  EXPECT_TRUE(set.insert(stream(0x10)));  // idempotent
  EXPECT_TRUE(set.snapshot().size() == 1);
  for (uintptr_t i = 1; i < jitckpt::StreamSet::kCapacity; ++i) EXPECT_TRUE(set.insert(stream(0x1000 + i)));
  EXPECT_TRUE(!set.insert(stream(0x99999)));  // full: reported, not stored
  EXPECT_TRUE(set.snapshot().size() == jitckpt::StreamSet::kCapacity);
  EXPECT_TRUE(set.contains(stream(0x10)) && !set.contains(stream(0x99999)));
}

TEST(StreamSet, ConcurrentInsertsAreAllVisible) {
  jitckpt::StreamSet set;
  std::vector<std::thread> threads;
  for (uintptr_t t = 0; t < 4; ++t)
    threads.emplace_back([&set, t] {
      for (uintptr_t i = 0; i < 8; ++i) set.insert(stream(0x100 * (t + 1) + i * 16));
    });
  for (auto& th : threads) th.join();
  EXPECT_TRUE(set.snapshot().size() == 32);
  for (uintptr_t t = 0; t < 4; ++t)
    for (uintptr_t i = 0; i < 8; ++i) EXPECT_TRUE(set.contains(stream(0x100 * (t + 1) + i * 16)));
}

TEST(StreamGraph, LearnsProcessgroupPattern) {
  jitckpt::StreamGraph g;
  cudaStream_t nccl = stream(0xa0), compute = stream(0xb0), other = stream(0xc0);
  cudaEvent_t done = event(0x7000), unrelated = event(0x8000);
  g.note_collective_stream(nccl);
  g.note_event_record(done, nccl);        // end-of-collective event on the NCCL stream
  g.note_event_record(unrelated, compute);
  g.note_stream_wait(other, unrelated);   // not an NCCL dependency
  EXPECT_TRUE(g.dependent_streams().snapshot().empty());
  g.note_stream_wait(compute, done);      // compute waits for the collective
  EXPECT_TRUE(g.dependent_streams().contains(compute));
  g.note_event_record(done, compute);     // event reused on a compute stream: forgotten
  g.note_stream_wait(other, done);
  EXPECT_TRUE(!g.dependent_streams().contains(other));
  g.note_stream_wait(nccl, done);         // the NCCL stream itself is never "dependent"
  EXPECT_TRUE(!g.dependent_streams().contains(nccl));
}

TEST(FailureLatch, FirstReportWinsAndIsClaimedOnce) {
  jitckpt::FailureLatch latch;
  EXPECT_TRUE(!latch.triggered());
  EXPECT_TRUE(!latch.wait_for_report(std::chrono::milliseconds(1)).has_value());
  EXPECT_TRUE(latch.report({"hang", "first", 0, 3, "forward"}));
  EXPECT_TRUE(!latch.report({"nccl_error", "second", 0, 4, "backward"}));
  auto claimed = latch.wait_for_report(std::chrono::milliseconds(1));
  EXPECT_TRUE(claimed.has_value() && claimed->detail == "first" && claimed->step == 3);
  EXPECT_TRUE(!latch.wait_for_report(std::chrono::milliseconds(1)).has_value());  // claimed already
  EXPECT_TRUE(latch.triggered() && !latch.handled());
  std::thread waiter([&] { latch.wait_handled(); });
  latch.mark_handled();
  waiter.join();
  EXPECT_TRUE(latch.handled() && latch.last()->kind == "hang");
}

TEST(JsonWriter, EscapesAndNests) {
  jitckpt::JsonWriter w;
  w.begin_object();
  w.key("s").value("a\"b\\c\n");
  w.key("n").value(static_cast<int64_t>(-3));
  w.key("list").begin_array().value(true).null().value(1.5).end_array();
  w.key("obj").begin_object().key("x").value(static_cast<uint64_t>(7)).end_object();
  w.end_object();
  EXPECT_TRUE(w.str() == R"({"s":"a\"b\\c\u000a","n":-3,"list":[true,null,1.5],"obj":{"x":7}})");
}

TEST(NextSymbol, Resolution) {
  jitckpt::NextSymbol<int (*)()> missing{"jitckpt_no_such_symbol", "libjitckpt-no-such.so"};
  EXPECT_TRUE(missing.get() == nullptr);
  jitckpt::NextSymbol<int (*)(int)> abs_fn{"abs", "libc.so.6"};
  EXPECT_TRUE(abs_fn.get() != nullptr && abs_fn.get()(-4) == 4);
}

}  // namespace

TEST(JsonReader, ReadsWhatJsonDumpsWrites) {
  jitckpt::JsonValue v;
  std::string err;
  EXPECT_TRUE(jitckpt::parse_json(R"({"records": [[3, 0, "activation", 0, 1, 5, 2, "send", ""]],
                                 "tensors": [{"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}, null],
                                 "x": -1.5e3, "t": true, "s": "a\"b\u00e9"})", &v, &err));
  const jitckpt::JsonValue* rec = v.find("records");
  EXPECT_TRUE(rec != nullptr && rec->array.size() == 1 && rec->array[0].array.size() == 9);
  EXPECT_TRUE(rec->array[0].array[0].is_integer && rec->array[0].array[0].integer == 3);
  EXPECT_TRUE(rec->array[0].array[2].string == "activation");
  const jitckpt::JsonValue* x = v.find("x");
  EXPECT_TRUE(x != nullptr && !x->is_integer && x->number == -1500.0);
  EXPECT_TRUE(v.find("t")->boolean && v.find("s")->string == "a\"b\xc3\xa9");
  EXPECT_TRUE(v.find("tensors")->array[1].kind == jitckpt::JsonValue::Kind::kNull);
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "[1] x", "\"unterminated", "tru", "{\"a\":01x}",
                          "[\"\\q\"]"}) {
    err.clear();
    EXPECT_TRUE(!jitckpt::parse_json(bad, &v, &err) && err.find("offset") != std::string::npos);
  }
  std::string deep(100, '[');
  EXPECT_TRUE(!jitckpt::parse_json(deep, &v, &err));  // bounded nesting, no stack overflow
}

TEST(LogChunk, ReaderRejectsDamage) {
  const std::string path = ::testing::TempDir() + "jitckpt_unit_chunk.log";
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
  EXPECT_TRUE(jitckpt::read_chunk(path, &out, &err) && out.size() == 1 && out[0].bytes.size() == 8 &&
        out[0].meta.payload == "gradient" && out[0].meta.src == 1 && out[0].meta.dtype == "float32");
  out.clear();
  write(good, std::string(7, 'x'), good.size());  // truncated payload
  EXPECT_TRUE(!jitckpt::read_chunk(path, &out, &err) && err.find("beyond the end") != std::string::npos);
  write(good, "", good.size() + 100);  // header length past the end
  EXPECT_TRUE(!jitckpt::read_chunk(path, &out, &err) && err.find("header length") != std::string::npos);
  const std::string short_row = R"({"records": [[1, 0, "gradient"]], "tensors": [null]})";
  write(short_row, "", short_row.size());
  EXPECT_TRUE(!jitckpt::read_chunk(path, &out, &err) && err.find("record 0") != std::string::npos);
  std::remove(path.c_str());
  // What write_chunk writes, read_chunk reads back (name, header and bytes).
  jitckpt::RecordMeta meta{7, 1, "activation", 0, 1, 3, 2, "send", "int32"};
  const int values[3] = {5, -6, 7};
  std::string dir = ::testing::TempDir();
  if (!dir.empty() && dir.back() == '/') dir.pop_back();
  EXPECT_TRUE(jitckpt::write_chunk(dir, 2, 424242, {{&meta, values, sizeof values, 3}}, &err));
  std::vector<jitckpt::ChunkFile> files;
  for (const jitckpt::ChunkFile& c : jitckpt::list_chunks(dir))
    if (c.number == 424242) files.push_back(c);
  EXPECT_TRUE(files.size() == 1 && files[0].name == "chunk-g2-424242-it7-7.log" && files[0].lo == 7 && files[0].hi == 7);
  out.clear();
  EXPECT_TRUE(jitckpt::read_chunk(dir + "/chunk-g2-424242-it7-7.log", &out, &err) && out.size() == 1 &&
        out[0].meta.iteration == 7 && out[0].meta.seq == 3 && out[0].meta.generation == 2 &&
        out[0].meta.dtype == "int32" && out[0].bytes.size() == sizeof values &&
        std::memcmp(out[0].bytes.data(), values, sizeof values) == 0);
  std::remove((dir + "/chunk-g2-424242-it7-7.log").c_str());
  size_t size = 0;
  EXPECT_TRUE(std::strcmp(jitckpt::torch_dtype(ncclBfloat16, &size), "bfloat16") == 0 && size == 2);
  EXPECT_TRUE(jitckpt::torch_dtype(static_cast<ncclDataType_t>(99), &size) == nullptr);
}

TEST(HangTimeout, ParsesTheLaunchersGrammar) {
  std::string err;
  auto fixed = jitckpt::HangTimeoutPolicy::parse(" 1.5 ", &err);
  ASSERT_TRUE(fixed.has_value()) << err;
  EXPECT_FALSE(fixed->adaptive);
  EXPECT_EQ(fixed->text(), "1.5");
  auto dflt = jitckpt::HangTimeoutPolicy::parse("auto", &err);
  ASSERT_TRUE(dflt.has_value());
  EXPECT_EQ(dflt->text(), "auto:floor=30,mult=10,startup=120,window=64,warmup=3");
  EXPECT_EQ(dflt->text(), jitckpt::HangTimeoutPolicy{}.text());  // the default is auto
  auto custom = jitckpt::HangTimeoutPolicy::parse("auto:floor=3,multiplier=4,startup=9,window=2,warmup=1", &err);
  ASSERT_TRUE(custom.has_value()) << err;
  EXPECT_EQ(custom->text(), "auto:floor=3,mult=4,startup=9,window=2,warmup=1");
  EXPECT_EQ(jitckpt::HangTimeoutPolicy::parse(custom->text(), &err)->text(), custom->text());
  for (const char* bad : {"", "0", "-1", "inf", "nan", "soon", "auto:floor", "auto:speed=3", "auto:floor=0",
                          "auto:window=0", "auto:warmup=1.5", "12s"}) {
    err.clear();
    EXPECT_FALSE(jitckpt::HangTimeoutPolicy::parse(bad, &err).has_value()) << bad;
    EXPECT_FALSE(err.empty()) << bad;
  }
}

TEST(HangTimeout, AdaptsToTheLongestRecentCollective) {
  std::string err;
  jitckpt::HangTimeout t;
  t.set(*jitckpt::HangTimeoutPolicy::parse("auto:floor=2,mult=10,startup=60,window=3,warmup=2", &err));
  EXPECT_EQ(t.current(), 60);  // start-up value until `warmup` samples
  t.record(0.1);
  EXPECT_EQ(t.current(), 60);
  t.record(0.5);
  EXPECT_EQ(t.current(), 5);   // 10 x 0.5
  t.record(0.01);
  t.record(0.01);
  EXPECT_EQ(t.current(), 5);   // 0.5 is still among the last 3
  t.record(0.01);
  EXPECT_EQ(t.current(), 2);   // it left the window; 10 x 0.01 is below the floor
  t.set(*jitckpt::HangTimeoutPolicy::parse("7", &err));
  t.record(100);
  EXPECT_EQ(t.current(), 7);   // fixed ignores durations
}
