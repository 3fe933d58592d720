"""Load test of the HTTP server: the sustainable request rate at a TTFT SLO, then 1x / 2x / 3x it.

What it does
------------
1. Rate search (unless ``--rate`` is given): short open-loop Poisson runs (``--search-duration``
   seconds each), doubling the rate from ``--search-start`` until a run fails, then
   ``--search-bisect`` bisection steps. A run *passes* when no request is lost, at most
   ``--max-reject`` of its requests are rejected (429 / 503 / in-stream error: once the server
   bounds its queues, overload shows as rejections, not as TTFT), and the p99 TTFT of the
   completed requests is at most ``--slo-ttft``. The sustainable rate is the highest rate that
   passed.
2. Three runs of ``--duration`` seconds (or ``--num-requests`` requests) of Poisson arrivals at
   1x, 2x and 3x that rate.

Per run: goodput (completed requests with TTFT <= SLO per second, and their output tokens/s),
p50 / p90 / p99 of TTFT, ITL (gap between streamed content chunks) and E2E of the completed
(admitted) requests, counts of HTTP 200 / 429 / 503 / other, and every request's outcome:

* ``complete``: HTTP 200, an SSE stream with a ``finish_reason`` that ends in ``data: [DONE]``;
* clean rejections: ``rejected_429`` / ``rejected_503`` (that status with an OpenAI error body
  ``{"error": {"message": ...}}``), ``rejected_in_stream`` (``data: {"error": ...}`` followed by
  ``data: [DONE]``);
* lost (neither): ``lost_timeout`` (no full answer within ``--request-timeout``),
  ``lost_connection`` (refused / reset / closed mid-stream), ``lost_truncated`` (a 200 stream
  without ``[DONE]``, without a ``finish_reason``, or an error event not followed by ``[DONE]``),
  ``lost_bad_rejection`` (429 / 503 without an OpenAI error body), ``lost_http_error`` (any other
  status: 500, 400, ...).

Targets (issue): nothing lost at 3x; p99 TTFT of admitted requests at 3x <= 2x the 1x run's.

Why aiohttp and not guidellm or locust
--------------------------------------
The issue asks for a maintained load tool, or aiohttp if neither fits. Both were tried here
(guidellm 0.8.1 and locust 2.47, installed from PyPI for the comparison) and neither can do what is measured:

* guidellm 0.8.1 has open-loop arrivals (``--profile kind=poisson``), offline synthetic prompts
  (``--data kind=synthetic_text`` with a local ``--tokenizer``) and keeps a record per request,
  but, run against a stub server that answers each failure kind in turn, it
  (a) calls ``raise_for_status()`` on a non-2xx answer without reading the body: the status
  survives only as text inside ``repr(HTTPStatusError)``, so a 429 with an OpenAI error body
  and a 429 with ``busy`` as body are the same record (a clean rejection cannot be told from a
  broken one) and ``Retry-After`` is not kept;
  (b) ignores ``finish_reason`` and does not require ``data: [DONE]``: a stream closed after
  its last token without ``[DONE]``, and one with ``[DONE]`` but no ``finish_reason``, are both
  recorded as *successful*, which are exactly the truncated answers a "nothing lost" check
  has to catch;
  (c) keeps only first / last token times and a chunk count per request, so there is no
  per-chunk ITL (its ITL is a per-request mean);
  (d) took 41 s wall and 16 s CPU for 9 requests (spawned worker processes, each loading the
  tokenizer), on a 2-core machine that it shares with the server under test.
* locust is closed-loop: each simulated user waits for its own response before its next
  request, so under overload the arrival rate falls with the server (coordinated omission) and
  the overload this test is about never shows; it has no arrival-rate mode, and it keeps only
  aggregated statistics (per-request records would have to be written in its event hooks).

So the requests are sent with aiohttp (one session, no connection limit) at pre-drawn Poisson
arrival times (seeded; the sender sleeps to each absolute arrival time, so a late request
does not delay the next; the lateness is reported), and every response is read to its end.

Prompts: ``--prompt-tokens`` tokens *after* the chat template (random words that are single
tokens of the model's own tokenizer, loaded from the local model folder: no hub access),
``--output-tokens`` tokens out (``max_tokens`` with ``ignore_eos``), greedy, streaming
``/v1/chat/completions``.

Usage::

    python benchmarks/load_test.py --start-server                   # full run, writes benchmarks/results/
    python benchmarks/load_test.py --url http://127.0.0.1:8000/v1   # a running server
    python benchmarks/load_test.py --rate 1.5 --duration 60          # skip the search
    python benchmarks/load_test.py --start-server --search-start 1 --search-duration 10 \\
        --search-bisect 0 --duration 10 --out /tmp/load_test.json    # a smoke run

Results: ``benchmarks/results/load_test.json`` and ``benchmarks/results/load_test.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer comes from the local model folder

from benchmarks.common import Figures, Results, free_port, load_average, percentile, pyplot  # noqa: E402

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "tool",
    "url",
    "model",
    "server_started_here",
    "server_args",
    "workload",
    "slo_ttft_s",
    "started",
    "search",
    "sustainable_rate_rps",
    "runs",
    "targets",
    "nothing_lost_any_run",
)
COMPLETE = "complete"
CLEAN_REJECTIONS = ("rejected_429", "rejected_503", "rejected_in_stream")
LOST = ("lost_timeout", "lost_connection", "lost_truncated", "lost_bad_rejection", "lost_http_error")
OUTCOMES = (COMPLETE, *CLEAN_REJECTIONS, *LOST)


# ---- one streamed request -------------------------------------------------------------------
@dataclass
class Rec:
    """One request: when it was due and sent, what came back and how it is classified."""

    index: int
    due: float = 0.0  # scheduled arrival, s after the run's start
    sent: float = 0.0  # actual send time, s after the run's start
    status: int | None = None  # HTTP status (None: no response at all)
    outcome: str = ""
    detail: str | None = None  # error text, for anything but complete
    retry_after: str | None = None
    ttft: float | None = None  # s, first content chunk
    itl: list[float] = field(default_factory=list)  # s, between content chunks
    e2e: float | None = None  # s, send -> [DONE] (or the end of the exchange)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (usage.prompt_tokens_details)


def is_openai_error(obj) -> bool:
    """``{"error": {"message": str, ...}}``, OpenAI's error body."""
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) and isinstance(obj["error"].get("message"), str)


