"""MLS's node_manifest hook: a data-owning SuperNode's MLS-layout folder becomes its manifest."""

import csv
import importlib.util
import os
import shutil

import pytest

from speechbrain_fl.data.mls_synth import generate_mls_corpus
from speechbrain_fl.fl.node_data import NodeData

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "MLS", "mls_prepare.py")
_spec = importlib.util.spec_from_file_location("mls_prepare_node", _PATH)
mls_prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mls_prepare)

TINY = dict(
    languages=["polish"], speakers_per_language=2, utterances_per_speaker=3, seed=3,
    public_speakers_per_language=1, public_utterances_per_speaker=1, dev_speakers=1,
    test_speakers=1, test_overlap_speakers=1, eval_utterances_per_speaker=1,
    public_test_speakers=1, progress=False,
)  # fmt: skip
HPARAMS = {"languages": ["english", "polish"]}


@pytest.fixture(scope="module")
def node_folder(tmp_path_factory):
    """A node's own data: only the train split of one language, in MLS's layout."""
    corpus = str(tmp_path_factory.mktemp("corpus") / "mls")
    generate_mls_corpus(corpus, **TINY)
    node = tmp_path_factory.mktemp("node") / "data"
    shutil.copytree(os.path.join(corpus, "mls_polish", "train"), node / "mls_polish" / "train")
    return node


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_mls_folder_is_prepared_on_the_node(node_folder, tmp_path):
    node = NodeData.from_node_config({"data-folder": str(node_folder), "work-dir": str(tmp_path)})
    path = mls_prepare.node_train_manifest(node, HPARAMS)
    assert path.startswith(str(tmp_path))  # written under the node's work-dir, not its data
    rows = _rows(path)
    with open(node_folder / "mls_polish" / "train" / "transcripts.txt", encoding="utf-8") as f:
        expected = sorted(line.split("\t")[0] for line in f if line.strip())
    assert rows and sorted(r["ID"] for r in rows) == expected
    for row in rows:  # every path resolves against the node's data root
        assert row["language"] == "polish" and float(row["duration"]) > 0
        assert os.path.isfile(row["wav"].replace("$data_root", node.data_root))


def test_a_given_manifest_or_train_csv_is_used_as_it_is(node_folder, tmp_path):
    manifest = tmp_path / "mine.csv"
    manifest.write_text("ID,duration,wav,spk_id,language,wrd\n", encoding="utf-8")
    node = NodeData.from_node_config(
        {"data-folder": str(node_folder), "data-manifest": str(manifest), "work-dir": str(tmp_path)}
    )
    assert mls_prepare.node_train_manifest(node, HPARAMS) == str(manifest.resolve())
    assert not (tmp_path / "sbfl_mls_node").exists()  # nothing prepared


def test_a_folder_without_mls_layout_is_a_named_error(tmp_path):
    (tmp_path / "data").mkdir()
    node = NodeData.from_node_config({"data-folder": str(tmp_path / "data")})
    with pytest.raises(OSError, match="is not an MLS folder"):
        mls_prepare.node_train_manifest(node, HPARAMS)
