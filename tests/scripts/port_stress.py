"""Port-race workloads on vLLM's real code (shm_broadcast.MessageQueue, RayExecutorV2's TCPStore port
selection, a real torch.distributed.TCPStore). One process = one worker of a stress run; the test starts
many at once. Prints `RESULT {...}`. Loads vLLM's general plugins exactly as a vLLM process does (so the
plugin is active unless VLLM_RLPATCH_* says otherwise); never imports vllm_rlpatch itself.

  (START_AT is `@DIR`: a start barrier with the harness, see _start_barrier)
  mq START_AT COUNT DELAY IP            create COUNT MessageQueues with a remote reader each, send and check a
                                        message through each; DELAY s are injected between vLLM's port probe
                                        and its bind (what a loaded node does)
  mq-writer DIR ID COUNT START_AT DELAY IP   the same, the reader being another process (another host)
  mq-reader DIR ID COUNT                 reads the handles mq-writer publishes in DIR, answers through DIR
  tcpstore START_AT HOLD THREADS [--mq IP]   THREADS concurrent engine inits: pick the TCPStore port as
                                        RayExecutorV2 does, (create the engine's MessageQueue next, as its
                                        _init_executor does,) wait HOLD s (the rank-0 actor starting), then bind
                                        a real TCPStore on it and keep it bound until every init is done
"""

import json
import os
import pickle
import sys
import time


def _plugins():
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def _inject_probe_delay(delay):
    if delay <= 0:
        return
    from vllm.utils import network_utils

    orig = network_utils._get_open_port

    def slow(*a, **kw):
        port = orig(*a, **kw)
        time.sleep(delay)  # the port is released; vLLM binds it only now
        return port

    network_utils._get_open_port = slow


def _wait_until(t):
    while time.time() < t:
        time.sleep(0.005)


def _start_barrier(arg):
    """START_AT is `@DIR`: say ready (imports done), wait for the harness's `go` file, return its start time."""
    d = arg[1:]
    open(os.path.join(d, f"ready-{os.getpid()}"), "w").close()
    go = os.path.join(d, "go")
    deadline = time.time() + 600
    while not os.path.exists(go):
        if time.time() > deadline:
            raise SystemExit("no go from the harness in 600 s")
        time.sleep(0.01)
    with open(go) as fh:
        return float(fh.read())


def _close(mq):
    for name in ("remote_socket", "local_socket"):
        s = getattr(mq, name, None)
        if s is not None:
            s.close(linger=0)


def _new_mq(ip):
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    try:
        return MessageQueue(1, 0, connect_ip=ip), None
    except zmq.ZMQError as e:
        return None, f"ZMQError: {e}"
    except Exception as e:  # noqa: BLE001 - reported
        return None, f"{type(e).__name__}: {e}"


def mq(start_at, count, delay, ip):  # start_at: `@DIR` (see _start_barrier)
    import threading

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    _plugins()
    _inject_probe_delay(delay)
    _wait_until(_start_barrier(start_at))
    ok, errors, bad, ports = 0, [], 0, []
    for i in range(count):
        w, err = _new_mq(ip)
        if w is None:
            errors.append(err)
            continue
        handle = w.export_handle()
        ports.append(int(handle.remote_subscribe_addr.rsplit(":", 1)[1]))
        r = MessageQueue.create_from_handle(handle, 0)
        t = threading.Thread(target=r.wait_until_ready)
        t.start()
        w.wait_until_ready()
        t.join()
        msg = {"pid": os.getpid(), "i": i, "payload": os.urandom(64).hex()}
        w.enqueue(msg)
        got = r.dequeue(timeout=30)
        ok += got == msg
        bad += got != msg
        _close(w)
        _close(r)
    return {"created": count - len(errors), "failed": len(errors), "delivered": ok, "corrupted": bad,
            "errors": errors[:3], "ports": ports[:5]}


def mq_writer(d, wid, count, start_at, delay, ip):
    _plugins()
    _inject_probe_delay(delay)
    import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401 - imported before the start
    _wait_until(_start_barrier(start_at))
    errors, ok = [], 0
    for c in range(count):
        w, err = _new_mq(ip)
        path = os.path.join(d, f"w{wid}-{c}")
        if w is None:
            errors.append(err)
            with open(path + ".tmp", "wb") as fh:
                pickle.dump(None, fh)
            os.replace(path + ".tmp", path + ".handle")
            continue
        with open(path + ".tmp", "wb") as fh:
            pickle.dump(w.export_handle(), fh)
        os.replace(path + ".tmp", path + ".handle")
        w.wait_until_ready()
        w.enqueue({"w": wid, "c": c, "payload": "x" * 1000})
        deadline = time.time() + 60
        while not os.path.exists(path + ".ack") and time.time() < deadline:
            time.sleep(0.005)
        ok += os.path.exists(path + ".ack") and open(path + ".ack").read() == "ok"
        _close(w)
    return {"created": count - len(errors), "failed": len(errors), "delivered": ok, "errors": errors[:3]}


