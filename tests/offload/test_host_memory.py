"""The pinned-host cap XLA's GPU client applies (64 GB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says more)."""
from surojax.offload import host_memory
from surojax.offload.host_memory import ENV, raise_host_memory_limit, total_ram_gb


def test_raised_to_90_percent_of_ram(monkeypatch):
    monkeypatch.setenv(ENV, "")  # unset for the function, restored afterwards
    assert raise_host_memory_limit(ram_gb=128) == 115
    assert host_memory.os.environ[ENV] == "115"


def test_user_setting_kept_and_default_never_lowered(monkeypatch):
    monkeypatch.setenv(ENV, "40")
    assert raise_host_memory_limit(ram_gb=1000) == 40
    monkeypatch.setenv(ENV, "")
    assert raise_host_memory_limit(ram_gb=16) == 64  # a small machine keeps XLA's default


def test_meminfo_parsed(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       131072000 kB\nMemFree:        1 kB\n")
    assert total_ram_gb(str(f)) == 134
    assert total_ram_gb(str(tmp_path / "missing")) is None
