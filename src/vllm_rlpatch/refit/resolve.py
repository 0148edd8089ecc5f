"""What a refit call was given -> the :class:`~vllm_rlpatch.refit.target.Target` that updates it: a
``vllm.LLM``, an ``AsyncLLM``, a Ray actor handle hosting one, or the base URL of ``vllm serve``."""

from __future__ import annotations

from typing import Any

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.http import HttpTarget
from vllm_rlpatch.refit.ray import RayTarget
from vllm_rlpatch.refit.target import AsyncTarget, LocalTarget, Target, is_async_llm, is_engine, is_ray_handle


def resolve(target: Any) -> Target:
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        if target.startswith(("http://", "https://")):
            return HttpTarget(target)
        raise P.RefitError(f"target {target!r}: a string target must be the base URL of `vllm serve` "
                           "(http://host:port)", kind="validation")
    if is_ray_handle(target):
        return RayTarget(target)
    if is_async_llm(target):
        return AsyncTarget(target)
    if is_engine(target):
        return LocalTarget(target)
    raise P.RefitError(f"unsupported target {type(target).__name__}: pass a vllm.LLM, an AsyncLLM, a Ray actor "
                       "handle hosting one, or the base URL of `vllm serve`", kind="validation")