def mq_reader(d, wid, count):
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    got = 0
    for c in range(count):
        path = os.path.join(d, f"w{wid}-{c}")
        deadline = time.time() + 120
        while not os.path.exists(path + ".handle") and time.time() < deadline:
            time.sleep(0.005)
        with open(path + ".handle", "rb") as fh:
            handle = pickle.load(fh)
        if handle is None:
            continue
        r = MessageQueue.create_from_handle(handle, 0)
        r.wait_until_ready()
        msg = r.dequeue(timeout=60)
        good = msg == {"w": wid, "c": c, "payload": "x" * 1000}
        got += good
        with open(path + ".ack.tmp", "w") as fh:
            fh.write("ok" if good else "bad")
        os.replace(path + ".ack.tmp", path + ".ack")  # the writer never reads a half-written ack
        _close(r)
    return {"received": got}


def tcpstore(start_at, hold, threads, mq_ip):
    import threading

    import torch.distributed as dist

    _plugins()
    from vllm.v1.executor import ray_executor_v2 as rx

    if mq_ip:
        import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401 - imported before the start
    start_at = _start_barrier(start_at)
    bind_at = start_at + hold
    results, keep = [], []
    lock = threading.Lock()

    def one():
        _wait_until(start_at)
        if hasattr(rx.RayWorkerProc, "create_dist_init_method"):  # upstream_patches/tcpstore_port applied
            # the rank-0 actor binds the store on port 0 and publishes its address: nothing to race for
            import types

            fake = types.SimpleNamespace(_parallel_config=types.SimpleNamespace(world_size=1))
            try:
                method = rx.RayWorkerProc.create_dist_init_method(fake)
                port, err = int(method.rsplit(":", 1)[1]), None
            except Exception as e:  # noqa: BLE001
                port, err = -1, f"{type(e).__name__}: {e}"
            _wait_until(bind_at)
            with lock:
                results.append({"port": port, "how": "create_dist_init_method()", "mq_port": None,
                                "bound": err is None, "error": err})
                keep.append((fake, None))
            return
        if hasattr(rx.RayExecutorV2, "_select_tcpstore_port"):  # 0.25+: DP off -> local rank 0, master port 0
            port = rx.RayExecutorV2._select_tcpstore_port(0, 0)
            how = "_select_tcpstore_port(0, 0)"
        else:  # 0.20: _init_executor calls the module's get_open_port()
            port = rx.get_open_port()
            how = "get_open_port()"
        mq_port, w = None, None
        if mq_ip:
            w, err = _new_mq(mq_ip)
            mq_port = int(w.export_handle().remote_subscribe_addr.rsplit(":", 1)[1]) if w else err
        _wait_until(bind_at)  # the rank-0 actor starts, then binds the store
        try:
            store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
            store.set("k", "v")
            err = None
        except Exception as e:  # noqa: BLE001 - EADDRINUSE is the bug
            store, err = None, f"{type(e).__name__}: {e}"
        with lock:
            results.append({"port": port, "how": how, "mq_port": mq_port, "bound": err is None, "error": err})
            keep.append((store, w))  # every store stays bound until all inits of this trial are done

    ts = [threading.Thread(target=one) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    _wait_until(bind_at + 3)
    return {"inits": results}


def main(argv):
    role = argv[0]
    if role == "mq":
        r = mq(argv[1], int(argv[2]), float(argv[3]), argv[4])
    elif role == "mq-writer":
        r = mq_writer(argv[1], int(argv[2]), int(argv[3]), argv[4], float(argv[5]), argv[6])
    elif role == "mq-reader":  # no barrier: it waits for the writer's handles
        r = mq_reader(argv[1], int(argv[2]), int(argv[3]))
    elif role == "tcpstore":
        mq_ip = argv[argv.index("--mq") + 1] if "--mq" in argv else None
        r = tcpstore(argv[1], float(argv[2]), int(argv[3]), mq_ip)
    else:
        raise SystemExit(f"unknown role {role}")
    print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
