"""Hub model IDs wherever a model directory is accepted (issue 17), from a pre-filled offline HF cache in tmp:
HF_HUB_OFFLINE=1, never the network."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from hf_models import make_model, make_tokenizer
from mcorekit.cli import main
from mcorekit.hub import HubError, is_hub_id, model_dir

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = make_model("llama", False, tmp_path_factory.mktemp("src") / "m")
    make_tokenizer(src)
    return src


@pytest.fixture
def offline_cache(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME/hub laid out as huggingface_hub writes it: refs/main -> snapshots/<commit>/ with the model's files."""
    home = tmp_path / "hf"
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(tiny_model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return repo / "snapshots" / COMMIT


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def one_error(result: tuple[int, str, str], *fragments: str) -> None:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("mcorekit: error: "), (code, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_resolver_local_path_wins_then_cache_then_one_line_offline(offline_cache: Path, tmp_path: Path) -> None:
    assert model_dir(REPO_ID, "config") == offline_cache
    assert model_dir(REPO_ID, "weights") == offline_cache and model_dir(REPO_ID, "tokenizer") == offline_cache
    local = tmp_path / "tiny-org" / "tiny-llama"  # a folder of that name here wins over the Hub
    local.mkdir(parents=True)
    assert not is_hub_id(REPO_ID) and model_dir(REPO_ID) == Path(REPO_ID)
    shutil.rmtree(tmp_path / "tiny-org")
    assert model_dir("no-such-dir") == Path("no-such-dir")  # not Hub-shaped: the caller's own checks speak
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("../x")
    with pytest.raises(HubError) as e:
        model_dir("nobody/absent", "config", "model.hf_config")
    assert str(e.value) == (f"model.hf_config nobody/absent: not in the Hugging Face cache {tmp_path / 'hf' / 'hub'} and "
                            f"HF_HUB_OFFLINE=1; download it once online (unset HF_HUB_OFFLINE, or `hf download "
                            f"nobody/absent`) or give a local model folder")


def test_convert_plan_launch_and_preprocess_take_a_hub_id(offline_cache: Path, tmp_path: Path) -> None:
    code, out, err = run("convert", "hf-to-mcore", REPO_ID, str(tmp_path / "ckpt"), "--quiet")
    assert code == 0, err
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    one_error(run("convert", "hf-to-mcore", "nobody/absent", str(tmp_path / "c2"), "--quiet"),
              "HF_DIR nobody/absent: not in the Hugging Face cache", "HF_HUB_OFFLINE=1")
    assert not (tmp_path / "c2").exists()
    code, out, err = run("convert", "mcore-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--hf-config",
                         REPO_ID, "--quiet")
    assert code == 0, err
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_hidden_layers"] == 4
    one_error(run("convert", "mcore-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "b2"), "--hf-config", "nobody/absent"),
              "--hf-config nobody/absent: not in the Hugging Face cache")

    code, out, err = run("export", "trtllm", REPO_ID, str(tmp_path / "trt"), "--target", "pytorch", "--quiet")
    assert code == 0, err
    assert json.loads((tmp_path / "trt" / "config.json").read_text())["num_hidden_layers"] == 4
    one_error(run("export", "trtllm", "nobody/absent", str(tmp_path / "t2"), "--target", "pytorch"),
              "SRC nobody/absent: not in the Hugging Face cache")

    code, out, err = run("launch", "plan", "--model", REPO_ID, "--gpus", "2")
    assert code == 0 and out.startswith("llama, 0.00B parameters"), (out, err)
    one_error(run("launch", "plan", "--model", "nobody/absent", "--gpus", "2"), "nobody/absent: not in the Hugging Face cache")

    code, out, err = run("launch", "--config", str(Path(__file__).parent.parent / "examples" / "llama-tiny.yaml"),
                         "--dry-run", "model.preset=null", f"model.hf_config={REPO_ID}")
    assert code == 0, err
    assert f"hf_config: {REPO_ID}" in out and "num_layers" not in err

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": "the answer is yes"}) + "\n" for _ in range(3)))
    code, out, err = run("data", "preprocess", str(corpus), "--tokenizer", REPO_ID, "--output-prefix",
                         str(tmp_path / "data" / "c"), "--workers", "1", "--quiet")
    assert code == 0, err
    meta = json.loads((tmp_path / "data" / "c.json").read_text())
    assert meta["eod"] == 2 and meta["tokens"] == 15 and meta["tokenizer"] == str(offline_cache)  # the cached tokenizer
