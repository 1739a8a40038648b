"""Configuration of a federated run (the ``# Federated`` and ``# Privacy`` YAML sections).

:class:`FLConfig` is a plain dataclass, built from a recipe's hparams by
:meth:`FLConfig.from_hparams` (the one mapping from the YAML vocabulary, :data:`YAML_KEYS`) or
from field names by :meth:`FLConfig.from_dict`; both refuse a bad value naming the key. A run
is private when ``noise_multiplier > 0``; the other decisions are in :class:`FLConfig`'s notes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speechbrain_fl.fl.settings.checks import check_config
from speechbrain_fl.privacy import FedAvg, PrivacyMethod, get_budget_method, privacy_method

__all__ = ["FLConfig", "YAML_KEYS", "ema_base_of"]

logger = logging.getLogger(__name__)


def ema_base_of(method: str) -> str | None:
    """The base allocation ("dim" or "uniform") an adaptive (EMA) budget method starts from.

    Read from the budget registry (``speechbrain_fl/privacy/budgets.py``), so a method
    registered with ``register_budget_method(..., ema_base=...)`` gets the server's EMA state
    like the built-in ``pfl_dim_ema`` and ``pfl_unif_ema``; None for a static method, for
    ``fedavg`` and for a name that is not registered.

    Example
    -------
    >>> ema_base_of("pfl_unif_ema"), ema_base_of("flat"), ema_base_of("fedavg")
    ('uniform', None, None)
    """
    try:
        return get_budget_method(method).ema_base
    except ValueError:
        return None


# YAML key -> FLConfig field, for every key whose name differs; every other field is read under
# its own name (``sampling_rate``, ``clip``, ``delta``, ...).
YAML_KEYS = {"number_of_rounds": "num_rounds"}


@dataclass
class FLConfig:
    """Settings of one federated run.

    Arguments
    ---------
    output_folder : str
        Where ``rounds.csv``, ``group_norms.csv`` and the server state go.
    num_rounds : int
        Number of training rounds T.
    sampling_rate : float
        Poisson rate q; the expected cohort is n = qK.
    min_clients : int
        Fewest valid replies for a round to be aggregated.
    local_epochs : int
        Epochs of ``brain.fit`` per client per round.
    noise_multiplier : float
        sigma of the Gaussian mechanism; 0 disables noise and accounting.
    clip : float, optional
        Total clip norm C; ``None`` disables clipping (non-private runs only).
    method : str
        Budget allocator of :func:`speechbrain_fl.privacy.compute_budgets`.
    alpha : float, optional
        Encoder fraction for ``alpha_split``.
    ema_beta, ema_gamma : float
        EMA rate and exponent for the ``*_ema`` methods.
    ema_warmup_rounds : int
        Rounds the EMA budgets stay at their base weights.
    ema_signal : str
        ``noisy`` (post-processing, default) or ``raw`` (client norms, outside DP).
    delta : float
        Target delta of the accountant.
    accountant : str
        Accountant name passed to :class:`speechbrain_fl.privacy.PrivacyAccountant`: ``pld``
        (default, dp-accounting's PLD), ``rdp`` (Opacus; always reported beside it as
        ``epsilon_rdp``) or ``prv``. The guarantee: results.json's ``privacy.epsilon``, the
        ``max_epsilon`` stop and the audit's ``accountant_epsilon`` use it.
    round_accountant : str
        The accountant of the *running* figure after each round (``rounds.csv``'s ``epsilon``,
        the ``train_log.txt`` line, the progress line, the strategy's round metrics); default
        ``rdp`` (our choice): Opacus's RDP upper bound, the PLD's at the recipes' settings within
        ~10% above it (tests/unit/test_accounting_round_figure.py), at a fraction of the cost of
        the PLD's self-composition, which grows with the rounds. Every figure it produces is
        labelled with its accountant (``epsilon_rdp`` in the log line, ``eps (rdp)`` in the
        progress line); ``round_accountant: pld`` gives the per-round PLD figure as before.
    audit_canaries : int
        Canary clients of the empirical privacy audit (:mod:`speechbrain_fl.privacy.audit`);
        0 (default) is off. Private runs only: each canary is drawn by the run's Poisson
        sampler and, when inserted, adds a fixed random direction of norm ``C``.
    max_epsilon : float, optional
        The run stops before a round that would exceed it.
    noise_cohort_size : int, optional
        M, a simulated deployment's expected cohort (ours, after pfl-research's option of the
        same name): the noise on the mean of the n clipped updates has std ``sigma C / M``
        instead of ``sigma C / n`` (on their sum ``sigma C n / M``), the utility of a round of
        M clients. ``None`` (default): the real mechanism. Private runs only; needs
        ``accounting_population``.
    accounting_population : int, optional
        N >= M, the simulated deployment's population: the accountant uses ``q = M / N`` for
        the same number of rounds (:attr:`accounting_sampling_rate`), so epsilon, the
        ``max_epsilon`` stop and the privacy report are the deployment's, labelled as such;
        they do not bound what this run's clients leak. Required with ``noise_cohort_size``.
    aggregation : str or callable, optional
        ``uniform``, ``weighted`` or a rule (see :mod:`speechbrain_fl.fl.aggregate.rules`).
    eval_every : int
        Server-side evaluation period in rounds (round 0 is always evaluated); 0 disables.
    round_timeout : float
        Seconds to wait for replies.
    max_retries : int
        Times a round with fewer than ``min_clients`` valid replies is re-sampled.
    seed : int, optional
        Seed of the clients' per-round training seeds, and of the cohort sampler of a
        non-private run; ``None`` seeds from the OS.
    noise_seed : int, optional
        Seed of the noise generator; for tests only (warns, recorded in results.json).
    population_size : int, optional
        The declared population K of a private run (n = qK in the noise and the accountant);
        default the number of partitions. Fewer connected nodes only warn.
    sampler_seed : int, optional
        Seed of a private run's cohort sampler; for tests only (warns, recorded). Private runs
        otherwise draw it from the OS; ``seed`` then seeds only the clients' training.
    backend : str
        Simulation backend of :func:`speechbrain_fl.fl.engines.run.run_simulation`: ``local`` (one
        process, the default on one machine) or ``ray`` (Flower's Ray backend, for clusters);
        a ``ray_address`` given to the engine selects ``ray``. Not used by ``flwr run``.
    record_norms : bool
        A run without clipping (FedAvg) still has its clients report their update's per-group
        and per-component norms (nothing is clipped), for the telemetry and Fig. 2.
    max_num_examples : int, optional
        The largest ``num-examples`` a reply may declare when the server does not know the
        partition sizes (deployment); a reply above it is dropped (:mod:`speechbrain_fl.fl.serverapp.replies`).
    max_update_norm : float, optional
        Non-private runs: a reply whose update has a larger L2 norm is dropped (a guard of
        FedAvg against absurd updates; off by default). A private run's ``clip`` bounds every
        update already, so it is refused there.
    node_partitions : dict of int to int, optional
        Deployment: the binding of authenticated SuperNode ids to partition ids (one node per
        partition). Only these nodes are sampled, and a node must answer the partition it is
        bound to (docs/fl_engine.md "Identity in deployment"). ``None``: partitions are
        self-declared; a partition id claimed by a second node is still refused.
    secure_aggregation : str, optional
        ``secaggplus``: every round's training goes through Flower's SecAgg+, the server learns
        only the sum of the clipped, integer-encoded updates and adds the noise after
        unmasking (:mod:`speechbrain_fl.fl.secagg.train_stage`); ``None`` (default): the
        central trust model, the server sees and re-clips every update. The options that
        need one client's update are refused (:mod:`speechbrain_fl.fl.settings.secagg`).
    secagg_num_shares : int or float
        SecAgg+'s shares per client (a float: a share of the cohort; default 1.0, all).
    secagg_reconstruction_threshold : int or float
        Shares needed to reconstruct a secret (a float: a share of the shares; default 0.7).
    secagg_clipping_range : float, optional
        Secure aggregation without a clip: the box [-c, c] each coordinate is cut to before
        the integer encoding (with a clip the box comes from the clip budgets).
    clip_quantile : float, optional
        Adaptive clipping (Andrew et al. 2021): the target fraction gamma of clients whose
        update is within the clip; each pool's clip moves towards that quantile of the
        clients' norms from the noisy count of their bits, starting at ``clip``
        (:mod:`speechbrain_fl.fl.dp.adaptive`); ``None`` (default) keeps a fixed clip.
    clip_quantile_lr : float
        eta_C of the geometric clip update ``C <- C exp(-eta_C (b - gamma))`` (default 0.2).
    clip_count_stddev : float, optional
        sigma_b, the std of the Gaussian noise on each pool's count of bits; default
        ``n / 20`` for the expected cohort n. The update's noise multiplier is raised so that
        update and count together spend ``noise_multiplier``.

    Notes
    -----
    - ``aggregation=None`` picks ``uniform`` (sum / n, n = qK) for a private run and ``weighted``
      (FedAvg's num-examples mean) otherwise.
    - A run is *private* when ``noise_multiplier > 0`` (:attr:`FLConfig.private`, the only
      definition): it then needs ``clip``, gets an accountant and reports epsilon. The YAML
      ``method`` is a :mod:`speechbrain_fl.privacy.methods` class that checks its own settings;
      ``FedAvg`` clips nothing and adds no noise. A clipping method with ``noise_multiplier: 0`` is
      a well-defined *non-private* run: updates are clipped to the method's budgets, no noise is
      added, no epsilon is reported (``None``, never ``Infinity``), and :meth:`from_hparams` logs a
      warning saying so.
    - ``noise_cohort_size`` (M) and ``accounting_population`` (N) simulate a large deployment, as
      pfl-research's ``noise_cohort_size`` does (our keys): the n clients of this run are trained
      with the noise of a cohort of M (std ``sigma C / M`` on their mean) and accounted at the
      deployment's sampling rate ``q = M / N``. The epsilon is then that of the simulated
      deployment, not of this run's clients, and every output that shows it says so
      (:mod:`speechbrain_fl.fl.dp.disclosure`).
    - ``ema_signal="noisy"`` (default) feeds the EMA budgets with the noisy aggregate
      (post-processing, inside the DP guarantee); ``"raw"`` uses the mean of the clients' reported
      pre-clip norms, as in the paper's experiments, and warns that it is outside the guarantee.

    Example
    -------
    >>> cfg = FLConfig.from_dict({"output_folder": "out", "num_rounds": 2})
    >>> cfg.private, cfg.aggregation_rule_name
    (False, 'weighted')
    """

    output_folder: str
    num_rounds: int = 3
    sampling_rate: float = 1.0
    min_clients: int = 1
    local_epochs: int = 1
    noise_multiplier: float = 0.0
    clip: float | None = None
    method: str = "flat"
    alpha: float | None = None
    ema_beta: float = 0.2
    ema_gamma: float = 0.75
    ema_warmup_rounds: int = 3
    ema_signal: str = "noisy"
    delta: float = 1e-5
    accountant: str = "pld"
    round_accountant: str = "rdp"
    audit_canaries: int = 0
    max_epsilon: float | None = None
    noise_cohort_size: int | None = None
    accounting_population: int | None = None
    aggregation: Any = None
    eval_every: int = 1
    round_timeout: float = 600.0
    max_retries: int = 0
    seed: int | None = None
    noise_seed: int | None = None
    population_size: int | None = None
    sampler_seed: int | None = None
    backend: str = "local"
    record_norms: bool = False
    max_num_examples: int | None = None
    max_update_norm: float | None = None
    node_partitions: dict[int, int] | None = None
    secure_aggregation: str | None = None
    secagg_num_shares: int | float = 1.0
    secagg_reconstruction_threshold: int | float = 0.7
    secagg_clipping_range: float | None = None
    clip_quantile: float | None = None
    clip_quantile_lr: float = 0.2
    clip_count_stddev: float | None = None

    def __post_init__(self) -> None:
        check_config(self, hparams_keys={field: key for key, field in YAML_KEYS.items()})

    @property
    def private(self) -> bool:
        """Return whether the run adds noise and accounts for privacy."""
        return self.noise_multiplier > 0

    @property
    def simulated_deployment(self) -> bool:
        """Return whether the noise and the accountant are those of a simulated deployment."""
        return self.noise_cohort_size is not None

    @property
    def accounting_sampling_rate(self) -> float:
        """The accountant's q: ``M / N`` of a simulated deployment, else ``sampling_rate``.

        Example
        -------
        >>> FLConfig(output_folder="o", noise_multiplier=0.5, clip=1.0, noise_cohort_size=1000,
        ...          accounting_population=100000).accounting_sampling_rate
        0.01
        """
        if self.noise_cohort_size is None:
            return self.sampling_rate
        return self.noise_cohort_size / self.accounting_population

    @property
    def aggregation_rule_name(self) -> str:
        """Return the rule name, resolving the ``None`` default."""
        if self.aggregation is None:
            return "uniform" if self.private or self.secure_aggregation else "weighted"
        return self.aggregation if isinstance(self.aggregation, str) else "custom"

    @classmethod
    def yaml_keys(cls) -> set[str]:
        """The hparams keys :meth:`from_hparams` reads.

        Example
        -------
        >>> {"number_of_rounds", "method", "clip"} <= FLConfig.yaml_keys()
        True
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        return (fields - set(YAML_KEYS.values())) | set(YAML_KEYS)

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any], **changes: Any) -> FLConfig:
        """Build from a recipe's hparams (YAML vocabulary; other keys are ignored).

        Arguments
        ---------
        hparams : mapping
            Loaded hparams; the keys of :data:`YAML_KEYS` and the fields named alike are read,
            the rest (model, data, logging keys) ignored. ``method`` is a
            :class:`~speechbrain_fl.privacy.methods.PrivacyMethod` built by the YAML
            (``!new:speechbrain_fl.privacy.methods.Flat``; default ``FedAvg()``), or the
            registered name of one (``--method flat``), built from the hparams' keys; its own
            settings (``clip``, ``noise_multiplier``, ``alpha``, the EMA keys) are the ones read
            and checked (:meth:`~speechbrain_fl.privacy.methods.PrivacyMethod.check`).
        **changes
            FLConfig fields to set after the mapping (e.g. ``output_folder`` of a profiling run).

        Returns
        -------
        FLConfig

        Example
        -------
        >>> cfg = FLConfig.from_hparams({"output_folder": "o", "number_of_rounds": 5,
        ...     "method": "alpha_split", "alpha": 0.1, "clip": 1.0, "noise_multiplier": 0.5,
        ...     "lr": 0.1})
        >>> cfg.num_rounds, cfg.method, cfg.private, cfg.aggregation_rule_name
        (5, 'alpha_split', True, 'uniform')
        >>> FLConfig.from_hparams({"output_folder": "o", "method": "fedavg", "clip": 3.0}).clip
        >>> from speechbrain_fl.privacy import PFLDimEMA
        >>> cfg = FLConfig.from_hparams({"output_folder": "o", "clip": 3.0,
        ...     "method": PFLDimEMA(clip=1.0, noise_multiplier=0.5, ema_warmup_rounds=1)})
        >>> cfg.method, cfg.clip, cfg.ema_warmup_rounds
        ('pfl_dim_ema', 1.0, 1)
        """
        method = hparams.get("method", FedAvg())
        if isinstance(method, str):  # a hand-built mapping may name a registered method
            method = privacy_method(method, **hparams)
        if not isinstance(method, PrivacyMethod):
            raise ValueError(f"method: {method!r} must be a speechbrain_fl.privacy.methods "
                             "object or a registered method name")  # fmt: skip
        method.check()
        keys = cls.yaml_keys()
        values = {YAML_KEYS.get(k, k): v for k, v in {**hparams, **method.settings()}.items()
                  if k in keys}  # fmt: skip
        values.pop("method")
        if method.clips:  # FedAvg's FLConfig has no clip, noise or method of its own
            values["method"] = method.name
        sigma = values.get("noise_multiplier") or 0.0
        if method.clips and sigma == 0:
            logger.warning(
                "method: %s with noise_multiplier: 0 clips the updates but adds no noise: "
                "a non-private run (no epsilon is reported)",
                method.name,
            )
        if not sigma and values.get("audit_canaries"):
            logger.warning(
                "audit_canaries: %s is ignored: the audit checks a private run's epsilon and "
                "this run (noise_multiplier: 0) has none",
                values["audit_canaries"],
            )
            values["audit_canaries"] = 0
        if values.get("noise_cohort_size") is not None and values.get("audit_canaries"):
            logger.warning(
                "audit_canaries: %s is ignored with noise_cohort_size: %s: the audit tests this "
                "run's mechanism, the accountant gives the simulated deployment's epsilon",
                values["audit_canaries"],
                values["noise_cohort_size"],
            )
            values["audit_canaries"] = 0
        values.update(changes)
        return cls(**values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FLConfig:
        """Build from a hparams mapping, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"federated config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**dict(values))
