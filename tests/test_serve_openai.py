"""``hfspec serve`` on a real loopback port, driven by the ``openai`` client: a tiny pair, one request at a time."""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfspec[serve]'")
openai = pytest.importorskip("openai", reason="the test extra is not installed: pip install 'hfspec[test]'")

import httpx  # noqa: E402
import tiny  # noqa: E402
import torch  # noqa: E402
from serve_fakes import running_server  # noqa: E402

import hfspec  # noqa: E402
from hfspec import api  # noqa: E402
from hfspec.models.presets import Preset  # noqa: E402
from hfspec.serve.app import create_app  # noqa: E402
from hfspec.serve.prompts import FIM_TOKENS  # noqa: E402
from hfspec.serve.sequential import SequentialEngine  # noqa: E402

N = 12  # new tokens per answer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and draft whose tokenizer has a chat template and the three FIM tokens (ids 61, 62, 63)."""
    paths = []
    for seed in (0, 1):
        path = tiny.build(tmp_path_factory.mktemp(f"fim{seed}"), "llama", seed=seed, tokenizer_size=61)
        tok = tiny.make_tokenizer(61)
        tok.add_tokens(list(FIM_TOKENS))
        tiny.save_tokenizer(tok, path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def server(pair):
    api.clear_cache()
    gen = api.load(Preset(name="custom", target=pair[0], draft=pair[1]))
    engine = SequentialEngine(gen, model_name="tiny")
    with running_server(create_app(engine, gen.tokenizer), engine) as url:
        yield url, gen, engine
    api.clear_cache()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(pair, prompt: str, chat: bool) -> str:
    return hfspec.generate(prompt, target=pair[0], draft=pair[1], max_new_tokens=N, chat=chat)


def test_chat_greedy_equals_generate_streamed_or_not(client, pair):
    messages = [{"role": "user", "content": "w10 w11 w12"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0)
    expected = reference(pair, "w10 w11 w12", chat=True)
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == N and whole.usage.total_tokens == whole.usage.prompt_tokens + N
    usage = whole.usage.model_extra["hfspec"]
    assert usage["target_passes"] + usage["accepted"] == N and usage["drafted"] >= usage["accepted"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    tags = [c.choices[0].model_extra["hfspec"] for c in chunks if c.choices and c.choices[0].model_extra.get("hfspec")]
    assert sum(len(t["token_ids"]) for t in tags) == N
    assert {o for t in tags for o in t["origins"]} <= {"accepted", "resampled", "bonus"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


def test_completions_greedy_equals_generate_streamed_or_not(client, pair):
    expected = reference(pair, "w20 w21", chat=False)
    whole = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=N, temperature=0)
    assert whole.choices[0].text == expected
    stream = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=N, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_fill_in_the_middle_lays_out_prefix_suffix_middle(client, server):
    _, gen, _ = server
    whole = client.completions.create(model="tiny", prompt="w20 w21", suffix="w30", max_tokens=N, temperature=0)
    ids = [61, 20, 21, 62, 30, 63]  # <|fim_prefix|> w20 w21 <|fim_suffix|> w30 <|fim_middle|>
    out = gen.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
    new = out.sequences[0, len(ids) : len(ids) + out.stats.rows[0].committed].tolist()
    assert whole.choices[0].text == gen.tokenizer.decode(new, skip_special_tokens=True)
    assert whole.usage.prompt_tokens == len(ids)
    stream = client.completions.create(
        model="tiny", prompt="w20 w21", suffix="w30", max_tokens=N, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def test_stop_string_cuts_the_text_and_finishes_with_stop(client, pair):
    full = reference(pair, "w20 w21", chat=False)
    word = full.split()[3]
    cut = full[: full.index(word)]
    whole = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=N, temperature=0, stop=[word])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="tiny", prompt="w20 w21", max_tokens=N, temperature=0, stop=word, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == cut


def test_openai_errors_map_to_the_clients_exceptions(client):
    with pytest.raises(openai.NotFoundError) as found:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "w10"}])
    assert found.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w10"}], n=2)
    assert [m.id for m in client.models.list()] == ["tiny"]


def metric(url: str, name: str) -> float:
    """One value of the server's Prometheus metrics."""
    return float(re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


def running(url: str) -> tuple[float, float]:
    return metric(url, "hfspec_requests_running"), metric(url, "hfspec_requests_cancelled_total")


def test_a_client_leaving_mid_stream_frees_the_row(server):
    url, _, engine = server
    body = {"prompt": "w20", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert engine.running == 1
    deadline = time.monotonic() + 10
    while running(url) != (0.0, 1.0):
        assert time.monotonic() < deadline, running(url)
        time.sleep(0.05)
    assert engine.running == 0


def test_concurrent_clients_each_get_the_answer_they_get_alone(client, pair):
    from concurrent.futures import ThreadPoolExecutor

    asks = [(f"w{10 + 3 * k} w{11 + 3 * k}", 4 + k % 3 * 4, k % 2 == 0) for k in range(6)]

    def ask(prompt: str, n: int, chat: bool) -> str:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0)
            return out.choices[0].message.content
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda a: ask(*a), asks))
    expected = [hfspec.generate(p, target=pair[0], draft=pair[1], max_new_tokens=n, chat=c) for p, n, c in asks]
    assert answers == expected


def test_a_client_leaving_while_queued_never_takes_a_row(pair, monkeypatch):
    # One row: a long answer holds it, a second request waits behind it and its client leaves before any chunk.
    from hfspec.serve import batch
    from hfspec.serve.engine import BatchEngine

    step, pause = batch.Batch.step, [0.3]  # a slow machine while the long answer runs

    def slow_step(self):
        time.sleep(pause[0])
        return step(self)

    monkeypatch.setattr(batch.Batch, "step", slow_step)
    api.clear_cache()
    gen = api.load(Preset(name="custom", target=pair[0], draft=pair[1]))
    engine = BatchEngine.from_generator(gen, model_name="tiny", max_batch=1, max_queue=4)
    engine.eos = []  # and no answer ends early: the long one holds the row to its budget

    with running_server(create_app(engine, gen.tokenizer), engine) as url, httpx.Client(timeout=30) as c:
        long = {"prompt": "w20", "max_tokens": 100, "temperature": 0, "stream": True}
        with c.stream("POST", url + "/v1/completions", json=long) as r:
            lines = r.iter_lines()  # kept: a dropped iterator would close the stream
            assert next(line for line in lines if line.startswith("data:"))
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={**long, "max_tokens": 5}, timeout=0.5)  # its own client
            deadline = time.monotonic() + 10
            while metric(url, "hfspec_requests_waiting") or metric(url, "hfspec_requests_cancelled_total") != 1:
                assert time.monotonic() < deadline, (
                    metric(url, "hfspec_requests_waiting"),
                    metric(url, "hfspec_requests_cancelled_total"),
                    engine.running,
                )
                time.sleep(0.05)
            assert engine.running == 1  # the long answer, still streaming
            pause[0] = 0.0
        deadline = time.monotonic() + 10
        while running(url) != (0.0, 2.0):
            assert time.monotonic() < deadline, running(url)
            time.sleep(0.05)
        short = {"prompt": "w10 w11 w12", "max_tokens": N, "temperature": 0}
        answer = c.post(url + "/v1/completions", json=short).json()
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == N
    api.clear_cache()
