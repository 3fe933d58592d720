"""OpenTelemetry traces (kvserve/telemetry/tracing.py, kvserve/deployments/gateway/tracing.py, kvserve/deployments/replica/tracing.py)
against real OTLP receivers in the test, the protocol decoded with ``opentelemetry-proto``: OTLP
over HTTP (a plain HTTP server) and over gRPC (a ``TraceService`` server); a request through the
gateway to a real engine gives one trace under the client's ``traceparent``: the gateway's
request span, its pipeline steps, and the replica's ``llm_request`` with its phases, across the
pickled hop of tests/local_app.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from helpers import free_port
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvserve.telemetry.tracing import resolve_protocol, tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver:
    """What an OTLP receiver got: every span of every export, flattened."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def add(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in req.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append((service, s))

    def of_trace(self, trace_id_hex: str):
        with self.lock:
            return [s for _, s in self.spans if s.trace_id.hex() == trace_id_hex]


@pytest.fixture(scope="module")
def http_receiver():
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf":
                got.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
            else:
                self.send_response(415)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield got, f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = (
            v.string_value
            if v.HasField("string_value")
            else v.int_value
            if v.HasField("int_value")
            else v.double_value
            if v.HasField("double_value")
            else v.bool_value
        )
    return out


def test_grpc_exporter_reaches_a_grpc_receiver():
    import grpc

    got = Receiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t = tracing(f"http://127.0.0.1:{port}", "grpc", service_name="kvserve-grpc-test")
        parent = t.extract({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        t.start_span("probe", parent, kind="server", attributes={"k": 1}).end()
        assert t.flush(20)
        spans = got.of_trace(TRACE_ID)
        assert [s.name for s in spans] == ["probe"] and spans[0].parent_span_id.hex() == PARENT_ID
        assert _attrs(spans[0]) == {"k": 1}
        assert ("kvserve-grpc-test", spans[0]) in got.spans
    finally:
        server.stop(0)


def test_protocol_and_ratio_checks(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert resolve_protocol(None) == "http/protobuf"
    assert resolve_protocol("grpc") == "grpc"
    with pytest.raises(ValueError, match="protocol"):
        resolve_protocol("http/json")
    with pytest.raises(ValueError, match="ratio"):
        tracing("http://127.0.0.1:1/v1/traces", "http/protobuf", sample_ratio=2.0)
    assert tracing(None) is None and tracing("") is None


def test_off_by_default_loads_no_exporter():
    """(Ray itself imports the OpenTelemetry SDK; what tracing adds, the OTLP exporters and a
    span processor's thread, stays out unless an endpoint is configured.)"""
    code = (
        "import sys; from kvserve.deployments.gateway.core import Gateway; from kvserve.deployments.replica.llm_server import "
        "LLMServer; from kvserve.deployments.contract.config import TracingArgs; from kvserve.telemetry.tracing import tracing; "
        "assert TracingArgs().otlp_traces_endpoint is None and tracing(None) is None; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.exporter.otlp')))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_request_is_one_trace_from_the_client_to_the_engine(tiny_llama_path, http_receiver):
    from local_app import LocalApp

    got, endpoint = http_receiver
    app = LocalApp(
        {
            "/": {
                "model": str(tiny_llama_path),
                "served_model_name": "tiny",
                "max_model_len": 256,
                "torch_num_threads": 1,
                "otlp_traces_endpoint": endpoint,
                "otlp_traces_protocol": "http/protobuf",
            }
        }
    ).start()
    try:
        r = httpx.post(
            f"{app.namespace().base_url}/chat/completions",
            timeout=120,
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "trace-test-1"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 5,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        # an untraced request starts a trace of its own (a new root)
        assert (
            httpx.post(
                f"{app.namespace().base_url}/completions",
                timeout=120,
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            ).status_code
            == 200
        )
    finally:
        app.stop()
    assert tracing(endpoint, "http/protobuf").flush(20)
    spans = {s.name: s for s in got.of_trace(TRACE_ID)}
    assert set(spans) == {
        "POST /v1/chat/completions",
        "cache_lookup",
        "key_admission",
        "routing",
        "llm_request",
        "queue",
        "prefill",
        "decode",
    }, sorted(spans)
    root = spans["POST /v1/chat/completions"]
    assert root.parent_span_id.hex() == PARENT_ID and root.kind == root.SPAN_KIND_SERVER
    for step in ("cache_lookup", "key_admission", "routing"):
        assert spans[step].parent_span_id == root.span_id, step
    llm = spans["llm_request"]
    assert llm.parent_span_id == spans["routing"].span_id  # across the replica hop
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase].parent_span_id == llm.span_id
    assert (
        spans["queue"].end_time_unix_nano <= spans["prefill"].end_time_unix_nano <= spans["decode"].end_time_unix_nano
    )
    a = _attrs(llm)
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert a["gen_ai.response.model"] == "tiny" and a["gen_ai.request.max_tokens"] == 5
    assert (
        a["gen_ai.latency.time_to_first_token"] >= 0
        and a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
    )
    ra = _attrs(root)
    assert ra["gen_ai.usage.completion_tokens"] == 5 and ra["kvserve.outcome"] == "ok"
    assert ra["kvserve.request_id"] == "trace-test-1"
    assert _attrs(spans["cache_lookup"])["kvserve.cache"] == "bypass"
    # the other request: its own root, with its replica span too
    others = [s for _, s in got.spans if s.trace_id.hex() != TRACE_ID]
    assert {"POST /v1/completions", "llm_request"} <= {s.name for s in others}
