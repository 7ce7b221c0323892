"""What a run trains, recorded at its first start and checked at every resume (INPUTS in its checkpoints folder).

A requeued job starts again from the run folder's config.yaml and re-reads its data, tokenizer, HF config and
reward files. If one of them changed since the first start, the resumed run would go on training another problem
(other samples at its position in the data, another objective, another schedule) without a sign. So the first start
records the experiment's settings that define the problem (SETTINGS; not where and how often it logs and saves, its
layout, precision or Slurm resources, which a restart may change) and the size, modification time and (within
DIGEST_BYTES) the digest of each file it reads. A resume that finds a setting changed, a file gone, of another size or
with other bytes stops with one line naming them; a file copied again (same bytes, or not digested, at the same size)
is a warning at most, and so is other software (SOFTWARE's versions). checkpoint.load and peft.lora.load are pinned
apart (checkpoint.pinned_sources)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from mcorekit.errors import ConfigError
from mcorekit.outputs import write_atomic

log = logging.getLogger("mcorekit.train")

INPUTS = "inputs.json"
# dotted prefixes of the experiment's settings that define what is trained
SETTINGS = ("model.", "data.", "dpo.", "grpo.", "peft.", "optimizer.lr", "optimizer.min_lr", "optimizer.weight_decay",
            "optimizer.adam_", "optimizer.clip_grad", "schedule.train_iters", "schedule.warmup_iters",
            "schedule.decay", "schedule.global_batch_size", "moe.aux_loss_coeff", "moe.expert_bias",
            "moe.capacity_factor", "moe.pad_to_capacity")
SOFTWARE = ("mcorekit", "megatron-core", "transformer-engine", "torch", "transformers")
# how the same problem is run or watched: caches, the backend, validation, how GRPO generates (changed after an out-of-
# memory); the adapters are pinned by pinned_sources
NOT_SETTINGS = ("data.cache_dir", "data.valid_paths", "data.dynamic_batching", "model.backend", "peft.lora.load",
                "grpo.generation", "grpo.kv_cache_gb")
TASKS = ("dpo", "grpo")  # a task's settings count only for runs of that task (data.kind)
# the files of an HF tokenizer or model folder that a start reads (not its READMEs, weights or stray files)
FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                "chat_template.json")
# Files up to DIGEST_BYTES are compared by content, DIGEST_TOTAL_BYTES in all (rank 0 reads them while the other
# ranks wait, at every start, under NCCL's timeout); larger ones, and the indexed data's .bin files (their documents
# are their .idx's, compared by content), by size and time
DIGEST_BYTES = 256 * 1024**2
DIGEST_TOTAL_BYTES = 2 * 1024**3
PATHS = ("data.paths", "data.tokenizer", "model.hf_config")  # settings that name local files: compared absolute


def settings(exp: Any) -> dict[str, Any]:
    """The experiment's settings that define the problem, as dotted keys (lists whole)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", exp.model_dump(mode="json"))
    other_tasks = tuple(f"{task}." for task in TASKS if task != exp.data.kind)
    return {k: v for k, v in flat.items()
            if k.startswith(SETTINGS) and not k.startswith(NOT_SETTINGS) and not k.startswith(other_tasks)}


def files(exp: Any) -> list[Path]:
    """The files a start reads: the training data (.bin/.idx pairs of indexed prefixes), the tokenizer's and the HF
    config's (FOLDER_FILES of a folder), reward functions given as files. Hub ids and paths that are not there are
    left to the code that reads them."""
    data = exp.data
    found: list[Path] = []
    for given in data.paths:
        found += [Path(given + s) for s in (".bin", ".idx")] if data.kind == "indexed" else [Path(given)]
    for folder in (data.tokenizer, exp.model.hf_config):
        if folder and Path(folder).is_dir():
            found += [Path(folder) / name for name in FOLDER_FILES]
        elif folder:
            found.append(Path(folder))
    for reward in exp.grpo.rewards if data.kind == "grpo" else []:
        module = reward.function.rpartition(":")[0]
        if module.endswith(".py"):
            found.append(Path(module))
    return [Path(os.path.abspath(p)) for p in dict.fromkeys(found) if p.is_file()]  # as _changes reads the record


def record_or_check(exp: Any, root: Path | None, resuming: bool) -> None:
    """At a first start (or a start without a checkpoint of its own) record the run's inputs under `root`; at a
    resume, compare them with the record (ConfigError naming what changed). Runs on rank 0."""
    if root is None or (resuming and check(exp, root)):
        return
    if resuming:  # a run recorded by an earlier version: nothing to compare with
        log.warning("%s is missing: this resume's inputs are recorded now, not compared with its first start's",
                    root / INPUTS)
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / INPUTS, json.dumps(_now(exp), indent=1) + "\n")


