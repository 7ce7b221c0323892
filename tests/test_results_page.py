"""docs/results.md is what tools/results_page.py generates from docs/results/ (a stale page fails here), and
every table on it says when, at which commit and on what hardware it was measured."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "results.md"
DATA = REPO / "docs" / "results"
DATE = r"\d{4}-\d{2}-\d{2}"
COMMIT = r"(commit `[0-9a-f]{7,40}`|no commit recorded \(figures added to the docs in `[0-9a-f]{7,40}`\))"
MEASURED = re.compile(rf"^Measured ({DATE}) · {COMMIT} · on (\S.+?)( · .*)?\.?$")


def generator():
    spec = importlib.util.spec_from_file_location("results_page", REPO / "tools" / "results_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page")
    assert generator().main(["--out", str(out)]) == 0
    return out


def tables(text: str) -> list[tuple[int, list[str]]]:
    """(line index of the header, rows) of every Markdown table."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|(-+\|)+$", lines[i + 1]):
            start, i = i, i + 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            found.append((start, rows))
        else:
            i += 1
    return found


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def test_page_is_what_the_generator_writes(generated: Path) -> None:
    assert PAGE.read_text() == (generated / "results.md").read_text(), (
        "docs/results.md is out of date: run .venv/bin/python tools/results_page.py and commit the page and its PNGs")


def test_every_plot_the_page_shows_is_generated_and_committed(generated: Path) -> None:
    images = re.findall(r"!\[[^\]]*\]\((results/[^)]+\.png)\)", PAGE.read_text())
    assert len(images) >= 4
    for image in images:
        assert (generated / image).is_file(), image
        assert (REPO / "docs" / image).is_file(), f"docs/{image} is not there: run tools/results_page.py"
    pngs = {f"results/{p.name}" for p in DATA.glob("*.png")}
    assert pngs == set(images), f"PNGs no page shows, or missing: {pngs ^ set(images)}"


def test_every_table_row_has_date_commit_and_hardware() -> None:
    text = PAGE.read_text()
    lines = text.splitlines()
    found = tables(text)
    assert len(found) >= 10
    glance_start, glance = found[0]
    header = cells(lines[glance_start])
    assert header[-3:] == ["date", "commit", "hardware"], header
    for row in glance:
        date, commit, hardware = cells(row)[-3:]
        assert re.fullmatch(DATE, date), row
        assert re.fullmatch(COMMIT, commit), row
        assert hardware, row
    for start, rows in found[1:]:
        # the table's heading line: the nearest "Measured DATE · COMMIT · on HARDWARE" above it, below its heading
        j = start - 1
        while j >= 0 and not MEASURED.match(lines[j]):
            assert not lines[j].startswith("#"), f"table at line {start + 1} has no 'Measured ...' line above it"
            j -= 1
        assert j >= 0, f"table at line {start + 1} has no 'Measured ...' line above it"
        assert rows, f"table at line {start + 1} is empty"


def test_every_measurement_folder_is_complete_and_dated() -> None:
    folders = [d for d in DATA.iterdir() if d.is_dir()]
    assert len(folders) >= 8
    for d in folders:
        meta = json.loads((d / "meta.json").read_text())
        json.loads((d / "results.json").read_text())
        assert re.fullmatch(DATE, meta["date"]), d
        assert meta.get("commit") or meta.get("recorded_in"), f"{d.name}: a commit, or the commit that recorded it"
        assert meta["hardware"] and meta["command"] and meta["source"], d
        for metrics in d.glob("*/metrics.jsonl"):
            assert all(json.loads(x)["loss"] > 0 for x in metrics.read_text().splitlines())


def test_no_work_period_wording_in_the_docs() -> None:
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"\bsession( \d|s \d)|this session|same session", line, re.I), f"{path.name}:{n}: {line}"


def test_a_superseded_measurement_is_one_line_under_the_newer_one() -> None:
    text = PAGE.read_text()
    for d in DATA.iterdir():
        meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").is_file() else {}
        if meta.get("superseded_by"):
            lines = [x for x in text.splitlines() if f"](results/{d.name}/)" in x]
            assert len(lines) == 1 and lines[0].startswith("Earlier measurement, superseded: "), d.name


