"""vllm_bridge.remote without vLLM: the key file, host discovery, and the async trainer's refusal."""

import json
import os

import pytest

from megatron_rz.recipe import load_recipe
from vllm_bridge.engine import RolloutEngineError
from vllm_bridge.remote import read_authkey, read_hosts, wait_for_hosts, write_authkey


def test_authkey_file_is_private_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("RZ_ROLLOUT_AUTHKEY", raising=False)
    with pytest.raises(RolloutEngineError, match="no rollout authkey"):
        read_authkey(tmp_path)
    path = write_authkey(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    key = read_authkey(tmp_path)
    assert len(key) == 64 and write_authkey(tmp_path) and read_authkey(tmp_path) != key  # fresh each time
    os.chmod(path, 0o644)
    with pytest.raises(RolloutEngineError, match="readable by others"):
        read_authkey(tmp_path)
    monkeypatch.setenv("RZ_ROLLOUT_AUTHKEY", "abc")
    assert read_authkey(tmp_path) == b"abc"


def test_wait_for_hosts_times_out_naming_what_it_found(tmp_path):
    d = tmp_path / "rollout"
    d.mkdir()
    (d / "node2.json").write_text(json.dumps({"node": "node2", "addr": "127.0.0.1", "port": 1234}))
    (d / "node3.json").write_text(json.dumps({"node": "node3", "serving": False}))  # a --hold host
    assert [h["node"] for h in read_hosts(tmp_path)] == ["node2"]
    assert [h["node"] for h in wait_for_hosts(tmp_path, expected=1, timeout_s=1)] == ["node2"]
    with pytest.raises(RolloutEngineError, match=r"only 1 of 2 rollout host\(s\).*\['node2'\]"):
        wait_for_hosts(tmp_path, expected=2, timeout_s=0.5, poll_s=0.1)


class _FakeEngine:
    """The part of RolloutEngine a RolloutHost calls, without vLLM (records what it was asked)."""

    def __init__(self, node):
        self.node, self.weights, self.weight_version, self.calls = node, {}, 0, []

    def generate(self, prompt_ids, n, *, temperature, top_p, max_new_tokens, seed, top_k):
        from vllm_bridge.samples import Sample

        self.calls.append(("generate", len(prompt_ids), seed))
        return [Sample(prompt_ids=p, response_ids=[seed + i * n + j], logprobs=[-1.0], versions=[self.weight_version],
                       finish_reason="length", group=i, index_in_group=j, info={"node": self.node})
                for i, p in enumerate(prompt_ids) for j in range(n)]

    def score(self, sequences, temperature=1.0):
        if temperature <= 0:
            raise ValueError("score: temperature must be > 0")
        return [[None] + [-0.5] * (len(s) - 1) for s in sequences]

    def update_weights(self, named, version, _reload=True):
        named = dict(named)
        self.weights.update(named)
        self.weight_version = version
        return {"version": version, "num_tensors": len(named), "bytes": 0, "reload_s": 0.0}

    def engine_checksums(self, names=None):
        from vllm_bridge.worker_ext import tensor_checksum

        out = {}
        for k in names or self.weights:
            t = self.weights[k]
            s, ws = tensor_checksum(t)
            out[k] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sum": s, "wsum": ws}
        return out

    def close(self):
        pass


def test_two_hosts_split_prompts_share_weights_and_report_errors(tmp_path):
    """Transport and multi-host logic over real TCP (two RolloutHost threads, fake engines)."""
    import threading

    import torch

    from vllm_bridge.engine import WeightSyncError
    from vllm_bridge.remote import RemoteRolloutEngine, RolloutHostError, RolloutHost

    key = b"k" * 32
    stop = threading.Event()
    hosts = []
    for node in ("nodeA", "nodeB"):
        h = RolloutHost(tmp_path, node=node, authkey=key, bind="127.0.0.1", addr="127.0.0.1", log=lambda m: None)
        h.engine = _FakeEngine(node)
        threading.Thread(target=h.serve, args=(stop.is_set, 0.1), daemon=True).start()
        hosts.append(h)
    try:
        client = RemoteRolloutEngine(wait_for_hosts(tmp_path, expected=2, timeout_s=5), key, heartbeat_timeout_s=5)
        assert client.nodes == ["nodeA", "nodeB"]
        prompts = [[1], [2], [3], [4], [5]]
        out = client.generate(prompts, 2, max_new_tokens=4, seed=100)
        # prompt i, sample j: seed 100 + i*2 + j, whichever host ran it; groups are global indices
        assert [s.response_ids[0] for s in out] == [100 + k for k in range(10)]
        assert [s.group for s in out] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        assert [s.info["node"] for s in out[::2]] == ["nodeA"] * 3 + ["nodeB"] * 2
        assert len(client.generate([[7]], 1, seed=0)) == 1  # fewer prompts than hosts
        assert [len(r) for r in client.score([[1, 2], [1, 2, 3], [4]])] == [2, 3, 1]

        w = {"model.embed_tokens.weight": torch.randn(6, 4), "model.norm.weight": torch.ones(4)}
        info = client.update_weights(w.items(), version=3, verify=True)
        assert info["hosts"] == 2 and client.weight_version == 3 and client.remote_weight_versions() == [3, 3]
        assert all(torch.equal(h.engine.weights["model.norm.weight"], w["model.norm.weight"]) for h in hosts)
        hosts[1].engine.weights["model.norm.weight"] = torch.full((4,), 2.0)
        with pytest.raises(WeightSyncError, match="rollout host on node nodeB"):
            client.verify_sync(w.items())
        with pytest.raises(RolloutHostError, match="node nodeA failed: ValueError: score: temperature"):
            client.score([[1, 2]], temperature=0.0)
        assert client.remote_weight_versions() == [3, 3]  # both channels still in step
        client.close()
    finally:
        stop.set()
