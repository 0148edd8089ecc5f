"""tests/shape.py's finders on small pieces of code (what they must find, and what they must leave alone), and
its checks of the allow lists. The package's own measures are checked in test_layers.py and by .ci/run."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shape  # noqa: E402

pytestmark = pytest.mark.quick


def files(code: str, path: str = "refit/x.py") -> dict:
    code = textwrap.dedent(code)
    return {path: (code, ast.parse(code))}


def lines(sites) -> list[int]:
    return [s.line for s in sites]


def test_transport_names_compared_as_strings():
    code = """\
        if tr == "shm": pass
        if "dist" != tr: pass
        if tr in ("cuda_ipc", "cuda_ipc_layout"): pass
        if tr not in {"x", "template"}: pass
        x = tr.startswith("cuda_ipc")
        match tr:
            case "dist": pass
        if tr == "auto": pass
        d = {"shm": 1}
        y = "dist"
        if tr in ["grpc"]: pass
    """
    assert lines(shape.transport_comparisons(files(code))) == [1, 2, 3, 4, 5, 7]


def test_control_flow_on_message_text():
    code = """\
        try:
            f()
        except ValueError as e:
            if "transport" in str(e): pass
            if str(e).startswith("x"): pass
            if e.args[0] == "y": pass
            msg = str(e).lower()
            if "dead" in msg: pass
            re.search("z", repr(e))
            log(str(e))
            raise Other(str(e)) from e
        def kind(error: BaseException, other: int):
            return "t" if "t" in str(error) else "u" if other == 1 else "v"
        def answer(r: dict):
            return "nothing to abort" in str(r.get("workers") or "")
        def fine(x, e):
            return str(e) == "a" or x.startswith("b")
    """
    sites = shape.message_text_classifications(files(code))
    assert lines(sites) == [4, 5, 6, 8, 9, 13, 15]
    assert {s.scope for s in sites} == {"refit/x.py::<module>", "refit/x.py::kind", "refit/x.py::answer"}


def test_sizes_count_from_the_def_line_to_the_last_line():
    code = "def f():\n" + "    x = 1\n" * 9 + "class C:\n    def g(self):\n        pass\n"
    got = {s.name: s.lines for s in shape.sizes(files(code, "m.py"))}
    assert got == {"m.py": 13, "m.py::f": 10, "m.py::C": 3, "m.py::C.g": 2}


def measures(sizes=(), transport=(), message=()) -> shape.Measures:
    return shape.Measures(list(sizes), list(transport), list(message))


def test_an_unlisted_offender_and_a_stale_entry_fail(monkeypatch):
    monkeypatch.setattr(shape, "ALLOWED_OVER", {"a.py::listed": "why", "a.py::shrunk": "why"})
    monkeypatch.setattr(shape, "TRANSPORT_COMPARISONS_KNOWN", {"a.py": 1, "b.py": 2})
    monkeypatch.setattr(shape, "MESSAGE_TEXT_ALLOWED", {"a.py::f": "why", "a.py::gone": "why"})
    m = measures(
        sizes=[shape.Size("function", "a.py::listed", 1, 81), shape.Size("function", "a.py::new", 9, 90),
               shape.Size("function", "a.py::shrunk", 20, 80), shape.Size("module", "a.py", 1, 100)],
        transport=[shape.Site("a.py", 1, "t == 'shm'"), shape.Site("b.py", 1, "t == 'dist'"),
                   shape.Site("c.py", 1, "t == 'dist'")],
        message=[shape.Site("a.py", 5, '"x" in str(e)', "a.py::f"), shape.Site("a.py", 7, '"y" in str(e)', "a.py::g")])
    problems = m.problems()
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    for needle in ("function a.py::new (line 9): 90 lines", "stale ALLOWED_OVER entry a.py::shrunk",
                   "b.py: 1 transport-name comparison(s), TRANSPORT_COMPARISONS_KNOWN says 2",
                   "c.py: 1 transport-name comparison(s), 0 known", "a.py:7: \"y\" in str(e) (in a.py::g)",
                   "stale MESSAGE_TEXT_ALLOWED entry a.py::gone"):
        assert needle in text, (needle, problems)


def test_a_registry_module_may_compare_transport_names(monkeypatch):
    monkeypatch.setattr(shape, "TRANSPORT_REGISTRY_MODULES", frozenset({"refit/senders.py"}))
    monkeypatch.setattr(shape, "TRANSPORT_COMPARISONS_KNOWN", {})
    monkeypatch.setattr(shape, "ALLOWED_OVER", {})
    monkeypatch.setattr(shape, "MESSAGE_TEXT_ALLOWED", {})
    assert measures(transport=[shape.Site("refit/senders.py", 3, "t == 'shm'")]).problems() == []
