"""The HTTP layer over a scripted engine: OpenAI's bodies and streams, errors, keys, metrics; no model, no socket."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfspec[serve]'")

import tiny  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from serve_fakes import FakeEngine  # noqa: E402

from hfspec.errors import HfspecError  # noqa: E402
from hfspec.serve.app import create_app  # noqa: E402

KEY = "sk-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.make_tokenizer(64)


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine, tokenizer):
    with TestClient(create_app(engine, tokenizer, api_key=KEY), raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def chat_body(**kw):
    return {"model": "fake-model", "messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 4, **kw}


def events(response) -> list:
    """The data of each server-sent event, JSON decoded ("[DONE]" kept as is)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


def test_chat_answer_has_openai_fields_and_hfspec_usage(client, engine, tokenizer):
    r = client.post(CHAT, json=chat_body(temperature=0, seed=3, stop=["w99"], top_k=5, min_p=0.1))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "w10 w11 w12 w13"}
    assert choice["finish_reason"] == "length"
    assert choice["hfspec"]["token_ids"] == [10, 11, 12, 13]
    assert choice["hfspec"]["origins"] == ["accepted", "bonus"] * 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "w10 w11"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 4,
        "total_tokens": len(ids) + 4,
        "hfspec": {"drafted": 4, "accepted": 2, "target_passes": 2},
    }
    (request,) = engine.requests
    assert list(request.prompt_ids) == ids
    assert (request.max_new_tokens, request.temperature, request.seed, request.stop) == (4, 0, 3, ("w99",))
    assert (request.top_k, request.min_p) == (5, 0.1)


def test_max_completion_tokens_wins_and_chat_default_fills_the_context(client, engine):
    client.post(CHAT, json=chat_body(max_tokens=2, max_completion_tokens=6))
    body = chat_body()
    del body["max_tokens"]
    client.post(CHAT, json=body)
    first, second = engine.requests
    assert first.max_new_tokens == 6
    assert second.max_new_tokens == engine.context_length - len(second.prompt_ids)


