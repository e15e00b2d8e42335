"""Huge pages for torch's large CPU tensors (`quantkit.platform.allocator`): asked for on import, reported honestly."""

import os
import subprocess
import sys

import pytest

from quantkit.platform import allocator

STATE = "from quantkit.platform import allocator; print(allocator.state())"


def _state(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != allocator.ENV}
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never"), ("", "unavailable")])
def test_the_kernels_thp_mode_is_read_from_sysfs(tmp_path, monkeypatch, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    monkeypatch.setattr(allocator, "KERNEL_MODE", f)
    assert allocator.kernel_mode() == mode
    monkeypatch.setattr(allocator, "KERNEL_MODE", tmp_path / "missing")
    assert allocator.kernel_mode() == "unavailable"


def test_the_request_keeps_a_setting_the_user_made(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "0")
    allocator.request_huge_pages()
    assert os.environ[allocator.ENV] == "0"
    monkeypatch.delenv(allocator.ENV)
    allocator.request_huge_pages()
    assert os.environ[allocator.ENV] == "1"


needs_thp = pytest.mark.skipif(allocator.kernel_mode() not in ("always", "madvise"),
                               reason="the kernel offers no transparent huge pages here")


@needs_thp
def test_importing_quantkit_puts_large_tensors_on_huge_pages():
    assert _state(STATE) == "huge pages on"
    # the kernel's own count: a 64 MB tensor written once is (mostly) backed by 2 MB pages
    code = ("import quantkit, torch; t = torch.ones(16 << 20); "
            "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    assert int(_state(code)) >= 32 << 10  # kB: at least half of the tensor


def _off(why: str) -> str:
    if allocator.kernel_mode() == "always":
        return f"huge pages from the kernel only (THP always; torch does not advise them: {why})"
    return f"huge pages off ({why})"


@needs_thp
def test_huge_pages_stay_off_when_the_user_says_so_or_torch_allocated_first():
    assert _state(STATE, **{allocator.ENV: "0"}) == _off(f"{allocator.ENV}=0")
    late = "import torch; t = torch.ones(1 << 22); " + STATE  # torch read the variable before quantkit set it
    assert _state(late) == _off("torch allocated before quantkit was imported")


def test_a_kernel_with_thp_always_is_reported_as_such(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("[always] madvise never\n")
    monkeypatch.setattr(allocator, "KERNEL_MODE", f)
    monkeypatch.setattr(allocator, "torch_uses_huge_pages", lambda: False)
    monkeypatch.setenv(allocator.ENV, "0")
    assert allocator.state() == f"huge pages from the kernel only (THP always; torch does not advise them: {allocator.ENV}=0)"
    f.write_text("always madvise [never]\n")
    assert allocator.state() == "huge pages off (kernel THP: never)"


def test_the_machine_line_says_whether_huge_pages_are_on():
    from quantkit.platform import compute

    assert "huge pages" in compute.machine_summary()
