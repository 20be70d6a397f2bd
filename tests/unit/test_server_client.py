"""vllm_bridge.server_client / serve / server_routes without a vLLM server: discovery, the key
file, weight-version spans, the chunking that keeps seeds per prompt, the admin-route guard."""

import asyncio
import json
import os

import pytest

from vllm_bridge.engine import RolloutEngineError
from vllm_bridge.server_client import (RolloutClient, Server, connect, read_key, read_servers, samples_from_response,
                                       spans_to_versions, write_key)
from vllm_bridge.server_routes import RequireKey


def test_key_file_is_private_and_checked(tmp_path):
    with pytest.raises(RolloutEngineError, match="no API key file"):
        read_key(tmp_path)
    path = write_key(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    key = read_key(tmp_path)
    assert len(key) == 64 and write_key(tmp_path) and read_key(tmp_path) != key  # fresh each time
    os.chmod(path, 0o644)
    with pytest.raises(RolloutEngineError, match="readable by others"):
        read_key(tmp_path)
    os.chmod(path, 0o600)
    path.write_text("\n")
    with pytest.raises(RolloutEngineError, match="is empty"):
        read_key(tmp_path)


def test_connect_waits_for_the_records_and_names_what_it_found(tmp_path):
    write_key(tmp_path)
    d = tmp_path / "rollout" / "servers"
    d.mkdir(parents=True)
    (d / "node2.json").write_text(json.dumps({"node": "node2", "url": "http://127.0.0.1:9"}))
    (d / ".node3.json.1.tmp").write_text("{")  # a record being written is not read
    assert read_servers(tmp_path) == [Server("node2", "http://127.0.0.1:9")]
    with pytest.raises(RolloutEngineError, match=r"only 1 of 2 rollout server\(s\).*\['node2'\]"):
        connect(tmp_path, expected=2, wait_s=0.5)
    # a server that is not there is named at once (nothing listens on port 9)
    with pytest.raises(RolloutEngineError, match=r"rollout server on node node2 \(http://127.0.0.1:9\) is gone: cannot reach"):
        connect(tmp_path, expected=1, wait_s=1)


def test_spans_to_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert spans_to_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert spans_to_versions([{"version": "default", "start": 0, "end": 2}], 2) == [0, 0]
    assert spans_to_versions(None, 0) == []
    with pytest.raises(RolloutEngineError, match="node n1: weight-version spans .* do not cover all 3"):
        spans_to_versions(spans[:1], 3, "n1")


def test_samples_from_response_checks_tokens_against_logprobs():
    out = {"choices": [
        {"index": 1, "token_ids": [7], "finish_reason": "length", "weight_versions": [{"version": "2", "start": 0, "end": 1}],
         "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}]}},
        {"index": 0, "token_ids": [4, 0], "finish_reason": "stop", "weight_versions": [{"version": "2", "start": 0, "end": 2}],
         "logprobs": {"content": [{"token_id": 4, "logprob": -1.25}, {"token_id": 0, "logprob": -2.0}]}}]}
    a, b = samples_from_response(out, [1, 2], 5, {"n": 2}, "n0", temperature=1.0, top_p=1.0, top_k=-1)
    assert (a.index_in_group, a.response_ids, a.logprobs, a.versions, a.group) == (0, [4, 0], [-1.25, -2.0], [2, 2], 5)
    assert (b.finish_reason, b.prompt_ids) == ("length", [1, 2])
    out["choices"][0]["logprobs"]["content"][0]["token_id"] = 8
    with pytest.raises(RolloutEngineError, match="node n0: prompt 5: 1 tokens but 1 matching logprobs"):
        samples_from_response(out, [1, 2], 5, {"n": 2}, "n0", temperature=1.0, top_p=1.0, top_k=-1)
    with pytest.raises(RolloutEngineError, match="2 samples, wanted 3"):
        samples_from_response(out, [1], 0, {"n": 3}, "n0", temperature=1.0, top_p=1.0, top_k=-1)


def test_prompts_split_in_contiguous_chunks_keeping_their_seeds():
    c = RolloutClient.__new__(RolloutClient)
    c._servers = [object()] * 3
    assert c._chunks(7) == [(0, 3), (3, 5), (5, 7)]
    assert c._chunks(2) == [(0, 1), (1, 2), (2, 2)]
    sp = RolloutClient.sampling_params(4, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=6, seed=10 + 2 * 4)
    assert sp == {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 6, "logprobs": 0,
                  "skip_special_tokens": False, "detokenize": False, "seed": 18}


def _call(mw, path, headers=()):
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request"}

    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers),
             "app": type("App", (), {"state": type("S", (), {"args": type("A", (), {"api_key": ["sekret"]})})})}
    asyncio.run(mw(scope, receive, send))
    return sent[0]["status"]


def test_require_key_guards_every_route_but_health():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = RequireKey(app)
    for path in ("/pause", "/collective_rpc", "/update_weight_version", "/v1/models", "/inference/v1/generate"):
        assert _call(mw, path) == 401
        assert _call(mw, path, [(b"authorization", b"Bearer wrong")]) == 401
        assert _call(mw, path, [(b"authorization", b"Bearer sekret")]) == 200
    assert _call(mw, "/health") == 200
