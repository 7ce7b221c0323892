"""The experiment schema: one YAML file says what to train (model, parallel layout, precision, data, optimizer,
schedule, checkpoints) and with what resources. `load_experiment` reads it with overrides; rules that involve
several keys, the model or the GPUs are in rules.py, not here: a schema field checks only its own value."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from mcorekit.config.loading import load
from mcorekit.config.values import NAME_RE, Strict, no_control, path_value, slurm_time
from mcorekit.models.parallel import Layout
from mcorekit.options import MAX_INT


class ModelConfig(Strict):
    preset: str | None = None  # a name from mcorekit.models.spec.PRESETS
    hf_config: str | None = None  # an HF model directory or config.json
    overrides: dict[str, Any] = Field(default_factory=dict)  # ModelSpec fields, e.g. {num_layers: 2}
    # te: Transformer Engine layers (needed for FP8 and packing); local: Megatron-Core's own layers with PyTorch's
    # fused SDPA attention; auto: te where Transformer Engine is importable, else local
    backend: Literal["auto", "te", "local"] = "auto"

    @field_validator("hf_config")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return path_value(v, "HF config path")


# Every integer setting is strict (strict=True): pydantic's lax mode would read `true` as 1 and `2.0` as 2; and
# bounded (le=): a huge value would otherwise pass here and fail only on the nodes, after the queue.
class ParallelConfig(Strict):
    tp: int = Field(1, ge=1, le=MAX_INT, strict=True)
    pp: int = Field(1, ge=1, le=MAX_INT, strict=True)
    vpp: int | None = Field(None, ge=1, le=MAX_INT, strict=True)  # virtual stages per pipeline rank (interleaved)
    cp: int = Field(1, ge=1, le=MAX_INT, strict=True)
    ep: int = Field(1, ge=1, le=MAX_INT, strict=True)
    etp: int = Field(1, ge=1, le=MAX_INT, strict=True)  # expert tensor parallel size
    sequence_parallel: bool = False
    # fully sharded data parallel through Megatron-FSDP: what is sharded over the data-parallel ranks (ZeRO-1/2/3
    # style). None: plain DDP, with optimizer.distributed sharding the optimizer state as before
    fsdp: Literal["optim", "optim_grads", "optim_grads_params"] | None = None


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
    # how the grouped experts compute: TE's GroupedLinear or torch._grouped_mm (one kernel per grouped GEMM, far less
    # host work per layer; bf16, or FP8 delayed/tensorwise with bf16 weights on compute capability 9.0/10.0).
    # auto: torch where it applies (1.7x on one H200), else te
    expert_gemm: Literal["auto", "te", "torch"] = "auto"
    dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    # FFN size of the shared expert(s) every token also passes through
    shared_expert_ffn: int | None = Field(None, ge=1, le=MAX_INT, strict=True)
    shared_expert_overlap: bool = False  # overlap the shared expert with the token dispatch (alltoall/allgather)
    permute_fusion: bool = True
    router_fusion: bool = False  # TE's fused top-k + softmax + aux loss
    a2a_overlap: bool = False  # overlap expert-parallel all-to-all with compute (needs EP > 1)


class DataConfig(Strict):
    kind: Literal["mock", "indexed", "sft", "dpo", "grpo"] = "mock"
    # indexed: path prefixes of .bin/.idx pairs (from `mcorekit data preprocess`); sft: .jsonl files of chats;
    # dpo: .jsonl files of {prompt, chosen, rejected} preference pairs; grpo: .jsonl files of {prompt, ...} whose
    # other fields (e.g. answer) go to the reward functions
    paths: list[str] = Field(default_factory=list)
    # blend weights, one per path (indexed); each > 0, as the job's dataset builder requires
    weights: list[Annotated[float, Field(gt=0)]] | None = None
    # held-out data of the same kind, for the validation loss every schedule.eval_interval steps (mock data
    # validates on its own stream without it)
    valid_paths: list[str] = Field(default_factory=list)
    tokenizer: str | None = None  # an HF tokenizer directory (sft; indexed takes its eod from the .idx side-car)
    seq_length: int = Field(2048, ge=1, le=MAX_INT, strict=True)
    packing: bool = False  # sft: several conversations per sequence, attention kept within each
    dynamic_batching: bool = False
    cache_dir: str | None = None  # dataset index caches; default <run dir>/data_cache
    seed: int = Field(1234, ge=0, le=2**32 - 1, strict=True)  # numpy seeds are unsigned 32-bit

    @field_validator("paths", "valid_paths", "tokenizer", "cache_dir")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        if isinstance(v, list):
            for item in v:
                path_value(item, "data path", "give a path, or remove the empty entry")
        else:
            path_value(v, "data path")
        return v


class DPOConfig(Strict):
    """Direct preference optimisation (data.kind=dpo): sigmoid loss on policy-vs-reference log-ratio margins."""

    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # conservative DPO: assumed fraction of flipped labels
    sft_weight: float = Field(0.0, ge=0)  # adds this x the NLL of the chosen response (RPO-style)
    # reference log-probs: live = a frozen copy of the starting weights on the same GPUs (with LoRA: the base with
    # adapters off, no copy); precomputed = one forward pass over the data before training, stored in the run dir
    reference: Literal["live", "precomputed"] = "live"


class RewardConfig(Strict):
    """One reward function: `module:function` (a module on sys.path) or `path/to/file.py:function` (relative to the
    working directory, like data.paths), called as function(prompt, completion, **fields, **kwargs) -> float."""

    function: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)  # extra keyword arguments, e.g. {pattern: "..."}

    @field_validator("function")
    @classmethod
    def _function(cls, v: str) -> str:
        no_control(v, "reward function")
        module, sep, name = v.rpartition(":")
        if not sep or not module or not name.isidentifier():
            raise ValueError(f"reward function {v!r} must be 'module:function' or 'path/to/file.py:function'")
        return v


class GRPOConfig(Strict):
    """Group relative policy optimisation (data.kind=grpo, train/tasks/grpo.py): per prompt a group of samples from
    the policy itself, rewards, group-normalised advantages, the clipped policy-gradient loss and a KL penalty."""

    group_size: int = Field(8, ge=2, le=MAX_INT, strict=True)  # G: samples per prompt
    # the step's global batch is prompts_per_step x group_size sequences
    prompts_per_step: int = Field(8, ge=1, le=MAX_INT, strict=True)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)  # 1.0: no nucleus filtering
    max_new_tokens: int = Field(256, ge=1, le=MAX_INT, strict=True)
    clip_low: float = Field(0.2, ge=0, lt=1)  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO: high 0.28)
    clip_high: float = Field(0.2, ge=0)
    kl_coeff: float = Field(0.0, ge=0)  # beta of the k3 KL penalty to the reference (0: no reference model)
    # token: every completion token weighs the same (DAPO); sequence: mean per completion, then over completions
    # (the original GRPO)
    loss_aggregation: Literal["token", "sequence"] = "token"
    scale_rewards: bool = True  # divide the advantages by the group's std (Dr. GRPO: false)
    rewards: list[RewardConfig] = Field(default_factory=list)
    # how rollouts are generated (train/generate.py): static = Megatron-Core's static-batch engine (KV cache);
    # dynamic = its DynamicInferenceEngine (needs flash-attn >= 2.7.3); plain = a sampling loop over the training
    # forward, no KV cache; auto = static, or plain where the engines do not apply (EP, SP, FP8)
    generation: Literal["auto", "dynamic", "static", "plain"] = "auto"
    kv_cache_gb: float = Field(2.0, gt=0)  # the dynamic engine's KV-cache buffer, allocated per step and freed
    # sampling seed; step s of DP rank r samples with seed + s x 1009 + r
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True)


class LoraConfig(Strict):
    rank: int = Field(16, ge=1, le=MAX_INT, strict=True)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Megatron-Core's linear layers: qkv (attention in), proj (attention out), fc1, fc2 (MLP in/out)
    target_modules: list[Literal["qkv", "proj", "fc1", "fc2"]] = Field(
        default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    experts: bool = False  # also adapt the MoE experts' fc1/fc2 (otherwise only dense and shared-expert MLPs)
    # adapters to start from (a LoRA checkpoint, e.g. `mcorekit convert hf-to-mcore HF_DIR OUT --lora PEFT_DIR`); the
    # base model is always checkpoint.load
    load: str | None = None

    @field_validator("load")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return path_value(v, "adapter checkpoint path")


class PeftConfig(Strict):
    lora: LoraConfig | None = None  # None: full fine-tuning


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
    # parameters per gradient bucket; null = one bucket
    bucket_size: int | None = Field(40_000_000, ge=1, le=MAX_INT, strict=True)
    tp_comm_overlap: bool = False


class ScheduleConfig(Strict):
    train_iters: int = Field(1000, ge=1, le=MAX_INT, strict=True)
    warmup_iters: int = Field(100, ge=0, le=MAX_INT, strict=True)
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    micro_batch_size: int = Field(1, ge=1, le=MAX_INT, strict=True)
    global_batch_size: int = Field(8, ge=1, le=MAX_INT, strict=True)
    # validation loss every N steps and at the end; 0 = none
    eval_interval: int = Field(0, ge=0, le=MAX_INT, strict=True)
    # global batches per validation (the same ones every time)
    eval_iters: int = Field(10, ge=1, le=MAX_INT, strict=True)
    # one CUDA graph for each step's forward and backward passes (Megatron-Core's full-iteration graph): the GPU
    # replays the step's kernels without the host launching each. auto: where it applies (rules.full_graph_blockers
    # lists what it does not cover yet); true: the same, and an error where it does not apply; false: never
    cuda_graph: Literal["auto"] | bool = "auto"


class RecomputeConfig(Strict):
    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = Field(1, ge=1, le=MAX_INT, strict=True)
    # selective: which submodules to recompute (Megatron-Core names: core_attn, mlp, moe, moe_act, layernorm, ...)
    modules: list[str] = Field(default_factory=lambda: ["core_attn"])
    # layers whose activations go to host memory (Transformer Engine)
    offload_layers: int = Field(0, ge=0, le=MAX_INT, strict=True)


class CheckpointConfig(Strict):
    dir: str | None = None  # default: <run dir>/checkpoints
    save_interval: int = Field(500, ge=1, le=MAX_INT, strict=True)
    keep_last: int = Field(3, ge=1, le=MAX_INT, strict=True)
    # write in the background (a thread) while training continues, from a copy made first: on the GPU where it has
    # room for one (each rank's share of the checkpoint next to the steps' peak; the run's mem_gb then includes
    # it), else in pinned host memory (3B shape, 36.6 GB: the loop blocked 14 s on one H200 the first time)
    async_save: bool = False
    load: str | None = None  # a checkpoint to start from (e.g. converted from HF)
    finetune: bool = False  # load: weights only, fresh optimizer, step 0 (always so for a converted `release`)

    @field_validator("dir", "load")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return path_value(v, "checkpoint path")


class WandbConfig(Strict):
    project: str
    entity: str | None = None
    name: str | None = None  # default: the experiment's name
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: write under the run dir, sync later


class LoggingConfig(Strict):
    log_interval: int = Field(10, ge=1, le=MAX_INT, strict=True)
    tensorboard: bool = False  # also write <run>/tensorboard (metrics always go to <run>/metrics.jsonl)
    wandb: WandbConfig | None = None  # also log to Weights & Biases (the optional `wandb` extra)


class ResourcesConfig(Strict):
    nodes: int = Field(1, ge=1, le=MAX_INT, strict=True)
    time: str | None = None  # HH:MM:SS or D-HH:MM:SS; default: the profile's time limit
    exclusive: bool | None = None  # default: the profile's choice
    # Slurm counts a job's restarts in 16 bits (restart_cnt, SLURM_RESTART_COUNT): a cap above that never applies
    max_restarts: int = Field(5, ge=0, le=2**16 - 1, strict=True)

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: object) -> object:
        return slurm_time(v)


class Experiment(Strict):
    name: str
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    peft: PeftConfig = Field(default_factory=PeftConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(
                f"name {v!r} must be 1-64 characters of letters, digits, '.', '_' or '-' (it becomes the Slurm job name)"
            )
        return v


MODEL_SOURCES = ("model.preset", "model.hf_config")  # an experiment names exactly one


def _one_model_source(overrides: list[str]) -> list[str]:
    """An override that names the model one way (model.hf_config=DIR) replaces the file's other way (its
    model.preset) instead of leaving both: the command line wins, unless it sets both itself."""
    given = {o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip() for o in overrides if "=" in o}
    named = [k for k in MODEL_SOURCES if k in given and given[k] not in ("", "null", "~", "None")]
    if len(named) == 1 and not any(k in given for k in MODEL_SOURCES if k != named[0]):
        return [f"{k}=null" for k in MODEL_SOURCES if k != named[0]] + overrides
    return overrides


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    return load(Experiment, path, _one_model_source(overrides or []))


def layout_of(exp: Experiment) -> Layout:
    """The experiment's parallel section as the Layout that models/ and the rules take."""
    p = exp.parallel
    return Layout(p.tp, p.pp, p.cp, p.ep, p.etp, p.vpp, p.sequence_parallel)
