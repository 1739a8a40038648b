"""Framework overhead of the federated engine against a plain PyTorch loop and pfl-research.

The workload: K=32 clients x 64 examples of a ~101k-parameter MLP regression
(136 -> 256 -> 256 -> 1), 4 local SGD steps per client per round (batch 16), 10 rounds; each
with and without flat DP (clip C=0.1, noise multiplier sigma=1, Poisson sampling q=0.5; C: see
:data:`DP`). Every
configuration runs in a fresh Python process, so the "whole run" time is what a user waits for
(interpreter start, imports, Ray start, rounds, shutdown, process exit):

- ``local``: :func:`speechbrain_fl.fl.run_simulation` on a :class:`TaskSpec` naming
  :func:`mlp_task` below with ``backend="local"`` (:class:`speechbrain_fl.fl.engines.local_grid.LocalGrid`:
  the same ServerApp, ClientApp and Messages, run in this process, each client built once);
- ``ray``: the same call with ``backend="ray"`` (Flower's Simulation Engine, Ray backend, one
  ClientApp per CPU, each actor builds the task once);
- ``plain``: the same training in one loop in one process (torch only: FedAvg, and for DP
  Poisson client sampling, per-client update clipping to C and Gaussian noise
  ``N(0, (sigma C)^2)`` on the sum divided by the expected cohort ``q K``);
- ``brain``: the plain loop with SpeechBrain doing the local steps (``Brain.fit`` of the
  engine's Brain on the engine's DataLoader with ``PaddedBatch`` collation, one loader per
  client): SpeechBrain's own cost, with no Flower and no engine;
- ``pfl``: pfl-research's ``FederatedAveraging`` on the same model, data and DP settings
  (``pip install pfl``; skipped when absent); its DP run computes no epsilon;
- ``pfl_eps`` (DP only): ``pfl`` that also reports the run's epsilon with pfl's own
  ``PLDPrivacyAccountant`` (dp-accounting's PLD), as the engine's DP run reports its PLD
  guarantee: the like-with-like DP comparison.

"steady round" is the median wall time of rounds 3..10. The engine's breakdown adds the import
time of ``speechbrain_fl.fl`` and of ``run_simulation`` (with torch, Flower), the Ray start
(``ray`` only: a separate ``ray.init``/``ray.shutdown`` with the engine's arguments), the first
round (which builds the clients) and the time from the last round to the end of
``run_simulation``.

Like with like: the engine's Brain runs with ``max_grad_norm: inf`` (:data:`RUN_OPTS`),
SpeechBrain's switch for no per-step gradient clipping, so its arithmetic equals the plain
loop's and pfl's, which do not clip per step; the engine then skips SpeechBrain's per-step
``clip_grad_norm_`` (``speechbrain_fl/fl/clientapp/optimizer.py``; SpeechBrain's default bound 5,
never reached here, would cost ~2 ms a client round). The engine's data path stays
SpeechBrain's (a DataLoader with ``PaddedBatch`` collation where the plain loop and pfl slice two
tensors), counted in the engine's figures and in ``brain``'s; ``--breakdown`` measures it.

``--pairs N`` (with two ``--kinds``, e.g. ``local,pfl`` or ``local,pfl_eps``) runs N pairs of fresh
processes per DP setting, the two kinds one right after the other and the first of a pair
alternating, and prints the median over the pairs of each pair's ratio with the pairs' range,
for the steady round and the whole run (:func:`pairs`): on the 2-core VM the figures come from,
one configuration's steady round moved by up to 1.3x between passes a few minutes apart, which
a table of medians over three passes does not resolve. ``--rounds R`` runs R rounds instead of
10 (the steady round is then the median of rounds 3..R: 18 rounds instead of 8 with
``--rounds 20``).

``--breakdown`` runs the local backend ``--repeats`` times per DP setting with
``perf_counter`` wrappers around the parts listed in :data:`TIMED` (the LocalGrid delivery,
our ClientApp handler, SpeechBrain's DataLoader/``PaddedBatch``/``fit_batch``/
``optimizers_step``/``clip_grad_norm_``, the server's reply check, aggregation, noise, state
file) during rounds 3..10 and prints milliseconds per client update next to the plain loop's.

The current figures, with the machine they ran on: ``docs/benchmarks.md``. The per-round
epsilon is RDP's (``round_accountant``), ~0.01 ms; the final PLD is computed once.
``local_rdp`` is ``local`` with ``accountant: rdp`` (the final figure from RDP too).

Run: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/fl_overhead.py [--repeats 3]
[--kinds plain,brain,local,local_rdp,ray,pfl,pfl_eps] [--breakdown] [--pairs 8 --kinds local,pfl]
[--rounds 20]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()

CLIENTS, EXAMPLES, BATCH, FEATURES, HIDDEN, LR = 32, 64, 16, 136, 256, 0.05
#: Rounds per run (``--rounds``, passed to the child processes through the environment).
ROUNDS = int(os.environ.get("SB_FL_BENCH_ROUNDS", "10"))
#: Flat DP: clip C, noise multiplier sigma, Poisson rate q. C = 0.1, not 1: with C = 1 the noise
#: on the mean (std sigma C / (q K) = 1/16 per coordinate, norm ~20 a round against a model of
#: norm ~16) drove every run, the plain loop's and pfl's too, to NaN by round ~4, and the engine
#: then timed its handling of non-finite replies (an error reply and a logged traceback per
#: client, ~0.7 ms each). At C = 0.1 every run stays finite (the plain loop's validation loss
#: 0.43 -> 0.33, 0.25 without DP); epsilon does not depend on C (10.46 after 10 rounds).
DP = {"clip": 0.1, "noise_multiplier": 1.0, "sampling_rate": 0.5}
#: The Brains' run options: SpeechBrain's per-step gradient clipping off (``max_grad_norm`` inf),
#: as in the plain loop and pfl-research, which do not clip per step.
RUN_OPTS = {"device": "cpu", "noprogressbar": True, "max_grad_norm": float("inf")}
#: The engine's clients share one model per process (see :func:`mlp_task`).
SHARED_MODEL = os.environ.get("SB_FL_BENCH_MODEL_PER_CLIENT") != "1"
HERE = os.path.abspath(__file__)


def _mlp():
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _data(seed: int, count: int):
    """Inputs N(0, I) and targets of a fixed random teacher plus noise (seeded, test-only)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(FEATURES, 1, generator=gen) / FEATURES**0.5
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=gen)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(count, 1, generator=gen)


