"""plot_sweep_heatmap (ferroattn.profiler.heatmap): CPU tests with synthetic sweeps."""
import math

import numpy as np
import pytest

from ferroattn.errors import ArgumentError
from ferroattn.profiler import Knee, detect_knee, plot_sweep_heatmap
from ferroattn.profiler.heatmap import KNEE_GID

BATCHES = [1, 2, 4, 8]
SEQLENS = [128, 256, 512, 1024]


def _lat(b, s):
    """Flat 1 ms (launch-bound) up to 1024 tokens, then 1 us per extra token."""
    t = b * s
    return 1.0 if t <= 1024 else 1.0 + (t - 1024) * 1e-3


def _grid():
    return {(b, s): _lat(b, s) for b in BATCHES for s in SEQLENS}


def _cells(ax):
    """{(row, col): text} from the annotations (rows = batches, cols = seqlens)."""
    return {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}


def _knee_patches(ax):
    return [p for p in ax.patches if p.get_gid() == KNEE_GID]


@pytest.fixture(autouse=True)
def _mpl():
    pytest.importorskip("matplotlib")


def test_writes_png_two_panels(tmp_path):
    path = tmp_path / "sweep.png"
    fig = plot_sweep_heatmap(_grid(), metric=("latency_ms", "tokens_per_s"), path=path, title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    panels = [ax for ax in fig.axes if ax.get_xlabel() == "sequence length"]
    assert [ax.get_title() for ax in panels] == ["latency (ms)", "throughput (tokens/s)"]
    assert fig._suptitle.get_text() == "t"
    for ax in panels:
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in SEQLENS]
        assert [t.get_text() for t in ax.get_yticklabels()] == [str(b) for b in BATCHES]


def test_cell_values_and_annotations():
    g = _grid()
    g[(8, 1024)] = 12.5
    fig = plot_sweep_heatmap(g, metric=("latency_ms", "tokens_per_s"), knee=False)
    lat_ax, tps_ax = [ax for ax in fig.axes if ax.get_xlabel() == "sequence length"]
    lat = lat_ax.images[0].get_array()
    tps = tps_ax.images[0].get_array()
    for i, b in enumerate(BATCHES):
        for j, s in enumerate(SEQLENS):
            assert lat[i, j] == pytest.approx(g[(b, s)])
            assert tps[i, j] == pytest.approx(b * s / (g[(b, s)] / 1e3))
    lc, tc = _cells(lat_ax), _cells(tps_ax)
    assert len(lc) == len(tc) == 16
    assert lc[(0, 0)] == "1" and lc[(3, 3)] == "12.5" and lc[(2, 2)] == "2.02"   # 4*512: 1 + 1.024
    assert tc[(0, 0)] == "128k"                     # 128 tokens / 1 ms
    assert tc[(3, 3)] == "655k"                     # 8192 tokens / 12.5 ms = 655360 tokens/s
    assert _knee_patches(lat_ax) == [] and _knee_patches(tps_ax) == []


def test_missing_cells_show_na():
    g = _grid()
    g[(8, 1024)] = None           # measured nothing (e.g. OOM)
    g[(4, 1024)] = float("nan")
    del g[(1, 1024)]              # never in the sweep
    fig = plot_sweep_heatmap(g, metric="tokens_per_s", knee=False)
    (ax,) = [ax for ax in fig.axes if ax.get_xlabel() == "sequence length"]
    arr = ax.images[0].get_array()
    c = _cells(ax)
    for i in (0, 2, 3):
        v = arr[i, 3]
        assert c[(i, 3)] == "n/a" and (v is np.ma.masked or math.isnan(v))
    assert c[(1, 3)] == "1.01M"                     # 2048 tokens / 2.024 ms = 1.0119M tokens/s
    assert sum(t == "n/a" for t in c.values()) == 3


def test_array_grid_with_axes():
    rows = [[_lat(b, s) for s in SEQLENS] for b in BATCHES]
    rows[0][1] = None
    fig = plot_sweep_heatmap(rows, batches=BATCHES, seqlens=SEQLENS, knee=False)
    c = _cells(fig.axes[0])
    assert c[(0, 1)] == "n/a" and c[(3, 3)] == f"{_lat(8, 1024):.3g}"


def test_knee_outlined_at_detected_cell():
    g = _grid()
    k = detect_knee(g)
    # flat up to 1024 tokens, then linear: the knee is the last flat point (batch*seqlen = 1024);
    # (2, 512) and (4, 256) tie in growth and work, the smaller batch wins
    assert k.config == (2, 512) and k.axis == "seqlen"
    fig = plot_sweep_heatmap(g, metric=("latency_ms", "tokens_per_s"))
    b, s = k.config
    i, j = BATCHES.index(b), SEQLENS.index(s)
    for ax in (a for a in fig.axes if a.get_xlabel() == "sequence length"):
        (p,) = _knee_patches(ax)
        assert p.get_xy() == (j - 0.5, i - 0.5) and p.get_width() == 1 and p.get_height() == 1
    assert f"batch={b}, seqlen={s}" in fig._suptitle.get_text()


