"""Plots of timing dumps: files are valid PNG / SVG, one row per rank."""

import xml.etree.ElementTree as ET

import pytest

from mpipar.analysis import breakdown, load
from mpipar.analysis import synthetic as sy
from mpipar.cli import main

plots = pytest.importorskip("mpipar.analysis.plots")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run8(tmp_path):
    """dp=2 x pp=2 x tp=2: every kind of event (F, B, LOSS, OPT, pp, tp, dp, world)."""
    path = sy.write(
        tmp_path / "trace.h5",
        sy.pipeline_events(pp=2, microbatches=3, steps=2, tp=2, dp=2),
        grid={"dp": 2, "pp": 2, "tp": 2},
    )
    return load(path)


def check_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def check_svg(path):
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")


def tick_labels(ax):
    return [t.get_text() for t in ax.get_yticklabels()]


def test_timeline_png_and_svg(run8, tmp_path):
    fig = plots.timeline(run8, tmp_path / "t.png")
    check_png(tmp_path / "t.png")
    labels = tick_labels(fig.axes[0])
    assert labels == [run8.label(r) for r in range(8)]
    assert labels[5] == "r5 dp1/pp0/tp1"
    # micro-batch numbers are written on the compute boxes
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"0", "1", "2"} <= texts
    fig = plots.timeline(run8, tmp_path / "t.svg", step=0)
    check_svg(tmp_path / "t.svg")
    assert "step 0" in fig.axes[0].get_title()


def test_timeline_bad_inputs(run8, tmp_path):
    with pytest.raises(ValueError, match="step 9 has no events"):
        plots.timeline(run8, tmp_path / "t.png", step=9)
    with pytest.raises(ValueError, match=r"use a \.png or \.svg suffix"):
        plots.timeline(run8, tmp_path / "t.pdf")


def test_breakdown_bars(run8, tmp_path):
    fig = plots.breakdown_bars(run8, tmp_path / "b.png")
    check_png(tmp_path / "b.png")
    assert len(tick_labels(fig.axes[0])) == 8
    # the stacked bars of a rank add up to its step time (compute + exposed + idle)
    ax = fig.axes[0]
    widths = {}
    for patch in ax.patches:
        y = round(patch.get_y() + patch.get_height() / 2)
        widths[y] = widths.get(y, 0.0) + patch.get_width()
    step = breakdown(run8)["ranks"]["step_time"]
    assert [widths[r] for r in range(8)] == pytest.approx(step.tolist(), rel=1e-9)
    plots.breakdown_bars(run8, tmp_path / "b.svg")
    check_svg(tmp_path / "b.svg")


def test_scaling(tmp_path):
    runs = []
    for pp in (1, 2, 4):
        runs.append(
            sy.write(
                tmp_path / f"pp{pp}.h5",
                sy.pipeline_events(pp=pp, steps=2),
                grid={"dp": 1, "pp": pp, "tp": 1},
            )
        )
    fig = plots.scaling(runs, tmp_path / "s.png")
    check_png(tmp_path / "s.png")
    ax_t, ax_e = fig.axes
    x, y = ax_e.lines[0].get_data()
    assert list(x) == [1, 2, 4] and y[0] == pytest.approx(1.0)
    plots.scaling(runs, tmp_path / "s.svg", x="pp")
    check_svg(tmp_path / "s.svg")
    with pytest.raises(ValueError, match="x must be one of"):
        plots.scaling(runs, tmp_path / "s.png", x="nodes")


def test_cli_plots(run8, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["analyze", run8.path, "--plots", str(out), "--plot-format", "svg"]) == 0
    assert "plots:" in capsys.readouterr().err
    name = run8.name
    check_svg(out / f"timeline_{name}.svg")
    check_svg(out / f"breakdown_{name}.svg")
