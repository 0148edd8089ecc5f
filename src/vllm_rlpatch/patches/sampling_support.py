"""Per-token support information from the sampler, opt-in per request: the log of the kept set's mass and its size.

Why:   With processed logprobs vLLM returns log p(token) under the distribution it sampled from: the logits after
       penalties and temperature, truncated by min-p / top-k / top-p and renormalized over the *kept set*. A
       trainer that recomputes a token's logprob needs that kept set. Full-vocabulary logprobs at the rollout
       temperature differ by log(mass of the kept set) on every token (trl#6789, vllm#42259); truncating the
       trainer's own fp32 logits gives a slightly different kept set than the engine's bf16/fp32 ones, so a
       sampled token can fall outside it (-inf, an infinite importance ratio). vLLM's own answer
       (``--return-sampling-mask``, 0.32+) exists for Model Runner V2 only and is a per-token mask of the
       vocabulary (a 152k-token vocabulary makes it large).
How:   ``SamplingParams(extra_args={"rlpatch_support": True})`` asks for it per request. In the worker, the V1
       runner's ``sample_tokens`` notes which rows of the batch asked (``input_batch.req_ids`` and each
       request's ``extra_args``); only then do the sampler hooks compute anything. A batch whose processing
       cannot mask a token (no top-k/top-p, no active min-p, no allowed-ids/bad-words mask) costs nothing:
       log mass 0, size V. Otherwise ``Sampler.apply_temperature`` (the logits after penalties and
       temperature, before min-p/top-k/top-p) gives the full-vocabulary log-normalizer (max, then one exp
       pass into a reused buffer on a CPU), and after ``Sampler.sample`` the same tensor holds the truncated logits (vLLM's
       min-p, top-k and top-p mask it in place; checked on every step: the sampled token must be finite there):
       the kept-set size is its count of values that are not -inf and its log-normalizer is
       ``x[token] - processed_logprob[token]`` (no second exp pass unless no processed logprob was computed). Per opted-in
       request: ``log_mass_kept = lse_kept - lse_T`` (<= 0) and ``kept_count``, attached to the
       ``ModelRunnerOutput`` (picklable, so it crosses to the engine core on every executor), put into the
       request's ``EngineCoreOutput`` by an engine-core output channel
       (:func:`vllm_rlpatch.hooks.engine_core.add_channel`) and set on the ``CompletionOutput`` as
       ``rlpatch_support``: a :class:`SamplingSupport` with one entry per output token and the engine's
       ``{"vllm", "runner", "device"}`` (the rules :func:`vllm_rlpatch.trainer.processed_logprobs` follows).
       A plain ``vllm.LLM.generate`` caller reads it from its outputs; no RPC. ``vllm serve`` clients ask with
       ``"vllm_xargs": {"rlpatch_support": true}`` (vLLM copies it into ``extra_args``) and read it from each
       choice, full or streamed (the ``refit_http`` patch). Then
       ``lp_processed(token) = lp_T(token) - log_mass_kept`` for any trainer's lp_T (the trainer twin does it).
       Greedy rows: in an all-greedy batch vLLM skips temperature and truncation (processed logprobs are the
       full softmax), reported as log_mass_kept 0; in a mixed batch greedy rows are processed at T=1, as vLLM
       does. Model Runner V2 (the GPU default from vLLM 0.29, the only GPU runner in 0.34): its ``Sampler``
       notes the slots that asked (``add_request``); in a step with such a row, the tensor
       ``SamplingStates.apply_min_p`` receives (after penalties and temperature) gives lse_T, and the
       ``processed_logits`` ``Sampler.sample`` returns (after min-p, top-k, top-p) give the kept count and lse
       of what MRv2 really kept; the two values ride on the ``SamplerOutput`` to ``AsyncOutput.get_output``
       (pinned, non-blocking copy). A step in which no row asked costs one set lookup per row; a sampler with
       no such request, one dict lookup. Not supported (``rlpatch_support`` stays absent, one WARNING when a
       request asks): speculative decoding. With the toggle off no sampler or runner hook is installed; on, a
       V1 batch in which no request asked costs one dict lookup per request.
Targets: vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens and AsyncGPUModelRunnerOutput.get_output,
       vllm.v1.sample.sampler:Sampler.sample and Sampler.apply_temperature; MRv2: vllm.v1.worker.gpu.sample.sampler:
       Sampler.add_request / __call__ / sample, ...gpu.sample.states:SamplingStates.apply_min_p,
       ...gpu.async_utils:AsyncOutput.get_output (worker, wrapped when vLLM imports them); the engine-core hook (Scheduler.update_from_output, OutputProcessor.process_outputs,
       RequestState._new_completion_output).
Upstream: vLLM 0.32 ``return_sampling_mask`` (MRv2 + processed logprobs only; a vocabulary-sized mask per
       token); no per-token kept mass upstream.
Remove when: vLLM returns the kept-set mass (or an equivalent) per token on every runner.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, NamedTuple

from vllm_rlpatch import _wrapping
from vllm_rlpatch.hooks import engine_core
from vllm_rlpatch.registry import PatchSpec
from vllm_rlpatch.versions import vllm_info

logger = logging.getLogger("vllm.rlpatch")

NAME = "sampling_support"
OWNER = NAME
REQUEST_KEY = "rlpatch_support"  # SamplingParams.extra_args key that asks for it

RUNNER = "vllm.v1.worker.gpu_model_runner"
SAMPLER = "vllm.v1.sample.sampler"
T_SAMPLE_TOKENS = f"{RUNNER}:GPUModelRunner.sample_tokens"
T_ASYNC_OUTPUT = f"{RUNNER}:AsyncGPUModelRunnerOutput.get_output"
T_SAMPLE = f"{SAMPLER}:Sampler.sample"
T_TEMPERATURE = f"{SAMPLER}:Sampler.apply_temperature"
MRV2_SAMPLER = "vllm.v1.worker.gpu.sample.sampler"
T_MRV2_ADD = f"{MRV2_SAMPLER}:Sampler.add_request"


class SamplingSupport(NamedTuple):
    """``CompletionOutput.rlpatch_support``: per output token, the log of the mass the engine's kept set
    (after min-p / top-k / top-p) had under the temperature-scaled distribution (after penalties), and the
    kept set's size; ``engine``: the rules the sampler followed (``{"vllm", "runner", "device"}``).
    ``lp_processed = lp_T - log_mass_kept``. NaN / -1: no information for that token."""

    log_mass_kept: list
    kept_count: list
    engine: dict


# This process's counters (a worker's: steps with support computed, rows, seconds spent in the hooks' own work).
RUNTIME: dict[str, Any] = {"steps": 0, "rows": 0, "seconds": 0.0}
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("vllm-rlpatch: sampling_support: " + msg, *args)


def wants(sampling_params: Any) -> bool:
    ea = getattr(sampling_params, "extra_args", None)
    return bool(ea) and bool(ea.get(REQUEST_KEY))


# ------------------------------------------------------------------------------------------ worker side
class _Step:
    __slots__ = ("req_ids", "rows", "all_rows", "num_rows", "lse_t", "tempered", "done", "result", "engine",
                 "in_sample")

    def __init__(self, req_ids: list, rows: list[int], num_rows: int, engine: dict) -> None:
        self.req_ids, self.rows, self.num_rows, self.engine = req_ids, rows, num_rows, engine
        self.all_rows = len(rows) == num_rows
        self.lse_t = self.tempered = self.result = None
        self.done = self.in_sample = False


def _truncates(md: Any) -> bool:
    """Can this batch's processing mask tokens (min-p, top-k, top-p, allowed ids, bad words, another
    argmax-invariant processor)? If not, every kept set is the whole vocabulary: log mass 0, size V."""
    if getattr(md, "top_k", None) is not None or getattr(md, "top_p", None) is not None:
        return True
    if getattr(md, "allowed_token_ids_mask", None) is not None or getattr(md, "bad_words_token_ids", None):
        return True
    procs = getattr(getattr(md, "logitsprocs", None), "argmax_invariant", None) or ()
    for proc in procs:
        if type(proc).__name__ != "MinPLogitsProcessor" or getattr(proc, "min_p_count", 1):
            return True
    return False


_TLS = threading.local()


def _engine_of(runner: Any) -> dict:
    eng = getattr(runner, "_rlpatch_engine", None)
    if eng is None:
        dev = getattr(getattr(runner, "device", None), "type", None) or "cpu"
        eng = {"vllm": vllm_info().raw_version, "runner": "v1", "device": str(dev)}
        try:
            runner._rlpatch_engine = eng
        except Exception:
            pass
    return eng


def _step_of(runner: Any) -> _Step | None:
    """Which rows of this step's batch asked for support information (None: none did, or not supported)."""
    ib = getattr(runner, "input_batch", None)
    reqs = getattr(runner, "requests", None)
    if ib is None or not isinstance(reqs, dict) or getattr(runner, "execute_model_state", True) is None:
        return None
    req_ids = list(ib.req_ids)
    rows = []
    for i, rid in enumerate(req_ids):
        st = reqs.get(rid)
        if st is not None and wants(getattr(st, "sampling_params", None)):
            rows.append(i)
    if not rows:
        return None
    if getattr(runner, "speculative_config", None) is not None:
        _warn_once("spec", "speculative decoding is on: no support information (rlpatch_support stays None)")
        return None
    return _Step(req_ids, rows, len(req_ids), _engine_of(runner))


