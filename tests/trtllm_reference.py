"""A reference reader, independent of export/: rebuilds full HF-named weights from TensorRT-LLM rank files of
any layout (TP with split or duplicated KV heads, PP, expert EP/TP inside the TP group, Qwen2-MoE's shared expert
as TensorRT-LLM's qwen converter writes it, padded lm_head, FP8)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _deq(w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    t = w[f"{prefix}.weight"]
    if t.dtype == torch.float8_e4m3fn:
        return t.float() * w[f"{prefix}.weights_scaling_factor"]
    return t.float()


def rebuild(ckpt: Path, hf_config: dict) -> dict[str, torch.Tensor]:
    cfg = json.loads((ckpt / "config.json").read_text())
    m = cfg["mapping"]
    tp, pp = m["tp_size"], m["pp_size"]
    moe_tp, moe_ep = m["moe_tp_size"], m["moe_ep_size"]
    ranks = {(p, t): load_file(str(ckpt / f"rank{p * tp + t}.safetensors")) for p in range(pp) for t in range(tp)}
    L, h, g, d = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    per = L // pp
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": ranks[(0, 0)]["transformer.vocab_embedding.weight"].float()}
    for layer in range(L):
        p, i = divmod(layer, per)
        tl, hf = f"transformer.layers.{i}", f"model.layers.{layer}"
        rs = [ranks[(p, t)] for t in range(tp)]
        qs, ks, vs = [], [], []
        for t, w in enumerate(rs):
            qkv = _deq(w, f"{tl}.attention.qkv")
            hq = h // tp * d
            hk = (g // tp if g >= tp else 1) * d
            q, k, v = torch.split(qkv, [hq, hk, hk])
            qs.append(q)
            if g >= tp or t % (tp // g) == 0:
                ks.append(k)
                vs.append(v)
            else:  # duplicated head: must equal its first copy
                assert torch.equal(k, ks[-1]) and torch.equal(v, vs[-1])
        a = f"{hf}.self_attn"
        out[f"{a}.q_proj.weight"], out[f"{a}.k_proj.weight"], out[f"{a}.v_proj.weight"] = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        if f"{tl}.attention.qkv.bias" in rs[0]:
            bq, bk, bv = [], [], []
            for t, w in enumerate(rs):
                kv = (g // tp if g >= tp else 1) * d
                q, k, v = torch.split(w[f"{tl}.attention.qkv.bias"].float(), [h // tp * d, kv, kv])
                bq.append(q)
                if g >= tp or t % (tp // g) == 0:
                    bk.append(k)
                    bv.append(v)
            out[f"{a}.q_proj.bias"], out[f"{a}.k_proj.bias"], out[f"{a}.v_proj.bias"] = torch.cat(bq), torch.cat(bk), torch.cat(bv)
        out[f"{a}.o_proj.weight"] = torch.cat([_deq(w, f"{tl}.attention.dense") for w in rs], dim=1)
        if f"{tl}.attention.q_layernorm.weight" in rs[0]:
            out[f"{a}.q_norm.weight"] = rs[0][f"{tl}.attention.q_layernorm.weight"].float()
            out[f"{a}.k_norm.weight"] = rs[0][f"{tl}.attention.k_layernorm.weight"].float()
        out[f"{hf}.input_layernorm.weight"] = rs[0][f"{tl}.input_layernorm.weight"].float()
        out[f"{hf}.post_attention_layernorm.weight"] = rs[0][f"{tl}.post_layernorm.weight"].float()
        if "moe" in cfg:
            mixtral = cfg["architecture"] == "MixtralForCausalLM"
            e = f"{hf}.block_sparse_moe" if mixtral else f"{hf}.mlp"
            gate_n, up_n, down_n = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            out[f"{e}.gate.weight"] = rs[0][f"{tl}.mlp.router.weight"].float()
            E = cfg["moe"]["num_experts"]
            local = E // moe_ep
            for x in range(E):
                ep_rank, j = divmod(x, local)
                ups, gates, downs = [], [], []
                for r in range(moe_tp):
                    w = rs[r * moe_ep + ep_rank]  # tp_rank = moe_tp_rank * moe_ep + moe_ep_rank
                    up, gate = torch.chunk(w[f"{tl}.mlp.fc.weight"][j].float(), 2)
                    ups.append(up)
                    gates.append(gate)
                    downs.append(w[f"{tl}.mlp.proj.weight"][j].float())
                out[f"{e}.experts.{x}.{gate_n}.weight"] = torch.cat(gates)
                out[f"{e}.experts.{x}.{up_n}.weight"] = torch.cat(ups)
                out[f"{e}.experts.{x}.{down_n}.weight"] = torch.cat(downs, dim=1)
            if f"{tl}.mlp.shared_expert.fc.weight" in rs[0]:  # Qwen2-MoE: [up_r; gate_r] over all of TP, gate replicated
                halves = [torch.chunk(w[f"{tl}.mlp.shared_expert.fc.weight"].float(), 2) for w in rs]
                out[f"{e}.shared_expert.up_proj.weight"] = torch.cat([up for up, _ in halves])
                out[f"{e}.shared_expert.gate_proj.weight"] = torch.cat([gate for _, gate in halves])
                out[f"{e}.shared_expert.down_proj.weight"] = torch.cat([w[f"{tl}.mlp.shared_expert.proj.weight"].float() for w in rs], dim=1)
                out[f"{e}.shared_expert_gate.weight"] = rs[0][f"{tl}.mlp.shared_expert_gate.weight"].float()
                assert all(torch.equal(w[f"{tl}.mlp.shared_expert_gate.weight"], rs[0][f"{tl}.mlp.shared_expert_gate.weight"]) for w in rs)
        else:
            mm = f"{hf}.mlp"
            out[f"{mm}.gate_proj.weight"] = torch.cat([_deq(w, f"{tl}.mlp.fc") for w in rs])
            out[f"{mm}.up_proj.weight"] = torch.cat([_deq(w, f"{tl}.mlp.gate") for w in rs])
            out[f"{mm}.down_proj.weight"] = torch.cat([_deq(w, f"{tl}.mlp.proj") for w in rs], dim=1)
    last = [ranks[(pp - 1, t)] for t in range(tp)]
    out["model.norm.weight"] = last[0]["transformer.ln_f.weight"].float()
    head = torch.cat([w["lm_head.weight"].float() for w in last])[: cfg["vocab_size"]]
    if not hf_config.get("tie_word_embeddings"):
        out["lm_head.weight"] = head
    else:
        assert torch.equal(head, out["model.embed_tokens.weight"])
    return out


def save_as_hf(weights: dict[str, torch.Tensor], hf_config: dict, out: Path) -> Path:
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out
