"""The plan path's write: one part's tensors copied into the destination windows of the verified copy plan.

Under ``rollback`` each window is backed up right before its copy (:class:`~vllm_rlpatch.refit.backup.WindowBackup`,
overlapped on CUDA). Otherwise the copies run as a fused copy-and-check kernel where it applies (each
destination block read back and digested right after its store), else as a CUDA graph an update template
captured, else one ``copy_`` per window. After the write (``verify``, and always under ``validate-then-write``)
the destination windows' digests are compared with the validated sources'.
"""

from __future__ import annotations

import logging

import torch

from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.backup import WindowBackup
from vllm_rlpatch.refit.plan import CopyPlan, Entry
from vllm_rlpatch.refit.tx_state import Part, Transaction, now
from vllm_rlpatch.refit.worker_state import WorkerState

logger = logging.getLogger("vllm.rlpatch")


class PlanWrite:
    """One part's write on the plan path (:meth:`run`)."""

    def __init__(self, ws: WorkerState, tx: Transaction, part: Part):
        self.ws, self.tx, self.part = ws, tx, part
        self.plan: CopyPlan = ws.plans.plan
        self.device = ws.device
        self.tmpl = part.template
        self.entries = self._entries()

    def _entries(self) -> list[Entry]:
        names, tmpl = self.part.plan_names, self.tmpl
        key = (self.plan, names)  # the plan object itself: an id could be reused
        if tmpl is not None and tmpl.entries_key == key:
            return tmpl.entries
        entries = self.plan.entries_for(names)
        if tmpl is not None:
            tmpl.entries_key, tmpl.entries = key, entries
        return entries

    @property
    def checked(self) -> bool:
        return self.tx.request.verify or self.tx.guarantee == "validate-then-write"

    def run(self, live_proven: bool = False) -> None:
        tx, plan = self.tx, self.plan
        if tx.guarantee == "validate-then-write" and not live_proven:  # proven again before the first byte moves
            why = plan.live()
            if why is not None:
                raise P.RefitError(f"validate-then-write: {why}", kind="validation")
        sources = self.part.tensors
        if sources is None:
            self._streamed()
            return
        t1 = now()
        if tx.guarantee == "rollback":
            self._with_backup(sources)
        else:
            self._first_window_fault(sources)
            if self._fused(sources, t1):
                return
            self._copies(sources, t1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tx.stage("write", now() - t1)
        tx.mark("synced")
        tx.check("plan_copy")
        if self.checked:
            self._check_after()

    def _streamed(self) -> None:
        """Direct over a streaming source: each tensor copied as it arrives."""
        names = self.part.plan_names
        for m, t in self.part.source.tensors():
            if m.name in names:
                self.plan.copy(self.plan.entries_for({m.name}), {m.name: t})
                self.tx.written = True
        self.tx.check("plan_copy")

    def _with_backup(self, sources: dict[str, torch.Tensor]) -> None:
        tx = self.tx
        if tx.windows is None:
            arena = self.ws.backups.arena(tx.backup_kind, self.device)
            arena.begin()
            tx.windows = WindowBackup(arena)
        dst = self.plan.windows(self.entries)
        src = self.plan.source_windows(self.entries, sources)

        def write(i: int) -> None:
            dst[i].copy_(src[i], non_blocking=True)
            tx.written = True
            if i == 0:
                tx.raise_fault("after_first_write", self.ws.rank)

        tx.windows.save_then(dst, write)
        if tx.backup_kind in ("host", "pinned"):
            tx.extra_host = max(tx.extra_host, tx.windows.bytes)
        tx.check(f"backup_{'device' if tx.backup_kind == 'device' else 'host'}")

    def _first_window_fault(self, sources: dict[str, torch.Tensor]) -> None:
        """A test's ``after_first_write`` fault: the first window is written, then the fault is raised."""
        if self.tx.fault_armed("after_first_write") and self.entries:
            self.plan.copy(self.entries[:1], sources)
            self.tx.written = True
            self.tx.raise_fault("after_first_write", self.ws.rank)

    def _fused(self, sources: dict[str, torch.Tensor], t1: float) -> bool:
        """The copies and the post-write check in one pass: each destination block is read back right after its
        store and digested (about one copy's time instead of a copy plus a digest pass). False where it does not
        apply (nothing written then)."""
        tx, entries = self.tx, self.entries
        if not self.checked or tx.fault or self.device.type != "cuda":
            return False
        fused = self._copy_check(sources)
        if fused is None:
            return False
        tmpl = self.tmpl
        whole = tmpl.fused_names if tmpl is not None and tmpl.fused is fused else None
        want = [self.part.expected.get(n) for n in whole] if whole is not None else self._expected_windows()
        tx.written = True
        bad = [entries[i].name for i in fused.run_and_compare(want)]
        tx.stage("write_check", now() - t1)
        tx.check("plan_copy")
        tx.check("copy_readback")
        tx.post_check = "window_digests"
        tx.check("window_digests")
        if bad:
            raise P.RefitError(f"after the write, {len(bad)} destination window(s) do not hold the validated bytes: "
                               f"{', '.join(bad[:6])}", kind="commit")
        return True

    def _copies(self, sources: dict[str, torch.Tensor], t1: float) -> None:
        tx = self.tx
        graph = self._copy_graph(sources) if not tx.fault else None
        tx.marks.append(("write", t1))
        if graph is not None:
            graph.replay()  # the template's copies, captured once: one launch
            tx.check("copy_graph")
        else:
            self.plan.copy(self.entries, sources)
        tx.written = True
        tx.mark("launched")

    def _check_after(self) -> None:
        tx, entries = self.tx, self.entries
        t1 = now()
        bad = [entries[i].name for i in checks.mismatches(self.plan.windows(entries), self._expected_windows())]
        tx.stage("check_after", now() - t1)
        tx.post_check = "window_digests"
        tx.check("window_digests")
        if bad:
            raise P.RefitError(f"after the write, {len(bad)} destination window(s) do not hold the validated bytes: "
                               f"{', '.join(bad[:6])}", kind="commit")

    def _copy_check(self, sources: dict[str, torch.Tensor]):
        """The fused copy-and-check kernel's plan for these windows (kept by an update template with the names
        whose digests its windows must have), or None where it does not apply."""
        tmpl, entries = self.tmpl, self.entries
        key = (self.plan, len(entries))  # the plan object (kept alive by the key), not its id
        if tmpl is not None and tmpl.fused_key == key:
            return tmpl.fused
        fused = checks.copy_check_plan(self.plan.windows(entries), self.plan.source_windows(entries, sources))
        if tmpl is not None and fused is not None:
            tmpl.fused_key, tmpl.fused = key, fused
            tmpl.fused_names = [e.name for e in entries] if all(e.whole_source for e in entries) else None
        return fused

    def _copy_graph(self, sources: dict[str, torch.Tensor]):
        """A CUDA graph of the plan's copies for an update template (its sources and the plan's windows stay
        the same tensors step after step): captured on the template's second use, replayed after. None where
        it does not apply (no template, not CUDA) or the capture failed (then the copies run one by one)."""
        tmpl, entries, dev = self.tmpl, self.entries, self.device
        if tmpl is None or dev.type != "cuda" or tmpl.graph_failed:
            return None
        key = (self.plan, len(entries))
        if tmpl.graph is not None and tmpl.graph_key == key:
            return tmpl.graph
        if not tmpl.seen:
            tmpl.seen = True  # the first use runs eagerly (the plan may be new); capture on the next
            return None
        try:
            dst = self.plan.windows(entries)
            src = self.plan.source_windows(entries, sources)
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.graph(g, stream=stream):
                for d, s_ in zip(dst, src):
                    d.copy_(s_, non_blocking=True)
            torch.cuda.current_stream(dev).wait_stream(stream)
        except Exception as e:  # noqa: BLE001 - the copies run one by one instead
            tmpl.graph_failed = True
            logger.info("vllm-rlpatch: capturing the refit copies as a CUDA graph failed (%s); copying eagerly", e)
            return None
        tmpl.graph, tmpl.graph_key = g, key
        return g

    def _expected_windows(self) -> list[str | None]:
        """The digest each destination window must have: the validated source digest where the window takes the
        whole source; else the source window's own digest, computed now (before anything else writes)."""
        part, entries = self.part, self.entries
        partial_src = [e for e in entries if not e.whole_source]
        extra = {}
        if partial_src and part.tensors is not None:
            ds = checks.digests(self.plan.source_windows(partial_src, part.tensors))
            extra = {id(e): d.key for e, d in zip(partial_src, ds)}
        return [part.expected.get(e.name) if e.whole_source else extra.get(id(e)) for e in entries]
