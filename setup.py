"""Build script for te_ep_torch.

The extension is compiled against the torch that is already installed, so
install with ``pip install --no-build-isolation .``: an isolated build env
would pull a second (possibly different) torch and produce a binary that
does not load. For the same reason the package requires exactly that torch
release (``torch==<its public version>``): pip then never swaps torch under a
built extension, and an extra whose pins need another torch fails to resolve
instead of upgrading it.

Build knobs (environment):
  TE_EP_FORCE_CUDA=0|1          skip / force compiling the CUDA sources
  TE_EP_CUDA_ARCH="90;100"      GPU architectures (SASS for each, PTX of the last one)
  TE_EP_NCCL_EP_INCLUDE=DIR     where nccl_ep.h is (default: the installed nccl-extensions)
  TE_EP_REQUIRE_NCCL_EP_BUILD=1 fail instead of building without the nccl_ep backend
  TE_EP_DEBUG=1                 -O0 host code
"""

import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
except ImportError as exc:  # pragma: no cover - exercised only on misconfigured installs
    sys.exit(
        "te_ep_torch compiles against the installed PyTorch, which could not be imported "
        f"({exc}). Install torch first, then build with `pip install --no-build-isolation .`"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
# Hopper (NCCL EP's HT kernels need it) and Blackwell; the PTX of the last one lets the
# driver compile the kernels for newer GPUs.
DEFAULT_CUDA_ARCHS = "90;100"


def _read_version() -> str:
    scope: dict = {}
    with open(os.path.join(ROOT, "te_ep_torch", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def _want_cuda() -> bool:
    forced = os.environ.get("TE_EP_FORCE_CUDA")
    if forced is not None:
        return forced == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None and shutil.which(
        os.path.join(CUDA_HOME, "bin", "nvcc")
    ) is not None


def _find_in_site_packages(relative: str):
    """First sys.path entry that holds `relative`, without importing anything."""
    for entry in sys.path:
        candidate = os.path.join(entry or ".", relative)
        if os.path.isfile(candidate):
            return candidate
    return None


def _nccl_ep_include_dirs():
    """Include dirs of nccl_ep.h and nccl.h, or None to build the nccl_ep stub.

    libnccl_ep and libnccl are opened at run time (dlopen), so only their
    headers are needed here; the nccl_ep backend is compiled when both exist.
    """
    ep_include = os.environ.get("TE_EP_NCCL_EP_INCLUDE")
    if not ep_include:
        header = _find_in_site_packages(os.path.join("nccl", "ep", "include", "nccl_ep.h"))
        ep_include = os.path.dirname(header) if header else None
    if not ep_include or not os.path.isfile(os.path.join(ep_include, "nccl_ep.h")):
        _without_nccl_ep("nccl_ep.h not found (install nccl-extensions or set TE_EP_NCCL_EP_INCLUDE)")
        return None
    nccl_header = _find_in_site_packages(os.path.join("nvidia", "nccl", "include", "nccl.h"))
    if nccl_header is None and CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "include", "nccl.h")):
        nccl_header = os.path.join(CUDA_HOME, "include", "nccl.h")
    if nccl_header is None:
        _without_nccl_ep("nccl.h not found (install nvidia-nccl-cu13)")
        return None
    return [ep_include, os.path.dirname(nccl_header)]


def _without_nccl_ep(reason: str) -> None:
    if os.environ.get("TE_EP_REQUIRE_NCCL_EP_BUILD") == "1":
        sys.exit(f"te_ep_torch: {reason}, and TE_EP_REQUIRE_NCCL_EP_BUILD=1 forbids building without the nccl_ep backend")
    print(f"te_ep_torch: {reason}; building without the nccl_ep backend")


def _cuda_archs():
    archs = [a.strip() for a in os.environ.get("TE_EP_CUDA_ARCH", DEFAULT_CUDA_ARCHS).split(";") if a.strip()]
    if not archs or not all(re.fullmatch(r"\d+[af]?", a) for a in archs):
        sys.exit(f"te_ep_torch: TE_EP_CUDA_ARCH must list compute capabilities like \"90;100\", got "
                 f"{os.environ.get('TE_EP_CUDA_ARCH')!r}")
    return archs


def _gencode(archs):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs[:-1]]
    last = archs[-1]
    return flags + [f"-gencode=arch=compute_{last},code=[sm_{last},compute_{last}]"]


