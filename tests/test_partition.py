"""Vertical partitioning, ID alignment, per-party encoding and padding (spec §1, §2, §6)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fl_split.data.base import (
    PartySlice,
    VerticalDataset,
    apply_padding,
    partition,
    positions_of,
    prepare_party,
    split_ids,
)
from fl_split.data.registry import load_dataset
from fl_split.errors import ConfigError, DataError


def _table_ds(n=50):
    rng = np.random.default_rng(0)
    table = pd.DataFrame({
        "a": rng.normal(5, 2, n), "b": rng.normal(size=n), "color": rng.choice(["red", "green", "blue"], n),
        "c": rng.integers(0, 10, n).astype(float), "d": rng.normal(size=n),
    })
    return VerticalDataset(name="toy", task="classification", ids=np.arange(100, 100 + n), labels=rng.integers(0, 2, n),
                           num_classes=2, table=table, categorical=("color",))


@pytest.mark.parametrize("dataset", ["digits", "breast-cancer"])
@pytest.mark.parametrize("guests,host_features", [(1, True), (1, False), (3, True), (4, False), (5, True)])
def test_every_feature_owned_exactly_once(dataset, guests, host_features):
    ds = load_dataset(dataset)
    slices = partition(ds, guests, host_features)
    assert set(slices) == {"host", *[f"guest-{i}" for i in range(1, guests + 1)]}
    owned = [c for s in slices.values() for c in s.columns]
    assert sorted(owned, key=str) == sorted(ds.columns, key=str)
    assert len(owned) == len(set(owned))
    assert (len(slices["host"].columns) > 0) == host_features
    # the labels stay with the host
    assert slices["host"].labels is not None
    assert all(s.labels is None for p, s in slices.items() if p != "host")
    # every guest holds something
    assert all(s.columns for p, s in slices.items() if p != "host")


def test_image_stripes_reassemble_the_image():
    ds = load_dataset("digits")
    slices = partition(ds, 3, True, shuffle_rows=False)
    stripes = [slices[p].images for p in ["host", "guest-1", "guest-2", "guest-3"]]
    assert [s.shape[3] for s in stripes] == [2, 2, 2, 2]
    np.testing.assert_array_equal(np.concatenate(stripes, axis=3), ds.images)


def test_too_many_guests_is_a_config_error():
    with pytest.raises(ConfigError) as exc:
        partition(load_dataset("digits"), 8, True)
    assert "--guests" in str(exc.value) and "at most 7" in str(exc.value)


def test_user_given_columns():
    ds = _table_ds()
    slices = partition(ds, 2, True, columns="host=a,b;guest-1=color;guest-2=c,d")
    assert slices["guest-1"].columns == ["color"] and slices["guest-2"].columns == ["c", "d"]
    assert slices["guest-1"].categorical == ("color",)


@pytest.mark.parametrize("spec,fragment", [
    ("host=a,b;guest-1=color", "no columns for ['guest-2']"),
    ("host=a,b;guest-1=color,a;guest-2=c,d", "given to both"),
    ("host=a;guest-1=color;guest-2=c", "belong to no party"),
    ("host=a,b,zz;guest-1=color;guest-2=c,d", "unknown column 'zz'"),
    ("host=a,b;guest-9=color;guest-2=c,d", "unknown party 'guest-9'"),
    ("host a,b", "has no '='"),
])
def test_bad_columns_spec(spec, fragment):
    with pytest.raises(ConfigError) as exc:
        partition(_table_ds(), 2, True, columns=spec)
    assert "--columns" in str(exc.value) and fragment in str(exc.value)


def test_image_columns_must_be_contiguous_ranges():
    ds = load_dataset("digits")
    slices = partition(ds, 1, True, columns="host=0:3;guest-1=3:8")
    assert slices["host"].images.shape[3] == 3 and slices["guest-1"].images.shape[3] == 5
    with pytest.raises(ConfigError, match="not contiguous"):
        partition(ds, 1, True, columns="host=0,2,4,6;guest-1=1,3,5,7")


def test_alignment_with_shuffled_and_extra_rows():
    ds = _table_ds(40)
    train, test = split_ids(ds, 0.25, seed=1)
    slices = partition(ds, 1, True, seed=7)
    # the guest holds its rows in another order, plus rows the host never heard of
    g = slices["guest-1"]
    extra = pd.DataFrame({c: g.table[c].iloc[:5].to_numpy() for c in g.columns})
    g2 = PartySlice(party="guest-1", ids=np.concatenate([g.ids, np.arange(900, 905)]), columns=g.columns,
                    table=pd.concat([g.table, extra], ignore_index=True), categorical=g.categorical)
    pd_ = prepare_party(g2, train, test)
    ref = prepare_party(partition(ds, 1, True, shuffle_rows=False)["guest-1"], train, test)
    assert torch.equal(pd_.x_train, ref.x_train) and torch.equal(pd_.x_test, ref.x_test)
    np.testing.assert_array_equal(pd_.train_ids, train)


def test_missing_ids_are_a_clear_error():
    ds = _table_ds(30)
    train, test = split_ids(ds, 0.2, seed=0)
    sl = partition(ds, 1, True)["guest-1"]
    keep = ~np.isin(sl.ids, train[:3])
    short = PartySlice(party="guest-1", ids=sl.ids[keep], columns=sl.columns, table=sl.table[keep].reset_index(drop=True))
    with pytest.raises(DataError) as exc:
        prepare_party(short, train, test)
    assert "guest-1" in str(exc.value) and "3 shared IDs are missing" in str(exc.value)
    assert str(train[0]) in str(exc.value)
    with pytest.raises(DataError):
        positions_of(np.array([1, 2, 3]), np.array([4]))


def test_encoding_uses_only_own_training_rows():
    ds = _table_ds(60)
    train, test = split_ids(ds, 0.3, seed=2)
    host = prepare_party(partition(ds, 1, True)["host"], train, test)
    # host's numeric columns standardised with train statistics: train mean 0, std 1
    a = host.x_train[:, host.feature_names.index("a")]
    assert abs(float(a.mean())) < 1e-5 and abs(float(a.std(unbiased=False)) - 1) < 1e-4
    # the statistics are the train rows', not all rows' (the test rows are not standardised to 0/1)
    raw = ds.table.set_index(ds.ids)["a"]
    mu, sd = raw.loc[train].mean(), raw.loc[train].std(ddof=0)
    np.testing.assert_allclose(host.x_test[:, host.feature_names.index("a")].numpy(),
                               ((raw.loc[test] - mu) / sd).to_numpy(), rtol=1e-5)


def test_one_hot_categories_from_train_rows():
    ds = _table_ds(60)
    train, test = split_ids(ds, 0.3, seed=2)
    # a category seen only in a test row encodes as all zeros
    ds.table.loc[np.where(ds.ids == test[0])[0][0], "color"] = "purple"
    sl = partition(ds, 1, True, columns="host=a,b;guest-1=color,c,d")["guest-1"]
    g = prepare_party(sl, train, test)
    onehot = [i for i, n in enumerate(g.feature_names) if n.startswith("color=")]
    assert [g.feature_names[i] for i in onehot] == ["color=blue", "color=green", "color=red"]
    assert float(g.x_test[0, onehot].sum()) == 0.0
    assert torch.all(g.x_train[:, onehot].sum(dim=1) == 1)


def test_split_is_deterministic_and_disjoint():
    ds = load_dataset("digits")
    a = split_ids(ds, 0.2, seed=5)
    b = split_ids(ds, 0.2, seed=5)
    c = split_ids(ds, 0.2, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])
    assert len(np.intersect1d(*a)) == 0 and len(a[0]) + len(a[1]) == len(ds.ids)
    assert len(split_ids(ds, 0.2, seed=5, limit=100)[1]) == 20


def test_padding_places_each_party_in_the_full_vector():
    ds = _table_ds(40)
    train, test = split_ids(ds, 0.25, seed=0)
    parts = {p: prepare_party(s, train, test) for p, s in partition(ds, 2, True).items()}
    padded = apply_padding(parts)
    widths = [parts[p].width for p in ["host", "guest-1", "guest-2"]]
    full = sum(widths)
    offset = 0
    for p, w in zip(["host", "guest-1", "guest-2"], widths):
        x = padded[p].x_train
        assert x.shape[1] == full
        assert torch.equal(x[:, offset:offset + w], parts[p].x_train)
        assert float(x[:, :offset].abs().sum() + x[:, offset + w:].abs().sum()) == 0.0
        offset += w


def test_image_padding_pads_the_width():
    ds = load_dataset("digits")
    train, test = split_ids(ds, 0.2, seed=0, limit=100)
    parts = {p: prepare_party(s, train, test) for p, s in partition(ds, 1, True).items()}
    padded = apply_padding(parts)
    assert padded["guest-1"].x_train.shape[1:] == (1, 8, 8)
    assert torch.equal(padded["guest-1"].x_train[..., 4:], parts["guest-1"].x_train)
    assert float(padded["guest-1"].x_train[..., :4].abs().sum()) == 0.0
