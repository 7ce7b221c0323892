"""Which op's first run fills the CUDA driver's JIT cache (PTX compiled at load time)? One process per op."""
import os, sys, time, json, subprocess
from pathlib import Path
OPS = ["matmul", "te_linear", "te_norm", "te_attn", "te_rope", "torch_adamw", "mcore_adam", "compile"]
def child(op):
    import torch
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    t = time.time()
    if op == "matmul":
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True); (a @ a).sum().backward()
    elif op == "te_linear":
        import transformer_engine.pytorch as te
        m = te.Linear(3072, 8192, bias=False, params_dtype=torch.bfloat16).cuda(); x = torch.randn(2048, 4, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        m(x).sum().backward()
    elif op == "te_norm":
        import transformer_engine.pytorch as te
        m = te.RMSNorm(3072, params_dtype=torch.bfloat16).cuda(); x = torch.randn(2048, 4, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        m(x).sum().backward()
    elif op == "te_attn":
        import transformer_engine.pytorch as te
        m = te.DotProductAttention(24, 128, num_gqa_groups=8, attn_mask_type="causal", qkv_format="sbhd")
        q = torch.randn(2048, 4, 24, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2048, 4, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2048, 4, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        m(q, k, v).sum().backward()
    elif op == "te_rope":
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
        x = torch.randn(2048, 4, 24, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        f = torch.randn(2048, 1, 1, 128, device="cuda")
        apply_rotary_pos_emb(x, f, fused=True).sum().backward()
    elif op == "torch_adamw":
        ps = [torch.nn.Parameter(torch.randn(1000, 1000, device="cuda")) for _ in range(4)]
        for p in ps: p.grad = torch.randn_like(p)
        torch.optim.AdamW(ps, fused=True).step()
    elif op == "mcore_adam":
        from transformer_engine.pytorch.optimizers import FusedAdam
        ps = [torch.nn.Parameter(torch.randn(1000, 1000, device="cuda")) for _ in range(4)]
        for p in ps: p.grad = torch.randn_like(p)
        FusedAdam(ps).step()
    elif op == "compile":
        f = torch.compile(lambda x: torch.nn.functional.silu(x) * x)
        f(torch.randn(1000, device="cuda"))
    torch.cuda.synchronize()
    print(json.dumps({"op": op, "first_s": round(time.time() - t, 2)}))
if len(sys.argv) > 1:
    child(sys.argv[1]); raise SystemExit
procs = {}
for op in OPS:
    env = dict(os.environ, CUDA_CACHE_PATH=f"/root/jit/{op}", TRITON_CACHE_DIR=f"/root/jit/triton-{op}", TORCHINDUCTOR_CACHE_DIR=f"/root/jit/ind-{op}")
    procs[op] = subprocess.Popen([sys.executable, __file__, op], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for op, p in procs.items():
    out = p.communicate()[0]
    files = [f for f in Path(f"/root/jit/{op}").rglob("*") if f.is_file() and f.name != "index"]
    print(op, "jit files:", len(files), "bytes:", sum(f.stat().st_size for f in files), "|", out.strip().splitlines()[-1][:300] if out.strip() else "")
