#include "save_redirect.h"

#include "diagnostics.h"
#include "real_api.h"

namespace jitckpt {

bool SaveRedirect::begin(int device) {
  if (auto set = real_cuda.setDevice.get()) set(device);
  if (stream_ == nullptr) {
    auto create = real_cuda.streamCreateWithFlags.get();
    // Non-blocking: no implicit synchronization with the legacy default stream.
    if (create == nullptr || create(&stream_, cudaStreamNonBlocking) != cudaSuccess) {
      log_always("could not create the save stream on device %d; device copies are not redirected", device);
      stream_ = nullptr;
      return false;
    }
  }
  active_.store(true, std::memory_order_release);
  return true;
}

}  // namespace jitckpt
