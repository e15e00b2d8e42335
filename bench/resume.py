"""Kill a quantize run after layer K (SIGKILL), resume it, and compare with an uninterrupted run.

Usage: python bench/resume.py MODEL RECIPE --kill-after K [--set KEY=VALUE ...] [--out DIR]
Runs, back to back on this machine: (1) the uninterrupted job; (2) the same job, SIGKILLed as soon as
its resumable state says K layers are finished; (3) `--resume` of it. Prints the wall time of each,
(2) + (3) against (1), and whether every output file of (3) equals (1)'s byte for byte (quantkit.json
aside: it holds timings).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def job(model: str, recipe: str, sets: list[str], out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "quantkit", "quantize", model, "--recipe", recipe,
            *(a for s in sets for a in ("--set", s)), "-o", str(out), "--no-progress", *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("recipe")
    parser.add_argument("--kill-after", type=int, required=True, help="SIGKILL once this many layers are finished")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path("/tmp/resume-bench"))
    args = parser.parse_args()
    from quantkit.platform import compute
    from quantkit.flow.resume import run_dir

    print(compute.machine_summary())
    args.out.mkdir(parents=True, exist_ok=True)
    ref, killed = args.out / "uninterrupted", args.out / "resumed"
    for d in (ref, killed):
        subprocess.run([sys.executable, "-m", "quantkit", "clean", str(args.out)], capture_output=True)
        if d.exists():
            import shutil

            shutil.rmtree(d)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    t0 = time.perf_counter()
    subprocess.run(job(args.model, args.recipe, args.sets, ref), check=True, env=env, capture_output=True)
    t_ref = time.perf_counter() - t0

    t0 = time.perf_counter()
    proc = subprocess.Popen(job(args.model, args.recipe, args.sets, killed), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    state = run_dir(killed) / "state.json"
    while proc.poll() is None:
        try:
            if json.loads(state.read_text()).get("finished", 0) >= args.kill_after:
                os.kill(proc.pid, signal.SIGKILL)
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.wait()
    t_killed = time.perf_counter() - t0
    finished = json.loads(state.read_text())["finished"]

    t0 = time.perf_counter()
    res = subprocess.run(job(args.model, args.recipe, args.sets, killed, "--resume"), env=env, capture_output=True,
                         text=True)
    t_resume = time.perf_counter() - t0
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    files = sorted(p.name for p in ref.iterdir() if p.name != "quantkit.json")
    same = all((ref / f).read_bytes() == (killed / f).read_bytes() for f in files)
    print(f"{args.model} {args.recipe} {' '.join(args.sets)}")
    print(f"uninterrupted          {t_ref:8.1f} s")
    print(f"killed after layer {finished:<3d} {t_killed:8.1f} s")
    print(f"resumed                {t_resume:8.1f} s")
    print(f"killed + resumed       {t_killed + t_resume:8.1f} s  ({(t_killed + t_resume) / t_ref:.2f}x uninterrupted)")
    print(f"output identical: {same} ({', '.join(files)})")


if __name__ == "__main__":
    main()
