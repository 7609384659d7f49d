// Kernel launch + memcpy roundtrip, pointer attributes, launch/config errors.
// Prints "key=value" lines that tests/native/test_simcuda_runtime.py checks.
#include <cuda_runtime.h>

__global__ void axpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

template <typename T>
__global__ void fill(T* out, T value, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value + static_cast<T>(i);
}

__global__ void histogram(const int* values, int n, int* bins, float* total) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    atomicAdd(&bins[values[i] % 4], 1);
    atomicAdd(total, 0.5f);
  }
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(axpy)
SIMCUDA_EXPORT_KERNEL(histogram)
SIMCUDA_EXPORT_KERNEL(fill<int>)
#else
#include <cstdio>
#include <vector>

#define CHECK(call)                                                                         \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("FAIL %s: %s (%s)\n", #call, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

int main() {
  const int n = 1000;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  CHECK(cudaMalloc(&dx, n * sizeof(float)));
  CHECK(cudaMalloc(&dy, n * sizeof(float)));
  CHECK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  axpy<<<(n + 255) / 256, 256>>>(2.0f, dx, dy, n);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < n; ++i)
    if (y[i] != 2.0f * i + 1.0f) ++bad;
  std::printf("axpy_mismatches=%d\n", bad);

  int* di = nullptr;
  CHECK(cudaMalloc(&di, n * sizeof(int)));
  fill<int><<<4, 256>>>(di, 7, n);
  std::vector<int> iv(n);
  CHECK(cudaMemcpy(iv.data(), di, n * sizeof(int), cudaMemcpyDefault));
  bad = 0;
  for (int i = 0; i < n; ++i)
    if (iv[i] != 7 + i) ++bad;
  std::printf("fill_mismatches=%d\n", bad);

  // Atomics: 1000 values into 4 bins (250 each), total 500.
  int* bins = nullptr;
  float* total = nullptr;
  CHECK(cudaMalloc(&bins, 4 * sizeof(int)));
  CHECK(cudaMalloc(&total, sizeof(float)));
  CHECK(cudaMemset(bins, 0, 4 * sizeof(int)));
  CHECK(cudaMemset(total, 0, sizeof(float)));
  CHECK(cudaMemcpy(di, iv.data(), n * sizeof(int), cudaMemcpyHostToDevice));
  histogram<<<8, 128>>>(di, n, bins, total);
  int hb[4] = {0, 0, 0, 0};
  float ht = 0;
  CHECK(cudaMemcpy(hb, bins, sizeof(hb), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&ht, total, sizeof(ht), cudaMemcpyDeviceToHost));
  std::printf("histogram=%d,%d,%d,%d\n", hb[0], hb[1], hb[2], hb[3]);
  std::printf("atomic_total=%g\n", ht);

  // D2D + memset + D2H through cudaMemcpyDefault.
  CHECK(cudaMemcpy(dx, dy, n * sizeof(float), cudaMemcpyDeviceToDevice));
  CHECK(cudaMemset(dy, 0, n * sizeof(float)));
  std::vector<float> z(n, -1.0f);
  CHECK(cudaMemcpy(z.data(), dy, n * sizeof(float), cudaMemcpyDefault));
  std::printf("memset_zero=%d\n", z[0] == 0.0f && z[n - 1] == 0.0f);
  CHECK(cudaMemcpy(z.data(), dx, n * sizeof(float), cudaMemcpyDefault));
  std::printf("d2d_ok=%d\n", z[10] == 21.0f);

  // Pointer attributes tell device, pinned host and plain host memory apart.
  float* pinned = nullptr;
  CHECK(cudaMallocHost(&pinned, 64));
  cudaPointerAttributes a{};
  CHECK(cudaPointerGetAttributes(&a, dx + 5));
  std::printf("attr_device=%d\n", a.type == cudaMemoryTypeDevice);
  CHECK(cudaPointerGetAttributes(&a, pinned));
  std::printf("attr_pinned=%d\n", a.type == cudaMemoryTypeHost);
  CHECK(cudaPointerGetAttributes(&a, x.data()));
  std::printf("attr_host=%d\n", a.type == cudaMemoryTypeUnregistered);

  // A host pointer passed as the device side is rejected (non-sticky).
  cudaError_t e = cudaMemcpy(z.data(), x.data(), 16, cudaMemcpyDeviceToHost);
  std::printf("host_as_device=%s\n", cudaGetErrorName(e));
  std::printf("last_error=%s\n", cudaGetErrorName(cudaGetLastError()));
  std::printf("last_error_cleared=%s\n", cudaGetErrorName(cudaGetLastError()));
  // Out-of-range device copy.
  e = cudaMemcpy(z.data(), dx, (n + 1) * sizeof(float), cudaMemcpyDeviceToHost);
  std::printf("out_of_range=%s\n", cudaGetErrorName(e));
  cudaGetLastError();
  // Bad launch configuration: non-sticky, later calls still work.
  axpy<<<1, 2048>>>(1.0f, dx, dy, n);
  std::printf("bad_config=%s\n", cudaGetErrorName(cudaGetLastError()));
  std::printf("after_bad_config=%s\n", cudaGetErrorName(cudaDeviceSynchronize()));

  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device_count=%d\n", count);
  std::printf("cc=%d.%d\n", prop.major, prop.minor);
  std::printf("set_bad_device=%s\n", cudaGetErrorName(cudaSetDevice(count)));
  cudaGetLastError();
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dy));
  CHECK(cudaFree(di));
  CHECK(cudaFreeHost(pinned));
  std::printf("double_free=%s\n", cudaGetErrorName(cudaFree(dx)));
  std::printf("done=1\n");
  return 0;
}
#endif
