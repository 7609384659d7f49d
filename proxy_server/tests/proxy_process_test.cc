// jitckpt-proxy on simcuda: calls run in the proxy, device memory exists only there, bad requests
// get clear errors without crashing it, and each side notices the other's death.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "proxy_client.h"
#include "proxy_functions.h"
#include <nccl.h>

using jitckpt::proxy::Call;
using jitckpt::proxy::CallResult;
using jitckpt::proxy::ProxyClient;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kArenaBase = 0x300000000000ULL;
#if defined(__SANITIZE_THREAD__)
constexpr bool kFixedArena = false;  // ThreadSanitizer keeps that range for its shadow memory
#else
constexpr bool kFixedArena = true;
#endif

std::unique_ptr<ProxyClient> start_proxy() {
  setenv("LD_LIBRARY_PATH", SIMCUDA_LIB_DIR, 1);
  if (kFixedArena)
    setenv("SIMCUDA_ARENA_BASE", "0x300000000000", 1);
  else
    unsetenv("SIMCUDA_ARENA_BASE");
  setenv("SIMCUDA_DEVICES", "2", 1);
  return ProxyClient::start(JITCKPT_PROXY_BINARY);
}

template <typename T>
T result_as(const CallResult& r) {
  T v{};
  EXPECT_GE(r.results.size(), sizeof v);
  if (r.results.size() >= sizeof v) std::memcpy(&v, r.results.data(), sizeof v);
  return v;
}

// Whether some mapping of process `pid` contains `addr`.
bool maps_contain(const std::string& pid, uint64_t addr) {
  std::ifstream maps("/proc/" + pid + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    uint64_t lo = 0, hi = 0;
    char dash;
    std::istringstream in(line);
    in >> std::hex >> lo >> dash >> hi;
    if (addr >= lo && addr < hi) return true;
  }
  return false;
}

bool gone_or_zombie(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = all.rfind(')');
  return close != std::string::npos && close + 2 < all.size() && all[close + 2] == 'Z';
}

}  // namespace

namespace {

// A generic call's request: RequestHead, then the arguments as the generated layer writes them.
CallResult generic(jitckpt::proxy::ProxyChannel& proxy, jitckpt::proxy::FunctionId id,
                   const std::vector<uint8_t>& args, bool no_reply = false,
                   std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  std::vector<uint8_t> payload(sizeof(jitckpt::proxy::RequestHead));
  const uint64_t seq = proxy.next_seq();
  const jitckpt::proxy::RequestHead head{seq, no_reply ? jitckpt::proxy::kNoReply : 0u, 0};
  std::memcpy(payload.data(), &head, sizeof head);
  payload.insert(payload.end(), args.begin(), args.end());
  const uint32_t tag = jitckpt::proxy::kGenericBase + static_cast<uint32_t>(id);
  if (no_reply) {
    CallResult r;
    r.error = proxy.post(tag, payload.data(), payload.size());
    return r;
  }
  return proxy.call_raw(tag, payload.data(), payload.size(), seq, timeout);
}

CallResult generic(ProxyClient& proxy, jitckpt::proxy::FunctionId id, const std::vector<uint8_t>& args,
                   bool no_reply = false, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return generic(proxy.primary(), id, args, no_reply, timeout);
}

template <typename T>
void put(std::vector<uint8_t>* v, T x) {
  const auto* p = reinterpret_cast<const uint8_t*>(&x);
  v->insert(v->end(), p, p + sizeof x);
}

// cudaGetDeviceCount, cudaSetDevice, cudaGetDevice and cudaDeviceSynchronize as the generated
// layer sends them.
CallResult device_count(jitckpt::proxy::ProxyChannel& proxy) {
  return generic(proxy, jitckpt::proxy::FunctionId::k_cudaGetDeviceCount, {1, 0, 0, 0, 0});
}
CallResult device_count(ProxyClient& proxy) { return device_count(proxy.primary()); }
CallResult set_device(ProxyClient& proxy, int32_t device) {
  std::vector<uint8_t> a;
  put(&a, device);
  return generic(proxy, jitckpt::proxy::FunctionId::k_cudaSetDevice, a);
}
CallResult get_device(ProxyClient& proxy) {
  return generic(proxy, jitckpt::proxy::FunctionId::k_cudaGetDevice, {1, 0, 0, 0, 0});
}
CallResult device_synchronize(ProxyClient& proxy) {
  return generic(proxy, jitckpt::proxy::FunctionId::k_cudaDeviceSynchronize, {});
}

}  // namespace

