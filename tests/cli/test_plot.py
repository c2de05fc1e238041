"""`sigmaflight plot` (sigmaflight/plot.py, matplotlib) on trajectories pulled from the real server.

References: the request the test sent (prompts, prompt-major sample order), the file read with
plain pyarrow (sigmas, log_prob column), and the stock pipeline's decode (tests/pipeline/test_decode.py
checks sigmaflight.pipeline.decode against it; here, the images drawn are those bytes).
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pyarrow as pa
import pytest
from matplotlib.image import AxesImage
from PIL import Image

from sigmaflight.cli import main
from sigmaflight.plot import PLOT_HEIGHT, PLOT_WIDTH, decode_final, draw
from sigmaflight.report import build_report, read_arrow_file
from tests.servers import InProcessServer

PROMPTS = ["a red cube on a table", "a dog"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Trajectory files pulled with the CLI: tiny-sd3 2x2, tiny-flux 2x5 (10 samples), tiny-wan 2x1, sd3 without x_T,
    tiny-sd3 of 20 prompts."""
    d = tmp_path_factory.mktemp("plot")
    runs = {
        "sd3": ["--model", "tiny-sd3", "-n", "2", "--steps", "4", "--sampler", "sde", "--sde-steps", "1,2"],
        "flux": ["--model", "tiny-flux", "-n", "5", "--steps", "3", "--sampler", "sde"],
        "wan": ["--model", "tiny-wan", "--steps", "2", "--sampler", "sde"],
        "no_xt": ["--model", "tiny-sd3", "--steps", "3", "--return-steps", "0,1"],
        "many": ["--model", "tiny-sd3", "--steps", "2", "--sampler", "sde",
                 *(a for k in range(2, 20) for a in ("-p", f"prompt number {k}"))],  # 20 prompts
    }
    out = {}
    with InProcessServer() as s:
        for name, flags in runs.items():
            argv = ["submit", "--url", s.rest_url, "-p", PROMPTS[0], "-p", PROMPTS[1], "--seed", "5", "--wait", *flags]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(argv) == 0
            path = d / f"{name}.arrow"
            assert main(["pull", json.loads(buf.getvalue())["id"], "--url", s.rest_url, "-o", str(path)]) == 0
            out[name] = path
    return out


def _figure(path, **kw):
    rep = build_report(str(path), *read_arrow_file(path))
    return rep, draw(rep, decode_final(path, rep, **kw))


def _table(path) -> pa.Table:
    with pa.memory_map(str(path)) as f:
        return pa.ipc.open_file(f).read_all()


def _image_axes(fig):
    return [ax for ax in fig.axes if any(isinstance(a, AxesImage) for a in ax.get_children())]


def test_panels_have_titles_ticks_legend_and_the_files_numbers(files):
    rep, fig = _figure(files["sd3"])
    sched, lp = fig.axes[0], fig.axes[1]
    assert "sigma schedule" in sched.get_title() and sched.get_xlabel() == "absolute step index i"
    assert "log_prob" in lp.get_title() and lp.get_ylabel() == "log_prob"
    table = _table(files["sd3"])
    sigmas = json.loads(table.schema.metadata[b"sigmaflight.sigmas"])
    line = sched.get_lines()[0]
    assert list(line.get_xdata()) == list(range(len(sigmas))) == list(sched.get_xticks())
    np.testing.assert_array_equal(np.asarray(line.get_ydata(), np.float32), np.asarray(sigmas, np.float32))
    stochastic = sched.get_lines()[1]
    assert list(stochastic.get_xdata()) == [1, 2]
    # One log-prob line per sample, its values those of the file's log_prob column.
    legend = [t.get_text() for t in lp.get_legend().get_texts()]
    assert legend == ["sample 0 (a red cube on a tab\u2026)", "sample 1 (a red cube on a tab\u2026)",
                      "sample 2 (a dog)", "sample 3 (a dog)"]
    rows = table.filter(pa.compute.is_valid(table["log_prob"])).select(["step", "sample", "log_prob"]).to_pylist()
    for k, ln in enumerate(lp.get_lines()):
        want = sorted((r["step"], r["log_prob"]) for r in rows if r["sample"] == k)
        assert list(zip(ln.get_xdata(), ln.get_ydata(), strict=True)) == want
    assert [int(t) for t in lp.get_xticks()] == [1, 2]
    # The decoded images, prompt-major, each with its prompt under it.
    images = _image_axes(fig)
    assert [ax.get_xlabel().replace("\n", " ") for ax in images] == [
        "#0: a red cube on a table", "#1: a red cube on a table", "#2: a dog", "#3: a dog"]
    for ax in images:
        arr = ax.get_images()[0].get_array()
        assert arr.shape == (32, 32, 3) and arr.dtype == np.uint8 and arr.std() > 5


