// Unit tests (GoogleTest, run by CTest from `make test`) of libjit.so's building blocks that need no
// CUDA runtime: the lock-free stream graph, the failure latch, the hang timeout policy, the JSON
// writer, the SWIFT log chunk writer and reader (binary layout, damaged input) and next-symbol
// resolution, the transparent recovery's vote rule.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "failure_latch.h"
#include "hang_timeout.h"
#include "json_writer.h"
#include "log_chunk.h"
#include "next_symbol.h"
#include "rebuild_vote.h"
#include "stage_join.h"
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

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void spit(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

std::string temp_dir() {
  std::string dir = ::testing::TempDir();
  if (!dir.empty() && dir.back() == '/') dir.pop_back();
  return dir;
}

// One int32 send record {5, -6, 7}, byte for byte as both writers lay it out (the same bytes
// are asserted for the Python writer in tests/test_logging_records.py).
const char* const kGoldenChunk =
    "4a495453574c47010100000000000000"  // magic "JITSWLG" v1, 1 record, reserved
    "0700000000000000"                  // iteration 7
    "0300000000000000"                  // seq 3
    "0000000000000000"                  // offset 0
    "0c00000000000000"                  // nbytes 12
    "01000000" "00000000" "01000000" "02000000"  // micro_batch 1, src 0, dst 1, generation 2
    "01" "01" "00" "09" "01" "000000"   // activation, send, no digest, int32, ndim 1, reserved
    "00000000000000000000000000000000"  // digest bytes
    "0300000000000000"                  // dims [3]
    "05000000faffffff07000000";         // the tensor's bytes

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

}  // namespace

TEST(LogChunk, WriterLaysOutTheDocumentedBytes) {
  jitckpt::RecordMeta meta{7, 1, "activation", 0, 1, 3, 2, "send", "int32"};
  const int32_t values[3] = {5, -6, 7};
  const std::string dir = temp_dir();
  std::string err;
  ASSERT_TRUE(jitckpt::write_chunk(dir, 2, 424242, {{&meta, values, sizeof values, 3}}, &err)) << err;
  std::vector<jitckpt::ChunkFile> files;
  for (const jitckpt::ChunkFile& c : jitckpt::list_chunks(dir))
    if (c.number == 424242) files.push_back(c);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].name, "chunk-g2-424242-it7-7.log");
  EXPECT_EQ(files[0].lo, 7);
  EXPECT_EQ(files[0].hi, 7);
  const std::string path = dir + "/" + files[0].name;
  EXPECT_EQ(slurp(path), unhex(kGoldenChunk));
  std::remove(path.c_str());
  size_t size = 0;
  EXPECT_STREQ(jitckpt::torch_dtype(ncclBfloat16, &size), "bfloat16");
  EXPECT_EQ(size, 2u);
  EXPECT_STREQ(jitckpt::torch_dtype(ncclFloat8e5m2, &size), "float8_e5m2");
  EXPECT_EQ(size, 1u);
  EXPECT_EQ(jitckpt::torch_dtype(static_cast<ncclDataType_t>(99), &size), nullptr);
  for (int t = 0; t < ncclNumTypes; ++t)  // every NCCL type has a dtype of the chunk format
    EXPECT_NE(jitckpt::torch_dtype(static_cast<ncclDataType_t>(t), &size), nullptr) << t;
}

TEST(LogChunk, RoundTripOfSeveralRecords) {
  jitckpt::RecordMeta a{-1, 0, "activation", 3, 4, 0, 0, "send", "float64"};
  jitckpt::RecordMeta b{9, 2147483647, "gradient", 4, 3, (int64_t{1} << 40), -5, "send", "uint8"};
  jitckpt::RecordMeta empty{9, 3, "gradient", 4, 3, 7, 1, "send", "bfloat16"};
  jitckpt::RecordMeta none{10, 0, "activation", 4, 5, 8, 1, "recv", ""};
  const double doubles[2] = {1.5, -2.25};
  const uint8_t bytes[5] = {0, 1, 2, 254, 255};
  const std::string dir = temp_dir();
  std::string err;
  ASSERT_TRUE(jitckpt::write_chunk(dir, 1, 424243,
                                   {{&a, doubles, sizeof doubles, 2}, {&b, bytes, sizeof bytes, 5},
                                    {&empty, nullptr, 0, 0}, {&none, nullptr, 0, 0}},
                                   &err))
      << err;
  const std::string path = dir + "/chunk-g1-424243-it-1-10.log";
  std::vector<jitckpt::ChunkRecord> out;
  ASSERT_TRUE(jitckpt::read_chunk(path, &out, &err)) << err;
  std::remove(path.c_str());
  ASSERT_EQ(out.size(), 4u);
  const jitckpt::RecordMeta* want[] = {&a, &b, &empty, &none};
  for (size_t i = 0; i < 4; ++i) {
    const jitckpt::RecordMeta& m = out[i].meta;
    EXPECT_EQ(m.iteration, want[i]->iteration) << i;
    EXPECT_EQ(m.micro_batch, want[i]->micro_batch) << i;
    EXPECT_EQ(m.payload, want[i]->payload) << i;
    EXPECT_EQ(m.src, want[i]->src) << i;
    EXPECT_EQ(m.dst, want[i]->dst) << i;
    EXPECT_EQ(m.seq, want[i]->seq) << i;
    EXPECT_EQ(m.generation, want[i]->generation) << i;
    EXPECT_EQ(m.kind, want[i]->kind) << i;
    EXPECT_EQ(m.dtype, want[i]->dtype) << i;
  }
  EXPECT_EQ(std::string(out[0].bytes.begin(), out[0].bytes.end()),
            std::string(reinterpret_cast<const char*>(doubles), sizeof doubles));
  EXPECT_EQ(std::string(out[1].bytes.begin(), out[1].bytes.end()),
            std::string(reinterpret_cast<const char*>(bytes), sizeof bytes));
  EXPECT_TRUE(out[2].bytes.empty() && out[3].bytes.empty());
}

