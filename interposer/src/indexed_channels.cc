#include "indexed_channels.h"

#include <algorithm>
#include <thread>

namespace jitckpt {

void IndexedChannels::attach(proxy::ProxyClient* client) {
  by_index_.clear();
  owned_.clear();
  client_ = client;
}

proxy::ProxyChannel* IndexedChannels::get(uint32_t index, std::string* why) {
  if (proxy::ProxyChannel* ch = find(index)) return ch;
  if (client_ == nullptr) {
    *why = "no proxy";
    return nullptr;
  }
  if (by_index_.size() <= index) by_index_.resize(index + 1, nullptr);
  if (index == 0) {
    by_index_[0] = &client_->primary();
  } else {
    try {
      owned_.push_back(client_->open_channel());
    } catch (const std::exception& e) {
      *why = e.what();
      return nullptr;
    }
    by_index_[index] = owned_.back().get();
  }
  return by_index_[index];
}

proxy::ProxyChannel* IndexedChannels::find(uint32_t index) const {
  return index < by_index_.size() ? by_index_[index] : nullptr;
}

void IndexedChannels::drop(uint32_t index) {
  proxy::ProxyChannel* ch = find(index);
  if (ch == nullptr) return;
  by_index_[index] = nullptr;
  auto it = std::find_if(owned_.begin(), owned_.end(), [&](const auto& c) { return c.get() == ch; });
  if (it != owned_.end()) owned_.erase(it);  // the primary channel belongs to the client
}

bool IndexedChannels::wait_for_posted(const proxy::ProxyChannel* except,
                                      std::chrono::steady_clock::time_point deadline) const {
  for (const proxy::ProxyChannel* ch : by_index_) {
    if (ch == nullptr || ch == except) continue;
    for (int spins = 0; !ch->posted_served(); ++spins) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      if (spins < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

}  // namespace jitckpt
