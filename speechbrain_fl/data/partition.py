"""Client partitions of a SpeechBrain CSV manifest: speaker-based and IID.

- ``speaker``: every speaker belongs to exactly one client. With ``num_clients=None`` each
  speaker is a client (the alpha-split paper's K=316 clients on MLS). With ``num_clients=K``
  speakers are shuffled (seeded) and assigned greedily to the client holding the fewest
  utterances so far (longest-processing-time balancing); with ``stratify_by_language=True`` the
  K clients are first shared among languages in proportion to their speaker counts (largest
  remainder, at least one per language), so no client mixes languages.
- ``iid``: utterances are shuffled (seeded) and cut into K near-equal parts.

Every utterance lands in exactly one client, and the same manifest, method and seed give the
same partition. ``write_partition`` writes one manifest per client (same columns as the input),
``partition.json`` (method, seed, counts, client -> speakers) and ``partition_stats.csv/.md``:
per language, the clients, utterances, hours and hours per client (like the alpha-split paper's
Table VI), then one row per client.

Hand-written rather than taken from ``flwr-datasets``: its partitioners work on Hugging Face
``datasets`` objects, while the recipes hold SpeechBrain CSV manifests.

Example
-------
>>> rows = [{"ID": f"u{i}", "spk_id": f"s{i % 3}", "language": "en", "duration": "1.0"}
...         for i in range(9)]
>>> part = speaker_partition(rows, seed=0)
>>> sorted(len(ids) for ids in part.values())
[3, 3, 3]
"""

from __future__ import annotations

import csv
import json
import os

import numpy as np

__all__ = [
    "read_manifest",
    "speaker_partition",
    "iid_partition",
    "partition_manifest",
    "write_partition",
    "load_partition",
    "PARTITION_FILE",
]

PARTITION_FILE = "partition.json"


