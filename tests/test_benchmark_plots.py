"""The plots of docs/benchmarks.md agree with the tables beside them.

Before: mesh.png drew the quick run (load time rising with devices) beside a paragraph
saying it does not rise; kernels.png drew a GPU target on a CPU plot and clipped bars at
200%; offload.png drew the engine above a line called "the ceiling". Now each plot draws
one recorded run of the page (`--replot`), in its table's unit, nothing clipped, and
says what it was measured on. Here each plotted run is read back from the page and
drawn; the figure's bars and lines must carry the table's values.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "benchmarks.md").read_text()
# (script, the heading above the recorded run its plot draws, in the doc)
PLOTTED = {
    "kernels": "### 2026-11-30, quick run (idle machine, 16:40 UTC)",
    "offload": "### 2026-11-30, quick run (idle machine, 16:40 UTC)",
    "canonical": "### 2026-11-30, full sizes (idle machine, 16:47 UTC)",
    "mesh": "### 2026-11-30, full sizes (idle machine, 16:48 UTC)",
}


def load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        f"_bench_plot_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def recorded(name: str) -> str:
    """The `text` block of `name`'s run under its heading in docs/benchmarks.md."""
    start = DOC.index("## Kernels" if name == "kernels" else f"(`benchmarks/{name}.py`)")
    section = DOC[start:]
    section = section[section.index(PLOTTED[name]) :]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    assert f"# {name} benchmark:" in block
    return block


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Runs `<script> --replot` on its recorded run; returns (module, the figure)."""
    figures = []

    def run(name: str):
        module = load(name)
        monkeypatch.setattr(module._report, "save", lambda fig, path: figures.append(fig))
        src = tmp_path / f"{name}.txt"
        src.write_text(recorded(name))
        assert module.main(["--replot", str(src), "--out", str(tmp_path)]) == 0
        (fig,) = figures
        return module, fig

    yield run
    import matplotlib.pyplot as plt

    plt.close("all")


def title_of(fig) -> str:
    texts = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    return " ".join(texts + [ax.get_title() for ax in fig.axes])


def bar_tops(ax) -> list[float]:
    # ratio bars start at 1 (bottom) and end at the value; plain bars start at 0
    return [round(p.get_y() + p.get_height(), 6) for p in ax.patches]


@pytest.mark.parametrize("name", sorted(PLOTTED))
def test_the_plot_says_where_it_was_measured(drawn, name):
    _, fig = drawn(name)
    assert "measured 2026-11-30, x86_64 2 CPUs, jax 0.10.2 on cpu" in title_of(fig)


def test_kernels_plot_draws_the_table_s_ratios_unclipped_and_no_gpu_target_on_cpu(drawn):
    module, fig = drawn("kernels")
    _, tables = module._report.read_recorded(recorded("kernels"), "kernels")
    rows = module._report.parse_rows(tables[0][1], module.COLUMNS)
    for ax, op in zip(fig.axes, ("gather", "scatter"), strict=True):
        want = [
            r[f"{op}_vs_copy"]
            for r in sorted(rows, key=lambda r: (r["layers"], r["page_kib"], r["blocks"]))
        ]
        assert bar_tops(ax) == pytest.approx(want)
        low, high = ax.get_ylim()
        assert low < min(want) and high > max(want)  # nothing clipped (3.73x included)
        labels = [line.get_label() for line in ax.get_lines()]
        assert not any("GPU" in label for label in labels), labels
        assert ax.get_yscale() == "log"


def test_offload_plot_draws_the_table_s_gib_per_s_and_no_ceiling(drawn):
    module, fig = drawn("offload")
    _, tables = module._report.read_recorded(recorded("offload"), "offload")
    by = dict(tables)
    for ax, title in zip(fig.axes, (module.STORE_TITLE, module.LOAD_TITLE), strict=True):
        cells = by[title]
        want = [float(r[h]) for h in ("engine", "per-block", "one copy") for r in cells]
        assert bar_tops(ax) == pytest.approx(want)
    text = title_of(fig) + " ".join(t.get_text() for t in fig.legends[0].get_texts())
    assert "ceiling" not in text.lower()


def test_mesh_plot_draws_the_full_run_s_ratios_that_do_not_rise(drawn):
    module, fig = drawn("mesh")
    (ax,) = fig.axes
    _, tables = module._report.read_recorded(recorded("mesh"), "mesh")
    rows = module._report.parse_rows(tables[0][1], module.COLUMNS)
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["store job"] == pytest.approx([r["store_over_1"] for r in rows])
    assert lines["load job"] == pytest.approx([r["load_over_1"] for r in rows])
    # What the paragraph beside it says: more devices cost no more (within 10%).
    assert max(lines["store job"] + lines["load job"]) <= 1.1
    assert "0.58-1.09×" in DOC


def test_canonical_plot_draws_the_relayout_share_of_the_full_run(drawn):
    module, fig = drawn("canonical")
    _, tables = module._report.read_recorded(recorded("canonical"), "canonical")
    rows = module._report.parse_rows(tables[0][1], module.COLUMNS)
    for ax, d in zip(fig.axes, ("store", "load"), strict=True):
        widths = [round(p.get_width(), 6) for p in ax.patches]
        want = [100 * r["relayout_extra_share"] for r in rows if r["direction"] == d]
        assert widths == pytest.approx(want)


def test_a_recorded_table_reads_back_as_printed():
    module = load("kernels")
    report = module._report
    rows = [
        {"backend": "xla", "layers": 32, "page_kib": 4, "blocks": 1024, "mib": 128.0,
         "gather_gibps": 2.41, "scatter_gibps": 4.02, "copy_gibps": 3.17,
         "gather_vs_copy": 0.76, "scatter_vs_copy": 1.27, "gather_vs_xla": 1.0,
         "scatter_vs_xla": float("nan")},
    ]  # fmt: skip
    text = report.banner("kernels", {"date": "d", "machine": "m", "cpus": 2}) + "\n\n"
    text += report.table(rows, module.COLUMNS)
    info, tables = report.read_recorded(text, "kernels")
    assert info == {"name": "kernels", "date": "d", "machine": "m", "cpus": 2}
    (back,) = report.parse_rows(tables[0][1], module.COLUMNS)
    nan = back.pop("scatter_vs_xla")
    assert nan != nan and back == {k: v for k, v in rows[0].items() if k != "scatter_vs_xla"}
    with pytest.raises(SystemExit, match="no '# mesh benchmark"):
        report.read_recorded(text, "mesh")
