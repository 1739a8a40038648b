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


def _rows(sizes_by_speaker, language_of=None):
    rows = []
    for spk, size in sizes_by_speaker.items():
        lang = (language_of or {}).get(spk, "en")
        rows += [{"ID": f"{spk}_{u}", "spk_id": spk, "language": lang} for u in range(size)]
    return rows


def test_speakers_balanced_by_utterances():
    """Largest speakers first, each to the lightest client (longest-processing-time)."""
    sizes = {"a": 10, "b": 9, "c": 8, "d": 1, "e": 1, "f": 1, "g": 1, "h": 1}
    part = speaker_partition(_rows(sizes), num_clients=3, seed=0)
    # 10 | 9 | 8, then the five 1s fill the lightest: loads 10, 11, 11 (any seed)
    assert sorted(len(v) for v in part.values()) == [10, 11, 11]
    owner = {u.split("_")[0]: c for c, ids in part.items() for u in ids}
    assert len({owner["a"], owner["b"], owner["c"]}) == 3  # the three large speakers apart


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=2, max_size=15), data=st.data())
def test_greedy_balance_bound(sizes, data):
    """Each speaker goes to the lightest client, so loads differ by at most the largest speaker."""
    k = data.draw(st.integers(1, len(sizes)))
    part = speaker_partition(
        _rows({f"s{i}": n for i, n in enumerate(sizes)}),
        num_clients=k,
        seed=data.draw(st.integers(0, 99)),
    )
    loads = [len(v) for v in part.values()]
    assert max(loads) - min(loads) <= max(sizes)


def test_language_shares_follow_speaker_counts():
    """K clients shared by speaker count: 1 each, the rest by largest remainder."""
    langs = {f"en{i}": "en" for i in range(8)} | {f"de{i}": "de" for i in range(4)}
    langs |= {f"pl{i}": "pl" for i in range(4)}
    rows = _rows({s: 2 for s in langs}, langs)

    def shares(k):
        part = speaker_partition(rows, num_clients=k, seed=1, stratify_by_language=True)
        out = {}
        for ids in part.values():
            lang = langs[ids[0].split("_")[0]]
            out[lang] = out.get(lang, 0) + 1
        return out

    # speaker shares de 0.25, en 0.5, pl 0.25; quota_g = 1 + (k - 3) * share_g
    # k=8: de 2.25, en 3.5, pl 2.25 -> 2, 3, 2 and the last client to en (remainder 0.5)
    assert shares(8) == {"de": 2, "en": 4, "pl": 2}
    # k=10: de 2.75, en 4.5, pl 2.75 -> 2, 4, 2 and one more to de and pl (remainder 0.75)
    assert shares(10) == {"de": 3, "en": 4, "pl": 3}
    # k=6: de 1.75, en 2.5, pl 1.75 -> 1, 2, 1, then de and pl
    assert shares(6) == {"de": 2, "en": 2, "pl": 2}
    # k=3: one client per language, whatever the counts
    assert shares(3) == {"de": 1, "en": 1, "pl": 1}
