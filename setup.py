"""Build script for te_ep_torch.

The extension is compiled against the torch that is already installed, so
install with ``pip install --no-build-isolation .``: an isolated build env
would pull a second (possibly different) torch and produce a binary that
does not load.
"""

import glob
import os
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


def _sources(with_cuda: bool):
    patterns = ["csrc/common/*.cpp", "csrc/torch/*.cpp"]
    if with_cuda:
        patterns += ["csrc/common/*.cu", "csrc/torch/*.cu"]
    out = []
    for p in patterns:
        out += sorted(glob.glob(os.path.join(ROOT, p)))
    return [os.path.relpath(s, ROOT) for s in out]


def _extension():
    with_cuda = _want_cuda()
    debug = os.environ.get("TE_EP_DEBUG") == "1"
    cxx = ["-O0" if debug else "-O3", "-std=c++17"]
    define_macros = [("TE_EP_WITH_CUDA", "1" if with_cuda else "0")]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if with_cuda:
        arch = os.environ.get("TE_EP_CUDA_ARCH", "90")
        nvcc = [
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-lineinfo",
        ] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch.split(";")]
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


setup(
    version=_read_version(),
    packages=find_packages(include=["te_ep_torch", "te_ep_torch.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
