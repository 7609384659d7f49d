// A single-producer single-consumer message ring in shared memory: the transport between the
// proxy-mode client (libjit.so, in the training process) and the device proxy (issue 15).
//
// Layout of the mapping: a RingHeader (head, tail and the two wait words, each on its own cache
// line), then `capacity` bytes of messages. A message is an 8-byte frame {u32 length, u32 tag}
// followed by `length` payload bytes, padded to 8; it never wraps: when the rest of the buffer is
// too short, the producer writes a wrap frame and starts again at offset 0.
//
// Waiting is spin-then-futex: a waiter spins for a bounded time (a call that returns within a few
// microseconds never sleeps), then sleeps on a futex word in the shared mapping (not
// FUTEX_PRIVATE: the two sides are different processes). Every wait is bounded by a deadline, so
// a caller whose peer died notices instead of hanging. The consumer validates every frame it reads
// (a corrupt or hostile writer gets an error naming the problem; the reader never reads outside
// the buffer) and then refuses further reads: a ring with a bad frame cannot be resynchronized.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace jitckpt::proxy {

struct RingHeader {
  static constexpr uint32_t kMagic = 0x4A52494E;  // "JRIN"
  static constexpr uint32_t kVersion = 1;
  uint32_t magic;
  uint32_t version;
  uint64_t capacity;                         // bytes of message space after the header
  alignas(64) std::atomic<uint64_t> head;    // consumer's position (bytes consumed, not wrapped)
  alignas(64) std::atomic<uint64_t> tail;    // producer's position (bytes published)
  alignas(64) std::atomic<uint32_t> data_word;   // bumped when data arrives for a sleeping consumer
  std::atomic<uint32_t> consumer_sleeping;
  alignas(64) std::atomic<uint32_t> space_word;  // bumped when space frees for a sleeping producer
  std::atomic<uint32_t> producer_sleeping;
};

enum class RingStatus { kOk, kTimeout, kTooLarge, kCorrupt };

const char* ring_status_name(RingStatus s);

// One mapping of a ring; owns the mapping (and the memfd it was made from), not the peer.
class ShmRing {
 public:
  static constexpr size_t kFrame = 8;
  static constexpr uint32_t kWrapTag = 0xFFFFFFFFu;

  // A new ring with `capacity` bytes of message space (a power of two, at least 4096) in a fresh
  // memfd; throws std::runtime_error naming the failure.
  static ShmRing create(size_t capacity);
  // Maps the ring of another process's memfd `fd` (dup'ed; the caller keeps its fd). Throws if the
  // fd does not hold a ring of this version.
  static ShmRing attach(int fd);

  ShmRing(ShmRing&& other) noexcept;
  ShmRing& operator=(ShmRing&& other) noexcept;
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;
  ~ShmRing();

  int fd() const { return fd_; }
  size_t capacity() const { return capacity_; }
  // The largest payload one message can carry.
  size_t max_payload() const { return capacity_ / 2 - kFrame; }

  // Producer side. Copies `payload` into the ring as one message, waiting (spin, then futex)
  // until there is room or `deadline` passes. kTooLarge if it can never fit.
  RingStatus push(uint32_t tag, const void* payload, size_t length,
                  std::chrono::steady_clock::time_point deadline);

  // Consumer side. The next message, waiting until one arrives or `deadline` passes. On kOk,
  // `tag`, `data` (valid until release()) and `length` describe it; release() frees its space.
  // kCorrupt: a frame was invalid; `error` says where and why; the ring stays unusable.
  RingStatus peek(uint32_t* tag, const uint8_t** data, size_t* length,
                  std::chrono::steady_clock::time_point deadline, std::string* error);
  void release();

  // The producer's position after its last message, and how far the consumer has released
  // (the proxy releases a request once it has executed it).
  uint64_t published() const { return header_->tail.load(std::memory_order_acquire); }
  uint64_t consumed() const { return header_->head.load(std::memory_order_acquire); }

  // For tests of the reader's validation: the raw message space.
  uint8_t* raw_data() { return data_; }

 private:
  ShmRing(int fd, RingHeader* header, size_t map_size);
  bool wait_for_data(std::chrono::steady_clock::time_point deadline);
  bool wait_for_space(uint64_t needed, std::chrono::steady_clock::time_point deadline);
  void wake_consumer();
  void wake_producer();

  int fd_ = -1;
  RingHeader* header_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t map_size_ = 0;
  size_t capacity_ = 0;
  uint64_t pending_ = 0;    // bytes the message returned by peek() occupies (0: none)
  bool broken_ = false;     // a corrupt frame was seen
  std::string broken_why_;
};

}  // namespace jitckpt::proxy