def mlp_task(hparams: str | None, overrides: dict):
    """The engine's factory of the workload (a :class:`~speechbrain_fl.fl.task.FLTask`).

    Each client gets its own Brain, loader and optimiser around one model per process
    (``SHARED_MODEL``, the default), as the MLS and SUPERB recipes build their clients
    (``speechbrain_fl.recipe.ModelCache``: the engine loads the global tensors before a
    client's training and puts them back after it) and as the plain loop and pfl-research train
    theirs; ``SB_FL_BENCH_MODEL_PER_CLIENT=1`` builds one model per client instead
    (32 models, whose weights a client's round does not find in the CPU's caches).
    """
    import functools

    from speechbrain.dataio.batch import PaddedBatch

    from speechbrain_fl.fl.clientapp.train import ClientTask
    from speechbrain_fl.fl.serverapp.task import ServerTask
    from speechbrain_fl.fl.settings.config import FLConfig
    from speechbrain_fl.fl.task import FLTask
    from speechbrain_fl.fl.toy import ToyBrain, _Examples

    shared: dict[str, object] = {}

    def brain(share: bool = False):
        import torch

        torch.manual_seed(0)
        if share and SHARED_MODEL:
            if "model" not in shared:
                shared["model"] = _mlp()
            model = shared["model"]
        else:
            model = _mlp()
        return ToyBrain(
            modules={"model": model},
            opt_class=lambda params: torch.optim.SGD(params, lr=LR),
            run_opts=RUN_OPTS,
        )

    def client(context):
        pid = int(context.node_config.get("partition-id", 0))
        return ClientTask(
            brain=brain(share=True),
            train_set=_Examples(*_data(1 + pid, EXAMPLES)),
            train_loader_kwargs={"batch_size": BATCH, "shuffle": True, "collate_fn": PaddedBatch},
        )

    def server(context):
        keys = FLConfig.yaml_keys()
        config = FLConfig.from_hparams({k: v for k, v in overrides.items() if k in keys})
        return ServerTask(
            brain=brain(),
            config=config,
            valid_set=_Examples(*_data(10_000, 256)),
            valid_loader_kwargs={"batch_size": 256, "collate_fn": PaddedBatch},
            min_available_nodes=CLIENTS,
            num_partitions=CLIENTS,
        )

    del hparams, functools
    return FLTask(build_client=client, build_server=server, num_partitions=CLIENTS)


