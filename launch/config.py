"""Experiment and cluster-profile schemas, YAML loading and dotted `a.b.c=value` overrides.

Unknown keys fail with a did-you-mean suggestion; values are type-checked by pydantic.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mcorekit.errors import ConfigError

# Values that end up in the sbatch script. Names are restricted; other values are quoted by the renderer,
# but a newline or other control character could end a `#SBATCH` line early, so those are rejected.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _no_control(value: str, what: str) -> str:
    if CONTROL_RE.search(value):
        raise ValueError(f"{what} {value!r} contains a newline or control character; remove it")
    return value


def shown(path: str | Path) -> str:
    """A path for a one-line message: as typed, or quoted with escapes when it holds a newline or control character."""
    text = str(path)
    return repr(text) if CONTROL_RE.search(text) else text


class Strict(BaseModel):
    # NaN or infinity is never a meaningful setting (YAML reads `.nan` and `.inf` as floats)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# ---------------------------------------------------------------- experiment


class ModelConfig(Strict):
    preset: str | None = None  # a name from mcorekit.models.spec.PRESETS
    hf_config: str | None = None  # an HF model directory or config.json
    overrides: dict[str, Any] = Field(default_factory=dict)  # ModelSpec fields, e.g. {num_layers: 2}
    # te: Transformer Engine layers (needed for FP8 and packing); local: Megatron-Core's own layers with PyTorch's
    # fused SDPA attention; auto: te where Transformer Engine is importable, else local
    backend: Literal["auto", "te", "local"] = "auto"


class ParallelConfig(Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vpp: int | None = Field(None, ge=1)  # virtual stages per pipeline rank (interleaved schedule)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)  # expert tensor parallel size
    sequence_parallel: bool = False


class PrecisionConfig(Strict):
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    fp8: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] | None = None
    fp8_params: bool = False
    loss_scale: float | None = Field(None, gt=0)  # fp16 only: None = dynamic loss scaling, a number = static scale


class MoEConfig(Strict):
    aux_loss_coeff: float = Field(1e-2, ge=0)
    expert_bias: bool = False  # aux-loss-free load balancing
    capacity_factor: float | None = Field(None, gt=0)  # tokens beyond factor x (even share) per expert are dropped
    pad_to_capacity: bool = False  # pad every expert to its capacity: fixed shapes, no host sync per layer
    grouped_gemm: bool = True
    # how the grouped experts compute: TE's GroupedLinear (needed for FP8) or torch._grouped_mm (one kernel per
    # grouped GEMM, far less host work per layer; bf16). auto: torch where it applies (1.7x on one H200), else te
    expert_gemm: Literal["auto", "te", "torch"] = "auto"
    dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    shared_expert_ffn: int | None = Field(None, ge=1)  # FFN size of the shared expert(s) every token also passes through
    shared_expert_overlap: bool = False  # overlap the shared expert with the token dispatch (alltoall/allgather)
    permute_fusion: bool = True
    router_fusion: bool = False  # TE's fused top-k + softmax + aux loss
    a2a_overlap: bool = False  # overlap expert-parallel all-to-all with compute (needs EP > 1)


class DataConfig(Strict):
    kind: Literal["mock", "indexed", "sft"] = "mock"
    # indexed: path prefixes of .bin/.idx pairs (from `mcorekit data preprocess`); sft: .jsonl files
    paths: list[str] = Field(default_factory=list)
    weights: list[Annotated[float, Field(ge=0)]] | None = None  # blend weights, one per path (indexed)
    # held-out data of the same kind, for the validation loss every schedule.eval_interval steps (mock data
    # validates on its own stream without it)
    valid_paths: list[str] = Field(default_factory=list)
    tokenizer: str | None = None  # an HF tokenizer directory (sft; indexed takes its eod from the .idx side-car)
    seq_length: int = Field(2048, ge=1)
    packing: bool = False  # sft: several conversations per sequence, attention kept within each
    dynamic_batching: bool = False
    cache_dir: str | None = None  # dataset index caches; default <run dir>/data_cache
    seed: int = Field(1234, ge=0, le=2**32 - 1)  # numpy seeds are unsigned 32-bit

    @field_validator("paths", "valid_paths", "tokenizer", "cache_dir")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        for item in [v] if isinstance(v, str) else (v or []):
            _no_control(item, "data path")
        return v


class OptimizerConfig(Strict):
    lr: float = Field(3e-4, ge=0)
    min_lr: float = Field(3e-5, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)  # 0: no clipping
    distributed: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    bucket_size: int | None = Field(40_000_000, ge=1)  # parameters per gradient bucket; null = one bucket
    tp_comm_overlap: bool = False


class ScheduleConfig(Strict):
    train_iters: int = Field(1000, ge=1)
    warmup_iters: int = Field(100, ge=0)
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    micro_batch_size: int = Field(1, ge=1)
    global_batch_size: int = Field(8, ge=1)
    eval_interval: int = Field(0, ge=0)  # validation loss every N steps and at the end; 0 = none
    eval_iters: int = Field(10, ge=1)  # global batches per validation (the same ones every time)


class RecomputeConfig(Strict):
    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = Field(1, ge=1)
    # selective: which submodules to recompute (Megatron-Core names: core_attn, mlp, moe, moe_act, layernorm, ...)
    modules: list[str] = Field(default_factory=lambda: ["core_attn"])
    offload_layers: int = Field(0, ge=0)  # layers whose activations go to host memory (Transformer Engine)


class CheckpointConfig(Strict):
    dir: str | None = None  # default: <run dir>/checkpoints
    save_interval: int = Field(500, ge=1)
    keep_last: int = Field(3, ge=1)
    async_save: bool = False  # write in the background while training continues
    load: str | None = None  # a checkpoint to start from (e.g. converted from HF)
    finetune: bool = False  # load: weights only, fresh optimizer, step 0 (always so for a converted `release`)

    @field_validator("dir", "load")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "checkpoint path")


class LoggingConfig(Strict):
    log_interval: int = Field(10, ge=1)
    tensorboard: bool = False  # also write <run>/tensorboard (metrics always go to <run>/metrics.jsonl)


class ResourcesConfig(Strict):
    nodes: int = Field(1, ge=1)
    time: str | None = None  # HH:MM:SS or D-HH:MM:SS; default: the profile's time limit
    exclusive: bool | None = None  # default: the profile's choice
    max_restarts: int = Field(5, ge=0)

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None:
            parse_time_minutes(v)
        return v


class Experiment(Strict):
    name: str
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(
                f"name {v!r} must be 1-64 characters of letters, digits, '.', '_' or '-' (it becomes the Slurm job name)"
            )
        return v


# ---------------------------------------------------------------- cluster profile


class ContainerConfig(Strict):
    image: str | None = None  # pyxis/enroot image, e.g. nvcr.io#nvidia/pytorch:25.01-py3
    mounts: list[str] = Field(default_factory=list)  # src:dst[:flags]
    workdir: str | None = None

    @field_validator("image", "workdir")
    @classmethod
    def _plain(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "container setting")

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            _no_control(m, "container mount")
            if "," in m:
                raise ValueError(f"container mount {m!r} contains ',', which pyxis uses to separate mounts")
        return v


class ClusterProfile(Strict):
    name: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int = Field(8, ge=0)  # 0: a CPU-only cluster (tests, the dev cluster)
    tasks_per_node: int | None = Field(None, ge=1)  # only for CPU-only clusters; GPU clusters run one task per GPU
    cpus_per_task: int = Field(8, ge=1)
    mem_per_gpu_gb: int | None = Field(None, ge=1)
    time_limit: str = "04:00:00"
    exclusive: bool = False
    signal_seconds: int = Field(120, ge=10)  # USR2 this long before the time limit: enough to save a checkpoint
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_peak_tflops_bf16: float = Field(989.0, gt=0)
    transformer_engine: bool = True  # FP8 needs it on the nodes
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)  # shell lines run before srun (module load, venv activation)
    srun_args: list[str] = Field(default_factory=list)
    python: str | None = None  # the interpreter on the nodes; default: the one running the launcher
    run_root: str = "runs"  # where run folders (logs, resolved config, checkpoints) go; shared by all nodes

    @field_validator("name", "partition", "account", "qos")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise ValueError(f"{v!r} must be letters, digits, '.', '_' or '-'")
        return v

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str) -> str:
        parse_time_minutes(v)
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not ENV_KEY_RE.match(key):
                raise ValueError(f"environment variable name {key!r} is not a valid shell identifier")
        return {k: _no_control(str(val), f"environment value of {k}") for k, val in v.items()}

    @field_validator("setup", "srun_args", "python", "run_root")
    @classmethod
    def _lines(cls, v: Any) -> Any:
        for item in [v] if isinstance(v, str) else (v or []):
            _no_control(item, "profile value")
        return v


def parse_time_minutes(value: str) -> int:
    """Slurm time (MM, HH:MM:SS, D-HH:MM:SS, D-HH) -> whole minutes, rounded up."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(value).strip())
    if not m:
        raise ValueError(f"time {value!r} is not a Slurm time (use HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # HH:MM:SS
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS
        secs = int(a) * 60 + int(b)
    else:  # MM
        secs = int(a) * 60
    if secs <= 0:
        raise ValueError(f"time {value!r} must be positive")
    return -(-secs // 60)


# ---------------------------------------------------------------- loading and overrides


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(options)}"


def _schema_at(schema: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    for part in path:
        field = schema.model_fields.get(part)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        schema = ann
    return schema


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_errors(err: ValidationError, schema: type[BaseModel], source: str) -> ConfigError:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        where = ".".join(loc)
        if e["type"] == "extra_forbidden":
            parent = _schema_at(schema, loc[:-1])
            options = sorted(parent.model_fields) if parent else []
            lines.append(f"unknown key {where!r}{_suggest(loc[-1], options)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg} (got {_short(e.get('input'))})" if where else msg)
    return ConfigError(f"{shown(source)}: " + "; ".join(lines))


# Limits for every YAML we read (files and command-line values): a few anchors can otherwise expand into
# billions of values ("billion laughs") and exhaust memory long before validation would refuse them.
MAX_YAML_BYTES = 1_000_000
MAX_YAML_ALIASES = 100
MAX_YAML_VALUES = 100_000  # scalars, lists and mappings, counted with every alias expanded
MAX_YAML_DEPTH = 64


class YamlLimitError(ConfigError):
    """A YAML text is over one of the limits above (never retried as a plain string)."""


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_yaml_graph(root: yaml.Node, source: str) -> None:
    """Refuse a composed document (aliases still shared, nothing built yet) whose aliases are too many, recursive,
    or expand to too many values; a walk over the shared graph costs no more than the text itself."""
    values: dict[int, int] = {}  # id(node) -> values once expanded, for nodes already walked
    on_path = {id(root)}
    stack = [(root, iter(_yaml_children(root)))]
    aliases = 0
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            values[id(node)] = 1 + sum(values[id(c)] for c in _yaml_children(node))
            if values[id(node)] > MAX_YAML_VALUES:
                raise YamlLimitError(f"{source}: holds more than {MAX_YAML_VALUES:,} values once its aliases (*name) are "
                                     f"expanded; write the values out instead of nesting aliases")
            continue
        if id(child) in on_path:
            raise YamlLimitError(f"{source}: an alias refers to a value that contains it (recursive); remove the alias")
        if id(child) in values:  # reached a second time: an alias
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise YamlLimitError(f"{source}: uses more than {MAX_YAML_ALIASES} aliases (*name); write the values out")
            continue
        if len(stack) >= MAX_YAML_DEPTH:
            raise YamlLimitError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep")
        on_path.add(id(child))
        stack.append((child, iter(_yaml_children(child))))


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(e).split())


def parse_yaml(text: str, source: str) -> Any:
    """yaml.safe_load with the limits above; `source` names the text in messages. Invalid YAML -> ConfigError."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlLimitError(f"{source}: {len(text):,} characters; YAML above {MAX_YAML_BYTES:,} is refused")
    loader = yaml.CSafeLoader(text) if yaml.__with_libyaml__ else yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_graph(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise YamlLimitError(f"{source}: nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; anything else is a ConfigError naming the file."""
    p = Path(path)
    name = shown(p)
    if not p.exists():
        raise ConfigError(f"config file not found: {name}")
    if not p.is_file():
        raise ConfigError(f"{name}: not a file; give a YAML file")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)  # bounded even where stat lies (/proc) or the file grows
    except OSError as e:
        raise ConfigError(f"{name}: cannot read: {e.strerror}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise YamlLimitError(f"{name}: larger than {MAX_YAML_BYTES:,} bytes; YAML files above that are refused")
    if b"\0" in raw:
        raise ConfigError(f"{name}: contains NUL bytes, so it is not a text file; give a YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 text (byte {e.start}); give a YAML file") from None
    data = parse_yaml(text, name)
    if data is None:
        raise ConfigError(f"{name}: is empty; expected `key: value` lines")
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a mapping (`key: value` lines) at the top level, got a {type(data).__name__}")
    return data


def parse_value(raw: str, source: str) -> Any:
    """A command-line value parsed as YAML (2 -> int, true -> bool, [1,2] -> list); text that is not valid YAML
    stays a string, but the size and alias limits still apply."""
    if not raw.strip():
        return raw
    try:
        return parse_yaml(raw, source)
    except YamlLimitError:
        raise
    except ConfigError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str], schema: type[BaseModel]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings; the value is parsed as YAML (so 2 is an int, true a bool, [1,2] a list)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        if CONTROL_RE.search(item):  # YAML would fold a raw newline into a space and hide it
            raise ConfigError(f"override {item!r} contains a newline or control character; remove it")
        key, raw = item.split("=", 1)
        path = key.strip().split(".")
        node_schema: type[BaseModel] | None = schema
        node = data
        for i, part in enumerate(path):
            if node_schema is not None:
                if part not in node_schema.model_fields:
                    where = ".".join(path[: i + 1])
                    raise ConfigError(f"override {item!r}: unknown key {where!r}{_suggest(part, sorted(node_schema.model_fields))}")
                node_schema = _schema_at(node_schema, [part])
            if i == len(path) - 1:
                node[part] = parse_value(raw, f"override {key.strip()!r}")
            else:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
    return data


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    data = apply_overrides(read_yaml(path), overrides or [], Experiment)
    try:
        return Experiment.model_validate(data)
    except ValidationError as e:
        raise _format_errors(e, Experiment, str(path)) from None


def load_profile(name_or_path: str | Path, overrides: list[str] | None = None) -> ClusterProfile:
    """A profile by path, or by name from slurm/clusters/<name>.yaml."""
    p = Path(name_or_path)
    if not p.suffix and NAME_RE.match(str(name_or_path)):  # a bare name; anything else is a path
        p = Path(__file__).resolve().parent.parent / "slurm" / "clusters" / f"{name_or_path}.yaml"
        if not p.is_file():
            known = sorted(q.stem for q in p.parent.glob("*.yaml"))
            raise ConfigError(f"no cluster profile named {str(name_or_path)!r}; known: {', '.join(known)} (or give a path)")
    data = apply_overrides(read_yaml(p), overrides or [], ClusterProfile)
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as e:
        raise _format_errors(e, ClusterProfile, str(p)) from None


def dump(model: BaseModel) -> str:
    return yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False)
