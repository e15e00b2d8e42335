"""The README's quick-start commands, as written there, on a tiny model standing in for SmolLM2 (the
Python block runs on the real model in test_real_model.py; `models fetch` in the real-model fixtures).
Calibrated recipes get a small calibration set added; everything else is the README's own words."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

from click.testing import CliRunner

from quantkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "calibration.num_samples=4", "--set", "calibration.seq_len=64"]


def quick_start() -> list[list[str]]:
    """The commands of the README's quick start, `&&` chains split, comments dropped."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.splitlines():
        line = line.split("  #", 1)[0].strip()
        for part in filter(None, (p.strip() for p in line.split("&&"))):
            commands.append(shlex.split(part))
    return commands


def test_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200
    assert re.search(r"```\nmake demo .*\nmake test ", readme)
    for link in re.findall(r"\]\(((?:docs|bench|evals)/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_the_quick_start_runs(tiny_llama, tmp_path, monkeypatch):
    commands = quick_start()
    assert [c[:2] for c in commands] == [["quantkit", "models"], ["quantkit", "quantize"], ["quantkit", "eval"],
                                         ["quantkit", "generate"], ["quantkit", "quantize"], ["quantkit", "export"]]
    model = tmp_path / "smollm2-135m"  # a local directory of that name: the tiny model, with a chat template
    shutil.copytree(tiny_llama, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    monkeypatch.chdir(tmp_path)
    for command in commands[1:]:  # `models fetch` downloads the real model: the real-model tests run it
        args = [("./smollm2-135m" if a == "smollm2-135m" else a) for a in command[1:]]
        args = [("stages.rtn.scheme.group_size=32" if a == "stages.rtn.scheme.group_size=64" else a) for a in args]
        if args[0] == "quantize":
            args += SMALL + ["--no-progress"]
        if args[0] == "eval":
            args += ["--seq-len", "64", "--max-windows", "2", "--no-progress"]
        if args[0] == "generate":
            args += ["-n", "4"]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, f"quantkit {' '.join(args)}\n{res.output}"
    assert (tmp_path / "sm-q4_0.gguf").stat().st_size > 0


def test_the_serve_section_runs(tiny_llama, tmp_path):
    """The README's `quantkit serve` line, as a process, answers the README's two-line client (on a free port
    instead of 8000, the tiny model under the README's name)."""
    import contextlib
    import io
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Serve", 1)[1].split("\n## ", 1)[0]
    command = shlex.split(re.search(r"```\n(quantkit serve .*?)  #", section).group(1))
    client = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert command[:2] == ["quantkit", "serve"] and len(client.strip().splitlines()) == 2
    model = tmp_path / command[2]
    shutil.copytree(tiny_llama, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", *command[2:], "--port", str(port),
                             "--kv-cache-gb", "0.01"], cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(client.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), {})
        # the answer's text, printed (a tiny random model may say little; the client checked the body's shape)
        assert out.getvalue().endswith("\n") and out.getvalue() != "None\n"
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
