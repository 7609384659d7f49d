#include "shm_ring.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

namespace jitckpt::proxy {
namespace {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && std::atomic<uint32_t>::is_always_lock_free,
              "the futex words must be plain 32-bit words");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "head and tail must be lock-free across processes");

using Clock = std::chrono::steady_clock;
// How long a waiter spins before it sleeps: a reply that comes within this never pays for a
// futex wake-up (a few microseconds each way), and an idle waiter costs no CPU for long.
constexpr auto kSpin = std::chrono::microseconds(5);

size_t round8(size_t n) { return (n + 7) & ~size_t{7}; }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  if (ns <= 0) return;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Not FUTEX_PRIVATE_FLAG: the word is shared with another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

// Waits until ready(order) holds or `deadline` passes: spins first, then sleeps on `word` with
// `sleeping` raised. `ready` loads the peer's position with the given order.
//
// Dekker's pattern, all four accesses seq_cst (not fences: ThreadSanitizer does not model
// those): the sleeper stores its flag, then loads the position; the waker (wake below) stores the
// position, then loads the flag. In the single total order one of the two stores comes first, so
// either the sleeper sees the new position or the waker sees the flag: no wake-up is lost.
template <typename Ready>
bool spin_then_sleep(Ready ready, std::atomic<uint32_t>* sleeping, std::atomic<uint32_t>* word,
                     Clock::time_point deadline) {
  if (ready(std::memory_order_acquire)) return true;
  const auto spin_end = std::min(deadline, Clock::now() + kSpin);
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready(std::memory_order_acquire)) return true;
      cpu_relax();
    }
  } while (Clock::now() < spin_end);
  while (true) {
    const uint32_t seen = word->load(std::memory_order_acquire);
    sleeping->store(1, std::memory_order_seq_cst);
    const auto now = Clock::now();
    if (ready(std::memory_order_seq_cst) || now >= deadline) {
      sleeping->store(0, std::memory_order_relaxed);
      return ready(std::memory_order_acquire);
    }
    futex_wait(word, seen, deadline - now);  // no wake-up is lost (above): sleep until the deadline
    sleeping->store(0, std::memory_order_relaxed);
  }
}

// The waker's half: called after the position was stored seq_cst.
void wake(std::atomic<uint32_t>* sleeping, std::atomic<uint32_t>* word) {
  if (sleeping->load(std::memory_order_seq_cst) != 0) {
    word->fetch_add(1, std::memory_order_release);
    futex_wake(word);
  }
}

}  // namespace

const char* ring_status_name(RingStatus s) {
  switch (s) {
    case RingStatus::kOk: return "ok";
    case RingStatus::kTimeout: return "timeout";
    case RingStatus::kTooLarge: return "message too large";
    case RingStatus::kCorrupt: return "corrupt ring";
  }
  return "?";
}

ShmRing ShmRing::create(size_t capacity) {
  if (capacity < 4096 || (capacity & (capacity - 1)) != 0)
    throw std::invalid_argument("ring capacity must be a power of two >= 4096, got " + std::to_string(capacity));
  int fd = memfd_create("jitckpt-proxy-ring", MFD_CLOEXEC);
  if (fd < 0) throw sys_error("memfd_create");
  size_t map_size = sizeof(RingHeader) + capacity;
  if (ftruncate(fd, static_cast<off_t>(map_size)) != 0) {
    close(fd);
    throw sys_error("ftruncate ring");
  }
  void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    throw sys_error("mmap ring");
  }
  auto* h = new (p) RingHeader{};
  h->magic = RingHeader::kMagic;
  h->version = RingHeader::kVersion;
  h->capacity = capacity;
  return ShmRing(fd, h, map_size);
}

ShmRing ShmRing::attach(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) throw sys_error("fstat ring fd");
  size_t map_size = static_cast<size_t>(st.st_size);
  if (map_size < sizeof(RingHeader) + 4096) throw std::runtime_error("ring fd is too small to hold a ring");
  int own = dup(fd);
  if (own < 0) throw sys_error("dup ring fd");
  void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, own, 0);
  if (p == MAP_FAILED) {
    close(own);
    throw sys_error("mmap ring");
  }
  auto* h = static_cast<RingHeader*>(p);
  uint64_t cap = h->capacity;
  if (h->magic != RingHeader::kMagic || h->version != RingHeader::kVersion || cap < 4096 ||
      (cap & (cap - 1)) != 0 || sizeof(RingHeader) + cap != map_size) {
    munmap(p, map_size);
    close(own);
    throw std::runtime_error("fd holds no jitckpt proxy ring of version " + std::to_string(RingHeader::kVersion));
  }
  return ShmRing(own, h, map_size);
}

ShmRing::ShmRing(int fd, RingHeader* header, size_t map_size)
    : fd_(fd),
      header_(header),
      data_(reinterpret_cast<uint8_t*>(header) + sizeof(RingHeader)),
      map_size_(map_size),
      capacity_(header->capacity) {}

ShmRing::ShmRing(ShmRing&& o) noexcept { *this = std::move(o); }

