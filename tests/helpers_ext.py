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


class FrameworkExtension(HeadProbeExtension):
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

    def framework_load_per_param(self, path):
        """One model.load_weights call per tensor, q/k/v and gate/up of a layer in separate calls (NeMo-RL,
        OpenRLHF and verl stream parameters this way)."""
        tensors = _tensors(path)
        model = self.model_runner.model
        n = 0
        try:
            for name in sorted(tensors):
                model.load_weights([(name, tensors[name])])
                n += 1
            return {"ok": True, "calls": n}
        except Exception as e:
            return {"ok": False, "calls": n, "error": f"{type(e).__name__}: {e}"}

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