def test_knee_given_is_used():
    k = Knee(config=(2, 256), axis="batch", growth=3.0, min_growth=1.5)
    fig = plot_sweep_heatmap(_grid(), knee=k)
    (p,) = _knee_patches(fig.axes[0])
    assert p.get_xy() == (SEQLENS.index(256) - 0.5, BATCHES.index(2) - 0.5)


def test_no_knee_no_outline():
    flat = {(b, s): 0.001 * b * s for b in BATCHES for s in SEQLENS}   # perfectly linear in tokens
    assert not detect_knee(flat).found
    fig = plot_sweep_heatmap(flat)
    assert _knee_patches(fig.axes[0]) == []
    assert "no knee" in fig._suptitle.get_text()


@pytest.mark.parametrize("metric", ["latency", "tokens/s", "", None, 3, ("latency_ms", "latency_ms"), ()])
def test_bad_metric(metric):
    with pytest.raises(ArgumentError, match=r"^metric:"):
        plot_sweep_heatmap(_grid(), metric=metric)


@pytest.mark.parametrize("knee", ["(1, 128)", (1, 128),
                                  Knee(config=(3, 128), axis="batch", growth=2.0, min_growth=1.5)])
def test_bad_knee(knee):
    with pytest.raises(ArgumentError, match=r"^knee:"):
        plot_sweep_heatmap(_grid(), knee=knee)


def test_bad_grid_named():
    with pytest.raises(ArgumentError, match=r"^grid:"):
        plot_sweep_heatmap({(1, 128): -1.0})
    with pytest.raises(ArgumentError, match=r"^seqlens:"):
        plot_sweep_heatmap([[1.0]], batches=[1])


def test_cell_with_batch_equal_to_seqlen():
    assert plot_sweep_heatmap({(4, 4): 1.0}).axes                         # one cell, batch == seqlen
    fig = plot_sweep_heatmap({(4, 4): 1.0, (4, 8): 2.0, (8, 4): 2.5})
    assert _cells(fig.axes[0]) == {(0, 0): "1", (0, 1): "2", (1, 0): "2.5", (1, 1): "n/a"}


@pytest.mark.parametrize("name, match", [
    ("dir", "is a directory"),
    ("plot", r"no suffix in"),
    ("plot.notafmt", r"suffix \.notafmt"),
])
def test_path_must_be_an_image_file_name(tmp_path, name, match):
    (tmp_path / "dir").mkdir()
    path = tmp_path / name
    with pytest.raises(ArgumentError, match=rf"^path: .*{match}"):
        plot_sweep_heatmap(_grid(), path=path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]       # nothing written, no "<dir>.png"
    with pytest.raises(ArgumentError, match="^path:"):
        plot_sweep_heatmap(_grid(), path="")


def test_other_formats_by_suffix(tmp_path):
    plot_sweep_heatmap(_grid(), path=tmp_path / "h.svg")
    plot_sweep_heatmap(_grid(), path=tmp_path / "H.PNG")
    assert (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "H.PNG").read_bytes()[:4] == b"\x89PNG"


def test_knee_without_growth_is_drawn():
    grid = _grid()
    cfg = next(iter(grid))
    fig = plot_sweep_heatmap(grid, knee=Knee(cfg, None, None, 1.5))
    assert len(_knee_patches(fig.axes[0])) == 1 and "knee at" in fig._suptitle.get_text()


# ---- layout and number formats ---------------------------------------------------------------------

def _render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _overlap(a, b):
    return min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0)


@pytest.mark.parametrize("metric", ["latency_ms", ("latency_ms", "tokens_per_s")])
def test_knee_legend_overlaps_no_axis_label_or_tick(metric):
    fig = plot_sweep_heatmap(_grid(), metric=metric)
    r = _render(fig)
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)
    legend = fig.legends[0].get_window_extent(r)
    for ax in fig.axes:
        for label in [ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels()]:
            if label.get_text():
                assert not _overlap(legend, label.get_window_extent(r)), label.get_text()


def test_large_growth_and_latency_are_not_in_exponent_notation():
    from ferroattn.profiler import Knee
    grid = {(1, 256): 1.0, (1, 512): 1.0, (1, 1024): 1234.5, (2, 256): 1.0, (2, 512): 2.0, (2, 1024): 4.0}
    fig = plot_sweep_heatmap(grid, knee=Knee((1, 512), "seqlen", 1234.5, 1.5))
    title = fig._suptitle.get_text()
    assert "1234x" in title and "e+" not in title
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "1234" in texts and not any("e+" in t for t in texts)
