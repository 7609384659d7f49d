// Calls proxy mode does not forward, one of each kind libjit.so defines for them
// (tests/native/test_unforwarded_calls.py): an NCCL device-API function (nccl_device.h), NCCL's
// profiling-interface names (pnccl*), and a symbol no header declares, found with dlsym and called
// through libjit.so's trampoline. Each result is printed, not checked: the test knows what observe
// mode (simcuda's answer) and proxy mode (a refusal naming the symbol) must give.
// argv[1]: "status" (calls that return a status) or "value" (ncclTeamRankToWorld, which returns an
// int: proxy mode has no error to give it and aborts).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const bool value_mode = argc > 1 && std::strcmp(argv[1], "value") == 0;
  ncclUniqueId id;
  ncclComm_t comm = nullptr;
  if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) {
    std::printf("FAIL communicator\n");
    return 1;
  }
  std::fflush(stdout);
  if (value_mode) {
    const ncclTeam_t team{1, 0, 1};
    std::printf("team_rank_to_world=%d\n", ncclTeamRankToWorld(comm, team, 0));
    return 0;
  }

  ncclDevCommRequirements_t reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
  ncclDevComm_t dev_comm;
  std::printf("dev_comm_create=%d\n", static_cast<int>(ncclDevCommCreate(comm, &reqs, &dev_comm)));

  // pnccl names: forwarded as their nccl twin is (version: in the client; rank: by the proxy, which
  // knows the communicator), refused as it is (NCCL-allocated memory).
  int version = 0, rank = -1;
  std::printf("pnccl_get_version=%d\n", static_cast<int>(pncclGetVersion(&version)));
  std::printf("version=%d\n", version);
  std::printf("pnccl_user_rank=%d\n", static_cast<int>(pncclCommUserRank(comm, &rank)));
  std::printf("rank=%d\n", rank);
  void* mem = nullptr;
  std::printf("pnccl_mem_alloc=%d\n", static_cast<int>(pncclMemAlloc(&mem, 1024)));
  std::printf("pnccl_mem_allocated=%d\n", mem != nullptr);
  if (mem != nullptr) std::printf("pnccl_mem_free=%d\n", static_cast<int>(pncclMemFree(mem)));

  // What the generic rule (a non-const T* is one in/out value) would marshal wrong: refused in
  // proxy mode (ncclCommShrink's exclude list, ncclCommInitRankScalable's ids); ncclConfig_t and its
  // strings are forwarded field by field (NCCL_DEBUG=INFO: simcuda says which strings arrived).
  int exclude = 0;
  ncclComm_t shrunk = nullptr;
  std::printf("shrink=%d\n", static_cast<int>(ncclCommShrink(comm, &exclude, 1, &shrunk, nullptr, NCCL_SHRINK_DEFAULT)));
  ncclComm_t scalable = nullptr;
  std::printf("init_scalable=%d\n", static_cast<int>(ncclCommInitRankScalable(&scalable, 1, 0, 1, &id, nullptr)));
  ncclConfig_t comm_config = NCCL_CONFIG_INITIALIZER;
  comm_config.commName = "jitckpt-split";
  ncclComm_t with_config = nullptr;
  const ncclResult_t split_config = ncclCommSplit(comm, 0, 0, &with_config, &comm_config);
  std::printf("split_config=%d\n", static_cast<int>(split_config));
  if (split_config == ncclSuccess) ncclCommDestroy(with_config);
  ncclConfig_t init_config = NCCL_CONFIG_INITIALIZER;  // as ProcessGroupNCCL makes its communicators
  init_config.commName = "jitckpt-init";
  init_config.netName = "Socket";
  ncclUniqueId config_id;
  ncclComm_t configured = nullptr;
  const ncclResult_t init_with_config = ncclGetUniqueId(&config_id) == ncclSuccess
                                            ? ncclCommInitRankConfig(&configured, 1, config_id, 0, &init_config)
                                            : ncclInternalError;
  std::printf("init_config=%d\n", static_cast<int>(init_with_config));
  if (init_with_config == ncclSuccess) std::printf("init_config_destroy=%d\n", static_cast<int>(ncclCommDestroy(configured)));
  ncclComm_t plain = nullptr;
  const ncclResult_t split = ncclCommSplit(comm, 0, 0, &plain, nullptr);
  std::printf("split=%d\n", static_cast<int>(split));
  if (split == ncclSuccess) std::printf("split_destroy=%d\n", static_cast<int>(ncclCommDestroy(plain)));

  // Deprecated: declared __CUDA_DEPRECATED, which the inventory leaves out, so a trampoline. Twice:
  // the first call resolves its slot, the second goes through the resolved slot.
  using GetConfig = int (*)(int*);
  auto get_config = reinterpret_cast<GetConfig>(dlsym(RTLD_DEFAULT, "cudaDeviceGetSharedMemConfig"));
  std::printf("shared_mem_config_found=%d\n", get_config != nullptr);
  if (get_config == nullptr) return 1;
  int config = -1;
  for (int i = 0; i < 2; ++i) std::printf("shared_mem_config_%d=%d\n", i, get_config(&config));

  std::printf("destroy=%d\n", static_cast<int>(ncclCommDestroy(comm)));
  std::printf("done=1\n");
  return 0;
}
