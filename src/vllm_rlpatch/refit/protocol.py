"""What the trainer side and the engine side of a refit agree on: tensor metadata, fingerprints, buckets,
the expected schema of an update, and the errors.

Everything that crosses a process or host boundary here is plain JSON-able data (names, dtype strings,
shapes, byte offsets, hex fingerprints): no pickle over the network. Tensor bytes travel separately
(shared memory, a ``torch.distributed`` broadcast or CUDA IPC; see :mod:`.shm`, :mod:`.dist`, :mod:`.cuda_ipc`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Iterable

import torch

from vllm_rlpatch.refit import checks

ALIGN = 64  # byte alignment of every tensor inside a bucket / shared-memory segment
DEFAULT_BUCKET_BYTES = 512 << 20

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
              torch.int32, torch.int64, torch.bool, getattr(torch, "float8_e4m3fn", None),
              getattr(torch, "float8_e5m2", None))
    if d is not None
}


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(sorted(_DTYPES))})") from None


GUARANTEES = ("auto", "rollback", "validate-then-write")


# A failure's kind when the engine does not hold the update template a request names (it restarted, or the
# template was released): the sender answers with the full request.
UNKNOWN_TEMPLATE = "template"

class RefitError(RuntimeError):
    """A weight update that did not land.

    ``kind``: ``validation`` (bad input, found before anything was written), ``refused`` (asleep, requests
    running under ``inflight="refuse"``, no room for the backup a guarantee needs, plugin missing),
    ``transport`` (bytes did not arrive: a sender that died, a checksum mismatch), ``commit`` (vLLM rejected
    the weights while loading them, or a post-write check failed), ``fault`` (an injected test fault).
    ``state``: what the engine holds now: ``unchanged`` (nothing was written), ``restored`` (written, then
    rolled back from the ``rollback`` backup, compared with it), ``mixed`` (written part-way with no backup:
    ``validate-then-write`` or ``direct``; the engine refuses to generate until a good update lands),
    ``writing`` (a part of a refit session failed after earlier parts were written: abort the session).
    """

    def __init__(self, message: str, *, kind: str = "validation", state: str = "unchanged",
                 problems: list[dict] | None = None, report: Any = None):
        super().__init__(message)
        self.kind = kind
        self.state = state
        self.problems = problems or []
        self.report = report


class TransportError(RefitError):
    """The bytes did not arrive (kind ``transport``): a transport's source could not open or receive them (a
    missing or truncated segment, a broadcast group that did not form, a bucket lost, a handle that does not
    open)."""

    def __init__(self, message: str, **kw):
        super().__init__(message, kind="transport", **kw)


@dataclasses.dataclass
class TensorMeta:
    """One tensor of an update. ``segment``/``offset``: where its bytes are in the transport's buffers."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    segment: int = 0
    offset: int = 0
    fingerprint: str | None = None  # the bytes' checksum (:class:`vllm_rlpatch.refit.checks.Digest` key)
    nonfinite: int | None = None  # NaN/inf values the sender counted in the same pass (None: not counted)

    def as_dict(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies, ~10 us a tensor (3 ms for an 8B model's 291)
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape, "nbytes": self.nbytes,
                "segment": self.segment, "offset": self.offset, "fingerprint": self.fingerprint,
                "nonfinite": self.nonfinite}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorMeta":
        return cls(d["name"], d["dtype"], d["shape"], d["nbytes"], d.get("segment", 0), d.get("offset", 0),
                   d.get("fingerprint"), d.get("nonfinite"))


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def assign_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[int]:
    """Give every tensor a segment and an offset; returns each segment's size. A tensor larger than the
    bucket travels alone in a segment of its own size (streamed alone, never an error)."""
    sizes: list[int] = []
    cur = -1
    for m in metas:
        need = aligned(m.nbytes)
        if need > bucket_bytes:
            sizes.append(need)
            m.segment, m.offset = len(sizes) - 1, 0
            cur = -1  # the next tensor starts a fresh bucket
            continue
        if cur < 0 or sizes[cur] + need > bucket_bytes:
            sizes.append(0)
            cur = len(sizes) - 1
        m.segment, m.offset = cur, sizes[cur]
        sizes[cur] += need
    return sizes


# ------------------------------------------------------------------------------------------ fingerprints
def fingerprints(tensors: Iterable[torch.Tensor]) -> list[str]:
    """Checksums of many tensors (:mod:`vllm_rlpatch.refit.checks`: one fused pass, one launch per dtype class
    on a GPU)."""
    return checks.keys(tensors)


def fingerprint(t: torch.Tensor) -> str:
    return fingerprints([t])[0]


def combine(fps: Iterable[str]) -> str:
    """One digest for a set of named fingerprints (order-independent input expected sorted by name)."""
    import hashlib

    h = hashlib.sha256()
    for f in fps:
        h.update(f.encode())
        h.update(b"\n")
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------------------ the request
@dataclasses.dataclass
class RefitRequest:
    """One part of an update, as a worker receives it (``rlpatch_refit_prepare``, or ``rlpatch_refit_commit``
    with ``request``). On the wire (vLLM's collective_rpc, HTTP) it is a plain dict: :meth:`from_wire` reads
    one, :meth:`to_wire` writes one. The defaults are what a worker assumes for a key the dict lacks."""

    txid: str
    mode: str | None = "atomic"  # atomic | direct (``direct``: the guarantee ``none``)
    guarantee: str | None = "auto"  # one of GUARANTEES
    partial: bool = False  # a subset of whole layers
    allow_cast: bool = False
    version: int | None = None  # the version to reach (None: the engine's next)
    inflight: str | None = None  # what happens to running requests (the engine core reads it)
    verify: bool = True  # digest the bytes (and the destination windows after the write)
    backup: str | None = "auto"  # where a ``rollback`` backup lives: auto | device | host
    workers: int | None = None  # the engine's worker count (1: prepare and commit in one RPC)
    session: bool = False  # a part of a refit_session (several parts, one commit)
    tensors: list[dict[str, Any]] | None = None  # TensorMeta dicts (None with an update template)
    transport: dict[str, Any] | None = None  # the transport's spec (``kind`` and what its Source needs)
    template: str | None = None  # register this update as a template under this key
    fingerprints: list[str | None] | None = None  # an update template's digests, one per tensor
    nonfinite: list[int | None] | None = None  # an update template's NaN/inf counts, one per tensor
    deadline: float | None = None  # wall-clock time after which the worker refuses to commit (a fleet's fence)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "RefitRequest":
        deadline = d.get("deadline")
        return cls(d["txid"], d.get("mode", "atomic"), d.get("guarantee", "auto"), bool(d.get("partial", False)),
                   bool(d.get("allow_cast", False)), d.get("version"), d.get("inflight"), bool(d.get("verify", True)),
                   d.get("backup", "auto"), d.get("workers"), bool(d.get("session")), d.get("tensors"),
                   d.get("transport"), d.get("template"), d.get("fingerprints"), d.get("nonfinite"),
                   float(deadline) if deadline is not None else None)

    def to_wire(self) -> dict[str, Any]:
        # by hand, like TensorMeta.as_dict: dataclasses.asdict deep-copies the tensor records
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# ------------------------------------------------------------------------------------------ schema
@dataclasses.dataclass
class Schema:
    """The tensors a complete update must contain, in the trainer's (Hugging Face) naming.

    ``tensors``: name -> (shape, dtype). ``aliases``: tied names (e.g. ``lm_head.weight`` ->
    ``model.embed_tokens.weight``) that a trainer's state dict may carry but that are not loaded separately.
    ``source``: where the schema came from (``transformers`` meta model of the engine's config, or the
    checkpoint's safetensors headers).
    """

    tensors: dict[str, tuple[list[int], str]]
    aliases: dict[str, str]
    source: str
    engine_dtype: str
    optional: list[str] = dataclasses.field(default_factory=list)  # in the checkpoint, never needed in an update
    workers: int | None = None  # the engine's worker count, set where the workers' descriptions were read

    def as_dict(self) -> dict[str, Any]:
        return {"tensors": {k: [list(s), d] for k, (s, d) in self.tensors.items()}, "aliases": dict(self.aliases),
                "source": self.source, "engine_dtype": self.engine_dtype, "optional": list(self.optional)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Schema":
        return cls({k: (list(v[0]), v[1]) for k, v in d["tensors"].items()}, dict(d["aliases"]), d["source"],
                   d["engine_dtype"], list(d.get("optional", [])))

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * torch.empty((), dtype=dtype_of(d)).element_size() for s, d in self.tensors.values())


def _floating(dtype: str) -> bool:
    try:
        return dtype_of(dtype).is_floating_point
    except ValueError:
        return False


def schema_from_hf_config(hf_config: Any, engine_dtype: torch.dtype, trust_remote_code: bool = False) -> Schema:
    """Build the Hugging Face model of ``hf_config`` on the meta device (no memory, no weights) and read its
    state dict: exactly the names and shapes a trainer holding that model pushes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code,
                                                     dtype=engine_dtype)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code,
                                                     torch_dtype=engine_dtype)
    sd = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    tensors: dict[str, tuple[list[int], str]] = {}
    aliases: dict[str, str] = {}
    for name, t in sd.items():
        key = id(t)
        if key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        d = dtype_name(engine_dtype) if t.is_floating_point() else dtype_name(t.dtype)
        tensors[name] = (list(t.shape), d)
    # a tied head the model class re-creates as its own tensor still counts as an alias
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in tensors:
        emb = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
        if emb is not None and tensors[emb][0] == tensors["lm_head.weight"][0]:
            aliases["lm_head.weight"] = emb
            del tensors["lm_head.weight"]
    return Schema(tensors, aliases, "transformers", dtype_name(engine_dtype))


def schema_from_checkpoint(model_dir: str, hf_config: Any, engine_dtype: torch.dtype) -> Schema:
    """Fallback: the names and shapes in the checkpoint's safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, tuple[list[int], str]] = {}
    for f in files:
        with safe_open(os.path.join(model_dir, f), "pt") as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                dt = sl.get_dtype()
                dt = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}.get(dt, dt.lower())
                tensors[name] = (list(sl.get_shape()), dtype_name(engine_dtype) if _floating(dt) else dt)
    aliases: dict[str, str] = {}
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        emb = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
        if emb is not None:
            aliases["lm_head.weight"] = emb
    # non-persistent buffers some checkpoints carry; a trainer's state_dict() does not, vLLM skips them
    optional = [n for n in tensors if n.rsplit(".", 1)[-1] in ("inv_freq", "cos_cached", "sin_cached")]
    return Schema(tensors, aliases, "checkpoint", dtype_name(engine_dtype), optional)