def run_engine(dp: bool, backend: str, accountant: str | None = None) -> dict:
    """One engine run in this process on ``backend``; returns its timings.

    ``accountant`` (DP only) replaces the engine's default (PLD) for the guarantee's epsilon
    (the per-round figure is RDP's either way, ``round_accountant``).
    """
    t = time.perf_counter()
    import speechbrain_fl.fl  # noqa: F401

    t_pkg = time.perf_counter() - t
    from speechbrain_fl.fl import TaskSpec, run_simulation

    t_imports = time.perf_counter() - t
    t_ray = 0.0
    if backend == "ray":
        import ray

        init = {"include_dashboard": False, "num_cpus": os.cpu_count(), "log_to_driver": False}
        t = time.perf_counter()
        ray.init(**init)
        ray.shutdown()
        t_ray = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as out:
        overrides = {
            "output_folder": out,
            "number_of_rounds": ROUNDS,
            "eval_every": 0,
            "method": "flat" if dp else "fedavg",
            **(DP if dp else {}),
            **({"accountant": accountant} if dp and accountant else {}),
        }
        t = time.perf_counter()
        result = run_simulation(
            TaskSpec(task=f"{HERE}:mlp_task", overrides=overrides),
            backend=backend,
            client_resources={"num_cpus": 1},
        )
        t_sim = time.perf_counter() - t
    rounds = result.round_seconds
    return {
        "import_pkg": t_pkg,
        "imports": t_imports,
        "ray_start_stop": t_ray,
        "run_simulation": t_sim,
        "first_round": rounds[0],
        "rounds": rounds,
        "epsilon": result.epsilon,
        "after_rounds": t_sim - sum(rounds),
    }