def _header_version(path: str, pattern: str):
    try:
        with open(path) as f:
            m = re.search(pattern, f.read())
    except OSError:
        return None
    return int(m[1]) if m else None


# What `python -m te_ep_torch` reports about this build (te_ep_torch/_build_info.py, not in git).
BUILD_INFO = {
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_archs": [],
    "nccl_ep": False,
    "nccl_ep_header_version": None,
    "nccl_header_version": None,
}


def _sources(with_cuda: bool):
    """Every .cpp under csrc/, and every .cu with CUDA: library.cpp and the family folders (csrc/README.md)."""
    patterns = ["csrc/**/*.cpp"]
    if with_cuda:
        patterns += ["csrc/**/*.cu"]
    out = []
    for p in patterns:
        out += sorted(glob.glob(os.path.join(ROOT, p), recursive=True))
    return [os.path.relpath(s, ROOT) for s in out]


def _extension():
    with_cuda = _want_cuda()
    if not with_cuda and os.environ.get("TE_EP_REQUIRE_NCCL_EP_BUILD") == "1":
        sys.exit("te_ep_torch: TE_EP_REQUIRE_NCCL_EP_BUILD=1, but this is a CPU-only build (the nccl_ep backend "
                 "needs torch with CUDA and nvcc: put the CUDA toolkit's bin on PATH or set CUDA_HOME)")
    debug = os.environ.get("TE_EP_DEBUG") == "1"
    cxx = ["-O0" if debug else "-O3", "-std=c++20"]
    define_macros = [("TE_EP_WITH_CUDA", "1" if with_cuda else "0")]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if with_cuda:
        nccl_ep_includes = _nccl_ep_include_dirs()
        define_macros.append(("TE_EP_WITH_NCCL_EP", "1" if nccl_ep_includes else "0"))
        include_dirs += nccl_ep_includes or []
        archs = _cuda_archs()
        BUILD_INFO["cuda_archs"] = archs
        if nccl_ep_includes:
            BUILD_INFO["nccl_ep"] = True
            BUILD_INFO["nccl_ep_header_version"] = ".".join(
                str(_header_version(os.path.join(nccl_ep_includes[0], "nccl_ep.h"), rf"#define NCCL_EP_{part} (\d+)"))
                for part in ("MAJOR", "MINOR", "PATCH"))
            BUILD_INFO["nccl_header_version"] = _header_version(
                os.path.join(nccl_ep_includes[1], "nccl.h"), r"#define NCCL_VERSION_CODE (\d+)")
        nvcc = [
            "-O3",
            "-std=c++20",
            "--expt-relaxed-constexpr",
            "-lineinfo",
        ] + _gencode(archs)
        return CUDAExtension(
            name="te_ep_torch._C",
            sources=_sources(True),
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            libraries=["dl"],
            py_limited_api=True,
        )
    return CppExtension(
        name="te_ep_torch._C",
        sources=_sources(False),
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx},
        libraries=["dl"],
        py_limited_api=True,
    )


class BuildExt(BuildExtension.with_options(no_python_abi_suffix=True)):
    """Writes te_ep_torch/_build_info.py next to the compiled library."""

    def run(self):
        super().run()
        path = os.path.join(os.path.dirname(self.get_ext_fullpath("te_ep_torch._C")), "_build_info.py")
        with open(path, "w") as f:
            f.write('"""Written by setup.py when te_ep_torch._C was built (not in git)."""\n\n')
            f.write(f"BUILD_INFO = {BUILD_INFO!r}\n")


def _public_version(version: str) -> str:
    return version.split("+", 1)[0]


# setuptools runs this file as __main__; tests import it for its helpers.
if __name__ == "__main__":
    setup(
        version=_read_version(),
        packages=find_packages(include=["te_ep_torch", "te_ep_torch.*"]),
        ext_modules=[_extension()],
        # The extension is ABI-bound to the torch it is compiled against (see the docstring).
        install_requires=[f"torch=={_public_version(torch.__version__)}", "numpy"],
        cmdclass={"build_ext": BuildExt},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
