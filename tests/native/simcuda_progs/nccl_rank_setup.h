// Shared by the NCCL rank programs: error checks that print and exit, and the unique-id exchange
// (rank 0 creates the id and prints "uid=<hex>"; the test passes that hex to the other ranks as
// argv[4]).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <chrono>
#include <fstream>

#define CUDACHECK(call)                                                      \
  do {                                                                       \
    cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("FAIL %s: %s\n", #call, cudaGetErrorName(e_));             \
      std::fflush(stdout);                                                   \
      std::exit(2);                                                          \
    }                                                                        \
  } while (0)
#define NCCLCHECK(call)                                                      \
  do {                                                                       \
    ncclResult_t r_ = (call);                                                \
    if (r_ != ncclSuccess) {                                                 \
      std::printf("FAIL %s: %s\n", #call, ncclGetErrorString(r_));           \
      std::fflush(stdout);                                                   \
      std::exit(3);                                                          \
    }                                                                        \
  } while (0)

// Rank 0: a new id, printed. Others: the id from argv[4]. False (with a message) if it is missing.
inline bool exchange_unique_id(int rank, int argc, char** argv, ncclUniqueId* id) {
  if (rank == 0) {
    NCCLCHECK(ncclGetUniqueId(id));
    std::printf("uid=");
    for (unsigned char c : id->internal) std::printf("%02x", c);
    std::printf("\n");
    std::fflush(stdout);
    return true;
  }
  if (argc < 5 || std::strlen(argv[4]) != 2 * sizeof(id->internal)) {
    std::fprintf(stderr, "rank %d needs rank 0's uid hex\n", rank);
    return false;
  }
  for (size_t i = 0; i < sizeof(id->internal); ++i)
    id->internal[i] = static_cast<char>(std::stoi(std::string(argv[4] + 2 * i, 2), nullptr, 16));
  return true;
}

// Under a launcher (jitckpt run --no-python): every rank gets the same argv, so the id goes through
// a file: rank 0 writes it (then renames it into place), the others wait for it (30 s at most).
inline bool exchange_unique_id_file(int rank, const std::string& path, ncclUniqueId* id) {
  if (rank == 0) {
    NCCLCHECK(ncclGetUniqueId(id));
    std::ofstream(path + ".tmp", std::ios::binary).write(id->internal, sizeof(id->internal));
    return std::rename((path + ".tmp").c_str(), path.c_str()) == 0;
  }
  for (int i = 0; i < 3000; ++i) {
    std::ifstream in(path, std::ios::binary);
    if (in.read(id->internal, sizeof(id->internal))) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::fprintf(stderr, "rank %d: no unique id in %s after 30 s\n", rank, path.c_str());
  return false;
}