TEST(LogChunk, WriterRefusesWhatTheLayoutCannotHold) {
  const int32_t v = 1;
  const std::string dir = temp_dir();
  std::string err;
  jitckpt::RecordMeta weights{1, 0, "weights", 0, 1, 0, 0, "send", "int32"};
  EXPECT_FALSE(jitckpt::write_chunk(dir, 0, 424244, {{&weights, &v, sizeof v, 1}}, &err));
  EXPECT_NE(err.find("record 0: payload 'weights'"), std::string::npos) << err;
  jitckpt::RecordMeta odd{1, 0, "gradient", 0, 1, 0, 0, "send", "float128"};
  EXPECT_FALSE(jitckpt::write_chunk(dir, 0, 424244, {{&odd, &v, sizeof v, 1}}, &err));
  EXPECT_NE(err.find("dtype float128"), std::string::npos) << err;
  jitckpt::RecordMeta ok{1, 0, "gradient", 0, 1, 0, 0, "send", "int32"};
  EXPECT_FALSE(jitckpt::write_chunk(dir, 0, 424244, {{&ok, &v, sizeof v, 2}}, &err));  // 4 bytes, 2 elements
  EXPECT_NE(err.find("4 bytes for 2 elements"), std::string::npos) << err;
  EXPECT_FALSE(jitckpt::write_chunk(dir, 0, 424244, {}, &err));
  for (const jitckpt::ChunkFile& c : jitckpt::list_chunks(dir)) EXPECT_NE(c.number, 424244) << c.name;
}