def run_plain(dp: bool, brain: bool = False) -> dict:
    """The same training as one loop in one process (torch only).

    With ``brain``: the local steps are SpeechBrain's instead, ``Brain.fit`` of the engine's
    Brain (:class:`~speechbrain_fl.fl.toy.ToyBrain`) on the engine's DataLoader (PaddedBatch
    collation, SpeechBrain's shuffling sampler; one loader per client, made once), everything
    else as the plain loop: what a SpeechBrain user's own FL loop would cost, with no engine.
    """
    import torch

    t = time.perf_counter()
    torch.manual_seed(0)
    model = _mlp()
    data = [_data(1 + pid, EXAMPLES) for pid in range(CLIENTS)]
    if brain:
        import speechbrain as sb
        from speechbrain.dataio.batch import PaddedBatch

        from speechbrain_fl.fl.toy import ToyBrain, _Examples

        sb_brain = ToyBrain(
            modules={"model": model},
            opt_class=lambda params: torch.optim.SGD(params, lr=LR),
            run_opts=RUN_OPTS,
        )
        loaders = []  # (loader, its shuffling sampler, which Brain.fit calls set_epoch on)
        for d in data:
            loader = sb_brain.make_dataloader(
                _Examples(*d), stage=sb.Stage.TRAIN, batch_size=BATCH, shuffle=True,
                collate_fn=PaddedBatch,
            )  # fmt: skip
            loaders.append((loader, sb_brain.train_sampler))
    x_val, y_val = _data(10_000, 256)
    params = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        cohort = range(CLIENTS)
        if dp:
            mask = torch.rand(CLIENTS, generator=gen) < DP["sampling_rate"]
            cohort = [i for i in range(CLIENTS) if mask[i]]
        total = [torch.zeros_like(p) for p in params]
        for pid in cohort:
            with torch.no_grad():
                for p, g in zip(model.parameters(), params, strict=False):
                    p.copy_(g)
            if brain:
                loader, sb_brain.train_sampler = loaders[pid]
                sb_brain.fit(range(1, 2), loader, progressbar=False)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=LR)
                x, y = data[pid]
                order = torch.randperm(EXAMPLES, generator=gen)
                for step in range(EXAMPLES // BATCH):
                    idx = order[step * BATCH : (step + 1) * BATCH]
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                    opt.step()
            delta = [p.detach() - g for p, g in zip(model.parameters(), params, strict=False)]
            if dp:
                norm = torch.sqrt(sum((d**2).sum() for d in delta))
                scale = min(1.0, DP["clip"] / (float(norm) + 1e-12))
                delta = [d * scale for d in delta]
            for s, d in zip(total, delta, strict=False):
                s += d
        if dp:
            denom = DP["sampling_rate"] * CLIENTS
            std = DP["noise_multiplier"] * DP["clip"]
            total = [s + std * torch.randn(s.shape, generator=gen) for s in total]
        else:
            denom = max(len(cohort), 1)
        params = [g + s / denom for g, s in zip(params, total, strict=False)]
        rounds.append(time.perf_counter() - start)
    with torch.no_grad():
        for p, g in zip(model.parameters(), params, strict=False):
            p.copy_(g)
        loss = float(torch.nn.functional.mse_loss(model(x_val), y_val))
    return {
        "rounds": rounds,
        "first_round": rounds[0],
        "loss": loss,
        "run": time.perf_counter() - t,
    }


def run_pfl(dp: bool, accountant: bool = False) -> dict:
    """pfl-research's FederatedAveraging on the same workload (pfl's own simulator).

    ``accountant`` (DP only): after the rounds, the run's epsilon from pfl's own
    ``PLDPrivacyAccountant`` (dp-accounting's PLD, its default 1e-4 grid, connect-the-dots) for
    the same ``(sigma, q, T, delta = 1e-5)``: what a pfl user reporting a guarantee computes,
    like the engine's final PLD.
    """
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return torch.nn.functional.mse_loss(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=True):
            return {"loss": Weighted(float(self.loss(x, y, True)) * len(x), len(x))}

    t = time.perf_counter()
    data = {pid: _data(1 + pid, EXAMPLES) for pid in range(CLIENTS)}
    fed = FederatedDataset(
        lambda uid: Dataset(raw_data=list(data[uid]), user_id=str(uid)),
        get_user_sampler("minimize_reuse", list(range(CLIENTS))),
    )
    net = Net()
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    # pfl draws a fixed cohort; DP: the expected Poisson cohort q K, clip C, noise sigma C.
    cohort = int(DP["sampling_rate"] * CLIENTS) if dp else CLIENTS
    postprocessors = []
    if dp:
        mech = GaussianMechanism(DP["clip"], DP["noise_multiplier"])
        postprocessors.append(CentrallyAppliedPrivacyMechanism(mech))
    backend = SimulatedBackend(training_data=fed, val_data=None, postprocessors=postprocessors)
    rounds: list[float] = []

    class Timer(TrainingProcessCallback):
        def __init__(self):
            self.last = time.perf_counter()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            now = time.perf_counter()
            rounds.append(now - self.last)
            self.last = now
            return False, Metrics()

    timer = Timer()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=ROUNDS,
            evaluation_frequency=10**6,
            train_cohort_size=cohort,
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=LR, local_num_epochs=1, local_batch_size=BATCH
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=256),
        callbacks=[timer],
    )
    out = {"rounds": rounds, "first_round": rounds[0]}
    if dp and accountant:
        from pfl.privacy import PLDPrivacyAccountant

        start = time.perf_counter()
        out["epsilon"] = PLDPrivacyAccountant(
            num_compositions=ROUNDS,
            sampling_probability=DP["sampling_rate"],
            mechanism="gaussian",
            noise_parameter=DP["noise_multiplier"],
            delta=1e-5,
        ).epsilon
        out["accountant_seconds"] = time.perf_counter() - start
    out["run"] = time.perf_counter() - t
    return out