def check(exp: Any, root: Path, elsewhere: bool = False) -> bool:
    """The run's inputs now against those its first start recorded under `root`: a ConfigError naming what changed,
    warnings for files rewritten at the same size and other software. False when there is no record (a run started
    by an earlier version), or one that cannot be read (a warning). `mcorekit launch --resume` asks before queueing,
    `elsewhere`: on a machine other than the job's, where a recorded file it cannot see (a node-local copy, a mount
    only the nodes have) is left to the job's own check (the launch's plan has warned of it: launch/plan.py)."""
    path = root / INPUTS
    if not path.is_file():
        return False
    now = _now(exp, elsewhere)
    try:
        then = json.loads(path.read_text())
        changed, rewritten = _changes(then, now, _folders_seen(exp) if elsewhere else None)
        upgraded = [f"{k} {v} -> {now['software'].get(k)}" for k, v in then.get("software", {}).items()
                    if now["software"].get(k) != v]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("%s cannot be read (%s): this resume's inputs are not compared with its first start's", path, e)
        return True
    if rewritten:
        log.warning("rewritten since this run's first start, at the same size: %s", ", ".join(rewritten))
    if upgraded:
        log.warning("this run started with other software: %s (losses may not follow on exactly)", ", ".join(upgraded))
    if changed:
        raise ConfigError(f"this run's inputs changed since its first start: {'; '.join(changed)}. A resumed run "
                          f"trains what it started on: restore them, or start a new run from this one's checkpoints "
                          f"(checkpoint.load={root}, in a run folder and checkpoint.dir of its own)")
    return True


def _now(exp: Any, elsewhere: bool = False) -> dict[str, Any]:
    budget = [DIGEST_TOTAL_BYTES]
    return {"settings": settings(exp), "files": {str(p): _stat(p, budget) for p in files(exp)},
            "hub": hub_revisions(exp, elsewhere), "software": software()}


def hub_revisions(exp: Any, elsewhere: bool = False) -> dict[str, str]:
    """{setting: the commit its Hub model ID resolves to now} (mcorekit.hub.model_dir's snapshot folder is named by
    it) for the settings that may name one: `org/name` follows the repository's newest commit, so a start after it
    moved on would read another tokenizer or config with the same settings. `elsewhere` (mcorekit launch --resume):
    an ID that cannot be resolved there is left to the job's own check, with a warning."""
    from mcorekit.hub import HubError, is_hub_id, model_dir

    found = {}
    for key, value, need in (("data.tokenizer", exp.data.tokenizer, "tokenizer"),
                             ("model.hf_config", exp.model.hf_config, "config")):
        if not (value and is_hub_id(value)):
            continue
        try:
            found[key] = model_dir(value, need, key).name
        except HubError as e:
            if not elsewhere:
                raise
            log.warning("%s; its Hub revision is checked where the job runs", e)
    return found


def software() -> dict[str, str | None]:
    """The versions of what trains: mcorekit and the libraries that define the numerics (a restart after an upgrade
    goes on, with a warning)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in SOFTWARE:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _stat(path: Path, budget: list[int]) -> list[Any]:
    """[size, modification time, the digest of the file's bytes or None (see DIGEST_BYTES; `budget`: the bytes left
    to digest)]: a file rewritten at the same size with other bytes (reordered lines, another .idx) is a change, one
    copied again is none."""
    st = path.stat()
    digest = None
    if path.suffix != ".bin" and st.st_size <= min(DIGEST_BYTES, budget[0]):
        budget[0] -= st.st_size
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        digest = h.hexdigest()
    return [st.st_size, st.st_mtime_ns, digest]


def _folders_seen(exp: Any) -> set[str]:
    """The folder inputs (tokenizer, HF config) this machine sees: a recorded file missing from one is gone."""
    return {os.path.abspath(f) for f in (exp.data.tokenizer, exp.model.hf_config) if f and Path(f).is_dir()}


def _changes(then: dict[str, Any], now: dict[str, Any],
             folders_seen: set[str] | None = None) -> tuple[list[str], list[str]]:
    """(what changed, files rewritten at the same size). `folders_seen` is given on a machine other than the job's
    (launch --resume): a recorded file it does not see is left out (the launch's plan warns of inputs it cannot see),
    unless it was in a folder input this machine sees (a tokenizer folder that lost a file: the plan sees the folder
    and says nothing). Settings one side lacks are those another version of mcorekit added or removed: not
    compared."""
    old, new = _absolute(then["settings"]), _absolute(now["settings"])
    changed = [f"{k} {_shown(old[k])} -> {_shown(new[k])}" for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]
    rewritten: list[str] = []
    recorded = {os.path.abspath(k): v for k, v in then["files"].items()}
    for name, (size, mtime, *digest) in recorded.items():  # runs recorded before the digests were: none
        if (name not in now["files"] and folders_seen is not None and not Path(name).exists()
                and os.path.dirname(name) not in folders_seen):
            continue
        if name not in now["files"]:
            changed.append(f"{name} is gone" if not Path(name).exists() else f"{name} is no longer read")
        elif now["files"][name][0] != size:
            changed.append(f"{name} changed ({size:,} -> {now['files'][name][0]:,} bytes)")
        elif digest and digest[0] and now["files"][name][2]:
            if digest[0] != now["files"][name][2]:
                changed.append(f"{name} changed (other bytes at the same size)")
        elif now["files"][name][1] != mtime:
            rewritten.append(name)
    changed += [f"{name} is read now, not at the first start" for name in now["files"] if name not in recorded]
    for key, commit in then.get("hub", {}).items():  # runs recorded before the Hub revisions were: nothing here
        if now["hub"].get(key, commit) != commit:
            changed.append(f"{key} {new.get(key)} resolves to the Hub's commit {now['hub'][key]} now, to {commit} at "
                           f"the first start")
    return changed, rewritten


def _absolute(settings: dict[str, Any]) -> dict[str, Any]:
    """PATHS as absolute paths (a run recorded with relative ones, started again from the same folder, is the same
    run); a hub id stays as given."""
    def local(v: Any) -> Any:
        return os.path.abspath(v) if isinstance(v, str) and os.path.exists(v) else v

    return {k: [local(x) for x in v] if isinstance(v, list) and k in PATHS else local(v) if k in PATHS else v
            for k, v in settings.items()}


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
