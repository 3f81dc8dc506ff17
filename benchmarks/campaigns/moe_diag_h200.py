"""GPU diagnostics for issue 15 (H200): the MoE LoRA step at batch 2 / 4 and recompute dots / none / full (each in its
own process), and the serve step's largest buffers at 4 layers (XLA buffer-assignment dump in $OUT/dump).
    PYTHONPATH=$PWD OUT=/tmp/out python3 benchmarks/campaigns/moe_diag_h200.py"""
import json, os, subprocess, sys, glob, re

def child_train(spec):
    from surojax.bench.train_bench import BenchConfig, run
    bc = BenchConfig(shape="qwen3-30b-a3b", mode="lora", seq=2048, steps=4, repeats=1, warmup=1,
                     targets="all-linear", unroll_layers=1, segments=4, **spec)
    r = run(bc)
    print("RESULT " + json.dumps({k: r.get(k) for k in ("tokens_per_s", "step_ms", "mfu", "mfu_6n", "peak_gib", "compile_s")} | {"spec": spec}), flush=True)

def child_serve(layers):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={os.environ['OUT']}/dump --xla_dump_hlo_module_re=.*paged_step.* --xla_dump_hlo_as_text"
    import jax, jax.numpy as jnp
    from flax import nnx
    from surojax.bench.shapes import model_config
    from surojax.models.decoder import Decoder
    from surojax.serve.engine import Engine
    from surojax.serve.config import EngineConfig, SchedulerConfig
    cfg = model_config("qwen3-30b-a3b").replace(num_layers=layers)
    m = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention="xla", rngs=nnx.Rngs(0)))
    gd, st = nnx.split(m)
    st = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) + 0.01, st))()
    m = nnx.merge(gd, st)
    print("after init GiB", jax.devices()[0].memory_stats()["bytes_in_use"] / 2**30, flush=True)
    eng = Engine(m, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=16 + 4 * 32, max_model_len=192), num_blocks=16 * 12 + 8, block_size=16))
    try:
        print(eng.generate([[1] * 32] * 4, max_tokens=4), flush=True)
    except Exception as e:
        print("SERVE FAILED", str(e)[:300], flush=True)
    print("peak GiB", jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0) / 2**30, flush=True)
    for f in glob.glob(f"{os.environ['OUT']}/dump/*paged_step*buffer-assignment.txt"):
        txt = open(f).read()
        allocs = re.findall(r"allocation (\d+): size (\d+)(.*?)\n((?:\s+value:.*\n)*)", txt)
        allocs.sort(key=lambda a: -int(a[1]))
        print("==", os.path.basename(f))
        for a in allocs[:4]:
            print(f"  alloc {a[0]} {int(a[1])/2**30:.2f} GiB {a[2][:80]}")
            print("    " + "\n    ".join(a[3].strip().splitlines()[:4]))

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        child_train(json.loads(sys.argv[2])); sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        child_serve(int(sys.argv[2])); sys.exit(0)
    rows = []
    p = subprocess.run([sys.executable, __file__, "serve", "4"], capture_output=True, text=True, timeout=200)
    print(p.stdout[-3000:], p.stderr[-1500:] if p.returncode else "", flush=True)
    for spec in ({"batch": 2, "recompute": "dots"}, {"batch": 2, "recompute": "none"}, {"batch": 4, "recompute": "full"}):
        try:
            p = subprocess.run([sys.executable, __file__, "train", json.dumps(spec)], capture_output=True, text=True, timeout=150)
            res = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            rows.append(res[-1] if res else f"{spec} FAILED rc={p.returncode} {p.stderr[-600:]}")
        except subprocess.TimeoutExpired:
            rows.append(f"{spec} TIMEOUT")
        print(rows[-1], flush=True)
    print("\n".join(rows))