TEST(ProxyProcess, CallsRunInTheProxyAndDeviceMemoryIsMappedOnlyThere) {
  auto proxy = start_proxy();
  CallResult n = device_count(*proxy);
  ASSERT_EQ(n.status, 0) << n.error;
  EXPECT_EQ(result_as<int32_t>(n), 2);
  ASSERT_EQ(set_device(*proxy, 1).status, 0);
  EXPECT_EQ(result_as<int32_t>(get_device(*proxy)), 1);
  ASSERT_EQ(set_device(*proxy, 0).status, 0);
  const uint64_t size = 1 << 16;
  CallResult m = proxy->call(Call::kMalloc, &size, sizeof size);
  ASSERT_EQ(m.status, 0) << m.error;
  const uint64_t ptr = result_as<uint64_t>(m);
  if (kFixedArena) {
    EXPECT_EQ(ptr, kArenaBase);  // the fixed arena: the same pointer after a proxy restart
  }
  std::vector<uint8_t> req(16 + size);
  const uint64_t head[2] = {ptr, size};
  std::memcpy(req.data(), head, sizeof head);
  for (size_t i = 0; i < size; ++i) req[16 + i] = static_cast<uint8_t>(i * 31 + 7);
  ASSERT_EQ(proxy->call(Call::kMemcpyToDevice, req.data(), req.size()).status, 0);
  ASSERT_EQ(device_synchronize(*proxy).status, 0);
  CallResult back = proxy->call(Call::kMemcpyFromDevice, head, sizeof head);
  ASSERT_EQ(back.status, 0) << back.error;
  ASSERT_EQ(back.results.size(), size);
  EXPECT_EQ(0, std::memcmp(back.results.data(), req.data() + 16, size));
  // The device memory is the proxy's: nothing of it is mapped in this (the application's) process.
  EXPECT_TRUE(maps_contain(std::to_string(proxy->pid()), ptr));
  EXPECT_FALSE(maps_contain("self", ptr));
  EXPECT_EQ(proxy->call(Call::kFree, &ptr, sizeof ptr).status, 0);
}

TEST(ProxyProcess, BadRequestsGetClearErrorsAndTheProxyServesOn) {
  auto proxy = start_proxy();
  const uint64_t stray = 0x12345000;
  CallResult r = proxy->call(Call::kFree, &stray, sizeof stray);
  EXPECT_EQ(r.status, 1);  // cudaErrorInvalidValue, as the direct call gives for a bad pointer
  EXPECT_NE(r.error.find("is not a device allocation of this proxy"), std::string::npos) << r.error;
  const uint64_t outside[2] = {0x1000, 16};
  r = proxy->call(Call::kMemcpyFromDevice, outside, sizeof outside);
  EXPECT_NE(r.error.find("is outside the device arena"), std::string::npos) << r.error;
  const uint64_t seq = proxy->next_seq();
  r = proxy->call_raw(77, &seq, sizeof seq, seq, std::chrono::seconds(10));
  EXPECT_NE(r.error.find("unknown call 77"), std::string::npos) << r.error;
  r = proxy->call_raw(static_cast<uint32_t>(Call::kMalloc), "abc", 3, 0);
  EXPECT_NE(r.error.find("cudaMalloc: truncated request"), std::string::npos) << r.error;
  const uint8_t short_args[sizeof(jitckpt::proxy::RequestHead) + 3] = {};
  r = proxy->call_raw(static_cast<uint32_t>(Call::kMalloc), short_args, sizeof short_args, 0);
  EXPECT_NE(r.error.find("3 argument bytes, expected 8"), std::string::npos) << r.error;
  CallResult n = device_count(*proxy);
  EXPECT_EQ(n.status, 0);
  EXPECT_EQ(result_as<int32_t>(n), 2);
}

