"""Helpers the tests share, imported as ``support.<module>`` (tests/ is on ``sys.path``: pytest puts the
folder of the root conftest there, and :func:`support.env.clean_env` puts it on the ``PYTHONPATH`` of every
subprocess a test starts, so scripts and vLLM's worker processes import the same helpers).

- :mod:`support.env`: the environment a test runs in (vLLM version, host CPU, model paths, a clean ``os.environ``).
- :mod:`support.logs`: reading what an engine wrote (the plugin's summary lines, ``RESULT`` lines, process tails).
- :mod:`support.runs`: running tests/scripts and engines in fresh interpreters.
- :mod:`support.reference`: the trainer-side reference logprobs (transformers, fp32).
- :mod:`support.fleet`: the fleet tests' shared script run and readers.
- :mod:`support.kvpin_sim`: a simulated GPU allocator for the kv-pin sizing.
- :mod:`support.portrace`: port-race trials on real vLLM code.

The pytest fixtures and hooks stay in tests/conftest.py; nothing imports from conftest.
"""