_SCRATCH: dict[tuple, Any] = {}


def _scratch(like, dtype=None):
    """A reused buffer shaped like ``like`` on a CPU (a fresh multi-MB allocation per step costs page faults
    that dwarf the arithmetic there); None elsewhere (the CUDA caching allocator reuses memory itself)."""
    if like.device.type != "cpu":
        return None
    import torch

    dtype = dtype or like.dtype
    key = (dtype,)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=dtype)
    return buf[: like.numel()].view(like.shape)


EXP_FLOOR = -87.0  # exp() of anything lower is an fp32 denormal: up to 15x slower on x86, and < 1.7e-38 each


def _lse(x):
    """logsumexp over the last dimension of a [R, V] fp32 tensor: max, exp into a reused buffer, sum. Arguments
    are floored at EXP_FLOOR (peaked logits put most of a 32k vocabulary there; their total is < V * 1.7e-38)."""
    import torch

    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype, device=m.device))
    buf = _scratch(x)
    d = x - m if buf is None else torch.sub(x, m, out=buf)
    e = torch.exp(d.clamp_(min=EXP_FLOOR), out=d)
    return m.squeeze(1) + torch.log(e.sum(dim=-1))


def _kept_count(x):
    import torch

    buf = _scratch(x, torch.bool)
    neg = torch.isneginf(x) if buf is None else torch.isneginf(x, out=buf)
    return x.shape[-1] - neg.sum(dim=-1)


