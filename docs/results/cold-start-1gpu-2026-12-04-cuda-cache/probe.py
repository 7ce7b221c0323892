import json, sys, time
from pathlib import Path
sys.path.insert(0, "/tmp/b")
import cold_start as c
out = Path("/root/cs")
cfg = c.bench_config("3b", "save", out / "config2", out / "ckpt2")
for name, cuda in [("warm", None), ("empty-cuda-cache", "/root/nv-empty-1"), ("warm2", None),
                   ("empty-cuda-cache2", "/root/nv-empty-2")]:
    env = c.case_env("warm", out)
    if cuda:
        env["CUDA_CACHE_PATH"] = cuda
    d = out / ("split-" + name); d.mkdir(exist_ok=True)
    marks, log = c.until_step1([sys.executable, "-m", "mcorekit.train", "--config", str(cfg), "--run-dir", str(d)], env, d / "log.txt")
    print(json.dumps({"case": name, "phases": c.phases(marks) if "step1" in marks else log[-800:],
                      "step1_s": marks.get("step1")}), flush=True)