async def stream_chat(
    session, url: str, body: dict, headers: dict, timeout: float, rec: Rec, t_base: float = 0.0
) -> Rec:
    """POST one streaming chat request and classify the answer into ``rec`` (see the module
    docstring). ``t_base`` is the run's start on ``time.perf_counter``'s clock. Never raises
    (but for cancellation)."""
    import aiohttp

    t0 = time.perf_counter()
    rec.sent = t0 - t_base
    done = False
    err = None
    last = None
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = await resp.text(errors="replace")
                rec.e2e = time.perf_counter() - t0
                rec.retry_after = resp.headers.get("Retry-After")
                rec.detail = f"HTTP {resp.status}: {text[:300]}"
                try:
                    clean = is_openai_error(json.loads(text))
                except ValueError:
                    clean = False
                if resp.status in (429, 503):
                    rec.outcome = f"rejected_{resp.status}" if clean else "lost_bad_rejection"
                else:
                    rec.outcome = "lost_http_error"
                return rec
            async for raw in resp.content:  # one line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    err = obj
                    continue
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    rec.output_tokens = obj["usage"].get("completion_tokens")
                    rec.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        if rec.ttft is None:
                            rec.ttft = now - t0
                        else:
                            rec.itl.append(now - last)
                        last = now
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
        rec.e2e = time.perf_counter() - t0
        if err is not None:
            rec.detail = f"in-stream error: {json.dumps(err)[:300]}"
            rec.outcome = "rejected_in_stream" if done and is_openai_error(err) else "lost_truncated"
        elif done and rec.finish_reason:
            rec.outcome = COMPLETE
        else:
            rec.outcome = "lost_truncated"
            rec.detail = "stream ended without [DONE]" if not done else "no finish_reason before [DONE]"
    except asyncio.CancelledError:
        raise
    except TimeoutError as e:  # asyncio's and aiohttp's timeouts are TimeoutError
        rec.outcome, rec.detail = "lost_timeout", f"no full answer within {timeout} s ({type(e).__name__})"
        rec.e2e = time.perf_counter() - t0
    except (aiohttp.ClientError, OSError) as e:
        rec.outcome, rec.detail = "lost_connection", f"{type(e).__name__}: {e}"[:300]
        rec.e2e = time.perf_counter() - t0
    except ValueError as e:  # a data line that is not JSON
        rec.outcome, rec.detail = "lost_truncated", f"bad SSE data: {e}"[:300]
        rec.e2e = time.perf_counter() - t0
    return rec


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- prompts --------------------------------------------------------------------------------
def load_tokenizer(path: str | None):
    """The model's tokenizer from its local folder (``kvserve.engine.model_loader.resolve_model``:
    None is the bundled SmolLM2-135M-Instruct)."""
    from transformers import AutoTokenizer

    from kvserve.engine.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(path)))


