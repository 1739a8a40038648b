"""A round's replies, as the server strategy takes them: one checked, re-clipped update per node.

:class:`ReplyCollectionMixin` holds the methods of :class:`~speechbrain_fl.fl.serverapp.strategy.DPFedAvg`
for steps 1-3 of a round (:mod:`speechbrain_fl.fl.serverapp.strategy`):

1. take one reply per sampled node, reject faulty ones (:mod:`speechbrain_fl.fl.serverapp.replies`), each with a log line;
   a reply whose ``partition-id`` differs from the node's answer to the server's query is
   refused, as are replies of refused, unsampled or already answered nodes;
2. a non-private round with fewer than ``min_clients`` valid replies -> :class:`RoundFailed` (the
   server may re-sample it); a private round is *always* released, whoever replied (possibly
   nobody): every Poisson draw is one application of the sampled Gaussian mechanism, and a
   re-sampled round would release a cohort that is no longer Poisson(q);
3. re-clip: u_i <- clip(u_i, C_l) per group, so a client that skipped clipping cannot raise the
   sensitivity above C (contract 3).

Every per-reply check (format, claims, re-clipping) runs inside one guard: a bad reply is dropped
with one log line naming the node and the reason, counted in ``RoundReport.num_dropped``, and the
round goes on. The updates are sorted by partition id, so the float sum of the aggregation does
not depend on the order the replies arrived in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import WARNING
from typing import Any

import torch
from flwr.app import Message
from flwr.common.logger import log

from speechbrain_fl.fl.aggregate.round_report import (
    RoundFailed,
    RoundReport,
    cohort_report,
    mean_or_none,
)
from speechbrain_fl.fl.aggregate.update import ClientUpdate
from speechbrain_fl.fl.serverapp.replies import (
    BufferPool,
    ReplyLimits,
    ReplyRejected,
    parse_train_reply,
)
from speechbrain_fl.fl.settings.config import FLConfig
from speechbrain_fl.privacy import Layout, clip_update

__all__ = ["ReplyCollectionMixin"]


class ReplyCollectionMixin:
    """Steps 1-3 of a DP strategy's round: collect, check and re-clip the replies.

    Mixed into :class:`~speechbrain_fl.fl.serverapp.strategy.DPFedAvg`, which sets the attributes
    annotated below in its ``__init__`` and ``configure_train``.
    """

    config: FLConfig
    layout: Layout
    rule: Any
    population_size: int | None
    partition_sizes: list[int] | None
    depth_names: dict[int, frozenset[str]] | None
    require_depth: bool
    refused_nodes: dict[int, str]
    node_order: dict[int, int]
    cohort: list[int]
    population: int
    last_report: RoundReport | None
    _reply_pool: BufferPool

    def reply_limits(self, global_params: Mapping[str, torch.Tensor]) -> ReplyLimits:
        """What a reply's claims are checked against this round (:mod:`speechbrain_fl.fl.serverapp.replies`)."""
        return ReplyLimits(
            depth_names=self.depth_names,
            require_depth=self.require_depth,
            partition_sizes=self.partition_sizes,
            max_num_examples=self.config.max_num_examples,
            max_update_norm=self.config.max_update_norm,
            dtypes={k: v.dtype for k, v in global_params.items()},
        )

    def _parse(self, message: Message, shapes, limits: ReplyLimits) -> ClientUpdate:
        """One reply -> a checked update (format, claims, partition), or :class:`ReplyRejected`."""
        node = message.metadata.src_node_id
        update = parse_train_reply(
            message,
            expected_shapes=shapes,
            allow_partial=bool(getattr(self.rule, "accepts_partial", False)),
            limits=limits,
            pool=self._reply_pool,
        )
        claimed = update.metrics.get("partition-id")
        known = self.node_order.get(node)
        if known is not None and claimed is not None and int(claimed) != known:
            raise ReplyRejected(
                f"node {node}: partition-id={claimed:g} differs from the partition-id={known} "
                "it answered to the server's query"
            )
        return update

    def _collect_replies(
        self,
        server_round: int,
        replies: Iterable[Message],
        global_params: Mapping[str, torch.Tensor],
        budgets: float | dict[str, float] | None,
    ) -> tuple[list[ClientUpdate], RoundReport]:
        """Steps 1 and 3: one checked, re-clipped update per sampled node, and the report."""
        shapes = {k: tuple(v.shape) for k, v in global_params.items()}
        limits = self.reply_limits(global_params)
        updates: list[ClientUpdate] = []
        failures: list[str] = []
        ignored: list[str] = []
        sampled, replied = set(self.cohort), set()
        dropped = 0
        for message in replies:
            node = message.metadata.src_node_id
            if node in self.refused_nodes:
                ignored.append(f"node {node}: refused ({self.refused_nodes[node]}), reply dropped")
                continue
            if node not in sampled:
                ignored.append(f"node {node}: not sampled this round, reply ignored")
                continue
            if node in replied:
                ignored.append(f"node {node}: a second reply this round, ignored")
                continue
            replied.add(node)
            try:
                update = self._parse(message, shapes, limits)
                if budgets is not None:  # server-side enforcement of the budgets (contract 3)
                    update.delta, _ = clip_update(
                        update.delta, budgets, layout=self.layout, inplace=True
                    )
                updates.append(update)
            except ReplyRejected as err:
                failures.append(str(err))
                dropped += 1
            except Exception as err:  # defence in depth: no reply may crash the round
                failures.append(f"node {node}: unreadable reply ({type(err).__name__}: {err})")
                dropped += 1
        for node in sorted(sampled - replied):
            failures.append(f"node {node}: no reply within {self.config.round_timeout:g} s")
        for reason in failures + ignored:
            log(WARNING, "round %d: dropped %s", server_round, reason)
        # a fixed summation order makes the float sum independent of reply arrival order
        updates.sort(key=lambda u: (u.metrics.get("partition-id", u.node_id), u.node_id))
        report = cohort_report(
            self,
            server_round,
            updates,
            failures,
            train_loss=mean_or_none(
                [u.metrics["train-loss"] for u in updates if "train-loss" in u.metrics]
            ),
            ignored=ignored,
            num_dropped=dropped,
        )
        return updates, report

    def _enforce_min_clients(self, report: RoundReport, updates: list[ClientUpdate]) -> None:
        """Step 2: a non-private round short of ``min_clients`` fails; a private one goes on."""
        if len(updates) >= self.config.min_clients:
            return
        summary = (
            f"round {report.round}: {len(updates)} valid replies from a cohort of "
            f"{len(self.cohort)} ({self.population} connected), fewer than min_clients="
            f"{self.config.min_clients}"
        )
        if not self.config.private:
            report.round_failed = summary
            self.last_report = report
            raise RoundFailed(summary)
        log(
            WARNING,
            "%s; released anyway (noise and an accountant step): a private run releases "
            "every Poisson draw",
            summary,
        )
