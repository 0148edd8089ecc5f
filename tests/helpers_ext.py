"""A framework-style worker extension, used to test composition with the plugin's own extension and the
update paths RL frameworks use inside the worker."""

import os


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(path)


class HeadProbeExtension:
    def head_probe(self, seed=0):
        """Logits of the worker's real model for random hidden states vs F.linear(h.float(), w.float()):
        the lm_head's dtype, the logits' dtype and the largest difference to the fp32 and bf16 products."""
        import torch
        import torch.nn.functional as F

        model = self.model_runner.model
        head = model.lm_head
        w = head.weight
        g = torch.Generator().manual_seed(seed)
        h = (torch.randn(5, w.shape[1], generator=g) * 2).to(w.dtype).to(w.device)
        with torch.no_grad():
            logits = model.compute_logits(h)
            ref = F.linear(h.float(), w.float())[..., : logits.shape[-1]]
            ref_bf16 = F.linear(h, w)[..., : logits.shape[-1]].float()
        return {"weight_dtype": str(w.dtype), "logits_dtype": str(logits.dtype),
                "max_diff_fp32": float((logits.float() - ref).abs().max()),
                "max_diff_model_dtype": float((logits.float() - ref_bf16).abs().max()),
                "fp32_vs_model_dtype": float((ref - ref_bf16).abs().max())}


_NOT_WEIGHTS = {"kv_cache", "attn_backend", "impl"}  # the KV cache changes with every request


def _reachable_tensors(model):
    """Every tensor the model holds that Python can reach: parameters, buffers, and tensors kept in module
    attributes, their objects (e.g. a quantization method) and closures (a CPU GEMM over a repacked weight).
    Weights repacked into opaque kernel handles (vLLM 0.32 CPU's oneDNN linear) are out of reach: generation
    equality covers those."""
    import torch

    out, seen = {}, set()

    def visit(prefix, obj, depth):
        if depth > 3 or id(obj) in seen:
            return
        if isinstance(obj, torch.Tensor):
            seen.add(id(obj))
            if not obj.is_meta and obj.numel() > 0:
                out[prefix] = obj
            return
        if isinstance(obj, (torch.nn.Module, type, str, bytes, int, float, bool)) or obj is None:
            return
        seen.add(id(obj))
        if callable(obj) and getattr(obj, "__closure__", None):
            for i, c in enumerate(obj.__closure__):
                try:
                    visit(f"{prefix}.<cell{i}>", c.cell_contents, depth + 1)
                except ValueError:
                    pass
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(f"{prefix}[{i}]", v, depth + 1)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                visit(f"{prefix}[{k!r}]", v, depth + 1)
        elif hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                if k not in _NOT_WEIGHTS:
                    visit(f"{prefix}.{k}", v, depth + 1)

    for name, mod in model.named_modules():
        for k, v in mod._parameters.items():
            visit(f"{name}.{k}", v, 0)
        for k, v in mod._buffers.items():
            visit(f"{name}.{k}", v, 0)
        for k, v in mod.__dict__.items():
            if k in ("_parameters", "_buffers", "_modules") or k in _NOT_WEIGHTS or k.startswith(
                    ("_forward", "_backward", "_state_dict", "_load_state_dict")):
                continue
            visit(f"{name}.{k}", v, 1)
    return out