TEST(ProxyProcess, ACorruptRequestRingIsReportedNotACrash) {
  auto proxy = start_proxy();
  auto& ring = proxy->request_ring();
  auto* header = reinterpret_cast<jitckpt::proxy::RingHeader*>(ring.raw_data() - sizeof(jitckpt::proxy::RingHeader));
  // A frame whose length claims more than was published, as a buggy or hostile writer leaves it.
  const uint32_t frame[2] = {1u << 20, 4};
  const uint64_t tail = header->tail.load();
  std::memcpy(ring.raw_data() + (tail & (ring.capacity() - 1)), frame, sizeof frame);
  header->tail.store(tail + 16);
  header->data_word.fetch_add(1);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header->data_word), 1 /*FUTEX_WAKE*/, 1, nullptr, nullptr, 0);
  CallResult r = device_count(*proxy);
  EXPECT_NE(r.error.find("corrupt request ring"), std::string::npos) << r.error;
  EXPECT_EQ(kill(proxy->pid(), 0), 0);  // alive: it stopped reading the ring, it did not crash
  EXPECT_FALSE(gone_or_zombie(proxy->pid()));
}

TEST(ProxyProcess, AKilledProxyFailsTheNextCallClearlyAndPromptly) {
  auto proxy = start_proxy();
  ASSERT_EQ(device_count(*proxy).status, 0);
  kill(proxy->pid(), SIGKILL);
  auto t0 = Clock::now();
  CallResult r = device_count(*proxy);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(r.status, 999);
  EXPECT_NE(r.error.find("jitckpt-proxy (pid " + std::to_string(proxy->pid()) + ") was killed by"),
            std::string::npos)
      << r.error;
}

TEST(ProxyProcess, TheProxyDoesNotOutliveItsClient) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t app = fork();
  ASSERT_GE(app, 0);
  if (app == 0) {  // the application: starts its proxy, then dies without any cleanup
    auto proxy = start_proxy();
    pid_t p = proxy->pid();
    if (write(pipefd[1], &p, sizeof p) != sizeof p) _exit(1);
    kill(getpid(), SIGKILL);
  }
  close(pipefd[1]);
  pid_t proxy_pid = 0;
  ASSERT_EQ(read(pipefd[0], &proxy_pid, sizeof proxy_pid), static_cast<ssize_t>(sizeof proxy_pid));
  int status = 0;
  waitpid(app, &status, 0);
  auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!gone_or_zombie(proxy_pid) && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(gone_or_zombie(proxy_pid)) << "jitckpt-proxy " << proxy_pid << " outlived its client";
  if (!gone_or_zombie(proxy_pid)) kill(proxy_pid, SIGKILL);
}

TEST(ProxyProcess, AMissingBinaryIsNamed) {
  try {
    ProxyClient::start("/nonexistent/jitckpt-proxy");
    FAIL() << "started a proxy that does not exist";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/jitckpt-proxy"), std::string::npos) << e.what();
  }
}


