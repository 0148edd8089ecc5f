"""The tools layer: the ``vllm-rlpatch`` command line and its reports (doctor, parity, rollout, kv-pin, demo,
upstream, tables, plots). Nothing in the runtime (plugin, refit, patches, hooks, core) imports this package.
"""

from vllm_rlpatch import plugin

plugin.compose()  # the tools read the registry: the composition root hands it the patch list
