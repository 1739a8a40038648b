#!/usr/bin/env python3
"""Measure one round's client update norms per pool for local-optimizer settings (no DP).

Runs the recipe's own client round (:func:`speechbrain_fl.fl.clientapp.train.train_round`, the same
Brain, data and local epochs as ``train_fl.py``) from the seed model on a few clients, once per
setting, and prints for each the (LLM + connector)/encoder update-norm ratio per matrix and per
coordinate (norm / sqrt(p) per pool; :func:`speechbrain_fl.fl.dp.profile.pool_norms`) and the mean
joint norm, so the clip C and the optimizer can be chosen against measured norms (the paper's
Sec. IV-A3). The norms are of the training clients, outside any DP guarantee: a calibration
for this embedded corpus, not a private procedure.

    > python recipes/MLS/studies/norm_probe.py hparams/fedavg.yaml --settings sgd:0.05 adamw:0.01 \\
          --clients 6

Authors
 * speechbrain-fl contributors
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_fl  # noqa: E402

from speechbrain_fl.fl.clientapp.train import ClientTask, train_round  # noqa: E402
from speechbrain_fl.fl.dp.profile import pool_norms  # noqa: E402
from speechbrain_fl.fl.params import trainable_state  # noqa: E402
from speechbrain_fl.recipe.schedules import RoundCosineLR  # noqa: E402

#: The optimizers a setting names: SGD with momentum (ours) and the paper's AdamW (base.yaml's).
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=0.0),
    "adamw": functools.partial(torch.optim.AdamW, weight_decay=0.0),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hparams", nargs="?", default="hparams/fedavg.yaml")
    parser.add_argument("--settings", nargs="+", default=["sgd:0.05", "adamw:0.01"],
                        help="optimizer:lr[:encoder_lr_multiplier] per setting")  # fmt: skip
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--override", default="", help="YAML overrides, e.g. '{local_epochs: 1}'")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import yaml

    overrides = yaml.safe_load(args.override) if args.override else {}
    hparams, run_opts, _ = train_fl.RECIPE.load_for_task(args.hparams, overrides)
    settings, _ = train_fl.prepare_run(hparams, run_opts)
    brain = train_fl.build_brain(settings, hparams)
    layout = train_fl.component_layout(brain)
    start = {k: v.clone() for k, v in trainable_state(brain.modules).items()}
    sizes = {}
    for g in layout:
        sizes[g.component] = sizes.get(g.component, 0) + g.numel
    print("trainable values per component:", sizes)
    for setting in args.settings:
        name, lr, *mult = setting.split(":")
        brain.hparams.opt_class = OPTIMIZERS[name]
        brain.hparams.lr_schedule = RoundCosineLR(float(lr), hparams["lr_min_ratio"])
        brain.hparams.encoder_lr_multiplier = float(mult[0]) if mult else 1.0
        norms_sum, joint = {}, []
        for cid in range(args.clients):
            task = ClientTask(
                brain=brain,
                train_set=train_fl.make_dataset(settings.clients[cid], settings.data_folder),
                train_loader_kwargs=dict(settings.hparams["dataloader_options"]),
                layout=layout,
            )
            content = RecordDict(
                {
                    "arrays": ArrayRecord({k: v.clone() for k, v in start.items()}),
                    "config": ConfigRecord(
                        {"local-epochs": int(hparams["local_epochs"]), "server-round": 1,
                         "num-rounds": int(hparams["number_of_rounds"]), "round-seed": 7}
                    ),
                }
            )  # fmt: skip
            reply = train_round(task, content, partition_id=cid)
            delta = reply["arrays"].to_torch_state_dict()
            sq = 0.0
            for g in layout:
                n = float(delta[g.name].norm())
                norms_sum[g.name] = norms_sum.get(g.name, 0.0) + n / args.clients
                sq += n * n
            joint.append(math.sqrt(sq))
        out = pool_norms(norms_sum, layout)
        pc = out["per_coordinate_norm"]
        print(
            f"{setting:>16}: joint norm {sum(joint) / len(joint):.4f}; per coordinate enc "
            f"{pc.get('encoder', float('nan')):.3e} llm {pc.get('llm', float('nan')):.3e}; "
            f"ratio per coordinate {out['ratio_per_coordinate'] or float('nan'):.2f}x, per "
            f"matrix {out['ratio_per_matrix'] or float('nan'):.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
