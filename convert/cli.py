"""`mcorekit convert`: HF <-> Megatron checkpoints, and verification.

  mcorekit convert hf-to-mcore HF_DIR OUT_DIR [--format torch_dist|torch] [--tp N --pp N --ep N --etp N --vpp N]
  mcorekit convert mcore-to-hf CKPT_DIR OUT_DIR [--hf-config HF_DIR_OR_CONFIG]
  mcorekit convert mcore-to-hf LORA_CKPT OUT_DIR --lora | --merge [--base BASE_CKPT]   (PEFT adapter | merged model)
  mcorekit convert hf-to-mcore HF_DIR OUT_DIR --lora PEFT_ADAPTER_DIR                 (adapter checkpoint)
  mcorekit convert verify HF_A HF_B                      (bitwise, every tensor, strict key coverage)
  mcorekit convert verify --logits HF_DIR CKPT_DIR       (GPU: HF model vs Megatron model on fixed prompts)
"""

from __future__ import annotations

import argparse
import sys

from mcorekit.cli import HelpFormatter, dispatch
from mcorekit.errors import ConversionError
from mcorekit.models import dtypes
from mcorekit.options import positive_float, positive_int

# torch (through convert.pipeline) is imported inside each command, once its arguments parse: --help stays fast.
FORMATS = {"torch_dist": "Megatron-Core's distributed format, loads at any layout",
           "torch": "Megatron-LM's legacy per-rank files for the layout given"}
# hf-to-mcore's options for converting a model, which --lora (an adapter) has no use for
MODEL_ONLY = ("format", "tp", "pp", "ep", "etp", "vpp", "vocab_divisible_by")
MAX_SHARD_GB = 1024**2  # a PiB: any larger shard size means "one shard"; a float beyond it may not fit an int


def shard_gb(text: str) -> float:
    """--max-shard-gb: a number > 0 and at most MAX_SHARD_GB."""
    value = positive_float(text)
    if value > MAX_SHARD_GB:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_SHARD_GB:,} (GB), got {text[:20]}")
    return value


def _hf_to_mcore(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit convert hf-to-mcore", formatter_class=HelpFormatter,
                                description="HF safetensors -> Megatron-Core checkpoint (torch_dist: any layout loads it; "
                                "torch: Megatron-LM's per-rank files for the layout given). Streams one tensor at a time.")
    p.add_argument("hf_dir", help="HF model directory (config.json and safetensors)")
    p.add_argument("out_dir", help="output checkpoint root (written aside and renamed when complete)")
    p.add_argument("--format", choices=list(FORMATS), default="torch_dist",
                   help="; ".join(f"{k}: {v}" for k, v in FORMATS.items()))
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel (torch: files per rank; torch_dist: checked only); it must divide the heads, "
                   "query groups and padded vocabulary")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages; must divide the layers")
    p.add_argument("--ep", type=positive_int, default=1, help="expert parallel (MoE); must divide the experts")
    p.add_argument("--etp", type=positive_int, default=1, help="expert tensor parallel: 1 or equal to --tp")
    p.add_argument("--vpp", type=positive_int, default=None, help="virtual stages per pipeline stage (needs --pp >= 2); "
                   "PP*VPP must divide the layers")
    p.add_argument("--dtype", choices=list(dtypes.NAMES), default=None,
                   help="default: keep the HF dtype. Casts float weights only: integer, bool or fp8 weights are an error")
    p.add_argument("--vocab-divisible-by", type=positive_int, default=128, help="pad the vocabulary to a multiple of this (Megatron's default 128)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR if an earlier mcorekit command wrote it (never an input or an unknown folder)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--lora", metavar="PEFT_ADAPTER_DIR", default=None,
                   help="convert this HF PEFT LoRA adapter of the HF_DIR model instead of the model: OUT_DIR becomes a "
                   "Megatron LoRA checkpoint to continue training from (peft.lora.load)")
    a = p.parse_args(argv)
    given = [f"--{dest.replace('_', '-')} {getattr(a, dest)}" for dest in MODEL_ONLY
             if getattr(a, dest) != p.get_default(dest)]
    if a.lora and given:  # they would be ignored: an adapter checkpoint is torch_dist, which loads at any layout
        raise ConversionError(f"{' '.join(given)}: --lora writes the adapter as a torch_dist checkpoint, which loads "
                              f"at any layout; drop {'it' if len(given) == 1 else 'them'} (they apply to converting a "
                              f"model)")
    from mcorekit.hub import model_dir

    a.hf_dir = str(model_dir(a.hf_dir, "model", "HF_DIR"))  # an org/name Hub ID: its snapshot in the HF cache
    from mcorekit.convert import pipeline
    if a.lora:
        from mcorekit.convert import lora

        s = lora.peft_to_mcore(a.hf_dir, a.lora, a.out_dir, dtype=a.dtype, force=a.force)
        print(s.line(f"hf-to-mcore --lora -> {a.out_dir}"))
        return 0
    s = pipeline.hf_to_mcore(a.hf_dir, a.out_dir, fmt=a.format, dtype=a.dtype, vocab_divisible_by=a.vocab_divisible_by,
                             tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, vpp=a.vpp, force=a.force, quiet=a.quiet)
    print(s.line(f"hf-to-mcore -> {a.out_dir}"))
    return 0


