"""ferroattn.profiler.detect_knee on synthetic grids with a known answer (CPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ferroattn.errors import ArgumentError
from ferroattn.profiler import detect_knee

BATCHES = (1, 2, 4, 8, 16)
SEQLENS = (256, 512, 1024, 2048, 4096, 8192)


def saturating(b, s, knee_tokens=8192, base_ms=1.0):
    """Flat (launch-bound) until knee_tokens tokens, then linear in tokens."""
    return base_ms * max(1.0, b * s / knee_tokens)


def test_known_knee_mapping():
    grid = {(b, s): saturating(b, s) for b in BATCHES for s in SEQLENS}
    k = detect_knee(grid)
    assert k.found
    # every line knee sits at 8192 tokens (not at a line's last point: no growth there); ties go
    # to the smaller batch
    assert k.config == (2, 4096)
    assert k.config[0] * k.config[1] == 8192
    assert k.growth >= 100  # flat -> linear: the floored ratio is large
    per_line = {ln.fixed: ln.knee for ln in k.lines["seqlen"]}
    assert per_line == {1: None, 2: 4096, 4: 2048, 8: 1024, 16: 512}
    per_col = {ln.fixed: ln.knee for ln in k.lines["batch"]}
    assert per_col == {256: None, 512: None, 1024: 8, 2048: 4, 4096: 2, 8192: None}


def test_unique_knee_off_grid_diagonal():
    # knee only along seqlen at s=1024 for every batch (latency independent of batch up to 16)
    grid = {(b, s): (1.0 if s <= 1024 else s / 1024.0) for b in BATCHES for s in SEQLENS}
    k = detect_knee(grid)
    assert k.found and k.axis == "seqlen" and k.config == (1, 1024)
    assert all(ln.knee is None for ln in k.lines["batch"])  # batch costs nothing here
    assert all(ln.knee == 1024 for ln in k.lines["seqlen"])


def test_array_form_matches_mapping():
    arr = np.array([[saturating(b, s) for s in SEQLENS] for b in BATCHES])
    k1 = detect_knee(arr, batches=BATCHES, seqlens=SEQLENS)
    k2 = detect_knee({(b, s): saturating(b, s) for b in BATCHES for s in SEQLENS})
    assert (k1.config, k1.axis, k1.growth) == (k2.config, k2.axis, k2.growth)


def test_order_and_units_do_not_matter():
    items = [((b, s), saturating(b, s)) for b in BATCHES for s in SEQLENS]
    k1 = detect_knee(dict(items))
    k2 = detect_knee({key: 1000.0 * v for key, v in reversed(items)})  # seconds vs ms, reversed order
    assert k1.config == k2.config and math.isclose(k1.growth, k2.growth, rel_tol=1e-6)


def test_linear_grid_has_no_knee():
    grid = {(b, s): 0.05 + 1e-4 * b * s for b in BATCHES for s in SEQLENS}
    k = detect_knee(grid)
    assert not k.found and k.config is None and k.axis is None
    assert k.growth == pytest.approx(1.0, rel=1e-6)
    assert all(g == pytest.approx(1.0, rel=1e-6) for ln in k.lines["seqlen"] for g in ln.growth)


def test_flat_grid_has_no_knee():
    k = detect_knee({(b, s): 2.5 for b in BATCHES for s in SEQLENS})
    assert not k.found and k.growth == 1.0
    assert all(m == 0 for ln in k.lines["batch"] for m in ln.marginal)


def test_too_few_points_no_growth():
    k = detect_knee({(1, 128): 1.0, (1, 256): 2.0, (2, 128): 2.0, (2, 256): 4.0})
    assert not k.found and k.growth is None
    assert all(ln.growth == () and ln.knee is None for a in ("batch", "seqlen") for ln in k.lines[a])


def test_quadratic_attention_with_flops_work():
    # attention-like: flat until 2^22 b*s^2, then proportional to b*s^2
    grid = {(b, s): max(1.0, b * s * s / 2 ** 22) for b in BATCHES for s in SEQLENS}
    k = detect_knee(grid, work=lambda b, s: float(b * s * s))
    assert k.found and k.config[0] * k.config[1] ** 2 == 2 ** 22
    # a pure power law in tokens (L ~ b s^2) is linear in b*s^2: no knee with that work ...
    pure = {(b, s): b * s * s * 1e-6 for b in BATCHES for s in SEQLENS}
    assert not detect_knee(pure, work=lambda b, s: float(b * s * s)).found
    # ... while with tokens as work each seqlen line is convex: no break shrinks the slope and the
    # best one grows it; batch lines (linear in tokens) stay at 1 (documented power-law case)
    k_tokens = detect_knee(pure)
    assert all(g >= 1.0 - 1e-9 for ln in k_tokens.lines["seqlen"] for g in ln.growth)
    assert all(ln.knee_growth > 1.5 for ln in k_tokens.lines["seqlen"])
    assert all(g == pytest.approx(1.0, rel=1e-6) for ln in k_tokens.lines["batch"] for g in ln.growth)
    assert k_tokens.axis == "seqlen"


def test_missing_points_are_skipped():
    grid = {(b, s): saturating(b, s) for b in BATCHES for s in SEQLENS}
    grid[(16, 8192)] = None          # e.g. out of memory
    grid[(8, 8192)] = float("nan")
    k = detect_knee(grid)
    assert k.config == (2, 4096)
    line16 = next(ln for ln in k.lines["seqlen"] if ln.fixed == 16)
    assert line16.values == (256, 512, 1024, 2048, 4096)


def test_min_growth_threshold():
    # marginal cost doubles once: growth 2 at s=1024
    ms = [1.0]
    for lo, hi, slope in ((256, 512, 1.0), (512, 1024, 1.0), (1024, 2048, 2.0)):
        ms.append(ms[-1] + slope * (hi - lo) / 256)
    grid = {(1, s): v for s, v in zip((256, 512, 1024, 2048), ms)}
    assert detect_knee(grid).config == (1, 1024)
    assert detect_knee(grid).growth == pytest.approx(2.0)
    assert not detect_knee(grid, min_growth=2.5).found


@pytest.mark.parametrize("kwargs, arg", [
    (dict(grid={(1, 2, 3): 1.0}), "grid"),
    (dict(grid={(0, 128): 1.0}), "grid"),
    (dict(grid={(1, 128): -1.0}), "grid"),
    (dict(grid={(1, 128): float("inf")}), "grid"),
    (dict(grid={(1, 128): "fast"}), "grid"),
    (dict(grid={(1, 128): None}), "grid"),
    (dict(grid={}), "grid"),
    (dict(grid=[[1.0, 2.0]]), "batches"),
    (dict(grid=[[1.0, 2.0]], batches=[1], seqlens=[128, 256, 512]), "grid"),
    (dict(grid=[[1.0, 2.0]], batches=[1], seqlens=[128, 128]), "seqlens"),
    (dict(grid=[[1.0, 2.0]], batches=[1.5], seqlens=[128, 256]), "batches"),
    (dict(grid={(1, 128): 1.0}, batches=[1]), "batches"),
    (dict(grid={(1, 128): 1.0}, min_growth=1.0), "min_growth"),
    (dict(grid={(1, 128): 1.0}, min_growth=float("nan")), "min_growth"),
    (dict(grid={(1, 128): 1.0}, work=3), "work"),
    (dict(grid={(1, 128): 1.0, (1, 256): 2.0}, work=lambda b, s: 1.0), "work"),
    (dict(grid={(1, 128): 1.0}, work=lambda b, s: -1.0), "work"),
])
def test_bad_inputs_name_the_argument(kwargs, arg):
    grid = kwargs.pop("grid")
    with pytest.raises(ValueError, match=rf"^{arg}:") as ei:
        detect_knee(grid, **kwargs)
    assert isinstance(ei.value, ArgumentError)


def test_mapping_keys_may_have_batch_equal_to_seqlen():
    # only each axis needs distinct values; a key (8, 8) is one cell
    grid = {(b, s): float(b * s) for b in (1, 2, 8) for s in (8, 16, 32)}
    k = detect_knee(grid)
    assert not k.found and k.growth == pytest.approx(1.0)            # linear: no knee
    assert detect_knee({(np.int64(4), np.int64(4)): 1.0}).growth is None
    sat = {(b, s): saturating(b, s, knee_tokens=64) for b in (1, 2, 8) for s in (8, 16, 32)}
    assert detect_knee(sat).found


@pytest.mark.parametrize("work", [lambda b, s: "x", lambda b, s: None, lambda b, s: True,
                                  lambda b, s: float("nan")])
def test_work_returning_a_non_number_names_work(work):
    with pytest.raises(ArgumentError, match=r"^work: expected a finite real number > 0, got .* at seqlen=128"):
        detect_knee({(1, 128): 1.0, (1, 256): 2.0}, work=work)


def test_numpy_min_growth_accepted_bool_rejected():
    grid = {(1, s): saturating(1, s, knee_tokens=256) for s in (64, 128, 256, 512, 1024)}
    assert detect_knee(grid, min_growth=np.float32(1.5)).found
    with pytest.raises(ArgumentError, match="^min_growth:"):
        detect_knee(grid, min_growth=True)


# ---- noise robustness ------------------------------------------------------------------------

NB_BATCHES = (1, 2, 4, 8, 16)
NB_SEQLENS = (256, 512, 1024, 2048, 4096)


def host_bound(b, s, rng, floor_ms=20.0, noise_ms=3.0, knee_tokens=4096, ms_per_ktok=6.0):
    """notebook 04's shape: a host-bound floor (uniform noise of +-noise_ms) up to knee_tokens,
    then linear in tokens (plus the same noise)."""
    t = b * s
    return floor_ms + ms_per_ktok * max(0, t - knee_tokens) / 1000.0 + rng.uniform(-noise_ms, noise_ms)


@pytest.mark.parametrize("seed", range(12))
def test_noisy_host_bound_floor_then_linear_finds_the_known_knee(seed):
    rng = np.random.default_rng(seed)
    grid = {(b, s): host_bound(b, s, rng) for b in NB_BATCHES for s in NB_SEQLENS}
    k = detect_knee(grid)
    assert k.found and k.config[0] * k.config[1] == 4096, (k.config, k.growth)
    assert k.noise_ms == pytest.approx(3.0 / math.sqrt(3), rel=0.6)   # uniform +-3 ms: sigma 1.73 ms
    # the all-floor line (batch 1: 256..4096 tokens) and column (seqlen 256) have no knee
    assert next(ln for ln in k.lines["seqlen"] if ln.fixed == 1).knee is None
    assert next(ln for ln in k.lines["batch"] if ln.fixed == 256).knee is None


@pytest.mark.parametrize("seed", range(12))
def test_noisy_flat_grid_has_no_knee(seed):
    rng = np.random.default_rng(100 + seed)
    grid = {(b, s): 20.0 + rng.uniform(-5.0, 5.0) for b in NB_BATCHES for s in NB_SEQLENS}
    k = detect_knee(grid)
    assert not k.found and k.config is None, (k.growth, k.noise_ms)


def test_the_h200_notebook_sweep_knee_is_at_the_end_of_the_host_bound_floor():
    """Latencies of notebook 04's sweep (H200, 2026-11-29; Llama-3.2-1B config): a 16-28 ms
    host-bound floor up to 4096 tokens, then ~5.9 ms per 1k tokens. The first rule put the knee at
    batch 2 x 256 (a dip of the noise)."""
    ms = {1: (22.973, 22.249, 22.851, 16.272, 27.610), 2: (21.985, 22.738, 17.160, 25.862, 53.841),
          4: (24.994, 20.971, 24.718, 49.728, 103.134), 8: (21.726, 23.942, 48.397, 97.572, 205.159),
          16: (24.820, 47.467, 93.660, 192.343, 406.961)}
    grid = {(b, s): v for b, row in ms.items() for s, v in zip(NB_SEQLENS, row)}
    k = detect_knee(grid)
    assert k.found and k.config[0] * k.config[1] == 4096, k.config
    assert k.growth > 3


def test_isotonic_pools_decreasing_runs():
    from ferroattn.profiler.knee import isotonic
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([18.0, 15.0, 16.0, 17.0, 22.0]) == pytest.approx([49 / 3, 49 / 3, 49 / 3, 17.0, 22.0])
    assert isotonic([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert isotonic([]) == []


def test_single_bump_within_the_noise_is_not_a_knee():
    # a clean linear grid with one point 2% high: the bump is not a change of slope
    grid = {(b, s): 1.0 + 1e-3 * b * s for b in BATCHES for s in SEQLENS}
    grid[(4, 1024)] *= 1.02
    assert not detect_knee(grid).found


def test_rows_and_latencies_must_be_numbers():
    for grid in (["12", "34"], [b"12", b"34"], [{1: 2, 3: 4}, {5: 6, 7: 8}], [{1.0, 2.0}, {3.0, 4.0}], "1234"):
        with pytest.raises(ArgumentError, match="^grid: expected a mapping or a 2-D array of latencies"):
            detect_knee(grid, batches=[1, 2], seqlens=[1, 2])
    with pytest.raises(ArgumentError, match="^grid: expected latencies in ms"):
        detect_knee({(1, 2): " 7 ", (1, 4): 8.0})
    with pytest.raises(ArgumentError, match="^grid: expected a mapping or a 2-D array"):
        detect_knee(5, batches=[1], seqlens=[1])