TEST(ProxyProcess, HandlesAreVirtualAndAnUnknownOneIsRefusedByName) {
  using jitckpt::proxy::FunctionId;
  auto proxy = start_proxy();
  std::vector<uint8_t> create;
  put<uint8_t>(&create, 1);   // the result pointer is present
  put<uint32_t>(&create, 1);  // cudaStreamNonBlocking
  CallResult r = generic(*proxy, FunctionId::k_cudaStreamCreateWithFlags, create);
  ASSERT_EQ(r.status, 0) << r.error;
  const uint64_t stream = result_as<uint64_t>(r);
  EXPECT_GE(stream, 0x7a0000000000ULL);  // a virtual handle, not the proxy's pointer
  std::vector<uint8_t> sync;
  put<uint64_t>(&sync, stream);
  EXPECT_EQ(generic(*proxy, FunctionId::k_cudaStreamSynchronize, sync).status, 0);
  std::vector<uint8_t> bogus;
  put<uint64_t>(&bogus, 0xdeadbeef000ULL);
  r = generic(*proxy, FunctionId::k_cudaStreamSynchronize, bogus);
  EXPECT_EQ(r.status, 400);  // cudaErrorInvalidResourceHandle
  EXPECT_NE(r.error.find("cudaStreamSynchronize: unknown handle 0xdeadbeef000 for 'stream'"), std::string::npos)
      << r.error;
  EXPECT_EQ(generic(*proxy, FunctionId::k_cudaStreamDestroy, sync).status, 0);
  r = generic(*proxy, FunctionId::k_cudaStreamSynchronize, sync);  // destroyed: forgotten
  EXPECT_NE(r.error.find("unknown handle"), std::string::npos) << r.error;
  // A failed stream-ordered call (no reply) is reported with the next reply.
  EXPECT_TRUE(generic(*proxy, FunctionId::k_cudaStreamWaitEvent, [] {
                std::vector<uint8_t> a;
                put<uint64_t>(&a, 0);
                put<uint64_t>(&a, 0xbad0000ULL);
                put<uint32_t>(&a, 0);
                return a;
              }(), true).error.empty());
  r = device_count(*proxy);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.async_status, 400);
  EXPECT_STREQ(jitckpt::proxy::call_name(r.async_call), "cudaStreamWaitEvent");
}

// Sends a module (`image`, then the NUL-terminated `names`) as libjit.so does: the memfd first.
CallResult register_module(ProxyClient& proxy, const std::string& image, const std::vector<std::string>& names,
                           uint32_t num_kernels) {
  std::string bytes = image;
  size_t names_size = 0;
  for (const std::string& n : names) names_size += n.size() + 1, bytes.append(n).push_back('\0');
  const int fd = memfd_create("test-module", MFD_CLOEXEC);
  EXPECT_EQ(pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  static uint64_t token = 1000;
  ++token;
  EXPECT_TRUE(proxy.send_fd(fd, token));
  close(fd);
  const jitckpt::proxy::RegisterModule m{token, image.size(), names_size, num_kernels, 0};
  return proxy.call(Call::kRegisterModule, &m, sizeof m);
}

std::string fatbin_image(uint64_t body) {
  const jitckpt::proxy::FatbinHeader h{jitckpt::proxy::FatbinHeader::kMagic, 1, sizeof h, body};
  return std::string(reinterpret_cast<const char*>(&h), sizeof h) + std::string(body, '\x7f');
}

TEST(ProxyProcess, UnknownKernelsAndLaunchesGetClearErrors) {
  auto proxy = start_proxy();
  CallResult r = register_module(*proxy, fatbin_image(64), {"_Z10no_such_kernelPi"}, 1);
  ASSERT_EQ(r.status, 0) << r.error;
  ASSERT_EQ(result_as<uint32_t>(r), 0u);
  const jitckpt::proxy::KernelRef first{0, 0}, missing{0, 1}, no_module{5, 0};
  r = proxy->call(Call::kRegisterKernel, &first, sizeof first);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.error.find("kernel _Z10no_such_kernelPi: the device runtime has no code for it"), std::string::npos)
      << r.error;
  r = proxy->call(Call::kRegisterKernel, &missing, sizeof missing);
  EXPECT_EQ(r.status, 98) << r.error;  // cudaErrorInvalidDeviceFunction
  EXPECT_NE(r.error.find("no kernel 1 in module 0"), std::string::npos) << r.error;
  r = proxy->call(Call::kRegisterKernel, &no_module, sizeof no_module);
  EXPECT_NE(r.error.find("no kernel 0 in module 5"), std::string::npos) << r.error;
  jitckpt::proxy::LaunchKernel launch{};
  launch.kernel_id = 7;
  launch.grid[0] = launch.grid[1] = launch.grid[2] = 1;
  launch.block[0] = launch.block[1] = launch.block[2] = 1;
  r = proxy->call(Call::kLaunchKernel, &launch, sizeof launch);
  EXPECT_NE(r.error.find("unknown kernel id 7"), std::string::npos) << r.error;
  // The first kernel is known to the proxy but has no code: it cannot be launched either.
  launch.kernel_id = 0;
  r = proxy->call(Call::kLaunchKernel, &launch, sizeof launch);
  EXPECT_NE(r.error.find("unknown kernel id 0"), std::string::npos) << r.error;
}

