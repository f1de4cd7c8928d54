"""Tests for jacobkit.memory: budgets, free memory, peak measurement."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from jacobkit import memory, runtime
from jacobkit.memory import (
    DEFAULT_BUDGET_FRACTION,
    PeakMemory,
    budget,
    format_bytes,
    free_bytes,
    measure_peak,
    normalize_device,
    parse_budget,
    peak,
)
from jacobkit.memory.free import (
    MemorySources,
    cgroup_free,
    meminfo_available,
    nvidia_smi_total_bytes,
    parse_nvidia_smi,
)

# CPU allocation statistics must be switched on before TensorFlow's runtime
# starts; do it at collection time, before any test creates a tensor.
memory.enable_cpu_memory_stats()

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
EXAMPLES = (
    "Valid examples: 2147483648 (bytes), '2GiB', '512 MB', '1.5G', '100k', "
    "0.5 (fraction of free memory), '50%', None (default fraction)"
)
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


def exact(message: str) -> str:
    """A ``match=`` pattern that accepts exactly ``message``."""
    return "^" + re.escape(message) + "$"


@pytest.fixture
def cpu_stats() -> None:
    if not memory.enable_cpu_memory_stats():
        pytest.skip(
            "TensorFlow started without TF_CPU_ALLOCATOR_USE_BFC=true before "
            "this module was collected; CPU memory statistics are unavailable"
        )


# ---------------------------------------------------------------- parse_budget


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (1, 1),
        (4096, 4096),
        (np.int64(5 * GiB), 5 * GiB),
        ("4096", 4096),
        ("2GiB", 2 * GiB),
        ("2gib", 2 * GiB),
        ("512MB", 512 * 1000**2),
        ("512 MiB", 512 * MiB),
        ("  512  mib  ", 512 * MiB),
        ("1.5G", 1536 * MiB),
        ("1.5g", 1536 * MiB),
        ("100k", 100 * KiB),
        ("100K", 100 * KiB),
        ("100 KiB", 100 * KiB),
        ("100kb", 100_000),
        ("2 GB", 2_000_000_000),
        ("1TB", 1000**4),
        ("1 TiB", TiB),
        ("3T", 3 * TiB),
        ("7M", 7 * MiB),
        ("7 Mi", 7 * MiB),
        ("4.35MB", 4_350_000),
        (".5 KiB", 512),
        ("1e3", 1000),
        ("10 B", 10),
        ("10 bytes", 10),
        ("1.7", 1),
    ],
)
def test_parse_budget_sizes(budget, expected):
    assert parse_budget(budget, free=0) == expected


@pytest.mark.parametrize(
    ("budget", "free", "expected"),
    [
        (0.5, 1000, 500),
        (1.0, 1000, 1000),
        (0.29, 100, 29),
        (0.7, 1000, 700),
        (0.25, 3, 0),
        (np.float32(0.5), 1000, 500),
        ("50%", 1000, 500),
        ("12.5 %", 800, 100),
        ("100%", 1234, 1234),
    ],
)
def test_parse_budget_fraction_uses_free_exactly(budget, free, expected):
    assert parse_budget(budget, free=free) == expected


def test_parse_budget_none_uses_default_fraction():
    assert DEFAULT_BUDGET_FRACTION == 0.8
    assert parse_budget(None, free=1000) == 800
    assert parse_budget(None, free=10 * GiB) == int(0.8 * 10 * GiB)


def test_parse_budget_fraction_of_device_free_memory(monkeypatch):
    seen = []

    def fake_free(device):
        seen.append(device)
        return 2000

    monkeypatch.setattr(budget, "free_bytes", fake_free)
    assert parse_budget(0.25, device="CPU:0") == 500
    assert parse_budget(None, device="/device:CPU:0") == 1600
    assert seen == ["CPU:0", "/device:CPU:0"]


def test_parse_budget_fraction_of_real_cpu_memory():
    free = free_bytes("CPU:0")
    budget = parse_budget(0.5)
    assert 0 < budget <= free


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (0, "memory_budget must be a positive number of bytes; got 0. "),
        (-5, "memory_budget must be a positive number of bytes; got -5. "),
        (
            1.5,
            "memory_budget as a float is a fraction of free memory and must be "
            "in (0, 1] (for an absolute size pass an int or a string such as "
            "'1.5GiB'); got 1.5. ",
        ),
        (
            0.0,
            "memory_budget as a float is a fraction of free memory and must be "
            "in (0, 1] (for an absolute size pass an int or a string such as "
            "'1.5GiB'); got 0.0. ",
        ),
        (
            -0.5,
            "memory_budget as a float is a fraction of free memory and must be "
            "in (0, 1] (for an absolute size pass an int or a string such as "
            "'1.5GiB'); got -0.5. ",
        ),
        (
            float("nan"),
            "memory_budget as a float is a fraction of free memory and must be "
            "in (0, 1] (for an absolute size pass an int or a string such as "
            "'1.5GiB'); got nan. ",
        ),
        (
            "lots",
            "memory_budget is not a size such as '2GiB' or '512 MB'; got 'lots'. ",
        ),
        ("", "memory_budget is not a size such as '2GiB' or '512 MB'; got ''. "),
        (
            "1.2.3GB",
            "memory_budget is not a size such as '2GiB' or '512 MB'; got '1.2.3GB'. ",
        ),
        (
            "GiB",
            "memory_budget is not a size such as '2GiB' or '512 MB'; got 'GiB'. ",
        ),
        (
            "5 XB",
            "memory_budget has unknown unit 'XB' (known: B, K, M, G, T, KiB, MiB, "
            "GiB, TiB, KB, MB, GB, TB); got '5 XB'. ",
        ),
        (
            "2 PiB",
            "memory_budget has unknown unit 'PiB' (known: B, K, M, G, T, KiB, MiB, "
            "GiB, TiB, KB, MB, GB, TB); got '2 PiB'. ",
        ),
        ("0GB", "memory_budget must be a positive size; got '0GB'. "),
        ("-1GiB", "memory_budget must be a positive size; got '-1GiB'. "),
        ("0.1", "memory_budget must be at least 1 byte; got '0.1'. "),
        ("0%", "memory_budget as a percentage must be in (0%, 100%]; got '0%'. "),
        (
            "150%",
            "memory_budget as a percentage must be in (0%, 100%]; got '150%'. ",
        ),
        (
            True,
            "memory_budget must be a size or a fraction, not a bool; got True. ",
        ),
        (
            False,
            "memory_budget must be a size or a fraction, not a bool; got False. ",
        ),
    ],
)
def test_parse_budget_invalid_values(budget, message):
    with pytest.raises(ValueError, match=exact(message + EXAMPLES)):
        parse_budget(budget, free=1000)


@pytest.mark.parametrize(
    ("budget", "shown"),
    [([1], "list: [1]"), (b"1GB", "bytes: b'1GB'"), (1j, "complex: 1j")],
)
def test_parse_budget_wrong_type(budget, shown):
    message = (
        "memory_budget must be an int (bytes), a float (fraction of free "
        "memory), a str (size with unit) or None; got " + shown
    )
    with pytest.raises(TypeError, match=exact(message)):
        parse_budget(budget, free=1000)


def test_parse_budget_rejects_negative_free():
    with pytest.raises(
        ValueError, match=exact("free must be a non-negative number of bytes; got -1")
    ):
        parse_budget(0.5, free=-1)


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("CPU:0", "CPU:0"),
        ("cpu:0", "CPU:0"),
        ("/CPU:0", "CPU:0"),
        ("/cpu:0", "CPU:0"),
        ("/device:CPU:0", "CPU:0"),
        ("/job:localhost/replica:0/task:0/device:CPU:0", "CPU:0"),
        ("CPU", "CPU:0"),
        ("GPU:0", "GPU:0"),
        ("/GPU:0", "GPU:0"),
        ("/device:GPU:1", "GPU:1"),
        ("gpu:3", "GPU:3"),
        (" GPU ", "GPU:0"),
    ],
)
def test_normalize_device(device, expected):
    assert normalize_device(device) == expected


def test_normalize_device_none_follows_visible_gpus():
    assert normalize_device(None) == ("GPU:0" if HAS_GPU else "CPU:0")


def test_normalize_device_of_a_tensor():
    with tf.device("CPU:0"):
        t = tf.constant(1.0)
    assert normalize_device(t.device) == "CPU:0"


@pytest.mark.parametrize("device", ["TPU:0", "CPU:x", "GPU0", "", "/device:", "cuda"])
def test_unknown_device_raises(device):
    message = (
        f"device {device!r} is not a known device; accepted forms: 'CPU:0', "
        "'GPU:0', '/GPU:0', '/device:GPU:0', "
        "'/job:localhost/replica:0/task:0/device:GPU:0' (any index), or None"
    )
    with pytest.raises(ValueError, match=exact(message)):
        normalize_device(device)
    with pytest.raises(ValueError, match=exact(message)):
        free_bytes(device)


def test_device_of_wrong_type_raises():
    with pytest.raises(TypeError, match="device must be a string"):
        normalize_device(0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- free_bytes


def test_free_bytes_cpu_is_positive_and_at_most_physical_memory():
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = free_bytes("CPU:0")
    assert isinstance(free, int)
    assert 0 < free <= physical
    assert free_bytes("/device:CPU:0") > 0


def test_meminfo_parsing(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(
        "MemTotal:       32000000 kB\n"
        "MemFree:         1000000 kB\n"
        "MemAvailable:    2000000 kB\n"
    )
    assert meminfo_available(str(path)) == 2_000_000 * 1024
    path.write_text("MemTotal:       32000000 kB\n")
    assert meminfo_available(str(path)) is None
    assert meminfo_available(str(tmp_path / "missing")) is None


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_minus_usage(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory.max", "max\n")
    _write(root / "memory.current", "123\n")
    job = root / "slurm" / "job_1"
    _write(job / "memory.max", str(4 * GiB))
    _write(job / "memory.current", str(3 * GiB))
    _write(job / "memory.stat", f"anon 1\ninactive_file {512 * MiB}\nfile 9\n")
    step = job / "step_0"
    _write(step / "memory.max", "max")
    _write(step / "memory.current", str(GiB))
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/slurm/job_1/step_0\n")
    assert cgroup_free(str(root), str(proc)) == GiB + 512 * MiB


def test_cgroup_v2_inside_container(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory.max", str(2 * GiB))
    _write(root / "memory.current", str(GiB + 5))
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    assert cgroup_free(str(root), str(proc)) == GiB - 5


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    root = tmp_path / "cgroup"
    mem = root / "memory"
    _write(mem / "memory.limit_in_bytes", str(8 * GiB))
    _write(mem / "memory.usage_in_bytes", str(6 * GiB))
    _write(mem / "memory.stat", f"cache 5\ntotal_inactive_file {GiB}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n0::/\n")
    assert cgroup_free(str(root), str(proc)) == 3 * GiB

    _write(mem / "memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_free(str(root), str(proc)) is None


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_free(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_cpu_free_bytes_takes_min_with_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable:    {10 * GiB // KiB} kB\n")
    root = tmp_path / "cgroup"
    _write(root / "memory.max", str(4 * GiB))
    _write(root / "memory.current", str(GiB))
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    sources = MemorySources(
        meminfo=str(meminfo), cgroup_root=str(root), proc_cgroup=str(proc)
    )
    assert free_bytes("CPU:0", sources=sources) == 3 * GiB
    _write(root / "memory.max", "max")
    assert free_bytes("CPU:0", sources=sources) == 10 * GiB


@pytest.mark.skipif(HAS_GPU, reason="checks the error on a machine without GPU")
def test_free_bytes_gpu_without_gpu_raises():
    with pytest.raises(RuntimeError, match=r"^cannot report free memory of GPU:0"):
        free_bytes("GPU:0")


def test_nvidia_smi_parsing_and_device_mapping(monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="81559, 1200\n", stderr="")

    sources = MemorySources(which=lambda name: "/x/nvidia-smi", run=fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvidia_smi_total_bytes(1, sources=sources) == 81559 * MiB
    assert calls[-1][-2:] == ["-i", "3"]
    assert "--query-gpu=memory.total,memory.used" in calls[-1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    nvidia_smi_total_bytes(1, sources=sources)
    assert calls[-1][-2:] == ["-i", "1"]


def test_nvidia_smi_missing_or_failing():
    missing = MemorySources(which=lambda name: None)
    with pytest.raises(RuntimeError, match="`nvidia-smi` is not on PATH"):
        nvidia_smi_total_bytes(0, sources=missing)

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 9, stdout="", stderr="No devices")

    failing = MemorySources(which=lambda name: "/x/nvidia-smi", run=failing_run)
    with pytest.raises(RuntimeError, match="exited with 9: No devices"):
        nvidia_smi_total_bytes(0, sources=failing)
    with pytest.raises(RuntimeError, match="unexpected `nvidia-smi` output"):
        parse_nvidia_smi("[N/A], [N/A]\n", 0)


# ---------------------------------------------------------------- peak memory


def test_peak_memory_measures_a_64_mib_tensor(cpu_stats):
    with PeakMemory("CPU:0") as m:
        x = tf.ones((16, 1024, 1024), tf.float32)
    assert m.extra_bytes >= 64 * MiB
    assert m.peak_bytes == m.baseline_bytes + m.extra_bytes
    assert m.extra_bytes < 80 * MiB
    del x


def test_peak_memory_small_tensor_is_small(cpu_stats):
    with PeakMemory("/device:CPU:0") as m:
        x = tf.ones((256, 1024), tf.float32)  # 1 MiB
    assert MiB <= m.extra_bytes < 16 * MiB
    del x


def test_peak_memory_sees_freed_tensors_and_baseline(cpu_stats):
    keep = tf.ones((4, 1024, 1024))  # 16 MiB alive before the block
    with PeakMemory("CPU:0") as m:
        tmp = tf.ones((16, 1024, 1024))
        del tmp
    assert m.baseline_bytes >= 16 * MiB
    assert m.extra_bytes >= 64 * MiB
    del keep


def test_peak_memory_nested_blocks(cpu_stats):
    with PeakMemory("CPU:0") as outer:
        tmp = tf.ones((16, 1024, 1024))
        del tmp
        with PeakMemory("CPU:0") as inner:  # resets TF's peak statistic
            small = tf.ones((256, 1024))
    assert outer.extra_bytes >= 64 * MiB
    assert MiB <= inner.extra_bytes < 16 * MiB
    del small


def test_peak_memory_attributes_before_and_after(cpu_stats):
    m = PeakMemory("cpu")
    assert (m.device, m.peak_bytes, m.baseline_bytes, m.extra_bytes) == (
        "CPU:0",
        None,
        None,
        None,
    )
    with m, pytest.raises(RuntimeError, match="already active"):
        m.__enter__()  # entering an active block again
    assert m.extra_bytes is not None
    assert "PeakMemory('CPU:0', peak=" in repr(m)


def test_peak_memory_records_on_exception(cpu_stats):
    m = PeakMemory("CPU:0")
    with pytest.raises(KeyError), m:
        x = tf.ones((16, 1024, 1024))
        raise KeyError("boom")
    assert m.extra_bytes >= 64 * MiB
    del x


def test_measure_peak(cpu_stats):
    def make(n, *, dtype):
        return tf.ones((n, 1024, 1024), dtype)

    result, extra = measure_peak(make, 16, dtype=tf.float32, device="CPU:0")
    assert result.shape == (16, 1024, 1024)
    assert extra >= 64 * MiB


def test_peak_memory_without_stats_explains_the_fix(monkeypatch):
    def unavailable(device):
        raise ValueError(f"Cannot reset memory stats for device '{device}'")

    monkeypatch.setattr(peak, "enable_cpu_memory_stats", lambda: False)
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", unavailable)
    expected = "CPU memory statistics need TF_CPU_ALLOCATOR_USE_BFC=true"
    with pytest.raises(RuntimeError, match=expected), PeakMemory("CPU:0"):
        pass


def test_enable_cpu_memory_stats_sets_environment():
    # what enable_cpu_memory_stats() does to os.environ before TF starts
    environ: dict[str, str] = {}
    assert runtime.request_bfc_cpu_allocator(environ, physical_bytes=256 * GiB)
    assert environ["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
    assert environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == str(256 * 1024)

    environ = {"TF_CPU_ALLOCATOR_USE_BFC": "false"}
    assert runtime.request_bfc_cpu_allocator(environ) is False
    assert environ["TF_CPU_ALLOCATOR_USE_BFC"] == "false"

    small: dict[str, str] = {}  # under TF's 64 GiB default cap: left alone
    assert runtime.request_bfc_cpu_allocator(small, physical_bytes=32 * GiB)
    assert small == {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def test_bfc_environment_of_a_child():
    assert runtime.bfc_environment() == {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    assert runtime.bfc_environment(512) == {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "512",
    }


def test_enable_cpu_memory_stats_after_start_reports_availability(cpu_stats):
    tf.constant(1.0)  # the runtime is running now
    assert memory.enable_cpu_memory_stats() is True


# ---------------------------------------------------------------- format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (12, "12 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (512 * MiB, "512.0 MiB"),
        (1536 * MiB, "1.5 GiB"),
        (MiB - 1, "1.0 MiB"),
        (3 * TiB, "3.0 TiB"),
        (5 * 1024**5, "5.0 PiB"),
        (-2048, "-2.0 KiB"),
        (np.int64(2048), "2.0 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a visible GPU")
def test_gpu_free_bytes_and_peak():
    total = (
        free_bytes("GPU:0") + tf.config.experimental.get_memory_info("GPU:0")["current"]
    )
    for name in ("GPU:0", "/GPU:0", "/device:GPU:0"):
        free = free_bytes(name)
        assert 0 < free <= total
    assert parse_budget(None, device="GPU:0") <= free_bytes("GPU:0")
    assert normalize_device(None) == "GPU:0"

    with tf.device("GPU:0"):
        with PeakMemory("GPU:0") as big:
            x = tf.ones((16, 1024, 1024), tf.float32)
        with PeakMemory("/device:GPU:0") as small:
            y = tf.ones((256, 1024), tf.float32)
        before = free_bytes("GPU:0")
        z = tf.ones((64, 1024, 1024), tf.float32)  # 256 MiB
        after = free_bytes("GPU:0")
    assert big.extra_bytes >= 64 * MiB
    assert small.extra_bytes < 16 * MiB
    assert before - after >= 256 * MiB
    del x, y, z
