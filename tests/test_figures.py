"""Every image the README and docs show was drawn by a script from data that is still current.

Each PNG carries its provenance (``flexsp.evaluation.plots.save_with_provenance``): the program that
drew it and a SHA-256 of what it plotted. A data-file image must match its CSV byte for byte (redraw
with ``python experiments/<script>.py --replot``); a plan image must match the plan the planner makes
today (redraw with the ``Source`` command).
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from flexsp.evaluation.plots import plan_digest, png_provenance

ROOT = Path(__file__).resolve().parents[1]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")


def shown_images() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {(page.parent / match).resolve() for page in pages for match in IMAGE.findall(page.read_text())}
    return sorted(found)


def test_docs_show_images():
    assert shown_images(), "the README and docs show no image: the check below would pass vacuously"


@pytest.mark.parametrize("image", shown_images(), ids=lambda p: p.name)
def test_image_is_generated_and_current(image):
    assert image.is_file(), f"{image} is shown in the docs but does not exist"
    meta = png_provenance(image)
    assert meta.get("Software") == "flexsp" and meta.get("Source"), \
        f"{image.name} has no provenance: draw it with a script that uses save_with_provenance"
    if "Data-SHA256" in meta:
        data = image.parent / meta["Data"]
        assert hashlib.sha256(data.read_bytes()).hexdigest() == meta["Data-SHA256"], \
            f"{image.name} was drawn from an older {data.name}: run {meta['Source']} --replot"
    else:
        assert "Plan-SHA256" in meta, f"{image.name} records neither its data file nor its plan"
        assert meta["Source"] == "flexsp simulate --gantt"
        assert meta["Plan-SHA256"] == _default_first_plan_digest(), \
            f"{image.name} shows an older plan: rerun `flexsp simulate --time-limit 60 --strategies flexsp --steps 1 " \
            f"--gantt {image.relative_to(ROOT)}`"


def _default_first_plan_digest() -> str:
    """The first FlexSP plan of the README's default simulation (a time limit that cannot bind)."""
    import flexsp
    from flexsp.evaluation.simulate import simulate
    from flexsp.plan.lengths import get_distribution
    cluster = flexsp.Cluster(64, 8)
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    sim = simulate(get_distribution("wikipedia"), cost, cluster, ["flexsp"], steps=1,
                   config=flexsp.PlanConfig(time_limit=60.0), progress=False)
    return plan_digest(sim.runs["flexsp"].first_plan, sim.first_batch)


def test_a_changed_csv_is_caught(tmp_path):
    from flexsp.evaluation.plots import _pyplot, save_with_provenance
    data = tmp_path / "d.csv"
    data.write_text("x\n1\n")
    plt = _pyplot()
    fig, _ = plt.subplots()
    image = save_with_provenance(fig, tmp_path / "d.png", source="test", data=data)
    data.write_text("x\n2\n")
    assert hashlib.sha256(data.read_bytes()).hexdigest() != png_provenance(image)["Data-SHA256"]