def read_manifest(path: str) -> list[dict]:
    """Read a SpeechBrain CSV manifest into a list of row dicts (needs ``ID`` and ``spk_id``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"manifest {path!r} does not exist")
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = {"ID", "spk_id"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"manifest {path!r} lacks column(s) {sorted(missing)}")
        rows = list(reader)
    seen = set()
    for row in rows:
        if row["ID"] in seen:
            raise ValueError(f"manifest {path!r} has duplicate ID {row['ID']!r}")
        seen.add(row["ID"])
    return rows


def _client_name(index: int) -> str:
    return f"client_{index:04d}"


def _group(speaker_sizes: list[tuple[str, int]], k: int, rng) -> list[list[str]]:
    """Assign speakers to k bins: seeded shuffle, then greedy fill of the lightest bin."""
    order = rng.permutation(len(speaker_sizes))
    speakers = [speaker_sizes[i] for i in order]
    speakers.sort(key=lambda s: -s[1])  # stable: ties keep the shuffled order
    bins, loads = [[] for _ in range(k)], [0] * k
    for spk, size in speakers:
        j = int(np.argmin(loads))
        bins[j].append(spk)
        loads[j] += size
    return [sorted(b) for b in bins]


def _share(counts: dict[str, int], k: int) -> dict[str, int]:
    """Share k clients among languages by speaker count (largest remainder, >= 1 each)."""
    langs = sorted(counts)
    if k < len(langs):
        raise ValueError(
            f"num_clients={k} < {len(langs)} languages: cannot stratify by language {langs}"
        )
    total = sum(counts.values())
    quota = {lang: 1 + (k - len(langs)) * counts[lang] / total for lang in langs}
    share = {lang: min(int(quota[lang]), counts[lang]) for lang in langs}
    rest = k - sum(share.values())
    for lang in sorted(langs, key=lambda g: (-(quota[g] - int(quota[g])), g)) * k:
        if rest == 0:
            break
        if share[lang] < counts[lang]:
            share[lang] += 1
            rest -= 1
    if rest:
        raise ValueError(f"num_clients={k} exceeds the {total} speakers available")
    return share


def speaker_partition(
    rows: list[dict],
    *,
    num_clients: int | None = None,
    seed: int = 0,
    stratify_by_language: bool = False,
) -> dict[str, list[str]]:
    """Partition utterances by speaker.

    Arguments
    ---------
    rows : list of dict
        Manifest rows with ``ID``, ``spk_id`` (and ``language`` when stratifying).
    num_clients : int or None
        None: one client per speaker; otherwise speakers are grouped into this many clients.
    seed : int
        Random seed for the grouping.
    stratify_by_language : bool
        Keep each client within one language.

    Returns
    -------
    dict
        ``{client_name: [utterance IDs]}``, client names ``client_0000``... in a fixed order.
    """
    by_speaker: dict[str, list[str]] = {}
    speaker_lang: dict[str, str] = {}
    for row in rows:
        by_speaker.setdefault(row["spk_id"], []).append(row["ID"])
        speaker_lang.setdefault(row["spk_id"], row.get("language", ""))
    if not by_speaker:
        raise ValueError("cannot partition an empty manifest")
    speakers = sorted(by_speaker, key=lambda s: (speaker_lang[s], s))
    if num_clients is None:
        groups = [[s] for s in speakers]
    else:
        if not 1 <= num_clients <= len(speakers):
            raise ValueError(
                f"num_clients={num_clients} must be between 1 and the {len(speakers)} speakers"
            )
        rng = np.random.default_rng(seed)
        if stratify_by_language:
            langs: dict[str, list[str]] = {}
            for s in speakers:
                langs.setdefault(speaker_lang[s], []).append(s)
            share = _share({g: len(v) for g, v in langs.items()}, num_clients)
            groups = []
            for lang in sorted(langs):
                sizes = [(s, len(by_speaker[s])) for s in langs[lang]]
                groups.extend(_group(sizes, share[lang], rng))
        else:
            groups = _group([(s, len(by_speaker[s])) for s in speakers], num_clients, rng)
    return {
        _client_name(i): [u for s in group for u in by_speaker[s]] for i, group in enumerate(groups)
    }


def iid_partition(rows: list[dict], *, num_clients: int, seed: int = 0) -> dict[str, list[str]]:
    """Shuffle utterances (seeded) and cut them into ``num_clients`` near-equal parts."""
    if not 1 <= num_clients <= len(rows):
        raise ValueError(f"num_clients={num_clients} must be between 1 and {len(rows)} utterances")
    ids = [row["ID"] for row in rows]
    order = np.random.default_rng(seed).permutation(len(ids))
    parts = np.array_split(order, num_clients)
    return {_client_name(i): [ids[j] for j in part] for i, part in enumerate(parts)}


def write_partition(
    rows: list[dict],
    clients: dict[str, list[str]],
    out_dir: str,
    *,
    method: str,
    seed: int,
    extra: dict | None = None,
) -> dict:
    """Write per-client manifests, ``partition.json`` and the statistics tables.

    Returns
    -------
    dict
        The content of ``partition.json`` (``clients`` maps a client to its speakers,
        languages, utterance count, hours and manifest path).
    """
    by_id = {row["ID"]: row for row in rows}
    fields = list(rows[0].keys())
    os.makedirs(os.path.join(out_dir, "clients"), exist_ok=True)
    info: dict = {}
    for client, ids in clients.items():
        path = os.path.join(out_dir, "clients", f"{client}.csv")
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(by_id[i] for i in ids)
        members = [by_id[i] for i in ids]
        info[client] = {
            "speakers": sorted({r["spk_id"] for r in members}),
            "languages": sorted({r.get("language", "") for r in members}),
            "utterances": len(ids),
            "hours": round(sum(float(r.get("duration", 0) or 0) for r in members) / 3600, 6),
            "manifest": os.path.relpath(path, out_dir),
        }
    content = {
        "method": method,
        "seed": seed,
        "num_clients": len(clients),
        "num_utterances": sum(len(v) for v in clients.values()),
        "counts": {c: len(v) for c, v in clients.items()},
        **(extra or {}),
        "clients": info,
    }
    with open(os.path.join(out_dir, PARTITION_FILE), "w", encoding="utf-8") as handle:
        json.dump(content, handle, indent=2)
    _write_stats(info, out_dir)
    return content


def _write_stats(info: dict, out_dir: str) -> None:
    per_lang: dict[str, list] = {}
    for c in info.values():
        lang = "+".join(c["languages"])
        entry = per_lang.setdefault(lang, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += c["utterances"]
        entry[2] += c["hours"]
    lines = ["level,name,clients,utterances,hours,hours_per_client"]
    md = [
        "| Language | Clients | Utterances | Hours | Hours/Client |",
        "|---|---:|---:|---:|---:|",
    ]
    for lang, (n, utts, hours) in sorted(per_lang.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"language,{lang},{n},{utts},{hours:.4f},{hours / n:.4f}")
        md.append(f"| {lang} | {n} | {utts} | {hours:.3f} | {hours / n:.3f} |")
    n, utts = len(info), sum(c["utterances"] for c in info.values())
    hours = sum(c["hours"] for c in info.values())
    lines.append(f"language,total,{n},{utts},{hours:.4f},{hours / max(n, 1):.4f}")
    md.append(f"| **Total** | {n} | {utts} | {hours:.3f} | {hours / max(n, 1):.3f} |")
    md += ["", "| Client | Language | Speakers | Utterances | Hours |", "|---|---|---:|---:|---:|"]
    for client, c in info.items():
        lang = "+".join(c["languages"])
        lines.append(f"client,{client},1,{c['utterances']},{c['hours']:.4f},{c['hours']:.4f}")
        md.append(
            f"| {client} | {lang} | {len(c['speakers'])} | {c['utterances']} | {c['hours']:.3f} |"
        )
    with open(os.path.join(out_dir, "partition_stats.csv"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "partition_stats.md"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(md) + "\n")


def partition_manifest(
    manifest: str,
    out_dir: str,
    *,
    method: str = "speaker",
    num_clients: int | None = None,
    seed: int = 0,
    stratify_by_language: bool = False,
) -> dict:
    """Partition a CSV manifest into clients and write the result (see module docstring).

    Arguments
    ---------
    manifest : str
        SpeechBrain CSV with at least ``ID`` and ``spk_id`` (``language``, ``duration`` used
        when present).
    out_dir : str
        Output folder (``clients/<client>.csv``, ``partition.json``, ``partition_stats.*``).
    method : str
        ``"speaker"`` or ``"iid"``.
    num_clients : int or None
        Number of clients (required for ``iid``; None = one per speaker for ``speaker``).
    seed : int
        Random seed.
    stratify_by_language : bool
        Speaker method only: clients never mix languages.

    Returns
    -------
    dict
        The content of ``partition.json``.

    Example
    -------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); path = os.path.join(d, "train.csv")
    >>> with open(path, "w") as f:
    ...     _ = f.write("ID,duration,spk_id,language\\na,1.0,s1,en\\nb,2.0,s2,en\\nc,1.5,s1,en\\n")
    >>> partition_manifest(path, os.path.join(d, "part"))["counts"]
    {'client_0000': 2, 'client_0001': 1}
    """
    rows = read_manifest(manifest)
    if method == "speaker":
        clients = speaker_partition(
            rows, num_clients=num_clients, seed=seed, stratify_by_language=stratify_by_language
        )
    elif method == "iid":
        if num_clients is None:
            raise ValueError("method='iid' needs num_clients")
        clients = iid_partition(rows, num_clients=num_clients, seed=seed)
    else:
        raise ValueError(f"unknown partition method {method!r}; use 'speaker' or 'iid'")
    extra = {
        "manifest": os.path.abspath(manifest),
        "stratify_by_language": bool(stratify_by_language),
    }
    return write_partition(rows, clients, out_dir, method=method, seed=seed, extra=extra)


def load_partition(out_dir: str) -> dict:
    """Read ``partition.json`` back; client manifest paths are made absolute."""
    path = os.path.join(out_dir, PARTITION_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {PARTITION_FILE} in {out_dir!r}")
    with open(path, encoding="utf-8") as handle:
        content = json.load(handle)
    for entry in content["clients"].values():
        entry["manifest"] = os.path.join(out_dir, entry["manifest"])
    return content
