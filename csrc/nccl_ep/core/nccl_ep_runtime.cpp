#include "nccl_ep/core/nccl_ep_runtime.h"

#if TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>

namespace te_ep {
namespace nccl_ep {

namespace {

constexpr const char* kInstallHint =
    "Install NCCL EP as the README's Install section says (`pip install 'nccl-extensions[cu13]'` with torch >= 2.14; "
    "python3 -m te_ep_torch prints the command for the torch installed).";

std::mutex g_mutex;
Api g_api;
// Leaked on purpose: it is read by destructors that may run during exit.
RuntimeInfo* g_info = nullptr;
std::atomic<bool> g_loaded{false};
std::atomic<bool> g_exiting{false};

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error("te_ep nccl_ep backend: " + message);
}

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string parent_dir(const std::string& path) {
  const auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string real_path(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return path;
  std::string out(resolved);
  std::free(resolved);
  return out;
}

std::string last_dl_error() {
  const char* err = ::dlerror();
  return err == nullptr ? std::string("unknown dlopen error") : std::string(err);
}

template <typename Fn>
void resolve(void* lib, const char* name, Fn* slot, const std::string& lib_path) {
  ::dlerror();
  void* sym = ::dlsym(lib, name);
  if (sym == nullptr) {
    fail(std::string("symbol ") + name + " not found in " + lib_path + " or its dependencies (" +
         last_dl_error() + "). The library is older or newer than te_ep_torch supports. " + kInstallHint);
  }
  *slot = reinterpret_cast<Fn>(sym);
}

// The NCCL_VERSION_CODE a header declares, or 0 if it declares none.
int header_version_code(const std::string& nccl_h) {
  std::ifstream in(nccl_h);
  std::string line;
  const std::string key = "#define NCCL_VERSION_CODE";
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) == 0) {
      return std::atoi(line.c_str() + key.size());
    }
  }
  return 0;
}

void check_driver() {
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    fail("no CUDA driver is available; the nccl_ep backend needs an NVIDIA GPU and driver.");
  }
  // The cu13 build of libnccl_ep links the CUDA 13 runtime statically.
  if (driver < 13000) {
    std::ostringstream msg;
    msg << "libnccl_ep (CUDA 13 build) needs an NVIDIA driver for CUDA 13 (R580 or newer); this driver "
        << "supports CUDA " << driver / 1000 << "." << (driver % 1000) / 10 << ".";
    fail(msg.str());
  }
}

// Opens the NCCL that libnccl_ep will bind to. Both libraries share the soname
// libnccl.so.2, and the dynamic linker resolves libnccl_ep's dependency to
// whichever object with that soname is loaded first. `import torch` already
// loaded one (from nvidia/nccl/lib next to torch), so that one is what NCCL EP
// uses: opening a second copy by path would leave two NCCLs in the process.
// We therefore only open `nccl_lib` when no NCCL is loaded yet.
void open_nccl(const std::string& nccl_lib) {
  if (::dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD) != nullptr) return;
  const std::string target = nccl_lib.empty() ? std::string("libnccl.so.2") : nccl_lib;
  if (::dlopen(target.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    fail("could not open NCCL (" + target + "): " + last_dl_error() + ". " + kInstallHint);
  }
}

std::string nccl_home_for_jit(const std::string& loaded_nccl, int runtime_version) {
  std::string home = env_or_empty("NCCL_HOME");
  const bool from_env = !home.empty();
  if (!from_env) home = parent_dir(parent_dir(loaded_nccl));
  const std::string header = home + "/include/nccl.h";
  if (!exists(header)) {
    fail("NCCL EP compiles its kernels at run time and needs the NCCL headers of the runtime it uses (" +
         loaded_nccl + "), but " + header +
         " does not exist. Set NCCL_HOME to the NCCL installation that provides that library "
         "(the nvidia-nccl-cu13 wheel ships them in nvidia/nccl/include).");
  }
  const int header_version = header_version_code(header);
  if (header_version != runtime_version) {
    fail("NCCL EP JIT-compiles against " + header + " (NCCL " + format_version(header_version) +
         ") but the NCCL runtime in this process is " + format_version(runtime_version) + " (" +
         loaded_nccl + "); headers and runtime must come from the same NCCL. " +
         (from_env ? "Point NCCL_HOME at the installation of the loaded library."
                   : "Reinstall nvidia-nccl-cu13 so that its headers and library match."));
  }
  return home;
}

