"""The lm_head projects in float32: rollout logits as a trainer computes them.

Why:   vLLM computes the logits in the model dtype (bf16): ``lm_head.quant_method.apply`` returns bf16, and
       the sampler's cast to fp32 comes after the rounding. A bf16 logit of magnitude ~10 carries an error of
       up to ~0.03, which goes straight into every sampled token's logprob: on the shipped llama-tiny at
       T=0.7/top-p 0.9 (vLLM 0.32 CPU) token_mult_prob_error against an fp32 trainer is 1.0082 with processed
       logprobs alone and 1.0017 with an fp32 head. vLLM 0.32 has ``hf_overrides={"head_dtype": "float32"}``
       (off by default); 0.20 and 0.25 accept ``head_dtype`` only for pooling models and have no fp32 head.
How:   vLLM >= 0.32: a config contributor adds ``head_dtype="float32"`` to ``hf_overrides`` unless the user
       set a head dtype (dict key, or a callable that sets one; a callable is composed, not replaced);
       vLLM's own ``LogitsProcessor._apply_head`` then projects in fp32 (``torch.mm(..., out_dtype=fp32)``
       on CUDA: no fp32 weight copy). A quantized head, where upstream raises, falls back to the model dtype
       with one WARNING when the fp32 head was the plugin's choice (the user's explicit choice is left to
       vLLM's error).
       vLLM < 0.32: ``LogitsProcessor._get_logits`` and ``get_top_tokens`` (drafters) mark the projection,
       and ``UnquantizedEmbeddingMethod.apply`` (the lm_head projection; embedding lookups use
       ``embedding()``) then returns fp32 logits: ``torch.mm(h, w.t(), out_dtype=float32)`` on CUDA, and
       ``F.linear(h.float(), w.float())`` elsewhere (torch has no CPU ``mm.dtype``), over vocab chunks of
       at most ``CHUNK_BYTES`` so no full fp32 copy of a large head is ever held. Quantized heads keep the
       model dtype with one WARNING; LoRA engines too (vLLM < 0.32's LoRA logits path projects on its own
       and adds bf16 deltas), with one WARNING at engine creation. A head dtype the user set in
       ``hf_overrides`` (which vLLM < 0.32 ignores for generation models) is honoured. Weights are not
       touched: refits and the checkpoint dtype are unchanged.
Targets: EngineArgs.create_engine_config (config hook); vllm.model_executor.layers.logits_processor:
       LogitsProcessor.__init__ / _get_logits / get_top_tokens / _apply_head; vllm.model_executor.layers.
       vocab_parallel_embedding:UnquantizedEmbeddingMethod.apply (lazy: wrapped when vLLM imports them).
Upstream: 0.32 added ``head_dtype`` for generation models (off by default: "required for RL training-inference
       consistency" in its docstring); nothing for 0.20/0.25. Peers: PipelineRL matched its reference only
       with an fp32 head (../shared/seeds); NeMo-RL warns that fp32 on one side only can make it worse.
Remove when: vLLM defaults generation models to an fp32 head (the 0.32+ path is then a no-op).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm_rlpatch import _wrapping, compat
from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "fp32_lm_head"
OWNER = NAME
# The marker the plugin leaves in hf_overrides (it becomes an attribute of the HF config) next to its own
# head_dtype choice, so the worker can tell the plugin's default from a user's explicit head dtype.
MARKER = "rlpatch_fp32_lm_head"
CHUNK_BYTES = 64 << 20

LP = "vllm.model_executor.layers.logits_processor"
EMB = "vllm.model_executor.layers.vocab_parallel_embedding"
T_GET_LOGITS = f"{LP}:LogitsProcessor._get_logits"
T_TOP_TOKENS = f"{LP}:LogitsProcessor.get_top_tokens"
T_APPLY_HEAD = f"{LP}:LogitsProcessor._apply_head"
T_LP_INIT = f"{LP}:LogitsProcessor.__init__"
T_EMB_APPLY = f"{EMB}:UnquantizedEmbeddingMethod.apply"

LORA_FALLBACK = ("LoRA engines on vLLM < 0.32 keep the lm_head in the model dtype (vLLM's LoRA logits path "
                 "projects on its own and adds bf16 deltas); vLLM >= 0.32 supports an fp32 head with LoRA")

# Runtime facts of this process (doctor, tests): which mechanism ran and which fallbacks happened.
RUNTIME: dict[str, Any] = {"mechanism": None, "fp32_projections": 0, "fallbacks": []}
_TLS = threading.local()
_warned: set[str] = set()


def _native() -> bool:
    """vLLM >= 0.32 has ``ModelConfig.head_dtype`` for generation models (LogitsProcessor._apply_head)."""
    return compat.native_head_dtype()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        RUNTIME["fallbacks"].append(msg)
        logger.warning("vllm-rlpatch: fp32_lm_head: %s", msg)


# ------------------------------------------------------------------------------------------ projection
_MM_OUT_DTYPE: bool | None = None


def project_fp32(x, weight, bias=None):
    """``F.linear(x.float(), weight.float(), bias)`` without materialising an fp32 copy of a large weight."""
    import torch
    import torch.nn.functional as F

    global _MM_OUT_DTYPE
    if x.is_cuda and _MM_OUT_DTYPE is not False:
        try:
            flat = x.reshape(-1, x.shape[-1])
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            if bias is not None:
                out = out + bias.float()
            return out.reshape(*x.shape[:-1], out.shape[-1])
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False  # an older torch: the chunked cast below
    x32 = x.float()
    rows = weight.shape[0]
    step = max(1, CHUNK_BYTES // max(1, weight.shape[1] * 4))
    if rows <= step:
        return F.linear(x32, weight.float(), None if bias is None else bias.float())
    out = x32.new_empty(*x.shape[:-1], rows)
    for s in range(0, rows, step):
        e = min(rows, s + step)
        out[..., s:e] = F.linear(x32, weight[s:e].float(), None if bias is None else bias[s:e].float())
    return out


# ------------------------------------------------------------------------------------------ vLLM < 0.32
def _mark(lm_head) -> bool:
    """Whether this projection goes fp32 (an unquantized floating-point head not already fp32)."""
    import torch

    qm = getattr(lm_head, "quant_method", None)
    w = getattr(lm_head, "weight", None)
    if type(qm).__name__ != "UnquantizedEmbeddingMethod" or not isinstance(w, torch.Tensor):
        _warn_once(f"quant:{type(qm).__name__}",
                   f"lm_head uses {type(qm).__name__} (a quantized head): logits stay in the model dtype")
        return False
    return w.is_floating_point() and w.dtype != torch.float32


def _run_marked(wrapped, lm_head, args, kwargs, instance=None):
    if not getattr(instance, "_rlpatch_fp32", True) or not _mark(lm_head):
        return wrapped(*args, **kwargs)
    prev = getattr(_TLS, "on", False)
    _TLS.on = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        _TLS.on = prev


def _get_logits_wrapper(wrapped, instance, args, kwargs):
    # _get_logits(self, hidden_states, lm_head, embedding_bias)
    lm_head = args[1] if len(args) > 1 else kwargs.get("lm_head")
    return _run_marked(wrapped, lm_head, args, kwargs, instance)


def _top_tokens_wrapper(wrapped, instance, args, kwargs):
    # get_top_tokens(self, lm_head, hidden_states, embedding_bias=None)
    lm_head = args[0] if args else kwargs.get("lm_head")
    return _run_marked(wrapped, lm_head, args, kwargs, instance)


def _emb_apply_wrapper(wrapped, instance, args, kwargs):
    # UnquantizedEmbeddingMethod.apply(self, layer, x, bias=None)
    if not getattr(_TLS, "on", False):
        return wrapped(*args, **kwargs)
    layer = args[0] if args else kwargs["layer"]
    x = args[1] if len(args) > 1 else kwargs["x"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    RUNTIME["mechanism"] = "logits_processor"
    RUNTIME["fp32_projections"] += 1
    return project_fp32(x, layer.weight, bias)


# ------------------------------------------------------------------------------------------ vLLM >= 0.32
def _lp_init_wrapper(wrapped, instance, args, kwargs):
    """Decide per LogitsProcessor, while vLLM builds the model under its config: vLLM >= 0.32 - was the fp32
    head the plugin's choice (a quantized head then falls back instead of raising); vLLM < 0.32 - project in
    fp32 unless the user set another head dtype in hf_overrides or the engine has LoRA."""
    out = wrapped(*args, **kwargs)
    try:
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
        mc = vc.model_config
    except Exception:  # no current config (a LogitsProcessor built outside an engine)
        vc = mc = None
    if _native():
        instance._rlpatch_head_by_plugin = bool(mc is not None and getattr(mc.hf_config, MARKER, False))
        if getattr(instance, "head_dtype", None) is not None:
            RUNTIME["mechanism"] = "head_dtype"
        return out
    user = getattr(mc.hf_config, "head_dtype", None) if mc is not None else None
    fp32 = user is None or str(user).lower() in ("float32", "fp32", "torch.float32")
    if vc is not None and getattr(vc, "lora_config", None) is not None:
        _warn_once("lora", LORA_FALLBACK)
        fp32 = False
    instance._rlpatch_fp32 = fp32
    return out


def _apply_head_wrapper(wrapped, instance, args, kwargs):
    # _apply_head(self, lm_head, hidden_states, embedding_bias)
    if getattr(instance, "_rlpatch_head_by_plugin", False):
        lm_head = args[0] if args else kwargs["lm_head"]
        hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
        qm = type(getattr(lm_head, "quant_method", None)).__name__
        if qm not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod") and instance.head_dtype != hidden.dtype:
            _warn_once(f"quant:{qm}", f"lm_head uses {qm} (a quantized head): logits stay in the model dtype "
                                      "(vLLM supports head_dtype only for unquantized heads)")
            bias = args[2] if len(args) > 2 else kwargs.get("embedding_bias")
            return lm_head.quant_method.apply(lm_head, hidden, bias=bias)
        RUNTIME["fp32_projections"] += 1
    return wrapped(*args, **kwargs)


# ------------------------------------------------------------------------------------------ config side
def _user_head_dtype(hf_overrides: Any) -> Any:
    if isinstance(hf_overrides, dict):
        return hf_overrides.get("head_dtype")
    return None


def contribute(engine_args: Any, ctx: config_hook.ConfigContext) -> None:
    import torch

    reason = "rollout logits in fp32, as the trainer computes them (bf16 logits round by up to ~0.03)"
    if getattr(engine_args, "enable_lora", False) and not _native():
        _warn_once("lora", LORA_FALLBACK)
        ctx.settings["head_dtype"] = config_hook.Setting("head_dtype", "model", "stock", NAME, "model",
                                                         LORA_FALLBACK, "enable_lora")
        return
    if str(getattr(engine_args, "dtype", "")) in ("float32", "torch.float32") or engine_args.dtype is torch.float32:
        ctx.settings["head_dtype"] = config_hook.Setting("head_dtype", "float32", "stock", NAME, "model",
                                                         "the model dtype is float32 already", "dtype")
        return
    hf = engine_args.hf_overrides
    user = _user_head_dtype(hf)
    if user is not None:
        ctx.settings["head_dtype"] = config_hook.Setting(
            "head_dtype", user, "user", NAME, "model", "passed explicitly; the plugin leaves it",
            "hf_overrides['head_dtype']")
        if str(user).lower() not in ("float32", "fp32", "torch.float32"):
            config_hook.warn_once(("user", "head_dtype", str(user)),
                                   "vllm-rlpatch: hf_overrides head_dtype=%r was set explicitly and is kept; "
                                   "rollout logits are then rounded to that dtype before sampling (logprob "
                                   "mismatch against an fp32 trainer)", user)
        return
    if not _native():
        # Applied in the workers (LogitsProcessor); nothing to change in the config.
        ctx.settings["head_dtype"] = config_hook.Setting(
            "head_dtype", "float32", "plugin", NAME, "model",
            reason + "; vLLM < 0.32: the plugin's LogitsProcessor projects in fp32", "vLLM version")
        return
    if callable(hf):
        user_fn = hf

        def composed(cfg, _user=user_fn):
            cfg = _user(cfg)
            if getattr(cfg, "head_dtype", None) is None:
                cfg.head_dtype = "float32"
                setattr(cfg, MARKER, True)
            return cfg

        engine_args.hf_overrides = composed
        detection = "hf_overrides is a callable: composed (fp32 unless it sets head_dtype)"
    else:
        new = dict(hf or {})
        new["head_dtype"] = "float32"
        new[MARKER] = True
        engine_args.hf_overrides = new
        detection = "hf_overrides has no head_dtype"
    ctx.settings["head_dtype"] = config_hook.Setting("head_dtype", "float32", "plugin", NAME, "model",
                                                     reason + " (vLLM's head_dtype)", detection)


# ------------------------------------------------------------------------------------------ apply/revert
_INIT = _wrapping.LazyWrap(T_LP_INIT, _lp_init_wrapper, OWNER)  # both paths decide in LogitsProcessor.__init__
_LAZY_OLD = (_INIT,
             _wrapping.LazyWrap(T_GET_LOGITS, _get_logits_wrapper, OWNER),
             _wrapping.LazyWrap(T_TOP_TOKENS, _top_tokens_wrapper, OWNER),
             _wrapping.LazyWrap(T_EMB_APPLY, _emb_apply_wrapper, OWNER))
_LAZY_NEW = (_INIT, _wrapping.LazyWrap(T_APPLY_HEAD, _apply_head_wrapper, OWNER))


def apply() -> None:
    config_hook.add_contributor(config_hook.Contributor(NAME, 25, contribute))
    for lw in (_LAZY_NEW if _native() else _LAZY_OLD):
        lw.apply()


def revert() -> None:
    config_hook.remove_contributor(NAME)
    for lw in (_INIT,) + _LAZY_OLD[1:] + _LAZY_NEW[1:]:
        lw.revert()


SPEC = PatchSpec(
    name=NAME,
    summary="The lm_head projects in fp32 (vLLM 0.32+: head_dtype; 0.20/0.25: the LogitsProcessor, no fp32 weight copy)",
    vllm=">=0.20",
    targets=(config_hook.TARGET,),
    lazy_targets=(T_LP_INIT, T_GET_LOGITS, T_TOP_TOKENS, T_EMB_APPLY),
    apply=apply,
    revert=revert,
    upstream="0.32 added hf_overrides head_dtype (off by default); nothing in 0.20/0.25",
    remove_when="vLLM defaults generation models to an fp32 head",
)