def test_many_samples_get_a_legend_per_prompt(files):
    _, fig = _figure(files["flux"])
    lp = fig.axes[1]
    assert [t.get_text() for t in lp.get_legend().get_texts()] == [
        "prompt 0: a red cube on a table", "prompt 1: a dog"]
    assert len(lp.get_lines()) == 10  # still a line per sample, coloured by prompt
    assert len(_image_axes(fig)) == 8 and any("first 8 of 10 samples" in t.get_text() for t in fig.texts)


def test_a_legend_of_many_prompts_names_the_first_and_counts_the_rest(files):
    """Twenty prompts made twenty legend entries, which covered the panel and its title."""
    _, fig = _figure(files["many"])
    lp = fig.axes[1]
    labels = [t.get_text() for t in lp.get_legend().get_texts()]
    assert labels[:2] == ["prompt 0: a red cube on a table", "prompt 1: a dog"]
    assert len(labels) == 10 and labels[-1] == "... 11 more prompts"
    assert len([line for line in lp.get_lines() if len(line.get_xdata())]) == 20  # a line per sample all the same


def test_video_shows_frames_per_sample(files, tmp_path):
    _, fig = _figure(files["wan"])
    images = _image_axes(fig)
    assert len(images) == 2 * 5  # 2 samples x 5 of the 9 frames
    assert [ax.get_title() for ax in images[:5]] == ["frame 0", "frame 2", "frame 4", "frame 6", "frame 8"]
    assert images[2].get_xlabel() == "#0: a red cube on a table" and images[7].get_xlabel() == "#1: a dog"
    first, last = images[0].get_images()[0].get_array(), images[4].get_images()[0].get_array()
    assert first.shape == (32, 32, 3) and not np.array_equal(first, last)
    png = tmp_path / "wan.png"
    assert main(["plot", str(files["wan"]), "-o", str(png)]) == 0
    with Image.open(png) as im:
        assert im.size == (PLOT_WIDTH, PLOT_HEIGHT)


def test_local_model_dir_decodes_with_its_vae(files, tmp_path):
    from sigmaflight.pipeline.models import ModelRegistry

    ModelRegistry().get("tiny-sd3").pipeline.save_pretrained(tmp_path / "m")
    _, built_in = _figure(files["sd3"])
    _, local = _figure(files["sd3"], model_dir=tmp_path / "m")
    for a, b in zip(_image_axes(built_in), _image_axes(local), strict=True):
        assert np.array_equal(a.get_images()[0].get_array(), b.get_images()[0].get_array())


def _says(fig, text: str) -> bool:
    """`text` is in one of the figure's texts; the panel wraps long lines (a long tmp path), so
    compare with the line breaks read as spaces."""
    return any(text in " ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts)


def test_the_panel_says_why_there_are_no_images(files, tmp_path):
    _, fig = _figure(files["no_xt"])
    assert not _image_axes(fig) and _says(fig, "x_T (step 3) was not streamed")
    _, fig = _figure(files["sd3"], model_dir=tmp_path / "missing")
    assert _says(fig, "is not a directory")
    # A model this machine does not have: the metadata names another id.
    table = _table(files["sd3"])
    meta = dict(table.schema.metadata)
    rollout = json.loads(meta[b"sigmaflight.rollout"])
    rollout["model"]["id"] = "someone-elses-model"
    meta[b"sigmaflight.rollout"] = json.dumps(rollout).encode()
    other = tmp_path / "other.arrow"
    with pa.OSFile(str(other), "wb") as sink, pa.ipc.new_file(sink, table.schema.with_metadata(meta)) as w:
        w.write_table(table)
    _, fig = _figure(other)
    assert _says(fig, "model 'someone-elses-model' is not available here")
    png = tmp_path / "other.png"
    assert main(["plot", str(other), "-o", str(png)]) == 0 and png.stat().st_size > 10_000