void set_jit_environment(const std::string& ep_path, const std::string& nccl_home, int nccl_version) {
  ::setenv("NCCL_HOME", nccl_home.c_str(), 0);

  if (env_or_empty("NCCL_EP_JIT_SOURCE_DIR").empty() && env_or_empty("NCCL_EP_HOME").empty()) {
    // The wheel keeps the kernel sources in nccl/ep/include/nccl_ep and the
    // library in nccl/ep/lib/cu13; a source build keeps them in build/include
    // and build/lib. Walk up from the library until the sources appear.
    std::string dir = parent_dir(ep_path);
    std::string found;
    for (int level = 0; level < 3 && found.empty(); ++level) {
      dir = parent_dir(dir);
      if (exists(dir + "/include/nccl_ep/device")) found = dir;
    }
    if (found.empty()) {
      fail("the NCCL EP kernel sources (include/nccl_ep/device) were not found near " + ep_path +
           "; NCCL EP compiles them at run time. Set NCCL_EP_HOME to the directory that contains "
           "include/nccl_ep (nccl/ep inside the nccl-extensions package).");
    }
    ::setenv("NCCL_EP_HOME", found.c_str(), 0);
  }

  if (env_or_empty("NCCL_EP_JIT_CUDA_INCLUDE_DIR").empty() && env_or_empty("CUDA_HOME").empty() &&
      env_or_empty("CUDA_PATH").empty()) {
    // Without one of these, libnccl_ep falls back to the CUDA path of the
    // machine it was built on, which does not exist here.
    fail("NCCL EP compiles its kernels with nvcc on first use and needs the CUDA toolkit: set CUDA_HOME "
         "(te_ep_torch._nccl_ep.load() sets it from the nvcc on PATH when it can).");
  }

  // libnccl_ep built against NCCL 2.30.x needs NCCL's device-API JIT when it
  // runs on a newer NCCL (nccl-extensions README, "compatibility with newer
  // NCCL runtimes"). A user setting wins.
  if (nccl_version / 100 > 230) ::setenv("NCCL_DEV_API_JIT", "1", 0);
}

void check_ep_version(int runtime) {
  const int built = NCCL_EP_VERSION_CODE;
  const int built_major = built / 10000, built_minor = (built / 100) % 100;
  const int run_major = runtime / 10000, run_minor = (runtime / 100) % 100;
  // Every public struct is passed by size; before 1.0 a minor release may
  // change their layout, so 0.x must match to the minor version.
  const bool compatible = run_major == built_major && (built_major == 0 ? run_minor == built_minor
                                                                         : run_minor >= built_minor);
  if (!compatible) {
    fail("te_ep_torch was compiled against NCCL EP " + format_version(built) +
         " headers but the loaded libnccl_ep is " + format_version(runtime) +
         ". Rebuild te_ep_torch against the installed nccl-extensions "
         "(pip install --no-build-isolation --force-reinstall --no-deps te_ep_torch), or install the "
         "nccl-extensions release it was built with.");
  }
}

void on_exit() { g_exiting.store(true); }

}  // namespace

std::string format_version(int code) {
  std::ostringstream out;
  out << code / 10000 << "." << (code / 100) % 100 << "." << code % 100;
  return out.str();
}

