"""Apply every patch that applies on this vLLM, either BEFORE vLLM imports the patch targets' modules or
AFTER, then report which targets end up wrapped (JSON on stdout). The contract test compares both orders.

    python tests/scripts/apply_order.py before|after
"""

import importlib
import json
import sys

from vllm_rlpatch import _wrapping, plugin, registry

plugin.compose()  # the composition root hands the patch list to the registry


def modules_of(specs):
    mods = []
    for s in specs:
        for t in (*s.targets, *s.lazy_targets):
            m = t.partition(":")[0]
            if m not in mods:
                mods.append(m)
    return mods


def import_all(mods):
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception:  # a module this vLLM lacks, or one that needs ray: absent in both orders
            pass


def main(order: str) -> None:
    specs = [s for s in registry.patches() if registry.decide(s)[0] is None]
    lazy = [t for s in specs for t in s.lazy_targets]
    mods = modules_of(specs)
    if order == "after":
        import_all(mods)
    not_yet = sorted({t.partition(":")[0] for t in lazy} - set(sys.modules))
    for s in specs:
        st = registry.apply_one(s)
        assert st.state == "applied", (s.name, st.state, st.reason)
    import_all(mods)
    wrapped = {t: _wrapping.is_wrapped(t) for s in specs for t in (*s.targets, *s.lazy_targets)}
    print(json.dumps({"applied": [s.name for s in specs], "late_modules": not_yet, "wrapped": wrapped}))


if __name__ == "__main__":
    main(sys.argv[1])
