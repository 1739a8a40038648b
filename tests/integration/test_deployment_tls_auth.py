"""Deployment with nothing shared: TLS, SuperNode authentication, each node its own data.

A SuperLink and two SuperNodes on loopback, as on three machines: each SuperNode runs in its own
working directory with its own data folder (the data owner's export of its examples), the
ServerApp's output folder holds none of the clients' data, TLS is on (a CA and a server
certificate generated here with ``cryptography``) and SuperNode authentication is on (each
node's key registered with ``flwr supernode register``). An unregistered SuperNode is refused by
the SuperLink. The run uses the typed run-config keys and matches the local simulation's round
structure (same rounds, same cohort and reply counts). docs/deployment.md runs the same
commands on two machines.
"""

from __future__ import annotations

import csv
import datetime
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import urllib.request
from pathlib import Path

import pytest

from speechbrain_fl.fl import run_deployment, run_simulation
from speechbrain_fl.fl.toy import toy_settings, toy_task, write_toy_manifest

from .conftest import BIN, REPO, free_port, server_round, wait_for


def make_pki(folder: Path, nodes: tuple[str, ...], host: str = "127.0.0.1") -> Path:
    """A CA, the SuperLink's certificate (SAN ``host``) and one OpenSSH key pair per node."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(name("fl-ca")).issuer_name(name("fl-ca"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP384R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))])
    cert = (
        x509.CertificateBuilder().subject_name(name("superlink")).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end).add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem, none = serialization.Encoding.PEM, serialization.NoEncryption()
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(cert.public_bytes(pem))
    (folder / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, none)
    )
    for node in nodes:
        node_key = ec.generate_private_key(ec.SECP384R1())
        (folder / node).write_bytes(
            node_key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, none)
        )
        (folder / f"{node}.pub").write_bytes(
            node_key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
    return folder


def healthy_tls(port: int, ca: Path) -> bool:
    """The SuperLink's health endpoint answers over TLS, verified against ``ca``."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=1,
                                    context=context) as reply:  # fmt: skip
            return reply.status == 200
    except OSError:
        return False