def _mcore_to_hf(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit convert mcore-to-hf", formatter_class=HelpFormatter,
                                description="Megatron-Core checkpoint (torch_dist or legacy torch) -> HF safetensors with "
                                "index, config and tokenizer files. Vocabulary padding is removed.")
    p.add_argument("ckpt_dir", help="checkpoint root (with latest_checkpointed_iteration.txt) or an iteration directory")
    p.add_argument("out_dir", help="output HF directory (written aside and renamed when complete)")
    p.add_argument("--hf-config", default=None, help="HF directory, config.json or Hub ID (default: the one stored at import)")
    p.add_argument("--dtype", choices=list(dtypes.NAMES), default=None, help="default: the HF config's dtype")
    p.add_argument("--max-shard-gb", type=shard_gb, default=5.0, help="largest output shard, in GB (> 0)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR if an earlier mcorekit command wrote it (never an input or an unknown folder)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--lora", action="store_true", help="CKPT_DIR is a LoRA run's checkpoint: write its adapters as an "
                      "HF PEFT adapter (adapter_config.json, adapter_model.safetensors) for peft.PeftModel.from_pretrained")
    lora.add_argument("--merge", action="store_true", help="CKPT_DIR is a LoRA run's checkpoint: write the base model "
                      "with the adapters merged in (W + alpha/r * B @ A), a full HF model")
    p.add_argument("--base", default=None, help="with --merge: the base model's Megatron checkpoint (default: the run's "
                   "checkpoint.load, recorded in lora.json)")
    a = p.parse_args(argv)
    if a.hf_config:
        from mcorekit.hub import model_dir

        a.hf_config = str(model_dir(a.hf_config, "config", "--hf-config"))  # a Hub ID: its config.json, cached
    from mcorekit.convert import pipeline

    if a.base and not a.merge:
        p.error("--base goes with --merge")
    if a.lora or a.merge:
        from mcorekit.convert import lora as lora_convert

        if a.lora:
            s = lora_convert.mcore_to_peft(a.ckpt_dir, a.out_dir, hf_config=a.hf_config, dtype=a.dtype, force=a.force)
        else:
            s = lora_convert.mcore_to_hf_merged(a.ckpt_dir, a.out_dir, base=a.base, hf_config=a.hf_config, dtype=a.dtype,
                                                max_shard_bytes=max(1, int(a.max_shard_gb * 1024**3)), force=a.force,
                                                quiet=a.quiet)
        print(s.line(f"mcore-to-hf {'--lora' if a.lora else '--merge'} -> {a.out_dir}"))
        return 0
    s = pipeline.mcore_to_hf(a.ckpt_dir, a.out_dir, hf_config=a.hf_config, dtype=a.dtype,
                             max_shard_bytes=max(1, int(a.max_shard_gb * 1024**3)), force=a.force, quiet=a.quiet)
    print(s.line(f"mcore-to-hf -> {a.out_dir}"))
    return 0


def _verify(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="mcorekit convert verify", formatter_class=HelpFormatter,
                                description="Bitwise comparison of two HF checkpoints (exit 1 on any difference), or with "
                                "--logits, HF vs Megatron logits on a GPU (exit 1 below cosine 0.9999 or top-1 100%).")
    p.add_argument("a", help="HF checkpoint (reference)")
    p.add_argument("b", help="HF checkpoint to check, or with --logits a Megatron checkpoint")
    p.add_argument("--logits", action="store_true",
                   help="compare logits on a GPU instead (HF model vs Megatron model on fixed prompts; needs cosine >= "
                   "0.9999 and 100%% top-1 agreement)")
    p.add_argument("--all", action="store_true", help="list equal tensors too")
    a = p.parse_args(argv)
    from mcorekit.convert import verify

    if a.logits:
        from mcorekit.convert.logits import verify_logits

        report = verify_logits(a.a, a.b)
        print(f"logits: {report.line()} -> {'OK' if report.passed() else 'FAILED'}")
        return 0 if report.passed() else 1
    reports = verify.compare_hf(a.a, a.b)
    bad = [r for r in reports if r.status != "equal"]
    for r in reports if a.all else bad:
        print(f"{r.status:>9}  {r.name}  {r.detail}")
    print(f"verify: {len(reports) - len(bad)} of {len(reports)} tensors bitwise equal" + ("" if not bad else f", {len(bad)} not"))
    return 0 if not bad else 1


COMMANDS = {"hf-to-mcore": _hf_to_mcore, "mcore-to-hf": _mcore_to_hf, "verify": _verify}
HELPS = {"hf-to-mcore": "HF safetensors -> Megatron-Core checkpoint (torch_dist, or legacy per-rank torch files)",
         "mcore-to-hf": "Megatron-Core checkpoint -> HF safetensors, config and tokenizer files",
         "verify": "bitwise comparison of two HF checkpoints, or HF vs Megatron logits on a GPU (--logits)"}


def main(command: str, argv: list[str]) -> int:
    return dispatch("mcorekit convert", __doc__, COMMANDS, argv, HELPS)


if __name__ == "__main__":
    sys.exit(main("convert", sys.argv[1:]))
