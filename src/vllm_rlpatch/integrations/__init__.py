"""Adapters that move an RL framework's own weight sync onto :func:`vllm_rlpatch.refit.push_weights`.

One module per framework (``vllm_rlpatch.integrations.trl``, ``.verl``, ``.openrlhf``, ...), each one line for
the user: a worker extension class the framework accepts, or the function its rollout calls for a sync. Every
adapter checks the installed framework's version against the releases it was written for
(:func:`vllm_rlpatch.integrations.support.require_framework`) and refuses anything else with the versions it
knows; nothing falls back silently.

Layer: above ``refit`` (adapters call it), below ``tools``.
"""
