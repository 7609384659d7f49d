#include "stage_join.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace jitckpt {
namespace {

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

std::string hex(const std::string& bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += {kHex[c >> 4], kHex[c & 15]};
  return out;
}

bool unhex(const std::string& text, std::string* bytes) {
  if (text.size() % 2 != 0) return false;
  bytes->clear();
  for (size_t i = 0; i < text.size(); i += 2) {
    char* end = nullptr;
    const std::string pair = text.substr(i, 2);
    const long v = std::strtol(pair.c_str(), &end, 16);
    if (*end != '\0') return false;
    bytes->push_back(static_cast<char>(v));
  }
  return true;
}

}  // namespace

StageJoin::StageJoin()
    : logging_(env_set("JITCKPT_SEND_LOG_DIR")), pending_(std::getenv("JITCKPT_STAGE_JOIN") != nullptr &&
                                                          std::strcmp(std::getenv("JITCKPT_STAGE_JOIN"), "1") == 0) {}

std::string StageJoin::Terms::encode() const {
  return hex(id) + "/" + std::to_string(rebuilds) + "/" + std::to_string(through);
}

bool StageJoin::Terms::decode(const std::string& text, Terms* out) {
  const size_t a = text.find('/'), b = text.find('/', a == std::string::npos ? a : a + 1);
  if (a == std::string::npos || b == std::string::npos || !unhex(text.substr(0, a), &out->id)) return false;
  out->rebuilds = std::strtoull(text.c_str() + a + 1, nullptr, 10);
  out->through = std::strtoll(text.c_str() + b + 1, nullptr, 10);
  return true;
}

bool StageJoin::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

bool StageJoin::joined() const {
  std::lock_guard<std::mutex> lock(mu_);
  return joined_;
}

std::string StageJoin::new_key(int nranks, int rank) {
  return "jitckpt/transparent/new/" + std::to_string(nranks) + "/" + std::to_string(rank);
}

bool StageJoin::join(const RendezvousStore& store, int nranks, int rank, std::chrono::milliseconds wait, Terms* terms,
                     std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ = false;
  joined_ = true;
  // The replacements of the other ranks so far are not newcomers to wait for later.
  for (int r = 0; r < nranks; ++r) {
    std::string nonce, ignored;
    if (r != rank && store.get(new_key(nranks, r), std::chrono::milliseconds(0), &nonce, &ignored)) taken_.insert(nonce);
  }
  const std::string nonce = std::to_string(getpid()) + "-" +
                            std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  std::string text;
  if (!store.set(new_key(nranks, rank), nonce, why)) return false;
  if (!store.get("jitckpt/transparent/join/" + nonce, wait, &text, why)) {
    *why = "the survivors did not take this replacement stage in (" + *why + ")";
    return false;
  }
  if (!Terms::decode(text, terms)) {
    *why = "unreadable terms from the survivors: " + text;
    return false;
  }
  return true;
}

bool StageJoin::announced(const RendezvousStore& store, int nranks, int rank) const {
  std::string nonce, ignored;
  if (!store.get(new_key(nranks, rank), std::chrono::milliseconds(0), &nonce, &ignored)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return taken_.count(nonce) == 0;
}

bool StageJoin::arrived(const RendezvousStore& store, int nranks, int rank, std::string* nonce) {
  std::string ignored;
  if (!store.get(new_key(nranks, rank), std::chrono::milliseconds(0), nonce, &ignored)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return taken_.insert(*nonce).second;
}

bool StageJoin::offer(const RendezvousStore& store, const std::string& nonce, const Terms& terms, std::string* why) {
  return store.set("jitckpt/transparent/join/" + nonce, terms.encode(), why);
}

}  // namespace jitckpt
