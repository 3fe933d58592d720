"""The ingress's response caches (``kvserve/deployments/cache/``): latency of hits and misses over
HTTP, hit rates on a workload with repeats and paraphrases, and the two choices behind the
semantic level (vector index, similarity threshold).

Parts, in one run:

1. **index** (no Ray): one lookup (best inner product) among 10,000 random unit vectors of 384
   dimensions, a numpy matrix (BLAS with its default threads and with one) and
   ``kvserve.deployments.cache.semantic.SemanticIndex.search`` against faiss-cpu ``IndexFlatIP`` (if
   installed; one and two OpenMP threads), 500 lookups each: p50 / p90 / p99.
2. **threshold** (no Ray): all-MiniLM-L6-v2 cosine similarity of :data:`PARAPHRASES` (26
   hand-written pairs that ask the same thing) and :data:`NEAR_MISSES` (24 hand-written pairs
   of the same shape that need another answer), recall and false accepts at thresholds 0.80 to
   0.96, and the embedding time of one sentence (one torch thread, as in the ingress).
3. **live** (a local Ray with token auth, the kvserve app on the default model,
   SmolLM2-135M-Instruct, one replica; exact cache on, memory backend, semantic ``opt-in``),
   over HTTP with keep-alive (httpx), every request greedy ``/v1/chat/completions``:

   * hit rates: a seeded sequence of :data:`NUM_REQUESTS` requests, 50 % unique questions
     (generated, plus each pair's first question), 30 % verbatim repeats of an earlier one, 20 %
     the hand-written paraphrase of an earlier one, one at a time, all with
     ``"cache": {"semantic": true}``; answers of ``--max-tokens`` tokens. Exact hits / repeats,
     semantic hits / paraphrases, hits on unique questions (must be 0);
   * exact hit end to end (request sent -> whole JSON body read), p50 / p99 over ``--hits``
     requests, streamed too (-> ``[DONE]``); target p50 < 5 ms. Beside it the floors of the
     path: ``GET /v1/models`` (Serve's proxy, the ingress replica, a dict read) and a POST of
     a chat body that fails validation (a 400: the same proxy, body transfer and FastAPI, no
     handler); a hit's time beyond the POST floor is the cache's and the handler's;
   * semantic hit end to end: the paraphrases that hit, sent again (a semantic hit stores
     nothing under the paraphrase's own key, so every re-send is an exact miss, an embedding,
     a vector search and a semantic hit); target p50 < 25 ms;
   * added TTFT of a miss: streamed requests with unique prompts and ``max_tokens`` 2, in
     pairs alternating (in both orders) a cache miss (looked up and stored) and the same
     ingress with the cache skipped (``"cache": false``: the path of ``response_cache: false`` but for one ``if``);
     median of the pairs' TTFT differences; target < 2 ms. The same for a semantic miss (the
     embedding runs before the request goes to the replica).

Usage::

    python benchmarks/cache.py                      # all parts, writes benchmarks/results/cache.{json,png}
    python benchmarks/cache.py --parts index,threshold --out /tmp/c.json

Results: ``benchmarks/results/cache.json`` and ``benchmarks/results/cache.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import Figures, Results, local_serve, percentile, pyplot  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("benchmark", "parts", "started", "index", "threshold", "live", "targets")

APP = "kvserve-cache-bench"
NUM_REQUESTS = 130  # 26 paraphrases (20 %), 39 repeats (30 %), 65 unique (50 %)
THRESHOLDS = (0.80, 0.85, 0.88, 0.90, 0.92, 0.94, 0.96)

#: Hand-written pairs asking the same question (first, paraphrase).
PARAPHRASES = [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I reverse a list in Python?", "What's the way to reverse a list in Python?"),
    ("Explain photosynthesis in simple terms.", "Can you explain photosynthesis simply?"),
    ("How many legs does a spider have?", "How many legs do spiders have?"),
    ("What is the boiling point of water at sea level?", "At sea level, what temperature does water boil at?"),
    ("Who wrote Romeo and Juliet?", "Who is the author of Romeo and Juliet?"),
    ("What is the largest planet in our solar system?", "Which planet is the biggest in the solar system?"),
    ("How do I make a cup of green tea?", "What is the way to prepare a cup of green tea?"),
    ("What does HTTP stand for?", "What is HTTP short for?"),
    ("Give me three tips for better sleep.", "Share three tips for sleeping better."),
    ("How far is the Moon from the Earth?", "What is the distance between the Earth and the Moon?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("Translate 'thank you' into Spanish.", "How do you say 'thank you' in Spanish?"),
    ("What are the primary colors?", "Which colors are the primary colors?"),
    ("How do I convert Celsius to Fahrenheit?", "What is the formula to convert Celsius into Fahrenheit?"),
    ("Why is the sky blue?", "What makes the sky look blue?"),
    ("What is the tallest mountain in the world?", "Which mountain is the highest in the world?"),
    ("Summarize the plot of Cinderella in one sentence.", "Give a one-sentence summary of the Cinderella story."),
    ("What is a prime number?", "Can you tell me what a prime number is?"),
    ("How many days are there in a leap year?", "How many days does a leap year have?"),
    ("What language is spoken in Brazil?", "Which language do people speak in Brazil?"),
    ("Name a good book for learning to cook.", "Recommend a good book to learn cooking."),
    ("What is the chemical symbol for gold?", "Which chemical symbol stands for gold?"),
    ("How do I center a div in CSS?", "What is the way to center a div with CSS?"),
    ("When did World War II end?", "In what year did the Second World War end?"),
    ("What is the freezing point of water in Fahrenheit?", "In Fahrenheit, at what temperature does water freeze?"),
]
#: Hand-written pairs of the same shape that need different answers (a semantic hit is wrong).
NEAR_MISSES = [
    ("What is the capital of France?", "What is the capital of Spain?"),
    ("How do I reverse a list in Python?", "How do I sort a list in Python?"),
    ("How many legs does a spider have?", "How many legs does an ant have?"),
    ("Who wrote Romeo and Juliet?", "Who wrote Pride and Prejudice?"),
    ("What is the largest planet in our solar system?", "What is the smallest planet in our solar system?"),
    ("How do I make a cup of green tea?", "How do I make a cup of coffee?"),
    ("What does HTTP stand for?", "What does HTTPS stand for?"),
    ("Give me three tips for better sleep.", "Give me three tips for better focus."),
    ("How far is the Moon from the Earth?", "How far is the Sun from the Earth?"),
    ("Translate 'thank you' into Spanish.", "Translate 'thank you' into German."),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
    ("What is the tallest mountain in the world?", "What is the longest river in the world?"),
    ("How many days are there in a leap year?", "How many days are there in February?"),
    ("What language is spoken in Brazil?", "What language is spoken in Mexico?"),
    ("What is the chemical symbol for gold?", "What is the chemical symbol for silver?"),
    ("When did World War II end?", "When did World War I end?"),
    ("What is the freezing point of water in Fahrenheit?", "What is the boiling point of water in Fahrenheit?"),
    ("Write a haiku about the sea.", "Write a haiku about the mountains."),
    ("Translate 'good morning' into French.", "Translate 'good night' into French."),
    ("What is 12 times 12?", "What is 12 times 13?"),
    ("Is 17 a prime number?", "Is 21 a prime number?"),
    ("Why is the sky blue?", "Why is the grass green?"),
    ("How do I center a div in CSS?", "How do I hide a div in CSS?"),
    ("Name a good book for learning to cook.", "Name a good book for learning to paint."),
]
SUBJECTS = [
    "a lighthouse",
    "the number {i}",
    "a violin",
    "volcanoes",
    "the city of Lyon",
    "honeybees",
    "glaciers",
    "the year {y}",
    "a chess opening",
    "tea ceremonies",
    "rainbows",
    "penguins",
    "the Nile",
    "submarines",
]
ASKS = ["Tell me one fact about {s}.", "Write a short sentence about {s}.", "Why do people like {s}?"]


def ms(xs: list[float]) -> dict:
    return (
        {
            "p50": round(1000 * percentile(xs, 50), 3),
            "p90": round(1000 * percentile(xs, 90), 3),
            "p99": round(1000 * percentile(xs, 99), 3),
            "mean": round(1000 * statistics.fmean(xs), 3),
            "n": len(xs),
        }
        if xs
        else {"n": 0}
    )


# ---- 1. index ----------------------------------------------------------------------------------
def bench_index(n: int = 10_000, dim: int = 384, lookups: int = 500, seed: int = 0) -> dict:
    import numpy as np

    from kvserve.deployments.cache.semantic import SemanticIndex

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    qs = rng.standard_normal((lookups, dim)).astype(np.float32)
    qs /= np.linalg.norm(qs, axis=1, keepdims=True)

    def timed(fn) -> list[float]:
        for q in qs[:20]:
            fn(q)
        out = []
        for q in qs:
            t0 = time.perf_counter()
            fn(q)
            out.append(time.perf_counter() - t0)
        return out

    from threadpoolctl import threadpool_info, threadpool_limits

    res = {
        "entries": n,
        "dim": dim,
        "lookups": lookups,
        "blas": [(i["internal_api"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"],
        "numpy_matvec_default_threads": ms(timed(lambda q: int(np.argmax(x @ q)))),
    }
    idx = SemanticIndex(dim, n)
    for i in range(n):
        idx.add("scope", "m", str(i), x[i], 3600.0)
    with threadpool_limits(
        limits=1, user_api="blas"
    ):  # as in the ingress (kvserve/deployments/cache/response_cache.py)
        res["numpy_matvec_1_thread"] = ms(timed(lambda q: int(np.argmax(x @ q))))
        res["semantic_index_search_1_thread"] = ms(timed(lambda q: idx.search("scope", q, 2.0)))  # no hit: full scan
    try:
        import faiss
    except ImportError:
        res["faiss"] = "not installed (pip install faiss-cpu)"
        return res
    res["faiss_version"] = faiss.__version__
    for threads in (1, 2):
        faiss.omp_set_num_threads(threads)
        fi = faiss.IndexFlatIP(dim)
        fi.add(x)
        res[f"faiss_flat_ip_{threads}_thread"] = ms(timed(lambda q: fi.search(q[None], 1)))
    return res


# ---- 2. threshold --------------------------------------------------------------------------------
def bench_threshold() -> dict:
    from kvserve.deployments.contract.encoder import SentenceEncoder

    emb = SentenceEncoder(num_threads=1)

    def sims(pairs):
        a = emb.embed([p[0] for p in pairs])
        b = emb.embed([p[1] for p in pairs])
        return (a * b).sum(1)

    p, d = sims(PARAPHRASES), sims(NEAR_MISSES)
    sweep = {
        f"{t:.2f}": {
            "paraphrase_recall": round(float((p >= t).mean()), 3),
            "near_miss_accepted": round(float((d >= t).mean()), 3),
            "near_misses_over": [f"{a} | {b}" for (a, b), s in zip(NEAR_MISSES, d) if s >= t],
        }
        for t in THRESHOLDS
    }
    texts = [f"What is the capital of country number {i}?" for i in range(60)]
    for t in texts[:5]:
        emb.embed([t])
    times = []
    for t in texts:
        t0 = time.perf_counter()
        emb.embed([t])
        times.append(time.perf_counter() - t0)
    return {
        "paraphrase_similarity": {f"{a} | {b}": round(float(s), 3) for (a, b), s in zip(PARAPHRASES, p)},
        "near_miss_similarity": {f"{a} | {b}": round(float(s), 3) for (a, b), s in zip(NEAR_MISSES, d)},
        "sweep": sweep,
        "embed_one_sentence_ms": ms(times),
        "note": "a hit also needs equal numbers (deployments/cache/semantic.py numbers_of): '12 times 12' / "
        "'12 times 13' never hit whatever the threshold",
    }


# ---- 3. live ----------------------------------------------------------------------------------------
def workload(seed: int) -> list[tuple[str, str]]:
    """``(kind, question)`` in sending order: ``unique``, ``repeat`` or ``paraphrase``; every
    repeat and paraphrase comes after its original."""
    rng = random.Random(seed)
    n_para = len(PARAPHRASES)
    n_rep = round(NUM_REQUESTS * 0.3)
    n_gen = NUM_REQUESTS - n_para - n_rep - n_para  # generated uniques, besides the pairs' first questions
    uniques = [
        rng.choice(ASKS).format(s=rng.choice(SUBJECTS).format(i=rng.randint(2, 999), y=rng.randint(1200, 2020)))
        for _ in range(n_gen * 3)
    ]
    uniques = list(dict.fromkeys(uniques))[:n_gen]
    pending = [("unique", q) for q in uniques] + [("unique", a) for a, _ in PARAPHRASES]
    rng.shuffle(pending)
    follow = [("paraphrase", b, a) for a, b in PARAPHRASES]
    out: list[tuple[str, str]] = []
    sent: list[str] = []
    reps = n_rep
    while pending or follow or reps:
        choices = []
        if pending:
            choices.append("unique")
        ready = [f for f in follow if f[2] in sent]
        if ready:
            choices.append("paraphrase")
        if reps and sent:
            choices.append("repeat")
        kind = rng.choice(choices)
        if kind == "unique":
            _, q = pending.pop()
            sent.append(q)
            out.append(("unique", q))
        elif kind == "paraphrase":
            f = rng.choice(ready)
            follow.remove(f)
            out.append(("paraphrase", f[1]))
        else:
            reps -= 1
            out.append(("repeat", rng.choice(sent)))
    return out


def chat_body(question: str, max_tokens: int, **kw) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }


def post(client, url: str, body: dict, headers: dict | None = None) -> tuple[float, str | None, dict]:
    t0 = time.perf_counter()
    r = client.post(url, json=body, headers=headers or {})
    r.read()
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return dt, r.headers.get("x-kvserve-cache"), r.json()


def stream(client, url: str, body: dict) -> tuple[float, float, str | None]:
    """(TTFT: first content chunk, E2E: [DONE], cache status) of one streamed request."""
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        status = r.headers.get("x-kvserve-cache")
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - t0
            if line == "data: [DONE]":
                break
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, status


def bench_live(args) -> dict:
    import httpx

    with local_serve(max(os.cpu_count() or 1, 4)) as port:
        from ray import serve

        from kvserve.deployments.app import build_app

        t0 = time.time()
        serve.run(
            build_app(
                {
                    "model": args.model,
                    "num_replicas": 1,
                    "max_num_seqs": 16,
                    "semantic_cache": "opt-in",
                    "admin_api_keys": ["bench-admin"],
                }
            ),
            name=APP,
            route_prefix="/",
        )
        deploy_s = time.time() - t0
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        admin = {"Authorization": "Bearer bench-admin"}
        with httpx.Client(timeout=300) as client:
            post(client, url, chat_body("Warm up the server.", 2, cache=False))
            stream(client, url, chat_body("Warm up the stream.", 2, cache=False))
            post(client, url, chat_body("Warm up the embedder.", 2, cache={"semantic": True}))
            client.delete(f"http://127.0.0.1:{port}/v1/cache", headers=admin)
            # hit rates
            work = workload(args.seed)
            outcomes: dict[str, dict[str, int]] = {}
            lat: dict[str, list[float]] = {}
            for kind, q in work:
                dt, status, _ = post(client, url, chat_body(q, args.max_tokens, cache={"semantic": True}))
                outcomes.setdefault(kind, {}).setdefault(status, 0)
                outcomes[kind][status] += 1
                lat.setdefault(f"{kind}:{status}", []).append(dt)
            count = {k: sum(v.values()) for k, v in outcomes.items()}
            hit_rates = {
                "requests": {k: count[k] for k in ("unique", "repeat", "paraphrase")},
                "outcomes": outcomes,
                "repeats_exact_hit_rate": round(outcomes["repeat"].get("exact", 0) / count["repeat"], 3),
                "paraphrases_semantic_hit_rate": round(
                    outcomes["paraphrase"].get("semantic", 0) / count["paraphrase"], 3
                ),
                "unique_hits": outcomes["unique"].get("exact", 0) + outcomes["unique"].get("semantic", 0),
                "overall_hit_rate": round(
                    sum(v for k in outcomes for s, v in outcomes[k].items() if s in ("exact", "semantic")) / len(work),
                    3,
                ),
            }
            print("hit rates:", json.dumps(hit_rates), flush=True)
            # exact hits: the repeats' questions, again
            repeats = list(dict.fromkeys(q for kind, q in work if kind == "repeat"))
            exact, exact_stream, exact_ttft = [], [], []
            for i in range(args.hits):
                body = chat_body(repeats[i % len(repeats)], args.max_tokens, cache={"semantic": True})
                dt, status, _ = post(client, url, body)
                assert status == "exact", status
                exact.append(dt)
                ttft, e2e, status = stream(client, url, body)
                assert status == "exact", status
                exact_stream.append(e2e)
                exact_ttft.append(ttft)
            # the floors: requests that do nothing: GET /v1/models (proxy, ingress, a cached dict)
            # and a POST of a chat body that fails validation (400: the same body through Serve's
            # proxy and FastAPI, no handler)
            floor, post_floor = [], []
            for _ in range(args.hits):
                t1 = time.perf_counter()
                client.get(f"http://127.0.0.1:{port}/v1/models").read()
                floor.append(time.perf_counter() - t1)
                t1 = time.perf_counter()
                r = client.post(url, json={**chat_body("x", args.max_tokens), "messages": []})
                r.read()
                post_floor.append(time.perf_counter() - t1)
                assert r.status_code == 400, r.status_code
            # semantic hits: the paraphrases that hit (a semantic hit stores nothing under its own
            # key, so re-sending one is a semantic hit again; those that missed are exact hits now)
            sem_qs = []
            for a, b in PARAPHRASES:
                _, status, _ = post(client, url, chat_body(b, args.max_tokens, cache={"semantic": True}))
                if status == "semantic":
                    sem_qs.append(b)
            semantic = []
            for i in range(args.hits if sem_qs else 0):
                dt, status, _ = post(
                    client, url, chat_body(sem_qs[i % len(sem_qs)], args.max_tokens, cache={"semantic": True})
                )
                assert status == "semantic", status
                semantic.append(dt)
            # added TTFT of a miss: alternate a miss with a request that skips the cache
            tag = random.Random(args.seed).randrange(1 << 30)
            diffs, miss_ttft, off_ttft, sem_diffs, sem_ttft = [], [], [], [], []
            for i in range(args.ttft_pairs):
                q = f"item {tag}-{i}: say something about it."
                order = [("off", False), ("miss", None)] if i % 2 else [("miss", None), ("off", False)]
                got = {}
                for name, cache in order:  # the pair's prompts differ from their first character on
                    body = chat_body(("A " if name == "off" else "B ") + q, 2)
                    if cache is False:
                        body["cache"] = False
                    ttft, _, status = stream(client, url, body)
                    assert status == ("bypass" if name == "off" else "miss"), status
                    got[name] = ttft
                diffs.append(got["miss"] - got["off"])
                miss_ttft.append(got["miss"])
                off_ttft.append(got["off"])
                if i < args.ttft_pairs // 2:  # a semantic miss (embedding before the replica) against a plain one
                    ttft_s, _, status = stream(client, url, chat_body("C " + q, 2, cache={"semantic": True}))
                    ttft_o, _, _ = stream(client, url, chat_body("D " + q, 2, cache=False))
                    sem_diffs.append(ttft_s - ttft_o)
                    sem_ttft.append(ttft_s)
            stats = client.get(f"http://127.0.0.1:{port}/v1/cache", headers=admin).json()
        return {
            "deploy_s": round(deploy_s, 1),
            "max_tokens": args.max_tokens,
            "hit_rates": hit_rates,
            "workload_latency_ms": {k: ms(v) for k, v in sorted(lat.items())},
            "exact_hit_e2e_ms": ms(exact),
            "exact_hit_stream_e2e_ms": ms(exact_stream),
            "exact_hit_stream_ttft_ms": ms(exact_ttft),
            "http_floor_get_models_ms": ms(floor),
            "http_floor_post_400_ms": ms(post_floor),
            "semantic_hit_e2e_ms": ms(semantic),
            "semantic_hit_questions": len(sem_qs),
            "miss_ttft_ms": ms(miss_ttft),
            "cache_off_ttft_ms": ms(off_ttft),
            "miss_added_ttft_ms": {
                "median": round(1000 * statistics.median(diffs), 3),
                "mean": round(1000 * statistics.fmean(diffs), 3),
                "pairs": len(diffs),
            },
            "semantic_miss_ttft_ms": ms(sem_ttft),
            "semantic_miss_added_ttft_ms": {
                "median": round(1000 * statistics.median(sem_diffs), 3),
                "pairs": len(sem_diffs),
            }
            if sem_diffs
            else None,
            "cache_stats": stats,
            "_samples": {
                "exact": exact,
                "exact_stream": exact_stream,
                "semantic": semantic,
                "miss_ttft": miss_ttft,
                "off_ttft": off_ttft,
            },
        }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    live = result.get("live")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    if live:
        s = live["_samples"]
        for name, xs in (
            ("exact hit (JSON)", s["exact"]),
            ("exact hit (stream)", s["exact_stream"]),
            ("semantic hit (JSON)", s["semantic"]),
            ("miss TTFT", s["miss_ttft"]),
            ("cache skipped TTFT", s["off_ttft"]),
        ):
            xs = sorted(1000 * x for x in xs)
            if xs:
                axes[0].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        axes[0].set_xscale("log")
        axes[0].axvline(5, color="grey", ls=":", lw=1)
        axes[0].axvline(25, color="grey", ls=":", lw=1)
        axes[0].set_xlabel("ms (end to end over HTTP; TTFT for the last two)")
        axes[0].set_ylabel("CDF")
        axes[0].set_title("response cache latency")
        axes[0].legend(fontsize=8)
        axes[0].grid(alpha=0.3)
    th = result.get("threshold")
    if th:
        ts = [float(t) for t in th["sweep"]]
        axes[1].plot(ts, [th["sweep"][f"{t:.2f}"]["paraphrase_recall"] for t in ts], "o-", label="paraphrases hit")
        axes[1].plot(ts, [th["sweep"][f"{t:.2f}"]["near_miss_accepted"] for t in ts], "s-", label="near misses hit")
        axes[1].axvline(0.92, color="grey", ls=":", lw=1)
        axes[1].set_xlabel("cosine similarity threshold")
        axes[1].set_ylabel("share of pairs")
        axes[1].set_title("semantic threshold (hand-written pairs)")
        axes[1].legend(fontsize=8)
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f, t = Figures(), r.get("targets", {})
    live, th, idx = r.get("live"), r.get("threshold"), r.get("index")
    if live:
        hr = live["hit_rates"]
        f.summary(
            "exact hit, JSON, p50 end to end",
            live["exact_hit_e2e_ms"]["p50"],
            "ms",
            target="< 5 ms",
            met=t.get("exact_hit_p50_ms < 5"),
            headline=True,
        )
        f.summary(
            "semantic hit p50 end to end",
            live["semantic_hit_e2e_ms"].get("p50"),
            "ms",
            target="< 25 ms",
            met=t.get("semantic_hit_p50_ms < 25"),
        )
        f.summary(
            "TTFT added by a miss, median over pairs",
            live["miss_added_ttft_ms"]["median"],
            "ms",
            target="< 2 ms",
            met=t.get("miss_added_ttft_ms < 2"),
        )
        f.summary("exact hit, streamed, p50 end to end", live["exact_hit_stream_e2e_ms"]["p50"], "ms")
        f.summary(
            "a POST that only fails validation, p50 (Serve proxy floor)", live["http_floor_post_400_ms"]["p50"], "ms"
        )
        f.summary("GET /v1/models p50", live["http_floor_get_models_ms"]["p50"], "ms")
        f.summary("TTFT added by a semantic miss, median", live["semantic_miss_added_ttft_ms"]["median"], "ms")
        f.summary("repeats answered by the exact level", hr["repeats_exact_hit_rate"] * 100, "%")
        f.summary("paraphrases answered by the semantic level", hr["paraphrases_semantic_hit_rate"] * 100, "%")
        f.summary("hits among unique questions", hr["unique_hits"])
        f.table(
            "Requests of the hit-rate workload",
            ["kind", "requests", "outcomes"],
            [
                [k, n, ", ".join(f"{o}: {c}" for o, c in hr["outcomes"].get(k, {}).items())]
                for k, n in hr["requests"].items()
            ],
        )
    if th:
        f.summary("embedding of one sentence, one thread, p50", th["embed_one_sentence_ms"]["p50"], "ms")
        f.table(
            "Semantic threshold sweep",
            ["threshold", "paraphrases that hit (%)", "near misses that would hit (%)"],
            [[k, x["paraphrase_recall"] * 100, x["near_miss_accepted"] * 100] for k, x in th["sweep"].items()],
            note=th.get("note"),
        )
    if idx:
        f.table(
            "Vector index: one lookup",
            ["index", "p50 (ms)", "p99 (ms)"],
            [[k, x["p50"], x["p99"]] for k, x in idx.items() if isinstance(x, dict) and "p50" in x],
            note=f"Among {idx.get('entries')} vectors of {idx.get('dim')} dimensions.",
        )
    return f


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or hub id (default SmolLM2-135M-Instruct)")
    ap.add_argument("--parts", default="index,threshold,live")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length of the hit-rate workload")
    ap.add_argument("--hits", type=int, default=200, help="timed hits per kind")
    ap.add_argument("--ttft-pairs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cache.json"))
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    parts = set(args.parts.split(","))
    result: dict = {
        "benchmark": "response caches (deployments/cache/)",
        "parts": sorted(parts),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if "index" in parts:
        result["index"] = bench_index()
        print("index:", json.dumps(result["index"]), flush=True)
    if "threshold" in parts:
        result["threshold"] = bench_threshold()
        print(
            "threshold sweep:",
            json.dumps(
                {t: (v["paraphrase_recall"], v["near_miss_accepted"]) for t, v in result["threshold"]["sweep"].items()}
            ),
            flush=True,
        )
    if "live" in parts:
        result["live"] = bench_live(args)
    live = result.get("live")
    if live:
        result["targets"] = {
            "exact_hit_p50_ms < 5": live["exact_hit_e2e_ms"]["p50"] < 5,
            "exact_hit_p50_ms": live["exact_hit_e2e_ms"]["p50"],
            "semantic_hit_p50_ms < 25": bool(live["semantic_hit_e2e_ms"].get("p50", 1e9) < 25),
            "semantic_hit_p50_ms": live["semantic_hit_e2e_ms"].get("p50"),
            "miss_added_ttft_ms < 2": live["miss_added_ttft_ms"]["median"] < 2,
            "miss_added_ttft_ms": live["miss_added_ttft_ms"]["median"],
        }
    out = Path(args.out)
    plot(result, out.with_suffix(".png"))
    if live:
        live.pop("_samples")
    result = prov.write(out, result)
    if live:
        print(
            "| exact hit p50 (JSON / stream) | floor p50 (GET models / POST 400) | semantic hit p50 | "
            "miss added TTFT | repeats hit | paraphrases hit |"
        )
        print("|---|---|---|---|---|---|")
        print(
            f"| {live['exact_hit_e2e_ms']['p50']:.2f} / {live['exact_hit_stream_e2e_ms']['p50']:.2f} ms | "
            f"{live['http_floor_get_models_ms']['p50']:.2f} / {live['http_floor_post_400_ms']['p50']:.2f} ms | "
            f"{live['semantic_hit_e2e_ms'].get('p50', float('nan')):.2f} ms | "
            f"{live['miss_added_ttft_ms']['median']:+.2f} ms | {live['hit_rates']['repeats_exact_hit_rate']:.2f} | "
            f"{live['hit_rates']['paraphrases_semantic_hit_rate']:.2f} |"
        )
        print("targets:", result["targets"])
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
