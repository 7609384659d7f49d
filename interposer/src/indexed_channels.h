// A proxy's channels by the index of the application thread they serve (0: the client's primary
// channel), opened on first use. The index survives a replacement of the proxy: a thread, or the
// replay of its calls, gets the new proxy's channel of the same index. Used for the application's
// proxy and for a validation's scratch proxy. Not thread-safe: the owner locks.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "proxy_client.h"

namespace jitckpt {

class IndexedChannels {
 public:
  // Forgets the channels of the previous proxy (`client` may be null: none).
  void attach(proxy::ProxyClient* client);
  // The channel of `index`, opened now if needed; nullptr with `why`.
  proxy::ProxyChannel* get(uint32_t index, std::string* why);
  // The channel of `index` if it is open, else nullptr.
  proxy::ProxyChannel* find(uint32_t index) const;
  // Forgets the channel of `index` (closed on the proxy's side already); a later get opens another.
  void drop(uint32_t index);
  // Waits (until `deadline` at most) for the proxy to have executed what every channel but
  // `except` posted without a reply so far. False on the deadline.
  bool wait_for_posted(const proxy::ProxyChannel* except, std::chrono::steady_clock::time_point deadline) const;

 private:
  proxy::ProxyClient* client_ = nullptr;
  std::vector<std::unique_ptr<proxy::ProxyChannel>> owned_;  // all but the primary channel
  std::vector<proxy::ProxyChannel*> by_index_;
};

}  // namespace jitckpt
