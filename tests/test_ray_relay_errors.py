"""The Ray ingress's relay when Ray itself refuses a request: a deployment that failed to deploy, a full queue or a
replica gone before it took the request are a 503 with a message (retry), never a 500 with Ray's traceback; a replica
lost before accepting is tried once more elsewhere. Runs the relay against stand-in handles: no Ray cluster."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402
from ray.serve._private.common import DeploymentID  # noqa: E402
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError  # noqa: E402

from slora_jax.serve.asgi_relay import RelayedRequest, ResponseStart  # noqa: E402
from slora_jax.serve.ray_app import RelayedResponse, SloraIngress  # noqa: E402

RELAY = next(c for c in SloraIngress.__mro__ if "relay" in vars(c)).relay  # the method under Ray's ingress wrapper
ACCEPTED = object()


class Stream:
    """A replica's answer stream: each item is yielded, or raised if it is an exception."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Handle:
    """``replicas.options(...).forward.remote(...)``: a planned stream per call, or the exception the call raises."""

    def __init__(self, *plans):
        self.plans, self.calls = list(plans), 0
        self.forward = self

    def options(self, **kwargs):
        return self

    def remote(self, req, routing):
        self.calls += 1
        plan = self.plans.pop(0)
        if isinstance(plan, BaseException):
            raise plan
        return plan


def relay(handle):
    ingress = SimpleNamespace(replicas=handle, routing="affinity")
    req = RelayedRequest("POST", "/v1/completions", b"", [], b"{}", None)
    return asyncio.run(RELAY(ingress, req, "demo-001"))


def body(response) -> dict:
    return json.loads(bytes(response.body))


@pytest.mark.parametrize("error", [DeploymentUnavailableError(DeploymentID("SloraReplica", "slora")),
                                   BackPressureError(num_queued_requests=9, max_queued_requests=8)])
@pytest.mark.parametrize("where", ["remote", "stream"])
def test_a_deployment_that_cannot_take_requests_is_a_503_with_a_message(error, where):
    handle = Handle(error if where == "remote" else Stream([error]))
    response = relay(handle)
    assert response.status_code == 503, body(response)
    message = body(response)["error"]["message"]
    assert type(error).__name__ in message and "retry" in message
    assert handle.calls == 1  # the whole deployment is out: no second try


@pytest.mark.parametrize("lost", [RayActorError(), ReplicaUnavailableError("replica-1")])
def test_a_replica_lost_before_accepting_is_tried_once_more_then_503(lost):
    start = ResponseStart(200, [(b"content-type", b"application/json")])
    handle = Handle(Stream([lost]), Stream([ACCEPTED, start, b"{}"]))
    response = relay(handle)
    assert isinstance(response, RelayedResponse) and response.status_code == 200 and handle.calls == 2
    response = relay(Handle(Stream([lost]), Stream([lost])))
    assert response.status_code == 503 and "stopped before taking it" in body(response)["error"]["message"]
    response = relay(Handle(Stream([ACCEPTED, lost])))  # took it, then was lost before its answer started
    assert response.status_code == 503 and "stopped" in body(response)["error"]["message"]