TEST(LogChunk, ReaderRejectsDamage) {
  const std::string good = unhex(kGoldenChunk);
  const std::string path = temp_dir() + "/jitckpt_unit_chunk.log";
  std::vector<jitckpt::ChunkRecord> out;
  std::string err;
  spit(path, good);
  ASSERT_TRUE(jitckpt::read_chunk(path, &out, &err)) << err;
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].meta.dtype, "int32");
  EXPECT_EQ(out[0].bytes.size(), 12u);
  // Byte offsets in the golden chunk: record 0 starts at 16.
  auto patched = [&](size_t at, const std::string& bytes) {
    std::string d = good;
    d.replace(at, bytes.size(), bytes);
    return d;
  };
  const std::string u64_1000 = unhex("e803000000000000");
  const struct {
    const char* what;
    std::string data;
    const char* message;
  } cases[] = {
      {"empty file", "", "truncated: 0 bytes, shorter than the 16-byte file header"},
      {"header cut", good.substr(0, 10), "shorter than the 16-byte file header"},
      {"record cut", good.substr(0, 40), "truncated: 1 records need more"},
      {"dims cut", good.substr(0, 16 + 72 + 4), "record 0: truncated (the file ends inside its dimensions)"},
      {"tensor cut", good.substr(0, good.size() - 1), "lie beyond the end of the file (11 bytes of data): truncated"},
      {"trailing byte", good + "x", "1 bytes after the last tensor"},
      {"bad magic", patched(0, "XIT"), "not a SWIFT log chunk"},
      {"other version", patched(7, "\x02"), "chunk format version 2, this jitckpt reads version 1: written by another "
                                            "jitckpt version; replay from the global checkpoint instead"},
      {"old JSON header", unhex("1000000000000000") + R"({"records": []})",
       "a chunk with a JSON header: written by another jitckpt version"},
      {"reserved header", patched(12, "\x01"), "reserved header field is 1, not 0"},
      {"too many records", patched(8, "\x10"), "truncated: 16 records need more"},
      {"offset beyond the end", patched(16 + 16, u64_1000), "tensor bytes [1000, 1012) of the data section lie beyond"},
      {"offset one past", patched(16 + 16, unhex("01")), "tensor bytes [1, 13)"},
      {"payload code", patched(16 + 48, "\x03"), "record 0: unknown payload code 3"},
      {"kind code", patched(16 + 49, std::string(1, '\0')), "record 0: unknown kind code 0"},
      {"digest code", patched(16 + 50, "\x07"), "record 0: unknown digest algorithm code 7"},
      {"dtype code", patched(16 + 51, "\x63"), "record 0: unknown dtype code 99"},
      {"reserved bytes", patched(16 + 54, "\x01"), "record 0: reserved bytes are not 0"},
      {"stray digest", patched(16 + 60, "\x01"), "record 0: digest bytes without a digest algorithm"},
      {"nbytes", patched(16 + 24, "\x08"), "record 0: nbytes 8, but shape [3] of int32 is 12 bytes"},
      {"negative dim", patched(16 + 72, unhex("ffffffffffffffff")), "record 0: negative dimension in shape [-1]"},
      {"huge dims", patched(16 + 72, unhex("ffffffffffffff7f")), "is more than 2^64 bytes"},
      {"tensor without dtype", patched(16 + 51, std::string(1, '\0')), "record 0: no tensor, yet ndim 1"},
  };
  for (const auto& c : cases) {
    spit(path, c.data);
    out.clear();
    err.clear();
    EXPECT_FALSE(jitckpt::read_chunk(path, &out, &err)) << c.what;
    EXPECT_TRUE(out.empty()) << c.what;
    EXPECT_EQ(err.rfind(path + ": ", 0), 0u) << c.what << ": " << err;
    EXPECT_NE(err.find(c.message), std::string::npos) << c.what << ": " << err;
  }
  // Two tensors at offset 0: each within the file, but not back to back.
  jitckpt::RecordMeta meta{7, 1, "activation", 0, 1, 3, 2, "send", "int32"};
  const int32_t values[3] = {5, -6, 7};
  ASSERT_TRUE(jitckpt::write_chunk(temp_dir(), 2, 424245, {{&meta, values, 12, 3}, {&meta, values, 12, 3}}, &err))
      << err;
  const std::string two = temp_dir() + "/chunk-g2-424245-it7-7.log";
  std::string data = slurp(two);
  ASSERT_EQ(data[16 + 72 + 8 + 16], '\x0c');  // the second record's offset, 12
  data[16 + 72 + 8 + 16] = 0;
  spit(two, data);
  out.clear();
  EXPECT_FALSE(jitckpt::read_chunk(two, &out, &err));
  EXPECT_NE(err.find("record 1: tensor at offset 0 of the data section, expected 12 (tensors are back to back)"),
            std::string::npos)
      << err;
  std::remove(two.c_str());
  std::remove(path.c_str());
  EXPECT_FALSE(jitckpt::read_chunk(path, &out, &err));
  EXPECT_NE(err.find("cannot read"), std::string::npos) << err;
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

namespace {

std::vector<jitckpt::VoteWord> words(std::initializer_list<const char*> texts) {
  std::vector<jitckpt::VoteWord> out;
  for (const char* t : texts) out.push_back(jitckpt::VoteWord::parse(t));
  return out;
}

}  // namespace

TEST(RebuildVote, ParsesTheWords) {
  const auto w = words({"yes/7", "yes/7/optimizer/undo", "replica/8/optimizer", "no: journal off"});
  EXPECT_EQ(w[0].kind, jitckpt::VoteWord::kYes);
  EXPECT_EQ(w[0].minibatch, 7u);
  EXPECT_FALSE(w[0].optimizer_step);
  EXPECT_TRUE(w[1].undo && w[1].optimizer_step);
  EXPECT_EQ(w[2].kind, jitckpt::VoteWord::kReplica);
  EXPECT_TRUE(w[2].optimizer_step && !w[2].undo);
  EXPECT_EQ(w[3].kind, jitckpt::VoteWord::kNo);
}

TEST(RebuildVote, EveryRankWithItsBuffersReplays) {
  const auto plan = jitckpt::plan_rebuild(words({"yes/5", "yes/5", "yes/5/optimizer/undo"}), 1);
  EXPECT_EQ(plan.refusal, "");
  EXPECT_TRUE(plan.receivers.empty());
}

