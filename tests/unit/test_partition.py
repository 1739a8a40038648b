"""Client partitions: coverage, determinism, speakers never split, outputs."""

import csv
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speechbrain_fl.data.partition import (
    iid_partition,
    load_partition,
    partition_manifest,
    read_manifest,
    speaker_partition,
)


@st.composite
def manifests(draw):
    n_spk = draw(st.integers(1, 12))
    langs = draw(st.lists(st.sampled_from(["en", "de", "pl"]), min_size=n_spk, max_size=n_spk))
    sizes = draw(st.lists(st.integers(1, 6), min_size=n_spk, max_size=n_spk))
    rows = []
    for s, (lang, size) in enumerate(zip(langs, sizes, strict=True)):
        for u in range(size):
            rows.append({"ID": f"{s}_{u}", "spk_id": f"s{s}", "language": lang, "duration": "1.5"})
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


def _covers_once(rows, clients):
    ids = [u for v in clients.values() for u in v]
    assert sorted(ids) == sorted(r["ID"] for r in rows)


@settings(max_examples=60, deadline=None)
@given(rows=manifests(), seed=st.integers(0, 1000), data=st.data())
def test_speaker_partition_properties(rows, seed, data):
    n_spk = len({r["spk_id"] for r in rows})
    langs = {r["language"] for r in rows}
    stratify = data.draw(st.booleans()) and n_spk >= len(langs)
    low = len(langs) if stratify else 1
    k = data.draw(st.one_of(st.none(), st.integers(low, n_spk)))
    a = speaker_partition(rows, num_clients=k, seed=seed, stratify_by_language=stratify)
    assert a == speaker_partition(rows, num_clients=k, seed=seed, stratify_by_language=stratify)
    _covers_once(rows, a)
    assert len(a) == (k if k is not None else n_spk)
    assert all(a.values())
    spk_of = {r["ID"]: r["spk_id"] for r in rows}
    lang_of = {r["ID"]: r["language"] for r in rows}
    owner = {}
    for client, ids in a.items():
        for u in ids:
            assert owner.setdefault(spk_of[u], client) == client  # speaker never split
        if stratify or k is None:
            assert len({lang_of[u] for u in ids}) == 1


@settings(max_examples=40, deadline=None)
@given(rows=manifests(), seed=st.integers(0, 1000), data=st.data())
def test_iid_partition_properties(rows, seed, data):
    k = data.draw(st.integers(1, len(rows)))
    a = iid_partition(rows, num_clients=k, seed=seed)
    assert a == iid_partition(rows, num_clients=k, seed=seed)
    _covers_once(rows, a)
    sizes = [len(v) for v in a.values()]
    assert len(sizes) == k and max(sizes) - min(sizes) <= 1


def _write(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_partition_manifest_outputs(tmp_path):
    rows = [
        {"ID": f"u{i}", "duration": "2.0", "wav": f"$data_root/{i}.flac", "spk_id": f"s{i % 5}",
         "language": "en" if i % 5 < 3 else "de", "wrd": "a b"}
        for i in range(20)
    ]  # fmt: skip
    manifest = tmp_path / "train.csv"
    _write(manifest, rows)
    out = tmp_path / "part"
    content = partition_manifest(
        str(manifest), str(out), num_clients=3, seed=1, stratify_by_language=True
    )
    assert content["method"] == "speaker" and content["seed"] == 1
    assert sum(content["counts"].values()) == 20
    loaded = load_partition(str(out))
    got = []
    for client, entry in loaded["clients"].items():
        client_rows = read_manifest(entry["manifest"])
        assert len(client_rows) == entry["utterances"] == content["counts"][client]
        assert {r["spk_id"] for r in client_rows} == set(entry["speakers"])
        got += [r["ID"] for r in client_rows]
    assert sorted(got) == sorted(r["ID"] for r in rows)
    with open(out / "partition.json", encoding="utf-8") as handle:
        assert json.load(handle)["stratify_by_language"] is True
    stats = (out / "partition_stats.csv").read_text().splitlines()
    assert "language,total,3,20,0.0111,0.0037" in stats
    assert (out / "partition_stats.md").read_text().startswith("| Language |")


def test_bad_input(tmp_path):
    rows = [
        {"ID": "a", "spk_id": "s", "language": "en"},
        {"ID": "b", "spk_id": "t", "language": "de"},
    ]
    with pytest.raises(ValueError, match="num_clients=3"):
        speaker_partition(rows, num_clients=3)
    with pytest.raises(ValueError, match="cannot stratify"):
        speaker_partition(rows, num_clients=1, stratify_by_language=True)
    with pytest.raises(ValueError, match="num_clients=0"):
        iid_partition(rows, num_clients=0)
    bad = tmp_path / "bad.csv"
    _write(bad, [{"ID": "a", "wav": "x"}])
    with pytest.raises(ValueError, match="spk_id"):
        read_manifest(str(bad))
    dup = tmp_path / "dup.csv"
    _write(dup, [{"ID": "a", "spk_id": "s"}, {"ID": "a", "spk_id": "s"}])
    with pytest.raises(ValueError, match="duplicate ID 'a'"):
        read_manifest(str(dup))
    good = tmp_path / "good.csv"
    _write(good, rows)
    with pytest.raises(ValueError, match="unknown partition method 'kmeans'"):
        partition_manifest(str(good), str(tmp_path / "p"), method="kmeans")
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        read_manifest(str(tmp_path / "missing.csv"))
