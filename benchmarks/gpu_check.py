"""GPU check: the four CUDA measurements ``docs/benchmarks.md`` lacks, in one run and one table.

On a machine with a CUDA GPU, each part runs as its own subprocess (memory freed between parts)
under its own time limit, so the whole check ends within ``--budget`` seconds (default 480,
8 minutes); a part that fails or runs out of time is a row saying so, not a crash:

1. ``mls_step``: one federated client update of the smallest real MLS preset
   (``whisper_tinyllama``: Whisper-small encoder + TinyLlama-1.1B, the architecture from
   ``speechbrain_fl/models/configs/`` with random weights written locally, no hub) at the
   paper's client batch of 16 (``recipes/MLS/hparams/models/whisper_tinyllama.yaml``), bf16
   weights under bf16 autocast, encoder frozen (``benchmarks/real_presets.py --device cuda
   --presets whisper_tinyllama --batch-sizes 16 --freeze-encoder true``): wall time of the
   update (``train_round``: load, one AdamW step, delta, per-group clip) and
   ``torch.cuda.max_memory_allocated``;
2. ``clipping``: ``benchmarks/clipping.py --device cuda`` (Table I and the 100 M-parameter
   layout; flat and alpha-split rows, copying and in place, with the ratio to flat and the
   fraction of ``copy_`` bandwidth);
3. ``memory_by_depth``: ``benchmarks/memory_by_depth.py --model base-random --device cuda``
   (wav2vec 2.0 Base architecture, random weights; KWS 12 -> 3 exits reduction of
   ``max_memory_allocated`` against the paper's 43.27%);
4. ``dp_sgd``: ``benchmarks/dp_sgd_overhead.py --device cuda`` (Opacus hooks and ghost
   clipping against the non-private step, the recipe's batch of 256).

Without CUDA it refuses (exit status 2) unless ``--smoke``, which runs every part on the CPU
at toy sizes (1 transformer layer, batch 1, the Table I clipping layout only, KWS exits 3/12 on
the tiny wav2vec 2.0, 2 DP-SGD steps) so the script itself can be tested without a GPU; smoke
figures are not measurements of anything.

Run::

    python benchmarks/gpu_check.py                 # on a GPU machine (<= 8 minutes)
    python benchmarks/gpu_check.py --smoke         # anywhere: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: Seconds per part on a GPU (sum 450 s, within the 480 s budget with start-up).
LIMITS = {"mls_step": 240, "clipping": 90, "memory_by_depth": 60, "dp_sgd": 60}


def _run(cmd: list[str], limit: float, log: Path) -> tuple[str, str]:
    """Run ``cmd`` (at most ``limit`` s); return (status, stdout+stderr). Output also in ``log``."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=max(limit, 1), check=False, env=env
        )
        out, status = proc.stdout + proc.stderr, f"exit {proc.returncode}"
        if proc.returncode == 0:
            status = "ok"
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        status = f"timed out after {limit:.0f} s"
    log.write_text(out, encoding="utf-8")
    return f"{status} ({time.perf_counter() - start:.0f} s)", out


def mls_step(args, work: Path, limit: float) -> list[tuple[str, str, str]]:
    out_json = work / "real_presets.json"
    cmd = [sys.executable, str(HERE / "real_presets.py"), "--presets", "whisper_tinyllama"]
    cmd += ["--device", args.device, "--dtype", "bf16", "--precision", "bf16"]
    cmd += ["--batch-sizes", "1" if args.smoke else "16", "--freeze-encoder", "true"]
    cmd += ["--output", str(out_json), "--work-dir", str(work), "--timeout", str(int(limit))]
    cmd += ["--max-new-tokens", "2"]
    if args.smoke:
        cmd += ["--num-layers", "1"]
    status, _ = _run(cmd, limit + 10, work / "mls_step.log")
    rows = []
    if out_json.is_file():
        for result in json.loads(out_json.read_text())["results"]:
            if "error" in result:
                rows.append(("mls_step", "whisper_tinyllama", f"error: {result['error']}"))
            for setting in result.get("settings", []):
                for step in setting.get("steps", []):
                    label = f"client update, batch {step['batch_size']}, bf16, encoder frozen"
                    if "error" in step:
                        rows.append(("mls_step", label, step["error"][:120]))
                        continue
                    mem = step.get("peak_cuda_gib")
                    mem_text = (
                        f"{mem} GiB max_memory_allocated"
                        if mem is not None
                        else (f"{step['peak_rss_gib']} GiB peak RSS (CPU)")
                    )
                    rows.append(("mls_step", label, f"{step['seconds']} s, {mem_text}"))
    return rows or [("mls_step", "whisper_tinyllama", status)]


