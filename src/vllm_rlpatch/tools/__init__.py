"""The tools layer: the ``vllm-rlpatch`` command line and its reports (doctor, parity, rollout, kv-pin, demo,
upstream, tables, plots). Nothing in the runtime (plugin, refit, patches, hooks, core) imports this package.
"""

import vllm_rlpatch.plugin  # noqa: E402,F401 - the composition root hands the patch list to the registry