TEST(ProxyProcess, MalformedModulesAreRefused) {
  auto proxy = start_proxy();
  CallResult r = register_module(*proxy, std::string(64, 'x'), {"_Z1kv"}, 1);
  EXPECT_EQ(r.status, 200) << r.error;  // cudaErrorInvalidKernelImage
  EXPECT_NE(r.error.find("the image is not a fat binary of 64 bytes"), std::string::npos) << r.error;
  std::string cut = fatbin_image(64);
  cut.resize(40);  // the header announces more than was sent
  r = register_module(*proxy, cut, {"_Z1kv"}, 1);
  EXPECT_NE(r.error.find("not a fat binary of 40 bytes"), std::string::npos) << r.error;
  r = register_module(*proxy, fatbin_image(8), {"_Z1kv", "_Z1jv"}, 3);  // fewer names than announced
  EXPECT_NE(r.error.find("the kernel names are not 3 NUL-terminated names"), std::string::npos) << r.error;
  r = register_module(*proxy, fatbin_image(8), {""}, 1);
  EXPECT_NE(r.error.find("NUL-terminated names of 1 to 4096 bytes"), std::string::npos) << r.error;
  // A request whose memfd never came: a bounded wait, then an error, and the proxy serves on.
  const jitckpt::proxy::RegisterModule orphan{424242, 16, 2, 1, 0};
  r = proxy->call(Call::kRegisterModule, &orphan, sizeof orphan);
  EXPECT_NE(r.error.find("the client's memfd did not arrive"), std::string::npos) << r.error;
  // A well-formed module still registers after all that.
  r = register_module(*proxy, fatbin_image(8), {"_Z1kv"}, 1);
  EXPECT_EQ(r.status, 0) << r.error;
  EXPECT_EQ(result_as<uint32_t>(r), 0u);
}

