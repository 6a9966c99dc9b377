"""Run a bench grid: calibrate, then one observed training per cell with every attack mounted on it.

A *cell* is (dataset, defence, target ε, seed). Its noise parameter is calibrated first, without
training (:func:`fl_split.bench.calibrate.calibrate`: bisected through the real ledger so that every
guest's planned ε after the run's epochs is the target within ``TOLERANCE``, never above; cached in
``calibration.json``). The cell then trains once per *session need* of its attacks — one run shared
by the attacks that read an ordinary run, one with the public split for those granted public
records, one per malicious-host attack (FSHA) — and mounts each attack through
:func:`fl_split.attacks.runner.run_attack`, as ``fl-split attack`` does. Utility and the privacy
reports come from the ordinary run (a plain training run if no attack needs one).

**Resumable.** Each finished cell is written atomically to ``cells/<key>.json`` with the hash of its
full specification (config, calibrated parameter, attacks and their options); a cell whose file
holds the same hash is not re-run, a changed or failed one is.

**Parallel.** ``workers`` > 1 runs the cells as Ray tasks (one CPU and one torch thread each); the
driver writes each cell's file as it finishes, so an interrupted run loses only the cells in flight.

**Seeds.** A cell's private seed is ``PrivateSeed.insecure(seed)`` (``--insecure-private-seed``): the
bench measures attacks on public benchmark datasets and its numbers must reproduce; its noise is
therefore guessable from the seed, and the results say so (``private_seed`` in ``bench.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fl_split.bench import calibrate as cal
from fl_split.bench.grid import Grid, attack_options
from fl_split.bench.scores import advantage

PRIVATE_SEED = "insecure-private-seed (PBKDF2 of the seed integer; reproducible, guessable)"


def _key(dataset: str, defence: str, eps: float | None, seed: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in defence)
    return f"{dataset}__{safe}__{'none' if eps is None else f'{eps:g}'}__{seed}"


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def calibrations(grid: Grid, out: Path, log: Callable[[str], None] = print) -> dict[str, dict]:
    """``{dataset/defence/ε: calibration}`` for every defended cell, cached in ``out/calibration.json``
    under the hash of the dataset's base config (a changed grid recalibrates)."""
    path = out / "calibration.json"
    cache = json.loads(path.read_text()) if path.is_file() else {}
    changed = False
    for ds in grid.datasets:
        base = grid.base(ds)
        h = _hash(base)
        probe_key = f"{ds}/probe/{h}"
        if probe_key not in cache:
            cache[probe_key] = cal.probe(base)
            changed = True
        parties = cache[probe_key]
        for d in grid.defences:
            if d == "none":
                continue
            claim_key = f"{ds}/{d}/claim/{h}"
            if claim_key not in cache:
                cache[claim_key] = cal.claims_privacy(base, d, parties)
                changed = True
            if not cache[claim_key]:
                log(f"{ds} {d}: no privacy claimed (no DP event): run once at its own options, not calibrated")
                continue
            for eps in grid.epsilons:
                k = f"{ds}/{d}/{eps:g}/{h}"
                if k not in cache:
                    c = cal.calibrate(base, d, eps, parties)
                    name = cal.parameter_of(d)[0]
                    cache[k] = {**c, "parameter": name, "value": c["changes"][name]}
                    log(f"calibrated {ds} {d} ε {eps:g}: {name} = {cache[k]['value']:.4g} "
                        f"(planned ε {c['planned_epsilon']:.4g}{'' if c['ok'] else ', NOT within tolerance'})")
                    changed = True
        if changed:
            _write(path, cache)
    return {k.rsplit("/", 1)[0]: v for k, v in cache.items() if "/probe/" not in k}


def _claims(calib: dict[str, dict], ds: str, d: str) -> bool:
    """False for a defence :func:`calibrations` found without a DP event (run once, ε = None)."""
    return d != "none" and calib.get(f"{ds}/{d}/claim", True) is not False