# (label, module, attribute): timed during the steady rounds by ``--breakdown`` (inclusive
# times; a row's children are indented under it).
TIMED = [
    (
        "client: LocalGrid delivery (all below + message copy, RNG restore)",
        "speechbrain_fl.fl.engines.local_grid",
        "LocalGrid._deliver",
    ),
    ("  ClientApp train handler (ours)", "speechbrain_fl.fl.clientapp.train", "train_round"),
    (
        "    decode global tensors (cached per round)",
        "speechbrain_fl.fl.clientapp.train",
        "_global_tensors",
    ),
    ("    load global into model (x2)", "speechbrain_fl.fl.clientapp.train", "load_trainable"),
    ("    local training (Brain.fit)", "speechbrain.core", "Brain.fit"),
    (
        "      DataLoader + PaddedBatch collation",
        "torch.utils.data.dataloader",
        "_BaseDataLoaderIter.__next__",
    ),
    (
        "        of which the collation",
        "speechbrain_fl.fl.clientapp.train",
        "_stacked_padded_batch",
    ),
    ("        of which PaddedBatch (fallback)", "speechbrain.dataio.batch", "PaddedBatch.__init__"),
    ("      fit_batch (forward, backward, step)", "speechbrain.core", "Brain.fit_batch"),
    ("        the Brain's compute_forward", "speechbrain_fl.fl.toy", "ToyBrain.compute_forward"),
    (
        "        the Brain's compute_objectives",
        "speechbrain_fl.fl.toy",
        "ToyBrain.compute_objectives",
    ),
    ("        backward", "torch", "Tensor.backward"),
    ("        Brain.optimizers_step", "speechbrain.core", "Brain.optimizers_step"),
    (
        "          clip_grad_norm_ (SpeechBrain's max_grad_norm)",
        "torch.nn.utils",
        "clip_grad_norm_",
    ),
    ("    delta = local - global", "speechbrain_fl.fl.clientapp.train", "_difference"),
    ("    clip the update (DP)", "speechbrain_fl.fl.clientapp.train", "clip_update"),
    (
        "    encode the reply (npy_codec.encode_record)",
        "speechbrain_fl.fl.clientapp.train",
        "encode_record",
    ),
    ("server: aggregate_train", "speechbrain_fl.fl.serverapp.strategy", "DPFedAvg.aggregate_train"),
    (
        "  decode + check a reply",
        "speechbrain_fl.fl.serverapp.strategy_replies",
        "parse_train_reply",
    ),
    ("  re-clip (DP)", "speechbrain_fl.fl.serverapp.strategy_replies", "clip_update"),
    ("  noise (DP)", "speechbrain_fl.privacy.noise", "GaussianNoise.add"),
    ("server: configure_train", "speechbrain_fl.fl.serverapp.strategy", "DPFedAvg.configure_train"),
    ("  start the noise's draws (DP)", "speechbrain_fl.privacy.noise", "GaussianNoise.prepare"),
    ("server: save state (atomic, fsync)", "speechbrain_fl.fl.serverapp.main", "atomic_torch_save"),
    (
        "server: rounds.csv / plots",
        "speechbrain_fl.fl.serverapp.telemetry",
        "RoundsTelemetry.write_round",
    ),
    (
        "server: per-round epsilon (round_accountant)",
        "speechbrain_fl.fl.serverapp.strategy",
        "DPFedAvg.round_epsilon",
    ),
    ("server: epsilon (accountant)", "speechbrain_fl.fl.serverapp.strategy", "DPFedAvg.epsilon"),
]