def test_check_mode_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = generator()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text(PAGE.read_text() + "\nhand-edited line\n")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    assert mod.main(["--check"]) == 1
    (docs / "results.md").write_text(PAGE.read_text())
    assert mod.main(["--check"]) == 0


def github_anchor(heading: str) -> str:
    keep = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def test_links_between_the_docs_reach_their_headings() -> None:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    anchors = {f.resolve(): {github_anchor(x.lstrip("#")) for x in f.read_text().splitlines() if x.startswith("#")}
               for f in files}
    for f in files:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)", f.read_text()):
            dest = (f.parent / target).resolve() if target else f.resolve()
            assert dest in anchors, f"{f.name}: link to {target}"
            assert anchor in anchors[dest], f"{f.name}: no heading #{anchor} in {dest.name}"
        for target in re.findall(r"\]\(((?:results|docs)/[^)#\s]+)\)", f.read_text()):
            assert (f.parent / target).exists(), f"{f.name}: {target} does not exist"


def test_start_save_figures_give_the_compile_seconds_and_the_warm_start(tmp_path: Path) -> None:
    """A start/save measurement with the bench's compile_s (torch.compile's seconds by function) shows them under
    step 1, with the second process's start-up less its load."""
    page = generator()
    folder = tmp_path / "start-save"
    folder.mkdir()
    meta = json.loads((DATA / "start-save-1gpu-2026-12-02-ahead" / "meta.json").read_text())
    results = json.loads((DATA / "start-save-1gpu-2026-12-02-ahead" / "results.json").read_text())
    results[0]["save"].update(compile_s={"swiglu": 2.84, "swiglu_back": 0.49}, compile_total_s=3.33)
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "results.json").write_text(json.dumps(results))
    rows = {name: value for name, value, _, _ in page.start_save_figures(page.Measurement(folder))}
    assert rows["of step 1: torch.compile, by function"] == "swiglu 2.84, swiglu_back 0.49 = 3.3 s"
    assert rows["start -> end of step 1, second process (torch's compile cache warm), less its load"] == \
        "16.1 s (step 1 3.8)"


def test_levers_and_step_profile_read_the_committed_dense_3b_runs() -> None:
    """bench/levers.py's rows (vs transformers and vs the defaults, cold start, compile seconds) and profile_step's
    kernel families, from the dense 3B measurements of 2026-12-02."""
    page = generator()
    levers = page.Measurement(DATA / "levers-dense-3b-1gpu-2026-12-02")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in page.levers_table(levers).splitlines()[2:]]
    rows = {row[0]: row[1:] for row in cells}
    assert rows["bf16, defaults"][:5] == ["31.1k", "53.1%", "67.7", "1.21x", "1.00x"]
    assert rows["bf16, gaf + te-act"][4] == "1.03x" and rows["bf16, ce-plain (unfused cross entropy)"][-2:] == ["19.4", "2.1"]
    assert rows["HF transformers bf16"][-2:] == ["", ""]  # no start-up or compile figures for transformers
    assert page.levers_headline(levers) == ("defaults 31.1k tokens/s (MFU 53.1%); best `gaf+te-act` 31.8k (+2.6%, "
                                            "1.24x transformers)")
    profile = page.Measurement(DATA / "profile-dense-3b-1gpu-2026-12-02")
    assert page.step_profile_headline(profile) == ("GPU busy 99% of a 2113 ms step: GEMM 65%, attention 16%, "
                                                   "other 15%, memory copy/set 3%")
    assert "| GPU idle (waiting for the host) | 18.3 | 0.9% |" in page.step_profile_table(profile)