def cell_specs(grid: Grid, calib: dict[str, dict]) -> list[dict]:
    """Every cell of ``grid`` as a JSON-able specification (what :func:`run_cell` needs), in grid order."""
    specs = []
    attacks = [[a, attack_options(grid, a).to_dict()] for a in grid.attacks]
    for ds in grid.datasets:
        for d in grid.defences:
            for eps in (grid.epsilons if _claims(calib, ds, d) else [None]):
                c = None if eps is None else calib[f"{ds}/{d}/{eps:g}"]
                changes = {} if c is None else dict(c["changes"])
                for seed in grid.seeds:
                    spec = {"key": _key(ds, d, eps, seed), "dataset": ds, "defence": d, "epsilon": eps,
                            "seed": seed, "config": {**grid.base(ds), **changes, "seed": seed},
                            "calibration": c, "attacks": attacks}
                    spec["hash"] = _hash({k: v for k, v in spec.items() if k != "key"})
                    specs.append(spec)
    return specs


def _groups(names: list[str]) -> list[list[str]]:
    """Attacks that can share one observed run: ordinary, public split, and each malicious one alone."""
    from fl_split.attacks.runner import get_attack

    plain, public, own = [], [], []
    for n in names:
        a = get_attack(n)
        (own.append([n]) if a.malicious else (public if a.public else plain).append(n))
    return [g for g in ([plain] if plain else []) + ([public] if public else []) + own]


def run_cell(spec: dict) -> dict:
    """Train and attack one cell; returns its tidy rows and what the report needs (no file written)."""
    import torch

    from fl_split.attacks.options import options_from_mapping
    from fl_split.attacks.runner import make_session, run_attack
    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.errors import ConfigError
    from fl_split.seeding import PrivateSeed

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = RunConfig(**spec["config"])
    seed = PrivateSeed.insecure(int(spec["seed"]))
    opts = {name: options_from_mapping(o) for name, o in spec["attacks"]}
    results, attacks, not_applicable = None, {}, {}
    for group in _groups(list(opts)):
        session = None
        for name in group:
            try:  # an attack refused on this dataset (e.g. feature inference on images) is refused
                # by its own check before its session trains: recorded as not applicable, not a failure
                if session is None:
                    session = make_session(cfg, opts[name], seed)
                r = run_attack(cfg, opts[name], session=session)
            except ConfigError as exc:
                not_applicable[name] = str(exc)
                continue
            attacks[name] = r
            if results is None and not session.public_parties and session._acting_host is None:
                results = {"final": r["final"], "privacy": r["privacy"]}
    if results is None:
        res = LocalEngine(cfg, private_seed=seed).run()
        results = {"final": res["final"], "privacy": res.get("privacy", {})}
    row = dict(dataset=spec["dataset"], defence=spec["defence"], epsilon=spec["epsilon"], seed=spec["seed"])
    rows = [dict(row, party="host", metric="utility", value=float(results["final"]["value"]))]
    for party, rep in sorted(results["privacy"].items()):
        if isinstance(rep, dict) and rep.get("epsilon") is not None:
            rows.append(dict(row, party=party, metric="epsilon", value=float(rep["epsilon"])))
            if spec["epsilon"] is not None and party.startswith("guest"):
                rows.append(dict(row, party=party, metric="epsilon_within_tolerance",
                                 value=float(cal.reported_ok(rep["epsilon"], spec["epsilon"]))))
    c = spec["calibration"]
    if c:
        rows.append(dict(row, party="guests", metric=f"parameter:{c['parameter']}", value=float(c["value"])))
    meta = {}
    for name, r in attacks.items():
        adv = advantage(r)
        rows += [dict(row, party=r["victim"], metric=f"{name}:{r['metric']}", value=float(r["value"])),
                 dict(row, party=r["victim"], metric=f"{name}:baseline", value=float(r["baseline"])),
                 dict(row, party=r["victim"], metric=f"{name}:advantage", value=float(adv))]
        meta[name] = {"adversary": r["adversary"], "victim": r["victim"], "metric": r["metric"],
                      "better": r["better"], "baseline_name": r["baseline_name"]}
    return {"key": spec["key"], "hash": spec["hash"], "rows": rows, "attacks": meta, "not_applicable": not_applicable,
            "utility_metric": results["final"].get("metric", "accuracy"), "seconds": time.perf_counter() - t0}


