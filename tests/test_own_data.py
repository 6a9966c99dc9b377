"""Own vertical data (``--data host=PATH --data guest-1=PATH … --id-column --label-column``):
the same numbers as the built-in dataset the tables came from, one-line errors for bad tables,
and ``--align psi`` training on exactly the intersection without any other ID leaving a party."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fl_split.builder import prepare_data
from fl_split.cli import main
from fl_split.config import RunConfig
from fl_split.data.base import partition
from fl_split.data.registry import load_dataset
from fl_split.errors import ConfigError, DataError, ProtocolError

SEED = 5
#: the shared run options of every comparison (small: the 2-core machine)
OPTS = ["--guests", "2", "--seed", str(SEED), "--epochs", "2", "--batch-size", "64", "--no-progress"]


def write_party_tables(tmp_path, fmt: str = "csv", keep: dict[str, np.ndarray] | None = None,
                       dataset: str = "breast-cancer", guests: int = 2, id_map=None) -> dict[str, str]:
    """The built-in ``dataset``'s raw columns as one table per party, as organisations hold them:
    each party's rows in its own (shuffled) order, an ``ID`` column, the host's labels in ``Y``.
    ``keep``: per party, the dataset IDs whose rows it holds (default: all); ``id_map``: the ID
    written for a dataset ID (default: itself)."""
    ds = load_dataset(dataset)
    # another row order than the run's own partition (seed 99): alignment is by ID only
    slices = partition(ds, guests, True, seed=99)
    paths = {}
    for party, sl in slices.items():
        frame = pd.DataFrame({"ID": sl.ids})
        for c in sl.columns:
            frame[c] = sl.table[c].to_numpy()
        if party == "host":
            frame["Y"] = sl.labels
        if keep is not None:
            frame = frame[np.isin(frame["ID"].to_numpy(), keep[party])]
        if id_map is not None:
            frame["ID"] = id_map(frame["ID"].to_numpy())
        path = tmp_path / f"{party}.{fmt}"
        if fmt == "csv":
            frame.to_csv(path, index=False)
        else:
            frame.to_parquet(path, index=False)
        paths[party] = str(path)
    return paths


def data_flags(paths: dict[str, str]) -> list[str]:
    out = []
    for party, path in paths.items():
        out += ["--data", f"{party}={path}"]
    return out + ["--id-column", "ID", "--label-column", "Y"]


def _run(tmp_path, name: str, args: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["train", *args, *OPTS, "--private-seed", "8c9e2d44d0ce787253e1ed754fe13786", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tables_train_like_the_builtin_dataset(tmp_path, fmt):
    paths = write_party_tables(tmp_path, fmt)
    builtin = _run(tmp_path, "builtin", ["--dataset", "breast-cancer"])
    own = _run(tmp_path, "own", [*data_flags(paths), "--data-name", "breast-cancer"])
    assert own["plan"] == builtin["plan"]
    # the same split, encoding, model initialisation and batches: the same numbers, bit for bit
    assert [h["train_loss"] for h in own["history"]] == [h["train_loss"] for h in builtin["history"]]
    assert [h["test_metric"] for h in own["history"]] == [h["test_metric"] for h in builtin["history"]]
    assert own["alignment"] == {"align": "public", "shared_ids": 569}
    assert own["config"]["data_name"] == "breast-cancer"


def test_prepared_data_equals_the_builtin_dataset(tmp_path):
    paths = write_party_tables(tmp_path)
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    own = prepare_data(RunConfig(data=spec, id_column="ID", label_column="Y", data_name="breast-cancer", guests=2,
                                 seed=SEED))
    ref = prepare_data(RunConfig(dataset="breast-cancer", guests=2, seed=SEED))
    np.testing.assert_array_equal(own.train_ids, ref.train_ids)
    np.testing.assert_array_equal(own.test_ids, ref.test_ids)
    assert own.num_classes == ref.num_classes
    for p in ref.parties:
        a, b = own.parties[p], ref.parties[p]
        assert a.feature_names == b.feature_names
        for name in ("x_train", "x_test", "y_train", "y_test"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or bool((x == y).all()), (p, name)


def test_one_table_with_a_column_assignment(tmp_path):
    ds = load_dataset("breast-cancer")
    frame = ds.table.copy()
    frame.insert(0, "ID", ds.ids)
    frame["Y"] = np.where(ds.labels == 1, "benign", "malignant")  # string labels: classes in sorted order
    path = tmp_path / "all.csv"
    frame.sample(frac=1.0, random_state=0).to_csv(path, index=False)
    cols = list(ds.table.columns)
    spec = f"host={','.join(cols[:10])};guest-1={','.join(cols[10:])}"
    prepared = prepare_data(RunConfig(data=str(path), id_column="ID", label_column="Y", columns=spec, seed=SEED))
    assert prepared.parties["host"].feature_names == cols[:10]
    assert prepared.parties["guest-1"].feature_names == cols[10:]
    assert prepared.num_classes == 2
    ids = prepared.train_ids
    want = (ds.labels[np.searchsorted(ds.ids, ids)] == 0).astype(np.int64)  # 'benign' < 'malignant'
    np.testing.assert_array_equal(prepared.parties["host"].y_train.numpy(), want)


def _bad(tmp_path, capsys, args):
    out = tmp_path / "bad.json"
    code = main(["train", *args, *OPTS, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert not out.exists()
    assert len(err.splitlines()) == 1 and err.startswith("fl-split: error:"), err
    return err


def test_bad_tables_are_one_line_errors(tmp_path, capsys):
    paths = write_party_tables(tmp_path)
    g1 = pd.read_csv(paths["guest-1"])

    def variant(name: str, frame: pd.DataFrame) -> dict[str, str]:
        p = tmp_path / f"{name}.csv"
        frame.to_csv(p, index=False)
        return {**paths, "guest-1": str(p)}

    col = g1.columns[3]
    err = _bad(tmp_path, capsys, data_flags(variant("noid", g1.drop(columns=["ID"]))))
    assert "no ID column 'ID'" in err and "guest-1" in err
    missing = g1.astype({"ID": "float64"})
    missing.loc[7, "ID"] = np.nan
    err = _bad(tmp_path, capsys, data_flags(variant("missing", missing)))
    assert "row 8, column 'ID': missing ID" in err
    dup = g1.copy()
    dup.loc[4, "ID"] = dup.loc[2, "ID"]
    err = _bad(tmp_path, capsys, data_flags(variant("dup", dup)))
    assert f"ID {dup.loc[2, 'ID']} in rows 3, 5" in err
    text = g1.astype({col: object})
    text.loc[12, col] = "n/a?"
    err = _bad(tmp_path, capsys, data_flags(variant("text", text)))
    assert f"row 13, column '{col}': 'n/a?' is not a number" in err and f"--encode '{col}=categorical'" in err
    labelled = g1.copy()
    labelled["Y"] = 0
    err = _bad(tmp_path, capsys, data_flags(variant("label", labelled)))
    assert "label column 'Y'" in err and "host's table only" in err
    short = g1.iloc[:-3]
    err = _bad(tmp_path, capsys, data_flags(variant("short", short)))
    assert "guest-1 (short.csv): 3 of the host's 569 IDs are not in its rows; IDs " in err
    assert "--align psi" in err
    err = _bad(tmp_path, capsys, [*data_flags(paths), "--data", f"guest-3={paths['guest-1']}"])
    assert "unknown party 'guest-3'" in err and "--data" in err
    err = _bad(tmp_path, capsys, [*data_flags({"host": paths["host"]})])
    assert "no table for guest-1, guest-2" in err
    err = _bad(tmp_path, capsys, [*data_flags({**paths, "guest-2": str(tmp_path / "nope.csv")})])
    assert "guest-2" in err and "does not exist" in err
    err = _bad(tmp_path, capsys, [*data_flags(paths), "--label-column", "Z"])
    assert "no label column 'Z'" in err


def _distinct(ids: np.ndarray) -> np.ndarray:
    """Customer numbers no run statistic can equal by chance (13 digits), so a scan means something."""
    return np.asarray(ids, np.int64) * 7919 + 4_000_000_000_017


def test_psi_trains_on_exactly_the_intersection_and_leaks_no_other_id(tmp_path, capsys):
    import re

    ids = np.sort(load_dataset("breast-cancer").ids)
    rng = np.random.default_rng(0)
    keep = {p: np.sort(rng.choice(ids, size=int(0.8 * len(ids)), replace=False)) for p in ("host", "guest-1", "guest-2")}
    inter = np.intersect1d(np.intersect1d(keep["host"], keep["guest-1"]), keep["guest-2"])
    outside = np.setdiff1d(np.union1d(np.union1d(keep["host"], keep["guest-1"]), keep["guest-2"]), inter)
    assert 200 < len(inter) < 400 and len(outside) > 150  # the three sets overlap partly
    paths = write_party_tables(tmp_path, keep=keep, id_map=_distinct)
    inter, outside = _distinct(inter), _distinct(outside)

    transcript = []
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    from fl_split.data.own import load_own

    cfg = RunConfig(data=spec, id_column="ID", label_column="Y", align="psi", guests=2, seed=SEED)
    loaded = load_own(cfg, transcript=lambda *m: transcript.append(m))
    np.testing.assert_array_equal(np.sort(np.concatenate([loaded["train_ids"], loaded["test_ids"]])), inter)
    for p, d in loaded["parties"].items():
        assert np.isin(d.train_ids, inter).all() and np.isin(d.test_ids, inter).all(), p
        assert d.x_train.shape[0] + d.x_test.shape[0] == len(inter), p
    # the messages: who sent what to whom (the ring host → guest-1 → guest-2 → host, the fully
    # blinded lists to the coordinator, then each party's positions), and no ID in them, in or outside
    # the intersection, as a 64-bit integer or as text (what is blinded is a hash of the integer)
    ring = [("list", "host", "guest-1"), ("list", "guest-1", "guest-2"), ("list", "guest-2", "host")]
    final = [("list", "host", "coordinator"), ("list", "guest-1", "coordinator"), ("list", "guest-2", "coordinator")]
    assert [m[:3] for m in transcript] == ring + ring + final + [
        ("positions", "coordinator", p) for p in ("host", "guest-1", "guest-2")]
    assert loaded["alignment"]["psi_messages"] == len(transcript) and loaded["alignment"]["time_s"] > 0
    blobs = b"".join(m[3] for m in transcript)
    for i in np.concatenate([outside, inter]):
        assert int(i).to_bytes(8, "little", signed=True) not in blobs and str(int(i)).encode() not in blobs

    out = tmp_path / "psi.json"
    assert main(["train", *data_flags(paths), "--align", "psi", *OPTS, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["alignment"]["align"] == "psi" and res["alignment"]["shared_ids"] == len(inter)
    assert res["plan"]["n_train"] + res["plan"]["n_test"] == len(inter)
    # results and logs: no ID outside the intersection (every 13-digit number in them is scanned)
    text = out.read_text() + captured.out + captured.err
    numbers = {int(x) for x in re.findall(r"\d{13}", text)}
    assert not numbers & set(outside.tolist())


def test_data_option_errors_need_no_file(tmp_path):
    with pytest.raises(ConfigError, match="align"):
        RunConfig(data=str(tmp_path / "all.csv"), align="psi")
    with pytest.raises(ConfigError, match="neither .csv nor .parquet"):
        RunConfig(data=f"host={tmp_path / 'a.txt'};guest-1={tmp_path / 'b.csv'}")
    with pytest.raises(ConfigError, match="party-files"):
        RunConfig(data=f"host={tmp_path / 'a.csv'};guest-1={tmp_path / 'b.csv'}", party_files=str(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(RunConfig(data=f"host={tmp_path / 'a.csv'};guest-1={tmp_path / 'b.csv'}"))


def test_deploy_party_files_must_be_a_directory(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "local", "--insecure", "--guests", "2",
                           "--party-files", str(tmp_path / "nope"), "--workdir", str(tmp_path / "dep")],
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert "party-files" in err and "no such directory" in err
    assert not (tmp_path / "dep").exists()


@pytest.mark.slow
def test_deploy_local_party_files_from_own_tables(tmp_path):
    """Own tables with partly overlapping IDs, aligned by PSI and exported (one file per party), run
    as a loopback deployment from those files (``deploy local --party-files``): the same numbers as
    the local engine on the same files and seeds. The private seed is an ``--insecure-private-seed``
    integer (a research reproduction): said on stderr, recorded in every party's report, and kept out
    of the run config (each node still gets a seed file of its own); a seed-file deployment:
    tests/test_deploy.py."""
    import subprocess
    import sys

    ids = np.sort(load_dataset("breast-cancer").ids)
    keep = {p: ids[ids % k != 0] for p, k in (("host", 5), ("guest-1", 7), ("guest-2", 11))}
    inter = _distinct(np.intersect1d(np.intersect1d(keep["host"], keep["guest-1"]), keep["guest-2"]))
    paths = write_party_tables(tmp_path, keep=keep, id_map=_distinct)
    parties = tmp_path / "parties"
    assert main(["export-parties", *data_flags(paths), "--align", "psi", "--guests", "2", "--seed", str(SEED),
                 "--out", str(parties)]) == 0
    from fl_split.party_files import load_party

    for p in ("host", "guest-1", "guest-2"):
        data, _ = load_party(parties / f"{p}.npz", p)
        np.testing.assert_array_equal(np.sort(np.concatenate([data.train_ids, data.test_ids])), inter)
    # a seed value on deploy's command line is refused (every local user could read it) unless
    # --insecure-private-seed says the run is a research reproduction
    run = ["--guests", "2", "--seed", str(SEED), "--epochs", "1", "--batch-size", "64", "--private-seed", "5",
           "--insecure-private-seed"]
    workdir, out = tmp_path / "dep", tmp_path / "dep.json"
    proc = subprocess.run([sys.executable, "-m", "fl_split.cli", "deploy", "local", "--insecure", *run,
                           "--party-files", str(parties), "--workdir", str(workdir), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (workdir / "parties").exists()  # the given files were used, nothing exported
    assert "--insecure-private-seed" in proc.stderr and "can be searched" in proc.stderr
    assert "private-seed" not in (workdir / "run-config.toml").read_text()
    assert all((workdir / "nodes" / p / "private-seed").is_file() for p in ("host", "guest-1", "guest-2"))
    local_out = tmp_path / "local.json"
    assert main(["train", *run, "--party-files", str(parties), "--no-progress", "--out", str(local_out)]) == 0
    dep, local = json.loads(out.read_text()), json.loads(local_out.read_text())
    assert dep["plan"]["n_train"] + dep["plan"]["n_test"] == len(inter)
    assert {r["private_randomness"] for r in dep["privacy"].values()} == {"insecure-private-seed"}
    assert dep["final"]["value"] == local["final"]["value"]
    assert dep["final"]["train_loss"] == pytest.approx(local["final"]["train_loss"], rel=1e-6)


def test_psi_messages_from_a_hostile_peer_are_refused():
    """DESIGN "Privacy principles" 7: a party checks each PSI frame (kind, sender, receiver, origin,
    hop, size, values of the group) and blinds one list per round; the coordinator checks that every
    hop keeps its list; nothing else escapes."""
    from fl_split.psi import (COORDINATOR, LocalRoute, PsiParty, decode, encode, list_frame, read_list, run_psi,
                              sizes_frame)

    order = ["host", "guest-1"]
    host, guest = PsiParty("host", np.arange(0, 50), order), PsiParty("guest-1", np.arange(25, 80), order)
    mine = host.start()
    with pytest.raises(ProtocolError, match="list from host to guest-1, expected guest-1 to host"):
        PsiParty("host", np.arange(3), order, rnd=1).hop(sizes_frame("host", [3, 50], mine))  # its own list back
    for junk in (b"", b"P2", b"XX\x00\x00\x01", encode("list", "host", "guest-1", b"\x00\x01" + b"\x07" * 33),
                 encode("positions", "host", "guest-1", b""), "text", mine):
        with pytest.raises(ProtocolError):
            PsiParty("guest-1", np.arange(3), order, rnd=1).hop(junk)
    guest.start()
    blinded = guest.hop(sizes_frame("guest-1", [50, 55], mine))
    origin, hop, pts = read_list(blinded, "guest-1", COORDINATOR)
    assert (origin, hop, len(pts)) == (0, 2, 50)
    with pytest.raises(ProtocolError, match="round 2 of 1"):  # blinding a second list: refused
        guest.hop(mine)
    with pytest.raises(ProtocolError, match="not uint32s"):
        guest.finish(encode("positions", COORDINATOR, "guest-1", b"\x00" * 5))
    with pytest.raises(ProtocolError, match="not sorted"):
        guest.finish(encode("positions", COORDINATOR, "guest-1", np.asarray([3, 1], "<u4").tobytes()))
    with pytest.raises(ProtocolError, match="expected coordinator to guest-1"):
        guest.finish(encode("positions", "host", "guest-1", b""))

    class Shrinking(LocalRoute):  # a party that drops values from a list it passes on
        def hop(self, frames):
            out = super().hop(frames)
            o, h, pts = read_list(out["guest-1"], "guest-1", COORDINATOR)
            out["guest-1"] = list_frame("guest-1", COORDINATOR, o, h, pts[1:])
            return out

    with pytest.raises(ProtocolError, match="with 49 values; expected origin 0 after 2 with 50"):
        run_psi(Shrinking({"host": np.arange(0, 50), "guest-1": np.arange(25, 80)}), order)

    class Repeating(LocalRoute):  # a party that repeats a value (to inflate a position count)
        def hop(self, frames):
            out = super().hop(frames)
            o, h, pts = read_list(out["guest-1"], "guest-1", COORDINATOR)
            out["guest-1"] = list_frame("guest-1", COORDINATOR, o, h, np.concatenate([pts[:-1], pts[:1]]))
            return out

    with pytest.raises(ProtocolError, match="repeats a value"):
        run_psi(Repeating({"host": np.arange(0, 50), "guest-1": np.arange(25, 80)}), order)
    assert decode(encode("list", "guest-1", "host", b"abc"), kind="list", sender="guest-1", receiver="host") == b"abc"


def test_the_hosts_view_of_psi_with_two_guests_is_exactly_the_intersection(monkeypatch):
    """Issue 23: with two guests the host learns I and nothing about which of its IDs only some guests
    hold. On the message transcript, with the parties' secret keys (read here, never sent):

    * every value the host receives or sends is blinded with a key set it cannot complete for its own
      IDs: none equals ``H(x)`` or ``H(x)^{k_host}`` of any of its IDs ``x``, and no fully blinded value
      of its own IDs (``F_host``) reaches it (the chained two-party design sent it back);
    * the one fully blinded list it produces is guest-1's, never its own;
    * what it receives about its own IDs is its positions: through its permutation exactly ``I``;
    * two worlds with the same set sizes and the same ``I`` but different sub-intersections (guest-1
      holding the host's IDs outside ``I`` or not) give the host messages of the same kinds and sizes
      and the same ``I``."""
    import fl_split.psi as psi
    from fl_split.psi import COORDINATOR, LocalRoute, decode, read_list, run_psi
    from fl_split.psi_group import blind, hash_ids

    secrets: list[bytes] = []
    made = psi.fresh_secret
    monkeypatch.setattr(psi, "fresh_secret", lambda: secrets.append(made()) or secrets[-1])

    host_ids = np.arange(1000, 1100)
    inter = host_ids[:30]

    def world(g1_extra):
        ids = {"host": host_ids, "guest-1": np.concatenate([inter, g1_extra]),
               "guest-2": np.concatenate([inter, np.arange(5000, 5040)])}
        secrets.clear()
        route, seen = LocalRoute(ids), []
        run_psi(route, ["host", "guest-1", "guest-2"], lambda *m: seen.append(m))
        return route, seen

    # world A: guest-1 holds 50 more of the host's IDs (outside I, since guest-2 lacks them)
    route, seen = world(host_ids[30:80])
    keys = dict(zip(route.parties, secrets[::2]))  # each party: its key, then its permutation's seed
    to_host = [m for m in seen if m[2] == "host"]
    by_host = [m for m in seen if m[1] == "host"]
    assert [m[0] for m in to_host] == ["list", "list", "positions"] and [m[0] for m in by_host] == ["list"] * 3
    # the values the host handles for the others: the lists it receives (one per round) and what it
    # makes of them (its first list is its own start, H(x)^{k_host})
    received = [read_list(m[3], "guest-2", "host")[2] for m in seen if m[1:3] == ("guest-2", "host")]
    sent = [read_list(m[3], "host", m[2])[2] for m in by_host]
    assert len(received) == 2
    handled = {bytes(v) for arr in received + sent[1:] for v in arr}
    h = hash_ids(host_ids)
    own = {bytes(v) for v in h} | {bytes(v) for v in blind(h, keys["host"], "test")}
    full_own = blind(blind(blind(h, keys["host"], "t"), keys["guest-1"], "t"), keys["guest-2"], "t")
    assert not handled & own
    # F_host never reaches the host (the guest-1 list it completes shares values with F_host, for the
    # IDs both hold: that is why F_host does not come back to it)
    assert not {bytes(v) for arr in received for v in arr} & {bytes(v) for v in full_own}
    # the host's last list is guest-1's, fully blinded; the host's own final list went from guest-2
    assert read_list(by_host[-1][3], "host", COORDINATOR)[0] == 1
    assert read_list([m for m in seen if m[1:3] == ("guest-2", COORDINATOR)][0][3], "guest-2", COORDINATOR)[0] == 0
    positions = np.frombuffer(decode(to_host[-1][3], kind="positions", sender=COORDINATOR, receiver="host"), "<u4")
    np.testing.assert_array_equal(np.sort(route.parties["host"]._order()[positions]), inter)
    np.testing.assert_array_equal(route.parties["host"].intersection, inter)

    # world B: the same sizes and I, but guest-1 holds none of the host's other IDs
    route_b, seen_b = world(np.arange(9000, 9050))
    view = [(m[0], m[1], m[2], len(m[3])) for m in seen if m[2] == "host"]
    assert view == [(m[0], m[1], m[2], len(m[3])) for m in seen_b if m[2] == "host"]
    np.testing.assert_array_equal(route_b.parties["host"].intersection, inter)


def test_psi_with_no_common_id_is_one_line(tmp_path, capsys):
    ids = np.sort(load_dataset("breast-cancer").ids)
    keep = {"host": ids[:300], "guest-1": ids[300:], "guest-2": ids}
    paths = write_party_tables(tmp_path, keep=keep)
    err = _bad(tmp_path, capsys, [*data_flags(paths), "--align", "psi"])
    assert "no ID in common" in err


def test_host_with_labels_only(tmp_path):
    """--no-host-features: the host's table holds IDs and labels; a host table with features needs the
    flag off, and one without them needs it on (one line each)."""
    paths = write_party_tables(tmp_path)
    host = pd.read_csv(paths["host"])
    labels_only = tmp_path / "labels.csv"
    host[["ID", "Y"]].to_csv(labels_only, index=False)
    spec = f"host={labels_only};guest-1={paths['guest-1']};guest-2={paths['guest-2']}"
    prepared = prepare_data(RunConfig(data=spec, id_column="ID", label_column="Y", host_features=False, guests=2))
    assert prepared.parties["host"].x_train is None and prepared.parties["host"].y_train is not None
    with pytest.raises(DataError, match="--no-host-features"):
        prepare_data(RunConfig(data=spec, id_column="ID", label_column="Y", guests=2))
    with pytest.raises(DataError, match="but --no-host-features"):
        prepare_data(RunConfig(data=";".join(f"{p}={v}" for p, v in paths.items()), id_column="ID", label_column="Y",
                               host_features=False, guests=2))
