"""The server state holds what resume needs, not the run's history: its size does not grow.

The per-round history (budgets, telemetry) goes to the output folder's files; the state keeps
the global model, the accountant, the EMA statistics, the RNG streams and the last round's
pending outputs. The fixed seeds are for tests only.
"""

from __future__ import annotations

import pytest

from speechbrain_fl.fl import TaskSpec, run_simulation
from speechbrain_fl.fl.dp.budget_log import BudgetLog
from speechbrain_fl.fl.serverapp.state import STATE_FILE

DP = {"num_partitions": 3, "seed": 0, "eval_every": 0, "method": "pfl_dim_ema", "clip": 0.5,
      "noise_multiplier": 0.8, "sampling_rate": 1.0, "noise_seed": 1, "sampler_seed": 2,
      "ema_warmup_rounds": 1}  # fmt: skip


def _state_size(tmp_path, rounds):
    out = tmp_path / f"rounds_{rounds}"
    spec = TaskSpec("speechbrain_fl.fl.toy:toy_task", None,
                    {**DP, "number_of_rounds": rounds, "output_folder": str(out)})  # fmt: skip
    result = run_simulation(spec, backend="local")
    assert result.last_round == rounds
    # the budgets of every round are in budgets.csv, and the result and report read them there
    assert len(BudgetLog(out).read()) == rounds == len(result.round_budgets)
    assert result.privacy["rounds"] == rounds
    return (out / STATE_FILE).stat().st_size


@pytest.mark.slow
def test_state_size_does_not_grow_with_the_rounds(tmp_path):
    short, long = _state_size(tmp_path, 3), _state_size(tmp_path, 30)
    assert abs(long - short) <= 16, (short, long)
