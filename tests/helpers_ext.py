"""A framework-style worker extension, used to test composition with the plugin's own extension."""

import os


class FrameworkExtension:
    def framework_hello(self):
        return {"pid": os.getpid(), "has_rlpatch": hasattr(self, "rlpatch_ping")}