def make_prompts(tokenizer, n: int, prompt_tokens: int, seed: int) -> tuple[list[str], list[int]]:
    """``n`` distinct user messages of random words, each ``prompt_tokens`` tokens long once the
    chat template is applied (as close as the template allows); returns them and their counts."""

    def templated(text: str) -> int:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    # words that are one token each with their leading space ("Ġword" in a byte-level BPE)
    words = [
        w
        for w, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower() and 3 <= len(w) <= 9
    ]
    words = [w[1:] for w in words[:20000]]
    overhead = templated("x") - 1
    rng = random.Random(seed)
    prompts, counts = [], []
    for _ in range(n):
        k = max(1, prompt_tokens - overhead)
        text = " ".join(rng.choice(words) for _ in range(k))
        c = templated(text)
        while c > prompt_tokens and k > 1:  # a merge at the edges: trim to fit
            k -= 1
            text = text.rsplit(" ", 1)[0]
            c = templated(text)
        prompts.append(text)
        counts.append(c)
    return prompts, counts


# ---- one open-loop run ----------------------------------------------------------------------
def poisson_arrivals(rate: float, seed: int, duration: float | None = None, count: int | None = None) -> list[float]:
    """Arrival times (s from the start) of a Poisson process: ``count`` of them, or all that
    fall before ``duration``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if (count is not None and len(out) >= count) or (count is None and t >= duration):
            return out
        out.append(t)


def output_range(text: str) -> tuple[int, int]:
    """``"64"`` -> (64, 64); ``"16-128"`` -> (16, 128) (argparse type of ``--output-tokens``)."""
    lo, _, hi = str(text).partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"want N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def output_lengths(n: int, lo_hi: tuple[int, int], seed: int) -> list[int]:
    """``max_tokens`` of request i: uniform in [lo, hi], seeded (the same draw at every rate).
    Equal lengths would make requests admitted together finish together, so completions (and
    free batch slots) come in waves, a synthetic worst case for any queue."""
    rng = random.Random(seed)
    return [rng.randint(*lo_hi) for _ in range(n)]


async def run_open_loop(
    url: str,
    model: str,
    api_key: str | None,
    prompts: list[str],
    output_tokens: tuple[int, int],
    arrivals: list[float],
    timeout: float,
    seed: int = 0,
) -> tuple[list[Rec], float]:
    """Send request i at ``arrivals[i]`` (prompt ``prompts[i % len]``) whatever the answers so
    far; wait for every answer. Returns the records and the wall time from the start to the
    last answer."""
    import aiohttp

    endpoint = url.rstrip("/") + "/chat/completions"
    headers = auth_headers(api_key)
    recs = [Rec(index=i, due=a) for i, a in enumerate(arrivals)]
    lengths = output_lengths(len(recs), output_tokens, seed)
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        tasks = []
        for rec in recs:
            delay = t0 + rec.due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = chat_body(model, prompts[rec.index % len(prompts)], lengths[rec.index])
            tasks.append(asyncio.create_task(stream_chat(session, endpoint, body, headers, timeout, rec, t0)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return recs, elapsed


# ---- metrics --------------------------------------------------------------------------------
def dist_ms(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": len(xs),
        "mean": 1000 * sum(xs) / len(xs),
        "p50": 1000 * percentile(xs, 50),
        "p90": 1000 * percentile(xs, 90),
        "p99": 1000 * percentile(xs, 99),
        "max": 1000 * max(xs),
    }


def status_counts(recs: list[Rec]) -> dict:
    c = {"200": 0, "429": 0, "503": 0, "other": 0}
    other: dict[str, int] = {}
    for r in recs:
        k = str(r.status) if r.status is not None else "no_response"
        if k in c:
            c[k] += 1
        else:
            c["other"] += 1
            other[k] = other.get(k, 0) + 1
    return {**c, "other_detail": other}


def summarize(name: str, rate: float, recs: list[Rec], elapsed: float, slo_s: float, duration: float | None) -> dict:
    outcomes = {o: 0 for o in OUTCOMES}
    for r in recs:
        outcomes[r.outcome] += 1
    done = [r for r in recs if r.outcome == COMPLETE]
    good = [r for r in done if r.ttft is not None and r.ttft <= slo_s]
    lost = [r for r in recs if r.outcome in LOST]
    rejected = sum(outcomes[o] for o in CLEAN_REJECTIONS)
    n = len(recs)
    rejections_429 = [r for r in recs if r.outcome == "rejected_429"]
    out_tok = sum(r.output_tokens or 0 for r in done)
    good_tok = sum(r.output_tokens or 0 for r in good)
    lateness = [max(0.0, r.sent - r.due) for r in recs]
    return {
        "run": name,
        "rate_rps": rate,
        "num_requests": n,
        "arrival_window_s": duration if duration is not None else (max((r.due for r in recs), default=0.0)),
        "elapsed_s": elapsed,
        "status_counts": status_counts(recs),
        "outcomes": outcomes,
        "completed": len(done),
        "rejected": rejected,
        "lost": len(lost),
        "lost_samples": [
            {"index": r.index, "outcome": r.outcome, "status": r.status, "detail": r.detail} for r in lost[:5]
        ],
        "rejection_samples": sorted({(r.detail or "")[:160] for r in recs if r.outcome in CLEAN_REJECTIONS})[:3],
        "retry_after_on_429": f"{sum(r.retry_after is not None for r in rejections_429)}/{len(rejections_429)}",
        "reject_fraction": rejected / n if n else 0.0,
        "slo_ttft_s": slo_s,
        "goodput_rps": len(good) / elapsed if elapsed > 0 else 0.0,
        "goodput_output_tok_per_s": good_tok / elapsed if elapsed > 0 else 0.0,
        "slo_attainment": len(good) / n if n else 0.0,  # of all requests sent
        "completed_rps": len(done) / elapsed if elapsed > 0 else 0.0,
        "output_tok_per_s": out_tok / elapsed if elapsed > 0 else 0.0,
        "output_tokens_per_request": (out_tok / len(done)) if done else None,
        "prompt_tokens_per_request": (sum(r.prompt_tokens or 0 for r in done) / len(done)) if done else None,
        "ttft_ms": dist_ms([r.ttft for r in done]),
        "itl_ms": dist_ms([x for r in done for x in r.itl]),
        "e2e_ms": dist_ms([r.e2e for r in done]),
        "client_send_lateness_ms": dist_ms(lateness),  # how far behind schedule requests left
        "load_average": load_average(),
    }


def passes(s: dict, slo_s: float, max_reject: float) -> bool:
    """A search step passes: nothing lost, rejections within ``max_reject``, p99 TTFT of the
    completed requests within the SLO."""
    p99 = s["ttft_ms"]["p99"]
    return (
        s["lost"] == 0
        and s["completed"] > 0
        and s["reject_fraction"] <= max_reject
        and p99 is not None
        and p99 <= 1000 * slo_s
    )


# ---- local server ---------------------------------------------------------------------------
def root_of(url: str) -> str:
    """``http://host:port`` of a ``.../v1`` base URL."""
    return url.rstrip("/").removesuffix("/v1")