def _done(path: Path, spec: dict) -> bool:
    if not path.is_file():
        return False
    try:
        got = json.loads(path.read_text())
    except ValueError:
        return False
    return got.get("hash") == spec["hash"] and "rows" in got


def run_grid(grid: Grid, out: str | Path, workers: int = 1, progress: bool = True,
             log: Callable[[str], None] = print) -> dict:
    """Run every cell of ``grid`` not finished in ``out`` and return ``{"cells", "ran", "skipped", "failed"}``
    (each cell's result, in grid order)."""
    out = Path(out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    calib = calibrations(grid, out, log)
    specs = cell_specs(grid, calib)
    todo = [s for s in specs if not _done(out / "cells" / f"{s['key']}.json", s)]
    skipped = len(specs) - len(todo)
    if skipped:
        log(f"resuming: {skipped} of {len(specs)} cells already finished in {out}")
    from tqdm.auto import tqdm

    failed: list[str] = []
    bar = tqdm(total=len(specs), initial=skipped, desc="bench", unit="cell", disable=not progress, leave=False)

    def finish(spec: dict, result: dict | None, error: str | None) -> None:
        if error is None:
            _write(out / "cells" / f"{spec['key']}.json", result)
        else:
            failed.append(f"{spec['key']}: {error}")
            log(f"cell {spec['key']} failed: {error}")
        bar.set_postfix_str(spec["key"], refresh=False)
        bar.update(1)

    try:
        if workers <= 1 or len(todo) <= 1:
            for s in todo:
                try:
                    finish(s, run_cell(s), None)
                except Exception as exc:  # noqa: BLE001 - one failed cell must not lose the others
                    if not _recoverable(exc):
                        raise
                    finish(s, None, str(exc))
        else:
            _run_ray(todo, workers, finish)
    finally:
        bar.close()
    cells = []
    for s in specs:
        p = out / "cells" / f"{s['key']}.json"
        if _done(p, s):
            cells.append(json.loads(p.read_text()))
    return {"cells": cells, "ran": len(todo) - len(failed), "skipped": skipped, "failed": failed,
            "total": len(specs)}


def _recoverable(exc: Exception) -> bool:
    from fl_split.errors import FlSplitError

    return isinstance(exc, (FlSplitError, ValueError, RuntimeError))


def _run_ray(todo: list[dict], workers: int, finish) -> None:
    import ray

    started = not ray.is_initialized()
    old = os.environ.get("PYTHONPATH")
    if started:
        # the workers import fl_split.bench.run by reference: they inherit this PYTHONPATH (as the Flower
        # engine does; a runtime_env would start Ray's runtime-env agent, slow on a loaded machine)
        os.environ["PYTHONPATH"] = os.pathsep.join([*sys.path, *([old] if old else [])])
        _start_ray(workers)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(run_cell)
        pending = {task.remote(s): s for s in todo}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                spec = pending.pop(ref)
                try:
                    finish(spec, ray.get(ref), None)
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause if hasattr(exc, "cause") else exc
                    finish(spec, None, f"{type(cause).__name__}: {cause}")
    finally:
        if started:
            ray.shutdown()
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


#: tries at a local Ray start (a loaded machine can miss Ray's fixed start-up limits, as in the Flower engine)
RAY_START_ATTEMPTS = 3


def _start_ray(workers: int) -> None:
    """Start a local Ray with ``workers`` CPUs; a timed-out start is ended (nothing left running) and
    tried again, then refused in one line pointing at ``--workers 1`` (no Ray)."""
    import contextlib

    import ray

    from fl_split.errors import FlSplitError
    from fl_split.flower.processes import descendants, end_processes

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = set(descendants(os.getpid()))
        try:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a timed-out start
            with contextlib.suppress(Exception):
                ray.shutdown()
            end_processes(set(descendants(os.getpid())) - before)
            if attempt == RAY_START_ATTEMPTS:
                raise FlSplitError(f"Ray did not start on this machine ({attempt} attempts): "
                                   f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; finished "
                                   "cells are kept: run again, or with --workers 1 (no Ray)") from None


__all__ = ["PRIVATE_SEED", "calibrations", "cell_specs", "run_cell", "run_grid"]
