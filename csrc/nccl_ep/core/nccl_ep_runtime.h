// Run-time loading of NCCL and NCCL EP.
//
// Neither library is a link dependency of te_ep_torch: the package must build
// and its reference backend must run on machines without nccl-extensions. Both
// are opened with dlopen the first time the nccl_ep backend is asked for, and
// every entry point we call goes through the symbol table below.
//
// Framework-free: no torch headers here. Errors are std::runtime_error with a
// message that says what to install or set.
#pragma once

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <nccl.h>
#include <nccl_ep.h>

#include <string>

namespace te_ep {
namespace nccl_ep {

// Oldest NCCL runtime the shipped libnccl_ep accepts. nccl-extensions 0.1.0
// pins nvidia-nccl-cu13==2.30.7: its HT kernels are JIT-compiled against the
// NCCL device API of that release, which older runtimes do not provide.
constexpr int kMinNcclVersionCode = 23007;

struct Api {
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  // The device check mode's agreement (checks='device').
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  // Symmetric windows of the zero-copy mode (NCCL >= 2.27).
  decltype(&::ncclMemAlloc) MemAlloc = nullptr;
  decltype(&::ncclMemFree) MemFree = nullptr;
  decltype(&::ncclCommWindowRegister) CommWindowRegister = nullptr;
  decltype(&::ncclCommWindowDeregister) CommWindowDeregister = nullptr;

  decltype(&::ncclEpGetVersion) EpGetVersion = nullptr;
  decltype(&::ncclEpCreateGroup) EpCreateGroup = nullptr;
  decltype(&::ncclEpGroupDestroy) EpGroupDestroy = nullptr;
  decltype(&::ncclEpHandleMemSize) EpHandleMemSize = nullptr;
  decltype(&::ncclEpInitHandle) EpInitHandle = nullptr;
  decltype(&::ncclEpUpdateHandle) EpUpdateHandle = nullptr;
  decltype(&::ncclEpHandleDestroy) EpHandleDestroy = nullptr;
  decltype(&::ncclEpDispatch) EpDispatch = nullptr;
  decltype(&::ncclEpCombine) EpCombine = nullptr;
};

struct RuntimeInfo {
  std::string nccl_ep_path;  // the libnccl_ep.so that was opened
  std::string nccl_path;     // the libnccl.so.2 it is bound to (may be torch's)
  std::string nccl_home;     // headers the NCCL EP JIT compiles against
  int nccl_version = 0;      // NCCL_VERSION_CODE of the loaded runtime
  int nccl_ep_version = 0;   // NCCL_EP_VERSION_CODE of the loaded libnccl_ep
};

// Opens both libraries (once per process; later calls return the first
// result and ignore their arguments) and checks that they fit together:
// NCCL runtime >= kMinNcclVersionCode, libnccl_ep API compatible with the
// header te_ep_torch was compiled against, a CUDA 13 driver, and JIT headers
// that match the NCCL runtime. `nccl_ep_lib` is the absolute path of
// libnccl_ep.so; `nccl_lib` the libnccl.so.2 to open if no NCCL is loaded yet
// (may be empty). Thread-safe.
const RuntimeInfo& load(const std::string& nccl_ep_lib, const std::string& nccl_lib);

// The symbol table; throws if load() has not succeeded.
const Api& api();
bool is_loaded();
const RuntimeInfo& info();

// "2.30.7" from 23007, "0.2.0" from 200: NCCL and NCCL EP share the encoding
// MAJOR*10000 + MINOR*100 + PATCH.
std::string format_version(int code);

// Set once the process is shutting down. From then on, destructors release
// host memory only: NCCL, NCCL EP and the CUDA driver may already be torn
// down, and calling into them from an exit handler can crash or hang.
void mark_process_exiting();
bool process_exiting();

// Throws std::runtime_error("<what>: <ncclGetErrorString>") on failure.
void check_nccl(ncclResult_t result, const char* what);

}  // namespace nccl_ep
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
