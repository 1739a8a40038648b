"""The real MLS presets at full size, offline: build, load, one federated client update, decode.

For each real preset of ``speechbrain_fl/models/presets.py`` (``whisper_tinyllama``,
``whisper_eurollm``, ``voxtral``), in a fresh subprocess (memory is freed between presets):

1. **check** the architecture configs of ``speechbrain_fl/models/configs/`` against the code on
   meta-device builds (dimensions, feature-extractor window and mel bins, module names LoRA
   targets, tokenizer size) and count parameters per component without allocating weights;
2. **write** each hub model with random weights (transformers' own initialisation) in
   ``--dtype`` to a temporary folder laid out like its hub repository (``save_pretrained``);
3. **load** it exactly as ``recipes/MLS/train_fl.py`` does: the recipe's hparams
   (``base.yaml`` + ``models/<preset>.yaml`` + the ``--method`` file) and its ``build_brain``
   (``build_speech_llm`` -> ``WhisperModel`` / ``AutoModelForCausalLM`` /
   ``VoxtralForConditionalGeneration`` / ``AutoTokenizer`` / ``AutoFeatureExtractor``
   ``from_pretrained``), with the hub IDs replaced by those folders;
4. run **one federated client update** per ``--batch-sizes`` entry and ``freeze_encoder``
   setting through the engine's client code (``speechbrain_fl.fl.clientapp.train.train_round``: load the
   global trainable tensors, ``SpeechLLMBrain.fit`` for one step of AdamW under
   ``--precision bf16`` autocast, delta, clip to the method's per-group budgets of
   ``speechbrain_fl.privacy.compute_budgets`` with ``clip_update``) on utterances synthesised
   with espeak-ng, through the recipe's data pipeline (``make_dataset``);
5. **decode** one short utterance greedily (``SpeechLLM.transcribe``; random weights, so the text
   is noise: the point is that generation runs with the real vocabulary size);
6. write the trainable **layout** the recipe builds (``component_layout``), print the budgets
   CLI's table for it (``speechbrain-fl budgets``) and compare it with the paper's Table I
   layout (``docs/examples/whisper_tinyllama_layout.json``).

Timings are wall-clock seconds and peak memory is the process's resident set size (sampled
every 20 ms; on CUDA also ``torch.cuda.max_memory_allocated``), each phase measured on its own.
The figures of ``recipes/MLS/README.md`` ("Real presets at full size") come from this script.

Run (CPU; the whole set takes long on 2 cores, a single preset ~10-30 min)::

    python benchmarks/real_presets.py                               # all presets, batch 1
    python benchmarks/real_presets.py --presets whisper_tinyllama --batch-sizes 1 16
    python benchmarks/real_presets.py --device cuda --batch-sizes 1 16   # on a GPU machine
    python benchmarks/real_presets.py --presets voxtral --num-layers 2  # cheap, fewer layers

``--num-layers N`` caps every transformer stack at N layers (widths, vocabulary, mel bins and the
30 s window unchanged): for quick checks only; the figures in the README are full size.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from speechbrain_fl.recipe.settings import RunSettings

ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = ROOT / "recipes" / "MLS"
TABLE_I_LAYOUT = ROOT / "docs" / "examples" / "whisper_tinyllama_layout.json"
REAL_PRESETS = ("whisper_tinyllama", "whisper_eurollm", "voxtral")  # smallest first
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore",
    "a federated model never sees the raw audio",
    "privacy budgets are split between the encoder and the language model",
    "the weather was cold and the river was frozen",
    "every client trains on its own recordings",
    "he read the letter twice before answering",
    "numbers and dates are spoken in full",
)
VARIANTS = ("f1", "m1", "f3", "m3", "f2", "m2", "f4", "m4")


# ------------------------------------------------------------------------------ measuring
def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """Wall time and peak resident memory (and CUDA peak) of a block, sampled every 20 ms."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds = math.nan
        self.peak_rss = 0
        self.peak_cuda = None

    def __enter__(self):
        gc.collect()
        self._stop = threading.Event()
        self.peak_rss = _rss_bytes()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def sample():
            while not self._stop.wait(0.02):
                self.peak_rss = max(self.peak_rss, _rss_bytes())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak_cuda = torch.cuda.max_memory_allocated()
        self.seconds = time.perf_counter() - self._start
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, _rss_bytes())
        return False

    def row(self) -> dict:
        out = {"seconds": round(self.seconds, 2), "peak_rss_gib": round(self.peak_rss / 2**30, 2)}
        if self.peak_cuda is not None:
            out["peak_cuda_gib"] = round(self.peak_cuda / 2**30, 2)
        return out