class Federation:
    """SuperLink (TLS + auth) and SuperNodes on loopback; every process in its own session."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.pki = make_pki(root / "pki", ("node0", "node1", "intruder"))
        self.port = free_port()
        home = root / "submitter_flwr_home"
        home.mkdir()
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "secure"\n\n[superlink.secure]\n'
            f'address = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.pki / "ca.crt"}"\n'
        )
        self.env = dict(os.environ, FLWR_HOME=str(home), OMP_NUM_THREADS="1")
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO), self.env.get("PYTHONPATH", "")])
        self.env["PATH"] = os.pathsep.join([str(BIN), self.env.get("PATH", "")])

    def spawn(self, cmd, name, cwd) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (closed by the process end)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True, cwd=cwd)  # fmt: skip
        self.procs.append(proc)
        return proc

    def start_superlink(self) -> None:
        server = self.root / "server"
        server.mkdir()
        pki = self.pki
        link = self.spawn(
            [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(pki / "ca.crt"),
             "--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key"),
             "--port", str(self.port), "--enable-supernode-auth",
             "--database", str(server / "state.db"),
             "--disable-runtime-dependency-installation"],
            "superlink", server,
        )  # fmt: skip
        wait_for(lambda: link.poll() is not None or healthy_tls(self.port, pki / "ca.crt"),
                 timeout=60,
                 what="the SuperLink", log=self.root / "superlink.log")  # fmt: skip
        assert link.poll() is None, (self.root / "superlink.log").read_text()[-3000:]

    def register(self, node: str) -> int:
        proc = subprocess.run(
            [str(BIN / "flwr"), "supernode", "register", str(self.pki / f"{node}.pub"),
             "secure", "--format", "json"],
            capture_output=True, text=True, env=self.env, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return int(json.loads(proc.stdout[proc.stdout.index("{") :])["node-id"])

    def start_supernode(self, node: str, node_config: str) -> subprocess.Popen:
        work = self.root / node
        work.mkdir(exist_ok=True)
        return self.spawn(
            [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
             "--root-certificates", str(self.pki / "ca.crt"),
             "--auth-supernode-private-key", str(self.pki / node),
             "--port", str(free_port()), "--node-config", node_config],
            node, work,
        )  # fmt: skip

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def federation(tmp_path):
    fed = Federation(tmp_path)
    yield fed
    fed.close()


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _start_toy_nodes(fed: Federation, tmp_path: Path) -> dict[int, int]:
    """Start the SuperLink and two authenticated SuperNodes, each with its own toy manifest.

    Returns the node id -> partition id map the server binds (``node_partitions``).
    """
    fed.start_superlink()
    bound = {fed.register("node0"): 0, fed.register("node1"): 1}
    settings = toy_settings(overrides={"num_partitions": 2})
    for node, pid in (("node0", 0), ("node1", 1)):
        data = tmp_path / f"{node}_data"  # the data owner's own folder, on its machine
        data.mkdir()
        write_toy_manifest(data / "train.csv", settings, pid)
        fed.start_supernode(node, f'partition-id={pid} data-folder="{data}" device="cpu"')
    return bound


def _run_toy_flat_two_rounds(
    fed: Federation, tmp_path: Path, out: Path, bound: dict[int, int], **extra
) -> list[dict[str, str]]:
    """``flwr run`` the toy app for two private flat rounds; wait for round 2; its rows.

    ``extra`` are further overrides of the toy task (e.g. ``secure_aggregation``).
    """
    overrides = {"num_partitions": 2, "output_folder": str(out), "seed": 0, "noise_seed": 0,
                 "node_partitions": bound, **extra}  # fmt: skip
    run_config = {"num-server-rounds": 2, "method": "flat", "noise-multiplier": 0.5,
                  "clip": 1.0, "overrides": overrides}  # fmt: skip
    proc = run_deployment("secure", app_dir=REPO, env=fed.env, timeout=600, run_config=run_config)
    (tmp_path / "flwr_run.log").write_text(proc.stdout)
    wait_for(lambda: server_round(out) >= 2, timeout=120, what="round 2",
             log=tmp_path / "superlink.log")  # fmt: skip
    return _rows(out / "rounds.csv")


STRUCTURE = ("round", "cohort_size", "num_replied", "num_failed", "dropped_replies")


@pytest.mark.slow
@pytest.mark.heavy
def test_toy_nothing_shared_tls_auth(tmp_path, federation):
    fed = federation
    bound = _start_toy_nodes(fed, tmp_path)
    intruder = fed.start_supernode("intruder", 'partition-id=1 data-folder="/nonexistent"')
    wait_for(lambda: intruder.poll() is not None, timeout=120, what="the intruder's refusal",
             log=tmp_path / "intruder.log")  # fmt: skip
    assert intruder.returncode != 0
    assert "Failed to activate SuperNode" in (tmp_path / "intruder.log").read_text()

    out = tmp_path / "server" / "out"
    deployed = _run_toy_flat_two_rounds(fed, tmp_path, out, bound)
    assert [r["round"] for r in deployed] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" for r in deployed[1:])
    assert float(deployed[2]["epsilon"]) > 0
    # each node kept what the server sent in its own working directory, and trained on its own
    # manifest: no path of the other node's data, nor of the server's folder, reached it
    for node, other in (("node0", "node1"), ("node1", "node0")):
        (setup,) = (tmp_path / node).glob("sbfl_run_*/setup.json")
        text = setup.read_text()
        assert f"{other}_data" not in text and str(out) not in text
    assert not list((tmp_path / "server").rglob("train.csv"))  # the server holds no client data

    sim = tmp_path / "sim"
    simulated = run_simulation(toy_task(overrides={
        "num_partitions": 2, "output_folder": str(sim), "seed": 0, "noise_seed": 0,
        "number_of_rounds": 2, "method": "flat", "noise_multiplier": 0.5, "clip": 1.0,
    }))  # fmt: skip
    # rounds.csv holds the running RDP figure (round_accountant), results the PLD guarantee
    assert simulated.privacy["epsilon_rdp"] == pytest.approx(float(deployed[2]["epsilon"]))
    local = _rows(sim / "rounds.csv")
    assert [{k: r[k] for k in STRUCTURE} for r in local] == [
        {k: r[k] for k in STRUCTURE} for r in deployed
    ]


MLS_TINY = {
    "languages": ["english", "german"],
    "corpus_speakers_per_language": 2,
    "corpus_utterances_per_speaker": 4,
    "corpus_public_speakers_per_language": 1,
    "corpus_public_utterances_per_speaker": 8,
    "corpus_eval_utterances_per_speaker": 2,
    "num_clients": 2,
    "sampling_rate": 1.0,
}


def _copy_owner_data(manifests, data_folder, root: Path) -> list[Path]:
    """Copy each client manifest's rows and the files they name into ``root/node<i>_data``.

    Every ``$data_root/...`` value of a row is a file of that owner; the copied manifest keeps
    the paths relative to ``$data_root``, which a node resolves to its own ``data-folder``.
    """
    import shutil

    folders = []
    for i, manifest in enumerate(manifests):
        with open(manifest, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        folder = root / f"node{i}_data"
        for row in rows:
            for value in row.values():
                if str(value).startswith("$data_root/"):
                    relative = value.replace("$data_root/", "", 1)
                    (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(Path(data_folder) / relative, folder / relative)
        with open(folder / "train.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        folders.append(folder)
    return folders


def _mls_owner_folders(root: Path) -> list[Path]:
    """The two data owners' own folders: each its speakers' audio and a ``train.csv``.

    The embedded corpus stands in for data that exists at the owners: it is generated once
    here (not in the server's folder), split by the recipe's own speaker partition, and each
    owner's rows and audio files are copied into its folder, paths relative to ``$data_root``.
    """
    import shutil

    from speechbrain_fl.fl.task import _import_script

    mls = _import_script("recipes/MLS/train_fl.py")
    owners = root / "owners_corpus"
    hparams, _, _ = mls.RECIPE.load_for_task("hparams/flat.yaml", {
        **MLS_TINY, "output_folder": str(owners / "out"), "cache_folder": str(owners / "cache"),
        "debug": True,
    })  # fmt: skip
    data_folder, _, _, partition, _ = mls.dataio_prepare(hparams, progressbar=False)
    save = Path(hparams["save_folder"]) / "partition"
    manifests = [save / partition["clients"][n]["manifest"] for n in sorted(partition["clients"])]
    folders = _copy_owner_data(manifests, data_folder, root)
    shutil.rmtree(owners)  # nothing of the owners' corpus is left where the server runs
    return folders


@pytest.mark.slow
@pytest.mark.heavy
def test_mls_debug_nothing_shared_tls_auth(tmp_path, federation):
    from speechbrain_fl.fl.engines.run import _run_status

    fed = federation
    folders = _mls_owner_folders(tmp_path)
    fed.start_superlink()
    fed.register("node0"), fed.register("node1")  # MLS's hparams have no node_partitions key
    for pid, folder in enumerate(folders):
        fed.start_supernode(f"node{pid}", f'partition-id={pid} data-folder="{folder}"')
    out = tmp_path / "server" / "out"
    overrides = {**MLS_TINY, "output_folder": str(out), "debug": True,
                 "cache_folder": str(tmp_path / "server" / "cache")}  # fmt: skip
    run_config = {"task": "recipes/MLS/train_fl.py:mls_task", "hparams": "hparams/flat.yaml",
                  "num-server-rounds": 2, "overrides": overrides}  # fmt: skip
    proc = run_deployment("secure", app_dir=REPO, env=fed.env, timeout=1500, run_config=run_config)
    (tmp_path / "flwr_run.log").write_text(proc.stdout)
    assert _run_status(proc.stdout, "secure", fed.env) == "finished:completed"
    wait_for(lambda: (out / "final_model" / "federated_model.json").is_file(), timeout=120,
             what="the final model", log=tmp_path / "flwr_run.log")  # fmt: skip
    rows = _rows(out / "rounds.csv")
    # the simulation's structure for q = 1, K = 2: every round samples and hears both nodes
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["cohort_size"] == "2" and r["num_replied"] == "2" for r in rows[1:])
    assert float(rows[2]["epsilon"]) > 0 and float(rows[0]["WER"]) >= 0
    for pid in (0, 1):  # the model came from the server: the shipped seed model, checked
        (setup,) = (tmp_path / f"node{pid}").glob("sbfl_run_*/setup.json")
        record = json.loads(setup.read_text())
        assert Path(record["model_folder"]).is_relative_to(tmp_path / f"node{pid}")
        assert f"node{1 - pid}_data" not in setup.read_text()
        # no path of the server's client partition or corpus reached the node
        assert record["prepared"]["settings"]["clients"] == ["", ""]
        assert "partition" not in json.dumps(record["prepared"]["settings"])
        assert not (tmp_path / f"node{pid}" / "cache").exists() or not list(
            (tmp_path / f"node{pid}" / "cache").rglob("*.flac")
        )  # the node generated no corpus


SUPERB_TINY = {
    "corpus_options": {"train_speakers": 4, "valid_speakers": 1, "test_speakers": 2,
                       "repeats": 1, "unknown_words_per_speaker": 2, "noise_seconds": 3},
    "public_corpus_options": {"splits": {"public": 2}, "utterances_per_speaker": 2},
    "num_clients": 2, "sampling_rate": 1.0, "pretrain_steps": 2, "debug": True,
}  # fmt: skip


def _superb_owner_folders(root: Path) -> list[Path]:
    """The two KWS data owners' folders (the recipe's own partition of the embedded corpus)."""
    import shutil
    import sys

    from speechbrain_fl.fl.task import _import_script

    superb = _import_script("recipes/SUPERB/superb_task.py")
    sys.path.insert(0, str(REPO / "recipes" / "SUPERB"))
    import superb_data

    owners = root / "owners_corpus"
    hparams, _, _ = superb.RECIPE.load_for_task("hparams/kws.yaml", {
        **SUPERB_TINY, "output_folder": str(owners / "out"), "cache_folder": str(owners / "cache"),
    })  # fmt: skip
    data = superb_data.prepare_task(hparams)
    folders = _copy_owner_data(data["clients"], data["data_folder"], root)
    shutil.rmtree(owners)
    return folders


@pytest.mark.slow
@pytest.mark.heavy
def test_superb_kws_nothing_shared_tls_auth(tmp_path, federation):
    from speechbrain_fl.fl.engines.run import _run_status

    fed = federation
    folders = _superb_owner_folders(tmp_path)
    fed.start_superlink()
    fed.register("node0"), fed.register("node1")
    for pid, folder in enumerate(folders):
        fed.start_supernode(f"node{pid}", f'partition-id={pid} data-folder="{folder}"')
    out = tmp_path / "server" / "out"
    overrides = {**SUPERB_TINY, "output_folder": str(out),
                 "cache_folder": str(tmp_path / "server" / "cache")}  # fmt: skip
    run_config = {"task": "recipes/SUPERB/superb_task.py:superb_task",
                  "hparams": "hparams/kws.yaml", "overrides": overrides}  # fmt: skip
    proc = run_deployment("secure", app_dir=REPO, env=fed.env, timeout=1500, run_config=run_config)
    (tmp_path / "flwr_run.log").write_text(proc.stdout)
    assert _run_status(proc.stdout, "secure", fed.env) == "finished:completed"
    wait_for(lambda: (out / "results.json").is_file(), timeout=60, what="results.json",
             log=tmp_path / "flwr_run.log")  # fmt: skip
    rows = _rows(out / "rounds.csv")
    # the simulation's structure (tests/integration/test_superb_flwr_run.py): two rounds, both
    # partial replies (one client at exit 3, one at exit 6) aggregated layer-wise
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert all(r["num_replied"] == "2" for r in rows[1:])
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["depths"]) == [3, 6] and set(results["test"]) == {"3", "6"}
    for pid in (0, 1):
        (setup,) = (tmp_path / f"node{pid}").glob("sbfl_run_*/setup.json")
        assert f"node{1 - pid}_data" not in setup.read_text()
        assert Path(json.loads(setup.read_text())["model_folder"]).is_relative_to(
            tmp_path / f"node{pid}"
        )
