"""A framework-style worker extension, used to test composition with the plugin's own extension."""

import os


class FrameworkExtension:
    def framework_hello(self):
        return {"pid": os.getpid(), "has_rlpatch": hasattr(self, "rlpatch_ping")}

    def framework_load_weights(self, path):
        """What trainers do in a colocated loop: push (name, tensor) pairs into the worker's model."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        model = self.model_runner.model
        try:
            model.load_weights(list(tensors.items()))
            return {"ok": True}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