ShmRing& ShmRing::operator=(ShmRing&& o) noexcept {
  if (this != &o) {
    this->~ShmRing();
    fd_ = std::exchange(o.fd_, -1);
    header_ = std::exchange(o.header_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    capacity_ = std::exchange(o.capacity_, 0);
    pending_ = std::exchange(o.pending_, 0);
    broken_ = std::exchange(o.broken_, false);
    broken_why_ = std::move(o.broken_why_);
  }
  return *this;
}

ShmRing::~ShmRing() {
  if (header_ != nullptr) munmap(header_, map_size_);
  if (fd_ >= 0) close(fd_);
  header_ = nullptr;
  fd_ = -1;
}

RingStatus ShmRing::push(uint32_t tag, const void* payload, size_t length, Clock::time_point deadline) {
  if (tag == kWrapTag || length > max_payload()) return RingStatus::kTooLarge;
  const size_t need = kFrame + round8(length);
  uint64_t tail = header_->tail.load(std::memory_order_relaxed);  // only this side writes it
  size_t off = tail & (capacity_ - 1);
  const size_t to_end = capacity_ - off;
  const bool wrap = to_end < need;
  if (!wait_for_space(need + (wrap ? to_end : 0), deadline)) return RingStatus::kTimeout;
  if (wrap) {  // offsets are multiples of 8: there is always room for the wrap frame
    const uint32_t frame[2] = {0, kWrapTag};
    std::memcpy(data_ + off, frame, kFrame);
    tail += to_end;
    off = 0;
  }
  const uint32_t frame[2] = {static_cast<uint32_t>(length), tag};
  std::memcpy(data_ + off, frame, kFrame);
  if (length > 0) std::memcpy(data_ + off + kFrame, payload, length);
  header_->tail.store(tail + need, std::memory_order_seq_cst);  // seq_cst: see spin_then_sleep
  wake_consumer();
  return RingStatus::kOk;
}

RingStatus ShmRing::peek(uint32_t* tag, const uint8_t** data, size_t* length, Clock::time_point deadline,
                         std::string* error) {
  if (pending_ != 0) release();
  auto corrupt = [&](const std::string& why) {
    broken_ = true;
    broken_why_ = why;
    *error = why;
    return RingStatus::kCorrupt;
  };
  while (true) {
    if (broken_) {
      *error = broken_why_;
      return RingStatus::kCorrupt;
    }
    const uint64_t head = header_->head.load(std::memory_order_relaxed);  // only this side writes it
    uint64_t tail = header_->tail.load(std::memory_order_acquire);
    if (tail == head) {
      if (!wait_for_data(deadline)) return RingStatus::kTimeout;
      continue;
    }
    const uint64_t avail = tail - head;
    if (avail > capacity_ || (avail & 7) != 0)
      return corrupt("ring tail " + std::to_string(tail) + " is not within one buffer of head " +
                     std::to_string(head));
    const size_t off = head & (capacity_ - 1);
    const size_t to_end = capacity_ - off;
    uint32_t frame[2];
    std::memcpy(frame, data_ + off, kFrame);  // read once: the writer is another process
    if (frame[1] == kWrapTag) {
      if (frame[0] != 0 || to_end > avail)
        return corrupt("bad wrap frame at ring offset " + std::to_string(off));
      header_->head.store(head + to_end, std::memory_order_seq_cst);
      wake_producer();
      continue;
    }
    const size_t need = kFrame + round8(frame[0]);
    if (frame[0] > max_payload() || need > to_end || need > avail)
      return corrupt("message at ring offset " + std::to_string(off) + " claims " + std::to_string(frame[0]) +
                     " bytes; only " + std::to_string(std::min<uint64_t>(avail, to_end) - kFrame) +
                     " were published");
    *tag = frame[1];
    *data = data_ + off + kFrame;
    *length = frame[0];
    pending_ = need;
    return RingStatus::kOk;
  }
}

void ShmRing::release() {
  if (pending_ == 0) return;
  header_->head.store(header_->head.load(std::memory_order_relaxed) + pending_, std::memory_order_seq_cst);
  pending_ = 0;
  wake_producer();
}

bool ShmRing::wait_for_data(Clock::time_point deadline) {
  const uint64_t head = header_->head.load(std::memory_order_relaxed);
  return spin_then_sleep([&](std::memory_order o) { return header_->tail.load(o) != head; },
                         &header_->consumer_sleeping, &header_->data_word, deadline);
}

bool ShmRing::wait_for_space(uint64_t needed, Clock::time_point deadline) {
  const uint64_t tail = header_->tail.load(std::memory_order_relaxed);
  return spin_then_sleep([&](std::memory_order o) { return capacity_ - (tail - header_->head.load(o)) >= needed; },
                         &header_->producer_sleeping, &header_->space_word, deadline);
}

void ShmRing::wake_consumer() { wake(&header_->consumer_sleeping, &header_->data_word); }

void ShmRing::wake_producer() { wake(&header_->producer_sleeping, &header_->space_word); }

}  // namespace jitckpt::proxy
