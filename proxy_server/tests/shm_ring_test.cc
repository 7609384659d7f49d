// The proxy ring: order and integrity across wrap-around, between processes, bounded waits, and a
// reader that survives whatever bytes a broken or hostile writer leaves in the ring.
#include "shm_ring.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

using jitckpt::proxy::RingStatus;
using jitckpt::proxy::ShmRing;
using Clock = std::chrono::steady_clock;

namespace {

Clock::time_point in(std::chrono::milliseconds ms) { return Clock::now() + ms; }

std::vector<uint8_t> message(uint32_t i) {  // varied sizes, content derived from the index
  std::vector<uint8_t> v(1 + (i * 37) % 700);
  for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<uint8_t>(i * 131 + k);
  return v;
}

// Reads `count` messages and checks each; returns how many matched.
int consume(ShmRing& ring, uint32_t count) {
  int ok = 0;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t tag;
    const uint8_t* data;
    size_t len;
    std::string err;
    if (ring.peek(&tag, &data, &len, in(std::chrono::milliseconds(10000)), &err) != RingStatus::kOk) break;
    auto want = message(i);
    if (tag == i && len == want.size() && std::memcmp(data, want.data(), len) == 0) ++ok;
    ring.release();
  }
  return ok;
}

}  // namespace

TEST(ShmRing, RefusesABadCapacity) {
  EXPECT_THROW(ShmRing::create(1000), std::invalid_argument);
  EXPECT_THROW(ShmRing::create(2048), std::invalid_argument);
}

TEST(ShmRing, KeepsOrderAndBytesAcrossWrapAroundBetweenThreads) {
  ShmRing ring = ShmRing::create(4096);  // small: thousands of wrap-arounds, a full ring often
  const uint32_t n = 20000;
  std::thread producer([&] {
    ShmRing p = ShmRing::attach(ring.fd());
    for (uint32_t i = 0; i < n; ++i) {
      auto m = message(i);
      ASSERT_EQ(p.push(i, m.data(), m.size(), in(std::chrono::milliseconds(10000))), RingStatus::kOk);
    }
  });
  EXPECT_EQ(consume(ring, n), static_cast<int>(n));
  producer.join();
}

TEST(ShmRing, WorksBetweenProcesses) {
  ShmRing ring = ShmRing::create(1 << 16);
  const uint32_t n = 5000;
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // the child is the producer, as the client process would be
    ShmRing p = ShmRing::attach(ring.fd());
    for (uint32_t i = 0; i < n; ++i) {
      auto m = message(i);
      if (p.push(i, m.data(), m.size(), in(std::chrono::milliseconds(10000))) != RingStatus::kOk) _exit(1);
    }
    _exit(0);
  }
  EXPECT_EQ(consume(ring, n), static_cast<int>(n));
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(ShmRing, WaitsAreBoundedByTheirDeadline) {
  ShmRing ring = ShmRing::create(4096);
  uint32_t tag;
  const uint8_t* data;
  size_t len;
  std::string err;
  auto t0 = Clock::now();
  EXPECT_EQ(ring.peek(&tag, &data, &len, in(std::chrono::milliseconds(120)), &err), RingStatus::kTimeout);
  auto waited = Clock::now() - t0;
  EXPECT_GE(waited, std::chrono::milliseconds(120));
  EXPECT_LT(waited, std::chrono::milliseconds(1000));
  // A full ring: the producer times out instead of overwriting unread messages.
  std::vector<uint8_t> big(ring.max_payload());
  ASSERT_EQ(ring.push(1, big.data(), big.size(), in(std::chrono::milliseconds(100))), RingStatus::kOk);
  ASSERT_EQ(ring.push(2, big.data(), big.size(), in(std::chrono::milliseconds(100))), RingStatus::kOk);
  t0 = Clock::now();
  EXPECT_EQ(ring.push(3, big.data(), big.size(), in(std::chrono::milliseconds(100))), RingStatus::kTimeout);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(100));
  EXPECT_EQ(ring.push(4, big.data(), big.size() + 1, in(std::chrono::milliseconds(100))), RingStatus::kTooLarge);
}

TEST(ShmRing, ASleepingConsumerIsWokenPromptly) {
  ShmRing ring = ShmRing::create(4096);
  std::thread producer([&] {
    ShmRing p = ShmRing::attach(ring.fd());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the consumer is asleep by now
    uint32_t v = 42;
    p.push(7, &v, sizeof v, in(std::chrono::milliseconds(1000)));
  });
  uint32_t tag;
  const uint8_t* data;
  size_t len;
  std::string err;
  auto t0 = Clock::now();
  ASSERT_EQ(ring.peek(&tag, &data, &len, in(std::chrono::milliseconds(5000)), &err), RingStatus::kOk);
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1500));  // woken, not timed out
  EXPECT_EQ(tag, 7u);
  producer.join();
}

TEST(ShmRing, AFrameClaimingMoreThanWasPublishedIsCorruptAndNamed) {
  ShmRing ring = ShmRing::create(4096);
  uint32_t v = 1;
  ASSERT_EQ(ring.push(5, &v, sizeof v, in(std::chrono::milliseconds(100))), RingStatus::kOk);
  const uint32_t lie = 3000;
  std::memcpy(ring.raw_data(), &lie, sizeof lie);  // the length field of the first frame
  uint32_t tag;
  const uint8_t* data;
  size_t len;
  std::string err;
  EXPECT_EQ(ring.peek(&tag, &data, &len, in(std::chrono::milliseconds(100)), &err), RingStatus::kCorrupt);
  EXPECT_NE(err.find("claims 3000 bytes"), std::string::npos) << err;
  // And it stays refused: a ring with a bad frame cannot be resynchronized.
  EXPECT_EQ(ring.peek(&tag, &data, &len, in(std::chrono::milliseconds(100)), &err), RingStatus::kCorrupt);
}

TEST(ShmRing, RandomBytesNeverMakeTheReaderReadOutsideTheRing) {
  std::mt19937_64 rng(1234);
  for (int trial = 0; trial < 2000; ++trial) {
    ShmRing ring = ShmRing::create(4096);
    auto* h = reinterpret_cast<jitckpt::proxy::RingHeader*>(ring.raw_data() - sizeof(jitckpt::proxy::RingHeader));
    for (size_t i = 0; i < ring.capacity(); ++i) ring.raw_data()[i] = static_cast<uint8_t>(rng());
    // A hostile writer also publishes an arbitrary tail (within 2 capacities, or anything).
    h->head.store(rng() % 8192 * 8);
    h->tail.store(trial % 2 ? h->head.load() + rng() % 8192 : rng());
    for (int reads = 0; reads < 8; ++reads) {
      uint32_t tag;
      const uint8_t* data;
      size_t len;
      std::string err;
      auto s = ring.peek(&tag, &data, &len, in(std::chrono::milliseconds(0)), &err);
      if (s != RingStatus::kOk) break;
      ASSERT_GE(data, ring.raw_data());
      ASSERT_LE(data + len, ring.raw_data() + ring.capacity());
      volatile uint8_t sink = 0;
      for (size_t k = 0; k < len; ++k) sink = sink + data[k];  // ASan checks these reads
      ring.release();
    }
  }
}

TEST(ShmRing, AttachRefusesWhatIsNotARing) {
  FILE* f = tmpfile();
  ASSERT_NE(f, nullptr);
  std::vector<char> junk(8192, 'x');
  fwrite(junk.data(), 1, junk.size(), f);
  fflush(f);
  EXPECT_THROW(ShmRing::attach(fileno(f)), std::runtime_error);
  fclose(f);
}
