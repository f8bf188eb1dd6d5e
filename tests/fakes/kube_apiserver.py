"""``FakeKubeApiServer``: a FAKE Kubernetes API server for tests (no kube-apiserver can run here).

A real HTTP server on a loopback port that implements exactly what Dyad uses, with the API
server's semantics for them:

- pods: ``list`` (``labelSelector``; the list's ``metadata.resourceVersion``), ``watch``
  (``resourceVersion``, ``allowWatchBookmarks`` → periodic ``BOOKMARK`` events, ``timeoutSeconds``;
  a version older than the kept history answers an ``ERROR`` event with code 410 "Expired"; a pod
  that stops/starts matching the selector arrives as ``DELETED``/``ADDED``), ``get``, and
  ``patch`` (``application/merge-patch+json``, RFC 7386);
- statefulsets and deployments: ``get``, and the ``scale`` subresource (``get``/``patch``,
  ``status.selector``);
- bearer-token auth (401), 404/405/415 Status objects for everything else.

Every call is recorded as (user, verb, resource) in ``requests`` (the user is the name ``tokens``
gives the bearer token) so a test can hold it against the RBAC
rules in ``deploy/kubernetes``.

A minimal controller turns a StatefulSet's replicas into pods ``<name>-<ordinal>`` (a Deployment's
into ``<name>-<n>``; its scale-in deletes the lowest ``pod-deletion-cost`` first, as a ReplicaSet does): a new pod is
created not Ready with ``podIP`` 127.0.0.1 and its ``http`` port from ``start_engine(pod_name)``
(the tests start a real ``dyad sim-engine`` process there); a kubelet-like loop marks it Ready once
``ready_delay_s`` has passed and its ``/health`` answers. Scale-in deletes the highest ordinals
gracefully: ``deletionTimestamp`` first, then ``stop_engine`` (SIGTERM and wait), then the pod is
gone (``DELETED``). Test hooks: ``compact()`` (history gone: next resume gets 410),
``drop_watches()`` (cut every watch connection mid-stream), ``set_ready(pod, bool | None)``
(force a readiness flip), ``add_pod``/``delete_pod`` (pods without a controller), ``scale`` (someone else
changes a workload's replicas: ``kubectl scale``, an HPA), ``delete_workload`` (a StatefulSet or Deployment
deleted under the actuator), ``fail`` (the next N calls of one verb on one resource answer an error Status:
409, 422, 403, 500, ...; or ``hang_s`` seconds of silence first).
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """Equality-based label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-separated."""
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            out.append(("!=", k.strip(), v.strip()))
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            out.append(("=", k.strip(), v.strip()))
        elif term.startswith("!"):
            out.append(("!", term[1:].strip(), None))
        else:
            out.append(("exists", term, None))
    return out


def matches(labels: dict[str, str], selector: list[tuple[str, str, str | None]]) -> bool:
    for op, k, v in selector:
        if op == "=" and labels.get(k) != v:
            return False
        if op == "!=" and labels.get(k) == v:
            return False
        if op == "exists" and k not in labels:
            return False
        if op == "!" and k in labels:
            return False
    return True


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeKubeApiServer:
    def __init__(self, tokens: dict[str, str] | None = None, bookmark_interval_s: float = 1.0, history: int = 10_000,
                 start_engine: Callable[[str], int] | None = None, stop_engine: Callable[[str], None] | None = None,
                 ready_delay_s: float = 0.5, controller_interval_s: float = 0.1) -> None:
        self.tokens = {"fake-token": "tester"} if tokens is None else tokens  # bearer token → user ({}: no auth)
        self.bookmark_interval_s = bookmark_interval_s
        self.history = history
        self.start_engine = start_engine
        self.stop_engine = stop_engine
        self.ready_delay_s = ready_delay_s
        self.cond = threading.Condition()
        self.rv = 100
        self.pods: dict[tuple[str, str], Obj] = {}
        self.statefulsets: dict[tuple[str, str], Obj] = {}
        self.deployments: dict[tuple[str, str], Obj] = {}
        self._serial = 0  # Deployment pod name suffixes
        self.events: list[tuple[int, str, Obj, Obj | None]] = []  # (rv, type, pod, pod before)
        self.compacted_rv = 0  # the oldest version a watch may resume from (events after it are kept)
        self.requests: list[tuple[str, str, str]] = []  # (user, verb, resource)
        self.patches: list[tuple[float, str, Obj]] = []  # (monotonic time, path, body)
        self._forced_ready: dict[tuple[str, str], bool] = {}
        self._created_at: dict[tuple[str, str], float] = {}
        self._drop_generation = 0
        self.active_watches = 0  # watch connections open now
        self._deleting: set[tuple[str, str]] = set()
        self._faults: list[list[Any]] = []  # [verb, resource, status, times left, hang_s, labelSelector]
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-kube-http"),
                         threading.Thread(target=self._control_loop, args=(controller_interval_s,), daemon=True,
                                          name="fake-kube-controller")]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ state (call with the lock held)
    def _bump(self) -> int:
        self.rv += 1
        return self.rv

    def _record(self, kind: str, pod: Obj, before: Obj | None) -> None:
        self.events.append((self.rv, kind, copy.deepcopy(pod), copy.deepcopy(before) if before else None))
        if len(self.events) > self.history:
            drop = len(self.events) - self.history
            self.compacted_rv = self.events[drop - 1][0]
            del self.events[:drop]
        self.cond.notify_all()

    def _put_pod(self, ns: str, pod: Obj, kind: str) -> Obj:
        key = (ns, pod["metadata"]["name"])
        before = self.pods.get(key)
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self.pods[key] = pod
        self._record(kind, pod, before)
        return pod

    def _remove_pod(self, ns: str, name: str) -> None:
        pod = self.pods.pop((ns, name), None)
        if pod is not None:
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self._bump())
            self._record("DELETED", pod, pod)
        self._created_at.pop((ns, name), None)
        self._forced_ready.pop((ns, name), None)

    # ------------------------------------------------------------------ test API
    def add_statefulset(self, name: str, replicas: int, labels: dict[str, str], namespace: str = "dyad",
                        ports: list[Obj] | None = None) -> None:
        """A StatefulSet whose pods carry ``labels`` (its selector is all of them)."""
        with self.cond:
            self.statefulsets[(namespace, name)] = {
                "apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(self._bump())},
                "spec": {"replicas": replicas, "serviceName": name, "selector": {"matchLabels": dict(labels)},
                         "template": {"metadata": {"labels": dict(labels)},
                                      "spec": {"containers": [{"name": "engine", "ports": ports or []}]}}},
            }

    def add_deployment(self, name: str, replicas: int, labels: dict[str, str], namespace: str = "dyad") -> None:
        """A Deployment (its ReplicaSet folded in): pods ``<name>-<n>``; scale-in deletes the pods with the
        lowest ``controller.kubernetes.io/pod-deletion-cost`` first, then not-Ready ones, then the newest."""
        with self.cond:
            self.deployments[(namespace, name)] = {
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(self._bump())},
                "spec": {"replicas": replicas, "selector": {"matchLabels": dict(labels)},
                         "template": {"metadata": {"labels": dict(labels)}}},
            }

    def add_pod(self, name: str, labels: dict[str, str], port: int, ready: bool = True, namespace: str = "dyad",
                annotations: dict[str, str] | None = None, ip: str = "127.0.0.1") -> Obj:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                            "annotations": dict(annotations or {}), "creationTimestamp": _now_iso()},
               "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
               "status": {"phase": "Running", "podIP": ip,
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        with self.cond:
            self._forced_ready[(namespace, name)] = ready
            return copy.deepcopy(self._put_pod(namespace, pod, "ADDED"))

    def patch_pod(self, name: str, patch: Obj, namespace: str = "dyad") -> Obj:
        with self.cond:
            pod = merge_patch(self.pods[(namespace, name)], patch)
            return copy.deepcopy(self._put_pod(namespace, pod, "MODIFIED"))

    def delete_pod(self, name: str, namespace: str = "dyad") -> None:
        with self.cond:
            self._remove_pod(namespace, name)

    def scale(self, name: str, replicas: int, namespace: str = "dyad") -> None:
        """Someone other than the actuator sets a workload's replicas (``kubectl scale``, an HPA)."""
        with self.cond:
            w = self.statefulsets.get((namespace, name)) or self.deployments[(namespace, name)]
            w["spec"]["replicas"] = replicas
            w["metadata"]["resourceVersion"] = str(self._bump())

    def delete_workload(self, name: str, namespace: str = "dyad") -> None:
        """The StatefulSet or Deployment is deleted (its pods stay, orphaned, as with ``--cascade=orphan``)."""
        with self.cond:
            self.statefulsets.pop((namespace, name), None)
            self.deployments.pop((namespace, name), None)

    def fail(self, verb: str, resource: str, status: int, times: int = 1, hang_s: float = 0.0,
             selector: str | None = None) -> None:
        """The next ``times`` calls of ``verb`` (get, list, patch, watch) on ``resource`` (pods,
        statefulsets/scale, deployments/scale, ...) answer ``status`` with a Status object (after
        ``hang_s`` seconds of silence; status 0: only the silence, then the normal answer); with
        ``selector``, only the list/watch calls with that ``labelSelector``."""
        with self.cond:
            self._faults.append([verb, resource, status, times, hang_s, selector])

    def _fault(self, verb: str, resource: str, selector: str | None = None) -> tuple[int, float] | None:
        with self.cond:
            for f in self._faults:
                if f[0] == verb and f[1] == resource and f[3] > 0 and f[5] in (None, selector):
                    f[3] -= 1
                    return f[2], f[4]
        return None

    def set_ready(self, name: str, ready: bool | None, namespace: str = "dyad") -> None:
        """Force a pod's Ready condition (None: back to the kubelet's probe)."""
        with self.cond:
            key = (namespace, name)
            if ready is None:
                self._forced_ready.pop(key, None)
                return
            self._forced_ready[key] = ready
            self._set_ready_locked(key, ready)

    def _set_ready_locked(self, key: tuple[str, str], ready: bool) -> None:
        pod = self.pods.get(key)
        if pod is None:
            return
        want = "True" if ready else "False"
        cond = pod["status"]["conditions"][0]
        if cond["status"] != want:
            pod = copy.deepcopy(pod)
            pod["status"]["conditions"][0]["status"] = want
            pod["status"]["conditions"][0]["lastTransitionTime"] = _now_iso()  # as the kubelet sets it
            self._put_pod(key[0], pod, "MODIFIED")

    def compact(self, upto: int | None = None) -> None:
        """Forget the events up to version ``upto`` (default: all of them): a watch resumed from a version
        older than ``upto`` gets 410 Gone."""
        with self.cond:
            if upto is None:
                upto = self._bump()
            self.compacted_rv = max(self.compacted_rv, upto)
            self.events = [e for e in self.events if e[0] > upto]

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (as a restarting API server or a proxy would)."""
        with self.cond:
            self._drop_generation += 1
            self.cond.notify_all()

    def pod(self, name: str, namespace: str = "dyad") -> Obj | None:
        with self.cond:
            p = self.pods.get((namespace, name))
            return copy.deepcopy(p) if p else None

    def pod_names(self, namespace: str = "dyad") -> list[str]:
        with self.cond:
            return sorted(n for ns, n in self.pods if ns == namespace)

    def replicas(self, name: str, namespace: str = "dyad") -> int:
        with self.cond:
            w = self.statefulsets.get((namespace, name)) or self.deployments[(namespace, name)]
            return int(w["spec"]["replicas"])

    def close(self) -> None:
        self._stop.set()
        self.drop_watches()
        self.server.shutdown()
        self.server.server_close()
        for (ns, name) in list(self.pods):
            if self.stop_engine is not None and self._created_at.get((ns, name)) is not None:
                self.stop_engine(name)

    # ------------------------------------------------------------------ the controller and kubelet
    def _control_loop(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                self._control_once()
            except Exception:  # a probe racing a deletion: next round
                pass
            self._stop.wait(interval_s)

    def _control_once(self) -> None:
        to_create: list[tuple[str, str, Obj]] = []
        to_delete: list[tuple[str, str]] = []
        to_probe: list[tuple[tuple[str, str], int]] = []
        with self.cond:
            for (ns, name), sts in self.statefulsets.items():
                n = int(sts["spec"]["replicas"])
                for i in range(n):
                    if (ns, f"{name}-{i}") not in self.pods:
                        to_create.append((ns, f"{name}-{i}", sts))
                for (pns, pname), pod in self.pods.items():
                    owner = pod["metadata"].get("labels", {}).get("statefulset.kubernetes.io/owner")
                    if pns == ns and owner == name and int(pname.rsplit("-", 1)[1]) >= n \
                            and (pns, pname) not in self._deleting:
                        to_delete.append((pns, pname))
            for (ns, name), dep in self.deployments.items():
                owned = sorted(((pname, pod) for (pns, pname), pod in self.pods.items() if pns == ns
                                and pod["metadata"]["labels"].get("fake.dyad/deployment") == name
                                and (pns, pname) not in self._deleting), key=lambda x: int(x[0].rsplit("-", 1)[1]))
                n = int(dep["spec"]["replicas"])
                for _ in range(n - len(owned)):
                    self._serial += 1
                    to_create.append((ns, f"{name}-{self._serial}", dep))

                def cost(item: tuple[str, Obj]) -> tuple:
                    pname, pod = item
                    ann = pod["metadata"].get("annotations") or {}
                    ready = pod["status"]["conditions"][0]["status"] == "True"
                    return (int(ann.get("controller.kubernetes.io/pod-deletion-cost", "0")), ready,
                            -int(pname.rsplit("-", 1)[1]))

                to_delete += [(ns, pname) for pname, _ in sorted(owned, key=cost)[:max(0, len(owned) - n)]]
            now = time.monotonic()
            for key, pod in self.pods.items():
                if key in self._forced_ready or key in self._deleting or key not in self._created_at:
                    continue
                if pod["status"]["conditions"][0]["status"] != "True" and now - self._created_at[key] >= self.ready_delay_s:
                    to_probe.append((key, pod["spec"]["containers"][0]["ports"][0]["containerPort"]))
        for ns, pname, sts in to_create:
            self._create_pod(ns, pname, sts)
        for ns, pname in to_delete:
            with self.cond:
                self._deleting.add((ns, pname))
                pod = copy.deepcopy(self.pods[(ns, pname)])
                pod["metadata"]["deletionTimestamp"] = _now_iso()
                pod["status"]["conditions"][0]["status"] = "False"
                self._put_pod(ns, pod, "MODIFIED")
            threading.Thread(target=self._terminate, args=(ns, pname), daemon=True).start()
        for key, port in to_probe:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    ok = r.status == 200
            except OSError:
                ok = False
            if ok:
                with self.cond:
                    if key not in self._deleting:
                        self._set_ready_locked(key, True)

    def _create_pod(self, ns: str, name: str, sts: Obj) -> None:
        port = self.start_engine(name) if self.start_engine is not None else 0
        kind = sts["kind"]
        labels = {**sts["spec"]["template"]["metadata"]["labels"],
                  **({"statefulset.kubernetes.io/pod-name": name, "statefulset.kubernetes.io/owner": sts["metadata"]["name"]}
                     if kind == "StatefulSet" else {"fake.dyad/deployment": sts["metadata"]["name"]})}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "labels": labels, "annotations": {},
                            "creationTimestamp": _now_iso(),
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind,
                                                 "name": sts["metadata"]["name"], "controller": True}]},
               "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
               "status": {"phase": "Running", "podIP": "127.0.0.1",
                          "conditions": [{"type": "Ready", "status": "False"}]}}
        with self.cond:
            self._created_at[(ns, name)] = time.monotonic()
            self._put_pod(ns, pod, "ADDED")

    def _terminate(self, ns: str, name: str) -> None:
        try:
            if self.stop_engine is not None:
                self.stop_engine(name)
        finally:
            with self.cond:
                self._remove_pod(ns, name)
                self._deleting.discard((ns, name))

    # ------------------------------------------------------------------ HTTP
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Obj) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                  "reason": reason, "code": code})

            def _injected(self, verb: str, resource: str, selector: str | None = None) -> bool:
                """Answer an injected fault (``FakeKubeApiServer.fail``) instead of the call; True if so."""
                f = fake._fault(verb, resource, selector)
                if f is None:
                    return False
                status, hang_s = f
                if hang_s:
                    time.sleep(hang_s)
                if not status:
                    return False
                reasons = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Gone", 422: "Invalid",
                           429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}
                self._status(status, reasons.get(status, "Unknown"), f"injected fault: {verb} {resource} answers {status}")
                return True

            def _route(self, method: str) -> None:
                url = urlsplit(self.path)
                q = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
                parts = url.path.strip("/").split("/")
                body = None
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    body = json.loads(self.rfile.read(n))
                auth = self.headers.get("Authorization", "")
                self.user = fake.tokens.get(auth.removeprefix("Bearer "), "") if fake.tokens else "anonymous"
                if not self.user:
                    return self._status(401, "Unauthorized", "Unauthorized")
                if method == "PATCH" and self.headers.get("Content-Type") != "application/merge-patch+json":
                    return self._status(415, "UnsupportedMediaType", "only application/merge-patch+json here")
                # /api/v1/namespaces/{ns}/pods[/{name}]
                if parts[:3] == ["api", "v1", "namespaces"] and len(parts) in (5, 6) and parts[4] == "pods":
                    ns = parts[3]
                    if len(parts) == 5 and method == "GET":
                        if q.get("watch") in ("true", "1"):
                            fake.requests.append((self.user, "watch", "pods"))
                            if self._injected("watch", "pods", q.get("labelSelector")):
                                return None
                            return self._watch(ns, q)
                        fake.requests.append((self.user, "list", "pods"))
                        if self._injected("list", "pods", q.get("labelSelector")):
                            return None
                        return self._list(ns, q)
                    if len(parts) == 6:
                        if self._injected(method.lower(), "pods"):
                            return None
                        return self._pod(method, ns, parts[5], body)
                # /apis/apps/v1/namespaces/{ns}/statefulsets/{name}[/scale]
                if parts[:4] == ["apis", "apps", "v1", "namespaces"] and len(parts) in (7, 8) \
                        and parts[5] in ("statefulsets", "deployments"):
                    resource = parts[5] + ("/" + parts[7] if len(parts) == 8 else "")
                    if self._injected(method.lower(), resource):
                        return None
                    return self._workload(parts[5], method, parts[4], parts[6], parts[7] if len(parts) == 8 else None,
                                          body)
                return self._status(404, "NotFound", f"the fake API server does not serve {url.path}")

            def do_GET(self) -> None:
                self._route("GET")

            def do_PATCH(self) -> None:
                self._route("PATCH")

            def do_PUT(self) -> None:
                self._route("PUT")

            def do_DELETE(self) -> None:
                self._route("DELETE")

            def do_POST(self) -> None:
                self._route("POST")

            def _list(self, ns: str, q: dict[str, str]) -> None:
                sel = parse_selector(q.get("labelSelector", ""))
                with fake.cond:
                    items = [copy.deepcopy(p) for (pns, _), p in sorted(fake.pods.items())
                             if pns == ns and matches(p["metadata"].get("labels", {}), sel)]
                    rv = fake.rv
                self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)},
                                 "items": items})

            def _pod(self, method: str, ns: str, name: str, body: Obj | None) -> None:
                with fake.cond:
                    pod = fake.pods.get((ns, name))
                    if pod is None:
                        return self._status(404, "NotFound", f'pods "{name}" not found')
                    if method == "GET":
                        fake.requests.append((self.user, "get", "pods"))
                        return self._send(200, copy.deepcopy(pod))
                    if method == "PATCH":
                        fake.requests.append((self.user, "patch", "pods"))
                        fake.patches.append((time.monotonic(), self.path, body or {}))
                        patched = merge_patch(pod, body or {})
                        return self._send(200, copy.deepcopy(fake._put_pod(ns, patched, "MODIFIED")))
                return self._status(405, "MethodNotAllowed", f"{method} pods is not served by the fake")

            def _workload(self, kind: str, method: str, ns: str, name: str, sub: str | None, body: Obj | None) -> None:
                with fake.cond:
                    sts = (fake.statefulsets if kind == "statefulsets" else fake.deployments).get((ns, name))
                    if sts is None:
                        return self._status(404, "NotFound", f'{kind}.apps "{name}" not found')
                    if sub is None and method == "GET":
                        fake.requests.append((self.user, "get", kind))
                        return self._send(200, copy.deepcopy(sts))
                    if sub != "scale" or method not in ("GET", "PATCH"):
                        return self._status(405, "MethodNotAllowed", f"only get/patch of {kind}/scale")
                    fake.requests.append((self.user, "get" if method == "GET" else "patch", f"{kind}/scale"))
                    if method == "PATCH":
                        fake.patches.append((time.monotonic(), self.path, body or {}))
                        n = (body or {}).get("spec", {}).get("replicas")
                        if not isinstance(n, int) or n < 0:
                            return self._status(422, "Invalid", "spec.replicas: must be a non-negative integer")
                        sts["spec"]["replicas"] = n
                        sts["metadata"]["resourceVersion"] = str(fake._bump())
                    labels = sts["spec"]["selector"]["matchLabels"]
                    owner_label = "statefulset.kubernetes.io/owner" if kind == "statefulsets" else "fake.dyad/deployment"
                    current = sum(1 for (pns, _), p in fake.pods.items() if pns == ns
                                  and p["metadata"]["labels"].get(owner_label) == name)
                    scale = {"kind": "Scale", "apiVersion": "autoscaling/v1",
                             "metadata": {"name": name, "namespace": ns,
                                          "resourceVersion": sts["metadata"]["resourceVersion"]},
                             "spec": {"replicas": sts["spec"]["replicas"]},
                             "status": {"replicas": current,
                                        "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}}
                return self._send(200, scale)

            def _watch(self, ns: str, q: dict[str, str]) -> None:
                sel = parse_selector(q.get("labelSelector", ""))
                bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
                deadline = time.monotonic() + float(q.get("timeoutSeconds") or 1800)
                since = q.get("resourceVersion") or ""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def emit(event: Obj) -> None:
                    data = (json.dumps(event) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                def visible(p: Obj | None) -> bool:
                    return p is not None and p["metadata"]["namespace"] == ns and matches(
                        p["metadata"].get("labels", {}), sel)

                with fake.cond:
                    generation = fake._drop_generation
                    if since in ("", "0"):
                        cursor = fake.rv
                        initial = [copy.deepcopy(p) for (pns, _), p in sorted(fake.pods.items()) if visible(p)]
                    else:
                        cursor, initial = int(since), []
                        if cursor < fake.compacted_rv:
                            emit({"type": "ERROR", "object": {
                                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                                "code": 410, "message": f"too old resource version: {cursor} ({fake.compacted_rv})"}})
                            self.wfile.write(b"0\r\n\r\n")
                            return
                with fake.cond:
                    fake.active_watches += 1
                try:
                    for p in initial:
                        emit({"type": "ADDED", "object": p})
                    last_bookmark = time.monotonic()
                    while True:
                        with fake.cond:
                            out = []
                            for rv, kind, pod, before in fake.events:
                                if rv <= cursor:
                                    continue
                                now_in, was_in = visible(pod), visible(before)
                                if kind == "ADDED" and now_in or kind == "MODIFIED" and now_in and was_in:
                                    out.append({"type": kind, "object": pod})
                                elif kind == "MODIFIED" and now_in:
                                    out.append({"type": "ADDED", "object": pod})
                                elif kind == "MODIFIED" and was_in or kind == "DELETED" and was_in:
                                    out.append({"type": "DELETED", "object": pod})
                            cursor = fake.rv
                            dropped = fake._drop_generation != generation
                            bookmark = None
                            if bookmarks and not out and time.monotonic() - last_bookmark >= fake.bookmark_interval_s:
                                bookmark = {"type": "BOOKMARK", "object": {
                                    "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(cursor)}}}
                                last_bookmark = time.monotonic()
                            if not out and bookmark is None and not dropped:
                                fake.cond.wait(min(0.2, fake.bookmark_interval_s))
                        if dropped or fake._stop.is_set():
                            self.close_connection = True
                            self.connection.shutdown(2)  # mid-stream: no terminating chunk
                            return
                        for e in out:
                            emit(e)
                        if bookmark is not None:
                            emit(bookmark)
                        if time.monotonic() >= deadline:
                            self.wfile.write(b"0\r\n\r\n")
                            return
                except (BrokenPipeError, ConnectionResetError, OSError):
                    self.close_connection = True
                finally:
                    with fake.cond:
                        fake.active_watches -= 1

        return Handler
