// Device pointers from a sequence of cudaMalloc/cudaFree, and a round trip through them.
// Prints "key=value" lines (tests/native/test_simcuda_runtime.py: the fixed device arena;
// test_proxy_mode.py: the proxy's). With "wait": then reads a line from stdin (a test replaces the
// proxy meanwhile), reads c back again, allocates once more and prints it, and waits for another
// line before it exits (the read back on a stream made before the pause).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const bool wait = argc > 1 && std::strcmp(argv[1], "wait") == 0;
  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  void* d = nullptr;
  cudaError_t e = cudaMalloc(&a, 1000);
  std::printf("malloc=%s\n", cudaGetErrorName(e));
  if (e != cudaSuccess) return 1;
  if (cudaMalloc(&b, 1 << 20) != cudaSuccess || cudaMalloc(&c, 37) != cudaSuccess || cudaFree(b) != cudaSuccess ||
      cudaMalloc(&d, 4096) != cudaSuccess)
    return 2;
  char in[37], out[37] = {};
  for (int i = 0; i < 37; ++i) in[i] = static_cast<char>(i * 7);
  if (cudaMemcpy(c, in, sizeof in, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(out, c, sizeof out, cudaMemcpyDeviceToHost) != cudaSuccess)
    return 3;
  std::printf("a=%p\nc=%p\nd=%p\nroundtrip=%d\n", a, c, d, std::memcmp(in, out, sizeof in) == 0);
  if (!wait) return 0;
  // A getter that hands out a handle, then a handle made after it: a new proxy must give the
  // stream the same handle (the getter is replayed in order, as what creates handles is).
  cudaMemPool_t pool = nullptr;
  cudaStream_t stream = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, 0) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess) return 7;
  std::fflush(stdout);
  char line[16];
  if (std::fgets(line, sizeof line, stdin) == nullptr) return 4;
  void* f = nullptr;
  std::memset(out, 0, sizeof out);
  if (cudaMemcpyAsync(out, c, sizeof out, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess || cudaMalloc(&f, 4096) != cudaSuccess)
    return 5;
  std::printf("roundtrip_after=%d\ne=%p\n", std::memcmp(in, out, sizeof in) == 0, f);
  std::fflush(stdout);
  if (std::fgets(line, sizeof line, stdin) == nullptr) return 6;
  return 0;
}
