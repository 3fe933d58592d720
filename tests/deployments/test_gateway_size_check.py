"""The gateway in-process, the size check: a request larger than a replica ever holds is refused by
the replica (a real ``Admission`` in a fake replica) and rendered as the same 400 ``too_large``,
also while the load shedder has the model marked full. No Ray, no Serve, no engine."""

import httpx
from gateway_fakes import FakeReplica, _client, _run, make_gateway

from kvserve.deployments.contract.types import GenerationChunk
from kvserve.deployments.gateway.api import build_api


class SizedReplica(FakeReplica):
    """A fake replica that checks a request's size as ``LLMServer.stream`` does, with a real
    :class:`~kvserve.deployments.replica.admission.Admission` (9 requests in flight at most)."""

    def __init__(self):
        from kvserve.deployments.replica.admission import Admission

        super().__init__()
        self.admission = Admission(max_num_seqs=8, max_waiting_requests=1, max_prompt_tokens=1000)

    async def _chunks(self, request):
        too_large = self.admission.never_fits(request.n, request.num_prompts)
        if too_large is not None:
            yield GenerationChunk.failed(too_large)
            return
        async for chunk in super()._chunks(request):
            yield chunk


def test_the_size_check_is_the_replicas_and_renders_as_the_same_400():
    """A batch of prompts x choices larger than a replica holds at once is refused by the
    replica, which knows its bound (the gateway has none to check), with the 400 the gateway used
    to give: code ``too_large``, param ``prompt``, the numbers in the message; one prompt with
    too many choices likewise; a batch that fits runs."""
    replica = SizedReplica()

    async def main():
        async with _client(replica) as c:
            big = await c.post("/v1/completions", json={"prompt": ["hi"] * 10, "max_tokens": 1})
            sent = list(replica.requests)
            many = await c.post("/v1/completions", json={"prompt": "hi", "n": 10, "max_tokens": 1})
            fits = await c.post("/v1/completions", json={"prompt": ["hi"] * 9, "max_tokens": 1})
            return big, sent, many, fits

    big, sent, many, fits = _run(main())
    assert big.status_code == 400 and big.json()["error"] == {
        "message": "10 prompts x 1 choices in one request; a replica of this model takes at most 9 requests at once "
        "(max_num_seqs + max_waiting_requests), so this request can never be admitted: send fewer "
        "prompts or choices per request",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "too_large",
    }
    assert len(sent) == 10 and {r.num_prompts for r in sent} == {10}  # the gateway sent it: no check of its own
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_large"
    assert many.json()["error"]["param"] is None and "n=10" in many.json()["error"]["message"]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 9


def test_a_batch_larger_than_the_capacity_seen_gets_the_replicas_verdict_under_a_full_mark():
    """While the model is marked full (the load shedder refuses at once what would exceed the
    capacity it saw), a batch larger than that capacity still goes to the replica: it may never
    fit, and then its answer is the replica's 400 ``too_large``, not a 429 no retry could fix."""
    replica = SizedReplica()
    gw = make_gateway(replica)
    gw.shedder.open["fake"] = 9
    gw.shedder.refused("fake", 3.0)  # the replica said "full" with 9 open: capacity 9
    gw.shedder.open["fake"] = 1

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            return (
                await c.post("/v1/completions", json={"prompt": ["hi"] * 10, "max_tokens": 1}),
                await c.post("/v1/completions", json={"prompt": ["hi"] * 9, "max_tokens": 1}),
            )

    big, full = _run(main())
    assert big.status_code == 400 and big.json()["error"]["code"] == "too_large"
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"  # 1 open + 9 > 9: shed here
    assert len(replica.requests) == 10
