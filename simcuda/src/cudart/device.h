// One simulated GPU: its properties, its streams, and the legacy-default-stream ordering rules.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <vector>

#include "error_state.h"
#include "stream.h"

namespace simcuda {

class Device {
 public:
  Device(int id, size_t memory_bytes, const ErrorState* errors);
  int id() const { return id_; }
  const cudaDeviceProp& properties() const { return props_; }
  // Attribute value for cudaDeviceGetAttribute; false if the attribute is not simulated.
  bool attribute(cudaDeviceAttr attr, int* value) const;

  std::shared_ptr<Stream> legacy_stream() const { return legacy_; }
  std::shared_ptr<Stream> create_stream(Stream::Kind kind, unsigned flags, int priority);

  // Enqueues `op` on `stream` applying the legacy default stream rules: work on the legacy stream
  // waits for all earlier work on blocking streams of this device, and work on a blocking stream waits
  // for all earlier work on the legacy stream. Returns the op's sequence number.
  uint64_t submit(const std::shared_ptr<Stream>& stream, Stream::Op op, bool always_run = false);
  // Blocks until every op enqueued so far on every stream of this device has finished.
  void synchronize();

 private:
  std::vector<std::shared_ptr<Stream>> live_streams();

  const int id_;
  const ErrorState* errors_;
  cudaDeviceProp props_{};
  std::shared_ptr<Stream> legacy_;
  std::mutex mu_;  // serializes submit() so cross-stream waits are captured consistently
  std::vector<std::weak_ptr<Stream>> streams_;
};

}  // namespace simcuda