class FrameworkExtension(HeadProbeExtension):
    def framework_snapshot(self):
        """A copy of every reachable tensor of the model, kept in this worker (for torch.equal checks)."""
        ts = _reachable_tensors(self.model_runner.model)
        self._framework_snapshot = {k: v.detach().clone() for k, v in ts.items()}
        return {"tensors": len(ts), "bytes": sum(v.numel() * v.element_size() for v in ts.values())}

    def framework_equal_to_snapshot(self):
        """torch.equal of every reachable tensor with the snapshot's copy (same names, same bits)."""
        import torch

        snap = getattr(self, "_framework_snapshot", None)
        if snap is None:
            return {"equal": False, "why": "no snapshot"}
        now = _reachable_tensors(self.model_runner.model)
        differ = sorted(k for k in set(now) | set(snap)
                        if k not in now or k not in snap or now[k].shape != snap[k].shape
                        or now[k].dtype != snap[k].dtype or not torch.equal(now[k], snap[k]))
        return {"equal": not differ, "differ": differ[:8], "n_differ": len(differ), "tensors": len(now)}

    def framework_hello(self):
        return {"pid": os.getpid(), "has_rlpatch": hasattr(self, "rlpatch_ping")}

    def framework_load_weights(self, path):
        """What trainers do in a colocated loop: push (name, tensor) pairs into the worker's model."""
        tensors = _tensors(path)
        model = self.model_runner.model
        try:
            model.load_weights(list(tensors.items()))
            return {"ok": True}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def framework_repacked(self):
        """Did vLLM post-process (repack) the projections at load: a new parameter without a loader, or an
        emptied one? vLLM 0.25/0.32 do on a CPU with AVX-512; vLLM 0.20, and a CPU without AVX-512, keep the
        checkpoint layout (then stock per-parameter loads work and a tied head follows its embedding)."""
        return any(not hasattr(p, "weight_loader") or p.numel() == 0
                   for n, p in self.model_runner.model.named_parameters() if n.endswith("_proj.weight"))

    def framework_load_per_param(self, path):
        """One model.load_weights call per tensor, q/k/v and gate/up of a layer in separate calls (NeMo-RL,
        OpenRLHF and verl stream parameters this way)."""
        tensors = _tensors(path)
        model = self.model_runner.model
        repacked = self.framework_repacked()
        n = 0
        try:
            for name in sorted(tensors):
                model.load_weights([(name, tensors[name])])
                n += 1
            return {"ok": True, "calls": n, "repacked": repacked}
        except Exception as e:
            return {"ok": False, "calls": n, "repacked": repacked, "error": f"{type(e).__name__}: {e}"}

    def framework_load_one(self, path, name):
        """One tensor per RPC, as OpenRLHF's ``WorkerWrap.update_weight`` and SkyRL's per-parameter sync do: a
        fused layer's q, k and v arrive in three RPCs."""
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            tensor = f.get_tensor(name)
        self.model_runner.model.load_weights([(name, tensor)])
        return {"ok": True}

    def framework_open_vllm_reload(self):
        """Open vLLM's own layerwise reload the way its weight-transfer API does (``start_weight_update``) and
        leave it open: the layers' parameters are on the meta device until their weights arrive."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        from vllm_rlpatch.hooks import workerctx

        with workerctx.vllm_config_ctx(self):
            initialize_layerwise_reload(self.model_runner.model)
        return {"ok": True}

    def framework_abort_vllm_reload(self):
        """Put every layer of an open reload back (the previous weights)."""
        from vllm_rlpatch.hooks import layerwise

        layerwise.abort_open_reload(self)
        return {"ok": not layerwise.reload_active(self.model_runner.model)}

    def framework_reload_in_two_calls(self, path, poison_uninitialized=True):
        """reload_weights with the weights split in two calls, one fused qkv layer split between them: the
        first call carries q_proj of layer 0 and everything else, the second its k_proj and v_proj.

        With ``poison_uninitialized`` the calls run with torch's deterministic fill of uninitialised memory
        (``torch.empty`` returns NaN), so a layer processed before all its parts arrived holds NaN by
        construction instead of whatever the allocator happened to hand out (which can be the right bytes
        by luck: freed buffers are reused). Returns one entry per call and the non-finite count of layer 0's
        attention tensors afterwards."""
        import torch

        tensors = _tensors(path)
        second = {k for k in tensors if k.startswith("model.layers.0.self_attn.") and ("k_proj" in k or "v_proj" in k)}
        out = []
        was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        if poison_uninitialized:
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            for part in ([(k, v) for k, v in tensors.items() if k not in second],
                         [(k, v) for k, v in tensors.items() if k in second]):
                try:
                    self.reload_weights(weights_iterator=part)
                    out.append({"ok": True})
                except Exception as e:
                    out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        # what layer 0's fused qkv projection computes now (its weights may be repacked for the CPU kernels, out
        # of reach as tensors: ask the layer itself)
        qkv = self.model_runner.model.model.layers[0].self_attn.qkv_proj
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, qkv.input_size, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            y = qkv(x)
        y = y[0] if isinstance(y, tuple) else y
        return {"calls": out, "layer0_qkv_nonfinite_outputs": int((~torch.isfinite(y.float())).sum())}


class SupportCaptureExtension:
    """Captures the logits vLLM's sampler receives (the logits the engine itself computed), per request and
    output position, so a test can run the trainer twin on exactly what the engine sampled from."""

    def support_capture_start(self):
        runner = self.model_runner
        sampler = runner.sampler
        rec = self.__dict__.setdefault("_support_capture", [])
        if getattr(sampler, "_support_capture_on", False):
            return True
        if type(runner).__module__.startswith("vllm.v1.worker.gpu."):
            return self._support_capture_mrv2(sampler, rec)
        orig = sampler.forward

        def forward(logits, sampling_metadata, *a, **k):
            ids = list(runner.input_batch.req_ids)[: logits.shape[0]]
            pos = [len(runner.requests[r].output_token_ids) for r in ids]
            rec.append((ids, pos, logits.detach().float().cpu().clone()))
            return orig(logits, sampling_metadata, *a, **k)

        sampler.forward = forward
        sampler._support_capture_on = True
        return True

    def _support_capture_mrv2(self, sampler, rec):
        """Model Runner V2 (vllm/v1/worker/gpu/sample/sampler.py, 0.32.0): ``Sampler.__call__(logits,
        input_batch)``, one row per scheduled request (no speculative decoding), ``input_batch.req_ids`` in row
        order. A special method is looked up on the type, so this sampler object gets a subclass of its own. A
        request's output position is the count of its earlier rows that sampled. A row samples once the request's
        computed plus scheduled tokens reach its prompt length; a row of a chunked prefill that does not yet
        samples nothing (vLLM's get_num_sampled_and_rejected decides the same on the GPU)."""
        seen: dict = self.__dict__.setdefault("_support_capture_pos", {})
        base = type(sampler)

        def __call__(this, logits, input_batch, *a, **k):
            n = int(input_batch.num_reqs)
            ids = list(input_batch.req_ids)[:n]
            done = (input_batch.num_computed_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
                    >= input_batch.prefill_len_np[:n])
            keep = [i for i in range(n) if bool(done[i])]
            pos = []
            for i in keep:
                pos.append(seen.get(ids[i], 0))
                seen[ids[i]] = pos[-1] + 1
            if keep:
                rec.append(([ids[i] for i in keep], pos, logits[keep].detach().float().cpu().clone()))
            return base.__call__(this, logits, input_batch, *a, **k)

        sampler.__class__ = type(base.__name__, (base,), {"__call__": __call__})
        sampler._support_capture_on = True
        return True

    def support_capture_dump(self, path):
        """Write {(internal request id, position): logits row} to ``path`` (torch.save); return the row count."""
        import torch

        rows = {}
        for ids, pos, logits in self.__dict__.get("_support_capture", []):
            for i, (rid, p) in enumerate(zip(ids, pos)):
                rows[(rid, p)] = logits[i]
        torch.save(rows, path)
        return len(rows)

    def support_hooks(self):
        """Which sampler / runner attributes the sampling_support patch wrapped in this worker."""
        from vllm_rlpatch import _wrapping
        from vllm_rlpatch.patches import sampling_support as s

        return {t: _wrapping.is_wrapped(t, s.OWNER) for t in (s.T_SAMPLE_TOKENS, s.T_SAMPLE, s.T_TEMPERATURE)}
