"""tests/_launches.py: the GPU parameters (world sizes, launches, ids, marks, and the skip with
its reason where this machine cannot run one), and NCCL EP's kernel cache carried in a .tar.gz
(``--kernel-cache``)."""

import os
import shutil
import tarfile

import pytest

import _launches
from _dist import Launch


class _Config:
    def __init__(self, world_size: str):
        self.world_size = world_size

    def getoption(self, name):
        return getattr(self, name)


def test_world_sizes():
    assert _launches.gpu_world_sizes(_Config("2,4")) == [2, 4]
    assert _launches.gpu_world_sizes(_Config("4 1,2 2")) == [1, 2, 4]
    for bad in ("", "two", "0,2"):
        with pytest.raises(pytest.UsageError, match="--world-size takes world sizes"):
            _launches.gpu_world_sizes(_Config(bad))


def test_gpu_launches_every_backend_mode_and_check_mode_world_size_outermost():
    ids = [launch.id for launch in _launches.gpu_launches(_Config("2,4"))]
    per_size = ["reference"] + [f"nccl_ep-{mode}-checks_{checks}" for mode in ("staged", "zero_copy")
                                for checks in ("local", "device", "synchronous")]
    assert ids == [f"cuda-W{w}-{rest}" for w in (2, 4) for rest in per_size]
    assert [launch.id for launch in _launches.gpu_launches(_Config("1"), ["nccl_ep"], ["local"])] == [
        "cuda-W1-nccl_ep-staged-checks_local", "cuda-W1-nccl_ep-zero_copy-checks_local"]


def test_a_gpu_parameter_carries_its_marks_and_skips_with_the_reason_where_it_cannot_run():
    launch = Launch(2, "cuda", "nccl_ep", "zero_copy", "device")
    p = _launches.param(launch, "body", name="routing_exact", quick=True)
    assert p.id == "cuda-W2-nccl_ep-zero_copy-checks_device-routing_exact" and p.values == ("body", launch)
    assert {"gpu", "nccl_ep", "quick"} <= {m.name for m in p.marks}
    why = launch.unavailable()  # on a machine without GPUs: "needs 2 CUDA GPUs, found 0"
    assert [m.kwargs["reason"] for m in p.marks if m.name == "skip"] == ([why] if why else [])
    cpu = _launches.param(Launch(2), "body", name="routing_exact")
    assert cpu.id == "cpu-W2-routing_exact" and not cpu.marks


def test_kernel_cache_round_trip(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_text("a")
    (src / "sub" / "b.bin").write_text("b")
    cache = tmp_path / "kernels.tgz"
    with tarfile.open(cache, "w:gz") as tar:
        tar.add(src / "a.bin", "a.bin")
        tar.add(src / "sub", "sub")
    jit = tmp_path / "jit"
    monkeypatch.setenv("NCCL_EP_JIT_CACHE_DIR", str(jit))
    assert _launches.unpack_kernel_cache(str(cache)) == str(jit)
    assert (jit / "a.bin").read_text() == "a" and (jit / "sub" / "b.bin").read_text() == "b"
    assert sorted(os.listdir(jit)) == ["a.bin", "sub"], "the unpacking left something behind"
    (jit / "c.bin").write_text("c")  # a kernel the run compiled
    _launches.save_kernel_cache(str(cache), str(jit))
    with tarfile.open(cache) as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == ["a.bin", "c.bin", "sub/b.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit", "kernels.tgz", "src"]


def test_kernel_cache_not_there_yet_goes_to_a_new_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_EP_JIT_CACHE_DIR", "")
    cache_dir = _launches.unpack_kernel_cache(str(tmp_path / "new.tgz"))
    try:
        assert os.environ["NCCL_EP_JIT_CACHE_DIR"] == cache_dir and os.listdir(cache_dir) == []
    finally:
        shutil.rmtree(cache_dir)


def test_a_file_that_is_no_kernel_cache_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "bad.tgz"
    bad.write_text("not a tarball")
    monkeypatch.setenv("NCCL_EP_JIT_CACHE_DIR", str(tmp_path / "jit"))
    with pytest.raises(pytest.UsageError, match="--kernel-cache must name a .tar.gz"):
        _launches.unpack_kernel_cache(str(bad))
