// cudaHostRegister of memory the program allocated itself (issue 15): a buffer that shares its
// pages with other data, an 8 MiB malloc'd buffer, a file mapping. Checks that
//   - the bytes around a registration survive registering, forking and unregistering;
//   - an async copy from registered memory reads the bytes when it runs, not when it is enqueued
//     (a kernel holds the stream until the host, having rewritten the buffer, sets a flag);
//   - an async copy into registered memory lands there with no explicit copy back;
//   - a forked child's writes to those pages stay in the child.
// Prints key=value lines; test_proxy_host_register.py runs it direct and in proxy mode.
#include <cuda_runtime.h>

__global__ void wait_for_flag(volatile int* flag, long long max_spins) {
  for (long long i = 0; i < max_spins && *flag == 0; ++i) {
  }
}

__global__ void scale(float* x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(wait_for_flag)
SIMCUDA_EXPORT_KERNEL(scale)
#else
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(call)                                                                         \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("FAIL %s: %s (%s)\n", #call, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

static bool all_equal(const char* p, size_t n, char c) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != c) return false;
  return true;
}

int main() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const int n = 1000;  // floats: from 64 bytes into the first page into the second
  char* block = static_cast<char*>(std::aligned_alloc(page, 4 * page));
  const size_t head = 64, tail_at = head + n * sizeof(float);
  std::memset(block, 'N', head);
  std::memset(block + tail_at, 'T', 2 * page - tail_at);
  float* data = reinterpret_cast<float*>(block + head);
  for (int i = 0; i < n; ++i) data[i] = static_cast<float>(i);

  CHECK(cudaHostRegister(data, n * sizeof(float), cudaHostRegisterDefault));
  bool kept = all_equal(block, head, 'N') && all_equal(block + tail_at, 2 * page - tail_at, 'T');
  for (int i = 0; i < n; ++i) kept = kept && data[i] == static_cast<float>(i);
  std::printf("kept_after_register=%d\n", kept);
  cudaPointerAttributes attr{};
  CHECK(cudaPointerGetAttributes(&attr, data));
  std::printf("attr_type=%d\n", static_cast<int>(attr.type));
  std::printf("register_twice=%s\n", cudaGetErrorName(cudaHostRegister(data, 16, 0)));
  cudaGetLastError();

  // The copy is enqueued behind a kernel that waits for the flag; the host rewrites the buffer
  // before it sets the flag, so the copy must read the new values.
  int* flag = nullptr;
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  float* dev = nullptr;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), n * sizeof(float)));
  wait_for_flag<<<1, 1, 0, s>>>(flag, 20000000000LL);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpyAsync(dev, data, n * sizeof(float), cudaMemcpyHostToDevice, s));
  for (int i = 0; i < n; ++i) data[i] = static_cast<float>(2 * i);
  __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
  scale<<<(n + 127) / 128, 128, 0, s>>>(dev, 0.5f, n);
  CHECK(cudaGetLastError());

  // Back into a large registered buffer (malloc's own mmap), async, no copy back by the program.
  const size_t big_bytes = size_t{8} << 20;
  float* big = static_cast<float*>(std::malloc(big_bytes));
  std::memset(big, 0, big_bytes);
  CHECK(cudaHostRegister(big, big_bytes, cudaHostRegisterPortable));
  CHECK(cudaMemcpyAsync(big + 12345, dev, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  int late = 0;
  for (int i = 0; i < n; ++i) late += big[12345 + i] == static_cast<float>(i);  // (2i) * 0.5
  std::printf("late_write_seen=%d\n", late == n);
  std::printf("big_untouched=%d\n", big[0] == 0.0f && big[big_bytes / sizeof(float) - 1] == 0.0f);

  // A forked child scribbles on the registered pages; the parent must not see it.
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    std::memset(block, 'X', head);
    data[0] = -1.0f;
    big[0] = -1.0f;
    _exit(all_equal(block, head, 'X') && data[0] == -1.0f ? 0 : 3);
  }
  int status = 0;
  waitpid(child, &status, 0);
  std::printf("child_ok=%d\n", WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::printf("fork_isolated=%d\n", all_equal(block, head, 'N') && data[0] == 0.0f && big[0] == 0.0f);

  CHECK(cudaHostUnregister(data));
  std::printf("unregister_twice=%s\n", cudaGetErrorName(cudaHostUnregister(data)));
  cudaGetLastError();
  kept = all_equal(block, head, 'N') && all_equal(block + tail_at, 2 * page - tail_at, 'T');
  for (int i = 0; i < n; ++i) kept = kept && data[i] == static_cast<float>(2 * i);
  data[1] = 42.0f;  // still ordinary writable memory
  std::printf("kept_after_unregister=%d\n", kept && data[1] == 42.0f);
  CHECK(cudaHostUnregister(big));
  std::free(big);

  // A shared file mapping: proxy mode cannot move it into shared memory without cutting it off
  // from its file.
  char path[] = "/tmp/jitckpt-host-register-XXXXXX";
  const int fd = mkstemp(path);
  unlink(path);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(page)) != 0) return 1;
  void* file_map = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const cudaError_t file_status = cudaHostRegister(file_map, page, 0);
  std::printf("file_register=%s\n", cudaGetErrorName(file_status));
  if (file_status == cudaSuccess) CHECK(cudaHostUnregister(file_map));
  cudaGetLastError();

  CHECK(cudaFree(dev));
  CHECK(cudaFreeHost(flag));
  CHECK(cudaStreamDestroy(s));
  munmap(file_map, page);
  close(fd);
  std::free(block);
  std::printf("ok=1\n");
  return 0;
}
#endif
