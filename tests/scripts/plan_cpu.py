"""The copy plan on real vLLM model classes, built on CPU without an engine; prints `RESULT {...}`.

    python plan_cpu.py MODEL_DIR WEIGHTS_B_DIR

Builds the model class vLLM would (its config through EngineArgs, a one-process gloo group, the class from
vLLM's registry), loads the checkpoint with the model's own ``load_weights`` (no post-processing: CPU
repacking happens in the engine's loader, not here, so the parameters keep the checkpoint layout), then:
captures and verifies the plan, replays another update and compares every parameter with a fresh load of it
(``torch.equal``), digests the destination windows, invalidates the plan by re-pointing a parameter, checks
what ``validate-then-write`` proves before writing, and backs windows up into a host arena with a fault after
the first write, restoring them bit-identically.
"""

import json
import os
import sys
import tempfile

import torch


def build(model_dir):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cfg = EngineArgs(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256).create_engine_config()
    with set_current_vllm_config(cfg):
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            initialize_model_parallel(1, 1)
        cls, _ = get_model_architecture(cfg.model_config)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = cls(vllm_config=cfg, prefix="")
        finally:
            torch.set_default_dtype(old)
    return cfg, model


def state(d):
    from safetensors.torch import load_file

    return dict(sorted(load_file(os.path.join(d, "model.safetensors")).items()))


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main():
    from vllm.config import set_current_vllm_config

    from vllm_rlpatch.refit import backup as B
    from vllm_rlpatch.refit import checks
    from vllm_rlpatch.refit.plan import CopyPlan

    model_dir, b_dir = sys.argv[1], sys.argv[2]
    cfg, model = build(model_dir)
    a, b = state(model_dir), state(b_dir)
    tied = "lm_head.weight" not in a
    skip = {"lm_head.weight"} if tied else set()
    out = {"model": type(model).__name__, "tied": tied}
    with set_current_vllm_config(cfg), torch.no_grad():
        model.load_weights(list(a.items()))
        metas = [(n, list(t.shape), t.dtype) for n, t in a.items() if n not in skip]
        plan = CopyPlan.capture(model, metas, skip=skip)
        out["copies"], out["names"] = plan.copies, len(plan.names)
        out["params"] = len({id(e.dst) for e in plan.entries})  # fused q/k/v land in one parameter
        out["verify"] = plan.verify(a)
        entries = plan.entries_for(None)
        out["all_whole_source"] = all(e.whole_source for e in entries)
        # replay B through the plan; compare with a fresh load of B by the model's own loader
        before = params(model)
        out["preconditions_ok"] = plan.preconditions(entries, b, allow_cast=False)
        plan.copy(entries, b)
        replayed = params(model)
        _, fresh = build(model_dir)
        fresh.load_weights(list(b.items()))
        differ = [n for n, p in fresh.named_parameters() if not torch.equal(p, replayed[n])]
        out["replay_equals_fresh_load"], out["replay_differ"] = not differ, differ[:5]
        out["replay_changed_something"] = any(not torch.equal(before[n], replayed[n]) for n in before)
        # the post-write check: every window's digest is its source's digest
        got = checks.digests(plan.windows(entries))
        want = checks.digests([b[e.name] for e in entries])
        out["window_digests_match"] = all(g.key == w.key for g, w in zip(got, want))
        # a corrupted window is found by it
        w0 = plan.windows(entries[:1])[0]
        keep = w0.clone()
        w0.view(-1)[0] = w0.view(-1)[0] + 1
        out["corruption_detected"] = checks.digests([w0])[0].key != want[0].key
        w0.copy_(keep)
        # invalidation: a parameter re-pointed (what a reload or a sleep does) makes the plan stale, also after
        # passing checks (the second one compares the parameters' addresses with the first's in one pass)
        out["live_primed"] = [plan.live(), plan.live()]
        p0 = entries[0].dst
        old_data = p0.data
        p0.data = old_data.clone()
        out["live_after_repoint"] = plan.live()
        p0.data = old_data
        out["live_after_restore"] = plan.live()
        # a tensor replaced on the model by a new object: the plan's own reference still has its storage, but the
        # model computes with the new one (the plan would write where nothing reads); a new object on the same
        # storage is still live
        qual, d, attr, _ = plan.holders[0]
        orig = d[attr]
        d[attr] = torch.nn.Parameter(orig.data.clone(), requires_grad=False)
        out["live_after_replace"] = [qual, plan.live()]
        d[attr] = torch.nn.Parameter(orig.data, requires_grad=False)
        out["live_same_storage"] = plan.live()
        d[attr] = orig
        out["live_after_put_back"] = [plan.live(), plan.live()]
        out["holders"] = len(plan.holders)
        # what validate-then-write proves before the first write
        name = next(e.name for e in entries if e.dst.dim() == 2)
        e_name = [e for e in entries if e.name == name]
        bad = dict(b)
        bad[name] = b[name].t().contiguous().t()  # same values, not contiguous
        out["pre_noncontiguous"] = plan.preconditions(e_name, bad, allow_cast=False)
        bad[name] = b[name].float()
        out["pre_dtype"] = plan.preconditions(e_name, bad, allow_cast=False)
        out["pre_dtype_cast_ok"] = plan.preconditions(e_name, bad, allow_cast=True)
        bad[name] = e_name[0].dst.data.view(-1)[: b[name].numel()].view(b[name].shape)  # a view of the model
        out["pre_overlap"] = plan.preconditions(e_name, bad, allow_cast=False)
        # rollback on the plan path: windows backed up into a reused host arena, a fault after the first
        # write, everything restored bit-identically
        snap = params(model)
        arena = B.BackupArena("host", torch.device("cpu"))
        arena.reserve(sum(w.numel() * w.element_size() for w in plan.windows(entries)))
        arena.begin()
        wb = B.WindowBackup(arena)
        dst = plan.windows(entries)
        src = plan.source_windows(entries, a)

        def write(i):
            dst[i].copy_(src[i])
            if i == 1:
                raise RuntimeError("injected fault after the first write")

        try:
            wb.save_then(dst, write)
        except RuntimeError as e:
            out["fault"] = str(e)
        out["written_before_fault"] = len(wb.saved)
        wb.restore()
        out["restored_bit_identical"] = all(torch.equal(p, snap[n]) for n, p in model.named_parameters())
        out["backup_bytes"] = wb.bytes
        out["arena_capacity"] = arena.capacity
        arena.release()
        arena.begin()
        out["arena_reused"] = arena.slot(16).data_ptr() == arena.chunks[0].data_ptr()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