def run_breakdown(dp: bool) -> dict:
    """One local run with perf_counter timers around :data:`TIMED` during rounds 3..10.

    Returns the milliseconds per client update of each row, the steady round and the number
    of client updates timed. Timers are plain wrappers (about 1 us a call), no profiler.
    """
    import importlib

    from speechbrain_fl.fl import TaskSpec, run_simulation
    from speechbrain_fl.fl.serverapp import strategy as strategy_module

    totals = {label: 0.0 for label, _, _ in TIMED}
    on, wrapped = [False], set()

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            if not on[0]:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        return wrapper

    for label, module_name, attr in TIMED:
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if hasattr(owner, name) and label not in wrapped:  # the first that exists
            setattr(owner, name, timed(label, getattr(owner, name)))
            wrapped.add(label)
    clients = [0]
    configure = strategy_module.DPFedAvg.configure_train

    def configure_train(self, server_round, *args, **kwargs):
        on[0] = server_round >= 3
        messages = list(configure(self, server_round, *args, **kwargs))
        if on[0]:
            clients[0] += len(messages)
        return messages

    strategy_module.DPFedAvg.configure_train = configure_train
    with tempfile.TemporaryDirectory() as out:
        overrides = {
            "output_folder": out,
            "number_of_rounds": ROUNDS,
            "eval_every": 0,
            "method": "flat" if dp else "fedavg",
            **(DP if dp else {}),
        }
        result = run_simulation(
            TaskSpec(task=f"{HERE}:mlp_task", overrides=overrides), backend="local"
        )
    steady = result.round_seconds[2:]
    per_client = {k: 1000 * v / max(clients[0], 1) for k, v in totals.items()}
    return {
        "per_client_ms": per_client,
        "round_ms": 1000 * statistics.median(steady),
        "all_rounds_per_client_ms": 1000 * sum(steady) / max(clients[0], 1),
        "clients": clients[0],
        "rounds": result.round_seconds,
    }


def child(kind: str, dp: bool) -> None:
    """Run one configuration and print its timings as one JSON line."""
    runners = {
        "local": lambda dp: run_engine(dp, "local"),
        "local_rdp": lambda dp: run_engine(dp, "local", accountant="rdp"),
        "ray": lambda dp: run_engine(dp, "ray"),
        "plain": run_plain,
        "brain": lambda dp: run_plain(dp, brain=True),
        "pfl": run_pfl,
        "pfl_eps": lambda dp: run_pfl(dp, accountant=True),
        "breakdown": run_breakdown,
    }
    out = runners[kind](dp)
    out["since_start"] = time.perf_counter() - T0
    print("RESULT " + json.dumps(out), flush=True)


