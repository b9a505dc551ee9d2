"""kvtransfer.serve.launch: the three commands one handoff deployment starts, without starting them."""
from __future__ import annotations

import ast
import json

import pytest

from kvtransfer.serve import launch


def _args(tmp_path, **kw):
    (tmp_path / "mapper").mkdir(exist_ok=True)
    argv = ["--source", str(tmp_path / "src"), "--target", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--mapper",
            str(tmp_path / "mapper"), "--store", str(tmp_path / "store"), "--port", "9000"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return launch.parser().parse_args(argv)


def _kv(cmd):
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_commands_start_a_producer_a_consumer_and_the_proxy_in_front(tmp_path):
    (tmp_path / "src").mkdir()
    cmds = launch.commands(_args(tmp_path, retention_s=60), python="py")
    src, tgt, proxy = cmds["source"], cmds["target"], cmds["proxy"]
    assert src[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and src[src.index("--port") + 1] == "9001"
    assert tgt[tgt.index("--port") + 1] == "9002" and tgt[tgt.index("--model") + 1] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    for cmd in (src, tgt):  # write-through needs the producer's cache, a kept session the consumer's
        assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert _kv(src)["kv_role"] == "kv_producer" and _kv(src)["kv_connector_extra_config"]["store_retention_s"] == "60.0"
    consumer = _kv(tgt)["kv_connector_extra_config"]
    assert _kv(tgt)["kv_role"] == "kv_consumer" and consumer["source_model"] == str((tmp_path / "src").resolve())
    assert consumer["mapper"] == str((tmp_path / "mapper").resolve())
    assert consumer["store"] == _kv(src)["kv_connector_extra_config"]["store"] == str((tmp_path / "store").resolve())
    assert proxy[proxy.index("--source") + 1] == "http://127.0.0.1:9001"
    assert proxy[proxy.index("--target") + 1] == "http://127.0.0.1:9002"
    assert proxy[proxy.index("--mapper") + 1] == consumer["mapper"] and proxy[proxy.index("--port") + 1] == "9000"


def test_a_missing_mapper_is_refused_with_the_command_that_fits_one(tmp_path):
    with pytest.raises(SystemExit, match="run.py pair=<pair> stage=\\[calibrate,fit\\]"):
        launch.main(["--source", "a", "--target", "b", "--mapper", str(tmp_path / "none")])


def test_the_printed_client_is_python_that_names_both_models():
    code = launch.client_snippet("127.0.0.1", 8000, "small", "big")
    ast.parse(code)
    assert 'model="small"' in code and 'model="big"' in code and "X-KVTransfer-Session" in code