def test_chat_stream_is_openai_sse_with_tags_and_usage_last(client):
    with client.stream("POST", CHAT, json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = events(r)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    middle = [c["choices"][0] for c in chunks[1:-2]]
    assert "".join(c["delta"]["content"] for c in middle) == "w10 w11 w12 w13"
    assert [t for c in middle for t in c["hfspec"]["token_ids"]] == [10, 11, 12, 13]
    assert all(c["finish_reason"] is None for c in middle) and all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["hfspec"] == {"drafted": 4, "accepted": 2, "target_passes": 2}


def test_completions_list_of_prompts_gives_one_choice_each(client, engine):
    r = client.post(COMPLETIONS, json={"prompt": ["w10", "w20 w21", "w30"], "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "w10 w11 w12" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 9
    assert client.post(COMPLETIONS, json={"prompt": [[5, 6, 7], [8]], "max_tokens": 3}).status_code == 200
    assert [list(r.prompt_ids) for r in engine.requests][-2:] == [[5, 6, 7], [8]]


def test_completions_default_to_16_tokens_and_stream_text_chunks(client, engine):
    with client.stream("POST", COMPLETIONS, json={"prompt": "w10", "stream": True}) as r:
        got = events(r)
    assert engine.requests[0].max_new_tokens == 16
    assert got[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in got[:-1])
    assert "".join(c["choices"][0]["text"] for c in got[:-1]).split() == [f"w{i}" for i in range(10, 26)]
    assert got[-2]["choices"][0]["finish_reason"] == "length"


def test_models_health_page_and_metrics(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert client.get("/health").json() == {"status": "ok"}
    engine.ready = False  # loading, or measuring its costs
    loading = client.get("/health")
    assert loading.status_code == 503 and loading.json() == {"status": "loading"} and loading.headers["retry-after"]
    engine.ready = True
    page = client.get("/")
    assert page.status_code == 200 and "data-origin" in page.text and "<script" in page.text
    assert "http://" not in page.text and "https://" not in page.text and " src=" not in page.text  # nothing fetched
    client.post(CHAT, json=chat_body())
    text = client.get("/metrics").text
    assert 'hfspec_requests_total{finish_reason="length"} 1.0' in text
    assert "hfspec_generation_tokens_total 4.0" in text
    assert "hfspec_target_passes_total 2.0" in text and "hfspec_accepted_tokens_total 2.0" in text
    assert "hfspec_time_to_first_token_seconds_count 1.0" in text
    assert "hfspec_requests_running 0.0" in text and "hfspec_requests_waiting 0.0" in text


# Each bad request: (method, path, body or raw bytes, headers, status, param or None, words of the message).
BAD = [
    ("POST", CHAT, b"{not json", {}, 400, None, "not valid JSON"),
    ("POST", CHAT, b"[1, 2]", {}, 400, None, ""),
    ("POST", CHAT, {"messages": "hello"}, {}, 400, "messages", ""),
    ("POST", CHAT, chat_body(max_tokens="ten"), {}, 400, "max_tokens", ""),
    ("POST", CHAT, chat_body(max_tokens=0), {}, 400, "max_tokens", "greater than or equal to 1"),
    ("POST", CHAT, chat_body(n=2), {}, 400, None, "only n=1"),
    ("POST", CHAT, chat_body(stream_options={"include_usage": True}), {}, 400, None, "only allowed with stream"),
    ("POST", CHAT, chat_body(temperature=-1), {}, 400, "temperature", ""),
    ("POST", CHAT, chat_body(top_p=2), {}, 400, "top_p", ""),
    ("POST", CHAT, chat_body(stop=["a", "b", "c", "d", "e"]), {}, 400, None, "at most 4"),
    ("POST", CHAT, chat_body(logprobs="maybe"), {}, 400, "logprobs", ""),
    ("POST", CHAT, chat_body(presence_penalty=[1]), {}, 400, "presence_penalty", ""),
    ("POST", CHAT, {"model": "fake-model", "messages": [{"role": "robot", "content": "x"}]}, {}, 400, None, "role"),
    ("POST", CHAT, chat_body(messages=[{"role": "user", "content": "w10 " * 70}]), {}, 400, None, "context"),
    ("POST", CHAT, chat_body(max_tokens=60), {}, 400, "max_tokens", "at most"),
    ("POST", CHAT, chat_body(model="gpt-4"), {}, 404, "model", "does not exist"),
    ("POST", CHAT, chat_body(), {"Authorization": "Bearer wrong"}, 401, None, "wrong"),
    ("POST", CHAT, chat_body(), {"Authorization": ""}, 401, None, "needed"),
    ("GET", "/v1/models", None, {"Authorization": "Basic abc"}, 401, None, ""),
    ("GET", "/v1/nothing", None, {}, 404, None, "no route"),
    ("POST", COMPLETIONS, {"prompt": "w10", "suffix": "w20"}, {}, 400, "suffix", "<|fim_prefix|>"),
    ("POST", COMPLETIONS, {"prompt": 5}, {}, 400, "prompt", ""),
    ("POST", COMPLETIONS, {"prompt": []}, {}, 400, None, "empty"),
    ("POST", COMPLETIONS, {"prompt": [1, 999]}, {}, 400, "prompt", "token ids"),
    ("POST", COMPLETIONS, {"max_tokens": 3}, {}, 400, "prompt", ""),
]


def ask(client, method, path, body, headers):
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={"Content-Type": "application/json", **headers})
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("case", BAD, ids=[f"{i}-{c[4]}" for i, c in enumerate(BAD)])
def test_bad_request_gets_status_and_openai_error_body(client, case):
    method, path, body, headers, status, param, words = case
    r = ask(client, method, path, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and "Traceback" not in r.text
    if param is not None:
        assert error["param"] == param


def test_after_200_bad_requests_the_server_still_answers(client, engine):
    for i in range(200):
        method, path, body, headers, status, _, _ = BAD[i % len(BAD)]
        assert ask(client, method, path, body, headers).status_code == status
    assert client.post(CHAT, json=chat_body()).json()["choices"][0]["message"]["content"] == "w10 w11 w12 w13"
    assert 'hfspec_http_errors_total{status="400"}' in client.get("/metrics").text


def test_full_queue_is_503_with_retry_after(client, engine):
    engine.full = True
    r = client.post(CHAT, json=chat_body())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded_error"


def test_internal_error_is_500_and_the_server_keeps_serving(client, engine, caplog):
    engine.mode = "raise"
    r = client.post(CHAT, json=chat_body())
    assert r.status_code == 500 and "Traceback" not in r.text
    assert r.json()["error"]["type"] == "server_error"
    assert any("scripted failure" in rec.getMessage() for rec in caplog.records)
    engine.mode = "normal"
    assert client.post(CHAT, json=chat_body()).status_code == 200


def test_engine_error_after_the_200_is_an_error_event_then_done(client, engine):
    engine.mode = "error"
    with client.stream("POST", CHAT, json=chat_body(stream=True)) as r:
        got = events(r)
    assert r.status_code == 200
    assert got[-1] == "[DONE]" and "error" in got[-2] and got[-2]["error"]["type"] == "server_error"
    assert client.post(CHAT, json=chat_body()).status_code == 500  # not streamed: a plain 500


def test_no_key_configured_means_no_check(engine, tokenizer):
    with TestClient(create_app(engine, tokenizer)) as c:
        assert c.get("/v1/models").status_code == 200


def test_engine_stopped_mid_stream_ends_the_stream_with_a_final_event(client, engine):
    engine.mode = "endless"
    with client.stream("POST", CHAT, json=chat_body(stream=True)) as r:
        lines = r.iter_lines()
        for line in lines:
            if "w12" in line:
                engine.stop()
                break
        rest = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x]
    assert rest[-1] == "[DONE]" and "shutting down" in rest[-2]["error"]["message"]


def test_settings_the_engine_refuses_are_a_400_naming_why(client, engine, monkeypatch):
    def refuse(request, loop):
        raise HfspecError("gamma 99 is more than this engine drafts")

    monkeypatch.setattr(engine, "submit", refuse)
    r = client.post(CHAT, json=chat_body())
    assert r.status_code == 400 and r.json()["error"]["message"] == "gamma 99 is more than this engine drafts"
