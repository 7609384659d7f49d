// What the proxy-mode client and the device proxy say over the rings (issue 15).
//
// Request: ring tag = the Call (or kGenericBase + a generated FunctionId, see
// proxy_functions.h), payload = RequestHead then the call's arguments. Reply: ring tag = the same,
// payload = ReplyHead then the call's results. A request with kNoReply set is stream-ordered work
// whose result the caller does not wait for (launches, async copies, event records, collectives):
// the proxy sends nothing back, and if it fails the error is reported with the next reply
// (ReplyHead::async_status), as an asynchronous error surfaces at the next call on a GPU.
// Protocol errors (an unknown call, a wrong size, a pointer the proxy never handed out, an unknown
// handle) come back as a cudaError_t plus a message in ReplyHead's text.
#pragma once

#include <cstdint>

namespace jitckpt::proxy {

inline constexpr uint32_t kProtocolVersion = 4;
inline constexpr uint32_t kHelloMagic = 0x4A505859;  // "JPXY"

enum class Call : uint32_t {
  // 1-3 and 8 were device queries, now generic calls like every value/handle/result function.
  kMalloc = 4,
  kFree = 5,
  kMemcpyToDevice = 6,    // args: MemcpyToDevice, then `count` bytes
  kMemcpyFromDevice = 7,  // reply: `count` bytes
  kRegisterKernel = 9,        // args: KernelRef; reply: KernelInfo + KernelParam[num_params]
  kLaunchKernel = 10,         // args: LaunchKernel, then the packed parameter bytes (kNoReply)
  kMemcpy = 11,               // args: MemcpyAddresses (device or pinned on both sides)
  kMemcpyAsync = 12,          // args: MemcpyAddresses (kNoReply)
  kMemcpyToDeviceAsync = 13,  // args: MemcpyInline, then `count` bytes (kNoReply)
  kMemcpyFromDeviceAsync = 14,// args: MemcpyInline; reply: `count` bytes once the stream got there
  kMemset = 15,               // args: Memset
  kHostAlloc = 16,            // args: HostAlloc; the memfd went first over the socket (SCM_RIGHTS)
  kHostFree = 17,             // args: PointerArg
  kKernelAttribute = 18,      // args: KernelAttribute; reply: cudaFuncAttributes or int32 (see its `op`)
  kRegisterModule = 19,       // args: RegisterModule; its memfd went first over the socket; reply: uint32 id
  kCloseChannel = 20,         // no args (kNoReply): the client thread exited; the channel's proxy thread ends
  kSaveDevice = 21,           // args: DeviceCopy, DeviceRange[count]; the memfd went first over the socket
  kRestoreDevice = 22,        // the same, the other way
  kFence = 23,                // args: FenceArg: whether a failed NCCL call stops device work (DeviceState::fenced)
};

// Generated calls (proxy_functions.h): tag = kGenericBase + FunctionId.
inline constexpr uint32_t kGenericBase = 0x10000;
// RequestHead::flags
inline constexpr uint32_t kNoReply = 1;

const char* call_name(uint32_t call);

struct RequestHead {
  uint64_t seq;
  uint32_t flags;  // kNoReply
  uint32_t reserved;
};

struct ReplyHead {
  uint64_t seq;
  int32_t status;        // the cudaError_t (or ncclResult_t) the direct call would return
  uint32_t has_text;     // 1: `text` explains a protocol error
  int32_t async_status;  // the first failure of a kNoReply call since the last reply (0: none)
  uint32_t async_call;   // its tag
  uint64_t async_seq;    // its seq
  char text[240];
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

// A fat binary and the kernels nvcc's code registered from it, sent once, before the first use of
// one of them: the memfd holds the fatbin image (`image_size` bytes, 0 if the client could not
// size it), then `names_size` bytes of `num_kernels` NUL-terminated mangled names.
struct RegisterModule {
  uint64_t token;  // the SocketMessage that carried the memfd
  uint64_t image_size;
  uint64_t names_size;
  uint32_t num_kernels;
  uint32_t reserved;
};
// Kernel `index` (in registration order) of module `module`.
struct KernelRef {
  uint32_t module;
  uint32_t index;
};
// The start of a fat binary image (what __cudaRegisterFatBinary's wrapper points at): its size is
// header_size + fat_size.
struct FatbinHeader {
  static constexpr uint32_t kMagic = 0xBA55ED50;
  uint32_t magic;
  uint16_t version;
  uint16_t header_size;
  uint64_t fat_size;
};
// What __cudaRegisterFatBinary receives (crt/host_runtime.h's __fatBinC_Wrapper_t).
struct FatbinWrapper {
  static constexpr int kMagic = 0x466243b1;
  int magic;
  int version;
  const void* data;
  void* filename_or_fatbins;
};

struct KernelInfo {
  uint32_t kernel_id;
  uint32_t num_params;
};
struct KernelParam {
  uint32_t offset;
  uint32_t size;
};
struct LaunchKernel {
  uint32_t kernel_id;
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t param_bytes;
  uint64_t shared_mem;
  uint64_t stream;  // a virtual handle (0, cudaStreamLegacy and cudaStreamPerThread as they are)
};
// The kernel-attribute calls, on a registered kernel: cudaFuncGetAttributes (reply: the struct),
// cudaFuncSetAttribute / cudaKernelSetAttributeForDevice, and the occupancy query (reply: int32).
struct KernelAttribute {
  enum Op : uint32_t { kGet = 1, kSet = 2, kSetForDevice = 3, kOccupancy = 4 };
  uint32_t kernel_id;
  uint32_t op;
  int32_t attribute;  // kSet*: the cudaFuncAttribute; kOccupancy: the block size
  int32_t value;      // kSet*: the value; kOccupancy: the flags
  int32_t device;     // kSetForDevice
  uint32_t reserved;
  uint64_t shared_mem;  // kOccupancy
};
struct MemcpyAddresses {
  uint64_t dst;
  uint64_t src;
  uint64_t count;
  int32_t kind;
  uint32_t reserved;
  uint64_t stream;
};
struct MemcpyInline {
  uint64_t device;  // dst (to device) or src (from device)
  uint64_t count;
  uint64_t stream;
};
struct Memset {
  uint64_t dst;
  uint64_t count;
  int32_t value;
  uint32_t reserved;
};
struct HostAlloc {
  uint64_t addr;   // where the client mapped the memfd; the proxy maps it at the same address
  uint64_t size;
  uint64_t token;  // the SocketMessage that carried the memfd
  uint32_t flags;
  uint32_t reserved;
};

// Device allocations copied whole to (kSaveDevice) or from (kRestoreDevice) a memfd of the client's,
// after the device has finished its work: how transparent recovery (issue 16) carries parameters and
// optimizer state from a proxy whose communicators failed to the proxy that replaces it.
struct DeviceCopy {
  uint64_t token;  // the SocketMessage that carried the memfd
  uint64_t count;  // DeviceRange entries that follow
  // kSaveDevice without waiting for the device's queued work, on a stream of its own: from a
  // device whose streams are blocked behind a hung collective (the work queued behind it, such
  // as the optimizer step, has not run, so the buffers hold the minibatch's start).
  uint64_t unsynchronized;
};
struct DeviceRange {
  uint64_t base;    // a device allocation's base
  uint64_t size;    // its size
  uint64_t offset;  // where its bytes are in the memfd
};

struct FenceArg {
  uint32_t on;
  uint32_t reserved;
};

// What the client sends on the Unix socket after the handshake, with file descriptors attached:
// a memfd (one fd, named by the token its kHostAlloc or kRegisterModule request carries), or the
// request and reply rings of a new channel (two fds): each client thread gets its own channel,
// served by its own proxy thread, so one thread's blocking call does not hold up another's.
struct SocketMessage {
  enum Kind : uint32_t { kMemfd = 1, kOpenChannel = 2 };
  uint32_t kind;
  uint32_t reserved;
  uint64_t token;
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
  uint64_t inventory_hash;  // kInventoryHash of the proxy's generated layer
  int32_t pid;
  int32_t status;  // 0, or why the proxy cannot serve (the text follows in `text`)
  char text[240];
};

}  // namespace jitckpt::proxy
