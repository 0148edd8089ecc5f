"""Wake-up OOM next to a trainer, and `vllm-rlpatch kv-pin`'s fix, on a real GPU (vLLM 0.25.1, H200).

Model: Llama-3-8B shape (32 layers, hidden 4096, 8 KV heads; 16.06 GB bf16, dummy weights), max_model_len
4096, enforce_eager (engine starts in ~30 s instead of ~90 s; the same for every engine here). Each scenario
runs in its own process; the "trainer" is a tensor of --reserve-gib that the driver process allocates on
the same GPU while the engine sleeps and keeps while it generates again (a colocated trainer's resident
state).

    python benchmarks/gpu/kv_pin.py phase1 OUTDIR   # unpinned engine (gpu_memory_utilization=0.8):
                                                     #   tokens/s, sleep, reserve, wake -> OOM?; then the
                                                     #   kv-pin CLI (measure + verify), and again (cache)
    python benchmarks/gpu/kv_pin.py phase2 OUTDIR   # pinned engine (VLLM_RLPATCH_KV_CACHE_BYTES from
                                                     #   phase1): tokens/s, sleep, reserve, wake, tokens/s;
                                                     #   level-2 wake order with the guard off and on
Needs the vLLM bundle at /tmp/site (benchmarks/gpu/setup_site.sh), PYTHONPATH=/tmp/site,
VLLM_USE_FLASHINFER_SAMPLER=0. Writes JSON under OUTDIR; nothing here is a pass/fail test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

GiB = 1 << 30
MODEL = "/tmp/m8b"
RESERVE_GIB = 60
ENGINE = dict(model=MODEL, load_format="dummy", dtype="bfloat16", max_model_len=4096, enforce_eager=True)
ROLLOUT = dict(n=256, max_tokens=512)  # ~140k tokens of KV in flight: fits the pin and the unpinned engine
PROMPT = "The quick brown fox jumps over the lazy dog while the"
CLI_ARGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager"]


def make_model(path: str = MODEL) -> None:
    if os.path.exists(f"{path}/config.json"):
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(3000)], tr)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                tie_word_embeddings=False).save_pretrained(path)


# ---------------------------------------------------------------------------------------------------------
# children
def _free():
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _rollout(llm):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=ROLLOUT["max_tokens"], ignore_eos=True, seed=0)
    t = time.time()
    outs = llm.generate([f"{PROMPT} {i}" for i in range(ROLLOUT["n"])], sp, use_tqdm=False)
    dt = time.time() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(outs), "tokens": toks, "seconds": round(dt, 2), "tokens_per_s": round(toks / dt, 1)}


def _greedy(llm):
    from vllm import SamplingParams

    outs = llm.generate([f"{PROMPT} {i}" for i in range(8)], SamplingParams(temperature=0.0, max_tokens=32),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def child_engine(mode: str, out: str) -> None:
    """mode: unpinned (gpu_memory_utilization=0.8, as the issue's run) | pinned (VLLM_RLPATCH_KV_CACHE_BYTES)."""
    import torch

    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    res = {"mode": mode, "gpu": torch.cuda.get_device_name(), "total": int(total), "free_before": int(free0),
           "reserve": RESERVE_GIB * GiB, "env_pin": os.environ.get("VLLM_RLPATCH_KV_CACHE_BYTES"),
           "rollout_tokens_declared": os.environ.get("VLLM_RLPATCH_ROLLOUT_TOKENS")}
    from vllm import LLM
    import vllm

    res["vllm"] = vllm.__version__
    kw = dict(ENGINE, enable_sleep_mode=True)
    if mode == "unpinned":
        kw["gpu_memory_utilization"] = 0.8
    t = time.time()
    llm = LLM(**kw)
    res["start_s"] = round(time.time() - t, 1)
    res["memory_awake"] = llm.collective_rpc("rlpatch_memory")[0]
    res["free_awake"] = _free()
    res["rollout_before_sleep"] = _rollout(llm)
    before = _greedy(llm)
    t = time.time()
    llm.sleep(level=1)
    res["sleep_s"] = round(time.time() - t, 2)
    res["free_asleep"] = _free()
    reserve = torch.empty(RESERVE_GIB * GiB, dtype=torch.uint8, device="cuda")
    res["free_asleep_with_reserve"] = _free()
    t = time.time()
    try:
        llm.wake_up()
        res["wake"] = "ok"
        res["wake_s"] = round(time.time() - t, 2)
        res["free_awake_with_reserve"] = _free()
        res["outputs_identical_after_wake"] = _greedy(llm) == before
        res["rollout_after_wake_with_reserve"] = _rollout(llm)
    except BaseException as e:  # the wake-up OOM
        res["wake"] = "failed"
        res["wake_s"] = round(time.time() - t, 2)
        res["wake_error"] = f"{type(e).__name__}: {e}"[:3000]
    del reserve
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    os._exit(0)  # a dead engine core can make a clean shutdown hang


def child_wake_order(guard: str, out: str) -> None:
    """Level 2: wake_up(['kv_cache']) first, then the right order (weights -> reload_weights -> kv_cache)."""
    from vllm import LLM

    import vllm_rlpatch.models as m

    res = {"guard": guard}
    llm = LLM(model=m.path("llama-tiny"), enable_sleep_mode=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=256, gpu_memory_utilization=0.2)
    before = _greedy(llm)
    llm.sleep(level=2)
    try:
        llm.wake_up(tags=["kv_cache"])
        res["kv_cache_first"] = "accepted"
    except BaseException as e:
        res["kv_cache_first"] = f"{type(e).__name__}: {e}"[:1500]
    try:
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        res["right_order_outputs_identical"] = _greedy(llm) == before
    except BaseException as e:
        res["right_order_error"] = f"{type(e).__name__}: {e}"[:1500]
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------
# driver
def _run(cmd: list[str], log: str, timeout: int, **env: str) -> tuple[int, float]:
    """Run with output to a file, in its own session; afterwards kill what it left (a dead engine core keeps
    running and would hold the GPU) and wait until the GPU memory is back."""
    import signal

    t = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=dict(os.environ, **env), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -9
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for _ in range(60):
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.strip()
        if used.isdigit() and int(used) < 2048:
            break
        time.sleep(1)
    return rc, round(time.time() - t, 1)


def _child(args: list[str], out: str, timeout: int, **env: str) -> dict:
    name = os.path.basename(out).replace(".json", "")
    rc, wall = _run([sys.executable, __file__, *args, out], out.replace(".json", ".log"), timeout, **env)
    try:
        with open(out) as f:
            r = json.load(f)
    except FileNotFoundError:
        with open(out.replace(".json", ".log")) as f:
            r = {"error": f"{name}: no result (rc {rc})", "log_tail": f.read()[-4000:]}
    r["wall_s"], r["rc"] = wall, rc
    print(f"[{name}] {json.dumps({k: v for k, v in r.items() if k not in ('memory_awake',)})[:2500]}", flush=True)
    return r


def phase1(outdir: str) -> None:
    make_model()
    r = {}
    if not os.environ.get("SKIP_UNPINNED"):
        r["unpinned"] = _child(["child-engine", "unpinned"], f"{outdir}/unpinned.json", 300)
    cli = [sys.executable, "-m", "vllm_rlpatch.tools.cli", "kv-pin", "--model", MODEL, "--trainer-reserve-gib",
           str(RESERVE_GIB), "--json", f"{outdir}/kvpin.json", *CLI_ARGS]
    for run in ("first", "second"):
        log = f"{outdir}/kvpin_{run}.log"
        rc, wall = _run(cli, log, 420)
        text = open(log).read()
        r[f"cli_{run}"] = {"rc": rc, "seconds": wall, "output": [l for l in text.splitlines()
                                                                 if "kv-pin" in l or l.startswith(("KV-cache", "verified",
                                                                 "budget", "use:", "  (", "WARNING: the"))]}
        print(f"[kv-pin {run}] rc={rc} {wall}s\n" + "\n".join(r[f"cli_{run}"]["output"]), flush=True)
    with open(f"{outdir}/phase1.json", "w") as f:
        json.dump(r, f, indent=1)


def phase2(outdir: str) -> None:
    make_model()
    pin = json.load(open(f"{outdir}/kvpin.json"))["pin"] if os.path.exists(f"{outdir}/kvpin.json") else None
    pin = pin or int(os.environ["KV_PIN"])
    r = {"pinned": _child(["child-engine", "pinned"], f"{outdir}/pinned.json", 400,
                          VLLM_RLPATCH_KV_CACHE_BYTES=str(pin), VLLM_RLPATCH_ROLLOUT_TOKENS="1024x1024")}
    r.update(wake_order(outdir))
    with open(f"{outdir}/phase2.json", "w") as f:
        json.dump(r, f, indent=1)


def wake_order(outdir: str) -> dict:
    r = {}
    for guard in ("0", "1"):
        out = f"{outdir}/wake_order_{guard}.json"
        r[f"wake_order_guard_{guard}"] = x = _child(["child-wake-order", guard], out, 240,
                                                    VLLM_RLPATCH_WAKE_ORDER_GUARD=guard)
        with open(out.replace(".json", ".log")) as f:
            x["log_lines"] = [l[:400] for l in f.read().splitlines()
                              if "rlpatch" in l.lower() or "Error" in l or "wake" in l.lower()][-40:]
    with open(f"{outdir}/wake_order.json", "w") as f:
        json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "child-engine":
        child_engine(sys.argv[2], sys.argv[3])
    elif what == "child-wake-order":
        child_wake_order(sys.argv[2], sys.argv[3])
    elif what == "phase1":
        phase1(sys.argv[2])
    elif what == "phase2":
        phase2(sys.argv[2])
    elif what == "wake-order":
        wake_order(sys.argv[2])
    else:
        sys.exit(f"unknown: {what}")
