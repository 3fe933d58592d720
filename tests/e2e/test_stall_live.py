"""Nothing a request sends stalls its replica, through a real Serve app (issue 63).

An app on the tiny model (engine core process on, as shipped) gets a request whose regex is a
few KB (far under every size limit) but takes xgrammar many seconds to compile, while three
long streams run on the same replica and ``/health`` is probed over and over. Before, the
compile ran in the engine core's input thread, the health check queued behind it, the replica's
2 s probe declared the engine dead, every stream failed and Serve reloaded the replica. Now the
compile runs in its own pool under ``compile_timeout_s`` (the request alone gets a 400 naming the
limit, or its answer on a machine that compiles it in time), every probe is answered, every
stream completes and the replica is the same actor before and after.
"""

import asyncio
import json

import httpx
import pytest
from _faults_helpers import (
    StreamResult,
    _wait_ready,
    _alive_llm_replicas,
    _app_args,
    _assert_completed,
    _deploy,
    _long_body,
    _stream,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: ~14 s of xgrammar compile on two cores; 5.8 KB
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 260)) + ")"
COMPILE_TIMEOUT_S = 5.0


def test_a_slow_grammar_and_health_probes_leave_the_replica_and_its_streams_whole(serve_app, tiny_llama_path):
    from ray import serve

    name, route, served = "kvserve-stall", "/stall", "tiny-stall"
    args = _app_args(
        tiny_llama_path, served, num_replicas=1, structured_outputs_config={"compile_timeout_s": COMPILE_TIMEOUT_S}
    )
    base = f"{serve_app.root}{route}"
    _deploy(args, name, route)
    try:
        _wait_ready(base)
        [replica] = _alive_llm_replicas(name)

        async def main():
            async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
                url = f"{base}/v1/completions"
                long = [StreamResult() for _ in range(3)]
                tasks = [
                    asyncio.create_task(
                        _stream(client, url, {**_long_body(), "model": served, "prompt": f"Count {i}: one, two,"}, r)
                    )
                    for i, r in enumerate(long)
                ]
                await asyncio.wait_for(asyncio.gather(*(r.first_token.wait() for r in long)), 120)
                big = asyncio.create_task(
                    client.post(
                        url,
                        json={
                            "model": served,
                            "prompt": "Pick:",
                            "max_tokens": 8,
                            "cache": False,
                            "structured_outputs": {"regex": SLOW_REGEX},
                        },
                    )
                )
                probes, in_flight = [], None
                while not big.done():
                    probes.append((await client.get(f"{base}/health")).status_code)
                    if in_flight is None:
                        in_flight = sum(not t.done() for t in tasks)  # streams running beside the compile
                    await asyncio.sleep(0.25)  # pacing of the probes, not a wait for anything
                await asyncio.gather(*tasks)
                after = (await client.get(f"{base}/health")).status_code
                return long, big.result(), probes, in_flight, after

        long, big, probes, in_flight, after = asyncio.run(main())
        assert in_flight, "the long streams ended before the first probe: nothing was in flight"
        assert probes and set(probes) == {200}, probes  # each probe answered, none queued behind the compile
        for res in long:
            _assert_completed(res)  # every token, finish_reason length, [DONE]: nothing failed
        if big.status_code == 400:  # past its deadline: refused alone, naming the limit
            err = big.json()["error"]
            assert "compile_timeout_s" in err["message"] and err["code"] == "invalid_value", err
        else:  # a machine fast enough compiles it within the deadline
            assert big.status_code == 200, big.text[:300]
            assert json.loads(big.text)["choices"][0]["finish_reason"] in ("stop", "length")
        assert after == 200
        assert _alive_llm_replicas(name) == [replica]  # the same replica actor: not reloaded
    finally:
        serve.delete(name)