_ROW = re.compile(r"^\| (?P<layout>[^|]+) \| (?P<method>[^|]+) \| (?P<ms>[\d.]+) \| (?P<rest>.*)$")


def clipping(args, work: Path, limit: float) -> list[tuple[str, str, str]]:
    cmd = [sys.executable, str(HERE / "clipping.py"), "--device", args.device]
    cmd += ["--repeats", "1" if args.smoke else "7"]
    if args.smoke:
        cmd += ["--skip-big"]
    status, out = _run(cmd, limit, work / "clipping.log")
    rows = []
    keep = {"flat", "alpha_split", "flat, in place", "alpha_split, in place"}
    for line in out.splitlines():
        m = _ROW.match(line)
        if m and m["method"].strip() in keep:
            cells = [c.strip() for c in m["rest"].split("|")]
            rows.append(
                (
                    "clipping",
                    f"{m['layout'].strip()}: {m['method'].strip()}",
                    f"{m['ms']} ms, {cells[0]}x flat, {cells[1]} of copy_ bandwidth",
                )
            )
    return rows or [("clipping", "benchmarks/clipping.py", status)]


def memory_by_depth(args, work: Path, limit: float) -> list[tuple[str, str, str]]:
    md = work / "memory_by_depth.md"
    cmd = [sys.executable, str(HERE / "memory_by_depth.py"), "--device", args.device]
    cmd += ["--tasks", "kws", "--exits", "3", "12", "--markdown", str(md)]
    cmd += ["--cache_dir", str(work / "w2v")]
    cmd += ["--model", "tiny" if args.smoke else "base-random"]
    status, _ = _run(cmd, limit, work / "memory_by_depth.log")
    rows = []
    if md.is_file():
        for line in md.read_text().splitlines():
            if line.startswith("| KWS"):
                cells = [c.strip() for c in line.strip("|").split("|")]
                rows.append(
                    (
                        "memory_by_depth",
                        f"KWS exit 3 / 12, feature encoder {cells[1]}",
                        f"MB (peak) {cells[2]} / {cells[3]}; reduction {cells[4]}, paper "
                        f"{cells[5]}",
                    )
                )
    return rows or [("memory_by_depth", "benchmarks/memory_by_depth.py", status)]


def dp_sgd(args, work: Path, limit: float) -> list[tuple[str, str, str]]:
    cmd = [sys.executable, str(HERE / "dp_sgd_overhead.py"), "--device", args.device]
    if args.smoke:
        cmd += ["--steps", "2", "--batch", "8", "--frames", "20"]
    status, out = _run(cmd, limit, work / "dp_sgd.log")
    rows, model = [], None
    for line in out.splitlines():
        if line and not line.startswith(" ") and ": batch" in line:
            model = line.split(":")[0]
        parts = line.split()
        if model and len(parts) == 3 and parts[0] in ("hooks", "ghost", "non-private"):
            rows.append(("dp_sgd", f"{model}: {parts[0]}", f"{parts[1]} ms/step, {parts[2]}x"))
    return rows or [("dp_sgd", "benchmarks/dp_sgd_overhead.py", status)]


PARTS = {"mls_step": mls_step, "clipping": clipping, "memory_by_depth": memory_by_depth,
         "dp_sgd": dp_sgd}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (no GPU)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds for the whole check (480; smoke 900)"
    )
    parser.add_argument("--keep", default=None, help="folder for the parts' logs (default: temp)")
    args = parser.parse_args(argv)
    import torch

    if args.budget is None:  # a shared CPU runs the toy sizes slower than a GPU the real ones
        args.budget = 900.0 if args.smoke else 480.0
    if args.smoke:
        args.device = "cpu"
    elif torch.cuda.is_available():
        args.device = "cuda"
    else:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing measured. "
            "Run it on a GPU machine, or with --smoke to test the script at toy sizes on the CPU.",
            file=sys.stderr,
        )
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (smoke)"
    start = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for part in args.parts:
            left = args.budget - (time.perf_counter() - start)
            limit = min(LIMITS[part] * (args.budget / 480.0), left - 5)
            if limit < 10:
                rows.append((part, "-", f"skipped: {left:.0f} s of the budget left"))
                continue
            part_dir = work / part
            part_dir.mkdir(parents=True, exist_ok=True)
            print(f"== {part} (at most {limit:.0f} s)", flush=True)
            rows += PARTS[part](args, part_dir, limit)
    total = time.perf_counter() - start
    print(f"\nGPU check on {name}, torch {torch.__version__}, {total:.0f} s")
    print("\n| part | what | figure |\n|---|---|---|")
    for part, what, figure in rows:
        print(f"| {part} | {what} | {figure} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
