"""Install the rlpatch worker extension, composed with the user's own ``worker_extension_cls``.

Why:   the plugin (and the refit API) need worker-side entry points reachable through
       ``collective_rpc``; RL frameworks pass their own ``worker_extension_cls`` and there is one slot.
How:   a config contributor sets ``worker_extension_cls`` to
       ``vllm_rlpatch.refit.worker_ext.RLPatchWorkerExtension`` when the user gave none, and to a composed class
       (theirs first, then ours; see :mod:`vllm_rlpatch.refit.worker_ext`) when they did. All methods are
       prefixed ``rlpatch_`` so vLLM's name-clash assertion never fires.
Targets: vllm.engine.arg_utils.EngineArgs.create_engine_config (through the shared config hook).
Upstream: not a bug; an extension point.
Remove when: never (this is the plugin's own RPC surface).
"""

from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.registry import PatchSpec

NAME = "worker_extension"
# The extension lives in the refit layer, above the patches: named here by string, resolved by vLLM in the worker.
MODULE = "vllm_rlpatch.refit.worker_ext"
COMPOSE_PREFIX = "with:"
QUALNAME = MODULE + ".RLPatchWorkerExtension"


def compose_qualname(user_qualname: str) -> str:
    """The worker extension that is theirs first, then ours (resolved by :mod:`vllm_rlpatch.refit.worker_ext`)."""
    if user_qualname == QUALNAME or user_qualname.startswith(MODULE + "." + COMPOSE_PREFIX):
        return user_qualname
    return MODULE + "." + COMPOSE_PREFIX + user_qualname.replace(".", ":")


def contribute(engine_args, ctx: config_hook.ConfigContext) -> None:
    current = engine_args.worker_extension_cls or ""
    is_user, how = ctx.explicit("worker_extension_cls")
    if is_user and current and current != QUALNAME:
        value = compose_qualname(current)
        engine_args.worker_extension_cls = value
        ctx.settings["worker_extension_cls"] = config_hook.Setting(
            "worker_extension_cls", value, "plugin", NAME, "",
            f"composed with the user's {current} (theirs first, rlpatch_* methods added)", how)
    else:
        ctx.propose("worker_extension_cls", QUALNAME, owner=NAME,
                    reason="rlpatch_* worker RPCs (collective_rpc('rlpatch_ping'), weight version)")


def apply() -> None:
    config_hook.add_contributor(config_hook.Contributor(NAME, 10, contribute))


def revert() -> None:
    config_hook.remove_contributor(NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="Install the rlpatch_* worker extension (composes with a user's worker_extension_cls)",
    vllm=">=0.20",
    targets=(config_hook.TARGET,),
    apply=apply,
    revert=revert,
    upstream="extension point, no upstream bug",
    remove_when="never (the plugin's own RPC surface)",
)