// Random tags, flags and argument bytes (generic CUDA runtime calls and the hand-written ones):
// every request gets an answer or is dropped, and the proxy serves on. NCCL calls are left out
// (a random communicator init waits for peers that never come), and so is cudaHostAlloc (it
// waits for a memfd on the socket).
TEST(ProxyProcess, RandomRequestsNeverCrashTheProxy) {
  auto proxy = start_proxy();
  std::mt19937_64 rng(20261124);
  std::vector<uint32_t> tags;
  for (uint32_t id = 0; id < jitckpt::proxy::kFunctionCount; ++id)
    if (std::strncmp(jitckpt::proxy::function_name(id), "cuda", 4) == 0) tags.push_back(jitckpt::proxy::kGenericBase + id);
  for (uint32_t c = 1; c <= static_cast<uint32_t>(Call::kKernelAttribute); ++c)
    if (c != static_cast<uint32_t>(Call::kHostAlloc)) tags.push_back(c);
  for (int i = 0; i < 10000; ++i) {
    const uint32_t tag = tags[rng() % tags.size()];
    std::vector<uint8_t> payload(sizeof(jitckpt::proxy::RequestHead) + rng() % 80);
    for (auto& b : payload) b = static_cast<uint8_t>(rng());
    const uint64_t seq = proxy->next_seq();
    const bool no_reply = rng() % 4 == 0;
    const jitckpt::proxy::RequestHead head{seq, no_reply ? jitckpt::proxy::kNoReply : 0u, 0};
    std::memcpy(payload.data(), &head, sizeof head);
    if (no_reply) {
      ASSERT_EQ(proxy->post(tag, payload.data(), payload.size()), "") << "request " << i;
    } else {
      CallResult r = proxy->call_raw(tag, payload.data(), payload.size(), seq, std::chrono::seconds(10));
      ASSERT_NE(r.status, 999) << "request " << i << " (" << jitckpt::proxy::call_name(tag) << "): " << r.error;
    }
  }
  CallResult n = device_count(*proxy);
  EXPECT_EQ(n.status, 0) << n.error;
  EXPECT_EQ(result_as<int32_t>(n), 2);
  EXPECT_FALSE(gone_or_zombie(proxy->pid()));
}

TEST(ProxyProcess, DeviceMemoryIsAtTheFixedArenaByDefault) {
  if (!kFixedArena) GTEST_SKIP() << "ThreadSanitizer keeps the arena's range for its shadow memory";
  setenv("LD_LIBRARY_PATH", SIMCUDA_LIB_DIR, 1);
  unsetenv("SIMCUDA_ARENA_BASE");
  uint64_t first[2] = {0, 0};
  for (uint64_t& ptr : first) {  // two proxies, one after the other: the same pointer
    auto proxy = ProxyClient::start(JITCKPT_PROXY_BINARY);
    const uint64_t size = 1 << 20;
    CallResult r = proxy->call(Call::kMalloc, &size, sizeof size);
    ASSERT_EQ(r.status, 0) << r.error;
    ptr = result_as<uint64_t>(r);
    EXPECT_GE(ptr, kArenaBase);
    EXPECT_LT(ptr, kArenaBase + (uint64_t{64} << 30));
  }
  EXPECT_EQ(first[0], first[1]);
}

// Each client thread has its own channel, served by its own proxy thread: while one channel is
// blocked in a call that does not return (rank 0 of a 2-rank communicator waiting for rank 1),
// another channel's calls are answered. The blocked call does not keep the proxy alive either.
TEST(ProxyProcess, ABlockedChannelDoesNotHoldUpAnother) {
  using jitckpt::proxy::FunctionId;
  auto proxy = start_proxy();
  std::vector<uint8_t> want_id;
  put<uint8_t>(&want_id, 1);
  want_id.resize(want_id.size() + sizeof(ncclUniqueId));
  CallResult id = generic(*proxy, FunctionId::k_ncclGetUniqueId, want_id);
  ASSERT_EQ(id.status, 0) << id.error;
  ASSERT_EQ(id.results.size(), sizeof(ncclUniqueId));
  std::vector<uint8_t> init;
  put<uint8_t>(&init, 1);    // the communicator result is wanted
  put<int32_t>(&init, 2);    // nranks: rank 1 never comes
  init.insert(init.end(), id.results.begin(), id.results.end());
  put<int32_t>(&init, 0);    // rank
  auto t0 = Clock::now();
  std::thread blocked([&] {
    CallResult r = generic(*proxy, FunctionId::k_ncclCommInitRank, init, false, std::chrono::seconds(2));
    EXPECT_NE(r.error.find("no reply"), std::string::npos) << r.error;
  });
  auto other = proxy->open_channel();
  CallResult n = device_count(*other);
  EXPECT_EQ(n.status, 0) << n.error;
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  blocked.join();
}