const RuntimeInfo& load(const std::string& nccl_ep_lib, const std::string& nccl_lib) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_loaded.load()) return *g_info;

  if (nccl_ep_lib.empty() || nccl_ep_lib[0] != '/') {
    fail("the path of libnccl_ep.so must be absolute, got '" + nccl_ep_lib + "'.");
  }
  check_driver();

  open_nccl(nccl_lib);
  void* ep = ::dlopen(nccl_ep_lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (ep == nullptr) {
    fail("could not open " + nccl_ep_lib + ": " + last_dl_error() + ". " + kInstallHint);
  }

  // NCCL entry points are looked up through libnccl_ep's handle, so they come
  // from exactly the NCCL that libnccl_ep is bound to.
  Api api;
  resolve(ep, "ncclGetVersion", &api.GetVersion, nccl_ep_lib);
  resolve(ep, "ncclGetErrorString", &api.GetErrorString, nccl_ep_lib);
  resolve(ep, "ncclGetUniqueId", &api.GetUniqueId, nccl_ep_lib);
  resolve(ep, "ncclCommInitRank", &api.CommInitRank, nccl_ep_lib);
  resolve(ep, "ncclCommDestroy", &api.CommDestroy, nccl_ep_lib);
  resolve(ep, "ncclAllReduce", &api.AllReduce, nccl_ep_lib);
  resolve(ep, "ncclMemAlloc", &api.MemAlloc, nccl_ep_lib);
  resolve(ep, "ncclMemFree", &api.MemFree, nccl_ep_lib);
  resolve(ep, "ncclCommWindowRegister", &api.CommWindowRegister, nccl_ep_lib);
  resolve(ep, "ncclCommWindowDeregister", &api.CommWindowDeregister, nccl_ep_lib);
  resolve(ep, "ncclEpGetVersion", &api.EpGetVersion, nccl_ep_lib);
  resolve(ep, "ncclEpCreateGroup", &api.EpCreateGroup, nccl_ep_lib);
  resolve(ep, "ncclEpGroupDestroy", &api.EpGroupDestroy, nccl_ep_lib);
  resolve(ep, "ncclEpHandleMemSize", &api.EpHandleMemSize, nccl_ep_lib);
  resolve(ep, "ncclEpInitHandle", &api.EpInitHandle, nccl_ep_lib);
  resolve(ep, "ncclEpUpdateHandle", &api.EpUpdateHandle, nccl_ep_lib);
  resolve(ep, "ncclEpHandleDestroy", &api.EpHandleDestroy, nccl_ep_lib);
  resolve(ep, "ncclEpDispatch", &api.EpDispatch, nccl_ep_lib);
  resolve(ep, "ncclEpCombine", &api.EpCombine, nccl_ep_lib);

  auto info = new RuntimeInfo();
  info->nccl_ep_path = real_path(nccl_ep_lib);
  Dl_info where{};
  info->nccl_path = ::dladdr(reinterpret_cast<void*>(api.GetVersion), &where) != 0 && where.dli_fname != nullptr
                        ? real_path(where.dli_fname)
                        : std::string("libnccl.so.2");

  if (api.GetVersion(&info->nccl_version) != ncclSuccess) fail("ncclGetVersion failed.");
  if (info->nccl_version < kMinNcclVersionCode) {
    std::string msg = "NCCL EP needs NCCL >= " + format_version(kMinNcclVersionCode) +
                      ", but this process runs NCCL " + format_version(info->nccl_version) + " from " +
                      info->nccl_path +
                      ". torch loads libnccl.so.2 when it is imported (from nvidia/nccl/lib next to torch), "
                      "so the newer NCCL must replace that one: pip install -U 'nvidia-nccl-cu13>=2.30.7' "
                      "into the environment of torch";
    if (!nccl_lib.empty() && real_path(nccl_lib) != info->nccl_path) {
      msg += ", or preload the newer library before torch starts: LD_PRELOAD=" + nccl_lib;
    }
    fail(msg + ".");
  }

  int ep_version = 0;
  if (api.EpGetVersion(&ep_version) != ncclSuccess) fail("ncclEpGetVersion failed.");
  info->nccl_ep_version = ep_version;
  check_ep_version(ep_version);

  info->nccl_home = nccl_home_for_jit(info->nccl_path, info->nccl_version);
  set_jit_environment(info->nccl_ep_path, info->nccl_home, info->nccl_version);

  g_api = api;
  g_info = info;
  std::atexit(on_exit);
  g_loaded.store(true);
  return *g_info;
}

bool is_loaded() { return g_loaded.load(); }

const Api& api() {
  if (!g_loaded.load()) {
    fail("NCCL EP is not loaded; call te_ep_torch._nccl_ep.load() first (te_ep_torch.EpGroup does this for "
         "backend='nccl_ep').");
  }
  return g_api;
}

const RuntimeInfo& info() {
  api();
  return *g_info;
}

void mark_process_exiting() { g_exiting.store(true); }

bool process_exiting() { return g_exiting.load(); }

void check_nccl(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  std::string reason = g_loaded.load() ? std::string(g_api.GetErrorString(result)) : std::string("error");
  throw std::runtime_error(std::string("te_ep nccl_ep backend: ") + what + " failed: " + reason + " (ncclResult_t " +
                           std::to_string(static_cast<int>(result)) + ")");
}

}  // namespace nccl_ep
}  // namespace te_ep

#endif  // TE_EP_WITH_CUDA && TE_EP_WITH_NCCL_EP