TEST(RebuildVote, ALostRankTakesTheSameOrTheNextMinibatchFromTheLowestDonor) {
  auto plan = jitckpt::plan_rebuild(words({"yes/5/optimizer/undo", "yes/5", "replica/5", "yes/5"}), 1);
  EXPECT_EQ(plan.refusal, "");
  EXPECT_EQ(plan.donor, 1);  // rank 0 undoes its own step: not a donor
  EXPECT_EQ(plan.receivers, std::vector<int>{2});
  EXPECT_FALSE(plan.skip[2]);
  plan = jitckpt::plan_rebuild(words({"yes/6", "replica/5/optimizer", "yes/6"}), 1);
  EXPECT_EQ(plan.refusal, "");
  EXPECT_EQ(plan.receivers, std::vector<int>{1});
  EXPECT_TRUE(plan.skip[1]);
}

// A flake seen on 2026-11-26: rank 2's stream was slow, its all-reduce of minibatch 670 not yet
// seen complete while rank 0 was in 671. Replaying 670 put it a collective out of step with rank 0.
TEST(RebuildVote, ARankAMinibatchBehindInItsOptimizerStepTakesTheDonorsBuffers) {
  const auto plan = jitckpt::plan_rebuild(words({"yes/671", "replica/670/optimizer", "yes/670/optimizer"}), 1);
  EXPECT_EQ(plan.refusal, "");
  EXPECT_EQ(plan.donor, 0);
  EXPECT_EQ(plan.receivers, (std::vector<int>{1, 2}));
  EXPECT_TRUE(plan.skip[1] && plan.skip[2]);
}

TEST(RebuildVote, RanksOutOfStepAreRefusedAlike) {
  // Behind, but not yet in its optimizer step: the rest of its minibatch cannot be skipped.
  auto plan = jitckpt::plan_rebuild(words({"yes/671", "yes/670"}), 1);
  EXPECT_NE(plan.refusal.find("rank 1 of a communicator of 2 is at minibatch 670"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"yes/672", "replica/670/optimizer"}), 1);
  EXPECT_NE(plan.refusal.find("out of step"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"replica/4", "replica/4"}), 1);
  EXPECT_NE(plan.refusal.find("no replica"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"yes/4/optimizer/undo", "replica/4/optimizer"}), 1);
  EXPECT_NE(plan.refusal.find("no replica"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"yes/4", "replica/4"}), 2);
  EXPECT_NE(plan.refusal.find("several communicators"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"yes/4", "no: the journal is off"}), 1);
  EXPECT_NE(plan.refusal.find("rank 1 of a communicator of 2 cannot recover transparently: the journal is off"),
            std::string::npos) << plan.refusal;
}

// --plugin logging in proxy mode: a dead stage's replacement ("new") joins the survivors.
TEST(RebuildVote, ANewcomerReplaysThroughTheIterationBeforeTheSurvivors) {
  auto plan = jitckpt::plan_rebuild(words({"yes/9/it12", "new", "yes/3/it12"}), 1);  // rank 2 joined earlier
  EXPECT_EQ(plan.refusal, "");
  EXPECT_EQ(plan.newcomers, std::vector<int>{1});
  EXPECT_EQ(plan.through, 11);
  EXPECT_TRUE(plan.receivers.empty());
  EXPECT_EQ(plan.donor, -1);
  plan = jitckpt::plan_rebuild(words({"yes/9/it12", "new", "yes/9/it13"}), 1);
  EXPECT_NE(plan.refusal.find("rank 2 of a communicator of 3 is at iteration 13 and rank 0 at 12"), std::string::npos)
      << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"new", "replica/9/it4"}), 1);
  EXPECT_NE(plan.refusal.find("not supported"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"new", "yes/9"}), 1);
  EXPECT_NE(plan.refusal.find("no send-log iteration"), std::string::npos) << plan.refusal;
  plan = jitckpt::plan_rebuild(words({"new", "no: the journal is off"}), 1);
  EXPECT_NE(plan.refusal.find("the journal is off"), std::string::npos) << plan.refusal;
  EXPECT_EQ(jitckpt::VoteWord::parse("yes/4/optimizer/it7").iteration, 7);
  EXPECT_TRUE(jitckpt::VoteWord::parse("yes/4/optimizer/it7").optimizer_step);
}

// The survivors' terms for a replacement stage go through the store as text.
TEST(StageJoin, TermsSurviveTheStoreAndBadTextIsRefused) {
  jitckpt::StageJoin::Terms terms{std::string{'\0', '\xff', '\x10', 'a', 'b'}, 3, 41}, back;
  ASSERT_TRUE(jitckpt::StageJoin::Terms::decode(terms.encode(), &back));
  EXPECT_EQ(back.id, terms.id);
  EXPECT_EQ(back.rebuilds, 3u);
  EXPECT_EQ(back.through, 41);
  EXPECT_FALSE(jitckpt::StageJoin::Terms::decode("zz/1/2", &back));  // not hex
  EXPECT_FALSE(jitckpt::StageJoin::Terms::decode("abc/1/2", &back));  // odd length
  EXPECT_FALSE(jitckpt::StageJoin::Terms::decode("ab", &back));       // fields missing
}