def test_attention_and_writer_probes_read_their_committed_runs() -> None:
    """attention_probe's kernel columns come from the profiled kernels (the call columns include TE's host time),
    and writer_probe's rows are told apart by CUDA_DEVICE_MAX_CONNECTIONS where they give it."""
    page = generator()
    attn = page.Measurement(DATA / "attention-probe-1gpu-2026-12-03")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in page.attention_probe_table(attn).splitlines()[2:]}
    assert rows["te-sbhd"][:4] == ["0.966", "1.411", "0.356 (579)", "0.995 (518)"]
    assert rows["torch-flash"][2:4] == ["0.685 (301)", "1.823 (283)"] and rows["torch-flash"][-1] == "1.1e-03"
    assert page.attention_probe_headline(attn) == ("TE (cuDNN): forward kernel 0.36 ms, backward kernel 0.99 ms; "
                                                   "FlashAttention-2 (torch) 0.69 and 1.82 ms")
    probe = page.Measurement(DATA / "writer-probe-connections-1gpu-2026-12-03")
    assert "| copy-steps | 1 | 1.53 | 0.4311 |" in page.writer_probe_table(probe)
    assert "| steps | 8 |  | 0.4296 |" in page.writer_probe_table(probe)  # no writer: an empty cell
    headline = page.writer_probe_headline(probe)
    assert headline.startswith("1 CUDA connection(s): the writer copying from the GPU one tensor ahead 0.605 GB/s")
    assert "8 CUDA connection(s): " in headline and headline.endswith("the copies alone 45.761 GB/s")


def test_cold_start_reads_its_committed_run() -> None:
    page = generator()
    run = page.Measurement(DATA / "cold-start-1gpu-2026-12-03")
    assert "| no-bytecode | 27.59 | 4.56 | 16.58 | 0.02 | 0.37 | 0.33 | 0.27 | 5.46 |" in page.cold_start_table(run)
    assert page.cold_start_headline(run) == (
        "start to the end of step 1: the first run (its caches empty) 42.5 s, later runs 13.4 and 14.6 s; without "
        "the bytecode cache 27.6 s (PYTHONDONTWRITEBYTECODE=1, torch installed without bytecode)")
    cold = page.Measurement(DATA / "cold-start-1gpu-2026-12-03-cold-disk")  # first-serial and --cold-disk
    assert "| first-serial | 34.62 | 5.45 | 13.08 |" in page.cold_start_table(cold)
    assert page.cold_start_headline(cold).startswith(
        "start to the end of step 1: the first run (its caches empty) 22.6 s (34.6 s compiling on its own), the "
        "installs' files out of the page cache before each, later runs 11.0 and 9.8 s; without the bytecode cache "
        "19.6 s")


def test_cold_start_headline_names_the_cuda_cache_case(tmp_path: Path) -> None:
    """A run of bench/cold_start.py since its no-cuda-cache case: the headline gives it after the warm runs."""
    page = generator()
    folder = tmp_path / "cold-start"
    folder.mkdir()
    meta = json.loads((DATA / "cold-start-1gpu-2026-12-04-cuda-cache" / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(meta))
    rows = [{"case": "environment", "PYTHONDONTWRITEBYTECODE": "", "torch_installed_with_bytecode": True,
             "cold_disk": False}] + [{"case": c, "step1_s": s} for c, s in
                                     (("first", 24.0), ("warm", 12.0), ("no-cuda-cache", 15.5))]
    (folder / "results.json").write_text(json.dumps(rows))
    assert page.cold_start_headline(page.Measurement(folder)) == (
        "start to the end of step 1: the first run (its caches empty) 24.0 s, later runs 12.0 s; with the CUDA "
        "driver's cache empty 15.5 s (PYTHONDONTWRITEBYTECODE=unset, torch installed with bytecode)")


def test_levers_headline_when_no_lever_beats_the_defaults() -> None:
    page = generator()
    run = page.Measurement(DATA / "levers-dense-3b-gaf-1gpu-2026-12-04")
    assert page.levers_headline(run) == ("defaults 31.7k tokens/s (MFU 54.3%), ahead of every lever; next `no-gaf` "
                                         "30.9k (-2.6%)")


def test_levers_headline_of_a_run_of_the_defaults_alone(tmp_path: Path) -> None:
    page = generator()
    source = DATA / "levers-dense-3b-gaf-1gpu-2026-12-04"
    (tmp_path / "meta.json").write_text((source / "meta.json").read_text())
    rows = [r for r in json.loads((source / "results.json").read_text()) if r["run"] == "base"]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert page.levers_headline(page.Measurement(tmp_path)) == "defaults 31.7k tokens/s (MFU 54.3%)"