def measure(kind: str, dp: bool) -> dict | None:
    """Run ``child`` in a fresh interpreter; add the whole wall time."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, HERE, "--child", kind] + (["--dp"] if dp else []),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    whole = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{kind} dp={dp} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    out = json.loads(lines[-1][len("RESULT ") :])
    out["whole"] = whole
    out["load"] = load
    out["steady"] = statistics.median(out["rounds"][2:])
    return out


def breakdown(repeats: int) -> dict:
    """Print the per-client milliseconds of each :data:`TIMED` row (medians of ``repeats``);
    return them by DP setting (``--save``)."""
    saved = {}
    for dp in (False, True):
        runs = [measure("breakdown", dp) for _ in range(repeats)]
        plain = [measure("plain", dp) for _ in range(repeats)]
        runs, plain = [r for r in runs if r], [r for r in plain if r]
        if not runs:
            continue
        loads = [r["load"] for r in runs + plain]
        cohort = CLIENTS * (DP["sampling_rate"] if dp else 1.0)
        print(
            f"\n{'DP' if dp else 'no DP'}: ms per client update, rounds 3-{ROUNDS}, medians of "
            f"{len(runs)} runs (load {min(loads):.1f}-{max(loads):.1f})"
        )
        print("| part | ms per client |\n|---|---|")
        labels = list(dict.fromkeys(label for label, _, _ in TIMED))
        parts = []
        for label in labels:
            value = statistics.median(r["per_client_ms"][label] for r in runs)
            if value > 0:
                depth = (len(label) - len(label.lstrip())) // 2
                parts.append([label.lstrip(), depth, value])
                print(f"| {'. ' * depth}{label.lstrip()} | {value:.2f} |")
        whole = statistics.median(r["all_rounds_per_client_ms"] for r in runs)
        base = statistics.median(1000 * sum(r["rounds"][2:]) for r in plain) / (
            cohort * (ROUNDS - 2)
        )
        print(f"| steady round / client updates (engine) | {whole:.2f} |")
        print(f"| plain loop, same (expected cohort {cohort:g}) | {base:.2f} |")
        saved["dp" if dp else "no_dp"] = {
            "parts": parts, "engine": whole, "plain": base, "runs": len(runs),
            "load_average": [min(loads), max(loads)],
        }  # fmt: skip
    return saved


def pairs(count: int, kinds: list[str]) -> dict:
    """``count`` pairs of fresh processes per DP setting, the two kinds of ``kinds`` in turn.

    Each pair runs both kinds one right after the other, the first of the pair alternating
    from pair to pair, so the machine's drift (on the 2-core VM the figures of
    ``docs/benchmarks.md`` come from, the same run's steady round moved by up to 1.3x within
    minutes) reaches both alike; the figure is the median over the pairs of each pair's ratio
    (first kind / second), with the pairs' range, for the steady round and the whole run. A
    kind that does not apply to a setting (``pfl_eps`` without DP) is replaced by ``pfl``
    there. Returns the figures by DP setting (``--save``).
    """
    first, second = kinds
    saved = {}
    for dp in (False, True):
        names = [k if dp or k != "pfl_eps" else "pfl" for k in (first, second)]
        rows = []
        for i in range(count):
            order = names if i % 2 == 0 else names[::-1]
            runs = {kind: measure(kind, dp) for kind in order}
            if any(r is None for r in runs.values()):
                continue
            a, b = runs[names[0]], runs[names[1]]
            rows.append((a, b))
            print(
                f"  pair {i} {'DP' if dp else 'no DP'}: steady {1000 * a['steady']:.1f} / "
                f"{1000 * b['steady']:.1f} ms = {a['steady'] / b['steady']:.3f}, whole "
                f"{a['whole']:.2f} / {b['whole']:.2f} s = {a['whole'] / b['whole']:.3f} "
                f"(load {a['load']:.1f})",
                flush=True,
            )
        if not rows:
            continue
        print(
            f"{'DP' if dp else 'no DP'}, {names[0]} / {names[1]}, {len(rows)} pairs, "
            f"{ROUNDS} rounds each (steady: median of rounds 3-{ROUNDS})"
        )
        print("| | first kind | second kind | ratio, median of pairs (range) |\n|---|---|---|---|")
        figures = saved.setdefault("dp" if dp else "no_dp", {"kinds": names, "pairs": len(rows)})
        for key, unit, scale in (("steady", "ms", 1000), ("whole", "s", 1)):
            ratios = [a[key] / b[key] for a, b in rows]
            figures[key] = {
                "first": statistics.median(a[key] for a, _ in rows),
                "second": statistics.median(b[key] for _, b in rows),
                "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            }  # fmt: skip
            print(
                f"| {key} | {scale * statistics.median(a[key] for a, _ in rows):.2f} {unit} | "
                f"{scale * statistics.median(b[key] for _, b in rows):.2f} {unit} | "
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
            )
    return saved


def save_json(path, figures: dict) -> None:
    """A mode's figures as JSON, with the command and the machine (``benchmarks/figures.py``
    renders the docs' tables and the README's summary from these files)."""
    import platform

    import torch

    out = {
        "command": "python benchmarks/fl_overhead.py " + " ".join(sys.argv[1:]),
        "rounds": ROUNDS,
        "machine": f"{os.cpu_count()}-core {platform.machine()}, no GPU, torch {torch.__version__}",
        **figures,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="plain,brain,local,ray,pfl")
    parser.add_argument("--child", default=None)
    parser.add_argument("--dp", action="store_true")
    parser.add_argument(
        "--breakdown", action="store_true", help="time the parts of a steady round (local)"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="run this many interleaved pairs of the two --kinds per DP setting (see pairs())",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"rounds per run (default {ROUNDS})"
    )
    parser.add_argument("--save", default=None, help="write the medians to this JSON file")
    args = parser.parse_args()
    if args.rounds is not None:
        if args.rounds < 4:
            parser.error(f"--rounds {args.rounds}: the steady round needs >= 4 rounds")
        os.environ["SB_FL_BENCH_ROUNDS"] = str(args.rounds)  # read by the child processes
        globals()["ROUNDS"] = args.rounds
    if args.child:
        child(args.child, args.dp)
        return
    if args.breakdown:
        saved = breakdown(args.repeats)
        if args.save:
            save_json(args.save, {"repeats": args.repeats, "settings": saved})
        return
    if args.pairs:
        kinds = args.kinds.split(",")
        if len(kinds) != 2:
            parser.error(f"--pairs compares two kinds, got --kinds {args.kinds!r}")
        saved = pairs(args.pairs, kinds)
        if args.save:
            save_json(args.save, {"settings": saved})
        return
    kinds = args.kinds.split(",")
    if any(k.startswith("pfl") for k in kinds):
        try:
            import pfl  # noqa: F401
        except ImportError:
            print("pfl-research not installed (pip install pfl): skipped")
            kinds = [k for k in kinds if not k.startswith("pfl")]
    runs: dict = {}
    for rep in range(args.repeats):  # interleaved, so load changes hit every kind alike
        for dp in (False, True):
            for kind in kinds:
                if kind == "pfl_eps" and not dp:
                    continue  # pfl's run without DP has no epsilon: the same run as pfl
                res = measure(kind, dp)
                if res is not None:
                    runs.setdefault((kind, dp), []).append(res)
                    print(
                        f"  rep {rep} {kind:6s} dp={dp!s:5s} whole {res['whole']:6.2f} s "
                        f"steady {res['steady']:.3f} s (load {res['load']:.1f})",
                        flush=True,
                    )
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("whole", "steady")}
        for k, v in runs.items()
    }
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    loads = [r["load"] for v in runs.values() for r in v]
    print(
        f"\n{args.repeats} runs each, medians; load average {min(loads):.1f}-{max(loads):.1f} "
        f"at the runs' starts, {load[0]:.1f} at the end; {os.cpu_count()} CPUs"
    )
    if args.save:
        save_json(args.save, {
            "repeats": args.repeats, "load_average": [min(loads), max(loads)],
            "runs": {f"{kind}{',dp' if dp else ''}": {**m, "runs": len(runs[(kind, dp)])}
                     for (kind, dp), m in med.items()},
        })  # fmt: skip
    print("| | whole run | vs plain | steady round | vs plain |\n|---|---|---|---|---|")
    for (kind, dp), m in med.items():
        if kind == "pfl_eps" and not dp:
            continue  # the same run as pfl without DP (no epsilon to compute)
        base = med.get(("plain", dp))
        rw = f"{m['whole'] / base['whole']:.1f}x" if base else "-"
        rs = f"{m['steady'] / base['steady']:.1f}x" if base else "-"
        print(
            f"| {kind}{', DP' if dp else ''} | {m['whole']:.2f} s | {rw} | "
            f"{m['steady'] * 1000:.0f} ms | {rs} |"
        )
    losses = {dp: [r["loss"] for r in runs.get(("plain", dp), [])] for dp in (False, True)}
    if losses[False] or losses[True]:
        print(
            "plain loop's final validation loss: "
            + ", ".join(f"{'DP' if dp else 'no DP'} {v[0]:.4f}" for dp, v in losses.items() if v)
        )
        if any(not math.isfinite(x) for v in losses.values() for x in v):
            print("WARNING: a plain run diverged (non-finite loss): its timings are not of FedAvg")
    eps_runs = runs.get(("pfl_eps", True))
    if eps_runs:
        print(
            "pfl_eps DP: epsilon "
            f"{eps_runs[0]['epsilon']} from pfl's PLDPrivacyAccountant, computed in "
            f"{statistics.median(r['accountant_seconds'] for r in eps_runs):.2f} s (median)"
        )
    for kind in ("local", "local_rdp", "ray"):
        for dp in (False, True):
            eng = runs.get((kind, dp))
            if not eng:
                continue
            keys = ("import_pkg", "imports", "ray_start_stop", "first_round", "after_rounds")
            parts = {k: statistics.median(r[k] for r in eng) for k in keys}
            print(
                f"{kind}{' DP' if dp else ''} breakdown (medians): "
                + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
                + f", epsilon {eng[0]['epsilon']}"
            )


if __name__ == "__main__":
    main()