def _sample_tokens_wrapper(wrapped, instance, args, kwargs):
    t0 = time.perf_counter()
    step = _step_of(instance)
    if step is None:
        RUNTIME["seconds"] += time.perf_counter() - t0
        return wrapped(*args, **kwargs)
    prev = getattr(_TLS, "step", None)
    _TLS.step = step
    spent = time.perf_counter() - t0
    try:
        out = wrapped(*args, **kwargs)
    finally:
        _TLS.step = prev
    t1 = time.perf_counter()
    if step.result is not None:
        _attach(out, step)
    RUNTIME["seconds"] += spent + (time.perf_counter() - t1)
    return out


def _temperature_wrapper(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    step = getattr(_TLS, "step", None)
    if step is not None and step.in_sample and step.lse_t is None and getattr(out, "dim", lambda: 0)() == 2 \
            and out.shape[0] == step.num_rows:
        import torch

        t0 = time.perf_counter()
        x = out if step.all_rows else out.index_select(0, torch.tensor(step.rows, device=out.device))
        step.lse_t = _lse(x)
        step.tempered = out  # vLLM's min-p / top-k / top-p mask this very tensor in place
        RUNTIME["seconds"] += time.perf_counter() - t0
    return out


def _sample_wrapper(wrapped, instance, args, kwargs):
    step = getattr(_TLS, "step", None)
    if step is None or step.done:
        return wrapped(*args, **kwargs)
    logits = args[0] if args else kwargs.get("logits")
    md = args[1] if len(args) > 1 else kwargs.get("sampling_metadata")
    override = args[2] if len(args) > 2 else kwargs.get("logprobs_mode_override")
    if logits is None or logits.dim() != 2 or logits.shape[0] != step.num_rows:
        step.done = True  # not one row per request (e.g. a drafter's or a rejection sampler's call)
        return wrapped(*args, **kwargs)
    if not _truncates(md):  # nothing can mask a token: the kept set is the vocabulary (no work at all)
        out = wrapped(*args, **kwargs)
        step.done = True
        step.result = (step, [0.0] * len(step.rows), [int(logits.shape[1])] * len(step.rows))
        return out
    step.in_sample = True
    try:
        out = wrapped(*args, **kwargs)
    finally:
        step.in_sample = False
    step.done = True
    t0 = time.perf_counter()
    try:
        sampled, processed = out
        mode = override or getattr(instance, "logprobs_mode", None)
        step.result = _support(step, logits, md, sampled, processed, mode)
    except Exception as e:  # never break sampling
        step.result = None
        _warn_once("error", "could not compute support information (%s: %s); rlpatch_support stays None",
                   type(e).__name__, e)
    finally:
        step.tempered = None
        RUNTIME["seconds"] += time.perf_counter() - t0
    return out


def _support(step: _Step, logits, md, sampled, processed, mode):
    import torch

    dev = logits.device
    rows_t = None if step.all_rows else torch.tensor(step.rows, device=dev)
    pick = (lambda t: t) if rows_t is None else (lambda t: t.index_select(0, rows_t))
    tok = pick(sampled.reshape(-1).long()).unsqueeze(1)
    if step.lse_t is None:
        # all-greedy batch: vLLM returned before temperature and truncation (processed = full softmax)
        if not getattr(md, "all_greedy", False):
            raise RuntimeError("the sampler applied no temperature in a batch that is not all greedy")
        x = pick(logits)
        log_mass = torch.zeros(x.shape[0], dtype=torch.float32, device=dev)
        return step, log_mass, _kept_count(x)
    x = pick(step.tempered)
    x_tok = x.gather(1, tok).squeeze(1)
    ok = torch.isfinite(x_tok)  # the sampled token must be in the masked tensor's kept set
    if x.device.type == "cpu" and not bool(ok.all()):  # (on a GPU no sync here: NaN marks such a row below)
        raise RuntimeError("a sampled token is masked in the sampler's logits after sampling (vLLM no longer "
                           "truncates the tempered logits in place?)")
    count = _kept_count(x)
    if mode == "processed_logprobs" and processed is not None and processed.shape == step.tempered.shape:
        lse_kept = x_tok - pick(processed).gather(1, tok).squeeze(1)
    else:
        lse_kept = _lse(x)
    log_mass = torch.clamp_max(lse_kept - step.lse_t, 0.0)
    log_mass = torch.where(ok, log_mass, torch.full_like(log_mass, float("nan")))
    return step, log_mass, count


def _lists(step: _Step, log_mass, count) -> dict:
    as_list = (lambda t: t) if isinstance(log_mass, list) else (lambda t: t.tolist())
    return {"req_ids": [step.req_ids[i] for i in step.rows],
            "log_mass_kept": as_list(log_mass if isinstance(log_mass, list) else log_mass.float()),
            "kept_count": as_list(count), "engine": step.engine}


def _attach(out: Any, step: _Step) -> None:
    _, log_mass, count = step.result
    RUNTIME["steps"] += 1
    RUNTIME["rows"] += len(step.rows)
    if type(out).__name__ == "ModelRunnerOutput" or hasattr(out, "req_id_to_index"):
        out.rlpatch_support = _lists(step, log_mass, count)
        return
    if hasattr(out, "get_output"):  # async scheduling (GPU): copy now, convert when vLLM reads the output
        out._rlpatch_support_pending = (step, *_host_copy(log_mass, count))


def _host_copy(log_mass, count):
    """(both, event): the two per-row values on the host, copied without blocking where they are on a GPU."""
    import torch

    if isinstance(log_mass, list):
        return torch.tensor([log_mass, count], dtype=torch.float32), None
    if log_mass.is_cuda:  # into pinned memory: the copy does not block the host
        src = torch.stack([log_mass.float(), count.float()])
        both = torch.empty(src.shape, dtype=torch.float32, pin_memory=True)
        both.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return both, ev
    return torch.stack([log_mass.float(), count.float()]), None


def _async_get_output_wrapper(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    pending = instance.__dict__.pop("_rlpatch_support_pending", None)
    if pending is not None and out is not None:
        step, both, ev = pending
        if ev is not None:
            ev.synchronize()
        out.rlpatch_support = _lists(step, both[0], both[1].long())
    return out


_WORKER = (
    _wrapping.LateWraps(RUNNER, {T_SAMPLE_TOKENS: _sample_tokens_wrapper, T_ASYNC_OUTPUT: _async_get_output_wrapper},
                        OWNER, on_missing=lambda m: _warn_once("missing", "%s missing in this vLLM", ", ".join(m))),
    _wrapping.LateWraps(SAMPLER, {T_SAMPLE: _sample_wrapper, T_TEMPERATURE: _temperature_wrapper}, OWNER,
                        on_missing=lambda m: _warn_once("missing", "%s missing in this vLLM", ", ".join(m))),
)


# ------------------------------------------------------------------------------------------ Model Runner V2
# MRv2's Sampler (vllm/v1/worker/gpu/sample/sampler.py) keeps requests by slot (req_idx); `add_request` notes
# the slots that asked. Per step, `__call__(logits, input_batch)` maps batch rows to slots
# (input_batch.idx_mapping_np); `sample` runs penalties/temperature (apply_sampling_params), min-p in place
# (SamplingStates.apply_min_p: the tensor it receives is the temperature-scaled one), then top-k/top-p, and
# returns (sampled, processed_logits): the kept set is the finite entries of processed_logits. The result
# rides on the SamplerOutput to AsyncOutput.get_output, which builds the ModelRunnerOutput.
MRV2_STATES = "vllm.v1.worker.gpu.sample.states"
MRV2_ASYNC = "vllm.v1.worker.gpu.async_utils"
T_MRV2_CALL = f"{MRV2_SAMPLER}:Sampler.__call__"
T_MRV2_SAMPLE = f"{MRV2_SAMPLER}:Sampler.sample"
T_MRV2_MIN_P = f"{MRV2_STATES}:SamplingStates.apply_min_p"
T_MRV2_GET_OUTPUT = f"{MRV2_ASYNC}:AsyncOutput.get_output"


def _mrv2_add_request_wrapper(wrapped, instance, args, kwargs):
    req_idx = args[0] if args else kwargs.get("req_idx")
    sp = args[1] if len(args) > 1 else kwargs.get("sampling_params")
    slots = instance.__dict__.setdefault("_rlpatch_wants", set())
    if wants(sp):
        slots.add(req_idx)
    else:
        slots.discard(req_idx)
    return wrapped(*args, **kwargs)


def _pick(t, step: _Step):
    import torch

    return t if step.all_rows else t.index_select(0, torch.tensor(step.rows, device=t.device))


def _mrv2_call_wrapper(wrapped, instance, args, kwargs):
    slots = instance.__dict__.get("_rlpatch_wants")
    if not slots:
        return wrapped(*args, **kwargs)
    t0 = time.perf_counter()
    logits = args[0] if args else kwargs.get("logits")
    ib = args[1] if len(args) > 1 else kwargs.get("input_batch")
    idx = ib.idx_mapping_np.tolist()
    rows = [i for i, r in enumerate(idx) if r in slots]
    if not rows:
        RUNTIME["seconds"] += time.perf_counter() - t0
        return wrapped(*args, **kwargs)
    if logits.dim() != 2 or logits.shape[0] != len(idx):  # several logits rows per request: speculative decoding
        _warn_once("spec", "speculative decoding is on: no support information (rlpatch_support stays None)")
        return wrapped(*args, **kwargs)
    step = _Step(list(ib.req_ids), rows, len(idx), {"vllm": vllm_info().raw_version, "runner": "mrv2",
                                                     "device": str(logits.device.type)})
    needs = getattr(instance, "needs_logits_processing", None)
    if needs is not None and not bool(needs[ib.idx_mapping_np].any()):
        step.lse_t = _lse(_pick(logits, step).float())  # no temperature, no min-p: top-k/top-p mask these logits
    prev = getattr(_TLS, "mrv2", None)
    _TLS.mrv2 = step
    RUNTIME["seconds"] += time.perf_counter() - t0
    try:
        out = wrapped(*args, **kwargs)
    finally:
        _TLS.mrv2 = prev
    t1 = time.perf_counter()
    try:
        if step.result is None:
            raise RuntimeError("MRv2's sampler gave no processed logits to read the kept set from")
        sampled, processed = step.result
        _, log_mass, count = _mrv2_support(step, sampled, processed)
        RUNTIME["steps"] += 1
        RUNTIME["rows"] += len(step.rows)
        out._rlpatch_support_pending = (step, *_host_copy(log_mass, count))  # read by AsyncOutput.get_output
    except Exception as e:  # never break sampling
        _warn_once("error", "could not compute support information (%s: %s); rlpatch_support stays None",
                   type(e).__name__, e)
    RUNTIME["seconds"] += time.perf_counter() - t1
    return out


def _mrv2_min_p_wrapper(wrapped, instance, args, kwargs):
    step = getattr(_TLS, "mrv2", None)
    logits = args[0] if args else kwargs.get("logits")
    if step is not None and step.lse_t is None and logits is not None and logits.shape[0] == step.num_rows:
        t0 = time.perf_counter()
        step.lse_t = _lse(_pick(logits, step))  # temperature-scaled, before min-p masks it in place
        RUNTIME["seconds"] += time.perf_counter() - t0
    return wrapped(*args, **kwargs)


def _mrv2_sample_wrapper(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    step = getattr(_TLS, "mrv2", None)
    if step is not None and step.result is None:
        step.result = out  # (sampled, processed_logits after top-k/top-p)
    return out


def _mrv2_support(step: _Step, sampled, processed):
    import torch

    if step.lse_t is None:
        raise RuntimeError("no temperature-scaled logits seen before min-p")
    x = _pick(processed, step)
    tok = _pick(sampled.reshape(-1).long(), step).unsqueeze(1)
    ok = torch.isfinite(x.gather(1, tok).squeeze(1))  # the sampled token must be in the kept set
    count = _kept_count(x)
    log_mass = torch.clamp_max(_lse(x) - step.lse_t, 0.0)
    return step, torch.where(ok, log_mass, torch.full_like(log_mass, float("nan"))), count


def _mrv2_get_output_wrapper(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    so = getattr(instance, "sampler_output", None)
    pending = None if so is None else so.__dict__.pop("_rlpatch_support_pending", None)
    if pending is not None and out is not None:
        step, both, ev = pending
        if ev is not None:
            ev.synchronize()
        out.rlpatch_support = _lists(step, both[0], both[1].long())
    return out


_MRV2 = _wrapping.LateWraps(MRV2_SAMPLER, {T_MRV2_ADD: _mrv2_add_request_wrapper, T_MRV2_CALL: _mrv2_call_wrapper,
                                           T_MRV2_SAMPLE: _mrv2_sample_wrapper}, OWNER, all_or_none=True,
                            on_missing=lambda m: _warn_once("missing", "%s missing in this vLLM", ", ".join(m)))
_MRV2_LATE = (
    _wrapping.LateWraps(MRV2_STATES, {T_MRV2_MIN_P: _mrv2_min_p_wrapper}, OWNER,
                        on_missing=lambda m: _warn_once("missing", "%s missing in this vLLM", ", ".join(m))),
    _wrapping.LateWraps(MRV2_ASYNC, {T_MRV2_GET_OUTPUT: _mrv2_get_output_wrapper}, OWNER,
                        on_missing=lambda m: _warn_once("missing", "%s missing in this vLLM", ", ".join(m))),
)


# ------------------------------------------------------------------------------------------ engine core
def _engine_core(scheduler: Any, mro: Any, outputs: dict) -> None:
    sup = getattr(mro, "rlpatch_support", None)
    if not sup:
        return
    index = {rid: i for i, rid in enumerate(sup["req_ids"])}
    lm, cnt, eng = sup["log_mass_kept"], sup["kept_count"], sup["engine"]
    live = getattr(scheduler, "requests", None) or {}
    for eco in outputs.values():
        for o in getattr(eco, "outputs", ()) or ():
            i = index.get(o.request_id)
            if i is None or not o.new_token_ids:
                continue
            n = len(o.new_token_ids)  # one per step without speculative decoding
            req = live.get(o.request_id)
            first = req is None or len(getattr(req, "output_token_ids", ()) or ()) <= n
            engine_core.put_payload(o, NAME, [[lm[i]] * n, [cnt[i]] * n, eng if first else None])


# ------------------------------------------------------------------------------------------ front end
_STATE = "_rlpatch_support"


def _frontend(state: Any, payload: Any, n_before: int) -> None:
    lm, cnt, eng = payload
    d = state.__dict__.get(_STATE)
    if d is None:
        d = state.__dict__[_STATE] = {"lm": [], "cnt": [], "engine": eng}
    elif eng is not None:
        d["engine"] = eng
    while len(d["lm"]) < n_before:  # tokens that came without information
        d["lm"].append(math.nan)
        d["cnt"].append(-1)
    del d["lm"][n_before:], d["cnt"][n_before:]
    d["lm"].extend(float(x) for x in lm)
    d["cnt"].extend(int(x) for x in cnt)


def _completion(state: Any, out: Any) -> None:
    d = state.__dict__.get(_STATE)
    if d is None:  # not asked for, or not supported on this engine (rlpatch_support stays absent)
        return
    det = getattr(state, "detokenizer", None)
    total = det.num_output_tokens() if det is not None else len(d["lm"])
    lm, cnt = list(d["lm"][:total]), list(d["cnt"][:total])
    lm += [math.nan] * (total - len(lm))
    cnt += [-1] * (total - len(cnt))
    n = len(getattr(out, "token_ids", ()) or ())
    if n < total:  # DELTA output: the new tokens only
        lm, cnt = lm[total - n:], cnt[total - n:]
    try:
        out.rlpatch_support = SamplingSupport(lm, cnt, dict(d["engine"] or {}))
    except AttributeError:
        pass


def _merge(into: Any, nxt: Any) -> None:
    """Two DELTA outputs merged into one (a stream read more slowly than the engine produces): the later
    tokens' entries follow the earlier ones'."""
    a, b = getattr(into, "rlpatch_support", None), getattr(nxt, "rlpatch_support", None)
    if b is None:
        return
    into.rlpatch_support = b if a is None else SamplingSupport(
        list(a.log_mass_kept) + list(b.log_mass_kept), list(a.kept_count) + list(b.kept_count),
        a.engine or b.engine)


CHANNEL = engine_core.Channel(NAME, engine_core=_engine_core, frontend=_frontend, completion=_completion,
                              merge=_merge)


# ------------------------------------------------------------------------------------------ apply/revert
def apply() -> None:
    engine_core.require(NAME)
    engine_core.add_channel(CHANNEL)
    for lw in (*_WORKER, _MRV2, *_MRV2_LATE):
        lw.apply()


def revert() -> None:
    for lw in (*_WORKER, _MRV2, *_MRV2_LATE):
        lw.revert()
    engine_core.remove_channel(NAME)
    engine_core.release(NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="Per-token kept-set mass and size from the sampler, opt-in per request "
            "(extra_args={'rlpatch_support': True}; vllm_xargs over vllm serve): CompletionOutput.rlpatch_support",
    vllm=">=0.20,<0.35",  # V1 runner through 0.33; Model Runner V2 from 0.29 (0.34: MRv2 only)
    targets=(),
    lazy_targets=(T_SAMPLE_TOKENS, T_ASYNC_OUTPUT, T_SAMPLE, T_TEMPERATURE, T_MRV2_ADD, T_MRV2_CALL, T_MRV2_SAMPLE,
                  T_MRV2_MIN_P, T_MRV2_GET_OUTPUT, *engine_core.TARGETS),
    apply=apply,
    revert=revert,
    upstream="vLLM 0.32 return_sampling_mask (Model Runner V2 only, a vocabulary-sized mask per token)",
    remove_when="vLLM returns the kept-set mass per token on every runner",
)
