"""convert/: bitwise round trips for every architecture and layout, agreement with checkpoints Megatron-Core
wrote itself, HF loading, and bad input that fails early without partial output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import transformers

from hf_models import CONFIGS, MOE, make_model
from mcorekit.convert import pipeline
from mcorekit.convert.torch_dist import TorchDistReader
from mcorekit.convert.verify import compare_hf

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-written-torch_dist.tgz"
ARCHS = ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"]  # the architectures of the Megatron-written fixtures


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("hf")
    return {(n, tied): make_model(n, tied, root / f"{n}-{'tied' if tied else 'untied'}") for n in CONFIGS for tied in (False, True)}


@pytest.fixture(scope="session")
def megatron_written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not FIXTURES.is_file():
        pytest.skip(f"{FIXTURES} not present (shared/ fixtures live beside the repository)")
    root = tmp_path_factory.mktemp("fixtures")
    with tarfile.open(FIXTURES) as tar:
        tar.extractall(root, filter="data")
    return root


def assert_bitwise(a: Path, b: Path) -> None:
    reports = compare_hf(a, b)
    assert reports and all(r.status == "equal" for r in reports), [r for r in reports if r.status != "equal"][:3]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_torch_dist_round_trip_is_bitwise(models, tmp_path: Path, name: str, tied: bool) -> None:
    hf = models[(name, tied)]
    pipeline.hf_to_mcore(hf, tmp_path / "mcore", quiet=True)
    reader = TorchDistReader(tmp_path / "mcore" / "release")
    keys = reader.tensor_keys()
    assert ("output_layer.weight" in keys) is (not tied)  # tied embeddings stay tied: no separate output layer
    assert tuple(keys["embedding.word_embeddings.weight"].size) == (256, 64)  # 250 padded to a multiple of 128
    pipeline.mcore_to_hf(tmp_path / "mcore", tmp_path / "back", quiet=True)
    assert_bitwise(hf, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert (tmp_path / "back" / "tokenizer_config.json").is_file() and (tmp_path / "back" / "generation_config.json").is_file()


DENSE_LAYOUTS = [dict(tp=1), dict(tp=2), dict(pp=2), dict(tp=2, pp=2), dict(pp=2, vpp=2)]
MOE_LAYOUTS = [dict(ep=2), dict(ep=4), dict(ep=2, tp=2, etp=2), dict(ep=2, tp=2, etp=1)]


@pytest.mark.parametrize("name", [*ARCHS, "qwen2_moe"])
def test_legacy_torch_format_round_trips_at_every_layout(models, tmp_path: Path, name: str) -> None:
    hf = models[(name, name == "qwen2")]
    for layout in DENSE_LAYOUTS + (MOE_LAYOUTS if name in MOE else []):
        out = tmp_path / "_".join(f"{k}{v}" for k, v in layout.items())
        pipeline.hf_to_mcore(hf, out / "mcore", fmt="torch", quiet=True, **layout)
        ranks = sorted(p.name for p in (out / "mcore" / "release").iterdir())
        assert len(ranks) == layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1), (layout, ranks)
        pipeline.mcore_to_hf(out / "mcore", out / "back", quiet=True)
        assert_bitwise(hf, out / "back")


def test_legacy_rank_contents_follow_megatron_splits(models, tmp_path: Path) -> None:
    hf = models[("mixtral", False)]
    pipeline.hf_to_mcore(hf, tmp_path / "m", fmt="torch", tp=2, pp=2, ep=2, etp=2, quiet=True)
    rank = torch.load(tmp_path / "m/release/mp_rank_01_001_001/model_optim_rng.pt", weights_only=True)["model"]
    from mcorekit.convert.hf_io import HFReader

    reader = HFReader(hf)
    src = {n: reader.get(n) for n in reader.names()}
    # PP rank 1 holds global layers 2-3 as local 0-1; EP rank 1 holds experts 2-3 as local 0-1; TP rank 1 the 2nd halves.
    fc2 = rank["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, src["model.layers.3.block_sparse_moe.experts.2.w2.weight"].chunk(2, dim=1)[1])
    fc1 = rank["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    gate, up = src["model.layers.2.block_sparse_moe.experts.3.w1.weight"], src["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    assert torch.equal(fc1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert "embedding.word_embeddings.weight" not in rank and "output_layer.weight" in rank
    assert rank["decoder.layers.0.self_attention.linear_qkv._extra_state"] is None


def test_torch_dist_is_layout_free(models, tmp_path: Path) -> None:
    """Written 'for' EP2 or EP4 (or any TP/PP), the tensors are the same global tensors: any layout loads them."""
    hf = models[("qwen3_moe", False)]
    pipeline.hf_to_mcore(hf, tmp_path / "ep2", ep=2, quiet=True)
    pipeline.hf_to_mcore(hf, tmp_path / "ep4", ep=4, tp=2, quiet=True)
    a, b = TorchDistReader(tmp_path / "ep2/release"), TorchDistReader(tmp_path / "ep4/release")
    assert a.tensor_keys().keys() == b.tensor_keys().keys() and a.bytes_keys() == b.bytes_keys()
    assert all(torch.equal(a.read(k), b.read(k)) for k in a.tensor_keys())


@pytest.mark.parametrize("name", ARCHS)
def test_matches_checkpoints_megatron_wrote_itself(megatron_written: Path, tmp_path: Path, name: str) -> None:
    hf = megatron_written / name / "hf"
    pipeline.hf_to_mcore(hf, tmp_path / "ours", vocab_divisible_by=1, dtype="fp32", quiet=True)
    ours, ref = TorchDistReader(tmp_path / "ours/release"), TorchDistReader(megatron_written / name / "mcore/iter_0000001")
    # Same entries, TE extra states and common state included, and the same values.
    assert set(ours.metadata.state_dict_metadata) == set(ref.metadata.state_dict_metadata)
    for key, md in ref.tensor_keys().items():
        assert tuple(ours.tensor_keys()[key].size) == tuple(md.size)
        assert torch.equal(ours.read(key), ref.read(key)), key
    assert ours.read_bytes("common_state/shard_0_1") == ref.read_bytes("common_state/shard_0_1") == [{}]
    # And what Megatron wrote converts back to the original HF weights bit for bit.
    pipeline.mcore_to_hf(megatron_written / name / "mcore/iter_0000001", tmp_path / "back", hf_config=str(hf), quiet=True)
    assert_bitwise(hf, tmp_path / "back")


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe", "qwen2_moe"])
def test_result_loads_in_transformers_with_identical_logits(models, tmp_path: Path, name: str) -> None:
    hf = models[(name, True)]
    pipeline.hf_to_mcore(hf, tmp_path / "m", quiet=True)
    pipeline.mcore_to_hf(tmp_path / "m", tmp_path / "back", quiet=True)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)


@pytest.mark.parametrize("name", ["llama3", "mixtral", "qwen2_moe"])
def test_megatron_forward_on_cpu_gives_the_hf_logits(models, tmp_path: Path, name: str) -> None:
    """The converted checkpoint in Megatron-Core's own model (local spec, CPU): the logits of the HF model. For
    qwen2_moe (no Megatron-written fixture) this checks the shared expert and its sigmoid gate, and the router's
    softmax-then-top-k without renormalising, against Megatron-Core's SharedExpertMLP and router."""
    hf = models[(name, False)]
    pipeline.hf_to_mcore(hf, tmp_path / "m", dtype="fp32", quiet=True)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(here), "LOGITS_PORT": str(29570 + ["llama3", "mixtral", "qwen2_moe"].index(name))}
    proc = subprocess.run([sys.executable, str(here / "megatron_cpu_logits.py"), str(hf), str(tmp_path / "m/release")],
                          capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LOGITS ")), None)
    assert line, proc.stderr[-3000:]
    max_diff, cosine, top1 = map(float, line.split()[1:])
    assert max_diff < 1e-5 and cosine > 0.99999 and top1 == 1.0, line


def test_shards_are_bounded_and_indexed(models, tmp_path: Path) -> None:
    pipeline.hf_to_mcore(models[("llama", False)], tmp_path / "m", quiet=True)
    pipeline.mcore_to_hf(tmp_path / "m", tmp_path / "back", max_shard_bytes=64 * 1024, quiet=True)
    index = json.loads((tmp_path / "back/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((tmp_path / "back" / s).stat().st_size < 64 * 1024 + 40 * 1024 for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"


# ---------------------------------------------------------------- bad input: one line, nothing written


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcorekit", "convert", *args, "--quiet"], capture_output=True, text=True)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str, out: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcorekit: error:") and needle in lines[0], proc.stderr
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith((out.name, f".{out.name}"))]
    assert leftovers == [], leftovers


def test_missing_shard(models, tmp_path: Path) -> None:
    import shutil

    hf = shutil.copytree(models[("llama", False)], tmp_path / "hf")
    victim = sorted(hf.glob("model-*.safetensors"))[2]
    victim.unlink()
    assert_one_line_error(run_cli("hf-to-mcore", str(hf), str(tmp_path / "out")), f"missing shard {victim}", tmp_path / "out")


def test_corrupted_header(models, tmp_path: Path) -> None:
    import shutil

    hf = shutil.copytree(models[("llama", False)], tmp_path / "hf")
    victim = sorted(hf.glob("model-*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"{garbage!!!!"
    victim.write_bytes(bytes(data))
    assert_one_line_error(run_cli("hf-to-mcore", str(hf), str(tmp_path / "out")), f"corrupt or truncated safetensors file {victim}", tmp_path / "out")


def test_truncated_shard(models, tmp_path: Path) -> None:
    import shutil

    hf = shutil.copytree(models[("llama", False)], tmp_path / "hf")
    victim = sorted(hf.glob("model-*.safetensors"))[3]
    victim.write_bytes(victim.read_bytes()[:-100])
    assert_one_line_error(run_cli("hf-to-mcore", str(hf), str(tmp_path / "out")), str(victim), tmp_path / "out")


def test_unknown_architecture(models, tmp_path: Path) -> None:
    import shutil

    hf = shutil.copytree(models[("llama", False)], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    assert_one_line_error(run_cli("hf-to-mcore", str(hf), str(tmp_path / "out")),
                          "unsupported architecture model_type='gpt_neox'; supported: deepseek_v2, deepseek_v3, gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe", tmp_path / "out")


def test_config_that_disagrees_with_weights(models, tmp_path: Path) -> None:
    import shutil

    hf = shutil.copytree(models[("llama", False)], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert_one_line_error(run_cli("hf-to-mcore", str(hf), str(tmp_path / "out")), "config.json implies (192, 64)", tmp_path / "out")


def test_existing_output_needs_force(models, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = run_cli("hf-to-mcore", str(models[("llama", False)]), str(out))
    assert proc.returncode == 2 and "exists; pass --force" in proc.stderr
    assert (out / "keep.txt").read_text() == "precious"
    proc = run_cli("hf-to-mcore", str(models[("llama", False)]), str(out), "--force")  # not ours: --force refuses too
    assert proc.returncode == 2 and "was not written by mcorekit" in proc.stderr
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    out.rmdir()
    assert run_cli("hf-to-mcore", str(models[("llama", False)]), str(out)).returncode == 0
    assert run_cli("hf-to-mcore", str(models[("llama", False)]), str(out), "--force").returncode == 0  # ours: replaced
    assert (out / "release" / "metadata.json").is_file()


def test_interrupted_conversion_leaves_nothing_that_looks_complete(models, tmp_path: Path, monkeypatch) -> None:
    from mcorekit.convert import torch_dist

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch_dist.FileSystemWriter, "finish", boom)
    with pytest.raises(KeyboardInterrupt):
        pipeline.hf_to_mcore(models[("llama", False)], tmp_path / "out", quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_verify_cli_reports_a_flipped_bit(models, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    hf = models[("qwen2", False)]
    other = shutil.copytree(hf, tmp_path / "other")
    shard = sorted(other.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    t = tensors[name].clone()
    t.view(torch.int16).view(-1)[0] ^= 1  # one bit
    tensors[name] = t
    save_file(tensors, shard, metadata={"format": "pt"})
    proc = subprocess.run([sys.executable, "-m", "mcorekit", "convert", "verify", str(hf), str(other)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert f"different  {name}" in proc.stdout and "1 elements differ" in proc.stdout
    ok = subprocess.run([sys.executable, "-m", "mcorekit", "convert", "verify", str(hf), str(hf)], capture_output=True, text=True)
    assert ok.returncode == 0 and "bitwise equal" in ok.stdout


@pytest.mark.parametrize("count", [3, 400])  # 400 small tensors outgrow the reserved header area: the data moves
def test_streamed_shards_read_back_bitwise_by_safetensors(tmp_path: Path, count: int) -> None:
    """HFWriter writes each tensor straight into its shard's file behind a reserved header area; safetensors' own
    loader (and ours) read back every dtype, shape and byte, the empty and 0-d tensors included."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mcorekit.convert.hf_io import HFReader, HFWriter

    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(33, 17, generator=g).bfloat16(), "f32": torch.randn(5, generator=g),
               "i64": torch.arange(7), "bool": torch.rand(9, generator=g) > 0.5, "empty": torch.zeros(0, 3),
               "scalar": torch.tensor(2.5), "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
               "strided": torch.randn(6, 4, generator=g).T}
    tensors.update({f"small.{i}": torch.full((3,), float(i)) for i in range(count)})
    with HFWriter(tmp_path, max_shard_bytes=16 * 1024) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
        writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        got.update(load_file(tmp_path / shard))
        header_len = int.from_bytes((tmp_path / shard).read_bytes()[:8], "little")
        assert (8 + header_len) % 8 == 0  # data 8-byte aligned, as safetensors writes it
    (tmp_path / "config.json").write_text("{}")  # HFReader reads model folders
    reader = HFReader(tmp_path)
    for name, t in tensors.items():
        for other in (got[name], reader.get(name)):
            assert other.dtype == t.dtype and other.shape == t.shape
            assert torch.equal(other.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else other,
                               t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
    reader.close()
