"""``hfspec serve`` as a command: its flags, its extra, its shutdown; a client leaving a whole answer."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import tiny

from hfspec.commands import cli


def test_serve_without_its_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "hfspec.serve.app", raising=False)
    assert cli.main(["serve"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "hfspec: error: hfspec serve needs its extra: pip install 'hfspec[serve]'\n"


def test_serve_flags(capsys):
    parser = cli.build_parser("serve")  # an optional command's flags are built when it is the one named
    args = parser.parse_args(["serve", "--target", "t", "--draft", "d", "--gamma", "0", "--port", "0"])
    assert (args.host, args.port, args.gamma, args.max_batch, args.max_queue) == ("127.0.0.1", 0, 0, 8, 64)
    assert cli.main(["serve", "--port", "70000"]) == cli.EXIT_USAGE
    assert "--port: must be a port number" in capsys.readouterr().err


def test_serve_takes_the_ngram_flag_as_generate_does(monkeypatch, capsys):
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfspec[serve]'")
    from hfspec import api
    from hfspec.errors import HfspecError

    asked = []

    def resolve(target, draft, config, ngram=None):
        asked.append((target, draft, config, ngram))
        raise HfspecError("stop here")

    monkeypatch.setattr(api, "resolve_preset", resolve)
    assert cli.main(["serve", "--config", "smollm2-offline", "--ngram"]) == cli.EXIT_USAGE
    assert cli.main(["serve", "--target", "t", "--draft", "d", "--no-ngram"]) == cli.EXIT_USAGE
    assert asked == [(None, None, "smollm2-offline", True), ("t", "d", None, False)]
    assert "stop here" in capsys.readouterr().err


def test_a_signal_ends_the_streams_in_flight_and_the_server_exits():
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfspec[serve]'")
    import httpx
    from serve_fakes import FakeEngine, free_port

    from hfspec.serve.app import create_app
    from hfspec.serve.server import Server

    engine = FakeEngine(step_seconds=0.01)
    engine.mode = "endless"
    port = free_port()
    server = Server(create_app(engine, tiny.make_tokenizer(64)), engine, host="127.0.0.1", port=port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    body = {"prompt": "w10", "stream": True, "max_tokens": 10}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        start = time.monotonic()
        server.handle_exit(15, None)  # what SIGTERM runs
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5 and engine.stopped


def test_a_client_leaving_before_a_whole_answer_frees_the_row():
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfspec[serve]'")
    import httpx
    from serve_fakes import FakeEngine, running_server

    from hfspec.serve.app import create_app

    engine = FakeEngine(step_seconds=0.01)
    engine.mode = "endless"
    with running_server(create_app(engine, tiny.make_tokenizer(64)), engine) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "w10"}, timeout=0.5)
        deadline = time.monotonic() + 5
        while engine.running or "hfspec_requests_cancelled_total 1.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