class LocalServer:
    """``kvserve serve`` (or another ``command`` that takes ``--port``, e.g. ``vllm serve``) in a
    subprocess (its own session; Ray's token in a private temp file, not ``~/.ray/auth_token``),
    until it answers ``/ready`` (or ``/health`` where there is no ``/ready``); :meth:`stop` sends
    SIGINT (its own clean shutdown), then ends any process of its tree still alive, by pid.
    ``env``: the base environment (default this process's)."""

    def __init__(
        self,
        extra_args: list[str],
        api_key: str | None = None,
        port: int | None = None,
        log_path: str | None = None,
        ready_timeout: float = 600.0,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = command or [str(Path(sys.executable).with_name("kvserve")), "serve"]
        self.args = [*command, "--port", str(self.port), *extra_args]
        self.base_env = os.environ if env is None else env
        self.api_key = api_key
        self.ready_timeout = ready_timeout
        self._auth_dir = tempfile.mkdtemp(prefix="kvserve-load-auth-")
        self.log_path = log_path or os.path.join(self._auth_dir, "serve.log")
        self.proc: subprocess.Popen | None = None
        self._pids: set[int] = set()

    def start(self) -> LocalServer:
        import urllib.error
        import urllib.request

        env = dict(self.base_env, RAY_AUTH_TOKEN_PATH=os.path.join(self._auth_dir, "auth_token"))
        env.pop("RAY_AUTH_TOKEN", None)
        if self.api_key:
            env["KVSERVE_API_KEYS"] = self.api_key
        self._log = open(self.log_path, "w")
        print(f"starting: {' '.join(self.args)} (log: {self.log_path})", flush=True)
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.time() + self.ready_timeout
        root = root_of(self.url)
        paths = ["/ready", "/health"]
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise RuntimeError(f"kvserve serve exited with {rc}; see {self.log_path}")
            if time.time() > deadline:
                self.stop()
                raise TimeoutError(f"kvserve serve not ready after {self.ready_timeout} s; see {self.log_path}")
            self._remember_tree()
            try:
                req = urllib.request.Request(root + paths[0], headers=auth_headers(self.api_key))
                with urllib.request.urlopen(req, timeout=10) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:
                if e.code == 404 and len(paths) > 1:
                    paths.pop(0)  # no /ready on this server: /health
            except OSError:
                pass
            time.sleep(2)
        print(f"server ready at {self.url} ({paths[0]})", flush=True)
        return self

    def _remember_tree(self) -> None:
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            self._pids.update(c.pid for c in p.children(recursive=True))
        except Exception:
            pass

    def stop(self) -> None:
        if self.proc is None:
            return
        self._remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        left = []
        try:
            import psutil

            for pid in sorted(self._pids):
                try:
                    p = psutil.Process(pid)
                    if p.status() != psutil.STATUS_ZOMBIE:
                        left.append(p)
                except psutil.NoSuchProcess:
                    pass
            for p in left:
                p.kill()
        except ImportError:
            pass
        if left:
            print(f"killed {len(left)} process(es) the server left behind: {[p.pid for p in left]}", flush=True)
        self._log.close()
        try:
            os.unlink(os.path.join(self._auth_dir, "auth_token"))  # the log stays, for a look afterwards
        except OSError:
            pass
        print(f"server stopped (log: {self.log_path})", flush=True)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---- plot and report ------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    runs = result["runs"]
    search = result.get("search", {}).get("steps", [])
    fig, axes = plt.subplots(1, 3 if search else 2, figsize=(16 if search else 11, 4.5))
    names = [r["run"] for r in runs]
    x = range(len(runs))
    ax = axes[0]
    w = 0.38
    p50 = [(r["ttft_ms"]["p50"] or 0) / 1000 for r in runs]
    p99 = [(r["ttft_ms"]["p99"] or 0) / 1000 for r in runs]
    ax.bar([i - w / 2 for i in x], p50, w, label="TTFT p50")
    ax.bar([i + w / 2 for i in x], p99, w, label="TTFT p99")
    ax.axhline(result["slo_ttft_s"], color="red", ls="--", lw=1, label=f"SLO {result['slo_ttft_s']} s")
    ax.set_xticks(list(x), [f"{n}\n{r['rate_rps']:.2f} req/s" for n, r in zip(names, runs)])
    ax.set_ylabel("s")
    ax.set_title("TTFT of completed (admitted) requests")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    parts = [
        ("complete", "200 complete", "tab:green"),
        ("rejected_429", "429 (clean)", "tab:orange"),
        ("rejected_503", "503 (clean)", "tab:purple"),
        ("rejected_in_stream", "in-stream error (clean)", "tab:gray"),
        ("lost", "lost", "tab:red"),
    ]
    bottom = [0] * len(runs)
    for key, label, color in parts:
        vals = [r["lost"] if key == "lost" else r["outcomes"][key] for r in runs]
        ax.bar(list(x), vals, 0.6, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        ax.text(i, bottom[i], f"goodput\n{r['goodput_rps']:.2f}/s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylim(0, max(bottom + [1]) * 1.25)
    ax.set_ylabel("requests")
    ax.set_title("outcome of every request")
    ax.legend(fontsize=8)
    if search:
        ax = axes[2]
        ok = [s for s in search if s["pass"]]
        bad = [s for s in search if not s["pass"]]
        for group, marker, label in ((ok, "o", "pass"), (bad, "x", "fail")):
            ax.scatter(
                [s["rate_rps"] for s in group],
                [(s["ttft_p99_ms"] or 0) / 1000 for s in group],
                marker=marker,
                label=label,
                s=40,
            )
        ax.axhline(result["slo_ttft_s"], color="red", ls="--", lw=1)
        ax.axvline(result["sustainable_rate_rps"], color="gray", ls=":", lw=1, label="sustainable")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("TTFT p99 (s)")
        ax.set_title("rate search")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    m = result["machine"]
    wl = result["workload"]
    fig.suptitle(
        f"kvserve load test: {wl['prompt_tokens']} prompt / {wl['output_tokens']} output tokens, "
        f"{m['cores']} x {m['cpu_model']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(runs: list[dict]) -> str:
    def f(d, k, scale=1.0):
        v = d.get(k)
        return "-" if v is None else f"{v * scale:.0f}"

    lines = [
        (
            "| run | rate/s | n | 200/429/503/other | complete/rejected/LOST | goodput/s | good tok/s | "
            "TTFT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        sc = r["status_counts"]
        lines.append(
            f"| {r['run']} | {r['rate_rps']:.2f} | {r['num_requests']} | {sc['200']}/{sc['429']}/{sc['503']}/"
            f"{sc['other']} | {r['completed']}/{r['rejected']}/{r['lost']} | {r['goodput_rps']:.2f} | "
            f"{r['goodput_output_tok_per_s']:.1f} | {f(r['ttft_ms'], 'p50')}/{f(r['ttft_ms'], 'p99')} | "
            f"{f(r['itl_ms'], 'p50')}/{f(r['itl_ms'], 'p99')} | "
            f"{f(r['e2e_ms'], 'p50')}/{f(r['e2e_ms'], 'p99')} |"
        )
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------
def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f, t, w = Figures(), r.get("targets", {}), r["workload"]
    search = r.get("search", {})
    f.summary(
        f"sustainable request rate at a {r['slo_ttft_s']} s p99 TTFT SLO, one CPU replica",
        r["sustainable_rate_rps"],
        "req/s",
        headline=True,
    )
    if "p99_ttft_3x_over_1x" in t:
        f.summary(
            "p99 TTFT at 3x the sustainable rate / at 1x",
            t["p99_ttft_3x_over_1x"],
            "x",
            target="<= 2x",
            met=t.get("p99 TTFT at 3x <= 2 x p99 TTFT at 1x"),
        )
    f.targets(t, ("p99 TTFT at 3x <= 2 x p99 TTFT at 1x", "p99_ttft_3x_over_1x"))
    f.summary("no request lost in any run", r["nothing_lost_any_run"], met=r["nothing_lost_any_run"])
    f.table(
        "Runs",
        [
            "run",
            "req/s",
            "sent",
            "complete",
            "rejected (clean 429)",
            "lost",
            "429s with Retry-After",
            "TTFT p99 of admitted (ms)",
            "goodput (req/s)",
            "load",
        ],
        [
            [
                x["run"],
                x["rate_rps"],
                x["num_requests"],
                x["completed"],
                x["rejected"],
                x["lost"],
                x.get("retry_after_on_429"),
                x["ttft_ms"]["p99"],
                x["goodput_rps"],
                x.get("load_average"),
            ]
            for x in r["runs"]
        ],
        note=f"{w['endpoint']}, {w['prompt_tokens']}-token prompts, {w['output_tokens']} output tokens, "
        f"{w['arrivals']} arrivals, {w['duration_s']} s per run; TTFT SLO {r['slo_ttft_s']} s.",
    )
    f.table(
        "Rate search",
        ["req/s", "pass", "TTFT p99 (ms)", "lost", "rejected (%)"],
        [
            [x["rate_rps"], x["pass"], x["ttft_p99_ms"], x["lost"], x["reject_fraction"] * 100]
            for x in search.get("steps", [])
        ],
        note=f"Criteria: {search.get('criteria')}.",
    )
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model name sent in requests")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="local model folder for the tokenizer (default: the bundled SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="Bearer key (or $KVSERVE_API_KEY)")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds (default 2 on this CPU)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt tokens after the chat template")
    ap.add_argument(
        "--output-tokens",
        type=output_range,
        default="16-128",
        help="max_tokens (with ignore_eos): N, or LO-HI for a uniform draw per request (default 16-128, "
        "as the throughput and serving benchmarks: answers end at different lengths)",
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per 1x/2x/3x run")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per 1x/2x/3x run (instead of --duration)")
    ap.add_argument("--multipliers", default="1,2,3", help="runs at these multiples of the sustainable rate")
    ap.add_argument("--rate", type=float, default=None, help="sustainable rate, req/s: skip the search")
    ap.add_argument("--search-start", type=float, default=0.25, help="first rate of the search, req/s")
    ap.add_argument("--search-duration", type=float, default=30.0, help="seconds of arrivals per search step")
    ap.add_argument("--search-bisect", type=int, default=2, help="bisection steps after the doubling")
    ap.add_argument("--search-max-steps", type=int, default=8, help="most doubling / halving steps")
    ap.add_argument(
        "--max-reject",
        type=float,
        default=0.01,
        help="largest share of clean rejections a search step may have and still pass",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds a request may take in all; past it, it counts as lost",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-server", action="store_true", help="launch `kvserve serve` and stop it at the end")
    ap.add_argument("--server-args", default="", help="extra `kvserve serve` flags with --start-server (one string)")
    ap.add_argument("--out", default="benchmarks/results/load_test.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args(argv)
    if args.num_requests is None and args.duration <= 0:
        ap.error("--duration must be positive")
    prov = Results(__file__, RESULT_KEYS)

    tok = load_tokenizer(args.tokenizer)
    prompts, counts = make_prompts(tok, 512, args.prompt_tokens, args.seed)
    server = None
    if args.start_server:
        server = LocalServer(args.server_args.split(), api_key=args.api_key).start()
        args.url = server.url
    result: dict = {
        "tool": "aiohttp open-loop Poisson sender (guidellm 0.8.1 / locust 2.47 do not fit: see the module docstring)",
        "url": args.url,
        "model": args.model,
        "server_started_here": bool(server),
        "server_args": args.server_args if server else None,
        "workload": {
            "endpoint": "/v1/chat/completions (stream, include_usage)",
            "prompt_tokens": args.prompt_tokens,
            "prompt_tokens_templated_mean": sum(counts) / len(counts),
            "output_tokens": "{}-{}".format(*args.output_tokens),
            "ignore_eos": True,
            "temperature": 0.0,
            "arrivals": "Poisson",
            "seed": args.seed,
            "duration_s": None if args.num_requests else args.duration,
            "num_requests": args.num_requests,
            "request_timeout_s": args.request_timeout,
        },
        "slo_ttft_s": args.slo_ttft,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

    def run(name: str, rate: float, seed: int, duration: float | None, count: int | None) -> dict:
        arrivals = poisson_arrivals(rate, seed, duration, count)
        print(f"{name}: {rate:.3f} req/s, {len(arrivals)} requests ...", flush=True)
        recs, elapsed = asyncio.run(
            run_open_loop(
                args.url, args.model, args.api_key, prompts, args.output_tokens, arrivals, args.request_timeout, seed
            )
        )
        s = summarize(name, rate, recs, elapsed, args.slo_ttft, duration)
        print(
            f"  status {s['status_counts']}, outcomes { {k: v for k, v in s['outcomes'].items() if v} }, "
            f"TTFT p50/p99 {s['ttft_ms']['p50'] or float('nan'):.0f}/{s['ttft_ms']['p99'] or float('nan'):.0f} ms, "
            f"goodput {s['goodput_rps']:.2f}/s",
            flush=True,
        )
        return s

    try:
        # warm-up, not counted: first-call allocations along the whole path
        asyncio.run(run_open_loop(args.url, args.model, args.api_key, prompts[:1], (4, 4), [0.0], args.request_timeout))
        step_seed = args.seed + 1000
        if args.rate is None:
            steps = []

            def step(rate: float) -> bool:
                nonlocal step_seed
                step_seed += 1
                s = run(f"search {len(steps)}", rate, step_seed, args.search_duration, None)
                ok = passes(s, args.slo_ttft, args.max_reject)
                steps.append(
                    {
                        "rate_rps": rate,
                        "pass": ok,
                        "ttft_p99_ms": s["ttft_ms"]["p99"],
                        "lost": s["lost"],
                        "reject_fraction": s["reject_fraction"],
                        "num_requests": s["num_requests"],
                        "goodput_rps": s["goodput_rps"],
                        "summary": s,
                    }
                )
                print(f"  -> {'pass' if ok else 'FAIL'}", flush=True)
                return ok

            lo = hi = None
            rate = args.search_start
            for _ in range(args.search_max_steps):
                if step(rate):
                    lo = rate
                    if hi is not None:
                        break
                    rate *= 2
                else:
                    hi = rate
                    if lo is not None:
                        break
                    rate /= 2
            if lo is not None and hi is not None:
                for _ in range(args.search_bisect):
                    mid = (lo + hi) / 2
                    if step(mid):
                        lo = mid
                    else:
                        hi = mid
            if lo is None:
                raise SystemExit(f"no rate passed (lowest tried {rate:.3f} req/s): the SLO cannot be met here")
            sustainable = lo
            if hi is None:
                print(
                    f"WARNING: every rate up to {lo:.3f} req/s passed: the sustainable rate is a lower bound "
                    f"(raise --search-max-steps or --search-start)",
                    flush=True,
                )
            result["search"] = {
                "criteria": f"lost == 0, rejected <= {args.max_reject:.0%}, TTFT p99 <= SLO",
                "step_duration_s": args.search_duration,
                "lowest_failing_rate_rps": hi,
                "upper_bound_found": hi is not None,
                "steps": steps,
            }
        else:
            sustainable = args.rate
            result["search"] = {"skipped": True, "rate_given_rps": args.rate}
        result["sustainable_rate_rps"] = sustainable
        print(f"sustainable rate: {sustainable:.3f} req/s", flush=True)
        runs = []
        for m in [float(x) for x in args.multipliers.split(",")]:
            step_seed += 1
            runs.append(
                run(
                    f"{m:g}x",
                    m * sustainable,
                    step_seed,
                    None if args.num_requests else args.duration,
                    args.num_requests,
                )
            )
        result["runs"] = runs
    finally:
        if server is not None:
            server.stop()
    by = {r["run"]: r for r in runs}
    if "1x" in by and "3x" in by:
        p1, p3 = by["1x"]["ttft_ms"]["p99"], by["3x"]["ttft_ms"]["p99"]
        result["targets"] = {
            "nothing lost at 3x": by["3x"]["lost"] == 0,
            "p99 TTFT at 3x <= 2 x p99 TTFT at 1x": (p1 is not None and p3 is not None and p3 <= 2 * p1),
            "p99_ttft_3x_over_1x": (p3 / p1) if p1 and p3 else None,
        }
    result["nothing_lost_any_run"] = all(r["lost"] == 0 for r in runs)
    out = Path(args.out)
    result = prov.write(out, result)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(result, png)
    print(table(runs))
    if "targets" in result:
        print("targets:", json.dumps(result["targets"]))
    print(f"wrote {out} and {png}")
    return result


if __name__ == "__main__":
    main()
