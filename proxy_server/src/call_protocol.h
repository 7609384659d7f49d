// What the proxy-mode client and the device proxy say over the rings (issue 15).
//
// Request: ring tag = the Call, payload = RequestHead then the call's fixed arguments (and, for
// kMemcpyToDevice, the bytes). Reply: ring tag = the Call, payload = ReplyHead then the call's
// results. Every request here is synchronous (the client waits for the reply with the same seq);
// stream-ordered calls that need no reply come with the generated forwarding layer.
// Protocol errors (an unknown call, a wrong size, a pointer the proxy never handed out) come back
// as a cudaError_t plus a message in ReplyHead's text, so the caller can say what went wrong.
#pragma once

#include <cstdint>

namespace jitckpt::proxy {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr uint32_t kHelloMagic = 0x4A505859;  // "JPXY"

enum class Call : uint32_t {
  kGetDeviceCount = 1,
  kGetDevice = 2,
  kSetDevice = 3,
  kMalloc = 4,
  kFree = 5,
  kMemcpyToDevice = 6,    // args: MemcpyToDevice, then `count` bytes
  kMemcpyFromDevice = 7,  // reply: `count` bytes
  kDeviceSynchronize = 8,
};

const char* call_name(uint32_t call);

struct RequestHead {
  uint64_t seq;
};

struct ReplyHead {
  uint64_t seq;
  int32_t status;    // the cudaError_t the direct call would return
  uint32_t has_text; // 1: `text` explains a protocol error
  char text[240];
};

struct DeviceArg {
  int32_t device;
};
struct SizeArg {
  uint64_t size;
};
struct PointerArg {
  uint64_t ptr;
};
struct MemcpyToDevice {
  uint64_t dst;
  uint64_t count;
};
struct MemcpyFromDevice {
  uint64_t src;
  uint64_t count;
};

// Handshake over the Unix socket the proxy inherits: the client sends Hello with the request and
// reply ring fds (SCM_RIGHTS); the proxy answers Ready once it serves.
struct Hello {
  uint32_t magic;
  uint32_t version;
};
struct Ready {
  uint32_t magic;
  uint32_t version;
  int32_t pid;
  int32_t status;  // 0, or why the proxy cannot serve (the text follows in `text`)
  char text[240];
};

}  // namespace jitckpt::proxy