# ------------------------------------------------------------------------------------------ validation
def problem(kind: str, name: str | None, message: str) -> dict[str, Any]:
    return {"kind": kind, "name": name, "message": message}


def validate_metadata(metas: list[TensorMeta], schema: Schema, *, partial: bool = False,
                      allow_cast: bool = False) -> list[dict[str, Any]]:
    """Every problem with an update's metadata (before any byte is looked at or written)."""
    out: list[dict[str, Any]] = []
    if not metas:
        return [problem("empty", None, "the update contains no tensors")]
    seen: dict[str, int] = {}
    for m in metas:
        seen[m.name] = seen.get(m.name, 0) + 1
    for name, n in seen.items():
        if n > 1:
            out.append(problem("duplicate", name, f"{name} appears {n} times in the update"))
    known = list(schema.tensors) + list(schema.aliases)
    for m in metas:
        if m.name in schema.aliases:
            target = schema.aliases[m.name]
            exp = schema.tensors.get(target)
            if exp is not None and list(m.shape) != list(exp[0]):
                out.append(problem("shape", m.name, f"{m.name} (tied to {target}): shape {list(m.shape)} != "
                                                    f"{list(exp[0])}"))
            continue
        exp = schema.tensors.get(m.name)
        if exp is None:
            close = difflib.get_close_matches(m.name, known, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(problem("unknown", m.name, f"{m.name} is not a tensor of the engine's model{hint}"))
            continue
        shape, dtype = exp
        if list(m.shape) != list(shape):
            out.append(problem("shape", m.name, f"{m.name}: shape {list(m.shape)} != expected {list(shape)}"))
        if m.dtype != dtype:
            both_float = _floating(m.dtype) and _floating(dtype)
            if not (allow_cast and both_float):
                hint = (f"; cast it on the trainer side (tensor.to(torch.{dtype})) or pass allow_cast=True"
                        if both_float else "")
                out.append(problem("dtype", m.name, f"{m.name}: dtype {m.dtype} != engine dtype {dtype}{hint}"))
    if not partial:
        given = set(seen)
        optional = set(schema.optional)
        missing = [n for n in schema.tensors if n not in given and n not in optional]
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            out.append(problem("missing", None, f"{len(missing)} tensor(s) of the model are not in the update: "
                                                f"{shown} (pass partial=True to update a subset of whole layers)"))
    return out


def summarize(problems: list[dict[str, Any]], limit: int = 6) -> str:
    if not problems:
        return "no problems"
    lines = [p["message"] for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more")
    return "; ".join(lines)