# ------------------------------------------------------------------------------ recipe parts
def load_recipe():
    """``recipes/MLS/train_fl.py`` as a module (its Brain, build_brain, component_layout, ...)."""
    spec = importlib.util.spec_from_file_location("mls_train_fl", RECIPE_DIR / "train_fl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_hparams(preset: str, *, method: str, freeze_encoder: bool, output_folder: Path):
    """The recipe's layered hparams (base + preset + method file) for this preset."""
    from speechbrain_fl.recipe import load_layered_hparams

    overrides = {
        "model": preset,
        "freeze_encoder": freeze_encoder,
        "output_folder": str(output_folder),
    }
    hparams, _, _ = load_layered_hparams(
        RECIPE_DIR / "hparams" / f"{method}.yaml", overrides, recipe_dir=RECIPE_DIR
    )
    return hparams


def write_utterances(folder: Path, count: int) -> Path:
    """``count`` English utterances synthesised with espeak-ng, as a recipe manifest CSV."""
    import soundfile

    from speechbrain_fl.data.espeak import SAMPLE_RATE, Voice, synthesize

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        text = SENTENCES[i % len(SENTENCES)]
        wav = synthesize(text, Voice(language="en", variant=VARIANTS[i % len(VARIANTS)]))
        name = f"utt{i:02d}.wav"
        soundfile.write(folder / name, wav, SAMPLE_RATE)
        rows.append(
            {
                "ID": f"utt{i:02d}",
                "duration": len(wav) / SAMPLE_RATE,
                "wav": f"$data_root/{name}",
                "spk_id": VARIANTS[i % len(VARIANTS)],
                "language": "english",
                "wrd": text,
            }
        )
    path = folder / f"utterances_{count}.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def compare_with_table_i(layout) -> dict:
    """Groups and parameters per component: the built layout against the paper's Table I."""
    from speechbrain_fl.privacy import Layout

    def summary(lay):
        return {
            label: {"groups": len(groups), "params": sum(g.numel for g in groups)}
            for label, groups in lay.by_component().items()
        }

    table = summary(Layout.from_json(TABLE_I_LAYOUT))
    built = summary(layout)
    differences = []
    for label in dict.fromkeys([*table, *built]):
        t, b = table.get(label), built.get(label)
        if t != b:
            differences.append(f"{label}: Table I {t} vs built {b}")
    return {"table_i": table, "built": built, "differences": differences}


def budgets_cli(layout_path: Path, *, method: str, clip: float, alpha, sigma: float) -> str:
    """The table ``speechbrain-fl budgets`` prints for a layout file (first lines only)."""
    from speechbrain_fl.cli import main as cli_main

    argv = ["budgets", "--layout", str(layout_path), "--method", method, "--clip", str(clip)]
    argv += ["--noise-multiplier", str(sigma)]
    if alpha is not None:
        argv += ["--alpha", str(alpha)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(argv)
    return "\n".join(out.getvalue().splitlines()[:8])


def wire_bytes(arrays) -> int:
    """Bytes of the serialised tensors of a Flower ArrayRecord (what the client sends)."""
    return sum(len(array.data) for array in arrays.values())


# ------------------------------------------------------------------------------ one preset
def run_preset(args) -> dict:
    """Check, write, load, train one step per setting and decode one preset (one process)."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from speechbrain_fl.fl.clientapp.train import ClientTask, train_round
    from speechbrain_fl.fl.params import trainable_state
    from speechbrain_fl.models.configs import check_preset, offline_preset
    from speechbrain_fl.privacy import compute_budgets

    preset, device = args.presets[0], args.device
    dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[args.dtype])
    torch.set_num_threads(args.threads or torch.get_num_threads())
    result: dict = {
        "preset": preset,
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "num_layers": args.num_layers,
        "method": args.method,
    }
    with Peak(device) as peak:
        result["meta_counts"] = check_preset(preset, num_layers=args.num_layers)
    result["check"] = peak.row()
    work = Path(args.work_dir)
    with Peak(device) as peak:
        spec = offline_preset(preset, work / "hub", dtype=dtype, num_layers=args.num_layers)
    result["write_checkpoint"] = peak.row()
    result["checkpoint_gib"] = round(
        sum(p.stat().st_size for p in (work / "hub").rglob("*") if p.is_file()) / 2**30, 2
    )
    recipe = load_recipe()
    sizes = sorted(set(args.batch_sizes))
    manifests = {bs: write_utterances(work / "audio", bs) for bs in sizes}
    result["settings"] = []
    decoded = False
    for freeze in args.freeze_encoder:
        hparams = recipe_hparams(
            preset, method=args.method, freeze_encoder=freeze, output_folder=work / "out"
        )
        settings = {
            "hparams": {k: hparams[k] for k in recipe.BRAIN_KEYS},
            "run_opts": {"device": device, "precision": args.precision},
            "model": {
                "folder": spec,
                "cache_dir": str(work / "cache"),
                "options": recipe.model_options(hparams),
            },
        }
        settings["run_opts"]["max_grad_norm"] = hparams["max_grad_norm"]
        row: dict = {"freeze_encoder": freeze, "options": settings["model"]["options"]}
        with Peak(device) as peak:
            brain = recipe.build_brain(RunSettings(**settings), hparams)
        row["load"] = peak.row()
        model = brain.modules.model
        layout = recipe.component_layout(brain)
        layout_path = work / f"layout_{preset}_freeze{freeze}.json"
        layout.to_json(layout_path)
        row["layout"] = compare_with_table_i(layout)
        method = hparams["method"].name
        alpha = hparams["alpha"] if method == "alpha_split" else None
        row["budgets_cli"] = budgets_cli(
            layout_path,
            method=method,
            clip=hparams["clip"],
            alpha=alpha,
            sigma=hparams["noise_multiplier"],
        )
        budgets = compute_budgets(layout, method=method, clip=hparams["clip"], alpha=alpha)
        counts: dict = {}
        for name, param in model.named_parameters():
            c = counts.setdefault(model.component_of(name), {"total": 0, "trainable": 0})
            c["total"] += param.numel()
            c["trainable"] += param.numel() if param.requires_grad else 0
        row["counts"] = counts
        global_state = {f"model.{k}": v for k, v in trainable_state(model).items()}
        row["steps"] = []
        for bs in sizes:
            content = RecordDict(
                {
                    "arrays": ArrayRecord({k: v.cpu() for k, v in global_state.items()}),
                    "config": ConfigRecord(
                        {
                            "server-round": 1,
                            "num-rounds": int(hparams["number_of_rounds"]),
                            "local-epochs": 1,
                            "round-seed": 0,
                            "clip-budgets": json.dumps(budgets),
                            "clip-groups": json.dumps(list(layout.names)),
                            "clip-components": json.dumps(list(layout.components)),
                        }
                    ),
                }
            )
            task = ClientTask(
                brain=brain,
                train_set=recipe.make_dataset(str(manifests[bs]), str(manifests[bs].parent)),
                train_loader_kwargs={"batch_size": bs, "shuffle": False, "num_workers": 0},
                layout=layout,
            )
            try:
                with Peak(device) as peak:
                    reply = train_round(task, content)
            except (RuntimeError, MemoryError) as err:  # out of memory at this batch size
                row["steps"].append({"batch_size": bs, "error": f"{type(err).__name__}: {err}"})
                task = content = None
                gc.collect()
                continue
            metrics = reply["metrics"]
            delta = reply["arrays"].to_torch_state_dict()
            joint = math.sqrt(sum(float(t.float().pow(2).sum()) for t in delta.values()))
            row["steps"].append(
                {
                    "batch_size": bs,
                    **peak.row(),
                    "train_loss": float(metrics["train-loss"]),
                    "pre_clip_joint_norm": float(metrics["joint-norm"]),
                    "component_norms": dict(
                        zip(layout.components, metrics["component-norms"], strict=True)
                    ),
                    "post_clip_joint_norm": joint,
                    "clip": hparams["clip"],
                    "wire_bytes": wire_bytes(reply["arrays"]),
                    "finite": all(bool(torch.isfinite(t).all()) for t in delta.values()),
                }
            )
            del task, content, reply, delta
        if not decoded:
            import soundfile

            wav, _ = soundfile.read(manifests[sizes[0]].parent / "utt00.wav", dtype="float32")
            wavs = torch.from_numpy(wav)[None]
            with Peak(device) as peak, torch.no_grad():
                text = model.transcribe(
                    wavs.to(device),
                    torch.ones(1),
                    max_new_tokens=args.max_new_tokens,
                    languages=["english"],
                )
            result["decode"] = {
                **peak.row(),
                "max_new_tokens": args.max_new_tokens,
                "audio_seconds": round(len(wav) / 16000, 2),
                "text": text[0][:80],
            }
            decoded = True
        result["settings"].append(row)
        del brain, model, layout, global_state
        recipe._MODELS.clear()
        gc.collect()
    return result


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores"


# ------------------------------------------------------------------------------ table
def _fmt_m(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 1e5 else f"{n:,}"


def results_table(results: list[dict]) -> str:
    """Markdown sizing table: parameters, wire size, step time and memory per setting."""
    lines = [
        "| preset | encoder | params total (enc / conn / LLM) | trainable (enc / conn / LLM) "
        "| update on the wire | batch | step s | step peak RSS GiB | load s | load peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['preset']} | | failed: {res['error'][:80]} | | | | | | | |")
            continue
        for row in res["settings"]:
            c = row["counts"]
            parts = [
                c.get(k, {"total": 0, "trainable": 0}) for k in ("encoder", "connector", "llm")
            ]
            total = " / ".join(_fmt_m(p["total"]) for p in parts)
            train = " / ".join(_fmt_m(p["trainable"]) for p in parts)
            enc = "frozen" if row["freeze_encoder"] else "LoRA (-e)"
            for step in row["steps"] or [{}]:
                wire = step.get("wire_bytes")
                wire_s = f"{wire / 2**20:.1f} MiB" if wire else "-"
                time_s = step.get("seconds", step.get("error", "-"))
                lines.append(
                    f"| {res['preset']} | {enc} | {total} | {train} | {wire_s} "
                    f"| {step.get('batch_size', '-')} | {time_s} "
                    f"| {step.get('peak_rss_gib', '-')} | {row['load']['seconds']} "
                    f"| {row['load']['peak_rss_gib']} |"
                )
    lines += ["", "Trainable layout (recipe's component_layout) vs the paper's Table I:"]
    for res in results:
        for row in res.get("settings", []):
            enc = "frozen" if row["freeze_encoder"] else "LoRA (-e)"
            for diff in row["layout"]["differences"] or ["identical"]:
                lines.append(f"- {res['preset']}, encoder {enc}: {diff}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(REAL_PRESETS), choices=REAL_PRESETS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype",
        default="bf16",
        choices=("bf16", "fp32", "fp16"),
        help="dtype of the written random weights, hence of the loaded base model (the "
        "recipe loads with transformers' dtype='auto'); bf16 fits all presets in 24 GiB",
    )
    parser.add_argument("--precision", default="bf16", help="SpeechBrain --precision (autocast)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    parser.add_argument(
        "--freeze-encoder",
        nargs="+",
        default=["true", "false"],
        choices=("true", "false"),
        help="freeze_encoder settings to run (paper: frozen and -e variants)",
    )
    parser.add_argument("--method", default="alpha_split", help="recipe method file (budgets)")
    parser.add_argument("--num-layers", type=int, default=None, help="cap every stack (tests)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work-dir", default=None, help="checkpoints and audio (default: temp)")
    parser.add_argument("--output", default="results/benchmarks/real_presets.json")
    parser.add_argument("--timeout", type=int, default=3 * 3600, help="seconds per preset")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.freeze_encoder = [v == "true" for v in args.freeze_encoder]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available here")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = run_preset(args)
        Path(args.result_file).write_text(json.dumps(result, indent=1))
        return 0
    from speechbrain_fl.utils.atomic import atomic_open

    results = []
    for preset in args.presets:
        with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
            result_file = Path(work) / "result.json"
            cmd = [sys.executable, __file__, "--worker", "--presets", preset, "--result-file"]
            cmd += [str(result_file), "--work-dir", work, "--device", args.device]
            cmd += ["--dtype", args.dtype, "--precision", args.precision, "--method", args.method]
            cmd += ["--batch-sizes", *map(str, args.batch_sizes), "--freeze-encoder"]
            cmd += ["true" if f else "false" for f in args.freeze_encoder]
            cmd += ["--max-new-tokens", str(args.max_new_tokens)]
            if args.num_layers is not None:
                cmd += ["--num-layers", str(args.num_layers)]
            if args.threads is not None:
                cmd += ["--threads", str(args.threads)]
            print(f"== {preset}: {' '.join(cmd[2:])}", flush=True)
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, check=False)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code == 0 and result_file.is_file():
                result = json.loads(result_file.read_text())
            else:
                result = {"preset": preset, "error": f"worker exit status {code}"}
            result["wall_seconds"] = round(time.perf_counter() - start, 1)
            results.append(result)
            print(json.dumps(result, indent=1), flush=True)
    table = results_table(results)
    print("\n" + table)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(output) as handle:
        handle.write(json.dumps({"results": results, "table": table}, indent=1))
    print(f"\nresults written to {output}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
