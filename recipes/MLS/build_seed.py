#!/usr/bin/env python3
"""Rebuild the tiny seed model the MLS recipe ships (``recipes/MLS/seed/``).

The seed is pretrained on the embedded corpus's public split exactly as a run with
``shipped_seed: False`` would pretrain it (:mod:`mls_seed_model`: encoder CTC, LLM text, then
speech), from the settings of ``hparams/base.yaml`` plus any overrides given here; its encoder
and LLM tensors are then written in float16 to ``seed/seed.safetensors`` and the settings, the
file's SHA-256 and the pretraining's final losses to ``seed/seed.json``
(:func:`speechbrain_fl.recipe.shipped_seed.write_shipped_seed`). A run whose settings equal
those loads the shipped seed instead of pretraining.

To rebuild it (one torch thread, as the recipe's runs):

    > OMP_NUM_THREADS=1 python recipes/MLS/build_seed.py
    > python recipes/MLS/build_seed.py --cache_folder /tmp/seed --pretrain_speech_steps 3000

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import speechbrain as sb

RECIPE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(RECIPE_DIR))
from mls_seed_model import SHIPPED_SEED, seed_settings, seed_tensors  # noqa: E402

from speechbrain_fl.recipe import recipe_module  # noqa: E402
from speechbrain_fl.recipe.shipped_seed import write_shipped_seed  # noqa: E402


def main(argv=None):
    """Pretrain (or reuse the cached) seed for the settings asked, then write the shipped one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache_folder",
        default="results/MLS/seed_build",
        help="where the corpus and the pretrained seed are kept (reused when they exist)",
    )
    parser.add_argument("--out", default=str(SHIPPED_SEED), help="the shipped-seed folder")
    args, overrides = parser.parse_known_args(argv)
    cache = Path(args.cache_folder).resolve()
    train_fl = recipe_module(RECIPE_DIR / "train_fl.py")
    run = train_fl.RECIPE.parse(
        [
            str(RECIPE_DIR / "hparams" / "fedavg.yaml"),
            "--shipped_seed", "False", "--cache_folder", str(cache),
            "--output_folder", str(cache / "build_run"), *overrides,
        ]
    )  # fmt: skip
    sb.create_experiment_directory(**run.experiment)
    settings, _ = train_fl.prepare_run(run.hparams, run.run_opts)
    folder = Path(settings.model["folder"])
    stats = folder / "pretraining.json"
    facts = {
        "command": "python recipes/MLS/build_seed.py " + " ".join(overrides),
        "pretraining": json.loads(stats.read_text()) if stats.is_file() else None,
        "seconds": settings.timings.get("pretraining"),
    }
    manifest = write_shipped_seed(
        args.out,
        seed_tensors(folder),
        settings=seed_settings(run.hparams, run.run_opts),
        facts=facts,
    )
    print(f"Shipped seed written to {args.out} (sha256 {manifest['sha256']})")
    return manifest


if __name__ == "__main__":
    main(sys.argv[1:])
